"""Tests for lingvo_lite.core.hyperparams (Params, InstantiableParams, CopyFieldsTo)."""

import collections
import copy
import enum
import math
import pickle

import numpy as np
import pytest
import tensorflow as tf

from lingvo_lite.core import hyperparams
from lingvo_lite.core.hyperparams import CopyFieldsTo, InstantiableParams, Params


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Adam:
    """A toy configurable class: constructed from its params."""

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.Define("learning_rate", 0.001, "Step size.")
        p.Define("beta1", 0.9, "First-moment decay.")
        return p

    def __init__(self, params, name="adam"):
        self.params = params
        self.name = name


def _layer(dim: int) -> Params:
    p = Params()
    p.Define("dim", dim, "Width.")
    p.Define("activation", "relu", "Activation name.")
    return p


def _model() -> InstantiableParams:
    p = InstantiableParams(Adam)
    p.Define("learning_rate", 0.5, "Learning rate.")
    p.Define("num_layers", 3, "Layer count.")
    p.Define("name", "model", "Name.")
    p.Define("optimizer", Adam.Params(), "Optimizer params.")
    p.Define("layers", [_layer(4), _layer(8)], "Per-layer params.")
    return p


def _all_types() -> Params:
    """A Params holding one param of every supported value type."""
    p = Params()
    p.Define("i", -7, "")
    p.Define("big", 10**30, "")
    p.Define("f", 1e-05, "")
    p.Define("pinf", math.inf, "")
    p.Define("ninf", -math.inf, "")
    p.Define("nan", math.nan, "")
    p.Define("t", True, "")
    p.Define("fl", False, "")
    p.Define("none", None, "")
    p.Define("s", "hello world", "")
    p.Define("snum", "123", "")
    p.Define("stricky", "a;b # c: 'd' \"e\"\n\\", "")
    p.Define("sempty", "", "")
    p.Define("lst", [1, 2.5, "x", None, True, [3, 4]], "")
    p.Define("tup", (1, "y"), "")
    p.Define("tup1", (5,), "")
    p.Define("dct", {"a": 1, "b": [2, 3], 4: "four"}, "")
    p.Define("with_inf", [math.inf, -math.inf], "")
    p.Define("cls", collections.OrderedDict, "")
    p.Define("fn", math.sqrt, "")
    p.Define("local_cls", Adam, "")
    p.Define("nested_cls", Adam.Params, "")
    p.Define("tf_dtype", tf.float32, "")
    p.Define("np_dtype", np.dtype("int64"), "")
    p.Define("color", Color.BLUE, "")
    p.Define("classes", [math.floor, dict], "")
    p.Define("np_float", np.float32(1.5), "")
    p.Define("sub", _layer(16), "")
    p.Define("tuple_of_params", (_layer(1), _layer(2)), "")
    p.Define("dict_of_params", {"enc": _layer(3), "dec": _layer(5)}, "")
    return p


# ---- Define / attribute access -------------------------------------------------------------------


def test_define_get_set_attributes():
    p = Params()
    p.Define("foo", 1, "A foo.")
    assert p.foo == 1
    p.foo = 3
    assert p.foo == 3 and p.Get("foo") == 3
    assert p.GetDescription("foo") == "A foo."
    assert "foo" in p and "bar" not in p and len(p) == 1


@pytest.mark.parametrize("name", ["Foo", "1a", "a-b", "_x", "", "a.b"])
def test_define_rejects_bad_names(name):
    with pytest.raises(ValueError) as e:
        Params().Define(name, 1, "")
    assert repr(name) in str(e.value)


def test_redefinition_raises():
    p = Params()
    p.Define("foo", 1, "")
    with pytest.raises(AttributeError, match="'foo' is already defined"):
        p.Define("foo", 2, "")


def test_unknown_get_and_set_suggest_close_names():
    p = Params()
    p.Define("learning_rate", 0.1, "")
    p.Define("num_layers", 2, "")
    with pytest.raises(AttributeError) as e:
        _ = p.learnig_rate
    assert str(e.value) == "Params has no param 'learnig_rate'. Did you mean: learning_rate?"
    with pytest.raises(AttributeError) as e:
        p.num_layer = 3
    assert "'num_layer'" in str(e.value) and "num_layers" in str(e.value)
    with pytest.raises(AttributeError) as e:
        _ = p.zzz
    assert "'zzz'" in str(e.value) and "learning_rate" in str(e.value)  # Lists what exists.


def test_set_returns_self_and_accepts_dotted_names():
    p = _model()
    assert p.Set(num_layers=5, name="m2") is p
    assert p.num_layers == 5 and p.name == "m2"
    p.Set(**{"optimizer.learning_rate": 0.2})
    assert p.optimizer.learning_rate == 0.2
    assert p.SetDotted("layers[1].dim", 99) is p
    assert p.layers[1].dim == 99 and p.layers[0].dim == 4
    assert p.Get("layers[1].dim") == 99 and p.Get("optimizer.beta1") == 0.9
    assert p.GetDescription("optimizer.beta1") == "First-moment decay."
    assert "layers[0].activation" in p and "layers[2].dim" not in p


def test_set_dotted_through_tuple_rebuilds_tuple():
    p = Params()
    p.Define("pair", (_layer(1), 7), "")
    p.SetDotted("pair[1]", 8)
    p.SetDotted("pair[0].dim", 2)
    assert isinstance(p.pair, tuple) and p.pair[1] == 8 and p.pair[0].dim == 2


def test_dotted_unknown_names_suggest_full_paths():
    p = _model()
    with pytest.raises(AttributeError) as e:
        p.Get("optimizer.learnig_rate")
    assert "'optimizer.learnig_rate'" in str(e.value)
    assert "optimizer.learning_rate" in str(e.value)
    with pytest.raises(AttributeError) as e:
        p.SetDotted("layers[5].dim", 1)
    assert "'layers[5].dim'" in str(e.value)


def test_delete():
    p = _model()
    assert p.Delete("num_layers", "optimizer.beta1") is p
    assert "num_layers" not in p and "optimizer.beta1" not in p
    with pytest.raises(AttributeError):
        p.Delete("nope")


def test_iteration_sorted_by_name():
    p = Params()
    for name in ["zeta", "alpha", "mid"]:
        p.Define(name, name.upper(), "")
    expected = [("alpha", "ALPHA"), ("mid", "MID"), ("zeta", "ZETA")]
    assert list(p.IterParams()) == expected
    assert list(p) == expected


# ---- Copy / equality / freeze --------------------------------------------------------------------


def test_copy_is_deep_but_shares_classes():
    p = _model()
    p.Define("table", {"a": [1, 2]}, "")
    c = p.Copy()
    assert c == p and c is not p
    c.optimizer.learning_rate = 9.0
    c.layers[0].dim = 100
    c.layers.append(_layer(1))
    c.table["a"].append(3)
    assert p.optimizer.learning_rate == 0.001
    assert p.layers[0].dim == 4 and len(p.layers) == 2
    assert p.table == {"a": [1, 2]}
    assert c.cls is Adam and c.optimizer.cls is Adam
    assert type(c) is InstantiableParams and type(c.layers[0]) is Params
    assert c.GetDescription("num_layers") == "Layer count."


def test_equality():
    a, b = _model(), _model()
    assert a == b
    b.layers[1].activation = "gelu"
    assert a != b
    b = _model()
    b.num_layers = 3.0  # Same numeric value, different type: a different config.
    assert a != b
    b = _model()
    b.Define("extra", 1, "")
    assert a != b
    n1, n2 = Params(), Params()
    n1.Define("x", math.nan, "")
    n2.Define("x", float("nan"), "")
    assert n1 == n2
    assert a != 3


def test_freeze():
    p = _model()
    assert p.Freeze() is p and p.IsFrozen()
    assert p.optimizer.IsFrozen() and p.layers[0].IsFrozen()
    for action in [
        lambda: setattr(p, "num_layers", 4),
        lambda: p.Set(num_layers=4),
        lambda: p.SetDotted("num_layers", 4),
        lambda: p.Delete("num_layers"),
        lambda: p.FromText("num_layers : 4"),
    ]:
        with pytest.raises(TypeError, match="'num_layers'"):
            action()
    with pytest.raises(TypeError, match="'newp'"):
        p.Define("newp", 1, "")
    with pytest.raises(TypeError, match="'learning_rate'"):
        p.optimizer.learning_rate = 1.0
    with pytest.raises(TypeError, match="'dim'"):
        p.SetDotted("layers[0].dim", 1)
    assert p.num_layers == 3 and p.layers[0].dim == 4
    # Copy() gives a mutable copy; copy.deepcopy keeps the frozen state.
    c = p.Copy()
    assert not c.IsFrozen() and not c.optimizer.IsFrozen()
    c.num_layers = 4
    assert copy.deepcopy(p).IsFrozen()


# ---- Instantiate / CopyFieldsTo ------------------------------------------------------------------


def test_instantiate():
    p = Adam.Params().Set(learning_rate=0.3)
    opt = p.Instantiate(name="opt")
    assert isinstance(opt, Adam) and opt.params is p and opt.name == "opt"
    assert opt.params.learning_rate == 0.3
    with pytest.raises(ValueError, match="'cls'"):
        InstantiableParams().Instantiate()


def test_copy_fields_to():
    src = Params()
    src.Define("a", [1], "")
    src.Define("b", 2, "")
    src.Define("c", 3, "")
    src.Define("only_src", 4, "")
    dst = Params()
    dst.Define("a", None, "")
    dst.Define("b", None, "")
    dst.Define("c", None, "")
    assert CopyFieldsTo(src, dst, skip=["c"]) is dst
    assert dst.a == [1] and dst.a is not src.a and dst.b == 2 and dst.c is None
    assert "only_src" not in dst


# ---- ToText / FromText ---------------------------------------------------------------------------


def test_to_text_format():
    p = _model()
    expected = (
        "cls : type/hyperparams_test/Adam\n"
        "layers[0].activation : 'relu'\n"
        "layers[0].dim : 4\n"
        "layers[1].activation : 'relu'\n"
        "layers[1].dim : 8\n"
        "learning_rate : 0.5\n"
        "name : 'model'\n"
        "num_layers : 3\n"
        "optimizer.beta1 : 0.9\n"
        "optimizer.cls : type/hyperparams_test/Adam\n"
        "optimizer.learning_rate : 0.001\n"
    ).replace("hyperparams_test", Adam.__module__)
    assert p.ToText() == expected
    assert str(p) == expected


def test_to_text_value_encodings():
    lines = dict(line.split(" : ", 1) for line in _all_types().ToText().splitlines())
    assert lines["i"] == "-7"
    assert lines["pinf"] == "inf" and lines["ninf"] == "-inf" and lines["nan"] == "nan"
    assert lines["t"] == "True" and lines["fl"] == "False"
    assert lines["none"] == "NoneType"
    assert lines["snum"] == "'123'"
    assert lines["tup1"] == "(5,)"
    assert lines["fn"] == "type/math/sqrt"
    assert lines["cls"] == "type/collections/OrderedDict"
    assert lines["tf_dtype"] == "dtype/float32" and lines["np_dtype"] == "dtype/int64"
    assert lines["sub.dim"] == "16"
    assert lines["tuple_of_params[1].dim"] == "2"
    assert lines["dict_of_params[enc].dim"] == "3"


def test_round_trip_every_type():
    original = _all_types()
    target = _all_types()
    # Scramble every leaf of the target so the round trip really has to restore it.
    target.Set(i=0, big=1, f=2.0, pinf=0.0, ninf=0.0, nan=0.0, t=False, fl=True, none=5)
    target.Set(s="", snum="x", stricky="", sempty="z", lst=[], tup=(), tup1=(), dct={})
    target.Set(with_inf=[], cls=dict, fn=math.cos, local_cls=dict, nested_cls=dict)
    target.Set(tf_dtype=tf.int32, np_dtype=np.dtype("float16"), color=Color.RED)
    target.Set(classes=[], np_float=np.float32(0.0))
    target.SetDotted("sub.dim", 0)
    target.SetDotted("tuple_of_params[0].activation", "none")
    target.SetDotted("dict_of_params[dec].dim", 0)
    assert target != original
    assert target.FromText(original.ToText()) is target
    assert target == original
    # Spot-check types that == alone might let slip.
    assert target.tf_dtype is tf.float32
    assert isinstance(target.np_dtype, np.dtype) and target.np_dtype == np.dtype("int64")
    assert target.cls is collections.OrderedDict and target.fn is math.sqrt
    assert target.local_cls is Adam and target.nested_cls == Adam.Params
    assert target.classes[0] is math.floor and target.classes[1] is dict
    assert type(target.tup) is tuple and type(target.lst) is list
    assert target.none is None and target.color is Color.BLUE
    assert type(target.np_float) is np.float32 and target.np_float == 1.5
    assert target.stricky == "a;b # c: 'd' \"e\"\n\\"
    assert math.isnan(target.nan) and target.pinf == math.inf


def test_from_text_overrides_comments_and_separators():
    p = _model()
    text = """
    # A comment line.
    learning_rate : 2   # trailing comment
    name : 'a;b#c' ; num_layers : 7
    optimizer.beta1 : 0.5; layers[1].dim : 16
    """
    assert p.FromText(text) is p
    assert p.learning_rate == 2.0 and isinstance(p.learning_rate, float)  # int -> float allowed.
    assert p.name == "a;b#c" and p.num_layers == 7
    assert p.optimizer.beta1 == 0.5 and p.layers[1].dim == 16 and p.layers[0].dim == 4


def test_from_text_none_param_accepts_anything_and_any_param_accepts_none():
    p = Params()
    p.Define("x", None, "")
    p.Define("y", 3, "")
    p.FromText("x : [1, 'a']; y : NoneType")
    assert p.x == [1, "a"] and p.y is None
    p.x = None
    p.FromText("x : dtype/bfloat16")
    assert p.x is tf.bfloat16


def test_from_text_list_tuple_conversion():
    p = Params()
    p.Define("shape", (1, 2), "")
    p.FromText("shape : [3, 4]")
    assert p.shape == (3, 4) and type(p.shape) is tuple


def test_from_text_unknown_key():
    p = _model()
    with pytest.raises(AttributeError) as e:
        p.FromText("optimizer.learnig_rate : 0.1")
    msg = str(e.value)
    assert "'optimizer.learnig_rate'" in msg and "optimizer.learning_rate" in msg
    p.FromText("bogus : 1\nnum_layers : 9", allow_unknown=True)
    assert p.num_layers == 9


@pytest.mark.parametrize(
    "line, key, expected_type",
    [
        ("num_layers : 'abc'", "num_layers", "int"),
        ("num_layers : 2.5", "num_layers", "int"),
        ("num_layers : True", "num_layers", "int"),
        ("learning_rate : 'x'", "learning_rate", "float"),
        ("name : 3", "name", "str"),
        ("name : unquoted", "name", "str"),
        ("num_layers : [1,", "num_layers", "int"),
        ("num_layers : __import__('os')", "num_layers", "int"),
        ("cls : 5", "cls", "class/function"),
        ("cls : type/no_such_module_xyz/Foo", "cls", "class/function"),
        ("layers[0].dim : 'x'", "layers[0].dim", "int"),
    ],
)
def test_from_text_bad_values(line, key, expected_type):
    p = _model()
    before = p.Copy()
    with pytest.raises(ValueError) as e:
        p.FromText("learning_rate : 0.25\n" + line)
    msg = str(e.value)
    value_text = line.split(":", 1)[1].strip()
    assert repr(key) in msg and expected_type in msg and repr(value_text) in msg
    assert p == before  # Nothing applied, not even the valid first line.


def test_from_text_rejects_leaf_text_for_nested_params_and_malformed_lines():
    p = _model()
    with pytest.raises(ValueError, match="'optimizer'"):
        p.FromText("optimizer : 3")
    with pytest.raises(ValueError, match="no colon here"):
        p.FromText("no colon here")


def test_text_diff():
    a, b = _model(), _model()
    assert a.TextDiff(b) == ""
    b.num_layers = 4
    b.layers[0].activation = "gelu"
    b.optimizer.Delete("beta1")
    b.optimizer.Define("eps", 1e-08, "")
    expected = (
        "< layers[0].activation : 'relu'\n"
        "> layers[0].activation : 'gelu'\n"
        "< num_layers : 3\n"
        "> num_layers : 4\n"
        "< optimizer.beta1 : 0.9\n"
        "> optimizer.eps : 1e-08\n"
    )
    assert a.TextDiff(b) == expected


def test_module_has_no_tensorflow_import_at_top():
    # TensorFlow is only imported lazily when a dtype is decoded.
    assert "tf" not in vars(hyperparams) and "tensorflow" not in vars(hyperparams)


def test_mixed_list_of_params_and_values_round_trips():
    p = Params()
    p.Define("x", [_layer(2), 3], "")
    assert p.ToText() == "x[0].activation : 'relu'\nx[0].dim : 2\nx[1] : 3\n"
    p.FromText("x[1] : 4; x[0].dim : 5")
    assert p.x[1] == 4 and p.x[0].dim == 5


def test_pickle_round_trip():
    p = _model()
    q = pickle.loads(pickle.dumps(p))
    assert type(q) is InstantiableParams and q == p and q.optimizer.cls is Adam


def test_from_text_reads_classes_of_renamed_modules():
    # params.txt written before lingvo_lite.lr_schedule became lingvo_lite.tasks.learning_rate.
    from lingvo_lite.tasks import learning_rate

    p = hyperparams.Params()
    p.Define("schedule", None, "")
    p.FromText("schedule : type/lingvo_lite.lr_schedule/CosineDecay")
    assert p.schedule is learning_rate.CosineDecay
