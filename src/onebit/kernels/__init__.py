"""The kernel seam: one interface, its backends, and the one function that picks among them.

The interface is :class:`~onebit.kernels.interface.Kernels` (with its optional capabilities).
The backends, listed once in ``_REGISTRY`` (``ONEBIT_BACKEND`` names them):

* ``"torch"``: :class:`~onebit.kernels.reference.TorchKernels`, the torch formulation of SPEC
  sections 1 and 2: the reference the others must match, and what runs on every device without
  a faster backend. The others derive from it and name each operation they take from it
  (:func:`undeclared`).
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
next: a slower path is never taken silently. ``ONEBIT_BACKEND=auto|c|numpy|triton|torch`` forces
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
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .interface import FUSED_MOMENTUM, OPERATIONS, OPTIONAL, Kernels
from .native import CKernels
from .numpy_chunks import NumpyKernels
from .reference import TorchKernels

ENV = "ONEBIT_BACKEND"

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


_TRITON: Kernels | None = None


def _triton() -> Kernels:
    """The Triton backend, imported on first use (so ``TRITON_INTERPRET`` counts until then)."""
    global _TRITON
    if _TRITON is None:
        try:
            from .triton_kernels import TritonKernels

            _TRITON = TritonKernels()
        except Exception as err:  # not installed, or cannot load on this machine
            _TRITON = _Missing("triton", f"Triton cannot be imported ({err})")
    return _TRITON


class _Backend(NamedTuple):
    name: str
    fast_on: str | None
    """The device type where ``auto`` takes it, or ``None``."""
    load: Callable[[], Kernels]


_REGISTRY = (  # fastest first: auto tries a device's backends in this order
    _Backend("c", "cpu", lambda: _C),
    _Backend("numpy", "cpu", lambda: _NUMPY),
    _Backend("triton", "cuda", _triton),
    _Backend("torch", None, lambda: _TORCH),
)

BACKENDS = ("auto", *(b.name for b in _REGISTRY))
"""What ``ONEBIT_BACKEND`` may name."""


def _by_name(name: str) -> Kernels:
    return next(b.load() for b in _REGISTRY if b.name == name)


def requested() -> str:
    """The backend ``ONEBIT_BACKEND`` asks for (``"auto"`` when unset)."""
    name = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{ENV}={name!r} is not a backend: use one of {', '.join(BACKENDS)}")
    return name


def for_device(device: torch.device) -> Kernels:
    """The backend for tensors on ``device`` (see the module's docstring)."""
    name = requested()
    if name == "auto":
        for kernels in (b.load() for b in _REGISTRY if b.fast_on == device.type):
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


def _problem(kernels: Kernels, device: torch.device) -> str | None:
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


def for_tensors(*tensors: Tensor) -> Kernels:
    """The backend for an op on these tensors: that of their device, or the torch reference
    where they are on more than one."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return _TORCH
    return for_device(devices.pop() if devices else _CPU)


def available() -> list[str]:
    """The backends that can run on this machine's CPU, fastest first (Triton only under
    ``TRITON_INTERPRET=1``)."""
    return [b.name for b in _REGISTRY if b.load().unavailable() is None and b.load().runs_on(_CPU)]


def undeclared(backend: type[Kernels]) -> list[str]:
    """The operations that ``backend``, a subclass of the torch reference, takes from it without
    naming them. Each must be defined by ``backend`` or a class between it and the reference
    (``op = TorchKernels.op`` names one it takes as it is), so that none is taken by omission;
    with ``packs_momentum``, the fused momentum passes too. The optional capabilities
    (``block_quantizer``, ``model_passes``) may be left to the reference, which has none."""
    if backend is TorchKernels:
        return []
    own = backend.__mro__[: backend.__mro__.index(TorchKernels)]
    needed = [n for n in OPERATIONS if n not in OPTIONAL]
    needed += list(FUSED_MOMENTUM) if backend.packs_momentum else []
    return [n for n in needed if not any(n in vars(cls) for cls in own)]
