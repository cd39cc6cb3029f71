"""``comm_stats``: the bytes each rank sent, beside those an fp32 allreduce of the same gradients
(DDP's traffic) would have sent over the same steps, and the ratio of the two."""

from __future__ import annotations

from distributed import run_ranks
from family import loss_of, make_model, make_optimizer

from onebit.wire.protocol import allreduce_bytes


def _stats(rank, world_size, name):
    model = make_model()
    opt = make_optimizer(name, model.parameters())
    before = opt.comm_stats.fewer_bytes
    for step in range(1, 9):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        opt.step()
    stats = opt.comm_stats
    at_steps = (stats.fp32_bytes_total, stats.bytes_total, stats.fewer_bytes)
    if name == "zero_one":
        opt.synchronize()  # no step: DDP would send nothing for it
    saved = opt.state_dict()
    again = make_optimizer(name, make_model().parameters())
    again.load_state_dict(saved)
    numel = sum(p.numel() for p in model.parameters())
    return before, at_steps, opt.comm_stats.fp32_bytes_total, again.comm_stats, numel


def test_the_fp32_allreduce_figure_counts_every_step_and_survives_a_checkpoint():
    for name in ("adam", "lamb", "zero_one"):
        for before, (fp32, sent, ratio), after, loaded, numel in run_ranks(_stats, 2, name):
            assert before == 1.0  # nothing sent, nothing that would have been
            assert fp32 == 8 * allreduce_bytes(4 * numel, 2) == after
            assert 0 < sent < fp32 and ratio == fp32 / sent
            assert (
                loaded.fp32_bytes_total == fp32 and loaded.fewer_bytes == fp32 / loaded.bytes_total
            )


def _rounds(rank, world_size, name, settings):
    model = make_model()
    opt = make_optimizer(name, model.parameters(), **settings)
    per_step = []
    for step in range(1, 9):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        opt.step()
        stats = opt.comm_stats
        per_step.append((stats.last_step_stage, stats.last_step_rounds))
    if name == "zero_one":
        opt.step()  # step 9, local: the replicas differ
        opt.synchronize()
    again = make_optimizer(name, make_model().parameters(), **settings)
    again.load_state_dict(opt.state_dict())
    return per_step, dict(opt.comm_stats.rounds), again.comm_stats.rounds_total, len(opt.comms)


def test_rounds_count_the_collectives_each_step_waits_on():
    """A round is one collective: an fp32 warmup step is one all_reduce per bucket, a quantized
    or 1-bit exchange two (all-to-all, all-gather) whatever the buckets, a local step none."""
    cases = {
        ("adam", "fp32"): {"warmup": None, "compression": 2},
        ("adam", "int4"): {"warmup": 2, "compression": 2},
        ("zero_one", "int4"): {"variance": 2, "compression": 2, "sync": 2, "local": 0},
        ("zero_one", "fp32"): {"variance": None, "compression": 2, "sync": 2, "local": 0},
    }
    for (name, warmup), per_stage in cases.items():
        settings = {"warmup_compression": warmup}
        for per_step, rounds, loaded, buckets in run_ranks(_rounds, 2, name, settings):
            assert buckets > 1  # so that an fp32 mean's rounds are not those of an exchange
            expected = {k: buckets if v is None else v for k, v in per_stage.items()}
            assert {stage for stage, _ in per_step} == set(expected), (name, warmup)
            assert all(n == expected[stage] for stage, n in per_step), (name, warmup, per_step)
            booked = {stage: 0 for stage, _ in per_step}
            for stage, n in per_step:
                booked[stage] += n
            if name == "zero_one":
                booked["synchronize"] = 2  # one 1-bit exchange
            assert rounds == booked
            assert loaded == sum(rounds.values())


def _one_rank_rounds(rank, world_size):
    model = make_model()
    opt = make_optimizer("adam", model.parameters())
    for step in range(1, 6):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        opt.step()
    return opt.comm_stats.rounds_total


def test_a_single_process_waits_on_no_round():
    assert run_ranks(_one_rank_rounds, 1) == [0]
