"""The registered models: each module's `@model_registry.register` classes, found by
`trainer.py --model=<module>.<Class>` (trainer.py declares this package to the registry)."""

__all__: list[str] = []
