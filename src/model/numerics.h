/* model/numerics: the numerics switches of the forward pass, and profiles.
 *
 * Owns: dsv4_numerics, a plain struct of named switches that the forward pass
 * reads (never getenv).  Every difference between the `exact` profile (fp32 on
 * exactly dequantized weights, what transformers' DeepseekV4 computes) and the
 * `reference` profile (DeepSeek's own inference numerics, spec §2.0-§2.6) is
 * exactly one switch; profiles are constant bundles of switch values.  Users edit
 * a copy with `--set name=value`.  docs/NUMERICS.md explains each switch.
 * Lifetime: plain values; thread-safe.
 */
#ifndef DSV4_MODEL_NUMERICS_H
#define DSV4_MODEL_NUMERICS_H

#include <stddef.h>

#include "util/err.h"

typedef struct dsv4_numerics {
    int linear_act_fp8;     /* linear.act: 0 f32, 1 fp8 (1x128 ue8m0 act-quant inside FP8/FP4 linears) */
    int act_bf16;           /* act.bf16: 0 off, 1 on (bf16 rounding where the reference rounds) */
    int kv_sim_fp8;         /* kv.sim: 0 none, 1 fp8 (block-64 fp8 simulation of KV nope dims) */
    int indexer_sim_fp4;    /* indexer.sim: 0 none, 1 fp4 (Hadamard + fp4 on indexer q and keys) */
    int hc_state_bf16;      /* hc.state: 0 f32, 1 bf16 (storage of the HC residual after hc_post) */
    int moe_before_w2;      /* moe.weight: 0 after_w2, 1 before_w2 */
    int attn_prob_bf16;     /* attn.prob: 0 f32, 1 bf16 */
    int indexer_score_bf16; /* indexer.score: 0 f32, 1 bf16 */
    int mhc_gemm_bf16;      /* mhc.gemm: 0 f32, 1 bf16 (inputs of the mHC fn matmul rounded to bf16) */
    int indexer_keys;       /* indexer.keys: DSV4_IKEYS_* */
    int route_scale;        /* moe.route_scale: DSV4_RSCALE_* */
    int moe_dot_mma;        /* moe.dot: 0 f32, 1 mma (MXFP4 expert dots on f16 tensor cores), 2 e4m3 (GPU one-row path) */
    int lin_dot_mma;        /* linear.dot: 0 f32, 1 mma (one-row FP8 linear dots on f16 tensor cores, GPU) */
    int lin_gemm_e4m3;      /* linear.gemm: 0 f32, 1 e4m3 (many-row FP8 linears under linear.act=fp8 on e4m3
                             * tensor cores, GPU) */
} dsv4_numerics;

enum { DSV4_IKEYS_F32 = 0, DSV4_IKEYS_BF16, DSV4_IKEYS_FP8, DSV4_IKEYS_FP4 };
enum { DSV4_RSCALE_ROUTER = 0, DSV4_RSCALE_OUTPUT, DSV4_RSCALE_BOTH };

extern const dsv4_numerics DSV4_NUMERICS_EXACT;
extern const dsv4_numerics DSV4_NUMERICS_REFERENCE;

/* Profile by name ("exact", "reference"); -1 with a message listing the profiles. */
int dsv4_numerics_profile(dsv4_numerics *out, const char *name, dsv4_err *err);

/* Applies one "name=value" edit to *n.  Unknown names or values are errors that
 * list what is accepted; *n is unchanged on error. */
int dsv4_numerics_set(dsv4_numerics *n, const char *assignment, dsv4_err *err);

/* The switch table, for `dsv4 switches` and docs. */
typedef struct dsv4_switch_info {
    const char *name;       /* "kv.sim" */
    const char *values;     /* "none|fp8" */
    const char *meaning;    /* one line */
    const char *spec;       /* spec section, e.g. "§2.5" */
} dsv4_switch_info;
int dsv4_numerics_n_switches(void);
const dsv4_switch_info *dsv4_numerics_switch(int i);
/* Current value of switch i in n, as its value name ("fp8"). */
const char *dsv4_numerics_value(const dsv4_numerics *n, int i);
/* Writes "name=value name=value ..." (one space-separated line) into buf. */
void dsv4_numerics_format(const dsv4_numerics *n, char *buf, size_t size);

#endif
