// One MoE layer's decode step on ggml's CPU backend, built the way llama.cpp's
// llm_graph_context::build_moe_ffn (src/llama-graph.cpp) builds it, timed the way
// packages/cpumoe-executor/src/cpumoe_executor/bench.py (bench_one, routes_for) times ours.
//
//   moe_ggml_bench [--format q4_0,mxfp4,bf16] [--batch 1,8] [--routing random|shared|both] [--threads N]
//                  [--repeats 5] [--steps 20] [--warmup 3] [--seed 0] [--json FILE] [--llc BYTES]
//                  [--no-extra-bufts] [--down-scale] [--no-check] [--tol 0.05]
//
// Graph per step (inputs: x [H, T] f32, ids [top_k, T] i32, router weights [1, top_k, T] f32; the router
// itself, its softmax / top-k, is not part of the step, as in ours):
//   q4_0  (gemma4-26b, H 2816, I 704, E 128, top_k 8):  gu = mul_mat_id(gate_up_exps, x, ids)  (gemma4's GGUF
//         ships ffn_gate_up_exps merged), gate/up = views of gu, a = geglu_split(gate, up)  (GELU-tanh)
//   mxfp4 (gpt-oss-120b, H 2880, I 2880, E 128, top_k 4): up = add_id(mul_mat_id(up_exps, x, ids), up_b, ids),
//         gate = add_id(mul_mat_id(gate_exps, x, ids), gate_b, ids), a = swiglu_oai(gate, up, 1.702, 7.0)
//   bf16  (qwen3-30b, H 2048, I 768, E 128, top_k 8):  up = mul_mat_id(up_exps, ...), gate = mul_mat_id(gate_exps,
//         ...), a = swiglu_split(gate, up)  (SiLU GLU)
//   then d = mul_mat_id(down_exps, a, ids) (+ add_id(down_b) for mxfp4), d = mul(d, weights),
//   y = d[:, 0, :] + d[:, 1, :] + ... (ggml_add of the top_k views, in order), as build_moe_ffn does.
// --down-scale adds gemma4's per-expert down scale (ffn_down_exps_s: get_rows + mul) for q4_0.
//
// Weights: a bank of E_bank experts of real ggml data (random normal floats through ggml_quantize_chunk),
// placed in the buffer type llama.cpp's loader would pick (select_weight_buft: the CPU extra buffer types,
// CPU_REPACK / AMX, when they support the op, else CPU; --no-extra-bufts = llama.cpp --no-repack).
// E_bank, windows and routing mirror our bench: window = min(E, top_k * max_batch);
// need = max(4 LLC, 2 window bytes); n_win = max(2, ceil(need / window bytes)); E_bank = window * n_win;
// per (batch T, routing) the bank is cut into plans over windows of top_k * T experts (random: each token picks
// top_k distinct experts of the window) or top_k (shared: all tokens the same top_k); step s runs plan
// s % n_plans. Before every timed repeat a 4 x LLC buffer is read (untimed), as ours reads its ceiling window.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cstdarg>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifndef BENCH_GGML_OPENMP
#define BENCH_GGML_OPENMP 1
#endif
#ifndef BENCH_BUILD_FLAGS
#define BENCH_BUILD_FLAGS "unknown"
#endif

enum Act { ACT_SILU, ACT_GELU, ACT_OAI };

struct Model {
    const char * fmt;
    const char * model;
    ggml_type    type;
    int64_t      H, I, E;
    int          top_k;
    Act          act;
    bool         merged_gate_up;  // gemma4: ffn_gate_up_exps
    bool         biases;          // gpt-oss: ffn_{up,gate,down}_exps_b (f32)
};

static const Model MODELS[] = {
    {"q4_0", "gemma4-26b", GGML_TYPE_Q4_0, 2816, 704, 128, 8, ACT_GELU, true, false},
    {"mxfp4", "gpt-oss-120b", GGML_TYPE_MXFP4, 2880, 2880, 128, 4, ACT_OAI, false, true},
    {"bf16", "qwen3-30b", GGML_TYPE_BF16, 2048, 768, 128, 8, ACT_SILU, false, false},
};
static const float OAI_ALPHA = 1.702f, OAI_LIMIT = 7.0f;

struct Opts {
    std::vector<std::string> formats{"q4_0", "mxfp4", "bf16"};
    std::vector<int>         batch{1, 8};
    std::vector<std::string> routings{"random", "shared"};
    int                      threads = 0;
    int                      repeats = 5, steps = 20, warmup = 3;
    uint64_t                 seed = 0;
    std::string              json;
    int64_t                  llc = 0;
    bool                     extra_bufts = true, down_scale = false, check = true;
    double                   tol = 0.05;
};

static void logf_(const char * fmt, ...) __attribute__((format(printf, 1, 2)));
static void logf_(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "[ggml-bench] ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

static std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> out;
    std::stringstream        ss(s);
    std::string              item;
    while (std::getline(ss, item, sep)) {
        if (!item.empty()) out.push_back(item);
    }
    return out;
}

// ---- machine ------------------------------------------------------------------------------------------------
static int64_t parse_size(std::string s) {
    while (!s.empty() && isspace((unsigned char) s.back())) s.pop_back();
    if (s.empty()) return 0;
    int64_t mul = 1;
    char    c   = s.back();
    if (c == 'K' || c == 'k') mul = 1 << 10;
    if (c == 'M' || c == 'm') mul = 1 << 20;
    if (c == 'G' || c == 'g') mul = 1LL << 30;
    if (mul != 1) s.pop_back();
    return atoll(s.c_str()) * mul;
}

static std::string read_file(const std::string & path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// as cpumoe_formats.bench.llc_bytes: the level-3 cache of cpu0, else the largest data/unified cache
static int64_t llc_bytes() {
    int64_t l3 = 0, other = 0;
    for (int i = 0; i < 8; i++) {
        std::string d = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
        std::string type = read_file(d + "type");
        if (type.empty()) continue;
        if (type.rfind("Instruction", 0) == 0) continue;
        int     level = atoi(read_file(d + "level").c_str());
        int64_t size  = parse_size(read_file(d + "size"));
        if (level == 3) l3 = std::max(l3, size);
        other = std::max(other, size);
    }
    return l3 ? l3 : other;
}

static std::string cpu_model() {
    if (FILE * p = popen("lscpu 2>/dev/null", "r")) {
        char        line[512];
        std::string model;
        while (fgets(line, sizeof line, p)) {
            if (strncmp(line, "Model name:", 11) == 0) {
                model = line + 11;
                break;
            }
        }
        pclose(p);
        size_t a = model.find_first_not_of(" \t");
        size_t b = model.find_last_not_of(" \t\n");
        if (a != std::string::npos) return model.substr(a, b - a + 1);
    }
    std::stringstream ss(read_file("/proc/cpuinfo"));
    std::string       line;
    while (std::getline(ss, line)) {
        if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
    }
    return "unknown";
}

static std::string json_str(const std::string & s) {
    std::string o = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') { o += '\\'; o += c; }
        else if ((unsigned char) c < 0x20) { char b[8]; snprintf(b, sizeof b, "\\u%04x", c); o += b; }
        else o += c;
    }
    return o + "\"";
}

// ---- random data --------------------------------------------------------------------------------------------
static inline uint64_t splitmix64(uint64_t & x) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
    z          = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z          = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// n normal floats (Box-Muller), scaled, from a stream seeded by (seed, tensor, expert): any expert can be
// regenerated bit-exactly for the reference check
static void gen_normal(uint64_t seed, int tensor, int64_t expert, float scale, float * out, int64_t n) {
    uint64_t s = seed * 0x100000001B3ULL + (uint64_t) tensor * 0x9E3779B97F4A7C15ULL + (uint64_t) expert * 0xD1B54A32D192ED03ULL;
    splitmix64(s);
    const float two_pi = 6.28318530717958647692f;
    for (int64_t i = 0; i < n; i += 2) {
        uint64_t r  = splitmix64(s);
        float    u1 = ((r >> 40) + 1) * (1.0f / 16777217.0f);  // (0, 1]
        float    u2 = ((r >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
        float    m  = sqrtf(-2.0f * logf(u1)) * scale;
        out[i]      = m * cosf(two_pi * u2);
        if (i + 1 < n) out[i + 1] = m * sinf(two_pi * u2);
    }
}

// ---- weights ------------------------------------------------------------------------------------------------
struct Weight {
    std::string           name;
    int                   id;     // tensor id for the generator
    ggml_tensor *         t   = nullptr;
    ggml_context *        ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    ggml_op               op;     // the op llama.cpp's loader tests the buffer type with
    float                 scale;  // generator scale
    bool                  expert_matrix;
    std::string           buft;
};

// llama_model_loader's weight_buft_supported(): does `buft` on the CPU device support `op` with weight w?
static bool weight_buft_supported(ggml_tensor * w, ggml_op op, int top_k, ggml_backend_buffer_type_t buft, ggml_backend_dev_t dev) {
    ggml_init_params params = {ggml_tensor_overhead() * 8, nullptr, true};
    ggml_context *   ctx    = ggml_init(params);
    ggml_tensor *    op_t   = nullptr;
    if (op == GGML_OP_MUL_MAT_ID) {
        ggml_tensor * b   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], top_k, 512);
        ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, top_k, 512);
        op_t              = ggml_mul_mat_id(ctx, w, b, ids);
    } else if (op == GGML_OP_ADD_ID) {
        ggml_tensor * a = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], top_k, 512);
        ggml_tensor * c = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, top_k, 512);
        op_t            = ggml_add_id(ctx, a, w, c);
    } else {  // GGML_OP_MUL (the per-expert scale)
        ggml_tensor * a = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, w->ne[0], w->ne[1], w->ne[2], w->ne[3]);
        op_t            = ggml_mul(ctx, a, w);
    }
    w->buffer = ggml_backend_buft_alloc_buffer(buft, 0);
    bool ok   = ggml_backend_dev_supports_op(dev, op_t);
    ggml_backend_buffer_free(w->buffer);
    w->buffer = nullptr;
    ggml_free(ctx);
    return ok;
}

struct Bank {
    const Model *       m;
    int64_t             E;  // experts in the bank
    std::vector<Weight> w;  // gate_up | up, gate; down; biases; down scale
    Weight *            gate_up = nullptr, *up = nullptr, *gate = nullptr, *down = nullptr;
    Weight *            up_b = nullptr, *gate_b = nullptr, *down_b = nullptr, *down_s = nullptr;
    size_t              bytes_per_expert = 0;

    ~Bank() {
        for (auto & x : w) {
            if (x.buf) ggml_backend_buffer_free(x.buf);
            if (x.ctx) ggml_free(x.ctx);
        }
    }
};

static void fill_expert(const Weight & x, ggml_type type, uint64_t seed, int64_t e, void * dst, std::vector<float> & tmp) {
    const int64_t ne0 = x.t->ne[0], ne1 = x.expert_matrix ? x.t->ne[1] : 1;
    tmp.resize(ne0 * ne1);
    gen_normal(seed, x.id, e, x.scale, tmp.data(), ne0 * ne1);
    if (x.name == "down_s") {  // per-expert scales near 1
        for (auto & v : tmp) v = 1.0f + v;
    }
    ggml_quantize_chunk(type, tmp.data(), dst, 0, ne1, ne0, nullptr);
}

static Bank * build_bank(const Model & m, int64_t E, const Opts & o, ggml_backend_dev_t dev) {
    Bank * b = new Bank();
    b->m     = &m;
    b->E     = E;
    const float sh = 1.0f / sqrtf((float) m.H), si = 1.0f / sqrtf((float) m.I);
    auto add = [&](const char * name, int id, ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2, ggml_op op, float scale,
                   bool mat) {
        Weight x;
        x.name = name;
        x.id   = id;
        x.op   = op;
        x.scale         = scale;
        x.expert_matrix = mat;
        ggml_init_params p = {ggml_tensor_overhead() * 2, nullptr, true};
        x.ctx             = ggml_init(p);
        x.t               = ne2 ? ggml_new_tensor_3d(x.ctx, type, ne0, ne1, ne2) : ggml_new_tensor_2d(x.ctx, type, ne0, ne1);
        ggml_set_name(x.t, name);
        b->w.push_back(x);
    };
    // ids: 0 gate_up / 1 up / 2 gate / 3 down / 4.. biases (tensor shapes as llama.cpp creates them)
    if (m.merged_gate_up) {
        add("gate_up_exps", 0, m.type, m.H, 2 * m.I, E, GGML_OP_MUL_MAT_ID, sh, true);
    } else {
        add("up_exps", 1, m.type, m.H, m.I, E, GGML_OP_MUL_MAT_ID, sh, true);
        add("gate_exps", 2, m.type, m.H, m.I, E, GGML_OP_MUL_MAT_ID, sh, true);
    }
    add("down_exps", 3, m.type, m.I, m.H, E, GGML_OP_MUL_MAT_ID, si, true);
    if (m.biases) {
        add("up_exps_b", 4, GGML_TYPE_F32, m.I, E, 0, GGML_OP_ADD_ID, 0.1f, false);
        add("gate_exps_b", 5, GGML_TYPE_F32, m.I, E, 0, GGML_OP_ADD_ID, 0.1f, false);
        add("down_exps_b", 6, GGML_TYPE_F32, m.H, E, 0, GGML_OP_ADD_ID, 0.1f, false);
    }
    if (o.down_scale && m.merged_gate_up) {
        add("down_s", 7, GGML_TYPE_F32, 1, E, 0, GGML_OP_MUL, 0.1f, false);  // [E] as [1, E]: one value per expert
    }
    for (auto & x : b->w) {
        if (x.name == "gate_up_exps") b->gate_up = &x;
        if (x.name == "up_exps") b->up = &x;
        if (x.name == "gate_exps") b->gate = &x;
        if (x.name == "down_exps") b->down = &x;
        if (x.name == "up_exps_b") b->up_b = &x;
        if (x.name == "gate_exps_b") b->gate_b = &x;
        if (x.name == "down_exps_b") b->down_b = &x;
        if (x.name == "down_s") b->down_s = &x;
    }

    // buffer types, as llama.cpp's make_cpu_buft_list + select_weight_buft (CPU-only: extra bufts, then CPU)
    std::vector<ggml_backend_buffer_type_t> bufts;
    if (o.extra_bufts) {
        auto * reg = ggml_backend_dev_backend_reg(dev);
        auto   fn  = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
        if (fn) {
            for (ggml_backend_buffer_type_t * p = fn(dev); p && *p; ++p) bufts.push_back(*p);
        }
    }
    bufts.push_back(ggml_backend_dev_buffer_type(dev));

    const unsigned nthr = std::max(1u, std::thread::hardware_concurrency());
    ggml_quantize_init(m.type);
    auto t0 = std::chrono::steady_clock::now();
    for (auto & x : b->w) {
        ggml_backend_buffer_type_t chosen = bufts.back();
        for (auto * bt : bufts) {
            if (weight_buft_supported(x.t, x.op, m.top_k, bt, dev)) {
                chosen = bt;
                break;
            }
        }
        x.buft = ggml_backend_buft_name(chosen);
        x.buf  = ggml_backend_alloc_ctx_tensors_from_buft(x.ctx, chosen);
        if (!x.buf) {
            logf_("failed to allocate %s (%.2f GB)", x.name.c_str(), ggml_nbytes(x.t) / 1e9);
            exit(1);
        }
        ggml_backend_buffer_set_usage(x.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        // fill on the host (threads over experts), then one set_tensor: the repack buffer converts the
        // layout there and only takes whole tensors
        const size_t      nb   = ggml_nbytes(x.t);
        const size_t      per  = x.expert_matrix ? x.t->nb[2] : x.t->nb[1];
        std::vector<char> host(nb);
        std::vector<std::thread> th;
        for (unsigned k = 0; k < nthr; k++) {
            th.emplace_back([&, k]() {
                std::vector<float> tmp;
                for (int64_t e = k; e < E; e += nthr) fill_expert(x, x.t->type, o.seed, e, host.data() + e * per, tmp);
            });
        }
        for (auto & t : th) t.join();
        ggml_backend_tensor_set(x.t, host.data(), 0, nb);
        b->bytes_per_expert += per;
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string where;
    for (auto & x : b->w) where += " " + x.name + "=" + x.buft;
    logf_("%s: %lld experts, %.1f MiB each, %.2f GB built in %.1f s;%s", m.fmt, (long long) E,
          b->bytes_per_expert / 1048576.0, E * b->bytes_per_expert / 1e9, dt, where.c_str());
    return b;
}

// ---- graph --------------------------------------------------------------------------------------------------
struct Graph {
    ggml_context * ctx_in = nullptr;  // x, ids, weights: their own buffer, which the graph allocator never reuses
    ggml_backend_buffer_t buf_in = nullptr;
    ggml_context * ctx = nullptr;
    ggml_cgraph *  gf  = nullptr;
    ggml_gallocr_t galloc = nullptr;
    ggml_tensor *  x = nullptr, *ids = nullptr, *wts = nullptr, *y = nullptr;
    int            T = 0;
    ~Graph() {
        if (galloc) ggml_gallocr_free(galloc);
        if (ctx) ggml_free(ctx);
        if (buf_in) ggml_backend_buffer_free(buf_in);
        if (ctx_in) ggml_free(ctx_in);
    }
};

static Graph * build_graph(const Bank & b, int T) {
    const Model & m  = *b.m;
    Graph *       g  = new Graph();
    g->T             = T;
    ggml_init_params p = {ggml_tensor_overhead() * 512 + ggml_graph_overhead_custom(1024, false), nullptr, true};
    g->ctx             = ggml_init(p);
    ggml_context * ctx = g->ctx;
    const int      k   = m.top_k;
    // inputs set once per (batch, routing) (x, weights) or per step (ids): kept in a buffer of their own (in
    // llama.cpp the graph allocator may reuse input memory because every step sets the inputs again)
    ggml_init_params pin = {ggml_tensor_overhead() * 4, nullptr, true};
    g->ctx_in = ggml_init(pin);
    g->x   = ggml_new_tensor_2d(g->ctx_in, GGML_TYPE_F32, m.H, T);
    g->ids = ggml_new_tensor_2d(g->ctx_in, GGML_TYPE_I32, k, T);
    g->wts = ggml_new_tensor_3d(g->ctx_in, GGML_TYPE_F32, 1, k, T);
    ggml_set_input(g->x);
    ggml_set_input(g->ids);
    ggml_set_input(g->wts);
    g->buf_in = ggml_backend_alloc_ctx_tensors_from_buft(g->ctx_in, ggml_backend_cpu_buffer_type());
    g->gf = ggml_new_graph_custom(ctx, 1024, false);

    ggml_tensor * cur = ggml_reshape_3d(ctx, g->x, m.H, 1, T);
    ggml_tensor * up = nullptr, *gate = nullptr;
    if (b.gate_up) {
        ggml_tensor * gu = ggml_mul_mat_id(ctx, b.gate_up->t, cur, g->ids);  // [2I, k, T]
        const int64_t n_ff = gu->ne[0] / 2;
        gate = ggml_view_3d(ctx, gu, n_ff, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], 0);
        up   = ggml_view_3d(ctx, gu, n_ff, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], n_ff * gu->nb[0]);
    } else {
        up = ggml_mul_mat_id(ctx, b.up->t, cur, g->ids);  // [I, k, T]
        if (b.up_b) up = ggml_add_id(ctx, up, b.up_b->t, g->ids);
        gate = ggml_mul_mat_id(ctx, b.gate->t, cur, g->ids);
        if (b.gate_b) gate = ggml_add_id(ctx, gate, b.gate_b->t, g->ids);
    }
    ggml_tensor * a = nullptr;
    switch (m.act) {
        case ACT_SILU: a = ggml_swiglu_split(ctx, gate, up); break;
        case ACT_GELU: a = ggml_geglu_split(ctx, gate, up); break;
        case ACT_OAI: a = ggml_swiglu_oai(ctx, gate, up, OAI_ALPHA, OAI_LIMIT); break;
    }
    ggml_tensor * experts = ggml_mul_mat_id(ctx, b.down->t, a, g->ids);  // [H, k, T]
    if (b.down_s) {  // build_lora_mm_id's w_s: reshape, repeat over tokens, get_rows by ids, mul
        ggml_tensor * s = ggml_reshape_3d(ctx, b.down_s->t, 1, b.E, 1);
        s               = ggml_repeat_4d(ctx, s, 1, b.E, T, 1);
        s               = ggml_get_rows(ctx, s, g->ids);
        experts         = ggml_mul(ctx, experts, s);
    }
    if (b.down_b) experts = ggml_add_id(ctx, experts, b.down_b->t, g->ids);
    experts = ggml_mul(ctx, experts, g->wts);
    ggml_build_forward_expand(g->gf, experts);
    std::vector<ggml_tensor *> views(k);
    for (int i = 0; i < k; i++) {
        views[i] = ggml_view_2d(ctx, experts, m.H, T, experts->nb[2], i * experts->nb[1]);
        ggml_build_forward_expand(g->gf, views[i]);
    }
    ggml_tensor * out = views[0];
    for (int i = 1; i < k; i++) {
        out = ggml_add(ctx, out, views[i]);
        ggml_build_forward_expand(g->gf, out);
    }
    if (k == 1) out = ggml_cont(ctx, out);
    ggml_set_output(out);
    ggml_build_forward_expand(g->gf, out);
    g->y = out;

    g->galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    if (!ggml_gallocr_alloc_graph(g->galloc, g->gf)) {
        logf_("graph allocation failed");
        exit(1);
    }
    return g;
}

// ---- reference ----------------------------------------------------------------------------------------------
static void dequant_expert(const Weight & x, ggml_type type, uint64_t seed, int64_t e, std::vector<double> & out) {
    const int64_t      ne0 = x.t->ne[0], ne1 = x.expert_matrix ? x.t->ne[1] : 1;
    std::vector<char>  q(x.expert_matrix ? x.t->nb[2] : x.t->nb[1]);
    std::vector<float> tmp;
    fill_expert(x, type, seed, e, q.data(), tmp);
    std::vector<float> f(ne0 * ne1);
    if (type == GGML_TYPE_F32) memcpy(f.data(), q.data(), f.size() * sizeof(float));
    else ggml_get_type_traits(type)->to_float(q.data(), f.data(), ne0 * ne1);
    out.assign(f.begin(), f.end());
}

// float64 y for token 0 from the dequantized weights (ggml's to_float) and the f32 input; returns
// max |y - ref| / max |ref| (the activations ggml quantizes to q8_0 / bf16 are exact here)
static double check_step(const Bank & b, const Graph & g, const Opts & o, double * max_abs_ref) {
    const Model &        m = *b.m;
    const int            k = m.top_k;
    std::vector<float>   x(m.H), y(m.H), w(k);
    std::vector<int32_t> ids(k);
    ggml_backend_tensor_get(g.x, x.data(), 0, m.H * sizeof(float));
    ggml_backend_tensor_get(g.y, y.data(), 0, m.H * sizeof(float));  // token 0: y is [H, T] contiguous
    ggml_backend_tensor_get(g.ids, ids.data(), 0, k * sizeof(int32_t));
    ggml_backend_tensor_get(g.wts, w.data(), 0, k * sizeof(float));
    std::vector<double> ref(m.H, 0.0), Wgu, Wu, Wg, Wd, bu, bg, bd, s;
    for (int j = 0; j < k; j++) {
        const int64_t      e = ids[j];
        std::vector<double> gate(m.I), up(m.I), act(m.I);
        auto mv = [&](const std::vector<double> & W, int64_t row0, std::vector<double> & out) {
            for (int64_t r = 0; r < m.I; r++) {
                double acc = 0;
                const double * wr = &W[(row0 + r) * m.H];
                for (int64_t c = 0; c < m.H; c++) acc += wr[c] * x[c];
                out[r] = acc;
            }
        };
        if (b.gate_up) {
            dequant_expert(*b.gate_up, m.type, o.seed, e, Wgu);
            mv(Wgu, 0, gate);
            mv(Wgu, m.I, up);
        } else {
            dequant_expert(*b.up, m.type, o.seed, e, Wu);
            dequant_expert(*b.gate, m.type, o.seed, e, Wg);
            mv(Wu, 0, up);
            mv(Wg, 0, gate);
        }
        if (b.up_b) {
            dequant_expert(*b.up_b, GGML_TYPE_F32, o.seed, e, bu);
            dequant_expert(*b.gate_b, GGML_TYPE_F32, o.seed, e, bg);
            for (int64_t r = 0; r < m.I; r++) { up[r] += bu[r]; gate[r] += bg[r]; }
        }
        for (int64_t r = 0; r < m.I; r++) {
            double gt = gate[r], u = up[r];
            if (m.act == ACT_SILU) act[r] = gt / (1 + exp(-gt)) * u;
            else if (m.act == ACT_GELU) {
                const double c = sqrt(2.0 / M_PI);
                act[r] = 0.5 * gt * (1 + tanh(c * (gt + 0.044715 * gt * gt * gt))) * u;
            } else {
                double xg = std::min(gt, (double) OAI_LIMIT), yu = std::max(std::min(u, (double) OAI_LIMIT), -(double) OAI_LIMIT);
                act[r] = xg / (1 + exp(-OAI_ALPHA * xg)) * (yu + 1);
            }
        }
        dequant_expert(*b.down, m.type, o.seed, e, Wd);
        double sc = 1.0;
        if (b.down_s) {
            dequant_expert(*b.down_s, GGML_TYPE_F32, o.seed, e, s);
            sc = s[0];
        }
        if (b.down_b) dequant_expert(*b.down_b, GGML_TYPE_F32, o.seed, e, bd);
        for (int64_t r = 0; r < m.H; r++) {
            double acc = 0;
            const double * wr = &Wd[r * m.I];
            for (int64_t c = 0; c < m.I; c++) acc += wr[c] * act[c];
            acc *= sc;
            if (b.down_b) acc += bd[r];
            ref[r] += w[j] * acc;
        }
    }
    double maxref = 0, maxerr = 0;
    for (int64_t r = 0; r < m.H; r++) {
        maxref = std::max(maxref, fabs(ref[r]));
        maxerr = std::max(maxerr, fabs(ref[r] - y[r]));
    }
    *max_abs_ref = maxref;
    return maxerr / std::max(maxref, 1e-30);
}

// ---- timing -------------------------------------------------------------------------------------------------
struct Stats {
    double median, min, max;
    std::vector<double> samples;
};
static Stats stats(std::vector<double> v) {
    Stats s;
    s.samples = v;
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    s.min    = v.front();
    s.max    = v.back();
    return s;
}
static std::string json_stats(const Stats & s) {
    std::ostringstream o;
    o.precision(10);
    o << "{\"median\": " << s.median << ", \"min\": " << s.min << ", \"max\": " << s.max << ", \"samples\": [";
    for (size_t i = 0; i < s.samples.size(); i++) o << (i ? ", " : "") << s.samples[i];
    o << "]}";
    return o.str();
}

static volatile uint64_t g_sink;
static void evict(std::vector<uint64_t> & buf) {  // read 4 x LLC (untimed), as ours reads its ceiling window
    uint64_t s = 0;
    for (size_t i = 0; i < buf.size(); i += 8) s += buf[i];
    g_sink = s;
}

int main(int argc, char ** argv) {
    Opts o;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc) { fprintf(stderr, "%s needs a value\n", a.c_str()); exit(2); }
            return argv[++i];
        };
        if (a == "--format") o.formats = split(next(), ',');
        else if (a == "--batch") { o.batch.clear(); for (auto & s : split(next(), ',')) o.batch.push_back(atoi(s.c_str())); }
        else if (a == "--routing") { std::string r = next(); o.routings = r == "both" ? std::vector<std::string>{"random", "shared"} : std::vector<std::string>{r}; }
        else if (a == "--threads") o.threads = atoi(next().c_str());
        else if (a == "--repeats") o.repeats = atoi(next().c_str());
        else if (a == "--steps") o.steps = atoi(next().c_str());
        else if (a == "--warmup") o.warmup = atoi(next().c_str());
        else if (a == "--seed") o.seed = strtoull(next().c_str(), nullptr, 10);
        else if (a == "--json") o.json = next();
        else if (a == "--llc") o.llc = parse_size(next());
        else if (a == "--no-extra-bufts") o.extra_bufts = false;
        else if (a == "--down-scale") o.down_scale = true;
        else if (a == "--no-check") o.check = false;
        else if (a == "--tol") o.tol = atof(next().c_str());
        else if (a == "-h" || a == "--help") {
            printf("usage: %s [--format q4_0,mxfp4,bf16] [--batch 1,8] [--routing random|shared|both] [--threads N]\n"
                   "        [--repeats 5] [--steps 20] [--warmup 3] [--seed 0] [--json FILE] [--llc BYTES]\n"
                   "        [--no-extra-bufts] [--down-scale] [--no-check] [--tol 0.05]\n", argv[0]);
            return 0;
        } else { fprintf(stderr, "unknown argument %s\n", a.c_str()); return 2; }
    }
    if (o.threads <= 0) o.threads = (int) std::max(1u, std::thread::hardware_concurrency());
    const int64_t llc = o.llc ? o.llc : (llc_bytes() ? llc_bytes() : 32LL << 20);
    const int     max_batch = *std::max_element(o.batch.begin(), o.batch.end());

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, o.threads);
    ggml_threadpool_t tp = nullptr;
#if !BENCH_GGML_OPENMP
    // without OpenMP, a threadpool kept across steps (otherwise every compute starts its threads)
    ggml_threadpool_params tpp = ggml_threadpool_params_default(o.threads);
    tp                         = ggml_threadpool_new(&tpp);
    ggml_backend_cpu_set_threadpool(backend, tp);
#endif
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);

    std::string features;
    auto        feat = [&](const char * n, int v) { if (v) features += std::string(features.empty() ? "" : " ") + n; };
    feat("AVX2", ggml_cpu_has_avx2()); feat("FMA", ggml_cpu_has_fma()); feat("F16C", ggml_cpu_has_f16c());
    feat("AVX_VNNI", ggml_cpu_has_avx_vnni()); feat("AVX512", ggml_cpu_has_avx512());
    feat("AVX512_VBMI", ggml_cpu_has_avx512_vbmi()); feat("AVX512_VNNI", ggml_cpu_has_avx512_vnni());
    feat("AVX512_BF16", ggml_cpu_has_avx512_bf16()); feat("AMX_INT8", ggml_cpu_has_amx_int8());
    feat("LLAMAFILE", ggml_cpu_has_llamafile()); feat("OPENMP", BENCH_GGML_OPENMP);
    const std::string model_name = cpu_model();
    logf_("%s; ggml %s (%s), %d threads, LLC %.0f MiB, features: %s; built %s", model_name.c_str(), ggml_version(),
          ggml_commit(), o.threads, llc / 1048576.0, features.c_str(), BENCH_BUILD_FLAGS);

    std::vector<uint64_t> evict_buf(std::max<int64_t>(4 * llc, 64LL << 20) / 8, 1);
    std::ostringstream    fj;  // formats json
    fj.precision(10);
    bool    all_ok = true;
    int     nfmt = 0;
    std::mt19937_64 rng(o.seed);
    printf("%-6s %-13s %3s %5s %-7s %9s %9s %9s %7s %8s\n", "format", "model", "thr", "batch", "routing", "us/step",
           "min", "max", "GB/s", "experts");
    for (const auto & fname : o.formats) {
        const Model * mp = nullptr;
        for (auto & mm : MODELS) if (fname == mm.fmt) mp = &mm;
        if (!mp) { logf_("unknown format %s", fname.c_str()); return 2; }
        const Model & m = *mp;
        // the bank, as bench_one sizes it (bytes per expert from ggml's own tensor sizes)
        size_t bpe = 2 * ggml_row_size(m.type, m.H) * m.I + ggml_row_size(m.type, m.I) * m.H;  // gate+up, down
        if (m.biases) bpe += (2 * m.I + m.H) * sizeof(float);
        if (o.down_scale && m.merged_gate_up) bpe += sizeof(float);
        const int64_t window = std::min<int64_t>(m.E, (int64_t) m.top_k * max_batch);
        const double  need   = std::max<double>(4.0 * llc, (double) window * bpe * 2);
        const int64_t n_win  = std::max<int64_t>(2, (int64_t) ceil(need / ((double) window * bpe)));
        const int64_t E      = window * n_win;
        Bank *        b      = build_bank(m, E, o, dev);
        if (b->bytes_per_expert != bpe) { logf_("bytes per expert mismatch %zu vs %zu", b->bytes_per_expert, bpe); return 1; }

        std::ostringstream rj;
        rj.precision(10);
        int    nres = 0;
        double check_err = -1, check_ref = 0;
        bool   checked = false, finite_all = true;
        for (const auto & routing : o.routings) {
            for (int T : o.batch) {
                Graph * g = build_graph(*b, T);
                std::vector<float> x(m.H * T), w(m.top_k * T, 1.0f / m.top_k);
                std::normal_distribution<float> nd(0.0f, 1.0f);
                for (auto & v : x) v = nd(rng);
                ggml_backend_tensor_set(g->x, x.data(), 0, x.size() * sizeof(float));
                ggml_backend_tensor_set(g->wts, w.data(), 0, w.size() * sizeof(float));
                const bool    shared  = routing == "shared";
                const int64_t wsize   = shared ? m.top_k : std::min<int64_t>(E, (int64_t) m.top_k * T);
                const int64_t n_plans = E / wsize;
                std::vector<std::vector<int32_t>> plans(n_plans);
                std::vector<double>               bytes_read(n_plans);
                std::vector<int32_t>              pool(wsize);
                double                            uniq_sum = 0;
                for (int64_t j = 0; j < n_plans; j++) {
                    auto pick = [&](int32_t * out) {  // top_k distinct experts of window j
                        for (int64_t q = 0; q < wsize; q++) pool[q] = (int32_t) (j * wsize + q);
                        for (int q = 0; q < m.top_k; q++) {
                            std::uniform_int_distribution<int64_t> ud(q, wsize - 1);
                            std::swap(pool[q], pool[ud(rng)]);
                            out[q] = pool[q];
                        }
                    };
                    plans[j].resize((size_t) m.top_k * T);
                    if (shared) {
                        pick(plans[j].data());
                        for (int t = 1; t < T; t++) std::copy_n(plans[j].data(), m.top_k, plans[j].data() + t * m.top_k);
                    } else {
                        for (int t = 0; t < T; t++) pick(plans[j].data() + t * m.top_k);
                    }
                    std::set<int32_t> u(plans[j].begin(), plans[j].end());
                    bytes_read[j] = (double) u.size() * bpe;
                    uniq_sum += u.size();
                }
                const size_t ids_bytes = (size_t) m.top_k * T * sizeof(int32_t);
                for (int s = 0; s < o.warmup; s++) {
                    ggml_backend_tensor_set(g->ids, plans[s % n_plans].data(), 0, ids_bytes);
                    ggml_backend_graph_compute(backend, g->gf);
                }
                std::vector<double> times, gbps;
                int64_t last_plan = -1;
                for (int r = 0; r < o.repeats; r++) {
                    evict(evict_buf);
                    double nbytes = 0;
                    auto   t0     = std::chrono::steady_clock::now();
                    for (int s = 0; s < o.steps; s++) {
                        const int64_t j = s % n_plans;
                        ggml_backend_tensor_set(g->ids, plans[j].data(), 0, ids_bytes);
                        if (ggml_backend_graph_compute(backend, g->gf) != GGML_STATUS_SUCCESS) {
                            logf_("graph compute failed");
                            return 1;
                        }
                        nbytes += bytes_read[j];
                        last_plan = j;
                    }
                    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                    times.push_back(dt / o.steps * 1e6);
                    gbps.push_back(nbytes / dt / 1e9);
                }
                (void) last_plan;
                // sanity: y finite; at batch 1 (first routing) the float64 reference
                std::vector<float> y(m.H * T);
                ggml_backend_tensor_get(g->y, y.data(), 0, y.size() * sizeof(float));
                bool finite = std::all_of(y.begin(), y.end(), [](float v) { return std::isfinite(v); });
                finite_all = finite_all && finite;
                if (!finite) logf_("%s %s batch %d: NON-FINITE output", m.fmt, routing.c_str(), T);
                if (o.check && T == 1 && !checked) {
                    check_err = check_step(*b, *g, o, &check_ref);
                    checked   = true;
                    logf_("%s: batch 1 step vs float64 reference from the dequantized weights: max |y - ref| / max |ref| = %.3g "
                          "(max |ref| %.3g, tolerance %.3g) %s", m.fmt, check_err, check_ref, o.tol, check_err <= o.tol ? "ok" : "FAILED");
                }
                Stats st = stats(times), sg = stats(gbps);
                double bytes_per_step = 0;
                for (double v : bytes_read) bytes_per_step += v;
                bytes_per_step /= n_plans;
                printf("%-6s %-13s %3d %5d %-7s %9.0f %9.0f %9.0f %7.2f %8.1f\n", m.fmt, m.model, o.threads, T,
                       routing.c_str(), st.median, st.min, st.max, sg.median, uniq_sum / n_plans);
                fflush(stdout);
                rj << (nres++ ? ",\n" : "") << "    " << json_str(routing + "/" + std::to_string(T)) << ": {\"routing\": "
                   << json_str(routing) << ", \"batch\": " << T << ", \"step_us\": " << json_stats(st)
                   << ", \"gbps\": " << json_stats(sg) << ", \"bytes_per_step\": " << bytes_per_step
                   << ", \"unique_experts_per_step\": " << uniq_sum / n_plans << ", \"window\": " << wsize
                   << ", \"n_plans\": " << n_plans << ", \"finite\": " << (finite ? "true" : "false") << "}";
                delete g;
            }
        }
        const bool ok = finite_all && (!o.check || !checked || check_err <= o.tol);
        all_ok        = all_ok && ok;
        std::string bufts;
        for (auto & x : b->w) bufts += std::string(bufts.empty() ? "" : ", ") + json_str(x.name) + ": " + json_str(x.buft);
        fj << (nfmt++ ? ",\n" : "") << "  " << json_str(m.fmt) << ": {\"model\": " << json_str(m.model)
           << ", \"ggml_type\": " << json_str(ggml_type_name(m.type))
           << ", \"shape\": {\"H\": " << m.H << ", \"I\": " << m.I << ", \"E\": " << m.E << ", \"top_k\": " << m.top_k
           << ", \"activation\": " << json_str(m.act == ACT_SILU ? "swiglu (silu)" : m.act == ACT_GELU ? "geglu (gelu tanh)" : "swiglu_oai")
           << "}, \"merged_gate_up\": " << (m.merged_gate_up ? "true" : "false")
           << ", \"biases\": " << (m.biases ? "true" : "false")
           << ", \"bytes_per_expert\": " << bpe << ", \"E_bank\": " << E << ", \"bank_bytes\": " << (double) E * bpe
           << ", \"window_max_batch\": " << window << ", \"buffer_types\": {" << bufts << "}"
           << ", \"check\": {\"max_rel_err\": " << check_err << ", \"max_abs_ref\": " << check_ref << ", \"tol\": " << o.tol
           << ", \"ok\": " << (ok ? "true" : "false") << "}"
           << ", \"results\": {\n" << rj.str() << "\n  }}";
        delete b;
    }
    if (!o.json.empty()) {
        std::ofstream f(o.json);
        f << "{\n\"tool\": \"moe_ggml_bench\",\n\"machine\": {\"cpu\": " << json_str(model_name)
          << ", \"logical_cpus\": " << std::thread::hardware_concurrency() << ", \"llc_bytes\": " << llc
          << ", \"ggml_features\": " << json_str(features) << "},\n\"ggml\": {\"version\": " << json_str(ggml_version())
          << ", \"commit\": " << json_str(ggml_commit()) << ", \"build\": " << json_str(BENCH_BUILD_FLAGS)
          << ", \"openmp\": " << (BENCH_GGML_OPENMP ? "true" : "false") << ", \"extra_bufts\": " << (o.extra_bufts ? "true" : "false")
          << ", \"down_scale\": " << (o.down_scale ? "true" : "false") << "},\n\"threads\": " << o.threads
          << ",\n\"settings\": {\"repeats\": " << o.repeats << ", \"steps\": " << o.steps << ", \"warmup\": " << o.warmup
          << ", \"seed\": " << o.seed << "},\n\"formats\": {\n" << fj.str() << "\n},\n\"ok\": " << (all_ok ? "true" : "false") << "\n}\n";
        logf_("JSON written to %s", o.json.c_str());
    }
    ggml_backend_free(backend);
    if (tp) ggml_threadpool_free(tp);
    return all_ok ? 0 : 3;
}
