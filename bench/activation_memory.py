"""What activation checkpointing saves and costs (training.activation_checkpointing): one process trains
a model of 4 layers, dim 256, on 4 sequences of 512 tokens, in fp32 on the CPU, and reports

- activation memory: the process's peak resident memory during a forward and backward, less its
  resident memory just before (model, gradients and optimizer state already allocated by a first step),
  measured by the kernel (getrusage) from outside the trainer's code;
- step time: the forward and backward's wall time, median of 3.

Each measurement is a fresh process (a peak is per process), the modes interleaved ABBA over the rounds,
beside preflight's estimate of the activations (keel.trainer.planning.memory_model.activation_bytes, the same
formulas). Target: each mode keeps less than the one before it (none > selective > full), full at most
half of none.

    python bench/activation_memory.py --rounds 2
"""

from __future__ import annotations

import json
import subprocess
import sys

from memory_table import main, measure_steps

MODES = ["none", "selective", "full"]
SHAPE = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 768, "max_seq_len": 512}
BATCH, SEQ = 4, 512


def measure(mode: str) -> dict:
    """In this process: (activation bytes, median step seconds) of `mode`."""
    import torch
    import torch.nn.functional as F

    from keel.trainer.model import Transformer
    from keel.trainer.model_args import ModelArgs
    from keel.trainer.parallel.activation_checkpoint import apply_activation_checkpointing

    torch.set_num_threads(1)
    model = Transformer(ModelArgs(**SHAPE))
    model.init_weights(0)
    apply_activation_checkpointing(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()

    return measure_steps(step, optimizer)


def estimate(mode: str) -> int:
    from keel.trainer.config import load_config
    from keel.trainer.planning.memory_model import activation_bytes

    overrides = {f"model.{k}": v for k, v in SHAPE.items() if k != "max_seq_len"} | {
        "data.seq_len": SEQ, "training.global_batch_size": BATCH, "training.microbatches": 1, "training.activation_checkpointing": mode}  # fmt: skip
    return activation_bytes(load_config("tiny", overrides))


def _full_at_most_half(mode: str, medians: dict) -> str:
    return f"; <= none/2: {'met' if medians['full'] <= medians['none'] / 2 else 'MISSED'}" if mode == "full" else ""


def _child(mode: str) -> str:
    out = subprocess.run([sys.executable, __file__, "--child", mode], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


if __name__ == "__main__":
    main(__doc__, MODES, measure, lambda mode: json.loads(_child(mode)), estimate, _full_at_most_half)
