"""Mapping benchmarks: ckptkit converting Meta's Llama checkpoint folder (``consolidated.NN.pth``
per model-parallel rank + ``params.json``) to a Hugging Face model folder with ``--map
llama-meta``, against transformers' own converter and against copying the output's bytes,
interleaved in one run; then ckptkit's output against the converter's, bit for bit.

    python3 bench/mapping.py                   # a 1 GB bf16 Llama 3 in 2 ranks, 3 repeats
    python3 bench/mapping.py --quick           # tiny; a test can run this so it keeps working
    python3 bench/mapping.py --size-gb 2 --tp 4 --repeat 5 --dir /tmp/ckptkit-mapping

The Meta folder is made by ``fixtures/make_mapping.py``'s ``make_meta`` (Meta's documented
layout: q/k/v, w1 and w3 split by rows, wo and w2 by columns, Llama 3's embedding by rows,
norms copied to every rank; bf16), Llama-shaped: width 2048, 16 query heads and 4 key/value
heads (grouped-query attention), a 32000-token vocabulary, ``multiple_of`` 256, and as many
layers as reach ``--size-gb`` (smaller sizes get a narrower model). With ``--dir`` it is kept
there and reused by later runs of the same shape.

The ways:

- ``ckptkit convert META OUT --map llama-meta``: streams one rule's group at a time, fsyncs, and
  reads its output back to compare (its default);
- transformers' converter: ``write_model`` from transformers 4.46.3's
  ``models/llama/convert_llama_weights_to_hf.py`` (5.x no longer ships it), run with
  ``PYTHONPATH=--transformers`` (a ``pip install --target`` folder; default /tmp/tf446), its
  output then fsynced; skipped, and said so, when that folder has no converter;
- the anchor: ``cp`` of the ``model.safetensors`` ckptkit wrote, then ``sync`` of the copy;
- the imports alone (what ckptkit's convert imports; a mapping that only moves bytes never
  imports torch): the base its memory above is measured from.

Measured as in ``bench/run.py`` (fresh process per run, shuffled turns, a settled disk and a
warm cache; peak anonymous memory sampled from /proc, peak RSS from the kernel).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import python, ratio_line, run_once, run_ways, table  # noqa: E402

FIXTURE = HERE.parent / "fixtures" / "make_mapping.py"

# Makes the Meta folder argv[3] for params argv[1] and argv[2] ranks with make_meta, then its
# info.json, last (so a half-made folder is told by its missing info.json). Its own process:
# this one never imports torch, so the peak RSS its children inherit at fork stays small.
MAKE = """
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("make_mapping", sys.argv[4])
make_mapping = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_mapping)
params, tp, folder = json.loads(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
whole = make_mapping.make_meta(folder, tp, "3", params)
sizes = {key: t.numel() * t.element_size() for key, t in whole.items()}
# Every llama-meta rule makes one Hugging Face tensor from its rank slices, so the largest
# group one rule makes at once is the largest whole tensor.
largest = max(sizes, key=sizes.get)
info = {
    "params": params,
    "tp": tp,
    "ffn": make_mapping.ffn_size(params),
    "meta_bytes": sum(p.stat().st_size for p in folder.glob("consolidated.*.pth")),
    "tensors": len(sizes),
    "tensor_bytes": sum(sizes.values()),
    "largest_set_key": largest,
    "largest_set_bytes": sizes[largest],
}
(folder / "info.json").write_text(json.dumps(info, indent=2))
"""

# transformers 4.46.3's converter as fixtures/make_mapping.py's run_converter calls it, then an
# fsync of what it wrote: on the disk, as ckptkit's fsynced output is.
CONVERTER = """
import os, sys
from transformers.models.llama.convert_llama_weights_to_hf import write_model
out = sys.argv[1]
write_model(out, sys.argv[2], safe_serialization=True, llama_version="3",
            vocab_size=int(sys.argv[3]), num_shards=int(sys.argv[4]))
for name in os.listdir(out):
    fd = os.open(os.path.join(out, name), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
"""

# Every tensor of two model folders' safetensors files, compared as bytes (dtype and shape too).
COMPARE = """
import json, sys
from pathlib import Path
import torch
from safetensors import safe_open

def tensors(folder):
    files = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            files.update({key: path for key in f.keys()})
    return files

ours, theirs = tensors(sys.argv[1]), tensors(sys.argv[2])
n = {"tensors": len(ours), "converter_tensors": len(theirs), "bit_equal": 0, "differ": [],
     "only_ckptkit": sorted(set(ours) - set(theirs)),
     "only_converter": sorted(set(theirs) - set(ours))}
for key in sorted(set(ours) & set(theirs)):
    with safe_open(ours[key], "pt") as a, safe_open(theirs[key], "pt") as b:
        x, y = a.get_tensor(key), b.get_tensor(key)
    same = x.dtype == y.dtype and x.shape == y.shape
    if same:  # the raw bytes, so -0.0 against 0.0 or two NaNs' payloads differ too
        same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    if same:
        n["bit_equal"] += 1
    else:
        n["differ"].append(key)
print(json.dumps(n))
"""

CKPTKIT = "ckptkit convert --map llama-meta (verified)"
TRANSFORMERS = "transformers 4.46.3 write_model + fsync"
CP = "cp of ckptkit's output, then sync"
IMPORTS = "import ckptkit's convert (alone)"


def meta_params(total_bytes: int) -> dict:
    """Meta's params.json for a Llama of about ``total_bytes`` in bf16 (at least that): 16 query
    heads and 4 key/value heads (so up to 4 ranks split them), ``multiple_of`` 256, an MLP of
    Meta's 8/3 the width, an untied head; width 2048 and a 32000-token vocabulary from 0.5 GB,
    narrower below (the embedding and head alone of that width are 0.26 GB); as many layers as
    reach the size, at least one."""
    if total_bytes >= 5 * 10**8:
        dim, vocab = 2048, 32000
    elif total_bytes >= 8 * 10**7:
        dim, vocab = 512, 32000
    else:
        dim, vocab = 256, 8000
    params = {"dim": dim, "n_layers": 1, "n_heads": 16, "n_kv_heads": 4, "vocab_size": vocab}
    params |= {"multiple_of": 256, "ffn_dim_multiplier": 1.0, "norm_eps": 1e-05}
    params |= {"rope_theta": 500000.0}
    hidden = int(8 * dim / 3)
    ffn = 256 * ((hidden + 255) // 256)  # fixtures/make_mapping.py's ffn_size (no torch here)
    kv_dim = dim // 16 * 4
    per_layer = 2 * dim * dim + 2 * kv_dim * dim + 3 * ffn * dim + 2 * dim
    fixed = 2 * vocab * dim + dim
    params["n_layers"] = max(1, math.ceil((total_bytes / 2 - fixed) / per_layer))
    return params


def make(root: Path, params: dict, tp: int) -> dict:
    """The Meta folder of ``params`` in ``tp`` ranks under ``root``, reused when a finished one
    is there; returns its info.json with its paths."""
    folder = root / f"meta-d{params['dim']}-l{params['n_layers']}-v{params['vocab_size']}-tp{tp}"
    if not (folder / "info.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)  # a half-made one
        argv = python(MAKE) + [json.dumps(params), str(tp), str(folder), str(FIXTURE)]
        run_once(argv, "making the Meta folder")
    info = json.loads((folder / "info.json").read_text())
    info["folder"] = str(folder)
    info["inputs"] = [str(p) for p in sorted(folder.iterdir()) if p.name != "info.json"]
    return info


def has_converter(transformers: Path) -> bool:
    return (transformers / "transformers/models/llama/convert_llama_weights_to_hf.py").is_file()


def ckptkit_argv(meta: str, out: Path) -> list[str]:
    return [
        *(sys.executable, "-m", "ckptkit", "convert", meta, str(out)),
        *("--map", "llama-meta", "--force", "-q"),
    ]


def converter_argv(transformers: Path, info: dict, out: Path) -> list[str]:
    # `env` execs python, so the process measure() watches is the converter itself.
    return [
        *("env", f"PYTHONPATH={transformers}", "TRANSFORMERS_OFFLINE=1"),
        *python(CONVERTER),
        *(str(out), info["folder"], str(info["params"]["vocab_size"]), str(info["tp"])),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model (0.02 GB), 1 repeat")
    parser.add_argument("--size-gb", type=float, default=1.0, help="bf16 model size")
    parser.add_argument("--tp", type=int, default=2, help="model-parallel ranks (1, 2 or 4)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--transformers",
        type=Path,
        default=Path("/tmp/tf446"),
        help="a `pip install --target` folder holding transformers 4.46.3 (default /tmp/tf446)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        help="where to make (and keep, for later runs) the Meta folder (default: a temp dir)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.tp not in (1, 2, 4):  # 4 key/value heads: more ranks than that cannot split them
        parser.error("--tp must be 1, 2 or 4")
    repeat = 1 if args.quick else args.repeat
    params = meta_params(int((0.02 if args.quick else args.size_gb) * 1e9))
    converter = has_converter(args.transformers)
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        info = make(args.dir or folder, params, args.tp)
        inputs = tuple(Path(p) for p in info["inputs"])
        # The references, untimed: ckptkit's output is what the anchor copies, and both are
        # what the bit-for-bit check compares (the timed runs remove each other's outputs).
        ref_ckptkit, ref_converter = folder / "ref-ckptkit", folder / "ref-transformers"
        run_once(ckptkit_argv(info["folder"], ref_ckptkit))
        ref_file = ref_ckptkit / "model.safetensors"
        out_cp = folder / "out-cp.safetensors"
        ways = {
            CKPTKIT: ckptkit_argv(info["folder"], folder / "out-ckptkit"),
            CP: ["sh", "-c", f"cp '{ref_file}' '{out_cp}' && sync '{out_cp}'"],
            IMPORTS: python("import ckptkit.cli, ckptkit.convert"),
        }
        if converter:
            ways[TRANSFORMERS] = converter_argv(args.transformers, info, folder / "out-tf")
        outputs = (folder / "out-ckptkit", folder / "out-tf", out_cp)
        results: dict = {
            "model": {k: v for k, v in info.items() if k != "inputs"},
            "output_bytes": ref_file.stat().st_size,
            "transformers": str(args.transformers) if converter else None,
        }
        results["convert"] = run_ways(ways, repeat, outputs, inputs)
        results["bit_for_bit"] = None
        if converter:
            run_once(converter_argv(args.transformers, info, ref_converter))
            compared = run_once(
                python(COMPARE) + [str(ref_ckptkit), str(ref_converter)], "comparing the outputs"
            )
            results["bit_for_bit"] = json.loads(compared)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    report(results, repeat, args.transformers)


def report(results: dict, repeat: int, transformers: Path) -> None:
    info, convert, mb = results["model"], results["convert"], 1e6
    p = info["params"]
    print(
        f"Meta folder: {info['meta_bytes'] / 1e9:.2f} GB bf16 Llama 3 in {info['tp']} ranks "
        f"({p['n_layers']} layers, dim {p['dim']}, {p['n_heads']} heads / {p['n_kv_heads']} "
        f"key/value heads, MLP {info['ffn']}, vocabulary {p['vocab_size']}; {info['tensors']} "
        f"tensors), Hugging Face output: {results['output_bytes'] / 1e9:.2f} GB; largest "
        f"conversion set: {info['largest_set_key']}, {info['largest_set_bytes'] / mb:.0f} MB; "
        f"repeats: {repeat}, {os.cpu_count()} cores\n"
    )
    if results["transformers"] is None:
        print(
            f"transformers' converter: skipped (no transformers 4.46.3 at {transformers}; "
            f"pip install --target {transformers} transformers==4.46.3)\n"
        )
    print(table("Meta's Llama folder to Hugging Face", convert, CP))
    print("every run:", {name: [round(w, 2) for w in r["walls_s"]] for name, r in convert.items()})
    ours = convert[CKPTKIT]
    imports = convert[IMPORTS]["peak_anon_bytes"]
    above = ours["peak_anon_bytes"] - imports
    print()
    print(ratio_line("ckptkit / cp + sync (wall)", ours["wall_s"] / convert[CP]["wall_s"], 1.5))
    if TRANSFORMERS in convert:
        theirs = convert[TRANSFORMERS]
        print(f"ckptkit / transformers (wall): {ours['wall_s'] / theirs['wall_s']:.2f}x")
        print(
            ratio_line(
                "ckptkit / transformers (peak anonymous memory)",
                ours["peak_anon_bytes"] / theirs["peak_anon_bytes"],
                0.1,
            )
            + f" ({ours['peak_anon_bytes'] / mb:.0f} MB against "
            f"{theirs['peak_anon_bytes'] / mb:.0f} MB)"
        )
    else:
        print("ckptkit / transformers (wall; peak memory, target at most 0.1x): not measured")
    print(
        ratio_line(
            "ckptkit's peak anonymous memory above the imports / largest conversion set",
            above / info["largest_set_bytes"],
            2,
        )
        + f" ({ours['peak_anon_bytes'] / mb:.0f} MB - {imports / mb:.0f} MB = {above / mb:.0f} MB"
        f" against {info['largest_set_bytes'] / mb:.0f} MB)"
    )
    n = results["bit_for_bit"]
    if n is None:
        print("\nbit for bit against transformers' converter: not checked (no converter)")
        return
    equal = (
        n["bit_equal"] == n["tensors"] == n["converter_tensors"]
        and not n["only_ckptkit"]
        and not n["only_converter"]
    )
    print(
        f"\nbit for bit against transformers' converter: {'EQUAL' if equal else 'DIFFERENT'} "
        f"({n['bit_equal']} of {n['tensors']} tensors equal; the converter wrote "
        f"{n['converter_tensors']})"
    )
    for what in ("differ", "only_ckptkit", "only_converter"):
        if n[what]:
            print(f"  {what}: {', '.join(n[what][:10])}{' ...' if len(n[what]) > 10 else ''}")


if __name__ == "__main__":
    main()
