"""1-bit LAMB's compression stage (SPEC section 5): its first step freezes the variance, the
trust ratios and the momentum scaling; each step then sends the scaled momentum through the
1-bit compressed allreduce and corrects the frozen trust ratio by the fresh variance.

Where the packed momentum applies (:class:`~onebit.wire.momentum.PackedMomentumStage`) what
follows the allreduce takes two passes over every bucket where the backend has them (Triton),
else walks each bucket in blocks of :data:`BLOCK`; elsewhere it runs in torch ops on flat
buffers. The three give the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import host
from ..functional import (
    adam_denominator,
    fill_zero_variance_,
    lamb_factor,
    layer_norms,
    momentum_scaling,
    scaled_sub_,
)
from .options import apply_masks_
from .stage import Stage, Taken

if TYPE_CHECKING:
    from .lamb import OnebitLamb

BLOCK = 1 << 20
"""Elements of the temporaries a compression step takes after its allreduce where the backend
has no pass over every bucket (the C kernels): it walks each bucket in blocks this long, in two
buffers of 4 MiB whatever the bucket size."""


class TrustRatios:
    """1-bit LAMB's per-layer scalars, on the host, in parameter order: what its warmup
    averages, what its freeze fixes and what each compression step last used.

    Attributes:
        ema, updates: the moving average of each layer's trust ratio over the warmup, and how
            many defined ratios (no zero norm) entered it.
        frozen: the trust ratios frozen at the freeze (the bias-corrected average; 1 for a
            layer that had none).
        scaling: the momentum scaling ``mean(s) / s_l`` frozen at the freeze.
        factors: the fresh-variance factors of the last compression step.
        last: the trust ratios of the last step (``OnebitLamb.get_lamb_coeffs``).
    """

    _SAVED = {"ema": "coeff_ema", "updates": "coeff_updates", "frozen": "frozen_coeffs",
              "scaling": "scaling_coeffs", "factors": "last_factors", "last": "coeffs"}  # fmt: skip

    def __init__(self, layers: int) -> None:
        self.ema, self.updates = torch.zeros(layers), torch.zeros(layers)
        self.frozen, self.scaling = torch.ones(layers), torch.ones(layers)
        self.factors, self.last = torch.ones(layers), torch.ones(layers)

    def state_dict(self) -> dict[str, Tensor]:
        """A copy of every scalar, under the names a checkpoint keeps them by."""
        return {key: getattr(self, name).clone() for name, key in self._SAVED.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Take the scalars of :meth:`state_dict` (copied)."""
        for name, key in self._SAVED.items():
            setattr(self, name, state[key].clone())


class LambCompression(Stage):
    """The 1-bit steps: each layer's momentum, scaled to a common size, goes through the
    compressed allreduce; the change of momentum gives the averaged gradient and the fresh
    variance, whose ratio to the frozen one corrects the frozen trust ratio. Its first step
    freezes the variance, the trust ratios and the momentum scaling."""

    name = "compression"
    frozen = True
    shows = {
        "exp_avg": "exp_avg",
        "frozen_denom": "exp_avg_sq",
        "exp_avg_sq_fresh": "exp_avg_sq_fresh",
    }

    def __init__(self, optimizer: OnebitLamb) -> None:
        super().__init__(optimizer)
        self._uploaded_scaling: tuple[Tensor, Tensor] | None = None
        self._addresses = host.Uploaded(torch.int64)
        self._uploaded_decays = host.Uploaded(torch.float32)
        self._scratches: dict[int, Tensor] = {}  # see _scratch

    def enter(self) -> None:
        opt = self.optimizer
        opt.bucketer.grads_as_views = False
        if opt.exp_avg_sq_fresh is None:
            opt.exp_avg_sq_fresh = opt.flat.zeros()

    def step(self, t: int) -> Taken:
        opt = self.optimizer
        if not opt.frozen:
            self._freeze()
        opt.engine.clip_own_gradient()
        if opt.check_packed() is not None:
            return self._packed_step(t)
        return self._unpacked_step(t)

    def _device_scaling(self) -> Tensor:
        """The momentum scaling (a host vector, fixed from the freeze on) on the optimizer's
        device: uploaded once per value, so that no bucket's pass uploads it again."""
        opt = self.optimizer
        cached, scaling = self._uploaded_scaling, opt.trust_ratios.scaling
        if cached is None or cached[0] is not scaling or cached[1].device != opt.device:
            uploaded = host.upload(scaling, opt.device, torch.float32)
            self._uploaded_scaling = cached = (scaling, uploaded)
        return cached[1]

    def _unpacked_step(self, t: int) -> Taken:
        """The compression step in torch ops on flat buffers: the averaged momentum, the
        gradient it implies, the fresh variance, the factors and the update all pass through
        the gradient buffer."""
        opt = self.optimizer
        beta1, beta2 = opt.hyper.beta1, opt.hyper.beta2
        m, frozen_denom = opt.exp_avg[: opt.layout.numel], opt.exp_avg_sq
        v_fresh = opt.exp_avg_sq_fresh
        assert v_fresh is not None
        g = opt.engine.gather_grads()
        views = opt.layout.views(g)
        scaling = opt.trust_ratios.scaling.tolist()
        torch.lerp(m, g, 1 - beta1, out=g)
        torch._foreach_mul_(views, scaling)
        applied, nbytes = opt.engine.compressed_allreduce()  # in place: g is the averaged momentum
        if applied:
            torch._foreach_div_(views, scaling)
            m.mul_(-beta1).add_(g).div_(1 - beta1)  # the averaged gradient the momentum implies
            v_fresh.mul_(beta2).addcmul_(m, m, value=1 - beta2)
            m.copy_(g)
            apply_masks_(m, opt.masks)
            fresh = opt.hyper.denominator(v_fresh, t, out=opt.engine.grads)
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
                opt.trust_ratios.factors,
                opt.factor_min,
                opt.factor_max,
                opt.factor_threshold,
                update_ratio,
            )
            opt.trust_ratios.factors = factors
            self._apply(update, opt.trust_ratios.frozen * factors)
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
        applied, nbytes, calls = opt.engine.packed_allreduce(opt.packed_momentum, scaling)
        if not applied:
            return Taken(applied, nbytes)
        stage = opt.packed_momentum
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
        ratios = opt.trust_ratios
        factors = lamb_factor(
            self._layer_ratios(maxima), ratios.factors, opt.factor_min, opt.factor_max,
            opt.factor_threshold, update_ratio,
        )  # fmt: skip
        ratios.factors, ratios.last = factors, ratios.frozen * factors
        sizes = [group["lr"] * c for group, c in zip(self._groups(), ratios.last.tolist())]
        if passes is not None:
            bc1 = opt.hyper.bc1(t)
            step_sizes = host.upload(sizes, opt.device, torch.float32)
            passes.lamb_update(self._param_addresses(), stage.whole(new), opt.exp_avg_sq,
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
        stage, hyper = opt.packed_momentum, opt.hyper
        last = stage.whole(stage.packed)  # first: new's, made from its buckets, may evict it
        return passes.lamb_ratios(
            self._param_addresses(), stage.whole(new), last, opt.exp_avg_sq_fresh,
            opt.exp_avg_sq, self._decays(decays), (hyper.beta1, hyper.beta2),
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
        (beta1, beta2, eps, _), stage = opt.hyper, opt.packed_momentum
        bc2 = opt.hyper.bc2(t)
        ratios, layers = [], []
        for k, lo, hi in self._blocks():
            origin = opt.layout.buckets[k][0]
            g, last = self._scratch(hi - lo), self._scratch(hi - lo, 1)
            stage.momentum_(k, g, new, lo, masked=False)  # the allreduce's result
            stage.momentum_(k, last, start=lo).mul_(-beta1).add_(g).div_(1 - beta1)
            v_fresh = opt.exp_avg_sq_fresh[origin + lo : origin + hi]
            v_fresh.mul_(beta2).addcmul_(last, last, value=1 - beta2)
            ratio = adam_denominator(v_fresh, bc2, eps, out=last)
            torch.div(opt.exp_avg_sq[origin + lo : origin + hi], ratio, out=ratio)
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
        bc1 = opt.hyper.bc1(t)
        groups = self._groups()
        for k, lo, hi in self._blocks():
            origin = opt.layout.buckets[k][0]
            update = opt.packed_momentum.momentum_(k, self._scratch(hi - lo), new, lo)
            torch.div(update, opt.exp_avg_sq[origin + lo : origin + hi], out=update).div_(bc1)
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
            for lo, hi in opt.packed_momentum.blocks(k, BLOCK):
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
        return torch.div(m, denom, out=opt.engine.grads).div_(opt.hyper.bc1(step))

    def _add_weight_decay(self, update: Tensor) -> None:
        opt = self.optimizer
        for group, params, updates in opt.flat.per_group(update):
            if group["weight_decay"] and params:
                torch._foreach_add_(updates, params, alpha=group["weight_decay"])

    def _apply(self, update: Tensor, coeffs: Tensor) -> None:
        """``p = p - lr·coeff·update`` per layer; ``update`` is used as scratch."""
        opt = self.optimizer
        opt.trust_ratios.last = coeffs.clone()
        per_layer = coeffs.tolist()
        start = 0
        for group, params, updates in opt.flat.per_group(update):
            sizes = [group["lr"] * c for c in per_layer[start : start + len(params)]]
            scaled_sub_(params, updates, sizes)
            start += len(params)

    def _freeze(self) -> None:
        """Enter the compression stage: freeze v, the trust ratios and the momentum scaling."""
        opt = self.optimizer
        v, frozen_t = opt.exp_avg_sq, opt.freeze.variance_step(opt.num_steps)
        fill_zero_variance_(opt.layout.views(v), opt.hyper.zero_variance_floor(frozen_t))
        opt.exp_avg_sq_fresh = v.clone()
        opt.hyper.denominator(v, frozen_t, out=v)
        momentum = opt.layout.views(opt.exp_avg[: opt.layout.numel])
        ratios = opt.trust_ratios
        ratios.scaling = momentum_scaling(opt.shards.layer_norms(momentum), opt.shards.numels())
        ema = ratios.ema
        if opt.bias_correction:
            ema = ema / (1 - opt.coeff_beta**ratios.updates)
        ratios.frozen = torch.where(ratios.updates > 0, ema, 1.0)
        opt.engine.end_warmup()
        opt.set_frozen(True)
        opt.bucketer.release()  # the .grad views keep it; the compression stage gets its own
