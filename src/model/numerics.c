#include "model/numerics.h"

#include <stdio.h>
#include <string.h>

/* exact: fp32 everywhere, no simulation; the routing weight after w2 as
 * transformers does.  reference: DeepSeek's inference/model.py + kernel.py. */
const dsv4_numerics DSV4_NUMERICS_EXACT = {
    .linear_act_fp8 = 0,
    .act_bf16 = 0,
    .kv_sim_fp8 = 0,
    .indexer_sim_fp4 = 0,
    .hc_state_bf16 = 0,
    .moe_before_w2 = 0,
    .attn_prob_bf16 = 0,
    .indexer_score_bf16 = 0,
    .mhc_gemm_bf16 = 0,
    .indexer_keys = DSV4_IKEYS_F32,
    .route_scale = DSV4_RSCALE_ROUTER,
    .moe_dot_mma = 0,
    .lin_dot_mma = 0,
    .lin_gemm_e4m3 = 0,
};

const dsv4_numerics DSV4_NUMERICS_REFERENCE = {
    .linear_act_fp8 = 1,
    .act_bf16 = 1,
    .kv_sim_fp8 = 1,
    .indexer_sim_fp4 = 1,
    .hc_state_bf16 = 1,
    .moe_before_w2 = 1,
    .attn_prob_bf16 = 1,
    .indexer_score_bf16 = 1,
    .mhc_gemm_bf16 = 0, /* the reference's hc fn matmul is fp32 (spec §2.3) */
    .indexer_keys = DSV4_IKEYS_BF16,
    .route_scale = DSV4_RSCALE_ROUTER,
    .moe_dot_mma = 0, /* a GPU arithmetic of ours, not the reference's */
    .lin_dot_mma = 0, /* likewise */
    .lin_gemm_e4m3 = 0, /* DeepSeek's kernels' arithmetic, but not the CPU's: named, off (NUMERICS.md) */
};

/* ----- the switch table: one row per field, values in field order (0, 1, ...) ----- */
typedef struct {
    dsv4_switch_info info;
    size_t offset;
    const char *vals[5]; /* NULL-terminated value names; index = stored int */
} switch_row;

#define ROW(nm, field, vs, mean, sec, ...) \
    {{nm, vs, mean, sec}, offsetof(dsv4_numerics, field), {__VA_ARGS__, NULL}}

static const switch_row SWITCHES[] = {
    ROW("linear.act", linear_act_fp8, "f32|fp8",
        "activations entering FP8/FP4 linears: exact fp32, or 1x128 e4m3 act-quant with ue8m0 (pow2) scales",
        "§2.0", "f32", "fp8"),
    ROW("act.bf16", act_bf16, "off|on",
        "round activations to bf16 where the reference holds them in bf16 (linear/norm/rope/attention outputs)",
        "§2.0-§2.7", "off", "on"),
    ROW("kv.sim", kv_sim_fp8, "none|fp8",
        "fp8 simulation (block 64, pow2 scale) of KV nope dims, window rows and compressed rows", "§2.5", "none",
        "fp8"),
    ROW("indexer.sim", indexer_sim_fp4, "none|fp4",
        "Hadamard rotation + fp4 simulation (block 32) of indexer queries and compressed keys", "§2.5", "none",
        "fp4"),
    ROW("hc.state", hc_state_bf16, "f32|bf16", "storage precision of the 4-stream HC residual after hc_post",
        "§2.3", "f32", "bf16"),
    ROW("moe.weight", moe_before_w2, "after_w2|before_w2",
        "where the routing weight multiplies: after w2 (transformers) or on the SwiGLU activation before w2 "
        "(reference)",
        "§2.6", "after_w2", "before_w2"),
    ROW("attn.prob", attn_prob_bf16, "f32|bf16", "attention probabilities cast to bf16 before P*V", "§2.5", "f32",
        "bf16"),
    ROW("indexer.score", indexer_score_bf16, "f32|bf16", "indexer scores accumulated and held in bf16", "§2.5",
        "f32", "bf16"),
    ROW("mhc.gemm", mhc_gemm_bf16, "f32|bf16", "inputs of the mHC fn matmul rounded to bf16 (kernel variants)",
        "§2.3", "f32", "bf16"),
    ROW("indexer.keys", indexer_keys, "f32|bf16|fp8|fp4",
        "storage of indexer keys: f32, bf16, e4m3 with a per-row pow2 scale, or e2m1 blocks of 32 (production "
        "engines)",
        "§2.5, §6.1", "f32", "bf16", "fp8", "fp4"),
    ROW("moe.route_scale", route_scale, "router|output|both",
        "where routed_scaling_factor is applied: router weights, the routed sum, or both (the double-application "
        "bug, test-only)",
        "§2.6, §6.2", "router", "output", "both"),
    ROW("moe.dot", moe_dot_mma, "f32|mma|e4m3",
        "expert dots of one-row decode on the GPU: fp32 fma; f16 tensor-core MMA of MXFP4 experts (x split in "
        "three f16 parts, exact products; the MMA's own summation differs); or, with linear.act=fp8 only, e4m3 "
        "tensor-core MMA of the act-quantized input and the stored codes (DeepSeek's arithmetic; the MMA's own "
        "summation differs); the CPU computes f32 either way",
        "§2.6", "f32", "mma", "e4m3"),
    ROW("linear.dot", lin_dot_mma, "f32|mma",
        "FP8 linear dots of one-row decode on the GPU (the large ones: wq_b, wo_a, wo_b on Flash): fp32 fma, or f16 "
        "tensor-core MMA (x split in three f16 parts per 128 columns, exact products; the MMA's own summation "
        "differs); the CPU computes f32 either way",
        "§2.0", "f32", "mma"),
    ROW("linear.gemm", lin_gemm_e4m3, "f32|e4m3",
        "FP8 linears of many rows (prefill, >= 32) under linear.act=fp8 on the GPU: fp32 sums of the e4m3 "
        "products (the CPU's arithmetic), or e4m3 tensor-core MMA (DeepSeek's kernels' arithmetic: the MMA's "
        "reduced-precision sums within each 128-wide block, promoted to fp32 per block)",
        "§2.0", "f32", "e4m3"),
};
#define N_SWITCHES ((int)(sizeof SWITCHES / sizeof SWITCHES[0]))

static int *field(dsv4_numerics *n, int i) { return (int *)((char *)n + SWITCHES[i].offset); }

int dsv4_numerics_n_switches(void) { return N_SWITCHES; }

const dsv4_switch_info *dsv4_numerics_switch(int i) {
    if (i < 0 || i >= N_SWITCHES) return NULL;
    return &SWITCHES[i].info;
}

const char *dsv4_numerics_value(const dsv4_numerics *n, int i) {
    if (i < 0 || i >= N_SWITCHES) return "?";
    int v = *field((dsv4_numerics *)n, i);
    for (int k = 0; SWITCHES[i].vals[k]; k++)
        if (k == v) return SWITCHES[i].vals[k];
    return "?";
}

int dsv4_numerics_profile(dsv4_numerics *out, const char *name, dsv4_err *err) {
    if (!name || !strcmp(name, "exact")) {
        *out = DSV4_NUMERICS_EXACT;
        return 0;
    }
    if (!strcmp(name, "reference")) {
        *out = DSV4_NUMERICS_REFERENCE;
        return 0;
    }
    return dsv4_errf(err, "unknown numerics profile '%s' (known: exact, reference)", name);
}

int dsv4_numerics_set(dsv4_numerics *n, const char *a, dsv4_err *err) {
    if (!a) return dsv4_errf(err, "numerics: empty --set");
    const char *eq = strchr(a, '=');
    if (!eq || eq == a || !eq[1])
        return dsv4_errf(err, "numerics: --set expects NAME=VALUE, got '%s' (see `dsv4 switches`)", a);
    size_t nl = (size_t)(eq - a);
    for (int i = 0; i < N_SWITCHES; i++) {
        const char *nm = SWITCHES[i].info.name;
        if (strlen(nm) != nl || strncmp(nm, a, nl)) continue;
        for (int k = 0; SWITCHES[i].vals[k]; k++)
            if (!strcmp(SWITCHES[i].vals[k], eq + 1)) {
                *field(n, i) = k;
                return 0;
            }
        return dsv4_errf(err, "numerics: switch '%s' has no value '%s' (accepted: %s)", nm, eq + 1,
                         SWITCHES[i].info.values);
    }
    char names[512] = "";
    for (int i = 0; i < N_SWITCHES; i++) {
        size_t l = strlen(names);
        snprintf(names + l, sizeof names - l, "%s%s", i ? ", " : "", SWITCHES[i].info.name);
    }
    return dsv4_errf(err, "numerics: unknown switch '%.*s' (known: %s)", (int)nl, a, names);
}

void dsv4_numerics_format(const dsv4_numerics *n, char *buf, size_t size) {
    if (!size) return;
    buf[0] = 0;
    size_t l = 0;
    for (int i = 0; i < N_SWITCHES && l < size; i++) {
        int w = snprintf(buf + l, size - l, "%s%s=%s", i ? " " : "", SWITCHES[i].info.name,
                         dsv4_numerics_value(n, i));
        if (w < 0) break;
        l += (size_t)w;
    }
}
