"""A torch ``Adam`` or ``AdamW`` read as the arguments of a onebit optimizer: the param groups a
training script already builds (decay and no-decay groups, per-group learning rates), so that
:meth:`~onebit.optim.base.CompressedOptimizer.from_optimizer` can take its place in one line."""

from __future__ import annotations

from typing import Any

import torch

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
"""What each param group of the torch optimizer gives the onebit one."""

_IGNORED = ("foreach", "fused", "capturable")
"""torch's choices of implementation, which say nothing of the maths."""

_REFUSED = {
    "amsgrad": "amsgrad (the 1-bit optimizers freeze Adam's variance; they keep no maximum)",
    "maximize": "maximize (negate the loss instead)",
    "differentiable": "differentiable (onebit's steps are not differentiable)",
}


def adam_arguments(optimizer: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The param groups of ``optimizer``, a ``torch.optim.Adam`` or ``AdamW`` that has not
    stepped, and the constructor's ``lr``, ``betas``, ``eps`` and ``weight_decay`` (its
    defaults), for a onebit optimizer that honours both.

    Each group keeps its parameters, its four hyperparameters, and any key of the script's own
    (``"name"``, say); torch's implementation choices (``fused``, ``foreach``, ``capturable``)
    are dropped.

    Raises:
        TypeError: for an optimizer that is not a torch Adam or AdamW.
        ValueError: for what onebit cannot honour, naming it: ``amsgrad``, ``maximize``,
            ``differentiable``, ``torch.optim.Adam``'s L2 ``weight_decay`` (onebit's decay is
            decoupled, as AdamW's), or an optimizer that has already stepped (its moments would
            be lost).
    """
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            "from_optimizer takes a torch.optim.AdamW or torch.optim.Adam, got "
            f"{type(optimizer).__name__}"
        )
    name = type(optimizer).__name__
    if any(optimizer.state.values()):
        raise ValueError(
            f"the {name} has already stepped, and its moments would be lost: build the onebit "
            "optimizer from it before training"
        )
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        refused = [why for key, why in _REFUSED.items() if group.get(key)]
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay")
        if group["weight_decay"] and not decoupled:
            refused.append(
                "torch.optim.Adam's weight_decay, an L2 term in the gradient (onebit's decay is "
                "decoupled, as AdamW's: use torch.optim.AdamW)"
            )
        if refused:
            raise ValueError(
                f"param group {i} of the {name} asks for what onebit cannot honour: "
                + "; ".join(refused)
            )
        own = {k: v for k, v in group.items() if k not in optimizer.defaults and k != "params"}
        hyper = {k: _plain(group[k]) for k in HYPERPARAMETERS}
        groups.append({"params": list(group["params"]), **hyper, **own})
    defaults = {k: _plain(optimizer.defaults[k]) for k in HYPERPARAMETERS}
    return groups, defaults


def _plain(value: Any) -> Any:
    """A hyperparameter as a number: torch lets ``lr`` and ``betas`` be tensors."""
    if torch.is_tensor(value):
        return value.item()
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value
