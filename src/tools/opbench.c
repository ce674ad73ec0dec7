/* tools/opbench: `dsv4 opbench` -- each weight-reading decode op of one layer, timed alone.
 *
 * A backend diagnostic (like tests/test_cuda_ops.c it drives the backend table directly,
 * so unlike the other tools it sees weights and backend memory, not the engine API):
 * opens the checkpoint, loads its weights to the backend, and for one layer times every
 * op a decode step runs on weights (the matmuls, the grouped wo_a, mHC pre/post/head,
 * rmsnorm, rope) with R rows of random inputs in backend memory, plus plain copies of a
 * large buffer as the bandwidth reference.  Each op: 3 warm-up calls, a check (which
 * waits for the device), then N calls back to back with no wait between them, timed by
 * the host around a final check.  The figure is the per-call device time plus the launch
 * cost as it is amortized in a real stream; nothing else runs meanwhile, so the caches
 * hold only what these calls leave there (the weights of a single op can stay in L2
 * across calls when they are smaller than it: 50 MB on the H200 -- the bytes column
 * says which ops that concerns).
 * --flush-mb M adds a "cold" figure: each call follows a matmul that streams an M MB bf16
 * weight (which evicts the op's weights from the cache), and the op's time is the time of
 * the pairs minus that of the flush matmuls alone -- what the op costs when its weights
 * come from memory, as in a decode step that streams a whole layer.
 * The op flags follow the numerics profile (--numerics, default exact) exactly as
 * model/forward.c passes them.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "model/config.h"
#include "model/numerics.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "tools/commands.h"
#include "util/err.h"

static void usage(FILE *f) {
    fprintf(f, "usage: dsv4 opbench --model DIR [--backend cpu|cuda|auto] [--layer L] [--rows R] [--reps N]\n"
               "                    [--copy-mb M] [--flush-mb M] [--numerics exact|reference] [--threads N]\n"
               "Times each weight-reading op of one decode layer on a backend: every matmul of layer L\n"
               "(default: the first layer with an indexer, else 0) and the head, the grouped wo_a,\n"
               "hc_pre, hc_post, hc_head, rmsnorm, rope and the MoE (n_active distinct experts per row\n"
               "plus the shared one), with R rows (default 1) of random inputs.\n"
               "Per op: 3 warm-up calls, then N (default 100) calls back to back, timed around one\n"
               "final wait for the backend.  Prints us per call, bytes per call (weights; activations\n"
               "read + written), GB/s and the fraction of a copy of M MB (default 256) timed the same\n"
               "way.  --flush-mb M adds a cold figure: each call after a matmul streaming M MB (its\n"
               "time subtracted), so the op's weights come from memory, not the cache.\n"
               "Exit status: 0 ok, 1 failure (model, layer, backend), 2 bad options.\n");
}

static int parse_int(const char *s, int lo, int hi, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

/* ----- the ops, as closures over one argument block ----- */
typedef struct bench_ctx {
    dsv4_backend *be;
    const dsv4_config *c;
    const dsv4_numerics *nm;
    const dsv4_layer_w *L;
    const dsv4_model_w *w;
    int rows;
    float *in, *out;        /* backend memory: inputs [rows, max in], outputs [rows, max out] */
    float *X, *Xo, *y, *post, *comb; /* mHC buffers */
    float *q;               /* rope target [rows, n_heads*head_dim] */
    void *cpa, *cpb;        /* copy reference */
    size_t cp_bytes;
    int64_t *pos;
    double *freq;
    int32_t *eid;           /* moe: expert ids [rows, n_active] (backend memory), distinct per row */
    float *ewt;             /* moe: routing weights [rows, n_active] */
    dsv4_weight flush;      /* bf16 [rows, dim], host zeros (uploaded on first use); rows 0 = no cold run */
    float *flush_out;
} bench_ctx;

typedef struct bench_op {
    const char *name;
    int kind; /* OP_* */
    const dsv4_weight *wt;
    int a8, obf;             /* matmul flags */
} bench_op;

enum { OP_COPY, OP_MATMUL, OP_GROUPED, OP_HC_PRE, OP_HC_POST, OP_HC_HEAD, OP_RMSNORM, OP_ROPE, OP_MOE };

static void run_op(const bench_ctx *x, const bench_op *o) {
    const dsv4_backend_ops *op = x->be->ops;
    const dsv4_config *c = x->c;
    const dsv4_numerics *nm = x->nm;
    int R = x->rows, bf = nm->act_bf16;
    float eps = (float)c->norm_eps, heps = (float)c->hc_eps;
    switch (o->kind) {
    case OP_COPY: op->copy(x->be, x->cpb, x->cpa, x->cp_bytes); break;
    case OP_MATMUL: op->matmul(x->be, x->out, x->in, R, o->wt, o->a8, o->obf); break;
    case OP_GROUPED: op->matmul_grouped(x->be, x->out, x->in, R, o->wt, c->o_groups, bf, bf, 0); break;
    case OP_HC_PRE:
        op->hc_pre(x->be, x->y, x->post, x->comb, x->X, R, c->hc_mult, c->dim, &x->L->hc_attn_fn,
                   &x->L->hc_attn_base, &x->L->hc_attn_scale, c->hc_sinkhorn_iters, eps, heps, nm->mhc_gemm_bf16, bf);
        break;
    case OP_HC_POST:
        op->hc_post(x->be, x->Xo, x->y, x->X, x->post, x->comb, R, c->hc_mult, c->dim, nm->hc_state_bf16);
        break;
    case OP_HC_HEAD:
        op->hc_head(x->be, x->y, x->X, R, c->hc_mult, c->dim, &x->w->hc_head_fn, &x->w->hc_head_base,
                    &x->w->hc_head_scale, eps, heps, nm->mhc_gemm_bf16, bf);
        break;
    case OP_RMSNORM: op->rmsnorm(x->be, x->out, x->in, R, c->dim, &x->L->attn_norm, eps, bf); break;
    case OP_ROPE: op->rope(x->be, x->q, R, c->n_heads, c->head_dim, c->rope_dim, x->pos, x->freq, 0, bf); break;
    case OP_MOE: /* the routed scale at the output (where it applies does not change the work) */
        op->moe(x->be, x->out, x->in, R, x->L->experts, c->n_routed, x->eid, x->ewt, c->n_active,
                c->n_shared > 0 ? &x->L->shared : NULL, (float)c->swiglu_limit, nm->moe_before_w2,
                nm->linear_act_fp8, bf, (float)c->routed_scale);
        break;
    }
}

static const char *fmt_name(int fmt) {
    switch (fmt) {
    case DSV4_WF_F32: return "f32";
    case DSV4_WF_BF16: return "bf16";
    case DSV4_WF_FP8: return "fp8";
    case DSV4_WF_MXFP4: return "mxfp4";
    case DSV4_WF_NVFP4: return "nvfp4";
    default: return "?";
    }
}

/* shape text, weight bytes and activation bytes (read + written) of one call */
static void describe(const bench_ctx *x, const bench_op *o, char *shape, size_t n, double *wb, double *ab) {
    const dsv4_config *c = x->c;
    double R = x->rows, f = sizeof(float), hcd = (double)c->hc_mult * c->dim;
    *wb = *ab = 0;
    switch (o->kind) {
    case OP_COPY:
        snprintf(shape, n, "%zu MB, read + written", x->cp_bytes >> 20);
        *ab = 2.0 * (double)x->cp_bytes;
        break;
    case OP_MATMUL:
    case OP_GROUPED:
        if (o->kind == OP_GROUPED)
            snprintf(shape, n, "%s %d x [%lld x %lld]", fmt_name(o->wt->fmt), c->o_groups,
                     (long long)(o->wt->rows / c->o_groups), (long long)o->wt->cols);
        else
            snprintf(shape, n, "%s [%lld x %lld]", fmt_name(o->wt->fmt), (long long)o->wt->rows,
                     (long long)o->wt->cols);
        *wb = (double)dsv4_weight_bytes(o->wt);
        *ab = R * f * (double)(o->wt->rows + o->wt->cols * (o->kind == OP_GROUPED ? c->o_groups : 1));
        break;
    case OP_HC_PRE:
    case OP_HC_HEAD: {
        const dsv4_weight *fn = o->kind == OP_HC_PRE ? &x->L->hc_attn_fn : &x->w->hc_head_fn;
        snprintf(shape, n, "%s [%lld x %lld] hc %d", fmt_name(fn->fmt), (long long)fn->rows, (long long)fn->cols,
                 c->hc_mult);
        *wb = (double)dsv4_weight_bytes(fn);
        *ab = R * f * (hcd + c->dim + (o->kind == OP_HC_PRE ? c->hc_mult * (1.0 + c->hc_mult) : 0));
        break;
    }
    case OP_HC_POST:
        snprintf(shape, n, "hc %d x dim %d", c->hc_mult, c->dim);
        *ab = R * f * (2 * hcd + c->dim + c->hc_mult * (1.0 + c->hc_mult));
        break;
    case OP_RMSNORM:
        snprintf(shape, n, "dim %d", c->dim);
        *wb = (double)dsv4_weight_bytes(&x->L->attn_norm);
        *ab = R * f * 2.0 * c->dim;
        break;
    case OP_ROPE:
        snprintf(shape, n, "%d heads x %d, rope %d", c->n_heads, c->head_dim, c->rope_dim);
        *ab = R * f * 2.0 * c->n_heads * c->rope_dim;
        break;
    case OP_MOE: { /* every row routed to n_active distinct experts (different rows: different ones) */
        const dsv4_ffn_w *e0 = &x->L->experts[0];
        double eb = (double)(dsv4_weight_bytes(&e0->w1) + dsv4_weight_bytes(&e0->w2) + dsv4_weight_bytes(&e0->w3));
        int distinct = (int)R * c->n_active < c->n_routed ? (int)R * c->n_active : c->n_routed;
        snprintf(shape, n, "%s %d of %d + shared", fmt_name(e0->w1.fmt), c->n_active, c->n_routed);
        *wb = eb * distinct;
        if (c->n_shared > 0)
            *wb += (double)(dsv4_weight_bytes(&x->L->shared.w1) + dsv4_weight_bytes(&x->L->shared.w2) +
                            dsv4_weight_bytes(&x->L->shared.w3));
        *ab = R * f * 2.0 * c->dim;
        break;
    }
    }
}

static void run_flush(const bench_ctx *x) {
    x->be->ops->matmul(x->be, x->flush_out, x->in, 1, &x->flush, 0, 0);
}

/* us per call: warm-up, wait, N calls, wait.  flush: each call after a flush matmul (o NULL:
 * the flush alone) */
static int time_op(const bench_ctx *x, const bench_op *o, int flush, int reps, double *us, dsv4_err *err) {
    const dsv4_backend_ops *op = x->be->ops;
    for (int i = 0; i < 3; i++) {
        if (flush) run_flush(x);
        if (o) run_op(x, o);
    }
    if (op->check && op->check(x->be, err)) return -1;
    double t0 = dsv4_now();
    for (int i = 0; i < reps; i++) {
        if (flush) run_flush(x);
        if (o) run_op(x, o);
    }
    if (op->check && op->check(x->be, err)) return -1;
    *us = (dsv4_now() - t0) * 1e6 / reps;
    return 0;
}

/* backend buffer of n floats filled with uniform values in [-s, s) */
static float *rand_buf(dsv4_backend *be, size_t n, float s, uint32_t *rng, dsv4_err *err) {
    float *h = malloc(sizeof(float) * (n ? n : 1));
    float *d = be->ops->alloc(be, sizeof(float) * (n ? n : 1));
    if (!h || !d) {
        free(h);
        if (d) be->ops->free(be, d);
        dsv4_errf(err, "out of memory for %zu floats", n);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        *rng = *rng * 1664525u + 1013904223u;
        h[i] = ((*rng >> 8) / 16777216.0f * 2.0f - 1.0f) * s;
    }
    be->ops->upload(be, d, h, sizeof(float) * n);
    free(h);
    return d;
}

static int has(const dsv4_weight *w) { return w->data != NULL && w->rows > 0 && w->cols > 0; }

int dsv4_cmd_opbench(int argc, char **argv) {
    const char *model = NULL, *backend = "auto", *numerics = NULL;
    int layer = -1, rows = 1, reps = 100, copy_mb = 256, flush_mb = 0, threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        const char **sdst = NULL;
        int *idst = NULL, lo = 0, hi = 0;
        if (!strcmp(a, "--model")) sdst = &model;
        else if (!strcmp(a, "--backend")) sdst = &backend;
        else if (!strcmp(a, "--numerics")) sdst = &numerics;
        else if (!strcmp(a, "--layer")) idst = &layer, lo = 0, hi = DSV4_MAX_LAYERS;
        else if (!strcmp(a, "--rows")) idst = &rows, lo = 1, hi = 1024;
        else if (!strcmp(a, "--reps")) idst = &reps, lo = 1, hi = 1000000;
        else if (!strcmp(a, "--copy-mb")) idst = &copy_mb, lo = 1, hi = 65536;
        else if (!strcmp(a, "--flush-mb")) idst = &flush_mb, lo = 0, hi = 65536;
        else if (!strcmp(a, "--threads")) idst = &threads, lo = 0, hi = 4096;
        else {
            fprintf(stderr, "dsv4 opbench: unknown option %s (see --help)\n", a);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "dsv4 opbench: %s needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (sdst) *sdst = v;
        else if (parse_int(v, lo, hi, idst)) {
            fprintf(stderr, "dsv4 opbench: %s: '%s' is not a whole number in [%d, %d]\n", a + 2, v, lo, hi);
            return 2;
        }
    }
    if (!model) {
        fprintf(stderr, "dsv4 opbench: --model DIR is required (see --help)\n");
        return 2;
    }
    int want_cuda;
    if (!strcmp(backend, "cuda")) want_cuda = 1;
    else if (!strcmp(backend, "cpu")) want_cuda = 0;
    else if (!strcmp(backend, "auto")) want_cuda = dsv4_backend_cuda_available();
    else {
        fprintf(stderr, "dsv4 opbench: unknown backend '%s' (expected cpu, cuda or auto)\n", backend);
        return 2;
    }

    dsv4_err err = {{0}};
    dsv4_config cfg;
    dsv4_numerics nm;
    dsv4_st *st = NULL;
    dsv4_model_w w;
    int w_bound = 0, be_init = 0, rc = 1;
    dsv4_backend be;
    bench_ctx x;
    memset(&x, 0, sizeof x);
    memset(&be, 0, sizeof be);
    char cfgp[4200];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", model);
    if (dsv4_numerics_profile(&nm, numerics, &err)) goto done;
    if (dsv4_config_load(&cfg, cfgp, &err) || dsv4_st_open(&st, model, &err)) goto done;
    if (dsv4_weights_bind(&w, &cfg, st, &err)) {
        dsv4_err_prefix(&err, "%s", model);
        goto done;
    }
    w_bound = 1;
    int nl = dsv4_config_total_layers(&cfg);
    if (layer < 0) {
        layer = 0;
        for (int l = 0; l < cfg.n_layers; l++)
            if (w.layers[l].has_indexer) {
                layer = l;
                break;
            }
    } else if (layer >= nl) {
        dsv4_errf(&err, "--layer %d: the model has %d layers (0 .. %d)", layer, nl, nl - 1);
        goto done;
    }
    if (want_cuda ? dsv4_backend_cuda_init(&be, 0, &err) : dsv4_backend_cpu_init(&be, threads, &err)) goto done;
    be_init = 1;
    if (be.ops->load_weights && be.ops->load_weights(&be, &w, &err)) goto done;

    const dsv4_layer_w *L = &w.layers[layer];
    int bf = nm.act_bf16, a8 = nm.linear_act_fp8;
    bench_op ops[24];
    int n = 0;
    ops[n++] = (bench_op){"copy", OP_COPY, NULL, 0, 0};
    ops[n++] = (bench_op){"hc_pre attn", OP_HC_PRE, NULL, 0, 0};
    ops[n++] = (bench_op){"rmsnorm attn", OP_RMSNORM, NULL, 0, 0};
    ops[n++] = (bench_op){"matmul wq_a", OP_MATMUL, &L->wq_a, a8, bf};
    ops[n++] = (bench_op){"matmul wq_b", OP_MATMUL, &L->wq_b, a8, bf};
    ops[n++] = (bench_op){"rope q", OP_ROPE, NULL, 0, 0};
    ops[n++] = (bench_op){"matmul wkv", OP_MATMUL, &L->wkv, a8, bf};
    if (L->has_comp) {
        ops[n++] = (bench_op){"matmul comp.wkv", OP_MATMUL, &L->comp.wkv, 0, 0};
        ops[n++] = (bench_op){"matmul comp.wgate", OP_MATMUL, &L->comp.wgate, 0, 0};
    }
    if (L->has_indexer) {
        ops[n++] = (bench_op){"matmul idx.comp.wkv", OP_MATMUL, &L->idx.comp.wkv, 0, 0};
        ops[n++] = (bench_op){"matmul idx.comp.wgate", OP_MATMUL, &L->idx.comp.wgate, 0, 0};
        ops[n++] = (bench_op){"matmul idx.wq_b", OP_MATMUL, &L->idx.wq_b, a8, bf};
        ops[n++] = (bench_op){"matmul idx.weights_proj", OP_MATMUL, &L->idx.weights_proj, 0, bf};
    }
    ops[n++] = (bench_op){"matmul_grouped wo_a", OP_GROUPED, &L->wo_a, 0, 0};
    ops[n++] = (bench_op){"matmul wo_b", OP_MATMUL, &L->wo_b, a8, bf};
    ops[n++] = (bench_op){"hc_post", OP_HC_POST, NULL, 0, 0};
    ops[n++] = (bench_op){"matmul gate", OP_MATMUL, &L->gate, 0, 0};
    if (L->experts && cfg.n_active > 0 && cfg.n_active <= cfg.n_routed) ops[n++] = (bench_op){"moe", OP_MOE, NULL, 0, 0};
    ops[n++] = (bench_op){"hc_head", OP_HC_HEAD, NULL, 0, 0};
    ops[n++] = (bench_op){"matmul head", OP_MATMUL, &w.head, 0, 0};
    for (int i = 0; i < n; i++)
        if (ops[i].wt && !has(ops[i].wt)) {
            dsv4_errf(&err, "layer %d: weight of %s is missing", layer, ops[i].name);
            goto done;
        }

    /* buffers: the widest input and output over the ops, random inputs */
    size_t in_w = (size_t)cfg.dim, out_w = (size_t)cfg.dim;
    for (int i = 0; i < n; i++) {
        if (!ops[i].wt) continue;
        size_t iw = (size_t)ops[i].wt->cols * (ops[i].kind == OP_GROUPED ? (size_t)cfg.o_groups : 1);
        if (iw > in_w) in_w = iw;
        if ((size_t)ops[i].wt->rows > out_w) out_w = (size_t)ops[i].wt->rows;
    }
    size_t R = (size_t)rows, hcd = (size_t)cfg.hc_mult * cfg.dim, qn = (size_t)cfg.n_heads * cfg.head_dim;
    uint32_t rng = 12345;
    x = (bench_ctx){.be = &be, .c = &cfg, .nm = &nm, .L = L, .w = &w, .rows = rows};
    x.cp_bytes = (size_t)copy_mb << 20;
    if (!(x.in = rand_buf(&be, R * in_w, 1.0f, &rng, &err)) || !(x.out = rand_buf(&be, R * out_w, 0, &rng, &err)) ||
        !(x.X = rand_buf(&be, R * hcd, 1.0f, &rng, &err)) || !(x.Xo = rand_buf(&be, R * hcd, 0, &rng, &err)) ||
        !(x.y = rand_buf(&be, R * cfg.dim, 1.0f, &rng, &err)) ||
        !(x.post = rand_buf(&be, R * cfg.hc_mult, 1.0f, &rng, &err)) ||
        !(x.comb = rand_buf(&be, R * cfg.hc_mult * cfg.hc_mult, 0.5f, &rng, &err)) ||
        !(x.q = rand_buf(&be, R * qn, 1.0f, &rng, &err)))
        goto done;
    if (!(x.cpa = be.ops->alloc(&be, x.cp_bytes)) || !(x.cpb = be.ops->alloc(&be, x.cp_bytes))) {
        dsv4_errf(&err, "out of backend memory for two %d MB copy buffers", copy_mb);
        goto done;
    }
    x.pos = malloc(sizeof(int64_t) * R);
    x.freq = malloc(sizeof(double) * (size_t)(cfg.rope_dim / 2 + 1));
    if (!x.pos || !x.freq) {
        dsv4_errf(&err, "out of memory");
        goto done;
    }
    if (flush_mb) { /* bf16 [n, dim]: reads M MB, writes n floats */
        x.flush.fmt = DSV4_WF_BF16;
        x.flush.cols = cfg.dim;
        x.flush.rows = ((int64_t)flush_mb << 20) / (2 * (int64_t)cfg.dim);
        x.flush.name = "opbench.flush";
        if (x.flush.rows < 1) x.flush.rows = 1;
        if (!(x.flush.data = calloc((size_t)(x.flush.rows * x.flush.cols), 2)) ||
            !(x.flush_out = be.ops->alloc(&be, sizeof(float) * (size_t)x.flush.rows))) {
            dsv4_errf(&err, "out of memory for the %d MB flush weight", flush_mb);
            goto done;
        }
    }
    for (int r = 0; r < rows; r++) x.pos[r] = 1000 + r;
    { /* moe routing: row r takes experts (r*n_active + 37 j + 11) mod n_routed, j < n_active */
        size_t ne = R * (size_t)(cfg.n_active > 0 ? cfg.n_active : 1);
        int32_t *ids = malloc(sizeof(int32_t) * ne);
        float *wts = malloc(sizeof(float) * ne);
        if (!ids || !wts || !(x.eid = be.ops->alloc(&be, sizeof(int32_t) * ne)) ||
            !(x.ewt = be.ops->alloc(&be, sizeof(float) * ne))) {
            free(ids), free(wts);
            dsv4_errf(&err, "out of memory for the routing of %d rows", rows);
            goto done;
        }
        for (size_t i = 0; i < ne; i++) {
            size_t r = i / (size_t)cfg.n_active, j = i % (size_t)cfg.n_active;
            ids[i] = cfg.n_routed > 0 ? (int32_t)((r * (size_t)cfg.n_active + 37 * j + 11) % (size_t)cfg.n_routed) : 0;
            wts[i] = 1.0f / (float)cfg.n_active;
        }
        be.ops->upload(&be, x.eid, ids, sizeof(int32_t) * ne);
        be.ops->upload(&be, x.ewt, wts, sizeof(float) * ne);
        free(ids), free(wts);
    }
    for (int i = 0; i < cfg.rope_dim / 2; i++) x.freq[i] = pow(cfg.rope_theta, -2.0 * i / cfg.rope_dim);

    dsv4_backend_stats bs;
    memset(&bs, 0, sizeof bs);
    if (be.ops->stats) be.ops->stats(&be, &bs);
    printf("opbench: model %s, backend %s%s%s, layer %d (compress ratio %d), rows %d, %d calls per op after 3 "
           "warm-up, numerics %s\n",
           model, be.ops->name, bs.device[0] ? " " : "", bs.device, layer, L->ratio, rows, reps,
           numerics ? numerics : "exact");
    printf("%-24s %-30s %10s %10s %10s %9s %7s%s\n", "op", "shape", "us/call", "weight MB", "act MB", "GB/s", "%copy",
           flush_mb ? "   cold us   GB/s  %copy" : "");
    double copy_gbs = 0, flush_us = 0;
    if (flush_mb && time_op(&x, NULL, 1, reps, &flush_us, &err)) {
        dsv4_err_prefix(&err, "flush");
        goto done;
    }
    for (int i = 0; i < n; i++) {
        char shape[96];
        double wb, ab, us;
        describe(&x, &ops[i], shape, sizeof shape, &wb, &ab);
        if (time_op(&x, &ops[i], 0, reps, &us, &err)) {
            dsv4_err_prefix(&err, "%s", ops[i].name);
            goto done;
        }
        double gbs = (wb + ab) / (us * 1e-6) / 1e9;
        if (ops[i].kind == OP_COPY) copy_gbs = gbs;
        printf("%-24s %-30s %10.2f %10.3f %10.3f %9.1f %6.1f%%", ops[i].name, shape, us, wb / 1e6, ab / 1e6, gbs,
               copy_gbs > 0 ? 100.0 * gbs / copy_gbs : 0.0);
        if (flush_mb && ops[i].kind != OP_COPY) {
            double both;
            if (time_op(&x, &ops[i], 1, reps, &both, &err)) {
                dsv4_err_prefix(&err, "%s after flush", ops[i].name);
                goto done;
            }
            double cu = both - flush_us, cg = cu > 0 ? (wb + ab) / (cu * 1e-6) / 1e9 : 0;
            printf(" %10.2f %6.0f %5.1f%%", cu, cg, copy_gbs > 0 ? 100.0 * cg / copy_gbs : 0.0);
        }
        printf("\n");
    }
    rc = 0;
done:
    if (rc) fprintf(stderr, "dsv4 opbench: %s\n", err.msg);
    if (be_init) {
        void *bufs[] = {x.in, x.out, x.X, x.Xo, x.y, x.post, x.comb, x.q, x.cpa, x.cpb, x.flush_out, x.eid, x.ewt};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            if (bufs[i]) be.ops->free(&be, bufs[i]);
        if (want_cuda) dsv4_backend_cuda_free(&be);
        else dsv4_backend_cpu_free(&be);
    }
    free((void *)x.flush.data);
    free(x.pos);
    free(x.freq);
    if (w_bound) dsv4_weights_free(&w);
    if (st) dsv4_st_close(st);
    return rc;
}
