"""A GGUF file's tensors read one at a time with pread, never memory-mapped: the reader's mapping is used for the
header only, so a 19 GB file streamed into banks leaves the process's RSS at what it keeps (a mapped file counts
every page it touched). Pages read are dropped from the page cache as they are consumed (posix_fadvise), so
loading does not push the machine's other memory out.

The header is parsed once, by gguf's own GGUFReader over a plain view of its mapping (_PlainReader), and that
reader serves transformers' GGUF loading of the same file too (shared_reader(): its config and its tokenizer each
parse the header again otherwise). A header with Qwen3-30B-A3B's 151k-token vocabulary takes gguf's reader 4.3 s a
parse on the 2-core VM, the plain one 1.3 s.

Non-expert tensors map to transformers' parameter names through gguf's own tensor name map (gguf-py's
`get_tensor_name_map`, the table llama.cpp's converter writes with); F32 / F16 / BF16 are used as stored, quantized
ones (Q8_0, K-quants in real files) are dequantized with gguf's own `gguf.quants.dequantize`, since they are small.

Thread contract: not shareable; one loader reads a file from one thread. shared_reader() holds a module lock while
it swaps gguf.GGUFReader, so two loaders' transformers calls take turns."""
from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

_SWAP = threading.Lock()  # shared_reader(): one swap of gguf.GGUFReader at a time


@functools.cache  # one class: gguf is imported on first use, not with this module
def _plain_reader_class():
    from gguf import GGUFReader

    class _PlainReader(GGUFReader):
        """gguf's GGUFReader over a plain ndarray view of its np.memmap (the view keeps the mapping alive): the
        reader slices its data once per field element, and a memmap slice pays numpy's subclass finalization each
        time (Qwen3-30B-A3B's header: 1.3 s against 4.3 s, the same fields and tensors)."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, v):
            self._plain = v.view(np.ndarray) if isinstance(v, np.memmap) else v

    return _PlainReader

# transformers' model_type -> gguf-py's architecture name, where they differ
_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "gpt_oss": "gpt-oss", "minimax_m2": "minimax-m2"}
# architectures whose GGUF converter permutes the q / k rows for its rope (llama.cpp convert_hf_to_gguf.py)
_PERMUTED_QK = {"llama", "mistral", "mixtral"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # GGMLQuantizationType name: F32, BF16, Q4_0, ...
    shape: tuple  # numpy order (rows first): reversed ggml ne
    offset: int  # absolute byte offset in the file
    nbytes: int


class GgufTensors:
    """Index and pread access to one GGUF file."""

    def __init__(self, path):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        self._reader = None
        try:
            reader = _plain_reader_class()(self.path)
        except (ValueError, IndexError, OSError) as e:  # a header the reader cannot parse (truncated, not GGUF)
            raise ValueError(f"{self.path}: not a readable GGUF file ({size} bytes): {e}") from e
        self.fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
        self.tensors: dict[str, TensorInfo] = {}
        for t in reader.tensors:
            info = TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                              int(t.data_offset), int(t.n_bytes))
            if info.offset + info.nbytes > size:
                raise ValueError(f"{self.path}: truncated: tensor {t.name!r} ({info.type} {list(info.shape)}) needs "
                                 f"bytes {info.offset}..{info.offset + info.nbytes}, the file has {size}")
            self.tensors[t.name] = info
        self._reader = reader  # for shared_reader(); close() drops it and its mapping
        self.arch = self.fields.get("general.architecture")
        self._fd = os.open(self.path, os.O_RDONLY)

    @contextmanager
    def shared_reader(self):
        """While open, transformers' GGUF loading (AutoConfig / AutoTokenizer with gguf_file=: `from gguf import
        GGUFReader` at each call) gets this file's parsed reader instead of parsing its header again, and a
        _PlainReader for any other file."""
        import gguf

        mine = os.path.realpath(self.path)

        def reader(path, mode="r"):
            if mode == "r" and self._reader is not None and os.path.realpath(os.fspath(path)) == mine:
                return self._reader
            return _plain_reader_class()(path, mode)

        with _SWAP:
            original, gguf.GGUFReader = gguf.GGUFReader, reader
            try:
                yield
            finally:
                gguf.GGUFReader = original

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return t

    def read_raw(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor's bytes, uint8 [rows..., row bytes] (into `out` when given: C-contiguous, that size)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        t = self.info(name)
        block, tsize = GGML_QUANT_SIZES[GGMLQuantizationType[t.type]]
        shape = t.shape[:-1] + (t.shape[-1] // block * tsize,)
        if out is None:
            out = np.empty(shape, np.uint8)
        elif out.nbytes != t.nbytes or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out: {out.nbytes} bytes ({out.dtype} {out.shape}), expected a writable C-contiguous "
                             f"buffer of {t.nbytes} bytes for {name}")
        self._pread(name, memoryview(out.reshape(-1).view(np.uint8)), t.offset, t.nbytes)
        self.drop_cache(name)
        return out.reshape(shape)

    def read_slab(self, name: str, index: int, out: np.ndarray) -> None:
        """Row `index` of the tensor's first axis (one expert of an experts tensor), its bytes into `out`."""
        t = self.info(name)
        step = t.nbytes // t.shape[0]
        if not 0 <= index < t.shape[0] or out.nbytes != step or not out.flags.c_contiguous:
            raise ValueError(f"{name}: slab {index} of {t.shape[0]} ({step} bytes) into {out.nbytes} bytes")
        self._pread(name, memoryview(out.reshape(-1).view(np.uint8)), t.offset + index * step, step)

    def _pread(self, name: str, view, offset: int, n: int) -> None:
        got = 0
        while got < n:
            k = os.preadv(self._fd, [view[got:]], offset + got)
            if k <= 0:
                raise ValueError(f"{self.path}: truncated while reading {name!r} at byte {offset + got}")
            got += k

    def drop_cache(self, name: str) -> None:
        """The tensor's pages leave the page cache (consumed: the banks hold their own copy)."""
        t = self.info(name)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, t.offset, t.nbytes, os.POSIX_FADV_DONTNEED)

    def read_float(self, name: str):
        """A non-expert tensor in its numpy shape: F32 / F16 / BF16 as stored (a torch tensor over the bytes read:
        BF16 reaches a bf16 model with no conversion, where widening to float32 and narrowing back was most of this
        function's time in a profile of the load), quantized types dequantized by gguf (float32 numpy)."""
        import torch
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.info(name)
        raw = self.read_raw(name)
        stored = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16),
                  "BF16": (np.int16, torch.bfloat16)}
        if t.type in stored:
            np_t, torch_t = stored[t.type]
            return torch.from_numpy(raw.view(np_t).reshape(t.shape)).view(torch_t)
        try:
            return dequantize(raw, GGMLQuantizationType[t.type]).reshape(t.shape).astype(np.float32, copy=False)
        except NotImplementedError as e:
            raise ValueError(f"{self.path}: tensor {name!r} is {t.type}, which gguf cannot dequantize here") from e

    def hf_names(self, model, model_type: str, num_layers: int) -> dict[str, str]:
        """transformers parameter name -> GGUF tensor name, for every parameter of `model` the file's name map covers
        (the routed experts are not covered: they are read as banks)."""
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        want = _ARCH.get(model_type, model_type)
        arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == want), None)
        if arch is None:
            raise NotImplementedError(f"{self.path}: model_type {model_type!r} has no GGUF architecture in gguf "
                                      "(gguf-py's MODEL_ARCH_NAMES); expected one gguf knows")
        names = get_tensor_name_map(arch, num_layers)
        out = {}
        for hf in (n for n, _ in model.named_parameters()):
            base, _, suffix = hf.rpartition(".")
            g = names.get_name(base)
            if g is not None and f"{g}.{suffix}" in self.tensors:
                out[hf] = f"{g}.{suffix}"
        return out

    def permuted_qk(self, model_type: str) -> bool:
        return model_type in _PERMUTED_QK

    def close(self) -> None:
        self._reader = None
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def unpermute_qk(w, n_head: int):
    """Undo llama.cpp's q / k row permutation (its converter interleaves each head's rope halves); numpy or torch."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
