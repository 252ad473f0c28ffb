"""Keel for any training loop: the public API a loop Keel did not write uses to get Keel's recording,
rollback with data skip, hang watchdog and chaos drills, and the parts Keel's own trainer is built on.

- `open_run(...)` -> `LoopRun`: a plain PyTorch loop (under torchrun, DDP or FSDP2); see keel.trainer.toolkit.loop.
- `init_distributed()`: the process group from torchrun's (or srun's) variables, restartable (Keel's trainer's own).
- `ResumableBatchSampler`, and the `DataPosition` protocol any data can follow, for the data skip.
- `KeelRun`: the per-rank core both use (keel.trainer.toolkit.run).
- Adapters, each an optional extra: `keel.trainer.toolkit.hf.KeelCallback` (`pip install keel[hf]`) and
  `keel.trainer.toolkit.lightning.KeelLightningCallback` (`pip install keel[lightning]`).

docs/any-loop.md shows each, with the lines a loop adds.
"""

from keel.trainer.parallel.distributed import init_distributed
from keel.trainer.toolkit.data_position import DataPosition, ResumableBatchSampler
from keel.trainer.toolkit.loop import LoopRun, open_run
from keel.trainer.toolkit.run import KeelRun, KeelUsageError

__all__ = ["DataPosition", "KeelRun", "KeelUsageError", "LoopRun", "ResumableBatchSampler", "init_distributed", "open_run"]
