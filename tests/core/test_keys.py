"""The key core, on plain strings and dicts: no tensors, no torch."""

from __future__ import annotations

import re

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ckptkit.errors import KeyTransformError, UsageError
from ckptkit.keys import (
    WRAPPERS,
    add_prefix,
    build_plan,
    detect_wrappers,
    match_keys,
    parse_rename_rule,
    rename,
    strip_inner_wrappers,
    strip_prefix,
)

PLAIN = ["body.0.weight", "body.0.bias", "body.1.running_mean", "body.1.num_batches_tracked"]
names = st.text(alphabet="abcxyz_019", min_size=1, max_size=6)
key_sets = st.lists(
    st.lists(names, min_size=1, max_size=4).map(".".join), min_size=1, max_size=25, unique=True
)
prefixes = st.sampled_from([w.prefix for w in WRAPPERS] + ["model.", "a.b."])


def chain(keys):
    return [w.prefix for w in detect_wrappers(keys)]


def apply(mapping, keys):
    return [mapping[k] for k in keys]


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("module.", ["module."]),
        ("module.module.", ["module.", "module."]),
        ("module._orig_mod.", ["module.", "_orig_mod."]),
        ("_orig_mod.module.", ["_orig_mod.", "module."]),
        (
            "_fsdp_wrapped_module._checkpoint_wrapped_module.",
            ["_fsdp_wrapped_module.", "_checkpoint_wrapped_module."],
        ),
        ("_forward_module.", ["_forward_module."]),
        ("", []),
        ("model.", []),  # Lightning's prefix is a real attribute name, never guessed
    ],
)
def test_detect_wrapper_chain_in_any_order(prefix, expected):
    assert chain([prefix + k for k in PLAIN]) == expected


def test_a_submodule_named_module_is_not_a_wrapper():
    keys = ["module.weight", "module.bias", "head.weight"]
    assert chain(keys) == []
    # ...but the same keys inside a DDP wrapper are seen one layer deep only.
    assert chain(["module." + k for k in keys]) == ["module."]


def test_averaged_model_counter_belongs_to_the_wrapper():
    keys = ["n_averaged"] + ["module." + k for k in PLAIN]
    assert chain(keys) == ["module."]
    mapping = strip_prefix(keys, "module.")
    assert mapping["n_averaged"] is None
    assert [mapping["module." + k] for k in PLAIN] == PLAIN


def test_strip_keeps_keys_without_the_prefix_and_fails_when_none_has_it():
    assert strip_prefix(["model.a", "loss.w"], "model.") == {"model.a": "a", "loss.w": "loss.w"}
    with pytest.raises(
        KeyTransformError, match="no key starts with 'module.' \\(first key: 'a'\\)"
    ):
        strip_prefix(["a", "b"], "module.")


def test_add_rejects_bad_prefixes():
    with pytest.raises(UsageError):
        add_prefix(["a"], "")
    with pytest.raises(UsageError):
        add_prefix(["a"], ".x")


@given(keys=key_sets, prefix=prefixes)
def test_strip_undoes_add(keys, prefix):
    added = apply(add_prefix(keys, prefix), keys)
    assert apply(strip_prefix(added, prefix), added) == keys


@given(keys=key_sets, layers=st.lists(prefixes, max_size=3))
def test_detect_finds_every_added_wrapper_layer(keys, layers):
    wrapped = keys
    for prefix in layers:
        wrapped = apply(add_prefix(wrapped, prefix), wrapped)
    known = {w.prefix for w in WRAPPERS}
    found = chain(wrapped)
    # The outermost run of known wrappers is always found, outermost first.
    outer_known = []
    for prefix in reversed(layers):
        if prefix not in known:
            break
        outer_known.append(prefix)
    assert found[: len(outer_known)] == outer_known


@given(keys=key_sets, prefix=prefixes)
def test_plan_add_then_strip_wrappers_round_trips(keys, prefix):
    plan = build_plan(keys, add_prefixes=[prefix])
    wrapped = [plan.mapping[k] for k in keys]
    if prefix in {w.prefix for w in WRAPPERS} and not chain(keys):
        back = build_plan(wrapped, strip_wrappers=True)
        assert [back.mapping[k] for k in wrapped] == keys


def test_plan_orders_strip_add_rename_and_reports_steps():
    keys = ["module._orig_mod." + k for k in PLAIN]
    plan = build_plan(
        keys,
        strip_wrappers=True,
        add_prefixes=["net."],
        renames=[parse_rename_rule(r"\.0\.=.first.")],
    )
    assert plan.mapping["module._orig_mod.body.0.weight"] == "net.body.first.weight"
    assert plan.removed == ["module.", "_orig_mod."]
    assert plan.added == ["net."]
    assert [s.split(" ")[0] for s in plan.steps] == ["strip", "strip", "add", "rename"]


def test_add_module_goes_outermost():
    plan = build_plan(["w"], add_prefixes=["_orig_mod."], add_module=True)
    assert plan.mapping == {"w": "module._orig_mod.w"}


def test_collisions_fail_before_anything_is_written():
    with pytest.raises(KeyTransformError, match="'module.a' and 'a' -> 'a'"):
        build_plan(["module.a", "a"], strip_module=True)
    with pytest.raises(KeyTransformError, match="maps two keys onto one"):
        build_plan(["x.weight", "y.weight"], renames=[parse_rename_rule(r"^[xy]=z")])


def test_rename_rules():
    assert rename(["a.b"], [parse_rename_rule(r"^a\.=c.")]) == {"a.b": "c.b"}
    # Split at the last '=', so a lookahead works.
    pattern, repl = parse_rename_rule(r"a(?=\.b)=z")
    assert (pattern.pattern, repl) == (r"a(?=\.b)", "z")
    with pytest.raises(KeyTransformError, match="matches no key"):
        rename(["a"], [(re.compile("zzz"), "y")])
    with pytest.raises(UsageError, match="REGEX=REPLACEMENT"):
        parse_rename_rule("no-equals-sign")
    with pytest.raises(UsageError, match="invalid regular expression"):
        parse_rename_rule("(=x")


@pytest.mark.parametrize(
    ("source", "target", "description"),
    [
        ("module.", "", "strip 'module.'"),
        ("", "module.", "add 'module.'"),
        ("module._orig_mod.", "_orig_mod.", "strip 'module.'"),
        ("_orig_mod.", "module._orig_mod.", "add 'module.'"),
        ("model.", "", "strip 'model.'"),
        ("", "", "keys used as they are"),
    ],
)
def test_match_keys_finds_the_prefix_change(source, target, description):
    match = match_keys([source + k for k in PLAIN], [target + k for k in PLAIN])
    assert match.exact
    assert (
        match.describe()
        .replace(" (DataParallel / DistributedDataParallel / AveragedModel)", "")
        .replace(" (torch.compile)", "")
        == description
    )
    assert [match.mapping[source + k] for k in PLAIN] == [target + k for k in PLAIN]


def test_match_keys_reports_missing_and_unexpected():
    match = match_keys(["module.a", "module.b", "module.extra"], ["a", "b", "c"])
    assert match.missing == ["c"]
    assert match.unexpected == ["module.extra"]
    assert not match.exact


def test_inner_wrapper_segments_are_stripped_where_the_keys_show_them():
    keys = ["blocks.0._orig_mod.attn.w", "blocks.1._orig_mod.attn.w", "head.w"]
    mapping, found = strip_inner_wrappers(keys)
    assert mapping == {keys[0]: "blocks.0.attn.w", keys[1]: "blocks.1.attn.w", "head.w": "head.w"}
    assert [w.prefix for w in found] == ["_orig_mod."]
    # A submodule merely named `module` beside a sibling stays; an only child is a wrapper.
    assert strip_inner_wrappers(["head.module.w", "head.b"])[0] == {
        "head.module.w": "head.module.w",
        "head.b": "head.b",
    }
    assert strip_inner_wrappers(["enc.module.w", "x"])[0] == {"enc.module.w": "enc.w", "x": "x"}
    # AveragedModel inside: its n_averaged goes with it; nested wrappers all go.
    assert strip_inner_wrappers(["ema.module.w", "ema.n_averaged"])[0] == {
        "ema.module.w": "ema.w",
        "ema.n_averaged": None,
    }
    nested = [
        "a._orig_mod._checkpoint_wrapped_module.x",
        "a._orig_mod._checkpoint_wrapped_module.y",
    ]
    assert list(strip_inner_wrappers(nested)[0].values()) == ["a.x", "a.y"]


def test_strip_wrappers_composes_with_strip_prefix():
    plan = build_plan(
        ["model._orig_mod.l.w", "model._orig_mod.l.b"],
        strip_wrappers=True,
        strip_prefixes=["model."],
    )
    assert list(plan.mapping.values()) == ["l.w", "l.b"]
    assert plan.steps == ["strip '_orig_mod.' (torch.compile) inside keys", "strip 'model.'"]


_names = st.from_regex(r"[a-z][a-z0-9]{0,4}", fullmatch=True)


@given(
    st.lists(
        st.lists(_names, min_size=2, max_size=4).map(".".join), min_size=1, max_size=12, unique=True
    ),
    st.sampled_from([w.prefix for w in WRAPPERS if w.inner]),
)
def test_strip_inner_undoes_inserting_a_wrapper_under_a_subtree(keys, prefix):
    # Insert the wrapper after the first segment of every key under one subtree: all keys
    # under it get it, so the keys show a wrapper there.
    parent = keys[0].split(".")[0] + "."
    wrapped = {k: parent + prefix + k[len(parent) :] if k.startswith(parent) else k for k in keys}
    assume(not any(seg + "." in {w.prefix for w in WRAPPERS} for k in keys for seg in k.split(".")))
    mapping, _ = strip_inner_wrappers(wrapped.values())
    assert {old: mapping[new] for old, new in wrapped.items()} == {k: k for k in keys}
