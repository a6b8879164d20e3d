"""Which keras-hub families PipelinedModel trains exactly like plain Keras: one SGD step each.

    TF_CPP_MIN_LOG_LEVEL=2 python tools/keras_hub_family_probe.py [--only GPT2,Bert,...]

For every family in tests/keras_hub_families.py: builds the plain task model and a twin with
the same weights, wraps the twin in `PipelinedModel(twin, input_shape=..., num_cells=2,
num_micro_batches=2)` and compares one step's loss and every gradient with the plain model's
(`compute_loss` under a GradientTape, as `assert_step_matches` of
tests/keras_steps.py).
Prints one line per family: its name, a status and the seconds taken. Statuses:

    exact                 loss within 1e-5, every gradient within max(2e-6, 1e-6 * its scale)
    differs (...)         the loss difference and the worst gradient's max abs difference,
                          relative to that gradient's scale (its largest element)
    refused: MESSAGE      lingvo_lite raised a one-line ValueError/TypeError/NotImplementedError
    crash: TYPE @ FRAME: MESSAGE   anything else, or a refusal raised from an error that is
                          no refusal (the innermost cause; first 200 characters)
    plain keras-hub fails: ...     the plain model itself does not run one step

Refusals and crashes also name the innermost lingvo_lite frame ("in lingvo_lite/...").
Every family is caught on its own: one crash does not stop the probe. Like tests/conftest.py,
it splits the CPU into 8 logical devices (one per cell) before TensorFlow starts.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABS_TOL, REL_TOL, LOSS_TOL = 2e-6, 1e-6, 1e-5


def _frame(tb: traceback.FrameSummary) -> str:
    path = tb.filename
    for marker in ("site-packages/", REPO + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{tb.lineno} in {tb.name}"


def _lingvo_frame(error: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/lingvo_lite/" in f.filename]
    return f" [in {_frame(frames[-1])}]" if frames else ""


def _is_refusal(error: BaseException) -> bool:
    """Raised on purpose (a `raise` statement in lingvo_lite), one line, a usage error."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or "/lingvo_lite/" not in frames[-1].filename or "\n" in str(error):
        return False
    return (isinstance(error, (ValueError, TypeError, NotImplementedError))
            and (frames[-1].line or "").lstrip().startswith("raise"))


def describe_error(error: BaseException) -> str:
    """`refused: MESSAGE` for lingvo_lite's one-line refusals, else `crash: TYPE @ FRAME: ...`.

    A refusal raised `from` another error that is no refusal itself (lingvo_lite wrapping a
    failure of its own, such as a TypeError in its cost model) is a crash of that cause.
    """
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    if _is_refusal(error) and (cause is error or _is_refusal(cause)):
        return f"refused: {error}{_lingvo_frame(error)}"
    frames = traceback.extract_tb(cause.__traceback__)
    last = _frame(frames[-1]) if frames else "?"
    wrapped = "" if cause is error else f" (raised as {type(error).__name__}: {error})"
    return (f"crash: {type(cause).__name__} @ {last}: {(str(cause) + wrapped)[:200]!r}"
            f"{_lingvo_frame(error)}")


def compare_step(model: Any, pipelined: Any, spec: Any, x: Any, y: Any) -> str:
    """One step's loss and gradients, pipelined against plain: a status string."""
    import numpy as np
    import tensorflow as tf

    pipelined.compile(optimizer="sgd", loss=spec.loss)
    with tf.GradientTape() as tape:
        want_loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
    want = tape.gradient(want_loss, model.trainable_variables)
    got_loss, got = pipelined.loss_and_gradients(x, y)
    loss_diff = abs(float(got_loss) - float(want_loss))
    if len(got) != len(want):
        return (f"differs (loss {loss_diff:.2g}; {len(got)} gradients for "
                f"{len(want)} variables)")
    # The worst gradient: the most tolerances off; the largest absolute difference overall.
    worst_excess, worst, worst_rel, worst_path, largest, bad, missing = (
        -1.0, 0.0, 0.0, "", 0.0, 0, [])
    for v, g, w in zip(model.trainable_variables, got, want):
        if w is None or g is None:
            if (w is None) != (g is None):
                missing.append(v.path)
            continue
        g = np.asarray(tf.convert_to_tensor(g))
        w = np.asarray(tf.convert_to_tensor(w))  # Embeddings: IndexedSlices.
        scale = float(np.abs(w).max(initial=0.0))
        diff = float(np.abs(g - w).max(initial=0.0)) if g.shape == w.shape else float("inf")
        tolerance = max(ABS_TOL, REL_TOL * scale)
        bad += diff > tolerance
        largest = max(largest, diff)
        if diff / tolerance > worst_excess:
            worst_excess, worst, worst_path = diff / tolerance, diff, v.path
            worst_rel = diff / scale if scale else float(diff > 0)
    if missing:
        return f"differs (loss {loss_diff:.2g}; None gradient on one side: {missing[0]})"
    if loss_diff < LOSS_TOL and not bad:
        return f"exact (max abs diff {largest:.1g})"
    return (f"differs (loss {float(got_loss):.6g} vs {float(want_loss):.6g}, diff "
            f"{loss_diff:.2g}; {bad}/{len(want)} gradients off, worst {worst_path}: max abs "
            f"{worst:.2g} = {worst_rel:.2g} of its scale)")


def plain_step(model: Any, spec: Any, x: Any, y: Any) -> None:
    """The plain model runs and trains one step with plain Keras (raises if it cannot)."""
    model(x)
    model.compile(optimizer="sgd", loss=spec.loss)
    model.train_on_batch(x, y)


def probe(spec: Any, num_cells: int, num_micro_batches: int, batch_size: int,
          show_traceback: bool) -> str:
    """One family's status."""
    import keras

    from lingvo_lite.keras import PipelinedModel

    keras.backend.clear_session()
    x, y = spec.batch(batch_size, 0)
    try:
        plain_step(spec.build(), spec, x, y)
    except Exception as error:  # Every failure is a status.
        if show_traceback:
            traceback.print_exc()
        return f"plain keras-hub fails: {type(error).__name__}: {str(error)[:200]!r}"
    try:
        model = spec.build()  # The plain reference; the pipeline trains its own twin.
        model.compile(optimizer="sgd", loss=spec.loss)
        pipelined = PipelinedModel(spec.build(), input_shape=spec.input_shape,
                                   num_cells=num_cells, num_micro_batches=num_micro_batches)
        return compare_step(model, pipelined, spec, x, y)
    except Exception as error:  # Every failure is a status.
        if show_traceback:
            traceback.print_exc()
        return describe_error(error)


def main(argv: list[str] | None = None) -> int:
    """Probes the families asked for; prints one line each and the total time."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated family names")
    parser.add_argument("--num_cells", type=int, default=2)
    parser.add_argument("--num_micro_batches", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--traceback", action="store_true",
                        help="print each failure's full traceback to stderr")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    # One logical CPU device per cell, before TensorFlow's runtime starts (as conftest.py).
    importlib.import_module("lingvo_lite.core.devices").configure_logical_cpus(
        max(8, args.num_cells))
    families = importlib.import_module("keras_hub_families")
    specs = families.families()
    if args.only:
        wanted = [n.strip().lower() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {s.name.lower() for s in specs})
        if unknown:
            parser.error(f"unknown families {unknown}; known: {[s.name for s in specs]}")
        specs = [s for s in specs if s.name.lower() in wanted]
    start = time.perf_counter()
    for spec in specs:
        began = time.perf_counter()
        status = probe(spec, args.num_cells, args.num_micro_batches, args.batch_size,
                       args.traceback)
        print(f"{spec.name:16s} {spec.kind:17s} {status}  "
              f"({time.perf_counter() - began:.1f}s)", flush=True)
    print(f"total {len(specs)} families in {time.perf_counter() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
