"""Activation names, parameters and their float64 reference math.

| id | names | math (gate, up) |
|----|-------|-----------------|
| 0 | silu, swish | silu(gate) * up |
| 1 | gelu | 0.5 gate (1 + erf(gate / sqrt 2)) * up |
| 2 | gelu_tanh, gelu_pytorch_tanh | tanh-approximated gelu(gate) * up |
| 3 | swigluoai, gpt_oss_swiglu | g = min(gate, lim); u = clamp(up, +-lim); g sigmoid(alpha g) (u + 1) |
| 4 | swiglu_clamp | as 3 without the +1 (DeepSeek-V4: alpha = 1, lim = 10) |

`limit` applies only to ids 3 and 4 (None = no clamp); giving it to another
activation is an error rather than a silently ignored argument.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ACTIVATIONS = {
    "silu": 0, "swish": 0, "gelu": 1, "gelu_tanh": 2, "gelu_pytorch_tanh": 2,
    "swigluoai": 3, "gpt_oss_swiglu": 3, "swiglu_clamp": 4,
}
CANONICAL = ("silu", "gelu", "gelu_tanh", "swigluoai", "swiglu_clamp")
PARAMETRIZED = 3  # ids from here on take alpha and limit
_erf = np.vectorize(math.erf, otypes=[np.float64])


@dataclass(frozen=True)
class Activation:
    name: str
    id: int
    alpha: float
    limit: float  # +inf = no clamp

    @property
    def parametrized(self) -> bool:
        """alpha and limit apply (swigluoai, swiglu_clamp)."""
        return self.id >= PARAMETRIZED

    def kwargs(self) -> dict:
        """activation=, alpha=, limit= that resolve() (and every API taking an activation) maps back to this one:
        alpha and limit only where they apply, limit None for no clamp."""
        if not self.parametrized:
            return {"activation": self.name}
        return {"activation": self.name, "alpha": self.alpha,
                "limit": self.limit if math.isfinite(self.limit) else None}

    def __call__(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """float64 reference of the epilogue."""
        gate = np.asarray(gate, np.float64)
        up = np.asarray(up, np.float64)
        if self.id == 0:
            return gate / (1.0 + np.exp(-gate)) * up
        if self.id == 1:
            return 0.5 * gate * (1.0 + _erf(gate / math.sqrt(2.0))) * up
        if self.id == 2:
            c = math.sqrt(2.0 / math.pi)
            return 0.5 * gate * (1.0 + np.tanh(c * (gate + 0.044715 * gate**3))) * up
        g = np.minimum(gate, self.limit)
        u = np.clip(up, -self.limit, self.limit)
        s = g / (1.0 + np.exp(-self.alpha * g))
        return s * (u + 1.0) if self.id == 3 else s * u


def resolve(activation: str, alpha: float | None = None, limit: float | None = None) -> Activation:
    """Validate an activation name and its parameters."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; expected one of {sorted(ACTIVATIONS)}")
    aid = ACTIVATIONS[activation]
    name = CANONICAL[aid]
    if aid < PARAMETRIZED:
        if limit is not None:
            raise ValueError(f"limit={limit!r} only applies to swigluoai/swiglu_clamp, not activation={activation!r}")
        return Activation(name, aid, 1.0, math.inf)
    a = 1.702 if alpha is None else float(alpha)
    if not math.isfinite(a):
        raise ValueError(f"alpha={alpha!r} must be finite")
    lim = math.inf if limit is None else float(limit)
    if not lim > 0:
        raise ValueError(f"limit={limit!r} must be > 0 (or None for no clamp)")
    return Activation(name, aid, a, lim)
