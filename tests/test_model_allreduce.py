"""The compressed allreduce of every bucket at once (:mod:`onebit.model_allreduce`, on the Triton
kernels, under the interpreter here) against the same kernels a bucket at a time: the same
bits, on real gloo ranks, through non-finite gradients on the last rank (skipped steps, 0/1
Adam's skipped sync) and the error buffers read mid-run."""

import pytest
import torch
from backends import use_backend
from distributed import run_ranks
from harness import CASES, _non_finite

from onebit import kernels


def _run(rank: int, world_size: int, name: str, whole: bool):
    """``CASES[name]``'s run with non-finite gradients, every bucket at once or (``whole``
    false) a bucket at a time; with how many steps sent every bucket at once."""
    from onebit import base, momentum
    from onebit.kernels import triton_model

    use_backend("triton")
    took = [0]
    for method in ("compress", "signs"):  # 0/1 Adam's sync; 1-bit Adam's compression step
        original = getattr(triton_model.ModelPasses, method)

        def counted(self, *args, _original=original, **kwargs):
            took[0] += 1
            return _original(self, *args, **kwargs)

        setattr(triton_model.ModelPasses, method, counted)
    if not whole:
        base.CompressedOptimizer._model_allreduce = lambda self: None
        momentum.PackedMomentumStage.passes = lambda self: None
    calls, skipped, dropped, steps = _non_finite(CASES[name], rank, world_size)
    return [(c.stage, c.params_after, c.state_after) for c in calls], skipped, dropped, took[0]


@pytest.mark.skipif("triton" not in kernels.available(), reason="Triton cannot run here")
@pytest.mark.parametrize("name", ["adam", "zero_one"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_every_bucket_at_once_gives_the_bits_of_a_bucket_at_a_time(world_size, name):
    whole = run_ranks(_run, world_size, name, True, timeout=600)
    per_bucket = run_ranks(_run, world_size, name, False, timeout=600)
    for (calls, skipped, dropped, took), (want, want_skipped, want_dropped, none) in zip(
        whole, per_bucket
    ):
        sent = sum(stage in ("compression", "sync") for stage, _, _ in calls)
        assert none == 0 and took > 0 and (name == "zero_one" or took == sent)
        assert (skipped, dropped) == (want_skipped, want_dropped) and skipped > 0
        for i, ((stage, params, state), (want_stage, want_params, want_state)) in enumerate(
            zip(calls, want)
        ):
            assert stage == want_stage, i
            assert torch.equal(params, want_params), (i, stage)
            assert torch.equal(state, want_state), (i, stage)
