"""Scale benchmarks: checkpoints of many small tensors (a mixture of experts has tens of
thousands), a sharded folder of 160 shards, and a torch zip whose storage is deflated; ckptkit
against torch.load(mmap=True) (or what reads the file at all), interleaved in one run.

    python3 bench/scale.py                  # 10,000 and 100,000 tensors, 160 shards, 1 GiB
    python3 bench/scale.py --quick          # small; the test suite runs this so it keeps working
    python3 bench/scale.py --tensors 100000 --repeat 5 --dir /big/disk

Measured as in ``bench/run.py`` (a fresh process per run, shuffled turns, a settled disk and a
warm cache; peak anonymous memory sampled from /proc, peak RSS the kernel's high-water mark).
The ratio column is each way's wall time over the group's reference (torch.load(mmap=True) of
the same tensors, or plain torch.load where mmap cannot read the file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import python, run_ways, table  # noqa: E402

# N tensors of 8 x 8 float32 under mixture-of-experts names, saved by torch.save (a .pt) and
# by safetensors (the same tensors), in a child so this process never imports torch.
MAKE_MANY = """
import sys, torch
from safetensors.torch import save_file
n, pt, st = int(sys.argv[1]), sys.argv[2], sys.argv[3]
g = torch.Generator().manual_seed(0)
state = {}
for i in range(n):
    layer, expert = divmod(i, 1000)
    key = f"model.layers.{layer}.mlp.experts.{expert // 4}.w{expert % 4}.weight"
    state[key] = torch.randn(8, 8, generator=g)
torch.save(state, pt)
save_file(state, st, metadata={"format": "pt"})
"""

# A sharded folder as save_pretrained writes one: SHARDS safetensors files and the index.
MAKE_SHARDED = """
import json, os, sys, torch
from safetensors.torch import save_file
folder, shards, keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(folder, exist_ok=True)
weight_map, per = {}, -(-keys // shards)
for s in range(shards):
    name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    state = {
        f"model.layers.{i // 625}.mlp.experts.{i % 625}.weight": torch.full((2,), float(i))
        for i in range(s * per, min(keys, (s + 1) * per))
    }
    save_file(state, os.path.join(folder, name), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(state, name))
index = {"metadata": {}, "weight_map": weight_map}
with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f)
"""

# torch.save of one large storage, re-zipped with its members deflated (as zip tools do).
MAKE_DEFLATED = """
import shutil, sys, zipfile, torch
out, nbytes = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(0)
plain = out + ".plain"
torch.save({"big": torch.randn(nbytes // 4, generator=g), "small": torch.ones(3)}, plain)
dst = zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1)
with zipfile.ZipFile(plain) as src, dst:
    for info in src.infolist():
        with src.open(info) as a, dst.open(info.filename, "w", force_zip64=True) as b:
            shutil.copyfileobj(a, b, 1 << 20)
"""

SAFE_OPEN_SHARDS = """
import glob, os
from safetensors import safe_open
for name in sorted(glob.glob(os.path.join({folder!r}, "*.safetensors"))):
    with safe_open(name, "numpy") as f:  # no torch to import: the reader alone
        for key in f.keys():
            f.get_slice(key).get_shape()
"""


def make(script: str, *args: object) -> None:
    """Run a maker in a child (torch is imported there, never here)."""
    done = subprocess.run(python(script) + [str(a) for a in args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"making the files failed:\n{done.stderr[-4000:]}")


def ckptkit(*args: object) -> list[str]:
    return [sys.executable, "-m", "ckptkit", *map(str, args)]


def torch_load(path: Path, *, mmap: bool) -> list[str]:
    option = ", mmap=True" if mmap else ""
    return python(f"import torch; torch.load({str(path)!r}, weights_only=True{option})")


def many_ways(pt: Path, st: Path, out: Path) -> dict[str, dict[str, list[str]]]:
    """The groups for one count of tensors: the .pt file and the safetensors file."""
    reference = {"torch.load(mmap=True)": torch_load(pt, mmap=True)}
    return {
        "pt": {
            "ckptkit inspect": ckptkit("inspect", pt),
            "ckptkit scan": ckptkit("scan", pt),
            "ckptkit convert to .safetensors (verified)": ckptkit(
                "convert", pt, out.with_suffix(".safetensors"), "--force", "-q"
            ),
            "ckptkit convert to .pt (verified)": ckptkit(
                "convert", pt, out.with_suffix(".pt"), "--force", "-q"
            ),
            **reference,
            "torch.load (full)": torch_load(pt, mmap=False),
        },
        "safetensors": {
            "ckptkit inspect": ckptkit("inspect", st),
            "ckptkit scan": ckptkit("scan", st),
            "ckptkit convert to .safetensors (verified)": ckptkit(
                "convert", st, out.with_suffix(".safetensors"), "--force", "-q"
            ),
            "ckptkit convert to .pt (verified)": ckptkit(
                "convert", st, out.with_suffix(".pt"), "--force", "-q"
            ),
            "safetensors load_file": python(
                f"from safetensors.torch import load_file; load_file({str(st)!r})"
            ),
            **reference,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small files, 1 repeat")
    parser.add_argument(
        "--tensors", type=int, nargs="*", default=[10_000, 100_000], help="tensor counts"
    )
    parser.add_argument("--shards", type=int, default=160, help="shards of the sharded folder")
    parser.add_argument("--deflated-gib", type=float, default=1.0, help="the deflated storage")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--only",
        choices=["many", "sharded", "deflated"],
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    parts = set(args.only or ["many", "sharded", "deflated"])
    counts = [1_000, 4_000] if args.quick else args.tensors
    shards = 16 if args.quick else args.shards
    deflated = 16 * 2**20 if args.quick else int(args.deflated_gib * 2**30)
    repeat = 1 if args.quick else args.repeat
    keys = counts[-1]  # the sharded folder holds as many keys as the largest file tensors
    sharded_name = f"{shards} shards, {keys} keys"
    results: dict = {
        "counts": counts,
        "shards": shards,
        "deflated_bytes": deflated,
        "file_bytes": {},
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        out = folder / "out"
        outputs = (out.with_suffix(".safetensors"), out.with_suffix(".pt"))
        for n in counts if "many" in parts else []:
            pt, st = folder / f"many-{n}.pt", folder / f"many-{n}.safetensors"
            make(MAKE_MANY, n, pt, st)
            for kind, ways in many_ways(pt, st, out).items():
                name = f"{n} tensors, {kind}"
                results[name] = run_ways(ways, repeat, outputs, (pt, st))
                results["file_bytes"][name] = (pt if kind == "pt" else st).stat().st_size
            if n != keys:
                pt.unlink()
                st.unlink()
        if "sharded" in parts:
            reference = folder / f"many-{keys}.pt"
            if not reference.exists():  # the .pt of as many tensors, torch.load's to read
                make(MAKE_MANY, keys, reference, folder / "unused.safetensors")
            sharded = folder / "sharded"
            make(MAKE_SHARDED, sharded, shards, keys)
            results[sharded_name] = run_ways(
                {
                    "ckptkit inspect": ckptkit("inspect", sharded),
                    "ckptkit convert to one .safetensors (verified)": ckptkit(
                        "convert", sharded, out.with_suffix(".safetensors"), "--force", "-q"
                    ),
                    "safe_open of every shard (keys and shapes)": python(
                        SAFE_OPEN_SHARDS.format(folder=str(sharded))
                    ),
                    f"torch.load(mmap=True) ({keys}-tensor .pt)": torch_load(reference, mmap=True),
                },
                repeat,
                outputs,
                tuple(sorted(sharded.iterdir())),
            )
        if "deflated" in parts:
            defl = folder / "deflated.pt"
            make(MAKE_DEFLATED, defl, deflated)
            (folder / "deflated.pt.plain").unlink()
            results["deflated storage"] = run_ways(
                {
                    "ckptkit convert to .safetensors (verified)": ckptkit(
                        "convert", defl, out.with_suffix(".safetensors"), "--force", "-q"
                    ),
                    "ckptkit convert to .pt (verified)": ckptkit(
                        "convert", defl, out.with_suffix(".pt"), "--force", "-q"
                    ),
                    "torch.load (full; mmap cannot read it)": torch_load(defl, mmap=False),
                    "import torch (alone)": python("import torch"),
                },
                repeat,
                outputs,
                (defl,),
            )
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"repeats: {repeat}, {os.cpu_count()} cores\n")
    for name, nbytes in results["file_bytes"].items():
        title = f"{name} ({nbytes / 1e6:.1f} MB)"
        print(table(title, results[name], "torch.load(mmap=True)"), end="\n\n")
    if sharded_name in results:
        print(
            table(
                f"sharded folder: {sharded_name}",
                results[sharded_name],
                f"torch.load(mmap=True) ({keys}-tensor .pt)",
            ),
            end="\n\n",
        )
    if "deflated storage" in results:
        print(
            table(
                f"a torch zip whose {deflated / 2**20:.0f} MiB storage is deflated",
                results["deflated storage"],
                "torch.load (full; mmap cannot read it)",
            )
        )


if __name__ == "__main__":
    main()
