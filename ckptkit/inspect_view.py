"""The text ``inspect`` prints of a ``Summary``: the header facts, then the tensors as a tree
(repeated layers folded) or a flat list. ``render.py`` holds every other command's view; this
one sits below ``summary.py``, whose ``str()`` of a Summary is this text."""

from __future__ import annotations

from typing import Any

from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.source import TensorInfo
from ckptkit.keyfold import collapse, keep
from ckptkit.meta import NAMESPACE, TRAINING_KEY
from ckptkit.wording import describe_tensor, human_size, plural, short, terminal_safe

__all__ = ["inspect_lines", "summary_lines", "tree_lines", "flat_lines", "adapter_lines"]


@terminal_safe
def flat_lines(summary: Any, *, key_filter: str | None = None) -> list[str]:
    """One line per tensor: key, shape, dtype, size."""
    rows = [(k, i) for k, i in summary.tensors if keep(k, key_filter)]
    width = max((len(k) for k, _ in rows), default=0)
    return [f"{key:<{width}}  {describe_tensor(info)}" for key, info in rows]


@terminal_safe
def tree_lines(
    summary: Any, *, depth: int | None = None, key_filter: str | None = None
) -> list[str]:
    """Tensors as a tree by module path, repeated layers folded, subtrees past ``depth`` summed."""
    # Fold on what a tensor looks like, not on where its bytes live: one TensorInfo per look
    # (100,000 experts have a handful), so collapse compares objects it has seen by identity.
    looks: dict[tuple[Any, ...], TensorInfo] = {}
    rows = []
    for key, i in summary.tensors:
        if key_filter is not None and not keep(key, key_filter):
            continue
        look = (i.dtype, i.shape, i.contiguous, i.kind, i.detail, i.stored)
        info = looks.get(look)
        if info is None:
            info = looks[look] = TensorInfo(
                i.dtype,
                i.shape,
                contiguous=i.contiguous,
                kind=i.kind,
                detail=i.detail,
                stored=i.stored,
            )
        rows.append((key, info))
    folded = collapse(rows)
    root: dict[str, Any] = {}
    for parts, info, count in folded:
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = (info, count)
    lines: list[str] = []
    _render(root, 0, depth, lines)
    return lines


def _totals(node: Any) -> tuple[int, int]:
    if isinstance(node, tuple):
        info, count = node
        return count, info.nbytes * count
    tensors = size = 0
    for child in node.values():
        t, s = _totals(child)
        tensors, size = tensors + t, size + s
    return tensors, size


def _render(node: dict[str, Any], level: int, depth: int | None, lines: list[str]) -> None:
    width = max((len(name) for name in node), default=0)
    for name, child in node.items():
        label = name
        # Merge chains of single children ("encoder.layer" rather than two lines).
        while isinstance(child, dict) and len(child) == 1:
            ((inner, grandchild),) = child.items()
            label, child = f"{label}.{inner}", grandchild
        pad = "  " * level
        if isinstance(child, tuple):
            info, count = child
            lines.append(f"{pad}{label:<{width}}  {describe_tensor(info, count)}")
        else:
            tensors, size = _totals(child)
            lines.append(f"{pad}{label}  ({plural(tensors, 'tensor')}, {human_size(size)})")
            if depth is None or level + 1 < depth:
                _render(child, level + 1, depth, lines)


@terminal_safe
def summary_lines(summary: Any) -> list[str]:
    """The header of the default view: one fact a line."""
    lines = _where_lines(summary) + _contents_lines(summary)
    if summary.ema_model:
        lines += _ema_model_lines(summary.ema_model)
    if summary.adapter:
        return lines + adapter_lines(summary.adapter)
    lines += _key_lines(summary)
    lines += _training_lines(summary.training)
    lines += _metadata_lines(summary)
    lines.extend(_safety_lines(summary.safety))
    return lines


def _contents_lines(summary: Any) -> list[str]:
    """Its shards and parts, the state dict taken (and the others there), its tensors."""
    lines = []
    if summary.shards:
        lines.append(f"shards      {len(summary.shards)}: {', '.join(summary.shards)}")
    width = max((len(p["name"]) for p in summary.parts), default=0)
    for part in summary.parts:
        lines.append(
            f"part        {part['name']:<{width}}  {part['kind']}, {human_size(part['bytes'])}, "
            f"{part['verdict']}"
        )
    where = f"'{summary.selected}'" if summary.selected else "the top level"
    lines.append(f"state dict  {where} ({summary.selected_reason})")
    if len(summary.candidates) > 1:
        shown = []
        for c in summary.candidates:
            taken = "taken" if c.path == summary.selected else ("--ema" if c.is_ema else "--select")
            shown.append(f"'{c.path}' ({c.why}, {plural(c.tensors, 'tensor')}; {taken})")
        lines.append(f"weights     {'; '.join(shown)}")
    by_dtype = ", ".join(
        f"{DTYPES[d].short if d in DTYPES else d} {human_size(n)}"
        for d, n in summary.bytes_by_dtype.items()
    )
    count = f"{len(summary.tensors)}, {summary.parameters:,} elements, {human_size(summary.nbytes)}"
    lines.append(f"tensors     {count}" + (f" ({by_dtype})" if by_dtype else ""))
    return lines


def _key_lines(summary: Any) -> list[str]:
    """What its keys say: wrappers, a common prefix, ties, shared and strided storage, and the
    parts that are not weights."""
    lines = []
    if summary.wrappers:
        chain = " ".join(f"{w.prefix} ({w.added_by})" for w in summary.wrappers)
        lines.append(f"wrappers    {chain}; `ckptkit convert --strip-wrappers` removes them")
    else:
        lines.append("wrappers    none")
    lines += _mapping_lines(summary.mapping)
    if summary.common_prefix and summary.model_folder:
        lines.append(
            f"prefix      every key starts with '{summary.common_prefix}': the model folder's "
            "own names, which from_pretrained needs as they are"
        )
    elif summary.common_prefix:
        prefix = summary.common_prefix
        lines.append(
            f"prefix      every key starts with '{prefix}'; "
            f"`ckptkit convert --strip-prefix {prefix}` removes it"
        )
    for alias, target in summary.aliases.items():
        lines.append(f"tied        {alias} = {target}")
    for group in summary.shared:
        lines.append(
            f"shared      {len(group)} tensors in one buffer: {', '.join(group[:4])}"
            + (" ..." if len(group) > 4 else "")
        )
    if summary.non_contiguous:
        lines.append(
            f"strided     {', '.join(summary.non_contiguous[:5])}"
            + (" ..." if len(summary.non_contiguous) > 5 else "")
        )
    for part in summary.dropped:
        lines.append(
            f"also        {part.path}: {plural(part.tensors, 'tensor')}, "
            f"{human_size(part.nbytes)} (not weights)"
        )
    return lines


def _mapping_lines(mapping: dict[str, Any] | None) -> list[str]:
    """A model family's own names or rank file: the pack that maps it (``convert --map``)."""
    if mapping is None:
        return []
    if mapping["rank_file"]:
        return [f"mapping     {mapping['rank_file']}"]
    named = " or ".join(mapping["packs"])
    return [
        f"mapping     a model family's own names, which {named} maps: "
        f"`ckptkit convert --map {mapping['packs'][0]}` makes a Hugging Face model "
        f"(`inspect --map` shows how)"
    ]


def _training_lines(run: dict[str, Any]) -> list[str]:
    """The training run an engine checkpoint (or a file converted from one) records."""
    lines = []
    if run:
        lines.append(
            f"trained     {run.get('mode')} x{run.get('world_size')} on {run.get('nodes')} node(s) "
            f"({run.get('backend') or 'no process group'}, {run.get('device_type')}), epoch "
            f"{run.get('epoch')}, step {run.get('step')}, seed {run.get('seed')}, "
            f"torch {run.get('torch_version')}, {run.get('utc_time')}"
        )
        if run.get("removed_prefixes"):
            removed = "".join(run["removed_prefixes"])
            lines.append(f"unwrapped   saved without its {removed} wrapper: loads in any mode")
        if run.get("weights_sha256"):  # a DCP checkpoint's shards are not hashed whole
            lines.append(f"weights     sha256 {run['weights_sha256']}")
    return lines


def _metadata_lines(summary: Any) -> list[str]:
    """The non-tensor values beside the weights, the file's metadata, and ckptkit's own."""
    lines = []
    for key, value in summary.extras.items():
        if key != TRAINING_KEY and not summary.ema_model:  # an EMAModel's: in its line
            lines.append(f"also        {key} = {short(value)}")
    for key, value in summary.metadata.items():
        if not key.startswith(NAMESPACE):
            lines.append(f"metadata    {key} = {short(value)}")
    for key, value in summary.ckptkit_metadata.items():
        if key != "training":
            lines.append(f"ckptkit     {key} = {short(value)}")
    return lines


def _safety_lines(report: Any) -> list[str]:
    if report is None:
        return []
    if not report.pickles:
        return ["safety      safe: no pickle (safetensors holds only data)"]
    names = report.globals()
    odd = {name: cls for name, cls in names.items() if cls not in ("safe", "data")}
    data = [name for name, cls in names.items() if cls == "data"]
    if not odd and not report.problems and not report.damaged:
        if not data:
            return [f"safety      safe: {len(names)} globals, all in torch's weights_only set"]
        count = plural(len(names) - len(data), "global")
        return [
            f"safety      safe: {count} in torch's weights_only set, and plain data decoded "
            f"statically: {', '.join(data)}"
        ]
    listed = ", ".join(f"{name} ({cls})" for name, cls in odd.items())
    return [f"safety      {report.verdict}: {listed}; `ckptkit scan` explains"]


@terminal_safe
def adapter_lines(adapter: dict[str, Any]) -> list[str]:
    """What ``inspect`` says of a LoRA adapter (or a PeftModel state dict)."""
    if adapter["kind"] == "PeftModel state dict":
        return [
            f"adapter     a PeftModel state dict: the base's weights with "
            f"{plural(adapter['adapter_tensors'], 'adapter tensor')} "
            f"({human_size(adapter['adapter_bytes'])}) beside them and no lora_alpha",
            f"convert     {adapter['convert']}",
        ]
    pairs = ", ".join(f"r={p['rank']} alpha={p['alpha']:g}" for p in adapter["rank_alpha"])
    lines = [
        f"adapter     {adapter['kind']} ({adapter['variant']}), "
        f"{plural(len(adapter['targets']), 'module')}, {human_size(adapter['bytes'])}",
        f"base        {adapter['base'] or '(not named: convert needs --base PATH)'}",
        f"rank        {pairs}",
        f"targets     {', '.join(adapter['target_modules'])}",
    ]
    if len(adapter["rank_alpha"]) > 1:  # rank_pattern / alpha_pattern: per module
        lines += [
            f"  {t['module']}: r={t['rank']} alpha={t['alpha']:g}" for t in adapter["targets"]
        ]
    if adapter["modules_to_save"]:
        lines.append(f"replaces    {', '.join(adapter['modules_to_save'])} (modules_to_save)")
    for key, rows in adapter["trainable_tokens"].items():
        lines.append(f"tokens      {len(rows)} rows of {key} (trainable tokens: {rows})")
    lines.append("merge       `ckptkit convert ADAPTER OUT` (into the base; --base PATH to choose)")
    return lines


def _where_lines(summary: Any) -> list[str]:
    """The path, format and size, on disk or at a URL; and what reading it there fetched."""
    where = "at the URL" if summary.fetched is not None else "on disk"
    lines = [f"{summary.path}  ({summary.format}, {human_size(summary.file_size)} {where})"]
    if summary.fetched is not None:
        lines.append(
            f"fetched     {plural(summary.fetched['requests'], 'request')}, "
            f"{human_size(summary.fetched['bytes'])} of its {human_size(summary.file_size)} "
            "(headers, read 256 kB at a time)"
        )
    return lines


def _pipeline_lines(summary: Any) -> list[str]:
    """A diffusers pipeline folder: its components, and how to take one."""
    pipe = summary.pipeline
    version = f", diffusers {pipe['diffusers_version']}" if pipe["diffusers_version"] else ""
    lines = _where_lines(summary) + [
        f"pipeline    {pipe['class']}{version}, {plural(len(pipe['components']), 'component')}",
    ]
    width = max((len(c["name"]) for c in pipe["components"]), default=0)
    for c in pipe["components"]:
        what, w = f"{c['name']:<{width}}  {c['class']} ({c['library']})", c["weights"]
        if c.get("error"):
            lines.append(f"component   {what}: {c['error']}")
        elif w is None:
            lines.append(f"component   {what}: no weights")
        else:
            dtypes = ", ".join(DTYPES[d].short if d in DTYPES else d for d in w["bytes_by_dtype"])
            lines.append(
                f"component   {what}: {w['file']}, {plural(w['tensors'], 'tensor')}, "
                f"{w['parameters']:,} elements, {human_size(w['bytes'])} ({dtypes}), {w['verdict']}"
            )
    taken = [c["name"] for c in pipe["components"] if c["weights"]]
    example = "unet" if "unet" in taken else (taken[0] if taken else "COMPONENT")
    lines.append(
        f"convert     `ckptkit convert {summary.path} OUT` takes the whole pipeline; "
        f"`--select {example}` one component (`inspect --select {example}` shows it)"
    )
    return lines


def _ema_model_lines(ema: dict[str, Any]) -> list[str]:
    """A diffusers EMAModel state dict: its settings, and how its weights get names."""
    settings = ", ".join(f"{k} {short(v)}" for k, v in ema["settings"].items())
    named = "no names" if ema["names_from"] is None else f"named after {ema['names_from']}"
    return [
        f"ema model   a diffusers EMAModel: {ema['shadow_params']} shadow parameters, {named} "
        f"({settings})",
        f"convert     `{ema['convert']}`" + (" maps them" if ema["names_from"] is None else ""),
    ]


@terminal_safe
def inspect_lines(
    summary: Any, *, flat: bool = False, depth: int | None = None, key_filter: str | None = None
) -> list[str]:
    """``inspect``'s text: the header facts, a blank line, then the tree or the flat list."""
    if summary.pipeline:
        return _pipeline_lines(summary)
    if summary.ema_model and summary.ema_model["names_from"] is None:
        flat = True  # positions, not names: the tree would fold them into long sets
    body = (
        flat_lines(summary, key_filter=key_filter)
        if flat
        else tree_lines(summary, depth=depth, key_filter=key_filter)
    )
    return [*summary_lines(summary), "", *(body or ["(no tensor matches)"])]
