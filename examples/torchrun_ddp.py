"""A plain torchrun + DistributedDataParallel script, converted from AdamW to 1-bit Adam.

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py
    python examples/torchrun_ddp.py            # one process: trains, sends nothing

The conversion from an AdamW + DDP script:

    -optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    +optimizer = onebit.OnebitAdam(model.parameters(), lr=args.lr,
    +                              total_steps=args.steps, max_grad_norm=1.0)
    +ddp_model.register_comm_hook(optimizer, onebit.ddp_comm_hook)
    -torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)

The hook leaves every gradient local: DDP sends nothing and ``optimizer.step()`` does all the
communication: int4 gradients until Adam's variance settles (by a fifth of ``total_steps``),
then 1 bit per element. The
optimizer clips the averaged gradient itself (``max_grad_norm``); a ``clip_grad_norm_`` before
``step()`` would clip each rank's local gradient instead.
"""

import os

import torch
import torch.distributed as dist
from common import (
    arguments,
    close_process_group,
    evaluate,
    gpu_per_rank,
    log_step,
    report,
    text_data,
    tiny_gpt2,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import onebit

args = arguments(__doc__.splitlines()[0]).parse_args()

if "RANK" not in os.environ:  # not under torchrun, which sets these: a world of one
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
    )
if gpu_per_rank():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")

model = tiny_gpt2().to(device)
ddp_model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
optimizer = onebit.OnebitAdam(
    model.parameters(),
    lr=args.lr,
    total_steps=args.steps,
    max_grad_norm=1.0,
)
ddp_model.register_comm_hook(optimizer, onebit.ddp_comm_hook)

train, val = text_data()
sampler = DistributedSampler(train, shuffle=True, seed=0)
loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

step, epoch = 0, 0
while step < args.steps:
    sampler.set_epoch(epoch)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = ddp_model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 20 == 0 or step == 1:
            log_step(step, loss.item(), optimizer)
        if step == args.steps:
            break
    epoch += 1

# Every rank holds the same parameters: 1-bit Adam applies the same averaged update everywhere.
report(optimizer, evaluate(model, val, device=device))
close_process_group()
