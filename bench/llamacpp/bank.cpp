// moe_ggml_bench: the expert weight bank (declarations in moe_ggml.h).
#include "moe_ggml.h"

// ---- weights ------------------------------------------------------------------------------------------------

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


static void fill_expert(const Weight & x, ggml_type type, uint64_t seed, int64_t e, void * dst, std::vector<float> & tmp) {
    const int64_t ne0 = x.t->ne[0], ne1 = x.expert_matrix ? x.t->ne[1] : 1;
    tmp.resize(ne0 * ne1);
    gen_normal(seed, x.id, e, x.scale, tmp.data(), ne0 * ne1);
    if (x.name == "down_s") {  // per-expert scales near 1
        for (auto & v : tmp) v = 1.0f + v;
    }
    ggml_quantize_chunk(type, tmp.data(), dst, 0, ne1, ne0, nullptr);
}

Bank * build_bank(const Model & m, int64_t E, const Opts & o, ggml_backend_dev_t dev) {
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
    add("down_exps", 3, m.down_type(), m.I, m.H, E, GGML_OP_MUL_MAT_ID, si, true);
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
    ggml_quantize_init(m.down_type());
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


void dequant_expert(const Weight & x, ggml_type type, uint64_t seed, int64_t e, std::vector<double> & out) {
    const int64_t      ne0 = x.t->ne[0], ne1 = x.expert_matrix ? x.t->ne[1] : 1;
    std::vector<char>  q(x.expert_matrix ? x.t->nb[2] : x.t->nb[1]);
    std::vector<float> tmp;
    fill_expert(x, type, seed, e, q.data(), tmp);
    std::vector<float> f(ne0 * ne1);
    if (type == GGML_TYPE_F32) memcpy(f.data(), q.data(), f.size() * sizeof(float));
    else ggml_get_type_traits(type)->to_float(q.data(), f.data(), ne0 * ne1);
    out.assign(f.begin(), f.end());
}
