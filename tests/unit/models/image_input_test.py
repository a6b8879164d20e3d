"""Tests of the image input pipelines (tasks/image/input_generator.py).

Expected values come from independent computations: the digits csv read with gzip + csv, numpy
padding/slicing/bilinear interpolation, and the raw examples of the tfds builders.
"""

from __future__ import annotations

import collections
import csv
import gzip
import os
import tempfile

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from lingvo_lite.core.nested_map import NestedMap
from tasks.image import input_generator

_CSV = os.path.join(os.path.dirname(input_generator.__file__), "data", "digits.csv.gz")


def _read_csv() -> np.ndarray:
    """All 1,797 rows (64 pixels + label) as int64 [1797, 65], read without the code under test."""
    with gzip.open(_CSV, "rt") as f:
        return np.array([[int(v) for v in row] for row in csv.reader(f)], dtype=np.int64)


def _digits(**kwargs) -> input_generator.DigitsInput:
    p = input_generator.DigitsInput.Params()
    p.Set(**kwargs)
    return p.Instantiate()


def _one_pass(inp) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates all batches of a non-repeating input into (images, labels) numpy arrays."""
    images, labels = [], []
    for batch in inp.dataset():
        images.append(batch.image.numpy())
        labels.append(batch.label.numpy())
    return np.concatenate(images), np.concatenate(labels)


def _np_bilinear_resize(image: np.ndarray, size: int) -> np.ndarray:
    """Half-pixel-centre bilinear resize of [H, W, C] with edge clamping, in plain numpy."""

    def axis_weights(in_size: int) -> np.ndarray:
        w = np.zeros((size, in_size))
        for i in range(size):
            src = (i + 0.5) * in_size / size - 0.5
            lo = int(np.floor(src))
            frac = src - lo
            w[i, min(max(lo, 0), in_size - 1)] += 1 - frac
            w[i, min(max(lo + 1, 0), in_size - 1)] += frac
        return w

    wy, wx = axis_weights(image.shape[0]), axis_weights(image.shape[1])
    return np.einsum("yh,xw,hwc->yxc", wy, wx, image)


class _TestCase(tf.test.TestCase):
    # tf.test.TestCase.test_session is a deprecated helper that pytest would collect and skip.
    test_session = None


class DigitsInputTest(_TestCase):

    def _split(self, split: str, image_size: int = 8) -> tuple[np.ndarray, np.ndarray]:
        inp = _digits(split=split, batch_size=100, shuffle=False, repeat=False,
                      drop_remainder=False, augment=False, image_size=image_size)
        return _one_pass(inp)

    def testSplitsPartitionTheCsv(self):
        rows = _read_csv()
        self.assertEqual(rows.shape, (1797, 65))
        expected_sizes = {"train": 1397, "dev": 200, "test": 200}
        seen = collections.Counter()
        for split, size in expected_sizes.items():
            images, labels = self._split(split)
            self.assertEqual(images.shape, (size, 8, 8, 1))
            self.assertEqual(labels.dtype, np.int32)
            self.assertEqual(_digits(split=split).num_examples(), size)
            # Pixels are exactly raw / 16, so scaling back recovers the integer csv values.
            raw = images[..., 0].reshape(size, 64) * 16.0
            np.testing.assert_array_equal(raw, np.round(raw))
            seen.update(tuple(r) for r in np.concatenate([raw.astype(np.int64),
                                                          labels[:, None]], axis=1))
        # Together the splits hold every csv row exactly as often as the csv does: disjoint and
        # complete (as multisets, which also handles identical duplicate rows in the csv).
        self.assertEqual(seen, collections.Counter(tuple(r) for r in rows))

    def testSplitIndicesAreDisjoint(self):
        parts = [set(input_generator.digits_split_indices(s).tolist())
                 for s in ("train", "dev", "test")]
        self.assertEqual([len(s) for s in parts], [1397, 200, 200])
        self.assertEqual(parts[0] | parts[1] | parts[2], set(range(1797)))
        self.assertFalse(parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])

    def testLabelAndPixelRange(self):
        images, labels = self._split("train")
        self.assertEqual(set(labels.tolist()), set(range(10)))
        self.assertGreaterEqual(images.min(), 0.0)
        self.assertEqual(images.max(), 1.0)  # 16 / 16 occurs in the data.

    def testBilinearResizeMatchesNumpy(self):
        small, _ = self._split("dev")
        big, _ = self._split("dev", image_size=16)
        self.assertEqual(big.shape, (200, 16, 16, 1))
        for i in range(0, 200, 17):
            self.assertAllClose(big[i], _np_bilinear_resize(small[i].astype(np.float64), 16),
                                atol=1e-6)

    def testBatchesAreNestedMaps(self):
        batch = next(iter(_digits(batch_size=8).dataset()))
        self.assertIsInstance(batch, NestedMap)
        self.assertEqual(sorted(batch.keys()), ["image", "label"])
        self.assertEqual(batch.image.shape, (8, 16, 16, 1))
        self.assertEqual(batch.image.dtype, tf.float32)
        self.assertEqual(batch.label.shape, (8,))
        self.assertEqual(batch.label.dtype, tf.int32)

    def testBadParamsRaise(self):
        with self.assertRaisesRegex(ValueError, "batch_size"):
            _digits(batch_size=0)
        with self.assertRaisesRegex(ValueError, "split"):
            _digits(split="validation")
        with self.assertRaisesRegex(ValueError, "num_channels"):
            _digits(num_channels=2)


class DeterminismTest(_TestCase):

    def _first_batches(self, seed: int, n: int = 3) -> list[np.ndarray]:
        inp = _digits(batch_size=16, seed=seed, cutout_size=4, random_flip=True)
        it = iter(inp.dataset())
        return [next(it).image.numpy() for _ in range(n)]

    def testSameSeedSameBatches(self):
        for a, b in zip(self._first_batches(7), self._first_batches(7)):
            np.testing.assert_array_equal(a, b)

    def testDifferentSeedsDiffer(self):
        self.assertFalse(np.array_equal(self._first_batches(7, 1)[0],
                                        self._first_batches(8, 1)[0]))

    def testEpochsAreReshuffled(self):
        # 200 dev examples, batch 200: batch k is epoch k.
        inp = _digits(split="dev", batch_size=200, augment=False)
        it = iter(inp.dataset())
        first, second = next(it), next(it)
        self.assertFalse(np.array_equal(first.label.numpy(), second.label.numpy()))
        self.assertEqual(sorted(first.label.numpy()), sorted(second.label.numpy()))

    def testRestoredIteratorContinuesIdentically(self):
        inp = _digits(batch_size=16, cutout_size=4)
        it = iter(inp.dataset())
        ckpt = tf.train.Checkpoint(iterator=it)
        next(it)
        path = ckpt.write(os.path.join(self.get_temp_dir(), "it"))
        expected = [next(it).image.numpy() for _ in range(2)]
        ckpt.read(path).assert_consumed()
        for want in expected:
            np.testing.assert_array_equal(next(it).image.numpy(), want)


class AugmentationTest(_TestCase):

    def _pair(self, **aug) -> tuple[np.ndarray, np.ndarray]:
        """(augmented, plain) images of the same 64 train examples in the same order."""
        common = dict(split="train", batch_size=64, shuffle=False, seed=3)
        plain = next(iter(_digits(augment=False, **common).dataset())).image.numpy()
        augmented = next(iter(_digits(augment=True, **aug, **common).dataset())).image.numpy()
        return augmented, plain

    def testPadAndCropMatchesNumpySlicing(self):
        rng = np.random.RandomState(0)
        image = rng.rand(6, 5, 2).astype(np.float32)
        padded = np.pad(image, [(3, 3), (3, 3), (0, 0)])
        for dy, dx in [(0, 0), (1, 4), (3, 3), (6, 2), (6, 6)]:
            got = input_generator.pad_and_crop(tf.constant(image), 3, tf.constant([dy, dx]))
            np.testing.assert_array_equal(got.numpy(), padded[dy:dy + 6, dx:dx + 5])
        np.testing.assert_array_equal(
            input_generator.pad_and_crop(tf.constant(image), 3, tf.constant([3, 3])).numpy(),
            image)

    def testRandomCropIsAWindowOfThePaddedImage(self):
        augmented, plain = self._pair(crop_padding=2, random_flip=False, cutout_size=0)
        self.assertEqual(augmented.shape, (64, 16, 16, 1))
        offsets_used = set()
        for aug, img in zip(augmented, plain):
            padded = np.pad(img, [(2, 2), (2, 2), (0, 0)])
            matches = [(dy, dx) for dy in range(5) for dx in range(5)
                       if np.array_equal(aug, padded[dy:dy + 16, dx:dx + 16])]
            self.assertNotEqual(matches, [], "augmented image is no window of the padded image")
            if len(matches) == 1:
                offsets_used.add(matches[0])
        self.assertGreater(len(offsets_used), 5)  # the offset really is random

    def testRandomFlip(self):
        augmented, plain = self._pair(crop_padding=0, random_flip=True, cutout_size=0)
        flipped = 0
        for aug, img in zip(augmented, plain):
            if np.array_equal(aug, img[:, ::-1]) and not np.array_equal(img, img[:, ::-1]):
                flipped += 1
            else:
                np.testing.assert_array_equal(aug, img)
        self.assertTrue(0 < flipped < 64)

    def testCutoutZeroesOneSquare(self):
        augmented, plain = self._pair(crop_padding=0, random_flip=False, cutout_size=5)
        changed = 0
        for aug, img in zip(augmented, plain):
            diff = np.argwhere((aug != img)[..., 0])
            if len(diff) == 0:
                continue
            changed += 1
            (y0, x0), (y1, x1) = diff.min(axis=0), diff.max(axis=0)
            self.assertLessEqual(y1 - y0, 4)
            self.assertLessEqual(x1 - x0, 4)
            self.assertTrue(np.all(aug[diff[:, 0], diff[:, 1]] == 0.0))
        self.assertGreater(changed, 32)

    def testCutoutAgainstNumpy(self):
        image = np.ones((8, 9, 3), np.float32)
        for cy, cx in [(0, 0), (4, 4), (7, 8), (3, 8)]:
            want = image.copy()
            want[max(cy - 2, 0):cy + 2, max(cx - 2, 0):cx + 2] = 0.0
            got = input_generator.cutout(tf.constant(image), 4, tf.constant([cy, cx]))
            np.testing.assert_array_equal(got.numpy(), want)

    def testNoAugmentationOutsideTrain(self):
        kwargs = dict(split="dev", batch_size=32, shuffle=False, cutout_size=4, random_flip=True)
        a = next(iter(_digits(augment=True, **kwargs).dataset())).image.numpy()
        b = next(iter(_digits(augment=False, **kwargs).dataset())).image.numpy()
        np.testing.assert_array_equal(a, b)


class TfdsImageInputTest(_TestCase):

    def _write_mnist_metadata(self, data_dir: str, splits: dict[str, int]) -> None:
        """Writes real mnist metadata (features + split sizes), as a prepared dataset would have."""
        builder = tfds.builder("mnist", data_dir=data_dir)
        builder.info.set_splits(tfds.core.SplitDict([
            tfds.core.SplitInfo(name=name, shard_lengths=[n], num_bytes=0)
            for name, n in splits.items()
        ]))
        os.makedirs(builder.data_dir)
        builder.info.write_to_directory(builder.data_dir)

    def _params(self, data_dir: str, **kwargs):
        p = input_generator.TfdsImageInput.Params()
        p.Set(dataset_name="mnist", data_dir=data_dir, batch_size=4, shuffle=False,
              repeat=False, augment=False, image_size=28, num_channels=1)
        return p.Set(**kwargs)

    def testMockedMnist(self):
        data_dir = self.get_temp_dir()
        self._write_mnist_metadata(data_dir, {"train": 12, "test": 5})
        with tfds.testing.mock_data(num_examples=12, data_dir=data_dir):
            inp = self._params(data_dir).Instantiate()
            self.assertEqual(inp.num_classes(), 10)
            self.assertEqual(inp.num_examples(), 12)
            raw = list(tfds.builder("mnist", data_dir=data_dir).as_dataset(
                split="train", shuffle_files=False))
            images, labels = _one_pass(inp)
            self.assertEqual(images.shape, (12, 28, 28, 1))
            self.assertEqual(images.dtype, np.float32)
            self.assertEqual(labels.dtype, np.int32)
            want = np.stack([ex["image"].numpy() for ex in raw]).astype(np.float32) / 255.0
            self.assertAllClose(images, want, atol=1e-6)
            np.testing.assert_array_equal(labels, [int(ex["label"]) for ex in raw])
            self.assertTrue(np.all((labels >= 0) & (labels < 10)))

            # Resize + grey->RGB + augmentation keep the contract.
            inp = self._params(data_dir, image_size=12, num_channels=3, augment=True,
                               cutout_size=3).Instantiate()
            batch = next(iter(inp.dataset()))
            self.assertEqual(batch.image.shape, (4, 12, 12, 3))
            self.assertAllClose(batch.image[..., 0], batch.image[..., 2])
            self.assertTrue(np.all((batch.image.numpy() >= 0) & (batch.image.numpy() <= 1)))

            # 'dev' maps to 'validation', which mnist lacks: a clear error, then a slice works.
            with self.assertRaisesRegex(ValueError, "tfds_split"):
                self._params(data_dir, split="dev").Instantiate()
            inp = self._params(data_dir, split="dev", tfds_split={
                "train": "train[:50%]", "dev": "train[50%:]", "test": "test"}).Instantiate()
            self.assertEqual(inp.num_examples(), 6)

    def testMissingDataDirRaises(self):
        empty = os.path.join(self.get_temp_dir(), "no_tfds_here")
        with self.assertRaisesRegex(FileNotFoundError, "no_tfds_here") as ctx:
            self._params(empty).Instantiate()
        self.assertIn("mnist", str(ctx.exception))
        self.assertIn("data_dir", str(ctx.exception))

    def testUnknownDatasetRaises(self):
        with self.assertRaisesRegex(ValueError, "dataset_name"):
            self._params(self.get_temp_dir(), dataset_name="no_such_dataset_xyz").Instantiate()


class ImageFolderInputTest(_TestCase):

    # Class folder -> grey value of its images; labels must follow the sorted folder names.
    _CLASSES = {"dog": 200, "ant": 40, "cat": 120}

    def _make_folder(self, root: str) -> None:
        for split, count in [("train", 3), ("dev", 2)]:
            for name, value in self._CLASSES.items():
                folder = os.path.join(root, split, name)
                os.makedirs(folder)
                for i in range(count):
                    channels = 1 if i == 0 else 3  # grey PNGs must decode too
                    pixels = np.full((5 + i, 7 + 2 * i, channels), value, np.uint8)
                    tf.io.write_file(os.path.join(folder, f"{i}.png"), tf.io.encode_png(pixels))

    def _params(self, root, **kwargs):
        p = input_generator.ImageFolderInput.Params()
        p.Set(root_dir=root, batch_size=3, shuffle=False, repeat=False, drop_remainder=False,
              image_size=6, num_channels=3)
        return p.Set(**kwargs)

    def testLabelsShapesAndValues(self):
        root = tempfile.mkdtemp(dir=self.get_temp_dir())
        self._make_folder(root)
        names = sorted(self._CLASSES)
        for split, count, aug in [("train", 9, True), ("dev", 6, False)]:
            inp = self._params(root, split=split, augment=aug, crop_padding=0).Instantiate()
            self.assertEqual(inp.class_names(), names)
            self.assertEqual(inp.num_classes(), 3)
            self.assertEqual(inp.num_examples(), count)
            images, labels = _one_pass(inp)
            self.assertEqual(images.shape, (count, 6, 6, 3))
            self.assertEqual(labels.dtype, np.int32)
            self.assertEqual(sorted(labels.tolist()), sorted(list(range(3)) * (count // 3)))
            for image, label in zip(images, labels):
                # Constant images stay constant through resize and flips.
                self.assertAllClose(image, np.full_like(image, self._CLASSES[names[label]] / 255),
                                    atol=1e-6)

    def testMissingOrEmptyDirRaises(self):
        missing = os.path.join(self.get_temp_dir(), "no_images_here")
        with self.assertRaisesRegex(FileNotFoundError, "root_dir.*no_images_here"):
            self._params(missing).Instantiate()
        empty = tempfile.mkdtemp(dir=self.get_temp_dir())
        with self.assertRaisesRegex(FileNotFoundError, "root_dir"):
            self._params(empty).Instantiate()
        root = tempfile.mkdtemp(dir=self.get_temp_dir())
        self._make_folder(root)
        with self.assertRaisesRegex(FileNotFoundError, "'test'"):
            self._params(root, split="test").Instantiate()


if __name__ == "__main__":
    tf.test.main()
