/* model/config: config.json -> dsv4_config.
 *
 * Owns: every hyperparameter of a DeepSeek-V4 checkpoint (spec §1).  Reads both
 * the checkpoint's own keys (compress_ratios, rope_scaling, num_hash_layers, ...)
 * and the keys transformers' DeepseekV4Config writes (layer_types, compress_rates,
 * mlp_layer_types, rope_parameters).  Anything that changes the math has no silent
 * default: a missing or inconsistent value is an error naming the key.  Keys that
 * do not change the math (bos/eos ids, max_position_embeddings, torch_dtype) have
 * documented defaults.
 * Lifetime: a plain value struct, no heap; copy freely.  Thread-safe.
 */
#ifndef DSV4_MODEL_CONFIG_H
#define DSV4_MODEL_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "util/err.h"

#define DSV4_MAX_LAYERS 128 /* trunk layers + MTP layers */

typedef enum {
    DSV4_EXPERT_FP4 = 0,   /* MXFP4: packed e2m1, e8m0 per 32 (official) */
    DSV4_EXPERT_FP8 = 1,   /* FP8 e4m3 128x128 blocks (Flash-Base, convert --expert-dtype fp8) */
    DSV4_EXPERT_NVFP4 = 2, /* NVIDIA ModelOpt NVFP4 (weight, weight_scale e4m3/16, weight_scale_2) */
    DSV4_EXPERT_BF16 = 3,  /* unquantized experts (test configs) */
} dsv4_expert_dtype;

typedef enum {
    DSV4_LINEAR_FP8 = 0,  /* quantization_config fp8 e4m3, 128x128 blocks */
    DSV4_LINEAR_BF16 = 1, /* no quantization_config: plain bf16 linears */
} dsv4_linear_dtype;

typedef enum {
    DSV4_SCALE_UE8M0 = 0, /* F8_E8M0 block scales (official) */
    DSV4_SCALE_F32 = 1,   /* float32 block scales (Flash-Base) */
} dsv4_scale_fmt;

typedef struct dsv4_config {
    char name[64]; /* "flash", "pro", "tiny" or the file it came from */

    /* sizes */
    int vocab_size;          /* 129280 */
    int dim;                 /* hidden_size 4096 */
    int n_layers;            /* num_hidden_layers 43 (trunk only) */
    int n_mtp;               /* num_nextn_predict_layers 1 */
    int n_heads;             /* num_attention_heads 64 */
    int head_dim;            /* 512 (q/k/v; v = k) */
    int rope_dim;            /* qk_rope_head_dim 64 (last dims of each head) */
    int q_lora_rank;         /* 1024 */
    int o_lora_rank;         /* 1024 (per group) */
    int o_groups;            /* 8 */
    int window;              /* sliding_window 128 */
    int moe_inter;           /* moe_intermediate_size 2048 */
    int n_routed;            /* n_routed_experts 256 */
    int n_shared;            /* n_shared_experts 1 */
    int n_active;            /* num_experts_per_tok 6 */
    int n_hash_layers;       /* num_hash_layers 3 */
    int index_n_heads;       /* 64 */
    int index_head_dim;      /* 128 */
    int index_topk;          /* 512 */
    int hc_mult;             /* 4 */
    int hc_sinkhorn_iters;   /* 20 */

    /* per layer, index 0..n_layers+n_mtp-1 (MTP layers after the trunk) */
    int compress_ratio[DSV4_MAX_LAYERS]; /* 0, 4 or another ratio >1 ("128-style") */

    /* math constants */
    double norm_eps;            /* rms_norm_eps 1e-6 */
    double hc_eps;              /* 1e-6 */
    double routed_scale;        /* routed_scaling_factor 1.5 */
    double swiglu_limit;        /* 10.0 (0 = no clamp) */
    double rope_theta;          /* 10000, ratio-0 layers */
    double compress_rope_theta; /* 160000, compressed layers */
    /* YaRN, applied to compressed layers only (spec §2.4); yarn_factor 1 or
     * original_seq_len 0 means off */
    double yarn_factor;         /* 16 */
    double yarn_original_seq;   /* 65536 */
    double yarn_beta_fast;      /* 32 */
    double yarn_beta_slow;      /* 1 */

    /* formats */
    dsv4_linear_dtype linear_dtype;
    dsv4_scale_fmt scale_fmt;
    int quant_block;            /* weight_block_size 128 (both dims) */
    dsv4_expert_dtype expert_dtype;

    /* non-math */
    int bos_id, eos_id;
    int64_t max_position;
} dsv4_config;

/* Parses config.json text (len bytes, need not be NUL-terminated). `what`
 * names the source in messages (a path).  Validates ranges and consistency. */
int dsv4_config_parse(dsv4_config *cfg, const char *json, size_t len, const char *what, dsv4_err *err);

/* Reads and parses a file. */
int dsv4_config_load(dsv4_config *cfg, const char *path, dsv4_err *err);

/* Built-in configs: "flash" (V4-Flash, spec §1.1), "pro" (V4-Pro, spec §1.3),
 * "tiny" (a small CI config exercising every path).  Returns -1 for unknown. */
int dsv4_config_builtin(dsv4_config *cfg, const char *name, dsv4_err *err);

/* Writes cfg as a checkpoint-style config.json (the official key names, with
 * transformers' keys alongside so either reader works).  Returns malloc'd text. */
char *dsv4_config_to_json(const dsv4_config *cfg);

/* Truncates a config to its first n trunk layers (keeps the MTP entries).
 * n_hash_layers is clamped to n. */
int dsv4_config_truncate(dsv4_config *cfg, int n, dsv4_err *err);

/* 1 if a and b hold the same model (every field but `name`), else 0 and, if
 * diff is non-NULL, the first differing field's name written into it. */
int dsv4_config_equal(const dsv4_config *a, const dsv4_config *b, char *diff, size_t diff_len);

/* Convenience queries. */
static inline int dsv4_config_total_layers(const dsv4_config *c) { return c->n_layers + c->n_mtp; }
static inline int dsv4_config_is_hash(const dsv4_config *c, int layer) {
    return layer < c->n_layers && layer < c->n_hash_layers;
}
static inline int dsv4_config_nope_dim(const dsv4_config *c) { return c->head_dim - c->rope_dim; }

#endif
