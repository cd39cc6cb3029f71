"""Run a function on several gloo ranks in fresh processes, and collect what each returns.

The launcher is the library's own (:func:`onebit.train.launch.run_ranks`, which ``onebit train``,
the benchmarks and the examples share); the test modules import it from here.
"""

from __future__ import annotations

from onebit.train.launch import run_ranks

__all__ = ["run_ranks"]
