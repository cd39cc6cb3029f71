"""torchtitan configs that train Llama 3 with 1-bit Adam across nodes and FSDP2 inside each.

torchtitan's own ``llama3_8b`` and ``llama3_debugmodel``, with onebit's trainer and optimizer in
place of AdamW; everything else (data, schedule, checkpoints, activation checkpointing, metrics)
is torchtitan's. Launch as any torchtitan config, with this folder on ``PYTHONPATH``; on 2 nodes
of 8 GPUs each::

    PYTHONPATH=examples/torchtitan torchrun --nnodes 2 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 \\
        -m torchtitan.train --module onebit_llama3 --config llama3_8b_onebit \\
        --parallelism.data_parallel_replicate_degree 2 \\
        --parallelism.data_parallel_shard_degree 8

Command-line overrides work as for any torchtitan config, onebit's options included:
``--optimizer.optimizer-factory-kwargs-by-name.OnebitAdam.freeze-step 200``.
"""

from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel

from onebit.integrations.torchtitan import OnebitTrainer, onebit_config, onebit_optimizer


def llama3_8b_onebit() -> OnebitTrainer.Config:
    """``llama3_8b`` with 1-bit Adam: a warmup of 200 of its 1,000 steps (int4 gradients with
    error feedback), then 1 bit a parameter across nodes each step."""
    optimizer = onebit_optimizer("OnebitAdam", lr=3e-4, freeze_step=200)
    return onebit_config(llama3_8b(), optimizer)


def llama3_debugmodel_onebit() -> OnebitTrainer.Config:
    """torchtitan's debug model with 1-bit Adam, frozen after 4 of its 10 steps."""
    optimizer = onebit_optimizer("OnebitAdam", lr=8e-4, freeze_step=4)
    return onebit_config(llama3_debugmodel(), optimizer)
