"""A DDP GPT trainer, as most training scripts are written, and its port to 1-bit Adam.

    torchrun --nproc-per-node 2 examples/ddp_gpt.py --optimizer adamw   # AdamW + DDP
    torchrun --nproc-per-node 2 examples/ddp_gpt.py --optimizer onebit  # 1-bit Adam
    torchrun --nproc-per-node 2 examples/ddp_gpt.py --optimizer onebit --save-at 100
    torchrun --nproc-per-node 2 examples/ddp_gpt.py --optimizer onebit \
        --resume out-ddp-gpt/ckpt-100.pt   # goes on from iteration 100, bit for bit

It has what such scripts have: the model's ``configure_optimizers()`` with decay and no-decay
groups, a learning rate set on every param group each iteration, gradient accumulation,
``GradScaler`` and gradient clipping, and a checkpoint written by rank 0 and read by every rank.
The onebit path differs from the AdamW path only where ``ONEBIT`` is tested; docs/porting.md
walks through each of those places. It runs on the CPU over gloo, or on one GPU per rank.
"""

import argparse
import difflib
import math
import os
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import onebit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--optimizer", choices=["adamw", "onebit"], default="onebit")
parser.add_argument("--max-iters", type=int, default=200)
parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per iteration")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
parser.add_argument("--grad-clip", type=float, default=1.0, help="0 turns clipping off")
parser.add_argument("--out", default="out-ddp-gpt", help="where the checkpoints go")
parser.add_argument("--save-at", type=int, default=0, help="also save at this iteration")
parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
parser.add_argument("--warmup-compression", default=None, help="onebit: fp32 is exactly DDP")
parser.add_argument("--freeze-step", type=int, default=None, help="onebit: a fixed warmup")
args = parser.parse_args()
ONEBIT = args.optimizer == "onebit"
learning_rate, min_lr, warmup_iters, weight_decay, grad_clip = 3e-3, 3e-4, 10, 0.1, args.grad_clip
block_size = 64

if "RANK" not in os.environ:  # one process, without torchrun
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
if gpus >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
else:
    device = torch.device("cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
master_process = rank == 0
ptdtype = getattr(torch, args.dtype)
autocast = torch.autocast(device.type, dtype=ptdtype, enabled=args.dtype != "float32")


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A byte-level GPT: 2 blocks of width 128 (0.4M parameters)."""

    def __init__(self, layers: int = 2, width: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, width), nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, 256, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, 256).float(), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW, with weight decay on the matrices only."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


def text() -> torch.Tensor:
    """The sources of three standard-library modules, as bytes."""
    data = b"".join(Path(m.__file__).read_bytes() for m in (difflib, textwrap, argparse))
    return torch.tensor(list(data), dtype=torch.long)


data = text()
train_data, val_data = data[: int(0.9 * len(data))], data[int(0.9 * len(data)) :]


def get_batch(split: str, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own batch, the same on a resumed run: seeded by iteration and rank."""
    source = train_data if split == "train" else val_data
    gen = torch.Generator().manual_seed(100_000 * it + 100 * rank + micro)
    ix = torch.randint(len(source) - block_size - 1, (args.batch_size,), generator=gen)
    x = torch.stack([source[i : i + block_size] for i in ix])
    y = torch.stack([source[i + 1 : i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


def get_lr(it: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr``."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / max(1, args.max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss(model: nn.Module) -> float:
    model.eval()
    losses = [model(*get_batch("val", 10**6, k)).item() for k in range(8)]
    model.train()
    return sum(losses) / len(losses)


torch.manual_seed(1337)
model = GPT().to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (0.9, 0.95), device.type)
if ONEBIT:  # the optimizer's groups, lr, betas and weight decay, and the run's length
    extra = {"freeze_step": args.freeze_step} if args.freeze_step else {}
    if args.warmup_compression:
        extra["warmup_compression"] = args.warmup_compression
    optimizer = onebit.OnebitAdam.from_optimizer(
        optimizer, max_grad_norm=grad_clip or None, total_steps=args.max_iters, **extra
    )
else:
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
raw_model = model.module if isinstance(model, DDP) else model
scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "float16")
iter_num = 0
if args.resume:
    checkpoint = torch.load(args.resume, map_location=device, weights_only=True)
    raw_model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num = checkpoint["iter_num"]


def save_checkpoint(name: str) -> None:
    # onebit: each rank's error buffers go in the file; a collective, so on every rank
    state = optimizer.consolidated_state_dict() if ONEBIT else optimizer.state_dict()
    if master_process:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        torch.save({"model": raw_model.state_dict(), "optimizer": state, "iter_num": iter_num},
                   Path(args.out) / name)  # fmt: skip
    dist.barrier()


while iter_num < args.max_iters:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    for micro_step in range(args.accumulation):
        if not ONEBIT:  # DDP averages on the last micro-batch only; onebit, in step()
            model.require_backward_grad_sync = micro_step == args.accumulation - 1
        with autocast:
            loss = model(*get_batch("train", iter_num, micro_step)) / args.accumulation
        scaler.scale(loss).backward()
    if grad_clip != 0.0 and not ONEBIT:  # onebit clips the averaged gradient: max_grad_norm
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if master_process and (iter_num % 50 == 0 or iter_num == 1):
        print(f"iter {iter_num}: loss {loss.item() * args.accumulation:.4f}, lr {lr:.2e}")
    if iter_num == args.save_at:
        save_checkpoint(f"ckpt-{iter_num}.pt")

val_loss = estimate_loss(raw_model)
save_checkpoint("ckpt.pt")
if master_process:
    line = f"final val loss {val_loss:.4f}"
    if ONEBIT:
        stats = optimizer.comm_stats
        line += (f" | sent {stats.bytes_total / 1e6:.1f} MB, {stats.fewer_bytes:.1f}x fewer bytes "
                 f"than an fp32 allreduce | froze at step {optimizer.freeze_step}")  # fmt: skip
    print(line)
dist.destroy_process_group()
