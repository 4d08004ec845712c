"""Single checkpoint files: torch zip and legacy, safetensors, and every way a loader reads a
file's bytes."""
