"""The base of the onebit optimizers: torch's face and the step template.

:class:`CompressedOptimizer` builds an optimizer (with checks that raise on every rank alike),
opens and ends each step, and is what torch, ``GradScaler`` and the frameworks call (``step``,
``no_sync``, ``state_dict``). Where its state lives and how it follows the parameters is
:mod:`onebit.optim.placement`'s; its checkpoints, :mod:`onebit.optim.checkpoint`'s; what a step
sends and the verdict every rank reaches, the :class:`~onebit.transport.engine.Engine`'s; each
optimizer's update, its own module's (with Adam's math in :mod:`onebit.optim.adam_step`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..freeze import FreezeSchedule
from ..stats import CommStats
from ..transport.clipping import Clipping
from ..transport.header import EDITED, EDITED_BY_UNSCALE, OpenStep
from ..transport.sharding import Replicated, has_dtensors
from ..wire.momentum import PackedMomentumStage
from ..wire.protocol import allreduce_bytes, group_size_and_rank
from . import rehearsal
from .checkpoint import Checkpointed
from .from_torch import HYPERPARAMETERS, adam_arguments
from .options import check_masks, check_options
from .placement import Placement
from .stage import Stage, show_side


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


class CompressedOptimizer(Checkpointed, Placement, torch.optim.Optimizer):
    """Base of the optimizers that own their gradient communication: torch's face and the step
    template.

    At construction it checks that every rank has the same parameters and settings, broadcasts
    the parameters from rank 0, and lays the state out in flat fp32 buffers split into buckets,
    on the parameters' device (:class:`~onebit.optim.placement.Placement`, which also follows the
    parameters to another device or to tensors that replaced them in ``param_groups``). Each
    bucket has its communicators; the :attr:`engine` runs a step's exchanges over them, the
    :attr:`bucketer` gathers and launches the buckets, and :mod:`onebit.optim.checkpoint` saves and
    loads the state (:class:`~onebit.optim.checkpoint.Checkpointed`).

    A subclass passes this constructor its argument checks, ``check``, which raises
    ``ValueError`` or returns the :class:`~onebit.freeze.FreezeSchedule` that ends its warmup
    (run here, so that a problem raises on every rank, not one). It says what its steps read
    from the param groups (:meth:`_step_hyperparameters`, :attr:`_group_keys`), makes its
    buffers in :meth:`_allocate_state`, declares its stages (:attr:`_stage_types`, each a
    :class:`~onebit.optim.stage.Stage`: the buffers it shows, what it sends, its step's update)
    and says which one each step runs (:attr:`stage`).

    Under ``torch.amp.GradScaler`` (``_step_supports_amp_scaling``) each step reads
    ``grad_scale`` and unscales while copying the gradients into its own buffer, and every rank
    takes part in every step's collectives whatever its local ``found_inf``; a non-finite value
    on any rank makes every rank skip the step.

    Attributes:
        backend: the kernels its steps run on the parameters' device (``"triton"`` on CUDA,
            ``"c"`` on the CPU; ``"numpy"`` or ``"torch"`` where those cannot run, with a
            warning; see :mod:`onebit.kernels`).
        engine: the :class:`~onebit.transport.engine.Engine` of its steps' exchanges.
        bucketer: the :class:`~onebit.transport.bucketer.Bucketer` of the gradient buckets.
        flat: the :class:`~onebit.state.flat_state.FlatState` that shows the flat buffers per
            parameter in ``state``.
        freeze: the :class:`~onebit.freeze.FreezeSchedule`; ``freeze_step`` and
            ``in_warmup`` read it.
        comm_stats: :class:`~onebit.stats.CommStats`, bytes sent per step and in total.
        skipped_steps: steps skipped on every rank because some rank had a non-finite gradient.
        num_steps: steps applied so far (those in ``skipped_steps`` not counted): the step
            number ``freeze_step`` and the bias correction count.
        grad_norm: the gradient norm the last step's ``max_grad_norm`` clipping used (``None``
            without clipping): the averaged gradient's in full-precision steps, the rank's own
            in 1-bit and local steps, the mean of the ranks' under ``overlap_backward``.

    What its stages use, beyond ``engine``, ``bucketer``, ``flat`` and ``layout``: ``hyper``, the
    hyperparameters of the open (or last) step; ``masks``, ``exp_avg_mask`` as ``(offset,
    mask)`` on the flat layout; ``frozen`` and :meth:`set_frozen`, the side of the freeze the
    state is named for; and the subclass's flat buffers.
    """

    _step_supports_amp_scaling = True

    _keeps_gradient_buffer = False
    """Whether the subclass keeps data in the bucketer's gradient buffer from one step to the
    next (0/1 Adam its sync parameters). If not, a sharded optimizer frees the buffer after each
    step: FSDP2 owns the gradients, and between steps the buffer would be one more copy."""

    _stage_types: tuple[type[Stage], ...] = ()
    """The subclass's stages, each made once at construction; :attr:`stage` names a step's."""

    _rehearsal_options: dict[str, Any] = {}
    """What :func:`~onebit.optim.rehearsal.rehearse` changes in the keyword arguments of its copy,
    so that the copy goes through every kind of step within its few steps."""

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
        max_grad_norm: float | None = None,
        exp_avg_mask: Mapping[Tensor, Tensor] | None = None,
        overlap_backward: bool = False,
        scale_per: str = "tensor",
        warmup_compression: str = "fp32",
        error_dtype: torch.dtype = torch.float32,
        allow_edited_grads: bool = False,
    ) -> None:
        super().__init__(params, defaults)
        self.allow_edited_grads = bool(allow_edited_grads)
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
            max_grad_norm = check_options(
                bucket_size, scale_per, warmup_compression, error_dtype, max_grad_norm
            )
            self.clipping = Clipping(max_grad_norm)
            self._adopt(*self._laid_out(params, bucket_size, masked=bool(exp_avg_mask)))
            self.masks = check_masks(exp_avg_mask or {}, self.layout)
        except ValueError as err:
            if self.world_size == 1 and not sharded:
                raise
            problem = str(err)  # raised on every rank below, not here alone
        self._agree(self._settings() if problem is None else problem, sharded)
        self._build_on_device()
        self._step: OpenStep | None = None
        self._replace_problem: str | None = None
        self.bucketer = self._new_bucketer()
        self.engine = self._new_engine()
        self._stages = {stage.name: stage for stage in (s(self) for s in self._stage_types)}
        self.comm_stats = CommStats()
        self.comm_stats.freeze_step = self.freeze.freeze_step
        self.skipped_steps = 0
        self.num_steps = 0
        self._calls = 0
        self._gathered: tuple[int, dict[int, Any]] | None = None  # consolidate_state_dict()
        self.hyper = self._step_hyperparameters(self.param_groups)[0]  # each step reads anew
        self._allocate_state()
        self._push_next_sender()

    @classmethod
    def from_optimizer(
        cls, optimizer: torch.optim.Optimizer, **options: Any
    ) -> CompressedOptimizer:
        """This optimizer, built on the param groups of ``optimizer``, a ``torch.optim.AdamW``
        (or ``Adam``) that has not stepped: the groups' parameters and their ``lr``, ``betas``,
        ``eps`` and ``weight_decay`` are kept, so a script's own optimizer factory is reused::

            optimizer = onebit.OnebitAdam.from_optimizer(model.configure_optimizers(...))

        ``options`` are this optimizer's other keyword arguments (``max_grad_norm``,
        ``total_steps``, ...).

        Raises:
            TypeError: for another kind of optimizer.
            ValueError: for what onebit cannot honour (``amsgrad``, ``maximize``,
                ``differentiable``, ``torch.optim.Adam``'s L2 ``weight_decay``, an optimizer
                that has stepped), or ``options`` that would set a hyperparameter the groups
                already give.
        """
        given = sorted(set(options) & set(HYPERPARAMETERS))
        if given:
            raise ValueError(
                f"from_optimizer takes {', '.join(given)} from the optimizer's param groups: "
                "set them there, not as options"
            )
        groups, defaults = adam_arguments(optimizer)
        return cls(groups, **defaults, **options)

    # What each subclass provides (with _allocate_state and _stage_types).

    def _step_hyperparameters(self, groups: list[dict[str, Any]]) -> tuple[Any, bool]:
        """What the subclass's step reads from the param groups ``groups`` when it opens (kept
        as ``hyper``), and whether the groups agree on what acts on whole buckets (if not,
        every rank raises)."""
        raise NotImplementedError

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
        """``"warmup"`` until ``freeze_step`` steps are done, then ``"compression"``: the name
        of the stage the next step runs."""
        return "warmup" if self.in_warmup else "compression"

    def set_frozen(self, frozen: bool) -> None:
        """Name the state for the stages after the freeze (``frozen``) or before it."""
        self.frozen = frozen
        show_side(self._stages.values(), frozen, self.flat)

    # Each step: the hyperparameters and loss scale it runs with, and what it sends.

    def _begin_step(self, follow: bool = True) -> OpenStep:
        """Open the step: read its hyperparameters, make its headers (an
        :class:`~onebit.transport.header.OpenStep`), and return it; idempotent until the step
        ends (:meth:`_take_step`).

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
        self.hyper, uniform = self._step_hyperparameters(self.param_groups)
        self.freeze.note_lr(max(float(g["lr"]) for g in self.param_groups))
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
            hyper=self.hyper,
            status=status,
            call=self._calls + 1,
            backward_passes=self.bucketer.backward_passes,
            buckets=len(self.comms),
            device=self.device,
            replace_problem=self._replace_problem,
        )
        self.comm_stats.count_rounds()
        return self._step

    @property
    def _step_open(self) -> bool:
        """Whether a step is open: from :meth:`_begin_step` to its end, error or abandon."""
        return self._step is not None and self._step.open

    def _close_step(self) -> None:
        """Close the step without applying it (it raised, or was abandoned)."""
        if self._step is not None:
            self._step.close()
        self.comm_stats.stop_counting()

    def _push_next_sender(self) -> None:
        """Give the bucketer what the next step sends, if it can start during backward (at
        construction, after each step and after a load)."""
        sender = self._stages[self.stage].sends() if self.overlap_backward else None
        self.bucketer.sender = sender

    @property
    def max_grad_norm(self) -> float | None:
        """The global norm gradients are clipped to (``None``: no clipping)."""
        return self.clipping.max_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self.clipping.max_norm = value

    @property
    def grad_norm(self) -> float | None:
        """The gradient norm the last step's ``max_grad_norm`` clipping used (``None`` without
        clipping, or before a step has clipped): the averaged gradient's in full-precision
        steps, the rank's own in 1-bit and local steps, the mean of the ranks' norms under
        ``overlap_backward``."""
        return self.clipping.norm

    @grad_norm.setter
    def grad_norm(self, value: float | None) -> None:
        self.clipping.norm = value

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

    def _start_step(self) -> None:
        """What opens ``step()``: this step's hyperparameters, the loss scale, and the check that
        no gradient was changed since backward by anything but the optimizer (every rank raises
        if one was, unless ``allow_edited_grads``; a gradient that ``overlap_backward`` already
        sent raises on this rank in any case)."""
        scaled = hasattr(self, "found_inf")  # set by torch.amp.GradScaler, with grad_scale
        unscaled = scaled and getattr(self, "grad_scale", None) is None  # scaler.unscale_ ran
        edited = self.bucketer.edited_since_backward()
        step = self._begin_step()
        if scaled:
            self.engine.read_grad_scale(step, getattr(self, "grad_scale", None))
        if edited:
            self.bucketer.check_unsent(edited)
            if not self.allow_edited_grads and not step.status:
                step.status = EDITED_BY_UNSCALE if unscaled else EDITED

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without launching communication (for all but the last backward
        of a step when ``overlap_backward`` is on), as ``DistributedDataParallel.no_sync``."""
        with self.bucketer.no_sync():
            yield

    def _take_step(self) -> None:
        """Take the step in the stage it runs (:attr:`stage`), then end it: count it (applied,
        or skipped on every rank), book its bytes, release what FSDP2 and the bucketer hold
        between steps, and push what the next step sends; after the first warmup step, compile
        the next stage's kernels ahead."""
        running = self._stages[self.stage]
        applied, nbytes, round_skipped = running.step(self.num_steps + 1)
        first_warmup = self._calls == 0 and self.in_warmup
        self._close_step()
        self._calls += 1
        self.shards.release(self.layout.params)
        if self.shards.sharded and not self._keeps_gradient_buffer:
            self.bucketer.release()
        self.bucketer.armed = True
        fp32 = allreduce_bytes(4 * self.layout.numel, self.world_size)
        self.comm_stats.record(running.name, nbytes, round_skipped, fp32_bytes=fp32)
        if applied:
            self.num_steps += 1
        else:
            self.skipped_steps += 1
        self._push_next_sender()
        if first_warmup:
            options = {**self._constructor_options, **self._rehearsal_options}
            scaled = self._step.inv_scale is not None  # closed, not gone
            rehearsal.compile_ahead(self, options, scaled=scaled, any_rank=self._any_rank)

    packed_momentum: PackedMomentumStage | None = None
    """The packed momentum stage, where the subclass has one
    (:class:`~onebit.wire.momentum.PacksMomentum`)."""


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
