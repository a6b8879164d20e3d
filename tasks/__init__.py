"""Tasks: model and input definitions built on lingvo_lite (image classification, translation)."""

__all__: list[str] = []  # Import the modules (e.g. tasks.image.classifier).
