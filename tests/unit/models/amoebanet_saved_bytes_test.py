"""AmoebaNet's saved-activation count (FPropMeta) against the gradient graph TensorFlow builds.

The memory model counts, per layer, the tensors its backward reads
(`tasks/image/amoebanet/_wiring.py`, `backward_needs`). Here the same number comes from the
graph: the layer's forward and its gradient are traced, and every activation-sized tensor of
the forward that an op of the gradient takes as input (not just its shape) is summed once.
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from tasks.image import amoebanet as an

# Ops that read only a tensor's shape: they run as soon as the tensor exists and do not keep
# it for the backward.
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
BATCH = 2


def _flat(value) -> list[tf.Tensor]:
    return value.Flatten() if isinstance(value, NestedMap) else [value]


def _read_by_gradient(layer, inputs) -> tuple[int, list[bool]]:
    """Bytes of the forward's activations ([BATCH, H, W, C]; not per-channel statistics or
    filters) that the gradient's ops read, each once, and for each input leaf whether the
    gradient reads it."""
    leaves = _flat(inputs)

    @tf.function(autograph=False)
    def step(*args):
        x = NestedMap(inputs).Pack(list(args)) if isinstance(inputs, NestedMap) else args[0]
        weights = [v for v in layer.vars.Flatten() if v.trainable]
        with tf.GradientTape() as tape:
            tape.watch(list(args))
            with tf.name_scope("fwd"), fprop_context.fprop_context(training=True, step_seed=3):
                y = layer.FProp(layer.theta, x)
            # A plain sum: its gradient reads only shapes, so all that is read is the layer's.
            loss = tf.add_n([tf.reduce_sum(v) for v in _flat(y)
                             if v.dtype.is_floating and v.shape.rank and v.shape.rank >= 3])
        return tape.gradient(loss, list(args) + weights)

    graph = step.get_concrete_function(*leaves).graph
    placeholders = graph.inputs[:len(leaves)]
    read: dict[int, tf.Tensor] = {}
    for op in graph.get_operations():
        if not op.name.startswith("gradient_tape/") or op.type in SHAPE_OPS:
            continue
        for t in op.inputs:
            forward = t.op.name.startswith("fwd/") or any(t is p for p in placeholders)
            if forward and t.shape.rank == 4 and t.shape[0] == BATCH:  # An activation.
                read[id(t)] = t
    total = sum(t.shape.num_elements() * t.dtype.size for t in read.values())
    inputs_read = [any(p is t for t in read.values()) for p in placeholders]
    return total, inputs_read


class SavedBytesTest(tf.test.TestCase):

    def test_operations(self):
        for op in ("1x1", "3x3", "1x7_7x1", "max_pool_3x3", "avg_pool_3x3", "separable_3x3_2",
                   "dil_2_separable_5x5_2", "none"):
            for stride, cin, f in ((1, 8, 8), (2, 8, 16), (1, 8, 16)):
                if op.startswith("dil") and stride == 2:
                    continue
                with self.subTest(op=op, stride=stride, cin=cin, f=f):
                    p = an.AmoebaOpLayer.Params().Set(name="op", operation=op, input_dim=cin,
                                                      filters=f, stride=stride)
                    x = tf.random.stateless_normal([BATCH, 8, 8, cin], seed=[1, 2])
                    meta = p.cls.FPropMeta(p, x.shape)
                    total, inputs_read = _read_by_gradient(p.Instantiate(), x)
                    self.assertEqual(meta.memory.saved_activation_bytes, total)
                    self.assertEqual(meta.kept_input, inputs_read[0])

    def test_cells(self):
        for variant in ("D", "B"):
            for cell_type in ("normal", "reduction"):
                for prev_shape, prev_stride, keep in (((BATCH, 8, 8, 5), 1, 1.0),
                                                      ((BATCH, 16, 16, 5), 2, 0.6)):
                    with self.subTest(variant=variant, cell=cell_type, prev=prev_shape,
                                      drop_path_keep_prob=keep):
                        spec = an.CELL_SPECS[variant][cell_type]
                        p = an.AmoebaNetCell.Params().Set(
                            name="cell", cell_type=cell_type, operations=list(spec.operations),
                            hiddenstate_indices=list(spec.hiddenstate_indices),
                            used_hiddenstates=list(spec.used_hiddenstates), filters=4,
                            input_dim=6, prev_input_dim=5, prev_stride=prev_stride,
                            drop_path_keep_prob=keep, total_num_cells=4, cell_index=2)
                        inputs = NestedMap(
                            x=tf.random.stateless_normal([BATCH, 8, 8, 6], seed=[1, 2]),
                            prev_x=tf.random.stateless_normal(prev_shape, seed=[3, 4]))
                        meta = p.cls.FPropMeta(p, NestedMap(x=inputs.x.shape,
                                                            prev_x=inputs.prev_x.shape))
                        total, _ = _read_by_gradient(p.Instantiate(), inputs)
                        self.assertEqual(meta.memory.saved_activation_bytes, total)


if __name__ == "__main__":
    tf.test.main()
