"""Where an optimizer's state is laid out, and how it follows the parameters.

At construction the state is laid out on this rank's parameters (their shards, under FSDP2)
and every rank checks that all ranks laid out the same optimizer, then takes rank 0's
parameters. After that it follows them as torch's optimizers do, which step whatever
``param_groups`` holds, wherever it is, and frameworks rely on it: HF Trainer and Accelerate
move the model to the GPU after the optimizer was built, Accelerate and HF Trainer put FSDP2's
sharded parameters in ``param_groups``, and a user may point them at a copy of the model. The
state moves to the parameters' device, or is laid out anew on parameters that replaced those it
was built on, agreeing across ranks where it must; where it cannot, every rank raises.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import kernels
from ..state.flat_state import FlatState
from ..state.layout import FlatLayout
from ..transport.agreement import broadcast_from_first_rank, check_ranks_agree
from ..transport.bucketer import Bucketer
from ..transport.engine import Engine, bucket_communicators
from ..transport.header import HEADER_NUMEL
from ..transport.sharding import Replicated, has_dtensors, shards_of
from .options import check_parameters


class Placement:
    """The part of :class:`~onebit.optim.base.CompressedOptimizer` that lays its state out on the
    parameters (:meth:`_laid_out`, :meth:`_adopt`), makes it on their device with the
    communicators, bucketer and engine (:meth:`_build_on_device`, :meth:`_new_bucketer`,
    :meth:`_new_engine`), checks that every rank did the same (:meth:`_agree`, on
    :meth:`_settings`), and follows the parameters to another device
    (:meth:`_follow_parameters`) and to tensors that replaced them in ``param_groups``
    (:meth:`_follow_param_groups`)."""

    def _build_on_device(self) -> None:
        """Make the communicators, the flat state and the masks on :attr:`device` (the
        subclass's buffers are :meth:`_allocate_state`'s)."""
        device, group = self.device, self.process_group
        self.backend = kernels.for_device(device).name
        self.comms, self.warmup_comms = bucket_communicators(
            self.layout,
            group=group,
            device=device,
            scale_per=self.scale_per,
            warmup_compression=self.warmup_compression,
            error_dtype=self.error_dtype,
        )
        self.flat = FlatState(self.layout, self.state, self.param_groups, device)
        self.masks = [(offset, mask.to(device)) for offset, mask in self.masks]

    def _allocate_state(self) -> None:
        """Make the subclass's flat buffers on :attr:`device`, as a new optimizer has them (run
        at construction, and again when the parameters move to another device)."""

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
            device=self.device,
            backend=self.backend,
            overlap=self.overlap_backward,
            clipping=self.clipping,
            open_step=functools.partial(self._begin_step, follow=False),
        )

    def _laid_out(
        self, params: list[Tensor], bucket_size: int, masked: bool
    ) -> tuple[Replicated, FlatLayout]:
        """Check this rank's ``params`` (the param groups' parameters, in order); return their
        shards and the flat layout of the tensors the optimizer steps. Changes nothing."""
        if not params:
            raise ValueError(f"{type(self).__name__} got no parameters")
        shards = shards_of(params, self.process_group)
        local = shards.locals()
        check_parameters(local)
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

    _group_keys: tuple[str, ...] = ("lr", "weight_decay")
    """What every rank must agree on in each param group."""

    def _group_hyperparameters(self) -> list[tuple[Any, ...]]:
        """Each param group's :attr:`_group_keys`, as plain values."""
        return [tuple(_plain(g[key]) for key in self._group_keys) for g in self.param_groups]

    _agreed: tuple[str, ...] = ()
    """The subclass's own attributes that every rank must agree on (as :meth:`_settings`)."""

    def _settings(self) -> dict[str, Any]:
        """What every rank must agree on; subclasses add their own knobs (:attr:`_agreed`)."""
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
            "freeze_step": self.freeze.freeze_step,
            "auto_freeze": self.freeze.auto_freeze,
            "overlap_backward": self.overlap_backward,
            "exp_avg_mask": [offset for offset, _ in self.masks],
            **self.shards.settings(),
            **{name: getattr(self, name) for name in self._agreed},
        }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Raises ``RuntimeError`` once the optimizer is built: its state is laid out over every
        parameter at construction, so pass all param groups to the constructor."""
        if hasattr(self, "layout"):
            raise RuntimeError(
                f"{type(self).__name__} lays its state out at construction: pass every param "
                "group to the constructor"
            )
        super().add_param_group(param_group)

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
        self.packed_momentum = None
        self._build_on_device()
        self.bucketer.place(device)
        self.engine = self._new_engine()
        self._allocate_state()
        self._load_state(saved)

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
        shards, layout = self._laid_out(params, old_layout.bucket_size, bool(self.masks))
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
        if not same and self.masks:
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
        self.packed_momentum = None
        self._gathered = None
        self._build_on_device()
        self.bucketer.close()
        self.bucketer = self._new_bucketer(self.bucketer.backward_passes)
        self.engine = self._new_engine()
        self._allocate_state()
        self._push_next_sender()
        if saved is not None:
            self._load_state(saved)

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


def _plain(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value
