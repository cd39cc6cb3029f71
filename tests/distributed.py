"""Run a function on several gloo ranks in fresh processes, and collect what each returns.

The launcher is the library's own (:func:`onebit.train.launch.run_ranks`, which ``onebit train``,
the benchmarks and the examples share); here each rank is forked from a server that imported
torch, ``torch._dynamo`` (which the first ``torch.optim.Optimizer`` imports: seconds) and onebit
once, instead of spawned: a rank starts in a fraction of a second, not six.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from onebit.train import launch

PRELOAD = ["torch", "torch._dynamo", "onebit"]
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)

__all__ = ["run_ranks"]


def run_ranks(fn: Any, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`onebit.train.launch.run_ranks` with ``start_method="forkserver"``."""
    return launch.run_ranks(fn, world_size, *args, start_method="forkserver", **kwargs)
