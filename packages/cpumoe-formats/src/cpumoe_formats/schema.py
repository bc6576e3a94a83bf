"""Bank schemas: what each format's banks must look like, and their validation.

A bank is one per-layer array `[E, rows, cols]` (or `[E, rows]`). Validation
checks name, dtype, shape, strides (innermost contiguous, rows not overlapping)
and base alignment, and raises naming the format, the bank and what was expected.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from ._arrays import as_array, describe
from .roles import RoleMethods, bank_role

Dims = tuple  # (E, H, I)


_SPECS: dict = {}  # name -> FormatSpec, filled as the format modules define their SPEC


def _spec(name: str):
    if name not in _SPECS:
        raise ValueError(f"format {name!r} is not defined; expected one of {sorted(_SPECS)}")
    return _SPECS[name]


class BankViews(list):
    """FormatSpec.bank_views' result: (pointer, expert stride, row stride) per bank, holding the arrays the
    pointers point into (`.arrays`) alive."""

    arrays: tuple = ()


@dataclass(frozen=True)
class BankSpec:
    name: str
    dtypes: tuple  # accepted numpy dtypes; the first is the canonical one
    shape: Callable[[int, int, int], tuple]  # expected shape from (E, H, I)
    align: int = 16  # base-pointer alignment in bytes
    padded_last: bool = False  # last dim may be larger than expected (padded scale rows)
    role: str = field(init=False)  # "gate_up" or "down", from the name (roles.py): the pass that reads the bank

    def __post_init__(self):
        object.__setattr__(self, "role", bank_role(self.name))

    def expected(self, E: int, H: int, I: int) -> tuple:  # noqa: E741 - I is the model's name for it
        return tuple(int(v) for v in self.shape(E, H, I))


@dataclass
class FormatSpec(RoleMethods):
    """One weight format, Python side. Subclasses fill in the format's math; RoleMethods (roles.py) validates,
    dequantizes and repacks one role (gate_up or down) of a layer alone.

    Threads: shareable; a spec is not changed after its module defines it, and its methods read their arguments
    and return new arrays (repacks run their numpy copies on threads of their own: to_layout)."""

    name: str
    id: int
    banks: tuple  # BankSpec in native slot order
    k_multiple: int = 1
    input_weight: bool = True
    modes: tuple = ("native",)
    default_mode: str = "native"
    aliases: tuple = ()
    round_gate_up: bool = False  # gate/up rounded to bf16 before the activation
    round_route_term: bool = False  # each route's down term rounded to bf16 before the sum
    description: str = ""
    # mode -> tiers at which the format has its own kernel for that mode (lowest first);
    # forcing another tier runs the highest of these below it.
    kernel_tiers: dict = field(default_factory=lambda: {"native": ("scalar",)})
    # tiers whose kernel runs only when asked for by name (isa= or CPUMOE_ISA=<tier>), never by auto
    opt_in_tiers: tuple = ()
    amd_auto_tiers: tuple = ()  # tiers auto picks only on AMD CPUs (elsewhere opt-in)
    # advice a consumer logs when it loads banks of this format (e.g. a faster equivalent layout); "" for none
    hint: str = ""
    # a format with the same math from the same bytes in an order a CPU reads faster, reached by to_cpu_layout (a
    # consumer may repack at load: cpumoe_executor's repack=; a layout may name its own, a chain: to_layout).
    # mxfp4 -> mxfp4_panel -> mxfp4_x16 (w4a8) are bit-identical; q4_0 ->
    # q4_0_x16 and nvfp4 -> nvfp4_x16 / ds_fp4 -> ds_fp4_x16 (w4a8 only), fp8_block -> fp8_block_x16 sum in their
    # own fp32 order (within the format's tolerance). "" for none
    cpu_layout: str = ""
    # the lowest tier at which a consumer should repack by default ("" = wherever the layout's kernel is at least
    # this format's tier): q4_0_x16's AVX2 kernel is faster for batches that share experts but slower for one token
    # (nvfp4: avx512vnni too, where nvfp4_x16 was measured)
    cpu_layout_min_tier: str = ""
    bank_names: tuple = field(init=False)

    def __post_init__(self):
        self.bank_names = tuple(b.name for b in self.banks)
        roles = [b.role for b in self.banks]
        if "gate_up" not in roles or "down" not in roles or roles != sorted(roles, key=("gate_up", "down").index):
            raise ValueError(f"format {self.name!r}: banks {list(self.bank_names)} must be gate_up banks, then down "
                             "banks (roles.py)")
        _SPECS[self.name] = self  # layout links (cpu_layout) resolve here, not by importing the registry

    def to_cpu_layout(self, banks: Mapping) -> dict:
        """One layer's banks (validated) -> new banks of format `cpu_layout` (the same bytes, moved)."""
        if not self.cpu_layout:
            raise ValueError(f"format {self.name!r} has no CPU layout to repack into (cpu_layout is empty)")
        return _spec(self.cpu_layout).repack_from(banks)

    def to_layout(self, banks: Mapping, name: str, threads: int | None = None) -> dict:
        """One layer's banks -> format `name`, a CPU layout down this format's chain of cpu_layout links (mxfp4 ->
        mxfp4_panel -> mxfp4_x16); `name` == this format returns the banks as given. The experts are moved in
        `threads` slices at once (default: the CPUs this process may run on): every bank's first axis is the
        expert, the repacks are numpy copies that release the GIL, and one thread ran at 0.1-0.5 GB/s."""
        from ._arrays import split_experts, usable_cpus

        if name == self.name:
            return banks
        moves = self._direct_moves(name, banks)
        if moves is not None:  # one gather per bank straight into the final arrays: a layer's peak is two copies
            return moves.apply(banks, threads or usable_cpus())
        return split_experts(lambda b: self._to_layout_one(b, name), banks, threads)

    def _direct_moves(self, name: str, banks, role: str | None = None):
        """The byte moves of layout `name` where it is built from this format's banks directly, else None."""
        layout = _spec(name)
        _, (_, H, I) = self.validate(banks) if role is None else self.validate_role(role, banks)  # noqa: E741
        moves = layout.moves_from(self, H, I)
        if moves is not None and role is not None:  # one role alone: each of its banks from one source bank
            mine = set(layout.role_banks(role))
            if any(one is None for n, _, _, one, _, _ in moves.plan if n in mine):
                return None
        return moves

    def moves_from(self, source, H: int, I: int):  # noqa: E741
        """This format as a byte permutation of `source`'s banks at (H, I) (formats/_moves.py), or None: only a CPU
        layout built from `source` directly can be one (formats/_layout.py CpuLayout overrides this)."""
        return None

    @staticmethod
    def _defined(name: str):
        """The defined format `name` (the registry this module keeps; roles.py reaches it through here)."""
        return _spec(name)

    def _to_layout_one(self, banks: Mapping, name: str) -> dict:
        layout = _spec(name)
        target, spec, chain = layout.name, self, [self.name]
        # a layout built from this format's banks directly (mxfp4_x16 from mxfp4) skips the steps between: each
        # step is a full copy of the layer (mxfp4 -> panels -> mxfp4 -> mxfp4_x16 would be three)
        source = getattr(layout, "source", None)
        if source is not None and source.name == self.name and target != self.name:
            return layout.from_source(banks)
        while spec.name != target:
            if not spec.cpu_layout:
                raise ValueError(f"format {target!r} is not on {self.name!r}'s CPU layout chain {chain}")
            banks, spec = spec.to_cpu_layout(banks), _spec(spec.cpu_layout)
            chain.append(spec.name)
        return banks

    def repack_from(self, banks: Mapping) -> dict:
        """A CPU layout's own constructor from the banks of the format that names it (see to_cpu_layout)."""
        raise ValueError(f"format {self.name!r} is no format's CPU layout")

    # ---- dims and validation -------------------------------------------------
    def dims(self, banks: Mapping) -> Dims:
        """(E, H, I) read off the banks (the format knows which dims carry them)."""
        raise NotImplementedError

    def check_dims(self, H: int, I: int) -> None:  # noqa: E741
        if H <= 0 or I <= 0:
            raise ValueError(f"{self.name}: H={H} and I={I} must be positive")
        m = self.k_multiple
        if H % m or I % m:
            raise ValueError(f"{self.name}: H and I must be multiples of {m} (got H={H}, I={I})")

    def validate(self, banks, E: int | None = None, H: int | None = None, I: int | None = None  # noqa: E741
                 ) -> tuple[list[np.ndarray], Dims]:
        """Check every bank; returns the arrays in slot order and (E, H, I)."""
        if not isinstance(banks, Mapping):
            raise TypeError(f"banks for format {self.name!r} must be a mapping of bank name to array, "
                            f"got {type(banks).__name__}")
        missing = [n for n in self.bank_names if n not in banks]
        extra = [n for n in banks if n not in self.bank_names]
        if missing or extra:
            raise ValueError(f"format {self.name!r} needs banks {list(self.bank_names)}; "
                             f"missing {missing}, unexpected {extra}")
        arrs = {n: as_array(banks[n], f"bank {n!r}") for n in self.bank_names}
        for spec in self.banks:
            a = arrs[spec.name]
            if a.dtype not in [np.dtype(d) for d in spec.dtypes]:
                raise TypeError(f"{self.name} bank {spec.name!r}: dtype {a.dtype}, expected "
                                f"{' or '.join(str(np.dtype(d)) for d in spec.dtypes)}")
        e, h, i = self.dims(arrs)
        for want, got, nm in ((E, e, "E"), (H, h, "H"), (I, i, "I")):
            if want is not None and int(want) != got:
                raise ValueError(f"{self.name} banks have {nm}={got}, expected {nm}={want}")
        self.check_dims(h, i)
        for spec in self.banks:
            self._check_bank(spec, arrs[spec.name], e, h, i)
        return [arrs[n] for n in self.bank_names], (e, h, i)

    def _check_bank(self, spec: BankSpec, a: np.ndarray, E: int, H: int, I: int, role: str = "") -> None:  # noqa: E741
        exp = spec.expected(E, H, I)
        where = f"{self.name} {role + ' ' if role else ''}bank {spec.name!r}"
        bad_shape = a.ndim != len(exp) or a.shape[:-1] != exp[:-1] or (
            a.shape[-1] < exp[-1] if spec.padded_last else a.shape[-1] != exp[-1])
        if bad_shape:
            pad = " (last dim may be padded larger)" if spec.padded_last else ""
            raise ValueError(f"{where}: {describe(a)}, expected shape {exp}{pad}")
        item = a.dtype.itemsize
        if a.strides[-1] != item:
            raise ValueError(f"{where}: innermost stride {a.strides[-1]} bytes, expected {item} (contiguous rows)")
        if a.ndim == 3 and a.shape[1] > 1 and a.strides[1] < a.shape[2] * item:
            raise ValueError(f"{where}: row stride {a.strides[1]} bytes overlaps rows of {a.shape[2] * item} bytes")
        row_bytes = a.strides[1] * (a.shape[1] - 1) + a.shape[-1] * item if a.ndim == 3 else a.shape[-1] * item
        if a.shape[0] > 1 and a.strides[0] < row_bytes:
            raise ValueError(f"{where}: expert stride {a.strides[0]} bytes overlaps experts of {row_bytes} bytes")
        if a.ctypes.data % spec.align:
            raise ValueError(f"{where}: data pointer {a.ctypes.data:#x} is not {spec.align}-byte aligned "
                             f"(allocate with cpumoe_formats.aligned_empty)")

    # ---- math the subclasses provide ------------------------------------------
    def quantize(self, gate_up: np.ndarray, down: np.ndarray, **opts) -> dict:
        """Float weights gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I] -> banks."""
        raise NotImplementedError

    def random_banks(self, E: int, H: int, I: int, rng: np.random.Generator) -> dict:  # noqa: E741
        """Valid banks with random codes and well-scaled scales (bench and fuzzing)."""
        raise NotImplementedError

    def dequantize(self, banks: Mapping) -> tuple[np.ndarray, np.ndarray]:
        """float64 (gate_up [E, 2I, H] gate rows then up rows, down [E, H, I])."""
        raise NotImplementedError

    def biases(self, banks: Mapping) -> tuple[np.ndarray | None, np.ndarray | None]:
        """float64 (gate_up bias [E, 2I] in gate-then-up order, down bias [E, H]) or Nones."""
        return None, None

    def act_in(self, v: np.ndarray, mode: str) -> np.ndarray:
        """The activation vector (bf16 values, float64) as the kernel consumes it in `mode`."""
        return np.asarray(v, np.float64)

    # ---- helpers ----------------------------------------------------------------
    def bank_views(self, arrays: Sequence[np.ndarray]) -> BankViews:
        """(pointer, expert stride, row stride) per bank, the native slot order: a list that holds `arrays` (its
        `.arrays`), so the pointers stay valid as long as the list lives."""
        out = BankViews()
        for a in arrays:
            rs = a.strides[1] if a.ndim == 3 else a.strides[-1]
            out.append((a.ctypes.data, a.strides[0], rs))
        out.arrays = tuple(arrays)
        return out

    def bytes_per_expert(self, H: int, I: int) -> int:  # noqa: E741
        """Bytes of weights (all banks) one expert reads, with the schema's default shapes."""
        total = 0
        for spec in self.banks:
            shp = spec.expected(1, H, I)
            total += int(np.prod(shp)) * np.dtype(spec.dtypes[0]).itemsize
        return total
