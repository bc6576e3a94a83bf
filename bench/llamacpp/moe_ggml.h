// moe_ggml_bench's shared declarations: the model table, options, the weight bank, the graph and the helpers
// (one job per file: util.cpp machine facts, random data and statistics; bank.cpp the expert weights in the
// buffer types llama.cpp's loader picks; graph.cpp the step graph and its float64 check; moe_ggml_bench.cpp
// the command line and the timed loop).
#pragma once
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
    ggml_type    down = GGML_TYPE_COUNT;  // down_exps' type where it differs from gate / up's (a Q4_K_M layer)

    ggml_type down_type() const { return down == GGML_TYPE_COUNT ? type : down; }
};

inline const Model MODELS[] = {
    {"q4_0", "gemma4-26b", GGML_TYPE_Q4_0, 2816, 704, 128, 8, ACT_GELU, true, false},
    {"mxfp4", "gpt-oss-120b", GGML_TYPE_MXFP4, 2880, 2880, 128, 4, ACT_OAI, false, true},
    {"bf16", "qwen3-30b", GGML_TYPE_BF16, 2048, 768, 128, 8, ACT_SILU, false, false},
    // the GGUF files of Qwen3-30B-A3B as shipped: Q8_0 (every matrix), Q4_K_M (gate / up Q4_K, down Q4_K or Q6_K by
    // layer): each type alone on all three matrices, as ours runs one format per layer
    {"q8_0", "qwen3-30b", GGML_TYPE_Q8_0, 2048, 768, 128, 8, ACT_SILU, false, false},
    {"q4_k", "qwen3-30b", GGML_TYPE_Q4_K, 2048, 768, 128, 8, ACT_SILU, false, false},
    {"q6_k", "qwen3-30b", GGML_TYPE_Q6_K, 2048, 768, 128, 8, ACT_SILU, false, false},
    // Q5_K_M files: gate / up Q5_K (down Q5_K or Q6_K by layer), Q5_K alone on all three as above
    {"q5_k", "qwen3-30b", GGML_TYPE_Q5_K, 2048, 768, 128, 8, ACT_SILU, false, false},
    // a Q4_K_M layer of the use_more_bits rule: gate / up Q4_K, down Q6_K (ours: the (q4_k, q6_k) format pair)
    {"q4_k_m", "qwen3-30b", GGML_TYPE_Q4_K, 2048, 768, 128, 8, ACT_SILU, false, false, GGML_TYPE_Q6_K},
    // a Q5_K_M layer of the same rule: gate / up Q5_K, down Q6_K (ours: the (q5_k, q6_k) format pair)
    {"q5_k_m", "qwen3-30b", GGML_TYPE_Q5_K, 2048, 768, 128, 8, ACT_SILU, false, false, GGML_TYPE_Q6_K},
    // the end-to-end file's experts (docs/end-to-end.md: Qwen3-30B-A3B shape, experts Q4_0): ggml's share of a token
    {"q4_0-qwen3", "qwen3-30b", GGML_TYPE_Q4_0, 2048, 768, 128, 8, ACT_SILU, false, false},
};
inline const float OAI_ALPHA = 1.702f, OAI_LIMIT = 7.0f;

struct Opts {
    std::vector<std::string> formats{"q4_0", "mxfp4", "bf16"};
    std::vector<int>         batch{1, 8};
    std::vector<std::string> routings{"random", "shared"};
    int                      threads = 0;
    int                      repeats = 5, steps = 20, warmup = 3;
    std::string              working_set = "dram";  // dram | cache (ours: --working-set)
    uint64_t                 seed = 0;
    std::string              json;
    int64_t                  llc = 0;
    bool                     extra_bufts = true, down_scale = false, check = true;
    double                   tol = 0.05;
};


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

struct Stats {
    double median, min, max;
    std::vector<double> samples;
};

// util.cpp
void logf_(const char * fmt, ...) __attribute__((format(printf, 1, 2)));
std::vector<std::string> split(const std::string & s, char sep);
int64_t parse_size(std::string s);
int64_t llc_bytes();
std::string cpu_model();
std::string json_str(const std::string & s);
void gen_normal(uint64_t seed, int tensor, int64_t expert, float scale, float * out, int64_t n);
Stats stats(std::vector<double> v);
std::string json_stats(const Stats & s);
void evict(std::vector<uint64_t> & buf);
std::vector<std::vector<int32_t>> route_plans(uint64_t seed, int64_t n_plans, int64_t w, int T, int K, bool shared);
std::string routes_digest(const std::vector<std::vector<int32_t>> & plans);
// bank.cpp
Bank * build_bank(const Model & m, int64_t E, const Opts & o, ggml_backend_dev_t dev);
void dequant_expert(const Weight & x, ggml_type type, uint64_t seed, int64_t e, std::vector<double> & out);
// graph.cpp
Graph * build_graph(const Bank & b, int T);
double check_step(const Bank & b, const Graph & g, const Opts & o, double * max_abs_ref);
