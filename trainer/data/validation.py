"""The validation data: tokens training never reads, cut into the same batches at every evaluation.

`held_out(tokens, fraction)` splits a source's token array in place (no copy): the training part first and
the last `fraction` of the tokens held out, as nanoGPT keeps train.bin and val.bin apart, but from one
file. The split point depends on the source and data.val_fraction only, never on whether evaluation is on,
so a run trains on the same data with evaluation on or off.

`ValidationBatches` reads the validation tokens as consecutive windows from their start, the same global
batches every time, each dp rank its own rows: an evaluation's loss then moves only with the model, not
with a draw of data, and needs no RNG (training's RNG and data position are never touched).
"""

from __future__ import annotations

import numpy as np

from keel.trainer.config import ConfigError


def held_out(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(the training tokens, the held-out tokens): the last `fraction` of `tokens`, views of the same array."""
    cut = len(tokens) - int(len(tokens) * fraction)
    return tokens[:cut], tokens[cut:]


class ValidationBatches:
    """`n_batches` global batches of consecutive windows of `tokens` (seq_len + 1 tokens each, one token shared
    with the next window, as the training targets are the inputs shifted by one). Refuses, naming the fields
    to change, validation data too short for them or holding an id outside the model's vocabulary."""

    def __init__(
        self, tokens: np.ndarray, seq_len: int, global_batch_size: int, dp_rank: int, dp_size: int, n_batches: int, vocab_size: int, name: str
    ):
        windows = n_batches * global_batch_size
        needed = windows * seq_len + 1
        if len(tokens) < needed:
            raise ConfigError(
                f"eval.batches={n_batches}: {n_batches} batches of {global_batch_size} sequences of {seq_len} tokens need {needed:,} validation tokens "
                f"and {name} holds {len(tokens):,}; lower eval.batches, or hold more out (data.val_fraction) or name a larger eval.source"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.rows = slice(dp_rank * global_batch_size // dp_size, (dp_rank + 1) * global_batch_size // dp_size)
        self.n_batches = n_batches
        largest = int(np.asarray(tokens[:needed]).max())
        if largest >= vocab_size:
            raise ConfigError(
                f"eval: {name} holds the token id {largest}, outside the model's vocabulary of {vocab_size}; "
                f"use validation data made with the training data's tokenizer"
            )

    def __len__(self) -> int:
        return self.n_batches

    def batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int64 [global_batch_size // dp_size, seq_len]: this rank's rows of batch `index`."""
        first = index * self.global_batch_size
        starts = (first + np.arange(self.global_batch_size)[self.rows]) * self.seq_len
        rows = np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]).astype(np.int64)
        return rows[:, :-1], rows[:, 1:]
