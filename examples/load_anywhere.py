"""Load a ckptkit checkpoint anywhere: a plain model, DataParallel, DDP, torch.compile, on CPU.

    python3 examples/load_anywhere.py CHECKPOINT

Checkpoints from `ckptkit train` hold unwrapped keys, so plain torch loads them; `ckptkit.load_into`
also maps any other wrapper layout (an old `module.`-prefixed DDP checkpoint, say) automatically.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import ckptkit
from ckptkit.engine.demo import demo_model


def main(path: str) -> None:
    # 1. Plain torch, safely: weights_only=True, onto the CPU whatever device saved it.
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    plain = demo_model()
    plain.load_state_dict(checkpoint["model"], strict=True)
    print(f"plain model: loaded epoch {checkpoint['epoch']} with torch.load + load_state_dict")

    # 2. Into wrapped models: ckptkit finds the prefix change (here: add `module.` or `_orig_mod.`).
    for name, model in [
        ("DataParallel", nn.DataParallel(demo_model())),
        ("torch.compile", torch.compile(demo_model())),
    ]:
        report = ckptkit.load_into(model, path)
        print(f"{name}: {report.match.describe()}, {report.loaded} tensors loaded")

    # 3. Just the weights, memory-mapped, without running the pickle.
    state = ckptkit.load_state_dict(path)
    print(f"load_state_dict: {len(state)} tensors, e.g. {next(iter(state))}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python3 {sys.argv[0]} CHECKPOINT  (e.g. runs/demo/latest checkpoint)")
    main(sys.argv[1])
