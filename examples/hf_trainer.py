"""Hugging Face ``Trainer`` with 1-bit Adam instead of its AdamW.

    torchrun --nproc-per-node 2 examples/hf_trainer.py
    python examples/hf_trainer.py              # one process: trains, sends nothing

Two changes to a Trainer script: build the optimizer with
``onebit.integrations.transformers.create_optimizer`` (it reads ``learning_rate``, the Adam
betas and eps, ``weight_decay`` and ``max_grad_norm`` from the ``TrainingArguments``) and pass it
as ``optimizers=(optimizer, None)``; then add ``OnebitCallback(trainer)``, which hands the
gradient communication of the DDP model Trainer builds, and its clipping, to the optimizer.
Schedulers, ``--bf16``, logging and checkpoints work as usual: the run ends with a checkpoint in
``--out``, which ``trainer.train(resume_from_checkpoint=...)`` resumes on every rank exactly.
"""

import tempfile
from pathlib import Path

from common import arguments, close_process_group, gpu_per_rank, report, text_data, tiny_gpt2
from transformers import Trainer, TrainingArguments

import onebit
from onebit.integrations.transformers import OnebitCallback, create_optimizer

parser = arguments(__doc__.splitlines()[0])
parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "onebit-hf-trainer"))
parser.add_argument("--bf16", action="store_true", help="bf16 autocast (CPU or GPU)")
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
    bf16=args.bf16,
    seed=0,
    disable_tqdm=True,
    ddp_find_unused_parameters=False,
)
model = tiny_gpt2()
optimizer = create_optimizer(model, training_args, onebit.OnebitAdam, total_steps=args.steps)
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
