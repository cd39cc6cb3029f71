"""The Triton kernels as an H100 runs them, measured on the CPU: every kernel variant a step
launches, compiled for sm_90, with its registers, spills and the bytes it moves.

Two passes, the second in a fresh process:

1. Under ``TRITON_INTERPRET=1`` the steps of ``step.py``'s variants run on a GPT layout (the
   third step is measured; the first two build what is built once), and so does the public
   call ``CompressedAllreduce(out=)`` at world size 1 on as many elements. Each Triton launch is
   recorded: the kernel, its arguments (tensors by dtype and alignment) and the bytes it reads
   and writes, each address read counted once per launch and each written once (the DRAM
   traffic: tables of a few bytes per tensor, read by every element, count once). Torch ops
   between the launches count the bytes of their tensors (``launches.py``). Bytes are per
   parameter of the model: ``AdamW(fused=True)`` moves 28.
2. Without the interpreter, each launch goes through Triton's own binder for a
   ``GPUTarget("cuda", 90, 32)``, as a launch on an H100 would: launches with the same compile
   key are one variant. Each variant is compiled (the wheel ships ``ptxas``; no GPU is needed)
   and the ``ptxas -v`` of Triton's build gives its registers and spills.

It also prints the number of variants the first steps of each stage compile and how long that
takes on this CPU (a GPU machine compiles them on its CPU too).

    python benchmarks/registers.py
    python benchmarks/registers.py --python /path/to/venv/bin/python   # compile with its Triton

The GPU machines run Triton 3.6: for their figures, compile with a Python that has it
(``pip install triton==3.6.0`` in a virtual environment that sees this torch and onebit).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

LAYOUT = "GPT, 292 tensors"
BUCKET_SIZES = (1 << 22, 16384)
TARGET_REGISTERS = 128
ADAMW_BYTES = 28


@contextlib.contextmanager
def recording():
    """Under the interpreter: record each Triton launch into the yielded list (the kernel, its
    arguments, tensors by dtype and alignment, and the bytes it moves, each address read
    counted once and each written once)."""
    import numpy as np
    import triton.runtime.interpreter as interpreter

    from onebit.kernels import triton_common

    touched: list[tuple[np.ndarray, int, str]] = []
    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def width(ptrs) -> int:
        return np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize

    def counted_load(self, ptrs, mask, *args):
        touched.append((ptrs.data[mask.data].astype(np.uint64), width(ptrs), "load"))
        return load(self, ptrs, mask, *args)

    def counted_store(self, ptrs, value, mask, *args):
        touched.append((ptrs.data[mask.data].astype(np.uint64), width(ptrs), "store"))
        return store(self, ptrs, value, mask, *args)

    launches: list[dict] = []
    getitem = triton_common.Launched.__getitem__

    def recorded(self, grid):
        launch = getitem(self, grid)

        def run(*args, **kwargs):
            touched.clear()
            result = launch(*args, **kwargs)
            moved = sum(
                len(np.unique(np.concatenate([a for a, w, k in touched if (w, k) == kind])))
                * kind[0]
                for kind in {(w, k) for _, w, k in touched}
            )
            described = [_describe(a) for a in args]
            launches.append({"kernel": self.kernel.fn.__name__, "module": self.kernel.fn.__module__,
                             "args": described, "kwargs": {**kwargs, **self.options},
                             "bytes": moved})  # fmt: skip
            return result

        return run

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    triton_common.Launched.__getitem__ = recorded
    try:
        yield launches
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        triton_common.Launched.__getitem__ = getitem


def record(bucket_size: int, shapes: list[tuple[int, ...]] | None = None) -> dict:
    """Pass 1, under the interpreter: per step variant, its launches and its bytes, on the
    parameters of ``shapes`` (default: :data:`LAYOUT`)."""
    import torch
    from launches import LAYOUTS, _Counting, _counting_triton, built
    from step import VARIANTS

    from onebit import kernels

    os.environ[kernels.ENV] = "triton"
    shapes = LAYOUTS[LAYOUT] if shapes is None else shapes
    numel = sum(torch.Size(s).numel() for s in shapes)
    rows = []
    steps = [(name, built(shapes, optimizer, stage, {**options, "bucket_size": bucket_size}).step)
             for name, optimizer, stage, options in VARIANTS]  # fmt: skip
    steps.append(("CompressedAllreduce(out=)", _public_call(numel)))
    with recording() as launches:
        for name, step in steps:
            launches.clear()
            step()
            step()
            first = list(launches)  # what the first steps launch, and so compile
            launches.clear()
            with _counting_triton(), _Counting() as ops:
                step()
            rows.append({"step": name.strip(), "numel": numel, "first": first,
                         "measured": list(launches), "torch_bytes": ops.bytes})  # fmt: skip
    return {"bucket_size": bucket_size, "numel": numel, "rows": rows}


def record_all(bucket_sizes, shapes: list[tuple[int, ...]] | None = None) -> list[dict]:
    """:func:`record` at each of ``bucket_sizes``, each in a process of its own (spawned, with
    this environment: the interpreter runs a Python thread, so the sizes take one core each)."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(bucket_sizes), mp_context=spawn) as pool:
        return list(pool.map(record, bucket_sizes, [shapes] * len(bucket_sizes)))


def _public_call(numel: int):
    """The public call at world size 1 on a flat buffer of ``numel`` elements, in place."""
    import torch

    from onebit import CompressedAllreduce

    comm, x = CompressedAllreduce(numel), torch.randn(numel)
    return lambda: comm(x, out=x)


def _describe(arg):
    import torch

    if isinstance(arg, torch.Tensor):
        return {"dtype": str(arg.dtype).removeprefix("torch."), "align": arg.data_ptr() % 16}
    return arg


def _rebuild(arg):
    """A CPU tensor of the recorded dtype and alignment (what Triton's binder looks at)."""
    import torch

    if not isinstance(arg, dict):
        return arg
    dtype = getattr(torch, arg["dtype"])
    storage = torch.zeros(64, dtype=torch.uint8)
    return storage[arg["align"] : arg["align"] + 16].view(dtype)


def _bind(launch: dict, backend):
    """``launch`` through Triton's own binder for ``backend``'s target, as a launch there
    would: its JITFunction, the key of its variant, and what compiling it takes."""
    import importlib

    from triton.runtime import jit

    module = importlib.import_module(launch["module"])
    fn = getattr(module, launch["kernel"]).kernel  # a JITFunction: no interpreter here
    binder = jit.create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch["kwargs"])
    bound, specialization, options = binder(*[_rebuild(a) for a in launch["args"]], **kwargs)
    key = launch["kernel"] + str(jit.compute_cache_key({}, specialization, options))
    return fn, key, (kwargs, bound, specialization, options)


def compile_all(recorded: list[dict], build: bool = True, sass: bool = True) -> dict:
    """Pass 2, without the interpreter: each launch's variant (its compile key for sm_90), and
    (``build``) per variant its registers, spill bytes and compile time, from the log of the
    ``ptxas -v`` that Triton's own build runs (``TRITON_DUMP_PTXAS_LOG``), and (``sass``) its
    global loads, from ``nvdisasm`` (a third of a second a variant)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler.compiler import make_backend

    ptxas = Path(get_ptxas(90).path)  # the one Triton compiles sm_90 with
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    variants: dict[str, dict] = {}
    keys = []
    for launch in recorded:
        fn, key, (kwargs, bound, specialization, options) = _bind(launch, backend)
        keys.append(key)
        if key in variants or not build:
            continue
        options, signature, constexprs, attrs = fn._pack_args(
            backend, kwargs, bound, specialization, options
        )
        start = time.perf_counter()
        source = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # where TRITON_DUMP_PTXAS_LOG prints
            compiled = triton.compile(source, target=target, options=options.__dict__)
        seconds = time.perf_counter() - start
        variants[key] = {"kernel": launch["kernel"], "warps": options.num_warps,
                         "seconds": seconds, **_ptxas(log.getvalue(), compiled, ptxas)}  # fmt: skip
        if sass:
            variants[key].update(_global_loads(compiled, ptxas))
    return {"triton": triton.__version__, "variants": variants, "keys": keys}


def _ptxas(log: str, compiled, ptxas: Path) -> dict:
    """Registers and spill bytes from Triton's ``ptxas -v`` ``log``, or where this Triton
    printed none, from a ``ptxas -v`` of the variant's PTX."""
    if "Used" not in log:
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "kernel.ptx"
            ptx.write_text(compiled.asm["ptx"])
            log = subprocess.run(
                [str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                capture_output=True, text=True, check=True,
            ).stderr  # fmt: skip
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return {"registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_stores": spills[0], "spill_loads": spills[1]}  # fmt: skip


def _global_loads(compiled, ptxas: Path) -> dict:
    """A variant's global loads in its SASS, and how many of them load 64 or 128 bits."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(ptxas.parent / "nvdisasm"), str(cubin)],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    loads = re.findall(r"\bLDG\.E(\S*)", sass)
    return {"loads": len(loads), "wide_loads": sum(".128" in m or ".64" in m for m in loads)}


def _in_fresh_process(launches: list[dict], python: str, mode: str) -> dict:
    """:func:`compile_all` of ``launches`` in a fresh process of ``python``, without the
    interpreter or Triton's cache: ``mode`` is ``"--keys"`` (nothing built), ``"--compile"``
    or ``"--registers"`` (built, without the SASS)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "launches.json"
        path.write_text(json.dumps(launches))
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(Path(tmp) / "c"),
               "TRITON_DUMP_PTXAS_LOG": "1"}  # fmt: skip
        out = subprocess.run(
            [python, __file__, mode, str(path)], env=env, capture_output=True, text=True
        )
    if out.returncode:
        raise RuntimeError(f"binding for sm_90 failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def variant_keys(launches: list[dict], python: str = sys.executable) -> list[str]:
    """The variant each of ``launches`` (:func:`recording`'s) compiles on an H100: its key
    from Triton's binder for sm_90, as a launch there would bind it. Equal keys are one
    compiled variant."""
    return _in_fresh_process(launches, python, "--keys")["keys"]


def compile_recorded(results: list[dict], python: str, sass: bool = True) -> tuple[dict, str]:
    """Compile every launch of :func:`record`'s ``results`` in a fresh process of ``python``
    (:func:`compile_all`, with the SASS's loads if ``sass``); name each launch's variant in its
    ``"key"``. Returns the variants and that Triton's version."""
    launches = [launch for r in results for row in r["rows"] for launch in row["first"]]
    launches += [launch for r in results for row in r["rows"] for launch in row["measured"]]
    compiled = _in_fresh_process(launches, python, "--compile" if sass else "--registers")
    keys = iter(compiled["keys"])
    for part in ("first", "measured"):
        for r in results:
            for row in r["rows"]:
                row[part] = [dict(launch, key=next(keys)) for launch in row[part]]
    return compiled["variants"], compiled["triton"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the Python that compiles")
    parser.add_argument("--json", metavar="FILE", help="also write every launch and variant")
    parser.add_argument("--compile", metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--registers", metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--keys", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if given := args.compile or args.registers or args.keys:  # pass 2, in its own process
        recorded = json.loads(Path(given).read_text())
        built = compile_all(recorded, build=not args.keys, sass=bool(args.compile))
        print(json.dumps(built))
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    results = record_all(BUCKET_SIZES)
    variants, version = compile_recorded(results, args.python)
    _report(results, variants, version)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "variants": variants}))


def _report(results: list[dict], variants: dict, version: str) -> None:
    first = results[0]
    print(f"{LAYOUT} ({first['numel']:,} parameters), world size 1, Triton {version} compiling "
          "for sm_90 (H100)")  # fmt: skip
    print("\nVariants: every kernel variant compiled for sm_90")
    print("| kernel | warps | variants | registers | spill bytes (stores / loads) "
          "| global loads, of them 64/128-bit | compile s each |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    by_kernel = collections.defaultdict(list)
    for v in variants.values():
        by_kernel[v["kernel"]].append(v)
    for kernel, vs in sorted(by_kernel.items()):
        regs = sorted({v["registers"] for v in vs})
        stores = max(v["spill_stores"] for v in vs)
        loads = max(v["spill_loads"] for v in vs)
        seconds = sum(v["seconds"] for v in vs) / len(vs)
        flag = " (over)" if max(regs) > TARGET_REGISTERS or stores or loads else ""
        warps = _span(sorted({v["warps"] for v in vs}))
        wide = f"{max(v['loads'] for v in vs)}, {max(v['wide_loads'] for v in vs)}"
        print(f"| {kernel}{flag} | {warps} | {len(vs)} | {_span(regs)} | {stores} / {loads} "
              f"| {wide} | {seconds:.2f} |")  # fmt: skip
    for r in results:
        buckets = -(-r["numel"] // r["bucket_size"])
        print(f"\nPer step at {buckets} bucket(s): the variants the first steps compile (the "
              "third step's launches and bytes per parameter, Triton + torch ops; AdamW(fused) "
              f"moves {ADAMW_BYTES})")  # fmt: skip
        print(
            "| step | variants compiled | compile s | launches | Triton B/param "
            "| torch B/param | total B/param | per kernel, B/param |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for row in r["rows"]:
            keys = {launch["key"] for launch in row["first"] + row["measured"]}
            seconds = sum(variants[k]["seconds"] for k in keys)
            per_kernel = collections.Counter()
            for launch in row["measured"]:
                per_kernel[launch["kernel"]] += launch["bytes"] / r["numel"]
            triton_bytes = sum(per_kernel.values())
            torch_bytes = row["torch_bytes"] / r["numel"]
            kernels = ", ".join(f"{k} {v:.1f}" for k, v in per_kernel.most_common())
            print(f"| {row['step']} | {len(keys)} | {seconds:.1f} | {len(row['measured'])} "
                  f"| {triton_bytes:.1f} | {torch_bytes:.1f} | {triton_bytes + torch_bytes:.1f} "
                  f"| {kernels} |")  # fmt: skip


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
