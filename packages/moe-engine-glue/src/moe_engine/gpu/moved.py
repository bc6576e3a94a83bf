"""Host banks in a CPU layout (q4_0_x16, fp8_block_x16, ...) loaded into the GPU layout of the format they move.

A CPU layout is its source format's bytes, moved (16 rows interleaved per block or K pair): `unpack` gives the source
banks back. Where that is a pure byte permutation, the GPU can load an expert from the layout's banks: copy its bytes
to the device as they are, then gather them into the source's order there (one `index_select` per matrix). So a
hybrid runner keeps ONE copy of the experts on the host, in the executor's layout, and the GPU's loads (residency
changes, hot's moves, a prompt's staged layer) read it. The Qwen3-30B FP8 checkpoint held 54 GiB of experts on the
host as two copies (the file's layout for the GPU, fp8_block_x16 for the CPU); one copy is 27 GiB.

The permutation is cpumoe_formats.byte_moves' (the layout's repack run on one expert whose bytes are their own
indices, checked on random banks), inverted: a layout whose repack computes anything (mxfp4_x16 rebuilds mxfp4's
scales) is not a move, `source()` says None, and it keeps two copies.

Threads: the functions are pure (cached); a MovedRole is used by its GpuExperts' one caller at a time."""
from __future__ import annotations

import functools

import numpy as np
import torch

from .layouts import MATRIX_FORMATS, SAME_BITS

ROLES = ("gate_up", "down")


def role_banks(spec, role: str) -> list:
    """The BankSpecs of one matrix ("gate_up" or "down") of a format: the banks named after it."""
    return [b for b in spec.banks if b.name == role or b.name.startswith(role + "_")]


@functools.cache
def _perm(layout: str, H: int, I: int):  # noqa: E741
    """(source bank name -> int64 index into one expert's layout bytes (its banks concatenated in schema order),
    the layout's banks [(name, bytes per expert, last dim)], the source format's name) at (H, I), or None where the
    layout's repack is not a byte permutation (cpumoe_formats.byte_moves)."""
    import cpumoe_formats as cf

    m = cf.byte_moves(layout, int(H), int(I))
    if m is None:
        return None
    return m.inverse(), [(n, int(np.prod(s)) * dt.itemsize, s[-1]) for n, s, dt in m.dst], m.source


def source(layout: str, H: int, I: int) -> str | None:  # noqa: E741
    """The GPU format whose bytes `layout` moves at (H, I), so a GpuExperts of that format loads from banks in
    `layout`; `layout` itself where it is a GPU format; None where neither (mxfp4_x16: not a byte move)."""
    if layout in MATRIX_FORMATS:
        return layout
    got = _perm(layout, H, I)
    return got[2] if got is not None and got[2] in MATRIX_FORMATS else None


class MovedRole:
    """One matrix ("gate_up" or "down") of banks in `layout`, fetched to `device` in the source format's banks: the
    layout's bytes of the experts copied as they are, then gathered into the source's order on the device."""

    def __init__(self, layout: str, role: str, H: int, I: int, device):  # noqa: E741
        import cpumoe_formats as cf

        got = _perm(layout, int(H), int(I))
        if got is None:
            raise ValueError(f"format {layout!r} is not another format's bytes moved; the GPU cannot load from it")
        perm, sizes, src_name = got
        spec, src = cf.get_format(layout), cf.get_format(src_name)
        mine = [b.name for b in role_banks(spec, role)]
        offs, off = {}, 0
        for n, nbytes, last in sizes:
            offs[n] = (off, nbytes, last)
            off += nbytes
        # this role's layout banks, in order, and where their bytes sit in one expert's concatenation of them
        self.host = [(n, offs[n][1], offs[n][2]) for n in mine]
        base, rebase = 0, np.empty(off, np.int64)
        rebase.fill(-1)
        for n in mine:
            o, nbytes, _ = offs[n]
            rebase[o:o + nbytes] = np.arange(base, base + nbytes)
            base += nbytes
        self.out = []  # (source bank name, per-expert shape, itemsize)
        index = []
        for b in role_banks(src, role):
            i = rebase[perm[b.name]]
            if (i < 0).any():
                raise ValueError(f"{layout!r}: the {role} bank {b.name!r} of {src.name!r} draws on bytes of the other "
                                 "matrix; expected each matrix moved on its own")
            shape = b.expected(1, H, I)[1:]
            self.out.append((b.name, shape, np.dtype(b.dtypes[0])))
            index.append(i)
        index = np.concatenate(index)
        self.unit = cf.Moves.word(index, base)
        # gathered in units of self.unit bytes: the layouts move 2- or 4-byte runs (fp8_block_x16 a K pair, q4_0_x16
        # an fp16 d and 4-byte lanes), so the gather reads whole words, not bytes
        self.index = torch.from_numpy((index[::self.unit] // self.unit).astype(np.int32)).to(device)
        self.layout, self.role, self.device = layout, role, torch.device(device)

    def fetch(self, banks: dict, e, non_blocking: bool = False) -> dict:
        """Experts e (an int or a slice) of this role's layout banks -> {source bank name: device tensor [n, *shape]
        of an integer type of the bank's width} (n = 1 for an int); layouts.to_device views them as it views host
        banks."""
        parts = []
        for name, _, last in self.host:
            a = np.asarray(banks[name])
            a = a[e:e + 1] if not isinstance(e, slice) else a[e]
            if a.shape[-1] != last:  # a bank padded past its schema width (fp8_block's scales): the schema's columns
                a = a[..., :last]
            h = torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], -1))
            parts.append(h.to(self.device, non_blocking=non_blocking))
        raw = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        src = raw.view(SAME_BITS[self.unit]).index_select(1, self.index).view(torch.uint8)
        out, off = {}, 0
        for name, shape, dt in self.out:
            nbytes = int(np.prod(shape)) * dt.itemsize
            t = src[:, off:off + nbytes].contiguous().view(SAME_BITS[dt.itemsize])
            out[name] = t.reshape((src.shape[0],) + tuple(shape))
            off += nbytes
        return out


@functools.cache
def _host_role(layout: str, role: str, H: int, I: int) -> MovedRole:  # noqa: E741
    return MovedRole(layout, role, H, I, "cpu")


def source_banks(pair, banks: dict, H: int, I: int) -> dict:  # noqa: E741
    """One layer's banks, each matrix in a CPU layout of pair (gate_up, down), -> the same experts in the source
    formats' banks (numpy; new arrays where moved): what the GPU runs, for the float64 reference of its routes."""
    import cpumoe_formats as cf

    out = {}
    for role, lay in zip(ROLES, pair):
        if source(lay, H, I) == lay:
            out.update({b.name: banks[b.name] for b in role_banks(cf.get_format(lay), role)})
            continue
        m = _host_role(lay, role, int(H), int(I))
        got = m.fetch(banks, slice(None))
        out.update({name: got[name].numpy().view(dt) for name, _, dt in m.out})
    return out
