"""Translation: generated corpus, sentencepiece input, pipelined Transformer, search and BLEU."""

__all__: list[str] = []  # Import the modules (e.g. tasks.image.classifier).
