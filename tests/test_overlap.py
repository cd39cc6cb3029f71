"""Communication launched during backward gives bitwise the same results as after it."""

import pytest
import torch
from distributed import run_ranks

import onebit


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 2),
    )


def _train(rank, world_size, overlap, accumulate):
    model = _model()
    opt = onebit.OnebitAdam(
        model.parameters(), lr=1e-2, freeze_step=3, bucket_size=256, overlap_backward=overlap
    )
    launched_early = []
    for step in range(8):
        opt.zero_grad()
        for micro in range(accumulate):
            gen = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if micro < accumulate - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        launched_early.append(len(opt.bucketer.inflight))
        opt.step()
    return [p.detach() for p in model.parameters()], launched_early, len(opt.comms)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_overlapped_backward_is_bitwise_identical(accumulate):
    plain = run_ranks(_train, 2, False, accumulate)
    overlapped = run_ranks(_train, 2, True, accumulate)
    for (want, none_early, _), (got, early, buckets) in zip(plain, overlapped):
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert set(none_early) == {0}
        # From the second step on, every bucket was on the wire before step() was called, in
        # both stages (the first step waits to see whether DDP drives the launches).
        assert buckets > 2 and early[0] == 0 and set(early[1:]) == {buckets}


def test_backward_twice_without_no_sync_is_an_error():
    model = _model()
    opt = onebit.OnebitAdam(model.parameters(), freeze_step=3, overlap_backward=True)
    x = torch.randn(4, 6)
    model(x).sum().backward()
    opt.step()
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        model(x).sum().backward()
    assert opt.num_steps == 1
