"""Start-up: what each command costs over a bare interpreter, in one interleaved run.

    python3 bench/startup.py [--repeat 30]

Targets (issue 10): `ckptkit --help` within 0.08 s of `python -c pass`, and `ckptkit inspect` of
a small checkpoint within 0.15 s. The ways take turns in a seeded shuffled order each round;
medians are printed with their difference from the bare interpreter.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = ROOT / "fixtures" / "training.pt"


def ways() -> dict[str, list[str]]:
    ckptkit = [sys.executable, "-m", "ckptkit"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "ckptkit --help": [*ckptkit, "--help"],
        "ckptkit --version": [*ckptkit, "--version"],
        "ckptkit inspect (small .pt)": [*ckptkit, "inspect", str(SMALL)],
        "ckptkit scan (small .pt)": [*ckptkit, "scan", str(SMALL)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {name: [] for name in ways()}
    order = list(runs)
    for round_ in range(args.repeat):
        random.Random(round_).shuffle(order)
        for name in order:
            start = time.perf_counter()
            subprocess.run(ways()[name], check=True, capture_output=True, cwd=ROOT)
            runs[name].append(time.perf_counter() - start)
    bare = statistics.median(runs["python -c pass"])
    print(f"| way | median | over python -c pass |  ({args.repeat} interleaved runs)")
    print("|---|---|---|")
    for name, walls in runs.items():
        median = statistics.median(walls)
        print(f"| {name} | {median:.3f} s | {median - bare:+.3f} s |")


if __name__ == "__main__":
    main()
