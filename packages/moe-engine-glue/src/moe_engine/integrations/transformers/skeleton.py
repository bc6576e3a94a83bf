"""The model without its weights, then its non-expert weights put where they run.

The skeleton is transformers' own model class built from the config with every parameter on the meta device
(accelerate's init_empty_weights; buffers such as rope frequencies are computed for real), so nothing is allocated
for the routed experts, ever. Each non-expert parameter is then read from the checkpoint, checked against the
skeleton's shape and put on its device in the model's dtype; the experts modules keep empty parameters and are
served by a MoERunner.

Thread contract: plain functions over the model they are given; one model is built by one thread."""
from __future__ import annotations

import numpy as np

from ...progress import bar


def build(config, dtype):
    """transformers' model for `config`, every parameter on the meta device."""
    try:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ImportError(f"moe_engine.from_pretrained needs transformers >= 5 and accelerate ({e}); install them "
                          "with: pip install 'moe-engine-glue[transformers]'") from e
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def empty_experts(modules, device) -> None:
    """Every parameter of the experts modules becomes an empty tensor on `device` (their weights live in banks)."""
    import torch

    for m in modules:
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=device),
                                                         requires_grad=False)


def non_expert_names(model, experts_prefixes: list[str]) -> list[str]:
    """Parameters of `model` outside its experts modules (tied parameters once)."""
    pre = tuple(p + "." for p in experts_prefixes)
    return [n for n, _ in model.named_parameters() if not n.startswith(pre)]


def load(model, names: list[str], read, device, dtype, where: str, progress: bool = True) -> int:
    """Put each parameter `names` of `model` on `device` in `dtype`, its values from read(name) (a float numpy array
    or torch tensor); the skeleton's shape is checked first. Returns the bytes placed."""
    import torch

    total = 0
    with bar(total=len(names), desc=f"moe_engine: non-expert weights -> {device}", unit="tensor",
             disable=not progress) as pb:
        for name in names:
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            want = tuple(mod._parameters[attr].shape)
            a = read(name)
            t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
            if tuple(t.shape) != want and t.numel() == int(np.prod(want)) and len(want) != len(t.shape):
                t = t.reshape(want)  # a [1, H] gate stored as [H] (GGUF drops unit dimensions)
            if tuple(t.shape) != want:
                raise ValueError(f"{where}: tensor for {name}: shape {tuple(t.shape)}, expected {want} (the model's "
                                 "config and the checkpoint disagree)")
            keep = dtype if t.is_floating_point() else t.dtype
            mod._parameters[attr] = torch.nn.Parameter(t.to(device=device, dtype=keep), requires_grad=False)
            total += mod._parameters[attr].numel() * mod._parameters[attr].element_size()
            pb.update(1)
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    return total


def place_buffers(model, device) -> int:
    """Every buffer of `model` onto `device` (the skeleton computes them on the CPU: rope's inv_freq, ...). A buffer
    left on the CPU under GPU weights costs a host-to-device copy per use, and torch.compile's cudagraphs backend
    skips capturing the whole step for it. Returns how many moved."""
    moved = 0
    for m in model.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)
                moved += 1
    return moved


def meta_left(model) -> list[str]:
    """Parameters and buffers still on the meta device (none may be when the model runs)."""
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
