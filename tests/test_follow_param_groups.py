"""The optimizer steps the parameters ``param_groups`` holds now, as ``torch.optim`` does.

Frameworks replace them after the optimizer was built: Accelerate and HF Trainer put FSDP2's
sharded parameters there, and a user may point them at a copy of the model. The optimizer then
lays its state out anew on them, or raises on every rank where it cannot; it never keeps stepping
the tensors that no longer train.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from harness import CASES, same
from optimizer_state import flat

VARIANTS = [
    ("adam", {}),
    ("adam", {"warmup_compression": "int8"}),
    ("adam", {"max_grad_norm": 1.0}),
    ("adam", {"overlap_backward": True}),
    ("adam", {"exp_avg_mask": "ones"}),
    ("zero_one", {}),
    ("lamb", {}),
]


def _point_at(opt: torch.optim.Optimizer, old: list, new: list) -> None:
    """Put ``new[i]`` in ``old[i]``'s place in the param groups."""
    where = {id(p): i for i, p in enumerate(old)}
    for group in opt.param_groups:
        group["params"] = [new[where[id(p)]] for p in group["params"]]


def _run(name: str, settings: dict, rank: int, swap_at: int | None) -> tuple:
    """A run of the case; before step ``swap_at`` the param groups are pointed at a deep copy
    of the parameters, which the rest of the run trains. Returns the trained parameters after
    every step, the final state, and whether the originals stayed as they were at the swap."""
    case = CASES[name]
    params = case.problem.params()
    if settings.get("exp_avg_mask") == "ones":
        settings = {**settings, "exp_avg_mask": {p: torch.ones_like(p) for p in params}}
    opt = case.optimizer(params, **settings)
    trace, originals = [], None
    for t in range(1, case.steps + 1):
        if t == swap_at:
            originals = [p.detach().clone() for p in params]
            old, params = params, copy.deepcopy(params)
            _point_at(opt, old, params)
        opt.zero_grad()
        for i, p in enumerate(params):  # through backward, for overlap_backward's hooks
            (p * case.problem.grad(t, rank, i, p)).sum().backward()
        opt.step()
        trace.append(flat(params))
    untouched = originals is None or same(originals, [p.detach() for p in old])
    state = opt.state_dict()
    return trace, state["state"], state["onebit"]["ranks"], untouched


def _copied_and_straight(rank: int, world_size: int) -> list[tuple[bool, bool, bool]]:
    results = []
    for name, settings in VARIANTS:
        straight = _run(name, settings, rank, swap_at=None)
        for swap_at in (1, CASES[name].checkpoint):  # before any step; in the compression stage
            copied = _run(name, settings, rank, swap_at)
            results.append(
                (same(straight[0], copied[0]), same(straight[1:3], copied[1:3]), copied[3])
            )
    return results


def test_a_copy_in_param_groups_trains_on_as_the_original_would():
    """The copy is trained, bitwise as the original would have been, with the state it had."""
    for rank_results in run_ranks(_copied_and_straight, 2, timeout=300):
        assert rank_results == [(True, True, True)] * len(rank_results)


def _replaced_badly(rank: int, world_size: int, how: str) -> tuple[str | None, bool]:
    """Replace the parameters after two steps in a way the state cannot follow; return the
    step's error, and whether the parameters and the state were left as they were."""
    case = CASES["adam"]
    params = case.problem.params()
    opt = case.optimizer(params)
    for t in (1, 2):
        case.problem.set_grads(params, t, rank)
        opt.step()
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    if how == "shapes":
        opt.param_groups[0]["params"] = [torch.nn.Parameter(torch.zeros(5, 7)), params[1]]
    else:  # one parameter fewer
        opt.param_groups[1]["params"] = []
    case.problem.set_grads(params, 3, rank)
    try:
        opt.step()
        error = None
    except RuntimeError as err:
        error = str(err)
    with pytest.raises(ValueError, match="cannot lay its state out on the parameters"):
        opt.state_dict()
    opt.param_groups[0]["params"], opt.param_groups[1]["params"] = params[:2], params[2:]
    unchanged = same(before[0], [p.detach() for p in params]) and same(before[1], opt.state_dict())
    return error, unchanged


@pytest.mark.parametrize(
    ("how", "why"), [("shapes", "other shapes"), ("count", "2 parameters where")]
)
def test_a_replacement_that_cannot_be_followed_raises_on_every_rank(how, why):
    for error, unchanged in run_ranks(_replaced_badly, 2, how, timeout=120):
        assert error is not None and "ranks 0, 1 have parameters in param_groups" in error
        assert why in error and unchanged


def _replaced_on_one_rank(rank: int, world_size: int) -> str | None:
    """Before the first step rank 0 alone replaces a parameter by one of another shape, which
    needs a new layout and so the other ranks' agreement; the first step's error."""
    case = CASES["adam"]
    params = case.problem.params()
    opt = case.optimizer(params)
    if rank == 0:
        opt.param_groups[0]["params"] = [torch.nn.Parameter(torch.zeros(5, 7)), params[1]]
    case.problem.set_grads(params, 1, rank)
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)
    return None


def test_a_new_layout_on_some_ranks_only_raises_on_every_rank_instead_of_hanging():
    """The first step asks every rank whether any lays its state out anew, so the ranks whose
    param_groups did not change take part in the agreement, which fails, on every rank."""
    for error in run_ranks(_replaced_on_one_rank, 2, timeout=120):
        assert error is not None and "ranks 0, 1 have parameters in param_groups" in error
        assert "settings differ across ranks: shapes" in error


def _replaced_but_trained_the_old(rank: int, world_size: int) -> str | None:
    """With ``overlap_backward``, backward sends the gradients of the parameters the state is
    laid out on; if ``param_groups`` holds others by then, the step cannot be applied to them."""
    case = CASES["adam"]
    params = case.problem.params()
    opt = case.optimizer(params, overlap_backward=True)

    def backward(t: int) -> None:
        for i, p in enumerate(params):
            (p * case.problem.grad(t, rank, i, p)).sum().backward()

    for t in (1, 2):
        backward(t)
        opt.step()
        opt.zero_grad()
    _point_at(opt, params, copy.deepcopy(params))
    backward(3)
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)
    return None


def test_parameters_replaced_after_overlapped_backward_began_raise_on_every_rank():
    for error in run_ranks(_replaced_but_trained_the_old, 2, timeout=120):
        assert error is not None and "ranks 0, 1 have parameters in param_groups" in error
        assert "replace them between steps" in error


def _load_after_replacing(rank: int, world_size: int) -> bool:
    """A checkpoint loaded after the parameters were replaced goes to the new ones."""
    case = CASES["adam"]
    params = case.problem.params()
    opt = case.optimizer(params)
    for t in range(1, 6):
        case.problem.set_grads(params, t, rank)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = case.problem.params()
    restored = case.optimizer(fresh)
    copies = copy.deepcopy(params)
    _point_at(restored, fresh, copies)
    restored.load_state_dict(saved)
    for t in range(6, 9):
        case.problem.set_grads(params, t, rank)
        case.problem.set_grads(copies, t, rank)
        opt.step()
        restored.step()
    return same([p.detach() for p in params], [p.detach() for p in copies]) and all(
        restored.state[p] for p in copies
    )


def test_load_state_dict_follows_replaced_parameters():
    assert run_ranks(_load_after_replacing, 2, timeout=120) == [True, True]


# FSDP2 shards the model after the optimizer was built, and the param groups get the shards.


def _sharded_after_building(rank: int, world_size: int, name: str, replaced: bool) -> dict:
    from family import make_optimizer
    from test_fsdp import _local, _mesh, _shard, _train, _wide

    mesh = _mesh(2, 2)
    replicas = mesh["replicate"].get_group()
    model = _wide()
    if replaced:  # built on the whole model, then sharded, as Accelerate and HF Trainer do
        opt = make_optimizer(name, model.parameters(), process_group=replicas, bucket_size=4096)
        names = {p: n for n, p in model.named_parameters()}
        _shard(model, mesh["shard"])
        sharded = dict(model.named_parameters())
        for group in opt.param_groups:
            group["params"] = [sharded[names[p]] for p in group["params"]]
    else:
        _shard(model, mesh["shard"])
        opt = make_optimizer(name, model.parameters(), process_group=replicas, bucket_size=4096)
    _train(model, opt, range(6))
    return {
        "local": _local(model),
        "bytes": opt.comm_stats.state_dict(),
        "sharded": opt.shards.sharded,
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_fsdp2_sharding_after_the_optimizer_was_built_is_followed(name):
    """Sharded after the optimizer was built, the model trains bitwise as one whose optimizer
    was built on the shards, at 1 bit across replicas."""
    built_after = run_ranks(_sharded_after_building, 4, name, False, timeout=300)
    replaced = run_ranks(_sharded_after_building, 4, name, True, timeout=300)
    for a, b in zip(built_after, replaced):
        assert b["sharded"] and same(a, b)
        assert b["bytes"]["steps"]["compression"] > 0


def _accelerate_fsdp2(rank: int, world_size: int, hsdp: bool) -> tuple[str | None, bool]:
    """The usual Accelerate order: the optimizer on the model, then ``accelerator.prepare``
    shards both. Accelerate runs FSDP2 only on GPUs; its FSDP2 path is taken here on the CPU."""
    from frameworks import accelerate_hsdp_on_cpu, launched_as, tiny_gpt2

    import onebit

    launched_as(rank, world_size)
    accelerator = accelerate_hsdp_on_cpu(2 if hsdp else 1, 2 if hsdp else 4)
    model = tiny_gpt2()
    opt = onebit.OnebitAdam(model.parameters(), warmup_compression="fp32", lr=1e-3, freeze_step=3)
    model, opt = accelerator.prepare(model, opt)
    before = [p.detach().to_local().clone() for p in model.parameters()]
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    accelerator.backward(model(input_ids=x, labels=x).loss)
    try:
        opt.step()
        error = None
    except RuntimeError as err:
        error = str(err)
    after = [p.detach().to_local() for p in model.parameters()]
    dist.barrier()
    return error, same(before, after)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hsdp", "why"),
    [(False, "4 replicas x 4 shards is not the world's 4 ranks"), (True, "2-D mesh")],
    ids=["fsdp2", "hsdp"],
)
def test_accelerate_fsdp2_prepare_after_the_optimizer_is_an_error_on_every_rank(hsdp, why):
    """Where the sharded parameters cannot be followed (sharded over every rank, or on a 2-D
    mesh where FSDP2 would average across replicas itself), every rank raises, naming the fix,
    and the model is unchanged: never a step that trains nothing."""
    pytest.importorskip("accelerate")
    for error, unchanged in run_ranks(_accelerate_fsdp2, 4, hsdp, timeout=300, frameworks=True):
        assert error is not None and "ranks 0, 1, 2, 3 have parameters in param_groups" in error
        assert why in error and unchanged
