"""The one list of optimizers feeds ``onebit train``, the DeepSpeed translation and the package."""

import inspect

import pytest

import onebit
from onebit.integrations import deepspeed
from onebit.optim import registry
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
    assert (entry.name in optim.WARMUP_COMPRESSED) == entry.freezes
    assert deepspeed.OPTIMIZERS[entry.deepspeed] is entry.cls
    translated, _, _ = deepspeed.translate_config({"optimizer": {"type": entry.deepspeed.lower()}})
    assert translated is entry.cls


@pytest.mark.parametrize("entry", registry.OPTIMIZERS, ids=lambda e: e.name)
def test_freezes_says_which_take_a_freeze_step_and_a_warmup_compression(entry):
    takes = inspect.signature(entry.cls).parameters
    assert ("freeze_step" in takes and "warmup_compression" in takes) == entry.freezes
