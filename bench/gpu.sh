#!/usr/bin/env bash
# Keel's checks that need a GPU; run it whenever one is at hand (one NVIDIA H100 or H200 is the target):
#
#   bash bench/gpu.sh [OUT_DIR]            # default: gpu-results/
#   bash bench/gpu.sh --cpu-smoke          # the same pipeline on the CPU with the tiny preset, to check the script
#
# 1. The 1b preset (Llama 3.2 1B shapes) in bf16 on one GPU, eager and compiled (training.compile), each
#    with activation checkpointing none / selective / full: tokens/s, MFU against the GPU's data-sheet
#    peak, peak memory, from each run's store. Target: MFU >= 50% for the compiled run without
#    checkpointing (MegaScale reports 55% at 12k GPUs).
# 2. A real CUDA out-of-memory (`oom@step=5,real=1`: an allocation of twice the GPU's memory), which the
#    trainer must recover from by halving the micro-batch, with the loss unchanged.
# 3. `keel preflight` on the GPU: CUDA's free memory against the memory estimate, NCCL's bus bandwidth.
#
# Each step prints what it ran; the summary table is OUT_DIR/summary.txt.
set -euo pipefail

if [[ "${1:-}" == "--cpu-smoke" ]]; then
  SMOKE=1; OUT=${2:-gpu-smoke}; CONFIG=tiny; STEPS=8; DTYPE=fp32; OOM_FAULT="oom@step=5,rows=1"
else
  SMOKE=0; OUT=${1:-gpu-results}; CONFIG=1b; STEPS=40; DTYPE=bf16; OOM_FAULT="oom@step=5,real=1"
  python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'bench/gpu.sh: no CUDA device; use --cpu-smoke to check the script')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
mkdir -p "$OUT"
COMMON=(--monitor.wandb=false --monitor.prometheus=false --checkpoint.interval_steps=0 --checkpoint.interval_minutes=0)

for compile in false true; do
  for ac in none selective full; do
    echo "== $CONFIG, $DTYPE, compile $compile, activation checkpointing $ac"
    rm -rf "$OUT/train-$compile-$ac"
    keel train --config "$CONFIG" --pp 1 --dp 1 --tp 1 --steps "$STEPS" --training.dtype="$DTYPE" \
      --training.compile="$compile" --training.activation_checkpointing="$ac" --run-dir "$OUT/train-$compile-$ac" "${COMMON[@]}"
  done
done

echo "== a real out-of-memory at step 5, recovered by halving the micro-batch"
rm -rf "$OUT/oom" "$OUT/oom-reference"
keel train --config tiny --steps 10 --run-dir "$OUT/oom-reference" "${COMMON[@]}"
keel train --config tiny --steps 10 --run-dir "$OUT/oom" --fault "$OOM_FAULT" "${COMMON[@]}"

echo "== preflight on this machine"
keel preflight --config "$CONFIG" --pp 1 --dp 1 --tp 1 --training.dtype="$DTYPE" --run-dir "$OUT/preflight" || true

python - "$OUT" "$SMOKE" <<'EOF' | tee "$OUT/summary.txt"
import sys
from pathlib import Path

from keel.monitor.store import read_events, read_meta, read_steps

out, smoke = Path(sys.argv[1]), sys.argv[2] == "1"
print(f"{'compile':<8} {'activation checkpointing':<25} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9}  target")
for compile in ("false", "true"):
    for ac in ("none", "selective", "full"):
        steps = read_steps(out / f"train-{compile}-{ac}", effective=True)
        steady = steps[steps.step > 5]  # past compilation, the first allocations and the allocator's warm-up
        mfu = steady.mfu.median()
        if smoke or (compile, ac) != ("true", "none"):
            verdict = ""
        else:
            verdict = "MFU >= 50%: " + ("met" if mfu >= 0.5 else "NOT met")
        print(f"{compile:<8} {ac:<25} {steady.tokens_per_s.median():>10,.0f} {mfu:>7.1%} {steps.mem_peak_bytes.max() / 2**30:>9.2f}  {verdict}")
print("MFU basis:", read_meta(out / "train-false-none").get("mfu_basis"))
oom, ref = read_steps(out / "oom", effective=True), read_steps(out / "oom-reference", effective=True)
events = read_events(out / "oom")
recovered = (events.kind == "oom").sum()
worst = ((oom.loss - ref.loss).abs() / ref.loss).max()
print(f"real OOM: {recovered} recovered, {len(oom)} steps, largest loss difference from the run without it {worst:.2e}")
EOF
echo "summary: $OUT/summary.txt"
