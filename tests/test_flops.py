"""The FLOPs behind MFU come from the model Keel builds: every preset's parameter count, taken from the
modules themselves (built on the meta device, so 405B costs nothing), equals the analytic count, and
flops_per_token is 6 x the matmul parameters + attention's 12·layers·dim·seq (PaLM, appendix B)."""

from __future__ import annotations

import pytest
import torch

from keel.trainer.flops import device_peak_flops
from keel.trainer.model import Transformer
from keel.trainer.model_args import MODEL_PRESETS, count_params, flops_per_token

SEQ_LEN = 2048


@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_flops_per_token_counts_the_built_models_parameters(preset):
    args = MODEL_PRESETS[preset]
    with torch.device("meta"):
        model = Transformer(args)
    built = sum(p.numel() for p in model.parameters())
    lookup = model.tok_embeddings.weight.numel()  # an embedding is a lookup, not a matmul
    assert count_params(args) == (built, lookup)
    assert flops_per_token(args, SEQ_LEN) == 6 * (built - lookup) + 12 * args.n_layers * args.dim * SEQ_LEN


def test_a_configured_peak_replaces_the_calibration_and_the_table():
    """metrics.peak_tflops: MFU comparable across CPU runs (whose calibration varies with load), or a GPU the table lacks."""
    assert device_peak_flops(torch.device("cpu"), 0.05) == (5e10, "metrics.peak_tflops=0.05")
    peak, basis = device_peak_flops(torch.device("cpu"))
    assert peak > 0 and basis.startswith("cpu matmul calibration")
