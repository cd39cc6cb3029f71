"""What the examples share: a tiny byte-level GPT-2, training text that ships with Python, and
the closing report of the loss and the bytes 1-bit Adam saved.

The scripts run as ``torchrun ... examples/<name>.py``, which puts ``examples/`` on ``sys.path``,
so they ``from common import ...``.
"""

import argparse
import difflib
import os
import textwrap
from pathlib import Path

import torch

# Destroy the process group and let gloo's threads finish before exit (pytorch/pytorch#179291).
from onebit.train.launch import close_process_group as close_process_group

# Nothing here needs the network: keep Hugging Face and Weights & Biases offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Share the cores between the ranks on this machine instead of oversubscribing them.
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

BLOCK = 64  # bytes per example, the model's context


def arguments(description, steps=100, lr=3e-3, batch_size=8):
    """The command line every example takes; each adds its own options to the parser."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps,
                        help="optimizer steps (the optimizer's total_steps)")  # fmt: skip
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--batch-size", type=int, default=batch_size, help="per rank")
    return parser


def tiny_gpt2(seed=0):
    """A 2-layer byte-level GPT-2 (0.12M parameters), built from a config: no download.

    Dropout is off: a model this small trained for a hundred steps underfits, so dropout would
    only slow it down and add noise to the loss the examples print."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)  # the same weights on every rank (the optimizer broadcasts anyway)
    config = GPT2Config(
        vocab_size=256, n_positions=BLOCK, n_layer=2, n_embd=64, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # what transformers picks for GPT-2 anyway, minus a warning
    return model


def text_data(val_fraction=0.1):
    """The source of three stdlib modules as ``BLOCK``-byte causal-LM examples
    ``{"input_ids": t, "labels": t}``: (train, validation), the last tenth held out."""
    text = b"".join(Path(m.__file__).read_bytes() for m in (difflib, textwrap, argparse))
    data = torch.tensor(list(text), dtype=torch.long)
    windows = data[: len(data) // BLOCK * BLOCK].view(-1, BLOCK)
    split = int(len(windows) * (1 - val_fraction))
    examples = [{"input_ids": w, "labels": w} for w in windows]
    return examples[:split], examples[split:]


@torch.no_grad()
def evaluate(model, examples, batch_size=32, device="cpu"):
    """Mean loss of ``model`` (not DDP-wrapped) over ``examples``."""
    model.eval()
    losses = []
    for i in range(0, len(examples), batch_size):
        ids = torch.stack([e["input_ids"] for e in examples[i : i + batch_size]]).to(device)
        losses.append(model(input_ids=ids, labels=ids).loss.item())
    model.train()
    return sum(losses) / len(losses)


def gpu_per_rank():
    """Whether every local rank gets a GPU of its own. One GPU cannot hold two NCCL ranks, so
    with fewer GPUs than ranks (``torchrun --nproc-per-node 2`` on one GPU) the examples train
    on the CPU over gloo; ``CUDA_VISIBLE_DEVICES=`` does the same anywhere."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    usable = torch.cuda.is_available() and torch.cuda.device_count() >= ranks
    if torch.cuda.is_available() and not usable and is_rank0():
        print(f"{torch.cuda.device_count()} GPU(s) for {ranks} ranks: training on the CPU")
    return usable


def is_rank0():
    return int(os.environ.get("RANK", 0)) == 0


def log_step(step, loss, optimizer):
    """One progress line, on rank 0: the loss, the optimizer's stage and what this step sent."""
    stats = getattr(optimizer, "optimizer", optimizer).comm_stats  # Accelerate wraps it
    if is_rank0():
        print(f"step {step:4d} | loss {loss:.3f} | {stats.last_step_stage:11s} | "
              f"sent {stats.last_step_bytes / 1e3:.1f} kB")  # fmt: skip


def report(optimizer, final_loss):
    """Print, on rank 0, the final validation loss and the bytes this rank sent, against what
    an fp32 allreduce every step would have sent (``comm_stats.fp32_bytes_total``)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps it
    stats = optimizer.comm_stats
    if not is_rank0():
        return
    head = f"final validation loss {final_loss:.3f}"
    if not stats.bytes_total:
        print(f"{head} | one process sends nothing: run it with torchrun, 2+ ranks", end="")
        print(f" | optimizer state on {optimizer.device}")
        return
    steps, warmup = sum(stats.steps.values()), stats.steps.get("warmup", 0)
    fp32_step = stats.fp32_bytes_total / steps
    line = (
        f"{head} | sent {stats.bytes_total / 1e6:.2f} MB, an fp32 allreduce every step would "
        f"send {stats.fp32_bytes_total / 1e6:.2f} MB: {stats.fewer_bytes:.1f}x fewer bytes"
    )
    if steps > warmup:
        compressed_step = (stats.bytes_total - stats.total_bytes["warmup"]) / (steps - warmup)
        line += f" ({fp32_step / compressed_step:.0f}x fewer per step after warmup)"
    print(f"{line} | optimizer state on {optimizer.device}")


def accelerator_with_hsdp(replicas, shards):
    """``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
    parallelism_config=ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=shards))``.

    Accelerate runs FSDP2 only on GPUs. Without a GPU per rank this builds a CPU ``Accelerator``
    and sets it on Accelerate's FSDP2 path by hand, so that the example runs anywhere."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    config = ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=shards)
    if gpu_per_rank():
        return Accelerator(fsdp_plugin=plugin, parallelism_config=config)
    accelerator = Accelerator(cpu=True)
    for state in (PartialState(), accelerator.state):
        state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.build_device_mesh("cpu")
    return accelerator
