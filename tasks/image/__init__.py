"""Image classification: input pipelines (digits, tfds, image folders) and models."""

__all__: list[str] = []  # Import the modules (e.g. tasks.image.classifier).
