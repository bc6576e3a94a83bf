"""Per-layer expert banks (cpumoe_formats schemas) from float weights or random codes, with a progress bar."""
from __future__ import annotations

import numpy as np

import cpumoe_formats as cf

from .progress import bar

CHUNK_BYTES = 64 << 20  # experts quantized per call: keeps the float32 temporaries near 64 MiB


def _to_numpy(a, name: str) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor, on any device and of any float dtype
        a = a.detach().to("cpu").float().numpy()
    a = np.asarray(a)
    if a.dtype.kind != "f":
        raise TypeError(f"{name}: dtype {a.dtype}, expected a floating dtype (float weights to quantize)")
    return a


def _fill(fmt: str, E: int, make, label: str, progress: bool, per_expert_bytes: int) -> dict:
    """Banks of E experts built `chunk` experts at a time by make(e0, n) into 64-byte aligned arrays."""
    chunk = max(1, min(E, CHUNK_BYTES // max(per_expert_bytes, 1)))
    out = None
    with bar(total=E, desc=label, unit="expert", disable=not progress) as pb:
        for e0 in range(0, E, chunk):
            n = min(chunk, E - e0)
            part = make(e0, n)
            if out is None:
                out = {k: cf.aligned_empty((E,) + np.shape(v)[1:], np.asarray(v).dtype, 64) for k, v in part.items()}
            for k, v in part.items():
                out[k][e0:e0 + n] = v
            pb.update(n)
    cf.get_format(fmt).validate(out)
    return out


def quantize_layers(fmt: str, weights, *, progress: bool = True) -> list[dict]:
    """[(gate_up [E, 2I, H], down [E, H, I]) per layer] float weights (numpy or torch; gate rows then up rows)
    -> one bank dict per layer in format `fmt`, quantized by cpumoe_formats."""
    spec = cf.get_format(fmt)
    layers = []
    for li, pair in enumerate(weights):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"weights[{li}]: expected a (gate_up, down) pair")
        gu, dn = _to_numpy(pair[0], f"weights[{li}][0] (gate_up)"), _to_numpy(pair[1], f"weights[{li}][1] (down)")
        if gu.ndim != 3 or dn.ndim != 3 or gu.shape[0] != dn.shape[0]:
            raise ValueError(f"weights[{li}]: gate_up {gu.shape} and down {dn.shape}, expected [E, 2I, H] and "
                             "[E, H, I] with the same E")
        E, _, H = gu.shape
        bpe = 4 * (gu[0].size + dn[0].size)
        def make(e0, n, gu=gu, dn=dn):
            return cf.quantize(spec.name, gu[e0:e0 + n], dn[e0:e0 + n])

        layers.append(_fill(spec.name, E, make, f"quantizing layer {li} to {spec.name}", progress, bpe))
    return layers


def random_layers(fmt: str, E: int, H: int, I: int, num_layers: int, *, seed: int = 0,  # noqa: E741
                  progress: bool = True) -> list[dict]:
    """Synthetic banks: random codes with well-scaled scales (cpumoe_formats' random_banks), never zeros. Layer 0 is
    drawn; each later layer is a copy of it with its experts in another random order (random_banks draws at
    ~0.1 GB/s, a permuted copy runs at memory speed): the values repeat across layers, the memory does not."""
    spec = cf.get_format(fmt)
    rng = np.random.default_rng(seed)
    bpe = spec.bytes_per_expert(H, I)
    first = _fill(spec.name, E, lambda e0, n: spec.random_banks(n, H, I, rng), f"building layer 1/{num_layers} "
                  f"({spec.name})", progress, bpe)
    layers = [first]
    for li in range(1, num_layers):
        perm = rng.permutation(E)
        layers.append(_fill(spec.name, E, lambda e0, n, perm=perm: {k: v[perm[e0:e0 + n]] for k, v in first.items()},
                            f"building layer {li + 1}/{num_layers} ({spec.name})", progress, bpe))
    return layers


def random_pair_layers(pairs, E: int, H: int, I: int, *, seed: int = 0, progress: bool = True) -> list[dict]:  # noqa: E741
    """Synthetic banks for a (gate_up format, down format) pair per layer (a Q4_K_M model's mix): one layer of each
    format is drawn (random_layers), and each layer takes the gate_up banks of its gate_up format and the down banks of
    its down format, its experts in another random order."""
    names = sorted({f for p in pairs for f in p})
    drawn = {n: random_layers(n, E, H, I, 1, seed=seed, progress=progress)[0] for n in names}
    rng = np.random.default_rng(seed + 1)
    out = []
    for gu, dn in pairs:
        perm = rng.permutation(E)
        layer = {k: v for k, v in expert_slice(drawn[gu], perm).items()
                 if k in cf.get_format(gu).role_banks("gate_up")}
        layer.update({k: v for k, v in expert_slice(drawn[dn], perm).items()
                      if k in cf.get_format(dn).role_banks("down")})
        out.append(layer)
    return out


def expert_slice(banks: dict, experts) -> dict:
    """The banks of a subset of experts (a copy, leading dim len(experts)), e.g. for a float64 reference."""
    idx = np.asarray(experts, np.int64)
    out = {}
    for k, v in banks.items():
        a = cf.aligned_empty((len(idx),) + v.shape[1:], v.dtype, 64)
        a[...] = v[idx]
        out[k] = a
    return out
