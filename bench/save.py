"""How long a checkpoint holds training up: ``ckptkit train`` saving synchronously against
``--async-save`` (the state copied to CPU memory, then written on a thread), interleaved.

    python3 bench/save.py             # 0.5 GB of weights (+ SGD momentum), 3 saves a run
    python3 bench/save.py --quick     # small; the test suite runs this so it keeps working
    python3 bench/save.py --mode fsdp # 2 FSDP2 ranks saving DCP folders (dcp.async_save)

Each run trains a few steps per epoch and saves every epoch; the engine reports each save's
stall (``save_stalls`` in ``--json``: from the moment training stops for it until every rank
goes on). The figure is the median stall of all saves of all runs of a way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FACTORIES = """
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset

WIDTH, LAYERS = int(os.environ["BENCH_WIDTH"]), int(os.environ["BENCH_LAYERS"])


def model():
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def data():
    x = torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x[:, :WIDTH].argmax(1))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--mode",
        choices=["single", "fsdp"],
        default="single",
        help="fsdp: 2 ranks, each writing its shards of a DCP folder",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    width, layers = (256, 2) if args.quick else (4096, 8)
    stalls: dict[str, list[float]] = {"synchronous": [], "--async-save": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "bench_save_factories.py").write_text(FACTORIES)
        path = os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])
        env = {
            **os.environ,
            "BENCH_WIDTH": str(width),
            "BENCH_LAYERS": str(layers),
            "PYTHONPATH": path,
        }
        order = list(stalls)
        for round_ in range(repeat):
            random.Random(round_).shuffle(order)
            for name in order:
                out = folder / f"run-{round_}-{name.strip('-')}"
                argv = [
                    sys.executable,
                    "-m",
                    "ckptkit",
                    "train",
                    "--model",
                    "bench_save_factories:model",
                    "--data",
                    "bench_save_factories:data",
                    "--epochs",
                    "3",
                    "--keep-last",
                    "1",
                    "--lr-schedule",
                    "constant",
                    "--out",
                    str(out),
                    "--json",
                    "-q",
                    "--mode",
                    args.mode,
                ]
                if name == "--async-save":
                    argv.append("--async-save")
                subprocess.run(["sync"], check=True)
                done = subprocess.run(
                    argv, cwd=folder, env=env, capture_output=True, text=True, check=True
                )
                result = json.loads(done.stdout)
                stalls[name] += result["save_stalls"]
                subprocess.run(["rm", "-rf", str(out)], check=True)
    results = {
        name: {"median_stall_s": statistics.median(values), "saves": len(values)}
        for name, values in stalls.items()
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    params = width * width * layers
    where = "2 FSDP2 ranks, DCP folders" if args.mode == "fsdp" else "single device, .pt files"
    print(
        f"{params * 4 / 1e9:.2f} GB of weights (and as much SGD momentum), {where}, 3 saves "
        f"a run, repeats: {repeat}, {os.cpu_count()} cores\n"
    )
    base = results["synchronous"]["median_stall_s"]
    print("| way | stall per checkpoint (median) | against synchronous |")
    print("|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['median_stall_s']:.3f} s | {r['median_stall_s'] / base:.2f}x |")


if __name__ == "__main__":
    main()
