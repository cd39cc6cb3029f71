"""OnebitAdam (SPEC section 3) on real gloo process groups, against AdamW, DDP and a simulation."""

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from harness import CASES
from reference import RefBucketedAllreduce, bucket_bounds

import onebit
from onebit.transport.header import HEADER_NUMEL

CASE = CASES["adam"]
PROBLEM = CASE.problem


def _train_onebit(
    rank, world_size, steps, freeze_step, bucket_size, max_grad_norm=None, scale_per="tensor"
):
    params = PROBLEM.params()
    opt = CASE.optimizer(
        params,
        freeze_step=freeze_step,
        bucket_size=bucket_size,
        max_grad_norm=max_grad_norm,
        scale_per=scale_per,
    )
    history = []
    for step in range(1, steps + 1):
        PROBLEM.set_grads(params, step, rank)
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
    compression stage each rank's gradient by its own norm, before it is sent.

    The arithmetic is written with AdamW's primitives (lerp, addcmul, addcdiv): a 1-bit sign is
    a discontinuous function of its input, so rounding differences of 1 ulp would make two
    otherwise correct implementations flip different signs and drift apart.
    """
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    params = PROBLEM.params()
    lrs, wds = PROBLEM.lrs, PROBLEM.wds
    numel = sum(p.numel() for p in params)
    m, v = torch.zeros(numel), torch.zeros(numel)
    sizes = [p.numel() for p in params] if scale_per == "tensor" else None
    allreduce = RefBucketedAllreduce(numel, world_size, bucket_size, sizes)
    history = []
    for t in range(1, steps + 1):
        grads = [
            torch.cat([PROBLEM.grad(t, r, i, p).view(-1) for i, p in enumerate(params)])
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
            clipped = [g_r * _clip_coefficient(g_r.norm(), max_grad_norm) for g_r in grads]
            m = allreduce([m.lerp(g_r, 1 - beta1) for g_r in clipped])
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
    numel = PROBLEM.numel
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
    params, ref = PROBLEM.params(), PROBLEM.params()
    opt = onebit.OnebitAdam(
        PROBLEM.groups(params),
        warmup_compression="fp32",
        lr=1e-2,
        weight_decay=0.1,
        freeze_step=1000,
    )
    ref_opt = torch.optim.AdamW(PROBLEM.groups(ref), lr=1e-2, weight_decay=0.1)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (opt, ref_opt)
    ]
    for step in range(1, 21):
        PROBLEM.set_grads(params, step, 0)
        PROBLEM.set_grads(ref, step, 0)
        opt.step()
        ref_opt.step()
        for s in schedulers:
            s.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert opt.comm_stats.bytes_total == 0
    torch.testing.assert_close(opt.state[params[0]]["exp_avg"], ref_opt.state[ref[0]]["exp_avg"])


def _warmup_against_fused_adamw(device: torch.device) -> None:
    """Warmup steps with param groups and a scheduler are AdamW(fused=True)'s, bit for bit; the
    freeze then works on the variance the fused kernel kept."""
    params = [torch.nn.Parameter(p.detach().to(device)) for p in PROBLEM.params()]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = onebit.OnebitAdam(
        PROBLEM.groups(params), warmup_compression="fp32", lr=1e-2, weight_decay=0.1, freeze_step=12
    )
    ref_opt = torch.optim.AdamW(PROBLEM.groups(ref), lr=1e-2, weight_decay=0.1, fused=True)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (opt, ref_opt)
    ]
    for step in range(1, 13):
        for ps in (params, ref):
            for i, p in enumerate(ps):
                p.grad = PROBLEM.grad(step, 0, i, p.detach().cpu()).to(device)
        opt.step()
        ref_opt.step()
        for s in schedulers:
            s.step()
        assert all(torch.equal(p, q) for p, q in zip(params, ref)), step
    assert torch.equal(opt.state[params[0]]["exp_avg"], ref_opt.state[ref[0]]["exp_avg"])
    assert opt.stage == "compression"
    for i, p in enumerate(params):
        p.grad = PROBLEM.grad(13, 0, i, p.detach().cpu()).to(device)
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_warmup_in_torchs_fused_adamw_kernel_is_adamw_fused(monkeypatch):
    """On CUDA the warmup runs torch's fused AdamW kernel; the CPU has the same kernel, so the
    path is checked here too."""
    monkeypatch.setattr(onebit.optim.adam_step, "FUSED_ADAM_DEVICES", ("cpu",))
    _warmup_against_fused_adamw(torch.device("cpu"))


@pytest.mark.cuda
def test_warmup_on_cuda_is_adamw_fused():
    _warmup_against_fused_adamw(torch.device("cuda"))


def _warmup_vs_ddp(rank, world_size, steps):
    torch.manual_seed(rank)  # different initial weights per rank: both must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ours = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    opt = onebit.OnebitAdam(
        ours.parameters(), warmup_compression="fp32", lr=1e-2, weight_decay=0.01, freeze_step=steps
    )
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_keep_fp32_state(dtype):
    params, ref = PROBLEM.params(dtype), PROBLEM.params()
    opt = onebit.OnebitAdam(params, warmup_compression="fp32", lr=1e-2, freeze_step=3)
    ref_opt = onebit.OnebitAdam(ref, warmup_compression="fp32", lr=1e-2, freeze_step=3)
    for step in range(1, 7):
        PROBLEM.set_grads(params, step, 0)
        PROBLEM.set_grads(ref, step, 0)
        opt.step()
        ref_opt.step()
    assert all(p.dtype == dtype for p in params)
    state = opt.state_dict()["state"]  # the momentum is packed: unpacked here
    assert all(s[key].dtype == torch.float32 for s in state.values() for key in s)
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.float(), q, rtol=0.05, atol=0.05)


def test_none_gradient_counts_as_zero_and_mask_keeps_zeros():
    mask = torch.ones(PROBLEM.shapes[0])
    mask[0] = 0
    runs = []
    for none_grad in (True, False):
        params = PROBLEM.params()
        opt = onebit.OnebitAdam(
            params,
            warmup_compression="fp32",
            lr=1e-2,
            freeze_step=2,
            exp_avg_mask={params[0]: mask},
        )
        for step in range(1, 6):
            PROBLEM.set_grads(params, step, 0)
            params[2].grad = None if none_grad else torch.zeros_like(params[2])
            opt.step()
        exp_avg = opt.state_dict()["state"][0]["exp_avg"]  # packed: unpacked here
        assert torch.all(exp_avg[0] == 0)
        assert torch.all(exp_avg[1] != 0)
        runs.append(params)
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_state_views_share_the_flat_buffers():
    params = PROBLEM.params()
    opt = onebit.OnebitAdam(params, warmup_compression="fp32", freeze_step=2)
    exp_avg = opt.state[params[1]]["exp_avg"]
    assert exp_avg.shape == params[1].shape
    assert (
        exp_avg.untyped_storage().data_ptr()
        == opt.state[params[0]]["exp_avg"].untyped_storage().data_ptr()
    )


def test_no_process_group_needed():
    assert not dist.is_initialized()
    warnings.simplefilter("error")
    params = PROBLEM.params()
    opt = onebit.OnebitAdam(params, warmup_compression="fp32", freeze_step=1)
    PROBLEM.set_grads(params, 1, 0)
    opt.step()
    PROBLEM.set_grads(params, 2, 0)
    opt.step()
    assert opt.stage == "compression"


def test_backend_names_the_kernels_its_steps_run(monkeypatch):
    """``backend`` is the backend of the parameters' device, as ``ONEBIT_BACKEND`` sets it."""
    cpu = onebit.kernels.for_device(torch.device("cpu")).name
    assert (
        onebit.OnebitAdam(PROBLEM.params(), warmup_compression="fp32", freeze_step=1).backend == cpu
    )
    monkeypatch.setenv(onebit.kernels.ENV, "torch")
    opt = onebit.OnebitAdam(PROBLEM.params(), warmup_compression="fp32", freeze_step=1)
    assert opt.backend == "torch" and opt.check_packed() is None  # the reference packs nothing
