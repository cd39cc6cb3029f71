"""Plumbing shared by the 1-bit optimizers: checks, flat state, the step template and torch's
face (``state_dict``; what a state dict holds is :mod:`onebit.checkpoint`'s). When buckets are
gathered and launched is the :class:`~onebit.bucketer.Bucketer`'s job; what a step sends and
its verdict, the :class:`~onebit.engine.Engine`'s; what each message's header carries,
:mod:`onebit.header`'s; that all ranks built the same optimizer, :mod:`onebit.agreement`'s.

Subclasses implement the update rule in ``step`` and keep their math in
:mod:`onebit.functional` and :mod:`onebit.adam_step`; everything that touches
``torch.distributed`` lives here or below.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import checkpoint, kernels, rehearsal
from .agreement import broadcast_from_first_rank, check_ranks_agree, digest
from .bucketer import Bucketer
from .checkpoint import StatePart
from .clipping import Clipping
from .comm import CompressedAllreduce
from .engine import ALLREDUCE, QUANTIZED, Engine, Prepare
from .flat_state import FlatState
from .freeze import FreezeSchedule, VarianceMonitor
from .header import HEADER_NUMEL, OpenStep, gradient_factor
from .kernels.errors import check_error_dtype
from .kernels.fused import DTYPES
from .layout import FlatLayout
from .momentum import PackedMomentumStage, fused_parameters, unpacked_because
from .quantized import QuantizedAllreduce
from .sharding import Replicated, has_dtensors, shards_of
from .stats import CommStats
from .wire import group_size_and_rank

DEFAULT_BUCKET_SIZE = 2**22
"""Elements per compressed bucket (16 MiB of fp32). Smaller buckets overlap better, larger ones
send fewer messages."""

MAX_BUCKET_SIZE = 2**30
"""The largest ``bucket_size`` (4 GiB of fp32): the GPU kernels index a bucket with 32 bits."""

WARMUP_COMPRESSION = ("fp32", "bf16", "int8", "int4")
"""How the warmup averages gradients: ``"fp32"`` (default) is an fp32 allreduce, exactly DDP;
the others go through :class:`~onebit.quantized.QuantizedAllreduce` with error feedback."""

SCALE_PER = ("tensor", "bucket")
"""What gets its own 1-bit scale: ``"tensor"`` (default), each parameter's part of a bucket, so
that no tensor's magnitude sets another's step; ``"bucket"``, one scale per bucket as SPEC 2."""


def closes_step_on_error(step: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an optimizer's ``step`` so that an exception leaves nothing of the step behind: the
    step is closed, and ``grad_scale``/``found_inf`` that a ``GradScaler`` set (and would only
    have removed after a successful step) are dropped, so the next ``scaler.step`` starts clean.
    """

    @functools.wraps(step)
    def wrapper(self: CompressedOptimizer, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(self, *args, **kwargs)
        except BaseException:
            self._close_step()
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise

    return wrapper


def check_step_count(name: str, value: Any, minimum: int = 1) -> int:
    """Return ``value`` if it is an int ``>= minimum``, else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of the optimizers that own their gradient communication.

    At construction it checks that every rank has the same parameters and settings, broadcasts
    the parameters from rank 0, and lays the optimizer state out in flat fp32 buffers split into
    buckets, on the parameters' device. Each bucket has its own
    :class:`~onebit.comm.CompressedAllreduce`, whose error buffers are this rank's part of
    :meth:`state_dict`. Its :attr:`bucketer` gathers and launches the buckets.

    A subclass passes this constructor its argument checks, ``check``, which raises
    ``ValueError`` or returns the :class:`~onebit.freeze.FreezeSchedule` that ends its warmup
    (run here, so that a problem raises on every rank, not one), and ``prepare`` where a 1-bit
    message is not the gradient itself. It makes its buffers in :meth:`_allocate_state`, names
    them for each stage in :meth:`_set_frozen`, takes each step's update in :meth:`_take_step`,
    which :meth:`step` calls once the step is open, and says in :meth:`_next_kind` what the next
    step sends if that can start during backward.

    The state follows the parameters: if they have moved when a step (or :meth:`load_state_dict`)
    starts, as when HF Trainer or Accelerate move the model to the GPU after the optimizer was
    built, it is made anew on their device first (:meth:`_follow_parameters`). Like
    ``torch.optim``'s optimizers it steps the parameters ``param_groups`` holds at each step: if
    they were replaced (a copy of the model; FSDP2's shards, put there by Accelerate or HF
    Trainer), it lays its state out anew on them, or every rank raises where it cannot
    (:meth:`_follow_param_groups`).

    It follows torch's protocol for optimizers that handle loss scaling themselves
    (``_step_supports_amp_scaling``): under ``torch.amp.GradScaler`` each step reads
    ``grad_scale`` and unscales while copying the gradients into its own buffer, and every rank
    takes part in every step's collectives whatever its local ``found_inf``; a non-finite value
    on any rank makes every rank skip the step.

    Each subclass says what its steps read from the param groups (:meth:`_step_hyperparameters`,
    :attr:`_group_keys`), and its warmup steps average the gradients at full precision
    (:meth:`_average_gradients`).

    Attributes:
        backend: the kernels its steps run on the parameters' device (``"triton"`` on CUDA,
            ``"c"`` on the CPU; ``"numpy"`` or ``"torch"`` where those cannot run, with a
            warning; see :mod:`onebit.kernels`).
        bucketer: the :class:`~onebit.bucketer.Bucketer` of the gradient buckets.
        flat: the :class:`~onebit.flat_state.FlatState` that shows the flat buffers per
            parameter in ``state``.
        freeze: the :class:`~onebit.freeze.FreezeSchedule`; ``freeze_step`` and
            ``in_warmup`` read it.
        comm_stats: :class:`~onebit.stats.CommStats`, bytes sent per step and in total.
        skipped_steps: steps skipped on every rank because some rank had a non-finite gradient.
        grad_norm: the gradient norm the last step's ``max_grad_norm`` clipping used (``None``
            without clipping): the averaged gradient's in full-precision steps, the rank's own
            in 1-bit and local steps, the mean of the ranks' under ``overlap_backward``.
    """

    _step_supports_amp_scaling = True

    _keeps_gradient_buffer = False
    """Whether the subclass keeps data in the bucketer's gradient buffer from one step to the
    next (0/1 Adam its sync parameters). If not, a sharded optimizer frees the buffer after each
    step: FSDP2 owns the gradients, and between steps the buffer would be one more copy."""

    _compiles_ahead = True
    """Whether the first warmup step compiles the kernels of the stage to come (not in the
    rehearsal's own copy)."""

    _rehearsal_options: dict[str, Any] = {}
    """What :func:`~onebit.rehearsal.rehearse` changes in the keyword arguments of its copy, so
    that the copy goes through every kind of step within its few steps."""

    def __new__(cls, *args: Any, **kwargs: Any) -> CompressedOptimizer:
        self = super().__new__(cls)
        # For rehearsal.rehearse's copy; not the masks, which it makes anew (they would be kept).
        self._constructor_options = {k: v for k, v in kwargs.items() if k != "exp_avg_mask"}
        return self

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        process_group: dist.ProcessGroup | None,
        bucket_size: int,
        check: Callable[[], FreezeSchedule],
        bias_correction: bool = True,
        max_grad_norm: float | None = None,
        exp_avg_mask: Mapping[Tensor, Tensor] | None = None,
        overlap_backward: bool = False,
        scale_per: str = "tensor",
        warmup_compression: str = "fp32",
        error_dtype: torch.dtype = torch.float32,
        prepare: Prepare | None = None,
    ) -> None:
        super().__init__(params, defaults)
        self.bias_correction = bias_correction
        self.scale_per = scale_per
        self.warmup_compression = warmup_compression
        self.error_dtype = error_dtype
        self.process_group = process_group
        self.world_size, self.rank = group_size_and_rank(process_group)
        self.overlap_backward = bool(overlap_backward)
        params = [p for g in self.param_groups for p in g["params"]]
        sharded = has_dtensors(params)
        self.shards = Replicated([])  # _adopt's, once the parameters are checked
        problem = None
        try:
            self.freeze = check()
            self._check_arguments(bucket_size, max_grad_norm)
            self._adopt(*self._laid_out(params, bucket_size, masked=bool(exp_avg_mask)))
            self._masks = _check_masks(exp_avg_mask or {}, self.layout)
        except ValueError as err:
            if self.world_size == 1 and not sharded:
                raise
            problem = str(err)  # raised on every rank below, not here alone
        self._agree(self._settings() if problem is None else problem, sharded)
        self._build_on_device()
        self._step: OpenStep | None = None
        self._replace_problem: str | None = None
        self._prepare = prepare
        self.bucketer = self._new_bucketer()
        self.engine = self._new_engine()
        self.comm_stats = CommStats()
        self.comm_stats.freeze_step = self.freeze.freeze_step
        self.skipped_steps = 0
        self.num_steps = 0
        self._calls = 0
        self._gathered: tuple[int, dict[int, Any]] | None = None  # consolidate_state_dict()
        self._hyper = self._step_hyperparameters(self.param_groups)[0]  # each step reads anew
        self._allocate_state()
        self._push_next_sender()

    # Where the state lives: on the parameters' device, following them when they move.

    def _build_on_device(self) -> None:
        """Make the communicators, the flat state and the masks on :attr:`device` (the
        subclass's buffers are :meth:`_allocate_state`'s)."""
        device, group = self.device, self.process_group
        self.backend = kernels.for_device(device).name
        buckets = list(enumerate(self.layout.buckets))
        self.comms = [
            CompressedAllreduce(
                end - start,
                group=group,
                device=device,
                segments=self.layout.segments(k) if self.scale_per == "tensor" else None,
                header_numel=HEADER_NUMEL,
                error_dtype=self.error_dtype,
            )
            for k, (start, end) in buckets
        ]
        self.warmup_comms: list[QuantizedAllreduce] = []
        if self.warmup_compression != "fp32":
            self.warmup_comms = [
                QuantizedAllreduce(
                    end - start,
                    segments=self.layout.segments(k),
                    bits=self.warmup_compression,
                    group=group,
                    device=device,
                    header_numel=HEADER_NUMEL,
                )
                for k, (start, end) in buckets
            ]
        self.flat = FlatState(self.layout, self.state, self.param_groups, device)
        self._masks = [(offset, mask.to(device)) for offset, mask in self._masks]

    def _allocate_state(self) -> None:
        """Make the subclass's flat buffers on :attr:`device`, as a new optimizer has them (run
        at construction, and again when the parameters move to another device)."""

    def _follow_parameters(self) -> bool:
        """Put the state on the parameters' device if they have moved since it was made (as
        when HF Trainer or Accelerate move the model after the optimizer was built), the way
        torch's optimizers make their state where the parameters are at the first step.

        The state goes over through :meth:`state_dict` and :meth:`load_state_dict`, so the
        optimizer continues bit for bit as one built on that device. Returns ``False``, moving
        nothing, if the parameters are on more than one device (the step then raises on every
        rank).
        """
        self.shards.refresh(self.layout.params)
        devices = {p.device for p in self.layout.params}
        if len(devices) > 1:
            return False
        (device,) = devices
        if device != self.device:
            self._move_state_to(device)
        return True

    def _move_state_to(self, device: torch.device) -> None:
        """Make the state anew on ``device`` as a new optimizer has it, then load what it held."""
        kernels.for_device(device)  # a bad ONEBIT_BACKEND for that device raises, changing nothing
        saved = self.state_dict()
        self.device = device
        self.state.clear()
        self._fused = None
        self._build_on_device()
        self.bucketer.place(device)
        self.engine = self._new_engine()
        self._allocate_state()
        self.load_state_dict(saved)

    def _check_arguments(self, bucket_size: int, max_grad_norm: float | None) -> None:
        """Check the settings that do not depend on the parameters."""
        check_step_count("bucket_size", bucket_size)
        if bucket_size > MAX_BUCKET_SIZE:
            raise ValueError(f"bucket_size must be at most 2**30, got {bucket_size}")
        if self.scale_per not in SCALE_PER:
            raise ValueError(f"scale_per must be one of {SCALE_PER}, got {self.scale_per!r}")
        check_error_dtype(self.error_dtype)
        if self.warmup_compression not in WARMUP_COMPRESSION:
            raise ValueError(
                f"warmup_compression must be one of {WARMUP_COMPRESSION}, "
                f"got {self.warmup_compression!r}"
            )
        if max_grad_norm is not None and not (
            isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf
        ):
            raise ValueError(f"max_grad_norm must be None or a number > 0, got {max_grad_norm!r}")
        self.clipping = Clipping(None if max_grad_norm is None else float(max_grad_norm))
        for key in ("betas", "eps"):
            values = {repr(g[key]) for g in self.param_groups}
            if len(values) > 1:
                raise ValueError(f"{key} must be the same in every param group, got {values}")

    def _laid_out(
        self, params: list[Tensor], bucket_size: int, masked: bool
    ) -> tuple[Replicated, FlatLayout]:
        """Check this rank's ``params`` (the param groups' parameters, in order); return their
        shards and the flat layout of the tensors the optimizer steps. Changes nothing."""
        if not params:
            raise ValueError(f"{type(self).__name__} got no parameters")
        shards = shards_of(params, self.process_group)
        local = shards.locals()
        _check_parameters(local)
        if shards.sharded:
            if self.overlap_backward:
                raise ValueError(
                    "overlap_backward with FSDP2: FSDP2 sends the gradients during backward "
                    "itself, and onebit averages them across replicas in step()"
                )
            if masked:
                raise ValueError("exp_avg_mask is not supported with FSDP2-sharded parameters")
        kernels.for_device(local[0].device)  # a bad ONEBIT_BACKEND raises here, on every rank
        return shards, FlatLayout(local, bucket_size, self.world_size, keys=params)

    def _adopt(self, shards: Replicated, layout: FlatLayout) -> None:
        """Step the tensors of ``layout`` from now on (the flat buffers are made apart)."""
        self.shards, self.layout, self.device = shards, layout, layout.params[0].device
        if self.freeze.monitor is not None:  # "auto" decides on whole layers, across shards
            self.freeze.monitor.numels = shards.numels()
            self.freeze.monitor.layer_norms = shards.layer_norms

    def _agree(self, settings: dict[str, Any] | str, sharded: bool) -> None:
        """Raise the same ``ValueError`` on every rank unless every rank laid out the same
        optimizer (``settings`` is a string where this rank's own checks failed), then give
        every rank rank 0's parameters. A collective."""
        if sharded:  # every rank of the mesh: the shards must agree with each other too
            per_shard = ("shapes", "dtypes", "shard")
            check_ranks_agree(settings, None, self.shards.rank, per_shard)
        elif self.world_size > 1:
            check_ranks_agree(settings, self.process_group)
        if self.world_size > 1:
            broadcast_from_first_rank(self.layout.params, self.process_group)

    def _new_bucketer(self, backward_passes: int = 0) -> Bucketer:
        bucketer = Bucketer(
            self.layout,
            self.process_group,
            HEADER_NUMEL,
            clip=self.max_grad_norm is not None and self.overlap_backward,
            overlap=self.overlap_backward,
        )
        bucketer.backward_passes = backward_passes
        return bucketer

    def _new_engine(self) -> Engine:
        return Engine(
            self.layout,
            self.bucketer,
            self.comms,
            self.warmup_comms,
            process_group=self.process_group,
            shards=self.shards,
            backend=self.backend,
            overlap=self.overlap_backward,
            clipping=self.clipping,
            prepare=self._prepare,
            open_step=functools.partial(self._begin_step, follow=False),
        )

    # Following param_groups: frameworks replace the parameters after the optimizer was built.

    def _on_param_groups(self) -> bool:
        """Whether the state is laid out on the parameters ``param_groups`` holds now."""
        keys, groups = self.layout.keys, [g["params"] for g in self.param_groups]
        if sum(map(len, groups)) != len(keys):
            return False
        return all(map(operator.is_, itertools.chain.from_iterable(groups), keys))

    def _follow_param_groups(self, when: str = "step") -> str | None:
        """Lay the state out anew on the parameters in ``param_groups`` if they are no longer
        those it was laid out on; return why it could not, else ``None``.

        ``torch.optim`` optimizers step whatever ``param_groups`` holds, and frameworks rely on
        it: Accelerate and HF Trainer put FSDP2's sharded parameters there, and a user may
        point them at a copy of the model. Replacements of the same shapes (a copy, or the same
        model on another device) keep the state, each parameter's going to the one in its place,
        and need no collective. Replacements laid out differently (sharded by FSDP2 after the
        optimizer was built) get a new state, checked across ranks as at construction; they
        can only come before the first step, when there is no state to lose. Where this fails,
        nothing changes, and the step raises on every rank (status 5).

        ``when`` says who calls: the first ``"step"`` is a collective on every rank (whether
        any rank lays out anew), so that ranks whose ``param_groups`` did not change join the
        agreement instead of waiting in the step; ``"load"`` (``load_state_dict``, called on
        every rank) agrees only where this rank lays out anew; ``"save"`` (``state_dict``, on
        one rank maybe) never communicates, and cannot follow a new layout.
        """
        self._replace_problem = None
        replaced = not self._on_param_groups()
        first_step = when == "step" and self._calls == 0 and self._agreement_size() > 1
        if not replaced and not first_step:
            return None
        new, problem = None, None
        if replaced:
            try:
                new = self._replacement([p for g in self.param_groups for p in g["params"]])
            except ValueError as err:
                problem = str(err)
        anew = new is not None and not new[2]
        if anew and when == "save":
            self._replace_problem = (
                "they are laid out differently (sharded, say): the state moves onto them at the "
                "next step() or load_state_dict(), which every rank calls"
            )
            return self._replace_problem
        if first_step:
            anew = self._any_rank(anew)
        try:
            if anew:
                self._agree_anew(new, problem)
            elif problem is not None:
                raise ValueError(problem)
            elif new is not None:
                self._lay_out_anew(*new[:2], saved=self._state_dict_of(self.layout.keys))
        except ValueError as err:
            self._replace_problem = str(err)
        return self._replace_problem

    def _follow_param_groups_or_raise(self, when: str) -> None:
        """:meth:`_follow_param_groups`, raising ``ValueError`` where it cannot."""
        problem = self._follow_param_groups(when)
        if problem is not None:
            raise ValueError(
                f"{type(self).__name__} cannot lay its state out on the parameters that "
                f"replaced those in param_groups: {problem}"
            )

    def _replacement(self, params: list[Tensor]) -> tuple[Replicated, FlatLayout, bool]:
        """The shards and layout of ``params``, which replaced the parameters in
        ``param_groups``, and whether they are laid out as the current ones. Changes nothing;
        ``ValueError`` where the state cannot follow them."""
        old_shards, old_layout = self.shards, self.layout
        if len(params) != len(old_layout.keys):
            raise ValueError(
                f"param_groups hold {len(params)} parameters where the optimizer was built on "
                f"{len(old_layout.keys)}: build a new optimizer for another model"
            )
        if len(set(map(id, params))) != len(params):
            raise ValueError(
                "param_groups hold a parameter twice (Accelerate matches FSDP2's shards to the "
                "parameters by memory address, which empty local shards share: use "
                "onebit.integrations.accelerate.prepare)"
            )
        shards, layout = self._laid_out(params, old_layout.bucket_size, bool(self._masks))
        same = shards.settings() == old_shards.settings() and [p.shape for p in layout.params] == [
            p.shape for p in old_layout.params
        ]
        if not same and self._calls:
            raise ValueError(
                f"after {self._calls} steps the parameters were replaced by tensors of other "
                "shapes or sharding (as when FSDP2 shards the model after the first step): the "
                "optimizer's state cannot follow them. Shard the model before the first step, "
                "or build the optimizer on the sharded model and load a checkpoint"
            )
        if not same and self._masks:
            raise ValueError("exp_avg_mask belongs to parameters of other shapes")
        return shards, layout, same

    def _agreement_size(self) -> int:
        """How many ranks agree on a new layout: the world where the parameters are sharded or
        the optimizer spans it, else the optimizer's process group."""
        if not dist.is_initialized():
            return 1
        return dist.get_world_size(self._agreement_group())

    def _agreement_group(self) -> dist.ProcessGroup | None:
        params = [p for g in self.param_groups for p in g["params"]]
        return None if self.shards.sharded or has_dtensors(params) else self.process_group

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the agreement group (a collective)."""
        group = self._agreement_group()
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, bool(flag), group=group)
        return any(gathered)

    def _agree_anew(
        self, new: tuple[Replicated, FlatLayout, bool] | None, problem: str | None
    ) -> None:
        """Where some rank lays out anew: every rank of the agreement group checks, in one
        collective, that all ranks will step the same optimizer (this rank on ``new``, or on
        its current layout), then takes rank 0's parameters. Rolls back on ``ValueError``."""
        old_shards, old_layout = self.shards, self.layout
        saved = self._state_dict_of(old_layout.keys) if new is not None and new[2] else None
        if new is not None:
            self._adopt(*new[:2])
        try:
            world = self._agreement_group() is None
            self._agree(self._settings() if problem is None else problem, world)
        except BaseException:
            self._adopt(old_shards, old_layout)
            raise
        if new is not None:
            self._lay_out_anew(*new[:2], saved=saved)

    def _lay_out_anew(
        self, shards: Replicated, layout: FlatLayout, saved: dict[str, Any] | None
    ) -> None:
        """Make the state on ``layout`` as a new optimizer has it, then load ``saved`` (the
        state of the parameters it replaces) if given."""
        self._adopt(shards, layout)
        self.state.clear()
        self._fused = None
        self._gathered = None
        self._build_on_device()
        self.bucketer.close()
        self.bucketer = self._new_bucketer(self.bucketer.backward_passes)
        self.engine = self._new_engine()
        self._allocate_state()
        self._push_next_sender()
        if saved is not None:
            self.load_state_dict(saved)

    def _state_dict_of(self, params: list[Tensor]) -> dict[str, Any]:
        """:meth:`state_dict` with ``params``, the parameters the state is laid out on, in
        place of those in ``param_groups``."""
        current = [g["params"] for g in self.param_groups]
        given = iter(params)
        for group in self.param_groups:
            group["params"] = [next(given) for _ in group["params"]]
        try:
            return self.state_dict()
        finally:
            for group, ps in zip(self.param_groups, current):
                group["params"] = ps

    def _settings(self) -> dict[str, Any]:
        """What every rank must agree on; subclasses add their own knobs."""
        return {
            "optimizer": type(self).__name__,
            "shapes": [tuple(p.shape) for p in self.layout.params],
            "dtypes": [str(p.dtype) for p in self.layout.params],
            "device type": self.device.type,
            "bucket_size": self.layout.bucket_size,
            "scale_per": self.scale_per,
            "warmup_compression": self.warmup_compression,
            "error_dtype": str(self.error_dtype),
            "param groups": self._group_hyperparameters(),
            "max_grad_norm": self.max_grad_norm,
            "bias_correction": self.bias_correction,
            "freeze_step": self.freeze.freeze_step,
            "auto_freeze": self.freeze.auto_freeze,
            "overlap_backward": self.overlap_backward,
            "exp_avg_mask": [offset for offset, _ in self._masks],
            **self.shards.settings(),
        }

    _group_keys: tuple[str, ...] = ("lr", "weight_decay")
    """What every rank must agree on in each param group."""

    def _group_hyperparameters(self) -> list[tuple[Any, ...]]:
        """Each param group's :attr:`_group_keys`, as plain values."""
        return [tuple(_plain(g[key]) for key in self._group_keys) for g in self.param_groups]

    def _step_hyperparameters(self, groups: list[dict[str, Any]]) -> tuple[Any, bool]:
        """What the subclass's step reads from the param groups ``groups`` when it opens (kept
        as ``_hyper``), and whether the groups agree on what acts on whole buckets (if not,
        every rank raises)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "layout"):
            raise RuntimeError(
                f"{type(self).__name__} lays its state out at construction: pass every param "
                "group to the constructor"
            )
        super().add_param_group(param_group)

    # Where the warmup stands: the FreezeSchedule's answers.

    @property
    def freeze_step(self) -> int | None:
        """The last warmup step: the constructor's, or the step ``"auto"`` chose (``None`` while
        it has not)."""
        return self.freeze.freeze_step

    @property
    def in_warmup(self) -> bool:
        """True until ``freeze_step`` steps have been applied (or while ``"auto"`` waits)."""
        return self.freeze.in_warmup(self.num_steps)

    @property
    def stage(self) -> str:
        """``"warmup"`` until ``freeze_step`` steps are done, then ``"compression"``."""
        return "warmup" if self.in_warmup else "compression"

    @property
    def _freeze_monitor(self) -> VarianceMonitor | None:
        """The ``"auto"`` rule's state, ``freeze.monitor``."""
        return self.freeze.monitor

    # Each step: the hyperparameters and loss scale it runs with, and what it sends.

    def _begin_step(self, follow: bool = True) -> OpenStep:
        """Open the step: read its hyperparameters, make its headers (:class:`~onebit.header.
        OpenStep`), and return it; idempotent until :meth:`_end_step`.

        Runs at the first bucket launched (during backward with ``overlap_backward``, without
        ``follow``) or at the start of ``step()``, where it first follows ``param_groups`` to
        parameters that replaced the ones it was laid out on (:meth:`_follow_param_groups`).
        What the subclass reads from the param groups comes with the step; groups that
        disagree, or parameters it could not follow, are reported through the header, so every
        rank raises together.
        """
        if self._step_open:
            return self._step
        if follow:
            replaced = self._follow_param_groups() is not None
        else:
            replaced = not self._on_param_groups()
        one_device = self._follow_parameters()
        self._hyper, uniform = self._step_hyperparameters(self.param_groups)
        sparse = any(p.grad is not None and p.grad.is_sparse for p in self.layout.params)
        status = 2 if not uniform else 1 if sparse else 0 if one_device else 3
        if not status and not self.shards.syncing():
            status = 4
        if not status and replaced:
            status = 5
        self._step = OpenStep(
            owner=type(self).__name__,
            rank=self.rank,
            shards=self.shards,
            hyperparameters=self._group_hyperparameters(),
            hyper=self._hyper,
            status=status,
            call=self._calls + 1,
            backward_passes=self.bucketer.backward_passes,
            buckets=len(self.comms),
            device=self.device,
            replace_problem=self._replace_problem,
        )
        return self._step

    @property
    def _step_open(self) -> bool:
        return self._step is not None and self._step.open

    def _close_step(self) -> None:
        """Close the step without applying it (it raised, or was abandoned)."""
        if self._step is not None:
            self._step.close()

    def _read_grad_scale(self) -> None:
        """Take ``grad_scale`` set by ``torch.amp.GradScaler.step`` (``None`` outside it, or once
        ``scaler.unscale_`` has already unscaled ``.grad``)."""
        if not hasattr(self, "found_inf"):  # GradScaler sets both, grad_scale maybe to None
            return
        if self.bucketer.inflight:
            self.bucketer.abandon()
            raise RuntimeError(
                "overlap_backward sends gradients during backward, before torch.amp.GradScaler "
                "unscales them or passes its scale to step(): use overlap_backward=False with a "
                "GradScaler"
            )
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is None:
            return
        inverse = torch.as_tensor(grad_scale, device=self.device).double().reciprocal().float()
        self._step.inv_scale = gradient_factor(inverse, self.backend)

    def _next_kind(self) -> str | None:
        """What the next step sends, if it can start during backward (``overlap_backward``),
        else ``None``: a ``kind`` of :meth:`Engine.sender <onebit.engine.Engine.sender>`."""
        return None

    def _push_next_sender(self) -> None:
        """Give the bucketer what the next step sends (at construction, after each step and
        after a load)."""
        kind = self._next_kind() if self.overlap_backward else None
        sender = None if kind is None else self.engine.sender(kind, packed=self._fused)
        self.bucketer.sender = sender

    @property
    def _warmup_kind(self) -> str:
        """What a full-precision step sends: ``"allreduce"``, or ``"quantized"``."""
        return ALLREDUCE if self.warmup_compression == "fp32" else QUANTIZED

    def _average_gradients(self) -> tuple[bool, int]:
        """Average the gradients at full precision into the gradient buffer and clip the average
        (:meth:`Engine.average_gradients <onebit.engine.Engine.average_gradients>`)."""
        return self.engine.average_gradients(self._warmup_kind == QUANTIZED)

    @property
    def max_grad_norm(self) -> float | None:
        """The global norm gradients are clipped to (``None``: no clipping)."""
        return self.clipping.max_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self.clipping.max_norm = value

    @property
    def grad_norm(self) -> float | None:
        """The gradient norm the last step clipped with (``max_grad_norm``; ``None`` before one
        has): see the class's ``grad_norm`` attribute."""
        return self.clipping.norm

    @grad_norm.setter
    def grad_norm(self, value: float | None) -> None:
        self.clipping.norm = value

    def _apply_mask_(self, flat: Tensor) -> None:
        """Zero the masked-out entries of the flat momentum ``flat`` (``exp_avg_mask``)."""
        for offset, mask in self._masks:
            flat[offset : offset + mask.numel()].mul_(mask)

    # The step: the template every optimizer runs, and its overlap with backward.

    @closes_step_on_error
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step. Call it on every rank of the group, at every step (0/1 Adam's
        local steps too)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._start_step()
        self._take_step()
        return loss

    def _take_step(self) -> None:
        """The step's update, by the subclass's stages (after :meth:`_start_step`; each stage
        ends it with :meth:`_end_step`)."""
        raise NotImplementedError

    def _start_step(self) -> None:
        """What opens ``step()``: this step's hyperparameters, the loss scale, and the check that
        no gradient sent during backward was changed since."""
        self._begin_step()
        self._read_grad_scale()
        self.bucketer.check_unchanged()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without launching communication (for all but the last backward
        of a step when ``overlap_backward`` is on), as ``DistributedDataParallel.no_sync``."""
        with self.bucketer.no_sync():
            yield

    def _end_step(
        self, stage: str, nbytes: int, applied: bool, round_skipped: bool = False
    ) -> None:
        first_warmup = self._compiles_ahead and self._calls == 0 and self.in_warmup
        self._close_step()
        self._calls += 1
        self.shards.release(self.layout.params)
        if self.shards.sharded and not self._keeps_gradient_buffer:
            self.bucketer.release()
        self.bucketer.armed = True
        self.comm_stats.record(stage, nbytes, round_skipped)
        if applied:
            self.num_steps += 1
        else:
            self.skipped_steps += 1
        self._push_next_sender()
        if first_warmup:
            self._compile_ahead()

    def _compile_ahead(self) -> None:
        """After the first warmup step: compile the kernels of the stage to come now, where
        they compile at their first launch (:mod:`onebit.rehearsal`), if every rank can."""
        can = rehearsal.applies(self)
        if self.device.type == "cuda" and self.world_size > 1:
            can = not self._any_rank(not can)
        if can:
            rehearsal.rehearse(self._tiny_copy(), scaled=self._step.inv_scale is not None)

    def _tiny_copy(self) -> CompressedOptimizer:
        """A copy of this optimizer on :func:`~onebit.rehearsal.tiny_groups`, with the options
        of :attr:`_rehearsal_options`, for :func:`~onebit.rehearsal.rehearse`. It compiles
        nothing ahead itself. A collective, as the construction of any onebit optimizer."""
        groups = rehearsal.tiny_groups(self.param_groups, self.device)
        options = {
            **{k: v for k, v in self._constructor_options.items() if k != "params"},
            **self._rehearsal_options,
            "process_group": self.process_group,
        }
        if self._masks:
            first = groups[0]["params"][0]
            options["exp_avg_mask"] = {first: torch.ones_like(first)}
        copy = type(self)(groups, **options)
        copy._compiles_ahead = False
        return copy

    # The packed momentum of 1-bit Adam and 1-bit LAMB (onebit.momentum), where it applies.

    _fused: PackedMomentumStage | None = None
    _unpacked: str | None = None  # why _fused is None (momentum.unpacked_because)

    def _packed_stage(self) -> PackedMomentumStage | None:
        """The packed momentum stage, if the parameters still suit its kernels; once they do not
        (one layer cast to another dtype, or given other strides) it is unpacked, and the
        unfused path runs from then on."""
        if self._fused is not None and not fused_parameters(self.layout, DTYPES):
            self._fused.unpack_()
            self._fused = None
            self._unpacked = unpacked_because(self.layout, self.scale_per)
            self.flat.expose("exp_avg", self._exp_avg)
        return self._fused

    # Checkpoints (onebit.checkpoint): the state's parts, each saving and loading itself.

    _frozen = False
    """Whether the state is the frozen stage's (past the warmup), as :meth:`_set_frozen` named
    it."""

    def _set_frozen(self, frozen: bool) -> None:
        """Name the subclass's state in ``state`` for the warmup or, ``frozen``, the stage after
        it."""
        raise NotImplementedError

    def _stage_state(self) -> StatePart:
        """The subclass's own :class:`~onebit.checkpoint.StatePart`: its stages' counters and
        state that is not per parameter."""
        return checkpoint.NoState()

    def _state_parts(self) -> list[StatePart]:
        """The parts of the state that save and load themselves, in the order they load: the
        error buffers, the subclass's stages, which stage the buffers are named for, and the
        packed momentum."""
        errors = checkpoint.ErrorBuffers(
            self.comms, self.warmup_comms, self.error_dtype, type(self).__name__
        )
        parts = [errors, self._stage_state(), checkpoint.Frozen(self._frozen, self._set_frozen)]
        if self._fused is not None:
            parts.append(checkpoint.PackedMomentum(self._fused, self.flat))
        return parts

    def _end_warmup_compression(self) -> None:
        """At the freeze: zero the quantized warmup's error buffers, which tracked gradients that
        the compression stage no longer sends."""
        for comm in self.warmup_comms:
            comm.reset()

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
        with checkpoint.saving(parts):
            state = super().state_dict()
            state["state"] = {i: dict(s) for i, s in state["state"].items()}  # not self.state's
        if self.shards.sharded:
            state["state"] = checkpoint.sharded(state["state"], self.shards)
        ranks = {self._part: checkpoint.rank_state(parts)}
        if self._gathered is not None and self._gathered[0] == self._calls:
            ranks = self._gathered[1]
        state["onebit"] = {
            "optimizer": type(self).__name__,
            "world_size": self.world_size,
            "layout": self._layout_digest(),
            "num_steps": self.num_steps,
            "skipped_steps": self.skipped_steps,
            "calls": self._calls,
            "backward_passes": self.bucketer.backward_passes,
            "comm_stats": self.comm_stats.state_dict(),
            **self.freeze.state_dict(),
            **checkpoint.extra_state(parts),
            "ranks": ranks,
        }
        return state

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
        mine = checkpoint.rank_state(self._state_parts())
        parts = checkpoint.gather_rank_states(
            mine, to, self.rank, self.world_size, self.process_group
        )
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` or :meth:`consolidated_state_dict`, keeping every buffer
        fp32 and flat.

        This rank's part (error buffers) is taken from the dict. If the dict has no part for
        this rank (another rank's file), or it was saved with another world size or bucket
        layout, the error buffers are reset to zero with a warning; everything else is restored.
        A state of another optimizer raises ``ValueError`` and changes nothing.
        """
        self._follow_param_groups_or_raise("load")
        self._follow_parameters()
        saved = checkpoint.onebit_entry(state_dict, type(self).__name__)
        groups = state_dict["param_groups"]
        index = checkpoint.parameter_index(groups, self.param_groups)
        self._gathered = None
        parts = self._state_parts()
        undo = checkpoint.before_load(parts, saved)
        try:
            checkpoint.check_buffers(self.state, index, state_dict["state"])
        except ValueError:
            undo()
            raise
        checkpoint.copy_buffers(self.state, index, state_dict["state"])
        for saved_group, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        extra, ranks = checkpoint.split_ranks(saved, self._part, self._layout_digest())
        try:
            own = checkpoint.own_rank_state(extra, ranks, self._part, self._layout_digest())
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
        for key in ("optimizer", "world_size", "layout", "freeze_step", "auto_freeze"):
            extra.pop(key, None)
        for part in parts:
            part.load_extra_state(extra)
        if self._fused is not None and self._frozen:
            self.bucketer.release()  # the .grad views keep theirs; the packed stage needs none
        self._push_next_sender()


def _plain(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value


def onebit_optimizer(optimizer: Any, where: str) -> CompressedOptimizer:
    """The onebit optimizer that ``optimizer`` is or wraps (Accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``); ``TypeError`` naming ``where`` if there is none."""
    inner = optimizer
    for attribute in ("optimizer", "_optimizer"):  # Accelerate, Lightning
        if not isinstance(inner, CompressedOptimizer) and hasattr(inner, attribute):
            inner = getattr(inner, attribute)
    if not isinstance(inner, CompressedOptimizer):
        raise TypeError(
            f"{where} needs a onebit optimizer (OnebitAdam, ZeroOneAdam or OnebitLamb), "
            f"got {type(optimizer).__name__}"
        )
    return inner


def _check_parameters(params: list[Tensor]) -> None:
    """Raise ``ValueError`` for parameters the flat fp32 layout cannot hold."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    if any(p.is_meta for p in params):
        raise ValueError(
            "parameters are on the meta device (no data yet): materialise the model "
            "(model.to_empty(device=...) and load or initialise the weights) before building "
            "the optimizer"
        )
    if any(not p.is_floating_point() for p in params):
        raise ValueError("all parameters must be floating point")


def _check_masks(masks: Mapping[Tensor, Tensor], layout: FlatLayout) -> list[tuple[int, Tensor]]:
    """Validate ``exp_avg_mask``; return ``(offset in the flat buffers, flat uint8 mask)``, each
    mask in the flat buffers' order (a byte per entry: multiplying by it is multiplying by 0.0
    or 1.0)."""
    where = {id(p): i for i, p in enumerate(layout.params)}
    checked = []
    for p, mask in masks.items():
        if id(p) not in where:
            raise ValueError("exp_avg_mask has a tensor that is not one of the optimizer's params")
        if not torch.is_tensor(mask) or mask.shape != p.shape:
            raise ValueError(
                f"exp_avg_mask of shape {tuple(getattr(mask, 'shape', ()))} for a parameter of "
                f"shape {tuple(p.shape)}"
            )
        mask = mask.detach()
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("exp_avg_mask must hold only 0s and 1s: each momentum entry is kept "
                             "or zeroed")  # fmt: skip
        i = where[id(p)]
        flat = layout.flat(i, mask.to(device=p.device, dtype=torch.uint8))
        checked.append((layout.offsets[i], flat))
    return sorted(checked, key=lambda item: item[0])
