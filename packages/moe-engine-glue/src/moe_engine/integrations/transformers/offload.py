"""offload_experts: a loaded transformers model's routed experts through one MoERunner, transactionally (model_edit.py).

Thread contract: nothing may run or change the model while offload_experts runs; the runner it returns is
MoERunner's (shareable)."""
from __future__ import annotations

import gc
import logging
import os

import cpumoe_formats as cf

from ...progress import bar
from .adapter import FOLD_PAD, NAME, Binding, Offloaded, register
from .convert import banks_from_model
from .experts import decoder_layer, find_experts, inspect_experts

log = logging.getLogger("moe_engine")


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

    from ...runner import MoERunner
    from ..model_edit import ModelEdit

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
    layers = [decoder_layer(n, i) for i, (n, _) in enumerate(found)]
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
        from ... import checkpoints

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
        banks, report, down_biases = banks_from_model(found, specs, fmt, fold, device, progress, allow_nonfinite)
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
            from ...qualify import qualify_runner

            qualify_runner(runner, runner_kwargs.get("tp_group"), allow_nonfinite=True)
        # ---- commit: the model changes only now, all together or not at all (model_edit.py) -------------------
        out = Offloaded(runner, fmt, [n for n, _ in found], layers, source, report, fold)
        for i, (_, m) in enumerate(found):
            edit.bind(m, Binding(runner, i, first.H, first.E, down_biases[i] if fold else None,
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
