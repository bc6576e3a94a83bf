"""moe_engine behind Hugging Face transformers' experts dispatch (transformers >= 5).

transformers 5 runs every experts module decorated with `@use_experts_implementation` through a registered function
chosen by `config._experts_implementation` (`ExpertsInterface`, `ALL_EXPERTS_FUNCTIONS`; FP8 block checkpoints swap in
`FP8Experts`, dispatched through `FP8ExpertsInterface`). Importing this module registers the name "moe_engine" in both;
`offload_experts(model, ...)` then converts every experts module's weights into banks once, builds one MoERunner for all
of the model's MoE layers (one CPU executor), frees the modules' expert weights and selects "moe_engine" with
`model.set_experts_implementation`. Routers, shared experts (DeepSeek-V3, Qwen3-Next, Qwen3.5), routed_scaling_factor
(applied by DeepSeek-V3's router to the weights it passes), attention and caches stay as transformers runs them.

gpt-oss's MXFP4 experts (`Mxfp4GptOssExperts`, loaded only where the hub's Triton kernels are) are not dispatched:
their MLP calls the kernels directly, on Triton-swizzled weights. offload_experts replaces each such MLP with
transformers' own `GptOssMLP` around the same router and a decorated `GptOssExperts` (no weights), as transformers'
quantizers replace modules, and reads the experts from the checkpoint's `*_blocks` / `*_scales` (exact). Elsewhere
transformers loads MXFP4 (and FP8, GGUF) checkpoints dequantized into the decorated modules: pass `checkpoint=` to
read the experts in their shipped layout instead of requantizing the dequantized values (moe_engine.checkpoints).

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    offload_experts(model, format="fp8_block", strategy="cpu")    # or checkpoint=path (its own layout)
    model.generate(...)

Architectures and how their experts map onto a format (banks: gate rows then up rows, router weight on the output):
  Qwen3MoeExperts, MixtralExperts, DeepseekV3Experts, Qwen3NextExperts, Qwen3_5MoeExperts: gate_up [E, 2I, H]
    (gate; up), down [E, H, I], activation config.hidden_act (silu)
  GptOssExperts: gate_up [E, H, 2I] with columns interleaved (gate 2j, up 2j+1), down [E, I, H], biases;
    swigluoai(alpha, limit)
  FP8Experts: e4m3 gate_up / down with fp32 128x128 scale_inv; the activation its _apply_gate computes
gpt-oss's biases go into mxfp4's bias banks; a format without them (bf16, fp8_block, q4_0, ...) gets the gate_up bias
as one more input column (x gains a constant 1 and zeros up to a multiple of 32: exact) and the down bias added after
the executor, weighted by each route's router weight (sum_k w_k b[e_k], as transformers adds it).
"""
from __future__ import annotations

import gc
import logging
import os
import re
from dataclasses import dataclass, field

import numpy as np

import cpumoe_formats as cf

from ..progress import bar

log = logging.getLogger("moe_engine")
NAME = "moe_engine"
FOLD_PAD = 32  # gpt-oss's gate_up bias as input column H, zeros to H + 32: keeps H a multiple of 32 (q4_0, mxfp4)
CHUNK_BYTES = 64 << 20  # float32 weights converted per call
_HF_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_STANDARD = ("Qwen3MoeExperts", "MixtralExperts", "DeepseekV3Experts", "Qwen3NextExperts", "Qwen3_5MoeExperts")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The registered experts function: fn(experts module, hidden_states [T, H], top_k_index [T, K], top_k_weights).
    transformers' (index, weights) order becomes moe_engine's (weights, ids) here, at the boundary."""
    import torch

    b = self.__dict__.get("_moe_engine")
    if b is None:
        raise RuntimeError(f"{type(self).__name__}: experts_implementation={NAME!r} but this module's experts were not "
                           "converted; call moe_engine.integrations.transformers.offload_experts(model, ...) first")
    if b.plain and not torch.compiler.is_compiling():  # the decode path: straight to the runner
        return b.runner.forward(b.layer, hidden_states, top_k_weights, top_k_index)
    return b(hidden_states, top_k_weights, top_k_index)


def register() -> None:
    """Register NAME in transformers' ExpertsInterface and FP8ExpertsInterface (idempotent; done on import)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError(f"moe_engine's transformers integration needs transformers >= 5 with its experts dispatch "
                          f"({e}); install it with: pip install 'moe-engine-glue[transformers]'") from e

    ExpertsInterface.register(NAME, experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers without FP8 experts
        return
    FP8ExpertsInterface.register(NAME, experts_forward)


# ---- what one experts module holds -------------------------------------------------------------------------------
@dataclass
class ExpertsSpec:
    """One experts module as its architecture stores it."""

    kind: str  # standard | gpt_oss | fp8 | mxfp4_triton
    E: int
    H: int
    I: int  # noqa: E741
    activation: str
    alpha: float | None = None
    limit: float | None = None
    bias: bool = False


def _hf_activation(config, module) -> str:
    name = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if name not in _HF_ACT:
        raise NotImplementedError(f"{type(module).__name__}: hidden_act={name!r} has no moe_engine activation; "
                                  f"expected one of {sorted(_HF_ACT)}")
    return _HF_ACT[name]


def inspect_experts(module) -> ExpertsSpec:
    """How `module` stores its experts and which activation they use; raises for anything not mapped exactly."""
    cls = type(module).__name__
    names = {c.__name__ for c in type(module).__mro__}
    if "Mxfp4GptOssExperts" in names:
        return ExpertsSpec("mxfp4_triton", module.num_experts, module.hidden_size, module.intermediate_size,
                           "swigluoai", float(module.alpha), float(module.limit), True)
    if "FP8Experts" in names:
        return _inspect_fp8(module)
    if not hasattr(module, "is_transposed"):
        raise NotImplementedError(f"{cls}: not an experts module transformers dispatches (@use_experts_implementation)")
    if not module.has_gate or getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"{cls}: experts without a gate or with a post-expert norm have no moe_engine format")
    gu = module.gate_up_proj
    if cls == "GptOssExperts" or (module.is_transposed and not module.is_concatenated and module.has_bias
                                  and hasattr(module, "alpha") and hasattr(module, "limit")):
        E, H, I2 = gu.shape
        return ExpertsSpec("gpt_oss", E, H, I2 // 2, "swigluoai", float(module.alpha), float(module.limit), True)
    from transformers.integrations.moe import _default_apply_gate

    if module.is_transposed or not module.is_concatenated or module.has_bias:
        raise NotImplementedError(f"{cls}: is_transposed={module.is_transposed} is_concatenated="
                                  f"{module.is_concatenated} has_bias={module.has_bias} is not a mapped layout")
    if cls not in _STANDARD and getattr(type(module), "_apply_gate", None) is not _default_apply_gate:
        raise NotImplementedError(f"{cls}: a custom _apply_gate has no exact moe_engine activation")
    E, I2, H = gu.shape
    return ExpertsSpec("standard", E, H, I2 // 2, _hf_activation(module.config, module))


def _inspect_fp8(module) -> ExpertsSpec:
    cls = type(module).__name__
    if not module.has_gate or module.has_bias:
        raise NotImplementedError(f"{cls}: FP8 experts without a gate or with biases are not mapped")
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise NotImplementedError(f"{cls}: activation_scheme={module.activation_scheme!r} (static activation scales) "
                                  "is not an fp8_block mode (W8A16)")
    if getattr(module, "gate_softcap", None) is not None or getattr(module, "limit_after_act", False):
        raise NotImplementedError(f"{cls}: softcapped / limit-after-activation gates have no moe_engine activation")
    fp8 = module.gate_up_proj.element_size() == 1
    if fp8 and tuple(module.block_size or ()) != (128, 128):
        raise NotImplementedError(f"{cls}: block_size={module.block_size}, expected (128, 128) (fp8_block)")
    E, I2, H = module.gate_up_proj.shape
    kind = "fp8" if fp8 else "standard"
    alpha, limit = getattr(module, "swiglu_alpha", None), getattr(module, "limit", None)
    if alpha is not None:
        return ExpertsSpec(kind, E, H, I2 // 2, "swigluoai", float(alpha), float(limit))
    act = _hf_activation(module.config, module)
    if limit is not None:
        if act != "silu":
            raise NotImplementedError(f"{cls}: a clamped {act} gate has no moe_engine activation")
        return ExpertsSpec(kind, E, H, I2 // 2, "swiglu_clamp", 1.0, float(limit))
    return ExpertsSpec(kind, E, H, I2 // 2, act)


def find_experts(model) -> list[tuple[str, object]]:
    """(qualified name, module) of every experts module, in model order."""
    out = []
    for name, m in model.named_modules():
        names = {c.__name__ for c in type(m).__mro__}
        if "Mxfp4GptOssExperts" in names or "FP8Experts" in names or (
                hasattr(m, "is_transposed") and hasattr(m, "has_gate") and hasattr(m, "gate_up_proj")):
            out.append((name, m))
    return out


def _decoder_layer(name: str, default: int) -> int:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else default


# ---- weights -> banks ----------------------------------------------------------------------------------------------
def _f32(t) -> np.ndarray:
    import torch

    return t.detach().to("cpu", torch.float32).numpy()


def _float_chunk(module, spec: ExpertsSpec, e0: int, e1: int):
    """Experts e0..e1 as float32 numpy: gate_up [n, 2I, H] (gate rows, up rows), down [n, H, I], biases or None."""
    import torch

    if spec.kind == "gpt_oss":
        w = module.gate_up_proj[e0:e1].detach()
        gu = torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1).transpose(1, 2)
        b = module.gate_up_proj_bias[e0:e1].detach()
        return (_f32(gu), _f32(module.down_proj[e0:e1].transpose(1, 2)),
                _f32(torch.cat([b[:, 0::2], b[:, 1::2]], dim=-1)), _f32(module.down_proj_bias[e0:e1]))
    if spec.kind == "fp8":  # requantizing FP8 experts to another format: their exact values first
        return _fp8_values(module.gate_up_proj[e0:e1], module.gate_up_proj_scale_inv[e0:e1]), _fp8_values(
            module.down_proj[e0:e1], module.down_proj_scale_inv[e0:e1]), None, None
    return _f32(module.gate_up_proj[e0:e1]), _f32(module.down_proj[e0:e1]), None, None


def _fp8_values(codes, scale) -> np.ndarray:
    """e4m3 codes [n, R, K] times their 128x128 block scales [n, nb(R), nb(K)], float32."""
    w = codes.detach().to("cpu").float()
    s = scale.detach().to("cpu").float()
    s = s.repeat_interleave(128, 1)[:, :w.shape[1]].repeat_interleave(128, 2)[:, :, :w.shape[2]]
    return (w * s).numpy()


def _fold(gu, dn, gub):
    """gate_up bias as input column H (x gets a 1 there), zero columns to H + FOLD_PAD; down gets zero rows."""
    n, I2, H = gu.shape
    gu2 = np.zeros((n, I2, H + FOLD_PAD), np.float32)
    gu2[:, :, :H], gu2[:, :, H] = gu, gub
    dn2 = np.zeros((n, H + FOLD_PAD, dn.shape[2]), np.float32)
    dn2[:, :H] = dn
    return gu2, dn2


def _quantize_module(module, spec: ExpertsSpec, fmt: str, fold: bool, tick) -> dict:
    fspec = cf.get_format(fmt)
    per_expert = 4 * 3 * spec.H * spec.I
    chunk = max(1, min(spec.E, CHUNK_BYTES // per_expert))
    out = None
    for e0 in range(0, spec.E, chunk):
        e1 = min(spec.E, e0 + chunk)
        gu, dn, gub, dnb = _float_chunk(module, spec, e0, e1)
        if gub is not None and "gate_up_bias" in fspec.bank_names:
            part = cf.quantize(fmt, gu, dn, gate_up_bias=gub, down_bias=dnb)
        else:
            if fold:
                gu, dn = _fold(gu, dn, gub)
            part = cf.quantize(fmt, gu, dn)
        if out is None:
            out = {k: cf.aligned_empty((spec.E,) + np.shape(v)[1:], np.asarray(v).dtype, 64) for k, v in part.items()}
        for k, v in part.items():
            out[k][e0:e1] = v
        tick(e1 - e0)
    fspec.validate(out)
    return out


# ---- the per-module call -----------------------------------------------------------------------------------------
class _Binding:
    """One experts module's call into the shared runner: layer index, gpt-oss's folded biases, EP sentinels."""

    def __init__(self, runner, layer: int, H: int, E: int, down_bias=None, expert_parallel: bool = False):
        self.runner, self.layer, self.H, self.E = runner, layer, H, E
        self.down_bias = down_bias  # [E, H] float32 on the activations' device when the gate_up bias is folded
        self.expert_parallel = expert_parallel
        self.plain = down_bias is None and not expert_parallel  # nothing to add around the runner's call
        self._pad = None
        if down_bias is not None:
            import torch

            pad = torch.zeros(1, FOLD_PAD, device=down_bias.device)
            pad[0, 0] = 1.0
            self._pad = pad

    def __call__(self, x, w, ids):
        import torch

        if self.expert_parallel:  # other ranks' experts are ids >= E: no route here
            ids = ids.masked_fill(ids >= self.E, -1)
        xin = x if self._pad is None else torch.cat([x, self._pad.to(x.dtype).expand(x.shape[0], -1)], dim=1)
        if torch.compiler.is_compiling():
            y = self.runner.op(self.layer, xin, w, ids)  # one opaque node for dynamo / inductor
        else:
            y = self.runner.forward(self.layer, xin, w, ids)
        if self._pad is None:
            return y
        bias = (w.float().unsqueeze(-1) * self.down_bias[ids.clamp(min=0).long()]).masked_fill(
            (ids < 0).unsqueeze(-1), 0.0).sum(1)
        return (y[:, :self.H].float() + bias).to(x.dtype)


@dataclass
class Offloaded:
    """What offload_experts did: the runner (all MoE layers), the modules it serves, where the banks came from."""

    runner: object
    format: str
    modules: list  # qualified names, runner layer i = modules[i]
    decoder_layers: list
    source: str  # "model weights" or "<layout> checkpoint <path>"
    report: dict = field(default_factory=dict)  # per decoder layer: the loader's exactness / measured rounding
    folded_bias: bool = False

    def deviation(self) -> dict:
        from ..checkpoints import max_deviation

        return max_deviation(self.report)

    def close(self) -> None:
        self.runner.close()


def _mxfp4_replacements(model, found, edit) -> list:
    """Mxfp4GptOssMLP(router, Mxfp4GptOssExperts) -> GptOssMLP(router, GptOssExperts without weights), recorded in
    `edit` (applied at commit); returns `found` with the new experts modules in place of the replaced ones."""
    import torch

    out = []
    for name, m in found:
        if "Mxfp4GptOssExperts" not in {c.__name__ for c in type(m).__mro__}:
            out.append((name, m))
            continue
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssMLP

        parent_name = name.rsplit(".", 1)[0]
        parent = model.get_submodule(parent_name)
        cfg = parent.experts.__dict__.get("config", None) or model.config.get_text_config()
        with torch.device("meta"):
            experts = GptOssExperts(cfg)
        mlp = GptOssMLP.__new__(GptOssMLP)
        torch.nn.Module.__init__(mlp)
        mlp.router, mlp.experts = parent.router, experts
        edit.swap(parent_name, mlp)
        out.append((name, experts))
    return out


def _model_device(model):
    emb = model.get_input_embeddings()
    return emb.weight.device if emb is not None else next(model.parameters()).device


def _refuse_offloaded(model, found) -> None:
    """offload_experts runs once per model: a second call would find the first one's modules without weights."""
    bound = [n for n, m in found if "_moe_engine" in m.__dict__]
    prior = model.__dict__.get("moe_engine")
    if bound or prior is not None:
        what = f" ({prior.format}, strategy {prior.runner.strategy})" if isinstance(prior, Offloaded) else ""
        raise ValueError(f"{type(model).__name__}: its experts are already offloaded to moe_engine{what}: "
                         f"model.moe_engine holds the runner. offload_experts converts a model once; for another "
                         "format or strategy, load the model again")
    empty = [n for n, m in found if any(p.numel() == 0 for p in m.parameters(recurse=False))]
    if empty:
        raise ValueError(f"{empty[0]}: its expert weights are empty (freed?); offload_experts needs the loaded "
                         "weights, or checkpoint= with the module shapes intact")


def _banks_from_model(found, specs, fmt: str, fold: bool, device, progress: bool, allow_nonfinite: bool):
    """Banks of every experts module (its weights only read), the per-layer reports and gpt-oss's folded down
    biases."""
    import torch

    banks, down_biases, report = [], [], {}
    with bar(total=specs[0].E * len(found), desc=f"moe_engine: experts -> {fmt}", unit="expert",
             disable=not progress) as pb:
        for (name, m), s in zip(found, specs):
            if s.kind == "fp8" and fmt == "fp8_block":
                from ..checkpoints import fp8_block

                b, rep = fp8_block.bank_from_tensors(m.gate_up_proj, m.gate_up_proj_scale_inv, m.down_proj,
                                                     m.down_proj_scale_inv, pb.update, where=name,
                                                     allow_nonfinite=allow_nonfinite)
                report[_decoder_layer(name, len(banks))] = rep
            else:
                b = _quantize_module(m, s, fmt, fold, pb.update)
            banks.append(b)
            if fold:
                down_biases.append(m.down_proj_bias.detach().to(device, torch.float32).clone())
    return banks, report, down_biases


def offload_experts(model, format: str | None = None, strategy: str = "auto", *, checkpoint=None,  # noqa: A002
                    residency=None, threads: int | None = None, device=None, progress: bool = True,
                    allow_nonfinite: bool = False, **runner_kwargs) -> Offloaded:
    """Run `model`'s routed experts through one moe_engine MoERunner.

    format: the banks' format (bf16, fp8_block, q4_0, nvfp4, mxfp4, ds_fp4) quantized from the modules' weights;
        default: fp8_block for FP8Experts, mxfp4 for gpt-oss, else bf16. With checkpoint=, the checkpoint's layout
        decides (fp8_block, mxfp4, nvfp4, q4_0) and format may only repeat it.
    checkpoint: a safetensors file / directory or a .gguf file to read the experts from, in their shipped layout
        (moe_engine.checkpoints); needed for Mxfp4GptOssExperts (default there: the model's own directory).
    strategy, residency, threads: MoERunner's (cpu | hybrid | gpu | auto; GPU-resident experts; CPU workers).
    device: where the activations live (default: the input embeddings' device).
    allow_nonfinite: load checkpoint / FP8Experts scales that are NaN or Inf instead of refusing them (a
        CheckpointError naming the file, tensor and layer); start-up qualification then accepts NaN / Inf outputs
        where the float64 reference has them. Tokens routed through such experts compute NaN / Inf.
    runner_kwargs: the rest of MoERunner's keywords (graph_batch_sizes, max_tokens, mode, isa, handshake, qualify,
        capacity, prefill, tp_group).

    Transactional: the banks, the runner and its start-up qualification are built while the model is only read; the
    model changes (weights freed, modules bound, implementation selected) only after all of it succeeded, and an
    error at any point leaves the model exactly as it was. The price is peak memory: the experts' weights stay in the
    model until the banks and the runner exist, so the peak holds both (the banks' bytes above what the model held).
    A model offloaded once is refused (ValueError): load it again to change format or strategy.

    Thread contract: nothing may run or change the model while this runs (it reads the weights, then edits it);
    the returned runner is shareable (MoERunner's contract).
    """
    import torch

    from ..runner import MoERunner
    from .model_edit import ModelEdit

    register()
    found = find_experts(model)
    if not found:
        raise ValueError(f"{type(model).__name__}: no experts module transformers dispatches (no "
                         "@use_experts_implementation class, FP8Experts or Mxfp4GptOssExperts)")
    _refuse_offloaded(model, found)
    specs = [inspect_experts(m) for _, m in found]
    kinds = {s.kind for s in specs}
    first = specs[0]
    for (name, _), s in zip(found, specs):
        if (s.E, s.H, s.I, s.activation, s.alpha, s.limit) != (first.E, first.H, first.I, first.activation,
                                                                first.alpha, first.limit):
            raise ValueError(f"{name}: experts {s} differ from {found[0][0]}'s {first}; one runner serves one shape")
    layers = [_decoder_layer(n, i) for i, (n, _) in enumerate(found)]
    device = torch.device(device) if device is not None else _model_device(model)
    mtype = getattr(getattr(found[0][1], "config", None) or model.config, "model_type", None)
    if "mxfp4_triton" in kinds and checkpoint is None:
        guess = getattr(model.config, "_name_or_path", None)
        if not guess or not os.path.isdir(guess):
            raise ValueError("gpt-oss's MXFP4 experts (Mxfp4GptOssExperts) hold Triton-swizzled weights; pass "
                             "checkpoint=<the model's safetensors directory> to read its *_blocks / *_scales")
        checkpoint = guess
    edit = ModelEdit(model)
    down_biases = []
    # ---- build: the model is only read --------------------------------------------------------------------------
    if checkpoint is not None:
        from .. import checkpoints

        with bar(total=first.E * len(found), desc=f"moe_engine: reading experts from {checkpoint}", unit="expert",
                 disable=not progress) as pb:
            loaded = checkpoints.load_experts(checkpoint, layers, E=first.E, H=first.H, I=first.I,
                                              model_type=mtype, progress=pb.update, allow_nonfinite=allow_nonfinite)
        if format is not None and cf.get_format(format).name != loaded.format:
            raise ValueError(f"format={format!r}, but the checkpoint's experts are {loaded.layout} (format "
                             f"{loaded.format!r}); omit format= or pass {loaded.format!r}")
        fmt, banks, report = loaded.format, loaded.banks, loaded.report
        source = f"{loaded.layout} checkpoint {checkpoint}"
        if fmt != "mxfp4" and first.bias:
            raise ValueError(f"{loaded.layout} checkpoint for experts with biases: only mxfp4 banks hold them")
        fold = False
        found = _mxfp4_replacements(model, found, edit)
    else:
        fmt = format or ("fp8_block" if kinds == {"fp8"} else "mxfp4" if first.bias else "bf16")
        fspec = cf.get_format(fmt)
        fmt, source = fspec.name, "model weights"
        fold = first.bias and "gate_up_bias" not in fspec.bank_names
        fspec.check_dims(first.H + (FOLD_PAD if fold else 0), first.I)
        banks, report, down_biases = _banks_from_model(found, specs, fmt, fold, device, progress, allow_nonfinite)
    act = dict(activation=first.activation, alpha=first.alpha, limit=first.limit)
    if act["activation"] not in ("swigluoai", "swiglu_clamp"):
        act.pop("alpha"), act.pop("limit")
    cfg = getattr(found[0][1], "config", None) or model.config.get_text_config()
    top_k = int(cfg.num_experts_per_tok)
    qualify = runner_kwargs.pop("qualify", True)
    # allow_nonfinite qualifies here, accepting NaN / Inf where the reference has them (qualify.py)
    runner = MoERunner(fmt, banks, top_k=top_k, strategy=strategy, device=device, residency=residency,
                       threads=threads, progress=progress, qualify=qualify and not allow_nonfinite, **act,
                       **runner_kwargs)
    del banks
    try:
        if qualify and allow_nonfinite:
            from ..qualify import qualify_runner

            qualify_runner(runner, runner_kwargs.get("tp_group"), allow_nonfinite=True)
        # ---- commit: the model changes only now, all together or not at all (model_edit.py) -------------------
        out = Offloaded(runner, fmt, [n for n, _ in found], layers, source, report, fold)
        for i, (_, m) in enumerate(found):
            edit.bind(m, _Binding(runner, i, first.H, first.E, down_biases[i] if fold else None,
                                  bool(getattr(m, "_is_expert_parallel", False))))
            edit.free(m)
        # model.moe_engine keeps the runner alive with the model (the custom op holds it weakly)
        edit.commit(NAME, {"moe_engine": out})
    except BaseException:
        runner.close()
        raise
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log.info("%d experts modules of %s -> %s (%s); %s", len(found), type(model).__name__, fmt, source,
             runner.describe())
    return out


try:  # registering needs transformers; importing this module without it still gives the helpers a clear error
    register()
except ImportError:  # pragma: no cover
    pass

__all__ = ["NAME", "ExpertsSpec", "Offloaded", "experts_forward", "find_experts", "inspect_experts",
           "offload_experts", "register"]
