"""LoRA merge benchmarks: ckptkit merging a PEFT adapter into its base one tensor at a time,
against peft's ``merge_and_unload`` + ``save_pretrained`` and against copying the base's bytes,
interleaved in one run; then its peak memory as the base grows, and its merged values against
peft's and against an fp64 merge.

    python3 bench/adapters.py                  # a 1 GB bf16 Llama-shaped base (a minute to make)
    python3 bench/adapters.py --quick          # tiny; the test suite runs this so it keeps working
    python3 bench/adapters.py --size-gb 0.5 --repeat 3 --dir /tmp/ckptkit-adapters

The base is a random ``LlamaForCausalLM`` made from a config (nothing is downloaded; TinyLlama's
proportions: 8 query heads per key/value head, an MLP 2.75 times the width, a 32000-token
vocabulary, an untied head), saved with ``save_pretrained`` (safetensors, default sharding). The
adapter is peft's: r=16, lora_alpha=32 on every linear layer but the head (``all-linear``), B
random as well as A (``init_lora_weights=False``: the change is about as large as the weights, far
larger than a trained adapter's, so every rounding difference shows), saved with
``save_pretrained`` (fp32, as peft keeps an adapter of a bf16 model), its
``base_model_name_or_path`` pointing at the base. With ``--dir`` the models are kept there and
reused by later runs of the same size. ckptkit runs as ``ckptkit convert ADAPTER DST --base BASE``
(through its library call where the CLI has no ``--base``), writing DST/model.safetensors.

Measured as in ``bench/run.py`` (fresh process per run, shuffled turns, a settled disk and a warm
cache; peak anonymous memory sampled from /proc). Every way ends with its output on the disk:
ckptkit fsyncs what it writes, the others are followed by a sync of their files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import measure, python, run_once, run_ways, table  # noqa: E402

# Builds each missing model folder of argv[1] (a JSON list of [spec, folder]): base/, adapter/,
# and for a bf16 base adapter-bf16/ (the same adapter stored in bf16), then info.json, last.
MAKE = """
import json, math, sys
from pathlib import Path
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

for spec, folder in json.loads(sys.argv[1]):
    folder = Path(folder)
    torch.manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    shape = {k: v for k, v in spec.items() if k != "dtype"}
    model = LlamaForCausalLM._from_config(
        LlamaConfig(**shape, tie_word_embeddings=False), dtype=dtype
    )
    base = folder / "base"
    model.save_pretrained(base)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    adapter = folder / "adapter"
    get_peft_model(model, lora).save_pretrained(adapter)
    config = adapter / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "base_model_name_or_path": str(base)}, indent=2))
    weights = load_file(adapter / "adapter_model.safetensors")
    targets = {k.removeprefix("base_model.model.").replace(".lora_A", "")
               for k in weights if ".lora_A." in k}
    if dtype == torch.bfloat16:  # as an adapter trained and saved in bf16 would be
        (folder / "adapter-bf16").mkdir()
        (folder / "adapter-bf16" / config.name).write_text(config.read_text())
        save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
                  folder / "adapter-bf16" / "adapter_model.safetensors",
                  metadata={"format": "pt"})
    sizes = {}
    for path in base.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                sizes[key] = math.prod(f.get_slice(key).get_shape()) * dtype.itemsize
    info = {
        "spec": spec,
        "tie_word_embeddings": False,
        "base_bytes": sum(p.stat().st_size for p in base.iterdir()),
        "base_files": sorted(p.name for p in base.iterdir()),
        "tensors": len(sizes),
        "largest_tensor_bytes": max(sizes.values()),
        "merged_tensors": len(targets),
        "largest_merged_tensor_bytes": max(sizes[k] for k in targets),
        "adapter_bytes": (adapter / "adapter_model.safetensors").stat().st_size,
    }
    (folder / "info.json").write_text(json.dumps(info, indent=2))
"""

PEFT = """
import os
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({base!r}, dtype=torch.{dtype})
model = PeftModel.from_pretrained(model, {adapter!r}{extra}).merge_and_unload()
model.save_pretrained({out!r})
for name in os.listdir({out!r}):  # on the disk, as ckptkit's fsynced output is
    fd = os.open(os.path.join({out!r}, name), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
"""

# ckptkit's library call, for as long as `ckptkit convert` has no --base (see ckptkit_argv).
LIBRARY = """
from ckptkit.adapters import AdapterOptions
from ckptkit.convert import ReadOptions, convert_checkpoint
convert_checkpoint({adapter!r}, {dst!r}, read=ReadOptions(adapters=AdapterOptions(base={base!r})),
                   force=True)
"""

# Each case's merged tensors, peft's against ckptkit's, both against an fp64 merge of the base
# and adapter files: W + scale * B @ A in float64 (exact for these inputs up to the sum's own
# rounding, 2^-53 relative), and that merge rounded once to the base's dtype.
COMPARE = """
import json, sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file

INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def ordered(t):
    # The float's bits as integers that count ulps: neighbours differ by 1, -0 == +0.
    bits = t.view(INT[t.dtype]).to(torch.int64)
    top = 1 << (8 * t.element_size() - 1)
    return torch.where(bits < 0, -(bits + top), bits)


def from_ordered(o, dtype):
    top = 1 << (8 * dtype.itemsize - 1)
    return torch.where(o < 0, -o - top, o).to(INT[dtype]).view(dtype)


def nearest(ref, dtype):
    # ref rounded once: torch's cast goes through float32 for bf16 (it can round twice), so
    # take the closest of its result and that result's two neighbours.
    best = ref.to(dtype)
    err = (best.double() - ref).abs()
    for step in (-1, 1):
        other = from_ordered(ordered(best) + step, dtype)
        e = (other.double() - ref).abs()
        closer = e < err
        best, err = torch.where(closer, other, best), torch.where(closer, e, err)
    return best


results = {}
for case in json.loads(sys.argv[1]):
    config = json.load(open(case["adapter"] + "/adapter_config.json"))
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / r ** 0.5 if config.get("use_rslora") else alpha / r
    lora = {}
    for key, value in load_file(case["adapter"] + "/adapter_model.safetensors").items():
        module, _, which = key.removeprefix("base_model.model.").rpartition(".lora_")
        lora.setdefault(module + ".weight", {})[which[0]] = value.double()
    n = dict(tensors=0, bit_equal=0, merged_tensors=0, elements=0, equal=0, one_ulp=0,
             more=0, max_ulps=0, ckptkit_closer=0, peft_closer=0, as_close=0,
             ckptkit_nearest=0, peft_nearest=0)
    with safe_open(case["peft"], "pt") as p, safe_open(case["ckptkit"], "pt") as c, \\
            safe_open(case["base"], "pt") as b:
        assert set(p.keys()) == set(c.keys()), set(p.keys()) ^ set(c.keys())
        for key in sorted(p.keys()):
            theirs, ours = p.get_tensor(key), c.get_tensor(key)
            assert theirs.dtype == ours.dtype and theirs.shape == ours.shape, key
            ulps = (ordered(theirs) - ordered(ours)).abs()
            n["tensors"] += 1
            n["bit_equal"] += int(not ulps.any())
            if key not in lora:
                continue
            ref = b.get_tensor(key).double() + scale * (lora[key]["B"] @ lora[key]["A"])
            n["merged_tensors"] += 1
            n["elements"] += ulps.numel()
            n["equal"] += int((ulps == 0).sum())
            n["one_ulp"] += int((ulps == 1).sum())
            n["more"] += int((ulps > 1).sum())
            n["max_ulps"] = max(n["max_ulps"], int(ulps.max()))
            differ = ulps > 0
            ours_err, theirs_err = (ours.double() - ref).abs(), (theirs.double() - ref).abs()
            n["ckptkit_closer"] += int((differ & (ours_err < theirs_err)).sum())
            n["peft_closer"] += int((differ & (theirs_err < ours_err)).sum())
            n["as_close"] += int((differ & (theirs_err == ours_err)).sum())
            best = ordered(nearest(ref, ours.dtype))
            n["ckptkit_nearest"] += int((ordered(ours) == best).sum())
            n["peft_nearest"] += int((ordered(theirs) == best).sum())
    results[case["name"]] = n
print(json.dumps(results))
"""

# The quick run's models: tiny, so the test suite's run takes seconds beyond the imports.
QUICK = {"hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4}
QUICK |= {"num_key_value_heads": 2, "vocab_size": 1000}


def llama_spec(total_bytes: int, dtype: str, *, width: int) -> dict:
    """A Llama config of about ``total_bytes`` in TinyLlama's proportions: ``width`` wide,
    heads of 64 with one key/value head per 8 query heads, an MLP 2.75 times as wide, a
    32000-token vocabulary and an untied head; as many layers as fit, at least one."""
    heads, vocab, inner = width // 64, 32000, width * 11 // 4
    kv = max(1, heads // 8)
    per_layer = 2 * width * width + 2 * width * kv * 64 + 3 * width * inner + 2 * width
    fixed = 2 * vocab * width + width
    itemsize = 4 if dtype == "float32" else 2
    layers = max(1, round((total_bytes / itemsize - fixed) / per_layer))
    return {
        "hidden_size": width,
        "intermediate_size": inner,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "num_hidden_layers": layers,
        "dtype": dtype,
    }


def folder_of(root: Path, spec: dict) -> Path:
    return root / (
        f"llama-{spec['dtype']}-h{spec['hidden_size']}-l{spec['num_hidden_layers']}"
        f"-v{spec['vocab_size']}"
    )


def make(root: Path, specs: list[dict]) -> list[dict]:
    """Each spec's base and adapter (made in one child process, which this one never is: it
    does not import torch, so the peak RSS its children inherit at fork stays small), reused
    when a finished one is already there. Returns each one's info.json, with its paths."""
    todo = []
    for spec in specs:
        folder = folder_of(root, spec)
        if not (folder / "info.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a half-made one
            folder.mkdir(parents=True)
            todo.append([spec, str(folder)])
    if todo:
        made = subprocess.run(python(MAKE) + [json.dumps(todo)], capture_output=True, text=True)
        if made.returncode:
            raise SystemExit(f"making the models failed:\n{made.stderr[-4000:]}")
    infos = []
    for spec in specs:
        folder = folder_of(root, spec)
        info = json.loads((folder / "info.json").read_text())
        info.update(
            folder=str(folder),
            base=str(folder / "base"),
            adapter=str(folder / "adapter"),
            inputs=[str(p) for p in sorted((folder / "base").iterdir())]
            + [str(p) for p in sorted((folder / "adapter").iterdir())],
        )
        infos.append(info)
    return infos


def has_cli_base() -> bool:
    """Whether ``ckptkit convert`` takes ``--base`` yet (else its library call is timed)."""
    shown = subprocess.run(
        [sys.executable, "-m", "ckptkit", "convert", "--help"], capture_output=True, text=True
    )
    return "--base" in shown.stdout


def ckptkit_argv(adapter: str, base: str, dst: Path, cli: bool) -> list[str]:
    """ckptkit merging ``adapter`` into ``base``, written to ``dst`` and read back (verified)."""
    if cli:
        return [
            *(sys.executable, "-m", "ckptkit", "convert", adapter, str(dst)),
            *("--base", base, "--force", "-q"),
        ]
    return python(LIBRARY.format(adapter=adapter, dst=str(dst), base=base))


def peft_argv(base: str, adapter: str, out: Path, dtype: str, extra: str = "") -> list[str]:
    return python(PEFT.format(base=base, adapter=adapter, out=str(out), dtype=dtype, extra=extra))


def merge_ways(info: dict, folder: Path, cli: bool) -> dict[str, list[str]]:
    base, adapter = info["base"], info["adapter"]
    dtype = info["spec"]["dtype"]
    cp = folder / "out-cp"
    return {
        "ckptkit convert --base (verified)": ckptkit_argv(
            adapter, base, folder / "out-ckptkit" / "model.safetensors", cli
        ),
        "peft merge_and_unload + save_pretrained": peft_argv(
            base, adapter, folder / "out-peft", dtype
        ),
        "cp -r of the base, then sync": ["sh", "-c", f"cp -r '{base}' '{cp}' && sync '{cp}'/*"],
        "import torch (alone)": python("import torch"),
    }


def correctness(info: dict, fp32: dict, folder: Path, cli: bool) -> dict:
    """peft's merged tensors against ckptkit's, run afresh (the timed runs' outputs are gone):
    the bf16 base with peft's defaults, the same with the adapter stored in bf16 and held in
    bf16 by peft (``autocast_adapter_dtype=False``: peft rounds the delta to bf16, then the
    sum), and an fp32 base."""
    cases = [
        ("bf16 base, fp32 adapter (peft's defaults)", info, "adapter", ""),
        (
            "bf16 base, bf16 adapter, autocast_adapter_dtype=False",
            info,
            "adapter-bf16",
            ", autocast_adapter_dtype=False",
        ),
        ("fp32 base, fp32 adapter", fp32, "adapter", ""),
    ]
    todo = []
    for i, (name, model, adapter_name, extra) in enumerate(cases):
        adapter = str(Path(model["folder"]) / adapter_name)
        peft_out, ckptkit_out = folder / f"check-{i}-peft", folder / f"check-{i}-ckptkit"
        dtype = model["spec"]["dtype"]
        run_once(peft_argv(model["base"], adapter, peft_out, dtype, extra))
        run_once(ckptkit_argv(adapter, model["base"], ckptkit_out / "model.safetensors", cli))
        todo.append(
            {
                "name": name,
                "base": str(Path(model["base"]) / "model.safetensors"),
                "adapter": adapter,
                "peft": str(peft_out / "model.safetensors"),
                "ckptkit": str(ckptkit_out / "model.safetensors"),
            }
        )
    compared = subprocess.run(python(COMPARE) + [json.dumps(todo)], capture_output=True, text=True)
    if compared.returncode:
        raise SystemExit(f"comparing the merges failed:\n{compared.stderr[-4000:]}")
    for case in todo:
        shutil.rmtree(Path(case["peft"]).parent)
        shutil.rmtree(Path(case["ckptkit"]).parent)
    return json.loads(compared.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, 1 repeat")
    parser.add_argument("--size-gb", type=float, default=1.0, help="bf16 base size")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--dir",
        type=Path,
        help="where to make (and keep, for later runs) the models (default: a temp dir)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    if args.quick:
        full = {**QUICK, "num_hidden_layers": 2, "dtype": "bfloat16"}
        half = {**full, "num_hidden_layers": 1}
        fp32 = {**full, "dtype": "float32"}
    else:  # the half-size base keeps the widths (so the largest tensor), with fewer layers
        size = int(args.size_gb * 1e9)
        width = 2048 if size >= 5 * 10**8 else 1024
        full = llama_spec(size, "bfloat16", width=width)
        half = llama_spec(size // 2, "bfloat16", width=width)
        # A small fp32 base is enough to show bit-equality.
        fp32 = {**llama_spec(0, "float32", width=512), "vocab_size": 4000, "num_hidden_layers": 2}
    cli = has_cli_base()
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        root = args.dir or folder
        info, half_info, fp32_info = make(root, [full, half, fp32])
        ways = merge_ways(info, folder, cli)
        outputs = (folder / "out-ckptkit", folder / "out-peft", folder / "out-cp")
        inputs = tuple(Path(p) for p in info["inputs"])
        results: dict = {
            "model": {k: v for k, v in info.items() if k != "inputs"},
            "ckptkit_call": "cli" if cli else "library",
        }
        results["merge"] = run_ways(ways, repeat, outputs, inputs)
        results["flat_memory"] = {}
        for name, model in (("half", half_info), ("full", info)):
            argv = ckptkit_argv(
                model["adapter"], model["base"], outputs[0] / "model.safetensors", cli
            )
            results["flat_memory"][name] = {
                **measure(argv, outputs[:1], tuple(Path(p) for p in model["inputs"])),
                "base_bytes": model["base_bytes"],
                "largest_tensor_bytes": model["largest_tensor_bytes"],
                "layers": model["spec"]["num_hidden_layers"],
            }
        shutil.rmtree(outputs[0], ignore_errors=True)
        results["correctness"] = correctness(info, fp32_info, folder, cli)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    report(results, repeat)


def report(results: dict, repeat: int) -> None:
    info, merge = results["model"], results["merge"]
    spec, mb = info["spec"], 1e6
    print(
        f"base: {info['base_bytes'] / 1e9:.2f} GB bf16 Llama ({spec['num_hidden_layers']} layers, "
        f"width {spec['hidden_size']}, untied head; {info['tensors']} tensors, largest "
        f"{info['largest_tensor_bytes'] / mb:.0f} MB), adapter: r=16 on "
        f"{info['merged_tensors']} linear layers, {info['adapter_bytes'] / mb:.1f} MB fp32; "
        f"ckptkit called through its {results['ckptkit_call']}; repeats: {repeat}, "
        f"{os.cpu_count()} cores\n"
    )
    ckptkit = merge["ckptkit convert --base (verified)"]
    peft = merge["peft merge_and_unload + save_pretrained"]
    cp_name = "cp -r of the base, then sync"
    print(table("merge a LoRA adapter into its base", merge, cp_name))
    print("every run:", {name: [round(w, 2) for w in r["walls_s"]] for name, r in merge.items()})
    torch_alone = merge["import torch (alone)"]["peak_anon_bytes"]
    bound = 2 * info["largest_tensor_bytes"] + info["adapter_bytes"]
    print(
        f"\npeft / ckptkit: {peft['wall_s'] / ckptkit['wall_s']:.1f}x (target: at least 5x); "
        f"ckptkit / cp + sync: {ckptkit['wall_s'] / merge[cp_name]['wall_s']:.1f}x "
        f"(target: at most 2x)"
    )
    print(
        f"ckptkit's peak anonymous memory: {ckptkit['peak_anon_bytes'] / mb:.0f} MB, "
        f"{(ckptkit['peak_anon_bytes'] - torch_alone) / mb:+.0f} MB above torch alone; target: "
        f"2 x largest tensor ({info['largest_tensor_bytes'] / mb:.0f} MB; largest merged: "
        f"{info['largest_merged_tensor_bytes'] / mb:.0f} MB) + adapter "
        f"({info['adapter_bytes'] / mb:.1f} MB) = {bound / mb:.0f} MB\n"
    )
    print("ckptkit as the base grows (same widths, more layers)")
    print("| base | layers | wall | peak anonymous memory | peak RSS |\n|---|---|---|---|---|")
    for r in results["flat_memory"].values():
        anon, rss = r["peak_anon_bytes"] / mb, r["peak_rss_bytes"] / mb
        print(
            f"| {r['base_bytes'] / 1e9:.2f} GB | {r['layers']} | {r['wall_s']:.2f} s | "
            f"{anon:.0f} MB | {rss:.0f} MB |"
        )
    print(
        "\nmerged values, peft's against ckptkit's, in ulps of the base's dtype at the merged "
        "value (where W and the change nearly cancel, a rounding of the change is many of "
        "those); closer: to the fp64 merge W + scale * B @ A; nearest: equal to that merge "
        "rounded once"
    )
    print(
        "| case | tensors bit-equal | merged elements | equal | 1 ulp apart | more | "
        "of those apart, ckptkit closer / peft closer / as close | nearest: ckptkit / peft |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, n in results["correctness"].items():
        elements = n["elements"]
        print(
            f"| {name} | {n['bit_equal']} of {n['tensors']} | {elements:,} | {n['equal']:,} | "
            f"{n['one_ulp']:,} | {n['more']:,} (max {n['max_ulps']}) | "
            f"{n['ckptkit_closer']:,} / {n['peft_closer']:,} / {n['as_close']:,} | "
            f"{n['ckptkit_nearest'] / elements:.4%} / {n['peft_nearest'] / elements:.4%} |"
        )


if __name__ == "__main__":
    main()
