"""GPipe's Table 1 from the models' own costs: the largest model that fits per device.

No TensorFlow op runs: every figure comes from the layers' FPropMeta (parameters, output and
saved-activation bytes) and the memory model (lingvo_lite/analysis/memory_model.py) with the
partition, schedule and re-materialisation of each scenario.

    python bench/table1.py                 # AmoebaNet (8 GiB) and Transformer (16 GiB) tables
    python bench/table1.py --only=amoebanet

AmoebaNet-D at 224x224, mini-batch 128, RMSProp (2 slots), float32, as the registered
image.AmoebaNetD_* models (paper: 8 GB per TPU v2 core):

* Naive-1: one device, no micro-batching, no re-materialisation (K=1, T=1, remat never);
* Pipeline-1: one device, T=16 micro-batches, re-materialisation (remat always);
* Pipeline-K: K cells, T=16, GPipe schedule, remat except_last (this library's default).

For each L (normal cells per stack; the paper's L is 3x that) the largest filter count F (a
multiple of 8) that fits is found by bisection; the table keeps the (L, F) with the most
parameters (auxiliary head excluded, as the paper counts).

Transformer: the registered T(L, 8192, 16) family (model dim 1024, 16 heads, Adam), sequence
length 1024, 32 sentence pairs per mini-batch, T=32, 16 GiB per device; the largest L (encoder =
decoder layers) for K = 1 (naive and pipelined), 2, 4, ..., 128, partitioned into equal layer
counts (partition_method='uniform').
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GIB = 2**30

# GPipe (Huang et al., 2019), Table 1: (scenario, K, paper (L, F), paper parameters).
AMOEBANET_PAPER = [
    ("Naive-1", 1, (6, 208), 82e6),
    ("Pipeline-1", 1, (6, 416), 318e6),
    ("Pipeline-2", 2, (6, 544), 542e6),
    ("Pipeline-4", 4, (12, 544), 1.05e9),
    ("Pipeline-8", 8, (24, 512), 1.8e9),
]
# Table 1's Transformer-L: (scenario, K, paper total layers, paper parameters).
TRANSFORMER_PAPER = [
    ("Naive-1", 1, 3, 282.2e6),
    ("Pipeline-1", 1, 13, 785.8e6),
    ("Pipeline-8", 8, 103, 5.3e9),
    ("Pipeline-32", 32, 415, 21.0e9),
    ("Pipeline-128", 128, 1663, 83.9e9),
]


def _scenario(name: str, k: int, micro: int) -> tuple[int, str, str]:
    """(T, schedule, remat) of a Table 1 scenario."""
    if name == "Naive-1":
        return 1, "gpipe", "never"
    if k == 1:
        return micro, "gpipe", "always"
    return micro, "gpipe", "except_last"


def _counts(p) -> tuple[int, int]:
    """(parameters as the paper counts them, all weights) of a PipeliningLayer's params."""
    from lingvo_lite.pipeline import pipelining_layer

    metas = pipelining_layer.PipeliningLayer.LayerMetas(p)
    total = sum(m.num_params for m in metas)
    model = total - sum(m.get("non_trainable_params", 0) + m.get("training_only_params", 0)
                        for m in metas)
    return model, total


def amoebanet_params(num_normal_cells: int, filters: int, batch: int = 128):
    """The pipeline params and optimizer slots of AmoebaNet-D (L, F) as registered."""
    from lingvo_lite.analysis import memory_model
    from model_params import image

    cls = type("AmoebaNetTable1", (image._AmoebaNetImageNet,),
               {"NUM_NORMAL_CELLS": num_normal_cells, "FILTERS": filters,
                "BATCH_SIZE": batch})
    task = cls().Task()
    return task.network, memory_model.optimizer_slots(task.train.optimizer)


def transformer_params(num_layers: int, batch: int = 32, length: int = 1024):
    from lingvo_lite.analysis import memory_model
    from lingvo_lite.training import model_config
    from model_params import mt

    cls = type("TransformerTable1", (mt._GPipeTransformer,),
               {"NUM_LAYERS": num_layers, "BATCH_SIZE": batch, "MAX_LENGTH": length,
                "VOCAB_SIZE": 32000})
    task = cls().Task()
    (_, p), = model_config.iter_pipelining_params(task)
    # Identical layers: equal layer counts per cell balance them, and the exact partitioner's
    # O(L^2) search would dominate at thousands of layers.
    p.partition_method = "uniform"
    return p, memory_model.optimizer_slots(task.train.optimizer)


def peak(p, slots: int, k: int, micro: int, schedule: str, remat: str) -> int | None:
    """Predicted bytes of the fullest device, or None when K cells cannot be made."""
    from lingvo_lite.analysis import planner

    if k > len(p.layers):
        return None
    try:
        mem = planner.predict_memory(p, k, 1, micro, schedule, remat, slots)
    except ValueError:
        return None
    return max(m.total for m in mem)


def largest_filters(num_normal_cells: int, k: int, micro: int, schedule: str, remat: str,
                    budget: int) -> int:
    """The largest F (multiple of 8, up to 4096) of AmoebaNet-D (L, F) that fits; 0 if none."""
    def fits(f: int) -> bool:
        p, slots = amoebanet_params(num_normal_cells, f)
        bytes_ = peak(p, slots, k, micro, schedule, remat)
        return bytes_ is not None and bytes_ <= budget

    lo, hi = 0, 4096 // 8 + 1  # In units of 8 filters: lo fits (or is 0), hi does not.
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(8 * mid):
            lo = mid
        else:
            hi = mid
    return 8 * lo


def amoebanet_table(budget: int, micro: int, cells_per_stack: list[int]) -> list[str]:
    lines = [f"## Largest AmoebaNet-D per scenario: {budget / GIB:g} GiB per device, 224x224, "
             f"batch 128, T={micro}", "",
             "| scenario | K | T | remat | largest (L, F) here | parameters here | paper (L, F) "
             "| paper parameters | here / paper | paper's model: predicted peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, k, (paper_l, paper_f), paper_params in AMOEBANET_PAPER:
        t, schedule, remat = _scenario(name, k, micro)
        best = (0, 0, 0)
        for n in cells_per_stack:
            f = largest_filters(n, k, t, schedule, remat, budget)
            if f:
                params = _counts(amoebanet_params(n, f)[0])[0]
                best = max(best, (params, n, f))
        p, slots = amoebanet_params(paper_l, paper_f)
        paper_peak = peak(p, slots, k, t, schedule, remat)
        params, n, f = best
        lines.append(
            f"| {name} | {k} | {t} | {remat} | ({3 * n}, {f}) | {params / 1e6:,.0f}M | "
            f"({3 * paper_l}, {paper_f}) | {paper_params / 1e6:,.0f}M | "
            f"{params / paper_params:.2f} | {paper_peak / GIB:.1f} GiB |")
    return lines


def largest_layers(k: int, micro: int, schedule: str, remat: str, budget: int) -> int:
    """The largest L (encoder = decoder layers) of the Transformer that fits; 0 if none."""
    def fits(n: int) -> bool:
        p, slots = transformer_params(n)
        bytes_ = peak(p, slots, k, micro, schedule, remat)
        return bytes_ is not None and bytes_ <= budget

    lo, hi = 0, 1
    while len(transformer_params(hi)[0].layers) < k:  # Too few layers for K cells.
        hi *= 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def transformer_table(budget: int, micro: int, ks: list[int]) -> list[str]:
    lines = [f"## Largest Transformer T(L, 8192, 16) per K: {budget / GIB:g} GiB per device, "
             f"sequence length 1024, batch 32, T={micro}", "",
             "| scenario | K | largest L here (total layers) | parameters here | paper total "
             "layers | paper parameters | here / paper (layers) | here / paper (parameters) |",
             "|---|---|---|---|---|---|---|---|"]
    paper = {(name, k): (layers, params) for name, k, layers, params in TRANSFORMER_PAPER}
    for name, k in [("Naive-1", 1)] + [(f"Pipeline-{k}", k) for k in ks]:
        t, schedule, remat = _scenario(name, k, micro)
        n = largest_layers(k, t, schedule, remat, budget)
        paper_layers, paper_params = paper.get((name, k), (None, None))
        if n:
            params = _counts(transformer_params(n)[0])[0]
            ours = f"{n} ({2 * n}) | {params / 1e9:.2f}B"
            ratio = (f"{2 * n / paper_layers:.2f} | {params / paper_params:.2f}" if paper_layers
                     else "- | -")
        else:
            smallest = peak(*transformer_params(1), k, t, schedule, remat)
            ours = (f"none (L=1 needs {smallest / GIB:.1f} GiB)" if smallest is not None
                    else "none") + " | -"
            ratio = "- | -"
        lines.append(f"| {name} | {k} | {ours} | "
                     + (f"{paper_layers} | {paper_params / 1e9:.2f}B | {ratio} |"
                        if paper_layers else "- | - | - | - |"))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["amoebanet", "transformer"], default=None)
    parser.add_argument("--amoebanet_memory_gib", type=float, default=8.0)
    parser.add_argument("--transformer_memory_gib", type=float, default=16.0)
    parser.add_argument("--cells_per_stack", default="2,6,12,24",
                        help="AmoebaNet L/3 values searched.")
    parser.add_argument("--num_cells", default="1,2,4,8,16,32,64,128",
                        help="Transformer K values.")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.only in (None, "amoebanet"):
        print("\n".join(amoebanet_table(int(args.amoebanet_memory_gib * GIB), 16,
                                        [int(x) for x in args.cells_per_stack.split(",")])))
        print()
    if args.only in (None, "transformer"):
        print("\n".join(transformer_table(int(args.transformer_memory_gib * GIB), 32,
                                          [int(x) for x in args.num_cells.split(",")])))
    print(f"\n({time.perf_counter() - start:.0f} s, memory model only: no TensorFlow op ran.)")


if __name__ == "__main__":
    main()
