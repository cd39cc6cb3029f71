"""Peak optimizer-state memory: AdamW against OnebitAdam, ZeroOneAdam and OnebitLamb.

    python benchmarks/memory.py                      # 2 gloo ranks, a 16.8M-parameter MLP
    python benchmarks/memory.py --world-size 4 --width 1024

Each optimizer runs in fresh processes, one per rank, through its warmup and into its
compression stage (ZeroOneAdam: through phase A into phase B, with local steps and syncs).
Gradients are set directly (no forward or backward), so that everything allocated after the
model is the optimizer's. Two figures per optimizer, in model sizes (the fp32 bytes of the
parameters), for rank 0:

* ``state``: the bytes of every tensor storage the optimizer holds (its state, scratch and
  error buffers), the largest after any step. Exact.
* ``peak``: per stage, the process's peak resident memory during a step of that stage (the
  kernel's high-water mark, reset before each step) less its resident memory before the optimizer
  was built (after a run on a tiny model, so that code pages and thread pools are already in).
  It adds what a step allocates and frees (temporaries, communication buffers inside
  torch.distributed) and the allocator's overhead. Stages that send fp32 (warmup, ZeroOneAdam's
  variance steps) and 1-bit stages are listed apart.

AdamW is ``torch.optim.AdamW`` without communication; with ``DistributedDataParallel`` it would
also hold DDP's gradient buckets (one more model size).
"""

from __future__ import annotations

import argparse
import os
import resource

import torch
import torch.distributed as dist

import onebit
from onebit.train.launch import run_ranks

OPTIMIZERS = ("AdamW", "OnebitAdam", "ZeroOneAdam", "OnebitLamb")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def _storage_bytes(opt: torch.optim.Optimizer) -> int:
    tensors = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    tensors += [t for t in vars(opt).values() if torch.is_tensor(t)]
    for comm in getattr(opt, "comms", []):
        tensors += [comm.worker_error, comm.server_error]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _make(name: str, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, int]:
    """The optimizer and how many steps take it well into its compression stage."""
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=1e-3), 4
    if name == "OnebitAdam":
        return onebit.OnebitAdam(params, lr=1e-3, freeze_step=2), 5
    if name == "ZeroOneAdam":
        opt = onebit.ZeroOneAdam(
            params, lr=1e-3, var_freeze_step=3, local_step_scaler=2, local_step_clipper=4
        )
        return opt, 12
    return onebit.OnebitLamb(params, lr=1e-3, freeze_step=2), 5


def _run(
    name: str, params: list[torch.nn.Parameter], before: int = 0
) -> tuple[int, dict[str, int]]:
    """Step ``name`` through its stages; return its largest state and peak per stage."""
    for p in params:
        p.grad = torch.randn_like(p) if p.grad is None else p.grad
    opt, steps = _make(name, params)
    state, peaks = 0, {}
    for _ in range(steps):
        for p in params:
            p.grad.normal_()
        stage = getattr(opt, "stage", "-")
        _reset_peak_rss()
        opt.step()
        peaks[stage] = max(peaks.get(stage, 0), _peak_rss() - before)
        state = max(state, _storage_bytes(opt))
    return state, peaks


def _rank(
    rank: int, world_size: int, name: str, width: int, depth: int
) -> tuple[int, int, dict[str, int]]:
    """One rank of :func:`measure` (a gloo group is up): model bytes, state and peak per stage."""
    _run(name, [p for p in torch.nn.Linear(64, 64).parameters()])  # page code in, warm pools
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    params = [p for layer in layers for p in layer.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    model_bytes = sum(p.numel() * 4 for p in params)
    dist.barrier()
    before = _rss()
    state, peaks = _run(name, params, before)
    return model_bytes, state, peaks


def measure(name: str, world_size: int, width: int, depth: int) -> tuple[int, int, dict]:
    """Rank 0's model bytes, largest optimizer state and peak per stage, in fresh processes."""
    results = run_ranks(_rank, world_size, name, width, depth, timeout=None, collective_timeout=300)
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=16)
    args = parser.parse_args()
    numel = args.depth * (args.width * args.width + args.width)
    print(
        f"model: {args.depth} x Linear({args.width}, {args.width}), {numel / 1e6:.1f}M parameters, "
        f"{4 * numel / 2**20:.0f} MiB fp32; {args.world_size} gloo ranks; figures for rank 0"
    )
    print("state and peak in model sizes; peak per stage")
    print(f"{'optimizer':<12} {'state':>6}  peak")
    for name in OPTIMIZERS:
        model_bytes, state, peaks = measure(name, args.world_size, args.width, args.depth)
        per_stage = ", ".join(f"{stage} {peak / model_bytes:.2f}" for stage, peak in peaks.items())
        print(f"{name:<12} {state / model_bytes:>6.2f}  {per_stage}")


if __name__ == "__main__":
    main()
