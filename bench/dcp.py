"""DCP benchmarks: a checkpoint written by a 2-rank FSDP2 job with torch's own ``dcp.save``
(model plus Adam state), converted by ckptkit and by torch's own tools, interleaved in one run.

    python3 bench/dcp.py                # about 2 GB (a minute to make)
    python3 bench/dcp.py --quick        # small; the test suite runs this so it keeps working
    python3 bench/dcp.py --size-gb 4 --repeat 5 --dir /big/disk

Measured as in ``bench/run.py`` (fresh process per run, shuffled turns, a settled disk and a
warm cache; peak anonymous memory sampled from /proc).
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

from run import measure, python, run_ways, table  # noqa: E402

# A 2-rank FSDP2 job: an MLP sharded with fully_shard, one Adam step (so the optimizer holds
# exp_avg and exp_avg_sq), saved with dcp.save as {"model": ..., "optim": ...}, and its weights
# saved again with DCP's HuggingFaceStorageWriter beside it (<out>-hf).
MAKE = """
import os
import sys
from datetime import timedelta
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

out, width, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", timeout=timedelta(seconds=300))
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optim = torch.optim.Adam(model.parameters(), lr=1e-3)
model(torch.randn(2, width)).sum().backward()
optim.step()
msd, osd = get_state_dict(model, optim)
dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
# The Hugging Face writer's flavour of the same weights: one safetensors file per rank.
writer = dcp.HuggingFaceStorageWriter(out + "-hf", save_distributed=True)
dcp.save(msd, storage_writer=writer)
dist.barrier()  # no rank tears the group down while another still uses it
dist.destroy_process_group()
os._exit(0)  # no interpreter finalization: gloo's threads can abort it (see tests/test_fsdp.py)
"""

TORCH_WAY = """
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
dcp_to_torch_save({src!r}, {tmp!r})
state = torch.load({tmp!r}, weights_only=True)["model"]
save_file({{k: v.contiguous() for k, v in state.items()}}, {dst!r}, metadata={{"format": "pt"}})
"""

TORCH_SAVE = """
import torch
from safetensors.torch import load_file
torch.save(load_file({src!r}), {dst!r})
"""

CONSOLIDATE = """
import glob, os
from safetensors import safe_open
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
keys = set()
for name in glob.glob(os.path.join({src!r}, "*.safetensors")):
    with safe_open(name, "pt") as f:
        keys.update(f.keys())
os.makedirs({dst!r}, exist_ok=True)
consolidate_safetensors_files({src!r}, {dst!r}, dict.fromkeys(keys, 1))
"""

DCP_SAVE = """
import shutil, torch, torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
shutil.rmtree({dst!r}, ignore_errors=True)
dcp.save(load_file({src!r}), checkpoint_id={dst!r})
"""


def cp_sync(src: Path, dst: Path) -> list[str]:
    """cp, then the file forced to the disk: ckptkit fsyncs what it writes, cp alone does not."""
    return ["sh", "-c", f"cp '{src}' '{dst}' && sync '{dst}'"]


def make(folder: Path, total_bytes: int) -> dict:
    """The DCP checkpoint: weights about a third of it (Adam keeps two more copies)."""
    width = 256 if total_bytes < 2**27 else 4096
    layers = max(1, total_bytes // 3 // (width * width * 4))
    script = folder.with_name(folder.name + "_make.py")
    script.write_text(MAKE)
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(folder),
            str(width),
            str(layers),
        ],
        text=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if made.returncode != 0:  # what the ranks said, not only that torchrun failed
        raise SystemExit(f"making the DCP checkpoint failed:\n{made.stderr[-4000:]}")
    script.unlink()
    size = sum(p.stat().st_size for p in folder.iterdir())
    hf = sum(p.stat().st_size for p in folder.with_name(folder.name + "-hf").iterdir())
    return {"bytes": size, "hf_bytes": hf, "width": width, "layers": layers}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small files, 1 repeat")
    parser.add_argument("--size-gb", type=float, default=2.0, help="DCP checkpoint size")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    size = 24_000_000 if args.quick else int(args.size_gb * 1e9)
    repeat = 1 if args.quick else args.repeat
    ckptkit = [sys.executable, "-m", "ckptkit"]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        src, out = folder / "dcp", folder / "model.safetensors"
        info = make(src, size)
        files = tuple(sorted(src.iterdir()))
        s, o = str(src), str(out)
        subprocess.run([*ckptkit, "convert", s, str(folder / "ref.safetensors"), "-q"], check=True)
        ref = folder / "ref.safetensors"
        info["model_bytes"] = ref.stat().st_size
        results: dict = {"checkpoint": info}
        results["inspect"] = run_ways(
            {
                "ckptkit inspect --json": [*ckptkit, "inspect", s, "--json"],
                "import torch (alone)": python("import torch"),
            },
            repeat * 2,
            inputs=files,
        )
        results["to safetensors"] = run_ways(
            {
                "ckptkit convert (verified)": [*ckptkit, "convert", s, o, "--force", "-q"],
                "dcp_to_torch_save + torch.load + save_file": python(
                    TORCH_WAY.format(src=s, tmp=str(folder / "full.pt"), dst=o)
                ),
                "cp of the model's bytes": ["cp", str(ref), o],
                "cp, then sync of the file": cp_sync(ref, out),
            },
            repeat,
            (out, folder / "full.pt"),
            files,
        )
        hf, consolidated = folder / "dcp-hf", folder / "consolidated"
        results["hf writer to safetensors"] = run_ways(
            {
                "ckptkit convert (verified)": [*ckptkit, "convert", str(hf), o, "--force", "-q"],
                "consolidate_safetensors_files": python(
                    CONSOLIDATE.format(src=str(hf), dst=str(consolidated))
                ),
                "cp of the model's bytes": ["cp", str(ref), o],
                "cp, then sync of the file": cp_sync(ref, out),
            },
            repeat,
            (out, consolidated),
            tuple(sorted(hf.iterdir())),
        )
        pt, dcp_out = folder / "model.pt", folder / "out-dcp"
        results["to .pt and dcp"] = run_ways(
            {
                "ckptkit convert to .pt": [*ckptkit, "convert", str(ref), str(pt), "--force", "-q"],
                "load_file + torch.save": python(TORCH_SAVE.format(src=str(ref), dst=str(pt))),
                "ckptkit convert --to dcp": [
                    *ckptkit,
                    "convert",
                    str(ref),
                    str(dcp_out),
                    "--to",
                    "dcp",
                    "--force",
                    "-q",
                ],
                "load_file + dcp.save": python(DCP_SAVE.format(src=str(ref), dst=str(dcp_out))),
                "cp of the model's bytes": ["cp", str(ref), o],
                "cp, then sync of the file": cp_sync(ref, out),
            },
            repeat,
            (pt, out),
            (ref,),
        )
        results["flat_memory"] = {}
        if not args.quick:  # peak memory as the checkpoint grows: half the size, then this one
            half = folder / "half"
            made = make(half, size // 2)
            for name, path in (("half", half), ("full", src)):
                argv = [*ckptkit, "convert", str(path), o, "--force", "-q"]
                results["flat_memory"][name] = {
                    **measure(argv, (out,), tuple(path.iterdir())),
                    "bytes": made["bytes"] if name == "half" else info["bytes"],
                }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"DCP checkpoint: {info['bytes'] / 1e9:.2f} GB from 2 FSDP2 ranks "
        f"(the Hugging Face writer's: {info['hf_bytes'] / 1e9:.2f} GB) "
        f"({info['model_bytes'] / 1e9:.2f} GB of weights), repeats: {repeat}, "
        f"{os.cpu_count()} cores\n"
    )
    print(table("inspect", results["inspect"], "ckptkit inspect --json"), end="\n\n")
    print(
        table("DCP folder to safetensors", results["to safetensors"], "ckptkit convert (verified)"),
        end="\n\n",
    )
    hf_title = "DCP folder (Hugging Face writer) to safetensors"
    print(
        table(hf_title, results["hf writer to safetensors"], "ckptkit convert (verified)"),
        end="\n\n",
    )
    print(
        table(
            "safetensors to .pt and to a DCP folder",
            results["to .pt and dcp"],
            "ckptkit convert to .pt",
        ),
        end="\n\n",
    )
    for name, r in results["flat_memory"].items():
        print(
            f"flat memory, {name} ({r['bytes'] / 1e9:.2f} GB): "
            f"peak anonymous {r['peak_anon_bytes'] / 2**20:.0f} MiB"
        )


if __name__ == "__main__":
    main()
