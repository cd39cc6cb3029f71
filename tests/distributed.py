"""Run a function on several gloo ranks in fresh processes, and collect what each returns.

The launcher is the library's own (:func:`onebit.train.launch.run_ranks`, which ``onebit train``,
the benchmarks and the examples share); here each rank is forked from a server that imported
torch, ``torch._dynamo`` (which the first ``torch.optim.Optimizer`` imports: seconds) and onebit
once, instead of spawned: a rank starts in a fraction of a second, not six.
"""

from __future__ import annotations

from typing import Any

from onebit.train import launch

__all__ = ["run_ranks"]


def run_ranks(fn: Any, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`onebit.train.launch.run_ranks`, started by ``launch.fast_start_method()``."""
    start_method = launch.fast_start_method()
    return launch.run_ranks(fn, world_size, *args, start_method=start_method, **kwargs)
