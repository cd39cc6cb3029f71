"""Run a function on several gloo ranks in fresh processes, and collect what each returns; or run
a script as ``torchrun`` would start it (:func:`run_script`).

The launcher is the library's own (:func:`onebit.train.launch.run_ranks`, which ``onebit train``,
the benchmarks and the examples share); here each rank is forked from a server that imported
torch, ``torch._dynamo`` (which the first ``torch.optim.Optimizer`` imports: seconds) and onebit
once, instead of spawned: a rank starts in a fraction of a second, not six. The tests of the
frameworks ask for :data:`FRAMEWORKS` too, which each of their ranks would import again.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import socket
import sys
import tempfile
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


def run_script(
    script: Path,
    *args: str,
    ranks: int,
    timeout: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> list[tuple[int, str]]:
    """Run ``script`` as ``torchrun --standalone --nproc-per-node RANKS script *args`` does, with
    each rank forked from the server that imported :data:`FRAMEWORKS`: the same script, argument
    list, ``sys.path`` (the script's folder first), working directory (``cwd``, else this
    process's) and torchrun's environment variables (on top of this process's and ``env``),
    without the seconds of CPU each torchrun rank spends importing torch and the frameworks.

    Returns each rank's exit code and output (stdout and stderr, with a rank's uncaught error
    printed as an interpreter prints it), rank 0's first. As under torchrun, once a rank has
    failed the others are killed, after :data:`_PEER_GRACE_S` seconds to fail too. Raises
    ``TimeoutError``, with the end of each rank's output, if they run past ``timeout`` seconds.
    """
    if launch.fast_start_method() != "forkserver":
        raise RuntimeError("run_script forks its ranks: it needs the forkserver (Linux, macOS)")
    _preload_frameworks(True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = {
        **os.environ,
        **(env or {}),
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
    context = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory() as logdir:
        logs = [Path(logdir) / f"rank{rank}.txt" for rank in range(ranks)]
        workdir, path = str(cwd or Path.cwd()), [str(script.parent), *sys.path]
        processes = []
        for rank in range(ranks):
            environ = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            rank_args = (script, args, environ, workdir, path, logs[rank])
            processes.append(context.Process(target=_script_rank, args=rank_args))
            processes[-1].start()
        try:
            _wait(processes, timeout, f"{script.name} on {ranks} ranks")
        except TimeoutError as hung:
            tails = "".join(
                f"\n-- rank {r}:\n{log.read_text()[-2000:]}" for r, log in enumerate(logs)
            )
            raise TimeoutError(f"{hung}{tails}") from None
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join()
        return [(p.exitcode, log.read_text()) for p, log in zip(processes, logs)]


def _wait(processes: list[multiprocessing.process.BaseProcess], timeout: float, what: str) -> None:
    """Until every process has exited, or one has failed and the rest had :data:`_PEER_GRACE_S`
    seconds to; raise ``TimeoutError`` after ``timeout`` seconds."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.exitcode is None for p in processes):
        if failed_at is None and any(p.exitcode for p in processes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + _PEER_GRACE_S:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} ran past {timeout}s")
        time.sleep(0.2)


def _script_rank(
    script: Path,
    args: tuple[str, ...],
    environ: dict[str, str],
    cwd: str,
    path: list[str],
    log: Path,
) -> None:
    """One rank of :func:`run_script`: run ``script`` as ``__main__`` in ``cwd`` with its output
    in ``log``, then the exit handlers it registered, as the interpreter would."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    sys.argv = [str(script), *args]
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        atexit._run_exitfuncs()
