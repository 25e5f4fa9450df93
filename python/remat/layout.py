"""Parameter gradients in the layout autograd keeps.

``AccumulateGrad`` steals a gradient as the parameter's ``.grad`` only when its strides match the
parameter's (dimensions of size 1 aside); otherwise it copies it into the parameter's layout
(a convolution's weight gradient can come out channels-last). Capture copies a gradient whose
traced strides differ in the graph (``capture._grads_in_param_layout``); one that still differs
when it runs, the executor copies inside the backward phase, so the original dies at once, and
profiling counts the copy as a temporary of the node that makes the gradient.
"""

from __future__ import annotations

import torch


def obeys_layout(grad: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``AccumulateGrad`` keeps ``grad`` as it is for a dense parameter of ``stride``."""
    if tuple(grad.shape) != tuple(shape):
        return False
    for size, have, want in zip(grad.shape, grad.stride(), stride):
        if size != 1 and have != want:
            return False
        if size == 1 and have == 0:
            return False
    return True


def in_layout(grad: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """``grad`` itself when it obeys the layout, else a copy in the parameter's strides."""
    if obeys_layout(grad, shape, stride):
        return grad
    return torch.empty_strided(shape, stride, dtype=grad.dtype, device=grad.device).copy_(grad)
