"""The adapter at transformers' experts dispatch: the registered experts function, the per-module binding to the
shared runner, and the record of what was offloaded (`model.moe_engine`). Registration is idempotent.

Thread contract: experts_forward runs where transformers calls it (one generate() at a time per model); the runner
behind it is MoERunner (shareable)."""
from __future__ import annotations

from dataclasses import dataclass, field

NAME = "moe_engine"
FOLD_PAD = 32  # gpt-oss's gate_up bias as input column H, zeros to H + 32: keeps H a multiple of 32 (q4_0, mxfp4)


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The registered experts function: fn(experts module, hidden_states [T, H], top_k_index [T, K], top_k_weights).
    transformers' (index, weights) order becomes moe_engine's (weights, ids) here, at the boundary."""
    import torch

    b = self.__dict__.get("_moe_engine")
    if b is None:
        raise RuntimeError(f"{type(self).__name__}: experts_implementation={NAME!r} but this module's experts were not "
                           "converted; call moe_engine.integrations.transformers.offload_experts(model, ...) first")
    if b.plain and not torch.compiler.is_compiling():  # the decode path: straight to the runner
        return b.runner.forward(b.layer, hidden_states, top_k_weights, top_k_index)
    return b(hidden_states, top_k_weights, top_k_index)


def register() -> None:
    """Register NAME in transformers' ExpertsInterface and FP8ExpertsInterface (idempotent; done on import)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError(f"moe_engine's transformers integration needs transformers >= 5 with its experts dispatch "
                          f"({e}); install it with: pip install 'moe-engine-glue[transformers]'") from e

    ExpertsInterface.register(NAME, experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers without FP8 experts
        return
    FP8ExpertsInterface.register(NAME, experts_forward)


class Binding:
    """One experts module's call into the shared runner: layer index, gpt-oss's folded biases, EP sentinels."""

    def __init__(self, runner, layer: int, H: int, E: int, down_bias=None, expert_parallel: bool = False):
        self.runner, self.layer, self.H, self.E = runner, layer, H, E
        self.down_bias = down_bias  # [E, H] float32 on the activations' device when the gate_up bias is folded
        self.expert_parallel = expert_parallel
        self.plain = down_bias is None and not expert_parallel  # nothing to add around the runner's call
        self._pad = None
        if down_bias is not None:
            import torch

            pad = torch.zeros(1, FOLD_PAD, device=down_bias.device)
            pad[0, 0] = 1.0
            self._pad = pad

    def __call__(self, x, w, ids):
        import torch

        if self.expert_parallel:  # other ranks' experts are ids >= E: no route here
            ids = ids.masked_fill(ids >= self.E, -1)
        xin = x if self._pad is None else torch.cat([x, self._pad.to(x.dtype).expand(x.shape[0], -1)], dim=1)
        if torch.compiler.is_compiling():
            y = self.runner.op(self.layer, xin, w, ids)  # one opaque node for dynamo / inductor
        else:
            y = self.runner.forward(self.layer, xin, w, ids)
        if self._pad is None:
            return y
        bias = (w.float().unsqueeze(-1) * self.down_bias[ids.clamp(min=0).long()]).masked_fill(
            (ids < 0).unsqueeze(-1), 0.0).sum(1)
        return (y[:, :self.H].float() + bias).to(x.dtype)


@dataclass
class Offloaded:
    """What offload_experts did: the runner (all MoE layers), the modules it serves, where the banks came from."""

    runner: object
    format: str
    modules: list  # qualified names, runner layer i = modules[i]
    decoder_layers: list
    source: str  # "model weights" or "<layout> checkpoint <path>"
    report: dict = field(default_factory=dict)  # per decoder layer: the loader's exactness / measured rounding
    folded_bias: bool = False

    def deviation(self) -> dict:
        from ...checkpoints import max_deviation

        return max_deviation(self.report)

    tokenizer: object = None  # from_pretrained: the file's tokenizer, or None
    plan: object = None  # from_pretrained: what went where (loading.budget.Plan)
    load_seconds: float | None = None
    decode: tuple | None = None  # from_pretrained: (decode path, why), decode.py

    def close(self) -> None:
        self.runner.close()
