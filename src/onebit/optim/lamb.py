"""1-bit LAMB (Li et al., 2021; SPEC section 5)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from .. import host
from ..freeze import AutoFreeze, FreezeSchedule
from ..functional import (
    adam_denominator,
    adam_moments_,
    fill_zero_variance_,
    lamb_factor,
    layer_norms,
    momentum_scaling,
    scaled_sub_,
    trust_ratio,
)
from ..wire.momentum import PacksMomentum
from .adam_step import GROUP_KEYS, AdamHyper, AdamWarmup, check_adam_hyperparameters
from .base import CompressedOptimizer
from .checkpoint import NoState, StatePart
from .options import DEFAULT_BUCKET_SIZE, apply_masks_, shared_options
from .stage import Stage, Taken

BLOCK = 1 << 20
"""Elements of the temporaries a compression step takes after its allreduce where the backend
has no pass over every bucket (the C kernels): it walks each bucket in blocks this long, in two
buffers of 4 MiB whatever the bucket size."""


class _Warmup(Stage):
    """LAMB on gradients averaged at full precision, keeping a moving average of each layer's
    trust ratio for the freeze."""

    name = "warmup"

    def shows(self) -> dict[str, Tensor | None]:
        opt = self.optimizer
        return {"exp_avg": opt._exp_avg, "exp_avg_sq": opt._exp_avg_sq}

    def enter(self) -> None:
        opt = self.optimizer
        opt.bucketer.grads_as_views = True
        opt._exp_avg_sq_fresh = None

    def step(self, t: int) -> Taken:
        opt = self.optimizer
        m, v = opt._exp_avg[: opt.layout.numel], opt._exp_avg_sq
        applied, nbytes = opt.engine.average_gradients()
        if applied:
            hyper = opt._hyper
            adam_moments_(m, v, opt.engine.grads, hyper.beta1, hyper.beta2)
            bc1 = hyper.bc1(t)
            params, ms = opt.layout.params, opt.layout.views(m)
            norms = []
            for group, part, denoms in opt._adam.denominators(v, t, hyper):  # a chunk at a time
                updates = torch._foreach_div(ms[part], denoms)  # Adam's update, m̂ / denom
                del denoms
                torch._foreach_div_(updates, bc1)
                if group["weight_decay"]:
                    torch._foreach_add_(updates, params[part], alpha=group["weight_decay"])
                weight_norms = opt.shards.layer_norms(params[part])
                update_norms = opt.shards.layer_norms(updates)
                coeffs = trust_ratio(weight_norms, update_norms, opt.min_coeff, opt.max_coeff)
                scaled_sub_(params[part], updates, [group["lr"] * c for c in coeffs.tolist()])
                norms.append((weight_norms, update_norms, coeffs))
            weight_norms, update_norms, coeffs = (torch.cat(x) for x in zip(*norms))
            # Only defined ratios (no zero norm) enter the average that will be frozen.
            defined = (weight_norms > 0) & (update_norms > 0)
            ema = opt._coeff_ema * opt.coeff_beta + coeffs * (1 - opt.coeff_beta)
            opt._coeff_ema = torch.where(defined, ema, opt._coeff_ema)
            opt._coeff_updates += defined
            opt._coeffs = coeffs
        return Taken(applied, nbytes)


class _Compression(Stage):
    """The 1-bit steps: each layer's momentum, scaled to a common size, goes through the
    compressed allreduce; the change of momentum gives the averaged gradient and the fresh
    variance, whose ratio to the frozen one corrects the frozen trust ratio. Its first step
    freezes the variance, the trust ratios and the momentum scaling."""

    name = "compression"
    frozen = True

    def __init__(self, optimizer: OnebitLamb) -> None:
        super().__init__(optimizer)
        self._uploaded_scaling: tuple[Tensor, Tensor] | None = None
        self._addresses = host.Uploaded(torch.int64)
        self._uploaded_decays = host.Uploaded(torch.float32)
        self._scratches: dict[int, Tensor] = {}  # see _scratch

    def shows(self) -> dict[str, Tensor | None]:
        opt = self.optimizer
        fresh = opt._exp_avg_sq_fresh
        return {"exp_avg": opt._exp_avg, "frozen_denom": opt._exp_avg_sq, "exp_avg_sq_fresh": fresh}

    def enter(self) -> None:
        opt = self.optimizer
        opt.bucketer.grads_as_views = False
        if opt._exp_avg_sq_fresh is None:
            opt._exp_avg_sq_fresh = opt.flat.zeros()

    def step(self, t: int) -> Taken:
        opt = self.optimizer
        if not opt._frozen:
            self._freeze()
        opt.engine.clip_own_gradient()
        if opt._packed_stage() is not None:
            return self._packed_step(t)
        return self._unpacked_step(t)

    def _device_scaling(self) -> Tensor:
        """The momentum scaling (a host vector, fixed from the freeze on) on the optimizer's
        device: uploaded once per value, so that no bucket's pass uploads it again."""
        opt = self.optimizer
        cached = self._uploaded_scaling
        if cached is None or cached[0] is not opt._scaling or cached[1].device != opt.device:
            uploaded = host.upload(opt._scaling, opt.device, torch.float32)
            self._uploaded_scaling = cached = (opt._scaling, uploaded)
        return cached[1]

    def _unpacked_step(self, t: int) -> Taken:
        """The compression step in torch ops on flat buffers: the averaged momentum, the
        gradient it implies, the fresh variance, the factors and the update all pass through
        the gradient buffer."""
        opt = self.optimizer
        beta1, beta2 = opt._hyper.beta1, opt._hyper.beta2
        m, frozen_denom = opt._exp_avg[: opt.layout.numel], opt._exp_avg_sq
        v_fresh = opt._exp_avg_sq_fresh
        assert v_fresh is not None
        g = opt.engine.gather_grads()
        views = opt.layout.views(g)
        scaling = opt._scaling.tolist()
        torch.lerp(m, g, 1 - beta1, out=g)
        torch._foreach_mul_(views, scaling)
        applied, nbytes = opt.engine.compressed_allreduce()  # in place: g is the averaged momentum
        if applied:
            torch._foreach_div_(views, scaling)
            m.mul_(-beta1).add_(g).div_(1 - beta1)  # the averaged gradient the momentum implies
            v_fresh.mul_(beta2).addcmul_(m, m, value=1 - beta2)
            m.copy_(g)
            apply_masks_(m, opt._masks)
            fresh = opt._hyper.denominator(v_fresh, t, out=opt.engine.grads)
            torch.div(frozen_denom, fresh, out=g)
            raw = opt.shards.layer_norms(views, math.inf)  # each layer's largest ratio
            raw = torch.where(torch.tensor(opt.shards.numels()) > 0, raw, 1.0)
            update = self._adam_update(m, frozen_denom, t)
            update_ratio = None
            if any(group["weight_decay"] for group in opt.param_groups):
                adaptive = opt.shards.layer_norms(views)
                self._add_weight_decay(update)
                total = opt.shards.layer_norms(views)
                update_ratio = torch.where(total > 0, adaptive / total, 1.0).clamp_(max=1.0)
            factors = lamb_factor(
                raw,
                opt._last_factors,
                opt.factor_min,
                opt.factor_max,
                opt.factor_threshold,
                update_ratio,
            )
            opt._last_factors = factors
            self._apply(update, opt._frozen_coeffs * factors)
        return Taken(applied, nbytes)

    def _packed_step(self, t: int) -> Taken:
        """The compression step of :meth:`_unpacked_step` with the momentum packed
        (:class:`~onebit.wire.momentum.PackedMomentumStage`) and no gradient buffer: the fused
        passes read ``.grad``; what follows the allreduce takes two passes over every bucket
        where the backend has them (Triton), else walks each bucket in blocks (:meth:`_blocks`),
        bit for bit as the unpacked step, on two temporaries of a block (and one of a layer,
        for the norms that weight decay needs)."""
        opt = self.optimizer
        scaling = self._device_scaling()
        applied, nbytes, calls = opt.engine.packed_allreduce(opt._fused, scaling)
        if not applied:
            return Taken(applied, nbytes)
        stage = opt._fused
        new = stage.results(calls, scaling)  # the averaged momentum over the scaling
        decays = [group["weight_decay"] for group in self._groups()]
        passes = stage.model.passes()  # also where the allreduce went a bucket at a time
        layers = len(opt.layout.params)
        if passes is not None:
            values = host.read(self._model_ratios(passes, new, t, decays))  # the step's one
            maxima, norms = values[:layers], values[-2 * layers :]  # read after its verdict
        else:
            ratios, layers_of = self._fresh_variance_(new, t)
            parts = [ratios]
            if any(decays):
                parts.append(self._packed_update_norms(new, t))
            values = host.read_all(parts)
            maxima = self._part_maxima(values[: len(ratios)], layers_of)
            norms = values[len(ratios) :]
        update_ratio = None
        if any(decays):
            adaptive, total = (opt.shards.combine(n) for n in norms.view(2, -1))
            update_ratio = torch.where(total > 0, adaptive / total, 1.0).clamp_(max=1.0)
        factors = lamb_factor(
            self._layer_ratios(maxima), opt._last_factors, opt.factor_min, opt.factor_max,
            opt.factor_threshold, update_ratio,
        )  # fmt: skip
        opt._last_factors = factors
        opt._coeffs = opt._frozen_coeffs * factors
        sizes = [group["lr"] * c for group, c in zip(self._groups(), opt._coeffs.tolist())]
        if passes is not None:
            bc1 = opt._hyper.bc1(t)
            step_sizes = host.upload(sizes, opt.device, torch.float32)
            passes.lamb_update(self._param_addresses(), stage.whole(new), opt._exp_avg_sq,
                               self._decays(decays), step_sizes, bc1, stage.dtype)  # fmt: skip
        else:
            for indices, params, updates in self._packed_updates(new, t):
                scaled_sub_(params, updates, [sizes[i] for i in indices])
        stage.install(new)
        opt.flat.expose("exp_avg", None)  # packed now: see state_dict()
        self._scratches.clear()
        return Taken(applied, nbytes)

    def _model_ratios(
        self, passes: Any, new: list[tuple[Tensor, Tensor]], t: int, decays: list[float]
    ) -> Tensor:
        """From the last and the ``new`` packed momentum, in one pass over every bucket
        (``passes``: :class:`~onebit.kernels.triton_model.ModelPasses`): the fresh variance, and
        on the device each layer's largest ratio of the frozen to the fresh denominator, then
        with weight decay each layer's ``||m̂ / denom||`` and ``||update||``."""
        opt = self.optimizer
        stage, hyper = opt._fused, opt._hyper
        last = stage.whole(stage.packed)  # first: new's, made from its buckets, may evict it
        return passes.lamb_ratios(
            self._param_addresses(), stage.whole(new), last, opt._exp_avg_sq_fresh,
            opt._exp_avg_sq, self._decays(decays), (hyper.beta1, hyper.beta2),
            (hyper.bc1(t), hyper.bc2(t)), hyper.eps, any(decays),
            stage.dtype,
        )  # fmt: skip

    def _param_addresses(self) -> Tensor:
        """Each layer's address on the device (int64), uploaded when they change."""
        opt = self.optimizer
        return self._addresses([p.data_ptr() for p in opt.layout.params], opt.device)

    def _decays(self, decays: list[float]) -> Tensor:
        """Each layer's weight decay on the device (fp32), uploaded when it changes."""
        opt = self.optimizer
        return self._uploaded_decays(decays, opt.device)

    def _fresh_variance_(self, new: list[tuple[Tensor, Tensor]], t: int) -> tuple[Tensor, list]:
        """From the last and the ``new`` packed momentum, a block at a time (:meth:`_blocks`):
        the averaged gradient they imply into the fresh variance. Returns the largest ratio of
        the frozen to the fresh denominator in each block's part of each layer (on the device)
        and the layer of each, for :meth:`_part_maxima`."""
        opt = self.optimizer
        (beta1, beta2, eps, _), stage = opt._hyper, opt._fused
        bc2 = opt._hyper.bc2(t)
        ratios, layers = [], []
        for k, lo, hi in self._blocks():
            origin = opt.layout.buckets[k][0]
            g, last = self._scratch(hi - lo), self._scratch(hi - lo, 1)
            stage.momentum_(k, g, new, lo, masked=False)  # the allreduce's result
            stage.momentum_(k, last, start=lo).mul_(-beta1).add_(g).div_(1 - beta1)
            v_fresh = opt._exp_avg_sq_fresh[origin + lo : origin + hi]
            v_fresh.mul_(beta2).addcmul_(last, last, value=1 - beta2)
            ratio = adam_denominator(v_fresh, bc2, eps, out=last)
            torch.div(opt._exp_avg_sq[origin + lo : origin + hi], ratio, out=ratio)
            indices, _, parts = self._block_parts(k, lo, ratio)
            ratios += torch._foreach_norm(parts, math.inf)  # a block's parts are fp32
            layers += indices
        return torch.stack(ratios), layers

    def _part_maxima(self, ratios: Tensor, layers: list[int]) -> Tensor:
        """Each layer's largest ratio from :meth:`_fresh_variance_`'s (read on the host) and
        their ``layers``."""
        opt = self.optimizer
        index = torch.tensor(layers)
        return torch.zeros(len(opt.layout.params)).scatter_reduce_(0, index, ratios, "amax")

    def _layer_ratios(self, maxima: Tensor) -> Tensor:
        """Each layer's largest ratio (on the host) over the shards it spans; 1 for a layer with
        no elements."""
        opt = self.optimizer
        raw = opt.shards.combine(maxima, math.inf)
        return torch.where(torch.tensor(opt.shards.numels()) > 0, raw, 1.0)

    def _packed_updates(
        self, new: list[tuple[Tensor, Tensor]], t: int, decay: bool = True
    ) -> Iterator[tuple[list[int], list[Tensor], list[Tensor]]]:
        """A block at a time (:meth:`_blocks`), its parts of the layers as :meth:`_block_parts`
        gives them, with Adam's update ``m̂ / denom`` from the ``new`` packed momentum, plus
        weight decay if ``decay``, in a temporary of the block."""
        opt = self.optimizer
        bc1 = opt._hyper.bc1(t)
        groups = self._groups()
        for k, lo, hi in self._blocks():
            origin = opt.layout.buckets[k][0]
            update = opt._fused.momentum_(k, self._scratch(hi - lo), new, lo)
            torch.div(update, opt._exp_avg_sq[origin + lo : origin + hi], out=update).div_(bc1)
            indices, params, updates = self._block_parts(k, lo, update)
            for i, p, u in zip(indices, params, updates):
                if decay and groups[i]["weight_decay"]:
                    torch._foreach_add_([u], [p], alpha=groups[i]["weight_decay"])
            yield indices, params, updates

    def _packed_update_norms(self, new: list[tuple[Tensor, Tensor]], t: int) -> Tensor:
        """Each layer's ``||m̂ / denom||`` and ``||update||`` (``[2, layers]`` on the device), for
        the ratio :func:`lamb_factor` takes: the norms taken over each whole layer as
        :meth:`_unpacked_step` takes them."""
        opt = self.optimizer
        zero = torch.zeros((), device=opt.device)
        layers = len(opt.layout.params)
        adaptive, total = [zero] * layers, [zero] * layers
        started: dict[int, tuple[Tensor, int]] = {}  # layers that go on in the next block
        groups = self._groups()
        for indices, _, updates in self._packed_updates(new, t, decay=False):
            for i, u in zip(indices, updates):
                p = opt.layout.params[i]
                whole, filled = started.pop(i, (u, 0))
                if u.numel() < p.numel():  # a part: gathered into a buffer of the layer
                    whole = torch.empty(p.numel(), device=opt.device) if filled == 0 else whole
                    whole[filled : filled + u.numel()] = u
                    if filled + u.numel() < p.numel():
                        started[i] = whole, filled + u.numel()
                        continue
                whole = whole.as_strided(p.shape, opt.layout.strides[i])  # the layout's order
                adaptive[i] = layer_norms([whole])[0]
                if groups[i]["weight_decay"]:
                    torch._foreach_add_([whole], [p], alpha=groups[i]["weight_decay"])
                total[i] = layer_norms([whole])[0]
        return torch.stack([torch.stack(adaptive), torch.stack(total)])

    def _scratch(self, numel: int, slot: int = 0) -> Tensor:
        """A temporary fp32 buffer of ``numel`` elements (at most a block's, :data:`BLOCK`) on
        the state's device: the first elements of this step's ``slot``-th buffer, which every
        block of the step reuses (:meth:`_packed_step` releases them)."""
        opt = self.optimizer
        buffer = self._scratches.get(slot)
        if buffer is None or buffer.device != opt.device:
            largest = max((hi - lo for _, lo, hi in self._blocks()), default=0)
            buffer = self._scratches[slot] = torch.empty(largest, device=opt.device)
        return buffer[:numel]

    def _blocks(self) -> Iterator[tuple[int, int, int]]:
        """Every bucket ``k``'s elements as blocks ``(k, lo, hi)`` of at most :data:`BLOCK`
        (:meth:`~onebit.wire.momentum.PackedMomentumStage.blocks`), bucket after bucket: what a
        compression step without passes over every bucket takes after its allreduce."""
        opt = self.optimizer
        for k in range(len(opt.layout.buckets)):
            for lo, hi in opt._fused.blocks(k, BLOCK):
                yield k, lo, hi

    def _groups(self) -> list[dict[str, Any]]:
        """Each parameter's param group, in layout order."""
        opt = self.optimizer
        return [group for group in opt.param_groups for _ in group["params"]]

    def _block_parts(
        self, k: int, lo: int, flat: Tensor
    ) -> tuple[list[int], list[Tensor], list[Tensor]]:
        """For each parameter with elements in the block of bucket ``k`` from ``lo`` that
        ``flat`` holds: its index, its part (flat) and the same part of ``flat``."""
        opt = self.optimizer
        start = opt.layout.buckets[k][0] + lo
        end = start + flat.numel()
        indices, params, parts = [], [], []
        for i in opt.layout.bucket_params[k]:
            o, n = opt.layout.offsets[i], opt.layout.numels[i]
            a, b = max(start, o), min(end, o + n)
            if a < b:
                indices.append(i)
                params.append(opt.layout.flat(i, opt.layout.params[i])[a - o : b - o])
                parts.append(flat[a - start : b - start])
        return indices, params, parts

    def _adam_update(self, m: Tensor, denom: Tensor, step: int) -> Tensor:
        """Adam's update ``m̂ / denom``, ``m`` bias-corrected for ``step``, into the gradient
        buffer."""
        opt = self.optimizer
        return torch.div(m, denom, out=opt.engine.grads).div_(opt._hyper.bc1(step))

    def _add_weight_decay(self, update: Tensor) -> None:
        opt = self.optimizer
        for group, params, updates in opt.flat.per_group(update):
            if group["weight_decay"] and params:
                torch._foreach_add_(updates, params, alpha=group["weight_decay"])

    def _apply(self, update: Tensor, coeffs: Tensor) -> None:
        """``p = p - lr·coeff·update`` per layer; ``update`` is used as scratch."""
        opt = self.optimizer
        opt._coeffs = coeffs.clone()
        per_layer = coeffs.tolist()
        start = 0
        for group, params, updates in opt.flat.per_group(update):
            sizes = [group["lr"] * c for c in per_layer[start : start + len(params)]]
            scaled_sub_(params, updates, sizes)
            start += len(params)

    def _freeze(self) -> None:
        """Enter the compression stage: freeze v, the trust ratios and the momentum scaling."""
        opt = self.optimizer
        v, frozen_t = opt._exp_avg_sq, opt.freeze.variance_step(opt.num_steps)
        fill_zero_variance_(opt.layout.views(v), opt._hyper.zero_variance_floor(frozen_t))
        opt._exp_avg_sq_fresh = v.clone()
        opt._hyper.denominator(v, frozen_t, out=v)
        momentum = opt.layout.views(opt._exp_avg[: opt.layout.numel])
        opt._scaling = momentum_scaling(opt.shards.layer_norms(momentum), opt.shards.numels())
        ema = opt._coeff_ema
        if opt.bias_correction:
            ema = ema / (1 - opt.coeff_beta**opt._coeff_updates)
        opt._frozen_coeffs = torch.where(opt._coeff_updates > 0, ema, 1.0)
        opt.engine.end_warmup()
        opt._set_frozen(True)
        opt.bucketer.release()  # the .grad views keep it; the compression stage gets its own


class OnebitLamb(PacksMomentum, CompressedOptimizer):
    """LAMB whose gradient communication drops to 1 bit per element after a warmup.

    LAMB (You et al., 2020) is Adam with a per-layer trust ratio: each parameter ("layer")
    moves by ``lr · coeff · update`` with ``update = m̂ / (sqrt(v̂) + eps) + weight_decay · p``
    and ``coeff = clip(||p|| / ||update||, min_coeff, max_coeff)``, which keeps large-batch
    training stable. As with :class:`~onebit.OnebitAdam`, do not wrap the model in DDP: this
    optimizer owns the communication and broadcasts the parameters from rank 0 at construction.

    Warmup, steps ``1..freeze_step``: exactly LAMB on gradients averaged by an fp32 allreduce,
    keeping an exponential moving average of each layer's trust ratio.

    Compression stage: the variance ``v_T`` is frozen, and so are each layer's trust ratio
    (its moving average) and a momentum scaling coefficient ``mean(s) / s_l`` with
    ``s_l = ||m_l|| / sqrt(numel_l)``, which brings every layer's momentum to a common scale so that
    one 1-bit scale fits the whole model. Each step updates the momentum with the local
    gradient, scales it, averages it with one compressed allreduce and scales it back. From the
    change of momentum it rebuilds the averaged gradient and keeps a fresh variance; the trust
    ratio is the frozen one times ``factor = max((sqrt(v_T)+eps) / (sqrt(v_fresh)+eps))`` over
    the layer, which corrects for the variance having moved since the freeze.

    Args:
        params: parameters or param groups. ``lr`` and ``weight_decay`` may differ per group;
            ``betas`` and ``eps`` are read from the groups at every step and must be the same in
            every group.
        lr, betas, eps, weight_decay: as LAMB (decoupled weight decay inside the update).
        freeze_step: warmup length, or ``"auto"`` to freeze once the variance is stable (see
            :class:`~onebit.freeze.AutoFreeze`). The paper warms up for about 15% of the run.
        max_coeff, min_coeff: bounds of the trust ratio (defaults 10 and 0.01). BERT recipes
            lower ``max_coeff`` (e.g. 0.3) when early steps are too large.
        coeff_beta: decay of the trust ratios' moving average (default 0.9). Closer to 1 gives
            a smoother frozen ratio that reflects more of the warmup.
        factor_max, factor_min: bounds of the fresh-variance factor (defaults 4.0 and 0.5).
        factor_threshold: the factor may move by at most this fraction of its previous value per
            step (default 0.1), so that one noisy gradient does not jolt the step size.
        bias_correction: Adam's bias correction of ``m`` and ``v``, and of the trust ratios'
            moving average. ``False`` gives the reference implementation's numbers.
        process_group: the data-parallel group; ``None`` is the default group, or a single
            process if ``torch.distributed`` is not initialised.
        bucket_size: elements per communication bucket, rounded down to a multiple of
            ``8 * world_size``.
        scale_per: ``"tensor"`` (default) gives each parameter's part of a bucket its own 1-bit
            scale, so that a large tensor (an embedding, say) does not set the steps of the small
            ones sharing its bucket; ``"bucket"`` is one scale per bucket (SPEC 2, the reference
            implementation). Each scale costs 4 bytes per message.
        auto_freeze: knobs of ``freeze_step="auto"``.
        exp_avg_mask: optional ``{parameter: mask}`` of 0/1 tensors shaped like the parameter,
            applied to the averaged momentum in the compression stage.
        max_grad_norm: clip gradients to this norm (``None``: no clipping); as
            :class:`~onebit.OnebitAdam` (``docs/SPEC.md``).
        warmup_compression: ``"fp32"`` (default, exactly LAMB on fp32-averaged gradients),
            ``"bf16"``, ``"int8"`` or ``"int4"``: as :class:`~onebit.OnebitAdam`'s.
        error_dtype: ``torch.float32`` (default) or ``torch.bfloat16``: as
            :class:`~onebit.OnebitAdam`'s (half the error buffers' memory: 0.5 + 0.5/n model
            sizes fewer).

    Entries whose variance is (about) 0 at the freeze take their tensor's mean variance, as in
    :class:`~onebit.OnebitAdam`.

    The frozen variance makes the compression stage less tolerant of too large a learning rate
    than LAMB: in the runs of ``BENCHMARKS.md`` it ended at or below LAMB's loss at LAMB's best
    rate and below, but at four times that rate it diverged where LAMB merely stopped learning.
    If the loss climbs after the freeze, lower ``lr`` or freeze later.

    With weight decay the factor is blended towards 1 by the share of the update that does not
    depend on the variance, ``min(1, ||m̂/(sqrt(v_T)+eps)|| / ||update||)``, as the reference
    implementation does (SPEC section 5 leaves this out).

    A parameter whose ``.grad`` is ``None`` counts as a zero gradient. All state is fp32 (the
    error buffers: ``error_dtype``). If any rank has a non-finite gradient, every rank skips the
    step and changes nothing (``skipped_steps``). Parameters are identical on every rank after
    every step.

    State per parameter: ``exp_avg`` and ``exp_avg_sq``; at the freeze ``exp_avg_sq`` becomes
    ``frozen_denom`` (``sqrt(v̂_T) + eps``) and ``exp_avg_sq_fresh`` appears. Per-layer scalars
    (trust ratios, scaling coefficients, factors) are in ``state_dict()["onebit"]``. Memory in the
    warmup: AdamW's (momentum and variance), as the fp32 ``.grad`` live in the bucket buffer as
    in :class:`~onebit.OnebitAdam`'s warmup. In the compression stage, with the C kernels on the
    CPU or Triton on CUDA (parameters all fp32, bf16 or fp16, contiguous or ``channels_last``,
    ``scale_per="tensor"``, with or without ``exp_avg_mask``):
    three model-sized fp32 buffers (frozen denominator, fresh variance, worker error), the server
    error and the momentum packed to 1 bit (:mod:`onebit.wire.momentum`); ``exp_avg`` then leaves
    ``optimizer.state`` and appears, fp32 and exact, in ``state_dict()``. Elsewhere also the
    fp32 momentum and a gradient buffer. ``freeze`` is the
    :class:`~onebit.freeze.FreezeSchedule`; ``freeze_step``, ``in_warmup`` and ``stage`` say
    where the warmup stands.
    """

    _rehearsal_options = {"freeze_step": 1, "auto_freeze": None}
    _stage_types = (_Warmup, _Compression)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: int | Literal["auto"],
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        bias_correction: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        scale_per: str = "tensor",
        auto_freeze: AutoFreeze | None = None,
        exp_avg_mask: Mapping[Tensor, Tensor] | None = None,
        max_grad_norm: float | None = None,
        warmup_compression: str = "fp32",
        error_dtype: torch.dtype = torch.float32,
    ) -> None:
        def check() -> FreezeSchedule:
            check_adam_hyperparameters(lr, betas, eps, weight_decay, self.param_groups)
            _check_range("min_coeff", min_coeff, "max_coeff", max_coeff)
            if not 0.0 <= coeff_beta < 1.0:
                raise ValueError(f"Invalid coeff_beta: {coeff_beta}")
            _check_range("factor_min", factor_min, "factor_max", factor_max)
            if not 0.0 <= factor_threshold < 1.0:
                raise ValueError(f"Invalid factor_threshold: {factor_threshold}")
            return FreezeSchedule(freeze_step, auto_freeze, process_group, beta2=betas[1])

        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min = factor_max, factor_min
        self.factor_threshold = factor_threshold
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, check=check, **shared_options(locals()))
        layers = len(self.layout.params)
        self._coeff_ema = torch.zeros(layers)
        self._coeff_updates = torch.zeros(layers)
        self._frozen_coeffs = torch.ones(layers)
        self._scaling = torch.ones(layers)
        self._last_factors = torch.ones(layers)
        self._coeffs = torch.ones(layers)

    _group_keys = GROUP_KEYS

    def _step_hyperparameters(self, groups: list[dict[str, Any]]) -> tuple[AdamHyper, bool]:
        return AdamHyper.of(groups, self.bias_correction)

    def _allocate_state(self) -> None:
        self._adam = AdamWarmup.of(self)
        self._exp_avg = self.flat.zeros(padded=True)  # padded: it can hold the worker errors
        self.flat.expose("exp_avg", self._exp_avg)
        self._exp_avg_sq = self.flat.zeros("exp_avg_sq")
        self._exp_avg_sq_fresh: Tensor | None = None  # the compression stage's
        self._set_frozen(False)
        self._pack_momentum(self._exp_avg, keeps_last=True)

    def _settings(self) -> dict[str, Any]:
        knobs = ("max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min")
        return {
            **super()._settings(),
            "lamb": tuple(getattr(self, k) for k in (*knobs, "factor_threshold")),
        }

    def get_lamb_coeffs(self) -> list[float]:
        """Each parameter's trust ratio in the last step, in parameter order (a copy)."""
        return self._coeffs.tolist()

    def _stage_state(self) -> StatePart:
        return _TrustRatioState(self)


class _TrustRatioState(NoState):
    """1-bit LAMB's part of a checkpoint: the per-layer trust ratios, scaling coefficients and
    factors, and the fresh variance that the freeze makes (kept if a load fails)."""

    def __init__(self, optimizer: OnebitLamb) -> None:
        self.optimizer = optimizer

    def extra_state(self) -> dict[str, Any]:
        opt = self.optimizer
        return {
            "coeff_ema": opt._coeff_ema.clone(),
            "coeff_updates": opt._coeff_updates.clone(),
            "frozen_coeffs": opt._frozen_coeffs.clone(),
            "scaling_coeffs": opt._scaling.clone(),
            "last_factors": opt._last_factors.clone(),
            "coeffs": opt._coeffs.clone(),
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        opt = self.optimizer
        opt._coeff_ema = state["coeff_ema"].clone()
        opt._coeff_updates = state["coeff_updates"].clone()
        opt._frozen_coeffs = state["frozen_coeffs"].clone()
        opt._scaling = state["scaling_coeffs"].clone()
        opt._last_factors = state["last_factors"].clone()
        opt._coeffs = state["coeffs"].clone()

    def before_load(self, saved: dict[str, Any]) -> Callable[[], None]:
        fresh = self.optimizer._exp_avg_sq_fresh

        def undo() -> None:
            self.optimizer._exp_avg_sq_fresh = fresh  # what the stages' enter() keeps

        return undo


def _check_range(low_name: str, low: float, high_name: str, high: float) -> None:
    """Raise ``ValueError`` unless ``0 < low <= high < inf``."""
    if not 0.0 < low <= high < math.inf:
        raise ValueError(
            f"need 0 < {low_name} <= {high_name}, got {low_name}={low}, {high_name}={high}"
        )
