"""onebit with FSDP2 (``onebit.fsdp``): FSDP2 shards inside a node, onebit averages across nodes.

Every test runs real FSDP2 on gloo ranks in fresh processes, on a ``replicas x shards`` mesh: 2x2,
and the edge cases 1x4 (one node: onebit has one replica) and 4x1 (no sharding). The reference is
torch's own HSDP: ``fully_shard`` on the 2-D mesh with ``torch.optim.AdamW``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from family import NAMES, loss_of, make_model, make_optimizer
from optimizer_state import storage_bytes

import onebit

pytestmark = pytest.mark.slow

MESHES = [(2, 2), (1, 4), (4, 1)]
LR = 1e-2


def _mesh(replicas: int, shards: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _shard(model: torch.nn.Module, mesh, **kwargs) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _wide(seed: int = 0) -> torch.nn.Module:
    """The family's model with a hidden layer wide enough that the 1-bit messages' scales and
    headers weigh little."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 2))


def _onebit(mesh, name: str = "adam", model=None, fsdp: dict | None = None, **kwargs):
    """``model`` (default: the family's) sharded on ``mesh["shard"]``, and its onebit
    optimizer, attached."""
    model = _shard(model or make_model(), mesh["shard"], **(fsdp or {}))
    group = mesh["replicate"].get_group()
    opt = make_optimizer(name, model.parameters(), process_group=group, **kwargs)
    onebit.fsdp.attach(model, opt)
    return model, opt


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _local(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _train(model, opt, steps: range, clip: float | None = None, micro: int = 1) -> None:
    rank = dist.get_rank()
    for step in steps:
        for m in range(micro):
            if micro > 1:
                model.set_requires_gradient_sync(m == micro - 1)
            (loss_of(model, step, rank, m) / micro).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def _warmup_vs_hsdp(rank: int, world_size: int, mesh_shape, case: str) -> float:
    """Largest difference from torch's HSDP + AdamW after 4 fp32 warmup steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _mesh(*mesh_shape)
    fsdp, clip, micro = {}, None, 1
    if case == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fsdp = {"mp_policy": policy}
    elif case == "clip":
        clip = 0.05
    elif case == "accumulate":
        micro = 2
    model, opt = _onebit(mesh, freeze_step=100, fsdp=fsdp, max_grad_norm=clip)
    _train(model, opt, range(4), micro=micro)
    ref = _shard(make_model(0), mesh, **fsdp)
    adamw = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    _train(ref, adamw, range(4), clip, micro)
    if clip is not None:
        assert opt.grad_norm is not None
    return max(float((a - b).abs().max()) for a, b in zip(_full(model), _full(ref)))


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_warmup_equals_torch_hsdp_with_adamw(mesh_shape):
    (diff, *_) = run_ranks(_warmup_vs_hsdp, 4, mesh_shape, "plain")
    assert diff <= 1e-5


@pytest.mark.parametrize("case", ["clip", "bf16", "accumulate"])
def test_warmup_equals_torch_hsdp_in_users_loops(case):
    """``max_grad_norm`` clips by the global norm across shards and nodes, as
    ``clip_grad_norm_`` does on FSDP2's DTensors; bf16 through ``MixedPrecisionPolicy``;
    gradient accumulation with ``set_requires_gradient_sync(False)``."""
    (diff, *_) = run_ranks(_warmup_vs_hsdp, 4, (2, 2), case)
    assert diff <= 1e-5


def _compression_run(rank: int, world_size: int, mesh_shape, name: str, kwargs: dict) -> dict:
    mesh = _mesh(*mesh_shape)
    model, opt = _onebit(mesh, name, _wide(), bucket_size=4096, **kwargs)
    state = 0
    for step in range(8):
        _train(model, opt, range(step, step + 1))
        state = max(state, storage_bytes(opt, gradient_buffer=True))
    replicas = mesh["replicate"].get_group()
    replicated = _wide()  # the same optimizer on whole parameters, for its state's size
    rep_opt = make_optimizer(
        name, replicated.parameters(), process_group=replicas, bucket_size=4096, **kwargs
    )
    replicated_state = 0
    for step in range(8):
        _train(replicated, rep_opt, range(step, step + 1))
        replicated_state = max(replicated_state, storage_bytes(rep_opt, gradient_buffer=True))
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    return {
        "shard": mesh["shard"].get_local_rank(),
        "local": _local(model),
        "stats": opt.comm_stats.state_dict(),
        "fp32 allreduce bytes": 4
        * local_numel
        * 2
        * (dist.get_world_size(replicas) - 1)
        / dist.get_world_size(replicas),
        "state bytes": state,  # the most after any step, warmup or compression
        "replicated state bytes": replicated_state,  # the same
        "freeze": (opt.freeze_step, opt.freeze.monitor and opt.freeze.monitor.last_change),
        "model bytes": model_bytes,
    }


AUTO_INT8 = dict(
    warmup_compression="int8",
    freeze_step="auto",
    auto_freeze=onebit.AutoFreeze(window=2, tolerance=0.5, patience=1, min_step=2, max_step=6),
)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [*((n, {}) for n in NAMES), ("adam", AUTO_INT8), ("adam", {"error_dtype": torch.bfloat16})],
    ids=[*NAMES, "auto-int8", "bf16-errors"],
)
def test_compression_stage_keeps_replicas_equal_at_one_bit(name, kwargs):
    """Through the compression stage the ranks that hold the same shard stay bitwise equal and
    send about 1/32 of an fp32 allreduce between nodes (scales and headers aside). Each keeps
    1/S of the replicated optimizer's state, for OnebitAdam at most (2 + 1/R + 1/16) / S model
    sizes."""
    replicas, shards = 2, 2
    results = run_ranks(_compression_run, 4, (replicas, shards), name, kwargs)
    assert len({r["freeze"] for r in results}) == 1  # "auto": one decision, on the whole model
    by_shard: dict[int, list] = {}
    for r in results:
        by_shard.setdefault(r["shard"], []).append(r["local"])
        stats = r["stats"]
        compressed = stats["total_bytes"]["compression"] / stats["steps"]["compression"]
        assert compressed <= r["fp32 allreduce bytes"] / 24, (compressed, r)
        assert r["state bytes"] <= 1.05 * r["replicated state bytes"] / shards
        if name == "adam":
            target = (2 + 1 / replicas + 1 / 16) / shards * r["model bytes"]
            assert r["state bytes"] <= target, (r["state bytes"], target)
    assert len(by_shard) == shards
    for peers in by_shard.values():
        assert all(torch.equal(a, b) for a, b in zip(peers[0], peers[1]))


def _resume(rank: int, world_size: int, name: str, directory: str, load_on) -> dict:
    """Train 5 steps on a 2x2 mesh (past the freeze) and save; go on 3 steps. Then a fresh
    model and optimizer (on ``load_on``) load the checkpoint and run the same 3 steps."""
    mesh = _mesh(2, 2)
    model, opt = _onebit(mesh, name, _wide(), bucket_size=1024)
    _train(model, opt, range(5))
    onebit.fsdp.save(model, opt, directory)
    _train(model, opt, range(5, 8))
    straight = _full(model)
    mesh = _mesh(*load_on) if load_on != (2, 2) else mesh
    fresh = _wide(seed=1)  # another initialisation: everything must come from the checkpoint
    model, opt = _onebit(mesh, name, fresh, bucket_size=1024)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            onebit.fsdp.load(model, opt, directory, reshard=load_on == (1, 4))
        except ValueError as err:
            return {"error": str(err)}
    _train(model, opt, range(5, 8))
    return {
        "same": all(torch.equal(a, b) for a, b in zip(straight, _full(model))),
        "warnings": [str(w.message) for w in caught],
        "steps": opt.num_steps,
    }


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_resumes_bitwise_through_dcp(name, tmp_path):
    """Model and optimizer through ``torch.distributed.checkpoint``, every rank's error buffers
    included: the resumed run is bitwise the run that went on."""
    results = run_ranks(_resume, 4, name, str(tmp_path), (2, 2))
    assert all(r["same"] and r["steps"] == 8 and not r["warnings"] for r in results), results


def test_checkpoint_on_another_mesh_is_an_error_or_reshards(tmp_path):
    """Loading a 2x2 checkpoint on 4x1 raises on every rank; on 1x4 with ``reshard=True`` it
    loads, warns that the error buffers restart, and trains on."""
    errors = run_ranks(_resume, 4, "adam", str(tmp_path / "a"), (4, 1))
    assert all(
        "2 replicas x 2 shards" in r["error"] and "reshard=True" in r["error"] for r in errors
    )
    resharded = run_ranks(_resume, 4, "adam", str(tmp_path / "b"), (1, 4))
    for r in resharded:
        assert r["steps"] == 8 and any("error-feedback buffers reset" in w for w in r["warnings"])


def _generic_load(rank: int, world_size: int, name: str, directory: str) -> str:
    """Save after the freeze as torch.distributed.checkpoint's docs do, then load into a fresh
    optimizer the same way: a template from it, ``dcp.load``, ``set_optimizer_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    mesh = _mesh(2, 2)
    model, opt = _onebit(mesh, name, _wide(), bucket_size=1024)
    _train(model, opt, range(5))
    assert not opt.in_warmup
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=directory)
    model, opt = _onebit(mesh, name, _wide(seed=1), bucket_size=1024)
    template = {"optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(template, checkpoint_id=directory)
    try:
        set_optimizer_state_dict(model, opt, template["optimizer"])
    except ValueError as err:
        return str(err)
    return "loaded"


@pytest.mark.parametrize("name", NAMES)
def test_a_state_loaded_without_its_onebit_part_is_a_onebit_error(name, tmp_path):
    """torch.distributed.checkpoint's optimizer state dict keeps the per-parameter state only;
    loaded into a fresh optimizer (whose state names are the warmup's), it reaches onebit, which
    names what is missing and the fix, instead of failing in the reader on a name."""
    for error in run_ranks(_generic_load, 4, name, str(tmp_path)):
        assert "not a onebit state dict" in error and "onebit.fsdp.save" in error, error


def _errors(rank: int, world_size: int) -> dict[str, str | None]:
    """What each case of ``ERRORS`` raises on this rank (``None``: nothing), one after another."""
    return {case: _error(rank, case, _mesh(2, 2)) for case in ERRORS}


def _error(rank: int, case: str, mesh) -> str | None:
    from torch.distributed.fsdp import fully_shard

    try:
        if case == "2-D mesh":  # FSDP2's own HSDP: it would average across replicas itself
            model = _shard(make_model(), mesh)
            make_optimizer("adam", model.parameters(), process_group=mesh["replicate"].get_group())
        elif case == "world group":
            make_optimizer("adam", _shard(make_model(), mesh["shard"]).parameters())
        elif case == "lr on one rank":
            model = _shard(make_model(), mesh["shard"])
            group = mesh["replicate"].get_group()
            make_optimizer("adam", model.parameters(), process_group=group, lr=1e-2 + (rank == 3))
        elif case == "overlap_backward":
            _onebit(mesh, overlap_backward=True)
        elif case == "attach to another model":
            model, opt = _onebit(mesh)
            onebit.fsdp.attach(fully_shard(make_model(), mesh=mesh["shard"]), opt)
        elif case == "attach unsharded":
            model = make_model()
            onebit.fsdp.attach(model, make_optimizer("adam", model.parameters()))
        elif case == "step without gradient sync":
            model, opt = _onebit(mesh)
            model.set_requires_gradient_sync(False)
            loss_of(model, 0, rank).backward()
            opt.step()
    except (ValueError, RuntimeError) as err:
        return str(err)
    return None


ERRORS = {
    "2-D mesh": "1-D mesh",
    "world group": "is not the world's 4 ranks",
    "lr on one rank": "settings differ across ranks: param groups",
    "overlap_backward": "overlap_backward with FSDP2",
    "attach to another model": "parameters that FSDP2 does not shard",
    "attach unsharded": "built on the parameters of a model sharded",
    "step without gradient sync": "set_requires_gradient_sync(False)",
}


def test_mismatches_are_clear_errors_on_every_rank():
    """Each case raises on every rank, and the ranks go on to the next case: nothing hangs."""
    for messages in run_ranks(_errors, 4, timeout=120):
        for case, message in messages.items():
            assert message is not None and ERRORS[case] in message, (case, message)


INF_AT = {"adam": (1, 6), "lamb": (1, 6), "zero_one": (1, 3)}
"""Where ``_skip_inf`` puts a non-finite gradient: a warmup step, and a compressed one (for
0/1 Adam one of phase A: a local step of phase B skips on the ranks that saw it only)."""


def _skip_inf(rank: int, world_size: int, name: str) -> dict:
    """A non-finite gradient on global rank 3 alone, at the steps of ``INF_AT``."""
    mesh = _mesh(2, 2)
    model, opt = _onebit(mesh, name)
    kept = []
    for step in range(8):
        loss_of(model, step, rank).backward()
        if step in INF_AT[name] and rank == 3:
            next(model.parameters()).grad.to_local().view(-1)[0] = math.inf
        before = _local(model)
        opt.step()
        opt.zero_grad()
        if step in INF_AT[name]:
            kept.append(all(torch.equal(a, b) for a, b in zip(before, _local(model))))
    finite = all(bool(torch.isfinite(p).all()) for p in _local(model))
    return {"kept": kept, "skipped": opt.skipped_steps, "finite": finite}


@pytest.mark.parametrize("name", NAMES)
def test_inf_on_one_rank_skips_the_step_on_every_rank(name):
    results = run_ranks(_skip_inf, 4, name)
    assert all(r == {"kept": [True, True], "skipped": 2, "finite": True} for r in results), results


@pytest.mark.cuda
def test_one_node_hsdp_on_nccl(tmp_path):
    """On every GPU of this machine (one node, a 1 x S mesh), NCCL: the warmup follows FSDP2 +
    AdamW, and the compression stage runs with the GPU kernels and stays finite."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    gpus = torch.cuda.device_count()
    script = Path(__file__).with_name("fsdp_nccl.py")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    result = subprocess.run(
        [*run, f"--nproc-per-node={gpus}", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(ranks) == gpus
    for r in ranks:
        assert r["warmup_diff"] <= 1e-5 and r["stage"] == "compression" and r["finite"], r
        assert r["backend"] == "triton"


def _uneven(rank: int, world_size: int) -> dict[str, tuple]:
    """Each optimizer through its stages on a 1 x 4 mesh, where FSDP2 leaves the last layer's
    local shards empty on ranks 2 and 3 (2 rows over 4 ranks)."""
    mesh = _mesh(1, 4)
    results = {}
    for name in NAMES:
        model, opt = _onebit(mesh, name, max_grad_norm=1.0)
        _train(model, opt, range(8))
        local = _local(model)
        results[name] = (
            [tuple(p.shape) for p in local],
            all(bool(torch.isfinite(p).all()) for p in local),
            opt.comm_stats.steps,
            opt.grad_norm,
        )
    return results


def test_uneven_shards_with_empty_local_tensors():
    """Ranks whose shard of a layer is empty take part in every step's reductions (clipping,
    LAMB's norms) like the others: all finish, finite, with the same stages and gradient norm."""
    results = run_ranks(_uneven, 4)
    assert results[2]["adam"][0][2] == (0, 32)  # the last layer's weight: no rows on rank 2
    for name in NAMES:
        shapes, finite, steps, norm = zip(*(r[name] for r in results))
        assert all(finite) and len(set(map(str, steps))) == 1 and len(set(norm)) == 1, name


def _loss_scaled(rank: int, world_size: int) -> float:
    """Largest difference between a run under ``torch.amp.GradScaler`` (a power-of-two scale,
    which ``step()`` undoes while copying the gradients) and the same run unscaled."""
    mesh = _mesh(2, 2)
    model, opt = _onebit(mesh)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(8):
        scaler.scale(loss_of(model, step, rank)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    unscaled, ref = _onebit(mesh)
    _train(unscaled, ref, range(8))
    assert opt.skipped_steps == 0
    return max(float((a - b).abs().max()) for a, b in zip(_local(model), _local(unscaled)))


def test_grad_scaler_steps_bitwise_as_unscaled():
    assert run_ranks(_loss_scaled, 4) == [0.0] * 4
