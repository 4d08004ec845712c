"""The plan's account, from headers alone: every source byte is read by exactly one rule (or let
go by one, with its reason), and anything left over, taken twice, missing or made twice is
refused by name, one case at a time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import MappingError
from ckptkit.formats.base.source import TensorInfo
from ckptkit.mapping.plan import SourceKeys, plan_mapping
from ckptkit.mapping.spec import parse_mapping


def mapping(*rules, **extra):
    return parse_mapping({"from": "a", "to": "b", "rules": list(rules), **extra}, "m.toml")


def info(*shape, dtype="float32"):
    return TensorInfo(dtype, tuple(shape))


def plan(m, entries, names=None, ranks=None, target_ranks=None):
    if ranks is not None:
        source = SourceKeys([dict(entries) for _ in range(ranks)], True)
    else:
        source = SourceKeys.single(entries)
    return plan_mapping(m, source, names or {}, target_ranks)


def refused(m, entries, *needles, **kwargs):
    with pytest.raises(MappingError) as caught:
        plan(m, entries, **kwargs)
    for needle in needles:
        assert needle in str(caught.value), str(caught.value)


RENAME = {"from": "x.{i}.w", "to": "y.{i}.w"}


def test_every_byte_is_accounted_for_and_reported_by_rule():
    m = mapping(RENAME, {"from": "junk", "ops": ["drop(reason='not weights')"]})
    p = plan(m, {"x.0.w": info(4, 2), "x.1.w": info(4, 2), "junk": info(3, dtype="int64")})
    assert [t.key for t in p.targets] == ["y.0.w", "y.1.w"]
    assert p.accounted == p.source_bytes == 2 * 32 + 24 and p.dropped == 24
    described = p.describe()
    assert [r["keys_in"] for r in described["rules"]] == [2, 1]
    assert described["dropped"] == [{"rule": 2, "bytes": 24, "why": "not weights"}]


def test_a_key_no_rule_takes_is_refused_by_name():
    refused(mapping(RENAME), {"x.0.w": info(1), "stray.bias": info(2)}, "takes 'stray.bias'")


def test_a_key_two_rules_take_is_refused_naming_both():
    m = mapping(RENAME, {"from": "x.{j}.{name:str}", "to": "z.{j}.{name}"})
    refused(m, {"x.0.w": info(1)}, "'x.0.w' is taken by rule 1", "and by rule 2")


def test_a_group_missing_one_of_its_keys_is_refused():
    fuse = {"from": ["a.{i}.gate", "a.{i}.up"], "to": "a.{i}.fused", "ops": ["concat(dim=0)"]}
    refused(mapping(fuse), {"a.0.gate": info(2, 3), "a.0.up": info(2, 3), "a.1.gate": info(2, 3)},
            "'a.1.up' is missing")  # fmt: skip


def test_a_target_made_twice_is_refused():
    m = mapping({"from": "x.{i}.w", "to": "y.w"})
    refused(m, {"x.0.w": info(1), "x.1.w": info(1)}, "target 'y.w'", "also made by rule 1")


def test_a_rule_that_takes_nothing_is_refused_unless_optional():
    bias = {"from": "x.{i}.b", "to": "y.{i}.b"}
    refused(mapping(RENAME, bias), {"x.0.w": info(1)}, "rule 2 (x.{i}.b)", "takes no key")
    plan(mapping(RENAME, {**bias, "optional": True}), {"x.0.w": info(1)})


def test_a_shape_that_does_not_fit_is_refused_with_its_rule_and_key():
    m = mapping({"from": "q.{i}", "to": "q.{i}", "ops": ["permute_rope(heads=h)"]})
    refused(m, {"q.3": info(6, 4)}, "rule 1 (q.{i}) at 'q.3'", "is not 4 heads", names={"h": 4})


def test_ops_must_end_with_the_targets_count_and_rank_layout():
    split = {"from": "f", "to": ["g", "u", "extra"], "ops": ["split(dim=0, parts=2)"]}
    refused(mapping(split), {"f": info(4, 2)}, "make 2 tensor(s) for 3 target key(s)")
    refused(mapping(RENAME), {"x.0.w": info(4)}, "one tensor per rank", ranks=2)
    m = mapping(RENAME, sides={"b": {"files": "r{rank}.pt", "ranks": "tp"}})
    refused(m, {"x.0.w": info(4)}, "saved per rank", "end with scatter", target_ranks=2)


def test_rank_files_must_hold_the_same_keys():
    m = mapping({"from": "x.{i}.w", "to": "y.{i}.w", "ops": ["gather(dim=0)"]})
    source = SourceKeys([{"x.0.w": info(2)}, {"x.0.w": info(2), "x.1.w": info(2)}], True)
    with pytest.raises(MappingError, match="rank 1's file has 'x.1.w', which rank 0 lacks"):
        plan_mapping(m, source, {})


def test_stack_joins_the_values_of_a_capture_in_order():
    m = mapping({"from": "e.{k}.w", "to": "experts.w", "ops": ["stack(over=k)"]})
    p = plan(m, {"e.1.w": info(2, 3), "e.0.w": info(2, 3), "e.2.w": info(2, 3)})
    (group,) = p.groups
    assert [k for ((_, k),) in group.inputs] == ["e.0.w", "e.1.w", "e.2.w"]
    assert p.targets[0].info.shape == (3, 2, 3)
    refused(m, {"e.0.w": info(2), "e.2.w": info(2)}, "k runs [0, 2], not 0 to 1")


def test_non_dense_tensors_are_refused():
    refused(mapping(RENAME), {"x.0.w": TensorInfo("float32", (2,), kind="sparse")}, "sparse")


keys = st.lists(
    st.tuples(st.sampled_from(["enc", "dec", "head"]), st.integers(0, 30)),
    min_size=1,
    max_size=30,
    unique=True,
)


@settings(max_examples=60, deadline=None)
@given(keys, st.integers(0, 10**6))
def test_the_account_adds_up_and_any_stray_or_doubled_key_is_refused(found, seed):
    """Property: with a rule for every key, the plan reads each source byte once; a key
    outside every rule, or inside two, is refused naming it."""
    entries = {f"{part}.{i}.weight": info(1 + i % 4, 1 + seed % 3) for part, i in found}
    rules = [
        {"from": f"{part}.{{i}}.weight", "to": f"out.{part}.{{i}}"}
        for part in {p for p, _ in found}
    ]
    p = plan(mapping(*rules), entries)
    assert p.accounted == p.source_bytes == sum(i.nbytes for i in entries.values())
    assert sorted(t.key for t in p.targets) == sorted(
        f"out.{k.replace('.weight', '')}" for k in entries
    )
    stray = {**entries, "stray.0.weight": info(1)}
    refused(mapping(*rules), stray, "takes 'stray.0.weight'")
    doubled = [*rules, {"from": "{part:str}.{i}.weight", "to": "again.{part}.{i}"}]
    refused(mapping(*doubled), entries, "is taken by rule")
