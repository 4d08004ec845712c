"""Benchmarks: ckptkit against the usual way, interleaved in one run, medians and ratios.

    python3 bench/run.py            # a 4 GB training checkpoint (about 1 minute to make)
    python3 bench/run.py --quick    # small files; the test suite runs this so it keeps working
    python3 bench/run.py --size-gb 8 --repeat 5 --dir /big/disk

Each way runs in a fresh process, so every number includes starting Python and the imports a
user would pay for. The ways take turns, in a seeded shuffled order each round. Before each run
(untimed) its output is removed, `sync` flushes what earlier runs left for the disk to write (so
no way pays for another's writes), and the checkpoint is read through (so every way finds it in
the page cache). Wall time is the process's; peak anonymous memory is the highest RssAnon seen
in /proc while it ran, sampled every 10 ms (file-backed pages of a memory map are not counted:
they are the page cache, not the process's own memory); peak RSS is the kernel's exact
high-water mark, which counts those pages too, so it bounds the anonymous peak from above.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
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
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(t.shape, generator=gen),
            "exp_avg_sq": torch.rand(t.shape, generator=gen),
        }
        for i, t in enumerate(params)
    }
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
    largest = max(t.numel() * t.element_size() for t in state.values())
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "tensors": len(state),
        "largest_tensor_bytes": largest,
    }


def make(path: Path, total_bytes: int) -> dict:
    """:func:`make_training_checkpoint` in a child process: this process never imports torch,
    so the peak RSS its children inherit at fork stays small (see :func:`measure`)."""
    code = (
        f"import json, pathlib, sys; sys.path.insert(0, {str(HERE)!r}); import run; "
        f"print(json.dumps(run.make_training_checkpoint(pathlib.Path({str(path)!r}), "
        f"{total_bytes})))"
    )
    return json.loads(subprocess.run(python(code), check=True, capture_output=True).stdout)


def make_weight_pair(a: Path, b: Path, total_bytes: int) -> None:
    """Two weights-only checkpoints of ``total_bytes`` each (16 float32 tensors), B's largest
    tensor changed by 1e-3: the issue's case for ``diff --atol``. Weights only, so diff and cat
    read the same bytes (in a training checkpoint diff would skip the optimizer's two thirds)."""
    code = (
        "import torch; g = torch.Generator().manual_seed(0); "
        f"n = {total_bytes} // 4 // 16; "
        "s = {f'layer{i}.weight': torch.randn(n * (2 if i == 7 else 1) - (n if i == 8 else 0),"
        " generator=g) for i in range(16)}; "
        f"torch.save(s, {str(a)!r}); "
        "s['layer7.weight'] = s['layer7.weight'] + 1e-3; "
        f"torch.save(s, {str(b)!r})"
    )
    subprocess.run(python(code), check=True, capture_output=True)


def diff_ways(a: Path, b: Path) -> dict[str, list[str]]:
    return {
        "ckptkit diff --atol 1e-2": [
            sys.executable,
            "-m",
            "ckptkit",
            "diff",
            str(a),
            str(b),
            "--atol",
            "1e-2",
            "-q",
        ],
        "cat both files once": ["sh", "-c", f"cat {a} {b} > /dev/null"],
    }


def warm(path: Path) -> None:
    """Read a file through, so it is all in the page cache (the issue's measuring condition;
    the kernel drops pages of it now and then, and a way that read them from disk would be
    timing the disk)."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 * 1024 * 1024)
        while f.readinto(buf):
            pass


def measure(
    argv: list[str], outputs: tuple[Path, ...] = (), inputs: tuple[Path, ...] = ()
) -> dict[str, float]:
    """Run a command from a settled disk and a warm cache. Returns its wall seconds, its peak
    anonymous memory (RssAnon sampled every 10 ms) and its peak RSS (the kernel's exact
    high-water mark, which also counts mapped file pages, so it bounds the anonymous peak from
    above; it starts from this process's RSS at the fork, a few MB: no torch here)."""
    for out in outputs:  # a file, or a folder some ways write
        shutil.rmtree(out) if out.is_dir() else out.unlink(missing_ok=True)
    os.sync()
    for path in inputs:
        warm(path)
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        peak_anon = 0
        done = threading.Event()

        def watch() -> None:  # every 10 ms: a tighter loop takes a core from a 2-core machine
            nonlocal peak_anon
            while not done.wait(0.01):
                try:
                    with open(f"/proc/{proc.pid}/status") as f:
                        for line in f:
                            if line.startswith("RssAnon:"):
                                peak_anon = max(peak_anon, int(line.split()[1]) * 1024)
                                break
                except OSError:
                    break

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _, status, usage = os.wait4(proc.pid, 0)  # wait4, unlike Popen.wait, gives ru_maxrss
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        watcher.join()
        if proc.returncode:
            err.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed:\n{err.read().decode()}")
    return {"wall_s": wall, "peak_anon_bytes": peak_anon, "peak_rss_bytes": usage.ru_maxrss * 1024}


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


def torch_ways(src: Path, folder: Path) -> dict[str, list[str]]:
    """convert's paths that need torch: casting, and .pt output (streamed through torch)."""
    ckptkit = [sys.executable, "-m", "ckptkit", "convert", str(src), "--strip-module", "-q"]
    return {
        "import torch (alone)": python("import torch"),
        "--dtype bf16 to .safetensors": [
            *ckptkit,
            str(folder / "bf16.safetensors"),
            "--dtype",
            "bf16",
        ],
        "to .pt": [*ckptkit, str(folder / "out.pt")],
        "--dtype bf16 to .pt": [*ckptkit, str(folder / "bf16.pt"), "--dtype", "bf16"],
    }


def run_ways(
    ways: dict[str, list[str]],
    repeat: int,
    outputs: tuple[Path, ...] = (),
    inputs: tuple[Path, ...] = (),
) -> dict[str, dict[str, float]]:
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    order = list(ways)
    for round_ in range(repeat):  # interleaved, so drift in the machine hits every way alike,
        random.Random(round_).shuffle(order)  # and shuffled: what a way runs after matters
        for name in order:  # (on a VM, memory another way just freed is slow to touch again)
            samples[name].append(measure(ways[name], outputs, inputs))
    return {
        name: {
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "walls_s": [r["wall_s"] for r in runs],
            "peak_anon_bytes": max(r["peak_anon_bytes"] for r in runs),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        }
        for name, runs in samples.items()
    }


def run_once(argv: list[str], what: str | None = None) -> str:
    """Run a helper process to its end (untimed: making, comparing); its stdout. A failure
    ends the bench, naming ``what`` failed (default: the command) and its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what or ' '.join(argv)[:200]} failed:\n{done.stderr[-4000:]}")
    return done.stdout


def ratio_line(name: str, value: float, at_most: float) -> str:
    """A ratio against its target, and whether it is met."""
    met = "met" if value <= at_most else "MISSED"
    return f"{name}: {value:.2f}x (target: at most {at_most:g}x: {met})"


def table(title: str, results: dict[str, dict[str, float]], base: str) -> str:
    ref = results[base]["wall_s"]
    lines = [
        title,
        f"| way | wall (median) | peak anonymous memory | peak RSS | wall vs {base} |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio = r["wall_s"] / ref if ref else float("nan")
        anon, rss = r["peak_anon_bytes"] / 1e6, r["peak_rss_bytes"] / 1e6
        lines.append(
            f"| {name} | {r['wall_s']:.3f} s | {anon:.0f} MB | {rss:.0f} MB | {ratio:.1f}x |"
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
    parser.add_argument(
        "--only",
        choices=["inspect", "convert", "torch", "diff", "flat"],
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    size = 24_000_000 if args.quick else int(args.size_gb * 1e9)
    repeat = 1 if args.quick else args.repeat
    parts = set(args.only or ["inspect", "convert", "torch", "diff", "flat"])
    flat_sizes = [24_000_000, 96_000_000] if args.quick else [int(g * 1e9) for g in args.flat_gb]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        ckpt, out = folder / "train.pt", folder / "out.safetensors"
        info = make(ckpt, size)
        results = {
            "checkpoint": info,
            "inspect": {},
            "convert": {},
            "torch": {},
            "diff": {},
            "flat_memory": {},
        }
        if "inspect" in parts:
            results["inspect"] = run_ways(inspect_ways(ckpt), repeat, inputs=(ckpt,))
        if "convert" in parts:
            results["convert"] = run_ways(convert_ways(ckpt, out), repeat, (out,), (ckpt,))
        if "torch" in parts:  # memory is the point here, and these are slow: fewer repeats
            outputs = (folder / "bf16.safetensors", folder / "out.pt", folder / "bf16.pt")
            ways = torch_ways(ckpt, folder)
            results["torch"] = run_ways(ways, min(repeat, 3), outputs, (ckpt,))
        if "diff" in parts:
            a, b = folder / "weights_a.pt", folder / "weights_b.pt"
            make_weight_pair(a, b, size)
            results["diff"] = run_ways(diff_ways(a, b), repeat, (), (a, b))
            a.unlink()
            b.unlink()
        ckpt.unlink()
        for flat in flat_sizes if "flat" in parts else []:  # one at a time: less disk needed
            path = folder / f"flat-{flat}.pt"
            made = make(path, flat)
            argv = convert_ways(path, folder / "flat.safetensors")["ckptkit convert (verified)"]
            outputs = (folder / "flat.safetensors",)
            results["flat_memory"][made["bytes"]] = measure(argv, outputs, (path,))
            path.unlink()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    gb = info["bytes"] / 1e9
    print(
        f"checkpoint: {gb:.2f} GB, {info['tensors']} model tensors, repeats: {repeat}, "
        f"{os.cpu_count()} cores\n"
    )
    if results["inspect"]:
        print(table("inspect", results["inspect"], "ckptkit inspect --json"), end="\n\n")
    if results["convert"]:
        convert = results["convert"]
        print(table("convert --strip-module", convert, "ckptkit convert (verified)"))
        print(
            "every run:", {name: [round(w, 2) for w in r["walls_s"]] for name, r in convert.items()}
        )
        print()
    if results["torch"]:
        base = results["torch"]["import torch (alone)"]["peak_anon_bytes"]
        print(
            "convert's paths through torch (largest tensor: "
            f"{info['largest_tensor_bytes'] / 1e6:.0f} MB)"
        )
        print("| way | wall (median) | peak anonymous memory | above torch alone |")
        print("|---|---|---|---|")
        for name, r in results["torch"].items():
            anon = r["peak_anon_bytes"]
            print(
                f"| {name} | {r['wall_s']:.2f} s | {anon / 1e6:.0f} MB | "
                f"{(anon - base) / 1e6:+.0f} MB |"
            )
        print()
    if results["diff"]:
        print(
            table(
                "diff of two weights-only checkpoints, the largest tensor +1e-3 (--atol 1e-2)",
                results["diff"],
                "cat both files once",
            ),
            end="\n\n",
        )
    if results["flat_memory"]:
        print("ckptkit convert as the checkpoint grows")
        print("| checkpoint | wall | peak anonymous memory | peak RSS |\n|---|---|---|---|")
        for nbytes, r in results["flat_memory"].items():
            anon, rss = r["peak_anon_bytes"] / 1e6, r["peak_rss_bytes"] / 1e6
            print(f"| {nbytes / 1e9:.2f} GB | {r['wall_s']:.2f} s | {anon:.0f} MB | {rss:.0f} MB |")


if __name__ == "__main__":
    main()
