"""The views of every report: the text a command prints and the JSON document it emits.

Each command's report object (``ConvertReport``, ``Summary``, ``ScanReport``, ``DiffReport``,
``TrainResult``) is rendered here, both ways, so the two never drift (``inspect``'s text is made
in ``inspect_view.py``, below ``summary.py``, and re-exported here). JSON documents carry a
``schema`` version each (documented in the README); an error is a document too.

Text from files (keys, global names, metadata, member names) is made safe to print: every line
a view returns is escaped whole by ``ckptkit.text.escape`` (each public view is wrapped by
``wording.terminal_safe``, so no line is missed, whatever it is built from; ``str()`` of a report is
safe too), and a JSON document's strings that are not valid UTF-8 get the same escaping. The
CLI escapes again what it prints (``escape`` leaves escaped text as it is) and its ``Error:``
lines, so lines built outside these views are covered as well.
"""

from __future__ import annotations

import json
from typing import Any

from ckptkit.errors import CkptkitError
from ckptkit.inspect_view import flat_lines, inspect_lines, summary_lines, tree_lines
from ckptkit.text import escape
from ckptkit.wording import human_size, plural, terminal_safe

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


@terminal_safe
def convert_lines(report: Any) -> list[str]:
    """``convert``'s text report."""
    lines = _plan_lines(report) + _mapping_lines(report) + _merge_lines(report)
    if report.dry_run:
        lines.append("Dry run: nothing written")
        return lines
    return lines + _written_lines(report)


def _mapping_lines(report: Any) -> list[str]:
    return [] if report.mapping is None else mapping_lines(report.mapping)


@terminal_safe
def mapping_plan_lines(plan: dict[str, Any], key_filter: str | None = None) -> list[str]:
    """``inspect --map``: the mapping's account, then each target tensor and its source."""
    import fnmatch

    lines = [f"Source   {plan['source']}", *mapping_lines(plan)]
    if plan["documents"]:
        lines.append(f"Makes    {', '.join(plan['documents'])}")
    lines.append("Targets")
    for target in plan["targets"]:
        if key_filter and not fnmatch.fnmatchcase(target["key"], key_filter):
            continue
        rank = "" if target["rank"] is None else f"rank {target['rank']}: "
        ranks = f" ({target['ranks_read']} ranks)" if target["ranks_read"] > 1 else ""
        lines.append(
            f"  {rank}{target['key']}  {target['dtype']} {target['shape']}  <- "
            f"{', '.join(target['from'])}{ranks}, rule {target['rule']}"
        )
    return lines


@terminal_safe
def mapping_lines(mapping: dict[str, Any]) -> list[str]:
    """What ``--map`` does: the rules that ran and what each took, the bytes it let go and
    why, and the variables taken from the mapping's defaults."""
    ran = [r for r in mapping["rules"] if r["groups"]]
    lines = [
        f"Mapped   by {mapping['from']} ({mapping['direction']}): {len(ran)} of "
        f"{plural(len(mapping['rules']), 'rule')} ran; every source byte accounted for "
        f"({human_size(mapping['accounted_bytes'])})"
    ]
    for rule in ran:
        ops = ", ".join(rule["ops"]) or "rename"
        lines.append(
            f"  rule {rule['rule']}: {plural(rule['keys_in'], 'key')} -> {rule['keys_out']} ({ops})"
        )
    for drop in mapping["dropped"]:
        lines.append(f"Dropped  {human_size(drop['bytes'])} by rule {drop['rule']}: {drop['why']}")
    roundtrip = mapping.get("roundtrip")
    if roundtrip is not None:
        copied = roundtrip["groups"] - roundtrip["mapped_back"] - roundtrip["dropped"]
        lines.append(
            f"Checked  mapped back bit for bit in the stream: {roundtrip['mapped_back']} of "
            f"{plural(roundtrip['groups'], 'group')} ({copied} renamed, copied as bytes; "
            f"{roundtrip['dropped']} dropped)"
        )
    if mapping.get("config_from"):
        lines.append(
            f"Config   taken from {mapping['config_from']} (--config-from), with its tokenizer "
            "files; the weights checked against it"
        )
    variables = mapping["variables"]
    for name in mapping["defaults_taken"]:
        value = variables[name]
        lines.append(f"Assumed  {name} = {value} (the mapping's default; --set {name}=...)")
    return lines


def _plan_lines(report: Any) -> list[str]:
    """What was read and what the output holds of it: keys, ties, casts, what was left out."""
    where = (
        f"state dict at '{report.selected}'" if report.selected else "state dict at the top level"
    )
    lines = [
        f"Read     {report.source} ({report.source_format}); {where} ({report.selected_reason})"
    ]
    plan = report.plan
    steps = "; ".join(plan.steps) if plan.steps else "keys unchanged"
    if report.mapping is not None:  # inspect --map lists each target with its sources
        steps = f"made by {report.mapping['from']}'s rules (below)"
    lines.append(
        f"Keys     {plural(report.tensors, 'tensor')}, {human_size(report.nbytes)}: {steps}"
    )
    if report.kept_wrappers:
        chain = "".join(report.kept_wrappers)
        lines.append(f"Note     the keys keep '{chain}'; --strip-wrappers removes it")
    if report.dry_run and report.mapping is None:
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
    if report.megatron is not None and report.megatron.get("torch_dist"):
        save = report.megatron
        lines.append(
            f"Stacked  each block's layers (and experts) as torch_dist does, with "
            f"{plural(save['objects'], 'extra state object')}; no optimizer or RNG state "
            "(resume with --no-load-optim --no-load-rng, or --finetune)"
        )
        lines.append(f"Beside   the tensors: {', '.join(save['beside'])} (common.pt)")
    elif report.megatron is not None:
        cut = report.megatron
        changed = ", ".join(f"{k} {v}" for k, v in cut["args_set"].items())
        experts = f" x {cut['expert_parallel']} expert" if cut["expert_parallel"] > 1 else ""
        virtual = cut["virtual_stages"]
        chunks = f", {virtual} virtual stages on each" if virtual > 1 else ""
        lines.append(
            f"Cut      into {cut['tensor_parallel']} tensor x {cut['pipeline_parallel']} "
            f"pipeline{experts}-parallel ranks{chunks}; args set: {changed}"
        )
        lines.append(
            f"Beside   each rank's model: {', '.join(cut['beside'])}; no optimizer or RNG state "
            "(resume with --no-load-optim --no-load-rng, or --finetune)"
        )
    elif report.extras and report.output_format in ("safetensors", "dcp"):
        lines.append(f"Kept     {', '.join(report.extras)} in the metadata")
    elif report.extras:
        lines.append(
            f"Omitted  {', '.join(report.extras)}: not written (a .pt output holds only the "
            "state dict; .safetensors keeps them in its metadata)"
        )
    return lines


def _written_lines(report: Any) -> list[str]:
    """What was written, how it was checked, and what was copied as bytes."""
    lines = []
    if not report.verified:
        checked = "not verified (--no-verify)"
    elif report.merged:
        checked = (
            "verified: merged tensors equal a fresh fp32 merge from the files, the rest bit-exact"
        )
    elif report.mapping is not None:
        checked = (
            "verified: read back, copied tensors bit-exact against the source and mapped ones "
            "by the CRC-32 of the bytes made"
        )
    elif report.cast:
        checked = "verified: read back equal to the cast values"
    elif report.made and report.megatron is not None:
        made = "stacked" if report.megatron.get("torch_dist") else "cut"
        checked = (
            f"verified: read back, copied tensors bit-exact against the source and those {made} "
            "from views of its files by the CRC-32 of the bytes written"
        )
    elif report.made:  # joined from chunks: checked by the CRC-32 of what was written
        checked = (
            "verified: read back, copied tensors bit-exact against the source and those joined "
            "from chunks by the CRC-32 of the bytes written"
        )
    else:
        checked = "verified bit-exact"
    if report.part and report.megatron is not None:  # rank files; the tracker once all done
        ranks = [f for f in report.files if f.endswith(".pt")]
        folder = report.files[0].rsplit("/", 3)[0]
        named = ", ".join(f.rsplit("/", 2)[-2] for f in ranks)
        lines.append(
            f"Wrote    part {report.part}: {plural(len(ranks), 'rank file')} ({named}) of "
            f"{folder}, {checked}"
            + (
                "; and the tracker, every part done"
                if len(ranks) < len(report.files)
                else f"; `ckptkit convert --finish {folder}` writes the tracker once every "
                "part is done"
            )
        )
    elif report.part:
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
    elif report.mapping is not None and report.mapping["target_ranks"]:
        names = [f.rsplit("/", 1)[-1] for f in report.files]
        shown = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
        lines.append(
            f"Wrote    {plural(len(names), 'rank file')} ({shown}) in "
            f"{report.files[0][: -len(names[0]) - 1]}, "
            f"{checked}"
        )
    elif report.megatron is not None and not report.megatron.get("torch_dist"):
        # iter_N/mp_rank_TT_PPP/model_optim_rng.pt each
        folders = [f.rsplit("/", 2) for f in report.files]
        shown = folders[0][1] if len(folders) == 1 else f"{folders[0][1]} ... {folders[-1][1]}"
        lines.append(
            f"Wrote    {plural(len(folders), 'rank file')} ({shown}) in {folders[0][0]}, {checked}"
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
        config_from = (report.mapping or {}).get("config_from")  # --config-from's folder
        whence = config_from or "the model folder"
        lines.append(f"Copied   {', '.join(report.copied_files)} from {whence}")
    if report.made_files and report.megatron is not None:
        iteration = report.megatron["iteration"]
        named = "the release" if iteration == "release" else f"iteration {iteration}"
        lines.append(f"Made     {', '.join(report.made_files)}, naming {named}")
    elif report.made_files:
        lines.append(f"Made     {', '.join(report.made_files)} from the mapping")
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


@terminal_safe
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


@terminal_safe
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


@terminal_safe
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
