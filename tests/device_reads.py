"""Find, on the CPU, every place a step would read a device value or upload a host one on a GPU.

On the CPU the optimizer's "device" is the host, so a read costs nothing and looks like any
other. :class:`DeviceValues` tells them apart as CUDA would: a tensor is on the device if it
was made with a ``device`` argument, or computed from a tensor on the device (as a CUDA
tensor's results are); any other tensor lives on the host, as a CPU tensor would beside a CUDA
model. Reading a device tensor (``.item()``, ``bool()``, ``.tolist()``, ``.cpu()``, ...) or
moving a host tensor to the device is recorded, unless it happens inside
:func:`onebit.host.read` or :func:`onebit.host.upload`, or inside a Triton launch (the
interpreter's own copies). Run everything, the optimizer's construction included, under the
mode, so that every tensor is born with its place.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from onebit import host
from onebit.kernels import reference, triton_common

_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy",
          "__array__", "__format__"}  # fmt: skip

_INDICES = {"__getitem__": slice(1, None), "__setitem__": slice(1, -1), "index_select": slice(2, 3),
            "index_copy_": slice(2, 3), "index_add_": slice(2, 3)}  # fmt: skip
"""Where the indices are among the arguments of the ops that index a tensor."""


class DeviceValues(TorchFunctionMode):
    """Records ``(what, where)`` of each read or upload outside :mod:`onebit.host` in
    :attr:`found`, while :attr:`watching`."""

    def __init__(self) -> None:
        super().__init__()
        self._device: dict[int, weakref.ref] = {}
        self.found: list[tuple[str, str]] = []
        self.watching = False
        self._inside = 0

    def mark(self, *tensors: torch.Tensor) -> None:
        """Put ``tensors`` on the device (say, parameters made before the mode)."""
        for t in tensors:
            self._device[id(t)] = weakref.ref(t)

    def on_device(self, t: Any) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._inside:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        from_device = any(self.on_device(t) for t in tensors)
        named = [kwargs.get("device"), *(args[1:] if name in ("to", "cuda") else ())]
        to_host = any(d == "cpu" for d in named if isinstance(d, str))
        to_device = not to_host and any(
            isinstance(d, (torch.device, str)) or self.on_device(d) for d in named
        )
        if self.watching:
            self._check(name, args, tensors, from_device, to_device, to_host)
        result = func(*args, **kwargs)
        if (from_device and not to_host) or to_device:
            self.mark(*(t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)))
        return result

    def _check(self, name, args, tensors, from_device, to_device, to_host) -> None:
        if name in _INDICES and self.on_device(args[0]):
            indices = tree_flatten(args[_INDICES[name]])[0]
            if any(_sized(i) and not self.on_device(i) for i in indices):
                self._record(f"upload ({name} with host indices)")
        if name in ("copy_", "__setitem__"):
            target, source = args[0], args[-1]
            if self.on_device(target) and _sized(source) and not self.on_device(source):
                self._record(f"upload ({name})")
            elif not self.on_device(target) and self.on_device(source):
                self._record(f"read ({name} to the host)")
        elif name in _READS and tensors and self.on_device(tensors[0]):
            self._record(f"read ({name})")
        elif to_host and from_device:
            self._record(f"read ({name} to the host)")
        elif to_device and not from_device and tensors and _sized(tensors[0]):
            self._record(f"upload ({name})")
        elif to_device and name in ("tensor", "as_tensor") and isinstance(args[0], (list, tuple)):
            self._record(f"upload ({name})")

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """Run the block unwatched (a read or upload that is counted elsewhere)."""
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    def _record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-3] if "onebit" in f.filename]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
        self.found.append((what, where))


def _sized(t: Any) -> bool:
    """Whether moving ``t`` is an upload: CUDA takes a 0-dim host tensor as a scalar argument."""
    return isinstance(t, torch.Tensor) and t.dim() > 0


@contextlib.contextmanager
def device_values(monkeypatch: Any) -> Iterator[DeviceValues]:
    """A :class:`DeviceValues` mode, with :mod:`onebit.host` and Triton launches allowed and
    :func:`onebit.host.read`'s results on the host."""
    mode = DeviceValues()
    read, upload = host.read, host.upload

    def allowed_read(tensor):
        with mode.allowed():
            return read(tensor)

    def allowed_upload(*args, **kwargs):
        with mode.allowed():
            out = upload(*args, **kwargs)
        mode.mark(out)
        return out

    monkeypatch.setattr(host, "read", allowed_read)
    monkeypatch.setattr(host, "upload", allowed_upload)
    for module, cache in ((reference, "_SHIFTS"), (reference, "_WEIGHTS"),
                          (triton_common, "_TILINGS")):  # fmt: skip
        monkeypatch.setattr(module, cache, type(getattr(module, cache))())  # made under the mode
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        interpreter = None
    if interpreter is not None:
        run = interpreter.InterpretedFunction.run

        def allowed_run(self, *args, **kwargs):
            with mode.allowed():
                return run(self, *args, **kwargs)

        monkeypatch.setattr(interpreter.InterpretedFunction, "run", allowed_run)
    with mode:
        yield mode
