"""The fused compression stage with a packed momentum, of 1-bit Adam and 1-bit LAMB: the same
bits as the unfused torch formulation, on real gloo ranks, through AMP, missing gradients,
skipped steps and resume.
"""

import io
import re

import pytest
import torch
from distributed import run_ranks
from heavy import slow

import onebit
from onebit import _native
from onebit.optim import lamb_compression
from onebit.wire import momentum

pytestmark = pytest.mark.skipif(_native.load() is None, reason="needs the C kernels")

FREEZE, STEPS = 3, 9
STATE = {"OnebitAdam": {"frozen_denom"}, "OnebitLamb": {"frozen_denom", "exp_avg_sq_fresh"}}
"""Each optimizer's per-parameter state in the compression stage, besides the packed momentum."""


def _model(strided: bool = False) -> torch.nn.Module:
    """Three layers; ``strided``: the middle one a convolution in ``channels_last``, and the
    first layer's weight transposed in memory (parameters that fill their memory in another
    order than their shape's)."""
    torch.manual_seed(0)
    if not strided:
        return torch.nn.Sequential(
            torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5), torch.nn.Linear(5, 3)
        )
    conv = torch.nn.Sequential(
        torch.nn.Unflatten(1, (13, 2, 2)), torch.nn.Conv2d(13, 5, 2), torch.nn.Flatten()
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 52), torch.nn.Tanh(), conv, torch.nn.Linear(5, 3)
    )
    model.to(memory_format=torch.channels_last)
    model[0].weight.data = model[0].weight.data.t().contiguous().t()
    assert not any(p.is_contiguous() for p in (conv[1].weight, model[0].weight))
    return model


def _optimizer(
    model: torch.nn.Module,
    fused: bool,
    name: str = "OnebitAdam",
    freeze_step: int = FREEZE,
    **options,
) -> onebit.OnebitAdam | onebit.OnebitLamb:
    layers = list(model.children())
    groups = [
        {"params": layers[0].parameters(), "lr": 3e-3, "weight_decay": 0.1},
        {"params": [*layers[2].parameters(), *layers[3].parameters()], "lr": 1e-3},
    ]
    saved = momentum.unpacked_because
    if not fused:
        momentum.unpacked_because = lambda *args, **kwargs: "the test's unfused run"
    try:
        opt = getattr(onebit, name)(
            groups,
            freeze_step=freeze_step,
            bucket_size=64,
            warmup_compression="fp32",
            allow_edited_grads=True,  # the inf that _steps writes into .grad
            **options,
        )
    finally:
        momentum.unpacked_because = saved
    assert (opt.packed_momentum is not None) == fused
    return opt


def _steps(model, opt, scaler, rank: int, start: int, stop: int) -> list[list[torch.Tensor]]:
    """Steps ``start..stop-1``: AMP loss scaling throughout; step 5 has no gradient for the last
    layer's bias; step 6 has an inf on rank 0 (every rank skips it)."""
    history = []
    for t in range(start, stop):
        gen = torch.Generator().manual_seed(100 * t + rank)
        x, y = (torch.randn(16, n, generator=gen).to(model[0].weight) for n in (7, 3))
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if t == 5:
            model[3].bias.grad = None
        if t == 6 and rank == 0:
            model[0].weight.grad[1, 2] = float("inf")
        scaler.step(opt)
        scaler.update()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def _scaler(device: str = "cpu") -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device, init_scale=2.0**7, growth_interval=2)


def _masks(model: torch.nn.Module) -> dict[str, dict]:
    """An ``exp_avg_mask`` on two of :func:`_model`'s parameters: rows and a column of the
    first weight, one entry of the middle bias."""
    weight = torch.ones_like(model[0].weight)
    weight[3:7] = 0.0
    weight[:, 1] = 0.0
    bias = torch.ones_like(model[2].bias)
    bias[1] = 0.0
    return {"exp_avg_mask": {model[0].weight: weight, model[2].bias: bias}}


def _run(rank, world_size, name, fused, resume_fused, options=None):
    options = dict(options or {})
    strided, masked = options.pop("strided", False), options.pop("masked", False)
    dtype = options.pop("dtype", torch.float32)
    model = _model(strided).to(dtype)
    opt = _optimizer(model, fused, name, **options, **(_masks(model) if masked else {}))
    scaler = _scaler()
    history = _steps(model, opt, scaler, rank, 0, 5)
    if "max_grad_norm" in options:  # the compression step clipped
        assert opt.stage == "compression" and opt.grad_norm > 2 * options["max_grad_norm"]
    if fused:
        assert "exp_avg" not in opt.state[model[0].weight]  # packed
        assert opt.comms[0].worker_error.data_ptr() == opt.exp_avg.data_ptr()
    saved = io.BytesIO()
    states = {"model": model, "opt": opt, "scaler": scaler}
    torch.save({name: obj.state_dict() for name, obj in states.items()}, saved)
    history += _steps(model, opt, scaler, rank, 5, STEPS)
    state = opt.state_dict()
    assert opt.skipped_steps == 1

    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    model2 = _model(strided).to(dtype)
    model2.load_state_dict(checkpoint["model"])
    opt2 = _optimizer(model2, resume_fused, name, **options, **(_masks(model2) if masked else {}))
    scaler2 = _scaler()
    opt2.load_state_dict(checkpoint["opt"])
    if fused and resume_fused:  # packed again from the saved fp32 momentum, masks and all
        assert opt2.packed_momentum.packed is not None
    scaler2.load_state_dict(checkpoint["scaler"])
    resumed = _steps(model2, opt2, scaler2, rank, 5, STEPS)
    return history, state, resumed


LOOPS = {
    "plain": {},
    "max_grad_norm": {"max_grad_norm": 0.05},
    "channels_last": {"strided": True},
    "exp_avg_mask": {"masked": True},
    "bf16": {"dtype": torch.bfloat16},
    "fp16": {"dtype": torch.float16},
}
"""The loops the packed momentum is checked in, as the optimizer's options. With
``max_grad_norm`` each rank clips its own gradient by a factor the fused passes multiply it by;
``strided`` and ``masked`` (not options: :func:`_run` reads them) step :func:`_model`'s strided
parameters, which the flat buffers hold in memory order, and give it :func:`_masks`;
``dtype``: the model in bf16 or fp16, its gradients read and its parameters updated in that
dtype."""

CASES = [(name, loop) for name in STATE for loop in LOOPS]


@pytest.mark.parametrize("name,loop", CASES)
@pytest.mark.parametrize("world_size", [1, slow(3)])
def test_fused_steps_give_the_unfused_bits_and_resume_exactly(world_size, name, loop):
    """Through AMP, a missing gradient, a skipped step and a resume, in each of :data:`LOOPS`."""
    fused = run_ranks(_run, world_size, name, True, False, LOOPS[loop])
    unfused = run_ranks(_run, world_size, name, False, True, LOOPS[loop])
    for (history, state, resumed), (want, want_state, want_resumed) in zip(fused, unfused):
        for t, (got, expected) in enumerate(zip(history, want)):
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"step {t}"
        for i, per_param in want_state["state"].items():
            assert set(state["state"][i]) == set(per_param) == {"exp_avg", *STATE[name]}
            for key, value in per_param.items():
                assert torch.equal(state["state"][i][key], value), (i, key)
        comms = state["onebit"]["ranks"], want_state["onebit"]["ranks"]
        for a, b in zip(*(list(r.values())[0]["comms"] for r in comms)):
            assert torch.equal(a["worker_error"], b["worker_error"])
            assert torch.equal(a["server_error"], b["server_error"])
        # Resumed from step 5 across the two paths (fused state into unfused, and back).
        for got, expected in zip(resumed, want[5:]):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
        for got, expected in zip(want_resumed, history[5:]):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("name", STATE)
def test_state_holds_the_frozen_denominator_and_a_packed_momentum(name):
    model = _model()
    opt = _optimizer(model, True, name)
    p = model[0].weight
    assert set(opt.state[p]) == {"exp_avg", "exp_avg_sq"}
    assert opt.comms[0]._worker_error is None  # no error buffers in the warmup
    _steps(model, opt, _scaler(), 0, 0, FREEZE)
    if name == "OnebitAdam":  # frozen at the end of its last warmup step (LAMB: at the next)
        assert opt.bucketer._buffer is None  # the fused stage reads .grad: no gradient scratch
    _steps(model, opt, _scaler(), 0, FREEZE, FREEZE + 1)
    assert set(opt.state[p]) == STATE[name]
    assert opt.bucketer._buffer is None
    assert all(c.worker_error.data_ptr() == opt.exp_avg[c_start].data_ptr()
               for c, (c_start, _) in zip(opt.comms, opt.layout.buckets))  # fmt: skip
    assert set(opt.state_dict()["state"][0]) == {"exp_avg", *STATE[name]}
    assert set(opt.state[p]) == STATE[name]


def _two_runs(name, change=None, reload_at=None, packed=None, why=None) -> list[list[torch.Tensor]]:
    """The same single-process run fused and unfused; ``change(model)`` after step 4,
    ``reload_at``: the fused optimizer reloads its own state_dict before that step; ``packed``:
    whether the fused one's momentum is still packed at the end (``None``: not checked);
    ``why``: a pattern of the reason it gives where it is not."""
    runs = []
    for fused in (True, False):
        model = _model()
        opt, scaler = _optimizer(model, fused, name), _scaler()
        if fused and reload_at == 0:
            opt.load_state_dict(opt.state_dict())
        _steps(model, opt, scaler, 0, 0, FREEZE + 2)
        if change is not None:
            change(model)
        _steps(model, opt, scaler, 0, FREEZE + 2, STEPS)
        runs.append([p.detach().clone() for p in model.parameters()])
        if fused and packed is not None:
            stage = opt.packed_momentum
            assert (stage is not None and stage.packed is not None) == packed
        if fused and why is not None:
            assert re.search(why, opt._unpacked), opt._unpacked
    return runs


@pytest.mark.parametrize("name", STATE)
def test_a_warmup_state_reloaded_stays_a_warmup_state(name):
    fused, unfused = _two_runs(name, reload_at=0)  # an all-zero momentum is not a packed one
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_on_cuda_take_the_unfused_bits(dtype):
    """On a GPU the Triton passes read bf16 and fp16 gradients and update the parameters in
    their dtype as CUDA's ops round them: through AMP, weight decay, a missing gradient and a
    skipped step, the unfused path's bits."""
    runs = []
    for fused in (True, False):
        model = _model().to("cuda", dtype)
        opt = _optimizer(model, fused)
        runs.append(_steps(model, opt, _scaler("cuda"), 0, 0, STEPS))
    for t, (got, expected) in enumerate(zip(*runs)):
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"step {t}"


def _strided(model: torch.nn.Module) -> None:
    weight = model[0].weight
    weight.data = weight.data.t().contiguous().t()  # same values, not contiguous


def _mixed(model: torch.nn.Module) -> None:
    layer = model[3].bfloat16()  # the last layer in bf16, the others in fp32
    layer.register_forward_pre_hook(lambda _, args: tuple(a.bfloat16() for a in args))
    layer.register_forward_hook(lambda _, args, out: out.float())


@pytest.mark.parametrize("name", STATE)
@pytest.mark.parametrize(
    "change, why",
    [(_strided, "in the layout's order"), (_mixed, r"mixed dtypes \(bfloat16, float32\)")],
)
def test_parameters_that_stop_suiting_the_kernels_switch_to_the_unfused_path(name, change, why):
    """Parameters whose strides change, or of mixed dtypes: the momentum is unpacked, saying
    why, and the steps go on with the bits of the unfused path."""
    fused, unfused = _two_runs(name, change=change, packed=False, why=why)
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))


@pytest.mark.parametrize(
    "name, options, why",
    [
        ("OnebitAdam", {"scale_per": "bucket"}, 'scale_per="bucket"'),
        ("OnebitLamb", {"scale_per": "bucket"}, 'scale_per="bucket"'),
        ("OnebitAdam", {"overlap_backward": True, "max_grad_norm": 1.0}, "is no longer ±σ"),
        ("OnebitAdam", {"mixed": True}, r"mixed dtypes \(bfloat16, float32\)"),
        ("OnebitLamb", {"backend": "numpy"}, "the numpy kernels have no fused passes"),
    ],
)
def test_an_optimizer_without_a_packed_momentum_says_why(monkeypatch, name, options, why):
    """Each configuration that keeps an fp32 momentum gives its reason (which
    ``benchmarks/memory.py`` prints); the same optimizer without it packs."""
    for given in (options, {}):
        model = _model()
        if given.get("mixed"):
            _mixed(model)
        monkeypatch.setenv("ONEBIT_BACKEND", given.get("backend", "auto"))
        knobs = {k: v for k, v in given.items() if k not in ("mixed", "backend")}
        opt = getattr(onebit, name)(model.parameters(), freeze_step=FREEZE, **knobs)
        if given:
            assert opt.packed_momentum is None and re.search(why, opt._unpacked), opt._unpacked
        else:
            assert opt.packed_momentum is not None and opt._unpacked is None


@pytest.mark.parametrize("name", STATE)
def test_parameters_cast_to_bf16_stay_packed(name):
    """``model.bfloat16()`` after the freeze: the passes go on in bf16, with the unfused bits."""
    fused, unfused = _two_runs(name, change=torch.nn.Module.bfloat16, packed=True)
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))


def test_a_state_frozen_before_this_optimizers_freeze_step_is_refused():
    model = _model()
    opt = _optimizer(model, True)
    _steps(model, opt, _scaler(), 0, 0, FREEZE + 2)
    later = _optimizer(model, True, freeze_step=FREEZE + 5)  # 1-bit Adam's own check
    before = later.state_dict()
    with pytest.raises(ValueError, match="freeze_step"):
        later.load_state_dict(opt.state_dict())
    assert later.state_dict()["onebit"]["num_steps"] == before["onebit"]["num_steps"] == 0


def test_lamb_walks_its_buckets_in_blocks_with_the_unfused_bits(monkeypatch):
    """After its allreduce, 1-bit LAMB's compression step on the C kernels walks each bucket in
    blocks of ``lamb_compression.BLOCK``: with blocks that cut buckets and layers mid-way
    (weight decay's norms take whole layers), through AMP, a missing gradient and a skipped
    step, the bits stay the unfused path's."""
    monkeypatch.setattr(lamb_compression, "BLOCK", 24)
    runs = []
    for fused in (True, False):
        model = _model()
        opt = _optimizer(model, fused, "OnebitLamb")
        assert opt.param_groups[0]["weight_decay"] and len(opt.layout.buckets) > 1
        runs.append(_steps(model, opt, _scaler(), 0, 0, STEPS))
    for t, (got, expected) in enumerate(zip(*runs)):
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"step {t}"


def _run_triton(
    rank: int,
    world_size: int,
    name: str,
    counted: str,
    without: str | None,
    options: dict | None = None,
):
    """:func:`_run` of optimizer ``name`` on the Triton kernels (under the interpreter here),
    counting the steps that called ``ModelPasses.<counted>``. ``without="stage"``: the
    allreduce goes a bucket at a time; ``"model"``: no pass goes over every bucket (1-bit LAMB
    takes the torch formulation after its allreduce too). Returns the run and the count."""
    from backends import use_backend

    from onebit.kernels import triton_model
    from onebit.wire import model_allreduce

    use_backend("triton")
    took = [0]
    method = getattr(triton_model.ModelPasses, counted)

    def counting(self, *args, **kwargs):
        took[0] += 1
        return method(self, *args, **kwargs)

    setattr(triton_model.ModelPasses, counted, counting)
    if without == "stage":
        momentum.PackedMomentumStage.passes = lambda self: None
    elif without == "model":
        model_allreduce.ModelAllreduce.passes = lambda self: None
    return _run(rank, world_size, name, True, True, options), took[0]


@pytest.mark.parametrize(
    "name,world_size,loop",
    [(name, 1, "plain") for name in STATE]
    + [slow(name, 3, "plain") for name in STATE]
    + [slow(name, 2, loop) for name in STATE for loop in ("max_grad_norm", "exp_avg_mask")]
    + [slow(name, 1, loop) for name in STATE for loop in ("channels_last", "bf16")]
    + [slow("OnebitAdam", 2, "fp16")],
)
def test_passes_over_every_bucket_give_the_bits_of_a_bucket_at_a_time(world_size, name, loop):
    """The Triton allreduce in a few launches whatever the buckets (:mod:`onebit.kernels.
    triton_model`) against the same kernels' per-bucket passes, bit for bit: parameters, state
    and both errors, through AMP, a missing gradient, a skipped step and a resume (1-bit LAMB
    keeps its last momentum until its step has read it); with ``max_grad_norm``, the clipping
    coefficient the passes load from the device; with ``channels_last``, parameters addressed in
    memory order, with ``exp_avg_mask`` the masks the passes read, and in bf16 and fp16 the
    gradients and parameters read and rounded in their dtype (the C kernels' test above checks
    those against the unfused path). 3 ranks split the buckets' chunks unevenly; clipping,
    masks and fp16 act on each rank's own gradient, which 2 ranks show at two thirds of the
    cost."""
    args = (world_size, name, "signs")
    whole = run_ranks(_run_triton, *args, None, LOOPS[loop], timeout=600)
    per_bucket = run_ranks(_run_triton, *args, "stage", LOOPS[loop], timeout=600)
    for ((history, state, resumed), took), ((want, want_state, want_resumed), none) in zip(
        whole, per_bucket
    ):
        assert took == (STEPS - FREEZE) + (STEPS - 5) and none == 0  # every compression step
        for t, (got, expected) in enumerate(zip(history + resumed, want + want_resumed)):
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"step {t}"
        for i, per_param in want_state["state"].items():
            for key, value in per_param.items():
                assert torch.equal(state["state"][i][key], value), (i, key)
        comms = state["onebit"]["ranks"], want_state["onebit"]["ranks"]
        for a, b in zip(*(list(r.values())[0]["comms"] for r in comms)):
            assert torch.equal(a["worker_error"], b["worker_error"])
            assert torch.equal(a["server_error"], b["server_error"])


@pytest.mark.parametrize(
    "world_size,loop", [(1, "bf16"), slow(3, "plain"), slow(1, "exp_avg_mask")]
)
def test_lamb_after_its_allreduce_in_two_passes_follows_the_torch_formulation(world_size, loop):
    """On Triton, what 1-bit LAMB does after its allreduce (the fresh variance, each layer's
    largest ratio and norms, the update) is two passes over every bucket, each op rounded as
    the torch formulation rounds it but the square root (torch's on the CPU is within an ulp)
    and the norms' sums (added in another order): parameters and state stay within 1e-5 of
    it through AMP, a missing gradient, a skipped step, weight decay and a resume, in fp32,
    with bf16 parameters (read and rounded in bf16) and with masks (the gradient the momenta
    imply takes the new one before its mask)."""
    args = (world_size, "OnebitLamb", "lamb_ratios")
    passes = run_ranks(_run_triton, *args, None, LOOPS[loop], timeout=600)
    torch_ = run_ranks(_run_triton, *args, "model", LOOPS[loop], timeout=600)
    close = dict(rtol=1e-5, atol=1e-7)
    for ((history, state, resumed), took), ((want, want_state, want_resumed), none) in zip(
        passes, torch_
    ):
        applied = (STEPS - FREEZE) + (STEPS - 5) - 2  # the skipped step, before and resumed
        assert took == applied and none == 0
        for got, expected in zip(history + resumed, want + want_resumed):
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, **close)
        for i, per_param in want_state["state"].items():
            for key, value in per_param.items():
                torch.testing.assert_close(state["state"][i][key], value, **close)
