"""Byte moves: a CPU layout whose repack only moves its source format's bytes (q4_0_x16, fp8_block_x16, ...) is a
permutation of one expert's bytes. It is found once per (layout, H, I) by repacking one expert whose bytes are their
own indices (four byte planes of a uint32 index), and checked on random banks; a layout whose repack computes
anything (mxfp4_x16 rebuilds mxfp4's scales) has none.

Applying it is one gather per bank over whole words (np.take): on a Qwen3-30B-A3B layer, 1.2-1.9 GB/s a thread
against 0.3-0.5 GB/s for the layouts' numpy regrouping (2-core VM), which made the full-size Q4_0 file's load spend
~0.9 s a layer repacking. The GPU side (moe_engine's gpu/moved.py) applies the inverse on the device, so a host
holds the experts once, in the CPU's layout.

Threads: byte_moves is cached and pure; Moves is immutable; apply() reads its banks and returns new arrays."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import numpy as np

from .._arrays import aligned_empty


def _bytes(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).reshape(-1)


@dataclass(frozen=True)
class Moves:
    """One expert's bytes of `source`'s banks (concatenated in schema order, each at its schema width) moved into
    `layout`'s banks: layout bank `name`'s bytes are source bytes forward[name].

    Threads: safe to share; immutable after byte_moves builds it (plan is computed once, under cached_property's
    lock), and apply() only reads its banks and returns new arrays."""

    layout: str
    source: str
    src: tuple  # ((bank name, per-expert shape, dtype), ...) in the source's schema order
    dst: tuple  # the same for the layout's banks
    forward: dict  # layout bank name -> uint32 [its bytes per expert]: the source byte each comes from

    @staticmethod
    def word(index: np.ndarray, total: int) -> int:
        """The largest word (4, 2 or 1 bytes) the byte gather `index` (into `total` bytes) moves whole: runs of that
        many consecutive bytes, each starting at a multiple of it."""
        for u in (4, 2):
            if total % u or len(index) % u:
                continue
            runs = index.reshape(-1, u)
            if (runs[:, 0] % u == 0).all() and (runs == runs[:, :1] + np.arange(u)).all():
                return u
        return 1

    def _src_offsets(self) -> dict:
        out, off = {}, 0
        for n, shape, dt in self.src:
            nbytes = int(np.prod(shape)) * dt.itemsize
            out[n] = (off, nbytes)
            off += nbytes
        return out

    @functools.cached_property
    def plan(self) -> tuple:
        """Per layout bank: (name, shape, dtype, source bank or None (several: the concatenation), word, index in
        words into that source)."""
        offs, out = self._src_offsets(), []
        for n, shape, dt in self.dst:
            f = self.forward[n]
            one = next((s for s, (o, nb) in offs.items() if f.size and o <= f.min() and f.max() < o + nb), None)
            f = f.astype(np.int64)
            idx, span = (f - offs[one][0], offs[one][1]) if one is not None else (f, sum(nb for _, nb in offs.values()))
            u = Moves.word(idx, span)
            # int32: a cached plan of Qwen3-30B-A3B's q6_k_x16 is 15 MB, not 31 (np.take widens it per call)
            out.append((n, shape, dt, one, u, (idx[::u] // u).astype(np.int32)))
        return tuple(out)

    def inverse(self) -> dict:
        """source bank name -> int64 [its bytes per expert]: the byte of the layout's banks (concatenated in schema
        order) each comes from (unpack's gather)."""
        fwd = np.concatenate([self.forward[n] for n, _, _ in self.dst]).astype(np.int64)
        inv = np.empty(fwd.size, np.int64)
        inv[fwd] = np.arange(fwd.size)
        return {n: inv[o:o + nb] for n, (o, nb) in self._src_offsets().items()}

    def apply(self, banks, threads: int = 1, only=None) -> dict:
        """Source banks [E, ...] (validated; a padded last dim is cut to the schema's width) -> new layout banks,
        64-byte aligned, each gathered straight into its final array in `threads` expert slices at once (np.take
        releases the GIL); only: the layout banks to build (one role's), each from source banks present in `banks`.
        Threads: any."""
        flat = {}
        for n, shape, _ in self.src:
            if n not in banks:
                continue
            a = np.asarray(banks[n])
            if a.shape[-1] != shape[-1]:
                a = a[..., :shape[-1]]
            flat[n] = np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], -1)
        E = next(iter(flat.values())).shape[0]
        n_cuts = max(1, min(int(threads or 1), E))
        cut = [E * i // n_cuts for i in range(n_cuts + 1)]
        out, jobs, joined = {}, [], None
        for n, shape, dt, one, u, idx in self.plan:
            if only is not None and n not in only:
                continue
            if one is None and joined is None:  # a bank drawn from several source banks: their bytes side by side
                joined = np.concatenate([flat[k] for k, _, _ in self.src], axis=1)
            src = flat[one] if one is not None else joined
            dst = aligned_empty((E, *shape), dt)
            w = np.dtype(f"u{u}")
            sv, dv = src.view(w), dst.view(np.uint8).reshape(E, -1).view(w)
            jobs += [(sv[a:b], idx, dv[a:b]) for a, b in zip(cut, cut[1:]) if b > a]
            out[n] = dst

        def run(job):  # mode="clip": the indices are in range by construction, and "raise" buffers `out`
            np.take(job[0], job[1], axis=1, out=job[2], mode="clip")

        if n_cuts == 1:
            for job in jobs:
                run(job)
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(n_cuts, thread_name_prefix="cpumoe-moves") as ex:
                list(ex.map(run, jobs))
        return out


@functools.cache
def byte_moves(layout: str, H: int, I: int) -> Moves | None:  # noqa: E741
    """The byte permutation that CPU layout `layout`'s repack is at (H, I), or None where it is not one (or the
    layout does not take these dims)."""
    from . import get_format

    spec = get_format(layout)
    sspec = getattr(spec, "source", None)  # a CpuLayout's source format (mxfp4_panel names none: it pads anyway)
    if sspec is None:
        return None
    src_name = sspec.name
    repack = getattr(sys.modules[type(spec).__module__], "repack", None)
    if repack is None:
        return None
    try:
        spec.check_dims(H, I)
        src = tuple((b.name, b.expected(1, H, I)[1:], np.dtype(b.dtypes[0])) for b in sspec.banks)
        total = sum(int(np.prod(s)) * d.itemsize for _, s, d in src)
        idx = np.arange(total, dtype=np.uint32)
        planes = []
        for p in range(4):
            by = ((idx >> np.uint32(8 * p)) & np.uint32(0xFF)).astype(np.uint8)
            banks, off = {}, 0
            for n, s, d in src:
                nbytes = int(np.prod(s)) * d.itemsize
                banks[n] = by[off:off + nbytes].view(d).reshape((1, *s))
                off += nbytes
            planes.append(repack(banks))
        dst = tuple((b.name, planes[0][b.name].shape[1:], planes[0][b.name].dtype) for b in spec.banks)
        fwd = {n: sum(_bytes(planes[p][n]).astype(np.int64) << (8 * p) for p in range(4)).astype(np.uint32)
               for n, _, _ in dst}
        allb = np.concatenate(list(fwd.values()))
        if allb.size != total or not np.array_equal(np.sort(allb), np.arange(total)):
            return None  # not a permutation of the source's bytes
        moves = Moves(layout, src_name, src, dst, fwd)
        rb = sspec.random_banks(2, H, I, np.random.default_rng(0))
        rb = {n: np.ascontiguousarray(np.asarray(rb[n])[..., :s[-1]]) for n, s, _ in src}
        want, got = repack(rb), moves.apply(rb)
        if not all(np.array_equal(_bytes(want[n]), _bytes(got[n])) for n, _, _ in dst):
            return None
        return moves
    except (ValueError, TypeError):
        return None
