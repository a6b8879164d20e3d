"""The Keras path's cost and speedup, measured side by side in one process.

1. Framework overhead: one `train_on_batch` step of `PipelinedModel` at K=1, T=1,
   remat='never' against the same model as a plain `keras.Sequential` (same layers,
   weights, optimizer, batch), timed in interleaved rounds so both see the same load.
   Goal (issue 15): at most 1.05x.
2. Pipelined speedup of the registered Keras example (`keras_digits.ResNetDigits`'s
   layers) on serial devices (`serial_devices=True`: each logical CPU runs one op at a
   time, like an accelerator): K=2 at several T against K=1, T=1 on one serial device.

Run (2 logical devices, intra-op 1, inter-op 2, as the other serial benchmarks):

    python bench/keras_overhead.py --rounds=7 --iters=20 --out=/tmp/keras_overhead.json
    python bench/keras_overhead.py --quick            # tiny sizes: checks that it runs

Prints a markdown table per part and writes the medians (seconds per step) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_lib  # noqa: E402


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Tiny sizes, 1 round: a smoke run.")
    parser.add_argument("--rounds", type=int, default=7, help="Interleaved timing rounds.")
    parser.add_argument("--iters", type=int, default=20, help="Steps per timing sample.")
    parser.add_argument("--mlp_layers", type=int, default=8, help="Overhead model: Dense layers.")
    parser.add_argument("--mlp_width", type=int, default=512, help="Overhead model: width.")
    parser.add_argument("--batch", type=int, default=64, help="Batch size of both parts.")
    parser.add_argument("--micro_batches", default="1,2,4,8", help="T values of part 2.")
    parser.add_argument("--out", default="", help="Write the medians here as JSON.")
    return parser.parse_args()


def _overhead(args: argparse.Namespace) -> dict[str, float]:
    import keras
    import numpy as np

    from lingvo_lite.keras import PipelinedModel

    def sequential() -> keras.Sequential:
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((args.mlp_width,))]
            + [keras.layers.Dense(args.mlp_width, activation="relu")
               for _ in range(args.mlp_layers)]
            + [keras.layers.Dense(10)])

    plain = sequential()
    pipelined = PipelinedModel(sequential(), num_cells=1, num_micro_batches=1, remat="never")
    for model in (plain, pipelined):
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.mlp_width)).astype(np.float32)
    y = rng.integers(0, 10, size=args.batch).astype(np.int32)
    steps = {name: (lambda batch, m=model: m.train_on_batch(*batch), (x, y))
             for name, model in (("keras_sequential", plain), ("pipelined_K1_T1", pipelined))}
    samples = bench_lib.interleaved(steps, args.rounds, args.iters)
    return {name: bench_lib.median(values) for name, values in samples.items()}


def _speedup(args: argparse.Namespace) -> dict[str, float]:
    import keras
    import numpy as np

    from lingvo_lite.keras import PipelinedModel
    from model_params.keras_digits import resnet_layers

    image_size, filters = (8, 4) if args.quick else (16, 32)
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(args.batch, image_size, image_size, 1)).astype(np.float32)
    y = rng.integers(0, 10, size=args.batch).astype(np.int32)
    steps = {}
    configs = [(1, 1)] + [(2, int(t)) for t in args.micro_batches.split(",")]
    for num_cells, num_micro in configs:
        keras.utils.set_random_seed(0)
        model = PipelinedModel(resnet_layers(image_size, filters),
                               input_shape=(image_size, image_size, 1), num_cells=num_cells,
                               num_micro_batches=num_micro, remat="except_last",
                               serial_devices=True)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        steps[f"serial_K{num_cells}_T{num_micro}"] = (
            lambda batch, m=model: m.train_on_batch(*batch), (x, y))
    samples = bench_lib.interleaved(steps, args.rounds, args.iters)
    return {name: bench_lib.median(values) for name, values in samples.items()}


def main() -> None:
    args = _args()
    if args.quick:
        args.rounds, args.iters, args.mlp_layers, args.mlp_width = 1, 2, 2, 16
        args.batch, args.micro_batches = 8, "2"
    bench_lib.setup(2, 1, 2)
    overhead = _overhead(args)
    ratio = overhead["pipelined_K1_T1"] / overhead["keras_sequential"]
    print("| step | ms | ratio |\n|---|---|---|")
    for name, seconds in overhead.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / overhead['keras_sequential']:.3f} |")
    print(f"\nPipelinedModel K=1, T=1 overhead vs keras.Sequential: {ratio:.3f}x (goal <= 1.05x)\n")
    speedup = _speedup(args)
    base = speedup["serial_K1_T1"]
    print("| step (serial devices) | ms | speedup over K=1, T=1 |\n|---|---|---|")
    for name, seconds in speedup.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {base / seconds:.2f}x |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"overhead_s": overhead, "overhead_ratio": ratio, "speedup_s": speedup,
                       "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
