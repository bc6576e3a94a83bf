"""Page-locked host banks against a fake CUDA runtime that keeps the real one's rules (no overlapping registrations;
an async copy lies inside one registration or touches none): the budget, a failed registration, every array inside
one registration, and no other allocation in a registered page (an array sharing one is copied to pages of its own;
the executor's layouts and large numpy arrays are used in place)."""
from __future__ import annotations

import logging
import platform

import numpy as np
import pytest
from conftest import make_banks

import cpumoe_formats as cf
from cpumoe_formats._arrays import PAGE_OWNED_MIN
from moe_engine.placement.pinning import PAGE, PinnedBanks, owns_pages, spans


class _FakeRuntime:
    def __init__(self, fail_after):
        self.fail_after, self.calls, self.live, self.cleared = fail_after, 0, {}, 0

    def cudaGetLastError(self):
        self.cleared += 1
        return 0

    def cudaHostRegister(self, ptr, size, flags):
        self.calls += 1
        if self.calls > self.fail_after:
            return 2  # cudaErrorMemoryAllocation
        assert flags == 3 and ptr % PAGE == 0 and size % PAGE == 0
        assert all(ptr + size <= p or p + n <= ptr for p, n in self.live.items())  # the runtime refuses overlaps
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        if ptr not in self.live:
            return 1  # cudaErrorInvalidValue
        del self.live[ptr]
        return 0

    def cudaGetErrorString(self, err):
        return "out of memory"

    def copyable(self, a) -> bool:
        """The runtime's rule for an async copy: the host range lies inside one registration, or touches none."""
        s = a.__array_interface__["data"][0]
        e = s + a.nbytes
        inside = [p <= s and e <= p + n for p, n in self.live.items()]
        touching = [s < p + n and p < e for p, n in self.live.items()]
        return any(inside) or not any(touching)


def _carved_banks():
    """Three layers carved from one page-aligned buffer (as small arrays packed on the heap are): layer 2's first
    array starts in the page layer 1's second ends in, and runs on past it."""
    P = PAGE
    raw = np.zeros(12 * P, np.uint8)
    buf = raw[(-raw.ctypes.data) % P:]
    cut = [[(0, P - 100), (2 * P, 3 * P)], [(4 * P, 5 * P), (6 * P + 10, 6 * P + 1000)],
           [(6 * P + 2000, 7 * P + 500), (9 * P, 10 * P)]]
    return raw, [{f"m{i}": buf[s:e] for i, (s, e) in enumerate(layer)} for layer in cut]


def test_pinning_budget_and_failure(caplog):
    raw, banks = _carved_banks()
    P = PAGE
    units, of_layer = spans(banks)
    assert len(units) == 5 and of_layer[1] & of_layer[2]  # the shared page is one unit of both layers
    caplog.set_level(logging.WARNING, logger="moe_engine")
    rt = _FakeRuntime(fail_after=10**6)
    p = PinnedBanks(banks, "cuda", budget=5 * P, runtime=rt)
    # layer 2's first array lies in the unit layer 1 registered: wholly registered, though layer 2 is not pinned
    assert p.pinned == [True, True, False] and p.bytes == 5 * P and "layers 2 pageable: the pin budget" in p.why
    assert all(rt.copyable(a) for layer in banks for a in layer.values())
    assert "pinned in 2 of 3 layers" in caplog.text
    p.close()
    assert not rt.live
    rt = _FakeRuntime(fail_after=3)  # the second layer's second unit fails
    p = PinnedBanks(banks, "cuda", budget=1 << 40, runtime=rt)
    assert p.pinned == [True, False, False] and "layers 1..2 pageable: cudaHostRegister failed (out of memory)" in p.why
    assert rt.cleared == 1  # the failed call's error is not left for torch's next launch check
    assert all(rt.copyable(a) for layer in banks for a in layer.values())
    p.close()
    assert not rt.live  # what did register is released
    rt = _FakeRuntime(fail_after=10**6)
    p = PinnedBanks(banks, "cuda", budget=1 << 40, runtime=rt)
    rt.live.pop(next(iter(rt.live)))  # a range the runtime no longer holds: its unregister fails
    cleared = rt.cleared
    p.close()
    assert rt.cleared == cleared + 1 and "cudaHostUnregister failed for 1 of" in caplog.text  # not left for torch
    assert PinnedBanks(banks, "cpu").why == "no GPU: nothing to pin for"
    with pytest.raises(ValueError, match=r"pin_memory=-1: expected bytes"):
        PinnedBanks(banks, "cuda", budget=-1, runtime=rt)


def test_pinning_never_splits_an_array(rng):
    """Per-layer ranges trimmed where layers share a page left an array over two registrations, and the runtime
    refused its async copies (cudaErrorInvalidValue at hybrid's set_residency, intermittent with heap layout)."""
    for fmt in ("bf16", "fp8_block", "nvfp4"):
        banks, _ = make_banks(fmt, rng, layers=4, E=3)
        rt = _FakeRuntime(fail_after=10**6)
        p = PinnedBanks(banks, "cuda", budget=1 << 40, runtime=rt)
        assert all(p.pinned) and _others_copyable(rt, [])
        assert all(rt.copyable(a) for layer in p.banks for a in layer.values())
        p.close()
    _, banks = _carved_banks()
    rt = _FakeRuntime(fail_after=10**6)
    PinnedBanks(banks, "cuda", budget=1 << 40, runtime=rt)
    assert all(rt.copyable(a) for layer in banks for a in layer.values()) and len(rt.live) == 5


def _others_copyable(rt, others) -> bool:
    """Objects that are not banks (held from before the pinning, and 400 small arrays allocated after it, as torch's
    tensors are) each copy under the runtime's rule: inside one registration or touching none."""
    later = [np.empty(n, np.uint8) for n in np.random.default_rng(7).integers(16, 6000, 400)]
    return all(rt.copyable(a) for a in [*others, *later])


def test_what_owns_its_pages():
    heap = [np.empty(5000, np.uint8) for _ in range(4)]  # small: on the heap, beside other objects
    assert not any(owns_pages(a) for a in heap)
    big = np.empty(64 << 20, np.uint8)  # glibc maps it on its own
    assert owns_pages(big) or platform.libc_ver()[0] != "glibc"
    assert owns_pages(big[PAGE:2 * PAGE]) and not owns_pages(np.empty(3 * PAGE, np.uint8)[100:])
    import torch

    assert owns_pages(torch.empty(64 << 20, dtype=torch.uint8)[100:].numpy()) or platform.libc_ver()[0] != "glibc"
    assert not owns_pages(torch.empty(5000, dtype=torch.uint8).numpy())
    for n in (100, 5000, 1 << 17):
        assert owns_pages(cf.aligned_empty((n,), np.uint8, PAGE))
    assert owns_pages(cf.aligned_empty((1 << 17,), np.uint16))  # the executor's layouts from 64 KiB


def test_an_array_sharing_a_page_is_copied_first():
    """A torch tensor allocated on the heap beside a small bank array failed its next copy to the GPU (the H100
    profile bench: "invalid argument" at fp8_block's scales)."""
    rng = np.random.default_rng(5)
    big = rng.integers(0, 255, 64 << 20, dtype=np.uint8)
    small, neighbours = [], []
    for _ in range(2):  # each small bank array with a heap object allocated right after it, likely in its page
        small.append(rng.standard_normal(700).astype(np.float32))
        neighbours.append(np.ones(300, np.float32))
    banks = [{"w": big[: 32 << 20], "s": small[0]}, {"w": big[32 << 20:], "s": small[1]}]
    rt = _FakeRuntime(fail_after=10**6)
    p = PinnedBanks(banks, "cuda", budget=1 << 40, runtime=rt)
    assert all(p.pinned) and p.copied == 2 * 700 * 4 and "KiB" not in p.summary()
    assert "MiB copied to pages of their own" in p.summary()
    for li in range(2):
        got = p.banks[li]
        assert got["w"] is banks[li]["w"]  # in place: no second copy of the expert bytes
        assert got["s"] is not banks[li]["s"] and np.array_equal(got["s"], banks[li]["s"]) and owns_pages(got["s"])
        assert banks[li]["s"] is small[li]  # the caller's dicts are left as they were
    assert _others_copyable(rt, neighbours) and all(rt.copyable(a) for layer in p.banks for a in layer.values())
    p.close()
    assert not rt.live


@pytest.mark.parametrize("fmt", ["q4_0", "fp8_block"])
def test_the_executor_layout_is_pinned_in_place(fmt):
    """One host copy beside a GPU: the executor's banks are registered as they are; only arrays under 64 KiB (fp8's
    scales: 49 KiB a layer at Qwen3-30B-A3B's shape) may be copied."""
    rng = np.random.default_rng(6)
    H, I = 512, 256  # noqa: E741
    src = cf.get_format(fmt)
    banks = [src.to_layout(src.random_banks(8, H, I, rng), f"{fmt}_x16", threads=2) for _ in range(2)]
    rt = _FakeRuntime(fail_after=10**6)
    p = PinnedBanks(banks, "cuda", budget=1 << 40, runtime=rt)
    small = sum(a.nbytes for layer in banks for a in layer.values() if a.nbytes < PAGE_OWNED_MIN)
    assert all(p.pinned) and p.copied <= small and (fmt != "q4_0" or p.copied == 0)
    assert all(p.banks[li][k] is a for li in range(2) for k, a in banks[li].items() if a.nbytes >= PAGE_OWNED_MIN)
    assert _others_copyable(rt, [])
    p.close()
