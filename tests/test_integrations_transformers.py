"""HF Trainer with a onebit optimizer, on 2 gloo ranks: 1-bit traffic, the same training as a
plain loop, exact resume through Trainer's checkpoints, bf16, and an inf on one rank."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from family import NAMES, SETTINGS
from frameworks import (
    FREEZE,
    assert_resumed_exactly,
    assert_skipped_on_every_rank,
    assert_trained_as_a_plain_loop,
    fp32_bytes,
    launched_as,
    needs,
    text_windows,
    tiny_gpt2,
)

pytestmark = [pytest.mark.slow, needs("transformers")]

STEPS, SAVE_AT, BATCH = 8, 4, 4


def _trainer(rank, world_size, out, *, name="adam", bf16=False, inf_at=None, max_grad_norm=1.0):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from onebit.integrations.transformers import OnebitCallback, create_optimizer

    launched_as(rank, world_size)
    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
        lr_scheduler_type="constant", max_grad_norm=max_grad_norm, save_steps=SAVE_AT,
        logging_steps=1, report_to=[], use_cpu=True, bf16=bf16, seed=0, disable_tqdm=True,
    )  # fmt: skip
    model = tiny_gpt2()
    cls, settings = SETTINGS[name]  # each crosses its stages within STEPS
    optimizer = create_optimizer(model, args, cls, **settings)
    batches = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: batches.append((kwargs["input_ids"], kwargs["labels"])),
        with_kwargs=True,
    )

    class InfOnRank1(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if rank == 1 and state.global_step + 1 == inf_at:
                p = model.transformer.wte.weight
                handle = p.register_hook(lambda g: (handle.remove(), g * float("inf"))[1])

    trainer = Trainer(
        model=model, args=args, train_dataset=text_windows(64), optimizers=(optimizer, None),
        callbacks=[InfOnRank1()],
    )  # fmt: skip
    trainer.add_callback(OnebitCallback(trainer))
    return trainer, model, optimizer, batches


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train_then_replay(rank, world_size, out, name):
    """Trainer, then the same optimizer in a plain loop on the batches Trainer fed each rank."""
    trainer, model, optimizer, batches = _trainer(rank, world_size, out, name=name)
    trainer.train()
    assert trainer.args.max_grad_norm == 1.0  # handed to the optimizer for the run, then back
    if name != "zero_one":  # clipping at Trainer's default kept the momentum packed, 1 bit
        assert optimizer.packed_momentum is not None
        assert "exp_avg" not in optimizer.state[next(model.parameters())]
    every = [None] * world_size
    dist.all_gather_object(every, batches)

    from transformers import TrainingArguments

    from onebit.integrations.transformers import create_optimizer

    plain = tiny_gpt2()
    args = TrainingArguments(output_dir=out, learning_rate=1e-2, use_cpu=True, report_to=[])
    cls, settings = SETTINGS[name]
    plain_opt = create_optimizer(plain, args, cls, **settings)
    for step in range(STEPS):
        # Trainer's loss: summed over the tokens, divided by the labels of all ranks (counted
        # unshifted for GPT-2, whose config names no loss_type), times the world size.
        tokens = sum(labels.ne(-100).sum() for b in every for _, labels in [b[step]]) / 1
        input_ids, labels = batches[step]
        loss = plain(input_ids=input_ids, labels=labels, num_items_in_batch=tokens).loss
        (loss * world_size).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    return _params(model), _params(plain), optimizer.comm_stats, fp32_bytes(model)


def _resume(rank, world_size, out, name):
    trainer, model, optimizer, _ = _trainer(rank, world_size, out, name=name)
    trainer.train(resume_from_checkpoint=f"{out}/checkpoint-{SAVE_AT}")
    return _params(model), optimizer.num_steps


@pytest.mark.parametrize("name", NAMES)
def test_trainer_is_a_plain_loop_sends_one_bit_and_resumes_exactly(tmp_path, name):
    out = str(tmp_path / "run")
    results = run_ranks(_train_then_replay, 2, out, name, timeout=240, frameworks=True)
    assert_trained_as_a_plain_loop(results)
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    resumed = run_ranks(_resume, 2, out, name, timeout=240, frameworks=True)
    assert [num_steps for _, num_steps in resumed] == [STEPS, STEPS]
    assert_resumed_exactly(results, [params for params, _ in resumed])


def _bf16_with_inf(rank, world_size, out, inf_at):
    trainer, model, optimizer, _ = _trainer(rank, world_size, out, bf16=True, inf_at=inf_at)
    trainer.train()
    return _params(model), optimizer.skipped_steps


def test_bf16_and_an_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    results = run_ranks(
        _bf16_with_inf, 2, str(tmp_path / "run"), FREEZE + 2, timeout=240, frameworks=True
    )
    assert_skipped_on_every_rank(*zip(*results))


def _unrouted_clipping(rank, world_size, out):
    from transformers import Trainer, TrainingArguments

    import onebit
    from onebit.integrations.transformers import OnebitCallback

    launched_as(rank, world_size)
    args = TrainingArguments(output_dir=out, max_steps=2, use_cpu=True, report_to=[])
    model = tiny_gpt2()
    optimizer = onebit.OnebitAdam(
        model.parameters(), warmup_compression="fp32", freeze_step=FREEZE
    )  # no max_grad_norm
    trainer = Trainer(
        model=model, args=args, train_dataset=text_windows(16), optimizers=(optimizer, None)
    )
    trainer.add_callback(OnebitCallback(trainer))
    try:
        trainer.train()
    except ValueError as err:
        return str(err)


def test_trainer_clipping_the_optimizer_does_not_do_is_a_clear_error_on_every_rank(tmp_path):
    errors = run_ranks(_unrouted_clipping, 2, str(tmp_path / "run"), timeout=240, frameworks=True)
    assert all("TrainingArguments(max_grad_norm=1.0) would clip each rank" in e for e in errors)


def test_create_optimizer_takes_the_settings_trainer_gives_adamw(tmp_path):
    from transformers import TrainingArguments

    from onebit.integrations.transformers import create_optimizer

    args = TrainingArguments(
        output_dir=str(tmp_path), learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95,
        adam_epsilon=1e-6, weight_decay=0.1, max_grad_norm=0.5, use_cpu=True, report_to=[],
    )  # fmt: skip
    model = tiny_gpt2()
    optimizer = create_optimizer(model, args, freeze_step=FREEZE)
    decay, no_decay = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(".bias" not in names[id(p)] and "ln_" not in names[id(p)] for p in decay["params"])
    assert all(".bias" in names[id(p)] or "ln_" in names[id(p)] for p in no_decay["params"])
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert all(g["lr"] == 3e-4 and g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in [decay])
    assert optimizer.max_grad_norm == 0.5
    other = create_optimizer(model, args, freeze_step=FREEZE, weight_decay=0.3, max_grad_norm=2.0)
    assert other.param_groups[0]["weight_decay"] == 0.3 and other.max_grad_norm == 2.0


def test_create_optimizer_tells_the_optimizer_the_run_length(tmp_path):
    """With ``max_steps``, ``"auto"`` (the default) freezes by a fifth of the run and 0/1 Adam's
    local steps are sized to it; an explicit cap wins; without ``max_steps`` nothing is told."""
    from transformers import TrainingArguments

    import onebit
    from onebit.integrations.transformers import create_optimizer

    def args(**kw):
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)

    model = tiny_gpt2()
    told = create_optimizer(model, args(max_steps=400))
    assert told.freeze.auto_freeze.total_steps == 400 and told.freeze.auto_freeze.last_step == 80
    own = onebit.AutoFreeze(max_step=30)
    mine = create_optimizer(model, args(max_steps=400), freeze_step="auto", auto_freeze=own)
    assert mine.freeze.auto_freeze.last_step == 30
    assert create_optimizer(model, args(), freeze_step="auto").freeze.auto_freeze.last_step is None
    assert create_optimizer(model, args(max_steps=400), freeze_step=FREEZE).freeze_step == FREEZE
    zero_one = create_optimizer(model, args(max_steps=600), onebit.ZeroOneAdam, var_freeze_step=120)
    assert (zero_one.local_step_scaler, zero_one.local_step_clipper) == (1, 2)
    assert zero_one.var_update_scaler == 120
    told_zero_one = create_optimizer(model, args(max_steps=600), onebit.ZeroOneAdam)
    assert told_zero_one.var_freeze_step == 120  # a fifth of max_steps
