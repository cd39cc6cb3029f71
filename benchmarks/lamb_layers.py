"""Where 1-bit LAMB's steps part from LAMB's, layer by layer.

    python benchmarks/lamb_layers.py --data DIR --compare lamb,onebit-lamb:warmup=fp32:freeze=45 \
        --out runs/lamb-layers

takes ``onebit train``'s options (model, data, steps, seed, ``--compare``) and runs each row's
training loop as ``onebit train`` does, on its workers, with the same samples. After every step
rank 0 records, for each parameter ("layer") ``l``:

* ``rel``: the step's length against LAMB's unclipped one, ``||Δp_l|| / (lr · ||p_l||)``. Plain
  LAMB moves every layer by ``lr · ||p_l||`` unless its trust ratio is clipped, so this is 1
  there; in 1-bit LAMB it is ``coeff · ||u_l|| / ||p_l||`` with the update ``u_l`` it applied;
* ``coeff``: the trust ratio the step used (:meth:`~onebit.OnebitLamb.get_lamb_coeffs`);

and after 1-bit LAMB's freeze, from its state:

* ``frozen`` and ``factor``: the two parts of ``coeff`` (the warmup's averaged trust ratio and
  the fresh-variance factor), and ``scaling``, the momentum scaling coefficient;
* ``lamb``: the trust ratio LAMB would take from the same momentum with the fresh variance,
  ``clip(||p|| / ||m̂ / (sqrt(v̂_fresh) + eps) + wd·p||)``, and ``rel_lamb``, the relative step that
  would give: what the frozen ratio and the factor stand in for;
* ``denom_max``, ``denom_med`` and ``denom_norm``: the frozen denominator against the fresh one
  over the layer, as the largest and the median elementwise ratio, and as the ratio of the norms
  of the adaptive update ``||m̂ / frozen|| / ||m̂ / fresh||``: the first is what the factor
  follows, the last what would make the adaptive part as long as LAMB's.

It writes ``OUT/layers.json`` (every record) and ``OUT/layers.md`` (per layer, the means over
the steps after the freeze, and the validation losses).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from onebit.train import cli, optim
from onebit.train.data import get_batch, read_split
from onebit.train.launch import run_ranks
from onebit.train.loop import RunConfig, _eval_set, evaluate, lr_at
from onebit.train.model import build_model


def _layer_names(model: torch.nn.Module, params: list[torch.Tensor]) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in params]


def _compression_stats(opt: Any, groups: list[dict]) -> dict[str, list[float]]:
    """The per-layer quantities of a 1-bit LAMB step after the freeze (see the module's text)."""
    state = opt.state_dict()
    extra, t = state["onebit"], state["onebit"]["num_steps"]
    beta1, beta2 = groups[0]["betas"]
    eps = groups[0]["eps"]
    bc1 = 1 - beta1**t if opt.bias_correction else 1.0
    bc2 = 1 - beta2**t if opt.bias_correction else 1.0
    out: dict[str, list[float]] = {k: [] for k in ("lamb", "rel_lamb", "denom_max", "denom_med")}
    out["denom_norm"] = []
    for i, (p, group) in enumerate((p, g) for g in groups for p in g["params"]):
        s = state["state"][i]
        m, frozen = s["exp_avg"].float(), s["frozen_denom"].float()
        fresh = (s["exp_avg_sq_fresh"].float() / bc2).sqrt() + eps
        adaptive_fresh = (m / bc1) / fresh
        u_fresh = adaptive_fresh + group["weight_decay"] * p
        w, u = p.norm().item(), u_fresh.norm().item()
        coeff = min(max(w / u, opt.min_coeff), opt.max_coeff) if w > 0 and u > 0 else 1.0
        out["lamb"].append(coeff)
        out["rel_lamb"].append(coeff * u / w if w > 0 else math.nan)
        ratio = (frozen / fresh).flatten()
        out["denom_max"].append(ratio.max().item())
        out["denom_med"].append(ratio.median().item())
        adaptive_frozen = ((m / bc1) / frozen).norm().item()
        out["denom_norm"].append(adaptive_frozen / max(adaptive_fresh.norm().item(), 1e-30))
    out["frozen"] = extra["frozen_coeffs"].tolist()
    out["factor"] = extra["last_factors"].tolist()
    out["scaling"] = extra["scaling_coeffs"].tolist()
    return out


def worker(rank: int, world_size: int, config: RunConfig) -> dict[str, Any] | None:
    """One row's run on this rank; rank 0 returns its records."""
    train_data = read_split(Path(config.data), "train")
    eval_x, eval_y = _eval_set(read_split(Path(config.data), "val"), config)
    torch.manual_seed(config.seed)
    model = build_model(config.model_config())
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + rank)
    groups = model.param_groups(config.weight_decay)
    trainer = optim.build(
        config.optimizer,
        model,
        groups,
        lr=config.lr,
        freeze_step=config.freeze_step,
        steps=config.horizon(),
        bucket_size=config.bucket_size,
        warmup_compression=config.warmup_compression,
    )
    opt = trainer.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    records, losses = [], {}
    for step in range(1, config.steps + 1):
        lr = lr_at(step, config)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_data, config.batch_size, config.block_size, config.model, generator)
        _, loss = trainer.model(x, y)
        before = [p.detach().clone() for p in params] if rank == 0 else []
        trainer.step(loss)
        stage = trainer.stage()
        if rank == 0:
            weights = [b.norm().item() for b in before]
            moved = [(p.detach() - b).norm().item() for p, b in zip(params, before)]
            record: dict[str, Any] = {
                "step": step,
                "stage": stage,
                "lr": lr,
                "rel": [d / (lr * w) if w > 0 else math.nan for d, w in zip(moved, weights)],
                "coeff": opt.get_lamb_coeffs() if hasattr(opt, "get_lamb_coeffs") else None,
            }
            if stage == "compression":
                record.update(_compression_stats(opt, opt.param_groups))
            records.append(record)
        if step % config.eval_every == 0 or step == config.steps:
            losses[step] = evaluate(model, eval_x, eval_y, config.batch_size, torch.device("cpu"))
    dist.barrier()
    if rank != 0:
        return None
    return {
        "label": config.label,
        "layers": _layer_names(model, params),
        "numels": [p.numel() for p in params],
        "records": records,
        "val": losses,
    }


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan


def summarize(runs: list[dict[str, Any]]) -> str:
    """Per layer, the means over the compression stage of each 1-bit row (and the same steps of
    the uncompressed rows), and the validation losses."""
    lines = ["# 1-bit LAMB against LAMB, layer by layer", ""]
    finals = {run["label"]: run["val"][max(run["val"])] for run in runs}
    lines += ["| run | final val loss |", "| --- | ---: |"]
    lines += [f"| {label} | {loss:.4f} |" for label, loss in finals.items()]
    reference = next((r for r in runs if r["label"] == "lamb"), None)
    for run in runs:
        after = [r for r in run["records"] if r["stage"] == "compression"]
        if not after:
            continue
        steps = {r["step"] for r in after}
        ref = [r for r in reference["records"] if r["step"] in steps] if reference else []
        keys = ("rel", "coeff", "frozen", "factor", "lamb", "rel_lamb")
        keys += ("denom_max", "denom_med", "denom_norm", "scaling")
        header = ["layer", "numel"] + (["LAMB rel", "LAMB coeff"] if ref else []) + list(keys)
        lines += ["", f"## {run['label']}: steps {min(steps)}-{max(steps)}, means", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for i, (name, numel) in enumerate(zip(run["layers"], run["numels"])):
            row = [name, str(numel)]
            if ref:
                row += [f"{_mean([r[k][i] for r in ref]):.3g}" for k in ("rel", "coeff")]
            row += [f"{_mean([r[k][i] for r in after]):.3g}" for k in keys]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = cli.build_parser("lamb_layers.py")
    args = parser.parse_args(argv)
    plan = cli.resolve(args, torchrun=False, warn=lambda m: print(m, file=sys.stderr))
    others = [c.label for c in plan.configs if c.optimizer not in ("lamb", "onebit-lamb")]
    if others:
        parser.error(f"LAMB rows only (lamb, onebit-lamb), not {others}")
    out = Path(plan.configs[0].out)
    out = out.parent if args.compare else out  # --compare: a folder per row, inside --out
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for config in plan.configs:
        print(f"{config.label} ...", flush=True)
        ranks = run_ranks(worker, plan.workers, config, timeout=3600, collective_timeout=600)
        runs.append(ranks[0])
        (out / "layers.json").write_text(json.dumps(runs))
    text = summarize(runs)
    (out / "layers.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
