"""The data side of a rollback: where a loop is in its data, and how Keel moves it.

A rollback restores the newest good checkpoint and then skips the batches read since it (or reads them
again, with recovery.skip_data off). Keel asks a loop's data for five things only, `DataPosition`: the
index of the next batch, a jump forward, a jump back, and a state to save in checkpoints and load. Keel's
own sampler (keel.trainer.data.loader.BatchSampler) has them; `ResumableBatchSampler` gives them to a
`torch.utils.data.DataLoader` (as its `batch_sampler`) or to a loop that indexes its own dataset.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class DataPosition(Protocol):
    """A loop's position in its data, in batches. A batch's content must be a function of its index (and
    a seed), so that reading batch i again gives the same batch and a run can skip exactly a window."""

    batch_index: int  # the next batch to be read

    def skip_to(self, batch_index: int) -> None:
        """Moves on to `batch_index` without reading the batches before it (stepping over bad data)."""

    def rewind_to(self, batch_index: int) -> None:
        """Reads again from `batch_index`, an index already read."""

    def state_dict(self) -> dict:
        """A JSON-able state (it goes into the checkpoint's manifest), holding `batch_index`."""

    def load_state_dict(self, state: dict) -> None: ...


# Above this many samples an epoch's permutation (8 bytes a sample, on every rank) is not built: each batch
# is drawn with replacement from a generator seeded by (seed, batch index), as Keel's own sampler draws windows.
SHUFFLE_LIMIT = 1 << 24


class ResumableBatchSampler:
    """Batches of dataset indices for one rank, drawn from a seeded shuffle of each epoch: batch i is the
    i-th `global_batch_size` indices of epoch i // batches_per_epoch's permutation, and each of the `world`
    ranks takes its own rows of it, so the union over ranks is the same batch at any world size. Above
    SHUFFLE_LIMIT samples a batch is drawn with replacement from a generator seeded by (seed, i).

    Use it as a DataLoader's `batch_sampler` with `num_workers=0` (the loader then asks for each batch when
    the loop does, so a rollback's jump takes effect at the next batch), or call `next_indices()` yourself.
    `skip_ranges` {first: end} never reads batches [first, end): how a reference run skips what another
    run's rollback skipped (`data.skip_batches`)."""

    def __init__(self, num_samples: int, global_batch_size: int, rank: int = 0, world: int = 1, seed: int = 0):
        if global_batch_size < 1 or global_batch_size % world:
            raise ValueError(f"global_batch_size={global_batch_size}: must be a positive multiple of the world size {world}")
        if num_samples < global_batch_size:
            raise ValueError(f"num_samples={num_samples}: fewer than one global batch of {global_batch_size}")
        self.num_samples, self.global_batch_size, self.rank, self.world, self.seed = num_samples, global_batch_size, rank, world, seed
        self.batches_per_epoch = num_samples // global_batch_size
        self.batch_index = 0
        self.skip_ranges: dict[int, int] = {}
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def next_indices(self) -> list[int]:
        """This rank's dataset indices of the next batch; moves on by one batch."""
        while self.batch_index in self.skip_ranges:
            self.batch_index = self.skip_ranges[self.batch_index]
        local = self.global_batch_size // self.world
        if self.num_samples > SHUFFLE_LIMIT:
            batch = np.random.default_rng([self.seed, self.batch_index]).integers(0, self.num_samples, self.global_batch_size)
            first = self.rank * local
        else:
            epoch, within = divmod(self.batch_index, self.batches_per_epoch)
            if epoch != self._epoch:
                self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            batch, first = self._order, within * self.global_batch_size + self.rank * local
        self.batch_index += 1
        return batch[first : first + local].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:  # as many batches as the loop takes: the loop's step count ends it
            yield self.next_indices()

    def __len__(self) -> int:
        return self.batches_per_epoch

    def skip_to(self, batch_index: int) -> None:
        self.batch_index = batch_index

    def rewind_to(self, batch_index: int) -> None:
        self.batch_index = batch_index

    def state_dict(self) -> dict:
        return {"seed": self.seed, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict) -> None:
        # The seed travels with the position: the same batch_index under another seed is other data.
        self.seed, self.batch_index = int(state["seed"]), int(state["batch_index"])
