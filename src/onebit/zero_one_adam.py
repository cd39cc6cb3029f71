"""0/1 Adam's public path, ``onebit.zero_one_adam``: the optimizer lives in
:mod:`onebit.optim.zero_one_adam`; :func:`run_schedule` and :class:`ZeroOneAdam` are imported
from here too, as the README shows."""

from .optim.zero_one_adam import PAPER_SCHEDULE, Schedule, ZeroOneAdam, run_schedule

__all__ = ["PAPER_SCHEDULE", "Schedule", "ZeroOneAdam", "run_schedule"]
