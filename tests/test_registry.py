"""The one list of optimizers feeds ``onebit train``, the DeepSpeed translation and the package."""

import inspect
import re

import pytest
import torch

import onebit
from onebit.integrations import deepspeed
from onebit.optim import registry
from onebit.optim.options import SHARED_DOCS, SHARED_OPTIONS
from onebit.train import optim


def test_each_optimizer_is_exported_once_under_unique_names():
    entries = registry.OPTIMIZERS
    assert {e.cls for e in entries} == {onebit.OnebitAdam, onebit.ZeroOneAdam, onebit.OnebitLamb}
    for field in ("cls", "name", "deepspeed", "title"):
        assert len({getattr(e, field) for e in entries}) == len(entries), field
    assert all(getattr(onebit, e.cls.__name__) is e.cls for e in entries)


@pytest.mark.parametrize("entry", registry.OPTIMIZERS, ids=lambda e: e.name)
def test_onebit_train_and_deepspeed_know_each_optimizer(entry):
    assert entry.name in optim.OPTIMIZERS and entry.reference in optim.OPTIMIZERS
    assert optim.optimizer_class(entry.name) is entry.cls
    assert optim.REFERENCE[entry.name] == entry.reference
    assert entry.name in optim.WARMUP_COMPRESSED  # each has full-precision steps to quantize
    assert deepspeed.OPTIMIZERS[entry.deepspeed] is entry.cls
    translated, _, _ = deepspeed.translate_config({"optimizer": {"type": entry.deepspeed.lower()}})
    assert translated is entry.cls


@pytest.mark.parametrize("entry", registry.OPTIMIZERS, ids=lambda e: e.name)
def test_freezes_says_which_take_a_freeze_step_and_a_warmup_compression(entry):
    takes = inspect.signature(entry.cls).parameters
    assert ("freeze_step" in takes and "warmup_compression" in takes) == entry.freezes


NON_DEFAULT = {
    "bucket_size": (64, lambda opt: opt.layout.bucket_size == 64),
    "bias_correction": (False, lambda opt: opt.bias_correction is False),
    "scale_per": ("bucket", lambda opt: opt.scale_per == "bucket"),
    "exp_avg_mask": (None, lambda opt: len(opt.masks) == 1),  # made per model below
    "max_grad_norm": (0.5, lambda opt: opt.max_grad_norm == 0.5),
    "overlap_backward": (True, lambda opt: opt.overlap_backward is True),
    "warmup_compression": ("int8", lambda opt: opt.warmup_compression == "int8"),
    "error_dtype": (torch.bfloat16, lambda opt: opt.error_dtype == torch.bfloat16),
    "allow_edited_grads": (True, lambda opt: opt.allow_edited_grads is True),
}


@pytest.mark.parametrize("entry", registry.OPTIMIZERS, ids=lambda e: e.name)
def test_every_shared_setting_an_optimizer_takes_reaches_it(entry):
    """Each setting of ``options.SHARED_OPTIONS`` that an optimizer's signature lists gets to
    the base (``shared_options(locals())``), so a non-default value changes the optimizer; so
    does ``bias_correction``, which each of the Adam family keeps itself."""
    takes = set(inspect.signature(entry.cls).parameters)
    settings = [*SHARED_OPTIONS, "bias_correction"]
    shared = [name for name in settings if name in takes and name != "process_group"]
    assert set(shared) <= set(NON_DEFAULT) and "bucket_size" in shared
    required = {"freeze_step": 3} if "freeze_step" in takes else {"var_freeze_step": 3}
    for name in shared:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        value, holds = NON_DEFAULT[name]
        if name == "exp_avg_mask":
            value = {model[0].weight: torch.ones_like(model[0].weight)}
        opt = entry.cls(model.parameters(), **required, **{name: value})
        assert holds(opt), name


@pytest.mark.parametrize("entry", registry.OPTIMIZERS, ids=lambda e: e.name)
def test_every_argument_is_documented(entry):
    """Each argument of an optimizer's signature has an entry in its docstring's argument list
    (alone or in a group, ``lr, betas, eps, weight_decay:``), the shared ones written out from
    ``options.SHARED_DOCS``, and no placeholder is left."""
    doc = entry.cls.__doc__
    assert not re.search(r"^ *\{\w+\}$", doc, flags=re.M)
    entries = re.findall(r"^        ([\w, ]+):", doc, flags=re.M)
    documented = {name.strip() for e in entries for name in e.split(",")}
    takes = set(inspect.signature(entry.cls).parameters)
    assert takes <= documented, takes - documented
    for name, text in SHARED_DOCS.items():
        if name in takes:
            assert f"        {name}: {text.splitlines()[0]}" in doc, name
