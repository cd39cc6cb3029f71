"""A step sends every bucket's phase in one collective (onebit.wire.exchange), on 2 gloo ranks."""

import collections

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from family import all_equal, loss_of, make_model, make_optimizer, params_of

import onebit
from onebit.transport.header import OpenStep
from onebit.wire import exchange

STEPS = 8


def _counted_run(rank, world_size, name, settings):
    """Train STEPS steps; per step, its stage and the collectives of each kind it made."""
    counts = collections.Counter()

    def counting(kind, collective):
        def run(*args, **kwargs):
            counts[kind] += 1
            return collective(*args, **kwargs)

        return run

    patched = [
        (dist, "all_to_all_single", counting("all_to_all", dist.all_to_all_single)),
        (dist, "all_reduce", counting("all_reduce", dist.all_reduce)),
        (exchange, "_all_gather_single", counting("all_gather", exchange._all_gather_single)),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patched]
    for owner, attr, wrapper in patched:
        setattr(owner, attr, wrapper)
    try:
        model = make_model()
        opt = make_optimizer(name, model.parameters(), **settings)
        steps = []
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            loss_of(model, step, rank).backward()
            counts.clear()
            stage = opt.stage
            opt.step()
            steps.append((stage, dict(counts)))
        return len(opt.comms), steps, params_of(model)
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


@pytest.mark.parametrize(
    "name,settings",
    [
        ("adam", {}),
        ("adam", {"warmup_compression": "int8"}),
        ("adam", {"max_grad_norm": 1.0}),
        ("zero_one", {}),
        ("lamb", {}),
    ],
)
def test_a_step_makes_one_collective_per_phase_whatever_its_buckets(name, settings):
    results = run_ranks(_counted_run, 2, name, settings)
    buckets, steps, _ = results[0]
    assert buckets > 1, "the model must make several buckets"
    compressed = 0
    for stage, counts in steps:
        if counts.get("all_reduce"):  # the fp32 warmup: one allreduce per bucket
            continue
        # gloo: phase 2 too is an all-to-all (start_gather)
        assert counts.get("all_to_all", 0) in (0, 2) and "all_gather" not in counts, (stage, counts)
        compressed += counts.get("all_to_all", 0) // 2
    assert compressed >= 3, steps
    assert all(all_equal(a, b) for a, b in zip(results[0][2], results[1][2]))


def _unsent(rank, world_size):
    """Rank 1 fails while filling its messages; rank 0 must raise, not wait."""
    model = make_model()
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-2, bucket_size=128, freeze_step=1,
                            warmup_compression="int8")  # fmt: skip
    loss_of(model, 1, rank).backward()
    if rank == 1:  # each bucket's header is made as its message is filled
        OpenStep.header_for = lambda *args: (_ for _ in ()).throw(ValueError("broken"))
    try:
        opt.step()
    except (ValueError, RuntimeError) as err:
        return type(err).__name__, str(err)
    return None


def test_a_rank_that_fails_while_filling_the_exchange_makes_every_rank_raise():
    (kind0, message0), (kind1, message1) = run_ranks(_unsent, 2, timeout=120)
    assert kind1 == "ValueError" and "broken" in message1
    assert kind0 == "RuntimeError" and "different steps" in message0


def test_an_exchange_cannot_be_read_before_it_is_sent():
    ex = exchange.Exchange([5, 9], 1, None, torch.device("cpu"), gather=False)
    ex.part(1).fill_(7)
    with pytest.raises(RuntimeError, match="not sent"):
        ex.received(0)
    ex.send()
    assert ex.received(1).shape == (1, 9) and bool((ex.received(1) == 7).all())
    assert ex.received(1).data_ptr() % exchange.ALIGN == 0
    with pytest.raises(RuntimeError, match="already sent"):
        ex.send()


def _gathered(rank, world_size):
    """Phase 2 of 5 bytes from each rank, and the collectives it made."""
    counts = collections.Counter()
    real_gather, real_all_to_all = exchange._all_gather_single, dist.all_to_all_single

    def gather(*args, **kwargs):
        counts["all_gather"] += 1
        return real_gather(*args, **kwargs)

    def all_to_all(*args, **kwargs):
        counts["all_to_all"] += 1
        return real_all_to_all(*args, **kwargs)

    exchange._all_gather_single, dist.all_to_all_single = gather, all_to_all
    try:
        message = torch.arange(5, dtype=torch.uint8) + 10 * rank
        out = torch.empty(world_size, 5, dtype=torch.uint8)
        exchange.start_gather(out, message, None).wait()
    finally:
        exchange._all_gather_single, dist.all_to_all_single = real_gather, real_all_to_all
    return out, dict(counts)


def test_phase_two_on_gloo_sends_every_row_in_one_all_to_all():
    """gloo's all-gather is a ring, ``n - 1`` round trips of the link; its all-to-all sends every
    row at once. Every rank gets every rank's message in rank order, from one all-to-all."""
    expected = torch.arange(5, dtype=torch.uint8) + 10 * torch.arange(3, dtype=torch.uint8)[:, None]
    for out, counts in run_ranks(_gathered, 3):
        assert torch.equal(out, expected)
        assert counts == {"all_to_all": 1}
