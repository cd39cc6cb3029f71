"""Plumbing shared by the 1-bit optimizers: flat state, buckets, communication, checkpoints.

Subclasses implement the update rule in ``step`` and keep their math in
:mod:`onebit.functional`; everything that touches ``torch.distributed`` lives here or below.
"""

from __future__ import annotations

import hashlib
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import CompressedAllreduce, MeanAllreduce, finish_compressed_, group_size_and_rank
from .functional import all_finite
from .layout import FlatLayout
from .stats import CommStats

DEFAULT_BUCKET_SIZE = 2**22
"""Elements per compressed bucket (16 MiB of fp32). Smaller buckets overlap better, larger ones
send fewer messages."""


def check_adam_hyperparameters(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """Raise ``ValueError`` for hyperparameters ``torch.optim.AdamW`` would also reject."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_step_count(name: str, value: Any, minimum: int = 1) -> int:
    """Return ``value`` if it is an int ``>= minimum``, else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of the optimizers that own their gradient communication.

    At construction it checks that every rank has the same parameters, broadcasts them from
    rank 0, and lays the optimizer state out in flat fp32 buffers split into buckets. Each bucket
    has its own :class:`~onebit.comm.CompressedAllreduce`, whose error buffers are part of this
    rank's :meth:`state_dict`.

    Attributes:
        comm_stats: :class:`~onebit.stats.CommStats`, bytes sent per step and in total.
        skipped_steps: steps skipped on every rank because some rank had a non-finite gradient.
    """

    #: Hyperparameters that must be equal in every param group (they act on whole buckets).
    _uniform_hyperparameters: tuple[str, ...] = ("betas", "eps")

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        process_group: dist.ProcessGroup | None,
        bucket_size: int,
        overlap_backward: bool = False,
    ) -> None:
        super().__init__(params, defaults)
        check_step_count("bucket_size", bucket_size)
        for key in self._uniform_hyperparameters:
            values = {repr(g[key]) for g in self.param_groups}
            if len(values) > 1:
                raise ValueError(f"{key} must be the same in every param group, got {values}")
        params = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"all parameters must be on one device, got {sorted(map(str, devices))}"
            )
        if any(not p.is_floating_point() for p in params):
            raise ValueError("all parameters must be floating point")
        self.process_group = process_group
        self.world_size, self.rank = group_size_and_rank(process_group)
        self.device = params[0].device if params else torch.device("cpu")
        if self.world_size > 1:
            _check_same_parameters(params, process_group)
            _broadcast_from_first_rank(params, process_group)
        self.layout = FlatLayout(params, bucket_size, self.world_size)
        self.comms = [
            CompressedAllreduce(end - start, group=process_group, device=self.device)
            for start, end in self.layout.buckets
        ]
        self._grads = self.layout.zeros(padded=True, device=self.device)
        self._grad_buckets = self.layout.bucket_views(self._grads, padded=True)
        self._inflight: dict[int, Any] = {}
        self._no_sync = False
        self._buckets_of_param = [
            [k for k, (s, e) in enumerate(self.layout.buckets) if s < o + n and o < e]
            for o, n in zip(self.layout.offsets, self.layout.numels)
        ]
        self._bucket_sizes = [0] * len(self.comms)
        for p, buckets in zip(params, self._buckets_of_param):
            for k in buckets:
                self._bucket_sizes[k] += p.requires_grad
        self._bucket_pending = list(self._bucket_sizes)
        if overlap_backward:
            self._install_overlap_hooks()
        self.comm_stats = CommStats()
        self.skipped_steps = 0
        self.num_steps = 0

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "layout"):
            raise RuntimeError(
                f"{type(self).__name__} lays its state out at construction: pass every param "
                "group to the constructor"
            )
        super().add_param_group(param_group)

    def _new_state_buffer(self, name: str) -> Tensor:
        """A zero flat fp32 buffer exposed per parameter as ``self.state[p][name]``."""
        flat = self.layout.zeros(device=self.device)
        for p, view in zip(self.layout.params, self.layout.views(flat)):
            self.state[p][name] = view
        return flat

    def _per_group(self, *flats: Tensor) -> Iterator[tuple[Any, ...]]:
        """``(group, params, views of each flat buffer...)`` per param group."""
        views = [self.layout.views(f) for f in flats]
        start = 0
        for group in self.param_groups:
            end = start + len(group["params"])
            yield (group, group["params"], *(v[start:end] for v in views))
            start = end

    # Communication. Each bucket is filled from the gradients, launched, then completed.
    # Buckets launch in a fixed order (last first, as backward produces them) on every rank,
    # so the collectives match across ranks however early each bucket is launched.

    def _fill_bucket(self, k: int) -> None:
        """Copy the gradients overlapping bucket ``k`` into the flat gradient buffer."""
        start, end = self.layout.buckets[k]
        for p, offset, numel in zip(self.layout.params, self.layout.offsets, self.layout.numels):
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo >= hi:
                continue
            view = self._grads[lo:hi]
            if p.grad is None:
                view.zero_()
            elif p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            else:
                view.copy_(p.grad.reshape(-1)[lo - offset : hi - offset])

    def _prepare_bucket_(self, k: int, kind: str, grads: Tensor) -> None:
        """Turn bucket ``k``'s gathered gradients, in place, into what ``kind`` sends."""

    def _launch(self, k: int, kind: str, fill: bool) -> None:
        grads = self._grad_buckets[k]
        if fill:
            self._fill_bucket(k)
            self._prepare_bucket_(k, kind, grads[: self.comms[k].numel])
        if kind == "allreduce":
            self._inflight[k] = MeanAllreduce(grads[: self.comms[k].numel], self.process_group)
        else:
            self._inflight[k] = self.comms[k].start(grads)

    def _communicate(
        self, kind: str, out: Tensor | None = None, fill: bool = True
    ) -> tuple[bool, int]:
        """Launch every bucket not yet launched, then complete them all.

        ``kind`` is ``"allreduce"`` (average the gradient buffer in fp32, in place) or
        ``"compressed"`` (1-bit allreduce of the gradient buffer into the flat buffer ``out``).
        With ``fill`` each bucket is first gathered from ``.grad`` and passed through
        :meth:`_prepare_bucket_`; without it the caller has filled the gradient buffer.
        Returns (applied, bytes sent); not applied means some rank had a non-finite value and
        nothing but the gradient buffer changed.
        """
        for k in reversed(range(len(self.comms))):
            if k not in self._inflight:
                self._launch(k, kind, fill)
        calls = [self._inflight[k] for k in range(len(self.comms))]
        self._inflight = {}
        self._bucket_pending = list(self._bucket_sizes)
        if kind == "allreduce":
            for call in calls:
                call.wait()
            grads = self._grads[: self.layout.numel]
            # all_finite, not isfinite(grads).all(): no model-sized temporaries
            return all_finite([grads]), sum(c.bytes_sent for c in calls)
        applied = finish_compressed_(self.comms, calls, self.layout.bucket_views(out))
        return applied, sum(c.bytes_per_call for c in self.comms)

    def _gather_grads(self) -> Tensor:
        """Copy every ``.grad`` into the flat gradient buffer; ``None`` counts as zero."""
        for k in range(len(self.comms)):
            self._fill_bucket(k)
        return self._grads[: self.layout.numel]

    def _allreduce_grads(self) -> tuple[bool, int]:
        """Average the gathered gradients in fp32; return (all finite, bytes sent)."""
        return self._communicate("allreduce", fill=False)

    def _compressed_allreduce(self, out: Tensor) -> tuple[bool, int]:
        """Compressed allreduce of the (padded) flat gradient buffer, used as the input scratch,
        into the flat buffer ``out``; return (applied, bytes sent). Not applied means some rank
        had a non-finite value, and nothing was changed."""
        return self._communicate("compressed", out, fill=False)

    # Overlap with backward.

    def _next_communication(self) -> str | None:
        """What the next step sends, if it can be launched during backward, else ``None``."""
        return None

    def _on_grad_ready(self, index: int) -> None:
        kind = self._next_communication()
        if kind is None or self._no_sync:
            return
        for k in self._buckets_of_param[index]:
            if k in self._inflight:
                raise RuntimeError(
                    "a gradient changed after its bucket was sent: with overlap_backward, run "
                    "every backward but the last of a step inside optimizer.no_sync()"
                )
            self._bucket_pending[k] -= 1
        for k in reversed(range(len(self.comms))):
            if k in self._inflight:
                continue
            if self._bucket_pending[k] > 0:
                break
            self._launch(k, kind, fill=True)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without launching communication (for all but the last backward
        of a step when ``overlap_backward`` is on), as ``DistributedDataParallel.no_sync``."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def _install_overlap_hooks(self) -> None:
        this = weakref.ref(self)  # the hooks must not keep the optimizer alive

        def hook(index: int) -> None:
            optimizer = this()
            if optimizer is not None:
                optimizer._on_grad_ready(index)

        for index, p in enumerate(self.layout.params):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _, index=index: hook(index))

    def _end_step(
        self, stage: str, nbytes: int, applied: bool, round_skipped: bool = False
    ) -> None:
        self.comm_stats.record(stage, nbytes, round_skipped)
        if applied:
            self.num_steps += 1
        else:
            self.skipped_steps += 1

    # Checkpoints.

    def _extra_state(self) -> dict[str, Any]:
        """Subclass state that is not per parameter (schedules, frozen scalars)."""
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """This rank's whole state: per-parameter buffers, error buffers, schedules, counters.

        Error buffers differ between ranks: save one file per rank for an exact resume.
        """
        state = super().state_dict()
        state["onebit"] = {
            "world_size": self.world_size,
            "num_steps": self.num_steps,
            "skipped_steps": self.skipped_steps,
            "comm_stats": self.comm_stats.state_dict(),
            "comms": [c.state_dict() for c in self.comms],
            **self._extra_state(),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` in place, keeping every buffer fp32 and flat.

        Error buffers saved with another world size or bucket layout cannot be reused: they are
        reset to zero with a warning, and everything else is restored.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(g["params"]) for saved, g in zip(groups, self.param_groups)
        ):
            raise ValueError("loaded state dict has a different number of params or param groups")
        index = {
            i: p
            for saved, g in zip(groups, self.param_groups)
            for i, p in zip(saved["params"], g["params"])
        }
        for i, saved in state_dict["state"].items():
            p = index[i]
            for name, buffer in self.state[p].items():
                if buffer.shape != saved[name].shape:
                    raise ValueError(
                        f"state {name!r} of parameter {i} has shape "
                        f"{tuple(saved[name].shape)}, expected {tuple(buffer.shape)}"
                    )
        for i, saved in state_dict["state"].items():
            for name, buffer in self.state[index[i]].items():
                buffer.copy_(saved[name])
        for saved, g in zip(groups, self.param_groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        extra = dict(state_dict["onebit"])
        comms = extra.pop("comms")
        try:
            if len(comms) != len(self.comms):
                raise ValueError(f"{len(comms)} buckets saved, {len(self.comms)} here")
            for comm, saved in zip(self.comms, comms):
                comm.load_state_dict(saved)
        except ValueError as err:
            warnings.warn(
                f"error-feedback buffers reset ({err}); resume is not exact", stacklevel=2
            )
            for comm in self.comms:
                comm.reset()
        self.num_steps = extra.pop("num_steps")
        self.skipped_steps = extra.pop("skipped_steps")
        self.comm_stats.load_state_dict(extra.pop("comm_stats"))
        extra.pop("world_size")
        self._load_extra_state(extra)


def _check_same_parameters(params: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks hold the same shapes."""
    shapes = [tuple(p.shape) for p in params]
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    mine = (len(params), sum(p.numel() for p in params), digest)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if any(g != gathered[0] for g in gathered):
        table = ", ".join(
            f"rank {r}: {c} params, {n} elements" for r, (c, n, _) in enumerate(gathered)
        )
        raise ValueError(f"parameters differ across ranks (count, numel or shapes): {table}")


def _broadcast_from_first_rank(params: list[Tensor], group: dist.ProcessGroup | None) -> None:
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=src, group=group)
