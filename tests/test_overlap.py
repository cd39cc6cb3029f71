"""Communication launched during backward gives bitwise the same results as after it."""

import pytest
import torch
from backends import use_backend
from distributed import run_ranks

import onebit


def _model(strided: bool = False):
    """``strided``: the middle weight transposed in memory, which the optimizer's state follows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 2),
    )
    if strided:
        model[2].weight.data = model[2].weight.data.t().contiguous().t()
    return model


def _train(rank, world_size, overlap, accumulate, backend="auto", strided=False):
    use_backend(backend)
    model = _model(strided)
    opt = onebit.OnebitAdam(
        model.parameters(),
        warmup_compression="fp32",
        lr=1e-2,
        freeze_step=3,
        bucket_size=256,
        overlap_backward=overlap,
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
        sending = opt.bucketer.sending
        packed = getattr(sending, "fused", False)  # through the packed momentum's passes
        launched_early.append((len(opt.bucketer.inflight), packed))
        opt.step()
    stage = opt.packed_momentum
    assert stage is not None and stage.packed is not None  # 1 bit between steps
    return [p.detach() for p in model.parameters()], launched_early, len(opt.comms)


@pytest.mark.parametrize("accumulate,strided", [(1, False), (2, False), (1, True)])
def test_overlapped_backward_is_bitwise_identical(accumulate, strided):
    """Also in the compression stage, where backward's hooks start each bucket's fused pass
    from ``.grad`` and the momentum stays packed (of a weight that is not contiguous, too)."""
    plain = run_ranks(_train, 2, False, accumulate, "auto", strided)
    overlapped = run_ranks(_train, 2, True, accumulate, "auto", strided)
    for (want, none_early, _), (got, early, buckets) in zip(plain, overlapped):
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert {n for n, _ in none_early} == {0}
        # From the second step on, every bucket was on the wire before step() was called, in
        # both stages (the first step waits to see whether DDP drives the launches).
        assert buckets > 2 and early[0][0] == 0 and {n for n, _ in early[1:]} == {buckets}
        assert [packed for _, packed in early[3:]] == [True] * 5


def test_overlapped_backward_on_triton_gives_the_bits_of_its_passes_over_every_bucket():
    """On Triton (under its interpreter here) the hooks run the per-bucket passes, and step()
    without overlap the passes over every bucket at once: the same bits."""
    plain = run_ranks(_train, 2, False, 1, "triton", timeout=600)
    overlapped = run_ranks(_train, 2, True, 1, "triton", timeout=600)
    for (want, _, _), (got, early, _) in zip(plain, overlapped):
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert [packed for _, packed in early[3:]] == [True] * 5


def test_backward_twice_without_no_sync_is_an_error():
    model = _model()
    opt = onebit.OnebitAdam(
        model.parameters(), warmup_compression="fp32", freeze_step=3, overlap_backward=True
    )
    x = torch.randn(4, 6)
    model(x).sum().backward()
    opt.step()
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        model(x).sum().backward()
    assert opt.num_steps == 1
