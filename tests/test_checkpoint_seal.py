"""A checkpoint is sealed only when every shard its DCP metadata names is in its folder."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from keel.trainer.checkpoint.checkpointer import missing_shards


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process on purpose
def test_a_save_missing_a_shard_is_found_before_it_is_sealed(tmp_path):
    dcp.save({"w": torch.arange(8.0)}, checkpoint_id=tmp_path, no_dist=True)  # one process: one shard
    [shard] = [p for p in tmp_path.iterdir() if p.suffix == ".distcp"]
    assert missing_shards(tmp_path) == []
    shard.unlink()  # as when a rank wrote its shard into another run directory
    assert missing_shards(tmp_path) == [shard.name]
