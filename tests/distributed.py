"""Run a function on several gloo ranks in fresh processes, and collect what each returns.

The launcher is the library's own (:func:`onebit.train.launch.run_ranks`, which ``onebit train``,
the benchmarks and the examples share); here each rank is forked from a server that imported
torch, ``torch._dynamo`` (which the first ``torch.optim.Optimizer`` imports: seconds) and onebit
once, instead of spawned: a rank starts in a fraction of a second, not six. The tests of the
frameworks ask for :data:`FRAMEWORKS` too, which each of their ranks would import again.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import socket
import sys
import time
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

from onebit.train import launch

__all__ = ["FRAMEWORKS", "run_ranks", "run_script"]

FRAMEWORKS = (
    "transformers.trainer",
    "accelerate",
    "lightning.pytorch",
    "datasets",  # torchtitan's data loader
    "torch._inductor.compile_fx",  # torchtitan's torch.compile calls at import
)
"""What the frameworks' ranks import, preloaded on request: 1-2 s of CPU each. torchtitan
itself cannot be: it must be patched for the CPU before it is imported."""

_frameworks_preloaded = False
_PEER_GRACE_S = 15
"""How long :func:`run_script` waits for the other ranks after one failed, before killing them."""


def run_ranks(
    fn: Any, world_size: int, *args: Any, frameworks: bool = False, **kwargs: Any
) -> list[Any]:
    """:func:`onebit.train.launch.run_ranks`, started by ``launch.fast_start_method()``; with
    ``frameworks`` the server also imports :data:`FRAMEWORKS` (those not installed are skipped)."""
    start_method = launch.fast_start_method()
    if start_method == "forkserver":
        _preload_frameworks(frameworks)
    return launch.run_ranks(fn, world_size, *args, start_method=start_method, **kwargs)


def _preload_frameworks(wanted: bool) -> None:
    """Restart this process's forkserver, once, to import :data:`FRAMEWORKS` as well; keep them
    from then on (a server that imported more serves every test). The restart is CPython's
    ``ForkServer._stop`` (3.8 to 3.13); without it the ranks import the frameworks themselves."""
    global _frameworks_preloaded
    server = getattr(forkserver, "_forkserver", None)
    if wanted and not _frameworks_preloaded and hasattr(server, "_stop"):
        server._stop()  # the next rank starts a server with the new list
        _frameworks_preloaded = True
    if _frameworks_preloaded:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([*launch.PRELOAD, *FRAMEWORKS])


def run_script(script: Path, *args: str, ranks: int, log: Path, timeout: float) -> int:
    """Run ``script`` as ``torchrun --standalone --nproc-per-node RANKS script *args`` does, with
    each rank forked from the server that imported :data:`FRAMEWORKS`: the same script, argument
    list, ``sys.path`` (the script's folder first) and torchrun's environment variables, without
    the seconds of CPU each torchrun rank spends importing torch and the frameworks.

    Every rank's output goes to ``log``, rank 0's first; a rank's uncaught error is printed
    there, as an interpreter prints it. Returns the exit code: 0, or that of a failed rank, as
    torchrun does, after giving the other ranks :data:`_PEER_GRACE_S` seconds to fail too before
    they are killed. Raises ``TimeoutError`` if the ranks run past ``timeout`` seconds.
    """
    if launch.fast_start_method() != "forkserver":
        raise RuntimeError("run_script forks its ranks: it needs the forkserver (Linux, macOS)")
    _preload_frameworks(True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(ranks),
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    logs = [log.with_name(f"{log.name}.rank{rank}") for rank in range(ranks)]
    context = multiprocessing.get_context("forkserver")
    processes = [
        context.Process(
            target=_script_rank,
            args=(
                script,
                args,
                {**env, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)},
                [str(script.parent), *sys.path],
                logs[r],
            ),
        )
        for r in range(ranks)
    ]
    for process in processes:
        process.start()
    try:
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.exitcode is None for p in processes):
            if failed_at is None and any(p.exitcode for p in processes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + _PEER_GRACE_S:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{script.name} on {ranks} ranks ran past {timeout}s")
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
        log.write_text("".join(path.read_text() for path in logs if path.exists()))
    return next((p.exitcode for p in processes if p.exitcode), 0)


def _script_rank(
    script: Path, args: tuple[str, ...], environ: dict[str, str], path: list[str], log: Path
) -> None:
    """One rank of :func:`run_script`: run ``script`` as ``__main__`` with its output in ``log``."""
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    sys.argv = [str(script), *args]
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    runpy.run_path(str(script), run_name="__main__")
