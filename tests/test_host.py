"""A step reads the device only through :mod:`onebit.host`, and a bounded number of times: on a
GPU each read waits for every kernel queued before it, so reads that grow with the buckets
bound the step by the CPU.

On the CPU, :mod:`device_reads` tells device values from host ones as CUDA would, and records
every read or upload that does not go through :mod:`onebit.host`. The ``cuda`` test checks the
same on a GPU with ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
from device_reads import device_values

import onebit
from onebit import host

SHAPES = [(64, 32)] * 6 + [(32,)] * 6
"""Twelve tensors; a bucket size of 2048 elements cuts them into seven buckets."""

STEPS = {
    "OnebitAdam warmup": ("OnebitAdam", {"freeze_step": 10**9, "warmup_compression": "fp32"}),
    "OnebitAdam warmup, clip": (
        "OnebitAdam", {"freeze_step": 10**9, "warmup_compression": "fp32", "max_grad_norm": 1.0}
    ),
    "OnebitAdam warmup, int8": ("OnebitAdam", {"freeze_step": 10**9, "warmup_compression": "int8"}),
    "OnebitAdam compression": ("OnebitAdam", {"freeze_step": 1}),
    "OnebitAdam compression, per bucket": ("OnebitAdam", {"freeze_step": 1, "scale_per": "bucket"}),
    "OnebitAdam compression, clip": ("OnebitAdam", {"freeze_step": 1, "max_grad_norm": 1.0}),
    "ZeroOneAdam sync": ("ZeroOneAdam", {"var_freeze_step": 1, "local_step_scaler": 10**9}),
    "ZeroOneAdam sync, clip": (
        "ZeroOneAdam", {"var_freeze_step": 1, "local_step_scaler": 10**9, "max_grad_norm": 1.0}
    ),
    "OnebitLamb compression": ("OnebitLamb", {"freeze_step": 1}),
    "OnebitLamb compression, clip": ("OnebitLamb", {"freeze_step": 1, "max_grad_norm": 1.0}),
}  # fmt: skip
"""Each step a test checks: the optimizer and its options (its stage from the second step)."""

READS = {
    "ZeroOneAdam sync": 2,
    "ZeroOneAdam sync, clip": 2,
    "OnebitLamb compression": 2,
    "OnebitLamb compression, clip": 2,
}
"""Steps that read the device twice, at any number of buckets: 0/1 Adam's sync step reads its
local step's verdict too (with the norm it clips with), 1-bit LAMB its layers' ratios after the
verdict. Every other step reads once, its verdict; a 1-bit step that clips leaves the
coefficient on the device for the passes, and a warmup step the norm it clipped with."""


def _optimizer(name: str, device: torch.device | str, bucket_size: int, mode=None):
    optimizer, options = STEPS[name]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.1) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    if mode is not None:
        mode.mark(*params, *(p.grad for p in params))
    return getattr(onebit, optimizer)(params, lr=1e-3, bucket_size=bucket_size, **options)


@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
@pytest.mark.parametrize("name", STEPS)
def test_a_step_reads_and_uploads_only_through_onebit_host(name, backend, monkeypatch):
    with device_values(monkeypatch) as mode:
        opt = _optimizer(name, "cpu", 2048, mode)
        opt.step()
        opt.step()
        mode.watching = True
        opt.step()
    assert mode.found == [], f"device reads or uploads outside onebit.host: {mode.found}"


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
@pytest.mark.parametrize("name", STEPS)
def test_host_reads_per_step_are_few_and_do_not_grow_with_buckets(name, backend):
    counts = {}
    for bucket_size in (2**22, 2048):
        opt = _optimizer(name, "cpu", bucket_size)
        opt.step()
        opt.step()
        with host.counted() as transfers:
            opt.step()
        counts[bucket_size] = transfers
    assert len(opt.comms) == 7
    one, many = counts[2**22], counts[2048]
    assert many.reads == one.reads == READS.get(name, 1), counts
    assert many.uploads == one.uploads <= 2, counts


@pytest.mark.parametrize("backend", ["triton", "c"], indirect=True)
@pytest.mark.parametrize("name", ["OnebitAdam compression", "OnebitAdam compression, clip"])
def test_a_gradscaler_step_reads_its_scale_only_where_the_kernels_take_numbers(
    name, backend, monkeypatch
):
    """On Triton the inverse loss scale (times the clipping coefficient) stays on the device,
    where the passes load it: the step reads only its verdict, and only through onebit.host.
    The C kernels take numbers, each a read of the CPU, which costs nothing."""
    with device_values(monkeypatch) as mode:
        opt = _optimizer(name, "cpu", 2048, mode)
        opt.step()
        opt.step()
        opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
        mode.mark(opt.grad_scale, opt.found_inf)
        for p in opt.layout.params:
            p.grad.mul_(1024.0)
        mode.watching = backend == "triton"  # the C kernels read the CPU's memory, as they may
        with host.counted() as transfers:
            opt.step()
    assert mode.found == [], f"device reads or uploads outside onebit.host: {mode.found}"
    clip = opt.max_grad_norm is not None
    assert transfers.reads == (1 if backend == "triton" else 3 if clip else 2)
    assert opt.skipped_steps == 0


def test_grad_norm_is_read_when_asked_for_not_during_the_step():
    opt = _optimizer("OnebitAdam warmup, clip", "cpu", 2048)
    with host.counted() as transfers:
        opt.step()
    assert transfers.reads == 1
    expected = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in opt.layout.params]))
    with host.counted() as transfers:
        assert opt.grad_norm == pytest.approx(float(expected), rel=1e-5)
        assert opt.grad_norm == pytest.approx(float(expected), rel=1e-5)
    assert transfers.reads == 1


@pytest.mark.cuda
@pytest.mark.parametrize("name", STEPS)
def test_a_cuda_step_synchronises_only_in_onebit_host(name, monkeypatch):
    opt = _optimizer(name, "cuda", 2048)
    opt.step()
    opt.step()
    read = host.read

    def allowed(tensor):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return read(tensor)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(host, "read", allowed)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_read_all_reads_parts_lying_end_to_end_as_they_are():
    """Parts that lie end to end in one buffer (as a step lays out its verdict's values) are
    read in one copy with no op on the device first; others are concatenated, then read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    buffer = torch.arange(12.0)
    adjacent = [buffer[2:8].view(2, 3), buffer[8].reshape(()), buffer[9:11]]
    apart = [buffer[2:8].view(2, 3), buffer[9].reshape(())]
    for parts, copies in [(adjacent, ["_to_copy"]), (apart, ["cat", "_to_copy"])]:
        with host.counted() as transfers, Ops() as ops:
            values = host.read_all(parts)
        assert values.tolist() == torch.cat([p.reshape(-1) for p in parts]).tolist()
        assert transfers.reads == 1 and ops.names == copies
    strided = [buffer[0:6:2], buffer[6:8]]
    assert host.read_all(strided).tolist() == [0.0, 2.0, 4.0, 6.0, 7.0]


@pytest.mark.parametrize("count", [1, 3, 4, 6, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_upload_rows_starts_every_row_on_16_bytes_in_one_upload(count, dtype):
    """Each row comes back with its values and starts on a 16-byte boundary, whatever the
    number of values (Triton compiles a variant per alignment of a pointer argument)."""
    rows = [[float(10 * r + i) for i in range(count)] for r in range(4)]
    with host.counted() as transfers:
        uploaded = host.upload_rows(rows, torch.device("cpu"), dtype)
    assert transfers.uploads == 1
    for row, values in zip(uploaded, rows):
        assert row.dtype == dtype and row.tolist() == pytest.approx(values)
        assert row.data_ptr() % 16 == 0
