"""A Hugging Face `Trainer` (a 2-layer GPT-2 on bytes, AdamW, warm-up and cosine, gradient clipping, a
checkpoint every 10 steps) with Keel. The lines Keel adds end in `# keel`: 2 of them.

    python examples/hf_trainer.py --max-steps 60                                   # CPU is enough
    KEEL_ARGS="--run-dir runs/hf --fault spike@step=30,steps=3,lr=100,data=0 --spike.warmup_steps=10" python examples/hf_trainer.py
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py               # DDP: every rank runs the callback

Keel records every step (`keel dashboard runs`), skips a step whose gradient is not finite on any rank,
and stops training cleanly on a confirmed loss spike, naming the checkpoint to resume from
(docs/any-loop.md, "Hugging Face Trainer").
"""

from __future__ import annotations

import argparse

import torch
from plain_loop import BLOCK, corpus  # the plain loop's data, beside this file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from keel.trainer.toolkit.hf import KeelCallback  # keel


class ByteBlocks(torch.utils.data.Dataset):
    """plain_loop's corpus (Python's standard library as bytes) in blocks of BLOCK tokens."""

    def __init__(self):
        self.data = corpus()

    def __len__(self) -> int:
        return len(self.data) // BLOCK

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.data[i * BLOCK : (i + 1) * BLOCK]
        return {"input_ids": block, "labels": block}  # the model shifts the labels itself


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step and rank")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--output-dir", default="runs/hf-trainer", help="the Trainer's checkpoints")
    ap.add_argument("--resume-from-checkpoint", default=None, help="a checkpoint-N folder the Trainer saved")
    ap.add_argument("--data-seed", type=int, default=None, help="the sample order (default: --seed's)")
    args = ap.parse_args()
    set_seed(1337)
    config = GPT2Config(vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        weight_decay=0.1,
        warmup_steps=10,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=1,
        save_steps=10,
        data_seed=args.data_seed,
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),  # on CPU under torchrun the Trainer uses DDP (gloo) only with it
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(model=model, args=training, train_dataset=ByteBlocks(), callbacks=[KeelCallback()])  # keel
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)


if __name__ == "__main__":
    main()
