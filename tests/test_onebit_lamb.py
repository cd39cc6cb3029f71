"""OnebitLamb (SPEC section 5) against plain LAMB and a simulation of every rank, on gloo ranks."""

import copy
import math
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from optimizer_state import flat, roundtrip, storage_bytes
from reference import RefBucketedAllreduce

import onebit

SHAPES = [(7, 5), (13,), (0,), (3, 3, 2), (4,)]
LRS, WDS = [2e-2, 2e-2, 5e-3, 5e-3, 5e-3], [0.1, 0.1, 0.0, 0.0, 0.0]
FREEZE, STEPS, CHECKPOINT, BUCKET = 8, 20, 14, 32
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
MIN_COEFF, MAX_COEFF, COEFF_BETA = 0.01, 10.0, 0.9
FACTOR_MIN, FACTOR_MAX, THRESHOLD = 0.5, 4.0, 0.1


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _groups(params):
    return [
        {"params": params[:2]},
        {"params": params[2:], "lr": LRS[2], "weight_decay": WDS[2]},
    ]


def _optimizer(params, freeze_step=FREEZE, **kwargs):
    return onebit.OnebitLamb(
        _groups(params),
        lr=LRS[0],
        weight_decay=WDS[0],
        freeze_step=freeze_step,
        bucket_size=BUCKET,
        **kwargs,
    )


def _grad(step, rank, i, p):
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
    return torch.randn(p.shape, generator=gen) * (1 + rank) + 0.3 * p.detach().float()


def _set_grads(params, step, rank, poison=False):
    for i, p in enumerate(params):
        g = _grad(step, rank, i, p)
        if poison and g.numel():
            g.view(-1)[-1] = float("nan")
        p.grad = g.to(p.dtype)


def reference_onebit_lamb(world_size, steps, freeze_step):
    """SPEC section 5 for every rank at once (the parameters are the same on all of them).

    Warmup is plain LAMB with Adam's bias correction. Returns each step's flat parameters and
    trust ratios, and the coefficients frozen at the switch.
    """
    params = [p.detach().clone() for p in _params()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    ema, count = [0.0] * len(params), [0] * len(params)
    history, coeff_history, frozen = [], [], {}
    for t in range(1, steps + 1):
        grads = [[_grad(t, r, i, p) for i, p in enumerate(params)] for r in range(world_size)]
        bc1, bc2 = 1 - BETA1**t, 1 - BETA2**t
        coeffs = []
        if t <= freeze_step:
            for i, p in enumerate(params):
                g = sum(grads[r][i] for r in range(world_size)) / world_size
                m[i] = m[i].lerp(g, 1 - BETA1)
                v[i] = v[i].mul(BETA2).addcmul(g, g, value=1 - BETA2)
                u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + EPS) + WDS[i] * p
                w_norm, u_norm = p.norm().item(), u.norm().item()
                coeff = 1.0
                if w_norm > 0 and u_norm > 0:
                    coeff = min(max(w_norm / u_norm, MIN_COEFF), MAX_COEFF)
                    ema[i] = COEFF_BETA * ema[i] + (1 - COEFF_BETA) * coeff
                    count[i] += 1
                coeffs.append(coeff)
                params[i] = p - LRS[i] * coeff * u
        else:
            if t == freeze_step + 1:
                denom_t = [(x / (1 - BETA2**freeze_step)).sqrt() + EPS for x in v]
                v_fresh = [x.clone() for x in v]
                s = [x.norm().item() / math.sqrt(max(x.numel(), 1)) for x in m]
                mean_s = sum(x for x in s if x > 0) / sum(1 for x in s if x > 0)
                scaling = [mean_s / x if x > 0 else 1.0 for x in s]
                frozen_coeffs = [e / (1 - COEFF_BETA**c) if c else 1.0 for e, c in zip(ema, count)]
                last = [1.0] * len(params)
                allreduce = RefBucketedAllreduce(
                    sum(p.numel() for p in params), world_size, BUCKET, [p.numel() for p in params]
                )
                frozen = {"scaling": scaling, "coeffs": frozen_coeffs}
            local = [
                torch.cat(
                    [
                        (m[i].lerp(grads[r][i], 1 - BETA1) * scaling[i]).view(-1)
                        for i in range(len(params))
                    ]
                )
                for r in range(world_size)
            ]
            averaged = allreduce(local)
            offset = 0
            for i, p in enumerate(params):
                n = p.numel()
                new_m = averaged[offset : offset + n].view_as(p) / scaling[i]
                offset += n
                g = (new_m - BETA1 * m[i]) / (1 - BETA1)
                v_fresh[i] = v_fresh[i].mul(BETA2).addcmul(g, g, value=1 - BETA2)
                m[i] = new_m
                denom_fresh = (v_fresh[i] / bc2).sqrt() + EPS
                factor = (denom_t[i] / denom_fresh).max().item() if n else 1.0
                adaptive = (m[i] / bc1) / denom_t[i]
                u = adaptive + WDS[i] * p
                if WDS[i] > 0 and u.norm() > 0:
                    ratio = min(1.0, (adaptive.norm() / u.norm()).item())
                    factor = factor * ratio + (1 - ratio)
                factor = min(max(factor, FACTOR_MIN), FACTOR_MAX)
                factor = min(max(factor, last[i] * (1 - THRESHOLD)), last[i] * (1 + THRESHOLD))
                last[i] = factor
                coeffs.append(frozen_coeffs[i] * factor)
                params[i] = p - LRS[i] * coeffs[-1] * u
        history.append(flat(params))
        coeff_history.append(coeffs)
    return history, coeff_history, frozen


def _run(params, opt, rank, first, last, checkpoint=None, save_dir=None):
    history, coeffs = [], []
    for t in range(first, last + 1):
        _set_grads(params, t, rank)
        opt.step()
        history.append(flat(params))
        coeffs.append(opt.get_lamb_coeffs())
        if t == checkpoint:
            torch.save(
                {"model": [p.detach().clone() for p in params], "optim": opt.state_dict()},
                Path(save_dir) / f"rank{rank}.pt",
            )
    return history, coeffs


def _straight_run(rank, world_size, save_dir):
    params = _params()
    opt = _optimizer(params)
    checkpoint = CHECKPOINT if save_dir is not None else None
    history, coeffs = _run(params, opt, rank, 1, STEPS, checkpoint, save_dir)
    extra = opt.state_dict()["onebit"]
    result = {
        "history": history,
        "coeffs": coeffs,
        "stats": opt.comm_stats,
        "bytes_per_call": [c.bytes_per_call for c in opt.comms],
        "frozen": (extra["scaling_coeffs"].tolist(), extra["frozen_coeffs"].tolist()),
    }
    if save_dir is not None:
        result["non_finite"] = _non_finite_run(rank)
        result["low_precision"] = _low_precision_run(rank)
    return result


def _resumed_run(rank, world_size, save_dir):
    params = _params()
    opt = _optimizer(params)
    saved = torch.load(Path(save_dir) / f"rank{rank}.pt", weights_only=False)
    with torch.no_grad():
        for p, q in zip(params, saved["model"]):
            p.copy_(q)
    opt.load_state_dict(saved["optim"])
    history, coeffs = _run(params, opt, rank, CHECKPOINT + 1, STEPS)
    return history, coeffs, opt.comm_stats


def _non_finite_run(rank):
    """Rank 1 has a NaN gradient in call 3 (warmup) and call 12 (compression, step 11)."""
    params = _params()
    opt = _optimizer(params)
    unchanged = []
    for call in range(1, 15):
        before = flat(params)
        errors = [c.state_dict() for c in opt.comms]
        stage = opt.stage
        _set_grads(params, call, rank, poison=rank == 1 and call in (3, 12))
        opt.step()
        if call in (3, 12):
            same_errors = all(
                torch.equal(a["worker_error"], b.worker_error)
                and torch.equal(a["server_error"], b.server_error)
                for a, b in zip(errors, opt.comms)
            )
            unchanged.append((stage, torch.equal(before, flat(params)), same_errors))
    return unchanged, opt.skipped_steps, opt.num_steps, flat(params)


def _low_precision_run(rank):
    results = {}
    for dtype in (torch.bfloat16, torch.float16):
        params = _params(dtype)
        opt = _optimizer(params)
        history, _ = _run(params, opt, rank, 1, STEPS)
        state = [s for p in params for s in opt.state[p].values()]
        results[dtype] = (history, all(s.dtype == torch.float32 for s in state))
    return results


def _check_against_reference(results, world_size):
    expected, expected_coeffs, frozen = reference_onebit_lamb(world_size, STEPS, FREEZE)
    for result in results:
        for t in range(STEPS):
            torch.testing.assert_close(result["history"][t], expected[t], rtol=1e-5, atol=1e-5)
            assert result["coeffs"][t] == pytest.approx(expected_coeffs[t], rel=1e-4)
            # Replicas never drift apart: the same bits on every rank after every step.
            assert torch.equal(result["history"][t], results[0]["history"][t])
        scaling, coeffs = result["frozen"]
        assert scaling == pytest.approx(frozen["scaling"], rel=1e-5)
        assert coeffs == pytest.approx(frozen["coeffs"], rel=1e-5)
    stats = results[0]["stats"]
    assert stats.steps == {"warmup": FREEZE, "compression": STEPS - FREEZE}
    assert stats.total_bytes["compression"] == (STEPS - FREEZE) * sum(results[0]["bytes_per_call"])
    assert stats.freeze_step == FREEZE and stats.rounds_skipped == 0


def test_two_ranks_match_reference_resume_exactly_and_skip_non_finite(tmp_path):
    results = run_ranks(_straight_run, 2, str(tmp_path))
    _check_against_reference(results, 2)

    resumed = run_ranks(_resumed_run, 2, str(tmp_path))
    for rank, (history, coeffs, stats) in enumerate(resumed):
        assert all(
            torch.equal(a, b) for a, b in zip(history, results[rank]["history"][CHECKPOINT:])
        )
        assert coeffs == results[rank]["coeffs"][CHECKPOINT:]
        assert stats == results[rank]["stats"]

    (unchanged0, skipped0, steps0, final0), (unchanged1, skipped1, steps1, final1) = [
        r["non_finite"] for r in results
    ]
    expected = [("warmup", True, True), ("compression", True, True)]
    assert unchanged0 == unchanged1 == expected
    assert skipped0 == skipped1 == 2 and steps0 == steps1 == 12
    assert torch.equal(final0, final1) and torch.isfinite(final0).all()

    for dtype in (torch.bfloat16, torch.float16):
        (history0, fp32_0), (history1, fp32_1) = [r["low_precision"][dtype] for r in results]
        assert fp32_0 and fp32_1
        assert all(torch.equal(a, b) for a, b in zip(history0, history1))
        assert torch.isfinite(history0[-1]).all()
        # bf16/fp16 rounding flips some signs; the run as a whole stays close to the fp32 one.
        reference = results[0]["history"][-1]
        assert (history0[-1] - reference).norm() < 0.05 * reference.norm()


def test_four_ranks_match_reference():
    _check_against_reference(run_ranks(_straight_run, 4, None), 4)


def test_world_size_one_without_freeze_is_plain_lamb():
    params = _params()
    history, coeffs = _run(params, _optimizer(params, freeze_step=10**6), 0, 1, STEPS)
    expected, expected_coeffs, _ = reference_onebit_lamb(1, STEPS, 10**6)
    for t in range(STEPS):
        torch.testing.assert_close(history[t], expected[t], rtol=1e-6, atol=1e-6)
        assert coeffs[t] == pytest.approx(expected_coeffs[t], rel=1e-5)


def test_world_size_one_matches_reference_through_the_freeze():
    params = _params()
    history, coeffs = _run(params, _optimizer(params), 0, 1, STEPS)
    expected, expected_coeffs, _ = reference_onebit_lamb(1, STEPS, FREEZE)
    for t in range(STEPS):
        torch.testing.assert_close(history[t], expected[t], rtol=1e-5, atol=1e-5)
        assert coeffs[t] == pytest.approx(expected_coeffs[t], rel=1e-4)


@pytest.mark.parametrize("checkpoint", [3, FREEZE, FREEZE + 1, CHECKPOINT])
def test_resume_is_bitwise_exact(checkpoint):
    params = _params()
    straight, straight_coeffs = _run(params, _optimizer(params), 0, 1, STEPS)
    params = _params()
    opt = _optimizer(params)
    _run(params, opt, 0, 1, checkpoint)
    saved = roundtrip({"model": [p.detach().clone() for p in params], "optim": opt.state_dict()})
    params = _params()
    opt = _optimizer(params)
    with torch.no_grad():
        for p, q in zip(params, saved["model"]):
            p.copy_(q)
    opt.load_state_dict(saved["optim"])
    resumed, coeffs = _run(params, opt, 0, checkpoint + 1, STEPS)
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight[checkpoint:]))
    assert coeffs == straight_coeffs[checkpoint:]


def test_state_follows_the_stage_and_coeffs_are_a_copy():
    params = _params()
    opt = _optimizer(params)
    assert opt.get_lamb_coeffs() == [1.0] * len(SHAPES)
    _run(params, opt, 0, 1, FREEZE + 1)
    assert set(opt.state[params[0]]) == {"exp_avg", "frozen_denom", "exp_avg_sq_fresh"}
    assert all(s.dtype == torch.float32 for s in opt.state[params[0]].values())
    coeffs = opt.get_lamb_coeffs()
    coeffs[0] = -1.0
    assert opt.get_lamb_coeffs()[0] != -1.0
    assert opt.get_lamb_coeffs()[2] == 1.0  # the empty parameter
    fresh = _optimizer(_params())
    fresh.load_state_dict(roundtrip(opt.state_dict()))
    assert set(fresh.state[fresh.layout.params[0]]) == set(opt.state[params[0]])
    assert fresh.get_lamb_coeffs() == opt.get_lamb_coeffs()


def test_memory_is_five_model_sized_buffers_in_the_compression_stage():
    params = [torch.nn.Parameter(torch.randn(1000, 100)), torch.nn.Parameter(torch.randn(101))]
    numel = 100_101
    opt = onebit.OnebitLamb(params, freeze_step=2)
    for t in range(4):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        buffers = 4 if t < 2 else 5
        # + the server error (world size 1: a whole model), + padding and per-layer scalars
        assert storage_bytes(opt) <= (buffers + 1) * 4 * numel + 1024


def test_bad_hyperparameters_raise_value_error():
    params = _params()
    for kwargs in [
        dict(lr=-1.0),
        dict(betas=(0.9, 1.0)),
        dict(eps=-1.0),
        dict(weight_decay=-1.0),
        dict(freeze_step=0),
        dict(freeze_step="never"),
        dict(max_coeff=0.001),
        dict(min_coeff=0.0),
        dict(coeff_beta=1.0),
        dict(factor_min=0.0),
        dict(factor_max=0.1),
        dict(factor_threshold=-0.1),
        dict(factor_threshold=1.0),
        dict(bucket_size=0),
        dict(auto_freeze=onebit.AutoFreeze()),
    ]:
        kwargs = {"freeze_step": 5, **kwargs}
        with pytest.raises(ValueError):
            onebit.OnebitLamb(params, **kwargs)


def test_none_gradient_and_lr_scheduler():
    params = _params()
    opt = _optimizer(params)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for t in range(1, 13):
        _set_grads(params, t, 0)
        params[0].grad = None
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(LRS[0] * 0.5**4)
    assert torch.isfinite(flat(params)).all()
    assert copy.deepcopy(opt.comm_stats).steps == {"warmup": FREEZE, "compression": 12 - FREEZE}
