"""Hugging Face ``Trainer`` with FSDP2 inside a node and 1-bit Adam across nodes (hybrid
sharding).

    torchrun --nproc-per-node 4 examples/hf_trainer_hsdp.py   # 2 emulated nodes of 2

``onebit.integrations.transformers.shard_hsdp`` shards the model with FSDP2 over the ranks of
each node and returns the process group across nodes, which the optimizer averages each rank's
shard over: in int4 until Adam's variance settles (by a fifth of the run), then in 1 bit.
``TrainingArguments`` has no ``fsdp``: the model is already sharded. ``OnebitCallback`` keeps
Trainer from wrapping it in DDP, and makes Trainer's checkpoints hold every rank's state: the
run ends with a checkpoint in ``--out``, which ``trainer.train(resume_from_checkpoint=...)``
resumes exactly."""

import tempfile
from pathlib import Path

from common import arguments, close_process_group, gpu_per_rank, report, text_data, tiny_gpt2
from transformers import Trainer, TrainingArguments

import onebit
from onebit.integrations.transformers import OnebitCallback, create_optimizer, shard_hsdp

parser = arguments(__doc__.splitlines()[0])
parser.add_argument("--shard", type=int, default=2, help="ranks per node (FSDP2 shards over them)")
parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "onebit-hf-trainer-hsdp"))
args = parser.parse_args()

training_args = TrainingArguments(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=args.batch_size,
    per_device_eval_batch_size=32,
    learning_rate=args.lr,
    lr_scheduler_type="constant",
    max_grad_norm=1.0,  # clipped by the optimizer, across ranks
    logging_steps=20,
    save_strategy="steps",
    save_steps=args.steps,  # one checkpoint, at the end
    report_to="none",
    use_cpu=not gpu_per_rank(),
    seed=0,
    disable_tqdm=True,
)
model = tiny_gpt2()
replicas = shard_hsdp(model, model.transformer.h, training_args, shards=args.shard)
optimizer = create_optimizer(
    model, training_args, onebit.OnebitAdam, total_steps=args.steps, process_group=replicas
)
train, val = text_data()
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=train,
    eval_dataset=val,
    optimizers=(optimizer, None),
)
trainer.add_callback(OnebitCallback(trainer))
trainer.train()

report(optimizer, trainer.evaluate()["eval_loss"])
close_process_group()
