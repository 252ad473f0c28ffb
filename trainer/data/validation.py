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

from keel.trainer.config import ConfigError, JobConfig
from keel.trainer.data.blend import DataBlend
from keel.trainer.data.documents import eod_to_mask, mask_after_eod
from keel.trainer.data.loader import open_tokens


def held_out(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(the training tokens, the held-out tokens): the last `fraction` of `tokens`, views of the same array."""
    cut = len(tokens) - int(len(tokens) * fraction)
    return tokens[:cut], tokens[cut:]


def split_for_validation(
    cfg: JobConfig, data: DataBlend, vocab_size: int, dp_rank: int = 0, dp_size: int = 1
) -> tuple[list[np.ndarray], ValidationBatches | None]:
    """(each source's tokens training reads, the validation batches or None when eval.every is 0). The launcher
    calls it once before any worker starts, so that validation data that cannot serve is refused there."""
    # data.val_fraction holds out the end of data.source; a blend has no one end (DataConfig refuses the two together).
    first, *others = data.tokens
    training, held = held_out(first, cfg.data.val_fraction)
    if not cfg.eval.every:
        return [training, *others], None
    if cfg.eval.source:
        tokens, name = _open_eval_source(cfg, vocab_size), f"eval.source={cfg.eval.source}"
    else:
        tokens, name = held, f"the held-out data.val_fraction={cfg.data.val_fraction} of data.source"
    rows = (cfg.training.global_batch_size, dp_rank, dp_size)
    # The validation loss leaves out what the training loss does (data.mask_eod).
    batches = ValidationBatches(tokens, cfg.data.seq_len, *rows, cfg.eval.batches, vocab_size, name, eod_to_mask(cfg, data))
    return [training, *others], batches


def _open_eval_source(cfg: JobConfig, vocab_size: int) -> np.ndarray:
    named = f"data.source={cfg.eval.source}"
    try:
        return open_tokens(cfg.eval.source, cfg.data.seq_len, vocab_size).tokens
    except ConfigError as e:  # open_tokens names the field it is usually given as; here it is eval.source
        raise ConfigError(str(e).replace(named, f"eval.source={cfg.eval.source}", 1)) from None


class ValidationBatches:
    """`n_batches` global batches of consecutive windows of `tokens` (seq_len + 1 tokens each, one token shared
    with the next window, as the training targets are the inputs shifted by one). Refuses, naming the fields
    to change, validation data too short for them or holding an id outside the model's vocabulary. With
    `eod_id`, the targets after it are IGNORE_INDEX (keel.trainer.data.documents)."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        n_batches: int,
        vocab_size: int,
        name: str,
        eod_id: int | None = None,
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
        self.eod_id = eod_id  # targets after this id are left out of the loss (data.mask_eod)
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
        inputs = rows[:, :-1]
        return inputs, mask_after_eod(inputs, rows[:, 1:], self.eod_id)
