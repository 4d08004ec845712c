"""Bytes on disk: atomic commits, byte ranges and the kernel copy. Stdlib only."""
