"""Checkpoint folders: sharded Hugging Face, DCP, DeepSpeed, every rank's files, and the
assembly of tensors from chunks."""
