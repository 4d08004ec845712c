"""Remote benchmarks: ckptkit reading a checkpoint at a URL from a throttled loopback HTTP server,
against downloading it first (``fsspec get``), and a conversion spread over two processes
against the speed-up the disk itself allows two writers.

    python3 bench/remote.py                 # a 2 GB remote checkpoint, a 4 GB sharded output
    python3 bench/remote.py --quick         # small; the test suite runs this so it keeps working
    python3 bench/remote.py --only convert --size-gb 4 --repeat 5 --dir /big/disk

The server is tests/support/servers.py's ``RangeServer``, run in this process's threads while
the ways run as children; each request is answered after ``--latency-ms`` and its body paced on
its own to ``--rate-mbs`` (per request, so N requests in flight get N times the rate, as from an
object store). Its sockets are TCP_NODELAY, as production servers set theirs (tests/support/
servers.py does): left with Nagle's algorithm on (``--server-nagle``), an answer whose body
follows its headers in a second small write waits for the client's delayed ACK, about 40 ms a
request on Linux, which would make a 20 ms server a 60 ms one. The parts (``--only``,
repeatable; default all):

* inspect: ``ckptkit inspect URL --json`` of a torch.save checkpoint and of a safetensors file of
  ``--size-gb`` (Llama-shaped: 24 layers, 219 bf16 tensors of mixed sizes), with the requests
  and bytes it fetched (its own ``fetched``, and the server's count) as a share of the file.
* convert: the .pt URL (``--convert-from safetensors``: the other one) to a local
  .safetensors: ``ckptkit convert URL --workers 8`` (the default), ``--workers 1``, and
  ``fsspec get`` of the URL followed by a local ``ckptkit convert`` (one process that
  downloads, then execs the convert: one pid, so its memory is watched throughout). Also each
  way's requests and bytes on the wire, from one run apiece.
* spread: a sharded .safetensors output (``--max-shard-size``) of a local ``--spread-gb``
  checkpoint, by one process and by ``torchrun --nproc-per-node 2`` (gloo on CPU,
  OMP_NUM_THREADS=1), with two ``--part`` processes and a ``--finish`` beside them; and the
  disk's own parallel speed-up: ``cp`` (then ``sync`` of the copy, as ckptkit fsyncs) of two
  different files of half the output's size, one after the other against both at once.

Measured as in ``bench/run.py``: a fresh process per run, shuffled turns, a settled disk and a
warm cache (the served files are read through before each run, so the server reads them from
memory), wall time and peak anonymous memory (RssAnon sampled from /proc) of the process run:
torchrun's launcher, not its ranks; the shell, for the --part pair and the cp ways; while peak
RSS is the largest of it and its children. Peak RSS starts from this process's RSS at the
fork, about 30 MB (the server's module imports pytest), so for small files the anonymous peak
is the number to read. The server shares the machine's cores with the ways it serves. The
issue's targets are printed under each table; at --quick sizes they say little (a header is a
larger share of a small file, and starting Python, or torch under torchrun, is most of every
way's time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "support"))

import servers  # noqa: E402
from run import python, run_ways, table  # noqa: E402
from servers import RangeServer  # noqa: E402

# Llama-shaped bf16 checkpoints, in a child so this process never imports torch. argv[1] is a
# JSON list of [total_bytes, pt_path, safetensors_path] (a path may be ""); prints a JSON list
# of what each has. 24 layers of q, k, v, o, gate, up, down and two norms, embedding, final
# norm and an untied head: 219 tensors; the hidden size is what makes up the total.
MAKE = """
import json, math, sys, torch
from safetensors.torch import save_file
made = []
for total, pt, st in json.loads(sys.argv[1]):
    layers, vocab = 24, 32000 if total >= 1e9 else 8000
    params = total / 2  # bf16
    a, b = layers * 12, 2 * vocab  # a layer holds about 12 h^2, embedding and head 2 v h
    h = max(64, round((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a) / 32) * 32)
    inter = round(8 * h / 3 / 32) * 32
    g = torch.Generator().manual_seed(0)
    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.bfloat16)
    state = {"model.embed_tokens.weight": randn(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q", "k", "v", "o"):
            state[p + f"self_attn.{name}_proj.weight"] = randn(h, h)
        state[p + "mlp.gate_proj.weight"] = randn(inter, h)
        state[p + "mlp.up_proj.weight"] = randn(inter, h)
        state[p + "mlp.down_proj.weight"] = randn(h, inter)
        state[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    state["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    state["lm_head.weight"] = randn(vocab, h)
    if pt:
        torch.save(state, pt)
    if st:
        save_file(state, st, metadata={"format": "pt"})
    made.append({
        "tensor_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "tensors": len(state), "layers": layers, "hidden": h, "intermediate": inter,
        "vocab": vocab,
        "largest_tensor_bytes": max(t.numel() * t.element_size() for t in state.values()),
    })
    del state
print(json.dumps(made))
"""

# fsspec get of the URL, then the local convert exec'd in the same process (so one pid: its
# memory is watched throughout, and the convert starts as fresh as a user's would).
FSSPEC_GET = """
import os, sys, fsspec
fsspec.filesystem("http").get({url!r}, {local!r})
os.execv(sys.executable, [sys.executable, "-m", "ckptkit", "convert", {local!r}, {dst!r},
                          "--force", "-q"])
"""

MIB = 2**20


def make(jobs: list[tuple[int, Path | None, Path | None]]) -> list[dict]:
    spec = json.dumps([[n, str(pt or ""), str(st or "")] for n, pt, st in jobs])
    done = subprocess.run(python(MAKE) + [spec], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"making the checkpoints failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def make_plain(path: Path, nbytes: int, seed: int) -> None:
    """``nbytes`` of incompressible bytes (a 1 MiB random block, repeated) for cp to copy."""
    block = random.Random(seed).randbytes(MIB)
    with open(path, "wb") as f:
        for start in range(0, nbytes, len(block)):
            f.write(block[: nbytes - start])


def ckptkit(*args: object) -> list[str]:
    return [sys.executable, "-m", "ckptkit", *map(str, args)]


def once(argv: list[str], server: RangeServer, outputs: tuple[Path, ...] = ()) -> dict:
    """Run ``argv`` once, untimed, and count what it asked the server for."""
    for out in outputs:
        out.unlink(missing_ok=True)
    server.reset()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-4000:]}")
    return {
        "stdout": done.stdout,
        "server_requests": len(server.requests),
        "server_bytes": server.bytes_sent,
    }


def inspect_part(server: RangeServer, files: dict[str, Path], repeat: int) -> dict:
    ways = {
        f"ckptkit inspect --json ({kind} URL)": ckptkit("inspect", server.url(path.name), "--json")
        for kind, path in files.items()
    }
    fetched = {}
    for (name, argv), path in zip(ways.items(), files.values(), strict=True):
        seen = once(argv, server)
        doc = json.loads(seen.pop("stdout"))
        size = path.stat().st_size
        fetched[name] = {
            **doc["fetched"],
            "file_bytes": size,
            "fraction": doc["fetched"]["bytes"] / size,
            **seen,
        }
    timed = run_ways(ways, repeat, inputs=tuple(files.values()))
    return {"ways": timed, "fetched": fetched}


def convert_ways(url: str, local: Path, dst: Path) -> dict[str, list[str]]:
    convert = ckptkit("convert", url, dst, "--force", "-q", "--workers")
    return {
        "ckptkit convert URL --workers 8": [*convert, "8"],
        "fsspec get, then ckptkit convert": python(
            FSSPEC_GET.format(url=url, local=str(local), dst=str(dst))
        ),
        "ckptkit convert URL --workers 1": [*convert, "1"],
    }


def convert_part(server: RangeServer, src: Path, folder: Path, repeat: int) -> dict:
    local, dst = folder / f"downloaded{src.suffix}", folder / "converted.safetensors"
    ways = convert_ways(server.url(src.name), local, dst)
    outputs = (dst, local)
    size = src.stat().st_size
    wire = {}
    for name, argv in ways.items():
        seen = once(argv, server, outputs)
        del seen["stdout"]
        wire[name] = {**seen, "fraction": seen["server_bytes"] / size}
    timed = run_ways(ways, repeat, outputs, (src,))
    for path in outputs:
        path.unlink(missing_ok=True)
    base = timed["ckptkit convert URL --workers 8"]
    return {
        "source": src.suffix.lstrip("."),
        "file_bytes": size,
        "ways": timed,
        "wire": wire,
        "fsspec_get_over_workers_8": timed["fsspec get, then ckptkit convert"]["wall_s"]
        / base["wall_s"],
        "workers_1_over_workers_8": timed["ckptkit convert URL --workers 1"]["wall_s"]
        / base["wall_s"],
    }


ONE = "ckptkit convert (one process)"
TORCHRUN = "torchrun --nproc-per-node 2"
PARTS = "2 x --part in parallel, then --finish"
CP_SEQ = "cp + sync of 2 half-size files, one after the other"
CP_PAR = "cp + sync of 2 half-size files in parallel"


def copy_of(path: Path) -> Path:
    return path.with_name(path.name + ".copy")


def cp_sync(src: Path, dst: Path) -> str:
    """cp, then the copy forced to the disk (ckptkit fsyncs what it writes; cp alone does not)."""
    return f"cp {shlex.quote(str(src))} {shlex.quote(str(dst))} && sync {shlex.quote(str(dst))}"


def spread_ways(src: Path, out: Path, shard: str, a: Path, b: Path) -> dict[str, list[str]]:
    dst = out / "model.safetensors"
    args = [src, dst, "--max-shard-size", shard, "--force", "-q"]
    part = shlex.join(ckptkit("convert", *args, "--part"))
    finish = shlex.join(ckptkit("convert", "--finish", dst, "-q"))
    ca, cb = cp_sync(a, copy_of(a)), cp_sync(b, copy_of(b))
    both = "p=$!; {} & q=$!; wait $p && wait $q"  # both ran, and both ended well
    # The output folder is made first, for every way alike: ckptkit's processes each create
    # it when missing (check, then mkdir), and two at once race: one fails with "File exists".
    made = f"mkdir -p {shlex.quote(str(out))} && "
    torchrun = ["env", "OMP_NUM_THREADS=1", sys.executable, "-m", "torch.distributed.run"]
    torchrun += ["--standalone", "--nproc-per-node", "2", "-m", "ckptkit", "convert"]
    return {  # exec: the process run is the one whose memory is watched
        ONE: ["sh", "-c", made + "exec " + shlex.join(ckptkit("convert", *args))],
        TORCHRUN: ["sh", "-c", made + "exec " + shlex.join([*torchrun, *map(str, args)])],
        PARTS: ["sh", "-c", f"{made}{part} 1/2 & " + both.format(f"{part} 2/2") + f" && {finish}"],
        CP_SEQ: ["sh", "-c", f"{ca} && {cb}"],
        CP_PAR: ["sh", "-c", f"({ca}) & " + both.format(f"({cb})")],
    }


def spread_part(src: Path, folder: Path, shard: str, repeat: int) -> dict:
    half = src.stat().st_size // 2
    a, b = folder / "plain-a.bin", folder / "plain-b.bin"
    make_plain(a, half, 1)
    make_plain(b, half, 2)
    out = folder / "sharded"
    outputs = (out, copy_of(a), copy_of(b))
    ways = spread_ways(src, out, shard, a, b)
    done = subprocess.run(ways[ONE], capture_output=True, text=True)  # untimed: what it writes
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(ways[ONE])} failed:\n{done.stderr[-4000:]}")
    shards = sorted(out.glob("*.safetensors"))
    output_bytes = sum(p.stat().st_size for p in shards)
    timed = run_ways(ways, repeat, outputs, (src, a, b))
    for path in (a, b, *outputs[1:]):
        path.unlink(missing_ok=True)
    disk_speedup = timed[CP_SEQ]["wall_s"] / timed[CP_PAR]["wall_s"]
    target = 1.2 * timed[ONE]["wall_s"] / disk_speedup
    return {
        "source_bytes": src.stat().st_size,
        "output_bytes": output_bytes,
        "shards": len(shards),
        "max_shard_size": shard,
        "copy_file_bytes": half,
        "ways": timed,
        "disk_speedup": disk_speedup,
        "target_s": target,
        "torchrun_within_target": timed[TORCHRUN]["wall_s"] <= target,
        "parts_within_target": timed[PARTS]["wall_s"] <= target,
    }


def no_proxy_for_loopback() -> None:
    """The server is on 127.0.0.1: never through a proxy (ckptkit's HTTP client honours them)."""
    for var in ("NO_PROXY", "no_proxy"):
        os.environ[var] = ",".join(filter(None, [os.environ.get(var), "127.0.0.1", "localhost"]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small files, 1 repeat")
    parser.add_argument("--size-gb", type=float, default=2.0, help="the remote checkpoint")
    parser.add_argument("--spread-gb", type=float, default=4.0, help="the spread's checkpoint")
    parser.add_argument(
        "--max-shard-size", default="256MB", help="the spread's shards (quick: 8MB)"
    )
    parser.add_argument("--rate-mbs", type=float, default=100.0, help="MB/s per request")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="before each answer")
    parser.add_argument(
        "--convert-from",
        choices=["pt", "safetensors"],
        default="pt",
        help="which remote file convert reads (default: the torch.save one)",
    )
    parser.add_argument(
        "--server-nagle",
        action="store_true",
        help="turn Nagle's algorithm on in the server (a small answer then waits ~40 ms for "
        "the client's delayed ACK)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--only",
        choices=["inspect", "convert", "spread"],
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    parts = set(args.only or ["inspect", "convert", "spread"])
    size = 32_000_000 if args.quick else int(args.size_gb * 1e9)
    spread_size = 64_000_000 if args.quick else int(args.spread_gb * 1e9)
    shard = "8MB" if args.quick else args.max_shard_size
    repeat = 1 if args.quick else args.repeat
    rate, latency = args.rate_mbs * 1e6, args.latency_ms / 1e3
    no_proxy_for_loopback()
    servers._Handler.disable_nagle_algorithm = not args.server_nagle  # TCP_NODELAY at accept
    results: dict = {
        "server": {
            "bytes_per_s": rate,
            "latency_s": latency,
            "per": "request",
            "tcp_nodelay": not args.server_nagle,
        },
        "repeat": repeat,
        "files": {},
        "inspect": {},
        "convert": {},
        "spread": {},
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        served = folder / "served"
        served.mkdir()
        files = {"pt": served / "model.pt", "safetensors": served / "model.safetensors"}
        spread_src = folder / "spread.pt"
        jobs = []
        if parts & {"inspect", "convert"}:
            jobs.append((size, files["pt"], files["safetensors"]))
        if "spread" in parts:
            jobs.append((spread_size, spread_src, None))
        made = make(jobs)
        if parts & {"inspect", "convert"}:
            info = made.pop(0)
            for kind, path in files.items():
                results["files"][kind] = {**info, "bytes": path.stat().st_size}
            with RangeServer(served) as server:
                server.throttle(bytes_per_s=rate, latency_s=latency)
                if "inspect" in parts:
                    results["inspect"] = inspect_part(server, files, repeat)
                if "convert" in parts:
                    src = files[args.convert_from]
                    results["convert"] = convert_part(server, src, folder, repeat)
                if server.errors:
                    raise SystemExit(f"the server failed: {server.errors!r}")
            for path in files.values():
                path.unlink()
        if "spread" in parts:
            results["files"]["spread source"] = {**made.pop(0), "bytes": spread_src.stat().st_size}
            results["spread"] = spread_part(spread_src, folder, shard, repeat)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    report(results, rate, latency)


def report(results: dict, rate: float, latency: float) -> None:
    nodelay = "TCP_NODELAY" if results["server"]["tcp_nodelay"] else "Nagle's algorithm on"
    print(
        f"server: {rate / 1e6:.0f} MB/s and {latency * 1e3:.0f} ms per request, loopback, "
        f"{nodelay}; repeats: {results['repeat']}, {os.cpu_count()} cores"
    )
    for kind, info in results["files"].items():
        print(
            f"{kind}: {info['bytes'] / 1e6:.1f} MB, {info['tensors']} tensors "
            f"(hidden {info['hidden']}, largest {info['largest_tensor_bytes'] / 1e6:.1f} MB)"
        )
    print()
    if results["inspect"]:
        inspect = results["inspect"]
        first = next(iter(inspect["ways"]))
        print(table("inspect of a URL", inspect["ways"], first))
        print("| way | requests | bytes fetched | share of the file | server saw |")
        print("|---|---|---|---|---|")
        for name, f in inspect["fetched"].items():
            print(
                f"| {name} | {f['requests']} | {f['bytes'] / 1e3:.1f} kB | "
                f"{f['fraction']:.4%} | {f['server_requests']} requests, "
                f"{f['server_bytes'] / 1e3:.1f} kB |"
            )
        worst = max(f["fraction"] for f in inspect["fetched"].values())
        met = "met" if worst < 0.001 else "NOT met"
        print(f"target: under 0.1% of the file's bytes; largest share {worst:.4%}: {met}\n")
    if results["convert"]:
        convert = results["convert"]
        ways = convert["ways"]
        title = f"remote .{convert['source']} -> local .safetensors"
        print(table(title, ways, "ckptkit convert URL --workers 8"))
        print("| way | requests | bytes on the wire | share of the file |\n|---|---|---|---|")
        for name, w in convert["wire"].items():
            print(
                f"| {name} | {w['server_requests']} | {w['server_bytes'] / 1e6:.1f} MB | "
                f"{w['fraction']:.2f}x |"
            )
        ratio = convert["fsspec_get_over_workers_8"]
        anon = ways["ckptkit convert URL --workers 8"]["peak_anon_bytes"]
        print(
            f"target: fsspec get + convert at least 1.5x --workers 8's wall: {ratio:.2f}x "
            f"({'met' if ratio >= 1.5 else 'NOT met'}); --workers 8 peak anonymous memory at "
            f"most 128 MiB: {anon / MIB:.0f} MiB ({'met' if anon <= 128 * MIB else 'NOT met'})\n"
        )
    if results["spread"]:
        spread = results["spread"]
        title = (
            f"{spread['output_bytes'] / 1e9:.2f} GB sharded output, {spread['shards']} shards "
            f"of at most {spread['max_shard_size']}, from a local .pt; cp files "
            f"{spread['copy_file_bytes'] / 1e9:.2f} GB each"
        )
        print(table(title, spread["ways"], ONE))
        one = spread["ways"][ONE]["wall_s"]
        print(
            f"the disk's parallel copy speed-up (2 cp one after the other / 2 at once): "
            f"{spread['disk_speedup']:.2f}x"
        )
        print(
            f"target: 2 processes within 1.2 x {one:.2f} s / {spread['disk_speedup']:.2f} = "
            f"{spread['target_s']:.2f} s; torchrun {spread['ways'][TORCHRUN]['wall_s']:.2f} s "
            f"({'met' if spread['torchrun_within_target'] else 'NOT met'}), --part pair "
            f"{spread['ways'][PARTS]['wall_s']:.2f} s "
            f"({'met' if spread['parts_within_target'] else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
