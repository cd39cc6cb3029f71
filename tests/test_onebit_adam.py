"""OnebitAdam (SPEC section 3) on real gloo process groups, against AdamW, DDP and a simulation."""

import copy
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from reference import RefBucketedAllreduce, bucket_bounds

import onebit
from onebit.base import HEADER_NUMEL

SHAPES = [(7, 5), (13,), (3, 3, 2)]


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _grad(step, rank, i, p):
    """A gradient that depends on the parameter, the step and the rank."""
    gen = torch.Generator().manual_seed(100 * step + 10 * rank + i)
    return torch.randn(p.shape, generator=gen) * (1 + rank) + 0.3 * p.detach().float()


def _set_grads(params, step, rank):
    for i, p in enumerate(params):
        p.grad = _grad(step, rank, i, p).to(p.dtype)


def _groups(params):
    return [
        {"params": params[:2]},
        {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0},
    ]


def _train_onebit(
    rank, world_size, steps, freeze_step, bucket_size, max_grad_norm=None, scale_per="tensor"
):
    params = _params()
    opt = onebit.OnebitAdam(
        _groups(params),
        lr=1e-2,
        weight_decay=0.1,
        freeze_step=freeze_step,
        bucket_size=bucket_size,
        max_grad_norm=max_grad_norm,
        scale_per=scale_per,
    )
    history = []
    for step in range(1, steps + 1):
        _set_grads(params, step, rank)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history, opt.comm_stats, [c.bytes_per_call for c in opt.comms]


def _clip_coefficient(norm, max_grad_norm):
    if max_grad_norm is None:
        return 1.0
    return float(torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0))


def _reference_onebit_adam(
    world_size, steps, freeze_step, bucket_size, max_grad_norm=None, scale_per="tensor"
):
    """SPEC section 3 for all ranks at once; parameters are the same on every rank.

    With ``max_grad_norm``, the averaged gradient is clipped by its norm in warmup, and in the
    compression stage the momentum's gradient part by the mean of the ranks' local norms.

    The arithmetic is written with AdamW's primitives (lerp, addcmul, addcdiv): a 1-bit sign is
    a discontinuous function of its input, so rounding differences of 1 ulp would make two
    otherwise correct implementations flip different signs and drift apart.
    """
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    params = _params()
    lrs, wds = [1e-2, 1e-2, 3e-3], [0.1, 0.1, 0.0]
    numel = sum(p.numel() for p in params)
    m, v = torch.zeros(numel), torch.zeros(numel)
    sizes = [p.numel() for p in params] if scale_per == "tensor" else None
    allreduce = RefBucketedAllreduce(numel, world_size, bucket_size, sizes)
    history = []
    for t in range(1, steps + 1):
        grads = [
            torch.cat([_grad(t, r, i, p).view(-1) for i, p in enumerate(params)])
            for r in range(world_size)
        ]
        sizes = [p.numel() for p in params]
        if t <= freeze_step:
            g = torch.stack(grads).sum(0) / world_size
            norm = torch.stack([s.norm() for s in g.split(sizes)]).norm()
            g = g * _clip_coefficient(norm, max_grad_norm)
            m = m.lerp(g, 1 - beta1)
            v = v.mul(beta2).addcmul(g, g, value=1 - beta2)
            bc2 = 1 - beta2**t
        else:
            compressed = allreduce([m.lerp(g_r, 1 - beta1) for g_r in grads])
            norm = sum(g_r.norm() for g_r in grads) / world_size
            m = m.mul(beta1).lerp(compressed, _clip_coefficient(norm, max_grad_norm))
            bc2 = 1 - beta2**freeze_step
        denom = (v.sqrt() / math.sqrt(bc2)).add(eps)
        offset = 0
        with torch.no_grad():
            for p, lr, wd in zip(params, lrs, wds):
                view = slice(offset, offset + p.numel())
                p.mul_(1 - lr * wd)
                p.addcdiv_(m[view].view_as(p), denom[view].view_as(p), value=-lr / (1 - beta1**t))
                offset += p.numel()
        history.append([p.detach().clone() for p in params])
    return history


@pytest.mark.parametrize(
    "world_size,bucket_size,max_grad_norm,scale_per",
    [
        (2, 10**6, None, "tensor"),
        (2, 10**6, None, "bucket"),
        (4, 64, None, "tensor"),
        (4, 64, None, "bucket"),
        (2, 32, 2.0, "tensor"),
    ],
)
def test_compression_stage_matches_reference_simulation(
    world_size, bucket_size, max_grad_norm, scale_per
):
    steps, freeze_step = 10, 4
    args = (world_size, steps, freeze_step, bucket_size, max_grad_norm, scale_per)
    results = run_ranks(_train_onebit, *args)
    expected = _reference_onebit_adam(*args)
    if max_grad_norm is not None:  # the clipping really clips, before and after the freeze
        unclipped = _reference_onebit_adam(world_size, steps, freeze_step, bucket_size)
        assert not torch.allclose(expected[1][0], unclipped[1][0])
        assert not torch.allclose(
            expected[-1][0] - expected[-2][0], unclipped[-1][0] - unclipped[-2][0]
        )
    for t in range(steps):
        for history, *_ in results:
            for got, want in zip(history[t], expected[t]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # Replicas never drift: every rank holds the same bits after every step.
            assert all(torch.equal(a, b) for a, b in zip(history[t], results[0][0][t]))
    stats, bytes_per_call = results[0][1], results[0][2]
    numel = sum(math.prod(s) for s in SHAPES)
    assert stats.steps == {"warmup": freeze_step, "compression": steps - freeze_step}
    # fp32 allreduce of each bucket; the last also carries its padding and one header
    # per rank (the step check).
    sizes = [e - s for s, e in bucket_bounds(numel, bucket_size, world_size)]
    sizes[-1] = -(-sizes[-1] // (8 * world_size)) * 8 * world_size + HEADER_NUMEL * world_size
    warmup_bytes = sum(2 * (world_size - 1) * 4 * size // world_size for size in sizes)
    assert stats.total_bytes["warmup"] == freeze_step * warmup_bytes
    assert stats.last_step_bytes == sum(bytes_per_call)
    assert stats.last_step_stage == "compression"


def test_world_size_one_matches_adamw_with_lr_scheduler():
    params, ref = _params(), _params()
    opt = onebit.OnebitAdam(_groups(params), lr=1e-2, weight_decay=0.1, freeze_step=1000)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.1)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (opt, ref_opt)
    ]
    for step in range(1, 21):
        _set_grads(params, step, 0)
        _set_grads(ref, step, 0)
        opt.step()
        ref_opt.step()
        for s in schedulers:
            s.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert opt.comm_stats.bytes_total == 0
    torch.testing.assert_close(opt.state[params[0]]["exp_avg"], ref_opt.state[ref[0]]["exp_avg"])


def _warmup_vs_ddp(rank, world_size, steps):
    torch.manual_seed(rank)  # different initial weights per rank: both must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ours = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    opt = onebit.OnebitAdam(ours.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=steps)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        for net, optimizer in ((ddp, ref_opt), (ours, opt)):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
    return [p.detach() for p in model.parameters()], [p.detach() for p in ours.parameters()]


def test_warmup_on_four_ranks_matches_ddp_adamw():
    for ddp_params, our_params in run_ranks(_warmup_vs_ddp, 4, 8):
        for p, q in zip(our_params, ddp_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _train_model(rank, opt_kwargs, steps, params, opt_state=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if params is not None:
        model.load_state_dict(params)
    opt = onebit.OnebitAdam(model.parameters(), **opt_kwargs)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    for _ in range(steps):
        gen = torch.Generator().manual_seed(opt.num_steps * 10 + rank)
        x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


RESUME_KWARGS = dict(lr=1e-2, weight_decay=0.01, freeze_step=3, bucket_size=32)


def _straight(rank, world_size, steps):
    model, opt = _train_model(rank, RESUME_KWARGS, steps, None)
    return model.state_dict(), opt.comm_stats


def _save_after(rank, world_size, steps, directory):
    model, opt = _train_model(rank, RESUME_KWARGS, steps, None)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{directory}/{rank}.pt")


def _resume(rank, world_size, steps, directory):
    checkpoint = torch.load(f"{directory}/{rank}.pt")
    model, opt = _train_model(rank, RESUME_KWARGS, steps, checkpoint["model"], checkpoint["opt"])
    return model.state_dict(), opt.comm_stats


def test_resume_is_bitwise_exact_inside_compression_stage(tmp_path):
    k = 5
    straight = run_ranks(_straight, 2, 2 * k)
    run_ranks(_save_after, 2, k, str(tmp_path))
    resumed = run_ranks(_resume, 2, k, str(tmp_path))
    for (want, want_stats), (got, got_stats) in zip(straight, resumed):
        assert all(torch.equal(want[name], got[name]) for name in want)
        assert got_stats == want_stats
    # The error buffers really matter: dropping them (as the reference did) changes the result.
    checkpoint = torch.load(tmp_path / "0.pt")
    for comm in checkpoint["opt"]["onebit"]["ranks"][0]["comms"]:
        assert comm["worker_error"].abs().sum() > 0
    # Loading a state saved on 2 ranks into 1 keeps the moments and resets the errors.
    model, opt = _train_model(0, RESUME_KWARGS, 0, checkpoint["model"])
    with pytest.warns(UserWarning, match="error-feedback buffers reset"):
        opt.load_state_dict(checkpoint["opt"])
    assert all(c.worker_error.abs().sum() == 0 for c in opt.comms)
    saved = checkpoint["opt"]["state"][0]["exp_avg"]
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], saved)
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float32


def _snapshot(opt, params):
    return (
        [p.detach().clone() for p in params],
        {k: v.clone() for k, v in opt.state_dict()["state"][0].items()},
        [c.worker_error.clone() for c in opt.comms] + [c.server_error.clone() for c in opt.comms],
    )


def _equal(a, b):
    flat_a = [*a[0], *a[1].values(), *a[2]]
    flat_b = [*b[0], *b[1].values(), *b[2]]
    return all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


def _non_finite(rank, world_size):
    params = _params()
    opt = onebit.OnebitAdam(params, lr=1e-2, freeze_step=3, bucket_size=64)
    skipped_unchanged = []
    for step in range(1, 9):
        _set_grads(params, step, rank)
        bad = step in (2, 6)  # one in warmup, one in the compression stage
        if bad and rank == world_size - 1:
            params[1].grad[0] = float("nan") if step == 2 else float("inf")
        before = _snapshot(opt, params)
        opt.step()
        if bad:
            skipped_unchanged.append(_equal(before, _snapshot(opt, params)))
    finite = all(torch.isfinite(p).all() for p in params)
    return skipped_unchanged, opt.skipped_steps, opt.num_steps, finite, [p.detach() for p in params]


def test_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank():
    results = run_ranks(_non_finite, 2)
    for skipped_unchanged, skipped, num_steps, finite, params in results:
        assert skipped_unchanged == [True, True]
        assert skipped == 2 and num_steps == 6 and finite
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][4]))


def test_bad_hyperparameters_raise_value_error():
    params = _params()
    for kwargs, match in [
        (dict(lr=-1.0), "learning rate"),
        (dict(betas=(1.0, 0.999)), "beta parameter at index 0"),
        (dict(betas=(0.9, -0.1)), "beta parameter at index 1"),
        (dict(eps=-1e-8), "epsilon"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(freeze_step=0), "freeze_step"),
        (dict(freeze_step=2.5), "freeze_step"),
        (dict(bucket_size=0), "bucket_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            onebit.OnebitAdam(params, **{"freeze_step": 10, **kwargs})
    with pytest.raises(TypeError):
        onebit.OnebitAdam(params)  # freeze_step is required
    with pytest.raises(ValueError, match="betas must be the same"):
        onebit.OnebitAdam(
            [{"params": params[:1]}, {"params": params[1:], "betas": (0.8, 0.9)}], freeze_step=5
        )
    with pytest.raises(ValueError, match="exp_avg_mask"):
        onebit.OnebitAdam(params, freeze_step=5, exp_avg_mask={params[0]: torch.ones(3)})


def test_sparse_gradient_is_rejected_before_anything_changes():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = onebit.OnebitAdam(emb.parameters(), freeze_step=5)
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(before, emb.weight) and opt.num_steps == 0


def _mismatched(rank, world_size):
    params = _params()[: 2 + rank]
    try:
        onebit.OnebitAdam(params, freeze_step=3)
    except ValueError as err:
        return str(err)
    return None


def test_parameters_that_differ_across_ranks_are_a_clear_error():
    for message in run_ranks(_mismatched, 2):
        assert message is not None and "differ across ranks" in message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_keep_fp32_state(dtype):
    params, ref = _params(dtype), _params()
    opt = onebit.OnebitAdam(params, lr=1e-2, freeze_step=3)
    ref_opt = onebit.OnebitAdam(ref, lr=1e-2, freeze_step=3)
    for step in range(1, 7):
        _set_grads(params, step, 0)
        _set_grads(ref, step, 0)
        opt.step()
        ref_opt.step()
    assert all(p.dtype == dtype for p in params)
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in params)
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.float(), q, rtol=0.05, atol=0.05)


def test_none_gradient_counts_as_zero_and_mask_keeps_zeros():
    mask = torch.ones(SHAPES[0])
    mask[0] = 0
    runs = []
    for none_grad in (True, False):
        params = _params()
        opt = onebit.OnebitAdam(params, lr=1e-2, freeze_step=2, exp_avg_mask={params[0]: mask})
        for step in range(1, 6):
            _set_grads(params, step, 0)
            params[2].grad = None if none_grad else torch.zeros_like(params[2])
            opt.step()
        assert torch.all(opt.state[params[0]]["exp_avg"][0] == 0)
        assert torch.all(opt.state[params[0]]["exp_avg"][1] != 0)
        runs.append(params)
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_state_views_share_the_flat_buffers():
    params = _params()
    opt = onebit.OnebitAdam(params, freeze_step=2)
    exp_avg = opt.state[params[1]]["exp_avg"]
    assert exp_avg.shape == params[1].shape
    assert (
        exp_avg.untyped_storage().data_ptr()
        == opt.state[params[0]]["exp_avg"].untyped_storage().data_ptr()
    )


def test_no_process_group_needed():
    assert not dist.is_initialized()
    warnings.simplefilter("error")
    params = _params()
    opt = onebit.OnebitAdam(params, freeze_step=1)
    _set_grads(params, 1, 0)
    opt.step()
    _set_grads(params, 2, 0)
    opt.step()
    assert opt.stage == "compression"
    assert Path  # keep import used for tmp paths in other tests
