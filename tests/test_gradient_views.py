"""1-bit Adam's warmup accumulates ``.grad`` straight into its bucket buffer, bitwise unchanged."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

import onebit
from onebit.functional import clip_coefficient


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3), torch.nn.Linear(3, 3)
    )
    model[3].to(dtype)
    return model


def _loss(model, step, rank, micro=0):
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 3, generator=gen)
    h = model[2](model[1](model[0](x)))
    out = h + model[3](h.to(model[3].weight.dtype)).float() if step % 2 else h  # [3] unused
    return torch.nn.functional.mse_loss(out, y)


def _in_buffer(opt, p):
    buffer = opt.bucketer._buffer
    return (
        p.grad is not None
        and buffer is not None
        and p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    )


def _train(rank, world_size, views, kwargs, accumulate, set_to_none, steps=10):
    """Train with a GradScaler; return each step's parameters, how many ``.grad`` were views of
    the buffer before each step, and whether ``.grad`` held the ranks' average after it."""
    model = _model()
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-2, bucket_size=200, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    history, in_buffer, averaged = [], [], []
    for step in range(steps):
        opt.bucketer.grads_as_views &= views
        opt.zero_grad(set_to_none=set_to_none)
        for micro in range(accumulate):
            scaler.scale(_loss(model, step, rank, micro)).backward()
        in_buffer.append(sum(_in_buffer(opt, p) for p in model.parameters()))
        warmup = opt.in_warmup
        local = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        scaler.step(opt)
        scaler.update()
        if warmup and kwargs["warmup_compression"] == "fp32":  # an fp32 average: exact
            norm = opt.grad_norm
            clip = 1.0 if norm is None else float(clip_coefficient(torch.tensor(norm), 0.5))
            for g in local:  # the scale stays 2**8: no step has an inf
                dist.all_reduce(g)
                g.mul_(clip / (world_size * 2.0**8))
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            averaged.append(all(torch.allclose(g, a) for g, a in zip(local, grads)))
        history.append([p.detach().clone() for p in model.parameters()])
    return history, in_buffer, averaged


@pytest.mark.parametrize(
    "kwargs, accumulate, set_to_none",
    [
        (dict(freeze_step=4, warmup_compression="fp32"), 1, True),  # then the fused, packed stage
        (dict(freeze_step=4, warmup_compression="fp32", max_grad_norm=0.5), 2, False),  # unfused
        (dict(freeze_step=4, warmup_compression="int8"), 1, False),
    ],
)
def test_warmup_grads_live_in_the_bucket_buffer_and_training_is_bitwise_unchanged(
    kwargs, accumulate, set_to_none
):
    plain = run_ranks(_train, 2, False, kwargs, accumulate, set_to_none)
    views = run_ranks(_train, 2, True, kwargs, accumulate, set_to_none)
    for (want, none, _), (got, in_buffer, averaged) in zip(plain, views):
        for a, b in zip(want, got):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert set(none) == {0}
        # warmup: every gradient (2 layers have them on even steps, 3 on odd ones and on every
        # step after the first odd one if zero_grad keeps them)
        assert in_buffer[:4] == ([4, 6, 4, 6] if set_to_none else [4, 6, 6, 6])
        assert set(in_buffer[4:]) == {0}  # the compression stage leaves .grad to the user
        # after each warmup step .grad held the averaged (and clipped) gradient
        assert averaged == ([] if kwargs["warmup_compression"] != "fp32" else [True] * 4)


def test_the_compression_stage_leaves_grad_as_backward_made_it():
    model = _model()
    opt = onebit.OnebitAdam(
        model.parameters(), warmup_compression="fp32", freeze_step=2, max_grad_norm=1.0
    )
    for step in range(5):
        opt.zero_grad(set_to_none=False)  # the warmup's views stay .grad
        _loss(model, 2 * step + 1, 0).backward()
        before = [p.grad.clone() for p in model.parameters()]
        opt.step()
        if step >= 2:
            assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


def test_only_dense_fp32_grads_become_views():
    model = _model(dtype=torch.bfloat16)
    opt = onebit.OnebitAdam(model.parameters(), warmup_compression="fp32", freeze_step=5)
    ref_model = _model(dtype=torch.bfloat16)
    ref = onebit.OnebitAdam(ref_model.parameters(), warmup_compression="fp32", freeze_step=5)
    ref.bucketer.grads_as_views = False
    for _ in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            _loss(m, 1, 0).backward()
        assert [_in_buffer(opt, p) for p in model.parameters()] == [True] * 4 + [False] * 2
        opt.step()
        ref.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_no_views_while_buckets_are_sent_during_backward():
    model = _model()
    opt = onebit.OnebitAdam(
        model.parameters(), warmup_compression="fp32", freeze_step=5, overlap_backward=True
    )
    for step in range(2):
        opt.zero_grad()
        _loss(model, step, 0).backward()
        assert not any(_in_buffer(opt, p) for p in model.parameters())
        opt.step()
