"""A model's dense bf16 linears (attention projections, routers, the LM head) on the CPU executor's threads:
cpumoe_formats' dense bf16 linear (C ABI 1.9) through `CpuMoeExecutor.linear`, for the few tokens of a decode step;
more tokens (a prompt) go to torch's own F.linear on the same weight.

At batch 1 a linear is one read of its weight: on the 2-core Zen 4 VM the kernel reads a 4096x2048 bf16 weight at
~35 GB/s (the read ceiling) where oneDNN's packed inner product read 25 and aten::mm 19 (docs/end-to-end.md).

    y = linear(executor, x, weight, bias)       # x [..., K] bf16 on the CPU -> [..., M]
    m = DenseLinear(nn_linear, executor)        # an nn.Linear whose decode products run there
    torch.ops.moe_engine.linear(x, weight, bias, runner.handle)   # the same as a torch custom op (torch.compile)

Numerics: fp32 accumulation of exact bf16 products, bias added in fp32, one rounding to bf16: torch's bf16 linear
within its own accumulation order (tests/test_dense.py); NaN and inf propagate as there. The avx512bf16 tier reads
subnormal bf16 values as zero (vdpbf16ps), as oneDNN's bf16 kernels do.
Thread contract: pure functions of their inputs; any number of threads may call them (each call takes the
executor's step lock, so calls from several threads run one after another)."""
from __future__ import annotations

import torch

# Tokens a call runs through the executor's kernel; more go to F.linear (oneDNN's GEMM is compute-bound there,
# the kernel's row dots are not). Zen 4 VM, 2 threads, 4096x2048: see docs/end-to-end.md.
MAX_TOKENS = 8


def linear(executor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_tokens: int = MAX_TOKENS) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [..., K]: on the executor's threads where x is a contiguous CPU bf16 tensor of at
    most max_tokens rows and weight (and bias) CPU bf16 with contiguous rows, no gradient wanted; torch's F.linear
    otherwise (which raises on shapes it refuses)."""
    K = x.shape[-1]
    if (executor is None or x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or not x.is_cpu
            or not 0 < x.numel() <= max_tokens * K or weight.dim() != 2 or weight.shape[1] != K
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.nn.functional.linear(x, weight, bias)
    return executor.linear(x, weight, bias)


class DenseLinear(torch.nn.Linear):
    """An nn.Linear (bf16, on the CPU) whose products of up to MAX_TOKENS tokens run on a CpuMoeExecutor's threads
    (`linear`), the rest through F.linear. It keeps the original's weight and bias Parameters (no copy: state_dict,
    tied weights and prompts see the same tensors). Under torch.compile it is the op torch.ops.moe_engine.linear
    (one opaque node) when built with a runner handle. Inference only: with gradients wanted it is F.linear."""

    def __init__(self, lin: torch.nn.Linear, executor, handle: int | None = None, max_tokens: int = MAX_TOKENS):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias  # the same Parameters
        self._executor, self._handle, self.max_tokens = executor, handle, max_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque node with a runner handle, else torch's own product
            if self._handle is None:
                return torch.nn.functional.linear(x, self.weight, self.bias)
            return torch.ops.moe_engine.linear(x, self.weight, self.bias, self._handle)
        return linear(self._executor, x, self.weight, self.bias, self.max_tokens)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, up to {self.max_tokens} tokens on the executor's threads"


class DenseWeight(torch.nn.Parameter):
    """A weight Parameter whose F.linear(x, weight[, bias]) runs `linear` on an executor: for modules that call
    F.linear on a weight of their own instead of holding an nn.Linear (transformers' MoE routers:
    Qwen3MoeTopKRouter and its kin, 128x2048 at Qwen3-30B-A3B's shape, where aten::mm took ~100 us a call on the
    Zen 4 VM against ~15 us here). Every other op sees a plain tensor: torch-function handling is off for it and
    its results are plain tensors (state_dict, .to(), pickling: a Parameter's). Inference only, like DenseLinear:
    F.linear with gradients wanted runs torch's own."""

    def __new__(cls, data: torch.Tensor, executor, max_tokens: int = MAX_TOKENS):
        plain = data.detach()
        self = torch.Tensor._make_subclass(cls, plain, False)
        self._dense = (executor, plain, max_tokens)  # plain: the same storage, a plain tensor for the kernel
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():
            # torch's own product inside the graph: dynamo traces neither the executor's binding nor the disabled
            # torch-function impl (the router is ~3% of a decode token)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear and len(args) >= 2 and type(args[1]) is cls:
            kw = kwargs or {}
            bias = args[2] if len(args) > 2 else kw.get("bias")
            ex, plain, n = args[1]._dense
            if type(args[0]) is torch.Tensor and (bias is None or type(bias) in (torch.Tensor, torch.nn.Parameter)):
                return linear(ex, args[0], plain, bias, n)
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = DenseWeight(self._dense[1].clone(), self._dense[0], self._dense[2])
        return memo[id(self)]

    def __repr__(self) -> str:
        return f"DenseWeight({tuple(self.shape)}, {self.dtype}: F.linear on the executor's threads)"
