"""The training data: token files and their sidecars, Megatron-LM's indexed datasets, tokenizers, `keel
prepare-data`, and the sampler that draws batches. No torch: `keel train` validates a job's data, and
`keel prepare-data` writes it, without importing it. May import keel.trainer.config and keel.monitor."""
