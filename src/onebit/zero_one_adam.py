"""0/1 Adam's public path, ``onebit.zero_one_adam``: the optimizer lives in
:mod:`onebit.optim.zero_one_adam`, its schedule in :mod:`onebit.optim.zero_one_schedule`;
:func:`run_schedule`, :func:`run_freeze_step` and :class:`ZeroOneAdam` are imported from here
too, as docs/api.md shows."""

from .optim.zero_one_adam import ZeroOneAdam
from .optim.zero_one_schedule import PAPER_SCHEDULE, Schedule, run_freeze_step, run_schedule

__all__ = ["PAPER_SCHEDULE", "Schedule", "ZeroOneAdam", "run_freeze_step", "run_schedule"]
