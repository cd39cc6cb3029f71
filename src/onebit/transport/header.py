"""One open step: the header its messages carry, what it found wrong, and its verdict.

Every collective a step sends carries a small header per rank (:data:`HEADER_NUMEL` fp32
values: the step() call number, a digest of the hyperparameters, a status code, the local
gradient norm and the number of backward passes run). In the compressed allreduce it rides in
the phase-1 message next to the scale; in the fp32 allreduce each rank writes it into a slot of
its own at the end of the buffer. Every rank therefore sees every rank's header before anything
is committed, and all ranks raise the same error together when they disagree, instead of
hanging or diverging.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import Tensor

from .. import host
from .sharding import Replicated

HEADER_NUMEL = 5
"""Per-rank header of every step's messages: call number, hyperparameter digest, status, the
squared norm of the bucket's local gradient, backward passes so far."""

STATUS = {
    1: "a sparse gradient (not supported)",
    2: "betas or eps that differ between param groups (they act on whole buckets: set them "
    "the same in every group)",
    3: "parameters on more than one device (move the whole model: model.to(device))",
    4: "gradients that FSDP2 did not reduce (set_requires_gradient_sync(False) is on: turn it "
    "back on before the last backward of a step)",
    5: "parameters in param_groups that replaced those the optimizer was laid out on, and it "
    "could not follow them",
    6: "gradients changed between backward and step() (by clip_grad_norm_, clip_grad_value_ "
    "or an in-place edit of .grad), which would change each rank's local gradient before the "
    "optimizer averages or compresses it: clip with the optimizer's max_grad_norm instead. If "
    "you changed them on purpose, identically on every rank, build the optimizer with "
    "allow_edited_grads=True",
    7: "gradients changed after scaler.unscale_(optimizer) (by clip_grad_norm_, say), which "
    "would change each rank's local gradient before the optimizer averages or compresses it: "
    "let the optimizer unscale, calling scaler.step(optimizer) without scaler.unscale_, and "
    "clip with its max_grad_norm. If you changed them on purpose, identically on every rank, "
    "build the optimizer with allow_edited_grads=True",
}
"""What each status code a step's header carries means, for the error every rank raises."""

EDITED, EDITED_BY_UNSCALE = 6, 7
"""The :data:`STATUS` codes of gradients edited after backward, by the user or after
``scaler.unscale_``."""

_REPLACED_IN_BACKWARD = (
    "backward sent the gradients of the parameters the optimizer was laid out on "
    "(overlap_backward), not of those in param_groups: replace them between steps"
)
_COUNTER = 1 << 24  # integers below this are exact in fp32


def gradient_factor(value: Tensor, backend: str) -> float | Tensor | None:
    """``value``, what every pass multiplies each gradient by, as ``backend``'s kernels take it:
    left on the device for Triton's passes, which load it (no read); a number for the C kernels
    (a read of the CPU, which costs nothing), ``None`` for 1."""
    if backend == "triton":
        return value.reshape(())
    number = float(host.read(value))
    return None if number == 1.0 else number


class OpenStep:
    """What one step of an optimizer runs with and has found, from the moment it opens (at its
    first bucket, during backward with ``overlap_backward``, or at ``step()``) to its verdict.

    Args:
        owner: the optimizer's name, for the errors.
        rank: this rank in the optimizer's group.
        shards: the parameters' shards; the verdict is combined across the shard group.
        hyperparameters: what every rank must agree on in each param group (its digest goes in
            the header; the error shows this rank's).
        hyper, status: the first values of the attributes below.
        call, backward_passes: this ``step()`` call's number and the backward passes run so
            far, which must be the same on every rank.
        buckets, device: one header per bucket, on the device.
        replace_problem: why this rank could not follow ``param_groups``, if it could not.

    Attributes:
        headers: ``[buckets, HEADER_NUMEL]`` on the device, this rank's header for each bucket.
        status: this rank's problem so far (a :data:`STATUS` code; 0 for none). Problems found
            after the headers went up are sent by the buckets that leave later, and raised by
            this rank in any case.
        hyper: the optimizer's hyperparameters for this step (what its ``_step_hyperparameters``
            read from the param groups).
        inv_scale: what every gradient pass multiplies the gradients by (the inverse loss
            scale, times the clipping coefficient; see :func:`gradient_factor`), ``None`` for 1.
        open: until the step is applied, skipped or abandoned (:meth:`close`).
    """

    def __init__(
        self,
        *,
        owner: str,
        rank: int,
        shards: Replicated,
        hyperparameters: list[tuple[Any, ...]],
        hyper: Any,
        status: int,
        call: int,
        backward_passes: int,
        buckets: int,
        device: torch.device,
        replace_problem: str | None = None,
    ) -> None:
        self.owner, self.rank, self.shards = owner, rank, shards
        self.hyperparameters, self.hyper, self.open = hyperparameters, hyper, True
        self.status, self.replace_problem = status, replace_problem
        self.inv_scale: float | Tensor | None = None
        digest = zlib.crc32(repr(hyperparameters).encode()) % _COUNTER
        row = [float(call % _COUNTER), float(digest), float(status), 0.0,
               float(backward_passes % _COUNTER)]  # fmt: skip
        self.headers = host.upload([row] * max(buckets, 1), device)
        self._sent_status = status

    def close(self) -> None:
        """The step is over: the next message opens another."""
        self.open = False

    def header_for(self, k: int, sparse: bool = False, norm2: Tensor | None = None) -> Tensor:
        """This rank's header for the message of bucket ``k``; ``sparse`` if gathering it met a
        sparse gradient, ``norm2`` its squared norm (on the device)."""
        if sparse:
            self.status = 1
        header = self.headers[k]
        if self.status != self._sent_status:
            header[2] = float(self.status)
        if norm2 is not None:
            header[3] = norm2
        return header

    def all_headers(self) -> Tensor:
        """The headers of a step that sends every bucket at once (the same in every bucket),
        with the status found since they went up."""
        if self.status != self._sent_status:
            self.headers[:, 2] = float(self.status)
        return self.headers

    def verdict(
        self, headers: Tensor, finite: Tensor, norms2: Tensor | None = None
    ) -> tuple[bool, Tensor | None]:
        """The step's verdict from the device in one host read: :meth:`check` of the ranks'
        ``headers`` and ``finite``, a boolean tensor or a float that is finite if every rank's
        values were (say the largest of their scales); returns (applied, ``norms2`` on the
        host, if given)."""
        parts = [headers, finite.reshape(1)]
        if norms2 is not None:
            parts.append(norms2)
        values = host.read_all(parts)  # fp32, as the headers
        size, width = headers.numel(), headers.shape[-1]
        listed = values[: size + 1].tolist()
        flag = listed[size]
        finite_ = bool(flag) if finite.dtype == torch.bool else math.isfinite(flag)
        rows = [listed[i : i + width] for i in range(0, size, width)]
        return self.check(rows, finite_), None if norms2 is None else values[size + 1 :]

    def check(self, headers: list[list[float]], finite: bool) -> bool:
        """Raise the same ``RuntimeError`` on every rank if the ranks' headers (a row of
        ``HEADER_NUMEL`` values per rank, identical on every rank) show different steps,
        hyperparameters or a local problem; else return whether every rank's values were
        ``finite``.

        With sharded parameters both verdicts are combined across the shard group in one
        collective, so a problem of one shard's ranks stops every rank of the mesh."""
        calls, digests, status, passes = ([row[i] for row in headers] for i in (0, 1, 2, 4))
        error = None
        if len(set(calls)) > 1 or len(set(passes)) > 1:
            at = ", ".join(
                f"rank {r}: call {int(c)} of step() after {int(b)} backward passes"
                for r, (c, b) in enumerate(zip(calls, passes))
            )
            error = (
                f"ranks are at different steps ({at}). Every rank must run the same number of "
                "backward passes and call step() after each the same way: do not skip step() "
                "on some ranks only"
            )
        elif len(set(digests)) > 1:
            ranks = [r for r, d in enumerate(digests) if d != digests[0]]
            error = (
                f"hyperparameters differ across ranks (rank 0 and rank(s) {ranks}): lr, "
                "weight_decay, betas or eps of some param group, as when a learning-rate "
                f"scheduler steps on some ranks only. This rank has {self.hyperparameters}"
            )
        else:
            bad = [(r, int(s)) for r, s in enumerate(status) if s]
            if self.status and not bad:  # found after the header left (overlap_backward)
                bad = [(self.rank, self.status)]
            if bad:
                error = f"{self.owner}.step(): {self._problems(bad)}{self.detail()}"
        verdict = self.shards.worst(2 if error is not None else 0 if finite else 1)
        if verdict == 2:
            raise RuntimeError(
                error
                or f"{self.owner}.step(): the ranks that hold another shard raised an error "
                "(see theirs); this step was not applied"
            )
        return verdict == 0

    def detail(self) -> str:
        """What this rank knows beyond its status code (why it could not follow
        ``param_groups``), to end an error message with."""
        if self.status != 5:
            return ""
        return f". On this rank: {self.replace_problem or _REPLACED_IN_BACKWARD}"

    @staticmethod
    def _problems(bad: list[tuple[int, int]]) -> str:
        ranks: dict[int, list[int]] = {}
        for r, s in bad:
            ranks.setdefault(s, []).append(r)
        return "; ".join(
            f"rank {rs[0]} has {STATUS.get(s, s)}"
            if len(rs) == 1
            else f"ranks {', '.join(map(str, rs))} have {STATUS.get(s, s)}"
            for s, rs in ranks.items()
        )
