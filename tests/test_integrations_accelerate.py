"""Accelerate with a onebit optimizer, on 2 gloo ranks: 1-bit traffic, the same training as a
plain loop, exact resume through save_state/load_state, bf16, and an inf on one rank."""

import pytest
import torch
from frameworks import (
    check_an_inf_on_one_rank_skips_everywhere,
    check_plain_loop_and_exact_resume,
    launched_as,
    needs,
    onebit_adam,
    replay,
    text_windows,
    tiny_gpt2,
)

pytestmark = [pytest.mark.slow, needs("accelerate")]

STEPS, SAVE_AT, BATCH = 8, 4, 4


def _run(rank, world_size, out, *, resume=False, mixed_precision="no", inf_at=None):
    """What a user's Accelerate script does, saving its state at step SAVE_AT."""
    from accelerate import Accelerator

    from onebit.integrations.accelerate import prepare

    launched_as(rank, world_size)
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = tiny_gpt2(seed=1 if resume else 0)
    optimizer = onebit_adam(model)
    loader = torch.utils.data.DataLoader(text_windows(64), batch_size=BATCH)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)
    start = 0
    if resume:
        accelerator.load_state(out)
        start = SAVE_AT
        loader = accelerator.skip_first_batches(loader, SAVE_AT)
    batches = []
    for step, batch in enumerate(loader, start=start + 1):
        batches.append(batch)
        loss = model(**batch).loss
        if rank == 1 and step == inf_at:
            loss = loss * float("inf")
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == SAVE_AT and not resume:
            accelerator.save_state(out)
        if step == STEPS:
            break
    inner = optimizer.optimizer
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return params, batches, inner.comm_stats, inner.skipped_steps


def _train_then_replay(rank, world_size, out):
    params, batches, stats, _ = _run(rank, world_size, out)
    plain, fp32 = replay(batches)
    return params, plain, stats, fp32


def _resume(rank, world_size, out):
    return _run(rank, world_size, out, resume=True)[0]


def test_accelerate_is_a_plain_loop_sends_one_bit_and_resumes_exactly(tmp_path):
    check_plain_loop_and_exact_resume(_train_then_replay, _resume, str(tmp_path / "state"))


def _bf16_with_inf(rank, world_size, out, inf_at):
    params, _, _, skipped = _run(rank, world_size, out, mixed_precision="bf16", inf_at=inf_at)
    return params, skipped


def test_bf16_and_an_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    check_an_inf_on_one_rank_skips_everywhere(_bf16_with_inf, str(tmp_path / "state"))
