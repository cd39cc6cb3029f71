"""Pretrain with torchtitan, FSDP2 inside each node and a onebit optimizer across nodes.

A torchtitan config function returns :class:`OnebitTrainer`'s config in place of ``Trainer``'s,
with a onebit optimizer in place of AdamW; nothing else changes::

    from torchtitan.models.llama3.config_registry import llama3_8b
    from onebit.integrations.torchtitan import onebit_config, onebit_optimizer

    def llama3_8b_onebit():
        optimizer = onebit_optimizer("OnebitAdam", lr=3e-4, freeze_step=200)
        return onebit_config(llama3_8b(), optimizer)

(a config function that builds ``Trainer.Config(...)`` itself builds ``OnebitTrainer.Config(...,
optimizer=onebit_optimizer(...))`` instead). It is launched as torchtitan's own configs are
(``-m torchtitan.train --module my_configs --config llama3_8b_onebit``), with
``--parallelism.data_parallel_replicate_degree`` the nodes and ``data_parallel_shard_degree``
the GPUs of a node.

What :class:`OnebitTrainer` changes in torchtitan's run:

* **Sharding.** FSDP2 shards the model over the ``fsdp`` dimension only, so that it
  reduce-scatters inside a node and sends nothing across nodes; the optimizer averages each local
  shard across the ``dp_replicate`` dimension, in the warmup's compression until the freeze, then
  at 1 bit. (FSDP2's HSDP, on the 2-D mesh, would all-reduce across nodes in fp32 itself, and it
  offers no way to keep its gradients without that all-reduce.) The model's own
  ``parallelize_fn`` runs unchanged, seeing a ``ParallelDims`` without the replicate dimension.
* **Gradient scale.** torchtitan sums gradients and divides the loss by the global token count;
  FSDP2 then scales each node's sum by the number of replicas, so that the optimizer's average
  is torchtitan's sum.
* **Clipping.** ``training.max_norm`` becomes the optimizer's ``max_grad_norm``, which clips the
  replica-averaged gradient (SPEC 6 says what it clips after the freeze); torchtitan's own
  clipping, which would clip each node's gradient before the average, does not run. The
  ``grad_norm`` torchtitan logs is the one onebit clipped with.
* **Checkpoints.** torchtitan's checkpointer saves onebit's whole state: the moments as DTensors
  beside the model's, and each rank's error buffers, counters and schedule as one object of its
  own. A resume on the same layout is bit for bit.
* **Metrics.** Each logged step adds a ``onebit`` line: the stage, the bytes sent across nodes
  and how many times fewer that is than an fp32 all-reduce.

It refuses, on every rank and with an error that says so, what it cannot do: tensor, context,
pipeline or expert parallelism, a single replica, CPU offload, async checkpointing, any
``spmd_backend`` but ``"partial_dtensor"``, a non-onebit optimizer, and a checkpoint written by
another optimizer or on another layout (torchtitan's ``--checkpoint.exclude_from_loading
optimizer`` starts the warmup from such a run's model, data and schedule). torchtitan is
imported only when this module is; it was written for torchtitan 0.3.0 and refuses another
version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import math
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import torch
import torchtitan
import tyro
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.config.configs import ParallelismConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ..fsdp import attach, check_mesh, rank_state
from ..optim.base import CompressedOptimizer
from ..optim.checkpoint import to_cpu
from ..optim.registry import OPTIMIZERS

__all__ = ["OnebitOptimizers", "OnebitTrainer", "onebit_config", "onebit_optimizer"]

TORCHTITAN_VERSIONS = ("0.3.0",)
"""The torchtitan releases this module was written for and tested with."""

if torchtitan.__version__ not in TORCHTITAN_VERSIONS:
    raise ImportError(
        f"onebit.integrations.torchtitan supports torchtitan {', '.join(TORCHTITAN_VERSIONS)}; "
        f"this is torchtitan {torchtitan.__version__}"
    )

_BY_NAME = {entry.cls.__name__: entry.cls for entry in OPTIMIZERS}
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")
_MOMENTS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "frozen_denom": "exp_avg_sq"}
"""Per-parameter state torchtitan's checkpoint holds as DTensors, by the name it has on either
side of the freeze (the frozen denominator lives where the variance did); whatever else a stage
shows is in the rank's own object."""


def onebit_optimizer(
    name: str = "OnebitAdam",
    lr: float = 8e-4,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    **options: Any,
) -> OnebitOptimizers.Config:
    """The optimizer config of a onebit run: one param group of every parameter.

    ``name`` is ``"OnebitAdam"``, ``"ZeroOneAdam"`` or ``"OnebitLamb"``; ``lr``, ``betas``,
    ``eps`` and ``weight_decay`` default to torchtitan's ``default_adamw``. ``options`` are the
    optimizer's keyword arguments (``freeze_step``, ``warmup_compression``, ``error_dtype``,
    ``bucket_size``, ...), as torchtitan passes instance-wide arguments
    (``optimizer_factory_kwargs_by_name``); ``error_dtype`` may be a name (``"bfloat16"``).
    ``max_grad_norm`` is ``training.max_norm``, and ``total_steps`` ``training.steps``, unless
    given here.
    """
    defaults = _configurable_defaults(_optimizer_class(name))
    group = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    return OnebitOptimizers.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=name, optimizer_kwargs=group)],
        optimizer_factory_kwargs_by_name={name: {**defaults, **options}},
    )


_CONFIGURABLE = (
    "freeze_step",
    "var_freeze_step",
    "warmup_compression",
    "error_dtype",
    "bucket_size",
)
"""The options :func:`onebit_optimizer` writes into the config with their defaults, so that the
command line can set them (``--optimizer.optimizer-factory-kwargs-by-name.OnebitAdam.freeze-step
2000``)."""


def _configurable_defaults(cls: type[CompressedOptimizer]) -> dict[str, Any]:
    parameters = inspect.signature(cls).parameters
    defaults = {}
    for name in _CONFIGURABLE:
        default = parameters[name].default if name in parameters else None
        if isinstance(default, torch.dtype):
            default = str(default).removeprefix("torch.")
        if default is not None:
            defaults[name] = default
    return defaults


def _optimizer_class(name: str) -> type[CompressedOptimizer]:
    if name not in _BY_NAME:
        raise ValueError(
            f"optimizer {name!r} is not a onebit optimizer: use one of {', '.join(_BY_NAME)}"
        )
    return _BY_NAME[name]


class OnebitOptimizers(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` for one onebit optimizer over the whole model.

    Built by :class:`OnebitTrainer`, which gives it the replicas' mesh. Its param groups are
    torchtitan's (``param_groups``: a pattern, the optimizer's name and its per-group
    hyperparameters); they must all name the same onebit optimizer, whose other keyword arguments
    come from ``optimizer_factory_kwargs_by_name`` or, the same in every group, from
    ``optimizer_kwargs``. ``implementation`` (torchtitan's fused/foreach choice) does not apply:
    onebit picks its kernels by device.

    Its ``state_dict`` is torchtitan's flat, name-keyed one: each parameter's moments as DTensors,
    and this rank's error buffers, counters and schedule as one object under its own key.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        replicate_mesh: Annotated[Any, tyro.conf.Suppress] = None
        """The ``dp_replicate`` mesh the optimizer averages across: set by
        :class:`OnebitTrainer` once torchtitan has made it."""

        def to_dict(self) -> dict:
            state = OptimizersContainer.Config.to_dict(self)
            state.pop("replicate_mesh", None)
            return state

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        if config.replicate_mesh is None:
            raise ValueError(
                "a onebit optimizer runs under OnebitTrainer, which shards the model for it: "
                "return OnebitTrainer.Config from the config function (onebit_config converts a "
                "Trainer.Config)"
            )
        (model,) = model_parts  # one: OnebitTrainer refuses pipelining
        groups, patterns = self._build_param_groups(model, config.param_groups, {})
        ((name, param_groups),) = groups.items()  # one name: OnebitTrainer checked
        options = dict(config.optimizer_factory_kwargs_by_name.get(name, {}))
        for key, value in _group_options(param_groups).items():
            if options.setdefault(key, value) != value:
                raise ValueError(
                    f"{key} is {value!r} in optimizer_kwargs and {options[key]!r} in "
                    "optimizer_factory_kwargs_by_name: set it once"
                )
        optimizer = _build(name, param_groups, options, config.replicate_mesh)
        attach(model, optimizer)
        self.optimizers = [optimizer]
        self.model_parts = model_parts
        self._log_optimizer(optimizer, 0, patterns[name])
        all_params = [p for group in param_groups for p in group["params"]]
        self._validate_params(all_params)
        self._post_init(all_params)
        self.grad_norm: torch.Tensor | None = None

    @property
    def onebit(self) -> CompressedOptimizer:
        """The onebit optimizer."""
        return self.optimizers[0]

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """The onebit optimizer's step; then :attr:`grad_norm`, if set, holds the norm it
        clipped with (``nan`` without clipping)."""
        result = super().step(closure)
        if self.grad_norm is not None:
            norm = self.onebit.grad_norm
            self.grad_norm.fill_(math.nan if norm is None else norm)
        return result

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's flat state dict: ``state.<name>.exp_avg`` and ``.exp_avg_sq`` (the
        frozen denominator after the freeze) as DTensors, zeros before the first step, and this
        rank's own object (``onebit_rank_<rank>``: what else each parameter's state holds, the
        error buffers, counters, schedule, param groups and the layout)."""
        optimizer = self.onebit
        state = optimizer.state_dict()
        names = _param_names(optimizer)
        flat: dict[str, Any] = {}
        extra: dict[int, dict[str, torch.Tensor]] = {}
        for i, local in enumerate(optimizer.shards.locals()):
            saved = state["state"].get(i, {})
            for name, tensor in saved.items():
                if name in _MOMENTS:
                    flat[f"state.{names[i]}.{_MOMENTS[name]}"] = tensor
                else:
                    extra.setdefault(i, {})[name] = tensor
            for key in set(_MOMENTS.values()) - {_MOMENTS[n] for n in saved if n in _MOMENTS}:
                flat[f"state.{names[i]}.{key}"] = optimizer.shards.wrap(i, torch.zeros_like(local))
        buffer = io.BytesIO()
        torch.save(to_cpu({**rank_state(optimizer, state), "extra": extra}), buffer)
        flat[_rank_key()] = buffer.getvalue()
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved; ``ValueError`` if it was saved on another
        layout (``[replicas, shards]``)."""
        optimizer = self.onebit
        rest = torch.load(io.BytesIO(state_dict[_rank_key()]), weights_only=True)
        check_mesh(
            optimizer,
            rest["mesh"],
            "start a new warmup from the model with --checkpoint.exclude_from_loading optimizer",
        )
        names = _param_names(optimizer)
        state = {
            i: {
                key: (
                    state_dict[f"state.{names[i]}.{_MOMENTS[key]}"]
                    if key in _MOMENTS
                    else rest["extra"][i][key]
                )
                for key in keys
            }
            for i, keys in rest["state_keys"].items()
        }
        optimizer.load_state_dict(
            {"state": state, "param_groups": rest["param_groups"], "onebit": rest["onebit"]}
        )


def _rank_key(rank: int | None = None) -> str:
    """The key of ``rank``'s own state (this rank's by default)."""
    return f"onebit_rank_{torch.distributed.get_rank() if rank is None else rank}"


def _param_names(optimizer: CompressedOptimizer) -> list[str]:
    return [name for group in optimizer.param_groups for name in group["param_names"]]


def _group_options(param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Take the optimizer's keyword arguments out of torchtitan's param groups (which hold
    whatever ``optimizer_kwargs`` had): they must be the same in every group."""
    options: dict[str, Any] = {}
    for group in param_groups:
        group.pop("fused", None)
        group.pop("foreach", None)
        for key in [k for k in group if k not in (*_GROUP_KEYS, "params", "param_names")]:
            value = group.pop(key)
            if options.setdefault(key, value) != value:
                raise ValueError(
                    f"{key} differs between param groups ({options[key]!r}, {value!r}): it is "
                    "the optimizer's, the same for every group"
                )
    return options


def _build(
    name: str, param_groups: list[dict[str, Any]], options: dict[str, Any], mesh: Any
) -> CompressedOptimizer:
    cls = _optimizer_class(name)
    for key, value in options.items():
        if isinstance(value, str) and value.isdigit():  # "auto"'s replacement on the command line
            options[key] = int(value)
    if isinstance(options.get("error_dtype"), str):
        options["error_dtype"] = getattr(torch, options["error_dtype"])
    if "process_group" in options:
        raise ValueError("process_group is the dp_replicate mesh's: do not set it")
    return cls(param_groups, process_group=mesh.get_group(), **options)


class _WithoutReplicas:
    """A ``ParallelDims`` as a model's ``parallelize_fn`` sees it under :class:`OnebitTrainer`:
    without the replicate dimension, so that FSDP2 shards over ``fsdp`` alone."""

    def __init__(self, dims: Any) -> None:
        self._dims = dims

    dp_replicate_enabled = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)


class OnebitTrainer(Trainer):
    """torchtitan's ``Trainer`` with a onebit optimizer averaging across the ``dp_replicate``
    dimension (see the module's docstring for what it changes).

    Its ``Config`` is ``Trainer.Config`` with an :class:`OnebitOptimizers` config as
    ``optimizer`` (1-bit Adam with ``default_adamw``'s hyperparameters by default).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        optimizer: OnebitOptimizers.Config = dataclasses.field(default_factory=onebit_optimizer)
        parallelism: ParallelismConfig = dataclasses.field(
            default_factory=lambda: ParallelismConfig(spmd_backend="partial_dtensor")
        )

    def __init__(self, config: Config) -> None:
        _refuse(config)
        spec = config.model_spec
        config.model_spec = dataclasses.replace(
            spec, parallelize_fn=self._shard_only(spec.parallelize_fn, config)
        )
        self._move_clipping(config)
        super().__init__(config)
        if self.checkpointer.enable:
            self.checkpointer.dcp_load = _loading_onebit_state(self.checkpointer.dcp_load)

    @staticmethod
    def _shard_only(parallelize: Callable[..., Any], config: Config) -> Callable[..., Any]:
        """The model's ``parallelize_fn``, sharding over ``fsdp`` only, with FSDP2 scaling each
        node's gradient sum by the replicas; it hands the optimizer the replicas' mesh."""

        def parallelize_fn(model: torch.nn.Module, *, parallel_dims: Any, **kwargs: Any) -> Any:
            from torch.distributed.fsdp import FSDPModule

            replicas = parallel_dims.dp_replicate
            model = parallelize(model, parallel_dims=_WithoutReplicas(parallel_dims), **kwargs)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0 / replicas)
            config.optimizer.replicate_mesh = parallel_dims.get_mesh("dp_replicate")
            return model

        return parallelize_fn

    @staticmethod
    def _move_clipping(config: Config) -> None:
        """``training.max_norm`` becomes the onebit optimizer's ``max_grad_norm`` (``None`` for
        0 or inf), and ``training.steps`` its ``total_steps`` unless its options set it."""
        max_norm = config.training.max_norm
        clip = max_norm if 0 < max_norm < math.inf else None
        for name in {group.optimizer_name for group in config.optimizer.param_groups}:
            options = config.optimizer.optimizer_factory_kwargs_by_name.setdefault(name, {})
            if options.setdefault("max_grad_norm", clip) != clip:
                raise ValueError(
                    f"max_grad_norm={options['max_grad_norm']} but training.max_norm={max_norm}: "
                    "set training.max_norm alone, which onebit's max_grad_norm takes over"
                )
            options.setdefault("total_steps", config.training.steps)

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        """torchtitan's step, with its gradient clipping handed to the optimizer (which clips
        the replica-averaged gradient) and a ``onebit`` metrics line."""
        with _clipping_by(self.optimizers):
            super().train_step(data_iterator)
        if self.metrics_processor.should_log(self.step):
            self._log_onebit()

    def _log_onebit(self) -> None:
        optimizer = self.optimizers.onebit
        stats = optimizer.comm_stats
        metrics = {
            "onebit/bytes_across_replicas": stats.bytes_total,
            "onebit/fewer_bytes_than_fp32": stats.fewer_bytes,
            "onebit/frozen": float(optimizer.frozen),
        }
        self.metrics_processor.logger.log(metrics, self.step)
        logger.info(
            f"onebit  step: {self.step:2}  stage: {stats.last_step_stage}  sent across replicas: "
            f"{stats.bytes_total / 2**20:.2f} MiB  {stats.fewer_bytes:.1f}x fewer than fp32"
        )


def _loading_onebit_state(dcp_load: Callable[..., None]) -> Callable[..., None]:
    """torchtitan's ``CheckpointManager.dcp_load``, refusing with a clear error, on every rank
    alike, a checkpoint that lacks onebit's state of any rank (another optimizer's, or one saved
    on fewer ranks)."""

    def checked(
        state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        import torch.distributed.checkpoint as dcp

        if "optimizer" in state_dict and not from_hf:
            saved = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
            ranks = range(torch.distributed.get_world_size())
            if any(f"optimizer.{_rank_key(rank)}" not in saved for rank in ranks):
                by_onebit = any(key.startswith("optimizer.onebit_rank_") for key in saved)
                raise ValueError(
                    f"the checkpoint {checkpoint_id} lacks onebit's state of some of these "
                    "ranks: "
                    + (
                        "it was saved on fewer, and each rank's error buffers belong to its "
                        "shard. Resume on the layout it was saved on, or"
                        if by_onebit
                        else "another optimizer (AdamW, say) saved it, and onebit cannot take "
                        "over another optimizer's moments. To start a onebit run from that "
                        "run's model, data and schedule,"
                    )
                    + " add --checkpoint.exclude_from_loading optimizer"
                )
        dcp_load(state_dict, checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)

    return checked


@contextlib.contextmanager
def _clipping_by(optimizers: OnebitOptimizers) -> Iterator[None]:
    """Within the block, torchtitan's ``clip_grad_norm_`` (which ``Trainer.train_step`` calls
    before the optimizer's step, on each node's gradient) clips nothing and returns a tensor that
    the step fills with the norm onebit clipped with. torchtitan 0.3 has no hook for this."""
    clip = dist_utils.clip_grad_norm_

    def handed_over(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        optimizers.grad_norm = torch.full((), math.nan)
        return optimizers.grad_norm

    dist_utils.clip_grad_norm_ = handed_over
    try:
        yield
    finally:
        dist_utils.clip_grad_norm_ = clip


def _refuse(config: Trainer.Config) -> None:
    """``ValueError`` for what the integration cannot do, on every rank before anything runs."""
    p = config.parallelism
    unsupported = {
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
    }
    for name, degree in unsupported.items():
        if degree != 1:
            raise ValueError(
                f"parallelism.{name} = {degree}: onebit's torchtitan integration supports data "
                "parallelism only (data_parallel_replicate_degree nodes x "
                "data_parallel_shard_degree GPUs a node)"
            )
    if p.data_parallel_replicate_degree < 2:
        raise ValueError(
            "parallelism.data_parallel_replicate_degree must be the number of nodes, at least 2: "
            "onebit compresses what crosses between them, and with one there is nothing to send"
        )
    if p.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"parallelism.spmd_backend = {p.spmd_backend!r}: onebit's torchtitan integration "
            "runs on FSDP2's own sharding, --parallelism.spmd_backend partial_dtensor"
        )
    if config.training.enable_cpu_offload:
        raise ValueError("training.enable_cpu_offload is not supported with a onebit optimizer")
    if (
        config.checkpoint.enable
        and getattr(config.checkpoint, "async_mode", "disabled") != "disabled"
    ):
        raise ValueError(
            "checkpoint.async_mode must be 'disabled' with a onebit optimizer: saving its "
            "per-rank state asynchronously is not supported yet"
        )
    if not isinstance(config.optimizer, OnebitOptimizers.Config):
        raise ValueError("OnebitTrainer needs a onebit optimizer: optimizer=onebit_optimizer(...)")
    if config.optimizer.implementation == "fused_opt_states_bf16":
        raise ValueError(
            "optimizer.implementation 'fused_opt_states_bf16' is AdamW's; a onebit optimizer "
            "keeps its moments in fp32 (error_dtype='bfloat16' halves its error buffers)"
        )
    names = sorted({group.optimizer_name for group in config.optimizer.param_groups})
    if len(names) != 1:
        raise ValueError(
            f"every param group must name the same onebit optimizer, not {names}: the "
            "parameters of any other optimizer would not be averaged across replicas"
        )
    _optimizer_class(names[0])


def onebit_config(
    config: Trainer.Config, optimizer: OnebitOptimizers.Config
) -> OnebitTrainer.Config:
    """``config``, a ``Trainer.Config`` (a config function's, say), as :class:`OnebitTrainer`'s
    config with ``optimizer``, on FSDP2's own sharding (``spmd_backend="partial_dtensor"``)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields["parallelism"] = dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor")
    return OnebitTrainer.Config(**{**fields, "optimizer": optimizer})
