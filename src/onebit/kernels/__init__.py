"""The kernel seam: one interface, its backends, and the one function that picks among them.

Backends (``ONEBIT_BACKEND`` names them):

* ``"torch"``: :class:`~onebit.kernels.reference.TorchKernels`, the torch formulation of SPEC
  sections 1 and 2. It is the interface, the reference the others must match, and what runs on
  every device without a faster backend.
* ``"c"``: :class:`~onebit.kernels.native.CKernels`, the fused C kernels built at install, for
  the CPU; also the fused passes of the packed momentum.
* ``"numpy"``: :class:`~onebit.kernels.numpy_chunks.NumpyKernels`, the CPU's fallback where the
  C kernels were not built.
* ``"triton"``: :class:`~onebit.kernels.triton_kernels.TritonKernels`, for CUDA tensors (CPU
  tensors under ``TRITON_INTERPRET=1``, the way a machine without a GPU tests them). Imported on
  first use only: a CPU install needs no Triton.

:func:`for_tensors` decides which runs, for a set of tensors: the C kernels on the CPU (else
numpy, else torch), Triton on CUDA (else torch), the torch reference elsewhere. Where ``auto``
cannot take the fast backend of a device (Triton not installed, or ``TRITON_INTERPRET=1`` left
set, on CUDA; the C kernels not built, on the CPU), it warns once with the reason and takes the
next: a slower path is never taken silently. ``ONEBIT_BACKEND=auto|torch|c|numpy|triton`` forces
one; an unknown value, or a backend that cannot run on the tensors' device or on this machine,
raises a ``ValueError`` that names ``ONEBIT_BACKEND`` (the optimizers check it when they are
built and when their state moves, so that every rank raises it together).

Signs, packing, unpacking, error updates and the server's average are bit for bit the same on
every backend. Scales are not: each backend sums in its own order. The C and numpy sums are
within 2e-6 of the exact value, the torch reference's fp32 norm within 1e-4
(``tests/test_kernels.py::test_scale``). Nothing outside this function chooses a
kernel by device: callers use the backend it returns and do not know which one it is.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from .native import CKernels
from .numpy_chunks import NumpyKernels
from .reference import TorchKernels

ENV = "ONEBIT_BACKEND"
BACKENDS = ("auto", "torch", "c", "numpy", "triton")

_TORCH, _NUMPY, _C = TorchKernels(), NumpyKernels(), CKernels()
_CPU = torch.device("cpu")


class _Missing(TorchKernels):
    """A backend whose module cannot be imported here."""

    def __init__(self, name: str, why: str) -> None:
        self.name, self.why = name, why

    def unavailable(self) -> str | None:
        return self.why

    def runs_on(self, device: torch.device) -> bool:
        return False


_TRITON: TorchKernels | None = None


def _triton() -> TorchKernels:
    """The Triton backend, imported on first use (so ``TRITON_INTERPRET`` counts until then)."""
    global _TRITON
    if _TRITON is None:
        try:
            from .triton_kernels import TritonKernels

            _TRITON = TritonKernels()
        except Exception as err:  # not installed, or cannot load on this machine
            _TRITON = _Missing("triton", f"Triton cannot be imported ({err})")
    return _TRITON


def _by_name(name: str) -> TorchKernels:
    return {"c": _C, "numpy": _NUMPY, "torch": _TORCH}.get(name) or _triton()


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
        faster = (_C, _NUMPY) if device == _CPU else (_triton(),) if device.type == "cuda" else ()
        for kernels in faster:
            problem = _problem(kernels, device)
            if problem is None:
                return kernels
            _warn_once(kernels.name, device.type, problem)
        return _TORCH
    kernels = _by_name(name)
    problem = _problem(kernels, device)
    if problem is not None:
        raise ValueError(f"{ENV}={name} cannot run here: {problem}")
    return kernels


def _problem(kernels: TorchKernels, device: torch.device) -> str | None:
    """Why ``kernels`` cannot run on tensors on ``device``, or ``None``."""
    problem = kernels.unavailable()
    if problem is None and not kernels.runs_on(device):
        problem = f"it does not take tensors on {device}"
        if kernels.name == "triton" and device.type == "cuda":
            problem = "TRITON_INTERPRET=1 is set, which runs Triton's kernels on the CPU only"
    return problem


_WARNED: set[tuple[str, str]] = set()


def _warn_once(name: str, device_type: str, problem: str) -> None:
    """Say, once per process, that ``auto`` passed over backend ``name`` on ``device_type``."""
    if (name, device_type) in _WARNED:
        return
    _WARNED.add((name, device_type))
    warnings.warn(
        f"onebit: the {name} kernels cannot run on {device_type} here ({problem}), so onebit "
        f"takes a slower backend. Fix that, or set {ENV} to the backend you want to silence "
        "this warning",
        RuntimeWarning,
        stacklevel=3,
    )


def for_tensors(*tensors: Tensor) -> TorchKernels:
    """The backend for an op on these tensors: that of their device, or the torch reference
    where they are on more than one."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return _TORCH
    return for_device(devices.pop() if devices else _CPU)


def available() -> list[str]:
    """The backends that can run on this machine's CPU, fastest first (Triton only under
    ``TRITON_INTERPRET=1``)."""
    names = ("c", "numpy", "triton", "torch")
    return [n for n in names if _by_name(n).unavailable() is None and _by_name(n).runs_on(_CPU)]
