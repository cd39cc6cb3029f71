"""When to freeze Adam's variance: a fixed ``freeze_step`` or ``freeze_step="auto"``.

1-bit Adam and 1-bit LAMB rest on one observation (Tang et al., 2021): after a warmup, Adam's
variance ``v`` barely moves, so it can be frozen and the momentum sent with 1-bit compression.
A fixed ``freeze_step`` must be guessed before training; ``"auto"`` watches ``v`` and freezes once
it has stopped moving, on a time scale set by the run itself. The rule, with the knobs of
:class:`AutoFreeze`:

* measure, at the end of some warmup steps, each parameter's ("layer's") mean of Adam's
  denominator ``sqrt(v̂) + eps``, the quantity that will be frozen. By default the measurements
  are a growing window apart: the largest power of two at most ``step / 8``, so a window is
  always 1/16 to 1/8 of the run so far, and a run of any length measures about 8 times per
  doubling of its step;
* the statistic is the relative change of these means since the previous measurement, averaged
  over layers weighted by their sizes (the large matrices, which hold the parameters and the
  bytes, decide), *per unit of relative time*: divided by ``window / min(step, memory)``, where
  ``memory = 1 / (1 - beta2)`` is how many steps ``v`` averages. It reads as "percent change of
  the denominator per percent of the steps that ``v`` averages", the same on a run of 300 steps
  and of 300,000. The ranks agree on it with one scalar ``MAX`` allreduce;
* freeze at the end of the first measuring step at or after ``min_step`` where the statistic has
  been below ``tolerance`` for ``patience`` measurements in a row, and at ``max_step`` at the
  latest. Told the run's length (``total_steps``), ``max_step`` defaults to ``max_fraction`` of
  it.

:class:`FreezeSchedule` holds the step, fixed or chosen, and the rule's state. The chosen step is
recorded in the optimizer's ``freeze_step``, in ``comm_stats.freeze_step`` and in the state dict,
so a resumed run keeps it (and an unfinished decision continues exactly).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from . import host
from .functional import layer_norms
from .stats import count_collective


@dataclass(frozen=True)
class AutoFreeze:
    """Knobs of ``freeze_step="auto"``. The defaults adapt to the run; pass ``total_steps`` when
    the run's length is known, so that the warmup is capped at a fraction of it.

    Args:
        window: steps between two measurements of the variance. ``None`` (default): a window
            that grows with the run, the largest power of two at most ``step / 8``. An int
            measures every ``window`` steps, as a fixed schedule.
        tolerance: the statistic below which the variance counts as stable (default 0.25): the
            size-weighted mean over layers of the relative change of each layer's mean Adam
            denominator over one window, divided by the window's share of
            ``min(step, 1 / (1 - beta2))``. A variance averaging gradients whose squares are
            now ``q`` times its mean moves at about ``(1 - q) / 2``: 0.25 asks that the last
            gradients be at least half as large, in square, as those the variance holds. Lower
            it to freeze later and more safely; raise it to compress sooner.
        patience: consecutive stable measurements needed (default 3), so that one quiet window
            in a noisy warmup does not freeze early.
        min_step: never freeze before this step. ``None`` (default): 50, or ``max_step`` if
            that is lower. The variance of the first steps is an average of few gradients;
            freezing it makes a noisy preconditioner.
        max_step: freeze at this step at the latest, stable or not. ``None`` (default):
            ``max_fraction`` of ``total_steps`` when that is given, else no limit but
            ``lr_drop``'s. A variance that never settles (a run shorter than the
            ``1 / (1 - beta2)`` steps ``v`` averages, which still holds its first large
            gradients, or a drifting loss scale) would otherwise keep every step in the warmup.
        total_steps: the run's length in optimizer steps, when known (``None``: unknown).
        max_fraction: with ``total_steps`` and no ``max_step``, the largest share of the run the
            warmup may take (default 0.2, within the 15-25% the papers warm up for). A short run
            whose variance never settles freezes there: with an int4 warmup, a fifth kept every
            seed of the measured tasks within 1% of AdamW's loss, a quarter did not.
        lr_drop: without ``total_steps`` or ``max_step``, also freeze once the learning rate
            has fallen this fraction below the highest it has been (default 0.05; ``None``: do
            not watch it), from ``min_step`` on. The learning-rate schedule is what an
            optimizer can see of the run's length: a warmup over the first 5% of the run, then
            a cosine decay to a tenth, falls 5% below its peak a fifth into the run (a linear
            decay to zero, a tenth into it). A constant learning rate leaves the decision to the
            variance alone.

    Raises:
        ValueError: for a knob out of range, or a ``min_step`` above ``max_step``: the message
            says which to change.
    """

    window: int | None = None
    tolerance: float = 0.25
    patience: int = 3
    min_step: int | None = None
    max_step: int | None = None
    total_steps: int | None = None
    max_fraction: float = 0.2
    lr_drop: float | None = 0.05

    DEFAULT_MIN_STEP = 50

    def __post_init__(self) -> None:
        _check_int("patience", self.patience, 1)
        for name, low in (("window", 1), ("min_step", 0), ("max_step", 1), ("total_steps", 1)):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low)
        if not (isinstance(self.tolerance, (int, float)) and 0 < self.tolerance < math.inf):
            raise ValueError(f"AutoFreeze.tolerance must be > 0, got {self.tolerance!r}")
        fraction = self.max_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ValueError(f"AutoFreeze.max_fraction must be a number, got {fraction!r}")
        if not 0 < fraction <= 1:
            raise ValueError(f"AutoFreeze.max_fraction must be in (0, 1], got {fraction!r}")
        drop = self.lr_drop
        if drop is not None and not (
            isinstance(drop, (int, float)) and not isinstance(drop, bool) and 0 < drop < 1
        ):
            raise ValueError(f"AutoFreeze.lr_drop must be None or in (0, 1), got {drop!r}")
        last = self.last_step
        if self.min_step is not None and last is not None and self.min_step > last:
            cap = (
                f"max_step={last}"
                if self.max_step is not None
                else f"max_step={last} ({fraction:g} of total_steps={self.total_steps})"
            )
            raise ValueError(
                f"AutoFreeze.min_step={self.min_step} is above {cap}: the warmup cannot end "
                f"after its own cap. Lower min_step to {last} or less (or leave it None), or "
                "raise the cap"
            )

    @property
    def last_step(self) -> int | None:
        """The step at which the warmup ends at the latest (``None``: no fixed limit, and
        ``lr_drop`` watches the learning rate)."""
        if self.max_step is not None:
            return self.max_step
        if self.total_steps is None:
            return None
        return max(1, math.floor(self.max_fraction * self.total_steps))

    @property
    def first_step(self) -> int:
        """The first step at which the variance may freeze for being stable."""
        if self.min_step is not None:
            return self.min_step
        last = self.last_step
        return self.DEFAULT_MIN_STEP if last is None else min(self.DEFAULT_MIN_STEP, last)

    def window_at(self, step: int) -> int:
        """The window that ends at ``step``: ``window``, or the growing one."""
        if self.window is not None:
            return self.window
        return max(1, (1 << (step.bit_length() - 1)) // 8)


def told_auto_freeze(
    freeze_step: int | str, auto_freeze: AutoFreeze | None, total_steps: int | None
) -> AutoFreeze | None:
    """The knobs of ``freeze_step="auto"`` told the run's length: an optimizer's
    ``total_steps`` argument, the same as ``auto_freeze=AutoFreeze(total_steps=...)``. A fixed
    ``freeze_step`` needs no cap: there ``total_steps`` changes nothing.

    Raises:
        ValueError: for a ``total_steps`` that is not an int >= 1, or one that ``auto_freeze``
            contradicts.
    """
    if total_steps is None:
        return auto_freeze
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
    if freeze_step != "auto":
        return auto_freeze  # FreezeSchedule refuses knobs without "auto"
    if auto_freeze is None:
        return AutoFreeze(total_steps=total_steps)
    if not isinstance(auto_freeze, AutoFreeze):
        return auto_freeze  # FreezeSchedule says what is wrong
    if auto_freeze.total_steps not in (None, total_steps):
        raise ValueError(
            f"total_steps={total_steps} and auto_freeze=AutoFreeze(total_steps="
            f"{auto_freeze.total_steps}) disagree: give the run's length once"
        )
    return dataclasses.replace(auto_freeze, total_steps=total_steps)


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"AutoFreeze.{name} must be an int >= {low}, got {value!r}")


class VarianceMonitor:
    """The state of the ``"auto"`` rule: the last measurement and the run of stable ones.

    ``memory`` is how many steps the variance averages, ``1 / (1 - beta2)``. ``numels`` are the
    layers' sizes, which weigh the statistic (``None``: the sizes of the denominators
    observed). ``layer_norms(tensors, ord)`` takes each layer's norm as a CPU vector; an
    optimizer of sharded parameters sets both to the whole layers'
    (:class:`onebit.transport.sharding.Sharded`), so that every shard measures the same statistic.
    """

    def __init__(
        self,
        config: AutoFreeze,
        memory: float = math.inf,
        numels: list[int] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.memory = memory
        self.process_group = process_group
        self.numels = numels
        self.layer_norms: Callable[[list[Tensor], float], Tensor] = _layer_norms
        self.reference: Tensor | None = None
        self.reference_step = 0
        self.stable_windows = 0
        self.last_change = math.inf
        self.lr = self.peak_lr = 0.0

    def note_lr(self, lr: float) -> None:
        """The learning rate of the step that opens (the largest of the param groups')."""
        self.lr, self.peak_lr = lr, max(self.peak_lr, lr)

    def capped(self, step: int) -> bool:
        """Whether the warmup must end at ``step``, stable or not: its cap is reached, or, with
        no cap, the learning rate has fallen ``lr_drop`` below its peak."""
        config, last = self.config, self.config.last_step
        if last is not None:
            return step >= last
        drop = config.lr_drop
        fallen = drop is not None and self.lr <= (1 - drop) * self.peak_lr
        return fallen and self.peak_lr > 0 and step >= config.first_step

    def due(self, step: int) -> bool:
        """Whether step ``step`` measures: a window ends there, or the warmup must end."""
        return step % self.config.window_at(step) == 0 or self.capped(step)

    def observe(self, step: int, denominators: list[Tensor]) -> bool:
        """Measure at the end of warmup step ``step``; return whether to freeze now.

        ``denominators`` are each layer's ``sqrt(v̂) + eps``. A collective on measuring steps:
        call it on every rank.
        """
        if not self.due(step):
            return False
        config = self.config
        sizes = [d.numel() for d in denominators] if self.numels is None else self.numels
        numels = torch.tensor(sizes, dtype=torch.float32)
        means = self.layer_norms(denominators, 1) / numels.clamp(min=1)
        weights = numels / numels.sum().clamp(min=1)
        change = math.inf
        if self.reference is not None:
            elapsed = min(self.reference_step, self.memory) / max(1, step - self.reference_step)
            change = _relative_change(means, self.reference, weights) * elapsed
        if dist.is_available() and dist.is_initialized():
            device = denominators[0].device if denominators else torch.device("cpu")
            agreed = host.upload([change], device, torch.float64)
            count_collective()
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.process_group)
            change = float(host.read(agreed))
        self.reference, self.reference_step = means, step
        self.last_change = change
        self.stable_windows = self.stable_windows + 1 if change < config.tolerance else 0
        stable = step >= config.first_step and self.stable_windows >= config.patience
        return stable or self.capped(step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "reference": None if self.reference is None else self.reference.clone(),
            "reference_step": self.reference_step,
            "stable_windows": self.stable_windows,
            "last_change": self.last_change,
            "peak_lr": self.peak_lr,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        reference = state["reference"]
        # A state saved before "reference_step" existed measures afresh from its next window.
        known = "reference_step" in state
        self.reference = None if reference is None or not known else reference.clone()
        self.reference_step = state.get("reference_step", 0)
        self.stable_windows = state["stable_windows"]
        self.last_change = state["last_change"]
        self.peak_lr = state.get("peak_lr", 0.0)  # saved before it was: the peak from here on


def _layer_norms(tensors: list[Tensor], ord: float) -> Tensor:
    return host.read(layer_norms(tensors, ord))


def _relative_change(now: Tensor, before: Tensor, weights: Tensor) -> float:
    """``Σ_l w_l·|now_l - before_l| / before_l``; layers that stay exactly put count 0."""
    diff = (now - before).abs()
    rel = torch.where(diff == 0, 0.0, diff / before)
    return float((rel * weights).sum())


class FreezeSchedule:
    """When an optimizer's warmup ends and Adam's variance freezes: a state object of its own.

    Each optimizer holds one as ``freeze`` (the way a DDP comm hook holds its ``PowerSGDState``)
    and asks it where the warmup stands; it knows nothing of the optimizer, so everything it
    uses comes in as an argument.

    Args:
        freeze_step: the last warmup step, an int >= 1, or ``"auto"`` to choose it while
            training by the rule of :class:`AutoFreeze`.
        auto_freeze: the knobs of ``"auto"`` (default ``AutoFreeze()``); only with ``"auto"``.
        process_group: the group whose ranks agree on an ``"auto"`` decision (``None``: the
            default group).
        beta2: Adam's ``beta2``, whose ``1 / (1 - beta2)`` steps the ``"auto"`` statistic
            takes as the variance's memory.

    Attributes:
        freeze_step: the last warmup step: the constructor's int, or the step ``"auto"`` chose;
            ``None`` while that decision is pending.
        auto_freeze: the knobs of ``"auto"``; ``None`` for a fixed step.
        monitor: the :class:`VarianceMonitor` of ``"auto"``; ``None`` for a fixed step.

    Raises:
        ValueError: for a ``freeze_step`` that is neither an int >= 1 nor ``"auto"``, or knobs
            without ``"auto"``.
    """

    def __init__(
        self,
        freeze_step: int | Literal["auto"],
        auto_freeze: AutoFreeze | None = None,
        process_group: dist.ProcessGroup | None = None,
        beta2: float = 0.999,
    ) -> None:
        self.freeze_step: int | None
        self.auto_freeze: AutoFreeze | None
        self.monitor: VarianceMonitor | None = None
        if freeze_step == "auto":
            self.freeze_step = None
            self.auto_freeze = AutoFreeze() if auto_freeze is None else auto_freeze
            if not isinstance(self.auto_freeze, AutoFreeze):
                raise ValueError(f"auto_freeze must be an AutoFreeze, got {auto_freeze!r}")
            memory = 1 / (1 - beta2) if beta2 < 1 else math.inf
            self.monitor = VarianceMonitor(self.auto_freeze, memory, process_group=process_group)
        else:
            if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
                raise ValueError(f'freeze_step must be an int >= 1 or "auto", got {freeze_step!r}')
            if auto_freeze is not None:
                raise ValueError('auto_freeze needs freeze_step="auto"')
            self.freeze_step = freeze_step
            self.auto_freeze = None

    def note_lr(self, lr: float) -> None:
        """The learning rate of the step that opens, which ``"auto"`` watches (``lr_drop``)."""
        if self.monitor is not None and self.freeze_step is None:
            self.monitor.note_lr(lr)

    def in_warmup(self, num_steps: int) -> bool:
        """Whether the step after ``num_steps`` applied steps is a warmup step: until
        ``freeze_step`` steps are applied, and while ``"auto"`` has not decided."""
        return self.freeze_step is None or num_steps < self.freeze_step

    def variance_step(self, step: int) -> int:
        """The step whose variance is in use at ``step``: ``step``, or ``freeze_step`` after it
        (the step count of the variance's bias correction)."""
        return step if self.freeze_step is None else min(step, self.freeze_step)

    def measures(self, step: int) -> bool:
        """Whether :meth:`observe` measures at ``step``: an ``"auto"`` decision is pending and
        the step is one of its measuring steps."""
        return self.monitor is not None and self.freeze_step is None and self.monitor.due(step)

    def observe(self, step: int, denominators: list[Tensor]) -> bool:
        """Feed the ``"auto"`` rule each layer's ``sqrt(v̂) + eps`` at the end of applied warmup
        step ``step``; return whether it froze at ``step`` (``freeze_step`` is then ``step``).

        A collective on measuring steps (:meth:`measures`): call it on every rank.
        """
        if not self.measures(step):
            return False
        assert self.monitor is not None
        if not self.monitor.observe(step, denominators):
            return False
        self.freeze_step = step
        return True

    def state_dict(self) -> dict[str, Any]:
        """``freeze_step`` and the ``"auto"`` rule's state (``None`` for a fixed step)."""
        monitor = self.monitor
        return {
            "freeze_step": self.freeze_step,
            "auto_freeze": None if monitor is None else monitor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore an ``"auto"`` decision, made or pending; a fixed ``freeze_step`` stays the
        constructor's (and needs no keys in ``state``)."""
        if self.monitor is None:
            return
        self.freeze_step = state["freeze_step"]
        if state["auto_freeze"] is not None:
            self.monitor.load_state_dict(state["auto_freeze"])
