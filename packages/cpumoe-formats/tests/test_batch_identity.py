"""A token's output never depends on which other tokens share its step.

The kernels compute several tokens of one expert at once (multi-token micro-kernels: a weight chunk is
decoded once and FMA'd into the accumulators of up to 3-8 tokens). Their contract is that every token keeps
the exact arithmetic of the single-token path, so for every format, mode and tier a batch of n tokens must
give, token by token, the SAME BITS as n steps of one token (no tolerance: the comparison is on the raw bf16
words). Ragged shapes (K tails, partial scale blocks), batch sizes that are not multiples of the token
blocks, duplicated experts within a token, -1 routes and every token on the same experts (the shared-routing
case that makes the token blocks full) are covered. Outputs are poisoned before each run (run_forced).
"""

import numpy as np
import pytest
from conftest import routes, run_forced, tier_cases

import cpumoe_formats as cf

# Per format: a ragged (E, H, I) the format accepts, exercising main loops and their tails.
SHAPES = {
    "bf16": (6, 1059, 331),  # K % 8 != 0: scalar tails; K % 32: one-vector tails
    "fp8_block": (6, 1100, 300),  # partial 128-blocks in both passes and in the scale rows
    "nvfp4": (6, 720, 368),  # 720 = 11 * 64 + 16: chunk loop plus 16-block tail
    "ds_fp4": (6, 640, 384),  # 5 and 3 128-blocks: odd chunk counts
    "q4_0": (6, 736, 416),  # 23 and 13 blocks: 8-block, 4-block, pair and single-block paths
    "mxfp4": (6, 320, 288),
    "mxfp4_panel": (6, 352, 288),  # 5.5 panels of 64 columns in the down pass
    "q4_0_x16": (6, 736, 416),  # 46 / 52 groups of 16 rows, 13 / 23 blocks
    "fp8_block_x16": (6, 1104, 304),  # 69 / 38 groups, partial 128-blocks of 80 and 48 codes
    "bf16_x16": (6, 1104, 304),  # 69 / 38 groups
    "nvfp4_x16": (6, 720, 368),  # 45 / 46 groups of 16 rows, 45 / 23 blocks (partial last chunks of 1 and 3)
    "ds_fp4_x16": (6, 640, 384),  # 40 / 48 groups of 16 rows, 12 / 20 blocks
    "mxfp4_x16": (6, 352, 288),  # 22 / 36 groups of 16 rows, 9 / 11 blocks
    "q8_0": (6, 736, 416),  # 23 and 13 blocks: 4-block steps and 3 / 1 lone blocks
    "q4_k": (6, 768, 512),  # 3 and 2 blocks of 256
    "q6_k": (6, 768, 512),
    "q5_k": (6, 768, 512),
    "q4_k_x16": (6, 768, 512),  # 48 / 64 groups of 16 rows, 3 / 2 blocks
    "q6_k_x16": (6, 768, 512),  # 48 / 64 groups of 16 rows, 3 / 2 blocks
    "q5_k_x16": (6, 768, 512),  # 48 / 64 groups of 16 rows, 3 / 2 blocks
    "q8_0_x16": (6, 736, 416),  # 46 / 52 groups of 16 rows, 23 / 13 blocks
}
PARAMS = [pytest.param(f, *p.values, id=f"{f}-{p.id}", marks=p.marks) for f in SHAPES for p in tier_cases(f)]


def _banks(fmt, rng):
    E, H, I = SHAPES[fmt]  # noqa: E741
    return cf.get_format(fmt).random_banks(E, H, I, rng), E, H


@pytest.mark.parametrize("fmt,mode,tier", PARAMS)
@pytest.mark.parametrize("routing", ["random", "shared"])
@pytest.mark.parametrize("T", [2, 9])
def test_batch_equals_single_tokens(rng, fmt, mode, tier, routing, T):
    banks, E, H = _banks(fmt, rng)
    top_k = 4
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, top_k, E)  # duplicated expert in token 0, a -1 route in the last token
    if routing == "shared":  # every token on the same experts: full token blocks in every group
        ids[:] = ids[0]
        ids[0, 2] = -1  # ...except one route of token 0, so one group is one token short
    y = run_forced(fmt, banks, x, w, ids, mode, tier).astype(np.float32)
    for t in range(T):
        y1 = run_forced(fmt, banks, x[t : t + 1], w[t : t + 1], ids[t : t + 1], mode, tier).astype(np.float32)
        np.testing.assert_array_equal(
            y[t].view(np.uint32), y1[0].view(np.uint32), err_msg=f"token {t} of {T} differs from its single-token step"
        )


@pytest.mark.parametrize("fmt,mode,tier", PARAMS)
def test_probe_cancels_exactly(rng, fmt, mode, tier):
    """The sensitive form of the same contract. bf16 outputs hide most fp32 reassociation (a 1-ulp change of a
    dot rarely moves the bf16 of y), so: experts 0 and 1 are bit-identical copies; every token routes to expert
    0 (whose group runs in token blocks), and one probe token also routes to expert 1 (alone in its group:
    the single-token path) with the opposite weight. y[probe] = w * dot_block(e0) - w * dot_single(e1) is
    exactly 0 iff the blocked and the single-token arithmetic agree to the last bit (g rows included)."""
    banks, E, H = _banks(fmt, rng)
    for a in banks.values():
        a[1] = a[0]
    T, top_k = 9, 3
    x = rng.standard_normal((T, H), dtype=np.float32)
    w = rng.random((T, top_k), dtype=np.float32) + 0.05
    for probe in (0, 4, T - 1):  # first, middle and last token block
        ids = rng.integers(2, E, (T, top_k)).astype(np.int32)
        ids[:, 0] = 0
        ids[probe] = [0, 1, -1]
        w[probe, 1] = -w[probe, 0]
        y = run_forced(fmt, banks, x, w, ids, mode, tier).astype(np.float32)
        assert (y[probe] == 0).all(), f"probe token {probe}: the token-blocked dot differs from the single-token dot"


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "q4_0", "fp8_block"])
def test_router_weight_on_input(rng, fmt):
    """apply_router_weight_on_input scales x per route in gate_up: still per token (default mode and tier)."""
    banks, E, H = _banks(fmt, rng)
    T, top_k = 6, 3
    x = rng.standard_normal((T, H), dtype=np.float32)
    w, ids = routes(rng, T, top_k, E)
    ids[1:3] = ids[0]
    kw = dict(apply_router_weight_on_input=True)
    y = cf.moe_forward(fmt, banks, x, w, ids, **kw).astype(np.float32)
    for t in range(T):
        y1 = cf.moe_forward(fmt, banks, x[t : t + 1], w[t : t + 1], ids[t : t + 1], **kw).astype(np.float32)
        np.testing.assert_array_equal(y[t].view(np.uint32), y1[0].view(np.uint32), err_msg=f"token {t}")


@pytest.mark.parametrize("fmt,mode,tier", PARAMS)
def test_down_route_split(rng, fmt, mode, tier):
    """The executor's down items start on the expert groups whose g is ready while later groups still run
    gate_up, so one item's routes may reach the kernel in several calls, split between expert groups. A down
    call over routes [0, n) must equal calls over [0, a) then [a, n) on the same acc bit for bit, for every
    group boundary a and for one call per group: a route's term is added into acc in route order whatever
    the call (sensitive: acc starts from noise far below the terms, so a reassociated add shows)."""
    E, H, I = SHAPES[fmt]  # noqa: E741
    spec = cf.get_format(fmt)
    banks = spec.random_banks(E, H, I, rng)
    views = spec.bank_views(spec.validate(banks)[0])
    k = cf.Kernel(fmt, E, H, I, mode=mode, isa=tier)
    experts = [0, 0, 0, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4, 5, 5]  # lone, small and > 16 groups
    n, T = len(experts), 20
    tokens = [int(t) for t in rng.integers(0, T, n)]
    acts = []
    for _ in range(n):  # each route's prepared activation
        src = np.ascontiguousarray(rng.standard_normal(I).astype(cf.numerics.BF16)).view(np.uint16)
        dst = cf.aligned_empty((k._k.act_bytes(I),), np.uint8)
        k._k.prep_act(src.ctypes.data, I, dst.ctypes.data)
        acts.append(dst)
    wts = (rng.random(n) + 0.1).astype(np.float32)
    rts = [(tokens[r], experts[r], float(wts[r]), acts[r].ctypes.data) for r in range(n)]
    base = (rng.standard_normal((T, H)) * 1e-6).astype(np.float32)

    def down(cuts):
        acc = base.copy()
        for a, b in zip([0, *cuts], [*cuts, n]):
            k._k.down(views, 0, H, rts[a:b], acc.ctypes.data, H)
        return acc.view(np.uint32)

    whole = down([])
    assert (whole != base.view(np.uint32)).any(axis=1)[sorted(set(tokens))].all(), "a routed token's acc unchanged"
    bounds = [r for r in range(1, n) if experts[r] != experts[r - 1]]
    for a in bounds:
        np.testing.assert_array_equal(down([a]), whole, err_msg=f"split at route {a}")
    np.testing.assert_array_equal(down(bounds), whole, err_msg="one call per expert group")
