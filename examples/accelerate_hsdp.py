"""Accelerate with FSDP2 inside a node and 1-bit Adam across nodes (hybrid sharding).

    torchrun --nproc-per-node 4 examples/accelerate_hsdp.py            # 2 emulated nodes of 2
    torchrun --nproc-per-node 4 examples/accelerate_hsdp.py --out ckpt # and save_state at the end

Accelerate's own hybrid sharding puts the model on a 2-D mesh, where FSDP2 averages the
gradients across nodes in fp32. Here the model is sharded by hand on the mesh's shard dimension
only, the optimizer is built on it with the replica dimension's process group, and
``onebit.integrations.accelerate.prepare`` prepares both. FSDP2 reduce-scatters the gradients
inside each node; ``optimizer.step()`` averages each rank's shard across the nodes, in int4
until Adam's variance settles (by a fifth of the run), then in 1 bit. ``accelerator.save_state``
writes every rank's state. Without a GPU per rank the example takes Accelerate's FSDP2 path on
the CPU (``common.accelerator_with_hsdp``)."""

import os

from common import (
    accelerator_with_hsdp,
    arguments,
    close_process_group,
    evaluate,
    log_step,
    report,
    text_data,
    tiny_gpt2,
)
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import onebit
from onebit.integrations.accelerate import prepare

parser = arguments(__doc__.splitlines()[0])
parser.add_argument("--shard", type=int, default=2, help="ranks per node (FSDP2 shards over them)")
parser.add_argument("--out", default=None, help="accelerator.save_state here at the end")
args = parser.parse_args()

nodes = int(os.environ["WORLD_SIZE"]) // args.shard
accelerator = accelerator_with_hsdp(replicas=nodes, shards=args.shard)
mesh = accelerator.torch_device_mesh
model = tiny_gpt2()
for block in model.transformer.h:
    fully_shard(block, mesh=mesh["dp_shard_cp"])
fully_shard(model, mesh=mesh["dp_shard_cp"])
optimizer = onebit.OnebitAdam(
    model.parameters(),
    lr=args.lr,
    total_steps=args.steps,
    max_grad_norm=1.0,
    process_group=mesh["dp_replicate"].get_group(),
)
train, val = text_data()
loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True)
model, optimizer, loader = prepare(accelerator, model, optimizer, loader)

step = 0
while step < args.steps:
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % 20 == 0 or step == 1:
            log_step(step, loss.item(), optimizer)
        if step == args.steps:
            break

final_loss = evaluate(model, val, device=accelerator.device)  # every rank: gathers the shards
if args.out:
    accelerator.save_state(args.out)
report(optimizer, final_loss)
accelerator.end_training()
close_process_group()
