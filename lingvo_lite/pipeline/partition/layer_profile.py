"""Measured layer costs: each layer's forward and backward time, for partition_cost='measured'.

FPropMeta's FLOPs are a model of time, and a poor one for layers whose kernels run at different
efficiencies (AmoebaNet's separable convolutions and poolings against its 1x1 convolutions: the
FLOPs balance the digits model's cells to 1.06 while their busy times differ 1.34x). This module
times the layers instead:

- every layer is built alone, on the device the profile is for, and fed one micro-batch: the
  pipeline's input for the first layer (synthesised from `input_shapes`), then the previous
  layer's real output;
- a `tf.function` forward and a `tf.function` forward + backward (gradients with respect to the
  float inputs and the trainable weights, as a cell's backward computes them) are each called a
  few times to warm up, then timed; the median of the timed runs is kept;
- with `serial_devices` the calls run on TensorFlow's single-threaded executor, as the cells do.

A layer's cost is the time it adds to its cell per micro-batch: its forward action plus its
backward action, the latter re-running the forward when the pipeline re-materialises
(`LayerTiming.cost`). `load_or_measure` caches profiles in a JSON file (PipeliningLayer's
`partition_profile_path`; the trainer uses `<logdir>/layer_profile.json`), keyed by everything the
times depend on: the layers' params, the micro-batch's input shapes, the device kind, the
executor, the thread count and the TensorFlow version.

Synthesised inputs: a leaf of `input_shapes` given as a `tf.TensorSpec` gets its dtype; a
`TensorShape` leaf is int32 zeros when its name is an id or label field (`ids`, `*_ids`, `label`,
`labels`, `*_labels`), otherwise normal noise in the pipeline's activation dtype. The values do
not change dense kernels' times; give `TensorSpec`s where the guess is wrong.

The examples below use these params (two 4x4 projections, T=2 micro-batches of 4 examples):

>>> from lingvo_lite.layers import dense
>>> from lingvo_lite.pipeline.pipelining_layer import PipeliningLayer
>>> p = PipeliningLayer.Params().Set(
...     name="pipe", num_cells=2, num_micro_batches=2, partition_cost="measured",
...     input_shapes=tf.TensorShape([8, 4]),
...     layers=[dense.ProjectionLayer.Params().Set(name=f"fc{i}", input_dim=4, output_dim=4)
...             for i in range(2)])
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import re
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from absl import logging

from lingvo_lite.core import base_layer, fprop_context, hyperparams, progress
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import placement
from lingvo_lite.pipeline import step_layout, tf_private

__all__: list[str] = []

FILE_FORMAT = "lingvo_lite.layer_profile/1"
DEFAULT_WARMUP_RUNS = 2
DEFAULT_TIMED_RUNS = 5
# Short calls are repeated until about this much time is spent timing them.
MIN_TIMED_SECONDS = 0.05
MAX_TIMED_RUNS = 50
# Profiles kept in one file (a file shared by several pipelines or settings), newest last.
MAX_PROFILES_PER_FILE = 16
_INT_FIELD = re.compile(r"(^|_)(ids|labels?)$")

# Profiles measured in this process, by key digest: partitions for several K (inspect_model,
# benchmarks) share one measurement.
_MEMO: dict[str, LayerProfile] = {}


@dataclasses.dataclass(frozen=True)
class LayerTiming:
    """Measured seconds of one layer on one micro-batch.

    Attributes:
      name: the layer's name.
      forward_s: median time of a forward call.
      forward_backward_s: median time of one call that runs the forward and then the
        backward (input and weight gradients).

    >>> LayerTiming("fc", forward_s=1.0, forward_backward_s=3.0).cost(recompute_share=1.0)
    4.0
    """

    name: str
    forward_s: float
    forward_backward_s: float

    @property
    def backward_s(self) -> float:
        """The backward alone (forward + backward minus forward; >= 0)."""
        return max(self.forward_backward_s - self.forward_s, 0.0)

    def cost(self, recompute_share: float = 1.0) -> float:
        """Seconds this layer adds to its cell per micro-batch.

        Its forward action plus its backward action, the backward re-running the forward for
        `recompute_share` of the micro-batches (1 with remat='always', 0 with 'never').
        """
        return self.forward_s * (1.0 + recompute_share) + self.backward_s


def recompute_share(remat: str, num_micro_batches: int) -> float:
    """The share of micro-batches whose backward re-runs the forward, in GPipe's order.

    'always': 1, 'never': 0, 'except_last': (T-1)/T (the last micro-batch keeps its
    activations on every cell).

    >>> recompute_share("except_last", 4)
    0.75
    """
    if remat == "never":
        return 0.0
    if remat == "except_last":
        return (num_micro_batches - 1) / num_micro_batches
    return 1.0


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """Per-layer timings, and the key of the conditions they were measured under.

    Example (timings from a file, or from `measure_profile`):

    >>> profile = LayerProfile(key={}, layers=(LayerTiming("a", 1e-3, 3e-3),
    ...                                        LayerTiming("b", 2e-3, 5e-3)))
    >>> [round(c, 6) for c in profile.costs(recompute_share=1.0)]
    [0.004, 0.007]
    """

    key: dict[str, Any]
    layers: tuple[LayerTiming, ...]

    def costs(self, recompute_share: float = 1.0) -> list[float]:
        """One cost per layer in seconds (see `LayerTiming.cost`)."""
        return [t.cost(recompute_share) for t in self.layers]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key,
                "layers": [dataclasses.asdict(t) for t in self.layers]}

    @classmethod
    def from_json(cls, data: Any) -> LayerProfile:
        """Parses `to_json`'s form; a ValueError says what is wrong."""
        if not isinstance(data, dict) or not isinstance(data.get("key"), dict) \
                or not isinstance(data.get("layers"), list):
            raise ValueError("a profile must be an object with a 'key' object and a 'layers' list")
        layers = []
        for i, row in enumerate(data["layers"]):
            try:
                timing = LayerTiming(str(row["name"]), float(row["forward_s"]),
                                     float(row["forward_backward_s"]))
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"layer {i} of a profile lacks name, forward_s or "
                                 "forward_backward_s") from None
            if not all(math.isfinite(v) and v >= 0 for v in (timing.forward_s,
                                                            timing.forward_backward_s)):
                raise ValueError(f"layer {i} of a profile has a negative or non-finite time")
            layers.append(timing)
        names = data["key"].get("layer_names")
        if isinstance(names, list) and names != [t.name for t in layers]:
            raise ValueError(f"a profile's {len(layers)} layers do not match its key's "
                             f"{len(names)} layer names")
        return cls(key=data["key"], layers=tuple(layers))


# ---------------------------------------------------------------------------------------------
# What a profile depends on.


def _layer_names(p: hyperparams.Params) -> list[str]:
    """The names PipeliningLayer gives its layers (and partitions report)."""
    return [lp.name or f"{lp.cls.__name__}_{i}" for i, lp in enumerate(p.layers)]


def _micro_batch_shapes(p: hyperparams.Params) -> Any:
    """`p.input_shapes` with the batch dimension of one micro-batch of one replica."""
    shapes = p.input_shapes
    leaves = shapes.Flatten() if isinstance(shapes, NestedMap) else [shapes]
    full = [_as_shape(s) for s in leaves if s is not None]
    batched = [s for s in full if s.rank is not None and s.rank > p.batch_dim]
    if not batched or batched[0][p.batch_dim] is None:
        raise ValueError("partition_cost='measured' needs p.input_shapes with a known batch "
                         f"dimension (batch_dim={p.batch_dim}); set the full mini-batch shape.")
    batch = int(batched[0][p.batch_dim])
    try:
        replica_batch = step_layout.replica_batch_size(batch, p.num_replicas)
    except ValueError:
        raise ValueError(f"input_shapes' batch of {batch} does not split into "
                         f"num_replicas={p.num_replicas} shards; make it a multiple of "
                         "it.") from None
    size = replica_batch // step_layout.num_micro_batches(p, replica_batch)

    def shrink(leaf: Any) -> Any:
        if leaf is None:
            return None
        shape = _as_shape(leaf)
        if shape.rank is None or shape.rank <= p.batch_dim:
            return leaf
        dims = shape.as_list()
        dims[p.batch_dim] = size
        if isinstance(leaf, tf.TensorSpec):
            return tf.TensorSpec(dims, leaf.dtype, leaf.name)
        return tf.TensorShape(dims)

    return shapes.Transform(shrink) if isinstance(shapes, NestedMap) else shrink(shapes)


def _num_micro_batches(p: hyperparams.Params) -> int:
    """T for `p.input_shapes`' mini-batch (1 when the batch size cannot be read)."""
    batch = step_layout.global_batch_size(p)
    if batch is None:
        return 1
    return step_layout.num_micro_batches(p, step_layout.replica_batch_size(batch,
                                                                           p.num_replicas))


def _as_shape(leaf: Any) -> tf.TensorShape:
    return leaf.shape if isinstance(leaf, tf.TensorSpec) else tf.TensorShape(leaf)


def _input_specs(shapes: Any, float_dtype: tf.DType) -> Any:
    """`shapes` (TensorShapes / TensorSpecs, or a NestedMap of them) as TensorSpecs."""
    def spec(name: str, leaf: Any) -> Any:
        if leaf is None:
            return None
        if isinstance(leaf, tf.TensorSpec):
            return leaf
        int_field = bool(_INT_FIELD.search(name.rsplit(".", 1)[-1]))
        return tf.TensorSpec(tf.TensorShape(leaf), tf.int32 if int_field else float_dtype)

    if isinstance(shapes, NestedMap):
        return shapes.Pack([spec(path, leaf) for path, leaf in shapes.FlattenItems()])
    return spec("", shapes)


def _format_specs(specs: Any) -> str:
    def one(s: Any) -> str:
        return "None" if s is None else f"{s.dtype.name}{s.shape.as_list()}"

    if isinstance(specs, NestedMap):
        return "{" + ", ".join(f"{k}: {one(s)}" for k, s in specs.FlattenItems()) + "}"
    return one(specs)


def _device_kind(device: str | None) -> str:
    """What the device is, e.g. 'CPU (Intel(R) Xeon(R) ...)' or 'GPU (NVIDIA H100 ...)'."""
    spec = tf.DeviceSpec.from_string(device or "")
    kind = (spec.device_type or "CPU").upper()
    model = ""
    try:
        if kind == "GPU":
            gpus = tf.config.list_physical_devices("GPU")
            if gpus:
                details = tf.config.experimental.get_device_details(gpus[spec.device_index or 0])
                model = str(details.get("device_name", ""))
        elif kind == "CPU":
            model = _cpu_model()
    except (IndexError, ValueError, RuntimeError, OSError):
        model = ""
    return f"{kind} ({model})" if model else kind


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_key(p: hyperparams.Params, device: str | None) -> dict[str, Any]:
    """Everything a PipeliningLayer params' layer times depend on (JSON-serialisable).

    >>> profile_key(p, "/device:CPU:0")["input_shapes"]  # One micro-batch.
    'float32[4, 4]'
    """
    params_text = "\n".join(lp.ToText() for lp in p.layers)
    specs = _input_specs(_micro_batch_shapes(p), tf.as_dtype(p.fprop_dtype or p.dtype))
    return {
        "params_sha256": hashlib.sha256(params_text.encode("utf-8")).hexdigest(),
        "layer_names": _layer_names(p),
        "input_shapes": _format_specs(specs),
        "batch_dim": int(p.batch_dim),
        "device_kind": _device_kind(device),
        "serial_devices": bool(p.serial_devices),
        "intra_op_threads": int(tf.config.threading.get_intra_op_parallelism_threads()),
        "tf_version": tf.__version__,
    }


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()


def profile_device(p: hyperparams.Params) -> str | None:
    """The device a cell runs on (cell 0's: every cell's device is of the same kind).

    None (TensorFlow's default device) when the placement cannot be resolved here, e.g. for
    a model inspected without its logical devices.

    >>> profile_device(p) in (None, "/device:CPU:0")
    True
    """
    try:
        sched = step_layout.placement_schedule(p)
        mesh = placement.resolve_mesh(p.placement, p.num_replicas, sched.num_devices)
        return mesh[0][sched.device_of_cell(0)]
    except (ValueError, RuntimeError, IndexError):
        return None


# ---------------------------------------------------------------------------------------------
# Measuring.


def _synthetic_input(specs: Any, seed: int = 0) -> Any:
    """A value matching `specs`: int zeros, float normal noise (deterministic)."""
    def make(s: Any) -> Any:
        if s is None:
            return None
        if s.dtype.is_floating:
            noise = tf.random.stateless_normal(s.shape, seed=[seed, 1])
            return tf.cast(noise, s.dtype)
        return tf.zeros(s.shape, s.dtype)

    return specs.Transform(make) if isinstance(specs, NestedMap) else make(specs)


def _flat(x: Any) -> list[Any]:
    return x.Flatten() if isinstance(x, NestedMap) else [x]


def _pack(like: Any, leaves: list[Any]) -> Any:
    return like.Pack(leaves) if isinstance(like, NestedMap) else leaves[0]


def _asynchronous_devices() -> bool:
    """Whether calls may return before their kernels finished (GPUs, TPUs; not CPUs)."""
    return any(d.device_type != "CPU" for d in tf.config.list_logical_devices())


def _median_seconds(call: Callable[[], Any], warmup_runs: int | None,
                    timed_runs: int | None) -> float:
    """Median seconds of `call` after `warmup_runs` calls (the first one traces).

    None: the module's DEFAULT_WARMUP_RUNS / DEFAULT_TIMED_RUNS, read at call time.

    At least `timed_runs` timed calls, more (up to MAX_TIMED_RUNS) for calls shorter than
    MIN_TIMED_SECONDS / timed_runs, whose times scatter most.
    """
    warmup_runs = DEFAULT_WARMUP_RUNS if warmup_runs is None else warmup_runs
    timed_runs = DEFAULT_TIMED_RUNS if timed_runs is None else timed_runs
    last = 0.0
    for _ in range(max(warmup_runs, 1)):
        start = time.perf_counter()
        call()
        last = time.perf_counter() - start
    runs = timed_runs
    if last > 0:
        runs = min(max(timed_runs, math.ceil(MIN_TIMED_SECONDS / last)), MAX_TIMED_RUNS)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return float(statistics.median(samples))


def time_layer(layer: base_layer.BaseLayer, x: Any, *, batch_dim: int = 0,
               serial: bool = False, warmup_runs: int | None = None,
               timed_runs: int | None = None) -> tuple[float, float, Any]:
    """(forward seconds, forward + backward seconds, output) of `layer` on input `x`.

    Both are medians over at least `timed_runs` calls of a `tf.function` (more for short
    calls), after `warmup_runs` calls (the first one traces). The backward differentiates
    every float output (with ones as output gradients) with respect to the float leaves of
    `x` and the trainable weights.
    Run in training mode; batch-norm statistics are not reported anywhere.

    >>> layer = p.layers[0].Instantiate()
    >>> forward_s, forward_backward_s, y = time_layer(layer, tf.ones([4, 4]))
    >>> y.shape, forward_s > 0
    (TensorShape([4, 4]), True)
    """
    leaves = [v for v in _flat(x) if v is not None]
    weights = [v for v in layer.vars.Flatten()
               if isinstance(v, tf.Variable) and v.trainable and v.dtype.is_floating]
    structure: dict[str, Any] = {}

    def run_forward(flat: list[Any]) -> Any:
        it = iter(flat)
        value = _pack(x, [next(it) if v is not None else None for v in _flat(x)])
        with fprop_context.fprop_context(training=True, batch_dim=batch_dim, updates=None):
            return layer.FProp(layer.theta, value)

    def forward(*flat: Any) -> list[Any]:
        y = run_forward(list(flat))
        structure["y"] = y
        return tf.nest.flatten(y, expand_composites=True)

    def forward_backward(*flat: Any) -> list[Any]:
        sources = [v for v in flat if v.dtype.is_floating] + weights
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(sources)
            y = run_forward(list(flat))
        targets = [v for v in tf.nest.flatten(y) if v is not None and v.dtype.is_floating]
        grads = tape.gradient(targets, sources, output_gradients=[tf.ones_like(v) for v in targets],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in grads]

    # Partials: TensorFlow counts traces per code object, and one new function per layer
    # (same code) would read as retracing; a partial has no code object and counts alone.
    fns = [tf.function(functools.partial(f), autograph=False)
           for f in (forward, forward_backward)]
    outputs: list[Any] = []

    def call(fn: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            with tf_private.serial_function_calls(serial):
                out = fn(*leaves)
            if _asynchronous_devices():
                tf.test.experimental.sync_devices()
            outputs[:] = [out]
        return run

    forward_s = _median_seconds(call(fns[0]), warmup_runs, timed_runs)
    y = tf.nest.pack_sequence_as(structure["y"], outputs[0], expand_composites=True)
    forward_backward_s = _median_seconds(call(fns[1]), warmup_runs, timed_runs)
    return forward_s, forward_backward_s, y


def measure_profile(p: hyperparams.Params, device: str | None = None, *,
                    warmup_runs: int | None = None,
                    timed_runs: int | None = None) -> LayerProfile:
    """Times every layer of PipeliningLayer params `p` on `device` (see the module docstring).

    Each layer is built alone (its variables on `device`), timed on one micro-batch, and its
    output feeds the next layer. Works inside a graph or tf.function being traced: the
    measurement runs eagerly in a thread of its own.

    >>> [t.name for t in measure_profile(p, "/device:CPU:0").layers]
    ['fc0', 'fc1']
    """
    key = profile_key(p, device)
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(_measure_layers(p, device, key, warmup_runs, timed_runs))
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            result.append(e)

    # A thread of its own runs eagerly with a fresh tape and fprop_context, whatever the
    # caller is inside (a graph being traced, a tape; tf.init_scope would pause tapes).
    thread = threading.Thread(target=run, name="layer_profile")
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _measure_layers(p: hyperparams.Params, device: str | None, key: dict[str, Any],
                    warmup_runs: int | None, timed_runs: int | None) -> LayerProfile:
    names = key["layer_names"]
    specs = _input_specs(_micro_batch_shapes(p), tf.as_dtype(p.fprop_dtype or p.dtype))
    timings = []
    bar = progress.ProgressBar(len(p.layers), "Timing layers for the partition")
    with tf.device(device) if device else contextlib.nullcontext(), bar:
        x = _synthetic_input(specs)
        for i, lp in enumerate(p.layers):
            q = lp.Copy()
            q.name = names[i]
            try:
                layer = q.Instantiate()
                fwd, fwd_bwd, x = time_layer(layer, x, batch_dim=p.batch_dim,
                                             serial=p.serial_devices, warmup_runs=warmup_runs,
                                             timed_runs=timed_runs)
            except (ValueError, TypeError, tf.errors.OpError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(
                    f"partition_cost='measured': timing layer {i} ({names[i]}) on the "
                    f"synthesised input {key['input_shapes']} failed: {first}. Give "
                    "input_shapes leaves as tf.TensorSpec with their dtypes, or use "
                    "partition_cost='flops'.") from e
            timings.append(LayerTiming(names[i], fwd, fwd_bwd))
            bar.advance()
            del layer
    return LayerProfile(key=key, layers=tuple(timings))


# ---------------------------------------------------------------------------------------------
# The cache file.


def _read_profiles(path: str) -> list[dict[str, Any]]:
    """The profiles stored in `path` ([] when it does not exist); ValueError when unreadable."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT \
            or not isinstance(data.get("profiles"), list):
        raise ValueError(f"not a {FILE_FORMAT} file")
    for entry in data["profiles"]:
        LayerProfile.from_json(entry)  # Validates every entry.
    return data["profiles"]


def _write_profiles(path: str, profiles: list[dict[str, Any]]) -> None:
    """Writes atomically (a reader never sees half a file); logs and goes on when it cannot."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"format": FILE_FORMAT, "profiles": profiles[-MAX_PROFILES_PER_FILE:]},
                      f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        logging.warning("Layer profile: could not write %s (%s); the measured costs are "
                        "used but not cached.", path, e)


def _differences(key: dict[str, Any], stored: list[dict[str, Any]]) -> list[str]:
    """The key fields in which the closest stored profile differs from `key`."""
    best: list[str] | None = None
    for entry in stored:
        other = entry["key"]
        diff = sorted(k for k in set(key) | set(other) if key.get(k) != other.get(k))
        if best is None or len(diff) < len(best):
            best = diff
    return best or []


def load_or_measure(p: hyperparams.Params, device: str | None = None,
                    measure: Callable[[hyperparams.Params, str | None], LayerProfile]
                    | None = None) -> LayerProfile:
    """The layer profile of `p`: from this process, from `p.partition_profile_path`, or measured.

    A file that does not hold a profile with this key (other params, shapes, device kind,
    TensorFlow version, ...) or that cannot be read is re-measured with one log line, and the
    new profile is written to it (other valid profiles in it are kept). Never raises for the
    file; a failed measurement raises a ValueError naming the layer.

    Args:
      p: PipeliningLayer params (layers, input_shapes, num_micro_batches, serial_devices,
        partition_profile_path, ...).
      device: the device to time on; None: `profile_device(p)`.
      measure: replaces `measure_profile` (tests).

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "layer_profile.json")
    >>> profile = load_or_measure(p.Copy().Set(partition_profile_path=path))
    >>> os.path.exists(path), len(profile.costs())
    (True, 2)
    """
    device = profile_device(p) if device is None else device
    key = profile_key(p, device)
    digest = _digest(key)
    path = p.partition_profile_path
    stored: list[dict[str, Any]] = []
    if path:
        try:
            stored = _read_profiles(path)
        except ValueError as e:
            logging.warning("Layer profile: %s is unreadable (%s); re-measuring and rewriting "
                            "it.", path, e)
            stored = []
        for entry in stored:
            if _digest(entry["key"]) == digest:
                profile = LayerProfile.from_json(entry)
                _MEMO[digest] = profile
                return profile
    profile = _MEMO.get(digest)
    if profile is None:
        if path and stored:
            logging.info("Layer profile: no profile in %s matches this pipeline (the closest "
                         "differs in %s); measuring %d layers on %s.", path,
                         ", ".join(_differences(key, stored)), len(p.layers), key["device_kind"])
        else:
            logging.info("Layer profile: measuring %d layers on %s%s.", len(p.layers),
                         key["device_kind"], f" (cached in {path})" if path else "")
        profile = (measure or measure_profile)(p, device)
        profile = LayerProfile(key=key, layers=profile.layers)
        _MEMO[digest] = profile
    if path:
        _write_profiles(path, stored + [profile.to_json()])
    return profile


def measured_costs(p: hyperparams.Params) -> list[float]:
    """Per-layer costs (seconds per micro-batch) for PipeliningLayer.ComputePartition.

    >>> all(c > 0 for c in measured_costs(p))
    True
    """
    profile = load_or_measure(p)
    return profile.costs(recompute_share(p.remat, _num_micro_batches(p)))


def clear_memo() -> None:
    """Forgets the profiles measured in this process (tests).

    >>> clear_memo()  # The next load_or_measure reads its file or measures again.
    """
    _MEMO.clear()


def format_profile(profile: LayerProfile) -> list[str]:
    """Lines of a table: per layer forward, backward and forward + backward milliseconds.

    >>> print("\\n".join(format_profile(LayerProfile({}, (LayerTiming("fc", 1e-3, 3e-3),)))))
    #  layer  fwd ms  bwd ms  fwd+bwd ms
    ------------------------------------
    0  fc      1.000   2.000       3.000
    """
    rows = [(str(i), t.name, f"{1e3 * t.forward_s:.3f}",
             f"{1e3 * t.backward_s:.3f}", f"{1e3 * t.forward_backward_s:.3f}")
            for i, t in enumerate(profile.layers)]
    header = ("#", "layer", "fwd ms", "bwd ms", "fwd+bwd ms")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    fmt = "{:>%d}  {:<%d}  {:>%d}  {:>%d}  {:>%d}" % tuple(widths)
    lines = [fmt.format(*header), "-" * (sum(widths) + 8)]
    return lines + [fmt.format(*r) for r in rows]
