"""offload_experts is transactional: a failure at any point (a bad format, a checkpoint that does not match or is
corrupted, the banks half built, the runner refusing its arguments, start-up qualification, the model edit itself)
leaves the model exactly as it was: every parameter and buffer the same object with the same values, every module
of the same type, the experts implementation unchanged, nothing bound. A second offload of one model is refused, and
a residency strategy 'cpu' cannot hold is refused through offload_experts too. After all the failures the same model
offloads and matches its untouched copy."""
from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")

import checkpoint_writers as cw  # noqa: E402
import hf_models as hm  # noqa: E402
from test_transformers import LAYER_TOL, QUANT_TOL  # noqa: E402

from moe_engine import checkpoints, qualify  # noqa: E402
from moe_engine.integrations import model_edit  # noqa: E402
from moe_engine.integrations import transformers as mt  # noqa: E402
from moe_engine.integrations.transformers import convert  # noqa: E402

KW = dict(strategy="cpu", threads=2, progress=False)


def snapshot(model) -> dict:
    """What 'exactly as it was' compares: tensors (object, dtype, shape, device, values), module types, each experts
    module's attributes, the configs' experts implementation, the model's moe_engine attribute."""
    tensors = {}
    for n, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                model.named_buffers(remove_duplicate=False)):
        tensors[n] = (id(t), t.dtype, tuple(t.shape), t.device, None if t.is_meta else t.detach().clone())
    return {"tensors": tensors, "types": {n: type(m) for n, m in model.named_modules()},
            "dicts": {n: sorted(m.__dict__) for n, m in mt.find_experts(model)},
            "impl": [c._experts_implementation for c in model_edit._configs(model, [])],
            "moe_engine": "moe_engine" in model.__dict__}


def assert_unchanged(model, before: dict, label: str = "") -> None:
    after = snapshot(model)
    for k in ("types", "dicts", "impl", "moe_engine"):
        assert after[k] == before[k], (label, k)
    assert after["tensors"].keys() == before["tensors"].keys(), label
    for n, (i, dt, shape, dev, v) in before["tensors"].items():
        i2, dt2, shape2, dev2, v2 = after["tensors"][n]
        assert (i2, dt2, shape2, dev2) == (i, dt, shape, dev), (label, n)
        assert v is None or torch.equal(v, v2), (label, n)


def _raise_on_call(n: int, fn, exc=None):
    """fn, except that its n-th call raises exc (default RuntimeError('injected'))."""
    calls = []

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise exc or RuntimeError("injected")
        return fn(*a, **k)
    return wrapped


def _failures(tmp_path, model):
    """(label, offload kwargs, patch(monkeypatch) or None, the error and message expected) at every stage."""
    ckpt = cw.write_fp8(model, tmp_path / "fp8.safetensors")[0]
    small = cw.write_fp8(hm.build("qwen3_moe", experts=4, top_k=2), tmp_path / "e4.safetensors")[0]
    nan = cw.poke(ckpt, tmp_path / "nan.safetensors", cw.safetensors_index(ckpt)[1][
        f"model.layers.{cw.LAYER}.mlp.experts.3.up_proj.weight_scale_inv"][2], b"\x00\x00\xc0\x7f")
    tol0 = {"native": 0.0, "w4a8": 0.0}
    return [
        ("bad format", dict(format="nope"), None, ValueError, "nope"),
        ("checkpoint of other experts", dict(checkpoint=small), None, KeyError, "expert tensors missing"),
        ("format against checkpoint", dict(checkpoint=ckpt, format="q4_0"), None, ValueError, "format='q4_0'"),
        ("NaN scale in the checkpoint", dict(checkpoint=nan), None, checkpoints.CheckpointError, "NaN or Inf"),
        ("banks half built", dict(format="q4_0"),
         lambda m: m.setattr(convert, "quantize_module", _raise_on_call(2, convert.quantize_module)),
         RuntimeError, "injected"),
        ("runner: residency=1.5", dict(residency=1.5), None, ValueError, "residency"),
        ("runner: residency of the wrong length", dict(residency=[[False] * hm.E]), None, ValueError, "residency"),
        ("qualification", dict(format="bf16"), lambda m: m.setattr(qualify, "TOLERANCE", tol0),
         RuntimeError, "start-up qualification failed"),
        ("qualification, allow_nonfinite", dict(format="bf16", allow_nonfinite=True),
         lambda m: m.setattr(qualify, "TOLERANCE", tol0), RuntimeError, "start-up qualification failed"),
        ("commit: set_experts_implementation", dict(format="bf16"),
         lambda m: m.setattr(model, "set_experts_implementation", _raise_on_call(1, None)),
         RuntimeError, "injected"),
        ("commit: freeing the second module", dict(checkpoint=ckpt),
         lambda m: m.setattr(model_edit, "free_weights", _raise_on_call(2, model_edit.free_weights)),
         RuntimeError, "injected"),
    ]


def test_failures_leave_the_model_as_it_was(tmp_path, monkeypatch):
    model = hm.build("qwen3_moe")
    ref = hm.clone(model)
    before = snapshot(model)
    for label, kw, patch, exc, match in _failures(tmp_path, model):
        with monkeypatch.context() as m:  # the patch is undone after its case
            if patch is not None:
                patch(m)
            with pytest.raises(exc, match=match):
                mt.offload_experts(model, **{**KW, **kw})
        assert_unchanged(model, before, label)
    off = mt.offload_experts(model, format="bf16", **KW)  # the model still offloads, and computes as before
    assert off.runner.num_layers == 2 and model.moe_engine is off
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < LAYER_TOL, name


def test_mxfp4_mlp_swap_is_undone(tmp_path, monkeypatch):
    """gpt-oss's Mxfp4GptOssMLP stays when the runner or the edit fails; the swap happens only on success."""
    model = hm.build("gpt_oss")
    ckpt = cw.write_mxfp4(model, tmp_path / "model.safetensors")
    ref = cw.mxfp4_reference(model, ckpt)
    cw.as_mxfp4_triton(model)
    before = snapshot(model)
    with pytest.raises(ValueError, match="residency"):
        mt.offload_experts(model, checkpoint=ckpt, residency=1.5, **KW)
    assert_unchanged(model, before)
    with monkeypatch.context() as m:
        m.setattr(model_edit, "free_weights", _raise_on_call(2, model_edit.free_weights))
        with pytest.raises(RuntimeError, match="injected"):
            mt.offload_experts(model, checkpoint=ckpt, **KW)
    assert_unchanged(model, before)
    off = mt.offload_experts(model, checkpoint=ckpt, **KW)
    assert off.format == "mxfp4" and [type(la.mlp).__name__ for la in model.model.layers] == ["GptOssMLP"] * 2
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < QUANT_TOL, name


def test_second_offload_is_refused():
    model = hm.build("mixtral")
    ref = hm.clone(model)
    off = mt.offload_experts(model, format="bf16", **KW)
    after_first = snapshot(model)
    with pytest.raises(ValueError, match=r"already offloaded to moe_engine \(bf16, strategy cpu\)"):
        mt.offload_experts(model, format="q4_0", **KW)
    assert_unchanged(model, after_first)
    assert model.moe_engine is off and off.runner.executor is not None  # the first runner still serves
    for name, y_ref, y in hm.layer_pairs(ref, model, hm.prompt()):
        assert hm.rel(y.float(), y_ref.float()) < LAYER_TOL, name


def test_freed_weights_are_named():
    """A module whose weights were emptied some other way says so, instead of failing to unpack its shape."""
    model = hm.build("qwen3_moe")
    name, m = mt.find_experts(model)[0]
    model_edit.free_weights(m)
    with pytest.raises(ValueError, match=f"{name}: its expert weights are empty"):
        mt.offload_experts(model, **KW)


@pytest.mark.parametrize("layout", checkpoints.LAYOUTS)
def test_corrupted_checkpoint_is_refused_before_the_runner(tmp_path, monkeypatch, layout):
    """Every layout: a truncated checkpoint through offload_experts raises CheckpointError before a runner is built,
    and the model is untouched."""
    from moe_engine import runner

    model = hm.build(cw.ARCH_OF[layout])
    src = cw.write_layout(layout, model, tmp_path)
    bad = cw.truncated(src, tmp_path / f"cut{src.suffix}", src.stat().st_size * 2 // 3)
    before = snapshot(model)
    monkeypatch.setattr(runner.MoERunner, "__init__", _raise_on_call(1, None, AssertionError("runner built")))
    with pytest.raises(checkpoints.CheckpointError, match="truncated"):
        mt.offload_experts(model, checkpoint=bad, **KW)
    assert_unchanged(model, before)
