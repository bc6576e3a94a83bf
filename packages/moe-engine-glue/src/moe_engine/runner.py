"""MoERunner: one object per model that runs every MoE layer's routed experts, on the CPU (strategy `cpu`), split
between GPU-resident and CPU experts (`hybrid`), or all on the GPU (`gpu`, the baseline). It owns the executor
(one worker pool for all layers), the handshake, the GPU experts and the residency tables, and is qualified at
start-up before it serves (qualify.py). forward() takes and returns torch tensors on the activations' device."""
from __future__ import annotations

import logging
import os
import threading

import numpy as np

import cpumoe_formats as cf

from . import layer_formats, validate
from .banks import quantize_layers
from .placement.initial import fraction_masks, initial_masks
from .residency import Residency

log = logging.getLogger("moe_engine")
STRATEGIES = ("auto", "cpu", "hybrid", "gpu")
SPIN_US_GPU, SPIN_US_CPU = 2000, 50  # how long idle workers spin before they sleep (cpumoe_executor's spin_us)


class CaptureRefusedError(RuntimeError):
    """forward() was called under CUDA/HIP graph capture, but start-up qualification refused decode graphs."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def threads_beside_gpu() -> int:
    """The CPU executor's default worker count beside a GPU: the cores it would take, less one, which stays free for
    the thread driving the GPU (launches, replays, their waits); that thread otherwise shares a pinned worker's core:
    H200 host, demo hybrid bf16 batch 1, 570 us/layer with 15 workers, 2472 with 16 (docs/moe-engine.md). The
    runner and `moe-engine bench --profile` both take it, so the profile measures the executor as the runner runs it."""
    from cpumoe_executor import resolve_cores

    return max(1, len(resolve_cores()[0]) - 1)


class MoERunner:
    """Routed experts of every MoE layer of one model.

    Thread contract: shareable. forward() / op() / set_residency() / close() hold the runner's lock for the call, so
    steps from several threads run one after another (one executor, one task in flight) and each gets its own y.
    step() is the unlocked body for a caller that holds the order itself (a graph capture, a benchmark).

    format: a cpumoe_formats format name (bf16, fp8_block, nvfp4, mxfp4, ds_fp4, q4_0, q8_0, q4_k, q6_k, ...), or a
        list with one entry per layer, each a name or a (gate_up format, down format) pair (a Q4_K_M GGUF's layers;
        cpumoe_executor's per-layer spec). `runner.format` is the name for a uniform model, else that per-layer list;
        `runner.layer_formats` the (gate_up, down) pair of every layer. Under hybrid / gpu, one GpuExperts per
        distinct pair serves its layers (gpu/by_pair.py).
    banks: one dict of bank arrays per layer (cpumoe_formats schema; a pair layer: the gate_up format's gate_up banks
        and the down format's down banks); or weights: one (gate_up [E, 2I, H], down [E, H, I]) float pair per
        layer, quantized to `format`, a name (progress bar).
    strategy: cpu | hybrid | gpu | auto (hybrid where the activations are on a GPU, else cpu; with a GPU, hot
        residency and a bandwidth profile, also split="auto").
    device: where the activations live (default: cuda if torch sees a GPU, else cpu).
    residency: hybrid's GPU-resident experts: a fraction of each layer (a seeded random subset; 0.25 is the default
        without a GPU), "hot" (the default beside a GPU: each layer's most-routed experts, from routing counts taken
        on the device, re-placed every `replace_every` steps; placement/hot.py), "static" (the
        most-routed experts of `routing_profile`, from `moe-engine profile`), "random" or "uniform" (capacity
        experts per layer), "layers" (every expert of the `gpu_layers` layers, none of the others: each layer then
        runs on one side only, as llama.cpp's --n-cpu-moe places; placement/layerwise.py), or per-layer bool masks
        of length E. capacity: GPU slots per layer (default: the most
        resident experts of any layer; a quarter of E for the named placements). Routes are counted when residency
        is "hot" or count_routes=True (runner.route_counts).
    split: hybrid's miss split (placement/split.py): a fraction q in [0, 1] of the expected miss bytes read by the GPU
        experts zero-copy from pinned host banks while the CPU computes the rest; "auto": q from `profile` (a
        bandwidth profile, placement/profile.py; default: this GPU's cached one) and the live miss rate, re-chosen
        at each re-placement of residency="hot" (one log line when the mode changes). bf16, fp8_block, nvfp4.
        split_rule: "expert" (the default: a fixed set of experts per layer) or "step" (round(q n) of each step's n
        missed experts; not yet measured on a GPU); runner.split.set_rule() changes it between steps.
    pin_memory: host banks to page-lock on a GPU (cudaHostRegister), any strategy: bytes, True (half of
        MemAvailable), False (none); None: True when split is on, else False. Layers past the budget, or whose
        registration fails, stay pageable (one warning); pinned ones make staged prefill and hot's copies run at
        link speed.
    graph_batch_sizes: the decode batch sizes an engine captures; max_tokens (default their max) bounds a decode step,
        a larger batch (a prompt) runs eagerly as prefill (prefill.py).
    threads, mode, isa: the CPU executor's worker count, precision mode and ISA cap (cpumoe_executor).
    repack: CpuMoeExecutor's repack= (None: its format's CPU layout where that pays, e.g. q4_0 -> q4_0_x16; False:
        the banks as given). Beside a GPU the runner keeps the given banks for the GPU's loads (host_banks), so a
        repacked executor holds the experts a second time on the host; from_pretrained passes False where host
        memory cannot hold both (loading/budget.py host_copy).
    spin_us: how long the executor's idle workers spin before sleeping (default 50 with CPU activations, where torch
        shares their cores between steps; 2000 beside a GPU).
    team: who runs the executor's steps (CpuMoeExecutor's team=): "pool", its own pinned workers; "openmp", the
        calling thread's OpenMP team, the threads torch runs the rest of the model on. Default: "openmp" with the
        activations on the CPU where torch's parallel backend is the OpenMP runtime loaded here (libgomp), so one set
        of threads serves the whole token; "pool" beside a GPU (the doorbell's coordinator needs it).
    handshake: force a GPU handshake path (CUDA: kernel, memop, host-func, eager; HIP: copy-native, copy-splice,
        host-func, eager); default: the best that its probe and qualification proved.
    prefill: how a batch above max_tokens runs: auto (measured: CPU chunks or experts staged on the GPU), cpu, gpu;
        checked here, changed later with runner.prefill_policy.set(...).
    qualify: run the start-up qualification (eager must pass, else this raises; graphs are refused with a warning
        on every tensor-parallel rank of `tp_group` when replay fails).
    """

    def __init__(self, format, banks=None, *, weights=None, top_k: int, activation: str = "silu",
                 alpha: float | None = None, limit: float | None = None, apply_router_weight_on_input: bool = False,
                 strategy: str = "auto", device=None, residency=None, capacity: int | None = None,
                 graph_batch_sizes=(1, 2, 4, 8), max_tokens: int | None = None, threads: int | None = None,
                 mode: str | None = None, isa: str | None = None, handshake: str | None = None, qualify: bool = True,
                 prefill: str = "auto", tp_group=None, progress: bool = True, check_ids: bool = True,
                 spin_us: int | None = None, replace_every: int = 50, routing_profile=None,
                 count_routes: bool = False, split=None, pin_memory=None, profile=None, team: str | None = None,
                 gpu_layers=None, repack: bool | None = None, split_rule: str | None = None):
        import torch

        self.closed = False
        self._lock = threading.RLock()  # one step at a time: the executor has one task in flight
        if isinstance(format, str):
            cf.get_format(format)  # an unknown name is refused before anything else
        if (banks is None) == (weights is None):
            raise ValueError("give exactly one of banks= (per-layer bank dicts) or weights= (per-layer float "
                             "(gate_up, down) pairs to quantize)")
        if weights is not None:
            if not isinstance(format, str):
                raise ValueError("weights= quantizes every layer to one format: pass a format name, or banks= for "
                                 "per-layer formats")
            banks = quantize_layers(format, weights, progress=progress)
        if isinstance(banks, dict) or not hasattr(banks, "__len__") or len(banks) == 0:
            raise TypeError("banks must be a non-empty list with one mapping of bank name -> array per layer")
        self.layer_formats = layer_formats.normalize(format, len(banks))
        # one name for a uniform model (as cpumoe_formats names it), else the per-layer list the executor takes
        self.format = layer_formats.compact(self.layer_formats)
        self.spec = cf.get_format(self.format) if isinstance(self.format, str) else None
        dims = (None, None, None)
        for li, (b, pair) in enumerate(zip(banks, self.layer_formats)):
            try:
                _, dims = layer_formats.validate_layer(pair, b, *dims)
            except (ValueError, TypeError) as e:
                raise type(e)(f"banks[{li}]: {e}") from None
        self.E, self.H, self.I = dims
        self.gpu_layer_formats, self.gpu_format = self.layer_formats, self.format  # hybrid / gpu: see below
        from cpumoe_formats.inputs import MAX_TOP_K

        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(MAX_TOP_K, self.E):
            raise ValueError(f"top_k={top_k!r}: expected an int in [1, {min(MAX_TOP_K, self.E)}]")
        self.num_layers, self.top_k = len(banks), top_k
        self.act = cf.activations.resolve(activation, alpha, limit)
        self.apply_router_weight_on_input = bool(apply_router_weight_on_input)
        self.device = validate.device(torch, device)
        self._placement_args = (replace_every, routing_profile, capacity, gpu_layers)
        self.layer_path = None  # residency="layers": each layer's fixed path, "gpu" or "cpu" (step())
        self.strategy, why = self._pick_strategy(strategy)
        if residency is None and self.strategy == "hybrid" and self.device.type == "cuda":
            # hot is the default beside a GPU: its GPU checks passed on the H100 (the placement suites; 1,000 replays
            # with re-placement and the split on, 0 mismatches), and it ran 1.20-1.52x random at equal slots
            residency = "hot"
        if self.strategy in ("hybrid", "gpu"):
            # the formats the GPU runs: a layer's own, or the format its CPU layout moves (gpu/moved.py: q4_0_x16 ->
            # q4_0), so the GPU loads from the one host copy the executor runs
            from .gpu.moved import source

            self.gpu_layer_formats = [tuple(source(f, self.H, self.I) or f for f in p) for p in self.layer_formats]
            self.gpu_format = layer_formats.compact(self.gpu_layer_formats)
            self._check_gpu_formats()
        masks = None
        if residency is not None:
            masks = self._masks(residency)  # malformed residency is refused whatever the strategy
            if self.strategy == "cpu" and any(m.any() for m in masks):
                if strategy == "cpu":
                    raise ValueError(f"residency={_short(residency)} keeps experts on the GPU, but strategy='cpu' runs "
                                     "every expert on the CPU; omit residency (or pass 0) or use strategy='hybrid'")
                why += "; residency ignored: no experts on a GPU"
        self.graph_batch_sizes = validate.batch_sizes(graph_batch_sizes)
        self.max_tokens = validate.max_tokens(max_tokens, self.graph_batch_sizes)
        self.check_ids = bool(check_ids)
        # qualify=False is the caller's opt-out: graphs then rest on the handshake's own start-up probe alone
        self.graphs_ok, self.graphs_reason = self.device.type == "cuda", "not qualified (qualify=False)"
        self.executor = self.sync = self.gpu = self.residency = self.route_counts = self.hot = None
        self.split = self.pinned = None
        # the GPU loads experts from these (residency changes, staged prefill); the executor may hold a repacked copy
        self.host_banks = banks if self.device.type == "cuda" or self.strategy != "cpu" else None
        from .prefill import PrefillPolicy, check_policy

        check_policy(prefill)  # before the executor is built
        self.last_prefill = None
        act_kw = dict(activation=self.act.name, alpha=alpha, limit=limit)
        try:
            if self.strategy in ("cpu", "hybrid"):
                from cpumoe_executor import CpuMoeExecutor

                if threads is None and self.device.type == "cuda":
                    threads = threads_beside_gpu()
                if spin_us is None:
                    # with the activations on the CPU, torch runs attention on the workers' cores right after each
                    # step: workers that spin 2 ms for the next one starve it (2-core VM, small qwen3moe, attention
                    # 255 ms/token spinning, see docs/end-to-end.md); beside a GPU they spin for the next layer
                    spin_us = SPIN_US_CPU if self.device.type == "cpu" else SPIN_US_GPU
                if team is None:
                    team = "openmp" if self.device.type == "cpu" and _torch_on_openmp() else "pool"
                self.executor = CpuMoeExecutor(self.format, banks, top_k=top_k, max_tokens=self.max_tokens,
                                               threads=threads, mode=mode, isa=isa, spin_us=spin_us, team=team,
                                               repack=repack,
                                               apply_router_weight_on_input=self.apply_router_weight_on_input, **act_kw)
                self.top_k = self.executor.top_k
                from .sync import open_sync

                self.sync, self.sync_why = open_sync(self.executor, self.device, handshake)
                if handshake is not None and self.sync.path != handshake:
                    raise RuntimeError(f"handshake={handshake!r} is unavailable here: {self.sync.summary()}")
            if self.strategy in ("hybrid", "gpu"):
                self._open_gpu(residency, masks, capacity, act_kw)
            self._open_placement(residency, count_routes)
            self._open_split(split, pin_memory, profile, strategy == "auto", split_rule)
            self.prefill_policy = PrefillPolicy(self, prefill)  # prefill.py; .set() changes it between steps
            if qualify:
                from .qualify import qualify_runner

                qualify_runner(self, tp_group)
            if self.route_counts is not None:
                self.route_counts.reset()  # qualification's routes are not the model's
            if self.split is not None:
                self.split.restart_window()  # nor its steps the CPU's live rate
        except BaseException:
            self.closed = True
            self._close()  # what was built so far (the executor's threads, the handshake) goes with the error
            raise
        from .op import register

        self.handle = register(self)
        # forward()'s direct path: every expert on the CPU, activations there, no routes to count (decode_routed)
        self._routed = self.executor if (self.strategy == "cpu" and self.device.type == "cpu"
                                         and self.route_counts is None) else None
        log.info("ready: strategy=%s (%s) %s", self.strategy, why, self.describe())

    # ---- construction ------------------------------------------------------------------------------
    def _pick_strategy(self, strategy: str) -> tuple[str, str]:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}: expected one of {list(STRATEGIES)}")
        on_gpu = self.device.type == "cuda"
        if strategy == "auto":
            return ("hybrid", "auto: the activations are on a GPU") if on_gpu else ("cpu", "auto: no GPU")
        if strategy in ("hybrid", "gpu") and not (on_gpu or _interpreting()):
            raise ValueError(f"strategy={strategy!r} runs experts on a GPU, but device={self.device}; expected a "
                             "CUDA/HIP device (or strategy='cpu')")
        return strategy, "requested"

    def _check_gpu_formats(self) -> None:
        """Every (gate_up, down) pair of the model has GPU experts kernels; ValueError naming those that lack them."""
        from .gpu.experts import GpuExperts

        pairs = list(dict.fromkeys(self.gpu_layer_formats))
        if layer_formats.is_uniform(self.gpu_layer_formats):
            if self.gpu_format not in GpuExperts.FORMATS:
                raise ValueError(f"format {self.format!r} has no GPU experts kernel, so strategy={self.strategy!r} "
                                 f"cannot run it; expected one of {list(GpuExperts.FORMATS)}, a CPU layout of one "
                                 "that moves its bytes (q4_0_x16, fp8_block_x16, ...) or strategy='cpu'")
            return
        lacking = [p for p in pairs if not all(f in GpuExperts.FORMATS for f in p)]
        if lacking:
            raise ValueError(f"strategy={self.strategy!r} runs experts on the GPU, but the (gate_up, down) pairs "
                             f"{lacking} of this model ({layer_formats.describe(self.layer_formats)}) have no GPU "
                             f"experts kernel (GpuExperts runs {list(GpuExperts.FORMATS)}); use strategy='cpu'")

    def _open_gpu(self, residency, masks, capacity, act_kw) -> None:
        from .gpu.by_pair import open_gpu_experts
        from .placement import layerwise

        if self.strategy != "hybrid" or masks is None:  # hybrid reuses the masks checked above (a profile read once)
            masks = self._masks(residency if self.strategy == "hybrid" else 1.0)
        need = max(int(m.sum()) for m in masks)
        cap = need if capacity is None else capacity
        if not isinstance(cap, int) or not need <= cap <= self.E:
            raise ValueError(f"capacity={capacity!r}: expected an int in [{need}, E={self.E}] (the residency needs "
                             f"{need} GPU slots in its fullest layer)")
        caps = None
        if self.strategy == "hybrid" and residency == "layers":
            self.layer_path = layerwise.paths(masks, self.E)
            caps = layerwise.capacities(self.layer_path, self.E)
        self.gpu = open_gpu_experts(self.gpu_layer_formats, host_pairs=self.layer_formats, capacity=max(cap, 1),
                                    layer_capacity=caps, E=self.E, H=self.H, I=self.I, top_k=self.top_k,
                                    max_tokens=self.max_tokens, device=self.device,
                                    apply_router_weight_on_input=self.apply_router_weight_on_input, **act_kw)
        self.residency = Residency(self.num_layers, self.E, cap if caps is None else caps, self.device)
        for layer, m in enumerate(masks):
            self.set_residency(layer, m)

    def _masks(self, residency) -> list[np.ndarray]:
        replace_every, routing_profile, capacity, gpu_layers = self._placement_args
        return initial_masks(residency, self.num_layers, self.E, replace_every=replace_every,
                             routing_profile=routing_profile, capacity=capacity, gpu_layers=gpu_layers)

    # ---- residency -----------------------------------------------------------------------------------
    def set_residency(self, layer: int, mask) -> int:
        """Make `mask` (bool [E], True = on the GPU) layer `layer`'s GPU-resident experts between steps: the new
        experts' weights are copied into free slots and the device tables rewritten in place, on the current stream
        (a captured graph replays with the new split; no recapture). Returns the number of experts loaded."""
        with self._lock:
            return self._set_residency(layer, mask)

    def _set_residency(self, layer: int, mask) -> int:
        if self.residency is None:
            raise RuntimeError(f"set_residency: strategy {self.strategy!r} keeps no experts on the GPU")
        validate.layer(layer, self.num_layers)
        if self.strategy == "gpu" and not np.asarray(mask).all():
            raise ValueError("set_residency: strategy 'gpu' keeps every expert resident")
        if self.layer_path is not None and self.layer_path[layer] == "gpu" and not np.asarray(mask).all():
            raise ValueError(f"set_residency: residency='layers' keeps every expert of layer {layer} on the GPU (its "
                             "captured step has no CPU side); expected a mask of all True")
        loads = self.residency.plan(layer, mask)
        for e, slot in loads:
            self.gpu.load(layer, slot, self.host_banks[layer], e)
        self.residency.commit(layer)
        if self.split is not None:
            self.split.assign(layer)
        return len(loads)

    # ---- placement (placement/) -----------------------------------------------------------------------
    def _open_placement(self, residency, count_routes: bool) -> None:
        from .placement.calibrate import HOT
        from .placement.counts import RoutingCounts
        from .placement.hot import HotResidency

        hot = self.residency is not None and self.strategy == "hybrid" and residency == "hot"
        if hot:
            self.hot = HotResidency(self, every=self._placement_args[0], half_life=HOT["half_life"],
                                    hysteresis=HOT["hysteresis"])
            self.route_counts = self.hot.counts
        elif count_routes:
            self.route_counts = RoutingCounts(self.num_layers, self.E, self.max_tokens * self.top_k, self.device)

    def end_step(self) -> int:
        """Call once after each decode step an engine replays from a CUDA graph (eager forward() calls it on the
        last layer itself): under residency="hot", folds the device's routing counts into the placement every
        `replace_every` steps and re-places, without waiting for the device. Returns the experts loaded."""
        with self._lock:
            return self.hot.end_step() if self.hot is not None else 0

    # ---- the miss split (placement/missplit.py) ---------------------------------------------------------
    def set_split(self, q: float) -> None:
        """Between steps, the fraction q of the miss bytes the GPU reads zero-copy from now on (a runner opened with
        split=<a fraction>); a captured graph replays with it (the tables in place; no recapture)."""
        with self._lock:
            if self.closed:
                raise RuntimeError("set_split: the runner is closed")
            if self.split is None:
                raise RuntimeError("set_split: this runner has no miss split; open it with split=<a fraction>")
            self.split.set_q(q)

    def _open_split(self, split, pin_memory, profile, auto: bool, rule=None) -> None:
        hybrid = self.strategy == "hybrid" and self.residency is not None
        if split is not None and not hybrid:
            raise ValueError(f"split={split!r}: the miss split runs under strategy='hybrid', not {self.strategy!r}")
        if split is not None and self.layer_path is not None:
            raise ValueError(f"split={split!r}: residency='layers' gives each layer one side (its CPU layers read "
                             "every expert on the CPU); the miss split goes with a residency of slots in every layer")
        if split is not None and self.format != self.gpu_format:
            raise ValueError(f"split={split!r}: the miss split's GPU side reads the host banks as they are, in "
                             f"{layer_formats.describe(self.gpu_layer_formats)}'s layout, but these are in "
                             f"{layer_formats.describe(self.layer_formats)} (the executor's layout, one copy); give "
                             "the banks in the GPU's format for the split")
        if split is None and auto and hybrid and self.hot is not None and self.device.type == "cuda":
            from .placement.profile import resolve

            # strategy='auto' with a measured profile also picks the byte path of the misses (split='auto'), where
            # the host banks are in the GPU's layout (the zero-copy reads take them as they are)
            if self.format == self.gpu_format and resolve(profile, gpu=self.torch_device_name(),
                                                          format=self.gpu_format) is not None:
                split = "auto"
        if rule is not None and split is None:
            raise ValueError(f"split_rule={rule!r}: it says how the miss split divides the misses; give split=")
        if pin_memory is None:
            pin_memory = split is not None  # pinned banks come with the split unless asked for
        if self.device.type == "cuda" and self.host_banks is not None and pin_memory is not False:
            from .placement.pinning import PinnedBanks

            # pinned: the staged prefill and hot's copies read them at link speed, the split's GPU side reads them
            self.pinned = PinnedBanks(self.host_banks, self.device, None if pin_memory is True else pin_memory)
            self.host_banks = self.pinned.banks  # the same bytes; an array sharing a page with other memory copied
        if split is not None:
            from .placement.missplit import MissSplit

            self.split = MissSplit(self, split, self.pinned, profile, rule)

    def torch_device_name(self) -> str | None:
        import torch

        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None

    # ---- forward -------------------------------------------------------------------------------------
    def forward(self, layer: int, hidden_states, topk_weights, topk_ids):
        """y [T, H] = the routed experts' weighted sum for `layer`, on hidden_states' device and dtype.

        topk_weights [T, top_k] float, topk_ids [T, top_k] int (-1 = no route): the order of every layer of this
        project (executor, sync backends, GPU experts) and of vLLM's fused-MoE; transformers' adapter maps its own
        (top_k_index, top_k_weights) at its boundary. The one check of the step's shapes, dtypes and devices."""
        with self._lock:
            if self._routed is not None and not self.closed:
                # a decode step on a router's tensors: the executor reads them in place (its decode_routed checks
                # everything validate.step would); in a model each check or op here costs ~10-50 us (cold caches)
                y = self._routed.decode_routed(layer, hidden_states, topk_weights, topk_ids)
                if y is not None:
                    return y
            import torch

            T = validate.step(self, layer, hidden_states, topk_weights, topk_ids)
            capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
            if capturing and not self.graphs_ok:
                raise CaptureRefusedError(f"moe_engine: decode graphs were refused at start-up "
                                          f"({self.graphs_reason}); decode MoE layers eagerly (disable CUDA/HIP "
                                          "graphs for decode)")
            if T > self.max_tokens:
                if capturing:
                    raise ValueError(f"hidden_states: batch of {T} tokens under graph capture, expected at most "
                                     f"max_tokens={self.max_tokens} (the largest graph batch size)")
                from .prefill import prefill

                return prefill(self, int(layer), hidden_states, topk_weights, topk_ids)
            if self.check_ids and not capturing and (hidden_states.is_cuda or self.executor is None):
                validate.ids_range(topk_ids, self.E)  # on the CPU the executor checks them, naming the bad one
            y = self.step(int(layer), hidden_states, topk_weights, topk_ids)
            if self.hot is not None and not capturing and int(layer) == self.num_layers - 1:
                self.hot.end_step()  # eager decode: the last layer ends a step
            return y if y.dtype == hidden_states.dtype else y.to(hidden_states.dtype)

    __call__ = forward

    def step(self, layer: int, x, w, ids):
        """One decode step of at most max_tokens tokens whose arguments forward() has checked: the body a graph
        captures, bf16 [T, H]. Qualification and benchmarks call it directly; engines call forward()."""
        import torch

        if self.route_counts is not None:
            self.route_counts.add(layer, ids)  # fixed-shape device ops: captured with the step
        path = self.strategy if self.layer_path is None else self.layer_path[layer]
        if path == "cpu":  # strategy cpu, or a CPU layer of residency="layers" (no slot: no GPU experts' kernels)
            return self.sync.decode(layer, x, w, ids, check=False)
        wf = w if w.dtype == torch.float32 else w.float()
        if self.split is not None:
            return self.split.step(layer, x, wf, ids)
        if path == "hybrid":
            # the CPU starts first: the slot lookup and the GPU experts run while it works (the lookup before the
            # doorbell put its kernels on the CPU's critical path)
            self.sync.submit(layer, x, wf, ids, self.residency.mask[layer], check=False)
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        y = self.gpu.forward(layer, xb, wf, self.residency.slots(layer, ids))  # the GPU-resident experts
        return y if path == "gpu" else self.sync.finish(layer, partial=y)  # + the CPU's y: each route once

    def op(self, layer: int, hidden_states, topk_weights, topk_ids):
        """forward() through the torch custom op torch.ops.moe_engine.experts (one opaque node for torch.compile)."""
        import torch

        return torch.ops.moe_engine.experts(hidden_states, topk_weights, topk_ids, self.handle, int(layer))

    # ---- reporting -------------------------------------------------------------------------------------
    def describe(self) -> str:
        given, on_gpu = layer_formats.describe(self.layer_formats), layer_formats.describe(self.gpu_layer_formats)
        if on_gpu != given:
            on_gpu += f" (loaded from the host's one copy in {given})"
        parts = [f"format={given}", f"E={self.E} H={self.H} I={self.I} top_k={self.top_k}",
                 f"layers={self.num_layers}", f"device={self.device}"]
        if self.executor is not None:
            ran = layer_formats.describe(layer_formats.executor_formats(self.executor))
            parts.append(f"cpu={ran if ran == given else f'{given} as {ran}'} isa={self.executor.isa} "
                         f"threads={self.executor.threads} team={self.executor.team}")
            parts.append(f"handshake={self.sync.path} ({self.sync_why}; {self.sync.summary()})")
        if self.residency is not None:
            if self.layer_path is not None:
                from .placement.layerwise import describe as layers_text

                parts.append(f"gpu_experts={on_gpu} {layers_text(self.layer_path)} "
                             f"resident={100 * self.residency.fraction():.0f}%")
            else:
                parts.append(f"gpu_experts={on_gpu} slots={self.residency.capacity}/layer "
                             f"resident={100 * self.residency.fraction():.0f}%")
            if self.hot is not None:
                parts.append(f"placement=hot every {self.hot.placer.every} steps")
            if self.split is not None:
                parts.append(f"split q={self.split.q:.2f} by {self.split.rule}{' (auto)' if self.split.auto else ''}")
        if self.pinned is not None:
            parts.append(f"host banks {self.pinned.summary()}")
        if self.device.type == "cuda":
            parts.append(f"graphs={'ok' if self.graphs_ok else 'refused'} ({self.graphs_reason}) "
                         f"batch_sizes={list(self.graph_batch_sizes)} max_tokens={self.max_tokens}")
        else:
            parts.append(f"max_tokens={self.max_tokens}")
        return " ".join(parts)

    @property
    def bytes_per_expert(self) -> int:
        """One expert's weight bytes (the largest layer's where the layers' formats differ)."""
        return max(layer_formats.bytes_per_expert(p, self.H, self.I) for p in set(self.layer_formats))

    def close(self) -> None:
        """Stop serving: the handshake, the executor's threads and buffers, the GPU experts and the host banks go;
        every later call raises. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._close()

    def _close(self) -> None:
        from .op import unregister

        unregister(getattr(self, "handle", None))
        if self.sync is not None:
            self.sync.close()
        if self.pinned is not None:
            if self.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.device)  # no kernel may read a bank once it is unregistered
            self.pinned.close()
            self.pinned = None
        if self.executor is not None:
            self.executor.close()
        self.sync = self.executor = self.gpu = self.residency = self.host_banks = self._routed = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _torch_on_openmp() -> bool:
    """Whether torch runs its CPU parallel regions on the OpenMP runtime the executor can join (libgomp, loaded):
    its OpenMP threads then spin ~12 ms after every region on the cores a pool of our own would use (the 2-core VM:
    our workers entered a 760 us step 390-650 us late; on torch's team, within 1 us)."""
    import torch

    from cpumoe_executor import openmp_team_unusable

    return "parallel backend: OpenMP" in torch.__config__.parallel_info() and not openmp_team_unusable()


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


__all__ = ["CaptureRefusedError", "MoERunner", "STRATEGIES", "fraction_masks"]
