"""Tests of `BaseLayer.declare_children`: one declaration drives construction and FPropMeta."""

from __future__ import annotations

import doctest

import numpy as np
import tensorflow as tf

from lingvo_lite.core import base_layer
from lingvo_lite.layers import composite, dense


class _Mlp(base_layer.BaseLayer):
    """input -> `num_hidden` RELU projections of width `hidden_dim` (a list child) -> `out`."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define("input_dim", 0, "Input depth.")
        p.Define("hidden_dim", 0, "Hidden depth.")
        p.Define("num_hidden", 1, "Hidden layers.")
        p.Define("output_dim", 0, "Output depth.")
        return p

    @classmethod
    def declare_children(cls, p):
        if p.num_hidden < 1:
            raise ValueError(f"{p.name}: p.num_hidden must be >= 1, got {p.num_hidden}.")
        hidden = [dense.ProjectionLayer.Params().Set(
            input_dim=p.input_dim if i == 0 else p.hidden_dim, output_dim=p.hidden_dim,
            activation="RELU", dtype=p.dtype) for i in range(p.num_hidden)]
        out = dense.ProjectionLayer.Params().Set(input_dim=p.hidden_dim,
                                                 output_dim=p.output_dim, dtype=p.dtype)
        return {"hidden": hidden, "out": out}

    def FProp(self, theta, x):
        x = composite.chain_fprop(self.hidden, theta.hidden, x)
        return self.out.FProp(theta.out, x)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        children = cls.declare_children(p)
        metas = composite.chain_meta(children["hidden"] + [children["out"]], x_shape)
        return composite.sum_meta(metas, (x_shape,), p.dtype)


def _params(**kw):
    p = _Mlp.Params().Set(name="mlp", input_dim=3, hidden_dim=5, num_hidden=2, output_dim=4)
    return p.Set(**kw)


class DeclareChildrenTest(tf.test.TestCase):

    def test_children_created_as_declared(self):
        layer = _params(dtype=tf.float64).Instantiate()
        self.assertEqual(list(layer.children), ["hidden", "out"])
        self.assertLen(layer.hidden, 2)
        self.assertEqual([c.path for c in layer.hidden], ["mlp/hidden_0", "mlp/hidden_1"])
        self.assertEqual(layer.out.path, "mlp/out")
        for child, (din, dout, act) in zip(layer.hidden + [layer.out],
                                           [(3, 5, "RELU"), (5, 5, "RELU"), (5, 4, "NONE")]):
            self.assertIsInstance(child, dense.ProjectionLayer)
            self.assertEqual((child.params.input_dim, child.params.output_dim,
                              child.params.activation), (din, dout, act))
            self.assertEqual(child.params.dtype, tf.float64)
            self.assertEqual(child.vars.w.shape, (din, dout))
            self.assertEqual(child.vars.w.dtype, tf.float64)
        # theta mirrors the declaration: a list for the list child.
        self.assertLen(layer.theta.hidden, 2)

    def test_children_are_created_under_the_callers_device(self):
        # A pipeline creates each cell's layers under its device: list children too (a
        # tf.device(None) per child had put them on the default device).
        with tf.device("/device:CPU:1"):
            layer = _params().Instantiate()
        devices = {v.name: v.device for v in layer.vars.Flatten()}
        self.assertLen(devices, 6)
        for name, device in devices.items():
            self.assertEndsWith(device, "CPU:1", msg=name)

    def test_create_children_devices_place_each_child(self):
        class Pair(base_layer.BaseLayer):
            def __init__(self, params):
                super().__init__(params)
                child = dense.ProjectionLayer.Params().Set(input_dim=2, output_dim=2)
                self.CreateChildren("proj", [child, child], devices=["/device:CPU:2", None])

        with tf.device("/device:CPU:1"):
            layer = Pair.Params().Set(name="pair").Instantiate()
        self.assertEndsWith(layer.proj[0].vars.w.device, "CPU:2")
        self.assertEndsWith(layer.proj[1].vars.w.device, "CPU:1")  # None: the caller's.

    def test_fprop_matches_numpy(self):
        layer = _params().Instantiate()
        x = np.random.RandomState(0).randn(6, 3).astype(np.float32)
        v = layer.vars
        h = x
        for hv in v.hidden:
            h = np.maximum(h @ hv.w.numpy() + hv.b.numpy(), 0.0)
        want = h @ v.out.w.numpy() + v.out.b.numpy()
        self.assertAllClose(layer(tf.constant(x)), want, rtol=1e-5, atol=1e-5)

    def test_fprop_meta_equals_hand_sum(self):
        batch = 6
        meta = _Mlp.FPropMeta(_params(), tf.TensorShape([batch, 3]))
        # (in, out, activation flops per element) of each projection; bias add 1 per output.
        dims = [(3, 5, 1), (5, 5, 1), (5, 4, 0)]
        flops = sum(2 * batch * i * o + batch * o * (1 + a) for i, o, a in dims)
        params = sum(i * o + o for i, o, _ in dims)
        self.assertEqual(meta.flops, flops)
        self.assertEqual(meta.num_params, params)
        self.assertEqual(meta.out_shapes, (tf.TensorShape([batch, 4]),))
        # The params count what construction creates.
        layer = _params().Instantiate()
        self.assertEqual(sum(int(np.prod(w.shape)) for w in layer.vars.Flatten()), params)

    def test_fprop_meta_instantiates_nothing(self):
        def refuse(next_creator, **kwargs):
            raise AssertionError("FPropMeta created a variable")

        with tf.variable_creator_scope(refuse):
            _Mlp.FPropMeta(_params(), tf.TensorShape([2, 3]))
            with self.assertRaisesRegex(AssertionError, "created a variable"):
                _params().Instantiate()

    def test_declaration_validates_both_paths(self):
        with self.assertRaisesRegex(ValueError, "num_hidden must be >= 1"):
            _params(num_hidden=0).Instantiate()
        with self.assertRaisesRegex(ValueError, "num_hidden must be >= 1"):
            _Mlp.FPropMeta(_params(num_hidden=0), tf.TensorShape([2, 3]))

    def test_no_declaration_no_children(self):
        layer = dense.ProjectionLayer.Params().Set(name="p", input_dim=2,
                                                   output_dim=3).Instantiate()
        self.assertEqual(dict(layer.children), {})

    def test_docstring_example_runs(self):
        finder = doctest.DocTestFinder()
        runner = doctest.DocTestRunner()
        tests = [t for t in finder.find(base_layer.BaseLayer.declare_children,
                                        globs=vars(base_layer).copy()) if t.examples]
        self.assertLen(tests, 1)
        self.assertEqual(runner.run(tests[0]).failed, 0)


class ChainMetaTest(tf.test.TestCase):

    def test_error_names_the_layer(self):
        first = dense.ProjectionLayer.Params().Set(name="first", input_dim=3, output_dim=5)
        second = dense.ProjectionLayer.Params().Set(name="second", input_dim=4, output_dim=2)
        with self.assertRaisesRegex(ValueError,
                                    r"Layer 1 \(second\) cannot take the output of layer 0"):
            composite.chain_meta([first, second], tf.TensorShape([2, 3]))
        with self.assertRaisesRegex(ValueError, r"Layer 0 \(second\) cannot take the batch"):
            composite.chain_meta([second], tf.TensorShape([2, 3]), input_name="the batch")


if __name__ == "__main__":
    tf.test.main()
