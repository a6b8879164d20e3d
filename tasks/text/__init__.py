"""Language modelling on text generated inside the project (no download)."""

__all__: list[str] = []  # Import the modules (e.g. tasks.text.char_lm_input).
