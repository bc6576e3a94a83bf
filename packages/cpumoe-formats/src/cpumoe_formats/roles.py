"""One role of a format: its gate_up banks or its down banks, validated, dequantized and repacked alone.

A model may run a (gate_up format, down format) pair per layer (GGUF Q4_K_M: Q4_K gate/up, Q6_K down in some layers):
such a layer's mapping holds the gate_up format's gate_up banks and the down format's down banks under their schema
names. Every bank belongs to one role, read off its schema name (``BankSpec.role``: "gate_up..." or "down..."), so
the registry's schemas are the one place that says which bank is which.

What needs the whole layer (a format's dequantize, its CPU-layout repack, numa's I-slice cut) runs on the role's banks
beside zero banks of the other role (``RoleMethods._with_zeros``), and keeps the role's part of the result: the math of
one role never reads the other's banks (each kernel's gate_up reads gate_up banks only, its down down banks only).
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from ._arrays import aligned_empty, as_array, describe

ROLES = ("gate_up", "down")
_PROBE = 1 << 14  # a value of H and I every block size of the registry (16 .. 256) divides
_CHUNK = 8  # experts per call where a role runs through a whole-layer function beside zero banks


def check_role(role) -> str:
    if role not in ROLES:
        raise ValueError(f"role={role!r}: expected one of {list(ROLES)}")
    return role


def bank_role(name: str) -> str:
    """The role of a bank, by its schema name ("gate_up", "gate_up_scale" -> gate_up; "down_bias" -> down)."""
    for role in ROLES:
        if name == role or name.startswith(role + "_"):
            return role
    raise ValueError(f"bank name {name!r} names no role: a bank's name starts with 'gate_up' or 'down'")


class RoleMethods:
    """FormatSpec's per-role methods (mixed in; see the module docstring). Threads: as FormatSpec."""

    def role_banks(self, role: str) -> tuple:
        """The names of the role's banks, in slot order."""
        check_role(role)
        return tuple(b.name for b in self.banks if b.role == role)

    def role_slots(self, role: str) -> tuple:
        """The native slot index of each of the role's banks (the C kernel's bank array), in slot order."""
        check_role(role)
        return tuple(i for i, b in enumerate(self.banks) if b.role == role)

    def role_bytes_per_expert(self, role: str, H: int, I: int) -> int:  # noqa: E741
        """Bytes of the role's banks one expert reads, at the schema's shapes (unpadded)."""
        return sum(int(np.prod(b.expected(1, H, I))) * np.dtype(b.dtypes[0]).itemsize
                   for b in self.banks if b.role == check_role(role))

    def role_dims(self, role: str, banks: Mapping) -> tuple:
        """(E, H, I) read off the role's banks alone. E is the first axis; H (I) is solved from each axis the schema
        makes a function of H (I) alone: the smallest value giving at least the axis's length (shapes grow with H
        and I), the largest over those axes. validate_role then checks every shape against these dims exactly."""
        specs = [b for b in self.banks if b.role == check_role(role)]
        arrs = {b.name: as_array(banks[b.name], f"bank {b.name!r}") for b in specs}
        first = arrs[specs[0].name]
        if first.ndim == 0:
            raise ValueError(f"{self.name} bank {specs[0].name!r}: {describe(first)}, expected [E, ...]")
        E = int(first.shape[0])
        found: dict = {}
        for _ in range(2):  # a second round solves axes of both H and I once one of them is known (mxfp4_panel)
            for which in ("H", "I"):
                if which in found:
                    continue
                best = None
                for b in specs:
                    a = arrs[b.name]
                    oth = found.get("I" if which == "H" else "H", _PROBE)

                    def at(v, w, b=b, which=which):  # the shape with `which` = v, the other = w
                        return b.expected(E, v, w) if which == "H" else b.expected(E, w, v)

                    base = at(_PROBE, oth)
                    if a.ndim != len(base):
                        raise ValueError(f"{self.name} {role} bank {b.name!r}: {describe(a)}, expected "
                                         f"{len(base)} dims")
                    for ax in range(1, len(base)):
                        if b.padded_last and ax == len(base) - 1:
                            continue
                        if at(2 * _PROBE, oth)[ax] == base[ax] or (
                                oth == _PROBE and at(_PROBE, 2 * _PROBE)[ax] != base[ax]):
                            continue  # not a function of `which` (given what is known) alone
                        v = _smallest(lambda v, ax=ax, at=at, oth=oth: at(v, oth)[ax], a.shape[ax])
                        if v is None:
                            raise ValueError(f"{self.name} {role} bank {b.name!r}: {describe(a)}: dim {ax} is larger "
                                             f"than any {which} gives")
                        best = v if best is None else max(best, v)
                if best is not None:
                    found[which] = best
        for which in ("H", "I"):
            if which not in found:
                raise ValueError(f"{self.name}: no {role} bank has an axis that gives {which} (schema)")
        return E, found["H"], found["I"]

    def validate_role(self, role: str, banks, E: int | None = None, H: int | None = None,
                      I: int | None = None) -> tuple:  # noqa: E741
        """Check the role's banks (other names in `banks` are not looked at: a pair layer's mapping holds the other
        format's banks of the other role); returns (arrays in the role's slot order, (E, H, I)). Errors name the
        format, the role and the bank."""
        check_role(role)
        if not isinstance(banks, Mapping):
            raise TypeError(f"banks for format {self.name!r} must be a mapping of bank name to array, "
                            f"got {type(banks).__name__}")
        names = self.role_banks(role)
        missing = [n for n in names if n not in banks]
        if missing:
            raise ValueError(f"format {self.name!r} needs {role} banks {list(names)}; missing {missing}")
        arrs = {n: as_array(banks[n], f"bank {n!r}") for n in names}
        specs = [b for b in self.banks if b.role == role]
        for spec in specs:
            a = arrs[spec.name]
            if a.dtype not in [np.dtype(d) for d in spec.dtypes]:
                raise TypeError(f"{self.name} {role} bank {spec.name!r}: dtype {a.dtype}, expected "
                                f"{' or '.join(str(np.dtype(d)) for d in spec.dtypes)}")
        e, h, i = self.role_dims(role, arrs)
        for want, got, nm in ((E, e, "E"), (H, h, "H"), (I, i, "I")):
            if want is not None and int(want) != got:
                raise ValueError(f"{self.name} {role} banks have {nm}={got}, expected {nm}={want}")
        self.check_dims(h, i)
        for spec in specs:
            self._check_bank(spec, arrs[spec.name], e, h, i, role)
        return [arrs[n] for n in names], (e, h, i)

    def _zeros(self, role: str, E: int, H: int, I: int) -> dict:  # noqa: E741
        """Zero banks of `role` (the schema's shapes, canonical dtypes, 64-byte aligned)."""
        out = {}
        for b in self.banks:
            if b.role == role:
                a = aligned_empty(b.expected(E, H, I), b.dtypes[0])
                a.view(np.uint8)[...] = 0
                out[b.name] = a
        return out

    def _with_zeros(self, role: str, arrs: Mapping, dims) -> dict:
        """A whole layer of this format: the role's banks as given, the other role's zero banks."""
        other = ROLES[1 - ROLES.index(role)]
        return {**{n: arrs[n] for n in self.role_banks(role)}, **self._zeros(other, *dims)}

    def dequantize_role(self, role: str, banks: Mapping) -> np.ndarray:
        """float64 weights of one role: gate_up [E, 2I, H] (gate rows then up rows) or down [E, H, I]."""
        arrs, dims = self.validate_role(role, banks)
        gu, dn = self.dequantize(self._with_zeros(role, dict(zip(self.role_banks(role), arrs)), dims))
        return gu if role == "gate_up" else dn

    def biases_role(self, role: str, banks: Mapping):
        """float64 bias of one role (gate_up [E, 2I] gate then up, down [E, H]) or None."""
        arrs, dims = self.validate_role(role, banks)
        b = self.biases(self._with_zeros(role, dict(zip(self.role_banks(role), arrs)), dims))
        return b[ROLES.index(role)]

    def map_role(self, role: str, banks: Mapping, fn: Callable, out_spec, threads: int | None = None):
        """fn(a whole layer of this format) -> a layer (or a list of layers) of format `out_spec`, applied to one
        role: the experts run in chunks of 8 beside zero banks of the other role, and the role's banks of each result
        are joined back along the experts (fn must work expert by expert: a repack, an I-slice cut). Chunks run on
        `threads` threads at once (numpy copies release the GIL)."""
        from concurrent.futures import ThreadPoolExecutor

        arrs, (E, H, I) = self.validate_role(role, banks)  # noqa: E741
        arrs = dict(zip(self.role_banks(role), arrs))
        keep = out_spec.role_banks(role)
        starts = list(range(0, E, _CHUNK))

        def one(a):
            sub = {n: v[a:a + _CHUNK] for n, v in arrs.items()}
            res = fn(self._with_zeros(role, sub, (sub[next(iter(sub))].shape[0], H, I)))
            return [{n: r[n] for n in keep} for r in (res if isinstance(res, list) else [res])]

        n = max(1, min(threads or 1, len(starts)))
        with ThreadPoolExecutor(n, thread_name_prefix="cpumoe-role") as ex:
            pieces = list(ex.map(one, starts))
        out = []
        for p in range(len(pieces[0])):
            joined = {}
            for name in keep:
                parts = [pc[p][name] for pc in pieces]
                a = aligned_empty((E, *parts[0].shape[1:]), parts[0].dtype)
                np.concatenate(parts, axis=0, out=a)
                joined[name] = a
            out.append(joined)
        return out

    def to_layout_role(self, role: str, banks: Mapping, name: str, threads: int | None = None) -> dict:
        """One role's banks -> that role's banks of layout `name` (down this format's cpu_layout chain, as
        to_layout); `name` == this format returns the role's banks as given."""
        if name == self.name:
            arrs, _ = self.validate_role(role, banks)
            return dict(zip(self.role_banks(role), arrs))
        moves = self._direct_moves(name, banks, role)
        if moves is not None:  # the role's banks gathered straight into their final arrays
            from ._arrays import usable_cpus

            return moves.apply(banks, threads or usable_cpus(), only=self._defined(name).role_banks(role))
        return self.map_role(role, banks, lambda b: self._to_layout_one(b, name), self._defined(name), threads)[0]


def _smallest(f: Callable[[int], int], target: int) -> int | None:
    """The smallest v >= 1 with f(v) >= target (f non-decreasing), or None below 2^40."""
    hi = 1
    while f(hi) < target:
        hi *= 2
        if hi > 1 << 40:
            return None
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if f(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo
