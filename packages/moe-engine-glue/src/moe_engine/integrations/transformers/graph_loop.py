"""Greedy decode of a from_pretrained model as one captured step: transformers' own forward on a StaticCache, the
argmax and the next step's inputs inside the step, so on a GPU a token is one CUDA graph replay and nothing of
Python's runs between tokens (generate() runs its loop, logits processors and stopping checks in Python, and the
cudagraphs backend checks its guards and copies its inputs, every token, while the GPU and the CPU experts wait).

The step's inputs are tensors the graph owns: the current token, its position (the cache position, position ids),
a [1, max_len] attention mask whose position is set inside the step, and a counter indexing the tokens written. Under
capture transformers builds the causal mask from them with tensor ops (masking_utils skips its data-dependent
shortcut while a CUDA stream captures). Without a GPU (or capture=False) the same step runs eagerly in a loop: the
CPU tests check it against generate()'s greedy tokens.

    loop = GraphLoop(model, max_len=4096)
    new = loop.generate(ids, 32)             # [1, 32]; loop.last: the decode's seconds and tokens

compile=True (the default where from_pretrained's decode path is `compile`): the step's forward is torch.compile'd
(inductor, fullgraph, static shapes; our experts one opaque op inside) and then captured, so a replay runs
inductor's fused kernels (norms, rotary, the cache update, the router's softmax and top-k) instead of transformers'
one kernel per small op. The prompt's forward stays eager (its shape changes per call). The first step compiles
(a minute or more for 48 layers), outside the capture; inductor's compile workers are shut down after it.

A replay runs none of the runner's Python, so the loop ends each replayed step itself (runner.end_step(): under
residency="hot" the routing counts are folded and experts re-placed between replays, through the in-place tables);
an eager step ends itself in the runner's last layer.

Thread contract: one generate() at a time (the step's tensors are shared); close() drops the graph and the cache."""
from __future__ import annotations

import inspect
import time


def _drop_compile_workers() -> None:
    """Shuts inductor's compile workers down once the step is compiled (static shapes: nothing more to compile; a
    later compile starts a new pool). The pool holds a process per core beside the CPU experts' pinned threads, the
    likely cause of the slow first timed repeat after every compile on a 16-core GPU host (strategy cpu 11.4 tok/s,
    then 79-80; not re-measured with the pool gone)."""
    try:
        from torch._inductor.async_compile import shutdown_compile_workers
    except ImportError:  # a torch without inductor's worker pools
        return
    shutdown_compile_workers()


def cache_kwarg(model) -> str:
    """The name of the cache argument of model.forward: transformers >= 5.2x names it `cache` (past_key_values is
    deprecated there), 5.17 does not."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class GraphLoop:
    def __init__(self, model, max_len: int = 4096, *, capture: bool | None = None, compile: bool | None = None):
        import torch

        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len={max_len!r}: expected an int >= 2 (the prompt plus the new tokens)")
        off = getattr(model, "moe_engine", None)
        self.device = off.runner.device if off is not None else next(model.parameters()).device
        cuda = self.device.type == "cuda"
        if capture and not cuda:
            raise ValueError(f"capture=True: a CUDA graph needs the model on a GPU, it is on {self.device}")
        if cuda and capture is None and off is not None and not off.runner.graphs_ok:
            capture = False  # the runner refused graphs at qualification (its reason is in runner.graphs_reason)
        self.capture = cuda if capture is None else bool(capture)
        self.model, self.max_len = model, max_len
        if compile is None:
            compile = getattr(model, "_moe_engine_decode", None) == "compile"
        self.compiled = bool(compile)
        self._workers_dropped = False
        self._forward = model
        if self.compiled:
            from .decode import COMPILE

            self._forward = torch.compile(model.__call__, **COMPILE)
        # a replay runs no Python of the runner's: its end of step (hot placement's counts and moves) is called here
        self._end_step = off.runner.end_step if off is not None else (lambda: 0)
        self._kv = cache_kwarg(model)
        self.cache = self.graph = None
        long = dict(dtype=torch.long, device=self.device)
        self.cur = torch.zeros((1, 1), **long)  # the token the step reads
        self.pos = torch.zeros((1,), **long)  # its position
        self.k = torch.zeros((1,), **long)  # how many tokens the steps wrote
        self.mask = torch.zeros((1, max_len), **long)
        self.out = torch.zeros((1, max_len), **long)
        self.last = None

    def _cache(self):
        from transformers import StaticCache

        if self.cache is None:
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        else:
            self.cache.reset()
        return self.cache

    def _step(self) -> None:
        """One token: set its mask position, transformers' forward on the static cache, argmax, the next inputs."""
        self.mask.index_fill_(1, self.pos, 1)
        logits = self._forward(input_ids=self.cur, attention_mask=self.mask, cache_position=self.pos,
                               position_ids=self.pos.view(1, 1), use_cache=True, **{self._kv: self.cache}).logits
        nxt = logits[:, -1].float().argmax(-1).view(1, 1)  # CPU, 151936 logits: bf16 argmax 545 us, cast + fp32 140
        self.out.index_copy_(1, self.k, nxt)
        self.cur.copy_(nxt)
        self.pos.add_(1)
        self.k.add_(1)

    def _capture(self) -> None:
        import torch

        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            self._step()
        torch.cuda.current_stream(self.device).wait_stream(s)
        self.graph = g

    def generate(self, ids, n: int):
        """The n greedy tokens after ids ([1, P] or [P]), as [1, n] on the model's device. self.last: the prompt's
        seconds, the decode's seconds for tokens 2..n (the first comes from the prompt), whether captured."""
        import torch

        ids = torch.as_tensor(ids, device=self.device).view(1, -1).long()
        P = ids.shape[1]
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r}: expected an int >= 1 (tokens to generate)")
        if P < 1 or P + n > self.max_len:
            raise ValueError(f"a prompt of {P} tokens plus n={n} new ones: expected 1 <= P and P + n <= "
                             f"max_len={self.max_len}")
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        with torch.no_grad():
            t0 = time.perf_counter()
            cache = self._cache()
            self.mask.zero_()
            self.mask[:, :P] = 1
            logits = self.model(input_ids=ids, attention_mask=self.mask[:, :P],
                                cache_position=torch.arange(P, device=self.device), use_cache=True,
                                **{self._kv: cache}).logits
            self.out[:, :1] = logits[:, -1].float().argmax(-1).view(1, 1)
            self.cur.copy_(self.out[:, :1])
            self.pos.fill_(P)
            self.k.fill_(1)
            sync()
            t1 = time.perf_counter()
            steps = n - 1
            if steps and self.compiled and not self._workers_dropped:
                self._step()  # traces and compiles the step
                steps -= 1
                _drop_compile_workers()
                self._workers_dropped = True
            if steps and self.capture and self.graph is None:
                self._step()  # eagerly (compiled: its code run alone once): kernels loaded, workspaces made outside
                steps -= 1
                self._capture()
            for _ in range(steps):
                if self.graph is not None:
                    self.graph.replay()
                    self._end_step()
                else:
                    self._step()
            sync()
            t2 = time.perf_counter()
        self.last = {"prompt_s": t1 - t0, "decode_s": t2 - t1, "decode_tokens": n - 1,
                     "captured": self.graph is not None, "compiled": self.compiled}
        return self.out[:, :n].clone()

    def close(self) -> None:
        """Drops the graph, the cache and the compiled step; a later generate() runs the step uncompiled."""
        self.graph = self.cache = None
        self._forward, self.compiled = self.model, False
