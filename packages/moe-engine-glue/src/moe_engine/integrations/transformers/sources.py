"""Where from_pretrained reads a model: a GGUF file or a Hugging Face safetensors directory, behind one interface:

  config              transformers' config (GGUF: from the file's metadata, as transformers reads it)
  tokenizer()         the file's tokenizer, or None when it has none
  read(hf_name)       one non-expert parameter as a torch tensor (its stored dtype) or float32 numpy, by
                      transformers' name
  layout / format     how the routed experts are stored, and the cpumoe_formats format that holds them as they are
                      (GGUF: a (gate_up, down) pair per layer where the file's types differ between layers or matrices)
  expert_banks(...)   one decoder layer's experts as banks, read from the file (never a float copy of all experts)

Thread contract: not shareable; one source is read by one thread, then closed."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import cpumoe_formats as cf

from ... import layer_formats
from ...loading.gguf_tensors import GgufTensors, unpermute_qk

# GGUF block types whose bytes are a cpumoe_formats format's banks as they are (GGML type name -> format); a type is
# served when the registry has its format (expert_types()), so Q5_K is read once cpumoe_formats defines q5_k
GGUF_BLOCK_FORMATS = {"Q4_0": "q4_0", "Q8_0": "q8_0", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
GGUF_EXPERTS = ("blk.{n}.ffn_gate_exps.weight", "blk.{n}.ffn_up_exps.weight", "blk.{n}.ffn_down_exps.weight")


def expert_types() -> dict[str, str]:
    """GGML type name -> format, for the GGUF expert types served as shipped here (the registry's formats)."""
    return {t: f for t, f in GGUF_BLOCK_FORMATS.items() if f in cf.FORMATS}


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
        with self.file.shared_reader():  # transformers reads the header this process parsed already
            self.config = AutoConfig.from_pretrained(str(directory), gguf_file=file.name)
        self.model_type = self.config.model_type
        self.layout, self.format = "gguf", None
        self.pairs: dict[int, tuple[str, str]] = {}  # decoder layer -> (gate_up, down) format, from experts_format
        self._names: dict[str, str] | None = None

    def experts_format(self, layers: list[int]):
        """The experts' formats, from the tensors' types (no tensor data is read): one format name when every layer
        holds one type, else one (gate_up, down) pair per layer (a Q4_K_M file). ValueError naming the tensor, its
        type and the types served, or a layer whose gate and up differ."""
        served = expert_types()
        pairs = []
        for n in layers:
            types = []
            for pattern in GGUF_EXPERTS:
                name = pattern.format(n=n)
                t = self.file.info(name)
                if t.type not in served:
                    raise ValueError(f"{self.where}: expert tensor {name} is {t.type}; moe_engine serves GGUF experts "
                                     f"in {sorted(served)}")
                types.append(t.type)
            if types[0] != types[1]:
                g, u = (p.format(n=n) for p in GGUF_EXPERTS[:2])
                raise ValueError(f"{self.where}: layer {n}: {g} is {types[0]} but {u} is {types[1]}; gate and up "
                                 "experts must share a type (they run as one gate_up bank)")
            pairs.append((served[types[0]], served[types[2]]))
        self.pairs = dict(zip(layers, pairs))
        self.format = layer_formats.compact(pairs)
        return self.format

    def bind(self, model) -> list[str]:
        """Map the model's parameter names to the file's tensors; returns the names the file does not hold."""
        c = self.config.get_text_config()
        self._names = self.file.hf_names(model, self.model_type, c.num_hidden_layers)
        return [n for n, _ in model.named_parameters() if n not in self._names]

    def read(self, hf_name: str):
        name = self._names.get(hf_name) if self._names else None
        if name is None:
            raise KeyError(f"{self.where}: no GGUF tensor for {hf_name}")
        a = self.file.read_float(name)
        if self.file.permuted_qk(self.model_type) and (".attn_q." in name or ".attn_k." in name):
            c = self.config.get_text_config()
            heads = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads
            a = unpermute_qk(a, heads)
        return a

    def expert_banks(self, layer: int, E: int, H: int, I: int, fmt=None) -> dict:  # noqa: E741
        """One layer's banks in its (gate_up, down) formats (experts_format): gate rows then up rows per expert, the
        file's blocks copied as they are. `fmt` is not used: the file's types decide."""
        g, u, d = (p.format(n=layer) for p in GGUF_EXPERTS)
        gu_fmt, dn_fmt = self.pairs[layer]
        gu_spec, dn_spec = cf.get_format(gu_fmt), cf.get_format(dn_fmt)
        want = {"gate_up": next(b for b in gu_spec.banks if b.name == "gate_up").expected(E, H, I),
                "down": next(b for b in dn_spec.banks if b.name == "down").expected(E, H, I)}
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
            with self.file.shared_reader():
                return AutoTokenizer.from_pretrained(str(self.directory), gguf_file=Path(self.where).name)
        except (ValueError, KeyError, OSError, TypeError):  # a file without tokenizer metadata
            return None

    def close(self) -> None:
        self.file.close()


class SafetensorsSource:
    """A Hugging Face directory: config.json, *.safetensors (an index or every file), a tokenizer if present. Experts
    in a shipped layout (FP8 block, gpt-oss MXFP4, ModelOpt NVFP4) are read by moe_engine.checkpoints' loaders;
    float experts (bf16) are quantized layer by layer to `format=`. Non-expert FP8 / NVFP4 weights are dequantized
    (they are small), everything else is read as stored."""

    def __init__(self, directory: Path, allow_nonfinite: bool):
        from transformers import AutoConfig

        from ...checkpoints import open_store

        self.directory, self.where, self.allow = directory, str(directory), allow_nonfinite
        self.config = AutoConfig.from_pretrained(str(directory))
        self.model_type = self.config.get_text_config().model_type
        self.store = open_store(directory)
        self.layout, self.format, self._names = None, None, None

    def experts_format(self, layers: list[int]) -> str:
        from ...checkpoints import FORMAT_OF, detect_layout

        E = _num_experts(self.config)
        try:
            self.layout = detect_layout(self.store, E, layers[0])
        except ValueError:  # no quantized experts: float weights, quantized to format= as they are read
            self.layout = "float"
            self.format = None
            return None
        self.format = FORMAT_OF[self.layout]
        return self.format

    def bind(self, model) -> list[str]:
        keys = set(self.store.keys())
        self._names = {n: n for n, _ in model.named_parameters() if n in keys}
        return [n for n, _ in model.named_parameters() if n not in keys]

    def read(self, hf_name: str):
        import torch

        t = self.store.get(hf_name, what="non-expert weight")
        base = hf_name[: -len(".weight")] if hf_name.endswith(".weight") else None
        if t.dtype == torch.float8_e4m3fn and base is not None and base + ".weight_scale_inv" in self.store:
            s = self.store.get(base + ".weight_scale_inv", what="non-expert weight scale").float()
            rows, cols = t.shape
            s = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            return (t.float() * s).to(torch.float32)
        if t.dtype == torch.uint8 and base is not None and base + ".weight_scale_2" in self.store:
            from ...checkpoints.nvfp4 import dequantize_weight

            return dequantize_weight(t, self.store.get(base + ".weight_scale"),
                                     self.store.get(base + ".weight_scale_2"))
        if not t.is_floating_point():
            raise ValueError(f"{self.where}: tensor {hf_name} is {t.dtype}, expected a float weight (or FP8 / NVFP4 "
                             "with its scales)")
        return t

    def expert_banks(self, layer: int, E: int, H: int, I: int, fmt: str | None = None) -> dict:  # noqa: E741
        from ...checkpoints import MODULE_OF, SUFFIX, naming

        if self.layout == "float":
            return self._float_banks(layer, E, H, I, fmt)
        suffix, fused = SUFFIX[self.layout]
        names = naming.resolve(self.store.keys(), layer, E, suffix, self.model_type, fused_suffix=fused)
        banks, _report = MODULE_OF[self.layout].load_layer(self.store, names, E, H, I, None, self.allow)
        self.store.close()  # the layer's pages leave the process's mappings (RSS stays what the banks hold)
        return banks

    def _float_banks(self, layer: int, E: int, H: int, I: int, fmt: str) -> dict:  # noqa: E741
        """Float experts (per expert gate / up / down, or fused) quantized to `fmt`, a few experts at a time."""
        from ...checkpoints import naming

        names = naming.resolve(self.store.keys(), layer, E, ".weight", self.model_type, fused_suffix="")
        spec = cf.get_format(fmt)
        out = {b.name: cf.aligned_empty(b.expected(E, H, I), b.dtypes[0], 64) for b in spec.banks}
        step = max(1, (64 << 20) // (12 * H * I))  # ~64 MB of float32 weights per call
        for e0 in range(0, E, step):
            e1 = min(E, e0 + step)
            if names.gate is not None:
                gu = np.stack([np.concatenate([self._f32(names.gate[e] + ".weight"),
                                               self._f32(names.up[e] + ".weight")]) for e in range(e0, e1)])
                dn = np.stack([self._f32(names.down[e] + ".weight") for e in range(e0, e1)])
            else:
                gu = self._f32(names.gate_up + ".weight")[e0:e1]
                dn = self._f32(names.down_fused + ".weight")[e0:e1]
            part = cf.quantize(fmt, gu, dn)
            for k, v in part.items():
                out[k][e0:e1] = v
        spec.validate(out)
        self.store.close()
        return out

    def _f32(self, name: str) -> np.ndarray:
        import torch

        return self.store.get(name, what="float expert weight").to(torch.float32).numpy()

    def tokenizer(self):
        from transformers import AutoTokenizer

        if not any((self.directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            return None
        try:
            return AutoTokenizer.from_pretrained(str(self.directory))
        except (ValueError, KeyError, OSError, TypeError):
            return None

    def close(self) -> None:
        self.store.close()


def _num_experts(config) -> int:
    c = config.get_text_config()
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(c, k, None):
            return int(getattr(c, k))
    raise ValueError(f"config of {c.model_type}: no expert count (num_experts / num_local_experts / n_routed_experts)")


def open_source(path, gguf_file=None, allow_nonfinite: bool = False):
    """The source for `path` (and gguf_file=); FileNotFoundError / ValueError naming what is wrong, before anything
    heavy is read."""
    directory, g = resolve(path, gguf_file)
    if g is not None:
        return GgufSource(directory, g)
    return SafetensorsSource(directory, allow_nonfinite)
