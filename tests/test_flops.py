"""The FLOPs behind MFU come from the model Keel builds: every preset's parameter count, taken from the
modules themselves (built on the meta device, so 405B costs nothing), equals the analytic count, and
flops_per_token is 6 x the matmul parameters + attention's 12·layers·dim·seq (PaLM, appendix B). The
matmul parameters are all but the embedding lookup, with the head counted once more when it is tied to
the embedding (the same matrix, used as a matmul)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from keel.trainer.flops import device_peak_flops, gpu_peak_flops
from keel.trainer.model import Transformer
from keel.trainer.model_args import MODEL_PRESETS, count_params, flops_per_token
from keel.trainer.planning.gpus import GPUS

SEQ_LEN = 2048


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_flops_per_token_counts_the_built_models_parameters(preset, tied):
    args = replace(MODEL_PRESETS[preset], tie_embeddings=tied)
    with torch.device("meta"):
        model = Transformer(args)
    built = sum(p.numel() for p in model.parameters())  # a tied matrix once
    lookup = model.tok_embeddings.weight.numel()  # an embedding is a lookup, not a matmul
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    assert count_params(args) == (built, lookup)
    head = model.output.weight.numel() if tied else 0  # a tied head is a matmul too, but not a parameter of its own
    assert flops_per_token(args, SEQ_LEN) == 6 * (built - lookup + head) + 12 * args.n_layers * args.dim * SEQ_LEN


def test_a_configured_peak_replaces_the_calibration_and_the_table():
    """metrics.peak_tflops: MFU comparable across CPU runs (whose calibration varies with load), or a GPU the table lacks."""
    assert device_peak_flops(torch.device("cpu"), 0.05) == (5e10, "metrics.peak_tflops=0.05")
    peak, basis = device_peak_flops(torch.device("cpu"))
    assert peak > 0 and basis.startswith("cpu matmul calibration")


@pytest.mark.parametrize(
    ("device_name", "kind"),
    [("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA L4", "L4"), ("NVIDIA A100-SXM4-40GB", "A100")],
)
def test_a_gpu_is_found_by_the_exact_name_its_driver_reports(device_name, kind):
    peak, basis = gpu_peak_flops(device_name)
    assert peak == GPUS[kind].peak_bf16_flops and basis.startswith(f"table: {kind} ")


def test_an_unknown_gpu_gets_no_mfu_rather_than_a_neighbours_peak():
    """An L40 once matched "L4" by substring and got 121 TFLOPS (its own is about 181): now no name matches
    by a part of it, and an unknown GPU reports no MFU, with one line that names the setting that fixes it."""
    peak, basis = gpu_peak_flops("NVIDIA L40")
    assert math.isnan(peak)
    assert basis.startswith("GPU 'NVIDIA L40': unknown; known kinds: H200, ") and "set metrics.peak_tflops" in basis
