"""CpuMoeExecutor: the Python face of the executor."""
from __future__ import annotations

import logging
import math
import sys
import time

import numpy as np

import cpumoe_formats as cf
from cpumoe_formats.arrays import as_array, check_array, describe
from cpumoe_formats.inputs import MAX_TOP_K, check_routing, x_as_bf16
from cpumoe_formats.kernels import TIERS
from cpumoe_formats.numerics import BF16
from cpumoe_formats.roles import check_role

from . import _native, dense_linear, model_formats, numa_banks
from .cores import _resolve_cores
from .cpu_layout import repack_target
from .executor_io import Doorbell
from .executor_numa import NumaPlacement
from .trace import trace_summary

log = logging.getLogger("cpumoe_executor")
_MODES = ("native", "w4a8")
TEAMS = ("pool", "openmp")  # who runs the steps: our own worker threads, or the caller's OpenMP team


def _pair_name(pair) -> str:
    """"q4_k" for a one-format layer, "q4_k/q6_k" for a two-format one."""
    return pair[0].name if pair[0] is pair[1] else f"{pair[0].name}/{pair[1].name}"


class CpuMoeExecutor(NumaPlacement, Doorbell):
    """MoE decode on the CPU for one model: every layer's banks in one format, or a format per layer and per matrix.

    Threads: safe to share. Any thread may call any method; the steps (decode, doorbell tasks, read_bandwidth,
    the trace) run one at a time under the executor's lock, so a decode never interleaves with another nor with
    a task the coordinator serves (each caller gets its own inputs' result). The IO block is one buffer: one
    ringer (a sync backend) owns it at a time (docs/protocol.md).
    Life: close() (or leaving a `with` block) waits for the step in flight, joins the coordinator and the worker
    threads and frees the kernel, scratch and banks (the repacked copies); close() again is a no-op, and every
    later call raises RuntimeError naming the closed executor (stop_coordinator() too is a no-op). What it hands
    out stays valid: io_arrays() views keep the IO block alive after close() or `del`; io_block()'s addresses stay
    valid while its "owner" entry or this object lives; handle and hostfn_arg() while this object lives (after
    close() their C entry points fail through the error word instead of running).
    Fork: in a forked child (multiprocessing's default start method on Linux) the worker threads do not exist;
    every call raises RuntimeError saying so. Create a new executor in the child. Exiting the interpreter with a
    decode in flight in a daemon thread is safe (that thread parks; the process exits).

    format: a format name (every layer, both matrices), or a list with one entry per layer, each a format name or a
    (gate_up_format, down_format) pair (cpumoe_formats.layer_formats; docs/executor.md "Formats per layer"). A
    pair's formats share E, H, I and the activation mode; mode=None picks the one mode every format of the model
    supports, preferring the first layer's gate_up format's default (cpumoe_formats.model_mode).
    banks: a list, one mapping per layer, of bank name -> array (cpumoe_formats schema). A pair layer's mapping holds
    the gate_up format's gate_up banks and the down format's down banks under their schema names (q4_k's "gate_up",
    q6_k's "down").
    repack: None (default) repacks each layer into the format's CPU layout where it pays off (FormatSpec.cpu_layout:
    mxfp4 -> mxfp4_panel, and on to mxfp4_x16 in mode w4a8, both bit-identical; q4_0 -> q4_0_x16, nvfp4 ->
    nvfp4_x16 and ds_fp4 -> ds_fp4_x16 in mode w4a8 and fp8_block -> fp8_block_x16, each from avx2; bf16 -> bf16_x16
    from avx512f below AMX; q8_0 -> q8_0_x16 and q4_k -> q4_k_x16 in mode w4a8, q5_k -> q5_k_x16 and q6_k ->
    q6_k_x16, from avx2; each the format's math in the layout's own fp32 order; only for shapes the layout takes);
    the layers are repacked on the executor's threads, and the executor then holds that new copy and not the given
    arrays. False keeps the given arrays, zero-copy; True forces the (first) layout. With several formats the rule
    runs per format and each role is repacked alone (a Q4_K_M layer's q4_k gate_up -> q4_k_x16, its q6_k down ->
    q6_k_x16; a Q5_K_M layer's q5_k gate_up -> q5_k_x16; a format given as a layout, which has none of its own,
    stays as given); True forces the formats that have a layout (it raises where none has).
    numa: None (auto: "split" where two or more NUMA nodes get workers and the format can be cut by I, else "off"),
    "split" (one worker group per node, each layer's experts cut by I into one slice per node, each slice copied
    onto its node), "replicate" (a full copy on every node, each worker reading its node's), "off" (one pool on the
    given arrays, as on one node), or a numa.NumaPlan (explicit groups and slices: tests). The threads of every group
    follow the contracts above; a placed copy is freed by close() once no layer_banks() view holds it
    (docs/numa.md). sysfs_root: where the topology is read ("/sys"; CPUMOE_SYSFS_ROOT; tests describe any machine).
    team: "pool" (default): the steps run on worker threads of this executor's own, pinned to core_ids, spinning
    spin_us between steps. "openmp": on the OpenMP team of the thread that calls decode, from the OpenMP runtime the
    process already loaded (libgomp.so.1: torch's), `threads` of its threads; nothing of ours is started or pinned.
    For activations on the CPU, where torch runs the rest of the model on those threads: they spin ~12 ms after each
    of torch's parallel regions, so workers of our own on the same cores enter a step late (390-650 us into a 760 us
    step on the 2-core VM). Synchronous decode only (no coordinator, no NUMA groups); ValueError naming the cause
    and the way out where it cannot run (openmp_team_unusable(): no OpenMP runtime loaded, or a forked child). A
    decode from another thread runs on that thread's team (libgomp keeps one per thread that starts regions); one
    from inside a parallel region runs on the caller alone.
    """

    def __init__(self, format, banks, *, top_k: int, E: int | None = None, H: int | None = None,
                 I: int | None = None, activation: str = "silu", alpha: float | None = None,  # noqa: E741
                 limit: float | None = None, apply_router_weight_on_input: bool = False, max_tokens: int = 8,
                 threads: int | None = None, core_ids=None, mode: str | None = None, isa: str | None = None,
                 pin: bool = True, spin_us: int = 2000, repack: bool | None = None, numa=None,
                 sysfs_root: str | None = None, team: str = "pool"):
        if team not in TEAMS:
            raise ValueError(f"team={team!r}: expected one of {list(TEAMS)}")
        if team == "openmp" and (why := _native.openmp_team_unusable()):
            raise ValueError(f"team='openmp': {why}")  # before any repack; the native executor checks again
        if repack not in (None, True, False):
            raise ValueError(f"repack={repack!r} must be None (auto), True or False")
        if isinstance(banks, dict) or not hasattr(banks, "__len__") or len(banks) == 0:
            raise TypeError("banks must be a non-empty list with one mapping of bank name -> array per layer")
        pairs = cf.layer_formats(format, len(banks))
        given = list(dict.fromkeys(n for p in pairs for n in p))  # the distinct formats, in first-use order
        if repack and not any(cf.get_format(n).cpu_layout for n in given):
            what = (f"format {given[0]!r} has no CPU layout" if len(given) == 1 else
                    f"none of the formats {given} has a CPU layout")
            raise ValueError(f"repack=True: {what} to repack into; expected repack=None or False")
        if not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
            raise ValueError(f"top_k={top_k!r} must be an int in [1, {MAX_TOP_K}]")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r} must be a positive int")
        for n in given:
            if apply_router_weight_on_input and not cf.get_format(n).input_weight:
                raise ValueError(f"format {n!r} applies the router weight on the output; "
                                 "apply_router_weight_on_input=True is not supported")
        self._given_pairs = pairs
        self._arrays = []
        dims = (E, H, I)
        for layer, b in enumerate(banks):
            try:
                (gu, dn), d = cf.validate_layer(pairs[layer], b, *dims)
            except (ValueError, TypeError) as e:
                raise type(e)(f"layer {layer}: {e}") from None
            dims = d
            self._arrays.append(gu + dn)
        self.E, self.H, self.I = dims
        self.act = cf.activations.resolve(activation, alpha, limit)
        if cf.is_uniform(pairs):
            spec = cf.get_format(pairs[0][0])
            mode = spec.default_mode if mode is None else mode
            if mode not in spec.modes:
                raise ValueError(f"mode={mode!r} is not supported by format {spec.name!r}; "
                                 f"expected one of {list(spec.modes)}")
        else:
            mode = cf.model_mode(pairs, mode)
        if isa is not None and isa not in TIERS:
            raise ValueError(f"isa={isa!r} is not a tier; expected one of {list(TIERS)}")
        self._formats = model_formats.resolve(pairs, self.H, self.I, mode, isa, repack, repack_target)
        kernel_specs = self._formats.kernel_formats
        self._topology, self._placed = None, None
        if team == "openmp":
            if numa not in (None, "off"):
                raise ValueError(f"numa={numa!r} with team='openmp': an OpenMP team is one pool; expected numa=None "
                                 "or 'off' (or team='pool')")
            numa = "off"
        self.numa_plan = self._plan_numa(numa, sysfs_root, threads, core_ids, len(banks))
        if self.numa_plan is None:
            self.core_ids, why = _resolve_cores(threads, core_ids)
        else:
            self.core_ids, why = self.numa_plan.cores, self.numa_plan.why
        self.mode, self.top_k, self.max_tokens, self.num_layers = mode, top_k, max_tokens, len(banks)
        if self.numa_plan is None:
            for layer, arrays in self._layers_as(banks):
                self._arrays[layer] = arrays  # repacked copies where a role repacks (the executor holds them)
        lim = self.act.limit if math.isfinite(self.act.limit) else float("inf")
        plan = self.numa_plan
        self._x = _native.Executor(kernel_specs[0].id, self.act.id, _MODES.index(mode),
                                   bool(apply_router_weight_on_input), self.E, self.H, self.I, self.act.alpha, lim,
                                   -1 if isa is None else TIERS.index(isa), self.num_layers, top_k, max_tokens,
                                   self.core_ids, bool(pin), int(spin_us), self._label(),
                                   groups=[(g.node, list(g.cores), list(g.parts)) for g in plan.groups] if plan else [],
                                   bounds=list(plan.bounds) if plan else [], formats=[s.id for s in kernel_specs],
                                   layer_kernels=self._formats.layer_kernels(), team_openmp=team == "openmp")
        self.team = team
        self._kernel_names = tuple(self._x.kernel_names)  # per kernel format; readable after close()
        self._linear_isa = self._x.linear_name
        self._attention_isa = self._x.attention_name
        if plan is None:
            # the arrays must outlive the executor (the given ones where a layer runs them in place)
            self._banks_ref = banks if not self._repacked() else None
            for layer, arrays in enumerate(self._arrays):
                views = kernel_specs[0].bank_views(arrays)  # pointers and strides (bank_views reads only the arrays)
                self._x.set_banks(layer, views, *self._formats.bank_maps(layer))
        else:
            try:
                self._place(banks)
            except BaseException:
                self._x.close()
                raise
        log.info("cpumoe_executor ready: format=%s isa=%s threads=%d cores=%s (%s) E=%d H=%d I=%d top_k=%d "
                 "max_tokens=%d layers=%d act=%s route_sum=%s numa=%s", self._formats_line(), self.isa,
                 self.threads, self.core_ids, why, self.E, self.H, self.I, top_k, max_tokens, self.num_layers,
                 self.act.name, self._x.route_sum_isa, self._numa_line())
        for s_ in kernel_specs:
            if s_.hint:
                log.info("cpumoe_executor: format %s: %s", s_.name, s_.hint)

    def _repacked(self) -> bool:
        """Whether any layer's role runs a repacked copy (not the given arrays)."""
        return any(r is not g for gp, rp in zip(self._formats.given, self._formats.run) for g, r in zip(gp, rp))

    def _formats_line(self) -> str:
        """The ready line's formats: "q4_0_x16 (repacked from q4_0)" for a single-format model, else per layer
        ("q4_k_x16/q6_k_x16 x 12 layers, ... (given q4_k/q6_k x 12 layers, ...)")."""
        f = self._formats
        if f.uniform:
            g, r = f.given[0][0].name, f.run[0][0].name
            return r if g == r else f"{r} (repacked from {g})"
        run, given = f.summary("run"), f.summary("given")
        return run if run == given else f"{run} (given {given})"

    # ---- formats: one for the model, or per layer and role --------------------------------------------------
    @property
    def mixed(self) -> bool:
        """Whether the model was given more than one format (per layer or per matrix)."""
        return not self._formats.uniform

    @property
    def spec(self):
        """The FormatSpec every layer runs (the repacked layout where it repacked). A mixed model has none:
        ValueError (layer_formats / layer_spec)."""
        if self.mixed:
            raise ValueError(f"{self._label()} runs a format per layer and per matrix ({self._formats.summary()}): "
                             "it has no one spec; use layer_formats or layer_spec(layer, role)")
        return self._formats.run[0][0]

    @property
    def given_format(self) -> str:
        """The format name the banks were given in. A mixed model: ValueError (given_layer_formats)."""
        if self.mixed:
            raise ValueError(f"{self._label()} was given a format per layer and per matrix "
                             f"({self._formats.summary('given')}): use given_layer_formats")
        return self._formats.given[0][0].name

    @property
    def layer_formats(self) -> list:
        """Per layer, the (gate_up, down) format names as they run (after repack), e.g. ("q4_k_x16", "q6_k_x16")."""
        return [(g.name, d.name) for g, d in self._formats.run]

    @property
    def given_layer_formats(self) -> list:
        """Per layer, the (gate_up, down) format names the banks were given in (canonical names)."""
        return [(g.name, d.name) for g, d in self._formats.given]

    def layer_spec(self, layer: int, role: str = "gate_up"):
        """The FormatSpec that runs `role` ("gate_up" or "down") of `layer`."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r}: expected an int in [0, {self.num_layers})")
        return self._formats.run[layer][cf.ROLES.index(check_role(role))]

    def _layers_as(self, banks):
        """(layer, arrays in ModelFormats.names() order) of every layer, each role repacked into its run format one
        layer at a time (progress logged), or as validated where nothing repacks."""
        f = self._formats
        t0, n, every = time.perf_counter(), 0, max(1, len(banks) // 10)
        for layer, b in enumerate(banks):
            gp, rp = f.given[layer], f.run[layer]
            if gp[0] is rp[0] and gp[1] is rp[1]:
                yield layer, self._arrays[layer]
                continue
            # the experts in as many slices at once as the executor has threads
            arrays = model_formats.repack_layer(gp, rp, b, (self.E, self.H, self.I), len(self.core_ids))
            n += sum(a.nbytes for a in arrays)
            if (layer + 1) % every == 0 or layer + 1 == len(banks):
                log.info("cpumoe_executor: repacked %s -> %s, layer %d/%d, %.2f GB in %.1f s (repack=False keeps "
                         "the given arrays)", _pair_name(gp), _pair_name(rp), layer + 1,
                         len(banks), n / 1e9, time.perf_counter() - t0)
            yield layer, arrays

    def _label(self) -> str:
        f = self._formats
        if f.uniform:
            g, r = f.given[0][0].name, f.run[0][0].name
            ran = r if g == r else f"{g} as {r}"
        else:
            ran = "per layer: " + f.summary()
        return (f"CpuMoeExecutor({ran}, {self.num_layers} layers, E={self.E} H={self.H} I={self.I}, "
                f"id {id(self):#x})")

    def __repr__(self) -> str:
        x = getattr(self, "_x", None)
        state = "unbuilt" if x is None else "closed" if x.closed else "forked away" if x.state_error() else "live"
        return f"<{self._label()[:-1]}, {state})>" if hasattr(self, "num_layers") else "<CpuMoeExecutor (unbuilt)>"

    def _check(self) -> None:
        """RuntimeError unless the executor can run: not closed, and in the process that created it."""
        err = self._x.state_error()
        if err:
            raise RuntimeError(err)

    @property
    def closed(self) -> bool:
        return self._x.closed

    # ---- properties ---------------------------------------------------------------
    @property
    def isa(self) -> str:
        """The kernel that runs: tier plus precision mode (e.g. 'avx512bf16', 'avx2+w4a8'). A model of several
        formats whose kernels differ: each format's, "q5_k_x16=avx512vnni+w4a8, q6_k_x16=avx2+w4a8" (kernel_isas)."""
        names = set(self._kernel_names)
        if len(names) == 1:
            return self._x.kernel_name
        return ", ".join(f"{k}={v}" for k, v in self.kernel_isas.items())

    @property
    def kernel_isas(self) -> dict:
        """Run format name -> the kernel that runs it (tier plus mode), one entry per format of the model."""
        return dict(zip((s.name for s in self._formats.kernel_formats), self._kernel_names))

    @property
    def threads(self) -> int:
        return self._x.threads

    @property
    def handle(self) -> int:
        """The native executor (cpumoe_executor*) for consumers of the C ABI: valid while this object lives (hold
        a reference to it, as gpusync's IO block does); after close() its entry points fail through the error
        word."""
        self._check()
        return self._x.handle

    # ---- synchronous decode -------------------------------------------------------------
    def decode(self, layer: int, x, topk_weights, topk_ids, out=None):
        """y [T, H] bf16 for one layer's routed experts; synchronous on host arrays/tensors. out: a writable,
        aligned, C-contiguous bfloat16 array [T, H] to write y into (cpumoe_formats.arrays.check_array), else a new
        one. CPU torch tensors as a router leaves them (x bf16, weights float32 or bf16, ids int32 or int64, each
        C-contiguous) go to the native step in place, y a new bf16 tensor: no conversion runs in Python."""
        if out is None:
            y = self.decode_routed(layer, x, topk_weights, topk_ids)
            if y is not None:
                return y
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r} is not in [0, {self.num_layers})")
        torch_in = str(getattr(x, "dtype", "")).startswith("torch.")
        xb = x_as_bf16(x, self.H)
        T = xb.shape[0]
        if not 1 <= T <= self.max_tokens:
            raise ValueError(f"batch size {T} (x rows) is not in [1, max_tokens={self.max_tokens}]")
        w, ids = check_routing(topk_weights, topk_ids, T, self.E)
        if ids.shape[1] != self.top_k:
            raise ValueError(f"topk_ids: {describe(ids)}, expected top_k={self.top_k} columns")
        out = np.empty((T, self.H), BF16) if out is None else check_array(out, "out", dtype=BF16, shape=(T, self.H),
                                                                            writable=True)
        self._x.decode(int(layer), T, xb.ctypes.data, ids.ctypes.data, w.ctypes.data, out.ctypes.data)
        if torch_in:
            import torch  # only when given torch tensors

            return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
        return out

    def _unserved(self):
        """decode_routed's None for an input it does not take, after the one check every input gets: open."""
        self._check()
        return None

    def decode_routed(self, layer: int, x, topk_weights, topk_ids):
        """decode() of CPU torch tensors as a router leaves them, read in place by the native step: x [T, H] bf16,
        topk_weights [T, top_k] float32 or bf16 (widened exactly there), topk_ids [T, top_k] int32 or int64
        (range-checked there before narrowing: ValueError naming the route), each C-contiguous, 1 <= T <=
        max_tokens, layer an int in range. Returns y, a new bf16 tensor like x; or None, with nothing run, for any
        other input (the caller's general path converts it or names what is wrong); a closed executor raises either way.

        Between a model's layers Python finds its caches and TLB cold (the layer streamed tens of MB): on the Zen 4
        VM each tensor attribute read then costs ~10 us and a torch op 30-60 us, so this reads five kinds of
        attribute and runs one op (torch.empty_like). Threads: decode's."""
        torch = sys.modules.get("torch")
        if (torch is None or type(layer) is not int or not 0 <= layer < self.num_layers
                or type(x) is not torch.Tensor or type(topk_weights) is not torch.Tensor
                or type(topk_ids) is not torch.Tensor):
            return self._unserved()
        wd, idd = topk_weights.dtype, topk_ids.dtype
        if (x.dtype is not torch.bfloat16 or (wd is not torch.float32 and wd is not torch.bfloat16)
                or (idd is not torch.int64 and idd is not torch.int32)):
            return self._unserved()
        xs, ws = x.shape, topk_weights.shape
        if len(xs) != 2 or xs[1] != self.H or not 1 <= xs[0] <= self.max_tokens or ws != (xs[0], self.top_k) \
                or topk_ids.shape != ws:
            return self._unserved()
        if not (x.is_cpu and topk_weights.is_cpu and topk_ids.is_cpu and x.is_contiguous()
                and topk_weights.is_contiguous() and topk_ids.is_contiguous()):
            return self._unserved()
        ib, wb = (8 if idd is torch.int64 else 4), (2 if wd is torch.bfloat16 else 4)
        xp, wp, ip = x.data_ptr(), topk_weights.data_ptr(), topk_ids.data_ptr()
        if xp % 2 or wp % wb or ip % ib:  # element-misaligned views (a byte offset into a storage)
            return self._unserved()
        y = torch.empty_like(x)
        self._x.decode(layer, xs[0], xp, ip, wp, y.data_ptr(), ib, wb == 2)
        return y

    # ---- the dense bf16 linear (cpumoe-formats C ABI 1.9) ---------------------------------------------------------
    @property
    def linear_isa(self) -> str:
        """The tier the dense linear runs (e.g. 'avx512bf16'): the best one under the experts' cap (isa= or
        CPUMOE_ISA). Readable after close()."""
        return self._linear_isa

    def linear(self, x, weight, bias=None, out=None):
        """y [n, M] = x @ weight.T (+ bias) on this executor's threads (the first worker group's: the caller and
        its workers, or its OpenMP team), by cpumoe_formats' dense bf16 linear: the non-expert projections of a
        model at decode. fp32 accumulation; y bf16 (to nearest even), or float32 into a float32 `out`.

        x [n, K] bfloat16 with contiguous rows (a CPU torch tensor may also be a contiguous [..., K]: y is then
        [..., M]); weight [M, K] bfloat16 with contiguous rows (a row stride is allowed: a slice of a wider
        matrix); bias None or bfloat16 [M]; out None (a new bf16 array or tensor) or a writable [n, M] bfloat16 or
        float32 array with contiguous rows. CPU torch tensors are read in place and y is a torch tensor; numpy
        arrays give numpy. Any n >= 1 runs (a few tokens is what it is fast for: the weight
        is read once per call, rows shared by up to 4 tokens a pass). Runs under the step lock, so a linear and a
        decode step never interleave. Threads: decode's."""
        torch = sys.modules.get("torch")
        plain = () if torch is None else (torch.Tensor, torch.nn.Parameter)  # a module's weight is a Parameter
        if out is None and type(x) in plain and type(weight) in plain and (bias is None or type(bias) in plain):
            y = dense_linear.run_torch(self._x, torch, x, weight, bias)
            if y is not None:
                return y
        self._check()
        return dense_linear.run_general(self._x, x, weight, bias, out)

    # ---- decode attention (cpumoe-formats C ABI 1.11) ------------------------------------------------------------
    @property
    def attention_isa(self) -> str:
        """The tier the decode attention runs (e.g. 'avx512f'), under the experts' cap. Readable after close()."""
        return self._attention_isa

    def attention_raw(self, n: int, group: int, D: int, L: int, Hkv: int, q: int, q_tok: int, q_head: int, k: int,
                      k_head: int, k_pos: int, v: int, v_head: int, v_pos: int, mask: int, mask_tok: int,
                      scale: float, o: int, o_tok: int, o_head: int) -> None:
        """cpumoe_formats.DecodeAttention.run_raw's call (addresses, element strides; mask 0 = none) on this
        executor's threads: the n tokens x Hkv kv heads are work items its first group's threads claim (the same
        bits on any team). For a caller that holds the arrays and checked them (moe_engine.attention); an address
        that does not hold what the sizes say is undefined behaviour. Under the step lock. Threads: decode's."""
        self._x.attention(n, group, D, L, Hkv, q, q_tok, q_head, k, k_head, k_pos, v, v_head, v_pos, mask, mask_tok,
                          float(scale), o, o_tok, o_head)

    # ---- machine ceiling -------------------------------------------------------------------------
    def read_bandwidth(self, buf, passes: int = 1) -> float:
        """GB/s of `passes` whole-buffer reads of `buf` (a C-contiguous array, e.g. 4x the LLC) by this executor's
        own pool, every thread reading its slice: the read ceiling the decode steps compete with."""
        a = as_array(buf, "buf")
        if not a.flags.c_contiguous or a.nbytes < 4096:
            raise ValueError(f"buf: {describe(a)}, expected a C-contiguous array of at least 4096 bytes")
        if not isinstance(passes, int) or passes < 1:
            raise ValueError(f"passes={passes!r} must be a positive int")
        bw = self._x.read_bandwidth(a.ctypes.data, a.nbytes, passes)
        return len(bw) / sum(1.0 / b for b in bw)

    def work(self) -> tuple[float, int]:
        """(seconds, experts) of every step that has run the pool since this executor opened, any handshake path:
        each step's time from its start to its last down item, and the distinct experts it routed. Deltas of two
        readings give a caller the experts (so weight bytes) per second its steps read live. Any thread."""
        self._check()
        return self._x.work_ns / 1e9, int(self._x.work_experts)

    def layer_banks(self, layer: int) -> dict:
        """Layer `layer`'s banks as this executor runs them (format `spec.name`: the repacked copies where it repacked;
        a two-format layer: layer_formats[layer]'s gate_up format's gate_up banks and its down format's down banks),
        bank name -> array; the arrays are the executor's own (read them, do not write). Placed on NUMA nodes:
        read-only views of the first group's copy (they keep it alive after close()), or under numa="split" the
        slices joined back into new arrays (numa_banks.join: the same weights)."""
        self._check()
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r}: expected an int in [0, {self.num_layers})")
        names, (g, d) = self._formats.names(layer), self._formats.run[layer]
        if self._placed is None:
            return dict(zip(names, self._arrays[layer]))
        parts = []  # per slice, read-only views of the first placed copy (they keep it alive)
        for q in range(len(self.numa_plan.bounds) - 1):
            mem, descs = next(v for (_, p), v in sorted(self._placed[layer].items()) if p == q)
            parts.append({n: np.ndarray(shape, dtype, buffer=mem, offset=off, strides=st)
                          for n, (shape, dtype, st, off) in zip(names, descs)})
        if len(parts) == 1:
            return parts[0]
        if g is d:
            return numa_banks.join(g, parts)
        return {**numa_banks.join_role(g, "gate_up", parts), **numa_banks.join_role(d, "down", parts)}

    @property
    def team_unit(self) -> int:
        """Weight bytes per worker when a step sizes its team (set_team_unit)."""
        self._check()
        return _native.team_unit(self.handle)

    def set_team_unit(self, unit_bytes: int) -> None:
        """Weight bytes per worker when a step sizes its team (0: every worker works on every step; benchmarks and
        tests pin it, the default is measured for the machine)."""
        if not isinstance(unit_bytes, int) or unit_bytes < 0:
            raise ValueError(f"unit_bytes={unit_bytes!r}: expected an int >= 0")
        self._check()
        _native.set_team_unit(self.handle, unit_bytes)

    # ---- step trace ------------------------------------------------------------------------------
    def start_trace(self) -> None:
        """Trace the steps from now on (clears earlier sums): per thread, where its time in a step goes."""
        self._x.set_trace(True)

    def stop_trace(self) -> dict:
        """Stop tracing; returns the traced steps' averages in microseconds per step (trace.trace_summary: the
        step, each phase averaged over the threads that ran, the spread of their busy time) with the raw
        per-thread nanosecond sums under "raw"."""
        self._x.set_trace(False)
        raw = self._x.trace()
        if not raw["steps"]:
            return {"steps": 0, "raw": raw}
        return {"steps": raw["steps"], **trace_summary(raw), "raw": raw}

    def close(self) -> None:
        """Wait for the step in flight, join the coordinator and the workers, free the kernel, scratch and banks.
        Idempotent; every later call raises RuntimeError naming this executor (class docstring: what stays valid).
        In a forked child it forgets the parent's threads instead of joining them."""
        self._x.close()
        self._arrays = self._banks_ref = self._placed = None

    def __enter__(self):
        self._check()
        return self

    def __exit__(self, *exc):
        self.close()


