"""Image-classification inputs: bundled digits, prepared tfds datasets, and image folders.

All generators yield `NestedMap(image=float32 [B, H, W, C] in [0, 1], label=int32 [B])` with
H = W = `p.image_size`. They share one preprocessing path (`BaseImageInput._preprocess`):

    to float32 in [0, 1] -> match p.num_channels -> bilinear resize to image_size
    -> (train split only, if p.augment) random pad-and-crop, optional flip, optional cutout

The augmentations use stateless random ops seeded per example by `BaseInputGenerator`, so a run is
reproducible and a restored iterator continues with the same augmentations. None of these inputs
ever downloads anything.
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.tasks import base_input_generator

__all__ = [
    "BaseImageInput",
    "cutout",
    "digits_split_indices",
    "DigitsInput",
    "ImageFolderInput",
    "pad_and_crop",
    "TfdsImageInput",
]

_SPLITS = ("train", "dev", "test")


def pad_and_crop(image: tf.Tensor, padding: int, offset: tf.Tensor) -> tf.Tensor:
    """Zero-pads `image` [H, W, C] by `padding` pixels per side, then crops H x W at `offset`.

    `offset` is an int32 [2] tensor (row, column) into the padded image, each in
    [0, 2 * padding]; offset (padding, padding) returns the original image.
    """
    height, width, channels = image.shape
    padded = tf.pad(image, [[padding, padding], [padding, padding], [0, 0]])
    return tf.slice(padded, [offset[0], offset[1], 0], [height, width, channels])


def cutout(image: tf.Tensor, size: int, center: tf.Tensor) -> tf.Tensor:
    """Zeroes the size x size square of `image` [H, W, C] centred at `center` (clipped at edges).

    The square covers rows [cy - size // 2, cy - size // 2 + size) and likewise for columns
    (DeVries & Taylor, 2017, "Improved Regularization of CNNs with Cutout").
    """
    height, width, _ = image.shape
    top = center[0] - size // 2
    left = center[1] - size // 2
    rows = tf.range(height)
    cols = tf.range(width)
    in_rows = (rows >= top) & (rows < top + size)
    in_cols = (cols >= left) & (cols < left + size)
    keep = tf.logical_not(in_rows[:, None] & in_cols[None, :])
    return image * tf.cast(keep, image.dtype)[:, :, None]


class BaseImageInput(base_input_generator.BaseInputGenerator):
    """Shared params and preprocessing of the image-classification inputs."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        """Returns the default params (batching, image size, augmentation)."""
        p = super().Params()
        p.Define("split", "train", "Which split to read: 'train', 'dev' or 'test'.")
        p.Define("image_size", 32, "Images are resized (bilinear) to image_size x image_size.")
        p.Define("num_channels", 3, "Output channels: 1 (grey) or 3 (RGB); converted as needed.")
        p.Define(
            "augment", True,
            "Apply the random augmentations below; they are only ever applied to split 'train'.",
        )
        p.Define(
            "crop_padding", 4,
            "Random pad-and-crop: zero-pad by this many pixels per side, then crop back to "
            "image_size at a random offset. 0 disables it.",
        )
        p.Define("random_flip", True, "Randomly flip images left-right (train augmentation).")
        p.Define("cutout_size", 0, "Side of the random square zeroed by cutout; 0 disables it.")
        return p

    def _validate(self) -> None:
        super()._validate()
        p = self.params
        name = type(self).__name__
        if p.split not in _SPLITS:
            raise ValueError(f"{name}: split must be one of {_SPLITS}, got {p.split!r}.")
        if not isinstance(p.image_size, int) or p.image_size < 1:
            raise ValueError(f"{name}: image_size must be an int >= 1, got {p.image_size!r}.")
        if p.num_channels not in (1, 3):
            raise ValueError(f"{name}: num_channels must be 1 or 3, got {p.num_channels!r}.")
        if not isinstance(p.crop_padding, int) or p.crop_padding < 0:
            raise ValueError(f"{name}: crop_padding must be an int >= 0, got {p.crop_padding!r}.")
        if not isinstance(p.cutout_size, int) or p.cutout_size < 0:
            raise ValueError(f"{name}: cutout_size must be an int >= 0, got {p.cutout_size!r}.")
        for flag in ("augment", "random_flip"):
            if not isinstance(p.Get(flag), bool):
                raise ValueError(f"{name}: {flag} must be True or False, got {p.Get(flag)!r}.")

    def num_classes(self) -> int:
        """Number of label classes; labels are in [0, num_classes)."""
        raise NotImplementedError(f"{type(self).__name__} must implement num_classes().")

    def _match_channels(self, image: tf.Tensor) -> tf.Tensor:
        """Converts grey <-> RGB (and drops an alpha channel) to get p.num_channels channels."""
        want = self.params.num_channels
        have = image.shape[-1]
        if have == 4:  # RGBA: drop alpha.
            image, have = image[..., :3], 3
        if have == want:
            return image
        if have == 1 and want == 3:
            return tf.image.grayscale_to_rgb(image)
        if have == 3 and want == 1:
            return tf.image.rgb_to_grayscale(image)
        raise ValueError(
            f"{type(self).__name__}: cannot convert images with {have} channels to "
            f"num_channels={want}."
        )

    def _augment(self, image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
        p = self.params
        crop_seed, flip_seed, cutout_seed = tf.unstack(
            tf.random.experimental.stateless_split(seed, num=3)
        )
        if p.crop_padding > 0:
            offset = tf.random.stateless_uniform(
                [2], crop_seed, minval=0, maxval=2 * p.crop_padding + 1, dtype=tf.int32
            )
            image = pad_and_crop(image, p.crop_padding, offset)
        if p.random_flip:
            image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        if p.cutout_size > 0:
            center = tf.random.stateless_uniform(
                [2], cutout_seed, minval=0, maxval=p.image_size, dtype=tf.int32
            )
            image = cutout(image, p.cutout_size, center)
        return image

    def _preprocess(self, example: NestedMap, seed: tf.Tensor) -> NestedMap:
        p = self.params
        image = example.image
        if image.dtype.is_integer:
            image = tf.image.convert_image_dtype(image, tf.float32)  # uint8 / 255
        else:
            image = tf.cast(image, tf.float32)
        image = self._match_channels(image)
        if image.shape[0] != p.image_size or image.shape[1] != p.image_size:
            image = tf.image.resize(image, [p.image_size, p.image_size], method="bilinear")
        image = tf.ensure_shape(image, [p.image_size, p.image_size, p.num_channels])
        if p.augment and p.split == "train":
            image = self._augment(image, seed)
        return NestedMap(image=image, label=tf.cast(example.label, tf.int32))


# ---- bundled digits ------------------------------------------------------------------------------

_DIGITS_PATH = os.path.join(os.path.dirname(__file__), "data", "digits.csv.gz")
_DIGITS_SPLIT_SEED = 20240521  # Fixed: the train/dev/test membership must never change.
_DIGITS_SPLIT_SIZES = {"train": 1397, "dev": 200, "test": 200}


@functools.lru_cache(maxsize=1)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Returns (pixels uint8 [1797, 8, 8] in 0..16, labels int32 [1797]) from the bundled file."""
    table = np.loadtxt(_DIGITS_PATH, delimiter=",", dtype=np.int64)
    pixels = table[:, :64].reshape(-1, 8, 8).astype(np.uint8)
    return pixels, table[:, 64].astype(np.int32)


def digits_split_indices(split: str) -> np.ndarray:
    """Row indices (into the bundled csv) of `split`; the three splits partition all 1,797 rows."""
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}.")
    num_rows = sum(_DIGITS_SPLIT_SIZES.values())
    # RandomState (not default_rng): its stream is frozen across numpy versions.
    order = np.random.RandomState(_DIGITS_SPLIT_SEED).permutation(num_rows)
    start = 0
    for name in _SPLITS:
        end = start + _DIGITS_SPLIT_SIZES[name]
        if name == split:
            return order[start:end]
        start = end
    raise AssertionError("unreachable")


class DigitsInput(BaseImageInput):
    """The 1,797 real 8x8 handwritten digits bundled with the package (no download needed).

    Source: UCI "Optical Recognition of Handwritten Digits" test set (CC BY 4.0); see
    tasks/image/data/README.md. Split deterministically into 1,397 train / 200 dev / 200 test.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        """Defaults for 8x8 grey digits upsampled to 16x16; no flips (they change digits)."""
        p = super().Params()
        p.name = "digits"
        p.image_size = 16
        p.num_channels = 1
        p.crop_padding = 2
        p.random_flip = False
        return p

    def num_classes(self) -> int:
        return 10

    def num_examples(self) -> int:
        return _DIGITS_SPLIT_SIZES[self.params.split]

    def _build_examples(self) -> tf.data.Dataset:
        pixels, labels = _load_digits()
        rows = digits_split_indices(self.params.split)
        images = pixels[rows][..., None].astype(np.float32) / 16.0  # raw values are 0..16
        return tf.data.Dataset.from_tensor_slices({"image": images, "label": labels[rows]})


# ---- prepared tfds datasets ----------------------------------------------------------------------


class TfdsImageInput(BaseImageInput):
    """Any tfds image-classification dataset already prepared under a local `data_dir`.

    Never downloads: if the data is missing it raises FileNotFoundError explaining how to prepare
    it on a machine with internet access.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        """Adds the tfds dataset name, its local data_dir and the split mapping."""
        p = super().Params()
        p.Define("dataset_name", None, "tfds dataset name, e.g. 'cifar10' or 'mnist:3.0.1'.")
        p.Define(
            "data_dir", None,
            "Local tfds data directory holding the prepared dataset (None: tfds' default, "
            "~/tensorflow_datasets).",
        )
        p.Define(
            "tfds_split", {"train": "train", "dev": "validation", "test": "test"},
            "Maps split ('train'/'dev'/'test') to a tfds split string; slices are allowed, "
            "e.g. {'train': 'train[:90%]', 'dev': 'train[90%:]', 'test': 'test'}.",
        )
        p.Define("image_key", "image", "Feature holding the image.")
        p.Define("label_key", "label", "Feature holding the class label (a tfds ClassLabel).")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        self._builder = self._make_builder()
        self._split_info = self._lookup_split()
        label_feature = self._builder.info.features[p.label_key]
        if not isinstance(label_feature, tfds.features.ClassLabel):
            raise ValueError(
                f"TfdsImageInput: feature label_key={p.label_key!r} of {p.dataset_name!r} is "
                f"{type(label_feature).__name__}, not a ClassLabel; set label_key."
            )
        self._num_classes = label_feature.num_classes

    def _validate(self) -> None:
        super()._validate()
        p = self.params
        if not p.dataset_name or not isinstance(p.dataset_name, str):
            raise ValueError(
                f"TfdsImageInput: set dataset_name to a tfds dataset name, got {p.dataset_name!r}."
            )
        if not isinstance(p.tfds_split, dict) or p.split not in p.tfds_split:
            raise ValueError(
                f"TfdsImageInput: tfds_split must be a dict with an entry for split "
                f"{p.split!r}, got {p.tfds_split!r}."
            )

    def _make_builder(self) -> tfds.core.DatasetBuilder:
        p = self.params
        try:
            builder = tfds.builder(p.dataset_name, data_dir=p.data_dir)
        except tfds.core.registered.DatasetNotFoundError:
            raise ValueError(
                f"TfdsImageInput: dataset_name {p.dataset_name!r} is not a known tfds dataset; "
                "see https://www.tensorflow.org/datasets/catalog for names."
            ) from None
        if not builder.is_prepared():
            data_dir = p.data_dir or "~/tensorflow_datasets"
            raise FileNotFoundError(
                f"TfdsImageInput: dataset_name={p.dataset_name!r} is not prepared in "
                f"data_dir={data_dir!r} (looked in {builder.data_dir}). This input never "
                "downloads. On a machine with internet access run\n"
                f"  tfds build {p.dataset_name} --data_dir=<dir>\n"
                "(or tfds.builder(name, data_dir=<dir>).download_and_prepare()), copy <dir> "
                "here and set data_dir to it."
            )
        return builder

    def _lookup_split(self) -> tfds.core.SplitInfo:
        p = self.params
        split = p.tfds_split[p.split]
        try:
            return self._builder.info.splits[split]
        except (KeyError, ValueError) as e:
            available = sorted(self._builder.info.splits.keys())
            raise ValueError(
                f"TfdsImageInput: tfds_split[{p.split!r}]={split!r} is not a valid split of "
                f"{p.dataset_name!r} (available: {available}); set tfds_split, e.g. "
                f"{{'dev': 'train[90%:]'}} to carve a dev set from train. ({e})"
            ) from None

    def num_classes(self) -> int:
        return self._num_classes

    def num_examples(self) -> int:
        return self._split_info.num_examples

    def _build_examples(self) -> tf.data.Dataset:
        p = self.params
        ds = self._builder.as_dataset(split=p.tfds_split[p.split], shuffle_files=False)
        return ds.map(lambda ex: {"image": ex[p.image_key], "label": ex[p.label_key]})


# ---- a folder of the user's own images -----------------------------------------------------------


class ImageFolderInput(BaseImageInput):
    """The user's own images laid out as `root_dir/<split>/<label>/*.png|jpg|jpeg`.

    Labels are the sorted class-folder names (over all splits) mapped to 0, 1, ...; see
    `class_names()`. Built on `tfds.ImageFolder`, which decodes images to 3 channels.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        """Adds the image root directory and the split -> sub-folder mapping."""
        p = super().Params()
        p.Define("root_dir", None, "Folder containing <split>/<label>/<image> files.")
        p.Define(
            "folder_split", {"train": "train", "dev": "dev", "test": "test"},
            "Maps split ('train'/'dev'/'test') to its sub-folder of root_dir.",
        )
        p.Define(
            "skip_bad_files", False,
            "Skip image files that cannot be read or decoded (one warning line per file and a "
            "count) instead of stopping with an error naming the first one. Checking costs one "
            "read and decode of every image of the split when the dataset is built.",
        )
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        if not p.root_dir or not os.path.isdir(p.root_dir):
            raise FileNotFoundError(
                f"ImageFolderInput: root_dir={p.root_dir!r} is not a directory; set root_dir to "
                "a folder laid out as <root_dir>/<split>/<label>/<image>.png|jpg."
            )
        self._builder = tfds.ImageFolder(p.root_dir)
        folder = p.folder_split[p.split]
        splits = self._builder.info.splits
        if folder not in splits or splits[folder].num_examples == 0:
            raise FileNotFoundError(
                f"ImageFolderInput: no images for split {p.split!r} under "
                f"root_dir={p.root_dir!r} (expected {os.path.join(p.root_dir, folder)}"
                f"/<label>/<image>.png|jpg|jpeg; found splits {sorted(splits.keys())}). "
                "Add images or set folder_split."
            )
        self._num_examples = splits[folder].num_examples

    def _validate(self) -> None:
        super()._validate()
        p = self.params
        if not isinstance(p.folder_split, dict) or p.split not in p.folder_split:
            raise ValueError(
                f"ImageFolderInput: folder_split must be a dict with an entry for split "
                f"{p.split!r}, got {p.folder_split!r}."
            )
        if not isinstance(p.skip_bad_files, bool):
            raise ValueError(
                f"ImageFolderInput: skip_bad_files must be True or False, got "
                f"{p.skip_bad_files!r}."
            )

    def class_names(self) -> list[str]:
        """Class-folder names; label i is class_names()[i]."""
        return list(self._builder.info.features["label"].names)

    def num_classes(self) -> int:
        return self._builder.info.features["label"].num_classes

    def num_examples(self) -> int:
        return self._num_examples

    def _files(self) -> list[tuple[str, str]]:
        """(image path, class name) of every file of this split, in tfds' order."""
        # tfds.ImageFolder's own file list (what its as_dataset reads); it has no public accessor.
        examples = self._builder._split_examples[self.params.folder_split[self.params.split]]
        return [(e.image_path, e.label) for e in examples]

    def _file_problem(self, path: str) -> str | None:
        """Why `path` cannot be read or decoded as tfds decodes it, or None."""
        try:
            data = tf.io.read_file(path)
            self._builder.info.features["image"].decode_example(data)
        except tf.errors.OpError as e:
            text = " ".join(re.sub(r"\{\{[^}]*\}\}", "", str(e.message)).split())
            return f"{type(e).__name__}: {text[:120]}"
        return None

    def _bad_files(self) -> list[tuple[str, str]]:
        """(path, problem) of every file of this split that cannot be read or decoded."""
        bad = []
        for path, _ in self._files():
            problem = self._file_problem(path)
            if problem is not None:
                bad.append((path, problem))
        return bad

    def explain_data_error(self, error: Exception) -> str | None:
        """Names the first unreadable or corrupt image of the split (see the base class)."""
        del error
        bad = self._bad_files()
        if not bad:
            return None
        path, problem = bad[0]
        more = f" (and {len(bad) - 1} more bad files in the split)" if len(bad) > 1 else ""
        return (f"ImageFolderInput {self.params.name!r}: {path} is not a readable image "
                f"({problem}){more}. Fix or remove it, or skip bad files with "
                "--input_params_override='skip_bad_files : True'.")

    def _build_examples(self) -> tf.data.Dataset:
        p = self.params
        if not p.skip_bad_files:
            ds = self._builder.as_dataset(split=p.folder_split[p.split], shuffle_files=False)
            return ds.map(lambda ex: {"image": ex["image"], "label": ex["label"]})
        files = self._files()
        bad = dict(self._bad_files())
        for i, (path, problem) in enumerate(bad.items(), 1):
            logging.warning("ImageFolderInput %r: skipping bad file %d of %d: %s (%s)",
                            p.name, i, len(bad), path, problem)
        good = [(path, label) for path, label in files if path not in bad]
        if bad:
            logging.warning("ImageFolderInput %r: skipped %d of %d files of split %r "
                            "(skip_bad_files=True).", p.name, len(bad), len(files), p.split)
        if not good:
            raise FileNotFoundError(
                f"ImageFolderInput: every image of split {p.split!r} under root_dir="
                f"{p.root_dir!r} is unreadable ({len(files)} tried); fix the files.")
        self._num_examples = len(good)
        labels = self._builder.info.features["label"]
        paths = tf.constant([path for path, _ in good])
        label_ids = tf.constant([labels.str2int(label) for _, label in good], tf.int64)
        image_feature = self._builder.info.features["image"]
        ds = tf.data.Dataset.from_tensor_slices((paths, label_ids))
        return ds.map(lambda path, label: {
            "image": image_feature.decode_example(tf.io.read_file(path)), "label": label})
