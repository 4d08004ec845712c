"""Training benchmarks: ckptkit's loop against a hand-written one, and ckptkit's own launcher
against torchrun, on the same model, data and optimizer, interleaved in one run.

    python3 bench/train.py              # an MLP of about 2M parameters, 6 epochs
    python3 bench/train.py --quick      # small; the test suite runs this so it keeps working
    python3 bench/train.py --repeat 5

Ways (each a fresh process, timed whole: start-up, training, one checkpoint at the end):
- single: ``ckptkit train --mode single`` against a plain loop (SGD, DistributedSampler of 1,
  the same batches) that saves its state with ``torch.save``;
- DDP x2 under torchrun: ``torchrun -m ckptkit train --mode ddp`` against the plain loop
  wrapped in DistributedDataParallel;
- ckptkit's own launcher: ``ckptkit train --mode ddp --nproc-per-node 2`` (OMP_NUM_THREADS=1
  per worker, as torchrun sets it) against the same loop under torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import measure  # noqa: E402

# The model and data both ways train: importable by the workers (the bench folder is on
# PYTHONPATH).
FACTORIES = """
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset

WIDTH = int(os.environ.get("BENCH_WIDTH", "512"))


def model():
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, WIDTH, generator=gen)
    return TensorDataset(x, (x[:, :10].argmax(1)))
"""

# The hand-written loop: what a user writes without ckptkit, single or DDP (under torchrun).
PLAIN = """
import os, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from bench_factories import data, model

epochs, batch, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ddp = "RANK" in os.environ
if ddp:
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
torch.manual_seed(0)
net = model()
if ddp:
    net = nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
dataset = data()
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0,
                             drop_last=True)
loader = DataLoader(dataset, batch_size=batch // world, sampler=sampler, drop_last=True)
started = time.perf_counter()
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
if rank == 0:  # the loop's throughput, as the engine's metrics.jsonl reports it
    with open(out + ".loop", "w") as f:
        f.write(str(epochs * len(loader) * batch / (time.perf_counter() - started)))
    inner = net.module if ddp else net
    torch.save({"model": inner.state_dict(), "optimizer": opt.state_dict()}, out)
if ddp:
    dist.barrier()
    dist.destroy_process_group()
"""


def _loop_rate(out: Path) -> float:
    """Samples per second of the training loop alone: the plain loop's own count, or the
    engine's per-epoch rates in metrics.jsonl (equal epochs: their harmonic mean)."""
    if out.suffix == ".pt":
        return float(Path(f"{out}.loop").read_text())
    rates = [json.loads(line)["samples_per_s"] for line in (out / "metrics.jsonl").open()]
    return len(rates) / sum(1 / r for r in rates)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small model, 1 repeat")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    epochs = 1 if args.quick else args.epochs
    repeat = 1 if args.quick else args.repeat
    batch = "64"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "bench_factories.py").write_text(FACTORIES)
        (folder / "plain_loop.py").write_text(PLAIN)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])
        os.environ["BENCH_WIDTH"] = "64" if args.quick else "512"
        os.chdir(folder)  # the engine imports MODULE:FACTORY from the current folder
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
        ]
        engine = [
            "-m",
            "ckptkit",
            "train",
            "--model",
            "bench_factories:model",
            "--data",
            "bench_factories:data",
            "--epochs",
            str(epochs),
            "--save-every",
            str(epochs),
            "--lr-schedule",
            "constant",
            "--batch-size",
            batch,
            "-q",
        ]
        plain = [str(folder / "plain_loop.py"), str(epochs), batch]
        ways = {  # name: (command, its output)
            "single: plain loop": ([sys.executable, *plain, "p1.pt"], "p1.pt"),
            "single: ckptkit train": ([sys.executable, *engine, "--out", "e1"], "e1"),
            "ddp x2 (torchrun): plain loop": ([*torchrun, *plain, "p2.pt"], "p2.pt"),
            "ddp x2 (torchrun): ckptkit train": (
                [*torchrun, *engine, "--out", "e2", "--mode", "ddp"],
                "e2",
            ),
            "ddp x2: ckptkit's own launcher": (
                [sys.executable, *engine, "--out", "e3", "--mode", "ddp", "--nproc-per-node", "2"],
                "e3",
            ),
        }
        walls: dict[str, list[float]] = {name: [] for name in ways}
        loops: dict[str, list[float]] = {name: [] for name in ways}
        order = list(ways)
        for round_ in range(repeat):  # interleaved and shuffled, as bench/run.py does
            random.Random(round_).shuffle(order)
            for name in order:
                argv, out = ways[name]
                walls[name].append(measure(argv)["wall_s"])
                loops[name].append(_loop_rate(folder / out))
        results = {
            name: {
                "wall_s": statistics.median(walls[name]),
                "loop_samples_per_s": statistics.median(loops[name]),
            }
            for name in ways
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{epochs} epochs of 4096 samples, global batch {batch}, width "
        f"{os.environ['BENCH_WIDTH']}, repeats: {repeat}, {os.cpu_count()} cores\n"
    )
    pairs = {
        "single: ckptkit train": "single: plain loop",
        "ddp x2 (torchrun): ckptkit train": "ddp x2 (torchrun): plain loop",
        "ddp x2: ckptkit's own launcher": "ddp x2 (torchrun): ckptkit train",
    }
    print("| way | wall (median) | loop samples/s (median) | loop time against |")
    print("|---|---|---|---|")
    for name, r in results.items():
        base = pairs.get(name)
        ratio = ""
        if base:  # loop time is the inverse of throughput
            ratio = f"{results[base]['loop_samples_per_s'] / r['loop_samples_per_s']:.3f}x {base}"
        print(f"| {name} | {r['wall_s']:.2f} s | {r['loop_samples_per_s']:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
