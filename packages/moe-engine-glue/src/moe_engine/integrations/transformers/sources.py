"""Where from_pretrained reads a model: a GGUF file or a Hugging Face safetensors directory, behind one interface:

  config              transformers' config (GGUF: from the file's metadata, as transformers reads it)
  tokenizer()         the file's tokenizer, or None when it has none
  read(hf_name)       one non-expert parameter as float32 numpy or a torch tensor, by transformers' name
  layout / format     how the routed experts are stored, and the cpumoe_formats format that holds them as they are
  expert_banks(...)   one decoder layer's experts as banks, read from the file (never a float copy of all experts)

Thread contract: not shareable; one source is read by one thread, then closed."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import cpumoe_formats as cf

from ...loading.gguf_tensors import GgufTensors, unpermute_qk

# GGUF expert tensor types served as shipped, and the format each is
GGUF_EXPERT_TYPES = {"Q4_0": "q4_0"}
GGUF_EXPERTS = ("blk.{n}.ffn_gate_exps.weight", "blk.{n}.ffn_up_exps.weight", "blk.{n}.ffn_down_exps.weight")


def resolve(path, gguf_file=None) -> tuple[Path, Path | None]:
    """(the model directory or file, the GGUF file or None); FileNotFoundError naming what is missing."""
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"path={os.fspath(path)!r}: no such file or directory")
    if gguf_file is not None:
        g = Path(os.fspath(gguf_file))
        g = g if g.is_absolute() or p.is_file() else p / g
        if p.is_file():
            g = p
        if not g.is_file():
            raise FileNotFoundError(f"gguf_file={os.fspath(gguf_file)!r}: no such file in {p}")
        return g.parent, g
    if p.is_file():
        if p.suffix == ".gguf":
            return p.parent, p
        raise ValueError(f"path={os.fspath(path)!r} is a file but not a .gguf; expected a GGUF file or a directory "
                         "with config.json and *.safetensors")
    if not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return p, ggufs[0]
        raise FileNotFoundError(f"path={os.fspath(path)!r}: no config.json (a Hugging Face directory) and "
                                f"{'no' if not ggufs else len(ggufs)} .gguf files; pass gguf_file= to pick one")
    return p, None


class GgufSource:
    def __init__(self, directory: Path, file: Path):
        from transformers import AutoConfig

        self.where = str(file)
        self.file = GgufTensors(file)  # validates the header and every tensor's extent first
        self.directory = directory
        self.config = AutoConfig.from_pretrained(str(directory), gguf_file=file.name)
        self.model_type = self.config.model_type
        self.layout, self.format = "gguf", None
        self._names: dict[str, str] | None = None

    def experts_format(self, layers: list[int]) -> str:
        """The format every expert tensor of these layers is in; ValueError naming a tensor of a type we lack."""
        fmts = set()
        for n in layers:
            for pattern in GGUF_EXPERTS:
                name = pattern.format(n=n)
                t = self.file.info(name)
                if t.type not in GGUF_EXPERT_TYPES:
                    raise ValueError(f"{self.where}: expert tensor {name} is {t.type}; moe_engine serves GGUF experts "
                                     f"in {sorted(GGUF_EXPERT_TYPES)}")
                fmts.add(GGUF_EXPERT_TYPES[t.type])
        if len(fmts) != 1:
            raise ValueError(f"{self.where}: experts in several types {sorted(fmts)}; one format per model here")
        self.format = fmts.pop()
        return self.format

    def bind(self, model) -> list[str]:
        """Map the model's parameter names to the file's tensors; returns the names the file does not hold."""
        c = self.config.get_text_config()
        self._names = self.file.hf_names(model, self.model_type, c.num_hidden_layers)
        return [n for n, _ in model.named_parameters() if n not in self._names]

    def read(self, hf_name: str) -> np.ndarray:
        name = self._names.get(hf_name) if self._names else None
        if name is None:
            raise KeyError(f"{self.where}: no GGUF tensor for {hf_name}")
        a = self.file.read_float(name)
        if self.file.permuted_qk(self.model_type) and (".attn_q." in name or ".attn_k." in name):
            c = self.config.get_text_config()
            heads = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads
            a = unpermute_qk(a, heads)
        return a

    def expert_banks(self, layer: int, E: int, H: int, I: int) -> dict:  # noqa: E741
        """q4_0 banks of one layer: gate rows then up rows per expert, the file's blocks copied as they are."""
        g, u, d = (p.format(n=layer) for p in GGUF_EXPERTS)
        want = {b.name: b.expected(E, H, I) for b in cf.get_format(self.format).banks}
        rb_h, rb_i = want["gate_up"][-1], want["down"][-1]
        for name, shape in ((g, (E, I, rb_h)), (u, (E, I, rb_h)), (d, (E, H, rb_i))):
            t = self.file.info(name)
            rows = t.shape[:-1] + (t.nbytes // max(1, int(np.prod(t.shape[:-1]))),)
            if rows != shape:
                raise ValueError(f"{self.where}: {name}: {t.type} bytes {list(rows)}, expected {list(shape)} "
                                 f"(E={E}, H={H}, I={I} from the config)")
        gu = cf.aligned_empty(want["gate_up"], np.uint8, 64)
        dn = cf.aligned_empty(want["down"], np.uint8, 64)
        for e in range(E):
            self.file.read_slab(g, e, gu[e, :I])
            self.file.read_slab(u, e, gu[e, I:])
        self.file.read_raw(d, dn)
        for name in (g, u):
            self.file.drop_cache(name)
        return {"gate_up": gu, "down": dn}

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.directory), gguf_file=Path(self.where).name)
        except (ValueError, KeyError, OSError, TypeError):  # a file without tokenizer metadata
            return None

    def close(self) -> None:
        self.file.close()


def open_source(path, gguf_file=None):
    directory, g = resolve(path, gguf_file)
    if g is not None:
        return GgufSource(directory, g)
    raise NotImplementedError("safetensors directories: SafetensorsSource")
