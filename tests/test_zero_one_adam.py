"""ZeroOneAdam (SPEC section 4) against AdamW and a simulation of every rank, on gloo ranks."""

import copy
import math
import warnings

import pytest
import torch
from distributed import run_ranks
from harness import CASES, ZERO_ONE_SCHEDULE, low_precision_runs, poison, run
from optimizer_state import flat, roundtrip, storage_bytes
from reference import RefBucketedAllreduce

import onebit
from onebit.transport.header import HEADER_NUMEL
from onebit.wire.protocol import allreduce_bytes
from onebit.zero_one_adam import PAPER_SCHEDULE, run_freeze_step, run_schedule

CASE = CASES["zero_one"]
PROBLEM = CASE.problem
SHAPES, LRS, WDS = PROBLEM.shapes, PROBLEM.lrs, PROBLEM.wds
NUMEL, SIZES = PROBLEM.numel, PROBLEM.sizes
CONFIG = ZERO_ONE_SCHEDULE
STEPS, BUCKET = CASE.steps, CASE.settings["bucket_size"]


def _unflat(flat):
    out, offset = [], 0
    for s in SHAPES:
        n = math.prod(s)
        out.append(flat[offset : offset + n].view(s))
        offset += n
    return out


def reference_zero_one_adam(world_size, steps, *, var_freeze_step, var_update_scaler,
                            local_step_scaler, local_step_clipper):  # fmt: skip
    """SPEC section 4 for every rank at once, in the SPEC's own terms (``acc``, ``lrs``).

    Weight decay follows the library's documented rule: it scales the parameters and ``acc``
    alike each local step and stays out of the rebuilt momentum.
    """
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    lr = torch.cat([torch.full((math.prod(s),), x) for s, x in zip(SHAPES, LRS)])
    wd = torch.cat([torch.full((math.prod(s),), x) for s, x in zip(SHAPES, WDS)])
    params = [flat(PROBLEM.params()) for _ in range(world_size)]
    m, v = torch.zeros(NUMEL), torch.zeros(NUMEL)
    allreduce = RefBucketedAllreduce(NUMEL, world_size, BUCKET, SIZES)
    var_interval, var_counter, var_updates = 1, 0, 0
    local_interval, local_counter = 1, 0
    history, stages = [], []
    for t in range(1, steps + 1):
        grads = [
            torch.cat([PROBLEM.grad(t, r, i, p).view(-1) for i, p in enumerate(_unflat(params[r]))])
            for r in range(world_size)
        ]
        step_size = lr / (1 - beta1**t)
        if t <= var_freeze_step:
            if t % var_interval == 0:
                stages.append("variance")
                g = torch.stack(grads).sum(0) / world_size
                v = v.mul(beta2).addcmul(g, g, value=1 - beta2)
                var_updates += 1
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, 2 * var_interval
            else:
                stages.append("compression")
                g = allreduce(grads)
            m = m.lerp(g, 1 - beta1)
            denom = (v.sqrt() / math.sqrt(1 - beta2**var_updates)).add(eps)
            p = params[0].mul(1 - lr * wd) - step_size * m / denom
            params = [p.clone() for _ in range(world_size)]
        else:
            if t == var_freeze_step + 1:
                denom = (v.sqrt() / math.sqrt(1 - beta2**var_updates)).add(eps)
                allreduce = RefBucketedAllreduce(NUMEL, world_size, BUCKET, SIZES)  # errors reset
                ms = [m.clone() for _ in range(world_size)]
                acc = [torch.zeros(NUMEL) for _ in range(world_size)]
                lrs = torch.zeros(NUMEL)
            for r in range(world_size):
                ms[r] = ms[r].lerp(grads[r], 1 - beta1)
                u = step_size * ms[r] / denom
                params[r] = params[r].mul(1 - lr * wd) - u
                acc[r] = acc[r].mul(1 - lr * wd) - u
            lrs = lrs + step_size
            if t % local_interval == 0:
                stages.append("sync")
                params = [p - a for p, a in zip(params, acc)]
                avg = allreduce([a * denom for a in acc])
                ms = [-avg / lrs for _ in range(world_size)]
                params = [p + avg / denom for p in params]
                acc = [torch.zeros(NUMEL) for _ in range(world_size)]
                lrs = torch.zeros(NUMEL)
            else:
                stages.append("local")
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter = 0
                local_interval = min(local_step_clipper, 2 * local_interval)
        history.append([p.clone() for p in params])
    return history, stages


def _straight_run(rank, world_size, low_precision):
    params = PROBLEM.params()
    opt = CASE.optimizer(params)
    trace = run(CASE, params, opt, rank, 1, STEPS)
    before_sync, stats = flat(params), copy.deepcopy(opt.comm_stats)
    opt.synchronize()
    result = {
        "history": trace.params,
        "stages": trace.stages,
        "stats": stats,
        "synchronize_bytes": opt.comm_stats.total_bytes["synchronize"],
        "bytes_per_call": [c.bytes_per_call for c in opt.comms],
        "before_sync": before_sync,
        "after_sync": flat(params),
    }
    if low_precision:
        result["low_precision"] = low_precision_runs(CASE, rank)
    return result


def _check_against_reference(results, world_size):
    expected, stages = reference_zero_one_adam(world_size, STEPS, **CONFIG)
    for rank, result in enumerate(results):
        assert result["stages"] == stages
        for t in range(STEPS):
            torch.testing.assert_close(
                result["history"][t], expected[t][rank], rtol=1e-5, atol=1e-5
            )
    for t, stage in enumerate(stages):
        same = all(torch.equal(r["history"][t], results[0]["history"][t]) for r in results)
        if stage != "local":
            assert same, f"replicas differ after {stage} step {t + 1}"
    # Local steps really are local: the replicas move apart between syncs.
    assert not torch.equal(results[0]["history"][-1], results[1]["history"][-1])
    # synchronize() brings them together (and they were apart before).
    assert all(torch.equal(r["after_sync"], results[0]["after_sync"]) for r in results)
    assert not torch.equal(results[0]["after_sync"], results[0]["before_sync"])

    stats = results[0]["stats"]
    counts = {s: stages.count(s) for s in set(stages)}
    assert stats.steps == counts
    assert stats.rounds_skipped == counts["local"]
    assert stats.total_bytes["local"] == 0
    # The last bucket is sent padded, with one header per rank (the step check).
    last = -(-(NUMEL - 64) // (8 * world_size)) * 8 * world_size + HEADER_NUMEL * world_size
    fp32_bytes = sum(allreduce_bytes(4 * size, world_size) for size in [32, 32, last])
    assert stats.total_bytes["variance"] == counts["variance"] * fp32_bytes
    compressed = sum(results[0]["bytes_per_call"])
    headers = 3 * (world_size - 1) * 4 * HEADER_NUMEL  # in each bucket's phase-1 message
    assert 0 < compressed - headers < fp32_bytes / 4  # tiny buckets: the scales weigh a lot
    assert stats.total_bytes["compression"] == counts["compression"] * compressed
    assert stats.total_bytes["sync"] == counts["sync"] * compressed
    assert results[0]["synchronize_bytes"] == compressed
    assert stats.freeze_step == CONFIG["var_freeze_step"]


def test_two_ranks_match_reference_and_keep_low_precision_replicas_together():
    results = run_ranks(_straight_run, 2, True)
    _check_against_reference(results, 2)

    # bf16 and fp16 parameters: fp32 state, identical replicas after every synchronising step.
    for dtype in (torch.bfloat16, torch.float16):
        (trace0, fp32_0), (trace1, fp32_1) = [r["low_precision"][dtype] for r in results]
        synced0, synced1 = [
            [p for p, stage in zip(t.params, t.stages) if stage != "local"]
            for t in (trace0, trace1)
        ]
        assert fp32_0 and fp32_1
        assert all(torch.equal(a, b) for a, b in zip(synced0, synced1))
        assert all(torch.isfinite(a).all() for a in synced0)


def test_four_ranks_match_reference():
    results = run_ranks(_straight_run, 4, False)
    _check_against_reference(results, 4)


def test_world_size_one_matches_reference():
    params = PROBLEM.params()
    trace = run(CASE, params, CASE.optimizer(params), 0, 1, STEPS)
    expected, expected_stages = reference_zero_one_adam(1, STEPS, **CONFIG)
    assert trace.stages == expected_stages
    for got, want in zip(trace.params, expected):
        torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


def test_matches_adamw_while_variance_is_updated_every_step():
    """With var_interval stuck at 1, no freeze and fp32 variance steps, every step is AdamW on
    averaged gradients."""
    params, ref = PROBLEM.params(), PROBLEM.params()
    opt = onebit.ZeroOneAdam(
        PROBLEM.groups(params),
        lr=1e-2,
        weight_decay=0.1,
        var_freeze_step=100,
        var_update_scaler=100,
        warmup_compression="fp32",
    )
    ref_opt = torch.optim.AdamW(PROBLEM.groups(ref), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.5)
    for t in range(1, 21):
        PROBLEM.set_grads(params, t, 0)
        PROBLEM.set_grads(ref, t, 0)
        opt.step()
        ref_opt.step()
        scheduler.step()
        ref_scheduler.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        opt.state[params[0]]["exp_avg_sq"], ref_opt.state[ref[0]]["exp_avg_sq"]
    )
    assert opt.comm_stats.steps == {"variance": 20}


def test_memory_is_four_model_sized_buffers_plus_server_error():
    """Four model-sized buffers and the server error; in phase A an int4 variance step's own
    worker and server errors besides, freed at the freeze."""
    params = [torch.nn.Parameter(torch.randn(1000, 100)), torch.nn.Parameter(torch.randn(101))]
    numel = 100_101
    slack = 4 * 8 * 4  # padding of the padded buffers
    limit = 4 * 4 * numel + 4 * numel + slack  # 4 buffers + the server error (world size 1)
    for warmup, phase_a in (("fp32", limit), ("int4", limit + 2 * 4 * numel + 1024)):
        opt = onebit.ZeroOneAdam(
            params, var_freeze_step=3, var_update_scaler=1, warmup_compression=warmup
        )
        for t in range(1, 8):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
            stage = opt.comm_stats.last_step_stage
            bound = phase_a if opt.in_warmup else limit
            assert storage_bytes(opt) <= bound, f"{warmup} step {t} ({stage})"
        assert opt.comm_stats.steps.get("local", 0) + opt.comm_stats.steps["sync"] == 4


def test_single_process_non_finite_and_none_gradients():
    params = PROBLEM.params()
    opt = CASE.optimizer(params)
    stages = {}
    for call in range(1, 21):
        before, stages[call] = flat(params), opt.stage
        PROBLEM.set_grads(params, call, 0)
        if call in (3, 18):
            poison(params)
        if call == 7:
            params[1].grad = None  # counts as zero
        opt.step()
        if call in (3, 18):  # a compressed step of phase A, then a local step of phase B
            assert torch.equal(flat(params), before), stages[call]
        assert torch.isfinite(flat(params)).all()
    assert (stages[3], stages[18]) == ("compression", "local")
    assert opt.skipped_steps == 1 and opt.local_skipped_steps == 1
    assert opt.num_steps == 19


def test_state_names_follow_the_phase():
    params = PROBLEM.params()
    opt = CASE.optimizer(params)
    assert set(opt.state[params[0]]) == {"exp_avg", "exp_avg_sq"}
    run(CASE, params, opt, 0, 1, 13)
    assert set(opt.state[params[0]]) == {"exp_avg", "frozen_denom", "sync_params"}
    assert all(s.dtype == torch.float32 for s in opt.state[params[0]].values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh = CASE.optimizer(PROBLEM.params())
        fresh.load_state_dict(roundtrip(opt.state_dict()))
    assert set(fresh.state[fresh.layout.params[0]]) == {"exp_avg", "frozen_denom", "sync_params"}


def test_the_schedule_is_sized_to_the_run_when_told_its_length():
    """``total_steps`` scales ``var_update_scaler``, ``local_step_scaler`` and
    ``local_step_clipper`` (:func:`run_schedule`), and without ``var_freeze_step`` phase A's
    length; explicit knobs win; without it, the paper's."""
    # Phase A in variance steps only; a sync every other step in phase B.
    assert run_schedule(600, 120) == (120, 1, 2)
    assert run_schedule(118_000, 23_000) == (128, 11_875, 16)  # the paper's BERT-Base run
    assert run_schedule(300, 60) == (60, 240, 1)  # too short for local steps
    assert run_schedule(5_000, 1_000) == (128, 1, 2)
    assert run_schedule(15_000, 3_000) == (128, 3_000, 4)  # intervals 1, 2, then 4 for 6k steps
    assert run_schedule(100, 10).var_update_scaler == 16
    assert [run_freeze_step(n) for n in (1, 600, 5_000)] == [1, 120, 1_000]
    params = [torch.nn.Parameter(torch.zeros(8))]
    told = onebit.ZeroOneAdam(params, total_steps=600)
    knobs = (told.var_freeze_step, told.var_update_scaler, told.local_step_scaler)
    assert knobs + (told.local_step_clipper,) == (120, 120, 1, 2)
    mixed = onebit.ZeroOneAdam(
        params, var_freeze_step=120, total_steps=600, local_step_clipper=8, var_update_scaler=4
    )
    assert (mixed.var_update_scaler, mixed.local_step_scaler, mixed.local_step_clipper) == (
        4, 80, 8,
    )  # fmt: skip
    # A scaler given asks for local steps: the clipper stays the paper's, not the run's 1.
    asked = onebit.ZeroOneAdam(params, var_freeze_step=2, total_steps=6, local_step_scaler=1)
    assert (asked.local_step_scaler, asked.local_step_clipper) == (1, 16)
    assert onebit.ZeroOneAdam(params, var_freeze_step=2, total_steps=6).local_step_clipper == 1
    with pytest.raises(ValueError, match="var_freeze_step=N .* or total_steps=N"):
        onebit.ZeroOneAdam(params)
    paper = onebit.ZeroOneAdam(params, var_freeze_step=120)
    knobs = (paper.var_update_scaler, paper.local_step_scaler, paper.local_step_clipper)
    assert knobs == PAPER_SCHEDULE
