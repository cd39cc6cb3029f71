"""Optimizer checkpoints: what a onebit state dict holds, and how it is checked and loaded.

A onebit optimizer's state dict is torch's (``state``, ``param_groups``) plus an ``"onebit"``
entry: the optimizer's name, world size and bucket layout, its counters and freeze schedule,
what each :class:`StatePart` saves, and under ``"ranks"`` each rank's own part (the error
buffers above all), keyed by rank. :class:`Checkpointed` gives the optimizer torch's face
(``state_dict``, ``load_state_dict``) and ZeroRedundancyOptimizer's consolidation; the pieces of
its state that save themselves are parts, each filling the :class:`StatePart` protocol, and this
module holds the checks and the steps of a load that do not depend on which optimizer it is.

Every state dict a release saved must still load: ``tests/checkpoints/`` holds one of each
optimizer in each stage, and a test loads them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ..state.flat_state import FlatState
from ..transport.agreement import digest
from ..transport.sharding import Replicated, local_tensor
from ..wire.momentum import PackedMomentumStage
from ..wire.protocol import Communicator

SHARDED_NAMES = {"frozen_denom": "exp_avg_sq"}
"""State that a sharded optimizer saves under its warmup name, so that
``torch.distributed.checkpoint``'s template (taken before the freeze) has a place for it."""

LEGACY_RANK_KEYS = ("comms", "local_skipped_steps")
"""What onebit 0.1.0 saved of one rank's state at the top of ``"onebit"``, without a rank."""


class StatePart(Protocol):
    """One piece of an optimizer's state that saves and loads itself (a stage's counters, the
    packed momentum, the error buffers): what :meth:`CompressedOptimizer.state_dict` and
    ``load_state_dict`` ask of it, in the order the optimizer lists its parts."""

    def extra_state(self) -> dict[str, Any]:
        """What it saves that is the same on every rank (into ``state_dict()["onebit"]``)."""
        ...

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`extra_state` saved (``state`` holds every part's)."""
        ...

    def rank_state(self) -> dict[str, Any]:
        """What it saves that differs between ranks (into this rank's ``"ranks"`` entry)."""
        ...

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`rank_state` saved; ``ValueError`` if it cannot."""
        ...

    def before_load(self, saved: dict[str, Any]) -> Callable[[], None]:
        """Before the per-parameter buffers are checked and copied: put them into the shape
        ``saved`` (the ``"onebit"`` entry) was saved in, or raise ``ValueError`` if it cannot
        be loaded at all; return what undoes this if the load fails."""
        ...

    def saving(self) -> contextlib.AbstractContextManager[None]:
        """A context within which the per-parameter buffers in ``optimizer.state`` show what a
        state dict saves (the packed momentum shows unpacked)."""
        ...


def _nothing() -> None:
    pass


class NoState:
    """A :class:`StatePart` that saves nothing: a part derives from it and fills in what it
    has."""

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def rank_state(self) -> dict[str, Any]:
        return {}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        pass

    def before_load(self, saved: dict[str, Any]) -> Callable[[], None]:
        return _nothing

    def saving(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class Frozen(NoState):
    """Which stage the state is in (``"frozen"``: past the warmup), saved so that a load
    renames the buffers before it copies them (``set_frozen`` names each stage's)."""

    def __init__(self, frozen: bool, set_frozen: Callable[[bool], None]) -> None:
        self.frozen, self.set_frozen = frozen, set_frozen

    def extra_state(self) -> dict[str, Any]:
        return {"frozen": self.frozen}

    def before_load(self, saved: dict[str, Any]) -> Callable[[], None]:
        self.set_frozen(bool(saved.get("frozen", False)))  # onebit 0.1.0: a warmup state
        return lambda: self.set_frozen(self.frozen)


class ErrorBuffers(NoState):
    """The communicators' error-feedback buffers, each rank's own: the 1-bit ones
    (``comms``) and those of a quantized warmup (``warmup_comms``).

    Args:
        comms, warmup_comms: one communicator per bucket.
        error_dtype: what the buffers are kept in; buffers saved in another dtype are converted,
            with a warning.
        owner: the optimizer's name, for that warning.
    """

    def __init__(
        self,
        comms: Sequence[Communicator],
        warmup_comms: Sequence[Communicator],
        error_dtype: torch.dtype,
        owner: str,
    ) -> None:
        self.comms, self.warmup_comms = list(comms), list(warmup_comms)
        self.error_dtype, self.owner = error_dtype, owner

    def rank_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"comms": [c.state_dict() for c in self.comms]}
        if self.warmup_comms:
            state["warmup_comms"] = [c.state_dict() for c in self.warmup_comms]
        return state

    def load_rank_state(self, state: dict[str, Any]) -> None:
        comms = state["comms"]
        if len(comms) != len(self.comms):
            raise ValueError(f"{len(comms)} buckets saved, {len(self.comms)} here")
        saved_dtypes = {s["worker_error"].dtype for s in comms if s["worker_error"] is not None}
        if saved_dtypes - {self.error_dtype}:
            warnings.warn(
                f"error buffers saved in {', '.join(sorted(map(str, saved_dtypes)))} load into "
                f"{self.owner}(error_dtype={self.error_dtype}): they are converted"
                + (" (rounded to bf16)" if self.error_dtype == torch.bfloat16 else ""),
                stacklevel=3,
            )
        for comm, saved in zip(self.comms, comms):
            comm.load_state_dict(saved)
        for comm, saved in zip(self.warmup_comms, state.get("warmup_comms", [])):
            comm.load_state_dict(saved)

    def reset(self) -> None:
        """Zero every buffer: where this rank's saved part is missing or does not fit."""
        for comm in self.comms + self.warmup_comms:
            comm.reset()


class PackedMomentum(NoState):
    """The packed momentum of 1-bit Adam or LAMB (:mod:`onebit.wire.momentum`): saved as the fp32
    ``exp_avg`` it stands for (exactly: each element is ``±σ`` of its piece), and packed again
    at load if it was saved packed.

    Args:
        stage: the optimizer's packed momentum.
        flat: the optimizer's flat state, where ``exp_avg`` shows while the momentum is fp32.
    """

    def __init__(self, stage: PackedMomentumStage, flat: FlatState) -> None:
        self.stage, self.flat = stage, flat

    def extra_state(self) -> dict[str, Any]:
        return {"packed_momentum": self.stage.packed is not None}

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        if self.stage.packed is None:
            yield
            return
        self.flat.expose("exp_avg", self.stage.materialize())
        try:
            yield
        finally:
            self.flat.expose("exp_avg", None)

    def before_load(self, saved: dict[str, Any]) -> Callable[[], None]:
        """The momentum loads as fp32 into ``exp_avg``, the errors apart from it."""
        packed, undo = self.stage.packed, self.stage.detach()
        self.flat.expose("exp_avg", self.stage.momentum)

        def undo_all() -> None:
            undo()
            if packed is not None:
                self.flat.expose("exp_avg", None)

        return undo_all

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.stage.reload(bool(state.get("packed_momentum", False)))
        if self.stage.packed is not None:
            self.flat.expose("exp_avg", None)


@contextlib.contextmanager
def saving(parts: Sequence[StatePart]) -> Iterator[None]:
    """Within the block, every part's :meth:`~StatePart.saving`."""
    with contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(part.saving())
        yield


def extra_state(parts: Sequence[StatePart]) -> dict[str, Any]:
    """Every part's :meth:`~StatePart.extra_state`, in one dict."""
    return {k: v for part in parts for k, v in part.extra_state().items()}


def rank_state(parts: Sequence[StatePart]) -> dict[str, Any]:
    """Every part's :meth:`~StatePart.rank_state`, in one dict: this rank's entry."""
    return {k: v for part in parts for k, v in part.rank_state().items()}


def before_load(parts: Sequence[StatePart], saved: dict[str, Any]) -> Callable[[], None]:
    """Each part's :meth:`~StatePart.before_load` in order; returns what undoes them all, in
    the same order: an undo puts back what its part held, and a later part's may build on
    it (the stage's name, :class:`Frozen`, names the buffers a stage put back). If one raises,
    those before it are undone first."""
    undos: list[Callable[[], None]] = []

    def undo() -> None:
        for step in undos:
            step()

    try:
        for part in parts:
            undos.append(part.before_load(saved))
    except ValueError:
        undo()
        raise
    return undo


def onebit_entry(state_dict: Any, name: str) -> dict[str, Any]:
    """The ``"onebit"`` entry of ``state_dict``, which optimizer ``name`` is to load;
    ``ValueError`` if there is none or another optimizer saved it."""
    saved = state_dict.get("onebit") if isinstance(state_dict, dict) else None
    if saved is None:
        raise ValueError(
            f"not a onebit state dict: {name} can only load what a {name} saved, with its "
            "'onebit' part (error buffers, counters, freeze schedule). A torch.optim state, "
            "say from AdamW, has none, and loaders that keep only 'state' and "
            "'param_groups' drop it (torch.distributed.checkpoint's "
            "set_optimizer_state_dict, a framework's FSDP checkpoint): save and load with "
            "onebit.fsdp.save and load, or through onebit.integrations"
        )
    if saved.get("optimizer", name) != name:
        raise ValueError(f"state dict of {saved['optimizer']} loaded into {name}")
    return saved


def parameter_index(
    saved_groups: list[dict[str, Any]], groups: list[dict[str, Any]]
) -> dict[int, Tensor]:
    """Each saved parameter index's parameter in ``groups``; ``ValueError`` if the groups or
    their sizes differ."""
    if len(saved_groups) != len(groups) or any(
        len(saved["params"]) != len(g["params"]) for saved, g in zip(saved_groups, groups)
    ):
        raise ValueError("loaded state dict has a different number of params or param groups")
    return {
        i: p for saved, g in zip(saved_groups, groups) for i, p in zip(saved["params"], g["params"])
    }


def saved_name(saved: dict[str, Any], key: str) -> str:
    """The name the state ``key`` has in ``saved``, a parameter's state in a state dict."""
    return key if key in saved else SHARDED_NAMES.get(key, key)


def check_buffers(
    state: dict[Tensor, dict[str, Tensor]], index: dict[int, Tensor], saved: dict[int, Any]
) -> None:
    """``ValueError`` unless every buffer in ``state`` has its saved value, of its shape."""
    for i, saved_state in saved.items():
        for key, buffer in state[index[i]].items():
            name = saved_name(saved_state, key)
            if name not in saved_state or buffer.shape != local_tensor(saved_state[name]).shape:
                got = tuple(saved_state[name].shape) if name in saved_state else "nothing"
                raise ValueError(
                    f"state {key!r} of parameter {i}: saved {got}, expected {tuple(buffer.shape)}"
                )


def copy_buffers(
    state: dict[Tensor, dict[str, Tensor]], index: dict[int, Tensor], saved: dict[int, Any]
) -> None:
    """Copy each saved buffer into ``state``'s (checked by :func:`check_buffers`)."""
    for i, saved_state in saved.items():
        for key, buffer in state[index[i]].items():
            buffer.copy_(local_tensor(saved_state[saved_name(saved_state, key)]))


def sharded(state: dict[int, dict[str, Any]], shards: Replicated) -> dict[int, dict[str, Any]]:
    """A sharded optimizer's per-parameter ``state`` as DTensors, for
    ``torch.distributed.checkpoint``, under the warmup's names (:data:`SHARDED_NAMES`)."""
    return {
        i: {
            SHARDED_NAMES.get(k, k): shards.wrap(i, v) if torch.is_tensor(v) else v
            for k, v in s.items()
        }
        for i, s in state.items()
    }


def split_ranks(saved: dict[str, Any], part: int, layout: str) -> tuple[dict[str, Any], dict]:
    """Split a saved ``"onebit"`` entry into what every rank loads and the ranks' own entries
    (``"ranks"``, by rank); ``part`` and ``layout`` (the digest of the bucket layout) stand in
    for what onebit 0.1.0 did not save."""
    extra = dict(saved)
    ranks = extra.pop("ranks", None)
    if ranks is None:  # onebit 0.1.0 saved one rank's state without naming the rank
        ranks = {part: {k: extra.pop(k) for k in LEGACY_RANK_KEYS if k in extra}}
        extra.setdefault("layout", layout)
    return extra, ranks


def own_rank_state(
    extra: dict[str, Any], ranks: dict[int, Any], part: int, layout: str
) -> dict[str, Any]:
    """Rank ``part``'s entry of ``ranks``; ``ValueError`` if it is missing, or was saved with
    another ``layout`` or world size (``extra["layout"]``)."""
    own = ranks.get(part)
    if own is None:
        raise ValueError(
            f"the state holds rank(s) {sorted(ranks)}, this is rank {part}; save "
            "with consolidated_state_dict() or one file per rank"
        )
    if extra.get("layout") != layout:
        raise ValueError("saved with another bucket layout or world size")
    return own


def inexact_resume_error(problems: dict[int, str]) -> str:
    """The error of a load that cannot resume exactly: ``problems``, by rank, says why."""
    why = "; ".join(f"rank {r}: {p}" for r, p in sorted(problems.items()))
    return (
        f"this state dict cannot resume every rank exactly ({why}). Each rank's error-feedback "
        "buffers are its own: save consolidated_state_dict() (a collective: call it on every "
        "rank, outside the rank-0 block, and save what rank 0 gets) or one state_dict() file "
        "per rank. To resume anyway, with those ranks' error buffers restarted at zero, pass "
        "load_state_dict(..., allow_inexact=True)"
    )


def gather_rank_states(
    state: dict[str, Any], to: int, rank: int, world_size: int, group: dist.ProcessGroup | None
) -> dict[int, Any] | None:
    """Every rank's ``state`` (its :func:`rank_state`), by rank in ``group``, on rank ``to``;
    ``None`` on the others. A collective."""
    parts: list[Any] | None = [None] * world_size if rank == to else None
    dst = dist.get_global_rank(group, to) if group else to
    dist.gather_object(to_cpu(state), parts, dst=dst, group=group)
    return None if parts is None else dict(enumerate(parts))


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists and tuples) copied to the CPU."""
    if torch.is_tensor(value):
        return value.cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


class Checkpointed:
    """The checkpoint face of :class:`~onebit.optim.base.CompressedOptimizer`: ``state_dict``,
    ``load_state_dict`` and the consolidation of every rank's part, built from the optimizer's
    :class:`StatePart` s (its error buffers, its stages' own part from :meth:`_stage_state`,
    which stage the buffers are named for, and the packed momentum)."""

    frozen = False
    """Whether the state is the frozen stage's (past the warmup), as :meth:`set_frozen` named
    it."""

    def set_frozen(self, frozen: bool) -> None:
        """Name the state in ``state`` for the stages before the freeze or, ``frozen``, after it
        (the base's, through its stages)."""
        raise NotImplementedError

    def _stage_state(self) -> StatePart:
        """The subclass's own :class:`~onebit.optim.checkpoint.StatePart`: its stages' counters and
        state that is not per parameter."""
        return NoState()

    def _state_parts(self) -> list[StatePart]:
        """The parts of the state that save and load themselves, in the order they load: the
        error buffers, the subclass's stages, which stage the buffers are named for, and the
        packed momentum."""
        errors = ErrorBuffers(self.comms, self.warmup_comms, self.error_dtype, type(self).__name__)
        parts = [errors, self._stage_state(), Frozen(self.frozen, self.set_frozen)]
        if self.packed_momentum is not None:
            parts.append(PackedMomentum(self.packed_momentum, self.flat))
        return parts

    def _layout_digest(self) -> str:
        layout = (self.layout.buckets, self.layout.numels, self.world_size)
        return digest((*layout, self.shards.settings()) if self.shards.sharded else layout)

    @property
    def _part(self) -> int:
        """Where this rank's part of the state sits in ``["onebit"]["ranks"]``: its rank in the
        group, or in the world where parameters are sharded (every rank's part differs)."""
        return self.rank if not self.shards.sharded else dist.get_rank()

    def state_dict(self) -> dict[str, Any]:
        """This rank's whole state: per-parameter buffers, error buffers, schedules, counters.

        What differs between ranks (the error buffers above all) sits under
        ``["onebit"]["ranks"][rank]``: save one file per rank, or gather every rank's part into
        one dict with :meth:`consolidated_state_dict` (or :meth:`consolidate_state_dict`, then
        this). ``torch.load(weights_only=True)`` loads it. A sharded optimizer's per-parameter
        state is DTensors, for ``torch.distributed.checkpoint``, and keeps the warmup's names
        through the freeze (``exp_avg_sq`` then holds ``frozen_denom``).
        """
        self._follow_param_groups_or_raise("save")
        parts = self._state_parts()
        with saving(parts):
            state = super().state_dict()
            state["state"] = {i: dict(s) for i, s in state["state"].items()}  # not self.state's
        if self.shards.sharded:
            state["state"] = sharded(state["state"], self.shards)
        ranks = {self._part: rank_state(parts)}
        if self._gathered is not None and self._gathered[0] == self._calls:
            ranks = self._gathered[1]
        state["onebit"] = {
            "optimizer": type(self).__name__,
            "world_size": self.world_size,
            "layout": self._layout_digest(),
            "warmup_compression": self.warmup_compression,
            "num_steps": self.num_steps,
            "skipped_steps": self.skipped_steps,
            "calls": self._calls,
            "backward_passes": self.bucketer.backward_passes,
            "comm_stats": self.comm_stats.state_dict(),
            **self.freeze.state_dict(),
            **extra_state(parts),
            "ranks": ranks,
        }
        return state

    def _take_saved_warmup(self, saved: dict[str, Any]) -> Callable[[], None]:
        """Go on with the warmup compression the state was saved with where the constructor
        was not given one: a run saved while the default was ``"fp32"`` resumes as it ran.
        Returns what undoes it."""
        quantized = any("warmup_comms" in r for r in [saved, *(saved.get("ranks") or {}).values()])
        mode = saved.get("warmup_compression", None if quantized else "fp32")
        options = self._constructor_options
        if mode is None or mode == self.warmup_compression or "warmup_compression" in options:
            return _nothing
        before, previous = self.state_dict(), self.warmup_compression

        def undo() -> None:
            self.warmup_compression = previous
            del options["warmup_compression"]
            self._lay_out_anew(self.shards, self.layout, saved=before)

        self.warmup_compression = options["warmup_compression"] = mode
        self._lay_out_anew(self.shards, self.layout, saved=None)
        return undo

    def _problems_of_every_rank(self, problem: str | None) -> dict[int, str]:
        """What keeps each rank's load from being exact (``problem``, this rank's), by rank,
        on every rank: a collective where the optimizer spans several ranks."""
        if not dist.is_initialized() or self._agreement_size() == 1:
            return {} if problem is None else {self._part: problem}
        group = self._agreement_group()
        device = self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        anyone = torch.tensor([float(problem is not None)], device=device)
        dist.all_reduce(anyone, op=dist.ReduceOp.MAX, group=group)
        if not anyone.item():
            return {}
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, problem, group=group)
        return {r: p for r, p in enumerate(gathered) if p is not None}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's part of the state on rank ``to``, for its next :meth:`state_dict`.

        A collective: call it on every rank. Until the next ``step()``, ``state_dict()`` on rank
        ``to`` then holds every rank's part, so one file saved from there resumes exactly on
        every rank. This is ``ZeroRedundancyOptimizer``'s protocol, which Lightning's and
        Fabric's checkpointing call on every rank before saving from rank 0.
        """
        if not isinstance(to, int) or not 0 <= to < self.world_size:
            raise ValueError(f"to must be a rank in [0, {self.world_size}), got {to!r}")
        if self.shards.sharded:
            raise ValueError(
                "a sharded optimizer's state is saved with torch.distributed.checkpoint, every "
                "rank its own part: see onebit.fsdp.save"
            )
        self._gathered = None
        if self.world_size == 1:
            return
        mine = rank_state(self._state_parts())
        parts = gather_rank_states(mine, to, self.rank, self.world_size, self.process_group)
        if parts is not None:
            self._gathered = (self._calls, parts)

    def consolidated_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """Every rank's state in one dict on rank ``to`` (``None`` on the others).

        A collective: call it on every rank. Where one optimizer file is saved from rank 0 and
        loaded on every rank (as HF Trainer, Accelerate and Lightning do with ``state_dict()``),
        save this instead and the run resumes exactly: :meth:`load_state_dict` takes each
        rank's own part.
        """
        self.consolidate_state_dict(to)
        return self.state_dict() if self.rank == to else None

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_inexact: bool = False) -> None:
        """Restore a :meth:`state_dict` or :meth:`consolidated_state_dict`, keeping every buffer
        fp32 and flat, so that the run goes on bit for bit.

        This rank's part (its error buffers) is taken from the dict. If the dict has no part for
        some rank (``state_dict()`` saved on rank 0 only and loaded everywhere), or it was saved
        with another world size or bucket layout, the resume cannot be exact: every rank raises
        ``ValueError``, naming the fix, and nothing changes. With ``allow_inexact`` those ranks
        instead restart their error buffers at zero, with a warning, and everything else is
        restored. A collective where the optimizer spans several ranks: call it on every rank.
        A state of another optimizer raises ``ValueError`` and changes nothing.
        """
        self._load_state(state_dict, agree=True, allow_inexact=allow_inexact)

    def _load_state(
        self, state_dict: dict[str, Any], agree: bool = False, allow_inexact: bool = True
    ) -> None:
        """:meth:`load_state_dict`; without ``agree``, this rank alone (the optimizer reloading
        its own state after a move), restarting its error buffers where they do not fit."""
        self._follow_param_groups_or_raise("load")
        self._follow_parameters()
        saved = onebit_entry(state_dict, type(self).__name__)
        groups = state_dict["param_groups"]
        index = parameter_index(groups, self.param_groups)
        extra, ranks = split_ranks(saved, self._part, self._layout_digest())
        try:
            own = own_rank_state(extra, ranks, self._part, self._layout_digest())
            problem = None
        except ValueError as err:
            own, problem = None, str(err)
        problems = self._problems_of_every_rank(problem) if agree else {}
        if problems and not allow_inexact:
            raise ValueError(inexact_resume_error(problems))
        self._gathered = None
        undo_warmup = self._take_saved_warmup(saved)
        parts = self._state_parts()
        undo = before_load(parts, saved)
        try:
            check_buffers(self.state, index, state_dict["state"])
        except ValueError:
            undo()
            undo_warmup()
            raise
        copy_buffers(self.state, index, state_dict["state"])
        for saved_group, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        try:
            if own is None:
                raise ValueError(problem)
            for part in parts:
                part.load_rank_state(own)
        except ValueError as err:
            warnings.warn(
                f"error-feedback buffers reset ({err}); resume is not exact", stacklevel=2
            )
            parts[0].reset()
        self.num_steps = extra.pop("num_steps")
        self.skipped_steps = extra.pop("skipped_steps")
        self._calls = extra.pop("calls", self.num_steps + self.skipped_steps)
        self.bucketer.backward_passes = extra.pop("backward_passes", 0)
        self.comm_stats.load_state_dict(extra.pop("comm_stats"))
        self.freeze.load_state_dict(extra)
        self.comm_stats.freeze_step = self.freeze.freeze_step
        for key in ("optimizer", "world_size", "layout", "warmup_compression", "freeze_step",
                    "auto_freeze"):  # fmt: skip
            extra.pop(key, None)
        for part in parts:
            part.load_extra_state(extra)
        if self.packed_momentum is not None and self.frozen:
            self.bucketer.release()  # the .grad views keep theirs; the packed stage needs none
        if self.frozen:
            self.engine.end_warmup()  # the warmup's error buffers: zeros, and not needed now
        self._push_next_sender()
