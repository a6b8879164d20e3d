"""Image classification with a pipelined AmoebaNet."""

from __future__ import annotations

import tensorflow as tf

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.tasks import inference, pipelined_task
from tasks.image import amoebanet

__all__ = ["amoebanet_task_params", "ImageClassifierTask"]


class ImageClassifierTask(pipelined_task.PipelinedTask):
    """Classifies `image` into `label`: the AmoebaNet layers, partitioned into cells."""

    # Classes (and their probabilities) the serving signatures return per image.
    TOP_K = 5

    def NetworkInputs(self, input_batch: NestedMap) -> NestedMap:
        return NestedMap(image=input_batch.image, label=input_batch.label)

    def Logits(self, images: tf.Tensor) -> tf.Tensor:
        """Eval-mode logits [B, num_classes] of float images [B, H, W, C] (the network's size),
        the network's layers run one after the other (any batch size)."""
        # The head's loss reads labels; the logits do not depend on them.
        inputs = NestedMap(image=images, label=tf.zeros(tf.shape(images)[:1], tf.int32))
        return inference.network_forward(self.network, self.theta.network, inputs).logits

    def Inference(self) -> inference.InferenceGraph:
        """Two signatures, images -> the TOP_K classes and their softmax probabilities.

        `serving_default` takes float images in [0, 1] (as the input generators yield them),
        `serving_uint8` takes uint8 images (0..255, divided by 255 as the generators do with
        integer images); both take any batch size and any height and width (resized bilinearly
        to the network's size when they differ) with the network's number of channels.
        Outputs: `classes` int32 [B, k], best first, and `probabilities` float32 [B, k].
        """
        _, height, width, channels = self.params.network.input_shapes.image.as_list()
        num_classes = self.network.layers[-1].params.num_classes
        k = min(self.TOP_K, num_classes)

        def classify(images: tf.Tensor) -> dict[str, tf.Tensor]:
            images = tf.cond(
                tf.reduce_all(tf.equal(tf.shape(images)[1:3], [height, width])),
                lambda: images, lambda: tf.image.resize(images, [height, width],
                                                        method="bilinear"))
            probabilities = tf.nn.softmax(tf.cast(self.Logits(images), tf.float32), axis=-1)
            top = tf.math.top_k(probabilities, k=k)
            return {"classes": top.indices, "probabilities": top.values}

        @tf.function(input_signature=[
            tf.TensorSpec([None, None, None, channels], tf.float32, name="images")])
        def serving_default(images: tf.Tensor) -> dict[str, tf.Tensor]:
            return classify(images)

        @tf.function(input_signature=[
            tf.TensorSpec([None, None, None, channels], tf.uint8, name="images")])
        def serving_uint8(images: tf.Tensor) -> dict[str, tf.Tensor]:
            return classify(tf.image.convert_image_dtype(images, tf.float32))

        return inference.InferenceGraph(
            signatures={"serving_default": serving_default, "serving_uint8": serving_uint8})


def amoebanet_task_params(
    net: hyperparams.Params,
    batch_size: int,
    num_cells: int = 2,
    num_micro_batches: int = 1,
    name: str = "amoebanet",
) -> hyperparams.InstantiableParams:
    """Task params whose pipeline holds the AmoebaNet described by `net` (AmoebaNetParams)."""
    p = ImageClassifierTask.Params().Set(name=name)
    p.network.Set(
        layers=amoebanet.amoebanet_layers(net),
        input_shapes=amoebanet.input_shapes(net, batch_size),
        num_cells=num_cells,
        num_micro_batches=num_micro_batches,
    )
    return p
