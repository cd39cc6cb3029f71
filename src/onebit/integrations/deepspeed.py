"""Build a onebit optimizer from a DeepSpeed config, for runs of DeepSpeed's 1-bit optimizers.

DeepSpeed deleted ``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb`` in 2026. This module reads
the ``"optimizer"`` section of a DeepSpeed config (and its top-level ``gradient_clipping``) and
builds :class:`~onebit.OnebitAdam`, :class:`~onebit.ZeroOneAdam` or :class:`~onebit.OnebitLamb`
with the arguments that give the same run. It does not import DeepSpeed.

The translations, established from DeepSpeed's optimizer code (``deepspeed/runtime/fp16/onebit``):

* DeepSpeed's first ``step()`` only initialises: it discards that gradient, moves nothing, and
  counts as step 1. Its 1-bit Adam and 1-bit LAMB then freeze at the end of the step where
  ``step >= freeze_step``, which gives ``freeze_step - 1`` warmup steps (and 1 for any
  ``freeze_step <= 1``, since step 1 never checks). onebit's step 1 is DeepSpeed's step 2, so
  DeepSpeed's ``freeze_step: F`` is onebit's ``freeze_step=max(F - 1, 1)``.
* DeepSpeed's 0/1 Adam leaves phase A once ``step > var_freeze_step``, counted the same way, so
  its ``var_freeze_step: V`` is onebit's ``var_freeze_step=max(V, 1)``: the same phase-A steps.
  But it tests ``step % var_interval`` and ``step % local_step_interval`` with that counter, one
  ahead of onebit's, so once an interval reaches 2 its variance updates and syncs fall one step
  off onebit's. No argument shifts that phase: the helper warns when the config gets there.
* None of DeepSpeed's three optimizers bias-corrects, whatever ``bias_correction`` says, so the
  helper passes ``bias_correction=False``. DeepSpeed's constructor defaults are passed for absent
  keys (``freeze_step`` 100000, ``local_step_scaler`` 32678, ...), not onebit's.
* DeepSpeed's 1-bit LAMB compresses the whole model as one buffer, so for it the helper sets
  ``bucket_size`` to cover the model (pass ``bucket_size=`` to choose smaller buckets).
* Param-group ``exp_avg_mask`` tensors (DeepSpeed's momentum masks) become onebit's
  ``exp_avg_mask``; ``non_freeze`` groups (1-bit Adam's uncompressed groups) have no onebit
  equivalent and raise.

Differences no argument removes (documented, not warned): DeepSpeed compresses each parameter
tensor of 1-bit Adam and 0/1 Adam as a buffer of its own, where onebit compresses buckets that
span parameters (each parameter's part with its own scale, by default); it pads a buffer to a
multiple of ``n·lcm(n, 8)`` where onebit pads to ``8n`` (the same when the world size n divides
8); and at world size 1 it does not compress at all (and its 0/1 Adam then skips the momentum
update of its 1-bit steps) where onebit does.

Clipping by ``gradient_clipping`` is DeepSpeed's: its engine clips the averaged gradient on the
steps whose gradients it averages in fp32, and each rank's own gradient on the others, as
onebit's ``max_grad_norm`` does (``docs/SPEC.md`` section 6). Only 1-bit Adam's
``overlap_backward=True``, passed as an override, changes that: it clips the 1-bit steps' result
by the mean of the ranks' norms.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..optim import registry
from ..optim.base import CompressedOptimizer
from ..optim.options import DEFAULT_BUCKET_SIZE, MAX_BUCKET_SIZE
from ..wire.protocol import group_size_and_rank

__all__ = [
    "KEY_MAP",
    "OPTIMIZERS",
    "KeyMapping",
    "Translation",
    "UnsupportedKeyWarning",
    "mapping_table",
    "optimizer_from_config",
    "translate_config",
]

ADAM, ZERO_ONE, LAMB = "OneBitAdam", "ZeroOneAdam", "OneBitLamb"

OPTIMIZERS: dict[str, type[CompressedOptimizer]] = {e.deepspeed: e.cls for e in registry.OPTIMIZERS}
"""DeepSpeed's optimizer ``type`` (matched ignoring case, as DeepSpeed does) -> onebit class."""

_ALL = tuple(OPTIMIZERS)
_FREEZING = tuple(e.deepspeed for e in registry.OPTIMIZERS if e.freezes)
_NAMES = {e.deepspeed: e.title for e in registry.OPTIMIZERS}


class UnsupportedKeyWarning(UserWarning):
    """DeepSpeed config keys that onebit cannot honour as DeepSpeed did: the message lists them,
    says why, and what happens instead."""


class KeyMapping(NamedTuple):
    """How one DeepSpeed config key translates (one row of the table in docs/deepspeed.md)."""

    onebit: str | None
    """The onebit constructor argument it sets; ``None`` where the key is dropped."""
    rule: str
    """How the value translates."""
    optimizers: tuple[str, ...]
    """The DeepSpeed optimizer types whose constructor takes the key."""
    default: Any
    """DeepSpeed's default, used where the key is absent."""
    top_level: bool = False
    """A key of the whole config, not of ``optimizer.params``."""


_SAME = "same value"

KEY_MAP: dict[str, KeyMapping] = {
    "lr": KeyMapping("lr", _SAME, _ALL, 1e-3),
    "betas": KeyMapping("betas", _SAME, _ALL, (0.9, 0.999)),
    "eps": KeyMapping("eps", _SAME, _ALL, 1e-8),
    "weight_decay": KeyMapping(
        "weight_decay",
        "same value; 0/1 Adam: warns (DeepSpeed folds it into the momentum its syncs rebuild)",
        _ALL,
        0.0,
    ),
    "freeze_step": KeyMapping(
        "freeze_step",
        "`F` -> `max(F - 1, 1)` (DeepSpeed's step 1 only initialises), with "
        "`warmup_compression=\"fp32\"`: DeepSpeed's warmup, an uncompressed allreduce (onebit's "
        'defaults are `"auto"` and an int4 warmup)',
        _FREEZING,
        100000,
    ),
    "bias_correction": KeyMapping(
        "bias_correction",
        "always `False`: DeepSpeed accepted it but never bias-corrected",
        _ALL,
        True,
    ),
    "var_freeze_step": KeyMapping(
        "var_freeze_step",
        '`V` -> `max(V, 1)`, with `warmup_compression="fp32"`: DeepSpeed\'s fp32 variance '
        "steps (onebit's default is int4); warns if `V > var_update_scaler` (variance steps one "
        "step apart)",
        (ZERO_ONE,),
        100000,
    ),
    "var_update_scaler": KeyMapping("var_update_scaler", _SAME, (ZERO_ONE,), 16),
    "local_step_scaler": KeyMapping(
        "local_step_scaler", "same value; absent: DeepSpeed's default 32678", (ZERO_ONE,), 32678
    ),
    "local_step_clipper": KeyMapping(
        "local_step_clipper",
        "same value; warns if >= 2 (syncs one step apart after `local_step_scaler` steps)",
        (ZERO_ONE,),
        16,
    ),
    "max_coeff": KeyMapping("max_coeff", _SAME, (LAMB,), 10.0),
    "min_coeff": KeyMapping("min_coeff", _SAME, (LAMB,), 0.01),
    "coeff_beta": KeyMapping("coeff_beta", _SAME, (LAMB,), 0.9),
    "factor_max": KeyMapping("factor_max", _SAME, (LAMB,), 4.0),
    "factor_min": KeyMapping("factor_min", _SAME, (LAMB,), 0.5),
    "factor_threshold": KeyMapping("factor_threshold", _SAME, (LAMB,), 0.1),
    "gradient_clipping": KeyMapping(
        "max_grad_norm",
        "`c > 0` -> `max_grad_norm=c`; as in DeepSpeed, fp32-averaged steps clip the average, "
        "the others each rank's own gradient",
        _ALL,
        0.0,
        top_level=True,
    ),
    "max_grad_norm": KeyMapping(
        None, "dropped with a warning: DeepSpeed never read it (use `gradient_clipping`)", _ALL, 0.0
    ),
    "eps_inside_sqrt": KeyMapping(
        None, "dropped (warns if true): DeepSpeed ignored it; eps is outside the sqrt", _ALL, False
    ),
    "amsgrad": KeyMapping(None, "`true`: `ValueError`, unsupported as in DeepSpeed", _ALL, False),
    "cuda_aware": KeyMapping(
        None, "dropped with a note: onebit uses the process group's backend", _ALL, False
    ),
    "comm_backend_name": KeyMapping(
        None, "dropped with a note: onebit uses the process group's backend", _ALL, "nccl"
    ),
}
"""Every key DeepSpeed's 1-bit optimizers accept (plus the top-level ``gradient_clipping``), in
the order of the table in docs/deepspeed.md. :func:`translate_config` applies it;
:func:`mapping_table` prints it."""

_BLOCK_KEYS = {"type", "params", "legacy_fusion"}


class Translation(NamedTuple):
    """What :func:`translate_config` makes of a DeepSpeed config."""

    optimizer_class: type[CompressedOptimizer]
    kwargs: dict[str, Any]
    """Constructor arguments, besides ``params`` and ``process_group``."""
    notes: list[str]
    """What cannot be honoured, one line per concern; empty when the run is reproduced."""


def mapping_table() -> str:
    """:data:`KEY_MAP` as a markdown table; consecutive keys that map alike share a row."""
    rows: list[tuple[list[str], KeyMapping]] = []
    for key, m in KEY_MAP.items():
        if rows:
            keys, last = rows[-1]
            renamed = m.onebit not in (None, key) or last.onebit not in (None, keys[0])
            if not renamed and m._replace(onebit=None, default=None) == last._replace(
                onebit=None, default=None
            ):
                keys.append(key)
                continue
        rows.append(([key], m))
    lines = [
        "| DeepSpeed key | optimizers | onebit argument | translation |",
        "|---|---|---|---|",
    ]
    for keys, m in rows:
        names = ", ".join(f"`{k}`" for k in keys) + (" (top level)" if m.top_level else "")
        which = "all" if m.optimizers == _ALL else ", ".join(_NAMES[o] for o in m.optimizers)
        target = "—" if m.onebit is None else "same name" if len(keys) > 1 else f"`{m.onebit}`"
        lines.append(f"| {names} | {which} | {target} | {m.rule} |")
    return "\n".join(lines)


def translate_config(ds_config: Mapping[str, Any]) -> Translation:
    """The onebit class, constructor arguments and notes for a DeepSpeed config.

    ``ds_config`` is the whole config (with an ``"optimizer"`` key) or its ``"optimizer"`` block
    (``{"type": ..., "params": {...}}``). Raises ``TypeError`` for values of the wrong type and
    ``ValueError`` for an unknown optimizer type or key, or ``amsgrad: true``. See
    :func:`optimizer_from_config`, which also translates the param groups.
    """
    block, whole = _optimizer_block(ds_config)
    ds_type = _optimizer_type(block.get("type"))
    params = block.get("params")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise TypeError(f"optimizer.params must be a dict, got {type(params).__name__}")
    _check_keys(ds_type, params)

    notes: list[str] = []
    if "legacy_fusion" in block:
        notes.append("optimizer.legacy_fusion: dropped; it only chose DeepSpeed's fp16 wrapper.")
    transport = [k for k in ("cuda_aware", "comm_backend_name") if k in params]
    if transport:
        notes.append(
            f"{', '.join(transport)}: dropped; they chose DeepSpeed's own communication backend. "
            "onebit communicates through the torch.distributed process group, with its backend "
            "(NCCL on GPU, gloo on CPU)."
        )

    values = {}
    for key, m in KEY_MAP.items():
        if ds_type in m.optimizers:
            source = (ds_config if whole else {}) if m.top_level else params
            values[key] = source.get(key, m.default)
    _check_values(values)
    if values["amsgrad"]:
        raise ValueError(
            f"amsgrad: true is not supported: DeepSpeed's {_NAMES[ds_type]} refused it too, and "
            "onebit has no AMSGrad variant. Remove the key or set it to false."
        )

    kwargs: dict[str, Any] = {
        key: values[key] for key, m in KEY_MAP.items() if key in values and m.onebit == key
    }
    kwargs["betas"] = tuple(values["betas"])
    kwargs["bias_correction"] = False
    if values["bias_correction"] and "bias_correction" in params:
        notes.append(
            "bias_correction: true is not honoured: DeepSpeed's 1-bit optimizers accepted it but "
            "never bias-corrected; bias_correction=False reproduces the run (pass "
            "bias_correction=True to get Adam's bias correction instead)."
        )
    if "max_grad_norm" in params:
        notes.append(
            "max_grad_norm: dropped; DeepSpeed's optimizers never read it (its engine rejects the "
            "key: clipping is the top-level gradient_clipping). Pass max_grad_norm=... to clip."
        )
    if values["eps_inside_sqrt"]:
        notes.append(
            "eps_inside_sqrt: true is not honoured: DeepSpeed ignored it as well and added eps "
            "outside the square root, as onebit does."
        )
    clip = values["gradient_clipping"]
    kwargs["max_grad_norm"] = float(clip) if clip > 0 else None

    if ds_type in _FREEZING:  # DeepSpeed's warmup: a fixed length, an fp32 allreduce
        kwargs["freeze_step"] = max(values["freeze_step"] - 1, 1)
        kwargs["warmup_compression"] = "fp32"
    if ds_type == ZERO_ONE:
        kwargs["warmup_compression"] = "fp32"  # DeepSpeed's variance steps: an fp32 allreduce
        _zero_one_notes(values, kwargs, notes)
    if ds_type == LAMB:
        if values["freeze_step"] <= 1:
            notes.append(
                f"freeze_step: {values['freeze_step']} gives one warmup step, as in DeepSpeed, "
                "but DeepSpeed then starts its fresh variance from zero (it copies v into it at "
                "step == freeze_step, which its warmup never reaches); onebit starts it from v."
            )
        if 1.0 in (values["max_coeff"], values["min_coeff"]):
            notes.append(
                "max_coeff/min_coeff: a bound of exactly 1.0 is not reproduced: DeepSpeed leaves "
                "a layer's trust-ratio average untouched on steps whose clipped ratio is exactly "
                "1.0; onebit averages every defined ratio."
            )
    return Translation(OPTIMIZERS[ds_type], kwargs, notes)


def optimizer_from_config(
    params: Iterable[Any],
    ds_config: Mapping[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    **overrides: Any,
) -> CompressedOptimizer:
    """The onebit optimizer that reproduces a DeepSpeed 1-bit optimizer config.

    Args:
        params: parameters or param groups, as you passed them to ``deepspeed.initialize``. A
            group's ``exp_avg_mask`` (DeepSpeed's momentum mask, broadcast to each of the
            group's parameters) becomes onebit's ``exp_avg_mask``. A group with
            ``non_freeze: True`` raises for 1-bit Adam (onebit compresses every parameter;
            remove the key to accept that) and is ignored with a warning for the other two,
            as DeepSpeed ignored it.
        ds_config: the whole DeepSpeed config (a dict with an ``"optimizer"`` key; its
            ``gradient_clipping`` is then used too) or just its ``"optimizer"`` block. Types
            ``"OneBitAdam"``, ``"ZeroOneAdam"`` and ``"OneBitLamb"``, in any case.
        process_group: the data-parallel group (``None``: the default group, or one process
            when ``torch.distributed`` is not initialised).
        **overrides: constructor arguments applied last, over the translated ones
            (``bucket_size``, ``max_grad_norm``, ``freeze_step="auto"``, ...).

    What it maps (:data:`KEY_MAP`, :func:`mapping_table`): ``lr``, ``betas``, ``eps``,
    ``weight_decay`` and the LAMB and 0/1 Adam knobs keep their values; ``freeze_step: F``
    becomes ``freeze_step=max(F - 1, 1)`` because DeepSpeed's first step only initialises,
    with ``warmup_compression="fp32"``, DeepSpeed's uncompressed warmup (onebit's defaults are
    ``"auto"`` and an int4 warmup);
    ``var_freeze_step: V`` becomes ``max(V, 1)``, also with ``warmup_compression="fp32"``;
    ``bias_correction`` is always ``False``,
    since DeepSpeed never bias-corrected; a top-level ``gradient_clipping: c > 0`` becomes
    ``max_grad_norm=c``; absent keys take DeepSpeed's defaults. For 1-bit LAMB, ``bucket_size``
    covers the whole model, as DeepSpeed compressed it as one buffer.

    What it cannot honour, in one :class:`UnsupportedKeyWarning` that says why and what happens
    instead: ``cuda_aware`` and ``comm_backend_name`` (onebit uses the process group's backend),
    ``max_grad_norm`` (DeepSpeed never read it), ``bias_correction: true`` and
    ``eps_inside_sqrt: true`` (DeepSpeed ignored both), 0/1 Adam schedules that reach an
    interval of 2 (DeepSpeed runs them one step out of phase) and 0/1 Adam weight decay (folded
    into DeepSpeed's rebuilt momentum), and two 1-bit LAMB edge cases. Unknown keys, keys of
    another optimizer type and ``amsgrad: true`` raise ``ValueError``. Differences that no key
    controls (per-tensor against per-bucket compression, padding when the world size does not
    divide 8, no compression at world size 1) are listed in this module's docstring.

    Example::

        import json
        from onebit.integrations.deepspeed import optimizer_from_config

        ds_config = json.load(open("ds_config.json"))  # {"optimizer": {"type": "OneBitAdam", ...
        optimizer = optimizer_from_config(model.parameters(), ds_config)
        # then train as with any torch.optim optimizer, without DDP and without DeepSpeed:
        # loss.backward(); optimizer.step(); optimizer.zero_grad()
    """
    optimizer_class, kwargs, notes = translate_config(ds_config)
    ds_type = next(t for t, cls in OPTIMIZERS.items() if cls is optimizer_class)
    groups, masks = _param_groups(params, ds_type, kwargs, notes)
    if masks:
        kwargs["exp_avg_mask"] = masks
    if ds_type == LAMB:
        kwargs["bucket_size"] = _whole_model_bucket(groups, process_group)
    if "max_grad_norm" in overrides:
        notes = [n for n in notes if not n.startswith("max_grad_norm:")]
    if "bias_correction" in overrides:
        notes = [n for n in notes if not n.startswith("bias_correction:")]
    if notes:
        warnings.warn(
            f"onebit cannot reproduce every part of this DeepSpeed {_NAMES[ds_type]} config:\n"
            + "\n".join(f"- {note}" for note in notes),
            UnsupportedKeyWarning,
            stacklevel=2,
        )
    return optimizer_class(groups, process_group=process_group, **{**kwargs, **overrides})


def _optimizer_block(ds_config: Any) -> tuple[Mapping[str, Any], bool]:
    """The ``optimizer`` block, and whether ``ds_config`` was the whole config."""
    if not isinstance(ds_config, Mapping):
        raise TypeError(
            f"ds_config must be a dict (a DeepSpeed config or its 'optimizer' block), "
            f"got {type(ds_config).__name__}"
        )
    whole = "optimizer" in ds_config
    block = ds_config["optimizer"] if whole else ds_config
    if whole and not isinstance(block, Mapping):
        raise TypeError(f"ds_config['optimizer'] must be a dict, got {type(block).__name__}")
    if "type" not in block:
        raise ValueError(
            "ds_config has no optimizer: pass a DeepSpeed config with an 'optimizer' section, or "
            "that section itself ({'type': 'OneBitAdam', 'params': {...}})"
        )
    unknown = sorted(set(block) - _BLOCK_KEYS)
    if unknown:
        raise ValueError(f"unknown keys in the optimizer block: {unknown}")
    return block, whole


def _optimizer_type(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"optimizer type must be a string, got {name!r}")
    for ds_type in OPTIMIZERS:
        if name.lower() == ds_type.lower():
            return ds_type
    raise ValueError(
        f"optimizer type {name!r} is not one of DeepSpeed's 1-bit optimizers "
        f"({', '.join(OPTIMIZERS)}); onebit only replaces those. For DeepSpeed's other "
        "optimizers use torch.optim (Adam, AdamW) with DistributedDataParallel."
    )


def _check_keys(ds_type: str, params: Mapping[str, Any]) -> None:
    """``ValueError`` naming every key the DeepSpeed constructor of ``ds_type`` would reject."""
    problems = []
    for key in params:
        m = KEY_MAP.get(key) if isinstance(key, str) else None
        if m is None or m.top_level:
            problems.append(f"{key!r} (not a DeepSpeed 1-bit optimizer key)")
        elif ds_type not in m.optimizers:
            owners = ", ".join(m.optimizers)
            problems.append(f"{key!r} (a key of {owners}, not of {ds_type})")
    if problems:
        raise ValueError(
            f"unknown keys in the {ds_type} optimizer params: {'; '.join(problems)}. "
            f"{ds_type} accepts: {', '.join(k for k, m in KEY_MAP.items() if _accepts(m, ds_type))}"
        )


def _accepts(m: KeyMapping, ds_type: str) -> bool:
    return ds_type in m.optimizers and not m.top_level


_INTEGER_KEYS = (
    "freeze_step",
    "var_freeze_step",
    "var_update_scaler",
    "local_step_scaler",
    "local_step_clipper",
)
_FLAG_KEYS = ("bias_correction", "eps_inside_sqrt", "amsgrad", "cuda_aware")


def _check_values(values: dict[str, Any]) -> None:
    """``TypeError`` for values of the wrong type; step counts become ints."""
    for key, value in values.items():
        if key in ("betas", "comm_backend_name"):
            continue
        if key in _FLAG_KEYS:
            if not isinstance(value, bool):
                raise TypeError(f"{key} must be true or false, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{key} must be a number, got {value!r}")
        elif key in _INTEGER_KEYS:
            if not float(value).is_integer():
                raise TypeError(f"{key} must be an integer, got {value!r}")
            values[key] = int(value)
    betas = values["betas"]
    if (
        isinstance(betas, (str, bytes))
        or not isinstance(betas, Sequence)
        or len(betas) != 2
        or any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in betas)
    ):
        raise TypeError(f"betas must be a list of two numbers, got {betas!r}")
    if "comm_backend_name" in values and not isinstance(values["comm_backend_name"], str):
        raise TypeError(f"comm_backend_name must be a string, got {values['comm_backend_name']!r}")


def _zero_one_notes(values: dict[str, Any], kwargs: dict[str, Any], notes: list[str]) -> None:
    v = max(values["var_freeze_step"], 1)
    kwargs["var_freeze_step"] = v
    kappa = values["var_update_scaler"]
    if v > kappa:
        notes.append(
            f"var_freeze_step/var_update_scaler: after {kappa} variance updates (step {kappa}) "
            "var_interval doubles to 2, and DeepSpeed tests step % var_interval with a step "
            "counter one ahead of onebit's (its initialisation call counts), so from step "
            f"{kappa + 1} to var_freeze_step ({v}) its fp32 variance steps fall one step off "
            "onebit's. No argument shifts that phase; the runs agree up to that step."
        )
    if values["local_step_clipper"] >= 2:
        scaler = values["local_step_scaler"]
        notes.append(
            f"local_step_scaler/local_step_clipper: {scaler} steps after var_freeze_step "
            f"(from step {v + scaler + 1}) local_step_interval doubles to 2, and with the same "
            "one-step offset DeepSpeed's syncs come one step before onebit's. No argument shifts "
            "that phase; set local_step_clipper=1 to sync every step in both."
        )
    if values["weight_decay"]:
        notes.append(
            "weight_decay: after var_freeze_step DeepSpeed folds wd*p*(sqrt(v)+eps) into the "
            "momentum each sync rebuilds, compounding the decay; onebit applies it as AdamW and "
            "keeps it out of the momentum, so the local-step phases differ."
        )


def _param_groups(
    params: Iterable[Any], ds_type: str, kwargs: dict[str, Any], notes: list[str]
) -> tuple[list[Any], dict[torch.Tensor, torch.Tensor]]:
    """``params`` as a list (groups copied, DeepSpeed-only keys removed) and the momentum masks."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of Tensors or dicts, got a Tensor: pass [tensor] or "
            "model.parameters()"
        )
    items = list(params)
    masks: dict[torch.Tensor, torch.Tensor] = {}
    ignored_non_freeze = False
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            continue
        group = dict(item)
        members = group.get("params", [])
        group["params"] = [members] if isinstance(members, torch.Tensor) else list(members)
        if group.pop("non_freeze", False) is True:
            if ds_type == ADAM:
                raise ValueError(
                    f"param group {i} has non_freeze=True: DeepSpeed's 1-bit Adam kept it "
                    "uncompressed, but onebit compresses every parameter after the freeze and has "
                    "no equivalent. Remove 'non_freeze' to compress this group too."
                )
            ignored_non_freeze = True
        for key in ("bias_correction", "max_grad_norm"):  # DeepSpeed read neither per group
            group.pop(key, None)
        for key in ("max_coeff", "min_coeff"):  # DeepSpeed's 1-bit LAMB read them per group
            if key in group and ds_type == LAMB and group.pop(key) != kwargs[key]:
                raise ValueError(
                    f"param group {i} sets its own {key}; onebit's OnebitLamb has one {key} for "
                    f"all groups ({kwargs[key]} from the config). Use the same value everywhere."
                )
        mask = group.pop("exp_avg_mask", None)
        if mask is not None:
            for p in group["params"]:
                try:
                    masks[p] = mask.to(p.device).expand_as(p)
                except (RuntimeError, AttributeError) as err:
                    raise ValueError(
                        f"param group {i}: exp_avg_mask of shape "
                        f"{tuple(getattr(mask, 'shape', ()))} does not broadcast to a parameter "
                        f"of shape {tuple(p.shape)}"
                    ) from err
        items[i] = group
    if ignored_non_freeze:
        notes.append(
            f"non_freeze: dropped from the param groups; DeepSpeed's {_NAMES[ds_type]} ignored "
            "it too (only its 1-bit Adam kept such groups uncompressed)."
        )
    return items, masks


def _whole_model_bucket(groups: list[Any], process_group: dist.ProcessGroup | None) -> int:
    """A ``bucket_size`` that holds every parameter in one bucket (DeepSpeed's 1-bit LAMB), or
    the largest there is (``MAX_BUCKET_SIZE``, 2**30 elements) for a model larger than that."""
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, Mapping) else [g])]
    numel = sum(p.numel() for p in tensors if isinstance(p, torch.Tensor))
    quantum = 8 * group_size_and_rank(process_group)[0]
    return min(MAX_BUCKET_SIZE, max(DEFAULT_BUCKET_SIZE, math.ceil(numel / quantum) * quantum))
