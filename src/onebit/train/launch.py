"""Gloo process groups on one machine: start one in a rank, close it, and run a function on
several ranks in fresh processes.

``onebit train``'s local workers, the test suite, the benchmarks and the examples all start and
stop gloo the same way, so they share these pieces:

* :func:`init_gloo` joins a rank to a gloo group over the loopback interface, through a file
  store, with one intra-op thread per rank (the ranks share the machine's cores);
* :func:`close_process_group` destroys the group and lets gloo's threads finish before the
  process exits (pytorch/pytorch#179291);
* :func:`gloo_process_group` is the two around a block;
* :func:`run_ranks` spawns the ranks, collects what each returns, and turns a hang into a
  ``TimeoutError`` and a rank's exception into the caller's;
* :func:`fast_start_method` forks ranks from a server that imported torch and onebit once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_TEARDOWN_GRACE_S = 0.2

PRELOAD = ("torch", "torch._dynamo", "onebit")
"""What a forkserver imports once for all its ranks: torch, ``torch._dynamo`` (which the first
``torch.optim.Optimizer`` imports) and onebit, seconds of CPU that each spawned rank repeats."""


def fast_start_method() -> str:
    """``"forkserver"``, with the server importing :data:`PRELOAD` when it starts, where the
    platform has it (Linux, macOS): each rank is then forked in a fraction of a second; else
    ``"spawn"``. The server never touches CUDA, so a forked rank may use it."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or
    ``None`` if there is none to be found."""
    try:
        return next((n for _, n in socket.if_nameindex() if n.startswith("lo")), None)
    except OSError:
        return None


def init_gloo(rank: int, world_size: int, store: str | Path, timeout: float = 600) -> None:
    """Join this process to a gloo group of ``world_size`` ranks on this machine.

    The ranks meet through the file ``store`` (a path that does not exist yet, the same for
    every rank, and fresh for every group: gloo would read a dead group's addresses from an old
    one). Gloo talks over the loopback interface unless ``GLOO_SOCKET_IFNAME`` already names
    one: its default, the interface of the host name, may not exist or may be firewalled. Each
    rank uses one intra-op thread, since the ranks share the machine's cores. A collective that
    waits more than ``timeout`` seconds for its peers raises.
    """
    if "GLOO_SOCKET_IFNAME" not in os.environ and (name := loopback_interface()):
        os.environ["GLOO_SOCKET_IFNAME"] = name
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


def close_process_group() -> None:
    """Destroy the default process group, if there is one, then give gloo's worker threads time
    to finish.

    A gloo worker drops a finished collective (and its tensors, which needs the GIL) after the
    waiting thread has already moved on. If the interpreter shuts down first, that worker is
    killed while taking the GIL and the process aborts with "terminate called without an
    active exception" (pytorch/pytorch#179291). Sleeping releases the GIL to it.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(_TEARDOWN_GRACE_S)


@contextlib.contextmanager
def gloo_process_group(
    rank: int, world_size: int, store: str | Path, timeout: float = 600
) -> Iterator[None]:
    """:func:`init_gloo` on entry and :func:`close_process_group` on exit, even on an error."""
    init_gloo(rank, world_size, store, timeout)
    try:
        yield
    finally:
        close_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = 180,
    collective_timeout: float = 60,
    start_method: str = "spawn",
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks, each in a fresh
    process; return their results, rank 0's first.

    ``start_method`` is ``"spawn"`` (a new interpreter per rank, which imports torch: about a
    second and a half of CPU each) or ``"forkserver"``, where each rank is forked from a server
    that imported what :func:`multiprocessing.set_forkserver_preload` names once (Linux and
    macOS; many short runs start much faster). Either way a rank runs ``fn`` with this
    process's environment and ``sys.path`` as they are at the call (a forked rank imports
    ``fn``'s module with the server's ``sys.path``, that of when it started).

    ``fn`` must be a module-level function, and ``args`` and the results picklable. An exception
    on any rank stops the others and raises ``torch.multiprocessing.ProcessRaisedException`` with
    the traceback of the rank that failed first (its peers then fail too, in a collective that
    lost it: their errors say nothing). If the ranks have not all finished after ``timeout``
    seconds (``None``: no limit), all are killed and ``TimeoutError`` is raised. A collective
    waiting longer than ``collective_timeout`` seconds fails its rank, naming where it hung.

    Gloo occasionally still aborts a rank while the process group is torn down, after every rank
    has returned and saved its result (see :func:`close_process_group`); that is tolerated, a
    rank that dies before then is not.
    """
    with tempfile.TemporaryDirectory() as workdir:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, args, workdir, collective_timeout, dict(os.environ), sys.path),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        results = [_result_path(workdir, rank) for rank in range(world_size)]
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not context.join(timeout=1):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks ran past {timeout}s")
        except mp.ProcessRaisedException as raised:
            raise _first_failure(workdir, raised, context.pids()) from None
        except mp.ProcessExitedException:
            if not all(path.exists() for path in results):
                raise
        finally:
            for process in context.processes:  # none left behind on a hang or a Ctrl-C
                if process.is_alive():
                    process.kill()
                process.join()
        return [torch.load(path, weights_only=False) for path in results]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    workdir: str,
    collective_timeout: float,
    environ: dict[str, str],
    path: list[str],
) -> None:
    """One rank of :func:`run_ranks`: run ``fn`` in the group and save what it returns, or when
    it failed and how, before its peers can notice. A forked rank takes the caller's
    ``environ`` and ``sys.path`` first (its server's are those of when it started)."""
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    with gloo_process_group(rank, world_size, f"{workdir}/store", collective_timeout):
        try:
            result = fn(rank, world_size, *args)
        except Exception:
            failure = _failure_path(workdir, rank)
            failure.with_suffix(".tmp").write_text(f"{time.monotonic()}\n{traceback.format_exc()}")
            failure.with_suffix(".tmp").replace(failure)
            raise
        dist.barrier()  # no rank tears down its connections while another still uses them
        path = _result_path(workdir, rank)
        torch.save(result, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)  # complete, or absent


def _first_failure(
    workdir: str, raised: mp.ProcessRaisedException, pids: list[int]
) -> mp.ProcessRaisedException:
    """The error of the rank that failed first (by the system-wide monotonic clock), in the form
    ``torch.multiprocessing`` gives ``raised``, the error it saw first."""
    failures = {}
    for rank in range(len(pids)):
        if (path := _failure_path(workdir, rank)).exists():
            stamp, _, trace = path.read_text().partition("\n")
            failures[rank] = float(stamp), trace
    if not failures:
        return raised
    rank = min(failures, key=lambda r: failures[r][0])
    if rank == raised.error_index:
        return raised
    message = f"\n\n-- Process {rank} terminated with the following error:\n{failures[rank][1]}"
    return mp.ProcessRaisedException(message, rank, pids[rank])


def _result_path(workdir: str, rank: int) -> Path:
    return Path(workdir) / f"result{rank}.pt"


def _failure_path(workdir: str, rank: int) -> Path:
    return Path(workdir) / f"failure{rank}.txt"
