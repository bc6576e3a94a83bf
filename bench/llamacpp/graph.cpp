// moe_ggml_bench: the step graph build_moe_ffn builds, and its float64 check (declarations in moe_ggml.h).
#include "moe_ggml.h"

// ---- graph --------------------------------------------------------------------------------------------------

Graph * build_graph(const Bank & b, int T) {
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

// float64 y for token 0 from the dequantized weights (ggml's to_float) and the f32 input; returns
// max |y - ref| / max |ref| (the activations ggml quantizes to q8_0 / bf16 are exact here)
double check_step(const Bank & b, const Graph & g, const Opts & o, double * max_abs_ref) {
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
        dequant_expert(*b.down, m.down_type(), o.seed, e, Wd);  // a Q4_K_M layer: the Q6_K down bank
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

