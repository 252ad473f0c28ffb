"""bf16 mixed precision as large runs do it: FSDP2's MixedPrecisionPolicy runs the forward and backward in
bf16 and reduces gradients in fp32, while the master weights and AdamW's moments stay fp32. On CPU too
(its bf16 matmuls round as a GPU's do), 50 steps follow the fp32 run within a stated tolerance."""

from __future__ import annotations

import pytest
import torch
from conftest import train
from torch.distributed.checkpoint import FileSystemReader

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

# Relative, at every step. bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3); over these 50
# steps the loss differed by at most 2.4e-3 at dp2, and by 3.9e-3 at dp2·tp2 with sequence and loss
# parallelism (measured on 2026-12-02).
TOLERANCE = 1e-2
# fp32 layouts agree to about 1e-7 (tests/test_parity.py): a run within this of fp32 did not compute in bf16.
FP32_AGREEMENT = 1e-5


def test_bf16_follows_fp32_over_50_steps_with_fp32_master_weights_and_optimizer_state(tmp_path):
    fp32 = train(tmp_path / "fp32", "--config", "tiny", "--steps", "50")
    bf16_dir = tmp_path / "bf16"
    bf16 = train(bf16_dir, "--config", "tiny", "--steps", "50", "--dp", "2", "--training.dtype=bf16")
    assert list(bf16.step) == list(fp32.step) == list(range(1, 51))
    relative = ((bf16.loss - fp32.loss).abs() / fp32.loss).max()
    assert FP32_AGREEMENT < relative < TOLERANCE, relative
    # What the run keeps between steps is fp32: the checkpoint's weights and AdamW's two moments.
    newest = max((bf16_dir / "checkpoints").glob("step-*"))
    entries = FileSystemReader(str(newest)).read_metadata().state_dict_metadata
    kept = {key: entry.properties.dtype for key, entry in entries.items() if key.startswith(("model.", "optim.state.")) and not key.endswith(".step")}  # fmt: skip
    assert len(kept) > 20 and set(kept.values()) == {torch.float32}, {k: v for k, v in kept.items() if v != torch.float32}
