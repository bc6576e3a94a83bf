"""ggml's K-quant scale searches (ggml-quants.c make_qkx2_quants for Q4_K, make_qx_quants with rmse_type 1 for
Q6_K), vectorised in numpy over independent sub-blocks: every fp32 operation of the C code in its order (each sum
runs element by element, each product and quotient rounded once, no fused multiply-adds: the C code compiled with
-ffp-contract=off), so the codes and scales are the C reference's bit for bit. A build that contracts (GCC's default
-ffp-contract=fast with -mfma) may pick another candidate scale for a few sub-blocks.

Arrays are [N, n] float32 sub-blocks; results are per sub-block.
"""
from __future__ import annotations

import numpy as np

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (fval + 1.5 * 2^23, read back): round half to even for |v| < 2^22, as int32."""
    return np.rint(np.asarray(v, F32)).astype(np.int32)


def _seq_sum(terms) -> np.ndarray:
    """sum_i terms(i) in fp32, element by element from i = 0 (the C loops' order)."""
    acc = None
    for t in terms:
        acc = t if acc is None else (acc + t).astype(F32)
    return acc


def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, weights [N, n] float32 -> (scale [N], the_min [N] (= -min >= 0), L [N, n] uint8 in [0, nmax]).

    Per sub-block: min = min(x, 0), max = max(x) (max == min: codes 0, scale 0); the codes of iscale = nmax /
    (max - min), then nstep + 1 candidates iscale = (rmin + rdelta * is + nmax) / (max - min) whose least-squares
    (scale, min) (min clamped to <= 0) replace the best so far where their weighted squared error is smaller
    (use_mad false). As in the C code, a candidate's codes and iscale use the best min so far."""
    x = np.asarray(x, F32)
    w = np.asarray(weights, F32)
    n = x.shape[1]
    mn, mx = x[:, 0].copy(), x[:, 0].copy()
    for i in range(1, n):
        mn = np.minimum(mn, x[:, i])
        mx = np.maximum(mx, x[:, i])
    sum_w = _seq_sum(w[:, i] for i in range(n))
    sum_x = _seq_sum((w[:, i] * x[:, i]).astype(F32) for i in range(n))
    mn = np.where(mn > 0, F32(0), mn).astype(F32)
    flat = mx == mn
    live = ~flat

    def span(m):  # max - min, 1 where the sub-block is flat (never used there)
        return np.where(flat, F32(1), (mx - m).astype(F32)).astype(F32)

    def codes(isc, m):
        with np.errstate(over="ignore", invalid="ignore"):
            v = (isc[:, None] * (x - m[:, None]).astype(F32)).astype(F32)
        return np.clip(nearest_int(np.where(np.isfinite(v), v, F32(0))), 0, nmax).astype(F32)

    def error(sc, m, lf):
        def term(i):
            d = (((sc * lf[:, i]).astype(F32) + m).astype(F32) - x[:, i]).astype(F32)
            return (w[:, i] * (d * d).astype(F32)).astype(F32)
        return _seq_sum(term(i) for i in range(n))

    iscale = (F32(nmax) / span(mn)).astype(F32)
    scale = (F32(1) / iscale).astype(F32)
    L = codes(iscale, mn)
    best = error(scale, mn, L)
    for step in range(nstep + 1):
        num = ((F32(rmin) + (F32(rdelta) * F32(step)).astype(F32)).astype(F32) + F32(nmax)).astype(F32)
        with np.errstate(divide="ignore"):
            La = codes((num / span(mn)).astype(F32), mn)
        sum_l = _seq_sum((w[:, i] * La[:, i]).astype(F32) for i in range(n))
        sum_l2 = _seq_sum(((w[:, i] * La[:, i]).astype(F32) * La[:, i]).astype(F32) for i in range(n))
        sum_xl = _seq_sum(((w[:, i] * La[:, i]).astype(F32) * x[:, i]).astype(F32) for i in range(n))
        D = ((sum_w * sum_l2).astype(F32) - (sum_l * sum_l).astype(F32)).astype(F32)
        ok = (D > 0) & live
        Ds = np.where(ok, D, F32(1)).astype(F32)
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = (((sum_w * sum_xl).astype(F32) - (sum_x * sum_l).astype(F32)).astype(F32) / Ds).astype(F32)
            this_min = (((sum_l2 * sum_x).astype(F32) - (sum_l * sum_xl).astype(F32)).astype(F32) / Ds).astype(F32)
            pos = this_min > 0
            this_scale = np.where(pos, (sum_xl / np.where(ok, sum_l2, F32(1))).astype(F32), this_scale).astype(F32)
        this_min = np.where(pos, F32(0), this_min).astype(F32)
        with np.errstate(over="ignore", invalid="ignore"):
            cur = error(this_scale, this_min, La)
        better = ok & (cur < best)
        L = np.where(better[:, None], La, L)
        best = np.where(better, cur, best).astype(F32)
        scale = np.where(better, this_scale, scale).astype(F32)
        mn = np.where(better, this_min, mn).astype(F32)
    scale = np.where(flat, F32(0), scale).astype(F32)
    L = np.where(flat[:, None], F32(0), L)
    return scale, (-mn).astype(F32), L.astype(np.uint8)


def make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, NULL), x [N, n] float32 -> (scale [N], L [N, n] int8 in
    [0, 2 nmax - 1], the code l + nmax). Weights x^2; the first iscale -nmax / max (max = the element of largest
    |x|, the first on ties, sign kept), then -(nmax + 0.1 is) / max for is in -9..9 (0 skipped), a candidate taken
    where sumlx^2 > best * suml2; amax < 1e-15: codes 0, scale 0."""
    x = np.asarray(x, F32)
    N, n = x.shape
    ax = np.abs(x)
    amax = ax[:, 0].copy()
    mx = x[:, 0].copy()
    for i in range(1, n):
        bigger = ax[:, i] > amax
        amax = np.where(bigger, ax[:, i], amax)
        mx = np.where(bigger, x[:, i], mx)
    zero = amax < GROUP_MAX_EPS
    mxs = np.where(zero, F32(1), mx).astype(F32)
    wt = (x * x).astype(F32)

    def codes(isc):
        return np.clip(nearest_int((isc[:, None] * x).astype(F32)), -nmax, nmax - 1)

    def sums(lc):
        lf = lc.astype(F32)
        sumlx = _seq_sum((((wt[:, i] * x[:, i]).astype(F32)) * lf[:, i]).astype(F32) for i in range(n))
        suml2 = _seq_sum((((wt[:, i] * lf[:, i]).astype(F32)) * lf[:, i]).astype(F32) for i in range(n))
        return sumlx, suml2

    iscale = (F32(-nmax) / mxs).astype(F32)
    L = codes(iscale)
    sumlx, suml2 = sums(L)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, (sumlx / suml2).astype(F32), F32(0)).astype(F32)
    best = (scale * sumlx).astype(F32)
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        isc = (-(F32(nmax) + (F32(0.1) * F32(is_)).astype(F32)).astype(F32) / mxs).astype(F32)
        lc = codes(isc)
        slx, sl2 = sums(lc)
        take = (sl2 > 0) & ((slx * slx).astype(F32) > (best * sl2).astype(F32))
        L = np.where(take[:, None], lc, L)
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = (slx / np.where(take, sl2, F32(1))).astype(F32)
        scale = np.where(take, sc, scale).astype(F32)
        best = np.where(take, (sc * slx).astype(F32), best).astype(F32)
    L = np.where(zero[:, None], -nmax, L)  # the code l + nmax below is then 0, as the C's L[i] = 0
    scale = np.where(zero, F32(0), scale).astype(F32)
    return scale, (L + nmax).astype(np.int8)
