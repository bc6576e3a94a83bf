"""GraphLoop (integrations/transformers/graph_loop.py): the decode step with its argmax and next inputs inside, on
a StaticCache, gives generate()'s greedy tokens, eagerly on the CPU (the same step a GPU captures) and, on a GPU,
captured as one CUDA graph and replayed; a second call reuses the cache and the graph. Bad arguments are named."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("gguf")

from moe_engine import from_pretrained  # noqa: E402
from moe_engine.integrations.transformers import graph_loop  # noqa: E402
from moe_engine.integrations.transformers.graph_loop import GraphLoop  # noqa: E402
from moe_engine.tools import synth  # noqa: E402


def _greedy(model, ids, n):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[:, ids.shape[1]:]


@pytest.mark.parametrize("decode", ["eager", "static", "gemv"])
def test_loop_gives_generates_tokens_on_the_cpu(small_gguf, decode):
    model = from_pretrained(small_gguf, strategy="cpu", device="cpu", threads=2, progress=False, decode=decode)
    assert model.config._attn_implementation == ("sdpa" if decode == "eager" else "moe_engine")
    ids = torch.tensor([[3, 17, 101, 42]])
    want = _greedy(model, ids, 10)
    loop = GraphLoop(model, max_len=64)
    assert not loop.capture
    assert torch.equal(loop.generate(ids, 10), want)
    other = torch.tensor([[7, 7, 9]])  # a second call: the cache reset, a prompt of another length
    assert torch.equal(loop.generate(other, 6), _greedy(model, other, 6))
    assert loop.last["decode_tokens"] == 5 and not loop.last["captured"]
    loop.close()
    model.moe_engine.close()


def _check_argmax(model, ids, new, n_off: int = 1):
    """The loop's tokens against the eager model's logits on the same tokens (teacher forcing): each the eager argmax,
    or within 3% of the largest |logit| of it (test_decode_path measured <= 3.2e-2 for the compile path, 0.12 at a
    routing flip: at most n_off such positions)."""
    with torch.no_grad():
        logits = model(torch.cat([ids, new[:, :-1]], 1)).logits[0, ids.shape[1] - 1:].float()
    gap = logits.max(-1).values - logits.gather(1, new.view(-1, 1)).view(-1)
    rel = gap / logits.abs().max(-1).values
    n = new.shape[1]
    assert (rel <= 3e-2).sum() >= n - n_off and rel.max() <= 0.15, [f"{r:.1e}" for r in rel]
    assert (gap == 0).sum() >= n - 3, gap  # mostly the very argmax: a wrong position or cache would not be


@pytest.mark.slow  # inductor compiles the 2-layer step: ~30 s on a quiet 2-core VM
def test_compiled_loop_picks_the_eager_models_argmax(small_gguf, monkeypatch):
    """decode='compile': the loop's step runs torch.compile'd (inductor), its fused norms and rotary in fp32."""
    model = from_pretrained(small_gguf, strategy="cpu", device="cpu", threads=2, progress=False, decode="compile")
    loop = GraphLoop(model, max_len=64)
    assert loop.compiled and not loop.capture
    ids = torch.tensor([[3, 17, 101, 42]])
    dropped = []
    monkeypatch.setattr(graph_loop, "_drop_compile_workers", lambda: dropped.append(1))
    new = loop.generate(ids, 12)
    assert loop.last["compiled"] and new.shape == (1, 12)
    assert dropped == [1]  # inductor's compile workers go once the step is compiled
    _check_argmax(model, ids, new)
    loop.generate(ids, 4)
    assert dropped == [1]  # and only once
    loop.close()
    assert not loop.compiled  # close() dropped the compiled step
    model.moe_engine.close()


def test_drop_compile_workers_shuts_inductors_pool():
    """The compiled loop's clean-up: inductor's worker pool (a process per core) exists, then is gone."""
    from torch._inductor import async_compile

    if async_compile.get_compile_threads() <= 1:
        pytest.skip("one compile thread: inductor compiles in this process, no pool")
    async_compile.AsyncCompile.warm_pool()
    assert async_compile._pool_set
    graph_loop._drop_compile_workers()
    assert not async_compile._pool_set


def test_replays_end_the_runners_step(small_gguf):
    """A replay runs none of the runner's Python: the loop calls runner.end_step() after each one (hot placement's
    window), and not after an eager step (the runner's last layer ends those itself)."""
    model = from_pretrained(small_gguf, strategy="cpu", device="cpu", threads=2, progress=False, decode="static")
    loop = GraphLoop(model, max_len=64)
    ended, replays = [], []

    class Replayed:  # stands in for the CUDA graph: the captured step's work, run eagerly
        def replay(self):
            replays.append(1)
            loop._step()

    loop._end_step = lambda: ended.append(1) or 0
    ids = torch.tensor([[3, 17, 101, 42]])
    want = _greedy(model, ids, 8)
    assert torch.equal(loop.generate(ids, 8), want) and not ended  # eager: the runner's own forward ends steps
    loop.graph = Replayed()
    assert torch.equal(loop.generate(ids, 8), want)
    assert len(ended) == len(replays) == 7
    model.moe_engine.close()


def test_loop_on_gpt_oss(tmp_path):
    """gpt-oss: sliding-window layers beside full ones, attention sinks; the step's masks from the static cache."""
    p = tmp_path / "oss"
    synth.write("mxfp4", p, small=True, layers=2, seed=3, progress=False)
    model = from_pretrained(p, strategy="cpu", device="cpu", threads=2, progress=False)
    ids = torch.tensor([[3, 17, 101, 42, 9]])
    assert torch.equal(GraphLoop(model, max_len=64).generate(ids, 12), _greedy(model, ids, 12))
    model.moe_engine.close()


def test_loop_refuses_bad_arguments(small_gguf):
    model = from_pretrained(small_gguf, strategy="cpu", device="cpu", threads=2, progress=False, decode="eager")
    with pytest.raises(ValueError, match="max_len=1"):
        GraphLoop(model, max_len=1)
    with pytest.raises(ValueError, match="capture=True: a CUDA graph needs the model on a GPU"):
        GraphLoop(model, capture=True)
    loop = GraphLoop(model, max_len=8)
    with pytest.raises(ValueError, match="n=0"):
        loop.generate(torch.tensor([[1]]), 0)
    with pytest.raises(ValueError, match=r"P \+ n <= max_len=8"):
        loop.generate(torch.tensor([[1, 2, 3]]), 6)
    model.moe_engine.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("strategy", ["cpu", "hybrid"])
@pytest.mark.parametrize("decode", ["auto", "compile"])
def test_loop_captured_on_a_gpu(small_gguf, strategy, decode):
    """The step captured as one CUDA graph; under decode='compile' inductor's kernels are what is captured."""
    model = from_pretrained(small_gguf, strategy=strategy, device="cuda", threads=2, progress=False,
                            gpu_memory="2GiB" if strategy == "hybrid" else None, decode=decode)
    ids = torch.tensor([[3, 17, 101, 42]], device="cuda")
    want = _greedy(model, ids, 12)
    loop = GraphLoop(model, max_len=64)
    assert loop.capture and loop.compiled == (decode == "compile")
    for _ in range(2):  # the first call captures, the second replays the same graph
        new = loop.generate(ids, 12)
        if decode == "compile":
            _check_argmax(model, ids, new)
        else:
            assert torch.equal(new, want)
        assert loop.last["captured"]
    loop.close()
    model.moe_engine.close()


def test_cli_generate_and_bench_through_the_loop(small_gguf, capsys):
    import json

    from moe_engine.tools.cli import main

    common = [str(small_gguf), "--strategy", "cpu", "--device", "cpu", "-t", "2", "--json", "--quiet"]
    got = {}
    for loop in ("generate", "graph"):
        assert main(["generate", *common, "--ids", "3,17,101", "--max-new-tokens", "6", "--loop", loop]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["loop"] == loop and len(res["ids"]) == 6 and res["decode_tok_s"] > 0
        got[loop] = res["ids"]
    assert got["graph"] == got["generate"]
    assert main(["bench", *common, "--host-memory", "64GiB", "-p", "4", "-n", "3", "-r", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["loop"] == "graph" and [r["test"] for r in res["results"]] == ["pp4", "tg3"]
    assert all(r["avg_ts"] > 0 for r in res["results"])
    # llama-bench's -d: the tests after that many tokens in the cache (its test names and n_depth)
    assert main(["bench", *common, "--host-memory", "64GiB", "-p", "4", "-n", "3", "-r", "1", "-d", "0,9"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["n_depth"]) for r in res["results"]] == [("pp4", 0), ("pp4 @ d9", 9), ("tg3", 0),
                                                                   ("tg3 @ d9", 9)]
    with pytest.raises(ValueError, match="-d 4,-1: expected depths >= 0"):
        main(["bench", *common, "-p", "4", "-n", "3", "-d", "4,-1"])
