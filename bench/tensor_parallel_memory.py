"""What sequence parallelism and the loss parallel save and cost under tensor parallelism
(parallel.sequence_parallel, parallel.loss_parallel): two processes (gloo, one thread each) run a model of
4 layers, dim 512, with a 32,000-token vocabulary on 4 sequences of 1,024 tokens at tp2, in fp32 on the CPU,
and report per rank

- activation memory: the process's peak resident memory during a forward and backward, less its
  resident memory just before (weights, gradients and optimizer state allocated by a first step),
  measured by the kernel (getrusage) from outside Keel's code; the larger of the two ranks;
- step time: the forward and backward's wall time, median of 3, the slower rank.

The model is Keel's (keel.trainer.model), split by Keel's tensor-parallel plan
(keel.trainer.parallel.parallelize.apply_tensor_parallel), the loss Keel's (parallel.loss_fn under torch's
loss_parallel where it is on). Each measurement is a fresh pair of processes (a peak is per process),
the modes interleaved ABBA over the rounds, beside preflight's estimate (keel.trainer.planning.memory_model.
activation_bytes). Target: each lever keeps less than the mode before it.

    python bench/tensor_parallel_memory.py --rounds 2
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from memory_table import main, measure_steps

MODES = {"tp2": (False, False), "tp2+sequence": (True, False), "tp2+sequence+loss": (True, True)}
SHAPE = {"dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 1536, "max_seq_len": 1024, "vocab_size": 32000}
BATCH, SEQ, TP = 4, 1024, 2


def measure(mode: str) -> dict:
    """In this rank's process: (activation bytes, median step seconds) of `mode`."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from keel.trainer.model import Transformer
    from keel.trainer.model_args import ModelArgs, padded_vocab_size
    from keel.trainer.parallel.parallelize import apply_tensor_parallel, loss_fn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    sequence, loss_split = MODES[mode]
    args = ModelArgs(**SHAPE)
    model = Transformer(args, padded_vocab=padded_vocab_size(args.vocab_size, TP))
    model.init_weights(0)
    apply_tensor_parallel(model, init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",)), sequence, loss_split)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        dist.barrier()
        with loss_parallel() if loss_split else contextlib.nullcontext():
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        assert isinstance(loss, DTensor) == loss_split

    measured = measure_steps(step, optimizer)
    dist.destroy_process_group()
    return measured


def run_pair(mode: str) -> dict:
    """Both ranks of one measurement, fresh processes; the larger activations and the slower step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(TP), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, __file__, "--child", mode], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
        for r in range(TP)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode:
            raise SystemExit(f"{mode}: a rank failed (exit {proc.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {"activation_bytes": max(r["activation_bytes"] for r in results), "step_s": max(r["step_s"] for r in results)}


def estimate(mode: str) -> int:
    from keel.trainer.config import load_config
    from keel.trainer.planning.memory_model import activation_bytes

    sequence, loss_split = MODES[mode]
    overrides = {f"model.{k}": v for k, v in SHAPE.items() if k != "max_seq_len"} | {
        "data.seq_len": SEQ, "training.global_batch_size": BATCH, "training.microbatches": 1, "parallel.tp": TP,
        "parallel.pp": 1, "parallel.dp": 1, "parallel.sequence_parallel": sequence, "parallel.loss_parallel": loss_split}  # fmt: skip
    return activation_bytes(load_config("tiny", overrides))


if __name__ == "__main__":
    main(__doc__, MODES, measure, run_pair, estimate)
