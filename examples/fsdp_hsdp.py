"""FSDP2 inside a node, 1-bit Adam across nodes (hybrid sharding), with torchrun.

    torchrun --nproc-per-node 4 examples/fsdp_hsdp.py            # 2 emulated nodes of 2 ranks
    torchrun --nproc-per-node 4 examples/fsdp_hsdp.py --shard 4  # 1 node: FSDP2 alone

The conversion from torch's HSDP (``fully_shard`` on the 2-D mesh) with AdamW:

    -fully_shard(block, mesh=mesh)
    +fully_shard(block, mesh=mesh["shard"])
    -optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    +optimizer = onebit.OnebitAdam(model.parameters(), lr=args.lr, total_steps=args.steps,
    +                              max_grad_norm=1.0, process_group=mesh["replicate"].get_group())
    +onebit.fsdp.attach(model, optimizer)

FSDP2 reduce-scatters the gradients inside each node; ``optimizer.step()`` averages each rank's
shard across the nodes, in int4 until Adam's variance settles (by a fifth of the run), then in 1
bit. Each rank keeps optimizer state for its own shard only. The checkpoint at the end goes
through ``torch.distributed.checkpoint``, every rank's error buffers included."""

import os

import torch.distributed as dist
from common import arguments, close_process_group, evaluate, log_step, report, text_data, tiny_gpt2
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

import onebit

parser = arguments(__doc__.splitlines()[0])
parser.add_argument("--shard", type=int, default=2, help="ranks per node (FSDP2 shards over them)")
parser.add_argument("--out", default=None, help="save a checkpoint here at the end")
args = parser.parse_args()

dist.init_process_group("gloo")  # on GPUs: "nccl", and init_device_mesh("cuda", ...)
nodes = dist.get_world_size() // args.shard
mesh = init_device_mesh("cpu", (nodes, args.shard), mesh_dim_names=("replicate", "shard"))

model = tiny_gpt2()
for block in model.transformer.h:
    fully_shard(block, mesh=mesh["shard"])
fully_shard(model, mesh=mesh["shard"])
optimizer = onebit.OnebitAdam(
    model.parameters(),
    lr=args.lr,
    total_steps=args.steps,
    max_grad_norm=1.0,
    process_group=mesh["replicate"].get_group(),
)
onebit.fsdp.attach(model, optimizer)

train, val = text_data()
sampler = DistributedSampler(train, shuffle=True, seed=0)
loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

step, epoch = 0, 0
while step < args.steps:
    sampler.set_epoch(epoch)
    for batch in loader:
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 20 == 0 or step == 1:
            log_step(step, loss.item(), optimizer)
        if step == args.steps:
            break
    epoch += 1

final_loss = evaluate(model, val)  # every rank: the forward pass gathers the shards
if args.out:
    onebit.fsdp.save(model, optimizer, os.path.join(args.out, f"step-{step}"))
report(optimizer, final_loss)
close_process_group()
