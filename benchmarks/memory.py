"""Peak optimizer-state memory: AdamW against OnebitAdam, ZeroOneAdam and OnebitLamb.

    python benchmarks/memory.py                      # 2 gloo ranks, a 16.8M-parameter MLP
    python benchmarks/memory.py --world-size 4 --width 1024
    python benchmarks/memory.py --world-size 4 --shard 2   # and sharded by FSDP2, 2 x 2
    python benchmarks/memory.py --loops                    # in the loops users run
    python benchmarks/memory.py --loops channels_last      # in some of them
    python benchmarks/memory.py --error-dtype bf16         # the onebit errors kept in bf16

Each optimizer runs in fresh processes, one per rank, through its warmup and into its
compression stage (ZeroOneAdam: through phase A into phase B, with local steps and syncs). Each
step is a user's: ``zero_grad()`` (gradients to ``None``), forward and backward of a batch of 4,
``step()``. Two figures per optimizer, in model sizes (the fp32 bytes of the parameters), for
rank 0:

* ``state``: the bytes of every tensor storage the optimizer holds (its state, scratch, error
  buffers, packed momentum), the largest after any step of the stage, less the storage of the
  parameters' ``.grad`` (which 1-bit Adam's warmup keeps in its bucket buffer, as DDP's
  ``gradient_as_bucket_view``). Exact.
* ``peak``: per stage, the process's peak resident memory during a step of that stage, backward
  included (the kernel's high-water mark, reset before each step), less its resident memory
  before the optimizer was built (after a run on a tiny model, so that code pages and thread
  pools are already in). It holds the gradients, what a step allocates and frees (temporaries,
  communication buffers inside torch.distributed) and the allocator's overhead. Stages that send
  fp32 (warmup, ZeroOneAdam's variance steps) and 1-bit stages are listed apart.

``AdamW`` is ``torch.optim.AdamW`` alone; ``AdamW+DDP`` runs its forward and backward under
``DistributedDataParallel``, whose gradient buckets (one more copy of the gradients) show in the
peak, not in the optimizer's state.

With ``--shard S`` each layer is sharded by FSDP2 over ``S`` ranks per node as well, and the
rows ``+HSDP`` follow: ``AdamW+HSDP`` is torch's own (``fully_shard`` on the 2-D mesh), the onebit
optimizers shard on the mesh's shard dimension and average across nodes themselves
(:mod:`onebit.fsdp`). Their state is per rank, for its shards; the model size stays the whole
model's. Then the state of a 1B and a 7B model is computed from the measured fractions.

With ``--loops``, AdamW+DDP, OnebitAdam and OnebitLamb run in each loop of :data:`LOOPS`
(clipping, a GradScaler, ``overlap_backward``, ``exp_avg_mask``, the DDP comm hook, bf16
parameters, a convolutional model in ``channels_last``), or in those named, each row against its
targets; a onebit row whose momentum is not kept packed says why. The bf16 rows count bytes per
parameter, next to AdamW's on the same bf16 parameters.

``--error-dtype bf16`` gives the onebit optimizers ``error_dtype=torch.bfloat16``: their worker and
server errors in bf16, half the bytes.
"""

from __future__ import annotations

import argparse
import os
import resource
from collections.abc import Sequence

import torch
import torch.distributed as dist

import onebit
from onebit.train.launch import run_ranks
from onebit.train.optim import ERROR_DTYPES

OPTIMIZERS = ("AdamW", "AdamW+DDP", "OnebitAdam", "ZeroOneAdam", "OnebitLamb")

LOOPS = ("plain", "max_grad_norm", "GradScaler", "overlap_backward", "exp_avg_mask",
         "ddp_comm_hook", "bf16", "channels_last", "overlap+clip", "scale_per_bucket",
         "mixed_dtypes")  # fmt: skip
"""The training loops of ``--loops``: ``max_grad_norm=1.0`` (``clip_grad_norm_`` for AdamW), a
``GradScaler``, ``overlap_backward=True`` (OnebitAdam only), an all-ones ``exp_avg_mask`` on the
first layer, the model under DDP with :func:`onebit.ddp_comm_hook`, bf16 parameters, 3x3
convolutions of about as many parameters as the linear layers, in ``channels_last``; and three
that keep an fp32 momentum: ``overlap_backward`` with ``max_grad_norm``, ``scale_per="bucket"``,
and bf16 parameters but the first layer's in fp32, under ``torch.autocast``."""


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


def _tensors(obj: object, found: list[torch.Tensor], seen: set[int]) -> None:
    """Every tensor reachable from ``obj`` through onebit objects, lists, tuples and dicts."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if torch.is_tensor(obj):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, found, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, found, seen)
    elif type(obj).__module__.startswith("onebit") or isinstance(obj, torch.optim.Optimizer):
        _tensors(vars(obj), found, seen)


def _storage_bytes(opt: torch.optim.Optimizer) -> int:
    """The bytes of every storage the optimizer holds: its state, flat buffers, error buffers,
    packed momentum and scratch (the parameters and their gradients excluded; of sharded
    parameters, their local shards)."""
    from torch.distributed.tensor import DTensor

    found: list[torch.Tensor] = []
    params = [p for g in opt.param_groups for p in g["params"]]
    shards = [p._local_tensor for p in params if isinstance(p, DTensor)]
    _tensors(opt, found, {id(p) for p in params + shards})
    found = [t._local_tensor if isinstance(t, DTensor) else t for t in found]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}
    for p in params:
        grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        if grad is not None:
            storages.pop(grad.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def _make(
    name: str,
    params: list[torch.nn.Parameter],
    group: dist.ProcessGroup | None = None,
    loop: str = "plain",
    errors: str = "fp32",
) -> tuple[torch.optim.Optimizer, int]:
    """The optimizer (the onebit ones across ``group``, with what ``loop`` asks of them and
    their errors in ``errors``) and how many steps take it well into its compression stage."""
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=1e-3), 4
    options: dict = {"error_dtype": ERROR_DTYPES[errors]}
    if loop in ("max_grad_norm", "overlap+clip"):
        options["max_grad_norm"] = 1.0
    if loop in ("overlap_backward", "overlap+clip"):
        options["overlap_backward"] = True
    if loop == "scale_per_bucket":
        options["scale_per"] = "bucket"
    if loop == "exp_avg_mask":
        options["exp_avg_mask"] = {params[0]: torch.ones_like(params[0])}
    if name == "OnebitAdam":
        return onebit.OnebitAdam(params, lr=1e-3, freeze_step=2, process_group=group, **options), 5
    if name == "ZeroOneAdam":
        opt = onebit.ZeroOneAdam(
            params,
            lr=1e-3,
            var_freeze_step=3,
            local_step_scaler=2,
            local_step_clipper=4,
            process_group=group,
            error_dtype=options["error_dtype"],
        )
        return opt, 12
    return onebit.OnebitLamb(params, lr=1e-3, freeze_step=2, process_group=group, **options), 5


def _shard(model: torch.nn.Sequential, name: str, shards: int) -> dist.ProcessGroup:
    """Shard each layer of ``model`` with FSDP2 over ``shards`` ranks per node (AdamW on the
    2-D mesh, as torch's HSDP); return the group of the replicas."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world_size = dist.get_world_size()
    names = ("replicate", "shard")
    mesh = init_device_mesh("cpu", (world_size // shards, shards), mesh_dim_names=names)
    on = mesh if name == "AdamW" else mesh["shard"]
    for layer in model:
        fully_shard(layer, mesh=on)
    fully_shard(model, mesh=on)
    return mesh["replicate"].get_group()


def _run(
    name: str, layers: list[torch.nn.Module], before: int = 0, shards: int = 1,
    loop: str = "plain", errors: str = "fp32",
) -> tuple[dict[str, int], dict[str, int], str | None]:  # fmt: skip
    """Step ``name`` through its stages in ``loop``; return its largest state and peak per
    stage, and why a onebit optimizer did not keep its momentum packed (``None`` if it did).

    ``AdamW+DDP`` runs forward and backward under ``DistributedDataParallel`` (whose gradient
    buckets are not optimizer state: they show in its peak only); ``+HSDP`` shards the model
    with FSDP2 over ``shards`` ranks per node.
    """
    model = torch.nn.Sequential(*layers)
    if loop in ("bf16", "mixed_dtypes"):
        model.bfloat16()
    if loop == "mixed_dtypes":
        layers[0].float()
    if isinstance(layers[0], torch.nn.Conv2d):
        model.to(memory_format=torch.channels_last)
        x = torch.randn(4, layers[0].in_channels, 2, 2).to(memory_format=torch.channels_last)
    else:
        x = torch.randn(4, layers[0].in_features, dtype=next(model.parameters()).dtype)
    group = None
    if name.endswith("+HSDP"):
        group = _shard(model, name.removesuffix("+HSDP"), shards)
    params = list(model.parameters())
    opt, steps = _make(name.split("+")[0], params, group, loop, errors)
    forward = model
    if name == "AdamW+DDP" or (loop == "ddp_comm_hook" and name.startswith("Onebit")):
        forward = torch.nn.parallel.DistributedDataParallel(model)
        if name != "AdamW+DDP":
            forward.register_comm_hook(opt, onebit.ddp_comm_hook)
    if group is not None and name != "AdamW+HSDP":
        onebit.fsdp.attach(model, opt)
    scaler = torch.amp.GradScaler("cpu") if loop == "GradScaler" else None
    state: dict[str, int] = {}
    peaks: dict[str, int] = {}
    for _ in range(steps):
        stage = getattr(opt, "stage", "-")
        _reset_peak_rss()
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=loop == "mixed_dtypes"):
            loss = forward(x).float().sum()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if loop in ("max_grad_norm", "overlap+clip") and name.startswith("AdamW"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        peaks[stage] = max(peaks.get(stage, 0), _peak_rss() - before)
        state[stage] = max(state.get(stage, 0), _storage_bytes(opt))
    return state, peaks, getattr(opt, "_unpacked", None)


def _rank(
    rank: int, world_size: int, name: str, width: int, depth: int, shards: int = 1,
    loop: str = "plain", errors: str = "fp32",
) -> tuple[int, dict[str, int], dict[str, int], str | None]:  # fmt: skip
    """One rank of :func:`measure` (a gloo group is up): model bytes, state and peak per stage,
    and why the momentum was not kept packed."""
    _run(name, _layers(loop, 64, 1), shards=shards, loop=loop)  # page code in, warm pools
    torch.manual_seed(0)
    layers = _layers(loop, width, depth)
    model_bytes = sum(p.numel() * 4 for layer in layers for p in layer.parameters())
    dist.barrier()
    before = _rss()
    return model_bytes, *_run(name, layers, before, shards, loop, errors)


def _layers(loop: str, width: int, depth: int) -> list[torch.nn.Module]:
    """``depth`` layers of ``Linear(width, width)``, or for ``channels_last`` 3x3 convolutions
    of ``width // 3`` channels (about as many parameters), on 2x2 images."""
    if loop == "channels_last":
        c = width // 3
        return [torch.nn.Conv2d(c, c, 3, padding=1) for _ in range(depth)]
    return [torch.nn.Linear(width, width) for _ in range(depth)]


def measure(
    name: str, world_size: int, width: int, depth: int, shards: int = 1, loop: str = "plain",
    errors: str = "fp32",
) -> tuple[int, dict[str, int], dict[str, int], str | None]:  # fmt: skip
    """Rank 0's model bytes, largest optimizer state and peak per stage, and why the momentum
    was not kept packed (``None``: it was), in fresh processes."""
    return run_ranks(
        _rank, world_size, name, width, depth, shards, loop, errors, timeout=None,
        collective_timeout=300,
    )[0]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument(
        "--shard", type=int, default=1, metavar="S", help="also shard with FSDP2, S ranks per node"
    )
    parser.add_argument("--loops", nargs="*", choices=LOOPS, metavar="LOOP",
                        help=f"a row per training loop (all: {', '.join(LOOPS)})")  # fmt: skip
    parser.add_argument("--error-dtype", choices=tuple(ERROR_DTYPES), default="fp32",
                        help="the onebit optimizers' error buffers")  # fmt: skip
    args = parser.parse_args()
    if args.loops is not None:
        loops = args.loops or LOOPS
        return _loops(args.world_size, args.width, args.depth, args.error_dtype, loops)
    numel = args.depth * (args.width * args.width + args.width)
    print(
        f"model: {args.depth} x Linear({args.width}, {args.width}), {numel / 1e6:.1f}M parameters, "
        f"{4 * numel / 2**20:.0f} MiB fp32; {args.world_size} gloo ranks; figures for rank 0; "
        f"onebit errors in {args.error_dtype}"
    )
    print("in model sizes, per stage: optimizer state (exact) / peak resident memory of a step")
    print(f"{'optimizer':<18}  per stage")
    names = list(OPTIMIZERS)
    if args.shard > 1:
        names += [f"{name}+HSDP" for name in OPTIMIZERS if name != "AdamW+DDP"]
    largest = {}
    for name in names:
        model_bytes, state, peaks, _ = measure(
            name, args.world_size, args.width, args.depth, args.shard, errors=args.error_dtype
        )
        cells = ", ".join(
            f"{stage} {state[stage] / model_bytes:.3f} / {peaks[stage] / model_bytes:.2f}"
            for stage in state
        )
        print(f"{name:<18}  {cells}")
        largest[name] = max(state.values()) / model_bytes
    n, s = args.world_size, args.shard
    print(f"OnebitAdam's expected state: 2 + 1/n + 1/32 = {2 + 1 / n + 1 / 32:.3f}")
    if s > 1:
        r = n // s
        expected = (2 + 1 / r + 1 / 32) / s
        print(f"OnebitAdam+HSDP's expected state: (2 + 1/R + 1/32)/S = {expected:.3f}")
        _computed(largest, r, s)


def _loops(
    world_size: int, width: int, depth: int, errors: str = "fp32", loops: Sequence[str] = LOOPS
) -> None:
    """A row per optimizer and training loop: the largest state after the warmup (AdamW: its
    state) and the largest peak of a step, with the targets: OnebitAdam's state at most
    2 + 1/n + 1/16 model sizes, OnebitLamb's 3 + 1/n + 1/16, and each peak within 0.5 of
    AdamW+DDP's in the same loop."""
    n = world_size
    targets = {"OnebitAdam": 2 + 1 / n + 1 / 16, "OnebitLamb": 3 + 1 / n + 1 / 16}
    print(
        f"model: {depth} x Linear({width}, {width}) (channels_last: Conv2d({width // 3}, "
        f"{width // 3}, 3)); {n} gloo ranks; figures for rank 0; onebit errors in {errors}"
    )
    print("state after the warmup (AdamW: its state) and the largest peak of a step, in model")
    print("sizes (fp32 bytes of the parameters; bf16, mixed_dtypes: in bytes per parameter)")
    print(f"{'loop':<17}{'optimizer':<12}{'state':>7}{'target':>8}{'peak':>7}{'vs DDP':>8}  note")
    for loop in loops:
        ddp_peak = None
        for name in ("AdamW+DDP", "OnebitAdam", "OnebitLamb"):
            if loop.startswith("overlap") and name == "OnebitLamb":
                continue
            model_bytes, state, peaks, why = measure(name, n, width, depth, loop=loop,
                                                     errors=errors)  # fmt: skip
            per_parameter = loop in ("bf16", "mixed_dtypes")
            unit = model_bytes / 4 if per_parameter else model_bytes
            after = [b for stage, b in state.items() if stage not in ("warmup", "variance")]
            held, peak = max(after) / unit, max(peaks.values()) / unit
            ddp_peak = peak if ddp_peak is None else ddp_peak
            target = targets.get(name)
            if target is not None and per_parameter:
                target *= 4
            note = ""
            if target is not None:
                ok = held <= target and peak <= ddp_peak + (2.0 if per_parameter else 0.5)
                note = "ok" if ok else "MISSED"
                note += "" if why is None else f"; fp32 momentum: {why}"
            cells = f"{held:>7.3f}{'' if target is None else f'{target:.3f}':>8}{peak:>7.2f}"
            print(f"{loop:<17}{name:<12}{cells}{peak - ddp_peak:>+8.2f}  {note}".rstrip())


def _computed(largest: dict[str, float], replicas: int, shards: int) -> None:
    """The largest state per rank, in GB, of 1B- and 7B-parameter models, scaled from the
    measured fractions of a model size (fp32). The sharded rows divide by the mesh's ``S`` as
    measured; the replicated rows do not depend on it."""
    print(f"computed, GB of optimizer state per rank ({replicas} x {shards} mesh):")
    print(f"{'optimizer':<18}  {'1B':>7}  {'7B':>7}")
    for name, fraction in largest.items():
        print(f"{name:<18}  {fraction * 4:>7.1f}  {fraction * 28:>7.1f}")


if __name__ == "__main__":
    main()
