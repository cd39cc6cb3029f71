"""0/1 Adam's schedule: the knobs that say when its steps communicate, and their sizing to a
run's length (:func:`run_schedule`)."""

from __future__ import annotations

from typing import NamedTuple


class Schedule(NamedTuple):
    """0/1 Adam's schedule knobs (:class:`~onebit.ZeroOneAdam` documents each)."""

    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int


PAPER_SCHEDULE = Schedule(16, 32768, 16)
"""The paper's knobs, for runs of 100k steps and more: 0/1 Adam's defaults without
``total_steps``."""


def run_schedule(
    total_steps: int, var_freeze_step: int, local_step_clipper: int | None = None
) -> Schedule:
    """0/1 Adam's schedule sized for a run of ``total_steps`` that freezes at
    ``var_freeze_step``, the defaults of :class:`~onebit.ZeroOneAdam` told ``total_steps``.

    The rules:

    * phase A starts with ``var_update_scaler`` variance steps in a row before its first
      1-bit step: all of phase A up to 128 steps, and 128 steps of a longer one (at least the
      paper's 16). Short runs learn much of what they will in their first steps, and 1-bit
      gradients there send a run down a worse path: on 600-step runs, 1-bit steps from step 17
      (the paper's 16) left GPT 3.4% and a CNN 3.0% above AdamW, and from step 65 the CNN 1.9%,
      where a phase A of variance steps only ends 0.5% below and 1.2% above
      (``BENCHMARKS.md``). On the paper's 23k-step phase A, 128 steps are negligible;
    * over phase B, ``P = total_steps - var_freeze_step`` steps, the local-step interval grows
      to ``local_step_clipper``: 1 (no local steps) for phase B under 400 steps, 2 up to 9,999
      steps, then the largest power of two at most ``P / 2500``, up to the paper's 16. An
      interval of 2 starts at once (``local_step_scaler`` 1): it makes 40% fewer rounds than
      1-bit Adam, for 1.0% of loss on a 600-step CNN and 0.7% on a 5,000-step GPT, where
      longer intervals cost more (``BENCHMARKS.md``: an interval of 4 over phase B's last
      240 steps ended a 600-step GPT 5.1% above AdamW, of 8 over its last 360 steps 24%, and
      intervals up to 16 a 5,000-step GPT 2.5%). A phase B of 240 steps (a 300-step run) with
      an interval of 2 ended an LSTM 64% above AdamW, and 2.2% below without local steps.
      Longer intervals, for phase B of 10k steps and more (runs this long were not measured
      here), double every ``local_step_scaler = P / (2 log2 clipper)`` steps, so that phase B
      runs its second half at the longest.

    A run of 600 steps that freezes at 120 gets ``(120, 1, 2)``: no 1-bit steps in phase A and
    a sync every other step in phase B; a run of 300 steps, ``(60, 240, 1)``: a sync every
    step. The paper's BERT-Base run (118k steps, 23k of them phase A) gets
    ``(128, 11875, 16)``. Given ``local_step_clipper``, the doubling is sized to reach it
    instead.
    """
    phase_b = max(1, total_steps - var_freeze_step)
    clipper = local_step_clipper
    if clipper is None:
        clipper = 1 if phase_b < 400 else 1 << min(4, max(1, (phase_b // 2500).bit_length() - 1))
    var_update_scaler = max(PAPER_SCHEDULE.var_update_scaler, min(var_freeze_step, 128))
    doublings = clipper.bit_length() - 1
    if doublings <= 1:  # no local steps, or an interval of 2 at once
        local_step_scaler = 1 if doublings else phase_b
    else:
        local_step_scaler = max(1, phase_b // (2 * doublings))
    return Schedule(var_update_scaler, local_step_scaler, clipper)


def run_freeze_step(total_steps: int) -> int:
    """0/1 Adam's ``var_freeze_step`` for a run of ``total_steps``, the default of
    :class:`~onebit.ZeroOneAdam` told ``total_steps`` without ``var_freeze_step``: a fifth of
    the run, as the paper (23k of 118k steps for BERT-Base; 10-20% in general)."""
    return max(1, total_steps // 5)
