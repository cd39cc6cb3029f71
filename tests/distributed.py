"""Run a function on several gloo ranks in fresh processes, and collect what each returns."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world_size: int, args: tuple, workdir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()  # no rank tears down its connections while another still uses them
        path = Path(workdir) / f"result{rank}.pt"
        torch.save(result, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)  # complete, or absent
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results.

    ``fn`` must be a module-level function. An exception on any rank fails the caller with that
    rank's traceback; a hang fails it after ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory() as workdir:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, args, workdir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        results = [Path(workdir) / f"result{r}.pt" for r in range(world_size)]
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks ran past {timeout}s")
        except mp.ProcessExitedException:
            # gloo occasionally aborts inside destroy_process_group, after every rank has
            # finished and saved its result; a crash before that still fails the test.
            if not all(path.exists() for path in results):
                raise
        return [torch.load(path, weights_only=False) for path in results]
