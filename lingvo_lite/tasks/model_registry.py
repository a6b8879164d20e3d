"""Model registry: model params classes registered under dotted names.

A model is a `SingleTaskModelParams` subclass (input params per split and the task params);
decorating it with `@model_registry.register` registers it as `<module>.<ClassName>`. The
library does not know where models live: the program that runs them declares the packages that
hold them (`trainer.py` declares the repository's `model_params` package), so that
`--model=image.AmoebaNetDigits` finds `AmoebaNetDigits` in `model_params/image.py` and
`--mode=list_models` lists every module of those packages.

>>> from lingvo_lite.tasks import base_input_generator, base_task, model_registry
>>> @model_registry.register
... class Tiny(model_registry.SingleTaskModelParams):
...     '''A one-line summary shown by --mode=list_models.'''
...     def Train(self):
...         return base_input_generator.BaseInputGenerator.Params().Set(batch_size=8)
...     def Task(self):
...         return base_task.BaseTask.Params().Set(name="tiny")
>>> name = f"{Tiny.__module__.rsplit('.', 1)[-1]}.Tiny"   # '<module>.Tiny'
>>> model_registry.get_class(name) is Tiny
True
>>> model_registry.get_params(name).Model().input.batch_size   # Task() with Train() attached
8
>>> model_registry.list_models()[name]
'A one-line summary shown by --mode=list_models.'
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil

from lingvo_lite.core import hyperparams

__all__ = [
    "SingleTaskModelParams",
    "SplitInputModelParams",
    "add_model_package",
    "get_class",
    "get_params",
    "import_model_packages",
    "list_models",
    "model_packages",
    "register",
]

_REGISTRY: dict[str, type] = {}
_MODEL_PACKAGES: list[str] = []


class SingleTaskModelParams:
    """Base of registered model params: input params per split and the task params."""

    def Train(self) -> hyperparams.Params:
        """Training input generator params."""
        raise NotImplementedError(f"{type(self).__name__}.Train")

    def Dev(self) -> hyperparams.Params:
        """Development (validation) input params."""
        raise NotImplementedError(f"{type(self).__name__} has no Dev split.")

    def Test(self) -> hyperparams.Params:
        """Test input params."""
        raise NotImplementedError(f"{type(self).__name__} has no Test split.")

    def Task(self) -> hyperparams.InstantiableParams:
        """The task (model) params."""
        raise NotImplementedError(f"{type(self).__name__}.Task")

    def Model(self) -> hyperparams.InstantiableParams:
        """Task params with the training input attached."""
        p = self.Task()
        p.input = self.Train()
        return p

    def Input(self, split: str) -> hyperparams.Params:
        """Input params of `split` ('train', 'dev' or 'test')."""
        methods = {"train": self.Train, "dev": self.Dev, "test": self.Test}
        if split not in methods:
            raise ValueError(f"Unknown split {split!r}; use one of {sorted(methods)}.")
        return methods[split]()


class SplitInputModelParams(SingleTaskModelParams):
    """Model params whose splits' inputs are one recipe applied to the split's name.

    Write `split_input(split)` once instead of Train, Dev and Test; `SPLITS` lists the splits
    the model has (asking for another one raises as `SingleTaskModelParams` does).

    >>> from lingvo_lite.tasks import base_input_generator
    >>> class Digits(SplitInputModelParams):
    ...     SPLITS = ("train", "dev")
    ...     def split_input(self, split):
    ...         p = base_input_generator.BaseInputGenerator.Params().Set(name=split)
    ...         return p if split == "train" else p.Set(batch_size=40)
    >>> Digits().Dev().batch_size, Digits().Input("train").name
    (40, 'train')
    >>> Digits().Test()
    Traceback (most recent call last):
    ...
    NotImplementedError: Digits has no Test split.
    """

    SPLITS: tuple[str, ...] = ("train", "dev", "test")

    def split_input(self, split: str) -> hyperparams.Params:
        """Input params of `split`, one of `SPLITS`."""
        raise NotImplementedError(f"{type(self).__name__}.split_input")

    def Train(self) -> hyperparams.Params:
        """`split_input('train')`."""
        return self.split_input("train") if "train" in self.SPLITS else super().Train()

    def Dev(self) -> hyperparams.Params:
        """`split_input('dev')`."""
        return self.split_input("dev") if "dev" in self.SPLITS else super().Dev()

    def Test(self) -> hyperparams.Params:
        """`split_input('test')`."""
        return self.split_input("test") if "test" in self.SPLITS else super().Test()


def add_model_package(package: str) -> None:
    """Declares `package` (a dotted module name) as holding registered models.

    Its modules are imported when a name is looked up or the models are listed, and a model
    in `package.sub.module` is registered as `sub.module.<Class>`.
    """
    if package not in _MODEL_PACKAGES:
        _MODEL_PACKAGES.append(package)


def model_packages() -> tuple[str, ...]:
    """The packages declared with `add_model_package`, in the order they were declared."""
    return tuple(_MODEL_PACKAGES)


def _registered_name(cls: type) -> str:
    module = cls.__module__
    for package in _MODEL_PACKAGES:
        if module.startswith(package + "."):
            return f"{module[len(package) + 1:]}.{cls.__name__}"
    return f"{module.rsplit('.', 1)[-1]}.{cls.__name__}"


def register(cls: type) -> type:
    """Class decorator: registers a SingleTaskModelParams subclass under '<module>.<Class>'."""
    if not (isinstance(cls, type) and issubclass(cls, SingleTaskModelParams)):
        raise TypeError(f"{cls!r} must subclass model_registry.SingleTaskModelParams.")
    name = _registered_name(cls)
    existing = _REGISTRY.get(name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"Model name {name!r} is already registered by {existing!r}.")
    _REGISTRY[name] = cls
    return cls


def import_model_packages() -> None:
    """Imports every module of the declared model packages so that their models register."""
    for package_name in _MODEL_PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package_name}.{info.name}")


def list_models() -> dict[str, str]:
    """Registered names -> the first line of the class docstring."""
    import_model_packages()
    return {
        name: (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        for name, cls in sorted(_REGISTRY.items())
    }


def get_class(name: str) -> type:
    """The params class registered as `name`; KeyError with suggestions if unknown."""
    if name not in _REGISTRY:
        import_model_packages()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3, cutoff=0.5)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise KeyError(
            f"Unknown model {name!r}.{hint} Run `python trainer.py --mode=list_models` to see "
            "all registered models."
        )
    return _REGISTRY[name]


def get_params(name: str) -> SingleTaskModelParams:
    """An instance of the registered model params class `name`."""
    return get_class(name)()
