"""Launch configurations of the GPU experts: block sizes, warps, pipelining, and which kernels run.

A Config is chosen per batch size T (GpuExperts.config_for / set_config); the defaults below come from the H200
sweep in bench/gpu_experts.py (docs/results/gpu_experts_h200.json) where one was run, else from the arithmetic in
the comments.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StageConfig:
    """One matrix's kernel: block_n output rows per program (gate_up: block_n gate rows and the same up rows),
    block_k K elements per step (bytes per row for mxfp4 / nvfp4), dot=True: token tiles of block_m through
    tl.dot, else one token at a time with fp32 FMAs."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    dot: bool = False
    block_m: int = 16


@dataclass(frozen=True)
class Config:
    """grouped: routes grouped by slot (one routing kernel; each expert read once per step); down: 'token' (one
    program per (token, row block) sums the token's routes itself: no workspace, no route-sum kernel) or 'group'
    (per-route rows into an fp32 [T*top_k, H] workspace, then route_sum)."""

    gate_up: StageConfig
    down: StageConfig
    grouped: bool
    down_mode: str = "group"
    sum_block: int = 512

    def replace(self, **kw) -> Config:
        return replace(self, **kw)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check(fmt: str, cfg: Config) -> None:
    if cfg.down_mode not in ("token", "group"):
        raise ValueError(f"Config.down_mode={cfg.down_mode!r}: expected 'token' or 'group'")
    for name, st in (("gate_up", cfg.gate_up), ("down", cfg.down)):
        for f in ("block_n", "block_k", "block_m"):
            if not _pow2(getattr(st, f)):
                raise ValueError(f"Config.{name}.{f}={getattr(st, f)} must be a power of two")
        if fmt == "fp8_block" and st.block_k > 128:
            raise ValueError(f"fp8_block: Config.{name}.block_k={st.block_k} must divide 128 (one scale per step)")
        if fmt == "mxfp4" and st.block_k < 16:
            raise ValueError(f"mxfp4: Config.{name}.block_k={st.block_k} bytes must be a multiple of 16")
        if fmt == "nvfp4" and st.block_k < 8:
            raise ValueError(f"nvfp4: Config.{name}.block_k={st.block_k} bytes must be a multiple of 8")
        if st.dot and (st.block_m < 16 or st.block_k < 16 or st.block_n < (8 if name == "gate_up" else 16)):
            raise ValueError(f"Config.{name}: dot=True needs block_m, block_k and the tile's rows >= 16")
    if cfg.down_mode == "token" and cfg.down.dot:
        raise ValueError("Config: down_mode='token' runs one token at a time (down.dot must be False)")
    if not _pow2(cfg.sum_block):
        raise ValueError(f"Config.sum_block={cfg.sum_block} must be a power of two")


# K per step of the FMA kernels: 512 bytes of each weight row (bf16: 256 elements), so that one program has 16 KB
# of gate_up tile in flight (the FMA loops are not software-pipelined: a tile's loads are what is in flight);
# fp8_block is capped at one 128-column scale block; the fp4 formats' decode is the bottleneck, not the loads.
_BK = {"bf16": 256, "fp8_block": 128, "mxfp4": 64, "nvfp4": 64}
_BK_DOT = {"bf16": 128, "fp8_block": 128, "mxfp4": 64, "nvfp4": 64}


def default(fmt: str, T: int, H: int, I: int) -> Config:  # noqa: E741
    """Batch 1: gate_up one program per (route, 16 rows of gate and of up): 8 x 48 = 384 programs for
    Qwen3-30B-A3B's I = 768 (~3 per SM of 132, one wave); down one program per (route, 16 rows of H): 1024
    programs of 24 KB, then the route sum (a program per (token, row block) summing the token's routes itself
    would be 128-256 programs each looping over 8 routes: too little in flight). Larger batches group routes by
    slot (each expert's weights read once per step); tensor cores from 16 tokens on, when groups hold several
    tokens."""
    if T >= 16:
        bk = _BK_DOT[fmt]
        return Config(gate_up=StageConfig(16, bk, 4, 3, dot=True), down=StageConfig(32, bk, 4, 3, dot=True),
                      grouped=True, down_mode="group")
    bk = _BK[fmt]
    return Config(gate_up=StageConfig(16, bk, 4, 2), down=StageConfig(16, bk, 4, 2), grouped=T > 1,
                  down_mode="group")
