"""NestedMap: a dict with attribute access and structure utilities (Lingvo semantics).

Layers pass tensors, variables and per-layer state around as nested maps; the helpers here
(`Flatten`, `Pack`, `Transform`, `FilterKeyVal`, ...) let code treat such a tree as a flat list of
leaves and rebuild it, in a deterministic order (sorted keys). NestedMap is a `dict` subclass whose
constructor accepts whatever `dict` accepts, so `tf.nest` treats it as a structure and rebuilds
NestedMaps (not plain dicts) in `tf.nest.map_structure` / `tf.nest.pack_sequence_as`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lingvo_lite.core import dotted_path

__all__ = ["NestedMap"]

_DELETE = object()  # Sentinel: "this sub-tree was filtered away entirely".


def _is_map(x: Any) -> bool:
    return isinstance(x, dict)


def _is_seq(x: Any) -> bool:
    return isinstance(x, (list, tuple))


def _rebuild_seq(template: list | tuple, items: list) -> list | tuple:
    """Builds a sequence of the same type as `template` (namedtuples included) from `items`."""
    if isinstance(template, list):
        return type(template)(items) if type(template) is not list else list(items)
    if hasattr(template, "_fields"):  # namedtuple
        return type(template)(*items)
    return type(template)(items)


def _rebuild_map(template: dict, pairs: Iterable[tuple[Any, Any]]) -> dict:
    if isinstance(template, NestedMap):
        return NestedMap(pairs)
    if type(template) is dict:
        return dict(pairs)
    return type(template)(pairs)


def _flatten_items(x: Any, prefix: str, out: list[tuple[str, Any]]) -> None:
    if _is_map(x):
        for k in sorted(x.keys()):
            _flatten_items(x[k], f"{prefix}.{k}" if prefix else str(k), out)
    elif _is_seq(x):
        for i, v in enumerate(x):
            _flatten_items(v, f"{prefix}[{i}]", out)
    else:
        out.append((prefix, x))


def _pack(template: Any, leaves: Iterable[Any]) -> Any:
    """Rebuilds `template`'s structure taking leaves in order from the iterator `leaves`."""
    if _is_map(template):
        return _rebuild_map(template, [(k, _pack(template[k], leaves)) for k in sorted(template)])
    if _is_seq(template):
        return _rebuild_seq(template, [_pack(v, leaves) for v in template])
    return next(leaves)


def _filter(x: Any, prefix: str, fn: Callable[[str, Any], bool], top: bool) -> Any:
    if _is_map(x):
        kept = []
        for k in sorted(x.keys()):
            v = _filter(x[k], f"{prefix}.{k}" if prefix else str(k), fn, False)
            if v is not _DELETE:
                kept.append((k, v))
        if not kept and not top:
            return _DELETE
        return _rebuild_map(x, kept)
    if _is_seq(x):
        kept = []
        for i, v in enumerate(x):
            v = _filter(v, f"{prefix}[{i}]", fn, False)
            if v is not _DELETE:
                kept.append(v)
        if not kept:
            return _DELETE
        if hasattr(x, "_fields") and len(kept) != len(x):
            return tuple(kept)  # A namedtuple cannot lose fields: fall back to a plain tuple.
        return _rebuild_seq(x, kept)
    return x if fn(prefix, x) else _DELETE


def _to_nested_map(x: Any) -> Any:
    if isinstance(x, dict):
        return NestedMap((k, _to_nested_map(v)) for k, v in x.items())
    if _is_seq(x):
        return _rebuild_seq(x, [_to_nested_map(v) for v in x])
    return x


def _split_path(key: str) -> list[str | int]:
    """Splits `a.b[0].c` into ['a', 'b', 0, 'c']; raises ValueError on malformed paths."""
    return [name if kind == "attr" else int(name)
            for kind, name in dotted_path.split(key, "NestedMap path", ValueError, r"-?[0-9]+")]


class NestedMap(dict):
    """A dict whose (identifier) keys are also attributes, with Lingvo's structure helpers.

    Keys must be valid Python identifiers that do not shadow a dict/NestedMap method (so that
    `m.key` is unambiguous). Leaves are anything that is not a dict, list or tuple (None included).
    """

    __slots__ = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for key in self.keys():
            NestedMap.CheckKey(key)

    @staticmethod
    def CheckKey(key: Any) -> None:
        """Raises ValueError unless `key` is usable as a NestedMap attribute name."""
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(
                f"Invalid NestedMap key {key!r}: keys must be str Python identifiers "
                "(letters, digits, underscores; not starting with a digit)."
            )
        if key in _RESERVED_KEYS:
            raise ValueError(
                f"Invalid NestedMap key {key!r}: it shadows a dict/NestedMap method; "
                "choose another name."
            )

    # ---- dict / attribute plumbing -------------------------------------------------------------

    def __setitem__(self, key: str, value: Any) -> None:
        NestedMap.CheckKey(key)
        super().__setitem__(key, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"NestedMap has no attribute {name!r}. Available attributes: {sorted(self.keys())}"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(
                f"NestedMap has no attribute {name!r}. Available attributes: {sorted(self.keys())}"
            ) from None

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.keys()))

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key not in self:
            self[key] = default
        return self[key]

    def copy(self) -> NestedMap:  # type: ignore[override]
        """Shallow copy that stays a NestedMap (dict.copy would return a plain dict)."""
        return NestedMap(self)

    def __deepcopy__(self, memo: dict) -> NestedMap:
        import copy

        return NestedMap((k, copy.deepcopy(v, memo)) for k, v in self.items())

    # ---- structure helpers ---------------------------------------------------------------------

    def FlattenItems(self) -> list[tuple[str, Any]]:
        """Returns [(path, leaf)] in deterministic order; paths look like `a.b[0].c`."""
        out: list[tuple[str, Any]] = []
        _flatten_items(self, "", out)
        return out

    def Flatten(self) -> list[Any]:
        """Returns the leaves in deterministic order (sorted keys, sequences in order)."""
        return [v for _, v in self.FlattenItems()]

    def Pack(self, lst: Iterable[Any]) -> NestedMap:
        """Returns a NestedMap with this structure whose leaves are taken in order from `lst`."""
        lst = list(lst)
        n_leaves = len(self.Flatten())
        if len(lst) != n_leaves:
            raise ValueError(
                f"NestedMap.Pack: structure has {n_leaves} leaves but {len(lst)} values were "
                "given; pass exactly one value per leaf of Flatten()."
            )
        return _pack(self, iter(lst))

    def Transform(self, fn: Callable[[Any], Any]) -> NestedMap:
        """Returns a NestedMap of the same structure with `fn` applied to every leaf."""
        return self.Pack([fn(v) for v in self.Flatten()])

    def FilterKeyVal(self, fn: Callable[[str, Any], bool]) -> NestedMap:
        """Keeps leaves with `fn(path, leaf)` True; sub-maps/sequences left empty are dropped."""
        return _filter(self, "", fn, True)

    def Filter(self, fn: Callable[[Any], bool]) -> NestedMap:
        """Keeps leaves with `fn(leaf)` True; sub-maps/sequences left empty are dropped."""
        return self.FilterKeyVal(lambda _, v: fn(v))

    def IsCompatible(self, other: Any) -> bool:
        """True iff `other` is a dict with the same structure (same leaf paths)."""
        if not isinstance(other, dict):
            return False
        if not isinstance(other, NestedMap):
            other = NestedMap.FromNestedDict(other)
        return [k for k, _ in self.FlattenItems()] == [k for k, _ in other.FlattenItems()]

    def DeepCopy(self) -> NestedMap:
        """Copies the whole structure (maps, lists, tuples); leaves are shared, not copied.

        Leaves are typically tensors/variables, which must not be duplicated.
        """
        return self.Pack(self.Flatten())

    def DebugString(self) -> str:
        """Multi-line `path  value` listing of all leaves, paths left-aligned."""
        items = self.FlattenItems()
        if not items:
            return ""
        width = max(len(k) for k, _ in items)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in items)

    @staticmethod
    def FromNestedDict(x: Any) -> Any:
        """Converts nested plain dicts (also inside lists/tuples) into NestedMaps."""
        return _to_nested_map(x)

    # ---- dotted-path access --------------------------------------------------------------------

    def GetItem(self, key: str) -> Any:
        """Returns the value at dotted path `key` (e.g. `a.b[0].c`); KeyError if missing."""
        cur: Any = self
        for tok in _split_path(key):
            try:
                if isinstance(tok, int):
                    if not _is_seq(cur):
                        raise KeyError(tok)
                    cur = cur[tok]
                else:
                    if not _is_map(cur):
                        raise KeyError(tok)
                    cur = cur[tok]
            except (KeyError, IndexError):
                raise KeyError(f"NestedMap has no item {key!r} (failed at {tok!r}).") from None
        return cur

    def Get(self, key: str, default: Any = None) -> Any:
        """Like GetItem, but returns `default` when the path does not exist."""
        try:
            return self.GetItem(key)
        except KeyError:
            return default

    def Set(self, key: str, value: Any) -> NestedMap:
        """Sets dotted path `key` to `value`, creating intermediate NestedMaps; returns self.

        List elements can be replaced (`a.b[0]`) but lists are never created or extended.
        """
        tokens = _split_path(key)
        cur: Any = self
        for tok, nxt in zip(tokens[:-1], tokens[1:]):
            if isinstance(tok, int):
                if not isinstance(cur, list) or not -len(cur) <= tok < len(cur):
                    raise KeyError(f"NestedMap.Set({key!r}): no list element [{tok}].")
                cur = cur[tok]
            else:
                if not _is_map(cur):
                    raise KeyError(f"NestedMap.Set({key!r}): {tok!r} is not inside a map.")
                if tok not in cur:
                    if isinstance(nxt, int):
                        raise KeyError(f"NestedMap.Set({key!r}): no list at {tok!r}.")
                    cur[tok] = NestedMap()
                cur = cur[tok]
        last = tokens[-1]
        if isinstance(last, int):
            if not isinstance(cur, list) or not -len(cur) <= last < len(cur):
                raise KeyError(f"NestedMap.Set({key!r}): no list element [{last}] to replace.")
            cur[last] = value
        else:
            if not _is_map(cur):
                raise KeyError(f"NestedMap.Set({key!r}): {last!r} is not inside a map.")
            cur[last] = value
        return self


_RESERVED_KEYS = frozenset(dir(dict)) | frozenset(
    name for name in vars(NestedMap) if not name.startswith("__")
)
