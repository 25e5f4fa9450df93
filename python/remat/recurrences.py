"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) as capture traces them: step by step,
through torch's decomposition, one layer at a time, with the dropout between stacked layers that
eager PyTorch draws and its final states' shape."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

# The ops of ``torch._VF`` that run a stack of recurrent layers.
_STACKS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})


@contextlib.contextmanager
def traced_step_by_step() -> Iterator[None]:
    """While tracing:

    - oneDNN is off, so that torch's decomposition traces an LSTM on CPU step by step (matmuls and
      pointwise ops), as it does on other devices, not as ``aten.mkldnn_rnn_layer``, whose
      workspace is empty when traced and undefined when run (its backward fails on real tensors).
      The decomposition reads oneDNN's flag, and nothing else traced does: convolutions choose
      their kernels when they run.
    - a stack of layers runs one layer at a time, with ``torch.dropout`` between them in training,
      as eager PyTorch draws it (the same masks from the same generator): torch's decomposition of
      a stack leaves that dropout out (torch 2.15), and returns the final states with a dimension
      too many (torch 2.11).
    """
    from torch.nn.modules import rnn

    flag, vf = torch._C._get_mkldnn_enabled(), rnn._VF
    torch._C._set_mkldnn_enabled(False)
    rnn._VF = _LayerByLayer(vf)
    try:
        yield
    finally:
        rnn._VF = vf
        torch._C._set_mkldnn_enabled(flag)


class _LayerByLayer:
    """``torch._VF`` as ``nn.RNNBase`` calls it, its stacks of layers run by :func:`_stack`."""

    def __init__(self, vf: Any) -> None:
        self._vf = vf

    def __getattr__(self, name: str) -> Any:
        op = getattr(self._vf, name)
        return functools.partial(_stack, op) if name in _STACKS else op


def _stack(op: Any, *args: Any) -> Any:
    """``op(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
    batch_first)`` one layer at a time, with dropout between layers in training, and the final
    states in eager PyTorch's shape, ``(layers * directions, batch, hidden)``: torch 2.11's
    decomposition adds a dimension of 1 after the first. A packed sequence's call (whose
    arguments differ) goes to ``op`` as it is."""
    if len(args) != 9:
        return op(*args)
    x, hx, params, has_biases, layers, p, train, bidirectional, batch_first = args
    directions = 2 if bidirectional else 1
    per_layer = len(params) // layers
    states = list(hx) if isinstance(hx, (tuple, list)) else None  # an LSTM's (h, c)
    finals = []
    for i in range(layers):
        if i > 0 and train and p > 0:
            x = torch.dropout(x, p, True)
        rows = slice(i * directions, (i + 1) * directions)
        layer_hx = [s[rows] for s in states] if states is not None else hx[rows]
        weights = params[i * per_layer : (i + 1) * per_layer]
        x, *final = op(x, layer_hx, weights, has_biases, 1, 0.0, train, bidirectional, batch_first)
        finals.append([f.reshape(directions, *f.shape[-2:]) for f in final])
    return (x, *(torch.cat(parts) for parts in zip(*finals)))
