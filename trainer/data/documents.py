"""Document-aware training: the loss not asked to predict across a document boundary (data.mask_eod).

Training windows are cut at random offsets of one concatenated token stream, so a window often spans the
end-of-document id and the start of an unrelated document. Predicting that document's first token from the
previous one's text is noise; Megatron-LM's `--eod-mask-loss` drops those positions from the loss
(the loss mask is 0 where the input is the end-of-document id). Keel does the same by setting those targets
to IGNORE_INDEX, which torch's cross_entropy (and its loss-parallel form) leaves out of the mean.

Attention is not cut at document boundaries (Megatron's `--reset-attention-mask`): that needs a
per-document block mask instead of the causal kernel, and its gain on a model of Keel's test sizes would
not show. Off by default, as in Megatron-LM and TorchTitan.
"""

from __future__ import annotations

import numpy as np

from keel.trainer.config import ConfigError, JobConfig
from keel.trainer.data.blend import DataBlend

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


def eod_to_mask(cfg: JobConfig, data: DataBlend) -> int | None:
    """The end-of-document id whose next token is left out of the loss, or None when data.mask_eod is off.
    Refuses data.mask_eod on data that records no end-of-document id (or, a blend, no one id for all sources)."""
    if not cfg.data.mask_eod:
        return None
    if data.eod_id is None:
        named = f"data.sources={cfg.data.sources}" if cfg.data.sources else f"data.source={cfg.data.source}"
        raise ConfigError(
            f"data.mask_eod=true: {named} records no end-of-document id common to its data (only token files of "
            f"`keel prepare-data --tokenizer ...` record one); make the data with a tokenizer, or set --data.mask_eod=false"
        )
    return data.eod_id


def mask_after_eod(inputs: np.ndarray, targets: np.ndarray, eod_id: int | None) -> np.ndarray:
    """`targets` with IGNORE_INDEX where the input is the end-of-document id (a new array); as given when None."""
    if eod_id is None:
        return targets
    return np.where(inputs == eod_id, IGNORE_INDEX, targets)
