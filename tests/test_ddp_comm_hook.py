"""onebit.ddp_comm_hook: a DDP-wrapped model trains bitwise as the bare model with onebit."""

import copy
from contextlib import nullcontext

import pytest
import torch
from distributed import run_ranks
from torch.nn.parallel import DistributedDataParallel

import onebit


class _Net(torch.nn.Module):
    """A small MLP with an extra head that only some ranks use (``find_unused_parameters``)."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 2)
        self.extra = torch.nn.Linear(32, 2) if extra else None
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        out = self.head(h)
        return out + self.extra(h) if self.use_extra else out


def _optimizer(name, params, overlap):
    if name == "adam":
        return onebit.OnebitAdam(
            params,
            warmup_compression="fp32",
            lr=1e-2,
            freeze_step=3,
            bucket_size=128,
            overlap_backward=overlap,
        )
    if name == "zero_one":
        return onebit.ZeroOneAdam(
            params, lr=1e-2, var_freeze_step=4, local_step_scaler=2, bucket_size=128
        )
    return onebit.OnebitLamb(
        params, warmup_compression="fp32", lr=1e-2, freeze_step=3, bucket_size=128
    )


def _train(rank, world_size, name, overlap, accumulate, find_unused, bucket_view):
    torch.manual_seed(rank)  # different initial weights: both paths broadcast rank 0's
    bare = _Net(extra=find_unused)
    wrapped = copy.deepcopy(bare)
    bare.use_extra = wrapped.use_extra = find_unused and rank == 0
    bare_opt = _optimizer(name, bare.parameters(), overlap)
    ddp = DistributedDataParallel(
        wrapped, find_unused_parameters=find_unused, gradient_as_bucket_view=bucket_view
    )
    ddp_opt = _optimizer(name, wrapped.parameters(), overlap)
    ddp.register_comm_hook(ddp_opt, onebit.ddp_comm_hook)
    history, early = [], []
    for step in range(9):
        for net, opt, no_sync in ((bare, bare_opt, bare_opt.no_sync), (ddp, ddp_opt, ddp.no_sync)):
            opt.zero_grad()
            for micro in range(accumulate):
                gen = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
                x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
                with no_sync() if micro < accumulate - 1 else nullcontext():
                    torch.nn.functional.mse_loss(net(x), y).backward()
            if opt is ddp_opt:
                early.append(len(opt.bucketer.inflight))
            opt.step()
        if name == "zero_one" and step == 8:
            bare_opt.synchronize()
            ddp_opt.synchronize()
        history.append(
            [
                (a.detach().clone(), b.detach().clone())
                for a, b in zip(bare.parameters(), wrapped.parameters())
            ]
        )
    return history, bare_opt.comm_stats, ddp_opt.comm_stats, early


@pytest.mark.parametrize(
    "name,overlap,accumulate,find_unused,bucket_view",
    [
        ("adam", False, 1, False, False),
        ("adam", True, 2, False, False),
        ("adam", True, 1, True, False),
        ("adam", False, 2, True, False),
        ("zero_one", False, 2, True, False),
        ("lamb", False, 2, True, False),
        # DDP's own .grad views and the optimizer's (in the warmup) take turns: same bits
        ("adam", False, 2, False, True),
        ("lamb", False, 2, True, True),
    ],
)
def test_ddp_wrapped_model_trains_bitwise_as_the_bare_model(
    name, overlap, accumulate, find_unused, bucket_view
):
    results = run_ranks(_train, 2, name, overlap, accumulate, find_unused, bucket_view)
    for history, bare_stats, ddp_stats, early in results:
        for step, pairs in enumerate(history):
            for bare, wrapped in pairs:
                assert torch.equal(bare, wrapped), f"step {step + 1} differs"
        # DDP sent nothing: the optimizer's bytes are all there is, and they match.
        assert bare_stats == ddp_stats
        # With overlap_backward, DDP's hook calls launched buckets during backward.
        assert (min(early) > 0) if overlap else (max(early) == 0)
    # The run really crossed into the compressed stages, and the replicas agree after it
    # (0/1 Adam's after a synchronize(): its local steps are local by design).
    assert set(results[0][2].steps) - {"warmup", "variance"}
    last = -2 if name == "zero_one" else -1
    for a, b in zip(results[0][0][last], results[1][0][last]):
        assert torch.equal(a[0], b[0])


def _wrong_state(rank, world_size):
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    model.register_comm_hook(None, onebit.ddp_comm_hook)
    try:
        model(torch.randn(2, 3)).sum().backward()
    except Exception as err:  # DDP re-raises the hook's TypeError as a RuntimeError
        return str(err)
    return None


def test_hook_without_the_optimizer_as_state_is_a_clear_error():
    for message in run_ranks(_wrong_state, 2):
        assert message is not None and "register_comm_hook(optimizer" in message


def _ddp_overlap_resume(rank, world_size):
    """DDP + hook + overlap_backward: train 8 steps straight, or 4, save, rebuild, load, 4."""

    def build(seed):
        torch.manual_seed(seed)
        model = _Net(extra=False)
        ddp = DistributedDataParallel(model)
        opt = _optimizer("adam", model.parameters(), overlap=True)
        ddp.register_comm_hook(opt, onebit.ddp_comm_hook)
        return model, ddp, opt

    def train(ddp, opt, steps):
        for step in steps:
            opt.zero_grad()
            gen = torch.Generator().manual_seed(100 * step + 10 * rank)
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()

    model, ddp, opt = build(0)
    train(ddp, opt, range(1, 9))
    straight = [p.detach().clone() for p in model.parameters()]
    model, ddp, opt = build(0)
    train(ddp, opt, range(1, 5))
    saved = {"model": copy.deepcopy(model.state_dict()), "opt": opt.consolidated_state_dict()}
    saved = [saved]
    torch.distributed.broadcast_object_list(saved)  # rank 0's file, loaded on every rank
    model, ddp, opt = build(1)
    model.load_state_dict(saved[0]["model"])
    opt.load_state_dict(saved[0]["opt"])
    train(ddp, opt, range(5, 9))
    return straight, [p.detach().clone() for p in model.parameters()]


def test_ddp_overlap_resume_is_bitwise_exact():
    for straight, resumed in run_ranks(_ddp_overlap_resume, 2):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
