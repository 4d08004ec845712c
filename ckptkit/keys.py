"""State-dict key rewriting: the wrapper table, wrapper detection, strip / add / rename, matching.

Pure and stdlib only: every function works on key strings (or a mapping of any value type), so
it is tested with plain dicts. A *key map* is ``{old_key: new_key}``, where ``None`` means the key
is dropped (only a wrapper's own bookkeeping keys are ever dropped).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ckptkit.errors import KeyTransformError, UsageError

__all__ = [
    "KeyRules",
    "plan_ties",
    "Wrapper",
    "WRAPPERS",
    "KeyMap",
    "KeyPlan",
    "KeyMatch",
    "wrapper_for",
    "detect_wrappers",
    "inner_wrappers",
    "strip_inner_wrappers",
    "strip_prefix",
    "add_prefix",
    "rename",
    "parse_rename_rule",
    "build_plan",
    "match_keys",
    "mismatch_message",
]

V = TypeVar("V")
KeyMap = dict[str, "str | None"]


@dataclass(frozen=True)
class Wrapper:
    """A module wrapper that prefixes every key of the model it wraps."""

    prefix: str
    added_by: str
    # Keys the wrapper keeps beside the wrapped model's (AveragedModel's step counter).
    own_keys: frozenset[str] = frozenset()
    # Whether it is also found inside keys, around one submodule (compile, checkpointing):
    # PeftModel's two-level prefix only ever wraps the whole model.
    inner: bool = True


WRAPPERS: tuple[Wrapper, ...] = (
    # nn.DataParallel and DistributedDataParallel keep the model as `.module`; so does
    # torch.optim.swa_utils.AveragedModel (EMA / SWA), which adds its own `n_averaged` buffer.
    Wrapper(
        "module.",
        "DataParallel / DistributedDataParallel / AveragedModel",
        frozenset({"n_averaged"}),
    ),
    # torch.compile returns an OptimizedModule holding the original as `._orig_mod`.
    Wrapper("_orig_mod.", "torch.compile"),
    # FullyShardedDataParallel (FSDP1) keeps the wrapped module as `._fsdp_wrapped_module`.
    Wrapper("_fsdp_wrapped_module.", "FullyShardedDataParallel"),
    # torch.distributed.algorithms._checkpoint.checkpoint_wrapper (activation checkpointing).
    Wrapper("_checkpoint_wrapped_module.", "activation checkpointing (checkpoint_wrapper)"),
    # Lightning Fabric's _FabricModule keeps the user's module as `._forward_module`.
    Wrapper("_forward_module.", "Lightning Fabric"),
    # peft's PeftModel keeps the model as `.base_model` (a LoraModel), which keeps it as `.model`.
    Wrapper("base_model.model.", "PEFT (PeftModel)", inner=False),
    # A peft LoRA layer keeps the layer it adapts as `.base_layer` (inside keys, beside the
    # adapter's lora_A / lora_B, which only a merge or --drop-adapters removes).
    Wrapper("base_layer.", "PEFT (LoRA layer)"),
)

MODULE_PREFIX = WRAPPERS[0].prefix


def wrapper_for(prefix: str) -> Wrapper | None:
    """The known wrapper that adds ``prefix``, or None."""
    return next((w for w in WRAPPERS if w.prefix == prefix), None)


def _describe(prefix: str) -> str:
    wrapper = wrapper_for(prefix)
    return f"'{prefix}' ({wrapper.added_by})" if wrapper else f"'{prefix}'"


def _outer_wrapper(keys: list[str]) -> Wrapper | None:
    for wrapper in WRAPPERS:
        # The first key that is not the wrapper's own rules most wrappers out at once.
        first = next((k for k in keys if k not in wrapper.own_keys), None)
        if first is None or not first.startswith(wrapper.prefix):
            continue
        body = [k for k in keys if k not in wrapper.own_keys]
        if body and all(k.startswith(wrapper.prefix) and k != wrapper.prefix for k in body):
            return wrapper
    return None


def detect_wrappers(keys: Iterable[str]) -> tuple[Wrapper, ...]:
    """Detect the chain of known wrappers around a state dict, outermost first.

    A prefix counts only when every key carries it (a wrapper's own keys aside), applied
    repeatedly, so ``module._orig_mod.x`` gives (DDP, compile) while a model that merely has a
    submodule named ``module`` next to others is left alone.
    """
    remaining = list(keys)
    chain: list[Wrapper] = []
    while (wrapper := _outer_wrapper(remaining)) is not None:
        chain.append(wrapper)
        remaining = [k[len(wrapper.prefix) :] for k in remaining if k not in wrapper.own_keys]
    return tuple(chain)


def strip_prefix(keys: Iterable[str], prefix: str) -> KeyMap:
    """Remove ``prefix`` from the keys that start with it; other keys stay as they are.

    A known wrapper's own keys (AveragedModel's ``n_averaged``) are dropped with it.

    Raises:
        KeyTransformError: no key starts with ``prefix``, or a key would become empty.
    """
    keys = list(keys)
    wrapper = wrapper_for(prefix)
    own = wrapper.own_keys if wrapper else frozenset()
    result: KeyMap = {}
    stripped = 0
    for key in keys:
        if key.startswith(prefix):
            if key == prefix:
                raise KeyTransformError(f"stripping '{prefix}' would leave key '{key}' empty")
            result[key] = key[len(prefix) :]
            stripped += 1
        else:
            result[key] = None if key in own else key
    if keys and not stripped:
        chain = detect_wrappers(keys)
        hint = "run `ckptkit inspect` to see the key prefixes, or drop this option"
        if chain:  # the keys are wrapped, just not by this prefix first
            found = "".join(w.prefix for w in chain)
            hint = f"the keys start with '{found}': --strip-wrappers removes the whole chain"
        raise KeyTransformError(
            f"no key starts with '{prefix}' (first key: '{keys[0]}')",
            hint,
        )
    return result


def add_prefix(keys: Iterable[str], prefix: str) -> KeyMap:
    """Put ``prefix`` in front of every key (the inverse of :func:`strip_prefix`)."""
    if not prefix or prefix.startswith("."):
        raise UsageError(f"invalid prefix '{prefix}'", "give a prefix such as 'module.'")
    return {key: prefix + key for key in keys}


def parse_rename_rule(text: str) -> tuple[re.Pattern[str], str]:
    """Parse ``REGEX=REPLACEMENT`` (split at the last '=', so lookaheads like ``(?=`` work)."""
    pattern, sep, repl = text.rpartition("=")
    if not sep or not pattern:
        raise UsageError(f"invalid rename rule '{text}'", "write it as REGEX=REPLACEMENT")
    try:
        return re.compile(pattern), repl
    except re.error as exc:
        raise UsageError(f"invalid regular expression '{pattern}': {exc}") from None


def rename(keys: Iterable[str], rules: Iterable[tuple[re.Pattern[str], str]]) -> KeyMap:
    """Apply each ``(regex, replacement)`` rule in turn with ``re.sub`` to every key.

    Raises:
        KeyTransformError: a rule matches no key, or a replacement is invalid.
    """
    current = {key: key for key in keys}
    for pattern, repl in rules:
        hits = 0
        for old, new in current.items():
            try:
                replaced = pattern.sub(repl, new)
            except (re.error, IndexError) as exc:
                raise UsageError(f"invalid replacement '{repl}': {exc}") from None
            hits += replaced != new
            current[old] = replaced
        if current and not hits:
            raise KeyTransformError(
                f"rename rule '{pattern.pattern}' matches no key",
                "run `ckptkit convert --dry-run` to see the keys",
            )
    return dict(current)


def _then(first: KeyMap, second: KeyMap) -> KeyMap:
    return {old: (None if new is None else second[new]) for old, new in first.items()}


def _live(mapping: KeyMap) -> list[str]:
    return [new for new in mapping.values() if new is not None]


def _check_collisions(mapping: KeyMap) -> None:
    seen: dict[str, str] = {}
    clashes: list[str] = []
    for old, new in mapping.items():
        if new is None:
            continue
        if new in seen:
            clashes.append(f"'{seen[new]}' and '{old}' -> '{new}'")
        else:
            seen[new] = old
        if new == "":
            raise KeyTransformError(f"key '{old}' would become empty")
    if clashes:
        more = f" (and {len(clashes) - 3} more)" if len(clashes) > 3 else ""
        raise KeyTransformError(
            f"renaming maps two keys onto one: {'; '.join(clashes[:3])}{more}",
            "change the prefix or rename options so every key stays distinct",
        )


@dataclass
class KeyPlan:
    """Where every key goes, computed from key names alone before any tensor is read."""

    mapping: KeyMap
    steps: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)

    @property
    def dropped(self) -> list[str]:
        """Keys the plan drops (a wrapper's own bookkeeping keys)."""
        return [old for old, new in self.mapping.items() if new is None]

    def apply(self, items: Mapping[str, V]) -> dict[str, V]:
        """Rename a mapping's keys by the plan, dropping those it drops."""
        return {new: items[old] for old, new in self.mapping.items() if new is not None}


def _has_prefix(keys: Iterable[str], prefix: str) -> bool:
    return any(key.startswith(prefix) for key in keys)


def build_plan(
    keys: Iterable[str],
    *,
    strip_wrappers: bool = False,
    strip_module: bool = False,
    strip_prefixes: Iterable[str] = (),
    add_prefixes: Iterable[str] = (),
    add_module: bool = False,
    renames: Iterable[tuple[re.Pattern[str], str]] = (),
) -> KeyPlan:
    """Compose the key rewrites convert offers, in a fixed order: strip, add, rename.

    Prefixes are added in the order given, then ``module.`` last (outermost, as DDP wraps the
    whole model).

    Raises:
        KeyTransformError: a step that does nothing, or two keys mapped onto one.
    """
    mapping: KeyMap = {key: key for key in keys}
    plan = KeyPlan(mapping)

    def step(transform, text: str) -> None:
        plan.mapping = _then(plan.mapping, transform(_live(plan.mapping)))
        plan.steps.append(text)

    if strip_wrappers:
        for wrapper in detect_wrappers(_live(plan.mapping)):
            step(
                lambda ks, p=wrapper.prefix: strip_prefix(ks, p),
                f"strip {_describe(wrapper.prefix)}",
            )
            plan.removed.append(wrapper.prefix)
        inner, found = strip_inner_wrappers(_live(plan.mapping))
        if found:
            plan.mapping = _then(plan.mapping, inner)
            names = ", ".join(_describe(w.prefix) for w in found)
            plan.steps.append(f"strip {names} inside keys")
    if strip_module and not _has_prefix(_live(plan.mapping), MODULE_PREFIX):
        if not detect_wrappers(_live(plan.mapping)):  # saved unwrapped (ckptkit's own are)
            plan.steps.append(
                f"no key starts with '{MODULE_PREFIX}' (saved unwrapped): none to strip"
            )
            strip_module = False
    strips = ([MODULE_PREFIX] if strip_module else []) + list(strip_prefixes)
    for prefix in strips:
        step(lambda ks, p=prefix: strip_prefix(ks, p), f"strip {_describe(prefix)}")
        plan.removed.append(prefix)
    adds = list(add_prefixes) + ([MODULE_PREFIX] if add_module else [])
    for prefix in adds:
        step(lambda ks, p=prefix: add_prefix(ks, p), f"add {_describe(prefix)}")
        plan.added.append(prefix)
    rules = list(renames)
    if rules:
        step(
            lambda ks: rename(ks, rules), "rename " + ", ".join(f"'{p.pattern}'" for p, _ in rules)
        )
    _check_collisions(plan.mapping)
    return plan


@dataclass(frozen=True)
class KeyRules:
    """The key rewrites asked for, as the CLI's key options and the library's arguments give
    them: strip, add, rename (``REGEX=REPLACEMENT`` text or compiled), and a reference
    checkpoint whose layout the keys must match (read by ``convert``)."""

    strip_wrappers: bool = False
    strip_module: bool = False
    strip_prefixes: tuple[str, ...] = ()
    add_module: bool = False
    add_prefixes: tuple[str, ...] = ()
    renames: tuple[str | tuple[re.Pattern[str], str], ...] = ()
    match_to: str | None = None

    def rename_rules(self) -> list[tuple[re.Pattern[str], str]]:
        """The rename rules compiled.

        Raises:
            UsageError: a rule that is not ``REGEX=REPLACEMENT`` or a bad regex.
        """
        return [parse_rename_rule(r) if isinstance(r, str) else r for r in self.renames]

    def plan(self, keys: Iterable[str]) -> KeyPlan:
        """The plan of these rules for ``keys`` (``match_to`` aside: it needs the reference)."""
        return build_plan(
            keys,
            strip_wrappers=self.strip_wrappers,
            strip_module=self.strip_module,
            strip_prefixes=self.strip_prefixes,
            add_prefixes=self.add_prefixes,
            add_module=self.add_module,
            renames=self.rename_rules(),
        )


def inner_wrappers(keys: Iterable[str]) -> list[tuple[str, Wrapper]]:
    """Wrapper segments inside keys (``blocks.0._orig_mod.attn.w``): ``(parent, wrapper)`` for
    each place where the wrapper's name is the only child of ``parent`` (its own bookkeeping
    keys aside) and has children itself, so the keys show a wrapper there; a submodule merely
    named ``module`` beside others is left alone. The top level is :func:`detect_wrappers`'s."""
    children: dict[str, set[str]] = {}
    inner: set[str] = set()  # paths that have children
    for key in keys:
        parts = key.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i]) + "."
            children.setdefault(parent, set()).add(parts[i])
            if i < len(parts) - 1:
                inner.add(parent + parts[i] + ".")
    sites = []
    for parent, names in children.items():
        for wrapper in (w for w in WRAPPERS if w.inner):
            name = wrapper.prefix[:-1]
            if parent + wrapper.prefix in inner and names - {name} <= wrapper.own_keys:
                sites.append((parent, wrapper))
    return sorted(sites, key=lambda site: site[0])


def strip_inner_wrappers(keys: Iterable[str]) -> tuple[KeyMap, list[Wrapper]]:
    """Remove every wrapper segment inside the keys (see :func:`inner_wrappers`), repeatedly,
    so nested ones go too; a wrapper's own keys there are dropped. Returns the key map and the
    wrappers removed (one entry per kind)."""
    mapping: KeyMap = {key: key for key in keys}
    found: list[Wrapper] = []
    while sites := inner_wrappers(_live(mapping)):
        step: KeyMap = {}
        for key in _live(mapping):
            new: str | None = key
            for parent, wrapper in sites:
                if key.startswith(parent + wrapper.prefix):
                    new = parent + key[len(parent) + len(wrapper.prefix) :]
                    break
                if key[len(parent) :] in wrapper.own_keys and key.startswith(parent):
                    new = None
                    break
            step[key] = new
        mapping = _then(mapping, step)
        found.extend(w for _, w in sites if w not in found)
    return mapping, found


def _leading_layers(keys: list[str]) -> list[str]:
    """Prefixes every key shares, layer by layer: known wrappers, or any common first name."""
    layers: list[str] = []
    while keys:
        wrapper = _outer_wrapper(keys)
        if wrapper is not None:
            prefix = wrapper.prefix
            keys = [k for k in keys if k not in wrapper.own_keys]
        else:
            head = keys[0].split(".", 1)[0] + "."
            if not all(k.startswith(head) and len(k) > len(head) for k in keys):
                break
            prefix = head
        layers.append(prefix)
        keys = [k[len(prefix) :] for k in keys]
    return layers


@dataclass
class KeyMatch:
    """How a checkpoint's keys map onto a target's (a model or a reference checkpoint)."""

    mapping: KeyMap
    removed: list[str]
    added: list[str]
    missing: list[str]
    unexpected: list[str]

    @property
    def exact(self) -> bool:
        """True when every target key is covered and no checkpoint key is left over."""
        return not self.missing and not self.unexpected

    def describe(self) -> str:
        """One line: the prefix change found, or that none was needed."""
        parts = [f"strip {_describe(p)}" for p in self.removed]
        parts += [f"add {_describe(p)}" for p in self.added]
        return ", ".join(parts) if parts else "keys used as they are"


def match_keys(source_keys: Iterable[str], target_keys: Iterable[str]) -> KeyMatch:
    """Find the prefix change (strip and/or add wrapper layers) that best maps source onto target.

    Tries every combination of stripping the source's leading layers and adding the target's,
    and keeps the one covering the most target keys, then leaving the fewest source keys over
    (a wrapper's own keys, dropped with it, do not count), then making the fewest changes.
    """
    source = list(source_keys)
    target = list(target_keys)
    target_set = set(target)
    src_layers = _leading_layers(source)
    dst_layers = _leading_layers(target)
    best: tuple[tuple[int, int, int], KeyMap, list[str], list[str]] | None = None
    for i in range(len(src_layers) + 1):
        mapping: KeyMap = {k: k for k in source}
        for prefix in src_layers[:i]:
            mapping = _then(mapping, strip_prefix(_live(mapping), prefix))
        for j in range(len(dst_layers) + 1):
            outer = "".join(dst_layers[:j])
            candidate = {
                old: (None if new is None else outer + new) for old, new in mapping.items()
            }
            hits = sum(1 for new in candidate.values() if new in target_set)
            left = sum(1 for new in candidate.values() if new is not None and new not in target_set)
            score = (hits, -left, -(i + j))
            if best is None or score > best[0]:
                best = (score, candidate, src_layers[:i], dst_layers[:j])
    assert best is not None
    _, mapping, removed, added = best
    produced = {new for new in mapping.values() if new is not None}
    return KeyMatch(
        mapping=mapping,
        removed=list(removed),
        added=list(added),
        missing=[k for k in target if k not in produced],
        unexpected=[
            old for old, new in mapping.items() if new is not None and new not in target_set
        ],
    )


def mismatch_message(head: str, match: KeyMatch, mismatched: Sequence[str] = ()) -> str:
    """One line naming the missing, unexpected and shape-mismatched keys (five of each)."""

    def some(items: Sequence[str]) -> str:
        shown = ", ".join(items[:5])
        return shown + (f" (+{len(items) - 5} more)" if len(items) > 5 else "")

    parts = [head + f" after '{match.describe()}'"]
    if match.missing:
        parts.append(f"{len(match.missing)} missing: {some(match.missing)}")
    if match.unexpected:
        parts.append(f"{len(match.unexpected)} unexpected: {some(match.unexpected)}")
    if mismatched:
        parts.append(f"{len(mismatched)} with other shapes: {some(mismatched)}")
    return "; ".join(parts)


def plan_ties(aliases: Mapping[str, str]) -> dict[str, str]:
    """Which names of each tied group to leave out, as ``safetensors.torch.save_model`` does.

    Args:
        aliases: alias -> the key it is the very same tensor as (any of its group).

    Returns:
        removed name -> the name kept for its group: the group's first name in sorted order,
        the one ``save_model`` keeps (so its ``load_model`` and the metadata agree).
    """
    groups: dict[str, set[str]] = {}
    for alias, target in aliases.items():
        group = groups.get(alias, {alias}) | groups.get(target, {target})
        for name in group:
            groups[name] = group
    removed: dict[str, str] = {}
    for group in {id(g): g for g in groups.values()}.values():
        kept = min(group)
        removed.update({name: kept for name in sorted(group) if name != kept})
    return removed


def module_prefixes(prefixes: Iterable[str], mapping: Mapping[str, str | None]) -> KeyMap:
    """Where each module of a state dict's ``_metadata`` (``""``, ``"0"``, ``"blocks.1"``: the
    version records torch keeps per module) ends up under a key mapping, read from the keys
    that live below it: ``{"module.0": "0"}`` after stripping ``module.``. A module none of whose
    keys survive maps to None."""
    out: dict[str, str | None] = {}
    for prefix in prefixes:
        head = f"{prefix}." if prefix else ""
        out[prefix] = None
        for old, new in mapping.items():
            rest = old[len(head) :]
            if new is not None and old.startswith(head) and new.endswith(rest):
                out[prefix] = new[: len(new) - len(rest)].removesuffix(".")
                break
    return out
