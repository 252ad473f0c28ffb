"""Gradient clipping as users set it: a norm to clip to, or 0 for none (Megatron-LM's convention)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import train
from torch import nn

from keel.trainer.optim import clip_grads

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow


def _layer_with_grads(*values: float) -> nn.Linear:
    layer = nn.Linear(len(values), 1, bias=False)
    layer.weight.grad = torch.tensor([values])
    return layer


def test_grad_clip_zero_leaves_the_gradients_as_they_are():
    layer = _layer_with_grads(3.0, 4.0)
    clip_grads([layer], max_norm=0.0, total_norm=5.0)
    assert layer.weight.grad.tolist() == [[3.0, 4.0]]


def test_grad_clip_scales_the_global_norm_down_to_the_limit_and_never_up():
    big, small = _layer_with_grads(3.0, 4.0), _layer_with_grads(0.3, 0.4)
    clip_grads([big], max_norm=1.0, total_norm=5.0)
    clip_grads([small], max_norm=1.0, total_norm=0.5)
    assert big.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    assert small.weight.grad.flatten().tolist() == pytest.approx([0.3, 0.4])


def test_a_run_with_grad_clip_zero_learns(tmp_path):
    # Before the fix every gradient was scaled by 0: the loss stayed at ln 256, the uniform guess.
    steps = train(tmp_path / "run", "--config", "tiny", "--training.steps=40", "--optim.grad_clip=0")
    assert steps.loss.iloc[-1] < math.log(256) - 1.5, steps.loss.tolist()
