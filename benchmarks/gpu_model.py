"""Model the step time of data-parallel training on GPUs over a network, AdamW + DDP against
onebit's 1-bit Adam, from a measured step compute and the wire bytes.

    python benchmarks/gpu_model.py                        # the H100 figures
    python benchmarks/gpu_model.py --onebit-step-ms 9.9   # a compression step of 1.5x AdamW

One GPU per node, ``n`` nodes, a link of ``bw`` bit/s per node and a latency ``alpha`` per
message, with the alpha-beta pieces of ``scaling.py``. Per step, with ``F`` forward + backward,
``B`` backward alone (``2/3 F``), ``d`` parameters:

* AdamW + DDP: ``F + max(0, R - B) + A``. ``R`` is DDP's ring allreduces of fp32 gradients in
  its 25 MiB buckets (``scaling.ring``: ``2 (n-1)/n · 4d`` bytes sent, ``2 (n-1)`` messages per
  bucket), which DDP overlaps with backward (as much as all of it: generous to DDP); ``A`` is
  ``AdamW(fused=True)``'s step.
* onebit, compression stage: ``F + S + W``. ``W`` is the 1-bit exchange in onebit's default
  buckets (``scaling.onebit``: an all-to-all of signs, then an all-gather, SPEC 2, ``2 (n-1)/n
  · d/8`` bytes and the scales; each phase one collective for all buckets, as a step sends
  them, or one per bucket, as onebit did before), not overlapped (``overlap_backward=False``,
  the default); ``S`` is the compression step's compute.
* onebit, fp32 warmup: ``F + R + S_w``, the fp32 allreduce not overlapped, ``S_w`` its step.
* A whole run spends ``--warmup`` of its steps in the warmup.

Bandwidth is the one number that matters: the model ignores stragglers, congestion and the
allreduce's own kernels, and treats every message as sent at the link's full rate.
"""

from __future__ import annotations

import argparse

from scaling import ddp_buckets, onebit, ring


def step_times(args: argparse.Namespace, nodes: int, gbit: float, onebit_ms: float,
               warmup_ms: float, per_bucket: bool = False) -> dict[str, float]:  # fmt: skip
    """Modeled step times in ms: AdamW + DDP, onebit's compression step and warmup step, and
    the whole run (``per_bucket``: the 1-bit phases one collective per bucket)."""
    beta, alpha, d = gbit * 1e9 / 8, args.alpha_us * 1e-6, int(args.params)  # bytes/s
    fwd_bwd, backward = args.forward_backward_ms / 1e3, args.forward_backward_ms / 1e3 * 2 / 3
    fp32 = ring(4 * d, nodes, ddp_buckets(4 * d), alpha, beta)[0]
    one_bit = onebit(d, nodes, alpha, beta, per_bucket=per_bucket)[0]
    ddp = fwd_bwd + max(0.0, fp32 - backward) + args.adamw_ms / 1e3
    compression = fwd_bwd + onebit_ms / 1e3 + one_bit
    warmup = fwd_bwd + fp32 + warmup_ms / 1e3
    run = args.warmup * warmup + (1 - args.warmup) * compression
    return {
        k: 1e3 * v
        for k, v in {"ddp": ddp, "compression": compression, "warmup": warmup, "run": run}.items()
    }


def break_even_gbit(args: argparse.Namespace, nodes: int, onebit_ms: float,
                    warmup_ms: float, per_bucket: bool = False) -> float | None:  # fmt: skip
    """The bandwidth above which the whole run is faster with AdamW + DDP (bisection in log
    space; ``None`` if onebit wins everywhere from 1 to 10,000 Gbit/s)."""
    lo, hi = 1.0, 10_000.0

    def gain(gbit: float) -> float:
        t = step_times(args, nodes, gbit, onebit_ms, warmup_ms, per_bucket)
        return t["ddp"] - t["run"]

    if gain(hi) > 0:
        return None
    if gain(lo) < 0:
        return lo
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=355e6, help="model parameters")
    parser.add_argument(
        "--forward-backward-ms",
        type=float,
        default=124.0,
        help="GPT-2 medium, bf16, batch 8x1024 on an H100",
    )
    parser.add_argument("--adamw-ms", type=float, default=6.6, help="AdamW(fused=True) step")
    parser.add_argument(
        "--before-step-ms",
        type=float,
        default=300.0,
        help="onebit's compression step before the Triton kernels (H100)",
    )
    parser.add_argument(
        "--before-warmup-ms",
        type=float,
        default=6.8 * 6.6,
        help="onebit's fp32 warmup step before the Triton kernels (6.8x AdamW)",
    )
    parser.add_argument(
        "--onebit-step-ms",
        type=float,
        default=1.5 * 6.6,
        help="onebit's compression step after (default: the 1.5x target)",
    )
    parser.add_argument(
        "--onebit-warmup-ms",
        type=float,
        default=1.5 * 6.6,
        help="onebit's fp32 warmup step after (default: the 1.5x target)",
    )
    parser.add_argument("--alpha-us", type=float, default=50.0, help="latency per message")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of steps in warmup")
    parser.add_argument("--nodes", default="8,64")
    parser.add_argument("--gbits", default="10,25,100")
    args = parser.parse_args()
    cases = {"before": (args.before_step_ms, args.before_warmup_ms, True),
             "after, 1-bit phases per bucket": (args.onebit_step_ms, args.onebit_warmup_ms, True),
             "after": (args.onebit_step_ms, args.onebit_warmup_ms, False)}  # fmt: skip
    print(f"{args.params / 1e6:.0f}M parameters, forward+backward {args.forward_backward_ms} ms, "
          f"AdamW step {args.adamw_ms} ms, {args.warmup:.0%} of the run in an fp32 warmup, "
          f"latency {args.alpha_us} us per message")  # fmt: skip
    for name, (step_ms, warmup_ms, per_bucket) in cases.items():
        sends = "a collective per bucket" if per_bucket else "one collective per phase"
        print(f"\n{name}: onebit compression step {step_ms:.1f} ms, warmup step {warmup_ms:.1f} "
              f"ms, 1-bit phases in {sends}")  # fmt: skip
        print(
            "| nodes | Gbit/s | AdamW + DDP ms | onebit 1-bit step ms | speedup | "
            "whole run ms | whole-run speedup |"
        )
        print("|---|---|---|---|---|---|---|")
        for nodes in map(int, args.nodes.split(",")):
            for gbit in map(float, args.gbits.split(",")):
                t = step_times(args, nodes, gbit, step_ms, warmup_ms, per_bucket)
                print(f"| {nodes} | {gbit:g} | {t['ddp']:.0f} | {t['compression']:.0f} | "
                      f"{t['ddp'] / t['compression']:.2f}x | {t['run']:.0f} | "
                      f"{t['ddp'] / t['run']:.2f}x |")  # fmt: skip
            even = break_even_gbit(args, nodes, step_ms, warmup_ms, per_bucket)
            where = "never, up to 10 Tbit/s" if even is None else f"above {even:.0f} Gbit/s"
            print(f"| {nodes} | AdamW + DDP is faster {where} | | | | | |")


if __name__ == "__main__":
    main()
