"""torch.ops.moe_engine.experts: MoERunner.forward as a torch custom operator with a fake (meta) implementation, so
torch.compile and engines that capture graphs see one opaque node (as vLLM registers its fused-MoE op). A runner is
named by an integer handle: the op's arguments stay tensors and ints. torch.ops.moe_engine.linear (a runner's dense
linear) is the same for the linears of a compiled decode step (moe_engine.attention registers the attention's op,
its executor named by a handle of this registry)."""
from __future__ import annotations

import itertools
import weakref

import torch

_RUNNERS: dict[int, weakref.ref] = {}
_NEXT = itertools.count(1)


def register(runner) -> int:
    h = next(_NEXT)
    _RUNNERS[h] = weakref.ref(runner)
    return h


def unregister(handle) -> None:
    _RUNNERS.pop(handle, None)


def runner_of(handle: int):
    r = _RUNNERS.get(int(handle))
    r = r() if r is not None else None
    if r is None:
        raise ValueError(f"moe_engine: handle {handle} is not open (its runner or executor closed or collected)")
    return r


@torch.library.custom_op("moe_engine::experts", mutates_args=())
def experts(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, runner: int,
            layer: int) -> torch.Tensor:
    y = runner_of(runner).forward(layer, hidden_states, topk_weights, topk_ids)
    # a custom op may not return one of its inputs (or a view of it)
    return y.clone() if y.data_ptr() == hidden_states.data_ptr() else y


@experts.register_fake
def _(hidden_states, topk_weights, topk_ids, runner, layer):
    return torch.empty_like(hidden_states)


@torch.library.custom_op("moe_engine::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, runner: int) -> torch.Tensor:
    """x @ weight.T (+ bias) on the runner's CPU executor (moe_engine.dense.linear; F.linear without one)."""
    from .dense import linear as dense_linear

    y = dense_linear(runner_of(runner).executor, x, weight, bias)
    return y.clone() if y.data_ptr() == x.data_ptr() else y


@linear.register_fake
def _(x, weight, bias, runner):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))

