"""``convert``: plan from headers, write tensor by tensor, report what was done.

The plan (which tensors, under which keys, in which dtype, in which shard) is computed from
headers before any tensor is read, so ``dry_run`` shows it and collisions fail before anything
is written. Each output format's writer (``formats/output/writers.py``) writes it to temporary
paths and reads it back; the output appears atomically, only after it compared bit-exact with
the source.

This module is the public front: the keyword API (``convert``, ``merge_adapters``), the
grouped one (``convert_checkpoint``), and a whole diffusers pipeline sent to
``pipeline_convert.py``. The work is in ``ckptkit.conversion`` (options, plan, write, report,
run), one job a module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from ckptkit.adapters import AdapterOptions, adapter_options
from ckptkit.conversion.options import Job, OutputOptions, ReadOptions
from ckptkit.conversion.report import ConvertReport
from ckptkit.conversion.run import convert_model
from ckptkit.errors import UsageError
from ckptkit.formats.files.readings import WEIGHT_SUFFIXES
from ckptkit.formats.output.plan import parse_size
from ckptkit.keys import KeyRules
from ckptkit.mapping.source import MapOptions
from ckptkit.spread import Part, parse_part
from ckptkit.storage.location import is_local, is_remote, local_path, location

__all__ = [
    "convert",
    "merge_adapters",
    "convert_checkpoint",
    "ConvertReport",
    "ReadOptions",
    "OutputOptions",
    "KeyRules",
    "parse_size",
]


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    select: str | None = None,
    ema: bool = False,
    strip_wrappers: bool = False,
    strip_module: bool = False,
    strip_prefixes: Iterable[str] = (),
    add_module: bool = False,
    add_prefixes: Iterable[str] = (),
    renames: Iterable[str | tuple[re.Pattern[str], str]] = (),
    match_to: str | Path | None = None,
    dtype: str | None = None,
    keep_dtype: Iterable[str] = (),
    allow_overflow: bool = False,
    max_shard_size: int | str | None = None,
    keep_tied_copies: bool = False,
    to: str | None = None,
    tensor_parallel: int | None = None,
    pipeline_parallel: int | None = None,
    expert_parallel: int | None = None,
    virtual_stages: int | None = None,
    dry_run: bool = False,
    force: bool = False,
    verify: bool = True,
    trust: bool = False,
    allow_globals: Iterable[str] = (),
    progress: bool = False,
    variant: str | None = None,
    names_from: str | Path | None = None,
    workers: int = 8,
    part: str | None = None,
    drop_adapters: bool = False,
    lora_alpha: float | None = None,
    adapter_config: str | Path | None = None,
    mapping: str | Path | None = None,
    reverse: bool = False,
    sets: Mapping[str, int | float | str] | None = None,
    check_roundtrip: bool = False,
    config_from: str | Path | None = None,
) -> ConvertReport:
    """Convert a checkpoint's state dict to safetensors, a plain ``.pt`` state dict or a DCP
    folder. This is the keyword front of :func:`convert_checkpoint` (the one function allowed
    its length: its arguments and their documentation).

    Args:
        src: the checkpoint to read (torch zip or legacy, safetensors, or sharded). A diffusers
            pipeline folder without ``select`` is converted whole into the pipeline folder
            ``dst`` (see ``pipeline_convert.py``).
        dst: the output; its suffix picks the format (``.safetensors``, ``.pt``) unless
            ``to`` does.
        select: dotted path of the state dict in a training checkpoint (default: found).
        ema: take a training checkpoint's EMA copy of the weights (timm's ``state_dict_ema``,
            ``model_ema``, ``ema``...); the report says which part was taken and why.
        strip_wrappers: strip the whole detected wrapper chain (``module._orig_mod.`` ...).
        strip_module: strip one leading ``module.`` (DataParallel / DDP).
        strip_prefixes: further prefixes to strip, such as Lightning's ``model.``.
        add_module: add ``module.`` so the result loads into a DP / DDP-wrapped model.
        add_prefixes: further prefixes to add (the first ends up innermost).
        renames: ``REGEX=REPLACEMENT`` rules applied to every key, in order.
        match_to: a reference checkpoint whose key layout the output must match exactly.
        dtype: cast floating-point tensors to ``bf16``, ``fp16`` or ``fp32``; integer and bool
            tensors never change.
        keep_dtype: globs of (output) keys that keep their dtype.
        allow_overflow: let a cast turn finite values into infinities.
        max_shard_size: split safetensors output into shards of at most this many bytes
            (``"5GB"``, ``"2GiB"`` or an int), with a Hugging Face style index.
        to: the output format: ``safetensors``, ``pt``, or ``dcp`` (a folder that
            ``torch.distributed.checkpoint.load`` reads, into a plain or a sharded model),
            ``megatron`` (a legacy Megatron-LM save, its model cut into rank files).
        tensor_parallel: with ``to="megatron"``, the tensor-parallel size (default 1).
        pipeline_parallel: with ``to="megatron"``, the pipeline stages (default 1).
        expert_parallel: with ``to="megatron"``, the expert-parallel ranks (default 1).
        virtual_stages: with ``to="megatron"``, the virtual pipeline stages on each stage.
        keep_tied_copies: write every name of a tied group to safetensors (by default one
            tensor is written and the others are named in the metadata, as
            ``safetensors.torch.save_model`` does; ``.pt`` output keeps one shared storage).
        dry_run: plan and report only; write nothing.
        force: replace existing outputs.
        verify: read the output back and compare every tensor bit-exact with the source.
        trust: read ``src`` with torch's full unpickler (only for files you trust).
        allow_globals: pickle globals to admit beside torch's safe set (never imported).
        progress: show a progress bar on stderr.
        variant: in a model folder, the weights of this variant (diffusers'
            ``diffusion_pytorch_model.fp16.safetensors`` for ``"fp16"``).
        names_from: the model folder a diffusers ``EMAModel`` state dict belongs to: its
            ``shadow_params`` take the model's parameter names, in order, and a folder ``dst``
            gets the model's config.
        workers: ranged requests in flight when ``src`` is a URL (``s3://``, ``https://``...);
            memory holds about ``workers + 1`` requests of 8 MiB.
        part: ``"I/N"``: write only part I of N of a sharded output's shards, no index
            (``ckptkit.spread.finish`` writes it once every part is done).
        drop_adapters: ``src`` is a PeftModel state dict: write the base model alone.
        lora_alpha: ``src`` is a PeftModel state dict: merge its adapter with this
            ``lora_alpha`` (the rank from the factors' shapes).
        adapter_config: ``src`` is a PeftModel state dict: merge its adapter as this
            ``adapter_config.json`` says.
        mapping: map names and shapes with this mapping file or pack (``"llama-meta"``):
            see docs/mapping.md.
        reverse: with ``mapping``, map the other way.
        sets: with ``mapping``, its variables (``{"tp": 2}``).
        config_from: with ``mapping``, a model folder whose config document the target takes
            as it is (its variables read from it, the weights checked against it), with its
            tokenizer files.
        check_roundtrip: with ``mapping``, map each group back as it streams and compare it
            with the source bit for bit.

    Returns:
        The report: where the state dict was, the key plan, what was dropped, cast and written.

    Raises:
        CkptkitError: a subclass naming the file, the key and the fix, before anything is
            written whenever the problem can be seen from headers.
    """
    # The keyword front of convert_checkpoint: its length is its arguments and their docs.
    return convert_checkpoint(
        src,
        dst,
        read=ReadOptions(
            select=select,
            ema=ema,
            trust=trust,
            allow_globals=tuple(allow_globals),
            variant=variant,
            adapters=AdapterOptions(
                drop_adapters=drop_adapters,
                lora_alpha=lora_alpha,
                adapter_config=None if adapter_config is None else str(adapter_config),
            ),
            names_from=None if names_from is None else str(names_from),
            mapping=None
            if mapping is None
            else MapOptions(
                mapping=mapping,
                reverse=reverse,
                sets=dict(sets or {}),
                check_roundtrip=check_roundtrip,
                config_from=None if config_from is None else Path(config_from),
            ),
            workers=workers,
        ),
        keys=KeyRules(
            strip_wrappers,
            strip_module,
            tuple(strip_prefixes),
            add_module,
            tuple(add_prefixes),
            tuple(renames),
            None if match_to is None else str(match_to),
        ),
        output=OutputOptions(
            to,
            dtype,
            tuple(keep_dtype),
            allow_overflow,
            max_shard_size,
            keep_tied_copies,
            tensor_parallel,
            pipeline_parallel,
            expert_parallel,
            virtual_stages,
        ),
        dry_run=dry_run,
        force=force,
        verify=verify,
        progress=progress,
        part=part,
    )


def merge_adapters(
    base: str | Path,
    adapters: Iterable[str | Path | tuple[str | Path, float]],
    dst: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: int | str | None = None,
    force: bool = False,
    verify: bool = True,
    check_outputs: bool = False,
    progress: bool = False,
) -> ConvertReport:
    """Merge LoRA adapters into a base model, one tensor at a time, and write the result.

    Args:
        base: the base model (a file, or a Hugging Face folder, which gives a folder ``dst``
            with its config and tokenizer files).
        adapters: PEFT adapter folders or kohya LoRA files, merged in order: ``PATH``,
            ``"PATH:WEIGHT"`` or ``(PATH, WEIGHT)``.
        dst: the output file, or a new folder for a folder base.
        dtype: cast the output (``bf16``, ``fp16``, ``fp32``); by default the base's dtypes.
        max_shard_size: shard the output (default: as the base folder was sharded).
        force: replace an existing ``dst``.
        verify: read the output back: merged tensors against a fresh merge from the files,
            the others bit-exact.
        check_outputs: run each merged layer and its unmerged form on seeded inputs.
        progress: show a progress bar on stderr.

    Returns:
        The report, with each merged tensor's relative change (and the output check).
    """
    return convert_checkpoint(
        base,
        dst,
        read=ReadOptions(adapters=adapter_options(None, adapters)),
        output=OutputOptions(dtype=dtype, max_shard_size=max_shard_size),
        force=force,
        verify=verify,
        check_outputs=check_outputs,
        progress=progress,
    )


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    read: ReadOptions | None = None,
    keys: KeyRules | None = None,
    output: OutputOptions | None = None,
    dry_run: bool = False,
    force: bool = False,
    verify: bool = True,
    check_outputs: bool = False,
    progress: bool = False,
    part: Part | str | None = None,
) -> ConvertReport:
    """:func:`convert` with its options grouped, as the CLI gives them: plan, write, report
    (``ckptkit.conversion``), or a whole diffusers pipeline (``pipeline_convert.py``). A
    ``dst`` URL is written through a local staging folder (see ``storage/destination.py``);
    ``part`` writes one share of a sharded output's shards (see ``ckptkit.spread``)."""
    job = Job(
        read=read or ReadOptions(),
        keys=keys or KeyRules(),
        output=output or OutputOptions(),
        dry_run=dry_run,
        force=force,
        verify=verify,
        check_outputs=check_outputs,
        progress=progress,
        part=parse_part(part) if isinstance(part, str) else part,
    )
    if _whole_pipeline(src, dst, job.read, part):
        return _convert_pipeline(src, dst, job)
    return convert_model(src, dst, job)


def _whole_pipeline(
    src: str | Path, dst: str | Path, read: ReadOptions, part: Part | str | None
) -> bool:
    """A local diffusers pipeline folder, converted whole into a folder (no component selected,
    nothing merged, not an EMAModel's weights, not a share of the shards). Into a file, the
    pipeline's error asks which component."""
    from ckptkit.formats.folders.diffusers import is_pipeline

    plain = read.select is None and not read.ema and read.names_from is None
    into_file = Path(str(dst)).suffix.lower() in WEIGHT_SUFFIXES
    merges_only = replace(read.adapters, adapters=()) == AdapterOptions()  # kohya LoRAs merged
    return (
        plain
        and not into_file
        and merges_only
        and part is None
        and is_local(where := location(src))  # a pipeline at a URL: a component with --select
        and is_pipeline(where)
    )


def _convert_pipeline(src: str | Path, dst: str | Path, job: Job) -> ConvertReport:
    """``convert PIPELINE OUT``: every component, into a pipeline folder (pipeline_convert.py)."""
    from ckptkit.pipeline_convert import convert_pipeline

    if is_remote(str(dst)):
        raise UsageError(
            f"{src} is a diffusers pipeline: converted whole, it is written to a local folder",
            "give a local folder, or take one component with --select NAME",
            api_hint="give a local folder, or take one component with select=",
        )
    if job.check_outputs:
        raise UsageError(
            "--check-outputs checks the merge of one model",
            "take one component with --select NAME",
            api_hint="take one component with select=",
        )
    return convert_pipeline(local_path(location(src)), Path(dst), job)
