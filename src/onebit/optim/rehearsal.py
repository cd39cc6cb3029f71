"""Compile the compression stage's GPU kernels before the freeze, so that training does not stall
there.

Triton compiles a kernel variant the first time it launches it (about a second each; Triton
then keeps it in its disk cache for later runs). Most of the compression stage's kernels first
launch at the freeze, so the step after the warmup would wait for them. At the end of the first
warmup step, the optimizer builds a copy of itself (its class, its keyword arguments, each
param group's hyperparameters but the learning rate, which a scheduler may start at 0) on a
few tiny parameters of the same dtypes and layouts (:func:`tiny_groups`), and :func:`rehearse`
takes a few steps with it, through its freeze: those launch, and so compile, the variants the
real steps will, since sizes do not choose variants (the kernels take them as runtime values,
``do_not_specialize``, and tables start on 16-byte boundaries). The copy runs on the same
process group, every rank together; it costs a few small collectives and no memory to speak
of, and leaves the optimizer and the random number generators as they were.

Where it does not apply, the kernels compile at their first launch as before: kernels that do
not compile at run time (the C kernels, the torch reference, Triton's interpreter), and
parameters sharded by FSDP2. A model of 2^31 elements or more on a rank passes some sizes as
64-bit integers, which the tiny copy does not, so a few of its variants still compile at the
freeze.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .base import CompressedOptimizer

LR = 1e-3
"""The copy's learning rate in every group (0/1 Adam's ``synchronize()`` does nothing at 0)."""

_rehearsing = False
"""Whether a copy is taking its steps (:func:`rehearse`), which compile nothing ahead."""

STEPS = 6
"""The copy's steps: its warmup (one step; 0/1 Adam's phase A: two variance steps and a
compressed one), then those of its stage (the first builds what later ones reuse; 0/1 Adam's
local steps: a sync, a local step, a sync)."""


def applies(optimizer: CompressedOptimizer) -> bool:
    """Whether ``optimizer``'s kernels compile when they first launch and a copy can run them:
    Triton on a GPU, parameters not sharded by FSDP2."""
    return (
        optimizer.backend == "triton"
        and optimizer.device.type == "cuda"
        and not optimizer.shards.sharded
    )


def compile_ahead(
    optimizer: CompressedOptimizer,
    options: dict[str, Any],
    *,
    scaled: bool,
    any_rank: Callable[[bool], bool],
) -> None:
    """After ``optimizer``'s first warmup step: compile the kernels of the stage to come now,
    where they compile at their first launch, if every rank can (``any_rank``: whether a flag
    holds on any rank, a collective on CUDA). ``options`` are the keyword arguments of the copy
    (:func:`tiny_copy`); ``scaled``: whether the step ran under a ``GradScaler``. Does nothing
    in a copy's own steps (:func:`rehearse`)."""
    if _rehearsing:
        return
    can = applies(optimizer)
    if optimizer.device.type == "cuda" and optimizer.world_size > 1:
        can = not any_rank(not can)
    if can:
        rehearse(tiny_copy(optimizer, options), scaled=scaled)


def tiny_copy(optimizer: CompressedOptimizer, options: dict[str, Any]) -> CompressedOptimizer:
    """A copy of ``optimizer`` on :func:`tiny_groups`, built with the keyword arguments
    ``options`` (the constructor's, with those its class changes for a rehearsal), for
    :func:`rehearse`. A collective, as the construction of any onebit optimizer."""
    groups = tiny_groups(optimizer.param_groups, optimizer.device)
    options = {
        **{k: v for k, v in options.items() if k != "params"},
        "process_group": optimizer.process_group,
    }
    if optimizer.masks:
        first = groups[0]["params"][0]
        options["exp_avg_mask"] = {first: torch.ones_like(first)}
    return type(optimizer)(groups, **options)


def tiny_groups(param_groups: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    """``param_groups`` on tiny parameters of the same dtypes and layouts (:func:`_tiny_params`),
    at the learning rate :data:`LR`: the copy's groups."""
    groups = []
    for group in param_groups:
        params = _tiny_params(group["params"], device)
        if params:
            groups.append({**group, "params": params, "lr": LR})
    return groups


def rehearse(copy: torch.optim.Optimizer, scaled: bool) -> None:
    """Take :data:`STEPS` steps of ``copy``, a copy of an optimizer on :func:`tiny_groups`
    (see the module), so that the kernels of its stage compile now; ``scaled``: as under a
    ``GradScaler``. A collective: every rank of its group calls it."""
    global _rehearsing
    params = [p for g in copy.param_groups for p in g["params"]]
    device = params[0].device
    _rehearsing = True
    try:
        for step in range(STEPS):
            with torch.enable_grad():
                sum(((p * (step + 1)).square()).sum() for p in params).backward()
            if scaled:
                copy.grad_scale = torch.full((), 2.0, device=device)
                copy.found_inf = torch.zeros((), device=device)
            copy.step()
            copy.zero_grad()
        synchronize = getattr(copy, "synchronize", None)  # 0/1 Adam's: a variant of its own
        if synchronize is not None:
            synchronize()
    finally:
        _rehearsing = False


def _tiny_params(params: list[Tensor], device: torch.device) -> list[torch.nn.Parameter]:
    """A parameter of 64 elements on ``device`` for each dtype among ``params``, and one in
    ``channels_last`` where some of that dtype are not contiguous."""
    kinds = sorted({(p.dtype, p.is_contiguous()) for p in params}, key=str)
    tiny = []
    for dtype, contiguous in kinds:
        values = torch.linspace(-1.0, 1.0, 64, device=device).view(2, 8, 2, 2).to(dtype)
        if not contiguous:
            values = values.to(memory_format=torch.channels_last)
        tiny.append(torch.nn.Parameter(values))
    return tiny
