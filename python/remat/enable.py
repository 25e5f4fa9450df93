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
import types
from typing import Any

from torch import nn

from .errors import ArgumentError
from .module import Remat

_KEY = "_remat"  # in the model's ``__dict__``: not a submodule, so not in its state dict


class _Original(nn.Module):
    """The model with the forward it had before ``enable``: what remat captures and runs. It
    trains where the model does (``model.train()``, ``model.eval()``)."""

    def __init__(self, model: nn.Module, forward: Any) -> None:
        super().__init__()
        self.model = model
        self.forward = forward

    @property
    def training(self) -> bool:  # type: ignore[override]
        return self.model.training

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # the model's own flag counts


def enable(model: nn.Module, budget: int | float | None, sample: Any = None, **options: Any) -> nn.Module:
    """Train ``model`` under ``budget`` in place and return it: its ``forward`` runs through a
    ``remat.Remat`` (``options`` are ``Remat``'s keyword arguments), everything else is the
    model's own. ``sample``: the inputs of one call, planned for now (the longest batch, whose
    sizes bound the plan); without it the first training call plans, at its sizes. Eval mode and
    ``torch.no_grad()`` run the model's own forward. ``remat.enabled(model)`` returns the
    ``Remat`` (for ``set_budget``, ``plan_for``); ``remat.disable(model)`` undoes this."""
    if _KEY in model.__dict__:
        raise ArgumentError("remat is enabled on this model already; call remat.disable(model) first")
    original = model.forward
    named = type(type(model).__name__, (_Original,), {})  # logs and progress name the model's class
    rm = Remat(named(model, original), sample, budget, **options)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__[_KEY](*args, **kwargs)

    forward.__doc__ = original.__doc__
    try:  # the model's parameters, so that frameworks that read them (Trainer's columns) see them
        signature = inspect.signature(original)
        this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        forward.__signature__ = signature.replace(parameters=[this, *signature.parameters.values()])
    except (TypeError, ValueError):
        pass
    model.__dict__[_KEY] = rm
    model.__dict__["_remat_replaced"] = model.__dict__.get("forward")  # an instance forward before, if any
    model.forward = types.MethodType(forward, model)
    return model


def enabled(model: nn.Module) -> Remat | None:
    """The ``Remat`` that ``enable`` put on ``model``, or ``None``."""
    return model.__dict__.get(_KEY)


def disable(model: nn.Module) -> nn.Module:
    """Undo ``enable``: the model's forward is its own again; returns the model."""
    if _KEY not in model.__dict__:
        return model
    del model.__dict__[_KEY]
    replaced = model.__dict__.pop("_remat_replaced")
    if replaced is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = replaced
    return model
