"""``warmup_compression``: the warmup's gradient average at 16, 8 or 4 bits, with error feedback.

The optimizers' warmup must be AdamW (or LAMB) on the average that a
:class:`~onebit.wire.quantized.QuantizedAllreduce` of the same geometry computes, the same on every
rank, resumable bit for bit, and skipped everywhere when any rank overflows.
"""

import io
import math

import pytest
import torch
from backends import use_backend
from distributed import run_ranks
from family import all_equal, loss_of, make_model, make_optimizer, params_of
from heavy import slow

import onebit
from onebit.wire.quantized import QuantizedAllreduce

STEPS = 8


def _shadow_adamw(rank, world_size, bits):
    """OnebitAdam in warmup against AdamW on averages from a QuantizedAllreduce of its own."""
    model, shadow = make_model(), make_model()
    opt = make_optimizer("adam", model.parameters(), freeze_step=100, warmup_compression=bits)
    reference = torch.optim.AdamW(shadow.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    layout = opt.layout
    comms = [
        QuantizedAllreduce(e - s, segments=layout.segments(k), bits=bits)
        for k, (s, e) in enumerate(layout.buckets)
    ]
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        opt.step()
        reference.zero_grad()
        loss_of(shadow, step, rank).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in shadow.parameters()])
        average = torch.cat([c(flat[s:e]) for c, (s, e) in zip(comms, layout.buckets)])
        for p, g in zip(shadow.parameters(), layout.views(average)):
            p.grad = g.clone()
        reference.step()
        for ours, theirs in zip(model.parameters(), shadow.parameters()):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    per_call = sum(c.bytes_per_call for c in opt.warmup_comms)
    return params_of(model), opt.comm_stats.total_bytes["warmup"], per_call


@pytest.mark.parametrize("bits", ["bf16", "int8", "int4"])
def test_warmup_is_adamw_on_the_quantized_average_on_every_rank(bits):
    """(The bytes per call against fp32 are checked on large buffers in
    test_quantized_allreduce.py; this model is mostly headers and padding.)"""
    results = run_ranks(_shadow_adamw, 2, bits)
    (params0, sent, per_call), (params1, *_) = results
    assert all_equal(params0, params1)
    assert sent == STEPS * per_call


def _run(rank, world_size, name, bits, state=None, start=1, inject=None):
    model = make_model()
    opt = make_optimizer(name, model.parameters(), warmup_compression=bits)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(torch.load(io.BytesIO(state["opt"][rank]), weights_only=False))
    history, saved = [], None
    for step in range(start, STEPS + 1):
        opt.zero_grad()
        loss = loss_of(model, step, rank)
        if inject == (step, rank):
            loss = loss * math.inf
        loss.backward()
        opt.step()
        history.append(params_of(model))
        if step == 2:
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            model_state = {k: v.clone() for k, v in model.state_dict().items()}
            saved = {"model": model_state, "opt": buffer.getvalue()}
    errors = [c.worker_error.numel() for c in opt.warmup_comms]
    return history, saved, opt.skipped_steps, errors


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_identical_on_every_rank_resumes_exactly_and_skips_non_finite(name):
    straight = run_ranks(_run, 2, name, "int8")
    assert all(all_equal(a, b) for a, b in zip(straight[0][0], straight[1][0]))
    assert straight[0][3] == [0] * len(straight[0][3])  # freed at the freeze (step 3)
    state = {"model": straight[0][1]["model"], "opt": [r[1]["opt"] for r in straight]}
    resumed = run_ranks(_run, 2, name, "int8", state, 3)
    for rank in range(2):
        assert all(all_equal(a, b) for a, b in zip(resumed[rank][0], straight[rank][0][2:]))
    skipped = run_ranks(_run, 2, name, "int8", None, 1, (2, 1))
    for history, _, count, _ in skipped:
        assert count == 1 and all_equal(history[1], history[0])  # step 2 changed nothing
        assert all_equal(history[1], skipped[0][0][1])


def _on_triton(rank, world_size, bits, at_once):
    """A warmup of OnebitAdam on the Triton kernels (under the interpreter here), every bucket
    at once or (``at_once`` false) a bucket at a time: a missing gradient at step 3, an inf on
    the last rank at step 4 (skipped), and from step 5 a new optimizer that loaded the state.
    Returns the parameters after each step, the error buffers, the skipped steps and how many
    steps went at once."""
    from onebit.wire.model_quantized import ModelQuantized

    use_backend("triton")
    took, start = [0], ModelQuantized.start

    def counting(self, *args):
        took[0] += 1
        return start(self, *args)

    ModelQuantized.start = counting
    if not at_once:
        ModelQuantized.build = classmethod(lambda cls, *args: None)
    model = make_model()
    make = lambda: make_optimizer(  # noqa: E731
        "adam",
        model.parameters(),
        freeze_step=100,
        warmup_compression=bits,
        bucket_size=64,
        allow_edited_grads=True,  # the gradient removed at step 3
    )
    opt, history = make(), []
    for step in range(1, STEPS + 1):
        if step == 5:
            state = opt.state_dict()
            opt = make()
            opt.load_state_dict(state)
        opt.zero_grad()
        loss = loss_of(model, step, rank) * (math.inf if (step, rank) == (4, world_size - 1) else 1)
        loss.backward()
        if step == 3:
            model[-1].bias.grad = None
        opt.step()
        history.append(params_of(model))
    errors = [(c.worker_error.clone(), c.server_error.clone()) for c in opt.warmup_comms]
    return history, errors, opt.skipped_steps, took[0], len(opt.warmup_comms)


@pytest.mark.parametrize(
    "world_size, bits", [(1, "int4"), slow(2, "int8"), slow(3, "int4"), (2, "bf16")]
)
def test_every_bucket_at_once_gives_the_bits_of_a_bucket_at_a_time(world_size, bits):
    """On Triton, the quantized warmup of every bucket at once (a few launches and two
    collectives a step, whatever the buckets) against the same kernels a bucket at a time, bit
    for bit: parameters and both error buffers, through a missing gradient, a skipped step and
    a resume. Chunks split unevenly on 3 ranks in int4; int8 differs in its width only."""
    at_once = run_ranks(_on_triton, world_size, bits, True, timeout=600)
    per_bucket = run_ranks(_on_triton, world_size, bits, False, timeout=600)
    for (history, errors, skipped, took, buckets), (want, want_errors, *rest) in zip(
        at_once, per_bucket
    ):
        assert buckets > 3 and took == STEPS and rest == [1, 0, buckets] and skipped == 1
        for t, (got, expected) in enumerate(zip(history, want)):
            assert all_equal(got, expected), f"step {t + 1}"
        for (worker, server), (want_worker, want_server) in zip(errors, want_errors):
            assert torch.equal(worker, want_worker) and torch.equal(server, want_server)
            assert worker.abs().max() > 0


def test_bad_value_is_refused():
    with pytest.raises(ValueError, match="warmup_compression must be one of"):
        onebit.OnebitAdam(make_model().parameters(), freeze_step=3, warmup_compression="int2")
