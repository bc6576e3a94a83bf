/* cpumoe-formats versioned C ABI (design principle 2).
 *
 * The Python module cpumoe_formats._native exports a PyCapsule named
 * CPUMOE_FORMATS_CAPSULE_NAME holding a `const cpumoe_formats_api*`. A consumer
 * (the executor) includes this header, fetches the capsule and calls
 * cpumoe_formats_check_api(); a mismatch is an error naming both versions.
 *
 * Rules: enums and format ids are append-only; new API functions are appended
 * to the end of the struct with a minor bump; a major bump renames the capsule.
 */
#ifndef CPUMOE_FORMATS_ABI_H
#define CPUMOE_FORMATS_ABI_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CPUMOE_FORMATS_ABI_MAJOR 1
#define CPUMOE_FORMATS_ABI_MINOR 11
#define CPUMOE_FORMATS_CAPSULE_NAME "cpumoe_formats._native._C_API_v1"

/* Weight formats. Ids follow the reference executor (FlashML numbering). */
enum cpumoe_format_id {
  CPUMOE_FMT_BF16 = 0,
  CPUMOE_FMT_NVFP4 = 1,
  CPUMOE_FMT_MXFP4 = 2, /* gpt-oss / Triton transposed split-K layout */
  CPUMOE_FMT_DS_FP4 = 3,
  CPUMOE_FMT_Q4_0 = 4,
  CPUMOE_FMT_FP8_BLOCK = 5,
  CPUMOE_FMT_MXFP4_PANEL = 6, /* mxfp4 repacked into 64-column panels, K-pair rows contiguous (ABI 1.2) */
  CPUMOE_FMT_Q4_0_X16 = 7,    /* q4_0 with 16 rows interleaved per 32-block, w4a8 (ABI 1.3) */
  CPUMOE_FMT_FP8_BLOCK_X16 = 8, /* fp8_block with 16 rows interleaved per K pair, native (ABI 1.4) */
  CPUMOE_FMT_NVFP4_X16 = 9,   /* nvfp4 with 16 rows interleaved per 16-block, w4a8 (ABI 1.4) */
  CPUMOE_FMT_DS_FP4_X16 = 10, /* ds_fp4 with 16 rows interleaved per 32-block, w4a8 (ABI 1.4) */
  CPUMOE_FMT_BF16_X16 = 11,   /* bf16 with 16 rows interleaved per K pair, native (ABI 1.4) */
  CPUMOE_FMT_MXFP4_X16 = 12,  /* mxfp4 with 16 rows interleaved per 32-block, w4a8 (ABI 1.5) */
  CPUMOE_FMT_Q8_0 = 13,       /* GGUF Q8_0 blocks as the file holds them (ABI 1.7) */
  CPUMOE_FMT_Q4_K = 14,       /* GGUF Q4_K blocks as the file holds them (ABI 1.7) */
  CPUMOE_FMT_Q6_K = 15,       /* GGUF Q6_K blocks as the file holds them (ABI 1.7) */
  CPUMOE_FMT_Q4_K_X16 = 16,   /* q4_k with 16 rows interleaved per 256-block, w4a8 (ABI 1.7) */
  CPUMOE_FMT_Q8_0_X16 = 17,   /* q8_0 with 16 rows interleaved per 32-block, w4a8 (ABI 1.7) */
  CPUMOE_FMT_Q5_K = 18,       /* GGUF Q5_K blocks as the file holds them (ABI 1.8) */
  CPUMOE_FMT_Q6_K_X16 = 19,   /* q6_k with 16 rows interleaved per 256-block, w4a8 (ABI 1.9) */
  CPUMOE_FMT_Q5_K_X16 = 20,   /* q5_k with 16 rows interleaved per 256-block, w4a8 and native (ABI 1.10) */
  CPUMOE_FMT_COUNT = 21
};

enum cpumoe_act_id {
  CPUMOE_ACT_SILU = 0,
  CPUMOE_ACT_GELU = 1,
  CPUMOE_ACT_GELU_TANH = 2,
  CPUMOE_ACT_SWIGLUOAI = 3,   /* min(g,lim)*sigmoid(a*min(g,lim))*(clamp(u,+-lim)+1) */
  CPUMOE_ACT_SWIGLU_CLAMP = 4, /* same without the +1 */
  CPUMOE_ACT_COUNT = 5
};

/* ISA tiers, a ladder: a tier is usable when the CPU and OS support all of its
 * features; CPUMOE_ISA caps the ladder. A format uses its best kernel at or
 * below the selected tier and reports that kernel's tier. */
enum cpumoe_tier {
  CPUMOE_TIER_SCALAR = 0,
  CPUMOE_TIER_AVX2 = 1,       /* AVX2 + FMA + F16C */
  CPUMOE_TIER_AVXVNNI = 2,    /* + AVX-VNNI (VEX vpdpbusd, 256-bit) */
  CPUMOE_TIER_AVX512F = 3,    /* AVX-512 F/BW/DQ/VL (Skylake-SP baseline) */
  CPUMOE_TIER_AVX512VNNI = 4, /* + AVX512-VNNI */
  CPUMOE_TIER_AVX512BF16 = 5, /* + AVX512-BF16 (vdpbf16ps) */
  CPUMOE_TIER_AMX = 6,        /* + AMX-TILE + AMX-BF16, OS permission granted (tile dot products; ABI 1.1) */
  CPUMOE_TIER_COUNT = 7
};

/* Activation precision modes. Each format lists the modes it supports; the
 * mode is part of the kernel name ("avx2+w4a8"), never switched silently. */
enum cpumoe_mode {
  CPUMOE_MODE_NATIVE = 0, /* the format's own activation precision: bf16/fp32 activations (W16A16, W8A16, W4A16) */
  CPUMOE_MODE_W4A8 = 1,   /* activations quantized to int8 per block (nvfp4: 16, q4_0 and q8_0: 32, q4_k, q5_k and
                           * q6_k: 256), whatever the weight width (q8_0's is W8A8, q5_k's W5A8, q6_k's W6A8) */
  CPUMOE_MODE_COUNT = 2
};

#define CPUMOE_MAX_BANKS 8

/* One bank of one layer: base of expert 0, byte strides between experts and
 * between rows (rows = dim 1). The innermost dimension is contiguous. */
typedef struct cpumoe_bank {
  const void *ptr;
  int64_t expert_stride;
  int64_t row_stride;
} cpumoe_bank;

typedef struct cpumoe_params {
  int32_t format;      /* cpumoe_format_id */
  int32_t act;         /* cpumoe_act_id */
  int32_t mode;        /* cpumoe_mode */
  int32_t apply_router_weight_on_input;
  int32_t num_experts; /* E */
  int32_t hidden;      /* H */
  int32_t inter;       /* I */
  float alpha;         /* swiglu alpha */
  float limit;         /* swiglu limit; +inf = none */
} cpumoe_params;

/* A route for the down pass: token row `token` of acc gets
 * weight * down[expert] . act, where act is a prepared intermediate vector. */
typedef struct cpumoe_route {
  int32_t token;
  int32_t expert;
  float weight;
  int32_t reserved;
  const void *act;
} cpumoe_route;

typedef struct cpumoe_kernel cpumoe_kernel;

/* Bytes of one prepared activation vector of length K (K = H for x, I for g). */
typedef size_t (*cpumoe_act_bytes_fn)(const cpumoe_kernel *k, int32_t K);
/* Prepare a bf16 activation vector (x row or g row) for this kernel. */
typedef void (*cpumoe_prep_act_fn)(const cpumoe_kernel *k, const uint16_t *src, int32_t K, void *dst);
/* Pass 1 work item: intermediate rows [i0, i1) of expert e for n tokens routed
 * to e (any 0 <= i0 < i1 <= I; several tokens share each weight read).
 * xs[j] is token j's prepared x (length H), w_in[j] its input weight (1 unless
 * apply_router_weight_on_input); the kernel writes bf16 g[j][i0..i1) of the
 * length-I row g[j]: g = bf16(act(gate * w_in, up * w_in)). */
typedef void (*cpumoe_gate_up_fn)(const cpumoe_kernel *k, const cpumoe_bank *banks, int32_t e, int32_t i0,
                                  int32_t i1, int32_t n, const void *const *xs, const float *w_in,
                                  uint16_t *const *g);
/* Pass 2 work item: output rows [h0, h1) for n routes; routes of one expert
 * are adjacent, so each weight row is read once per group. For each route r
 * and h in [h0, h1):
 *   acc[r.token * acc_stride + (h - h0)] += r.weight * dot(down[r.expert, h], r.act)
 * (fp32; ds_fp4 rounds each route's term to bf16 first). */
typedef void (*cpumoe_down_fn)(const cpumoe_kernel *k, const cpumoe_bank *banks, int32_t h0, int32_t h1,
                               const cpumoe_route *routes, int32_t n, float *acc, int64_t acc_stride);

struct cpumoe_kernel {
  uint32_t struct_size;
  int32_t tier;            /* cpumoe_tier of the code that runs */
  cpumoe_params params;
  const char *name;        /* e.g. "avx512bf16", "avx2+w4a8" */
  cpumoe_act_bytes_fn act_bytes;
  cpumoe_prep_act_fn prep_act;
  cpumoe_gate_up_fn gate_up;
  cpumoe_down_fn down;
  int32_t block_hint;      /* preferred multiple for i/h work-item blocks (rows) */
  int32_t reserved;
  void *state;             /* format-private, freed with free() by kernel_destroy */
  char name_buf[48];
};

/* Multiply-add kinds of peak_loop (ABI 1.6), and the instruction each tier runs for them:
 *   INT8 (u8 x s8 products, the w4a8 kernels): vpmaddubsw at avx2 / avx512f, vpdpbusd at avxvnni and the
 *        avx512 VNNI tiers, tdpbssd at amx;
 *   BF16 (bf16 weights): vdpbf16ps at avx512bf16, tdpbf16ps at amx, fp32 FMA below;
 *   FP32: vfmadd231ps (ymm at avx2 / avxvnni, zmm from avx512f). */
enum cpumoe_peak_kind { CPUMOE_PEAK_INT8 = 0, CPUMOE_PEAK_BF16 = 1, CPUMOE_PEAK_FP32 = 2, CPUMOE_PEAK_COUNT = 3 };

/* ABI 1.9. The dense bf16 linear: y = x W^T (+ bias) for a row-major bf16 W [M, K] and a few tokens x [n, K] (bf16),
 * the non-expert projections of a model at decode (attention, routers, the LM head), by the bf16 expert kernels' row
 * dots. One tier's functions; it holds no weights and no state, so one serves any number of threads at once.
 * Bytes of one token's prepared x of length K; 0: rows() reads the bf16 row as given (no prep). */
typedef struct cpumoe_linear cpumoe_linear;
typedef size_t (*cpumoe_linear_x_bytes_fn)(const cpumoe_linear *k, int32_t K);
/* Prepare one token's bf16 row (x_bytes(K) > 0). */
typedef void (*cpumoe_linear_prep_fn)(const cpumoe_linear *k, const uint16_t *src, int32_t K, void *dst);
/* Rows [r0, r1) of y for n >= 1 tokens: for t < n and r0 <= r < r1,
 *   y_t[r] = dot(W[r, 0:K], x_t) (+ bias[r]), fp32 accumulation, stored as fp32 (y_fp32) or bf16 (to nearest even).
 * w: row 0 of W, w_stride bytes between rows (rows 2-byte aligned); x: token 0's prepared row (its bf16 row where
 * x_bytes is 0), x_stride bytes between tokens; bias: M bf16 values or NULL; y: token 0's output row (element r at
 * y + r), y_stride bytes between tokens. Any K >= 1 and row range. A (row, token) result depends only on that row,
 * that token and K: never on r0, r1, n or the other rows (work splits and batches give the same bits). */
typedef void (*cpumoe_linear_rows_fn)(const cpumoe_linear *k, const void *w, int64_t w_stride, int32_t K,
                                      int32_t r0, int32_t r1, int32_t n, const void *x, int64_t x_stride,
                                      const uint16_t *bias, void *y, int64_t y_stride, int32_t y_fp32);
struct cpumoe_linear {
  uint32_t struct_size;
  int32_t tier;              /* cpumoe_tier of the code that runs */
  const char *name;          /* the tier's name, e.g. "avx512bf16" */
  cpumoe_linear_x_bytes_fn x_bytes;
  cpumoe_linear_prep_fn prep_x;
  cpumoe_linear_rows_fn rows;
  int32_t row_block;         /* rows per work item it runs best with (its weight streams span one item) */
  int32_t reserved;
  char name_buf[32];
};

/* ABI 1.11. Decode attention over a bf16 key/value cache, for a few query tokens (a model's decode step on the CPU):
 * for query token t < n, kv head g and its query heads h = g * group + i (i < group),
 *   o[t, h] = sum_j p_j v[g, j],  p = softmax_j(scale * dot(q[t, h], k[g, j])) over the positions j < L with
 *   mask[t, j] != 0 (every j when mask is NULL),
 * fp32 dots and sums of the bf16 inputs, o rounded once to bf16. A token with no position let through gets NaN.
 * Element (not byte) strides; the last (D) axis of q, k, v and o is contiguous. One tier's functions; no state. */
typedef struct cpumoe_attention_args {
  int32_t n, group, D, L;                 /* query tokens, query heads per kv head, head size, cache positions */
  const uint16_t *q;                      /* q[t, h, d] at q + t * q_tok + h * q_head + d */
  int64_t q_tok, q_head;
  const uint16_t *k;                      /* k[g, j, d] at k + g * k_head + j * k_pos + d */
  int64_t k_head, k_pos;
  const uint16_t *v;                      /* v[g, j, d] likewise */
  int64_t v_head, v_pos;
  const uint8_t *mask;                    /* mask[t, j] at mask + t * mask_tok + j, or NULL */
  int64_t mask_tok;
  float scale;
  int32_t reserved;
  uint16_t *o;                            /* o[t, h, d] at o + t * o_tok + h * o_head + d */
  int64_t o_tok, o_head;
} cpumoe_attention_args;
/* The args from addresses (as integers: what Python bindings pass) and element strides; mask 0 = none. */
static inline cpumoe_attention_args cpumoe_attention_args_of(
    int32_t n, int32_t group, int32_t D, int32_t L, uint64_t q, int64_t q_tok, int64_t q_head, uint64_t k,
    int64_t k_head, int64_t k_pos, uint64_t v, int64_t v_head, int64_t v_pos, uint64_t mask, int64_t mask_tok,
    float scale, uint64_t o, int64_t o_tok, int64_t o_head) {
  cpumoe_attention_args a;
  memset(&a, 0, sizeof a);
  a.n = n, a.group = group, a.D = D, a.L = L;
  a.q = (const uint16_t *)(uintptr_t)q, a.q_tok = q_tok, a.q_head = q_head;
  a.k = (const uint16_t *)(uintptr_t)k, a.k_head = k_head, a.k_pos = k_pos;
  a.v = (const uint16_t *)(uintptr_t)v, a.v_head = v_head, a.v_pos = v_pos;
  a.mask = (const uint8_t *)(uintptr_t)mask, a.mask_tok = mask_tok, a.scale = scale;
  a.o = (uint16_t *)(uintptr_t)o, a.o_tok = o_tok, a.o_head = o_head;
  return a;
}
typedef struct cpumoe_attention cpumoe_attention;
/* Scratch bytes heads() needs for these sizes (each concurrent call its own). */
typedef size_t (*cpumoe_attention_scratch_fn)(const cpumoe_attention *k, int32_t group, int32_t D, int32_t L);
/* kv heads [g0, g1) (and their query heads) of every query token. A result depends only on its own token and head:
 * never on g0, g1 or n. */
typedef void (*cpumoe_attention_heads_fn)(const cpumoe_attention *k, const cpumoe_attention_args *a, int32_t g0,
                                          int32_t g1, void *scratch);
struct cpumoe_attention {
  uint32_t struct_size;
  int32_t tier;              /* cpumoe_tier of the code that runs */
  const char *name;          /* the tier's name, e.g. "avx512f" */
  cpumoe_attention_scratch_fn scratch_bytes;
  cpumoe_attention_heads_fn heads;
  char name_buf[32];
};

typedef struct cpumoe_formats_api {
  uint32_t abi_major;
  uint32_t abi_minor;
  uint32_t struct_size;
  const char *build_info;
  /* Tiers */
  int32_t (*detected_tier)(void);           /* best tier of CPU+OS+build, before the cap */
  int32_t (*tier_cap)(void);                /* from CPUMOE_ISA, -1 if the value was invalid */
  const char *(*tier_name)(int32_t tier);
  /* Kernels: returns 0 on success, else writes a message to err. tier_cap < 0 = default cap. */
  int32_t (*kernel_create)(const cpumoe_params *p, int32_t tier_cap, cpumoe_kernel **out, char *err,
                           size_t errlen);
  void (*kernel_destroy)(cpumoe_kernel *k);
  /* Number of banks the format reads, in slot order (see docs/formats.md). */
  int32_t (*format_bank_count)(int32_t format);
  /* Single-threaded whole MoE step through the kernels (reference runner):
   * x [T,H] bf16, ids [T,top_k] int32 (-1 = skip), w [T,top_k] fp32, y [T,H] bf16.
   * scratch: at least step_scratch_bytes(). Returns 0 or -1 (bad expert id, message in err). */
  size_t (*step_scratch_bytes)(const cpumoe_kernel *k, int32_t T, int32_t top_k);
  int32_t (*moe_step)(const cpumoe_kernel *k, const cpumoe_bank *banks, int32_t T, int32_t top_k,
                      const uint16_t *x, const int32_t *ids, const float *w, uint16_t *y, void *scratch,
                      char *err, size_t errlen);
  /* Read [p, p + n) at the widest usable load width as four streams (its quarters, advanced together),
   * returning a checksum: the memory-read loop the benches' bandwidth ceilings are measured with. */
  uint64_t (*read_sum)(const void *p, size_t n);
  /* ABI 1.6. The compute roof beside read_sum's memory roof: `iters` rounds of 12 (ymm) or 24 (zmm) chains of `tier`'s
   * widest multiply-add instruction for `kind` (cpumoe_peak_kind), on the calling thread; returns the multiply-adds
   * done, or 0 where this CPU, OS or build cannot run that tier, or the tier has no such instruction (scalar).
   * Time it on every core for the machine's multiply-adds per second: an upper bound for any kernel of the tier. */
  uint64_t (*peak_loop)(int32_t kind, int32_t tier, uint64_t iters);
  /* ABI 1.9. The dense bf16 linear at the best tier <= tier_cap (< 0: the default cap, CPUMOE_ISA or the best):
   * returns 0, or -1 with a message in err. Free it with linear_destroy. */
  int32_t (*linear_create)(int32_t tier_cap, cpumoe_linear **out, char *err, size_t errlen);
  void (*linear_destroy)(cpumoe_linear *k);
  /* ABI 1.11. Decode attention at the best tier <= tier_cap (as linear_create). Free it with attention_destroy. */
  int32_t (*attention_create)(int32_t tier_cap, cpumoe_attention **out, char *err, size_t errlen);
  void (*attention_destroy)(cpumoe_attention *k);
} cpumoe_formats_api;

/* fp32 -> bf16, round to nearest even; NaN stays a quiet NaN of the same sign.
 * The one rounding every kernel and consumer uses for bf16 outputs. */
static inline uint16_t cpumoe_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Consumer-side check against the version the consumer was built with.
 * Returns 0 if usable, else writes a message naming both versions and what to do. */
static inline int cpumoe_formats_check_api_as(const cpumoe_formats_api *api, uint32_t major, uint32_t minor,
                                              size_t size, char *err, size_t errlen) {
  if (!api) {
    snprintf(err, errlen, "cpumoe-formats: capsule holds no API table");
    return -1;
  }
  if (api->abi_major != major || api->abi_minor < minor || api->struct_size < size) {
    snprintf(err, errlen,
             "cpumoe-formats ABI mismatch: the installed cpumoe-formats provides ABI %u.%u (table %u bytes) but "
             "this consumer was built against ABI %u.%u (table %zu bytes); rebuild/reinstall the consumer against "
             "the installed cpumoe-formats, or install a cpumoe-formats that provides ABI %u.x with x >= %u",
             api->abi_major, api->abi_minor, api->struct_size, major, minor, size, major, minor);
    return -1;
  }
  return 0;
}
#define cpumoe_formats_check_api(api, err, errlen)                                                        \
  cpumoe_formats_check_api_as((api), CPUMOE_FORMATS_ABI_MAJOR, CPUMOE_FORMATS_ABI_MINOR,                  \
                              sizeof(cpumoe_formats_api), (err), (errlen))

#ifdef __cplusplus
}
#endif
#endif
