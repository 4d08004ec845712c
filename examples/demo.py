"""ckptkit end to end: train with DDP (2 processes), inspect the checkpoint, convert it to
safetensors, and load it into a plain model, with identical outputs.

    python3 examples/demo.py [OUT_DIR]      (default: demo-out/)

Every step runs the real `ckptkit` command in a subprocess and shows what it printed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from ckptkit.engine.demo import BlobData, demo_model


def ckptkit(*args: str) -> None:
    print(f"$ ckptkit {' '.join(args)}", flush=True)
    proc = subprocess.run([sys.executable, "-m", "ckptkit", *args], text=True, capture_output=True)
    print(proc.stderr + proc.stdout, flush=True)  # progress lines first, then the result
    if proc.returncode:
        sys.exit(f"ckptkit exited with {proc.returncode}")


def main(out: Path) -> None:
    run = out / "run"
    shutil.rmtree(run, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)

    # 1. Train the built-in model with DistributedDataParallel: 2 workers, gloo on the CPU.
    ckptkit("train", "--mode", "ddp", "--nproc-per-node", "2", "--epochs", "3", "--out", str(run))
    checkpoint = run / "ckpt-epoch0003.pt"

    # 2. Look inside without loading it (no tensor data read, no pickle run).
    ckptkit("inspect", str(checkpoint), "--depth", "1")

    # 3. Convert the weights to safetensors; the run's metadata goes into the header.
    weights = out / "model.safetensors"
    ckptkit("convert", str(checkpoint), str(weights), "--force")

    # 4. Load into a plain, unwrapped model with strict=True and compare outputs with the
    #    checkpoint's own weights.
    plain = demo_model()
    plain.load_state_dict(load_file(weights), strict=True)
    reference = demo_model()
    reference.load_state_dict(torch.load(checkpoint, weights_only=True)["model"], strict=True)
    inputs = BlobData().inputs[:256]
    same = torch.equal(plain(inputs), reference(inputs))
    accuracy = (plain(inputs).argmax(1) == BlobData().labels[:256]).float().mean().item()
    print(
        f"Loaded {weights} into a plain model (strict=True): outputs identical: {same}, "
        f"accuracy {accuracy:.3f}"
    )
    if not same:
        sys.exit("outputs differ")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("demo-out"))
