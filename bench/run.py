"""Benchmarks: ckptkit against the usual way, interleaved in one run, medians and ratios.

    python3 bench/run.py            # a 4 GB training checkpoint (about 1 minute to make)
    python3 bench/run.py --quick    # small files; the test suite runs this so it keeps working
    python3 bench/run.py --size-gb 8 --repeat 5 --dir /big/disk

Each way runs in a fresh process, so every number includes starting Python and the imports a
user would pay for. Before each run (untimed) its output is removed and `sync` flushes what
earlier runs left for the disk to write, so no way pays for another's writes; the page cache
stays warm. Wall time is the process's; peak anonymous memory is the highest RssAnon seen
in /proc while it ran (file-backed pages of a memory map are not counted: they are the page
cache, not the process's own memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make_training_checkpoint(path: Path, total_bytes: int, *, seed: int = 0) -> dict:
    """A DDP-style training checkpoint: `module.` keys, Adam state (so weights are about a third
    of the file), a tied embedding and head, and plain extras."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    weight_bytes = total_bytes // 3
    width = 1024 if weight_bytes < 2**28 else 4096
    layer_bytes = width * width * 4
    layers = max(1, weight_bytes // layer_bytes - 1)
    state = {}
    embed = torch.randn(width, width, generator=gen)
    state["module.embed.weight"] = embed
    for i in range(layers):
        state[f"module.layers.{i}.weight"] = torch.randn(width, width, generator=gen)
        state[f"module.layers.{i}.bias"] = torch.randn(width, generator=gen)
    state["module.head.weight"] = embed  # tied
    params = [t for k, t in state.items() if k != "module.head.weight"]
    opt_state = {
        i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(t.shape, generator=gen),
            "exp_avg_sq": torch.rand(t.shape, generator=gen)}
        for i, t in enumerate(params)
    }  # fmt: skip
    checkpoint = {
        "model": state,
        "optimizer": {
            "state": opt_state,
            "param_groups": [{"lr": 1e-3, "params": list(range(len(params)))}],
        },
        "epoch": 7,
        "step": 7000,
    }
    torch.save(checkpoint, path)
    return {"path": str(path), "bytes": path.stat().st_size, "tensors": len(state)}


def measure(argv: list[str], outputs: tuple[Path, ...] = ()) -> tuple[float, int]:
    """Run a command from a settled disk; return (wall seconds, peak anonymous bytes)."""
    for out in outputs:
        out.unlink(missing_ok=True)
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0

    def watch() -> None:
        nonlocal peak
        status = f"/proc/{proc.pid}/status"
        while proc.poll() is None:
            try:
                with open(status) as f:
                    for line in f:
                        if line.startswith("RssAnon:"):
                            peak = max(peak, int(line.split()[1]) * 1024)
                            break
            except OSError:
                break
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - start
    watcher.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{err.decode()}")
    return wall, peak


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def inspect_ways(path: Path) -> dict[str, list[str]]:
    p = str(path)
    return {
        "ckptkit inspect --json": [sys.executable, "-m", "ckptkit", "inspect", p, "--json"],
        "torch.load (full)": python(f"import torch; torch.load({p!r}, weights_only=True)"),
        "torch.load (mmap=True)": python(
            f"import torch; torch.load({p!r}, weights_only=True, mmap=True)"
        ),
        "import torch (alone)": python("import torch"),
    }


NAIVE = """
import torch
from safetensors.torch import save_file
state = torch.load({src!r}, map_location="cpu", weights_only=True{mmap})["model"]
state = {{k.removeprefix("module."): v for k, v in state.items()}}
seen = set()
for key, tensor in state.items():  # safetensors refuses shared memory: clone the duplicates
    ptr = tensor.untyped_storage().data_ptr()
    state[key] = tensor.clone() if ptr in seen else tensor.contiguous()
    seen.add(ptr)
save_file(state, {dst!r}, metadata={{"format": "pt"}})
"""


def convert_ways(src: Path, dst: Path) -> dict[str, list[str]]:
    s, d = str(src), str(dst)
    return {
        "ckptkit convert (verified)": [
            sys.executable,
            "-m",
            "ckptkit",
            "convert",
            s,
            d,
            "--strip-module",
            "--force",
            "-q",
        ],
        "torch.load + strip + save_file": python(NAIVE.format(src=s, dst=d, mmap="")),
        "torch.load(mmap=True) + ...": python(NAIVE.format(src=s, dst=d, mmap=", mmap=True")),
        "cp of the whole file": ["cp", s, d],
    }


def run_ways(
    ways: dict[str, list[str]], repeat: int, outputs: tuple[Path, ...] = ()
) -> dict[str, dict[str, float]]:
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in ways}
    for _ in range(repeat):  # interleaved, so drift in the machine hits every way alike
        for name, argv in ways.items():
            samples[name].append(measure(argv, outputs))
    return {
        name: {
            "wall_s": statistics.median(w for w, _ in runs),
            "peak_anon_bytes": max(m for _, m in runs),
        }
        for name, runs in samples.items()
    }


def table(title: str, results: dict[str, dict[str, float]], base: str) -> str:
    ref = results[base]["wall_s"]
    lines = [
        title,
        f"| way | wall (median) | peak anonymous memory | wall vs {base} |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio = r["wall_s"] / ref if ref else float("nan")
        lines.append(
            f"| {name} | {r['wall_s']:.3f} s | {r['peak_anon_bytes'] / 1e6:.0f} MB | {ratio:.1f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small files, 1 repeat")
    parser.add_argument("--size-gb", type=float, default=4.0, help="training checkpoint size")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--flat-gb",
        type=float,
        nargs="*",
        default=[0.5, 4.0, 8.0],
        help="sizes for the flat-memory run, one file at a time",
    )
    parser.add_argument(
        "--dir", type=Path, help="where to write the checkpoints (default: a temp dir)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    size = 24_000_000 if args.quick else int(args.size_gb * 1e9)
    repeat = 1 if args.quick else args.repeat
    flat_sizes = [24_000_000, 96_000_000] if args.quick else [int(g * 1e9) for g in args.flat_gb]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        ckpt, out = folder / "train.pt", folder / "out.safetensors"
        info = make_training_checkpoint(ckpt, size)
        results = {
            "checkpoint": info,
            "inspect": run_ways(inspect_ways(ckpt), repeat),
            "convert": run_ways(convert_ways(ckpt, out), repeat, (out,)),
            "flat_memory": {},
        }
        ckpt.unlink()
        for flat in flat_sizes:  # one file at a time, so the disk holds only the largest
            path = folder / f"flat-{flat}.pt"
            made = make_training_checkpoint(path, flat)
            argv = convert_ways(path, folder / "flat.safetensors")["ckptkit convert (verified)"]
            wall, peak = measure(argv, (folder / "flat.safetensors",))
            results["flat_memory"][made["bytes"]] = {"wall_s": wall, "peak_anon_bytes": peak}
            path.unlink()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    gb = info["bytes"] / 1e9
    print(f"checkpoint: {gb:.2f} GB, {info['tensors']} model tensors, repeats: {repeat}, "
          f"{os.cpu_count()} cores\n")  # fmt: skip
    print(table("inspect", results["inspect"], "ckptkit inspect --json"))
    print()
    print(table("convert --strip-module", results["convert"], "ckptkit convert (verified)"))
    print("\nckptkit convert as the checkpoint grows")
    print("| checkpoint | wall | peak anonymous memory |\n|---|---|---|")
    for nbytes, r in results["flat_memory"].items():
        wall, peak = r["wall_s"], r["peak_anon_bytes"] / 1e6
        print(f"| {nbytes / 1e9:.2f} GB | {wall:.2f} s | {peak:.0f} MB |")


if __name__ == "__main__":
    main()
