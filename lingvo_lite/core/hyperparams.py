"""Params: typed-by-example, nestable, freezable hyperparameter containers (Lingvo semantics).

Every configurable object exposes a `Params()` classmethod returning a `Params` whose fields are
`Define`d with defaults and descriptions. Params nest (a field may hold a Params, or a
list/tuple/dict of Params), serialize to a line-per-leaf text form (`ToText`) and accept text
overrides (`FromText`), so experiments can be logged, diffed (`TextDiff`) and overridden from the
command line. `InstantiableParams.Instantiate()` builds the configured object as `cls(params)`.

Text form: `dotted.path : value`, e.g. `optimizer.learning_rate : 0.001` or
`layers[0].dim : 4`. Values: ints, floats (repr, `inf`/`nan` included), `True`/`False`,
`NoneType`, quoted strings, python literal lists/tuples/dicts, `type/module/QualName` for classes
and functions, `dtype/float32` for numpy/TensorFlow dtypes, `enum/module/QualName/MEMBER`.
"""

from __future__ import annotations

import ast
import copy
import difflib
import enum
import importlib
import inspect
import math
import re
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

from lingvo_lite.core import dotted_path

__all__ = ["CopyFieldsTo", "InstantiableParams", "Params"]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


class _Param:
    """One defined field: its current value and its description."""

    __slots__ = ("value", "description")

    def __init__(self, value: Any, description: str) -> None:
        self.value = value
        self.description = description


# ---------------------------------------------------------------------------------------------
# Value helpers
# ---------------------------------------------------------------------------------------------


def _is_class_or_function(v: Any) -> bool:
    return inspect.isclass(v) or isinstance(
        v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    )


def _is_dtype(v: Any) -> bool:
    if isinstance(v, np.dtype):
        return True
    t = type(v)
    return t.__name__ == "DType" and t.__module__.startswith("tensorflow")


def _contains_params(v: Any) -> bool:
    if isinstance(v, Params):
        return True
    if isinstance(v, (list, tuple)):
        return any(_contains_params(x) for x in v)
    if isinstance(v, dict):
        return any(_contains_params(x) for x in v.values())
    return False


def _copy_value(v: Any) -> Any:
    """Deep copy for param values; classes, functions, modules and dtypes are shared."""
    if isinstance(v, Params):
        return v._CopyImpl(keep_frozen=False)
    if isinstance(v, list):
        items = [_copy_value(x) for x in v]
        return items if type(v) is list else type(v)(items)
    if isinstance(v, tuple):
        items = [_copy_value(x) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    if isinstance(v, dict):
        return type(v)((k, _copy_value(x)) for k, x in v.items())
    if _is_class_or_function(v) or _is_dtype(v) or isinstance(v, (types.ModuleType, enum.Enum)):
        return v
    return copy.deepcopy(v)


def _values_equal(a: Any, b: Any) -> bool:
    """Config equality: types must match, NaN equals NaN, containers compare element-wise."""
    if isinstance(a, Params) or isinstance(b, Params):
        return isinstance(a, Params) and isinstance(b, Params) and a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. arrays with ambiguous truth values.
        return a is b


def _freeze_value(v: Any) -> None:
    if isinstance(v, Params):
        v.Freeze()
    elif isinstance(v, (list, tuple)):
        for x in v:
            _freeze_value(x)
    elif isinstance(v, dict):
        for x in v.values():
            _freeze_value(x)


# ---------------------------------------------------------------------------------------------
# Text encoding / decoding of leaf values
# ---------------------------------------------------------------------------------------------


def _encode(v: Any, top: bool = True) -> str:
    """Encodes a leaf value so that `_decode` returns an equal value."""
    if v is None:
        return "NoneType" if top else "None"
    if isinstance(v, (bool, int, str)) and not isinstance(v, enum.Enum):
        return repr(v)
    if isinstance(v, float):
        return repr(v)  # 'inf', '-inf', 'nan' are understood by the decoder.
    if isinstance(v, np.generic) and not isinstance(v, np.dtype):
        return _encode(v.item(), top)
    if _is_dtype(v):
        return f"dtype/{v.name}"
    if isinstance(v, enum.Enum):
        t = type(v)
        return f"enum/{t.__module__}/{t.__qualname__}/{v.name}"
    if _is_class_or_function(v):
        return f"type/{v.__module__}/{v.__qualname__}"
    if isinstance(v, list):
        return "[" + ", ".join(_encode(x, False) for x in v) + "]"
    if isinstance(v, tuple):
        if len(v) == 1:
            return "(" + _encode(v[0], False) + ",)"
        return "(" + ", ".join(_encode(x, False) for x in v) + ")"
    if isinstance(v, dict):
        items = (f"{_encode(k, False)}: {_encode(x, False)}" for k, x in v.items())
        return "{" + ", ".join(items) + "}"
    return repr(v)


class _DTypeName:
    """A decoded `dtype/<name>`; turned into a numpy or TF dtype once the target is known."""

    def __init__(self, name: str) -> None:
        self.name = name


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return _dotted(node.value) + "." + node.attr
    raise ValueError(f"unexpected expression {ast.dump(node)}")


def _segments(node: ast.AST) -> list[str]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _segments(node.left) + _segments(node.right)
    return [_dotted(node)]


# Modules renamed since params text was first written; text saved before still parses.
_MOVED_MODULES = {
    "lingvo_lite.lr_schedule": "lingvo_lite.tasks.learning_rate",
    "lingvo_lite.pipeline.timeline": "lingvo_lite.analysis.trace_analysis",
    "lingvo_lite.layers.keras_layer": "lingvo_lite.keras.keras_layer",
    "lingvo_lite.layers.keras_loss": "lingvo_lite.keras.keras_loss",
}


def _resolve_symbol(module: str, qualname: str) -> Any:
    module = _MOVED_MODULES.get(module, module)
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot resolve {module}.{qualname}: {e}") from None
    return obj


def _eval_node(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        named = {"None": None, "NoneType": None, "inf": math.inf, "nan": math.nan}
        if node.id in named:
            return named[node.id]
        raise ValueError(f"unknown name {node.id!r} (strings must be quoted)")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _eval_node(node.operand)
        if isinstance(operand, bool) or not isinstance(operand, (int, float)):
            raise ValueError("unary sign on a non-number")
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.List):
        return [_eval_node(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_eval_node(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("dict unpacking is not allowed")
        return {_eval_node(k): _eval_node(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        segs = _segments(node)
        kind = segs[0]
        if kind == "type" and len(segs) == 3:
            return _resolve_symbol(segs[1], segs[2])
        if kind == "dtype" and len(segs) == 2:
            return _DTypeName(segs[1])
        if kind == "enum" and len(segs) == 4:
            enum_cls = _resolve_symbol(segs[1], segs[2])
            try:
                return enum_cls[segs[3]]
            except (KeyError, TypeError):
                raise ValueError(f"{segs[2]} has no member {segs[3]!r}") from None
        raise ValueError("expected type/<module>/<QualName>, dtype/<name> or enum/...")
    raise ValueError(f"unsupported syntax {type(node).__name__}")


def _decode(text: str) -> Any:
    """Parses an encoded value; raises ValueError with the reason when it cannot."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not a valid value ({e.msg})") from None
    return _eval_node(tree.body)


def _materialize_dtypes(new: Any, old: Any) -> Any:
    """Replaces `_DTypeName`s by a numpy dtype when the old value was one, else a TF DType."""
    if isinstance(new, _DTypeName):
        if isinstance(old, np.dtype):
            return np.dtype(new.name)
        import tensorflow as tf  # Lazy: only needed for dtype-valued params.

        return tf.as_dtype(new.name)
    if isinstance(new, (list, tuple)):
        olds = old if isinstance(old, (list, tuple)) and len(old) == len(new) else [None] * len(new)
        return type(new)(_materialize_dtypes(n, o) for n, o in zip(new, olds))
    if isinstance(new, dict):
        olds = old if isinstance(old, dict) else {}
        return {k: _materialize_dtypes(v, olds.get(k)) for k, v in new.items()}
    return new


def _type_name(v: Any) -> str:
    if _is_dtype(v):
        return "dtype"
    if _is_class_or_function(v):
        return "class/function"
    return type(v).__name__


def _coerce(key: str, text: str, new: Any, old: Any) -> Any:
    """Checks that `new` (parsed from `text`) may replace `old` and converts it if needed."""
    ok = True
    if old is None or new is None:
        pass
    elif isinstance(old, Params):
        raise ValueError(
            f"Cannot set {key!r} from text {text!r}: it holds a nested Params; override its "
            f"fields instead, e.g. '{key}.<field> : <value>'."
        )
    elif isinstance(old, bool):
        ok = isinstance(new, bool)
    elif isinstance(old, (int, np.integer)):
        ok = isinstance(new, int) and not isinstance(new, bool)
        if ok and isinstance(old, np.integer):
            new = type(old)(new)
    elif isinstance(old, (float, np.floating)):
        ok = isinstance(new, (int, float)) and not isinstance(new, bool)
        if ok:
            new = type(old)(new) if isinstance(old, np.floating) else float(new)
    elif isinstance(old, enum.Enum):
        ok = isinstance(new, type(old))
    elif isinstance(old, str):
        ok = isinstance(new, str)
    elif isinstance(old, (list, tuple)):
        ok = isinstance(new, (list, tuple))
        if ok and type(new) is not type(old):
            new = list(new) if isinstance(old, list) else tuple(new)
    elif isinstance(old, dict):
        ok = isinstance(new, dict)
    elif _is_class_or_function(old):
        ok = _is_class_or_function(new)
    elif _is_dtype(old):
        ok = isinstance(new, _DTypeName)
    else:
        ok = type(new) is type(old)
    if not ok:
        got = "dtype" if isinstance(new, _DTypeName) else _type_name(new)
        raise ValueError(
            f"Cannot set {key!r} from text {text!r}: expected a value of type "
            f"{_type_name(old)}, got {got}"
            + (" (strings must be quoted, e.g. 'abc')" if isinstance(old, str) else "")
            + "."
        )
    return _materialize_dtypes(new, old)


def _split_overrides(text: str) -> list[str]:
    """Splits text into override statements at newlines and `;`, dropping `#` comments.

    Separators and `#` inside quoted strings are kept.
    """
    out: list[str] = []
    cur: list[str] = []
    quote: str | None = None
    i = 0
    in_comment = False
    while i < len(text):
        c = text[i]
        if in_comment:
            if c == "\n":
                in_comment = False
                out.append("".join(cur))
                cur = []
            i += 1
            continue
        if quote:
            cur.append(c)
            if c == "\\" and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
            cur.append(c)
        elif c == "#":
            in_comment = True
        elif c in ";\n":
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    out.append("".join(cur))
    return [s.strip() for s in out if s.strip()]


# ---------------------------------------------------------------------------------------------
# Dotted paths
# ---------------------------------------------------------------------------------------------


def _split_path(path: str) -> list[tuple[str, str]]:
    """Splits `a.b[0].c` into [('attr','a'), ('attr','b'), ('index','0'), ('attr','c')]."""
    return dotted_path.split(path, "param name", AttributeError)


def _index_key(container: Any, token: str) -> Any:
    """Maps an index token to a list position or dict key of `container`; KeyError if absent."""
    if isinstance(container, (list, tuple)):
        try:
            i = int(token)
        except ValueError:
            raise KeyError(token) from None
        if not -len(container) <= i < len(container):
            raise KeyError(token)
        return i
    if isinstance(container, dict):
        if token in container:
            return token
        try:
            if int(token) in container:
                return int(token)
        except ValueError:
            pass
    raise KeyError(token)


def _child(container: Any, kind: str, name: str) -> Any:
    if kind == "attr":
        if not isinstance(container, Params) or name not in container._params:
            raise KeyError(name)
        return container._params[name].value
    return container[_index_key(container, name)]


# ---------------------------------------------------------------------------------------------
# Params
# ---------------------------------------------------------------------------------------------


class Params:
    """A set of named, described hyperparameters; values may themselves be (lists of) Params."""

    def __init__(self) -> None:
        object.__setattr__(self, "_params", {})
        object.__setattr__(self, "_frozen", False)

    # ---- definition and attribute access -------------------------------------------------------

    def Define(self, name: str, default_value: Any = None, description: str = "") -> None:
        """Defines a new param `name` with a default value and a description."""
        self._CheckMutable(name)
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(
                f"Invalid param name {name!r}: must match {_NAME_RE.pattern} (lower_snake_case)."
            )
        if name in self._params:
            raise AttributeError(f"Param {name!r} is already defined.")
        self._params[name] = _Param(default_value, description)

    def _CheckMutable(self, name: str) -> None:
        if self._frozen:
            raise TypeError(
                f"Cannot modify param {name!r}: this Params is frozen. Use .Copy() to get a "
                "mutable copy."
            )

    def _NoParamError(self, name: str, candidates: list[str]) -> AttributeError:
        close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
        msg = f"{type(self).__name__} has no param {name!r}."
        if close:
            msg += f" Did you mean: {', '.join(close)}?"
        else:
            msg += f" Defined params: {', '.join(sorted(candidates)) or '(none)'}."
        return AttributeError(msg)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        params = self.__dict__.get("_params")
        if params is None or name not in params:
            raise self._NoParamError(name, list(params or ()))
        return params[name].value

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        self._SetParam(name, value)

    def _SetParam(self, name: str, value: Any) -> None:
        self._CheckMutable(name)
        if name not in self._params:
            raise self._NoParamError(name, list(self._params))
        self._params[name].value = value

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._params))

    # ---- dotted access -------------------------------------------------------------------------

    def _AllDottedNames(self) -> list[str]:
        names: list[str] = []

        def visit(path: str, v: Any) -> None:
            names.append(path)
            if isinstance(v, Params):
                for k, x in v._params.items():
                    visit(f"{path}.{k}", x.value)
            elif isinstance(v, (list, tuple)) and _contains_params(v):
                for i, x in enumerate(v):
                    visit(f"{path}[{i}]", x)
            elif isinstance(v, dict) and _contains_params(v):
                for k, x in v.items():
                    visit(f"{path}[{k}]", x)

        for k, p in self._params.items():
            visit(k, p.value)
        return names

    def _Walk(self, path: str) -> list[Any]:
        """Returns [self, child, grandchild, ...] along `path`; AttributeError if absent."""
        tokens = _split_path(path)
        chain: list[Any] = [self]
        for kind, name in tokens:
            try:
                chain.append(_child(chain[-1], kind, name))
            except (KeyError, IndexError, TypeError):
                raise self._NoParamError(path, self._AllDottedNames()) from None
        return chain

    def Get(self, name: str) -> Any:
        """Returns the value of param `name`; dotted paths like `a.b[0].c` are allowed."""
        return self._Walk(name)[-1]

    def GetDescription(self, name: str) -> str:
        """Returns the description of param `name` (dotted paths allowed)."""
        tokens = _split_path(name)
        if tokens[-1][0] != "attr":
            raise AttributeError(f"{name!r} is a list/dict element, not a defined param.")
        owner = self._Walk(name)[-2]
        return owner._params[tokens[-1][1]].description

    def SetDotted(self, name: str, value: Any) -> Params:
        """Sets param `name` (dotted path like `a.b[0].c` allowed) to `value`; returns self."""
        tokens = _split_path(name)
        chain = self._Walk(name)
        new_child = value
        # Assign bottom-up so that tuples on the path are rebuilt (they are immutable).
        for depth in range(len(tokens) - 1, -1, -1):
            container, (kind, key) = chain[depth], tokens[depth]
            if depth < len(tokens) - 1 and new_child is chain[depth + 1]:
                break  # The child was mutated in place; nothing more to re-assign.
            if kind == "attr":
                container._SetParam(key, new_child)
                new_child = container
            elif isinstance(container, tuple):
                lst = list(container)
                lst[_index_key(container, key)] = new_child
                is_namedtuple = hasattr(container, "_fields")
                new_child = type(container)(*lst) if is_namedtuple else type(container)(lst)
            else:
                owner = next(c for c in reversed(chain[:depth]) if isinstance(c, Params))
                owner._CheckMutable(name)
                container[_index_key(container, key)] = new_child
                new_child = container
        return self

    def Set(self, **kwargs: Any) -> Params:
        """Sets several params at once (`p.Set(a=1, b=2)`); returns self for chaining."""
        for name, value in kwargs.items():
            self.SetDotted(name, value)
        return self

    def Delete(self, *names: str) -> Params:
        """Deletes the given params (dotted paths allowed); returns self."""
        for name in names:
            tokens = _split_path(name)
            if tokens[-1][0] != "attr":
                raise AttributeError(f"{name!r} is a list/dict element, not a defined param.")
            owner = self._Walk(name)[-2]
            owner._CheckMutable(tokens[-1][1])
            del owner._params[tokens[-1][1]]
        return self

    def __contains__(self, name: str) -> bool:
        try:
            self._Walk(name)
        except AttributeError:
            return False
        return True

    # ---- iteration, copy, freeze, equality -----------------------------------------------------

    def IterParams(self) -> Iterator[tuple[str, Any]]:
        """Yields (name, value) of the top-level params, sorted by name."""
        for name in sorted(self._params):
            yield name, self._params[name].value

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self.IterParams()

    def __len__(self) -> int:
        return len(self._params)

    def _CopyImpl(self, keep_frozen: bool) -> Params:
        res = object.__new__(type(self))
        object.__setattr__(
            res,
            "_params",
            {k: _Param(_copy_value(p.value), p.description) for k, p in self._params.items()},
        )
        object.__setattr__(res, "_frozen", False)
        if keep_frozen and self._frozen:
            res.Freeze()
        return res

    def Copy(self) -> Params:
        """Returns a deep, *mutable* copy (classes, functions and dtypes are shared)."""
        return self._CopyImpl(keep_frozen=False)

    def __deepcopy__(self, memo: dict) -> Params:
        return self._CopyImpl(keep_frozen=True)

    def Freeze(self) -> Params:
        """Makes this Params and every nested Params immutable; returns self."""
        object.__setattr__(self, "_frozen", True)
        for p in self._params.values():
            _freeze_value(p.value)
        return self

    def IsFrozen(self) -> bool:
        return self._frozen

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Params):
            return NotImplemented
        if self._params.keys() != other._params.keys():
            return False
        return all(_values_equal(p.value, other._params[k].value) for k, p in self._params.items())

    __hash__ = None  # type: ignore[assignment]  # Mutable container.

    # ---- text form -----------------------------------------------------------------------------

    def _Leaves(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []

        def visit(path: str, v: Any) -> None:
            if isinstance(v, Params):
                for k, x in v.IterParams():
                    visit(f"{path}.{k}", x)
            elif isinstance(v, (list, tuple)) and _contains_params(v):
                for i, x in enumerate(v):
                    visit(f"{path}[{i}]", x)
            elif isinstance(v, dict) and _contains_params(v):
                for k in sorted(v, key=str):
                    visit(f"{path}[{k}]", v[k])
            else:
                out.append((path, v))

        for name, value in self.IterParams():
            visit(name, value)
        return out

    def ToText(self) -> str:
        """One `dotted.name : value` line per leaf (sorted); `FromText` parses it back."""
        return "".join(f"{k} : {_encode(v)}\n" for k, v in self._Leaves())

    def __str__(self) -> str:
        return self.ToText()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(\n{self.ToText()})"

    def FromText(self, text: str, allow_unknown: bool = False) -> Params:
        """Applies `name : value` overrides (newline- or `;`-separated, `#` comments); returns self.

        All statements are parsed and checked before any is applied, so a bad override leaves
        the params unchanged. Unknown names raise AttributeError unless `allow_unknown`.
        """
        updates: list[tuple[str, Any]] = []
        for stmt in _split_overrides(text):
            if ":" not in stmt:
                raise ValueError(f"Malformed override {stmt!r}: expected 'name : value'.")
            key, value_text = (s.strip() for s in stmt.split(":", 1))
            try:
                old = self._Walk(key)[-1]
            except AttributeError:
                if allow_unknown:
                    continue
                raise
            try:
                new = _decode(value_text)
            except ValueError as e:
                raise ValueError(
                    f"Cannot parse value {value_text!r} for param {key!r} "
                    f"(expected type {_type_name(old)}): {e}."
                ) from None
            updates.append((key, _coerce(key, value_text, new, old)))
        if self._frozen and updates:
            self._CheckMutable(updates[0][0])
        for key, value in updates:
            self.SetDotted(key, value)
        return self

    def TextDiff(self, other: Params) -> str:
        """Lines `< name : value` (self) / `> name : value` (other) for differing leaves."""
        mine = {k: _encode(v) for k, v in self._Leaves()}
        theirs = {k: _encode(v) for k, v in other._Leaves()}
        lines = []
        for k in sorted(mine.keys() | theirs.keys()):
            if k in mine and k in theirs and mine[k] == theirs[k]:
                continue
            if k in mine:
                lines.append(f"< {k} : {mine[k]}")
            if k in theirs:
                lines.append(f"> {k} : {theirs[k]}")
        return "".join(line + "\n" for line in lines)


class InstantiableParams(Params):
    """Params with a `cls` field; `Instantiate()` returns `cls(params, **kwargs)`."""

    def __init__(self, cls: type | None = None) -> None:
        super().__init__()
        self.Define("cls", cls, "Class to build; it is constructed as cls(params, **kwargs).")

    def Instantiate(self, **kwargs: Any) -> Any:
        """Builds the configured object: `self.cls(self, **kwargs)`."""
        if self.cls is None:
            raise ValueError(
                "InstantiableParams.Instantiate: 'cls' is None; set p.cls to the class to build."
            )
        return self.cls(self, **kwargs)


def CopyFieldsTo(from_p: Params, to_p: Params, skip: list[str] | None = None) -> Params:
    """Deep-copies every param defined in both `from_p` and `to_p`, except `skip`; returns to_p."""
    skip_set = set(skip or ())
    for name, value in from_p.IterParams():
        if name in skip_set or name not in to_p._params:
            continue
        to_p._SetParam(name, _copy_value(value))
    return to_p
