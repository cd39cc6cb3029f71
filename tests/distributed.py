"""Run a function on several gloo ranks in fresh processes, and collect what each returns.

The launcher is the library's own (:func:`onebit.train.launch.run_ranks`, which ``onebit train``,
the benchmarks and the examples share); here each rank is forked from a server that imported
torch, ``torch._dynamo`` (which the first ``torch.optim.Optimizer`` imports: seconds) and onebit
once, instead of spawned: a rank starts in a fraction of a second, not six. The tests of the
frameworks ask for :data:`FRAMEWORKS` too, which each of their ranks would import again.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver
from typing import Any

from onebit.train import launch

__all__ = ["FRAMEWORKS", "run_ranks"]

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
