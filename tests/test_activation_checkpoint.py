"""Activation checkpointing (training.activation_checkpointing) recomputes instead of keeping: the
numbers must not change. Here in one process, the three modes trained side by side; tests/test_parity.py
runs the layouts compiled with `full`. What it saves is measured in bench/activation_memory.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keel.trainer.config import ConfigError, load_config
from keel.trainer.model import Transformer
from keel.trainer.model_args import ModelArgs
from keel.trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from keel.trainer.parallel.compile_blocks import apply_checkpointing_and_compile
from keel.trainer.planning.memory_model import activation_bytes

ARGS = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=64)


def _train(mode: str, steps: int = 3) -> tuple[list[float], list[torch.Tensor], int]:
    """(losses, the last step's gradients, how many times a block's feed-forward ran) of `steps` AdamW
    steps on one fixed batch."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights(0)
    apply_activation_checkpointing(model, mode)
    runs, feed_forward = [], model.layers["1"].feed_forward
    forward = feed_forward.forward
    feed_forward.forward = lambda x: runs.append(1) or forward(x)  # counted in the call itself: recomputation runs no hooks
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, ARGS.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters()], len(runs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_changes_no_number(mode):
    losses, grads, runs = _train("none")
    checkpointed_losses, checkpointed_grads, recomputed_runs = _train(mode)
    assert (runs, recomputed_runs) == (3, 6)  # the backward ran each block's forward again
    assert checkpointed_losses == losses  # bit for bit: the same ops, recomputed in the same order
    for g, h in zip(grads, checkpointed_grads):
        assert torch.equal(g, h)


@pytest.mark.slow
@pytest.mark.parametrize(("checkpointing", "compile"), [("full", False), ("selective", True), ("full", True)])
def test_checkpointing_and_compile_keep_every_parameter_name(checkpointing, compile):
    """Names seed the initial weights and key the checkpoints: a wrapper module (checkpoint_wrapper's, or
    torch.compile's OptimizedModule) would change them."""
    plain, changed = Transformer(ARGS), Transformer(ARGS)
    apply_checkpointing_and_compile(changed, checkpointing, compile)
    assert [n for n, _ in changed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(changed.state_dict()) == list(plain.state_dict())


def test_preflight_counts_less_activation_memory_for_more_recomputation():
    kept = {
        mode: activation_bytes(load_config("small", {"training.activation_checkpointing": mode})) for mode in ("none", "selective", "full")
    }
    assert kept["none"] > kept["selective"] > kept["full"] > 0


def test_preflight_counts_the_activations_sequence_and_loss_parallelism_split():
    def estimate(**par) -> int:
        # pp1: the rank with the logits is the busiest (under a pipeline the first stage is, and holds none).
        layout = {"parallel.tp": 2, "parallel.pp": 1, **{f"parallel.{k}": v for k, v in par.items()}}
        return activation_bytes(load_config("small", layout))

    plain, sequence, both = estimate(), estimate(sequence_parallel=True), estimate(sequence_parallel=True, loss_parallel=True)
    assert plain > sequence > both > 0
    # At tp 1 there is nothing to split: the levers change nothing.
    tp1 = {"parallel.tp": 1, "parallel.pp": 1}
    levers = {"parallel.sequence_parallel": True, "parallel.loss_parallel": True}
    assert activation_bytes(load_config("small", tp1 | levers)) == activation_bytes(load_config("small", tp1))


def test_an_unknown_mode_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", {"training.activation_checkpointing": "some"})
    message = str(e.value)
    assert "training.activation_checkpointing" in message and "selective" in message and "\n" not in message
