/* model/weights: the tensor inventory and binding (contract in weights.h). */
#include "model/weights.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/quant.h"

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

const char *dsv4_wclass_name(dsv4_wclass c) {
    static const char *names[DSV4_CLASS_COUNT] = {"embedding/head", "attention",      "compressor",
                                                  "indexer",        "mHC",            "router",
                                                  "routed experts", "shared experts", "MTP"};
    return (unsigned)c < DSV4_CLASS_COUNT ? names[c] : "?";
}

const char *dsv4_wfmt_name(dsv4_wfmt f) {
    switch (f) {
    case DSV4_WF_NONE: return "none";
    case DSV4_WF_F32: return "F32";
    case DSV4_WF_BF16: return "BF16";
    case DSV4_WF_FP8: return "FP8";
    case DSV4_WF_MXFP4: return "MXFP4";
    case DSV4_WF_NVFP4: return "NVFP4";
    case DSV4_WF_I32: return "I32";
    case DSV4_WF_I64: return "I64";
    }
    return "?";
}

/* ----- the inventory (spec §4.1, §4.2) -----
 * One emitter per kind of tensor; the order is globals, then each trunk layer,
 * then each MTP layer, and inside a layer a fixed order.  Everything that
 * depends on the config (widths, ratio, hash routing, formats) is decided here
 * and nowhere else. */
typedef struct {
    const dsv4_config *cfg;
    dsv4_inv_fn fn;
    void *user;
    int rc;             /* first non-zero return of fn */
    dsv4_wclass cls;    /* class for the entries being emitted */
    int layer, expert;
    char prefix[48];    /* "layers.3." / "mtp.0." / "" */
} inv_ctx;

static void emit(inv_ctx *c, const char *suffix, dsv4_dtype dt, int ndim, int64_t s0, int64_t s1, int role,
                 dsv4_wpart part, dsv4_wfmt fmt, int64_t rows, int64_t cols) {
    if (c->rc) return;
    dsv4_inv_entry e;
    memset(&e, 0, sizeof e);
    snprintf(e.name, sizeof e.name, "%s%s", c->prefix, suffix);
    e.dtype = dt;
    e.ndim = ndim;
    e.shape[0] = s0;
    e.shape[1] = s1;
    e.cls = c->cls;
    e.layer = c->layer;
    e.expert = c->expert;
    e.role = role;
    e.part = part;
    e.fmt = fmt;
    e.rows = rows;
    e.cols = cols;
    size_t n = dsv4_dtype_size(dt);
    for (int i = 0; i < ndim; i++) n *= (size_t)e.shape[i];
    e.bytes = n;
    if (part == DSV4_PART_DATA && fmt != DSV4_WF_I32 && fmt != DSV4_WF_I64) e.params = rows * cols;
    c->rc = c->fn(&e, c->user);
}

/* A vector [n] (rows = 1). */
static void vec(inv_ctx *c, const char *suffix, dsv4_dtype dt, int64_t n, int role) {
    emit(c, suffix, dt, 1, n, 0, role, DSV4_PART_DATA, dt == DSV4_DT_F32 ? DSV4_WF_F32 : DSV4_WF_BF16, 1, n);
}

/* A plain 2-D tensor [rows, cols] in bf16 or f32. */
static void mat(inv_ctx *c, const char *suffix, dsv4_dtype dt, int64_t rows, int64_t cols, int role) {
    emit(c, suffix, dt, 2, rows, cols, role, DSV4_PART_DATA, dt == DSV4_DT_F32 ? DSV4_WF_F32 : DSV4_WF_BF16, rows,
         cols);
}

/* A linear "<base>.weight" [out, in] in format fmt, with its scale tensors. */
static void linear(inv_ctx *c, const char *base, dsv4_wfmt fmt, int64_t out, int64_t in, int role) {
    char n[80];
    int64_t B = c->cfg->quant_block > 0 ? c->cfg->quant_block : 128;
    snprintf(n, sizeof n, "%s.weight", base);
    switch (fmt) {
    case DSV4_WF_FP8:
        emit(c, n, DSV4_DT_F8_E4M3, 2, out, in, role, DSV4_PART_DATA, fmt, out, in);
        snprintf(n, sizeof n, "%s.scale", base);
        emit(c, n, c->cfg->scale_fmt == DSV4_SCALE_F32 ? DSV4_DT_F32 : DSV4_DT_F8_E8M0, 2, cdiv(out, B), cdiv(in, B),
             role, DSV4_PART_SCALE, fmt, out, in);
        break;
    case DSV4_WF_MXFP4:
        /* partial last blocks (test configs): ceil, spec §2.0 */
        emit(c, n, DSV4_DT_I8, 2, out, cdiv(in, 2), role, DSV4_PART_DATA, fmt, out, in);
        snprintf(n, sizeof n, "%s.scale", base);
        emit(c, n, DSV4_DT_F8_E8M0, 2, out, cdiv(in, 32), role, DSV4_PART_SCALE, fmt, out, in);
        break;
    case DSV4_WF_NVFP4:
        emit(c, n, DSV4_DT_U8, 2, out, cdiv(in, 2), role, DSV4_PART_DATA, fmt, out, in);
        snprintf(n, sizeof n, "%s.weight_scale", base);
        emit(c, n, DSV4_DT_F8_E4M3, 2, out, cdiv(in, 16), role, DSV4_PART_SCALE, fmt, out, in);
        snprintf(n, sizeof n, "%s.weight_scale_2", base);
        emit(c, n, DSV4_DT_F32, 0, 0, 0, role, DSV4_PART_SCALE2, fmt, out, in);
        snprintf(n, sizeof n, "%s.input_scale", base);
        emit(c, n, DSV4_DT_F32, 0, 0, 0, role, DSV4_PART_INPUT_SCALE, fmt, out, in);
        break;
    case DSV4_WF_F32: emit(c, n, DSV4_DT_F32, 2, out, in, role, DSV4_PART_DATA, fmt, out, in); break;
    default: emit(c, n, DSV4_DT_BF16, 2, out, in, role, DSV4_PART_DATA, DSV4_WF_BF16, out, in);
    }
}

static dsv4_wfmt linear_fmt(const dsv4_config *cfg) {
    return cfg->linear_dtype == DSV4_LINEAR_BF16 ? DSV4_WF_BF16 : DSV4_WF_FP8;
}

static dsv4_wfmt expert_fmt(const dsv4_config *cfg, int is_mtp) {
    switch (cfg->expert_dtype) {
    case DSV4_EXPERT_FP4: return DSV4_WF_MXFP4;
    case DSV4_EXPERT_FP8: return DSV4_WF_FP8;
    case DSV4_EXPERT_NVFP4: return is_mtp ? DSV4_WF_MXFP4 : DSV4_WF_NVFP4; /* MTP is excluded from NVFP4, §4.2 */
    case DSV4_EXPERT_BF16: return DSV4_WF_BF16;
    }
    return DSV4_WF_MXFP4;
}

static void compressor(inv_ctx *c, const char *base, int ratio, int64_t d, int roles0) {
    const dsv4_config *cfg = c->cfg;
    int64_t coff = ratio == 4 ? 2 : 1; /* overlapping windows need two halves, spec §2.5 */
    char n[80];
    snprintf(n, sizeof n, "%s.wkv.weight", base);
    mat(c, n, DSV4_DT_BF16, coff * d, cfg->dim, roles0 + 0);
    snprintf(n, sizeof n, "%s.wgate.weight", base);
    mat(c, n, DSV4_DT_BF16, coff * d, cfg->dim, roles0 + 1);
    snprintf(n, sizeof n, "%s.ape", base);
    mat(c, n, DSV4_DT_F32, ratio, coff * d, roles0 + 2);
    snprintf(n, sizeof n, "%s.norm.weight", base);
    vec(c, n, DSV4_DT_BF16, d, roles0 + 3);
}

static void hc_params(inv_ctx *c, const char *which, int role_fn) {
    const dsv4_config *cfg = c->cfg;
    int64_t hc = cfg->hc_mult, mix = (2 + hc) * hc;
    char n[48];
    snprintf(n, sizeof n, "hc_%s_fn", which);
    mat(c, n, DSV4_DT_F32, mix, hc * cfg->dim, role_fn);
    snprintf(n, sizeof n, "hc_%s_base", which);
    vec(c, n, DSV4_DT_F32, mix, role_fn + 1);
    snprintf(n, sizeof n, "hc_%s_scale", which);
    vec(c, n, DSV4_DT_F32, 3, role_fn + 2);
}

static void layer(inv_ctx *c, int L) {
    const dsv4_config *cfg = c->cfg;
    int is_mtp = L >= cfg->n_layers;
    int ratio = cfg->compress_ratio[L];
    dsv4_wfmt lf = linear_fmt(cfg), ef = expert_fmt(cfg, is_mtp);
    int64_t dim = cfg->dim, hd = cfg->head_dim;
    dsv4_wclass base_cls = is_mtp ? DSV4_CLASS_MTP : DSV4_CLASS_ATTENTION;
#define CLS(k) (c->cls = is_mtp ? DSV4_CLASS_MTP : (k))
    if (is_mtp)
        snprintf(c->prefix, sizeof c->prefix, "mtp.%d.", L - cfg->n_layers);
    else
        snprintf(c->prefix, sizeof c->prefix, "layers.%d.", L);
    c->layer = L;
    c->expert = -1;
    c->cls = base_cls;

    if (is_mtp) {
        linear(c, "e_proj", lf, dim, dim, DSV4_W_E_PROJ);
        linear(c, "h_proj", lf, dim, dim, DSV4_W_H_PROJ);
        vec(c, "enorm.weight", DSV4_DT_BF16, dim, DSV4_W_ENORM);
        vec(c, "hnorm.weight", DSV4_DT_BF16, dim, DSV4_W_HNORM);
        vec(c, "norm.weight", DSV4_DT_BF16, dim, DSV4_W_MTP_NORM);
        mat(c, "hc_head_fn", DSV4_DT_F32, cfg->hc_mult, (int64_t)cfg->hc_mult * dim, DSV4_W_MTP_HC_HEAD_FN);
        vec(c, "hc_head_base", DSV4_DT_F32, cfg->hc_mult, DSV4_W_MTP_HC_HEAD_BASE);
        vec(c, "hc_head_scale", DSV4_DT_F32, 1, DSV4_W_MTP_HC_HEAD_SCALE);
    }

    /* attention, spec §2.5 */
    CLS(DSV4_CLASS_ATTENTION);
    vec(c, "attn_norm.weight", DSV4_DT_BF16, dim, DSV4_W_ATTN_NORM);
    linear(c, "attn.wq_a", lf, cfg->q_lora_rank, dim, DSV4_W_WQ_A);
    vec(c, "attn.q_norm.weight", DSV4_DT_BF16, cfg->q_lora_rank, DSV4_W_Q_NORM);
    linear(c, "attn.wq_b", lf, (int64_t)cfg->n_heads * hd, cfg->q_lora_rank, DSV4_W_WQ_B);
    linear(c, "attn.wkv", lf, hd, dim, DSV4_W_WKV);
    vec(c, "attn.kv_norm.weight", DSV4_DT_BF16, hd, DSV4_W_KV_NORM);
    int64_t og = cfg->o_groups > 0 ? cfg->o_groups : 1;
    linear(c, "attn.wo_a", lf, og * cfg->o_lora_rank, (int64_t)cfg->n_heads * hd / og, DSV4_W_WO_A);
    linear(c, "attn.wo_b", lf, dim, og * cfg->o_lora_rank, DSV4_W_WO_B);
    vec(c, "attn.attn_sink", DSV4_DT_F32, cfg->n_heads, DSV4_W_ATTN_SINK);
    if (ratio != 0) {
        CLS(DSV4_CLASS_COMPRESSOR);
        compressor(c, "attn.compressor", ratio, hd, DSV4_W_COMP_WKV);
    }
    if (ratio == 4) {
        CLS(DSV4_CLASS_INDEXER);
        linear(c, "attn.indexer.wq_b", lf, (int64_t)cfg->index_n_heads * cfg->index_head_dim, cfg->q_lora_rank,
               DSV4_W_IDX_WQ_B);
        mat(c, "attn.indexer.weights_proj.weight", DSV4_DT_BF16, cfg->index_n_heads, dim, DSV4_W_IDX_WPROJ);
        compressor(c, "attn.indexer.compressor", ratio, cfg->index_head_dim, DSV4_W_IDX_COMP_WKV);
    }

    /* mHC, spec §2.3 */
    CLS(DSV4_CLASS_MHC);
    hc_params(c, "attn", DSV4_W_HC_ATTN_FN);
    hc_params(c, "ffn", DSV4_W_HC_FFN_FN);

    /* MoE, spec §2.6 */
    CLS(DSV4_CLASS_ROUTER);
    vec(c, "ffn_norm.weight", DSV4_DT_BF16, dim, DSV4_W_FFN_NORM);
    mat(c, "ffn.gate.weight", DSV4_DT_BF16, cfg->n_routed, dim, DSV4_W_GATE);
    if (dsv4_config_is_hash(cfg, L))
        emit(c, "ffn.gate.tid2eid", DSV4_DT_I64, 2, cfg->vocab_size, cfg->n_active, DSV4_W_TID2EID, DSV4_PART_DATA,
             DSV4_WF_I64, cfg->vocab_size, cfg->n_active);
    else
        vec(c, "ffn.gate.bias", DSV4_DT_F32, cfg->n_routed, DSV4_W_GATE_BIAS);
    int64_t inter = cfg->moe_inter;
    if (cfg->n_shared > 0) {
        CLS(DSV4_CLASS_SHARED);
        int64_t sw = (int64_t)cfg->n_shared * inter;
        linear(c, "ffn.shared_experts.w1", lf, sw, dim, DSV4_W_SH_W1);
        linear(c, "ffn.shared_experts.w2", lf, dim, sw, DSV4_W_SH_W2);
        linear(c, "ffn.shared_experts.w3", lf, sw, dim, DSV4_W_SH_W3);
    }
    CLS(DSV4_CLASS_ROUTED);
    for (int e = 0; e < cfg->n_routed && !c->rc; e++) {
        char b[64];
        c->expert = e;
        snprintf(b, sizeof b, "ffn.experts.%d.w1", e);
        linear(c, b, ef, inter, dim, DSV4_W_EXP_W1);
        snprintf(b, sizeof b, "ffn.experts.%d.w2", e);
        linear(c, b, ef, dim, inter, DSV4_W_EXP_W2);
        snprintf(b, sizeof b, "ffn.experts.%d.w3", e);
        linear(c, b, ef, inter, dim, DSV4_W_EXP_W3);
    }
    c->expert = -1;
#undef CLS
}

int dsv4_inventory(const dsv4_config *cfg, dsv4_inv_fn fn, void *user) {
    inv_ctx c;
    memset(&c, 0, sizeof c);
    c.cfg = cfg;
    c.fn = fn;
    c.user = user;
    c.layer = -1;
    c.expert = -1;
    c.cls = DSV4_CLASS_EMBED_HEAD;
    mat(&c, "embed.weight", DSV4_DT_BF16, cfg->vocab_size, cfg->dim, DSV4_W_EMBED);
    mat(&c, "head.weight", DSV4_DT_BF16, cfg->vocab_size, cfg->dim, DSV4_W_HEAD);
    vec(&c, "norm.weight", DSV4_DT_BF16, cfg->dim, DSV4_W_NORM);
    mat(&c, "hc_head_fn", DSV4_DT_F32, cfg->hc_mult, (int64_t)cfg->hc_mult * cfg->dim, DSV4_W_HC_HEAD_FN);
    vec(&c, "hc_head_base", DSV4_DT_F32, cfg->hc_mult, DSV4_W_HC_HEAD_BASE);
    vec(&c, "hc_head_scale", DSV4_DT_F32, 1, DSV4_W_HC_HEAD_SCALE);
    int total = dsv4_config_total_layers(cfg);
    if (total > DSV4_MAX_LAYERS) total = DSV4_MAX_LAYERS;
    for (int L = 0; L < total && !c.rc; L++) layer(&c, L);
    return c.rc;
}

typedef struct {
    dsv4_inv_entry *v;
    int64_t n, cap;
} inv_vec;

static int inv_push(const dsv4_inv_entry *e, void *user) {
    inv_vec *iv = user;
    if (iv->n == iv->cap) {
        int64_t cap = iv->cap ? iv->cap * 2 : 4096;
        dsv4_inv_entry *v = realloc(iv->v, (size_t)cap * sizeof *v);
        if (!v) return -1;
        iv->v = v;
        iv->cap = cap;
    }
    iv->v[iv->n++] = *e;
    return 0;
}

int dsv4_inventory_list(const dsv4_config *cfg, dsv4_inv_entry **out, int64_t *n, dsv4_err *err) {
    inv_vec iv = {0};
    *out = NULL;
    *n = 0;
    if (dsv4_inventory(cfg, inv_push, &iv)) {
        free(iv.v);
        return dsv4_errf(err, "inventory: out of memory after %" PRId64 " tensors", iv.n);
    }
    *out = iv.v;
    *n = iv.n;
    return 0;
}

/* ----- dequantization of one row (the CPU matmul's inner loop) ----- */
void dsv4_weight_row(const dsv4_weight *w, int64_t r, float *out) {
    switch (w->fmt) {
    case DSV4_WF_F32: dsv4_dequant_f32_row(w->data, r, w->cols, out); break;
    case DSV4_WF_BF16: dsv4_dequant_bf16_row(w->data, r, w->cols, out); break;
    case DSV4_WF_FP8:
        dsv4_dequant_fp8_row(w->data, w->scale_f32 ? NULL : w->scale, w->scale_f32 ? w->scale : NULL, r, w->cols,
                             w->block, out);
        break;
    case DSV4_WF_MXFP4: dsv4_dequant_mxfp4_row(w->data, w->scale, r, w->cols, out); break;
    case DSV4_WF_NVFP4: dsv4_dequant_nvfp4_row(w->data, w->scale, w->scale2, r, w->cols, out); break;
    case DSV4_WF_I32:
        for (int64_t c = 0; c < w->cols; c++) out[c] = (float)((const int32_t *)w->data)[r * w->cols + c];
        break;
    case DSV4_WF_I64:
        for (int64_t c = 0; c < w->cols; c++) out[c] = (float)((const int64_t *)w->data)[r * w->cols + c];
        break;
    case DSV4_WF_NONE: memset(out, 0, (size_t)w->cols * sizeof *out); break;
    }
}

size_t dsv4_weight_bytes(const dsv4_weight *w) {
    size_t rows = (size_t)w->rows, cols = (size_t)w->cols, B = w->block > 0 ? (size_t)w->block : 128;
    switch (w->fmt) {
    case DSV4_WF_F32: return rows * cols * 4;
    case DSV4_WF_BF16: return rows * cols * 2;
    case DSV4_WF_FP8:
        return rows * cols + ((rows + B - 1) / B) * ((cols + B - 1) / B) * (w->scale_f32 ? 4 : 1);
    case DSV4_WF_MXFP4: return rows * ((cols + 1) / 2) + rows * ((cols + 31) / 32);
    case DSV4_WF_NVFP4: return rows * ((cols + 1) / 2) + rows * ((cols + 15) / 16) + 8;
    case DSV4_WF_I32: return rows * cols * 4;
    case DSV4_WF_I64: return rows * cols * 8;
    case DSV4_WF_NONE: return 0;
    }
    return 0;
}

/* ----- binding ----- */
static dsv4_weight *global_slot(dsv4_model_w *m, int role) {
    switch (role) {
    case DSV4_W_EMBED: return &m->embed;
    case DSV4_W_HEAD: return &m->head;
    case DSV4_W_NORM: return &m->norm;
    case DSV4_W_HC_HEAD_FN: return &m->hc_head_fn;
    case DSV4_W_HC_HEAD_BASE: return &m->hc_head_base;
    case DSV4_W_HC_HEAD_SCALE: return &m->hc_head_scale;
    }
    return NULL;
}

static dsv4_weight *layer_slot(dsv4_layer_w *l, int role, int expert) {
    switch (role) {
    case DSV4_W_ATTN_NORM: return &l->attn_norm;
    case DSV4_W_FFN_NORM: return &l->ffn_norm;
    case DSV4_W_HC_ATTN_FN: return &l->hc_attn_fn;
    case DSV4_W_HC_ATTN_BASE: return &l->hc_attn_base;
    case DSV4_W_HC_ATTN_SCALE: return &l->hc_attn_scale;
    case DSV4_W_HC_FFN_FN: return &l->hc_ffn_fn;
    case DSV4_W_HC_FFN_BASE: return &l->hc_ffn_base;
    case DSV4_W_HC_FFN_SCALE: return &l->hc_ffn_scale;
    case DSV4_W_WQ_A: return &l->wq_a;
    case DSV4_W_Q_NORM: return &l->q_norm;
    case DSV4_W_WQ_B: return &l->wq_b;
    case DSV4_W_WKV: return &l->wkv;
    case DSV4_W_KV_NORM: return &l->kv_norm;
    case DSV4_W_WO_A: return &l->wo_a;
    case DSV4_W_WO_B: return &l->wo_b;
    case DSV4_W_ATTN_SINK: return &l->attn_sink;
    case DSV4_W_COMP_WKV: return &l->comp.wkv;
    case DSV4_W_COMP_WGATE: return &l->comp.wgate;
    case DSV4_W_COMP_APE: return &l->comp.ape;
    case DSV4_W_COMP_NORM: return &l->comp.norm;
    case DSV4_W_IDX_WQ_B: return &l->idx.wq_b;
    case DSV4_W_IDX_WPROJ: return &l->idx.weights_proj;
    case DSV4_W_IDX_COMP_WKV: return &l->idx.comp.wkv;
    case DSV4_W_IDX_COMP_WGATE: return &l->idx.comp.wgate;
    case DSV4_W_IDX_COMP_APE: return &l->idx.comp.ape;
    case DSV4_W_IDX_COMP_NORM: return &l->idx.comp.norm;
    case DSV4_W_GATE: return &l->gate;
    case DSV4_W_GATE_BIAS: return &l->gate_bias;
    case DSV4_W_TID2EID: return &l->tid2eid;
    case DSV4_W_EXP_W1: return l->experts ? &l->experts[expert].w1 : NULL;
    case DSV4_W_EXP_W2: return l->experts ? &l->experts[expert].w2 : NULL;
    case DSV4_W_EXP_W3: return l->experts ? &l->experts[expert].w3 : NULL;
    case DSV4_W_SH_W1: return &l->shared.w1;
    case DSV4_W_SH_W2: return &l->shared.w2;
    case DSV4_W_SH_W3: return &l->shared.w3;
    case DSV4_W_E_PROJ: return &l->e_proj;
    case DSV4_W_H_PROJ: return &l->h_proj;
    case DSV4_W_ENORM: return &l->enorm;
    case DSV4_W_HNORM: return &l->hnorm;
    case DSV4_W_MTP_NORM: return &l->norm;
    case DSV4_W_MTP_HC_HEAD_FN: return &l->hc_head_fn;
    case DSV4_W_MTP_HC_HEAD_BASE: return &l->hc_head_base;
    case DSV4_W_MTP_HC_HEAD_SCALE: return &l->hc_head_scale;
    }
    return NULL;
}

/* Problems are collected as lines; the first BIND_LIST_MAX are kept verbatim. */
#define BIND_LIST_MAX 20
typedef struct {
    char *lines[BIND_LIST_MAX];
    int n;                    /* total problems */
    int missing, unexpected, mismatched, invalid;
} problems;

static void problem(problems *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void problem(problems *p, const char *fmt, ...) {
    if (p->n < BIND_LIST_MAX) {
        char buf[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(buf, sizeof buf, fmt, ap);
        va_end(ap);
        p->lines[p->n] = dsv4_xstrdup(buf);
    }
    p->n++;
}

static void problems_free(problems *p) {
    for (int i = 0; i < p->n && i < BIND_LIST_MAX; i++) free(p->lines[i]);
}

/* "F8_E4M3 [512,4096]" */
static void fmt_type(char *buf, size_t cap, dsv4_dtype dt, int ndim, const int64_t *shape) {
    size_t o = (size_t)snprintf(buf, cap, "%s [", dsv4_dtype_name(dt));
    for (int i = 0; i < ndim && o < cap; i++) o += (size_t)snprintf(buf + o, cap - o, i ? ",%" PRId64 : "%" PRId64, shape[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

static int shape_matches(const dsv4_inv_entry *e, const dsv4_tensor *t) {
    if (e->ndim == 0) /* NVFP4 scalars: shape [] (accept [1] too: same single value) */
        return t->ndim == 0 || (t->ndim == 1 && t->shape[0] == 1);
    if (t->ndim != e->ndim) return 0;
    for (int i = 0; i < e->ndim; i++)
        if (t->shape[i] != e->shape[i]) return 0;
    return 1;
}

/* Open-addressing string set over inventory names, to find unexpected tensors. */
static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static int name_in_inventory(const dsv4_inv_entry *inv, const int64_t *table, uint64_t mask, const char *name) {
    for (uint64_t i = name_hash(name) & mask;; i = (i + 1) & mask) {
        if (table[i] < 0) return 0;
        if (!strcmp(inv[table[i]].name, name)) return 1;
    }
}

static void check_unexpected(const dsv4_inv_entry *inv, int64_t n_inv, const dsv4_st *st, problems *p) {
    uint64_t cap = 1;
    while (cap < (uint64_t)n_inv * 2 + 2) cap <<= 1;
    int64_t *table = malloc(cap * sizeof *table);
    if (!table) {
        problem(p, "out of memory checking for unexpected tensors");
        return;
    }
    memset(table, 0xff, cap * sizeof *table);
    for (int64_t i = 0; i < n_inv; i++) {
        uint64_t h = name_hash(inv[i].name) & (cap - 1);
        while (table[h] >= 0) h = (h + 1) & (cap - 1);
        table[h] = i;
    }
    int n = dsv4_st_count(st);
    for (int i = 0; i < n; i++) {
        const dsv4_tensor *t = dsv4_st_at(st, i);
        if (!name_in_inventory(inv, table, cap - 1, t->name)) {
            char ty[96];
            fmt_type(ty, sizeof ty, t->dtype, t->ndim, t->shape);
            problem(p, "%s: unexpected tensor (%s), not part of this config", t->name, ty);
            p->unexpected++;
        }
    }
    free(table);
}

static void bind_one(dsv4_model_w *m, const dsv4_config *cfg, const dsv4_inv_entry *e, const dsv4_tensor *t,
                     problems *p) {
    dsv4_weight *w = e->layer < 0 ? global_slot(m, e->role) : layer_slot(&m->layers[e->layer], e->role, e->expert);
    if (!w) return; /* internal invariant: every role has a slot */
    switch (e->part) {
    case DSV4_PART_DATA:
        w->fmt = e->fmt;
        if (e->role == DSV4_W_TID2EID) w->fmt = t->dtype == DSV4_DT_I32 ? DSV4_WF_I32 : DSV4_WF_I64;
        w->rows = e->rows;
        w->cols = e->cols;
        w->data = t->data;
        w->name = t->name;
        if (e->fmt == DSV4_WF_FP8) w->block = cfg->quant_block;
        break;
    case DSV4_PART_SCALE:
        w->scale = t->data;
        w->scale_f32 = t->dtype == DSV4_DT_F32 && e->fmt == DSV4_WF_FP8;
        if (e->fmt == DSV4_WF_FP8) w->block = cfg->quant_block;
        break;
    case DSV4_PART_SCALE2:
    case DSV4_PART_INPUT_SCALE: {
        float v;
        memcpy(&v, t->data, sizeof v);
        if (!isfinite(v) || (e->part == DSV4_PART_SCALE2 && v <= 0)) {
            problem(p, "%s: scalar scale %g is not a positive finite number", e->name, (double)v);
            p->invalid++;
        }
        if (e->part == DSV4_PART_SCALE2)
            w->scale2 = v;
        else
            w->input_scale = v;
        break;
    }
    }
}

/* tid2eid indexes the expert array: out-of-range ids would be wild reads later. */
static void check_tid2eid(const dsv4_model_w *m, problems *p) {
    for (int L = 0; L < m->n_layers; L++) {
        const dsv4_weight *w = &m->layers[L].tid2eid;
        if (!w->data) continue;
        int64_t n = w->rows * w->cols;
        for (int64_t i = 0; i < n; i++) {
            int64_t v = w->fmt == DSV4_WF_I32 ? ((const int32_t *)w->data)[i] : ((const int64_t *)w->data)[i];
            if (v < 0 || v >= m->cfg.n_routed) {
                problem(p, "%s: expert id %" PRId64 " at [%" PRId64 ",%" PRId64 "] is outside [0,%d)", w->name, v,
                        i / w->cols, i % w->cols, m->cfg.n_routed);
                p->invalid++;
                break;
            }
        }
    }
}

static char *problems_report(const problems *p) {
    size_t cap = 256;
    for (int i = 0; i < p->n && i < BIND_LIST_MAX; i++) cap += strlen(p->lines[i]) + 1;
    char *s = malloc(cap);
    if (!s) return NULL;
    size_t o = 0;
    s[0] = 0;
    for (int i = 0; i < p->n && i < BIND_LIST_MAX; i++) o += (size_t)snprintf(s + o, cap - o, "%s\n", p->lines[i]);
    if (p->n > BIND_LIST_MAX) snprintf(s + o, cap - o, "... and %d more\n", p->n - BIND_LIST_MAX);
    return s;
}

static void problems_summary(const problems *p, dsv4_err *err) {
    if (!err) return;
    char *s = err->msg;
    size_t cap = sizeof err->msg;
    size_t o = (size_t)snprintf(s, cap, "%d problem%s binding weights (%d missing, %d unexpected, %d mismatched, %d invalid)",
                                p->n, p->n == 1 ? "" : "s", p->missing, p->unexpected, p->mismatched, p->invalid);
    int shown = 0;
    for (int i = 0; i < p->n && i < BIND_LIST_MAX; i++) {
        size_t l = strlen(p->lines[i]);
        if (o + l + 2 + 24 >= cap) break; /* keep room for "; ... and N more" */
        o += (size_t)snprintf(s + o, cap - o, "%s%s", i ? "; " : ": ", p->lines[i]);
        shown++;
    }
    if (shown < p->n) snprintf(s + o, cap - o, "; ... and %d more", p->n - shown);
}

int dsv4_weights_bind_report(dsv4_model_w *m, const dsv4_config *cfg, const dsv4_st *st, char **report,
                             dsv4_err *err) {
    memset(m, 0, sizeof *m);
    if (report) *report = NULL;
    dsv4_inv_entry *inv;
    int64_t n_inv;
    if (dsv4_inventory_list(cfg, &inv, &n_inv, err)) return -1;

    m->cfg = *cfg;
    m->n_layers = dsv4_config_total_layers(cfg);
    m->layers = dsv4_xcalloc((size_t)m->n_layers, sizeof *m->layers);
    for (int L = 0; L < m->n_layers; L++) {
        dsv4_layer_w *l = &m->layers[L];
        l->id = L;
        l->ratio = cfg->compress_ratio[L];
        l->is_hash = dsv4_config_is_hash(cfg, L);
        l->is_mtp = L >= cfg->n_layers;
        l->has_comp = l->ratio != 0;
        l->has_indexer = l->ratio == 4;
        if (l->has_comp) {
            l->comp.ratio = l->ratio;
            l->comp.coff = l->ratio == 4 ? 2 : 1;
            l->comp.dim = cfg->head_dim;
        }
        if (l->has_indexer) {
            l->idx.comp.ratio = l->ratio;
            l->idx.comp.coff = 2;
            l->idx.comp.dim = cfg->index_head_dim;
        }
        if (cfg->n_routed > 0) l->experts = dsv4_xcalloc((size_t)cfg->n_routed, sizeof *l->experts);
    }

    problems p;
    memset(&p, 0, sizeof p);
    int64_t found = 0;
    for (int64_t i = 0; i < n_inv; i++) {
        const dsv4_inv_entry *e = &inv[i];
        const dsv4_tensor *t = dsv4_st_find(st, e->name);
        char want[96], got[96];
        if (!t) {
            fmt_type(want, sizeof want, e->dtype, e->ndim, e->shape);
            problem(&p, "%s: missing (expected %s)", e->name, want);
            p.missing++;
            continue;
        }
        found++;
        int dt_ok = t->dtype == e->dtype || (e->role == DSV4_W_TID2EID && t->dtype == DSV4_DT_I32);
        if (!dt_ok || !shape_matches(e, t)) {
            fmt_type(want, sizeof want, e->role == DSV4_W_TID2EID && t->dtype == DSV4_DT_I32 ? DSV4_DT_I32 : e->dtype,
                     e->ndim, e->shape);
            fmt_type(got, sizeof got, t->dtype, t->ndim, t->shape);
            problem(&p, "%s: expected %s, found %s", e->name, want, got);
            p.mismatched++;
            continue;
        }
        bind_one(m, cfg, e, t, &p);
    }
    if (found < dsv4_st_count(st)) check_unexpected(inv, n_inv, st, &p);
    if (p.n == 0) check_tid2eid(m, &p);
    free(inv);

    if (p.n) {
        problems_summary(&p, err);
        if (report) *report = problems_report(&p);
        problems_free(&p);
        dsv4_weights_free(m);
        return -1;
    }
    return 0;
}

int dsv4_weights_bind(dsv4_model_w *m, const dsv4_config *cfg, const dsv4_st *st, dsv4_err *err) {
    return dsv4_weights_bind_report(m, cfg, st, NULL, err);
}

void dsv4_weights_free(dsv4_model_w *m) {
    if (!m) return;
    if (m->layers)
        for (int L = 0; L < m->n_layers; L++) free(m->layers[L].experts);
    free(m->layers);
    memset(m, 0, sizeof *m);
}

/* ----- config vs tensors ----- */
/* Each check: a config key, its value, the tensor that reveals it, which dim. */
static int check_dim(const dsv4_st *st, const char *tensor, int dim_idx, int64_t want, int64_t mult, const char *key,
                     dsv4_err *err) {
    const dsv4_tensor *t = dsv4_st_find(st, tensor);
    if (!t || t->ndim <= dim_idx) return 0;
    int64_t got = t->shape[dim_idx];
    if (got == want * mult) return 0;
    char ty[96];
    fmt_type(ty, sizeof ty, t->dtype, t->ndim, t->shape);
    if (mult > 1 && got % mult == 0)
        return dsv4_errf(err, "%s = %" PRId64 " but %s is %s (implies %s = %" PRId64 ")", key, want, tensor, ty, key,
                         got / mult);
    if (mult > 1) return dsv4_errf(err, "%s = %" PRId64 " but %s is %s", key, want, tensor, ty);
    return dsv4_errf(err, "%s = %" PRId64 " but %s is %s (implies %s = %" PRId64 ")", key, want, tensor, ty, key, got);
}

/* Largest N+1 such that "<prefix>N.<anything>" is a tensor name. */
static int count_prefixed(const dsv4_st *st, const char *prefix) {
    size_t pl = strlen(prefix);
    int n = 0;
    for (int i = 0; i < dsv4_st_count(st); i++) {
        const char *s = dsv4_st_at(st, i)->name;
        if (strncmp(s, prefix, pl) || s[pl] < '0' || s[pl] > '9') continue;
        long v = strtol(s + pl, NULL, 10);
        if (v >= 0 && v < 100000 && v + 1 > n) n = (int)v + 1;
    }
    return n;
}

int dsv4_weights_check_config(const dsv4_config *cfg, const dsv4_st *st, dsv4_err *err) {
    if (check_dim(st, "embed.weight", 1, cfg->dim, 1, "hidden_size", err)) return -1;
    if (check_dim(st, "embed.weight", 0, cfg->vocab_size, 1, "vocab_size", err)) return -1;
    int nl = count_prefixed(st, "layers."), nm = count_prefixed(st, "mtp.");
    if (nl && nl != cfg->n_layers)
        return dsv4_errf(err, "num_hidden_layers = %d but the checkpoint has layers.0 .. layers.%d", cfg->n_layers,
                         nl - 1);
    if (nm != cfg->n_mtp) {
        if (nm == 0)
            return dsv4_errf(err, "num_nextn_predict_layers = %d but the checkpoint has no mtp.* tensors", cfg->n_mtp);
        return dsv4_errf(err, "num_nextn_predict_layers = %d but the checkpoint has mtp.0 .. mtp.%d", cfg->n_mtp,
                         nm - 1);
    }
    if (check_dim(st, "layers.0.attn.wq_a.weight", 0, cfg->q_lora_rank, 1, "q_lora_rank", err)) return -1;
    if (check_dim(st, "layers.0.attn.kv_norm.weight", 0, cfg->head_dim, 1, "head_dim", err)) return -1;
    if (check_dim(st, "layers.0.attn.attn_sink", 0, cfg->n_heads, 1, "num_attention_heads", err)) return -1;
    if (check_dim(st, "layers.0.ffn.gate.weight", 0, cfg->n_routed, 1, "n_routed_experts", err)) return -1;
    if (check_dim(st, "layers.0.attn.wo_b.weight", 1, cfg->o_lora_rank, cfg->o_groups, "o_lora_rank", err)) return -1;
    if (check_dim(st, "layers.0.ffn.experts.0.w1.weight", 0, cfg->moe_inter, 1, "moe_intermediate_size", err))
        return -1;
    if (check_dim(st, "layers.0.hc_attn_base", 0, (int64_t)(2 + cfg->hc_mult) * cfg->hc_mult, 1, "hc_mult (as (2+hc)*hc)",
                  err))
        return -1;
    int ne = count_prefixed(st, "layers.0.ffn.experts.");
    if (ne && ne != cfg->n_routed)
        return dsv4_errf(err, "n_routed_experts = %d but layers.0 has experts 0 .. %d", cfg->n_routed, ne - 1);
    for (int L = 0; L < cfg->n_layers; L++) {
        char n[96];
        snprintf(n, sizeof n, "layers.%d.attn.compressor.ape", L);
        const dsv4_tensor *t = dsv4_st_find(st, n);
        int r = cfg->compress_ratio[L];
        if (!t && r != 0 && count_prefixed(st, "layers.") > L)
            return dsv4_errf(err, "compress_ratios[%d] = %d but layers.%d has no attn.compressor", L, r, L);
        if (t && t->ndim == 2 && t->shape[0] != r)
            return dsv4_errf(err, "compress_ratios[%d] = %d but %s has %" PRId64 " rows (ratio %" PRId64 ")", L, r, n,
                             t->shape[0], t->shape[0]);
        snprintf(n, sizeof n, "layers.%d.ffn.gate.tid2eid", L);
        int has_hash = dsv4_st_find(st, n) != NULL;
        if (has_hash != dsv4_config_is_hash(cfg, L))
            return dsv4_errf(err, "num_hash_layers = %d but layers.%d %s ffn.gate.tid2eid", cfg->n_hash_layers, L,
                             has_hash ? "has" : "lacks");
    }
    return 0;
}
