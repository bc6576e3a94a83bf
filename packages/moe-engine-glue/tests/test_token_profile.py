"""moe_engine.tools.token_profile on the small GGUF Q4_0 checkpoint (2 layers): the parts of a decode token, our
experts' split (the executor's step inside the model from its trace, and the same runner alone on its own banks),
and the command line's report of both."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("gguf")

from moe_engine import from_pretrained  # noqa: E402
from moe_engine.tools import token_profile  # noqa: E402


def test_profile_splits_our_experts(small_gguf):
    model = from_pretrained(small_gguf, strategy="cpu", device="cpu", threads=2, progress=False)
    try:
        r = model.moe_engine.runner
        p = token_profile.profile(model, 3)
        ex = p["executor_in_model"]
        # generate() runs the prompt's step and 3 + 1 new tokens' steps through every MoE layer, each traced once
        assert ex["steps"] == (3 + 1) * r.num_layers
        assert 0 < ex["step_s"] <= p["parts_s"]["experts"] * (3 + 1) / 3  # the native step is inside the hooked call
        assert ex["enter_latest_us"] >= ex["enter_us"] >= 0
        a = token_profile.experts_alone(r, tokens=3)
        assert a["executor"]["steps"] == 3 * r.num_layers
        assert a["layer_us"] * 1e-6 * r.num_layers == pytest.approx(a["token_s"])
        assert a["executor"]["layer_step_us"] <= a["layer_us"]  # the step is inside runner.forward's call
    finally:
        model.moe_engine.close()


def test_command_reports_the_split(small_gguf, tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert token_profile.main([str(small_gguf), "-n", "2", "-t", "2", "--rounds", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "executor step" in text and "experts alone" in text and "GraphLoop" in text
    res = json.loads(out.read_text())
    assert not res["loop"]["captured"] and res["loop"]["token_s"] > 0 and res["generate"]["token_s"] > 0
    assert res["experts_alone"]["token_s"] > 0 and len(res["experts_alone"]["rounds"]) == 1
    assert set(res["executor_in_model"]) == {"step_s", "enter_us", "enter_latest_us"}
