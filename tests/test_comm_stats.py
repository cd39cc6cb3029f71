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
