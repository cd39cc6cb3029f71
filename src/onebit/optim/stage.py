"""A stage of a onebit optimizer's run, as an object: the state it shows and the step it takes.

An optimizer's run goes through stages: 1-bit Adam's and 1-bit LAMB's warmup, then their
compression steps; 0/1 Adam's variance and 1-bit gradient steps, then its local and sync steps.
Each is a :class:`Stage`. The optimizer declares its stages (``_stage_types``) and says which
one each step runs (``stage``); the step template of
:class:`~onebit.optim.base.CompressedOptimizer` runs that stage's :meth:`Stage.step` and ends
the step with what it returns. The stages on either side of the freeze name the optimizer's
buffers as ``optimizer.state`` shows them there (:attr:`Stage.shows`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from ..state.flat_state import FlatState
from ..transport.engine import Sender


class Taken(NamedTuple):
    """What one step of a stage did."""

    applied: bool
    """Whether every rank applied it (if not, every rank skipped it and changed nothing)."""
    nbytes: int
    """The bytes this rank sent."""
    round_skipped: bool = False
    """Whether it skipped its communication round (0/1 Adam's local steps)."""


class Stage:
    """One stage of an optimizer: its name, the buffers it shows, and the update of its step.

    A stage holds the optimizer it is a stage of, and works on that optimizer's buffers and
    :attr:`~onebit.optim.base.CompressedOptimizer.engine`. It is made once, at construction,
    so what it keeps between steps (uploaded tables, scratch buffers) lives as long as the
    optimizer.

    Attributes:
        name: what ``optimizer.stage`` says while it runs, and what ``comm_stats`` books its
            bytes under.
        frozen: whether it runs after the freeze. The stages on one side of it show the same
            buffers; a checkpoint saves which side the state is on.
        shows: what ``optimizer.state`` shows per parameter while it runs: each name, and
            the optimizer's attribute that holds its flat buffer (``None`` there: not shown),
            in the order shown.
    """

    name: str = ""
    frozen: bool = False
    shows: dict[str, str] = {}

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def enter(self) -> None:
        """Get the optimizer's state ready for the stages on this side of the freeze, before
        what it :attr:`shows` is read (at construction, at the freeze, and when a checkpoint is
        loaded)."""

    def sends(self) -> Sender | None:
        """What sends a step of this stage bucket by bucket if it can start during backward
        (``overlap_backward``): the engine's :meth:`~onebit.transport.engine.Engine.sender` of
        the wire format it sends in; ``None`` if it cannot."""
        return None

    def step(self, t: int) -> Taken:
        """Take step ``t`` (1-based) of the optimizer, whose step is open: exchange what the
        stage sends through the engine and apply its update where every rank may."""
        raise NotImplementedError


def show_side(stages: Iterable[Stage], frozen: bool, flat: FlatState) -> None:
    """Name an optimizer's state for its stages after the freeze (``frozen``) or before it: the
    first of ``stages`` on that side gets the state ready (:meth:`Stage.enter`), then ``flat``
    shows what it :attr:`~Stage.shows`, and none of what the others show."""
    stages = list(stages)
    first = next(s for s in stages if s.frozen == frozen)
    first.enter()
    for name in {name for other in stages for name in other.shows} - first.shows.keys():
        flat.expose(name, None)
    for name, attribute in first.shows.items():
        flat.expose(name, getattr(first.optimizer, attribute))
