"""ckptkit end to end: a DataParallel training checkpoint becomes a safetensors file that loads
strictly into a plain, unwrapped model with identical outputs.

    python3 examples/demo.py [OUT_DIR]      (default: demo-out/)

Every step runs the real `ckptkit` command in a subprocess and shows what it printed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def ckptkit(*args: str) -> None:
    print(f"$ ckptkit {' '.join(args)}")
    proc = subprocess.run([sys.executable, "-m", "ckptkit", *args], text=True, capture_output=True)
    print(proc.stdout + proc.stderr, end="")
    if proc.returncode:
        sys.exit(f"ckptkit exited with {proc.returncode}")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    # DataParallel splits batches over GPUs when there are some, and runs the module as it is
    # on a CPU-only machine.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs, labels = torch.randn(256, 16, device=device), torch.randint(0, 4, (256,), device=device)

    # 1. Train under nn.DataParallel and save
    #    the way most training scripts do: the wrapper's state dict inside a training checkpoint.
    wrapped = nn.DataParallel(make_model().to(device))
    opt = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(wrapped(inputs), labels)
        loss.backward()
        opt.step()
    wrapped.eval()
    src = out / "dp_checkpoint.pt"
    torch.save(
        {
            "model": wrapped.state_dict(),
            "optimizer": opt.state_dict(),
            "epoch": 20,
            "loss": loss.item(),
        },
        src,
    )
    print(f"Trained 20 steps under DataParallel (loss {loss.item():.3f}); saved {src}\n")

    # 2. The wall everyone hits: a plain model refuses the `module.` keys.
    plain = make_model()
    try:
        plain.load_state_dict(torch.load(src, weights_only=True)["model"])
    except RuntimeError as exc:
        print("A plain model refuses it:", str(exc).splitlines()[1].strip()[:90], "...\n")

    # 3. Convert: find the weights in the training checkpoint, strip `module.`, verify.
    dst = out / "model.safetensors"
    ckptkit("convert", str(src), str(dst), "--strip-module", "--force")
    print()

    # 4. The result loads strictly into the plain model and computes exactly the same outputs.
    plain.load_state_dict(load_file(dst), strict=True)
    plain.to(device).eval()
    same = torch.equal(plain(inputs), wrapped(inputs))
    print(f"Loaded {dst} into a plain model with strict=True; outputs identical: {same}")
    if not same:
        sys.exit("outputs differ")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("demo-out"))
