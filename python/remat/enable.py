"""``remat.enable``: remat in place, for loops that need the model itself.

``remat.Remat(model, ...)`` is a new module around the model. Frameworks that save, unwrap or
inspect the model by its type see the wrapper instead: transformers' Trainer saves a
``PreTrainedModel`` with ``save_pretrained`` (config and tied weights) and anything else as a bare
state dict, and accelerate unwraps only its own containers. ``enable`` keeps the model what it is
(its class, parameters, state dict, ``save_pretrained``) and routes its ``forward`` through a
``Remat`` held beside it, as ``gradient_checkpointing_enable()`` does for checkpointing; the
loop, its optimizer and its saving stay as they are.
"""

from __future__ import annotations

import inspect
from typing import Any, SupportsIndex

from torch import nn

from .errors import ArgumentError
from .module import Remat

_KEY = "_remat"  # in the model's ``__dict__``: not a submodule, so not in its state dict


class _Original(nn.Module):
    """The model with the forward it had before ``enable``: what remat captures and runs. It
    trains where the model does (``model.train()``, ``model.eval()``). Its class, made per model
    class, takes that class's name (logs and progress bars name the model's class); pickle and
    ``copy.deepcopy`` make it again from the model."""

    def __init__(self, model: nn.Module, replaced: Any) -> None:
        super().__init__()
        self.model = model
        self.replaced = replaced  # the model's instance forward before ``enable``, if any
        self.forward = type(model).forward.__get__(model) if replaced is None else replaced

    @property
    def training(self) -> bool:  # type: ignore[override]
        return self.model.training

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # the model's own flag counts

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple:
        return _original, (self.model, self.replaced)


def _original(model: nn.Module, replaced: Any) -> _Original:
    named = type(type(model).__name__, (_Original,), {})
    return named(model, replaced)


class _Forward:
    """The forward ``enable`` gives the model: its ``Remat``, with the signature and docstring of
    the forward it replaces (Trainer keeps the data's columns that the forward names)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.__doc__ = model.forward.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.__dict__[_KEY](*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature | None:
        try:
            return inspect.signature(self.model.__dict__[_KEY].model.forward)
        except (TypeError, ValueError):
            return None


def enable(model: nn.Module, budget: int | float | None, sample: Any = None, **options: Any) -> nn.Module:
    """Train ``model`` under ``budget`` in place and return it: its ``forward`` runs through a
    ``remat.Remat`` (``options`` are ``Remat``'s keyword arguments), everything else is the
    model's own. ``sample``: the inputs of one call, planned for now (the longest batch, whose
    sizes bound the plan); without it the first training call plans, at its sizes. Eval mode and
    ``torch.no_grad()`` run the model's own forward. ``torch.save`` and ``copy.deepcopy`` of the
    model keep it enabled, with its budget and settings; the copy plans at its first training
    call. ``remat.enabled(model)`` returns the ``Remat`` (for ``set_budget``, ``plan_for``);
    ``remat.disable(model)`` undoes this."""
    if _KEY in model.__dict__:
        raise ArgumentError("remat is enabled on this model already; call remat.disable(model) first")
    replaced = model.__dict__.get("forward")  # an instance forward before, if any
    rm = Remat(_original(model, replaced), sample, budget, **options)
    model.__dict__[_KEY] = rm
    model.forward = _Forward(model)
    return model


def enabled(model: nn.Module) -> Remat | None:
    """The ``Remat`` that ``enable`` put on ``model``, or ``None``."""
    return model.__dict__.get(_KEY)


def disable(model: nn.Module) -> nn.Module:
    """Undo ``enable``: the model's forward is its own again; returns the model."""
    if _KEY not in model.__dict__:
        return model
    replaced = model.__dict__.pop(_KEY).model.replaced
    if replaced is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = replaced
    return model
