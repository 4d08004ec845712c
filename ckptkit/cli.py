"""The ``ckptkit`` command: each command checks its flags, makes one library call, prints.

Errors the library expects become one ``Error: <what>; <fix>`` line on stderr with the error's
exit code; ``CKPTKIT_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ckptkit.errors import CkptkitError, UsageError
from ckptkit.formats.folders.megatron_ranks import MOST_PARALLEL
from ckptkit.formats.output.writers import TO_FORMATS
from ckptkit.meta import DISTRIBUTION

if TYPE_CHECKING:
    from ckptkit.convert import ReadOptions
    from ckptkit.keys import KeyRules

__all__ = ["cli", "main", "key_rule_options", "read_options"]


def _progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


def _emit(command: str, body: dict[str, Any]) -> None:
    from ckptkit.render import document

    click.echo(document(command, body))


def _echo(lines: list[str]) -> None:
    """Print text lines, each escaped (``ckptkit.text.escape``; the views' lines already are):
    whatever builds them, nothing from a file reaches the terminal raw."""
    from ckptkit.text import escape

    for line in lines:
        click.echo(escape(line))


# Options several commands share, defined once (as sqlite-utils' cli.py bundles its own).
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
quiet_option = click.option(
    "-q", "--quiet", is_flag=True, help="Print nothing; the exit code tells."
)
_VARIANT_HELP = (
    "In a model folder, the weights of this variant (diffusers' "
    "diffusion_pytorch_model.fp16.safetensors for fp16); default: the file without a variant, "
    "else the only one."
)
_NAMES_FROM_HELP = (
    "A diffusers EMAModel state dict: name its shadow_params after this model's "
    "parameters, in order (shapes checked); a folder DST gets the model's config."
)
variant_option = click.option("--variant", metavar="NAME", help=_VARIANT_HELP)
names_from_option = click.option(
    "--names-from",
    metavar="MODEL_FOLDER",
    type=click.Path(exists=True, path_type=str),
    help=_NAMES_FROM_HELP,
)
allow_global_option = click.option(
    "--allow-global",
    multiple=True,
    metavar="NAME",
    help="Admit pickle global NAME (module.Class); it is never imported. Names that run "
    "code are refused.",
)
# A mapping's direction and variables, for convert --map and inspect --map alike.
reverse_option = click.option(
    "--reverse", is_flag=True, help="With --map: map the other way (its 'to' side to its 'from')."
)
set_option = click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="NAME=VALUE",
    help="With --map: set a mapping variable (--set tp=2); repeatable.",
)


def key_rule_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The key-rewriting options (strip, add, rename, match), given to ``command`` as one
    ``keys`` argument: the ``KeyRules`` the library takes."""
    options = [
        click.option(
            "--strip-module",
            is_flag=True,
            help="Strip one leading 'module.' (DataParallel / DDP).",
        ),
        click.option(
            "--strip-wrappers",
            is_flag=True,
            help="Strip the whole detected wrapper chain (module., _orig_mod., ...).",
        ),
        click.option(
            "--strip-prefix",
            multiple=True,
            metavar="P",
            help="Strip prefix P, e.g. Lightning's 'model.' (repeatable).",
        ),
        click.option(
            "--add-module",
            is_flag=True,
            help="Add 'module.' so the result loads into a DP / DDP model.",
        ),
        click.option(
            "--add-prefix",
            multiple=True,
            metavar="P",
            help="Add prefix P to every key (repeatable).",
        ),
        click.option(
            "--rename",
            multiple=True,
            metavar="REGEX=REPL",
            help="Rewrite keys with re.sub (repeatable, in order).",
        ),
        click.option(
            "--match-to",
            metavar="REF",
            help="Map keys onto the layout of reference checkpoint REF.",
        ),
    ]

    @functools.wraps(command)
    def with_keys(
        *args: Any,
        strip_module: bool,
        strip_wrappers: bool,
        strip_prefix: tuple[str, ...],
        add_module: bool,
        add_prefix: tuple[str, ...],
        rename: tuple[str, ...],
        match_to: str | None,
        **kwargs: Any,
    ) -> Any:
        from ckptkit.keys import KeyRules

        if strip_module and strip_wrappers:
            raise UsageError("--strip-module and --strip-wrappers overlap", "use one of them")
        keys = KeyRules(
            strip_wrappers, strip_module, strip_prefix, add_module, add_prefix, rename, match_to
        )
        return command(*args, keys=keys, **kwargs)

    for option in reversed(options):
        with_keys = option(with_keys)
    return with_keys


# Said in each option's help that chooses weights: where SRC is an adapter, they are its base's.
_FOR_BASE = " For an adapter SRC, in its base."


# convert's reading options, in --help's order: ``read_options`` gives them as one ReadOptions.
_READ_OPTIONS = [
    click.option(
        "--select",
        metavar="DOTTED.PATH",
        help="Where the state dict is in a training checkpoint (default: found)." + _FOR_BASE,
    ),
    click.option(
        "--ema",
        is_flag=True,
        help="Take the EMA copy of the weights (state_dict_ema, model_ema, ema...)." + _FOR_BASE,
    ),
    click.option("--variant", metavar="NAME", help=_VARIANT_HELP + _FOR_BASE),
    click.option(
        "--names-from",
        metavar="MODEL_FOLDER",
        type=click.Path(exists=True, path_type=str),
        help=_NAMES_FROM_HELP + _FOR_BASE,
    ),
    click.option(
        "--base",
        metavar="PATH",
        help="The base model a LoRA adapter SRC is merged into (default: the one its "
        "adapter_config.json names, found locally or in the Hugging Face cache; never "
        "downloaded). --select, --ema, --variant and --names-from choose its weights.",
    ),
    click.option(
        "--adapter",
        "adapters",
        multiple=True,
        metavar="PATH[:WEIGHT]",
        help="Merge this LoRA adapter (PEFT folder or kohya file) into SRC; repeatable, in order.",
    ),
    click.option(
        "--drop-adapters",
        is_flag=True,
        help="A PeftModel state dict: write the base alone, without its adapter tensors.",
    ),
    click.option(
        "--lora-alpha",
        type=float,
        metavar="N",
        help="A PeftModel state dict: merge its adapter with this lora_alpha (rank from the "
        "shapes).",
    ),
    click.option(
        "--adapter-config",
        type=click.Path(exists=True, dir_okay=False, path_type=str),
        metavar="JSON",
        help="A PeftModel state dict: merge its adapter as this adapter_config.json says.",
    ),
    allow_global_option,
    click.option(
        "--trust",
        is_flag=True,
        help="Load SRC (and an adapter SRC's --base) with torch's full unpickler. It can run "
        "code: only for files you trust. Its classes are imported as `python` run here "
        "would (the current folder first); a pickled nn.Module gives its state_dict().",
    ),
    click.option(
        "--map",
        "mapping",
        metavar="NAME|FILE",
        help="Map names and shapes to another model family's with a mapping file or a pack "
        "(llama-meta: Meta's consolidated.NN.pth to Hugging Face); every source byte is "
        "accounted for before anything is written. See docs/mapping.md.",
    ),
    reverse_option,
    click.option(
        "--check-roundtrip",
        is_flag=True,
        help="With --map: map each group back as it streams and compare it with the source, "
        "bit for bit (nothing is written if one differs).",
    ),
    set_option,
    click.option(
        "--config-from",
        metavar="FOLDER",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="With --map: take the target's config (config.json) from this model folder as it "
        "is, with its tokenizer files, and check the weights against it.",
    ),
    click.option(
        "--workers",
        type=click.IntRange(1, 64),
        default=8,
        show_default=True,
        help="Ranged requests in flight when SRC is a URL (s3://, https://...); memory holds "
        "about WORKERS + 1 requests of 8 MiB. Local files ignore it.",
    ),
]


def read_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``convert``'s reading options (which weights, how safely, what is merged, how many
    requests), given to ``command`` as one ``read`` argument: the ``ReadOptions`` the library
    takes. Those that choose weights (``--select``, ``--ema``, ``--variant``, ``--names-from``)
    apply to the model, which for an adapter SRC is its base; ``--trust`` and
    ``--allow-global`` to SRC and its base (see docs/formats/adapters.md)."""

    @functools.wraps(command)
    def with_read(
        *args: Any,
        select: str | None,
        ema: bool,
        variant: str | None,
        names_from: str | None,
        base: str | None,
        adapters: tuple[str, ...],
        drop_adapters: bool,
        lora_alpha: float | None,
        adapter_config: str | None,
        allow_global: tuple[str, ...],
        trust: bool,
        mapping: str | None,
        reverse: bool,
        check_roundtrip: bool,
        sets: tuple[str, ...],
        config_from: Path | None,
        workers: int,
        **kwargs: Any,
    ) -> Any:
        from ckptkit.adapters import AdapterOptions, parse_adapter_arg
        from ckptkit.convert import ReadOptions
        from ckptkit.mapping.source import MapOptions, parse_sets

        if mapping is None and (reverse or sets or check_roundtrip or config_from):
            raise click.UsageError(
                "--reverse, --set, --check-roundtrip and --config-from go with --map NAME|FILE"
            )

        merge = AdapterOptions(
            tuple(parse_adapter_arg(a) for a in adapters),
            base,
            drop_adapters,
            lora_alpha,
            adapter_config,
        )
        read = ReadOptions(
            select=select,
            ema=ema,
            variant=variant,
            names_from=names_from,
            trust=trust,
            allow_globals=allow_global,
            adapters=merge,
            mapping=None
            if mapping is None
            else MapOptions(
                mapping=mapping,
                reverse=reverse,
                sets=parse_sets(sets),
                check_roundtrip=check_roundtrip,
                config_from=config_from,
            ),
            workers=workers,
        )
        return command(*args, read=read, **kwargs)

    for option in reversed(_READ_OPTIONS):
        with_read = option(with_read)
    return with_read


def _report_error(exc: BaseException) -> int:
    """Print one ``Error:`` line for an exception and return the exit code it maps to.

    The line is escaped (``ckptkit.text.escape``): messages quote keys and names from the file.
    """
    from ckptkit.text import escape

    def say(text: str) -> None:
        click.echo(f"Error: {escape(text)}", err=True)

    if os.environ.get("CKPTKIT_DEBUG") == "1":
        traceback.print_exception(exc)
    if isinstance(exc, CkptkitError):
        say(exc.cli_text)
        return exc.exit_code
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):  # `ckptkit` alone: the help
        exc.show()
        return exc.exit_code
    if isinstance(exc, click.ClickException):
        ctx = getattr(exc, "ctx", None)
        hint = f"; see '{ctx.command_path} --help'" if ctx else ""
        say(f"{exc.format_message().rstrip('.')}{hint}")
        return exc.exit_code
    if isinstance(exc, _Terminated) or isinstance(exc.__cause__, _Terminated):  # click: Abort
        say("terminated (SIGTERM); nothing was left half-written")
        return 143
    if isinstance(exc, (KeyboardInterrupt, click.Abort)):
        say("interrupted")
        return 130
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        say(f"{exc.strerror or exc}{where}")
        return 1
    say(
        f"internal error ({type(exc).__name__}: {exc}); "
        "rerun with CKPTKIT_DEBUG=1 and report the traceback"
    )
    return 1


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler stopping the job, ``kill``), raised where the command is, so its
    clean-up runs as for Ctrl-C: temp files removed, uploads aborted."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
@click.version_option(package_name=DISTRIBUTION, prog_name="ckptkit")
def cli() -> None:
    """Move PyTorch checkpoints between single-device, DataParallel, DDP and FSDP.

    \b
    Reads torch .pt files, safetensors (single or sharded), Hugging Face and Accelerate
    folders, DCP / FSDP folders, DeepSpeed ZeRO folders and every rank's files, from headers
    and a static pickle reader: nothing in a checkpoint runs unless you pass --trust.
    Writes safetensors, .pt and DCP, verified bit-exact.
    """


def _parallel_size(flag: str, dest: str, what: str) -> Callable[[Any], Any]:
    """One of ``--to megatron``'s sizes: a whole number from 1 to MOST_PARALLEL (None: 1)."""
    return click.option(
        flag,
        dest,
        type=click.IntRange(1, MOST_PARALLEL),
        help=f"With --to megatron: {what} (default 1).",
    )


@cli.command()
@click.argument("src", required=False, type=click.Path(dir_okay=True, path_type=str))
@click.argument("dst", required=False, type=click.Path(path_type=str))
@read_options
@key_rule_options
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]),
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
    type=click.Choice(list(TO_FORMATS)),  # what the writers declare (formats/output/writers.py)
    help="Output format (default: DST's suffix); dcp writes a torch.distributed.checkpoint "
    "folder, megatron a legacy Megatron-LM save (mp_rank_* files: --tp, --pp, --ep, --vpp), "
    "megatron-dist its torch_dist save.",
)
@_parallel_size("--tp", "tensor_parallel", "the tensor-parallel size to cut the model into")
@_parallel_size("--pp", "pipeline_parallel", "the pipeline stages to deal the layers to")
@_parallel_size("--ep", "expert_parallel", "the expert-parallel ranks to share the experts over")
@_parallel_size("--vpp", "virtual_stages", "the virtual pipeline stages on each stage (--pp)")
@click.option(
    "--check-outputs",
    is_flag=True,
    help="Run each merged layer and its unmerged form on seeded inputs; report the worst error.",
)
@click.option("--dry-run", is_flag=True, help="Print the key plan; write nothing.")
@click.option("--force", is_flag=True, help="Overwrite DST if it exists.")
@click.option(
    "--no-verify", is_flag=True, help="Skip reading the output back for a bit-exact comparison."
)
@click.option(
    "--part",
    metavar="I/N",
    help="Write only part I of N of a sharded output's shards (shard k goes to part k mod N), "
    "no index; then `ckptkit convert --finish DST` writes it. Under torchrun each rank takes "
    "its part by itself and rank 0 writes the index once every rank is done.",
)
@click.option(
    "--finish",
    "finish_dst",
    metavar="DST",
    type=click.Path(path_type=str),
    help="Write the index of DST's shards written by --part runs (every shard checked).",
)
@json_option
@click.option("-q", "--quiet", is_flag=True, help="No progress bar, no report.")
def convert(
    src: str | None,
    dst: str | None,
    read: ReadOptions,
    keys: KeyRules,
    check_outputs: bool,
    dry_run: bool,
    force: bool,
    no_verify: bool,
    part: str | None,
    finish_dst: str | None,
    as_json: bool,
    quiet: bool,
    **output: Any,
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
    ckptkit convert my-lora/ merged/ --base base-model/
    ckptkit convert my-lora/ merged/ --base base-model/ --variant fp16
    ckptkit convert base-model/ merged/ --adapter style.safetensors:0.8 --adapter fix/
    ckptkit convert s3://bucket/run/model.pt model.safetensors --workers 16
    ckptkit convert big/ out/model.safetensors --max-shard-size 5GB --part 3/8
    ckptkit convert megatron-run/ resharded/ --to megatron --tp 4 --pp 2
    ckptkit convert --finish out/model.safetensors
    torchrun --nproc-per-node 4 -m ckptkit convert big/ out/model.safetensors --max-shard-size 5GB
    """
    from ckptkit.convert import OutputOptions, convert_checkpoint
    from ckptkit.spread import finish, launched_part, parse_part

    if finish_dst is not None:
        if src is not None:
            raise click.UsageError("--finish DST takes no SRC: it writes the index of DST's shards")
        done = finish(finish_dst, force=force)
        if as_json:
            _emit("finish", done.to_dict())
        elif not quiet:
            _echo([f"Wrote    {done.index} ({done.tensors} tensors in {len(done.shards)} shards)"])
        return
    if src is None or dst is None:  # optional only for --finish
        raise click.UsageError(f"Missing argument '{'SRC' if src is None else 'DST'}'")
    launched = launched_part() if part is None else None
    spread = parse_part(part) if part is not None else launched
    silent = launched is not None and launched.index != 0  # under torchrun, rank 0 reports

    output["keep_dtype"] = tuple(output["keep_dtype"])
    with _sigterm_as_interrupt():  # cleaned up as for Ctrl-C: no temp file, no open upload
        report = convert_checkpoint(
            src,
            dst,
            read=read,
            keys=keys,
            output=OutputOptions(**output),
            dry_run=dry_run,
            force=force,
            verify=not no_verify,
            check_outputs=check_outputs,
            progress=_progress(quiet or as_json or silent),
            part=spread,
        )
    if silent:
        return
    if as_json:
        _emit("convert", report.to_dict())
    elif not quiet:
        _echo(report.lines())  # a pipeline's report renders its components


def _train_default(name: str) -> Any:
    """A ``TrainConfig`` field's default: the one place the defaults are written."""
    from dataclasses import fields

    from ckptkit.engine.config import TrainConfig

    return next(f.default for f in fields(TrainConfig) if f.name == name)


def _train_option(*decls: str, **kwargs: Any) -> Any:
    """An option of ``train`` whose default (shown in --help) is TrainConfig's."""
    name = kwargs.pop("dest", None) or decls[-1].lstrip("-").replace("-", "_")
    default = _train_default(name)
    if kwargs.get("is_flag"):
        return click.option(*decls, name, default=default, **kwargs)
    shown = default is not None and default != ()
    return click.option(*decls, name, default=default, show_default=shown, **kwargs)


@cli.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=str),
    help="A TOML file of these options (lr = 0.1, grad-accum = 4); flags override it.",
)
@_train_option(
    "--mode",
    type=click.Choice(["single", "dp", "ddp", "fsdp"]),
    help="single device, nn.DataParallel, DistributedDataParallel, or FSDP2 (fully_shard).",
)
@_train_option("--epochs", type=click.IntRange(min=1))
@_train_option(
    "--max-steps",
    type=click.IntRange(min=1),
    help="Stop after this many optimizer steps (a checkpoint is saved).",
)
@_train_option(
    "--batch-size",
    type=click.IntRange(min=1),
    help="Global batch of one optimizer step, split over the ranks.",
)
@_train_option(
    "--grad-accum",
    type=click.IntRange(min=1),
    help="Micro-batches per optimizer step (each rank's batch split in N).",
)
@_train_option("--optimizer", type=click.Choice(["sgd", "adamw", "adam"]))
@_train_option("--lr", type=float, help="Learning rate (before the schedule).")
@_train_option("--momentum", type=float, help="SGD's momentum.")
@_train_option("--weight-decay", type=float)
@_train_option(
    "--lr-schedule",
    type=click.Choice(["constant", "step", "cosine"]),
    help="Per step: step multiplies the lr by --lr-gamma every --lr-step-epochs "
    "epochs; cosine decays it to 0 at the last step.",
)
@_train_option("--lr-step-epochs", type=click.IntRange(min=1))
@_train_option("--lr-gamma", type=float)
@_train_option(
    "--warmup-steps",
    type=click.IntRange(min=0),
    help="Linear warmup from 0 to --lr over this many steps.",
)
@_train_option(
    "--precision",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    help="bf16/fp16: autocast; fp16 with a gradient scaler, saved and resumed.",
)
@_train_option(
    "--clip-grad-norm",
    type=click.FloatRange(min=0, min_open=True),
    help="Clip the gradients' total norm to this.",
)
@_train_option(
    "--loss",
    metavar="cross_entropy|mse|MODULE:FN",
    help="Loss of (output, target); a model returning a mapping with 'loss' (as "
    "Hugging Face models do) gives its own.",
)
@_train_option("--seed", type=int)
@_train_option("--out", help="Run folder: checkpoints, metrics.")
@_train_option(
    "--save-every", type=click.IntRange(min=1), help="Save every N epochs (and after the last)."
)
@_train_option(
    "--save-every-steps",
    type=click.IntRange(min=1),
    help="Also save every N optimizer steps, mid-epoch (resumed exactly).",
)
@_train_option("--keep-last", type=click.IntRange(min=0), help="Checkpoints to keep (0: all).")
@_train_option(
    "--async-save",
    is_flag=True,
    help="Copy the state to CPU memory and write it on a thread while training goes "
    "on (one save at a time; pt or safetensors).",
)
@_train_option(
    "--resume", metavar="PATH|auto", help="Resume from a checkpoint, or the newest complete one."
)
@_train_option(
    "--overwrite",
    is_flag=True,
    help="Delete an earlier run's checkpoints and logs in --out first (without it, or "
    "--resume, an --out holding a run is refused).",
)
@_train_option("--device", type=click.Choice(["cpu", "cuda"]))
@_train_option(
    "--save-format",
    type=click.Choice(["pt", "safetensors", "both", "dcp"]),
    help="pt: whole training state; safetensors: weights only; dcp: a folder of every rank's "
    "shards (torch.distributed.checkpoint).  [default: dcp in fsdp, else pt]",
)
@_train_option(
    "--model", metavar="MODULE:FACTORY", help="Your model factory (default: built-in demo)."
)
@_train_option(
    "--data",
    metavar="MODULE:FACTORY",
    help="Your dataset factory: (input, target) items, or mappings passed as keywords.",
)
@_train_option("--val-data", metavar="MODULE:FACTORY", help="Validation dataset factory.")
@_train_option(
    "--val-fraction",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    help="Hold out this fraction of the training data (seeded) to validate on.",
)
@_train_option("--val-every", type=click.IntRange(min=1), help="Validate every N epochs.")
@_train_option(
    "--monitor",
    metavar="METRIC",
    help="val_loss, val_accuracy, loss...: the `best` pointer names the checkpoint "
    "where it was best (never pruned).",
)
@_train_option("--monitor-mode", type=click.Choice(["min", "max"]))
@_train_option(
    "--early-stop-patience",
    type=click.IntRange(min=1),
    help="Stop after N validations without --monitor improving.",
)
@_train_option(
    "--log-every",
    type=click.IntRange(min=1),
    help="A line of steps.jsonl (loss, accuracy, lr) every N steps.",
)
@_train_option(
    "--log",
    type=click.Choice(["tensorboard"]),
    multiple=True,
    help="Also write TensorBoard event files to OUT/tensorboard (needs the "
    "ckptkit[tensorboard] extra).",
)
@_train_option("--num-workers", type=click.IntRange(min=0), help="DataLoader worker processes.")
@_train_option("--compile", is_flag=True, help="torch.compile the model (keys stay canonical).")
@_train_option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    help="DDP / FSDP workers to start here (ignored under torchrun).",
)
@_train_option(
    "--timeout",
    dest="timeout_s",
    type=click.FloatRange(min=1),
    help="Process-group timeout in seconds: a stuck rank fails the job this fast.",
)
@json_option
@_train_option("-q", "--quiet", is_flag=True, help="No progress bar, no per-epoch lines.")
@click.pass_context
def train(ctx: click.Context, as_json: bool, config_file: str | None, **options: Any) -> None:
    """Train in any mode; checkpoints load in every other mode.

    \b
    ckptkit train --mode ddp --nproc-per-node 2 --epochs 4 --out runs/demo
    ckptkit train --mode fsdp --nproc-per-node 2 --out runs/fsdp
    ckptkit train --config run.toml --lr 0.1 --resume auto
    torchrun --nnodes 2 --node-rank 0 ... -m ckptkit train --mode ddp
    """
    from ckptkit.engine import TrainConfig
    from ckptkit.engine import train as run
    from ckptkit.engine.config import read_config

    if config_file is not None:  # the file, then the flags given on the command line
        given = {
            name: value
            for name, value in options.items()
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
        }
        options = {**options, **read_config(config_file), **given}
    result = run(TrainConfig(**options))
    if os.environ.get("LOCAL_RANK", "0") != "0":  # under torchrun: one report per node
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
@variant_option
@names_from_option
@click.option(
    "--stats",
    is_flag=True,
    help="Read every tensor once: min, max, mean, std, NaN and inf counts (the table replaces "
    "the tree).",
)
@click.option(
    "--map",
    "mapping",
    metavar="NAME|FILE",
    help="Show what `convert --map` would make of PATH: each rule, what it takes, every "
    "target tensor and where it comes from (nothing is written).",
)
@reverse_option
@set_option
@json_option
@quiet_option
def inspect(
    path: str,
    select: str | None,
    flat: bool,
    key_filter: str | None,
    depth: int | None,
    variant: str | None,
    names_from: str | None,
    stats: bool,
    mapping: str | None,
    reverse: bool,
    sets: tuple[str, ...],
    as_json: bool,
    quiet: bool,
) -> None:
    """Show what is in a checkpoint without loading its tensors or running its pickle.

    \b
    ckptkit inspect model.pt
    ckptkit inspect model.safetensors --filter 'layers.0.*' --flat
    ckptkit inspect shards/ --depth 2
    ckptkit inspect download.safetensors --stats
    ckptkit inspect llama-2-13b/ --map llama-meta
    """
    from ckptkit.mapping.recognise import model_parallel
    from ckptkit.storage.location import is_local, location
    from ckptkit.summary import keep, summarize

    said = None
    where = location(path)
    asked = mapping is not None or reverse or sets or select is not None
    if not asked and is_local(where) and (found := model_parallel(where)) is not None:
        mapping, said = found.pack, found.said(where)  # only a pack reads such a folder
    if mapping is not None:
        _inspect_mapped(path, mapping, reverse, sets, select, key_filter, as_json, quiet, said)
        return
    if reverse or sets:
        raise UsageError("--reverse and --set go with --map NAME|FILE")
    if flat and depth:
        raise UsageError("--flat and --depth do not go together", "use one of them")
    summary = summarize(path, select=select, variant=variant, names_from=names_from)
    values = None
    if stats:  # every tensor read once (the headers alone say nothing of the values)
        from ckptkit.stats import tensor_stats

        keys = [key for key, _ in summary.tensors if keep(key, key_filter)]
        values = tensor_stats(path, select=select, keys=keys)
    if as_json:
        document = summary.to_dict(key_filter)
        if values is not None:
            document["stats"] = {key: s.to_dict() for key, s in values.items()}
        _emit("inspect", document)
    elif not quiet:
        from ckptkit.render import inspect_lines

        if values is not None:
            from ckptkit.render import summary_lines
            from ckptkit.stats import stats_lines

            _echo([*summary_lines(summary), "", *stats_lines(values)])
        else:
            _echo(inspect_lines(summary, flat=flat, depth=depth, key_filter=key_filter))


def _inspect_mapped(
    path: str,
    mapping: str,
    reverse: bool,
    sets: tuple[str, ...],
    select: str | None,
    key_filter: str | None,
    as_json: bool,
    quiet: bool,
    said: str | None = None,
) -> None:
    """``inspect PATH --map NAME``: the mapped conversion's plan, nothing written (``said``:
    why a folder inspected without --map is shown through a pack)."""
    from ckptkit.formats.open import OpenOptions
    from ckptkit.mapping.source import MapOptions, map_plan, parse_sets
    from ckptkit.render import mapping_plan_lines

    options = MapOptions(mapping=mapping, reverse=reverse, sets=parse_sets(sets))
    plan = map_plan(path, options, OpenOptions(select=select))
    plan["recognised"] = said
    if as_json:
        _emit("inspect", plan)
    elif not quiet:
        _echo([*([said] if said else []), *mapping_plan_lines(plan, key_filter)])


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
            from ckptkit.text import escape

            click.echo(escape(f"Error: {report.error}"), err=True)
    worst = overall_verdict(reports)
    if as_json:
        _emit("scan", {"verdict": worst, "files": [r.to_dict() for r in reports]})
    elif not quiet:
        for report in reports:
            _echo(scan_lines(report))
    if worst != "safe":
        raise click.exceptions.Exit(2 if worst == "error" else 1)


@cli.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("-o", "--output", "out", required=True, metavar="PNG", help="The image to write.")
@click.option("--force", is_flag=True, help="Overwrite the image if it exists.")
@click.option(
    "--log-y/--no-log-y",
    "log_y",
    default=None,
    help="A log or a linear loss axis (default: log when the loss spans more than two decades).",
)
@json_option
def plot(runs: tuple[str, ...], out: str, force: bool, log_y: bool | None, as_json: bool) -> None:
    """Draw loss, accuracy and learning rate per step of one or more runs, side by side.

    \b
    ckptkit plot runs/single runs/ddp -o curves.png
    """
    from ckptkit.plot import plot_runs

    path = plot_runs(list(runs), out, force=force, log_y=log_y)
    if as_json:
        _emit("plot", {"image": str(path), "runs": list(runs)})
    else:
        _echo([f"Wrote    {path} ({len(runs)} run{'s' if len(runs) > 1 else ''})"])


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
@click.option("--variant-a", metavar="NAME", help="A model folder A's weights variant (fp16).")
@click.option("--variant-b", metavar="NAME", help="A model folder B's weights variant (fp16).")
@click.option(
    "--names-from-a",
    metavar="MODEL_FOLDER",
    type=click.Path(exists=True, path_type=str),
    help="A is a diffusers EMAModel state dict: name its shadow_params after this model.",
)
@click.option(
    "--names-from-b",
    metavar="MODEL_FOLDER",
    type=click.Path(exists=True, path_type=str),
    help="B is a diffusers EMAModel state dict: name its shadow_params after this model.",
)
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
    variant_a: str | None,
    variant_b: str | None,
    names_from_a: str | None,
    names_from_b: str | None,
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
        report = run(
            a,
            b,
            atol=atol,
            rtol=rtol,
            keys_only=keys_only,
            select_a=select_a,
            select_b=select_b,
            variant_a=variant_a,
            variant_b=variant_b,
            names_from_a=names_from_a,
            names_from_b=names_from_b,
            allow_globals=allow_global,
            progress=_progress(quiet or as_json),
        )
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
    from ckptkit.allocator import return_large_buffers

    return_large_buffers()  # a streamed conversion's freed tensors go back to the system
    cli.main(argv, prog_name="ckptkit")
