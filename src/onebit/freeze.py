"""When to freeze Adam's variance: a fixed ``freeze_step`` or ``freeze_step="auto"``.

1-bit Adam and 1-bit LAMB rest on one observation (Tang et al., 2021): after a warmup, Adam's
variance ``v`` barely moves, so it can be frozen and the momentum sent with 1-bit compression.
A fixed ``freeze_step`` must be guessed before training; ``"auto"`` watches ``v`` and freezes once
it has stopped moving. The rule, with the knobs of :class:`AutoFreeze`:

* every ``window`` warmup steps, measure for each parameter ("layer") the mean of Adam's
  denominator ``sqrt(v̂) + eps``, the quantity that will be frozen;
* the statistic is the relative change of these means since the previous measurement, averaged
  over layers weighted by their sizes: the large matrices, which hold the parameters and the
  bytes, decide, and a tiny layer whose few elements keep a noisy variance cannot hold the freeze
  back forever. The ranks agree on it with one scalar ``MAX`` allreduce (``v`` comes from
  averaged gradients, so it is the same everywhere anyway; the allreduce makes it a guarantee);
* freeze at the end of the first measuring step at or after ``min_step`` where the statistic has
  been below ``tolerance`` for ``patience`` measurements in a row, and at ``max_step`` at the
  latest.

:class:`FreezeSchedule` holds the step, fixed or chosen, and the rule's state. The chosen step is
recorded in the optimizer's ``freeze_step``, in ``comm_stats.freeze_step`` and in the state dict,
so a resumed run keeps it (and an unfinished decision continues exactly).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from .functional import layer_norms


@dataclass(frozen=True)
class AutoFreeze:
    """Knobs of ``freeze_step="auto"``; the defaults suit runs of a few thousand steps or more.

    Args:
        window: steps between two measurements of the variance (default 50). Longer windows
            see slow drifts that short ones miss; keep it well below the warmup you expect. The
            tolerance is per window: halve it if you halve the window.
        tolerance: the statistic, the size-weighted mean over layers of the relative change of
            each layer's mean Adam denominator over one window, below which the variance counts
            as stable (default 0.02, i.e. 2%). Lower it to freeze later and more safely; raise it
            to compress sooner.
        patience: consecutive stable measurements needed (default 3), so that one quiet window
            in a noisy warmup does not freeze early.
        min_step: never freeze before this step (default 100). The variance of the first steps
            is an average of few gradients; freezing it makes a noisy preconditioner.
        max_step: freeze at this step at the latest, stable or not (default ``None``: no limit).
            A variance that never settles (a drifting loss scale, say) would keep every step in
            fp32; set it to cap the full-precision traffic, e.g. at 25% of the run.
    """

    window: int = 50
    tolerance: float = 0.02
    patience: int = 3
    min_step: int = 100
    max_step: int | None = None

    def __post_init__(self) -> None:
        for name in ("window", "patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AutoFreeze.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.min_step, bool) or not isinstance(self.min_step, int):
            raise ValueError(f"AutoFreeze.min_step must be an int, got {self.min_step!r}")
        if not (isinstance(self.tolerance, (int, float)) and 0 < self.tolerance < math.inf):
            raise ValueError(f"AutoFreeze.tolerance must be > 0, got {self.tolerance!r}")
        if self.max_step is not None and (
            isinstance(self.max_step, bool)
            or not isinstance(self.max_step, int)
            or self.max_step < max(1, self.min_step)
        ):
            raise ValueError(
                f"AutoFreeze.max_step must be None or an int >= max(1, min_step), "
                f"got {self.max_step!r}"
            )


class VarianceMonitor:
    """The state of the ``"auto"`` rule: the last measurement and the run of stable ones.

    ``numels`` are the layers' sizes, which weigh the statistic (``None``: the sizes of the
    denominators observed). ``layer_norms(tensors, ord)`` takes each layer's norm as a CPU
    vector; an optimizer of sharded parameters sets both to the whole layers'
    (:class:`onebit.sharding.Sharded`), so that every shard measures the same statistic.
    """

    def __init__(
        self,
        config: AutoFreeze,
        numels: list[int] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.process_group = process_group
        self.numels = numels
        self.layer_norms: Callable[[list[Tensor], float], Tensor] = _layer_norms
        self.reference: Tensor | None = None
        self.stable_windows = 0
        self.last_change = math.inf

    def due(self, step: int) -> bool:
        """Whether step ``step`` measures (every ``window`` steps, and at ``max_step``)."""
        return step % self.config.window == 0 or step == self.config.max_step

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
        change = _relative_change(means, self.reference, weights)
        if dist.is_available() and dist.is_initialized():
            device = denominators[0].device if denominators else torch.device("cpu")
            agreed = torch.tensor([change], dtype=torch.float64, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.process_group)
            change = float(agreed.item())
        self.reference = means
        self.last_change = change
        self.stable_windows = self.stable_windows + 1 if change < config.tolerance else 0
        stable = step >= config.min_step and self.stable_windows >= config.patience
        return stable or (config.max_step is not None and step >= config.max_step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "reference": None if self.reference is None else self.reference.clone(),
            "stable_windows": self.stable_windows,
            "last_change": self.last_change,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        reference = state["reference"]
        self.reference = None if reference is None else reference.clone()
        self.stable_windows = state["stable_windows"]
        self.last_change = state["last_change"]


def _layer_norms(tensors: list[Tensor], ord: float) -> Tensor:
    return layer_norms(tensors, ord).cpu()


def _relative_change(now: Tensor, before: Tensor | None, weights: Tensor) -> float:
    """``Σ_l w_l·|now_l - before_l| / before_l``; layers that stay exactly put count 0."""
    if before is None:
        return math.inf
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
    ) -> None:
        self.freeze_step: int | None
        self.auto_freeze: AutoFreeze | None
        self.monitor: VarianceMonitor | None = None
        if freeze_step == "auto":
            self.freeze_step = None
            self.auto_freeze = AutoFreeze() if auto_freeze is None else auto_freeze
            if not isinstance(self.auto_freeze, AutoFreeze):
                raise ValueError(f"auto_freeze must be an AutoFreeze, got {auto_freeze!r}")
            self.monitor = VarianceMonitor(self.auto_freeze, process_group=process_group)
        else:
            if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
                raise ValueError(f'freeze_step must be an int >= 1 or "auto", got {freeze_step!r}')
            if auto_freeze is not None:
                raise ValueError('auto_freeze needs freeze_step="auto"')
            self.freeze_step = freeze_step
            self.auto_freeze = None

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
