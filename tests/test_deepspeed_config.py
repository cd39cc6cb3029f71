"""onebit.integrations.deepspeed: DeepSpeed's documented 1-bit optimizer configs build the onebit
optimizer that gives the same run.

The DeepSpeed behaviour the tests compare against is transcribed from DeepSpeed's optimizers
(deepspeed/runtime/fp16/onebit/adam.py, zoadam.py, lamb.py): the first step() only initialises
and counts as step 1; 1-bit Adam and 1-bit LAMB freeze at the end of the step where
``step >= freeze_step``; 0/1 Adam tests its schedules against that same counter.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

import onebit
from onebit.integrations import deepspeed as ds
from onebit.integrations.deepspeed import (
    KEY_MAP,
    UnsupportedKeyWarning,
    mapping_table,
    optimizer_from_config,
    translate_config,
)
from onebit.optim.options import DEFAULT_BUCKET_SIZE

# DeepSpeed docs/_tutorials/onebit-adam.md, section 1.4 "Configuration of 1-bit Adam" (the
# tutorial's JSON, verbatim apart from JSON -> Python literals).
ONEBIT_ADAM_CONFIG = {
    "train_batch_size": 4096,
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {
        "type": "OneBitAdam",
        "params": {
            "lr": 4e-4,
            "freeze_step": 23000,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    },
    "fp16": {
        "enabled": True,
    },
}

# DeepSpeed docs/_tutorials/onebit-adam.md, section 3.2 (BERT-large pre-training, seq 128).
ONEBIT_ADAM_BERT_CONFIG = {
    "train_batch_size": 4096,
    "train_micro_batch_size_per_gpu": 16,
    "steps_per_print": 100,
    "prescale_gradients": False,
    "optimizer": {
        "type": "OneBitAdam",
        "params": {
            "lr": 4e-4,
            "weight_decay": 0.01,
            "bias_correction": False,
            "freeze_step": 23000,
            "comm_backend_name": "nccl",
        },
    },
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}

# DeepSpeed docs/_tutorials/zero-one-adam.md, section 1.4 "Configuration of 0/1 Adam".
ZERO_ONE_ADAM_CONFIG = {
    "train_batch_size": 4096,
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {
        "type": "ZeroOneAdam",
        "params": {
            "lr": 1e-3,
            "weight_decay": 0.01,
            "bias_correction": False,
            "var_freeze_step": 1000,
            "var_update_scaler": 16,
            "local_step_scaler": 1000,
            "local_step_clipper": 16,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    },
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}

# DeepSpeed docs/_tutorials/onebit-lamb.md, section 1.4 "Configuration of 1-bit LAMB".
ONEBIT_LAMB_CONFIG = {
    "train_batch_size": 65536,
    "train_micro_batch_size_per_gpu": 64,
    "optimizer": {
        "type": "OneBitLamb",
        "params": {
            "lr": 11e-3,
            "max_coeff": 0.3,
            "min_coeff": 0.01,
            "freeze_step": 1000,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
            "coeff_beta": 0.9,
            "factor_max": 4.0,
            "factor_min": 0.5,
            "factor_threshold": 0.1,
        },
    },
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
}

DOC_CONFIGS = [
    ONEBIT_ADAM_CONFIG,
    ONEBIT_ADAM_BERT_CONFIG,
    ZERO_ONE_ADAM_CONFIG,
    ONEBIT_LAMB_CONFIG,
]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y)


def _train(model, opt, steps: int, first: int = 1) -> list[str]:
    """Steps on batches first, first+1, ...; returns the stage each step ran in."""
    stages = []
    for step in range(first, first + steps):
        opt.zero_grad()
        _loss(model, step).backward()
        stages.append(opt.stage)
        opt.step()
    return stages


def _build(config, params=None, **overrides):
    """optimizer_from_config, returning the optimizer and the one warning's text ("" if none)."""
    params = _model().parameters() if params is None else params
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = optimizer_from_config(params, config, **overrides)
    assert len(caught) <= 1, [str(w.message) for w in caught]
    if not caught:
        return opt, ""
    assert caught[0].category is UnsupportedKeyWarning
    return opt, str(caught[0].message)


def _with_params(config, **params):
    config = copy.deepcopy(config)
    config["optimizer"]["params"].update(params)
    return config


# The documented configs: class, hyperparameters and notes.


def test_onebit_adam_tutorial_config():
    opt, message = _build(ONEBIT_ADAM_CONFIG)
    assert type(opt) is onebit.OnebitAdam
    group = opt.param_groups[0]
    assert group["lr"] == 4e-4
    assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8
    assert group["weight_decay"] == 0.0
    assert opt.freeze_step == 22999  # DeepSpeed's 23000, less its initialisation step
    assert opt.bias_correction is False
    assert opt.max_grad_norm is None  # no gradient_clipping in this config
    assert "cuda_aware, comm_backend_name: dropped" in message
    assert "process group" in message
    assert "bias_correction" not in message  # nothing else to report


def test_onebit_adam_bert_config_maps_weight_decay_and_gradient_clipping():
    opt, message = _build(ONEBIT_ADAM_BERT_CONFIG)
    assert type(opt) is onebit.OnebitAdam
    assert opt.param_groups[0]["lr"] == 4e-4
    assert opt.param_groups[0]["weight_decay"] == 0.01
    assert opt.freeze_step == 22999
    assert opt.bias_correction is False
    assert opt.max_grad_norm == 1.0  # from the top-level gradient_clipping
    assert "comm_backend_name: dropped" in message and "cuda_aware" not in message
    # The optimizer block alone has no gradient_clipping: no clipping.
    block_opt, _ = _build(ONEBIT_ADAM_BERT_CONFIG["optimizer"])
    assert block_opt.max_grad_norm is None and block_opt.freeze_step == 22999


def test_zero_one_adam_tutorial_config():
    opt, message = _build(ZERO_ONE_ADAM_CONFIG)
    assert type(opt) is onebit.ZeroOneAdam
    group = opt.param_groups[0]
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.01
    assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8
    assert opt.var_freeze_step == 1000
    assert opt.var_update_scaler == 16
    assert opt.local_step_scaler == 1000
    assert opt.local_step_clipper == 16
    assert opt.bias_correction is False
    assert opt.max_grad_norm == 1.0
    lines = message.splitlines()[1:]
    assert len(lines) == 4, message
    assert lines[0].startswith("- cuda_aware, comm_backend_name: dropped")
    assert lines[1].startswith("- var_freeze_step/var_update_scaler") and "step 17" in lines[1]
    assert lines[2].startswith("- local_step_scaler/local_step_clipper")
    assert "from step 2001" in lines[2]  # 1000 steps after var_freeze_step 1000
    assert lines[3].startswith("- weight_decay")


def test_onebit_lamb_tutorial_config():
    model = _model()
    opt, message = _build(ONEBIT_LAMB_CONFIG, model.parameters())
    assert type(opt) is onebit.OnebitLamb
    group = opt.param_groups[0]
    assert group["lr"] == 11e-3 and group["weight_decay"] == 0.0
    assert opt.freeze_step == 999
    assert (opt.max_coeff, opt.min_coeff, opt.coeff_beta) == (0.3, 0.01, 0.9)
    assert (opt.factor_max, opt.factor_min, opt.factor_threshold) == (4.0, 0.5, 0.1)
    assert opt.bias_correction is False
    assert opt.max_grad_norm == 1.0
    assert len(opt.layout.buckets) == 1  # the whole model in one buffer, as DeepSpeed
    assert message.count("\n- ") == 1 and "cuda_aware, comm_backend_name: dropped" in message


def test_lamb_bucket_covers_a_model_larger_than_the_default_bucket():
    big = [torch.nn.Parameter(torch.zeros(DEFAULT_BUCKET_SIZE + 5))]
    opt, _ = _build(ONEBIT_LAMB_CONFIG, big)
    assert len(opt.layout.buckets) == 1
    assert opt.layout.bucket_size >= DEFAULT_BUCKET_SIZE + 5
    opt, _ = _build(ONEBIT_LAMB_CONFIG, [torch.nn.Parameter(torch.zeros(10))], bucket_size=64)
    assert opt.layout.bucket_size == 64  # overrides win


@pytest.mark.parametrize("name", ["OneBitAdam", "onebitadam", "ONEBITADAM", "OnebitAdam"])
def test_type_names_ignore_case(name):
    opt, _ = _build({"type": name, "params": {"freeze_step": 5}})
    assert type(opt) is onebit.OnebitAdam and opt.freeze_step == 4


def test_deepspeed_constants_name_the_other_two():
    assert type(_build({"type": "zerooneadam"})[0]) is onebit.ZeroOneAdam
    assert type(_build({"type": "onebitlamb"})[0]) is onebit.OnebitLamb


def test_absent_keys_take_deepspeeds_defaults():
    adam, message = _build({"type": "OneBitAdam"})
    assert adam.freeze_step == 99999  # DeepSpeed's default freeze_step 100000
    assert adam.bias_correction is False and message == ""
    zero_one, _ = _build({"type": "ZeroOneAdam", "params": {}})
    assert zero_one.var_freeze_step == 100000
    assert zero_one.local_step_scaler == 32678  # DeepSpeed's default, not onebit's 32768
    assert (zero_one.var_update_scaler, zero_one.local_step_clipper) == (16, 16)
    lamb, _ = _build({"type": "OneBitLamb", "params": None})
    assert lamb.freeze_step == 99999 and (lamb.max_coeff, lamb.min_coeff) == (10.0, 0.01)


def test_clean_config_warns_nothing():
    config = {
        "optimizer": {
            "type": "OneBitAdam",
            "params": {"lr": 1e-3, "freeze_step": 10, "bias_correction": False, "amsgrad": False},
        },
        "gradient_clipping": 0.0,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = optimizer_from_config(_model().parameters(), config)
    assert opt.max_grad_norm is None and opt.freeze_step == 9


# The freeze step: DeepSpeed's first step() only initialises.


def _deepspeed_freeze_stages(freeze_step: int, calls: int) -> list[str]:
    """The stage of DeepSpeed's 1-bit Adam / 1-bit LAMB on calls 2..calls, transcribed: call 1
    initialises and returns before the freeze check; later calls check
    ``state['step'] >= freeze_step`` at their end."""
    stages, frozen = [], False
    for step in range(2, calls + 1):
        stages.append("compression" if frozen else "warmup")
        if not frozen and step >= freeze_step:
            frozen = True
    return stages


@pytest.mark.parametrize("ds_type", ["OneBitAdam", "OneBitLamb"])
@pytest.mark.parametrize("freeze_step", [-3, 0, 1, 2, 3, 5])
def test_freeze_step_is_deepspeeds_less_its_initialisation_step(ds_type, freeze_step):
    model = _model()
    config = {"type": ds_type, "params": {"freeze_step": freeze_step}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsupportedKeyWarning)
        opt = optimizer_from_config(model.parameters(), config)
    assert opt.freeze_step == max(freeze_step - 1, 1)
    calls = 9
    # onebit step k runs DeepSpeed call k + 1's batch and stage.
    stages = _train(model, opt, calls - 1, first=2)
    assert stages == _deepspeed_freeze_stages(freeze_step, calls)


def test_lamb_freeze_step_of_one_warns_about_the_fresh_variance():
    _, message = _build({"type": "OneBitLamb", "params": {"freeze_step": 1}})
    assert "freeze_step: 1 gives one warmup step" in message
    _, message = _build({"type": "OneBitLamb", "params": {"freeze_step": 2}})
    assert message == ""


def test_warmup_is_deepspeeds_adam_without_bias_correction():
    """Transcribed DeepSpeed 1-bit Adam warmup (call 1 moves nothing; then Adam without bias
    correction, decoupled weight decay) against the helper's optimizer on the same batches."""
    lr, wd, (b1, b2), eps, freeze = 1e-2, 0.01, (0.9, 0.999), 1e-8, 6
    ref = _model()
    m = [torch.zeros_like(p) for p in ref.parameters()]
    v = [torch.zeros_like(p) for p in ref.parameters()]
    for call in range(1, freeze + 1):
        ref.zero_grad()
        _loss(ref, call).backward()
        if call == 1:
            continue  # DeepSpeed's initialisation step
        with torch.no_grad():
            for p, mi, vi in zip(ref.parameters(), m, v):
                mi.mul_(b1).add_(p.grad, alpha=1 - b1)
                vi.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.add_(-lr * (mi / (vi.sqrt() + eps) + wd * p))
    config = {"type": "OneBitAdam", "params": {"lr": lr, "weight_decay": wd, "freeze_step": freeze}}
    ours = _model()
    opt, _ = _build(config, ours.parameters())
    assert _train(ours, opt, freeze - 1, first=2) == ["warmup"] * (freeze - 1)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    # Adam's bias correction (onebit's default) would be another run.
    corrected = _model()
    opt = onebit.OnebitAdam(
        corrected.parameters(),
        warmup_compression="fp32",
        lr=lr,
        weight_decay=wd,
        freeze_step=freeze,
    )
    _train(corrected, opt, freeze - 1, first=2)
    assert not torch.allclose(next(corrected.parameters()), next(ref.parameters()), atol=1e-4)


# 0/1 Adam's schedules.


def _deepspeed_zero_one_stages(
    var_freeze_step: int, kappa: int, scaler: int, clipper: int, calls: int
) -> list[str]:
    """The stage of DeepSpeed's 0/1 Adam on calls 2..calls, transcribed from zoadam.py."""
    var_interval, var_counter, interval, counter, frozen = 1, 0, 1, 0, False
    stages = []
    for step in range(2, calls + 1):  # state['step'] after its increment; call 1 initialises
        if not frozen:
            variance = step % var_interval == 0
            stages.append("variance" if variance else "compression")
            if variance:
                var_counter += 1
                if var_counter == kappa:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            stages.append("sync" if step % interval == 0 else "local")
            counter += 1
            if counter == scaler:
                counter, interval = 0, min(clipper, interval * 2)
        if step > var_freeze_step:
            frozen = True
    return stages


def _zero_one_stages(var_freeze_step, kappa, scaler, clipper, calls):
    config = {
        "type": "ZeroOneAdam",
        "params": {
            "var_freeze_step": var_freeze_step,
            "var_update_scaler": kappa,
            "local_step_scaler": scaler,
            "local_step_clipper": clipper,
        },
    }
    model = _model()
    opt, message = _build(config, model.parameters())
    ours = _train(model, opt, calls - 1, first=2)
    return ours, _deepspeed_zero_one_stages(var_freeze_step, kappa, scaler, clipper, calls), message


def test_zero_one_schedules_match_deepspeed_when_no_interval_reaches_two():
    ours, theirs, message = _zero_one_stages(4, 4, 3, 1, calls=14)
    assert ours == theirs
    assert ours[:4] == ["variance"] * 4 and set(ours[4:]) == {"sync"}
    assert message == ""


def test_zero_one_var_freeze_step_keeps_deepspeeds_phase_a_length():
    for v in (0, 1, 3):
        ours, theirs, _ = _zero_one_stages(v, 16, 100, 1, calls=8)
        assert ours == theirs
        assert sum(s in ("variance", "compression") for s in ours) == max(v, 1)


def test_zero_one_variance_schedule_out_of_phase_warns():
    ours, theirs, message = _zero_one_stages(8, 2, 100, 1, calls=12)
    assert ours[:2] == theirs[:2] and ours[2] != theirs[2]  # from step kappa + 1
    assert "var_freeze_step/var_update_scaler" in message and "from step 3" in message
    assert "local_step" not in message


def test_zero_one_local_step_schedule_out_of_phase_warns():
    ours, theirs, message = _zero_one_stages(2, 4, 3, 4, calls=14)
    assert ours[:5] == theirs[:5] and ours[5] != theirs[5]  # from step V + scaler + 1 = 6
    assert "local_step_scaler/local_step_clipper" in message and "from step 6" in message
    assert "var_update_scaler" not in message


# A short run: the helper's optimizer is bitwise the one built by hand.


def _run_twice(config, by_hand, steps=8):
    helped = _model()
    with pytest.warns(UnsupportedKeyWarning):
        opt = optimizer_from_config(helped.parameters(), config)
    manual = _model()
    ref = by_hand(manual.parameters())
    stages = _train(helped, opt, steps)
    assert _train(manual, ref, steps) == stages
    for p, q in zip(helped.parameters(), manual.parameters()):
        assert torch.equal(p, q)
    return stages


def test_onebit_adam_run_is_bitwise_the_hand_built_one():
    config = copy.deepcopy(ONEBIT_ADAM_BERT_CONFIG)
    config["optimizer"]["params"]["freeze_step"] = 4
    config["optimizer"]["params"]["lr"] = 1e-2
    config["gradient_clipping"] = 0.5
    stages = _run_twice(
        config,
        lambda p: onebit.OnebitAdam(
            p,
            warmup_compression="fp32",
            lr=1e-2,
            weight_decay=0.01,
            freeze_step=3,
            bias_correction=False,
            max_grad_norm=0.5,
        ),
    )
    assert stages == ["warmup"] * 3 + ["compression"] * 5


def test_zero_one_adam_run_is_bitwise_the_hand_built_one():
    config = copy.deepcopy(ZERO_ONE_ADAM_CONFIG)
    config["optimizer"]["params"].update(
        var_freeze_step=4, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4
    )
    stages = _run_twice(
        config,
        lambda p: onebit.ZeroOneAdam(
            p,
            lr=1e-3,
            weight_decay=0.01,
            var_freeze_step=4,
            var_update_scaler=1,
            local_step_scaler=2,
            local_step_clipper=4,
            bias_correction=False,
            max_grad_norm=1.0,
            warmup_compression="fp32",  # DeepSpeed's variance steps
        ),
        steps=10,
    )
    assert {"variance", "compression", "sync", "local"} <= set(stages)


def test_onebit_lamb_run_is_bitwise_the_hand_built_one():
    config = _with_params(ONEBIT_LAMB_CONFIG, freeze_step=4)
    stages = _run_twice(
        config,
        lambda p: onebit.OnebitLamb(
            p,
            warmup_compression="fp32",
            lr=11e-3,
            max_coeff=0.3,
            min_coeff=0.01,
            freeze_step=3,
            coeff_beta=0.9,
            factor_max=4.0,
            factor_min=0.5,
            factor_threshold=0.1,
            bias_correction=False,
            max_grad_norm=1.0,
        ),
    )
    assert stages == ["warmup"] * 3 + ["compression"] * 5


# What the helper refuses, or cannot honour.


def test_unknown_key_raises_naming_it():
    with pytest.raises(ValueError, match="'freeze_steps'"):
        optimizer_from_config(
            _model().parameters(), _with_params(ONEBIT_ADAM_CONFIG, freeze_steps=5)
        )
    with pytest.raises(ValueError, match="'var_freeze_step' \\(a key of ZeroOneAdam"):
        translate_config({"type": "OneBitAdam", "params": {"var_freeze_step": 5}})
    with pytest.raises(ValueError, match="'factor_max'"):
        translate_config({"type": "ZeroOneAdam", "params": {"factor_max": 4.0}})
    with pytest.raises(ValueError, match="'gradient_clipping'"):  # a top-level key, misplaced
        translate_config({"type": "OneBitAdam", "params": {"gradient_clipping": 1.0}})
    with pytest.raises(ValueError, match="'scheduler'"):
        translate_config({"type": "OneBitAdam", "scheduler": {}})


def test_unknown_type_or_no_optimizer_raises():
    with pytest.raises(ValueError, match="'Adam' is not one of DeepSpeed's 1-bit optimizers"):
        translate_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    with pytest.raises(ValueError, match="no optimizer"):
        translate_config({"train_batch_size": 8})
    with pytest.raises(TypeError, match="ds_config must be a dict"):
        translate_config('{"optimizer": {"type": "OneBitAdam"}}')
    with pytest.raises(TypeError, match="optimizer type must be a string"):
        translate_config({"type": None})
    with pytest.raises(TypeError, match="optimizer.params must be a dict"):
        translate_config({"type": "OneBitAdam", "params": [("lr", 1e-3)]})


def test_amsgrad_true_raises_and_false_is_accepted():
    with pytest.raises(ValueError, match="amsgrad"):
        translate_config(_with_params(ZERO_ONE_ADAM_CONFIG, amsgrad=True))
    assert translate_config(_with_params(ONEBIT_ADAM_CONFIG, amsgrad=False)).kwargs["freeze_step"]


def test_values_of_the_wrong_type_raise():
    for params in (
        {"freeze_step": "23000"},
        {"freeze_step": 10.5},
        {"freeze_step": True},
        {"lr": "1e-3"},
        {"betas": 0.9},
        {"betas": [0.9, 0.99, 0.999]},
        {"bias_correction": 1},
    ):
        with pytest.raises(TypeError):
            translate_config({"type": "OneBitAdam", "params": params})
    assert (
        translate_config({"type": "OneBitAdam", "params": {"freeze_step": 1e3}}).kwargs[
            "freeze_step"
        ]
        == 999
    )


def test_ignored_deepspeed_keys_are_reported():
    config = _with_params(
        ONEBIT_ADAM_BERT_CONFIG, bias_correction=True, eps_inside_sqrt=True, max_grad_norm=1.0
    )
    opt, message = _build(config)
    assert opt.bias_correction is False and opt.max_grad_norm == 1.0  # gradient_clipping
    assert "bias_correction: true is not honoured" in message
    assert "eps_inside_sqrt: true is not honoured" in message
    assert "max_grad_norm: dropped" in message
    # Overriding the argument makes its note moot.
    opt, message = _build(config, bias_correction=True, max_grad_norm=2.0)
    assert opt.bias_correction is True and opt.max_grad_norm == 2.0
    assert "bias_correction" not in message and "max_grad_norm" not in message
    assert "eps_inside_sqrt" in message
    block = {**ONEBIT_ADAM_CONFIG["optimizer"], "legacy_fusion": False}
    assert "legacy_fusion: dropped" in _build(block)[1]


def test_gradient_clipping_zero_means_none_and_overrides_win():
    config = copy.deepcopy(ONEBIT_ADAM_BERT_CONFIG)
    config["gradient_clipping"] = 0
    opt, _ = _build(config)
    assert opt.max_grad_norm is None
    opt, _ = _build(config, freeze_step="auto", bucket_size=64)
    assert opt.freeze_step is None and opt.layout.bucket_size == 64


def test_non_freeze_groups():
    model = _model()
    first, *rest = model.parameters()
    groups = [{"params": [first], "non_freeze": True}, {"params": rest}]
    with pytest.raises(ValueError, match="non_freeze=True"):
        optimizer_from_config(groups, {"type": "OneBitAdam", "params": {"freeze_step": 3}})
    groups[0]["non_freeze"] = False  # DeepSpeed's default: compressed, nothing to say
    opt, message = _build({"type": "OneBitAdam", "params": {"freeze_step": 3}}, groups)
    assert message == "" and "non_freeze" not in opt.param_groups[0]
    groups[0]["non_freeze"] = True  # DeepSpeed's 0/1 Adam ignored it
    opt, message = _build({"type": "ZeroOneAdam", "params": {"var_freeze_step": 3}}, groups)
    assert "non_freeze: dropped" in message and "non_freeze" not in opt.param_groups[0]


def test_group_exp_avg_mask_becomes_onebit_exp_avg_mask():
    model = _model()
    weight, bias, *rest = model.parameters()
    mask = torch.ones(5)
    mask[1:3] = 0  # broadcast over the weight's rows, as DeepSpeed's exp_avg.mul_(mask)
    groups = [{"params": [weight], "exp_avg_mask": mask}, {"params": [bias, *rest]}]
    opt, _ = _build({"type": "OneBitAdam", "params": {"freeze_step": 2}}, groups)
    assert "exp_avg_mask" not in opt.param_groups[0]
    _train(model, opt, 5)
    exp_avg = opt.state_dict()["state"][0]["exp_avg"]  # packed: unpacked here
    assert torch.all(exp_avg[:, 1:3] == 0) and torch.all(exp_avg[:, 0] != 0)
    groups[0]["exp_avg_mask"] = torch.ones(3)
    with pytest.raises(ValueError, match="does not broadcast"):
        optimizer_from_config(groups, {"type": "OneBitAdam", "params": {"freeze_step": 2}})


def test_lamb_group_coefficients_must_match_the_config():
    model = _model()
    groups = [{"params": list(model.parameters()), "max_coeff": 0.3}]
    opt, _ = _build(ONEBIT_LAMB_CONFIG, groups)
    assert "max_coeff" not in opt.param_groups[0]
    groups = [{"params": list(model.parameters()), "max_coeff": 0.5}]
    with pytest.raises(ValueError, match="own max_coeff"):
        optimizer_from_config(groups, ONEBIT_LAMB_CONFIG)


def test_a_tensor_is_not_params():
    with pytest.raises(TypeError, match="got a Tensor"):
        optimizer_from_config(torch.zeros(3), ONEBIT_ADAM_CONFIG)


# KEY_MAP, the README table and the constructors agree.


def test_key_map_covers_the_documented_keys_and_names_real_arguments():
    for config in DOC_CONFIGS:
        assert set(config["optimizer"]["params"]) <= set(KEY_MAP)
    for key, m in KEY_MAP.items():
        for ds_type in m.optimizers:
            if m.onebit is not None:
                signature = inspect.signature(ds.OPTIMIZERS[ds_type])
                assert m.onebit in signature.parameters, (key, ds_type)
        if m.rule == "same value":
            assert m.onebit == key
    table = mapping_table()
    for key in KEY_MAP:
        assert f"`{key}`" in table
    assert "`F` -> `max(F - 1, 1)`" in table
