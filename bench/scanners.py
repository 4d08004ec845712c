"""ckptkit scan beside picklescan, fickling and modelscan, on the peers' own test files.

    python3 bench/scanners.py CORPUS_DIR... [--peers SITE_DIR] [--all-malicious] [--json]

CORPUS_DIR: folders of files to scan (the peers' test data, exported from their repositories:
picklescan's tests/data and tests/data2, modelscan's tests/data, fickling's test/fixtures);
nothing of theirs is kept in this repository. --peers: where the peers are installed
(`pip install --target DIR picklescan fickling modelscan`), put on their PYTHONPATH.

A file counts as malicious or benign by its name, as the peers' own tests name them
(``malicious*``, ``GHSA-*``, ``*exploit*``...; ``benign*``, plain arrays and models); others are
"other" (--all-malicious: every file is hostile, as in tests/hostile.py's corpus written out).
A scanner flags a file when its exit status says unsafe or it could not clear the file
(ckptkit: any verdict but safe; picklescan, modelscan: status 1 or 2; fickling --check-safety:
non-zero). Per scanner the table gives malicious flagged, benign flagged, and the malicious
files it let through.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_MALICIOUS = re.compile(
    r"malicious|GHSA|exploit|sploit|injection|exfiltration|FileIO|FileHandler|urlopen|"
    r"CodeType|bad_pytorch|magic_bypass|unsafe|object_array",
    re.IGNORECASE,
)
_BENIGN = re.compile(r"benign|int_array|pytorch_model|squeezenet", re.IGNORECASE)


def label(path: Path) -> str:
    if _BENIGN.search(path.name) and "malicious" not in path.name:
        return "benign"
    return "malicious" if _MALICIOUS.search(path.name) else "other"


def scanners(peers: Path | None) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (argv before the file, environment)."""
    ours = {**os.environ, "PYTHONPATH": str(ROOT)}
    theirs = {**os.environ, "PYTHONPATH": str(peers)} if peers else dict(os.environ)
    py = [sys.executable, "-c"]
    return {
        "ckptkit scan": ([sys.executable, "-m", "ckptkit", "scan", "-q"], ours),
        "picklescan": (
            [*py, "import sys; from picklescan.cli import main; sys.exit(main())", "-p"],
            theirs,
        ),
        "fickling": (
            [*py, "import sys; from fickling.cli import main; sys.exit(main())", "--check-safety"],
            theirs,
        ),
        "modelscan": (
            [*py, "import sys; from modelscan.cli import main; sys.exit(main())", "-p"],
            theirs,
        ),
    }


def flagged(name: str, code: int) -> bool:
    if name in ("picklescan", "modelscan"):
        return code in (1, 2)
    return code != 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("corpus", nargs="+", type=Path)
    parser.add_argument("--peers", type=Path, help="site folder holding the peer scanners")
    parser.add_argument(
        "--all-malicious", action="store_true", help="every file is hostile (tests/hostile.py's)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    files = sorted(p.resolve() for d in args.corpus for p in d.rglob("*") if p.is_file())
    results: dict[str, dict[str, bool]] = {}
    # The scanners run in a scratch folder: fickling leaves safety_results.json where it runs.
    with tempfile.TemporaryDirectory() as scratch:
        for name, (argv, env) in scanners(args.peers).items():
            results[name] = {}
            for path in files:
                try:
                    done = subprocess.run(
                        [*argv, str(path)], env=env, cwd=scratch, capture_output=True, timeout=60
                    )
                    code = done.returncode
                except subprocess.TimeoutExpired:
                    code = 124
                results[name][str(path)] = flagged(name, code)
    labels = {str(p): "malicious" if args.all_malicious else label(p) for p in files}
    if args.json:
        print(json.dumps({"labels": labels, "flagged": results}, indent=2))
        return
    bad = [f for f, kind in labels.items() if kind == "malicious"]
    good = [f for f, kind in labels.items() if kind == "benign"]
    print(
        f"{len(files)} files: {len(bad)} malicious, {len(good)} benign, "
        f"{len(files) - len(bad) - len(good)} other (by name)\n"
    )
    print("| scanner | malicious flagged | benign flagged | others flagged |")
    print("|---|---|---|---|")
    for name, flags in results.items():
        other = [f for f, kind in labels.items() if kind == "other"]
        print(
            f"| {name} | {sum(flags[f] for f in bad)} of {len(bad)} | "
            f"{sum(flags[f] for f in good)} of {len(good)} | "
            f"{sum(flags[f] for f in other)} of {len(other)} |"
        )
    print()
    for name, flags in results.items():
        missed = [Path(f).name for f in bad if not flags[f]]
        print(f"{name} lets through: {', '.join(missed) or 'nothing'}")


if __name__ == "__main__":
    main()
