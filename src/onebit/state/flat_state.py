"""An optimizer's per-parameter state, kept in flat fp32 buffers.

The optimizers work on whole buffers (one kernel per buffer, not one per tensor), while
``optimizer.state[p]`` holds each parameter's view of them, so that torch's ``state_dict`` and
what users inspect are per parameter as in ``torch.optim.AdamW``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .layout import FlatLayout


class FlatState:
    """Named flat buffers laid out by ``layout``, exposed per parameter in ``state``.

    Args:
        layout: where each parameter lives in a flat buffer.
        state: the optimizer's ``state`` (``optimizer.state[p][name]`` is ``p``'s view).
        param_groups: the optimizer's param groups, in layout order.
        device: where the buffers live.
    """

    def __init__(
        self,
        layout: FlatLayout,
        state: dict[Tensor, dict[str, Any]],
        param_groups: list[dict[str, Any]],
        device: torch.device,
    ) -> None:
        self.layout, self.state, self.param_groups, self.device = (
            layout,
            state,
            param_groups,
            device,
        )

    def zeros(self, name: str | None = None, padded: bool = False) -> Tensor:
        """A new zero flat buffer (``padded``: to the buckets' padded length), exposed as
        ``name`` if given."""
        flat = self.layout.zeros(padded=padded, device=self.device)
        if name is not None:
            self.expose(name, flat)
        return flat

    def expose(self, name: str, flat: Tensor | None) -> None:
        """Make ``state[p][name]`` each parameter's view of ``flat``; ``None`` removes the entry.

        Optimizers whose state changes at the freeze (the variance turns into a frozen
        denominator, say) rename their buffers so that ``state_dict`` says what each holds.
        """
        layout = self.layout
        views = layout.views(flat) if flat is not None else [None] * len(layout.keys)
        for p, view in zip(layout.keys, views):
            if view is None:
                self.state[p].pop(name, None)
            else:
                self.state[p][name] = view

    def per_group(self, *flats: Tensor) -> Iterator[tuple[Any, ...]]:
        """``(group, the group's tensors in ``layout.params``, views of each flat buffer...)``
        per param group."""
        views = [self.layout.views(f) for f in flats]
        start = 0
        for group in self.param_groups:
            end = start + len(group["params"])
            yield (group, self.layout.params[start:end], *(v[start:end] for v in views))
            start = end
