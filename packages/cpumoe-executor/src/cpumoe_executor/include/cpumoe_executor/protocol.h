/* CPU MoE doorbell protocol v1: the IO block and the ready/done/error words.
 * Written down in docs/protocol.md; gpusync-*, kernelio and the executor all
 * check CPUMOE_PROTOCOL_VERSION and the block's magic before using it. */
#ifndef CPUMOE_EXECUTOR_PROTOCOL_H
#define CPUMOE_EXECUTOR_PROTOCOL_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CPUMOE_PROTOCOL_VERSION 1
#define CPUMOE_IOB_MAGIC 0x31424F49454D5043ull /* "CPMEIOB1" little-endian */
#define CPUMOE_IOB_ALIGN 64

/* task = layer << 32 | num_tokens; never 0 because num_tokens >= 1 */
#define CPUMOE_TASK(layer, num_tokens) ((((uint64_t)(uint32_t)(layer)) << 32) | (uint32_t)(num_tokens))
#define CPUMOE_TASK_LAYER(task) ((uint32_t)((task) >> 32))
#define CPUMOE_TASK_TOKENS(task) ((uint32_t)((task)&0xFFFFFFFFu))

/* done values */
#define CPUMOE_DONE_PENDING 0ull
#define CPUMOE_DONE_COMPLETE 1ull
#define CPUMOE_DONE_SHUTDOWN 0x7FFFFFFFFFFFFFFFull /* >= 1: releases any waiter */

/* error codes (sticky until the engine clears them) */
enum cpumoe_error_code {
  CPUMOE_ERR_NONE = 0,
  CPUMOE_ERR_EXPERT_ID = 1,  /* an id outside [-1, E) */
  CPUMOE_ERR_LAYER = 2,      /* layer >= num_layers */
  CPUMOE_ERR_NUM_TOKENS = 3, /* num_tokens == 0 or > max_tokens */
  CPUMOE_ERR_INTERNAL = 4
};

/* The block: one page-aligned host allocation. The words each sit on their own
 * cache line; the arrays follow, each 64-byte aligned, at the offsets below. */
typedef struct cpumoe_iob_header {
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint32_t hidden;     /* H */
  uint32_t top_k;
  uint32_t max_tokens;
  uint32_t num_layers;
  uint64_t x_off;      /* bf16 [max_tokens, H] */
  uint64_t ids_off;    /* int32 [max_tokens, top_k], -1 = not on the CPU */
  uint64_t w_off;      /* fp32 [max_tokens, top_k] */
  uint64_t y_off;      /* bf16 [max_tokens, H] */
  uint64_t total_bytes;
  uint64_t reserved0[7];
  /* 128 */ uint64_t ready;  uint64_t pad_ready[7];
  /* 192 */ uint64_t done;   uint64_t pad_done[7];
  /* 256 */ uint64_t error;  uint64_t pad_error[7];
  /* 320 */ uint64_t served; uint64_t pad_served[7];
} cpumoe_iob_header;

#define CPUMOE_IOB_READY_OFF 128
#define CPUMOE_IOB_DONE_OFF 192
#define CPUMOE_IOB_ERROR_OFF 256
#define CPUMOE_IOB_SERVED_OFF 320

#ifdef __cplusplus
static_assert(sizeof(cpumoe_iob_header) == 384, "IO block header layout");
static_assert(__builtin_offsetof(cpumoe_iob_header, ready) == CPUMOE_IOB_READY_OFF, "ready word offset");
static_assert(__builtin_offsetof(cpumoe_iob_header, done) == CPUMOE_IOB_DONE_OFF, "done word offset");
static_assert(__builtin_offsetof(cpumoe_iob_header, error) == CPUMOE_IOB_ERROR_OFF, "error word offset");
static_assert(__builtin_offsetof(cpumoe_iob_header, served) == CPUMOE_IOB_SERVED_OFF, "served word offset");
}
#endif
#endif
