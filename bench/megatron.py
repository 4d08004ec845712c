"""Megatron benchmarks: ckptkit merging a legacy Megatron-LM save (``mp_rank_TT`` files of a
tensor-parallel run) into one safetensors file, and mapping it to a Hugging Face folder with
``--map megatron-llama``, against the whole-state-dict way (every rank loaded with torch, the
slices joined with ``torch.cat``, ``save_file``) and against copying the output's bytes,
interleaved in one run; then ckptkit's merge against the whole-state-dict way's, bit for bit.

    python3 bench/megatron.py                   # a 1 GB bf16 Llama-like model at TP=2, 3 repeats
    python3 bench/megatron.py --quick           # tiny; tests/project/test_bench.py runs this
    python3 bench/megatron.py --size-gb 2 --tp 4 --repeat 5 --dir /tmp/ckptkit-megatron

The save is made here (megatron-core runs on this machine only for the tiny fixtures): a TP=1
state dict in megatron-core's names (grouped-query ``linear_qkv``, SwiGLU ``linear_fc1``,
RMSNorm, an untied output layer; bf16, seeded) cut into ranks by megatron-core's own rules,
the ones ``tests/formats/test_megatron.py`` checks ckptkit's merge against on saves
megatron-core wrote itself (``fixtures/make_megatron.py``): column-parallel tensors by rows
(SwiGLU's ``[gate; up]`` as ``[gate_r; up_r]`` per rank), row-parallel by columns, norms on
every rank; each rank's file is ``torch.save`` of Megatron-LM's dict (``args``, ``iteration``,
``checkpoint_version``, ``model`` with its ``_extra_state`` entries). With ``--dir`` it is kept
and reused by later runs of the same shape.

The ways:

- ``ckptkit convert SAVE merged.safetensors``: the ranks merged, fsynced, read back and compared
  (its default);
- ``ckptkit convert SAVE hf --map megatron-llama``: merged and mapped to Hugging Face;
- ``ckptkit convert SAVE recut --to megatron --tp N``: merged and cut again into another
  tensor-parallel size (4, or 2 from a save at TP=4), a legacy save's rank files;
- the whole-state-dict way: ``torch.load`` of every rank file, the slices joined with
  ``torch.cat`` by the same rules, ``safetensors.torch.save_file``, then an fsync;
- the anchor: ``cp`` of ckptkit's merged file, then ``sync`` of the copy;
- the imports alone (what ckptkit's convert imports: a merge never imports torch).

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

# The save for params argv[1] in argv[2] tensor-parallel ranks, in folder argv[3]; info.json
# last (a half-made folder lacks it). Its own process, so that this one never imports torch.
MAKE = r"""
import argparse, collections, json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file

p, tp, folder = json.loads(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
gen = torch.Generator().manual_seed(0)
dim, heads, groups = p["dim"], p["heads"], p["groups"]
ffn, vocab, layers = p["ffn"], p["vocab"], p["layers"]
hd = dim // heads

def w(*shape):
    return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

whole = {"embedding.word_embeddings.weight": w(vocab, dim)}
for i in range(layers):
    q = f"decoder.layers.{i}."
    whole[q + "input_layernorm.weight"] = (1 + w(dim)).to(torch.bfloat16)
    whole[q + "self_attention.linear_proj.weight"] = w(dim, heads * hd)
    whole[q + "self_attention.linear_qkv.weight"] = w((heads + 2 * groups) * hd, dim)
    whole[q + "pre_mlp_layernorm.weight"] = (1 + w(dim)).to(torch.bfloat16)
    whole[q + "mlp.linear_fc1.weight"] = w(2 * ffn, dim)
    whole[q + "mlp.linear_fc2.weight"] = w(dim, ffn)
whole["decoder.final_layernorm.weight"] = (1 + w(dim)).to(torch.bfloat16)
whole["output_layer.weight"] = w(vocab, dim)

def piece(key, t, r):
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return t.chunk(tp, dim=1)[r]
    if key.endswith("linear_fc1.weight"):  # [gate; up] -> [gate_r; up_r]
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
    if key.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return t.chunk(tp, dim=0)[r]
    return t

args = argparse.Namespace(
    num_layers=layers, hidden_size=dim, ffn_hidden_size=ffn, num_attention_heads=heads,
    group_query_attention=True, num_query_groups=groups, kv_channels=hd,
    max_position_embeddings=4096, seq_length=4096, vocab_size=vocab, padded_vocab_size=vocab,
    tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, swiglu=True,
    normalization="RMSNorm", layernorm_epsilon=1e-5, position_embedding_type="rope",
    rotary_base=10000, rotary_interleaved=False, untie_embeddings_and_output_weights=True,
    add_bias_linear=False, params_dtype=torch.bfloat16, bf16=True,
)
for r in range(tp):
    model = collections.OrderedDict()
    for key, t in whole.items():
        model[key] = piece(key, t, r).clone()
        if key.endswith(("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight")):
            model[key.removesuffix("weight") + "_extra_state"] = None
    (folder / "iter_0000001" / f"mp_rank_{r:02d}").mkdir(parents=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model}
    torch.save(state, folder / "iter_0000001" / f"mp_rank_{r:02d}" / "model_optim_rng.pt")
(folder / "latest_checkpointed_iteration.txt").write_text("1")
save_file(whole, folder.parent / (folder.name + "-whole.safetensors"))
sizes = {k: t.numel() * 2 for k, t in whole.items()}
largest = max(sizes, key=sizes.get)
info = {"params": p, "tp": tp, "bytes": sum(sizes.values()), "tensors": len(whole),
        "largest_set_key": largest, "largest_set_bytes": sizes[largest]}
(folder / "info.json").write_text(json.dumps(info, indent=2))
"""

# The whole-state-dict way: every rank loaded, joined with torch.cat, saved, fsynced.
WHOLE = r"""
import os, sys
from pathlib import Path
import torch
from safetensors.torch import save_file

folder, out = Path(sys.argv[1]), sys.argv[2]
ranks = sorted((folder / "iter_0000001").glob("mp_rank_*/model_optim_rng.pt"))
states = [torch.load(f, map_location="cpu", weights_only=False)["model"] for f in ranks]
merged = {}
for key in states[0]:
    if key.endswith("_extra_state"):
        continue
    parts = [s[key] for s in states]
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        merged[key] = torch.cat(parts, dim=1)
    elif key.endswith("linear_fc1.weight"):
        halves = [p.chunk(2) for p in parts]
        merged[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    elif key.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        merged[key] = torch.cat(parts, dim=0)
    else:
        merged[key] = parts[0]
save_file(merged, out)
fd = os.open(out, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
"""

# Two safetensors files' tensors compared as bytes (dtype and shape too).
COMPARE = r"""
import json, sys
import torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
same = sorted(a) == sorted(b) and all(
    a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
    and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
    for k in a
)
print(json.dumps({"tensors": len(a), "equal": same}))
"""

MERGE = "ckptkit convert (merge, verified)"
MAPPED = "ckptkit convert --map megatron-llama (verified)"
WHOLE_WAY = "whole state dict: torch.load + torch.cat + save_file + fsync"
CP = "cp of ckptkit's merged file, then sync"
IMPORTS = "import ckptkit's convert (alone)"
RECUT = "ckptkit convert --to megatron (cut to another TP, verified)"


def model_params(total_bytes: int) -> dict:
    """A Llama-like model of about ``total_bytes`` in bf16: 16 query heads in 4 groups, SwiGLU,
    an untied head; width 2048 and a 32000-token vocabulary from 0.5 GB, narrower below."""
    dim, vocab = (2048, 32000) if total_bytes >= 5 * 10**8 else (256, 8192)
    ffn = 256 * math.ceil(8 * dim / 3 / 256)
    hd = dim // 16
    per_layer = 2 * (dim * dim + (16 + 8) * hd * dim + 3 * ffn * dim + 2 * dim)
    fixed = 2 * (2 * vocab * dim + dim)
    layers = max(1, math.ceil((total_bytes - fixed) / per_layer))
    return {"dim": dim, "heads": 16, "groups": 4, "ffn": ffn, "vocab": vocab, "layers": layers}


def make(root: Path, params: dict, tp: int) -> dict:
    folder = root / f"megatron-d{params['dim']}-l{params['layers']}-tp{tp}"
    if not (folder / "info.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)  # a half-made one
        folder.mkdir(parents=True)
        argv = python(MAKE) + [json.dumps(params), str(tp), str(folder)]
        run_once(argv, "making the Megatron save")
    info = json.loads((folder / "info.json").read_text())
    info["folder"] = str(folder)
    info["whole"] = str(folder.parent / (folder.name + "-whole.safetensors"))
    info["inputs"] = [str(p) for p in sorted(folder.rglob("*.pt"))]
    return info


def ckptkit_argv(save: str, out: Path, *extra: str) -> list[str]:
    force = [] if "megatron" in extra else ["--force"]  # a Megatron save goes to a new folder
    return [sys.executable, "-m", "ckptkit", "convert", save, str(out), *extra, *force, "-q"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model (0.02 GB), 1 repeat")
    parser.add_argument("--size-gb", type=float, default=1.0, help="bf16 model size")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (1, 2 or 4)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to make (and keep) the save")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.tp not in (1, 2, 4):  # 4 query groups: more ranks than that would split one
        parser.error("--tp must be 1, 2 or 4")
    repeat = 1 if args.quick else args.repeat
    params = model_params(int((0.02 if args.quick else args.size_gb) * 1e9))
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        info = make(args.dir or folder, params, args.tp)
        ref = folder / "ref.safetensors"
        run_once(ckptkit_argv(info["folder"], ref))
        out_cp, merged, mapped, whole, recut = (
            folder / n
            for n in ("cp.safetensors", "merged.safetensors", "hf", "whole.safetensors", "recut")
        )
        other_tp = "2" if args.tp == 4 else "4"
        ways = {
            MERGE: ckptkit_argv(info["folder"], merged),
            MAPPED: ckptkit_argv(info["folder"], mapped, "--map", "megatron-llama"),
            RECUT: ckptkit_argv(info["folder"], recut, "--to", "megatron", "--tp", other_tp),
            WHOLE_WAY: python(WHOLE) + [info["folder"], str(whole)],
            CP: ["sh", "-c", f"cp '{ref}' '{out_cp}' && sync '{out_cp}'"],
            IMPORTS: python("import ckptkit.cli, ckptkit.convert"),
        }
        outputs = (merged, mapped, whole, out_cp, recut)
        inputs = tuple(Path(p) for p in info["inputs"])
        results: dict = {"model": {k: v for k, v in info.items() if k != "inputs"}}
        results["output_bytes"] = ref.stat().st_size
        results["convert"] = run_ways(ways, repeat, outputs, inputs)
        run_once(python(WHOLE) + [info["folder"], str(whole)])
        checks = {}
        for name, other in (("whole_state_dict", whole), ("tp1_model", Path(info["whole"]))):
            compared = run_once(python(COMPARE) + [str(ref), str(other)], "comparing the outputs")
            checks[name] = json.loads(compared)
        results["bit_for_bit"] = checks
    if args.json:
        print(json.dumps(results, indent=2))
        return
    report(results, repeat)


def report(results: dict, repeat: int) -> None:
    info, convert = results["model"], results["convert"]
    p = info["params"]
    print(
        f"Megatron save: {info['bytes'] / 1e9:.2f} GB bf16 in {info['tp']} tensor-parallel ranks "
        f"({p['layers']} layers, dim {p['dim']}, {p['heads']} heads in {p['groups']} groups, "
        f"SwiGLU {p['ffn']}, vocabulary {p['vocab']}; {info['tensors']} tensors); repeats: "
        f"{repeat}, {os.cpu_count()} cores\n"
    )
    print(table("Megatron legacy save, merged", convert, CP))
    print("every run:", {name: [round(w, 2) for w in r["walls_s"]] for name, r in convert.items()})
    cp, whole = convert[CP]["wall_s"], convert[WHOLE_WAY]
    print()
    for name in (MERGE, MAPPED, RECUT):
        ours = convert[name]
        print(ratio_line(f"{name} / cp + sync (wall)", ours["wall_s"] / cp, 1.5))
        print(
            ratio_line(
                f"{name} / whole state dict (peak anonymous memory)",
                ours["peak_anon_bytes"] / whole["peak_anon_bytes"],
                1 / 8,
            )
            + f" ({ours['peak_anon_bytes'] / 1e6:.0f} MB against "
            f"{whole['peak_anon_bytes'] / 1e6:.0f} MB)"
        )
        print(f"{name} / whole state dict (wall): {ours['wall_s'] / whole['wall_s']:.2f}x")
    checks = results["bit_for_bit"]
    for name, check in checks.items():
        verdict = "EQUAL" if check["equal"] else "DIFFERENT"
        what = name.replace("_", " ")
        print(f"ckptkit's merge against the {what}: {verdict} ({check['tensors']} tensors)")


if __name__ == "__main__":
    main()
