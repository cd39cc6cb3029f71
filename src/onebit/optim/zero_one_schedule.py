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

    * phase A starts with ``var_update_scaler`` full-precision steps before its 1-bit ones: all
      of phase A up to 128 steps, and 128 steps of a longer one (at least the paper's 16).
      Short runs learn much of what they will in their first steps, and 1-bit gradients there
      can send a run down a worse path: on runs of 600 steps, 30 such steps after 90
      full-precision ones left one BERT seed in three 8.6% above AdamW, and a CNN 1.1%, where a
      phase A all in full precision ends within 1% (``BENCHMARKS.md``). On the paper's 23k-step
      phase A, 128 steps are negligible;
    * over phase B, ``P = total_steps - var_freeze_step`` steps, the local-step interval may
      grow to the largest power of two at most ``P / 200`` (at least 1, at most the paper's 16),
      doubling evenly through phase B and reaching that cap for the last of its
      ``log2(cap) + 1`` equal parts. Long intervals let the replicas drift apart: on short runs
      an interval of 16 cost several percent of loss.

    A run of 600 steps that freezes at 120 gets ``(120, 240, 2)``: no 1-bit steps in phase A,
    local intervals 1, then 2. The paper's BERT-Base run (118k steps, 23k of them phase A) gets
    ``(128, 19000, 16)``. Given ``local_step_clipper``, the doubling is sized to reach it
    instead.
    """
    phase_b = max(1, total_steps - var_freeze_step)
    clipper = local_step_clipper
    if clipper is None:
        clipper = 1 << max(0, min(4, (phase_b // 200).bit_length() - 1))
    var_update_scaler = max(PAPER_SCHEDULE.var_update_scaler, min(var_freeze_step, 128))
    return Schedule(var_update_scaler, max(1, phase_b // clipper.bit_length()), clipper)
