// One MoE layer's decode step on ggml's CPU backend, built the way llama.cpp's
// llm_graph_context::build_moe_ffn (src/llama-graph.cpp) builds it, timed the way
// packages/cpumoe-executor/src/cpumoe_executor/bench.py (bench_one, routes_for) times ours.
//
//   moe_ggml_bench [--format q4_0,mxfp4,bf16] [--batch 1,8] [--routing random|shared|both] [--threads N]
//                  [--working-set dram|cache] [--repeats 5] [--steps 20] [--warmup 3] [--seed 0] [--json FILE]
//                  [--llc BYTES] [--no-extra-bufts] [--down-scale] [--no-check] [--tol 0.05]
//
// Graph per step (inputs: x [H, T] f32, ids [top_k, T] i32, router weights [1, top_k, T] f32; the router
// itself, its softmax / top-k, is not part of the step, as in ours):
//   q4_0  (gemma4-26b, H 2816, I 704, E 128, top_k 8):  gu = mul_mat_id(gate_up_exps, x, ids)  (gemma4's GGUF
//         ships ffn_gate_up_exps merged), gate/up = views of gu, a = geglu_split(gate, up)  (GELU-tanh)
//   mxfp4 (gpt-oss-120b, H 2880, I 2880, E 128, top_k 4): up = add_id(mul_mat_id(up_exps, x, ids), up_b, ids),
//         gate = add_id(mul_mat_id(gate_exps, x, ids), gate_b, ids), a = swiglu_oai(gate, up, 1.702, 7.0)
//   bf16  (qwen3-30b, H 2048, I 768, E 128, top_k 8):  up = mul_mat_id(up_exps, ...), gate = mul_mat_id(gate_exps,
//         ...), a = swiglu_split(gate, up)  (SiLU GLU)
//   q8_0, q4_k, q5_k, q6_k (qwen3-30b, as bf16's graph): Qwen3-30B-A3B's Q8_0, Q4_K_M and Q5_K_M GGUF files; one type on all
//         three matrices (a Q4_K_M file mixes Q4_K and Q6_K down projections by layer)
//   q4_k_m (qwen3-30b, as bf16's graph): a Q4_K_M layer of llama.cpp's use_more_bits rule: gate / up Q4_K, down Q6_K
//   q5_k_m (qwen3-30b, as bf16's graph): a Q5_K_M layer of the same rule: gate / up Q5_K, down Q6_K
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
// s % n_plans. The plans are ours' (route_plans in util.cpp repeats cpumoe_executor.bench.route_plans), and
// each result records their digest (routes_digest) for the summary to compare. Before every timed repeat a 4 x LLC buffer is read (untimed), as ours reads its ceiling window.
// --working-set cache (ours: the same flag): E_bank = window, one plan per (T, routing) drawn from the whole
// window (random: top_k distinct per token; shared: one top_k), run by every step; after the evicting read one
// untimed step loads the plan's experts back into the cache, as ours does.
#include "moe_ggml.h"

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
        else if (a == "--working-set") {
            o.working_set = next();
            if (o.working_set != "dram" && o.working_set != "cache") {
                fprintf(stderr, "--working-set %s: expected dram or cache\n", o.working_set.c_str());
                return 2;
            }
        }
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
                   "        [--working-set dram|cache] [--repeats 5] [--steps 20] [--warmup 3] [--seed 0] [--json FILE]\n"
                   "        [--llc BYTES] [--no-extra-bufts] [--down-scale] [--no-check] [--tol 0.05]\n", argv[0]);
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
    logf_("%s; ggml %s (%s), %d threads, LLC %.0f MiB, working set %s, features: %s; built %s", model_name.c_str(),
          ggml_version(), ggml_commit(), o.threads, llc / 1048576.0, o.working_set.c_str(), features.c_str(),
          BENCH_BUILD_FLAGS);

    std::vector<uint64_t> evict_buf(std::max<int64_t>(4 * llc, 64LL << 20) / 8, 1);
    std::ostringstream    fj;  // formats json
    fj.precision(10);
    bool    all_ok = true;
    int     nfmt = 0;
    std::mt19937_64 rng(o.seed);
    const bool cache = o.working_set == "cache";
    printf("%-6s %-13s %3s %5s %-7s %9s %9s %9s %7s %8s\n", "format", "model", "thr", "batch", "routing", "us/step",
           "min", "max", "GB/s", "experts");
    for (const auto & fname : o.formats) {
        const Model * mp = nullptr;
        for (auto & mm : MODELS) if (fname == mm.fmt) mp = &mm;
        if (!mp) { logf_("unknown format %s", fname.c_str()); return 2; }
        const Model & m = *mp;
        // the bank, as bench_one sizes it (bytes per expert from ggml's own tensor sizes)
        size_t bpe = 2 * ggml_row_size(m.type, m.H) * m.I + ggml_row_size(m.down_type(), m.I) * m.H;  // gate+up, down
        if (m.biases) bpe += (2 * m.I + m.H) * sizeof(float);
        if (o.down_scale && m.merged_gate_up) bpe += sizeof(float);
        const int64_t window = std::min<int64_t>(m.E, (int64_t) m.top_k * max_batch);
        const double  need   = std::max<double>(4.0 * llc, (double) window * bpe * 2);
        const int64_t n_win  = cache ? 1 : std::max<int64_t>(2, (int64_t) ceil(need / ((double) window * bpe)));
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
                const int64_t wsize   = cache ? window : shared ? m.top_k : std::min<int64_t>(E, (int64_t) m.top_k * T);
                const int64_t n_plans = E / wsize;
                const auto    plans   = route_plans(o.seed, n_plans, wsize, T, m.top_k, shared);  // ours' plans
                std::vector<double> bytes_read(n_plans);
                double              uniq_sum = 0;
                for (int64_t j = 0; j < n_plans; j++) {
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
                    if (cache) {  // the plan's experts back into the cache (untimed)
                        ggml_backend_tensor_set(g->ids, plans[0].data(), 0, ids_bytes);
                        ggml_backend_graph_compute(backend, g->gf);
                    }
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
                   << ", \"n_plans\": " << n_plans << ", \"routes_digest\": " << json_str(routes_digest(plans))
                   << ", \"finite\": " << (finite ? "true" : "false") << "}";
                delete g;
            }
        }
        const bool ok = finite_all && (!o.check || !checked || check_err <= o.tol);
        all_ok        = all_ok && ok;
        std::string bufts;
        for (auto & x : b->w) bufts += std::string(bufts.empty() ? "" : ", ") + json_str(x.name) + ": " + json_str(x.buft);
        fj << (nfmt++ ? ",\n" : "") << "  " << json_str(m.fmt) << ": {\"model\": " << json_str(m.model)
           << ", \"ggml_type\": " << json_str(ggml_type_name(m.type))
           << ", \"ggml_type_down\": " << json_str(ggml_type_name(m.down_type()))
           << ", \"working_set\": " << json_str(o.working_set)
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
          << ", \"seed\": " << o.seed << ", \"working_set\": " << json_str(o.working_set) << "},\n\"formats\": {\n" << fj.str() << "\n},\n\"ok\": " << (all_ok ? "true" : "false") << "\n}\n";
        logf_("JSON written to %s", o.json.c_str());
    }
    ggml_backend_free(backend);
    if (tp) ggml_threadpool_free(tp);
    return all_ok ? 0 : 3;
}
