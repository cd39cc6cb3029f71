"""The kernel seam: one interface, its backends, and the one function that picks among them.

Backends (``ONEBIT_BACKEND`` names them):

* ``"torch"``: :class:`~onebit.kernels.reference.TorchKernels`, the torch formulation of SPEC
  sections 1 and 2. It is the interface, the reference the others must match, and what runs on
  every device without a faster backend.
* ``"c"``: :class:`~onebit.kernels.native.CKernels`, the fused C kernels built at install, for
  the CPU; also the fused passes of the packed momentum.
* ``"numpy"``: :class:`~onebit.kernels.numpy_chunks.NumpyKernels`, the CPU's fallback where the
  C kernels were not built.
* ``"triton"``: the Triton kernels for CUDA, not part of this version yet.

:func:`for_tensors` decides which runs, for a set of tensors: the C kernels on the CPU (else
numpy, else torch), the torch reference elsewhere. ``ONEBIT_BACKEND=auto|torch|c|numpy|triton``
forces one; an unknown value, or a backend that cannot run on the tensors' device or on this
machine, raises a ``ValueError`` that names ``ONEBIT_BACKEND`` (the optimizers check it when
they are built and when their state moves, so that every rank raises it together).

Signs, packing, unpacking, error updates and the server's average are bit for bit the same on
every backend. Scales are not: each backend sums in its own order. The C and numpy sums are
within 2e-6 of the exact value, the torch reference's fp32 norm within 1e-4
(``tests/test_kernels.py::test_scale``). Nothing outside this function chooses a
kernel by device: callers use the backend it returns and do not know which one it is.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .native import CKernels
from .numpy_chunks import NumpyKernels
from .reference import TorchKernels

ENV = "ONEBIT_BACKEND"
BACKENDS = ("auto", "torch", "c", "numpy", "triton")

_TORCH, _NUMPY, _C = TorchKernels(), NumpyKernels(), CKernels()
_BY_NAME = {"c": _C, "numpy": _NUMPY, "torch": _TORCH}  # in order of preference
_CPU = torch.device("cpu")


def requested() -> str:
    """The backend ``ONEBIT_BACKEND`` asks for (``"auto"`` when unset)."""
    name = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{ENV}={name!r} is not a backend: use one of {', '.join(BACKENDS)}")
    return name


def for_device(device: torch.device) -> TorchKernels:
    """The backend for tensors on ``device`` (see the module's docstring)."""
    name = requested()
    if name == "auto":
        cpu = (_C, _NUMPY) if device == _CPU else ()
        return next((k for k in cpu if k.unavailable() is None), _TORCH)
    if name == "triton":
        raise ValueError(
            f"{ENV}=triton: this version of onebit has no Triton kernels yet; unset {ENV} or "
            "use torch"
        )
    kernels = _BY_NAME[name]
    problem = kernels.unavailable()
    if problem is None and not kernels.runs_on(device):
        problem = f"it runs on the CPU only, and these tensors are on {device}"
    if problem is not None:
        raise ValueError(f"{ENV}={name} cannot run here: {problem}")
    return kernels


def for_tensors(*tensors: Tensor) -> TorchKernels:
    """The backend for an op on these tensors: that of their device, or the torch reference
    where they are on more than one."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return _TORCH
    return for_device(devices.pop() if devices else _CPU)


def available() -> list[str]:
    """The backends that can run on this machine's CPU, fastest first."""
    return [name for name, k in _BY_NAME.items() if k.unavailable() is None]
