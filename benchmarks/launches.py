"""Count the kernels one optimizer step launches: torch ops that compute (views and allocations
left out) and Triton launches, per backend, on layouts of many and of few tensors; and its host
reads of device values (each one a synchronisation on a GPU) and uploads, as ``onebit.host``
counts them.

On a GPU every one of them is a kernel launch and its CPU time, which is what bounded the
compression step before the Triton kernels (5,665 kernels for 16 tensors). The
count is the same on any device, so this runs on the CPU, Triton under its interpreter:

    TRITON_INTERPRET=1 python benchmarks/launches.py
    python benchmarks/launches.py --device cuda   # counted on a GPU: kernels, syncs, compiles

``torch`` is the reference backend, which CUDA ran before; ``triton`` the Triton kernels. The
layouts are small (the counts do not depend on the tensors' sizes, only on their number and on
the buckets), and ``--bucket-size`` sets how many buckets they make.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
from step import VARIANTS, _gpt_shapes, _optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from onebit import host, kernels

_FREE = {"empty", "empty_strided", "empty_like", "alias", "detach", "lift_fresh", "set_"}
_FREE |= {"_record_function_enter_new", "_record_function_exit"}  # profiler marks, not kernels


_IN_TRITON = [False]  # the interpreter's own torch ops (copies of the arguments) do not count


_WRITE_ONLY = {"copy_", "fill_", "zero_"}


class _Counting(TorchDispatchMode):
    """Counts the torch ops that compute something (not views, not allocations), and about the
    bytes they move: each tensor argument read once, each output written once (an in-place op
    reads and writes its first argument; ``copy_``, ``fill_`` and ``zero_`` only write it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (_IN_TRITON[0] or func.is_view or name in _FREE):
            self.ops += 1
            inputs = [t for t in tree_flatten((args, kwargs or {}))[0] if torch.is_tensor(t)]
            outputs = [t for t in tree_flatten(out)[0] if torch.is_tensor(t)]
            written = {id(t) for t in outputs}
            read = [t for t in inputs if id(t) not in written]
            if name.endswith("_") and name not in _WRITE_ONLY:
                read += [t for t in inputs if id(t) in written]
            self.bytes += sum(t.numel() * t.element_size() for t in read + outputs)
        return out


@contextlib.contextmanager
def _counting_triton():
    """Count Triton launches (compiled or interpreted) in the yielded list's first item."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    count = [0]
    patched = []
    for owner in (jit.JITFunction, interpreter.InterpretedFunction):
        run = owner.run

        def counted(self, *args, _run=run, **kwargs):
            count[0] += 1
            _IN_TRITON[0] = True
            try:
                return _run(self, *args, **kwargs)
            finally:
                _IN_TRITON[0] = False

        owner.run = counted
        patched.append((owner, run))
    try:
        yield count
    finally:
        for owner, run in patched:
            owner.run = run


LAYOUTS = {
    "16 tensors": [(64, 128)] * 8 + [(128,)] * 8,
    "GPT, 292 tensors": _gpt_shapes(24, 32, 512, 64),
}


def built(shapes, optimizer: str, stage: str, options: dict, device: str | torch.device = "cpu"):
    """``optimizer`` (a name of ``step.VARIANTS``) with ``options`` on random parameters of
    ``shapes`` with gradients, in ``stage`` from its second step on (the warmup never ends)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return _optimizer(optimizer, params, 10**9 if stage == "warmup" else 1, options)


def count(shapes, backend: str, bucket_size: int) -> dict[str, tuple[int, int, int, int]]:
    """Per step variant: (torch ops, Triton launches, host reads, uploads) of its third step
    (the first two build what is built once: the last warmup step, then the first of the
    stage). Reads and uploads are those :mod:`onebit.host` counts, which the tests check are
    all of them; on a GPU each read is a synchronisation."""
    os.environ[kernels.ENV] = backend
    rows = {}
    for name, optimizer, stage, options in VARIANTS:
        opt = built(shapes, optimizer, stage, {**options, "bucket_size": bucket_size})
        opt.step()
        opt.step()
        with _counting_triton() as launches, _Counting() as ops, host.counted() as transfers:
            opt.step()
        rows[name] = ops.ops, launches[0], transfers.reads, transfers.uploads
    return rows


def _launched_kernels() -> list:
    """Every Triton kernel onebit launches (their ``JITFunction``)."""
    from onebit.kernels import triton_common, triton_kernels  # noqa: F401 (defines them all)

    return [k.kernel for k in triton_common.LAUNCHED]


def _variants() -> int:
    """How many Triton kernel variants this process has compiled (for any device)."""
    return sum(len(cache[0]) for k in _launched_kernels() for cache in k.device_caches.values())


def count_cuda(shapes, bucket_size: int) -> dict[str, tuple]:
    """Per step variant, on CUDA with the Triton kernels: (CUDA kernels of its third step, as
    the profiler lists them; host synchronisations of that step, as
    ``torch.cuda.set_sync_debug_mode`` warns of them; the reads :mod:`onebit.host` counted in
    it; then for its first step (the last warmup step, and the rehearsal that compiles the
    stage's kernels ahead) and its second (the first of its stage) the Triton variants each
    compiled and its time less a steady step's, in seconds). Each variant starts from an empty
    Triton cache, in memory and on disk."""
    import tempfile
    import time
    import warnings

    from torch.profiler import ProfilerActivity, profile

    os.environ.pop(kernels.ENV, None)
    cuda = torch.device("cuda")
    rows = {}
    for name, optimizer, stage, options in VARIANTS:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="onebit-triton-")
        for kernel in _launched_kernels():
            kernel.device_caches.clear()
        opt = built(shapes, optimizer, stage, {**options, "bucket_size": bucket_size}, cuda)
        first = []
        for _ in range(2):
            before, start = _variants(), time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            first.append((_variants() - before, time.perf_counter() - start))
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        steady = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt.step()
            torch.cuda.synchronize()
        launched = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with host.counted() as transfers:
                    opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        compiles = [(n, max(0.0, seconds - steady)) for n, seconds in first]
        rows[name] = (launched, syncs, transfers.reads, *compiles)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="torch,triton")
    parser.add_argument("--bucket-sizes", default=str(1 << 22) + ",16384")
    parser.add_argument(
        "--device", default="cpu", help="cuda: count kernels and synchronisations on the GPU"
    )
    args = parser.parse_args()
    if args.device == "cuda":
        main_cuda(args)
        return
    backends = args.backends.split(",")
    print(f"torch {torch.__version__}; per step, by backend: torch ops + Triton launches, "
          "and host reads (synchronisations on a GPU) / uploads")  # fmt: skip
    head = " | ".join(f"{b}: ops + launches | {b}: reads / uploads" for b in backends)
    print(f"| layout | buckets | step | {head} |")
    print("|---|---|---|" + "---|---|" * len(backends))
    for layout, shapes in LAYOUTS.items():
        numel = sum(torch.Size(s).numel() for s in shapes)
        for bucket_size in map(int, args.bucket_sizes.split(",")):
            counts = {b: count(shapes, b, bucket_size) for b in backends}
            buckets = -(-numel // bucket_size)
            for name, *_ in VARIANTS:
                cells = " | ".join(
                    f"{ops} + {launched} = {ops + launched} | {reads} / {uploads}"
                    for ops, launched, reads, uploads in (counts[b][name] for b in backends)
                )
                print(f"| {layout} | {buckets} | {name.strip()} | {cells} |")


def main_cuda(args: argparse.Namespace) -> None:
    """The counts on CUDA, each step variant compiling from empty Triton caches (a first run)."""
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; per step on CUDA: "
          "kernels (profiler), host synchronisations (sync debug mode), and the Triton "
          "variants compiled, with their time, by the first step (the last warmup step and "
          "the rehearsal that compiles the stage's kernels ahead) and by the second (the "
          "first of the stage)")  # fmt: skip
    print("| layout | buckets | step | CUDA kernels | host syncs | host reads | variants, "
          "step 1 / 2 | compile s, step 1 / 2 |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for layout, shapes in LAYOUTS.items():
        numel = sum(torch.Size(s).numel() for s in shapes)
        for bucket_size in map(int, args.bucket_sizes.split(",")):
            buckets = -(-numel // bucket_size)
            for name, (kernels_, syncs, reads, (n1, s1), (n2, s2)) in count_cuda(
                shapes, bucket_size
            ).items():
                print(f"| {layout} | {buckets} | {name.strip()} | {kernels_} | {syncs} "
                      f"| {reads} | {n1} / {n2} | {s1:.1f} / {s2:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
