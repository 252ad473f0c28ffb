"""The parallel layout: the device mesh, tensor/sequence parallelism, FSDP2 over dp, pipeline stages and their
schedule, activation checkpointing and torch.compile per block, and the process group under them. May import
keel.trainer's config and model, and keel.monitor; never the loop, the launcher, data or checkpoints."""
