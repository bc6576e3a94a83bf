"""Launch configurations of the GPU experts: block sizes, warps, pipelining, and which kernels run.

A Config is chosen per batch size T (GpuExperts.config_for / set_config); the defaults below are the H200 sweep's
best in bench/gpu_experts.py (docs/results/gpu_experts_h200.json).
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


def _pair(fmts) -> tuple[str, str]:
    return (fmts, fmts) if isinstance(fmts, str) else tuple(fmts)


def check(fmts, cfg: Config) -> None:
    """cfg is valid for the format (or the (gate_up, down) pair: each stage against its matrix's format)."""
    if cfg.down_mode not in ("token", "group"):
        raise ValueError(f"Config.down_mode={cfg.down_mode!r}: expected 'token' or 'group'")
    for fmt, (name, st) in zip(_pair(fmts), (("gate_up", cfg.gate_up), ("down", cfg.down))):
        for f in ("block_n", "block_k", "block_m"):
            if not _pow2(getattr(st, f)):
                raise ValueError(f"Config.{name}.{f}={getattr(st, f)} must be a power of two")
        if fmt == "fp8_block" and st.block_k > 128:
            raise ValueError(f"fp8_block: Config.{name}.block_k={st.block_k} must divide 128 (one scale per step)")
        if fmt == "mxfp4" and st.block_k < 16:
            raise ValueError(f"mxfp4: Config.{name}.block_k={st.block_k} bytes must be a multiple of 16")
        if fmt == "nvfp4" and st.block_k < 8:
            raise ValueError(f"nvfp4: Config.{name}.block_k={st.block_k} bytes must be a multiple of 8")
        if fmt in ("q4_0", "q8_0") and st.block_k < 32:
            raise ValueError(f"{fmt}: Config.{name}.block_k={st.block_k} must be a multiple of 32 (one block)")
        if fmt in ("q4_k", "q6_k") and st.block_k != 256:
            raise ValueError(f"{fmt}: Config.{name}.block_k={st.block_k} must be 256 (one block per step)")
        if st.dot and (st.block_m < 16 or st.block_k < 16 or st.block_n < (8 if name == "gate_up" else 16)):
            raise ValueError(f"Config.{name}: dot=True needs block_m, block_k and the tile's rows >= 16")
    if cfg.down_mode == "token" and cfg.down.dot:
        raise ValueError("Config: down_mode='token' runs one token at a time (down.dot must be False)")
    if not _pow2(cfg.sum_block):
        raise ValueError(f"Config.sum_block={cfg.sum_block} must be a power of two")


def _c(gu, dn, grouped, down_mode="group"):
    return Config(gate_up=StageConfig(*gu[:4], dot=gu[4]), down=StageConfig(*dn[:4], dot=dn[4]), grouped=grouped,
                  down_mode=down_mode)


# The H200 sweep's best (bench/gpu_experts.py, Qwen3-30B-A3B's E=128 H=2048 I=768 top_k=8, every expert resident,
# random routes; docs/results/gpu_experts_h200.json): (block_n, block_k, num_warps, num_stages, dot) per stage.
# Batch 1: gate_up one program per (route, 16 gate + 16 up rows) = 384 programs (~3 per SM of 132, one wave); down
# one program per (route, 16 rows of H) = 1024 programs, then the route sum: the per-token down (no route sum,
# 128-512 programs each looping over 8 routes) measured 29-67 us against 25.7. Batch 8: routes grouped by slot,
# tensor-core tiles of 16 tokens (bf16 / fp8_block / mxfp4); nvfp4's e4m3 x e2m1 decode made the per-route FMA
# gate_up (no grouping) the fastest at batch 8 (168 against 176 us grouped with tensor cores).
MEASURED = {
    ("bf16", 1): _c((16, 128, 4, 4, True), (16, 128, 8, 2, False), grouped=False),  # 25.7 us
    ("bf16", 8): _c((16, 64, 4, 3, True), (32, 128, 4, 4, True), grouped=True),  # 124.5 us
    ("fp8_block", 1): _c((16, 128, 4, 3, True), (16, 128, 4, 2, False), grouped=False),  # 24.9 us
    ("fp8_block", 8): _c((16, 128, 4, 3, True), (32, 128, 4, 3, True), grouped=True),  # 103.5 us
    ("mxfp4", 1): _c((16, 128, 4, 2, False), (16, 128, 4, 2, False), grouped=False),  # 31.0 us
    ("mxfp4", 8): _c((32, 64, 4, 3, True), (32, 64, 4, 3, True), grouped=True),  # 146.1 us
    ("nvfp4", 1): _c((8, 256, 4, 2, False), (32, 128, 4, 2, False), grouped=False),  # 31.4 us
    ("nvfp4", 8): _c((16, 64, 4, 2, False), (32, 32, 4, 2, False), grouped=False),  # 158.6 us
    # The GGUF formats: the H100 sweep's best (docs/results/gpu_experts_gguf_h100.json; the same shape and method),
    # us against the mxfp4-shaped configs they replace. Batch 1: half-width gate_up tiles of whole 256-element
    # steps (8 gate + 8 up rows: 768 programs, ~6 per SM) for q4_0 / q8_0. Batch 8: per-route FMAs beat grouped
    # tensor-core tiles for q4_0 (the 18-byte blocks' decode, not the MACs, bound the tile), grouping without
    # tensor cores for the K-quants. A Q4_K_M pair takes q4_k's gate_up and q6_k's down: 182.7 us at batch 8
    # against the pair sweep's best 174.9 (ungrouped).
    ("q4_0", 1): _c((8, 256, 4, 2, False), (16, 128, 4, 2, False), grouped=False),  # 23.7 us (was 29.0)
    ("q4_0", 8): _c((16, 128, 4, 2, False), (32, 64, 4, 2, False), grouped=False),  # 123.4 us (was 179.4)
    ("q8_0", 1): _c((8, 256, 4, 2, False), (32, 256, 4, 2, False), grouped=False),  # 25.3 us (was 30.4)
    ("q8_0", 8): _c((32, 128, 4, 3, True), (16, 256, 4, 2, False), grouped=True),  # 138.1 us (was 154.3)
    ("q4_k", 1): _c((16, 256, 4, 2, False), (32, 256, 4, 2, False), grouped=False),  # 25.7 us (was 26.7)
    ("q4_k", 8): _c((16, 256, 4, 2, False), (32, 256, 4, 2, False), grouped=True),  # 156.3 us (was 246.4)
    ("q6_k", 1): _c((16, 256, 4, 2, False), (16, 256, 4, 2, False), grouped=False),  # 45.4 us
    ("q6_k", 8): _c((16, 256, 4, 3, True), (32, 256, 4, 3, True), grouped=True),  # 251.9 us (was 282.2)
}
# From 16 tokens on, groups hold several tokens: every format groups and uses tensor-core tiles (nvfp4: its
# measured batch-8 runner-up, 176 us with gate_up 32x64, 175 with down 32x32).
# q4_0 and q4_k: their batch-8 configs have no tensor cores; from 16 tokens on they take the mxfp4-shaped tiles
# they ran before the GGUF sweep (not swept at these batches).
_LARGE = {"nvfp4": _c((32, 64, 4, 3, True), (32, 32, 4, 3, True), grouped=True),
          "q4_0": _c((32, 64, 4, 3, True), (32, 64, 4, 3, True), grouped=True),
          "q4_k": _c((32, 256, 4, 3, True), (32, 256, 4, 3, True), grouped=True)}


def default(fmts, T: int, H: int, I: int) -> Config:  # noqa: E741
    """The measured config of batch 1 for T = 1, of batch 8 for 2 <= T < 16, and grouped tensor-core tiles from 16
    tokens on (the batch-8 config where it already is one). A (gate_up, down) pair of two formats: the gate_up
    format's config with the down format's down stage and down_mode."""
    a, b = _pair(fmts)
    if a != b:
        return default(a, T, H, I).replace(down=default(b, T, H, I).down, down_mode=default(b, T, H, I).down_mode)
    fmt = a
    if T <= 1:
        return MEASURED[(fmt, 1)]
    if T < 16 or MEASURED[(fmt, 8)].grouped and MEASURED[(fmt, 8)].gate_up.dot:
        return MEASURED[(fmt, 8)]
    return _LARGE[fmt]
