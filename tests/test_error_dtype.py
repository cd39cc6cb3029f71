"""Error buffers kept in bf16 (``error_dtype=torch.bfloat16``): on every backend, on real gloo
ranks, the bits of the fp32 formulation with each error rounded to bf16 once written; half the
errors' memory; checkpoints that load across the two dtypes.
"""

import warnings

import pytest
import torch
from backends import use_backend
from distributed import run_ranks
from family import SETTINGS, all_equal, batch, loss_of, make_model, make_optimizer, params_of
from heavy import slow
from optimizer_state import roundtrip, storage_bytes
from torch.nn.parallel import DistributedDataParallel

import onebit
from onebit.compress import serve_pieces_

STEPS = 9
LOOPS = {
    "plain": {},
    "max_grad_norm": {"max_grad_norm": 0.05},
    "scale_per_bucket": {"scale_per": "bucket"},
    "overlap_backward": {"overlap_backward": True},
    "ddp_comm_hook": {},
}
"""The loops checked, as the optimizers' options: each takes another path through the kernels
(the packed momentum, clipped, the unfused path with one scale per bucket, backward's hooks:
1-bit Adam's alone; the model under DDP with :func:`onebit.ddp_comm_hook`)."""


def _rounded(opt) -> None:
    """Round every error buffer of an fp32-error optimizer to bf16 in place: what a bf16-error
    one keeps."""
    for comm in opt.comms:
        for buffer in (comm._worker_error, comm._server_error):
            if buffer is not None:
                buffer.copy_(buffer.bfloat16())


def _step(model, opt, t: int, rank: int) -> None:
    """Step ``t``; on step 6 rank 0's gradients are not finite, so every rank skips it."""
    opt.zero_grad()
    loss = loss_of(model, t, rank)
    (loss * float("inf") if t == 6 and rank == 0 else loss).backward()
    opt.step()


def _pair(rank: int, world_size: int, name: str, loop: str, backend: str):
    """Two optimizers side by side on one model's copies: fp32 errors rounded to bf16 after
    every step, and bf16 errors. Returns, per step, whether the parameters are equal, and at the
    end whether both error buffers are."""
    use_backend(backend)
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model()
        opt = make_optimizer(name, model.parameters(), error_dtype=dtype, **LOOPS[loop])
        if loop == "ddp_comm_hook":
            model = DistributedDataParallel(model)
            model.register_comm_hook(opt, onebit.ddp_comm_hook)
        runs.append((model, opt))
    (model, opt), (model_bf16, opt_bf16) = runs
    same = []
    for t in range(STEPS):
        _step(model, opt, t, rank)
        _rounded(opt)
        _step(model_bf16, opt_bf16, t, rank)
        same.append(all_equal(params_of(model), params_of(model_bf16)))
    errors = []
    for comm, comm_bf16 in zip(opt.comms, opt_bf16.comms):
        assert comm_bf16.worker_error.dtype == comm_bf16.server_error.dtype == torch.bfloat16
        errors.append(torch.equal(comm.worker_error.bfloat16(), comm_bf16.worker_error))
        errors.append(torch.equal(comm.server_error.bfloat16(), comm_bf16.server_error))
    stage = getattr(opt_bf16, "packed_momentum", None)
    packed = stage is not None and stage.packed is not None
    skipped = opt_bf16.skipped_steps + getattr(opt_bf16, "local_skipped_steps", 0)
    return same, errors, skipped, packed


CASES = [(name, 3, loop, "c") for name in SETTINGS for loop in list(LOOPS)[:3]]
CASES += [("adam", 3, loop, "c") for loop in ("overlap_backward", "ddp_comm_hook")]
CASES += [(name, 1, "plain", "torch") for name in SETTINGS]
CASES += [slow("adam", 3, "plain", "triton")] + [
    (name, 1, "plain", "triton") for name in ("lamb", "zero_one")
]


@pytest.mark.parametrize("name,world_size,loop,backend", CASES)
def test_bf16_errors_are_fp32_errors_rounded_once_written(name, world_size, loop, backend):
    """Every step, across the warmup, the freeze, a skipped step and the compression stage:
    the bf16-error optimizer's parameters and errors are bit for bit those of the fp32-error
    one whose errors are rounded to bf16 after each step (the packed momentum on the C and
    Triton kernels, Triton's passes over every bucket at once, the unfused path elsewhere)."""
    results = run_ranks(_pair, world_size, name, loop, backend, timeout=600)
    skipped = [skipped for _, _, skipped, _ in results]  # 0/1 Adam's is a local step: rank 0's
    assert skipped == [1] * world_size if name != "zero_one" else skipped[0] == 1
    for same, errors, _, packed in results:
        assert all(same), [t for t, ok in enumerate(same) if not ok]
        assert all(errors)
        fused = name != "zero_one" and loop == "plain" and backend in ("c", "triton")
        assert packed or not fused


@pytest.mark.parametrize("last", [False, True])
def test_the_server_pass_on_a_bf16_store_gives_its_fp32_copys_bits(monkeypatch, last):
    """:func:`~onebit.compress.serve_pieces_` on a bf16 server store (the error, or with
    ``last`` the last ``z``), which the C kernels read and write in place: the signs, scales
    and store of the torch reference on an fp32 copy, rounded once written."""
    gen = torch.Generator().manual_seed(1)
    k, m = 3, 4096 // 8 + 5  # a block, then a tail
    packed = torch.randint(0, 256, (k, m + 7), dtype=torch.uint8, generator=gen)[:, :m]
    bounds = torch.tensor([0, 5, 17, 2000, 8 * m])
    pieces = torch.stack([bounds[:-1], bounds[1:], torch.arange(len(bounds) - 1)], 1)
    scales = torch.rand(k, len(pieces), generator=gen)
    store = (torch.randn(8 * m, generator=gen) * 0.1).bfloat16()
    previous = torch.rand(len(pieces), generator=gen) if last else None
    results = []
    for backend in ("c", "torch"):
        use_backend(backend, monkeypatch)
        kept = store.clone()
        served = serve_pieces_(packed, scales, pieces, bounds, kept, previous, "rms")
        results.append((*served, kept))
    (signs, sigma, kept), (want_signs, want_sigma, want_kept) = results
    assert torch.equal(signs, want_signs) and torch.equal(kept, want_kept)
    torch.testing.assert_close(sigma, want_sigma, rtol=1e-6, atol=0)  # C sums in blocks
    assert not torch.equal(kept, store)


def test_bf16_errors_would_differ_unrounded():
    """The check above can fail: fp32 errors left unrounded end elsewhere."""
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model()
        opt = make_optimizer("adam", model.parameters(), error_dtype=dtype)
        for t in range(STEPS):
            _step(model, opt, t, 0)
        runs.append(params_of(model))
    assert not all_equal(*runs)


@pytest.mark.parametrize("name", SETTINGS)
def test_bf16_errors_take_half_the_memory(name):
    """Exact storage accounting in the compression stage: the worker and server errors take 2
    bytes per element instead of 4; with the packed momentum the fp32 momentum's storage,
    which held the fp32 worker errors, is released while the momentum is packed."""
    held = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model()
        opt = make_optimizer(name, model.parameters(), error_dtype=dtype)
        for t in range(STEPS):
            _step(model, opt, t, 1)  # rank 1 of 1: no step skipped
        assert opt.stage in ("compression", "local")
        held[dtype] = storage_bytes(opt)
        padded = sum(c.padded_numel for c in opt.comms)  # the server's chunk is all of it
        if opt.packed_momentum is not None:
            assert opt.packed_momentum.packed is not None
            assert opt.exp_avg.untyped_storage().nbytes() == (0 if dtype != torch.float32 else
                                                               4 * padded)  # fmt: skip
    assert held[torch.float32] - held[torch.bfloat16] == 2 * padded + 2 * padded


def _trained(name: str, dtype: torch.dtype, steps: int):
    model = make_model()
    opt = make_optimizer(name, model.parameters(), error_dtype=dtype)
    for t in range(steps):
        _step(model, opt, t, 1)
    return model, opt


@pytest.mark.parametrize("name", SETTINGS)
def test_a_checkpoint_resumes_exactly_and_loads_across_error_dtypes(name):
    """bf16 into bf16 resumes bit for bit, with no warning; bf16 into fp32 loads the errors
    exactly and fp32 into bf16 rounds them, each with a warning that says so, and the run goes
    on from the loaded state."""
    model, opt = _trained(name, torch.bfloat16, 5)
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    for t in range(5, STEPS):
        _step(model, opt, t, 1)

    resumed = make_model()
    resumed.load_state_dict(saved["model"])
    again = make_optimizer(name, resumed.parameters(), error_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(saved["opt"])
    for t in range(5, STEPS):
        _step(resumed, again, t, 1)
    assert all_equal(params_of(model), params_of(resumed))

    for into, source in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        model, opt = _trained(name, source, 5)
        errors = [c.worker_error.clone() for c in opt.comms]
        other = make_optimizer(name, model.parameters(), error_dtype=into)
        with pytest.warns(UserWarning, match=f"error buffers saved in {source}.*converted"):
            other.load_state_dict(roundtrip(opt.state_dict()))
        for comm, error in zip(other.comms, errors):
            assert comm.worker_error.dtype == into
            assert torch.equal(comm.worker_error, error.to(into))
        for t in range(5, STEPS):
            _step(model, other, t, 1)
        assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, "bf16"])
def test_an_error_dtype_the_kernels_do_not_keep_is_refused(name, dtype):
    model = make_model()
    with pytest.raises(ValueError, match="error_dtype must be one of"):
        make_optimizer(name, model.parameters(), error_dtype=dtype)


def test_the_packed_momentum_comes_back_when_the_parameters_stop_suiting_the_kernels():
    """With bf16 errors the packed momentum has no fp32 storage; parameters that stop suiting
    the fused passes (not contiguous) unpack it into storage given back, and the unfused path
    goes on with the same bits as fp32 errors rounded after each step."""
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model()
        opt = make_optimizer("adam", model.parameters(), error_dtype=dtype)
        for t in range(STEPS):
            if t == 6:
                assert opt.packed_momentum.packed is not None
                weight = model[0].weight
                weight.data = weight.data.t().contiguous().t()  # same values, not contiguous
            _step(model, opt, t, 1)
            if dtype == torch.float32:
                _rounded(opt)
        assert opt.packed_momentum is None  # unpacked
        assert "exp_avg" in opt.state[model[0].weight]
        runs.append(params_of(model))
    assert all_equal(*runs)


@pytest.mark.cuda
@pytest.mark.parametrize("name", SETTINGS)
def test_bf16_errors_on_a_gpu_are_fp32_errors_rounded_once_written(name):
    """On a GPU (Triton's passes over every bucket, compiled, not interpreted): the bits of
    fp32 errors rounded to bf16 after each step, as on the CPU."""
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model().cuda()
        opt = make_optimizer(name, model.parameters(), error_dtype=dtype)
        assert opt.backend == "triton"
        trace = []
        for t in range(STEPS):
            x, y = (v.cuda() for v in batch(t, 1))
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if dtype == torch.float32:
                _rounded(opt)
            trace.append(params_of(model))
        runs.append(trace)
    for t, (a, b) in enumerate(zip(*runs)):
        assert all_equal(a, b), f"step {t}"
