"""The changes offload_experts makes to a transformers model, applied together or not at all.

offload_experts first builds everything it needs (banks, the runner, its qualification) while only reading the
model; then ModelEdit.commit() makes the changes: the experts implementation selected (the one step transformers may
refuse, so it goes first), gpt-oss MXFP4 MLPs replaced, each experts module bound to the runner, its expert weights
freed, `model.moe_engine` set. If any of that raises, every change made so far is undone from the objects it kept
(the same Parameter objects go back), so the model is exactly as it was; the freed weights' memory is released only
once commit() has returned.

Thread contract: one thread at a time, and nothing may run the model while commit() does."""
from __future__ import annotations

_MISSING = object()
_IMPL = "_experts_implementation_internal"  # where transformers' config keeps the experts implementation


def free_weights(module) -> list[tuple]:
    """Replace every weight of an experts module by an empty tensor of the same dtype and device; returns what
    restore() puts back."""
    import torch

    saved = []
    for name, p in list(module._parameters.items()):
        if p is not None:
            saved.append(("param", name, p))
            module._parameters[name] = torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device),
                                                          requires_grad=False)
    for name in ("gate_up_proj", "down_proj"):  # Mxfp4GptOssExperts keeps Triton tensors as plain attributes
        if name in module.__dict__:
            saved.append(("attr", name, module.__dict__[name]))
            module.__dict__[name] = None
    return saved


def restore(module, saved: list[tuple]) -> None:
    for kind, name, value in saved:
        if kind == "param":
            module._parameters[name] = value
        else:
            module.__dict__[name] = value


def _configs(model, modules) -> list:
    """Every config set_experts_implementation may write: the model's, its sub-models', the experts modules'."""
    from transformers import PreTrainedModel

    out, seen = [], set()
    cands = [model.config] + [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    cands += [getattr(m, "config", None) for m in modules]
    for c in cands:
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            out.append(c)
    return out


class ModelEdit:
    """Changes to one model, recorded by swap() / bind() / free() and applied by commit(implementation, attrs)."""

    def __init__(self, model):
        self.model = model
        self._swaps: list[tuple[str, object]] = []
        self._binds: list[tuple[object, object]] = []
        self._frees: list[object] = []
        self._undo: list = []

    def swap(self, name: str, module) -> None:
        """Replace the submodule `name` by `module`."""
        self._swaps.append((name, module))

    def bind(self, module, binding) -> None:
        """Give an experts module its runner binding (module._moe_engine)."""
        self._binds.append((module, binding))

    def free(self, module) -> None:
        """Free an experts module's weights."""
        self._frees.append(module)

    def commit(self, implementation: str, attrs: dict) -> None:
        """Select `implementation`, make the recorded changes, set `attrs` on the model; on any error undo them all
        and re-raise."""
        model = self.model
        try:
            modules = [m for m, _ in self._binds]
            for c in _configs(model, modules):
                old = c.__dict__.get(_IMPL, _MISSING)
                self._undo.append(lambda c=c, old=old: c.__dict__.pop(_IMPL, None) if old is _MISSING
                                  else c.__dict__.__setitem__(_IMPL, old))
            model.set_experts_implementation(implementation)
            wrong = [type(m).__name__ for m in modules if getattr(getattr(m, "config", None),
                                                                   "_experts_implementation", implementation)
                     != implementation]
            if wrong:
                raise RuntimeError(f"set_experts_implementation({implementation!r}) did not reach {wrong[:3]} (their "
                                   "config's _experts_implementation differs); is this model's experts module "
                                   "dispatched?")
            for name, new in self._swaps:
                old = model.get_submodule(name)
                model.set_submodule(name, new)
                self._undo.append(lambda name=name, old=old: model.set_submodule(name, old))
            for m, b in self._binds:
                m.__dict__["_moe_engine"] = b
                self._undo.append(lambda m=m: m.__dict__.pop("_moe_engine", None))
            for m in self._frees:
                saved = free_weights(m)
                self._undo.append(lambda m=m, saved=saved: restore(m, saved))
            for k, v in attrs.items():
                old = model.__dict__.get(k, _MISSING)
                model.__dict__[k] = v
                self._undo.append(lambda k=k, old=old: model.__dict__.pop(k, None) if old is _MISSING
                                  else model.__dict__.__setitem__(k, old))
        except BaseException:
            self.rollback()
            raise
        self._undo.clear()  # drops the freed weights

    def rollback(self) -> None:
        while self._undo:
            self._undo.pop()()


__all__ = ["ModelEdit", "free_weights", "restore"]
