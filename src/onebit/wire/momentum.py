"""The momentum of 1-bit Adam and 1-bit LAMB in the compression stage: kept packed, updated by
fused passes.

After a compression step every momentum element is ``±σ`` of its piece (a tensor's part of a
chunk): exactly what the compressed allreduce returned, signs and scales, about ``d/8`` bytes
(1-bit LAMB's is that over the piece's momentum scaling, ``±(σ / c)``, just as exact).
:class:`PackedMomentumStage` keeps it that way instead of an fp32 copy, and runs each bucket's
worker side as the fused passes of :mod:`onebit.kernels.fused`, which read the gradients
straight from ``.grad``. The fp32 momentum buffer of the warmup becomes the worker error at the
first applied compression step, so the stage holds, per model element: the worker error (4
bytes), the server error (4/n) and the packed momentum (1/8 plus the scales), besides the
optimizer's own state (1-bit Adam: the frozen denominator, 4 bytes; 1-bit LAMB: that and the
fresh variance, 8). With the errors kept in bf16 (the communicators' ``error_dtype``) the worker
error gets a buffer of its own (2 bytes) and the fp32 momentum's storage is released while the
momentum is packed: 2 + 2/n bytes for both errors.

It applies to parameters of one dtype (fp32, bf16 or fp16) whose backend has the fused passes
(the C kernels on the CPU, Triton on CUDA) and a scale per tensor; elsewhere the optimizers run
the unfused formulation, which gives the same bits, and say why (:func:`unpacked_because`).
``max_grad_norm`` costs it nothing: each rank clips its own gradient before it is sent, by a
factor the passes multiply the gradient by with the inverse loss scale, so the momentum stays
what the allreduce returned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import host, kernels
from ..compress import decompress_pieces_, pack_signs
from ..kernels import fused
from ..state.layout import FlatLayout
from .comm import Call, CompressedAllreduce
from .exchange import Exchange, phase_exchange
from .model_allreduce import ModelAllreduce, ModelCall, bucket_runs


def unpacked_because(
    layout: FlatLayout, scale_per: str, masked: bool = False, clips_result: bool = False
) -> str | None:
    """Why :class:`PackedMomentumStage` cannot run the compression steps on the parameters of
    ``layout``, or ``None`` where it can: parameters all fp32, bf16 or fp16 (the passes read a
    low-precision gradient and update a parameter in place, rounding as torch's ops do:
    :data:`~onebit.kernels.fused.DTYPES`), on a backend with the fused passes, with a scale per
    tensor. Where it cannot, the optimizer keeps an fp32 momentum: 4 + 1/n model sizes for 1-bit
    Adam.

    It cannot (yet) with ``scale_per="bucket"`` (the passes take a scale per tensor), with
    parameters of mixed dtypes (one dtype per pass), with ``masked`` (an ``exp_avg_mask``) on a
    backend whose passes do not read masks (``packs_masked_momentum``: the C and Triton kernels
    do, a masked momentum being ``±σ·mask``), nor with ``clips_result``: ``overlap_backward``
    and ``max_grad_norm`` together, where the buckets leave before the rank's norm is known, so
    the result is clipped and is no longer ``±σ``. Parameters that are not contiguous but fill
    their memory (``channels_last``, a transpose) are packed: the flat layout follows their
    memory order."""
    if layout.numel == 0:
        return "no parameters"
    if scale_per != "tensor":
        return f'scale_per="{scale_per}": the fused passes take a scale per tensor'
    if clips_result:
        return (
            "overlap_backward with max_grad_norm: the buckets leave before the rank's norm is "
            "known, so the result is clipped and is no longer ±σ"
        )
    problem = _parameters_problem(layout, fused.DTYPES)
    if problem is None and masked:
        backend = kernels.for_tensors(*layout.params)
        if not backend.packs_masked_momentum:
            problem = f"exp_avg_mask: the {backend.name} kernels' passes do not read masks"
    return problem


def fused_parameters(layout: FlatLayout, dtypes: Sequence[torch.dtype] = (torch.float32,)) -> bool:
    """Whether the backend of the parameters of ``layout`` has the fused passes and they can
    update them in place: all of one dtype, one of ``dtypes``, and in the layout's order
    (:meth:`~onebit.state.layout.FlatLayout.in_order`). Checked at every step, since
    ``model.half()``, ``model.cuda()`` or ``.to(memory_format=...)`` can change it."""
    return _parameters_problem(layout, dtypes) is None


def _parameters_problem(layout: FlatLayout, dtypes: Sequence[torch.dtype]) -> str | None:
    """Why the fused passes cannot update the parameters of ``layout`` (see
    :func:`fused_parameters`), or ``None``."""
    params = layout.params
    backend = kernels.for_tensors(*params)
    if not backend.packs_momentum:
        return f"the {backend.name} kernels have no fused passes"
    found = {p.dtype for p in params}
    if len(found) > 1:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in found))
        return f"parameters of mixed dtypes ({names}): each pass takes one"
    if found and (dtype := found.pop()) not in dtypes:
        return f"{str(dtype).removeprefix('torch.')} parameters"
    if not all(layout.in_order(i, p) for i, p in enumerate(params)):
        return "parameters that do not fill their memory in the layout's order"
    return None


class PackedMomentumStage:
    """The momentum and the fused compression steps of one 1-bit Adam optimizer.

    Args:
        layout: the optimizer's flat layout.
        comms: one communicator per bucket, with a scale per tensor (``segments``).
        momentum: the flat fp32 momentum, ``layout.padded_numel`` long. While :attr:`packed` is
            ``None`` it holds the momentum; from the first applied step it holds the worker
            errors (each communicator's ``worker_error`` is a slice of it), or where they are
            kept in bf16, its storage is released (resized to nothing, the way FSDP frees a
            parameter's) until the momentum is unpacked or loaded into it again.
        keeps_last: the optimizer reads the last momentum after the allreduce (1-bit LAMB), so
            the results become the momentum only at :meth:`install`; at the first applied step
            the worker errors are committed there too, into the fp32 momentum's storage once
            it has been read (so the step holds no second model-sized buffer).
        masks: the optimizer's ``exp_avg_mask``, ``(offset in the flat buffers, flat 0/1 uint8
            mask)`` per masked parameter: the momentum is then the allreduce's result times the
            mask, which the passes read where they read the packed momentum (1-bit LAMB's
            fresh variance reads the result before it: :meth:`momentum_`).

    Attributes:
        packed: per bucket, the momentum as ``(signs, scales)`` of the last allreduce
            (:meth:`~onebit.wire.comm.CompressedAllreduce.result_signs`), or ``None`` while the
            momentum is the fp32 buffer.
    """

    def __init__(
        self,
        layout: FlatLayout,
        comms: list[CompressedAllreduce],
        momentum: Tensor,
        keeps_last: bool = False,
        masks: Sequence[tuple[int, Tensor]] = (),
    ) -> None:
        self.layout, self.comms, self.momentum = layout, comms, momentum
        self.keeps_last, self.masks = keeps_last, list(masks)
        self._mask_bases: Tensor | None = None  # per parameter, its mask's address (or 0)
        if self.masks:
            bases = dict.fromkeys(layout.offsets, 0)
            bases.update((offset, mask.data_ptr()) for offset, mask in self.masks)
            addresses = [bases[o] for o in layout.offsets]
            self._mask_bases = torch.tensor(addresses, device=momentum.device)
        self._bases = host.Uploaded(torch.int64)
        self.runs = bucket_runs(layout, comms)
        self.model = ModelAllreduce(layout, comms, self.runs)
        self._slices = layout.bucket_views(momentum, padded=True)
        self.compact = comms[0].error_dtype != torch.float32 if comms else False
        self._errors, self._error_slices = (None, []) if self.compact else (momentum, self._slices)
        self.packed: list[tuple[Tensor, Tensor]] | None = None
        self._whole: tuple[Tensor, Tensor] | None = None  # packed's phase-2 message and scales
        self._whole_of: list[tuple[Tensor, Tensor]] | None = None  # the packed it is of
        self._served: tuple[Tensor, Tensor] | None = None  # commit_all's, until results()
        self._results: tuple[list, tuple[Tensor, Tensor]] | None = None  # results()' whole
        self._scaled: tuple[Tensor, Tensor] | None = None  # see _divided
        self._deferred: dict[int, Callable[[], None]] = {}  # commits that wait for install()
        self._block_pieces: dict[tuple[int, int, int], Tensor] = {}  # see momentum_

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (:func:`fused_parameters`): the passes read the gradients and
        update the parameters in it."""
        return self.layout.params[0].dtype

    def _source(self, k: int) -> Tensor | fused.PackedMomentum:
        if self.packed is None:
            return self._slices[k]
        signs, scales = self.packed[k]
        chunk = self.comms[k].chunk_numel
        return fused.PackedMomentum(signs, scales.reshape(-1), chunk, self._mask_bases)

    # Every bucket at once, where the backend runs each pass over all of them (Triton).

    def passes(self) -> Any | None:
        """The backend's passes over every bucket at once (:class:`~onebit.wire.model_allreduce.
        ModelAllreduce`), or ``None`` where it runs them a bucket at a time."""
        return self.model.passes()

    def start_all(
        self,
        grads: Tensor,
        inv_scale: float | Tensor | None,
        beta1: float,
        headers: Tensor,
        scaling: Tensor | None = None,
        keep: Sequence[Tensor] = (),
    ) -> ModelCall:
        """Every bucket's pass 1 and phase 1, as :meth:`start` does for one, in one launch and
        one collective (``headers``: ``[buckets, header_numel]``; a step's are the same in
        every bucket)."""
        inputs = (grads, inv_scale, self._momentum_source(), 1 - beta1, self._error(), scaling)
        call = ModelCall(phase_exchange(self.comms, 1), inputs=inputs, keep=keep)
        with call.exchange.filling() as exchange:
            call.scales = self.passes().signs(*inputs, self.comms[0].scale, headers,
                                              exchange.message, self.dtype)  # fmt: skip
        return call

    def commit_all(self, call: ModelCall) -> None:
        """After :meth:`~onebit.wire.model_allreduce.ModelAllreduce.received` found every scale
        finite: commit every worker error, serve this rank's chunks and send them (phase 2, one
        collective), and make the results the momentum; with :attr:`keeps_last`, :meth:`results`
        (``None``) gives them and :meth:`install` makes them the momentum."""

        def commit() -> None:
            self.passes().commit(*call.inputs, call.scales, self._error_buffer(), self.dtype)
            for view, comm in zip(self._error_slices, self.comms):
                if comm.kept_worker_error is not view:
                    comm.worker_error = view

        if self.keeps_last and self.packed is None:  # the fp32 momentum is read after
            self._deferred = {-1: commit}
        else:
            commit()
        self._served = self.model.serve(call)
        if not self.keeps_last:
            self.install(self.results(None))

    def _momentum_source(self) -> Tensor | fused.PackedMomentum:
        """The momentum as the passes over every bucket read it (:meth:`whole`)."""
        return self.whole(self.packed)

    def whole(self, packed: list[tuple[Tensor, Tensor]] | None) -> Tensor | fused.PackedMomentum:
        """``packed`` (:attr:`packed`, or :meth:`results`) as the passes over every bucket read
        it: a phase-2 message and its scales (made from the buckets' if they came apart), or
        the fp32 buffer for ``None``."""
        if packed is None:
            return self.momentum
        if self._results is not None and self._results[0] is packed:
            return fused.PackedMomentum(*self._results[1], 0, self._mask_bases)
        if self._whole_of is not packed:
            g = self.model.passes().geometry
            bits = torch.zeros(g.world_size, g.width2, dtype=torch.uint8,
                               device=self.momentum.device)  # fmt: skip
            for (signs, _), part in zip(packed, g.parts2):
                bits[:, part : part + signs.shape[1]] = signs
            scales = torch.cat([scales.reshape(-1) for _, scales in packed])
            self._whole, self._whole_of = (bits, scales), packed
        return fused.PackedMomentum(*self._whole, 0, self._mask_bases)

    def _error_buffer(self) -> Tensor:
        """Where the worker errors live once packed (``_error_slices``, per bucket): the fp32
        momentum's storage, or with bf16 errors a buffer of their own, made when first asked."""
        if self._errors is None:
            dtype, device = self.comms[0].error_dtype, self.momentum.device
            self._errors = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
            self._error_slices = self.layout.bucket_views(self._errors, padded=True)
        return self._errors

    def _error(self) -> Tensor | None:
        """Every worker error in one buffer: ``None`` (zeros, before the first applied step),
        :meth:`_error_buffer` (where they live once packed), or a copy of errors kept apart (a
        checkpoint loaded with an fp32 momentum)."""
        errors = [c.kept_worker_error for c in self.comms]
        if all(e is None for e in errors):
            return None
        if self._errors is not None and all(e is s for e, s in zip(errors, self._error_slices)):
            return self._errors
        buffer = torch.zeros_like(self.momentum, dtype=self.comms[0].error_dtype)
        for error, slice_ in zip(errors, self.layout.bucket_views(buffer, padded=True)):
            if error is not None:
                slice_.copy_(error)
        return buffer

    def start(
        self,
        k: int,
        grads: Tensor,
        inv_scale: float | Tensor | None,
        beta1: float,
        header: Tensor | None,
        scaling: Tensor | None = None,
        exchange: tuple[Exchange, int] | None = None,
        keep: Sequence[Tensor] = (),
    ) -> Call:
        """Bucket ``k``'s passes 1 and phase 1: the signs and scales of
        ``lerp(m, g, 1 - beta1)·scaling + e`` (``grads``: each parameter's gradient address, see
        :func:`~onebit.kernels.fused.gradient_addresses`, ``keep`` the copies they point into;
        ``scaling``: fp32 per parameter, or ``None``), sent with ``header`` (in ``exchange``'s
        part, if given). The worker error is committed by the communicator's ``serve`` once
        every rank's scales are finite, or with :attr:`keeps_last` at the first applied step
        by :meth:`install`."""
        comm, runs, m = self.comms[k], self.runs[k], self._source(k)
        weight, post = 1 - beta1, scaling
        error = comm.kept_worker_error  # None: zeros, until the first applied step
        signs = torch.empty(comm.padded_numel // 8, dtype=torch.uint8, device=self.momentum.device)
        scales = fused.signs(runs, grads, inv_scale, m, weight, error, signs, comm.scale, post,
                             self.dtype)  # fmt: skip

        def commit(keep: Sequence[Tensor] = keep) -> None:  # holds keep until it runs
            if error is None:  # the momentum's storage (or the bf16 errors') becomes the error
                self._error_buffer()
                comm.worker_error = self._error_slices[k]
            fused.commit(runs, grads, inv_scale, m, weight, error, scales, comm.worker_error,
                         post, self.dtype)  # fmt: skip

        if error is None and self.keeps_last:  # the fp32 momentum is read after
            self._deferred[k] = commit
            return comm.start_compressed(signs, scales, header, commit=lambda: None,
                                         exchange=exchange)  # fmt: skip

        return comm.start_compressed(signs, scales, header, commit=commit, exchange=exchange)

    def finish(self, calls: list[Call]) -> None:
        """After an applied step: the allreduce's packed results are the new momentum."""
        self.install(self.results(calls))

    def results(
        self, calls: list[Call] | None, scaling: Tensor | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """The packed results of applied ``calls`` (``None``: of :meth:`commit_all`), with each
        piece's scale divided by its parameter's ``scaling`` (fp32 per parameter; ``None``: as
        they came)."""
        if calls is None:
            received, scales = self._served
            if scaling is not None:
                scales = self._divided(scales, scaling)
            results = self.model.results(received, scales)
            self._results = (results, (received, scales))
            return results
        results = [comm.result_signs(call) for comm, call in zip(self.comms, calls)]
        if scaling is None:
            return results
        divided = []
        for runs, (signs, scales) in zip(self.runs, results):
            scales, (columns, params) = scales.clone(), runs.columns_and_params(scales.device)
            scales.view(-1)[columns] = scales.view(-1)[columns] / scaling.to(scales)[params]
            divided.append((signs, scales))
        return divided

    def _divided(self, scales: Tensor, scaling: Tensor) -> Tensor:
        """:meth:`results`' division of every bucket's scales at once (as the phase-2 message
        holds them, end to end): each column's by its parameter's ``scaling``."""
        if self._scaled is None or self._scaled[0].device != scales.device:
            entries, params = [], []
            for runs, offset in zip(self.runs, self.passes().column_offsets):
                real = runs.run_params >= 0
                entries.append(runs.runs[real, 3] + offset)
                params.append(runs.run_params[real])
            tables = (torch.cat(entries), torch.cat(params))
            self._scaled = host.upload(torch.stack(tables), scales.device).unbind()
        entries, params = self._scaled
        divided = scales.clone()
        divided[entries] = scales[entries] / scaling.to(scales)[params]
        return divided

    def install(self, packed: list[tuple[Tensor, Tensor]]) -> None:
        """Make ``packed`` (:meth:`results`) the momentum; the worker errors move into
        :meth:`_error_buffer` if they were kept apart, or are committed there if the step's
        commits waited for it (:attr:`keeps_last`). With bf16 errors the fp32 momentum's
        storage is released."""
        deferred, self._deferred = self._deferred, {}
        for commit in deferred.values():
            commit()
        self._errors_in_place()
        self.packed = packed
        self._release_momentum()
        if self._results is not None and self._results[0] is packed:  # passes read it whole
            self._whole, self._whole_of = self._results[1], packed
        self._served = self._results = None

    def _errors_in_place(self) -> None:
        """Move the worker errors kept apart into :meth:`_error_buffer`."""
        if all(c.kept_worker_error is None for c in self.comms):
            return
        self._error_buffer()
        for slice_, comm in zip(self._error_slices, self.comms):
            error = comm.kept_worker_error
            if error is not None and error is not slice_:
                slice_.copy_(error)
                comm.worker_error = slice_

    def _release_momentum(self) -> None:
        """With bf16 errors, free the fp32 momentum's storage while the momentum is packed."""
        if self.compact and self.packed is not None:
            self.momentum.untyped_storage().resize_(0)

    def _restore_momentum(self) -> None:
        """Give the fp32 momentum its storage back (its values are to be written)."""
        storage = self.momentum.untyped_storage()
        nbytes = self.momentum.numel() * self.momentum.element_size()
        if storage.nbytes() < nbytes:
            storage.resize_(nbytes)

    def momentum_(
        self,
        k: int,
        out: Tensor,
        packed: list[tuple[Tensor, Tensor]] | None = None,
        start: int = 0,
        masked: bool = True,
    ) -> Tensor:
        """Bucket ``k``'s momentum (``packed``, else the current one) into ``out`` (fp32): the
        whole bucket's ``end - start`` elements, or from ``start`` one of its :meth:`blocks`;
        without ``masked``, a packed one before its masks (the allreduce's result)."""
        packed = self.packed if packed is None else packed
        origin, end = self.layout.buckets[k]
        if packed is None:
            return out.copy_(self.momentum[origin + start : origin + start + out.numel()])
        geometry = self.comms[k].scale_geometry
        if start == 0 and out.numel() == end - origin:
            decompress_pieces_(*packed[k], geometry.gathered, out)
            return self._masked(out, origin) if masked else out
        signs, scales = packed[k]
        j, a = divmod(start, self.comms[k].chunk_numel)
        key = (k, start, out.numel())
        if key not in self._block_pieces:
            table = geometry.gathered[geometry.gathered[:, 0] == j].clone()
            table[:, 0] = 0  # the one row decompressed
            table[:, 1:3] = table[:, 1:3].clamp(a, a + out.numel()) - a
            self._block_pieces[key] = table[table[:, 1] < table[:, 2]].contiguous()
        pieces = self._block_pieces[key]
        decompress_pieces_(signs[j : j + 1, a // 8 :], scales[j : j + 1], pieces, out)
        return self._masked(out, origin + start) if masked else out

    def _masked(self, out: Tensor, start: int) -> Tensor:
        """``out``, the packed momentum's elements from ``start`` in the flat buffers, times the
        masks over them (``masks``), as the passes read it."""
        end = start + out.numel()
        for offset, mask in self.masks:
            a, b = max(start, offset), min(end, offset + mask.numel())
            if a < b:
                out[a - start : b - start].mul_(mask[a - offset : b - offset])
        return out

    def blocks(self, k: int, size: int) -> list[tuple[int, int]]:
        """Bucket ``k``'s elements (not its padding) as ranges ``[lo, hi)`` of at most ``size``
        elements (a multiple of 8) within one chunk each: what :meth:`momentum_` decompresses
        from a ``start``, so that a caller walks the bucket in temporaries of ``size``."""
        origin, end = self.layout.buckets[k]
        chunk = self.comms[k].chunk_numel
        return [
            (lo, min(lo + size, row + chunk, end - origin))
            for row in range(0, end - origin, chunk)
            for lo in range(row, min(row + chunk, end - origin), size)
        ]

    def update_(
        self,
        denominator: Tensor,
        lrs: Sequence[float],
        weight_decays: Sequence[float],
        step_scale: float,
    ) -> None:
        """AdamW's update from the packed momentum: ``p = p·(1 - lr·wd) + (-lr·step_scale)·m /
        denominator``, with each parameter's ``lrs[i]`` and ``weight_decays[i]``."""
        device = self.momentum.device
        bases = self._bases([p.data_ptr() for p in self.layout.params], device)
        decay = [1 - lr * wd if wd else 1.0 for lr, wd in zip(lrs, weight_decays)]
        value = [-lr * step_scale for lr in lrs]
        decay, value = host.upload_rows([decay, value], device, torch.float32)
        passes = self.passes()
        if passes is not None:
            passes.update(bases, self._momentum_source(), denominator, decay, value, self.dtype)
            return
        for k, (start, end) in enumerate(self.layout.buckets):
            fused.update(self.runs[k], bases, self._source(k), denominator[start:end], decay,
                         value, self.dtype)  # fmt: skip

    def materialize(self) -> Tensor:
        """The momentum as a new flat fp32 buffer (``layout.numel``)."""
        if self.packed is None:
            return self.momentum[: self.layout.numel].clone()
        out = self.layout.zeros(device=self.momentum.device)
        for (start, end), comm, packed in zip(self.layout.buckets, self.comms, self.packed):
            decompress_pieces_(*packed, comm.scale_geometry.gathered, out[start:end])
        return self._masked(out, 0)

    def unpack_(self) -> None:
        """Back to an fp32 momentum in :attr:`momentum`, the worker errors in buffers of their
        own: what the unfused path needs (the parameters stopped suiting the kernels)."""
        if self.packed is None:
            return
        m = self.materialize()
        if not self.compact:  # the errors leave the momentum's storage
            for comm in self.comms:
                error = comm.kept_worker_error
                if error is not None:
                    comm.worker_error = error.clone()
        self._restore_momentum()
        self.momentum[: self.layout.numel].copy_(m)
        self.packed = None

    def detach(self) -> Callable[[], None]:
        """Before a checkpoint is loaded: forget the packed momentum and the errors, so that the
        loaded ones come in as fp32 buffers apart (:meth:`reload`); return what undoes it."""
        packed, errors = self.packed, [c.kept_worker_error for c in self.comms]
        self.packed = None
        for comm in self.comms:
            comm.worker_error = None
        self._restore_momentum()

        def undo() -> None:
            self.packed = packed
            for comm, error in zip(self.comms, errors):
                comm.worker_error = error
            self._release_momentum()

        return undo

    def reload(self, packed: bool) -> None:
        """After a checkpoint was loaded into :attr:`momentum` and the communicators: pack it
        again if it was saved packed (:meth:`load_`)."""
        errors = [c.kept_worker_error for c in self.comms]
        self.load_(self.momentum[: self.layout.numel].clone(), errors, packed)

    def load_(self, momentum: Tensor, worker_errors: list[Tensor | None], packed: bool) -> None:
        """Take a saved fp32 ``momentum`` (``layout.numel``) and the communicators' saved worker
        errors. With ``packed`` (it was saved from a packed momentum) the momentum is packed
        again, which loses nothing as every element is ``±σ`` of its piece (times its mask, which
        keeps the sign: ``-σ·0`` is ``-0.0``), and the errors move into :meth:`_error_buffer`;
        otherwise, or if it is not of that form after all, the fp32 momentum and the errors
        stay apart."""
        self._restore_momentum()
        self.momentum[: self.layout.numel].copy_(momentum)
        self.packed = None
        if not packed:
            return
        packed, device = [], self.momentum.device
        for (start, end), comm in zip(self.layout.buckets, self.comms):
            padded = torch.zeros(comm.padded_numel, device=device)
            padded[: end - start] = momentum[start:end]
            signs = pack_signs(torch.where(padded.signbit(), -1.0, 1.0))  # -0.0 stays -0.0
            signs = signs.view(comm.world_size, -1)
            table = comm.scale_geometry.gathered  # rows: chunk j, start, end, column c
            first = table[:, 0] * comm.chunk_numel + table[:, 1]
            scales = torch.zeros(comm.world_size, comm.server_scale_count, device=device)
            scales[table[:, 0], table[:, 3]] = padded[first].abs()
            if self.masks:  # a masked piece's σ is its largest magnitude (a 0/1 mask's)
                for j, a, b, c in table.tolist():
                    scales[j, c] = padded[j * comm.chunk_numel :][a:b].abs().amax()
            again = torch.empty(end - start, device=device)
            decompress_pieces_(signs, scales, table, again)
            self._masked(again, start)
            if not torch.equal(again.view(torch.int32), momentum[start:end].view(torch.int32)):
                packed = None
                break
            packed.append((signs, scales))
        if packed is None:
            return
        self._error_buffer()
        for slice_, comm, error in zip(self._error_slices, self.comms, worker_errors):
            if error is None:
                slice_.zero_()
            else:
                slice_.copy_(error)
            comm.worker_error = slice_
        self.packed = packed
        self._release_momentum()


class PacksMomentum:
    """What 1-bit Adam and 1-bit LAMB add to :class:`~onebit.optim.base.CompressedOptimizer`: their
    momentum kept packed in the compression stage, where it applies.

    Attributes:
        packed_momentum: the :class:`PackedMomentumStage`, or ``None`` where the momentum is not
            packed (:meth:`check_packed` says whether it still is).
    """

    packed_momentum: PackedMomentumStage | None = None
    _unpacked: str | None = None  # why packed_momentum is None (unpacked_because)

    def _pack_momentum(
        self, momentum: Tensor, keeps_last: bool = False, clips_result: bool = False
    ) -> None:
        """Make the packed momentum stage on the flat momentum ``momentum`` where it applies,
        else say why not in ``_unpacked``."""
        masked = bool(self.masks)
        self._unpacked = unpacked_because(self.layout, self.scale_per, masked, clips_result)
        if self._unpacked is None:
            self.packed_momentum = PackedMomentumStage(
                self.layout, self.comms, momentum, keeps_last=keeps_last, masks=self.masks
            )

    def check_packed(self) -> PackedMomentumStage | None:
        """The packed momentum stage, if the parameters still suit its kernels; once they do not
        (one layer cast to another dtype, or given other strides) it is unpacked, and the
        unfused path runs from then on."""
        stage = self.packed_momentum
        if stage is not None and not fused_parameters(self.layout, fused.DTYPES):
            stage.unpack_()
            self.packed_momentum = None
            self._unpacked = unpacked_because(self.layout, self.scale_per)
            self.flat.expose("exp_avg", stage.momentum)
        return self.packed_momentum
