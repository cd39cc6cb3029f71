"""Checkpoints that an earlier release of onebit saved still load, and step to the same bits.

``tests/checkpoints/`` holds small state dicts of each optimizer in each of its stages, saved by
a release, with the parameters that release reached a few steps after loading them: in one
process, on 2 ranks (the consolidated file frameworks write from rank 0, and each rank's own),
and through ``onebit.fsdp.save`` on a 2x2 FSDP2 mesh. A change to the library must keep them
loading, bit for bit; that they were written by older code is the point, so they are never
rewritten. ``python tests/test_saved_checkpoints.py`` writes those that are missing (a new case
added below), and nothing else.

Bits are compared where this machine's float arithmetic is the saver's
(:func:`rounds_as_the_saver`). Another CPU's matrix kernels round the model's gradients apart,
by about 1e-8, so there the continuations are compared within :data:`ROUNDING`, with a warning.
"""

from __future__ import annotations

import functools
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from backends import use_backend
from distributed import run_ranks
from family import all_equal, loss_of, make_model, make_optimizer, params_of
from optimizer_state import roundtrip

import onebit

HERE = Path(__file__).resolve().parent / "checkpoints"
BACKEND = "c"  # the CPU's default, which saved them; backends round AdamW's arithmetic apart
AFTER = 3  # steps taken after loading, across the next stage where there is one

# name: (optimizer, settings beyond the family's, steps done when saved). With the family's
# settings OnebitAdam and OnebitLamb freeze after step 3; ZeroOneAdam has variance steps 1, 2, 4,
# 1-bit steps 3, 5 and, from step 6, syncs on even steps and local steps on odd ones.
ONE_PROCESS = {
    "adam_warmup": ("adam", {}, 2),
    "adam_warmup_int4": ("adam", {"warmup_compression": "int4"}, 2),
    "adam_compression": ("adam", {}, 5),
    "adam_compression_bucket_scale": ("adam", {"scale_per": "bucket"}, 5),
    "adam_compression_bf16_errors": ("adam", {"error_dtype": torch.bfloat16}, 5),
    "adam_compression_clipped": ("adam", {"max_grad_norm": 0.1}, 5),
    "adam_auto_freeze": (
        "adam",
        {"freeze_step": "auto", "auto_freeze": onebit.AutoFreeze(window=1, patience=2, min_step=4)},
        3,
    ),
    "lamb_warmup": ("lamb", {}, 2),
    "lamb_compression": ("lamb", {}, 5),
    "zero_one_variance": ("zero_one", {}, 1),
    "zero_one_phase_a": ("zero_one", {}, 3),
    "zero_one_sync": ("zero_one", {}, 6),
    "zero_one_local": ("zero_one", {}, 7),
}
NAMES = ["adam", "lamb", "zero_one"]
SAVE_AT = 7  # on ranks: after the freeze; ZeroOneAdam's replicas differ after its local step 7

ROUNDING = 1e-6
"""How far the parameters may be from the saved continuation's where this machine does not
round as the saver did: three steps apart by a few float32 roundings of the gradients (3e-8 at
most on an AVX-512 Xeon against fixtures saved on an AMD EPYC). A load that loses any part of
the state moves them by 3e-3 or more (measured on every case: error buffers reset, or the step
count one off), and one that loads nothing by 4e-2 or more."""


@functools.cache
def rounds_as_the_saver() -> bool:
    """Whether this machine's arithmetic is that of the machine that saved the fixtures.

    torch's own ``AdamW``, which 1-bit Adam's warmup is bit for bit, replays the two steps that
    made ``adam_warmup``'s model; on the saver's machine it reaches that model exactly. No
    change to onebit can change the answer.
    """
    model = make_model()
    reference = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, foreach=True)
    _steps(model, reference, 0, 1, ONE_PROCESS["adam_warmup"][2])
    saved = torch.load(HERE / "adam_warmup.pt", weights_only=True)["model"]
    same = all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    if not same:
        warnings.warn(
            f"this machine rounds apart from the one that saved tests/checkpoints: the saved "
            f"checkpoints' continuations are compared within {ROUNDING}, not bit for bit",
            stacklevel=2,
        )
    return same


def _same(got: list[torch.Tensor], want: list[torch.Tensor], exact: bool) -> bool:
    """Whether the parameters ``got`` are the saved ones, ``want``: bit for bit if ``exact``,
    else within :data:`ROUNDING`."""
    if exact:
        return all_equal(got, want)
    close = (torch.allclose(a, b, rtol=0.0, atol=ROUNDING) for a, b in zip(got, want))
    return len(got) == len(want) and all(close)


def _steps(model, opt, rank: int, start: int, stop: int) -> None:
    for step in range(start, stop + 1):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        opt.step()


def _load(opt, state) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the saved state is this optimizer's, whole: no warning
        opt.load_state_dict(state)


# In one process.


def _one_process_write(case: str) -> dict:
    name, settings, save_at = ONE_PROCESS[case]
    model = make_model()
    opt = make_optimizer(name, model.parameters(), **settings)
    _steps(model, opt, 0, 1, save_at)
    saved = roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    _steps(model, opt, 0, save_at + 1, save_at + AFTER)
    return {**saved, "after": params_of(model), "stage": opt.stage}


@pytest.mark.parametrize("case", ONE_PROCESS)
def test_a_saved_state_loads_and_steps_to_the_same_bits(case, monkeypatch):
    use_backend(BACKEND, monkeypatch)
    name, settings, save_at = ONE_PROCESS[case]
    saved = torch.load(HERE / f"{case}.pt", weights_only=True)
    model = make_model(seed=1)
    model.load_state_dict(saved["model"])
    opt = make_optimizer(name, model.parameters(), **settings)
    _load(opt, saved["optimizer"])
    assert opt.num_steps == save_at
    _steps(model, opt, 0, save_at + 1, save_at + AFTER)
    assert _same(params_of(model), saved["after"], rounds_as_the_saver())
    assert opt.stage == saved["stage"]


# On 2 ranks: the consolidated file and each rank's own.


def _ranks_write(rank: int, world_size: int) -> dict:
    use_backend(BACKEND)
    out = {}
    for name in NAMES:
        model = make_model()
        opt = make_optimizer(name, model.parameters())
        _steps(model, opt, rank, 1, SAVE_AT)
        consolidated = roundtrip(opt.consolidated_state_dict(to=0))
        own, model_state = roundtrip((opt.state_dict(), model.state_dict()))
        _steps(model, opt, rank, SAVE_AT + 1, SAVE_AT + AFTER)
        out[name] = {
            "model": model_state,
            "consolidated": consolidated,
            "own": own,
            "after": params_of(model),
        }
    return out


def _ranks_check(
    rank: int, world_size: int, files: dict[str, str], exact: bool
) -> dict[str, list[bool]]:
    use_backend(BACKEND)
    results = {}
    for name, path in files.items():
        saved = torch.load(path, weights_only=True)
        mine = saved["ranks"][rank]
        same = []
        for state in (saved["consolidated"], mine["own"]):
            model = make_model(seed=1)
            model.load_state_dict(mine["model"])
            opt = make_optimizer(name, model.parameters())
            _load(opt, state)
            _steps(model, opt, rank, SAVE_AT + 1, SAVE_AT + AFTER)
            same.append(_same(params_of(model), mine["after"], exact))
        results[name] = same
    return results


def test_states_saved_on_two_ranks_load_and_step_to_the_same_bits(monkeypatch):
    use_backend(BACKEND, monkeypatch)
    files = {name: str(HERE / f"ranks2_{name}.pt") for name in NAMES}
    for result in run_ranks(_ranks_check, 2, files, rounds_as_the_saver()):
        assert result == {name: [True, True] for name in NAMES}, result


# Through onebit.fsdp on a 2x2 FSDP2 mesh.


def _fsdp2(name: str, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model(seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = make_optimizer(name, model.parameters(), process_group=mesh["replicate"].get_group())
    onebit.fsdp.attach(model, opt)
    return model, opt


def _local(model) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _fsdp2_write(rank: int, world_size: int, directory: str) -> dict:
    use_backend(BACKEND)
    out = {}
    for name in NAMES:
        model, opt = _fsdp2(name, seed=0)
        _steps(model, opt, rank, 1, SAVE_AT)
        onebit.fsdp.save(model, opt, os.path.join(directory, f"fsdp2_{name}"))
        _steps(model, opt, rank, SAVE_AT + 1, SAVE_AT + AFTER)
        out[name] = _local(model)
    return out


def _fsdp2_check(rank: int, world_size: int, directory: str, exact: bool) -> dict[str, bool]:
    use_backend(BACKEND)
    after = torch.load(os.path.join(directory, "fsdp2_after.pt"), weights_only=True)["ranks"]
    results = {}
    for name in NAMES:
        model, opt = _fsdp2(name, seed=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            onebit.fsdp.load(model, opt, os.path.join(directory, f"fsdp2_{name}"))
        _steps(model, opt, rank, SAVE_AT + 1, SAVE_AT + AFTER)
        results[name] = _same(_local(model), after[rank][name], exact)
    return results


@pytest.mark.slow
def test_fsdp2_checkpoints_load_and_step_to_the_same_bits(monkeypatch):
    use_backend(BACKEND, monkeypatch)
    for result in run_ranks(_fsdp2_check, 4, str(HERE), rounds_as_the_saver()):
        assert result == {name: True for name in NAMES}, result


def write_missing() -> list[str]:
    """Write the fixtures that ``tests/checkpoints/`` lacks; return their names."""
    use_backend(BACKEND)
    HERE.mkdir(exist_ok=True)
    made = (
        "onebit "
        + subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip()
    )
    written = []
    for case in ONE_PROCESS:
        if not (HERE / f"{case}.pt").exists():
            torch.save({**_one_process_write(case), "made_with": made}, HERE / f"{case}.pt")
            written.append(case)
    missing = [name for name in NAMES if not (HERE / f"ranks2_{name}.pt").exists()]
    if missing:
        ranks = run_ranks(_ranks_write, 2)
        for name in missing:
            saved = {"consolidated": ranks[0][name]["consolidated"], "made_with": made}
            saved["ranks"] = [{k: r[name][k] for k in ("model", "own", "after")} for r in ranks]
            torch.save(saved, HERE / f"ranks2_{name}.pt")
            written.append(f"ranks2_{name}")
    if not any(HERE.glob("fsdp2_*")):  # the checkpoints and what they step to, together
        after = run_ranks(_fsdp2_write, 4, str(HERE))
        torch.save({"ranks": after, "made_with": made}, HERE / "fsdp2_after.pt")
        written.append("fsdp2")
    return written


if __name__ == "__main__":
    print("wrote:", ", ".join(write_missing()) or "nothing (every fixture exists)")


@pytest.mark.parametrize("case", ["adam_warmup", "lamb_warmup"])
def test_a_warmup_saved_in_fp32_goes_on_in_fp32_under_the_new_defaults(case, monkeypatch):
    """Saved when the default warmup was fp32, a state loaded into an optimizer built without
    ``warmup_compression`` (now int4 by default) goes on in fp32, to the saved bits; one built
    with an explicit ``warmup_compression`` keeps it."""
    use_backend(BACKEND, monkeypatch)
    name, _, save_at = ONE_PROCESS[case]
    saved = torch.load(HERE / f"{case}.pt", weights_only=True)
    assert "warmup_compression" not in saved["optimizer"]["onebit"]  # written before it was
    cls = {"adam": onebit.OnebitAdam, "lamb": onebit.OnebitLamb}[name]
    model = make_model(seed=1)
    model.load_state_dict(saved["model"])
    opt = cls(model.parameters(), lr=1e-2, bucket_size=128, freeze_step=3)
    assert opt.warmup_compression == "int4"
    _load(opt, saved["optimizer"])
    assert opt.warmup_compression == "fp32" and opt.warmup_comms == []
    _steps(model, opt, 0, save_at + 1, save_at + AFTER)
    assert _same(params_of(model), saved["after"], rounds_as_the_saver())
    explicit = cls(make_model().parameters(), lr=1e-2, bucket_size=128, freeze_step=3,
                   warmup_compression="int8")  # fmt: skip
    explicit.load_state_dict(saved["optimizer"])
    assert explicit.warmup_compression == "int8"
