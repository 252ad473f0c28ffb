"""Checkpoints: DCP sharded saves in the background, made atomic and verifiable by a manifest, and whether a
resume may load one. May import keel.trainer's config and model, the parallel layout, and keel.monitor."""
