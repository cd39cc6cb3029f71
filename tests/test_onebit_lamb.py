"""OnebitLamb (SPEC section 5) against plain LAMB and a simulation of every rank, on gloo ranks."""

import copy
import math

import pytest
import torch
from distributed import run_ranks
from harness import CASES, low_precision_runs, run
from optimizer_state import flat, roundtrip, storage_bytes, temporaries
from reference import RefBucketedAllreduce

import onebit
from onebit import _native
from onebit.optim import lamb_compression

CASE = CASES["lamb"]
PROBLEM = CASE.problem
SHAPES, LRS, WDS = PROBLEM.shapes, PROBLEM.lrs, PROBLEM.wds
FREEZE, STEPS, BUCKET = CASE.settings["freeze_step"], CASE.steps, CASE.settings["bucket_size"]
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
MIN_COEFF, MAX_COEFF, COEFF_BETA = 0.01, 10.0, 0.9
FACTOR_MIN, FACTOR_MAX, THRESHOLD = 0.5, 4.0, 0.1


def reference_onebit_lamb(world_size, steps, freeze_step):
    """SPEC section 5 for every rank at once (the parameters are the same on all of them).

    Warmup is plain LAMB with Adam's bias correction. Returns each step's flat parameters and
    trust ratios, and the coefficients frozen at the switch.
    """
    params = [p.detach().clone() for p in PROBLEM.params()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    ema, count = [0.0] * len(params), [0] * len(params)
    history, coeff_history, frozen = [], [], {}
    for t in range(1, steps + 1):
        grads = [
            [PROBLEM.grad(t, r, i, p) for i, p in enumerate(params)] for r in range(world_size)
        ]
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


def _straight_run(rank, world_size, low_precision):
    params = PROBLEM.params()
    opt = CASE.optimizer(params)
    trace = run(CASE, params, opt, rank, 1, STEPS)
    extra = opt.state_dict()["onebit"]
    result = {
        "history": trace.params,
        "coeffs": trace.observed,
        "stats": opt.comm_stats,
        "bytes_per_call": [c.bytes_per_call for c in opt.comms],
        "frozen": (extra["scaling_coeffs"].tolist(), extra["frozen_coeffs"].tolist()),
    }
    if low_precision:
        result["low_precision"] = low_precision_runs(CASE, rank)
    return result


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


def test_two_ranks_match_reference_and_low_precision_stays_close():
    results = run_ranks(_straight_run, 2, True)
    _check_against_reference(results, 2)

    for dtype in (torch.bfloat16, torch.float16):
        (trace0, fp32_0), (trace1, fp32_1) = [r["low_precision"][dtype] for r in results]
        history0, history1 = trace0.params, trace1.params
        assert fp32_0 and fp32_1
        assert all(torch.equal(a, b) for a, b in zip(history0, history1))
        assert torch.isfinite(history0[-1]).all()
        # bf16/fp16 rounding flips some signs; the run as a whole stays close to the fp32 one.
        reference = results[0]["history"][-1]
        assert (history0[-1] - reference).norm() < 0.05 * reference.norm()


def test_four_ranks_match_reference():
    _check_against_reference(run_ranks(_straight_run, 4, False), 4)


def test_world_size_one_without_freeze_is_plain_lamb():
    params = PROBLEM.params()
    trace = run(CASE, params, CASE.optimizer(params, freeze_step=10**6), 0, 1, STEPS)
    history, coeffs = trace.params, trace.observed
    expected, expected_coeffs, _ = reference_onebit_lamb(1, STEPS, 10**6)
    for t in range(STEPS):
        torch.testing.assert_close(history[t], expected[t], rtol=1e-6, atol=1e-6)
        assert coeffs[t] == pytest.approx(expected_coeffs[t], rel=1e-5)


def test_world_size_one_matches_reference_through_the_freeze():
    params = PROBLEM.params()
    trace = run(CASE, params, CASE.optimizer(params), 0, 1, STEPS)
    history, coeffs = trace.params, trace.observed
    expected, expected_coeffs, _ = reference_onebit_lamb(1, STEPS, FREEZE)
    for t in range(STEPS):
        torch.testing.assert_close(history[t], expected[t], rtol=1e-5, atol=1e-5)
        assert coeffs[t] == pytest.approx(expected_coeffs[t], rel=1e-4)


def test_state_follows_the_stage_and_coeffs_are_a_copy():
    params = PROBLEM.params()
    opt = CASE.optimizer(params)
    assert opt.get_lamb_coeffs() == [1.0] * len(SHAPES)
    run(CASE, params, opt, 0, 1, FREEZE + 1)
    assert set(opt.state[params[0]]) == {"frozen_denom", "exp_avg_sq_fresh"}  # exp_avg packed
    saved = opt.state_dict()["state"][0]
    assert set(saved) == {"exp_avg", "frozen_denom", "exp_avg_sq_fresh"}
    assert all(s.dtype == torch.float32 for s in saved.values())
    coeffs = opt.get_lamb_coeffs()
    coeffs[0] = -1.0
    assert opt.get_lamb_coeffs()[0] != -1.0
    assert opt.get_lamb_coeffs()[2] == 1.0  # the empty parameter
    fresh = CASE.optimizer(PROBLEM.params())
    fresh.load_state_dict(roundtrip(opt.state_dict()))
    assert set(fresh.state[fresh.layout.params[0]]) == set(opt.state[params[0]])
    assert fresh.get_lamb_coeffs() == opt.get_lamb_coeffs()


def test_memory_in_the_compression_stage_is_three_model_sizes_and_the_errors():
    params = [torch.nn.Parameter(torch.randn(1000, 100)), torch.nn.Parameter(torch.randn(101))]
    numel = 100_101
    opt = onebit.OnebitLamb(params, warmup_compression="fp32", freeze_step=2)
    for t in range(4):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        packed = sum(b.numel() + 4 * s.numel() for b, s in opt.packed_momentum.packed or [])
        assert opt.bucketer._buffer is None or t < 2  # the warmup's .grad live there
        # warmup: momentum and variance; compression: frozen denominator, fresh variance and
        # worker error, the packed momentum (1/32 and the scales); + the server error (world
        # size 1: a whole model), padding and per-layer scalars
        buffers, packed_at_most = (2, 0) if t < 2 else (3, numel // 8 + 1024)
        assert storage_bytes(opt) + packed <= (buffers + 1) * 4 * numel + packed_at_most + 1024


@pytest.mark.skipif(_native.load() is None, reason="needs the C kernels")
def test_a_compression_step_takes_two_blocks_of_temporaries(monkeypatch):
    """Where the backend has no pass over every bucket (the C kernels), a compression step
    walks each bucket after its allreduce in blocks (``lamb_compression.BLOCK``): its
    temporaries are two blocks and the packed messages, whatever the bucket size. The first
    one, which freezes, commits the worker errors into the fp32 momentum's storage once it has
    read it, so it holds no second buffer of the model either."""
    monkeypatch.setattr(lamb_compression, "BLOCK", 1024)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 100)) for _ in range(4)]
    numel = 4 * 30_000
    opt = onebit.OnebitLamb(params, warmup_compression="fp32", freeze_step=2, bucket_size=40_000)
    compression = opt._stages["compression"]
    freeze = compression._freeze

    def marked_freeze() -> None:
        with torch.profiler.record_function("freeze"):
            freeze()

    compression._freeze = marked_freeze
    bound = 2 * 4 * lamb_compression.BLOCK + numel // 2  # the messages: a few bits an element
    for t in range(5):
        for p in params:
            p.grad = torch.randn_like(p)
        if t < 2:
            opt.step()
            continue
        assert temporaries(opt.step, "freeze" if t == 2 else None) <= bound, t
    assert opt.packed_momentum.packed is not None
    assert all(c.worker_error.data_ptr() >= opt.exp_avg.data_ptr() for c in opt.comms)


def test_none_gradient_and_lr_scheduler():
    params = PROBLEM.params()
    opt = CASE.optimizer(params)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for t in range(1, 13):
        PROBLEM.set_grads(params, t, 0)
        params[0].grad = None
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(LRS[0] * 0.5**4)
    assert torch.isfinite(flat(params)).all()
    assert copy.deepcopy(opt.comm_stats).steps == {"warmup": FREEZE, "compression": 12 - FREEZE}
