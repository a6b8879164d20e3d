"""Tests for lingvo_lite.core.nested_map.NestedMap (expected values are written out by hand)."""

import collections
import copy
import pickle

import pytest
import tensorflow as tf

from lingvo_lite.core.nested_map import NestedMap


def _sample() -> NestedMap:
    return NestedMap(
        z=1,
        a=NestedMap(y=[10, NestedMap(k=20), None], b=(30, 40)),
        m={"q": 50, "p": 60},
    )


# Written out by hand from _sample(): sorted keys, sequences in order, plain dicts recursed.
_SAMPLE_ITEMS = [
    ("a.b[0]", 30),
    ("a.b[1]", 40),
    ("a.y[0]", 10),
    ("a.y[1].k", 20),
    ("a.y[2]", None),
    ("m.p", 60),
    ("m.q", 50),
    ("z", 1),
]


def test_attribute_access_and_assignment():
    m = NestedMap(x=1)
    m.y = 2
    m["w"] = 3
    assert m.x == 1 and m["y"] == 2 and m.w == 3
    del m.x
    assert "x" not in m
    assert isinstance(m, dict)


def test_missing_attribute_lists_available_keys():
    m = NestedMap(alpha=1, beta=2)
    with pytest.raises(AttributeError) as e:
        _ = m.gamma
    assert "gamma" in str(e.value) and "alpha" in str(e.value) and "beta" in str(e.value)


@pytest.mark.parametrize("key", ["1abc", "a-b", "a.b", "", 3, "keys", "items", "Flatten", "get"])
def test_invalid_keys_rejected(key):
    with pytest.raises(ValueError, match="Invalid NestedMap key"):
        NestedMap({key: 1})
    m = NestedMap()
    with pytest.raises(ValueError):
        m[key] = 1


def test_update_and_setdefault_validate_keys():
    m = NestedMap()
    with pytest.raises(ValueError):
        m.update({"pop": 1})
    with pytest.raises(ValueError):
        m.setdefault("1x", 1)
    m.update(a=1)
    assert m.setdefault("b", 2) == 2 and m.setdefault("a", 5) == 1


def test_flatten_and_flatten_items_order():
    m = _sample()
    assert m.FlattenItems() == _SAMPLE_ITEMS
    assert m.Flatten() == [v for _, v in _SAMPLE_ITEMS]


def test_pack_rebuilds_same_structure_and_types():
    m = _sample()
    packed = m.Pack([f"v{i}" for i in range(8)])
    assert isinstance(packed, NestedMap) and isinstance(packed.a, NestedMap)
    assert isinstance(packed.a.y, list) and isinstance(packed.a.b, tuple)
    assert isinstance(packed.a.y[1], NestedMap)
    assert type(packed.m) is dict
    assert packed.a.b == ("v0", "v1")
    assert packed.a.y == ["v2", NestedMap(k="v3"), "v4"]
    assert packed.m == {"p": "v5", "q": "v6"}
    assert packed.z == "v7"
    # The original is untouched.
    assert m.Flatten() == [v for _, v in _SAMPLE_ITEMS]


def test_pack_length_mismatch_names_both_counts():
    with pytest.raises(ValueError) as e:
        _sample().Pack([1, 2, 3])
    assert "8" in str(e.value) and "3" in str(e.value)


def test_namedtuples_are_rebuilt():
    pair = collections.namedtuple("pair", "first second")
    m = NestedMap(t=pair(1, NestedMap(c=2)))
    assert m.FlattenItems() == [("t[0]", 1), ("t[1].c", 2)]
    packed = m.Pack([5, 6])
    assert type(packed.t) is pair and packed.t.first == 5 and packed.t.second == {"c": 6}
    assert m.FilterKeyVal(lambda k, v: v == 2) == {"t": ({"c": 2},)}


def test_transform():
    m = NestedMap(a=1, b=NestedMap(c=[2, 3]))
    t = m.Transform(lambda x: x * 10)
    assert t == {"a": 10, "b": {"c": [20, 30]}}
    assert isinstance(t.b, NestedMap)


def test_filter_key_val_drops_empty_submaps():
    m = _sample()
    kept = m.FilterKeyVal(lambda path, v: path.startswith("a.y") and v is not None)
    assert kept == {"a": {"y": [10, {"k": 20}]}}
    assert isinstance(kept.a, NestedMap)
    assert m.FilterKeyVal(lambda p, v: False) == NestedMap()
    only_z = m.FilterKeyVal(lambda p, v: p == "z")
    assert only_z == {"z": 1} and "a" not in only_z and "m" not in only_z


def test_filter_by_value():
    m = NestedMap(a=1, b=NestedMap(c=2, d=NestedMap(e=4)), f=[5, 6])
    assert m.Filter(lambda v: v % 2 == 0) == {"b": {"c": 2, "d": {"e": 4}}, "f": [6]}


def test_get_item_get_set():
    m = _sample()
    assert m.GetItem("a.y[1].k") == 20
    assert m.GetItem("a.b[1]") == 40
    assert m.Get("a.nope", "dflt") == "dflt"
    assert m.Get("a.y[7]") is None
    with pytest.raises(KeyError):
        m.GetItem("a.nope")
    out = m.Set("n1.n2.leaf", 5)
    assert out is m
    assert isinstance(m.n1, NestedMap) and isinstance(m.n1.n2, NestedMap) and m.n1.n2.leaf == 5
    m.Set("a.y[0]", 11)
    assert m.a.y[0] == 11
    m.Set("a.y[1].k", 21)
    assert m.a.y[1].k == 21


def test_every_flatten_items_path_is_gettable():
    m = _sample()
    for path, leaf in m.FlattenItems():
        assert m.GetItem(path) is leaf


def test_deep_copy_copies_structure_but_not_leaves():
    leaf = object()
    m = NestedMap(a=NestedMap(b=[leaf]))
    c = m.DeepCopy()
    c.a.b.append(2)
    c.a.x = 1
    assert m == {"a": {"b": [leaf]}}
    assert c.a.b[0] is leaf


def test_is_compatible():
    a = NestedMap(x=1, y=NestedMap(z=[1, 2]))
    assert a.IsCompatible(NestedMap(x="s", y=NestedMap(z=[None, 3.0])))
    assert a.IsCompatible({"x": 0, "y": {"z": [0, 0]}})
    assert not a.IsCompatible(NestedMap(x=1, y=NestedMap(z=[1])))
    assert not a.IsCompatible(NestedMap(x=1, w=NestedMap(z=[1, 2])))
    assert not a.IsCompatible([1, 2])


def test_debug_string():
    m = NestedMap(a=1, bb=NestedMap(c="x"))
    assert m.DebugString() == "a     1\nbb.c  x"


def test_from_nested_dict():
    m = NestedMap.FromNestedDict({"a": {"b": 1}, "c": [{"d": 2}], "e": 3})
    assert isinstance(m, NestedMap) and isinstance(m.a, NestedMap)
    assert isinstance(m.c[0], NestedMap) and m.c[0].d == 2 and m.e == 3


def test_copy_pickle_and_deepcopy_keep_type():
    m = _sample()
    assert type(m.copy()) is NestedMap
    for other in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert type(other) is NestedMap and type(other.a) is NestedMap
        assert other == m


def test_tf_nest_flatten_matches_flatten():
    m = NestedMap(b=tf.constant(2.0), a=NestedMap(c=tf.constant(1.0), d=[tf.constant(3.0)]))
    flat = tf.nest.flatten(m)
    assert [float(t) for t in flat] == [1.0, 3.0, 2.0]
    assert [float(t) for t in m.Flatten()] == [1.0, 3.0, 2.0]


def test_tf_nest_map_structure_returns_nested_map():
    m = NestedMap(a=tf.constant([1.0, 2.0]), b=NestedMap(c=tf.constant(3.0)))
    out = tf.nest.map_structure(lambda t: t * 2.0, m)
    assert type(out) is NestedMap and type(out.b) is NestedMap
    assert out.a.numpy().tolist() == [2.0, 4.0]
    assert float(out.b.c) == 6.0
    packed = tf.nest.pack_sequence_as(m, [1, 3])
    assert type(packed) is NestedMap and packed == {"a": 1, "b": {"c": 3}}
    tf.nest.assert_same_structure(m, out)


def test_tf_function_accepts_nested_map():
    @tf.function
    def f(x):
        return x.Transform(lambda t: t + 1.0)

    out = f(NestedMap(a=tf.constant(1.0), b=NestedMap(c=tf.constant(2.0))))
    assert type(out) is NestedMap and float(out.a) == 2.0 and float(out.b.c) == 3.0
