"""The views of every report: the text a command prints and the JSON document it emits.

Each command's report object (``ConvertReport``, ``Summary``, ``ScanReport``, ``DiffReport``,
``TrainResult``) is rendered here, both ways, so the two never drift. JSON documents carry a
``schema`` version each (documented in the README); an error is a document too.

Text from files (keys, global names, metadata, member names) is made safe to print: every line
a view returns is escaped whole by ``ckptkit.text.escape`` (each public view is wrapped by
``_terminal_safe``, so no line is missed, whatever it is built from; ``str()`` of a report is
safe too), and a JSON document's strings that are not valid UTF-8 get the same escaping. The
CLI escapes again what it prints (``escape`` leaves escaped text as it is) and its ``Error:``
lines, so lines built outside these views are covered as well.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, ParamSpec

from ckptkit.errors import CkptkitError
from ckptkit.formats.base.dtypes import DTYPES
from ckptkit.formats.base.source import KINDS, TensorInfo
from ckptkit.meta import NAMESPACE, TRAINING_KEY
from ckptkit.text import escape

__all__ = [
    "SCHEMAS",
    "document",
    "error_document",
    "human_size",
    "plural",
    "convert_lines",
    "scan_lines",
    "diff_lines",
    "train_lines",
    "inspect_lines",
    "summary_lines",
    "tree_lines",
    "flat_lines",
]

#: The version of each command's JSON document; bump one when its shape changes.
SCHEMAS = {
    "inspect": 2,
    "convert": 2,
    "finish": 1,
    "scan": 2,
    "diff": 2,
    "train": 2,
    "plot": 1,
    "error": 1,
}


_P = ParamSpec("_P")


def _terminal_safe(view: Callable[_P, list[str]]) -> Callable[_P, list[str]]:
    """A view whose lines are escaped (``ckptkit.text.escape``) when it returns: whatever a line
    holds, from ckptkit or from the file, no terminal acts on it. Lines of a view it calls are
    escaped already and stay as they are (escaping is done once)."""

    @functools.wraps(view)
    def safe(*args: _P.args, **kwargs: _P.kwargs) -> list[str]:
        return [escape(line) for line in view(*args, **kwargs)]

    return safe


def document(command: str, body: dict[str, Any]) -> str:
    """A command's JSON document: its schema version, then the report's fields.

    ASCII, as ``json.dumps`` writes it; a string that is not valid UTF-8 (a surrogate: bytes
    that were not UTF-8, or a lone ``\\ud800``) is escaped as the text views escape it, so the
    document is valid UTF-8 JSON any parser reads.
    """
    text = json.dumps({"schema": SCHEMAS[command], **body}, indent=2)
    if "\\ud" in text:  # a surrogate, lone or in a pair: look at the strings (rare)
        text = json.dumps({"schema": SCHEMAS[command], **_valid_utf8(body)}, indent=2)
    return text


def _valid_utf8(value: Any) -> Any:
    """``value`` with each string (and key) that is not valid UTF-8 escaped."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return escape(value)
        return value
    if isinstance(value, dict):
        return {_valid_utf8(k): _valid_utf8(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_valid_utf8(v) for v in value]
    return value


def error_document(exc: BaseException, exit_code: int) -> str:
    """What ``--json`` prints on stdout when the command fails (the line goes to stderr)."""
    if isinstance(exc, CkptkitError):
        error = {"type": type(exc).__name__, "message": exc.message, "hint": exc.hint}
    else:
        error = {"type": type(exc).__name__, "message": str(exc), "hint": None}
    return document("error", {"error": error, "exit_code": exit_code})


def plural(count: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def human_size(nbytes: int) -> str:
    """``1234567`` -> ``1.2 MB`` (decimal units, as disks are sold)."""
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def _describe(info: TensorInfo, count: int = 1) -> str:
    dtype = DTYPES[info.dtype].short if info.dtype in DTYPES else info.dtype
    shape = "[" + ", ".join(map(str, info.shape)) + "]"
    note = "" if info.contiguous else "  non-contiguous"
    if info.kind != "dense":
        note += f"  {KINDS.get(info.kind, info.kind)}" + (
            f" ({info.detail})" if info.detail else ""
        )
    times = f"  x{count}" if count > 1 else ""
    return f"{shape} {dtype}{times}  {human_size(info.nbytes * count)}{note}"


@_terminal_safe
def flat_lines(summary: Any, *, key_filter: str | None = None) -> list[str]:
    """One line per tensor: key, shape, dtype, size."""
    from ckptkit.summary import keep

    rows = [(k, i) for k, i in summary.tensors if keep(k, key_filter)]
    width = max((len(k) for k, _ in rows), default=0)
    return [f"{key:<{width}}  {_describe(info)}" for key, info in rows]


@_terminal_safe
def tree_lines(
    summary: Any, *, depth: int | None = None, key_filter: str | None = None
) -> list[str]:
    """Tensors as a tree by module path, repeated layers folded, subtrees past ``depth`` summed."""
    from ckptkit.summary import collapse, keep

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
            lines.append(f"{pad}{label:<{width}}  {_describe(info, count)}")
        else:
            tensors, size = _totals(child)
            lines.append(f"{pad}{label}  ({plural(tensors, 'tensor')}, {human_size(size)})")
            if depth is None or level + 1 < depth:
                _render(child, level + 1, depth, lines)


@_terminal_safe
def summary_lines(summary: Any) -> list[str]:
    """The header of the default view: one fact a line."""
    lines = _where_lines(summary)
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
    if summary.ema_model:
        lines += _ema_model_lines(summary.ema_model)
    if summary.adapter:
        return lines + adapter_lines(summary.adapter)
    if summary.wrappers:
        chain = " ".join(f"{w.prefix} ({w.added_by})" for w in summary.wrappers)
        lines.append(f"wrappers    {chain}; `ckptkit convert --strip-wrappers` removes them")
    else:
        lines.append("wrappers    none")
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
    run = summary.training
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
    for key, value in summary.extras.items():
        if key != TRAINING_KEY and not summary.ema_model:  # an EMAModel's: in its line
            lines.append(f"also        {key} = {_short(value)}")
    for key, value in summary.metadata.items():
        if not key.startswith(NAMESPACE):
            lines.append(f"metadata    {key} = {_short(value)}")
    for key, value in summary.ckptkit_metadata.items():
        if key != "training":
            lines.append(f"ckptkit     {key} = {_short(value)}")
    lines.extend(_safety_lines(summary.safety))
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


def _short(value: Any, limit: int = 90) -> str:
    import json

    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@_terminal_safe
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
    settings = ", ".join(f"{k} {_short(v)}" for k, v in ema["settings"].items())
    named = "no names" if ema["names_from"] is None else f"named after {ema['names_from']}"
    return [
        f"ema model   a diffusers EMAModel: {ema['shadow_params']} shadow parameters, {named} "
        f"({settings})",
        f"convert     `{ema['convert']}`" + (" maps them" if ema["names_from"] is None else ""),
    ]


@_terminal_safe
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


@_terminal_safe
def convert_lines(report: Any) -> list[str]:
    """``convert``'s text report."""
    where = (
        f"state dict at '{report.selected}'" if report.selected else "state dict at the top level"
    )
    lines = [
        f"Read     {report.source} ({report.source_format}); {where} ({report.selected_reason})"
    ]
    plan = report.plan
    steps = "; ".join(plan.steps) if plan.steps else "keys unchanged"
    lines.append(
        f"Keys     {plural(report.tensors, 'tensor')}, {human_size(report.nbytes)}: {steps}"
    )
    if report.kept_wrappers:
        chain = "".join(report.kept_wrappers)
        lines.append(f"Note     the keys keep '{chain}'; --strip-wrappers removes it")
    if report.dry_run:
        for old, new in plan.mapping.items():
            lines.append(f"  {old} -> {new if new is not None else '(dropped)'}")
    for part in report.dropped:
        lines.append(
            f"Dropped  {part.path} ({plural(part.tensors, 'tensor')}, {human_size(part.nbytes)}): "
            "not weights"
        )
    for key in plan.dropped:
        lines.append(f"Dropped  {key} (wrapper bookkeeping)")
    how = {
        "shared": "one storage, as torch.save keeps it",
        "chunk": "one stored chunk that both names point to",
        "copies": "written twice, recorded in metadata",
        "once": "written once, named in the metadata as save_model does",
    }[report.ties]
    for alias, target in report.aliases.items():
        lines.append(f"Tied     {alias} = {target} ({how})")
    if report.cast:
        saved = report.source_nbytes - report.nbytes
        change = f"{human_size(saved)} saved" if saved >= 0 else f"{human_size(-saved)} larger"
        lines.append(f"Cast     {plural(len(report.cast), 'floating-point tensor')}: {change}")
    if report.overflowed:
        lines.append(f"Overflow {', '.join(report.overflowed[:5])} (allowed with --allow-overflow)")
    if report.made_contiguous:
        lines.append(
            f"Packed   {plural(len(report.made_contiguous), 'non-contiguous tensor')} made "
            "contiguous"
        )
    if report.extras and report.output_format in ("safetensors", "dcp"):
        lines.append(f"Kept     {', '.join(report.extras)} in the metadata")
    elif report.extras:
        lines.append(
            f"Omitted  {', '.join(report.extras)}: not written (a .pt output holds only the "
            "state dict; .safetensors keeps them in its metadata)"
        )
    lines += _merge_lines(report)
    if report.dry_run:
        lines.append("Dry run: nothing written")
        return lines
    if not report.verified:
        checked = "not verified (--no-verify)"
    elif report.merged:
        checked = (
            "verified: merged tensors equal a fresh fp32 merge from the files, the rest bit-exact"
        )
    elif report.cast:
        checked = "verified: read back equal to the cast values"
    else:
        checked = "verified bit-exact"
    if report.part:
        shards = [f for f in report.files if not f.endswith(".index.json")]
        lines.append(
            f"Wrote    part {report.part}: {plural(len(shards), 'shard')} of "
            f"{report.destination}, {checked}"
            + (
                "; and the index, every part done"
                if len(shards) < len(report.files)
                else f"; `ckptkit convert --finish {report.destination}` writes the index "
                "once every part is done"
            )
        )
    elif len(report.files) > 1:
        lines.append(f"Wrote    {len(report.files) - 1} shards and {report.files[-1]}, {checked}")
    else:
        lines.append(f"Wrote    {report.destination} ({report.output_format}), {checked}")
    if report.copied:
        lines.append(
            f"Copied   {report.copied} of {plural(report.tensors, 'tensor')} as bytes, "
            "without torch"
        )
    if report.copied_files:
        lines.append(f"Copied   {', '.join(report.copied_files)} from the model folder")
    check = report.output_check
    if check and check["worst"]:
        worst = check["worst"]
        lines.append(
            f"Checked  {plural(check['layers'], 'merged layer')} against the unmerged adapter on "
            f"seeded inputs: worst relative error {worst['relative_error']:.2g} "
            f"({worst['key']})"
        )
    return lines


def _merge_lines(report: Any) -> list[str]:
    """What ``convert`` merged: each adapter, and the largest relative changes."""
    lines = []
    for adapter in report.adapters:
        weight = f" at weight {adapter['weight']:g}" if adapter["weight"] != 1 else ""
        # How the base was found is in the JSON; the text says it when the adapter's config
        # led out of its folder, which a downloaded adapter should not do unnoticed.
        how = adapter.get("base_from") or ""
        found = f" (found from {how})" if "outside" in how else ""
        lines.append(
            f"Merged   {adapter['path']} ({adapter['kind']}, {adapter['variant']}, "
            f"{plural(adapter['modules'], 'module')}){weight} into {adapter['base']}{found}"
        )
        left = adapter.get("left_out") or {}
        if left:
            parts = ", ".join(f"{plural(n, 'module')} for {c}" for c, n in sorted(left.items()))
            lines.append(f"         left out: {parts} (other components of the pipeline)")
    if report.merged:
        changes = [(k, v) for k, v in report.merged.items() if v is not None]
        top = sorted(changes, key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{key} {change:.3g}" for key, change in top)
        lines.append(
            f"Changed  {plural(len(report.merged), 'tensor')} (fp32, rounded once); largest "
            f"relative change: {shown}"
        )
    return lines


@_terminal_safe
def scan_lines(report: Any) -> list[str]:
    """``scan``'s text for one file (an unscannable file says so on stderr instead)."""
    if report.error:
        return []
    lines = [f"{report.path}: {report.verdict} ({report.format})"]
    lines.extend(f"  problem   {problem}" for problem in report.problems)
    lines.extend(f"  damaged   {damage}" for damage in report.damaged)
    classes = report.globals()
    for name, cls in classes.items():
        if cls == "data":
            lines.append(f"  data      {name} (plain data, decoded statically, never imported)")
        elif cls != "safe":
            lines.append(f"  {cls:<9} {name}")
    for findings in report.pickles:
        for name, count in findings.calls.items():
            if name not in report.allowed and classes.get(name) not in ("safe", "data"):
                times = f" x{count}" if count > 1 else ""
                lines.append(f"  call      {name}(...){times} in {findings.label}")
        lines.extend(f"  problem   {p} in {findings.label}" for p in findings.problems)
    safe = sum(1 for cls in classes.values() if cls == "safe")
    if safe:
        lines.append(f"  safe      {plural(safe, 'global')} in torch's weights_only set")
    return lines


_LISTED = 10  # differing tensors diff lists one by one


def _retyped_lines(retyped: list[Any], some: Any) -> list[str]:
    """One line per pair of dtypes: the key when one tensor has it, else the count and keys."""
    pairs: dict[tuple[str, str], list[str]] = {}
    for t in retyped:
        pairs.setdefault(t.dtypes, []).append(t.key)
    lines = []
    for (a, b), keys in pairs.items():
        what = keys[0] if len(keys) == 1 else f"{len(keys)} tensors"
        lines.append(f"dtype        {what}: {a} vs {b} (values compared in the wider type)")
        if len(keys) > 1:
            lines.append(f"             {some(keys)}")
    return lines


@_terminal_safe
def diff_lines(report: Any) -> list[str]:
    """``diff``'s text report."""
    lines = []
    for name, side in (("A", report.a), ("B", report.b)):
        removed = f", stripped {''.join(side.removed)}" if side.removed else ""
        lines.append(f"{name}  {side.path} ({side.format}{removed})")
        lines += [f"   read from outside its folder: {shown}" for shown in side.followed]

    def some(keys: list[str]) -> str:
        return ", ".join(keys[:6]) + (f" (+{len(keys) - 6} more)" if len(keys) > 6 else "")

    if report.only_a:
        lines.append(f"only in A    {len(report.only_a)}: {some(report.only_a)}")
    if report.only_b:
        lines.append(f"only in B    {len(report.only_b)}: {some(report.only_b)}")
    for key, ia, ib in report.mismatched:
        lines.append(
            f"mismatch     {key}: {list(ia.shape)} {ia.dtype} vs {list(ib.shape)} {ib.dtype}"
        )
    lines += _retyped_lines(report.retyped, some)
    if report.keys_only:
        lines.append(f"headers      {report.common} common keys compared (no data read)")
    else:
        counts = {
            s: sum(1 for t in report.tensors if t.status == s)
            for s in ("equal", "close", "different")
        }
        lines.append(
            f"values       {counts['equal']} bit-equal, {counts['close']} within "
            f"tolerance, {counts['different']} different"
        )
        for t in report.different[:_LISTED]:
            lines.append(
                f"  {t.key}: {t.differing} elements differ, max abs {t.max_abs:.3g}, "
                f"max rel {t.max_rel:.3g}"
            )
        if len(report.different) > _LISTED:
            lines.append(f"  ... and {len(report.different) - _LISTED} more (--json lists all)")
    lines.append("equal" if report.equal else "differ")
    return lines


@_terminal_safe
def train_lines(result: Any, mode: str) -> list[str]:
    """``train``'s closing lines."""
    last = result.metrics[-1] if result.metrics else None
    done = f"; last epoch loss {last['loss']:.4f}" if last else ""
    for name, form in (("accuracy", ".3f"), ("val_loss", ".4f"), ("val_accuracy", ".3f")):
        if last and last.get(name) is not None:
            done += f", {name.replace('_', ' ')} {last[name]:{form}}"
    why = {"max_steps": "--max-steps reached", "early_stop": "no --monitor improvement"}
    if getattr(result, "stopped", None) in why:
        done += f" (stopped early: {why[result.stopped]})"
    return [
        f"Trained {plural(result.epochs_run, 'epoch')} in {mode} mode{done}",
        (f"Checkpoint {result.checkpoint}" if result.checkpoint else "No checkpoint written")
        + (
            f" (written by rank 0 on {result.writer_host})"
            if result.rank and result.checkpoint
            else ""
        ),
    ]
