"""A Hugging Face Accelerate training loop with 1-bit Adam instead of AdamW.

    torchrun --nproc-per-node 2 examples/accelerate_loop.py
    python examples/accelerate_loop.py        # one process: trains, sends nothing

Two changes to an Accelerate script: build ``onebit.OnebitAdam`` (after ``Accelerator()``,
which sets up ``torch.distributed``) with ``max_grad_norm`` in place of
``accelerator.clip_grad_norm_``, which would clip each rank's local gradient; and call
``onebit.integrations.accelerate.prepare(accelerator, model, optimizer, ...)`` instead of
``accelerator.prepare(model, optimizer, ...)``, which also hands the gradient communication of
the DDP model Accelerate builds to the optimizer. ``accelerator.backward``,
``--mixed-precision bf16`` and ``save_state``/``load_state`` work as usual.
"""

import torch
from accelerate import Accelerator
from common import (
    arguments,
    close_process_group,
    evaluate,
    gpu_per_rank,
    log_step,
    report,
    text_data,
    tiny_gpt2,
)

import onebit
from onebit.integrations.accelerate import prepare

parser = arguments(__doc__.splitlines()[0])
parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
args = parser.parse_args()

accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=not gpu_per_rank())
model = tiny_gpt2()
optimizer = onebit.OnebitAdam(
    model.parameters(),
    lr=args.lr,
    total_steps=args.steps,
    max_grad_norm=1.0,
)
train, val = text_data()
loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True)
model, optimizer, loader = prepare(accelerator, model, optimizer, loader)

step = 0
while step < args.steps:
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % 20 == 0 or step == 1:
            log_step(step, loss.item(), optimizer)
        if step == args.steps:
            break

# Every rank holds the same parameters: 1-bit Adam applies the same averaged update everywhere.
report(optimizer, evaluate(accelerator.unwrap_model(model), val, device=accelerator.device))
accelerator.end_training()
close_process_group()
