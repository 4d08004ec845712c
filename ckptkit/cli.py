"""The ``ckptkit`` command: each command checks its flags, makes one library call, prints.

Errors the library expects become one ``Error: <what>; <fix>`` line on stderr with the error's
exit code; ``CKPTKIT_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from typing import Any

import click

from ckptkit.errors import CkptkitError, UsageError
from ckptkit.meta import VERSION

__all__ = ["cli", "main"]


def _progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


def _emit(command: str, body: dict[str, Any]) -> None:
    from ckptkit.render import document

    click.echo(document(command, body))


def _echo(lines: list[str]) -> None:
    for line in lines:
        click.echo(line)


# Options several commands share, defined once (as sqlite-utils' cli.py bundles its own).
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
quiet_option = click.option(
    "-q", "--quiet", is_flag=True, help="Print nothing; the exit code tells."
)
allow_global_option = click.option(
    "--allow-global",
    multiple=True,
    metavar="NAME",
    help="Admit pickle global NAME (module.Class); it is never imported. Names that run "
    "code are refused.",
)


def _report_error(exc: BaseException) -> int:
    """Print one ``Error:`` line for an exception and return the exit code it maps to."""
    if os.environ.get("CKPTKIT_DEBUG") == "1":
        traceback.print_exception(exc)
    if isinstance(exc, CkptkitError):
        click.echo(f"Error: {exc.cli_text}", err=True)
        return exc.exit_code
    if isinstance(exc, click.ClickException):
        ctx = getattr(exc, "ctx", None)
        hint = f"; see '{ctx.command_path} --help'" if ctx else ""
        click.echo(f"Error: {exc.format_message().rstrip('.')}{hint}", err=True)
        return exc.exit_code
    if isinstance(exc, (KeyboardInterrupt, click.Abort)):
        click.echo("Error: interrupted", err=True)
        return 130
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        click.echo(f"Error: {exc.strerror or exc}{where}", err=True)
        return 1
    click.echo(
        f"Error: internal error ({type(exc).__name__}: {exc}); "
        "rerun with CKPTKIT_DEBUG=1 and report the traceback",
        err=True,
    )
    return 1


class _Group(click.Group):
    """A click group whose standalone run turns every error into one line and an exit code."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name or "ckptkit", complete_var, False, **extra)
        except click.exceptions.Exit as exc:
            code = exc.exit_code
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the one place errors end
            code = _report_error(exc)
            if "--json" in (sys.argv[1:] if args is None else list(args)):
                from ckptkit.render import error_document

                click.echo(error_document(exc, code))  # scripts read stdout, people stderr
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(VERSION, prog_name="ckptkit")
def cli() -> None:
    """Move PyTorch checkpoints between single-device, DataParallel, DDP and safetensors."""


@cli.command()
@click.argument("src", type=click.Path(dir_okay=True, path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option(
    "--select",
    metavar="DOTTED.PATH",
    help="Where the state dict is in a training checkpoint (default: found).",
)
@click.option(
    "--ema",
    is_flag=True,
    help="Take the EMA copy of the weights (state_dict_ema, model_ema, ema...).",
)
@click.option(
    "--strip-module", is_flag=True, help="Strip one leading 'module.' (DataParallel / DDP)."
)
@click.option(
    "--strip-wrappers",
    is_flag=True,
    help="Strip the whole detected wrapper chain (module., _orig_mod., ...).",
)
@click.option(
    "--strip-prefix",
    multiple=True,
    metavar="P",
    help="Strip prefix P, e.g. Lightning's 'model.' (repeatable).",
)
@click.option(
    "--add-module", is_flag=True, help="Add 'module.' so the result loads into a DP / DDP model."
)
@click.option(
    "--add-prefix", multiple=True, metavar="P", help="Add prefix P to every key (repeatable)."
)
@click.option(
    "--rename",
    multiple=True,
    metavar="REGEX=REPL",
    help="Rewrite keys with re.sub (repeatable, in order).",
)
@click.option(
    "--match-to", metavar="REF", help="Map keys onto the layout of reference checkpoint REF."
)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    help="Cast floating-point tensors (integer and bool tensors never change).",
)
@click.option(
    "--keep-dtype", multiple=True, metavar="GLOB", help="Keys that keep their dtype (repeatable)."
)
@click.option("--allow-overflow", is_flag=True, help="Let a cast turn finite values into inf.")
@click.option(
    "--max-shard-size",
    metavar="SIZE",
    help="Shard safetensors output: 5GB, 500MB, 2GiB... (with a Hugging Face index).",
)
@click.option(
    "--keep-tied-copies",
    is_flag=True,
    help="Write every name of a tied group to safetensors (default: one tensor, the others "
    "named in the metadata, as safetensors' save_model does).",
)
@click.option(
    "--to",
    type=click.Choice(["safetensors", "pt", "dcp"]),
    help="Output format (default: DST's suffix); dcp writes a torch.distributed.checkpoint folder.",
)
@click.option("--dry-run", is_flag=True, help="Print the key plan; write nothing.")
@click.option("--force", is_flag=True, help="Overwrite DST if it exists.")
@click.option(
    "--no-verify", is_flag=True, help="Skip reading the output back for a bit-exact comparison."
)
@allow_global_option
@click.option(
    "--trust",
    is_flag=True,
    help="Load SRC with torch's full unpickler. It can run code: only for files you trust.",
)
@json_option
@click.option("-q", "--quiet", is_flag=True, help="No progress bar, no report.")
def convert(
    src: str,
    dst: str,
    strip_prefix: tuple[str, ...],
    add_prefix: tuple[str, ...],
    rename: tuple[str, ...],
    allow_global: tuple[str, ...],
    no_verify: bool,
    as_json: bool,
    quiet: bool,
    **options: Any,
) -> None:
    """Convert SRC's state dict to DST (.safetensors, .pt, or a DCP folder with --to dcp),
    rewriting key prefixes.

    \b
    ckptkit convert ddp.pt model.safetensors --strip-module
    ckptkit convert dcp_dir/ model.safetensors
    ckptkit convert model.safetensors dcp_out --to dcp
    ckptkit convert lightning.ckpt model.safetensors --strip-prefix model.
    ckptkit convert single.pt ddp-ready.pt --add-module
    ckptkit convert big.pt out/model.safetensors --dtype bf16 --max-shard-size 5GB
    """
    from ckptkit.convert import convert as run

    if options["strip_module"] and options["strip_wrappers"]:
        raise UsageError("--strip-module and --strip-wrappers overlap", "use one of them")
    report = run(
        src,
        dst,
        strip_prefixes=strip_prefix,
        add_prefixes=add_prefix,
        renames=rename,
        allow_globals=allow_global,
        verify=not no_verify,
        progress=_progress(quiet or as_json),
        **options,
    )
    if as_json:
        _emit("convert", report.to_dict())
    elif not quiet:
        from ckptkit.render import convert_lines

        _echo(convert_lines(report))


@cli.command()
@click.option(
    "--mode",
    type=click.Choice(["single", "dp", "ddp", "fsdp"]),
    default="single",
    show_default=True,
    help="single device, nn.DataParallel, DistributedDataParallel, or FSDP2 (fully_shard).",
)
@click.option("--epochs", type=click.IntRange(min=1), default=4, show_default=True)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Global batch size, split evenly over the ranks.",
)
@click.option("--lr", type=float, default=0.05, show_default=True, help="SGD learning rate.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--out", default="runs/ckptkit", show_default=True, help="Run folder: checkpoints, metrics."
)
@click.option(
    "--save-every",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Save every N epochs (and after the last).",
)
@click.option(
    "--keep-last",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Checkpoints to keep (0: all).",
)
@click.option(
    "--resume", metavar="PATH|auto", help="Resume from a checkpoint, or the newest complete one."
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--save-format",
    type=click.Choice(["pt", "safetensors", "both", "dcp"]),
    help="pt: whole training state; safetensors: weights only; dcp: a folder of every rank's "
    "shards (torch.distributed.checkpoint).  [default: dcp in fsdp, else pt]",
)
@click.option(
    "--model", metavar="MODULE:FACTORY", help="Your model factory (default: built-in demo)."
)
@click.option(
    "--data", metavar="MODULE:FACTORY", help="Your dataset factory, (input, label) items."
)
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="DDP / FSDP workers to start here (ignored under torchrun).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=60,
    show_default=True,
    help="Process-group timeout in seconds: a stuck rank fails the job this fast.",
)
@json_option
@click.option("-q", "--quiet", is_flag=True, help="No progress bar, no per-epoch lines.")
def train(as_json: bool, **options: Any) -> None:
    """Train in any mode; checkpoints load in every other mode.

    \b
    ckptkit train --mode ddp --nproc-per-node 2 --epochs 4 --out runs/demo
    ckptkit train --mode fsdp --nproc-per-node 2 --out runs/fsdp
    ckptkit train --mode single --resume auto --out runs/demo
    torchrun --nnodes 2 --node-rank 0 ... -m ckptkit train --mode ddp
    """
    from ckptkit.engine import TrainConfig
    from ckptkit.engine import train as run

    result = run(TrainConfig(**options))
    if result is None:  # a worker under torchrun that is not rank 0
        return
    if as_json:
        _emit("train", result.to_dict())
    elif not options["quiet"]:
        from ckptkit.render import train_lines

        _echo(train_lines(result, options["mode"]))


@cli.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--select", metavar="DOTTED.PATH", help="Where the state dict is (default: found).")
@click.option("--flat", is_flag=True, help="One line per tensor instead of the tree.")
@click.option("--filter", "key_filter", metavar="GLOB", help="Only tensors whose key matches GLOB.")
@click.option(
    "--depth",
    type=click.IntRange(min=1),
    help="Fold the tree below this depth.  [default: no folding]",
)
@json_option
@quiet_option
def inspect(
    path: str,
    select: str | None,
    flat: bool,
    key_filter: str | None,
    depth: int | None,
    as_json: bool,
    quiet: bool,
) -> None:
    """Show what is in a checkpoint without loading its tensors or running its pickle.

    \b
    ckptkit inspect model.pt
    ckptkit inspect model.safetensors --filter 'layers.0.*' --flat
    ckptkit inspect shards/ --depth 2
    """
    from ckptkit.summary import summarize

    if flat and depth:
        raise UsageError("--flat and --depth do not go together", "use one of them")
    summary = summarize(path, select=select)
    if as_json:
        _emit("inspect", summary.to_dict(key_filter))
    elif not quiet:
        from ckptkit.render import inspect_lines

        _echo(inspect_lines(summary, flat=flat, depth=depth, key_filter=key_filter))


@cli.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@allow_global_option
@json_option
@quiet_option
def scan(paths: tuple[str, ...], allow_global: tuple[str, ...], as_json: bool, quiet: bool) -> None:
    """Scan checkpoints' pickles for code they would run, without running it.

    Every way a loader would read each file is scanned (torch.load's zip, tar or pickle stream,
    pickle.load, a zip at the end); a file loaders read differently is a polyglot, never safe.
    Verdicts: safe, unknown (a global outside torch's weights_only set), damaged, dangerous.
    Exit code 0 when every file is safe, 1 when one is not, 2 when one cannot be scanned (the
    others are still reported): a gate for CI.

    \b
    ckptkit scan downloads/*.pt
    ckptkit scan model.pt --allow-global fractions.Fraction
    """
    from ckptkit.render import scan_lines
    from ckptkit.scan import overall_verdict, scan_many

    reports = scan_many(paths, allow_globals=allow_global)
    for report in reports:
        if report.error:
            click.echo(f"Error: {report.error}", err=True)
    worst = overall_verdict(reports)
    if as_json:
        _emit("scan", {"verdict": worst, "files": [r.to_dict() for r in reports]})
    elif not quiet:
        for report in reports:
            _echo(scan_lines(report))
    if worst != "safe":
        raise click.exceptions.Exit(2 if worst == "error" else 1)


@cli.command()
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str))
@click.option(
    "--atol",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Absolute tolerance (0 and 0: bit-exact).",
)
@click.option(
    "--rtol",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Relative tolerance, of B's values.",
)
@click.option("--keys-only", is_flag=True, help="Compare keys, shapes and dtypes; read no data.")
@click.option("--select-a", metavar="DOTTED.PATH", help="Where A's state dict is.")
@click.option("--select-b", metavar="DOTTED.PATH", help="Where B's state dict is.")
@allow_global_option
@json_option
@quiet_option
def diff(
    a: str,
    b: str,
    atol: float,
    rtol: float,
    keys_only: bool,
    select_a: str | None,
    select_b: str | None,
    allow_global: tuple[str, ...],
    as_json: bool,
    quiet: bool,
) -> None:
    """Compare two checkpoints of any formats, wrapper prefixes stripped on both sides.

    Exit code 0 when they are equal (bit-exact, or within --atol/--rtol), 1 when they differ,
    2 on error, like diff(1).

    \b
    ckptkit diff ddp.pt model.safetensors
    ckptkit diff run1.pt run2.pt --atol 1e-6
    """
    from ckptkit.diff import diff as run

    try:
        report = run(a, b, atol=atol, rtol=rtol, keys_only=keys_only, select_a=select_a,
                     select_b=select_b, allow_globals=allow_global,
                     progress=_progress(quiet or as_json))  # fmt: skip
    except CkptkitError as exc:
        exc.exit_code = 2
        raise
    if as_json:
        _emit("diff", report.to_dict())
    elif not quiet:
        from ckptkit.render import diff_lines

        _echo(diff_lines(report))
    if not report.equal:
        raise click.exceptions.Exit(1)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``ckptkit`` script and ``python -m ckptkit``."""
    # torch warns on import when numpy is absent; ckptkit never uses numpy, so say nothing.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    cli.main(argv, prog_name="ckptkit")
