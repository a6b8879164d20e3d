"""The TensorFlow private APIs the pipeline depends on, in one place.

Each of these has no public equivalent in TensorFlow 2.21:
- `serial_function_calls`: function calls built inside it run on TensorFlow's single-threaded
  executor (the per-call `function_call_options` of the eager context), which is how logical CPU
  devices emulate accelerators that run one op at a time;
- `NO_INLINE`: the function attributes that keep grappler and the function-lowering pass from
  inlining a call into its caller, so each pipeline action stays one call (one executor run),
  and grappler from specialising a copy of the function for every call site (a constant input
  or an unused output is enough to trigger it; with 2KT call sites that doubled the first
  step's run time). tf.function accepts only listed attributes: `allow_function_attributes`
  adds `_nospecialize` to its lists;
- `xplane_pb2`: the profiler's trace protobuf, read by `trace_analysis`;
- `without_automatic_control_dependencies`: a tf.while_loop built inside it has no automatic
  control dependencies in its body. With them, every loop output waits for every stateful op
  of its iteration (each cell's call), so iteration t + 1 could not start its first cell before
  iteration t finished its last: the micro-batch loop would not pipeline at all.

If a TensorFlow upgrade breaks the pipeline, look here first.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from types import ModuleType

__all__: list[str] = []

SERIAL_EXECUTOR = "SINGLE_THREADED_EXECUTOR"
NO_INLINE = {"_noinline": True, "_nospecialize": True}


def allow_function_attributes() -> None:
    """Lets tf.function take the attributes of NO_INLINE (idempotent)."""
    from tensorflow.python.eager.polymorphic_function import attributes

    for name in ("POLYMORPHIC_FUNCTION_ALLOWLIST", "TRACING_COMPILATION_ALLOWLIST",
                 "MONOMORPHIC_FUNCTION_ALLOWLIST"):
        allowed = getattr(attributes, name)
        if not set(NO_INLINE) <= allowed:
            setattr(attributes, name, allowed | frozenset(NO_INLINE))


@contextlib.contextmanager
def serial_function_calls(enabled: bool = True) -> Iterator[None]:
    """Function calls created inside (and their tape gradients) run one op at a time.

    TensorFlow's single-threaded executor rejects reference-typed edges, which
    grappler's memory optimiser creates when it turns a large AddN into an
    in-place accumulation; that rewrite is switched off for these calls only.
    """
    if not enabled:
        yield
        return
    # Imported here: this module is also read by TensorFlow-free analysis code (trace_analysis).
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context as tf_context

    ctx = tf_context.context()
    saved = ctx.function_call_options
    options = copy.copy(saved)
    config = config_pb2.ConfigProto()
    config.ParseFromString(saved.config_proto_serialized)
    config.graph_options.rewrite_options.memory_optimization = (
        rewriter_config_pb2.RewriterConfig.NO_MEM_OPT)
    options.config_proto_serialized = config
    options.executor_type = SERIAL_EXECUTOR
    ctx.function_call_options = options
    try:
        yield
    finally:
        ctx.function_call_options = saved


@contextlib.contextmanager
def without_automatic_control_dependencies() -> Iterator[None]:
    """Control-flow bodies built inside get only the control dependencies written in them.

    `tf.while_loop` builds its body with the enclosing graph's automatic-control-dependency
    setting (while_v2 reads `Graph._add_control_dependencies`); eager code has none to change.
    """
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    saved = getattr(graph, "_add_control_dependencies", None)
    if saved is None:
        yield
        return
    graph._add_control_dependencies = False
    try:
        yield
    finally:
        graph._add_control_dependencies = saved


def xplane_pb2() -> ModuleType:
    """The profiler's XSpace protobuf module (its location moved between TF releases)."""
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2 as module
    except ImportError:  # Older layouts.
        from tensorflow.core.profiler.protobuf import xplane_pb2 as module  # type: ignore
    return module
