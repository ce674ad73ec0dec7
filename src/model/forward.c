/* model/forward: the DeepSeek-V4 forward pass (contract in forward.h).
 *
 * Reading order: model init (rope tables, host copies of small vectors,
 * validation) -> run-state buffers -> one layer (attention, compressors, indexer,
 * MoE) -> the batch driver (sub-batches, head, checkpoints) -> MTP.
 *
 * Rows: a sub-batch is a list of segments, each a run of consecutive positions of
 * one sequence; rows of all segments are stacked.  Within a layer every op runs on
 * all rows at once.  Keys a query needs that were produced in this sub-batch come
 * from the fresh kv rows (`kvc`), older ones from the sequence's ring; the ring is
 * written only after attention, so a chunk longer than the window is fine.
 * Compressor updates run row by row in position order (they are recurrences), and
 * visibility (`t < (p+1) div r`) keeps rows emitted later in the chunk out of
 * earlier queries.
 *
 * Host/backend split: the host builds what it knows from positions (per-row window
 * key pointers, compressed-row bases and counts, hash ids); what one op produces for
 * another (top-k picks, expert ids and weights) stays in backend memory, so a device
 * backend never waits inside a forward call except for the logits.  Host copies of
 * picks and routing are downloaded only when a trace is set.
 */
#include "model/forward.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/quant.h"

#define B_(m) ((m)->be)
#define OPS(m) ((m)->be->ops)

/* the matmul ops' flags for the quantized linears (DSV4_LIN_*) */
static int lin_flags(const dsv4_numerics *nm) {
    return (nm->linear_act_fp8 ? DSV4_LIN_ACT_FP8 : 0) | (nm->lin_dot_mma ? DSV4_LIN_DOT_MMA : 0) |
           (nm->lin_gemm_e4m3 ? DSV4_LIN_GEMM_E4M3 : 0);
}

typedef struct segment {
    int item;               /* index into the items of the call */
    dsv4_state *st;
    const int32_t *tok;
    int n, row0;
    int64_t pos0;
    int ci, cne;            /* run_compressor: rows taken so far, rows emitted */
    int64_t cfirst;         /* run_compressor: the state's compressed rows before this call */
} segment;

/* pool_multi's jobs held at a decode step (forward side: a fifth flushes the four), and the entries a held pool may
 * have (a ratio-4 window's two halves: 8); a larger pool is issued at once */
enum { PJ_JOBS = 4, PJ_ROWS = 16 };

struct dsv4_model {
    const dsv4_model_w *w;
    const dsv4_config *cfg;
    dsv4_backend *be;
    dsv4_numerics num;
    int max_rows;
    int n_all;              /* trunk + MTP layers */
    double *freq_main, *freq_comp; /* rope_dim/2 each */
    float **bias;           /* [layer] gate bias (n_routed) or NULL */
    float **sink;           /* [layer] attn_sink (n_heads) */
    float **ape;            /* [layer] main compressor ape [ratio][coff*head_dim] (backend memory) */
    float **iape;           /* [layer] indexer compressor ape (backend memory) */
    dsv4_route_trace_fn trace;
    void *trace_user;
    dsv4_model_op_trace_fn op_trace; /* layer-diff hook (forward.h); host copies in trace_f/trace_w */
    void *op_trace_user;
    float *trace_f, *trace_w;
    size_t trace_fcap, trace_wcap;

    /* ----- run state (sized for max_rows at init; attention lists grow with context) ----- */
    float *X, *Xb, *Xs;     /* [R][hc*dim] HC state, next state, saved state (MTP input) */
    float *y, *post, *comb; /* [R][dim], [R][hc], [R][hc*hc]: y and the attention half's post/comb */
    float *fpost, *fcomb;   /* [R][hc], [R][hc*hc] the MoE half's (two pairs: hc_post_pre_norm, backend.h) */
    int hc_ready;           /* the layer whose attention hc_pre is already in y/post/comb (-1: none) */
    float *qa, *q, *kvc;    /* [R][q_lora], [R][nh*hd], [R][hd] */
    float *ck, *cg;         /* [R][2*hd] compressor projections */
    float *ick, *icg;       /* [R][2*ihd] */
    float *iq, *iw;         /* [R][inh*ihd], [R][inh] */
    float *o, *low, *a;     /* [R][nh*hd], [R][og*olr], [R][dim] */
    float *rl, *wts;        /* [R][n_routed], [R][k] routing weights (backend memory) */
    int32_t *experts, *hash;/* [R][k] expert ids (backend memory), hash ids (host: tokens are known here) */
    int n_hash;             /* hash-routed layers among the main ones; hash_slot[l]: their index (-1: not,
                               MTP blocks included: only the main pass uploads, layer_forward reads) */
    int *hash_slot;
    int32_t *hash_all;      /* [n_hash][rows][k] this pass's hash ids of every hash layer (host), and */
    int32_t *hash_dev;      /* their copy in backend memory, uploaded once with the embedding, so that a
                               hash layer's route reads them in place (no host copy inside a layer's
                               graph on a device backend) */
    float *hx, *logits;     /* [R][dim], [R][vocab] */
    int64_t *pos, *cpos;    /* [R], [R+1] */
    int64_t *epos;          /* [2][R]: a decode step's emitted rows' positions, per compressor and segment (the
                             * op list reads a task's positions at its flush, by host pointer) */
    int32_t *tok;           /* [R] */
    int *seg_of;            /* [R] */
    segment *segs;          /* [R] */
    int32_t *picks;         /* [R][topk] top-k output (backend memory) */
    int *n_picks;           /* [R] (backend memory) */
    /* host copies of picks/experts/weights, filled only when a trace wants them */
    int32_t *h_picks, *h_experts;
    int *h_npicks;
    float *h_wts;
    /* attention key lists (host arrays the backend reads; keys stay in backend memory) */
    const float **win;      /* [R][window] window key pointers (fresh kv rows or the ring) */
    int *n_win;             /* [R] */
    const float **comp_base;/* [R] compressed rows of the row's sequence (NULL: none) */
    int *n_comp;            /* [R] visible compressed rows */
    const float **key_base; /* [R] indexer compressed rows of the row's sequence */
    float *scores;          /* [score_rows][max_keys] (backend memory) */
    int score_rows;         /* rows the score buffer holds (<= max_rows) */
    int *n_keys;
    int max_keys;
    const float *poolkv[1024], *poolg[1024]; /* pointers for one compressor emit */
    /* pool_multi (DSV4_POOL_MULTI, on by default): a decode step's window-end pools held until the next flush of
     * the op list (pool_flush), then issued as one call; n_pj held, each job's output, tables, entries and width */
    int n_pj;
    float *pj_out[PJ_JOBS];
    const float *pj_kv[PJ_JOBS][PJ_ROWS], *pj_g[PJ_JOBS][PJ_ROWS];
    int pj_n[PJ_JOBS], pj_w[PJ_JOBS];
    void **cl_dst;          /* [2R] a copy list (copy_list): destinations, sources, sizes */
    const void **cl_src;
    size_t *cl_bytes;
    dsv4_op_task *ol;       /* [ol_cap] an op list (op_list): independent small ops issued as one call */
    int n_ol, ol_cap;
    int *done;              /* [done_cap] tokens consumed per item of the current call */
    float *mtp_x, *mtp_a;   /* host scratch of the MTP input mix [hc*dim], [dim] */
    int seg_layers;         /* layers per segment after layer 0 (DSV4_SEG_LAYERS, default 1) */
    int seg_layers_greedy;  /* the same inside dsv4_forward_greedy's device loop (DSV4_GREEDY_SEG_LAYERS,
                             * default 4): the host runs ahead of the device there, so fewer graph
                             * boundaries cost no idle time (docs/CUDA.md, "CUDA graphs") */
    int l0_split;           /* layer 0 in three segments of its own (its attention from wq_b and its MoE half
                             * apart): 1 in the step API, whose host builds each step while the device waits;
                             * 0 in the greedy loop (DSV4_GREEDY_L0_SPLIT=1: 1 there too), whose host runs
                             * ahead, so that the embedding and layer 0 up to layer 1's first mark are one graph */
    int l0_split_greedy;
    int seg_at_hc;          /* DSV4_SEG_AT_HC: where a segment after layer 0 starts: 0 at its own y
                             * projections, 1 at the previous layer's last hc_post (fused with its hc_pre),
                             * 2 (the default) at the previous layer's router gate, 3 as 2 but layer 1
                             * as 0 (seg_at) */
    int side_chain;         /* DSV4_SIDE_CHAIN (default 1; "0" off): a decode step runs the compressors and the
                             * indexer as a side chain beside wq_b (ops->side / ops->join) */
    int hc_defer;           /* DSV4_HC_DEFER ("1" on): an hc_pre whose comb the fused hc_post_pre_norm reads
                             * leaves Sinkhorn to that op (DSV4_HC_COMB_LOGITS, backend.h); same values */
    int pool_multi;         /* DSV4_POOL_MULTI (default 1 since stop 52; "0" off): with emit_list, a decode
                             * step's window-end pools of both compressors in one pool_multi call, before the
                             * op list of their tails (pool_flush); same values */
    int emit_list;          /* DSV4_EMIT_LIST (default 1 since stop 50; "0" off): at a decode step a closed
                             * window's shift copies and its row's norm and RoPE go into one op list, the
                             * attention's compressor's held for the indexer's (run_compressor); same values */
    int wqb_first;          /* DSV4_WQB_FIRST (default 1 since stop 50; "0" off): at a decode step wq_b
                             * (matmul_rn) ahead of the first op list, the list beside it (op_list_beside); same
                             * values */
    double fwd_t[6];        /* host seconds per section of dsv4_forward (DSV4_FWD_TIMES) */
    double lay_t[6];        /* host seconds per section of layer_forward */
    long fwd_calls;
    int done_cap;
    int32_t *gtok;          /* dsv4_forward_greedy's tokens in backend memory: [0] the first, [s + 1] step
                             * s's argmax (gtok_cap ints) */
    int gtok_cap;
    float *glog;            /* its host logits row when it picks on the host (vocab floats) */
};

const dsv4_numerics *dsv4_model_numerics(const dsv4_model *m) { return &m->num; }

void dsv4_model_set_trace(dsv4_model *m, dsv4_route_trace_fn fn, void *user) {
    m->trace = fn;
    m->trace_user = user;
}

void dsv4_model_set_op_trace(dsv4_model *m, dsv4_model_op_trace_fn fn, void *user) {
    m->op_trace = fn;
    m->op_trace_user = user;
}

/* Hands one op's output to the op trace: floats are downloaded into a host
 * buffer (backend memory may not be host memory); ids and positions are host
 * arrays already.  If the host buffer cannot grow, the event carries no floats
 * (width 0) and the tool reports a shape mismatch rather than reading garbage. */
static void op_trace(dsv4_model *m, const char *op, int layer, int rows, int width, const float *f,
                     const int32_t *ids, const int *n_valid, const int64_t *pos) {
    if (!m->op_trace) return;
    dsv4_op_info info = {.op = op, .layer = layer, .rows = rows, .width = width, .ids = ids, .n_valid = n_valid,
                         .pos = pos};
    if (f) {
        size_t n = (size_t)rows * (size_t)width;
        if (n > m->trace_fcap) {
            float *nb = realloc(m->trace_f, sizeof(float) * n);
            if (!nb) {
                info.width = 0;
                m->op_trace(m->op_trace_user, &info);
                return;
            }
            m->trace_f = nb;
            m->trace_fcap = n;
        }
        if (n) OPS(m)->download(B_(m), m->trace_f, f, sizeof(float) * n);
        info.f = m->trace_f;
    }
    m->op_trace(m->op_trace_user, &info);
}

/* Host-time diagnostics (DSV4_FWD_TIMES=1): seconds of host wall time per section of
 * dsv4_forward, summed over calls and printed to stderr when the model is freed. */
static double fwd_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
static const char *const fwd_names[6] = {"reserve+validate", "embed", "layers", "check", "bookkeeping", "head+logits"};

/* ----- RoPE tables (spec §2.4) ----- */
/* base^(-2i/rd); YaRN on compressed layers only: pairs below `low` keep their frequency,
 * above `high` are divided by the factor, linear blend between.  No mscale. */
static void rope_table(double *f, int rd, double base, const dsv4_config *c, int yarn) {
    int half = rd / 2;
    for (int i = 0; i < half; i++) f[i] = 1.0 / pow(base, (2.0 * i) / rd);
    if (!yarn || c->yarn_factor <= 1.0 || c->yarn_original_seq <= 0) return;
    double orig = c->yarn_original_seq;
#define CORR(nrot) (rd * log(orig / ((nrot) * 2.0 * M_PI)) / (2.0 * log(base)))
    double low = floor(CORR(c->yarn_beta_fast)), high = ceil(CORR(c->yarn_beta_slow));
#undef CORR
    if (low < 0) low = 0;
    if (high > rd - 1) high = rd - 1;
    if (low == high) high += 0.001;
    for (int i = 0; i < half; i++) {
        double ramp = (i - low) / (high - low);
        if (ramp < 0) ramp = 0;
        if (ramp > 1) ramp = 1;
        /* transformers/reference: extrapolation weight (1 - ramp) keeps f, ramp uses f/factor */
        f[i] = f[i] / c->yarn_factor * ramp + f[i] * (1.0 - ramp);
    }
}

/* ----- init ----- */
static float *host_vec(const dsv4_weight *w) {
    if (w->fmt == DSV4_WF_NONE) return NULL;
    float *v = malloc(sizeof(float) * (size_t)(w->rows * w->cols));
    if (!v) return NULL;
    for (int64_t r = 0; r < w->rows; r++) dsv4_weight_row(w, r, v + r * w->cols);
    return v;
}

static size_t nz(size_t n) { return n ? n : 1; }

/* A small vector weight as floats in backend memory (NULL if absent or out of memory). */
static float *backend_vec(dsv4_backend *be, const dsv4_weight *w) {
    float *h = host_vec(w);
    if (!h) return NULL;
    size_t bytes = sizeof(float) * (size_t)(w->rows * w->cols);
    float *d = be->ops->alloc(be, nz(bytes));
    if (d) be->ops->upload(be, d, h, bytes);
    free(h);
    return d;
}

static int is_pow2(int v) { return v > 0 && (v & (v - 1)) == 0; }

void dsv4_model_free(dsv4_model *m) {
    if (!m) return;
    if (getenv("DSV4_FWD_TIMES") && m->fwd_calls) {
        fprintf(stderr, "forward host time over %ld calls (ms per call):", m->fwd_calls);
        for (int i = 0; i < 6; i++) fprintf(stderr, " %s %.3f", fwd_names[i], m->fwd_t[i] / m->fwd_calls * 1e3);
        static const char *const ln[6] = {"projections", "compressors", "indexer", "attention", "ring+hc_post", "moe"};
        fprintf(stderr, "; inside layers:");
        for (int i = 0; i < 6; i++) fprintf(stderr, " %s %.3f", ln[i], m->lay_t[i] / m->fwd_calls * 1e3);
        fprintf(stderr, "\n");
    }
    for (int l = 0; l < m->n_all; l++) {
        if (m->bias) free(m->bias[l]);
        if (m->sink) free(m->sink[l]);
        if (m->ape && m->ape[l]) OPS(m)->free(B_(m), m->ape[l]);
        if (m->iape && m->iape[l]) OPS(m)->free(B_(m), m->iape[l]);
    }
    free(m->bias);
    free(m->sink);
    free(m->ape);
    free(m->iape);
    free(m->done);
    free(m->freq_main);
    free(m->freq_comp);
    free(m->trace_f);
    free(m->trace_w);
    /* activations live in backend memory (device memory on a GPU) ... */
    void *dev[] = {m->X,  m->Xb,  m->Xs,  m->y, m->post, m->comb, m->qa,  m->q,       m->kvc,   m->ck,
                   m->cg, m->ick, m->icg, m->iq, m->iw, m->o,    m->low, m->a,       m->rl,    m->hx,
                   m->logits, m->wts, m->experts, m->picks, m->n_picks, m->fpost, m->fcomb};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) OPS(m)->free(B_(m), dev[i]);
    if (m->hash_dev) OPS(m)->free(B_(m), m->hash_dev);
    if (m->gtok) OPS(m)->free(B_(m), m->gtok);
    free(m->glog);
    free(m->hash_slot);
    free(m->hash_all);
    if (m->scores) OPS(m)->free(B_(m), m->scores);
    /* ... indices, lists and what the host reads stay host memory */
    void *bufs[] = {m->hash,          m->pos,      m->cpos,  m->epos, m->tok,           m->seg_of,      m->segs,
                    m->h_picks,       m->h_npicks, m->h_experts, m->h_wts,      (void *)m->win, m->n_win,
                    (void *)m->comp_base, m->n_comp, (void *)m->key_base, m->n_keys, m->mtp_x,  m->mtp_a,
                    (void *)m->cl_dst, (void *)m->cl_src, m->cl_bytes, m->ol};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(m);
}

int dsv4_model_init(dsv4_model **out, const dsv4_model_w *w, dsv4_backend *be, const dsv4_numerics *num,
                    int max_rows, dsv4_err *err) {
    *out = NULL;
    const dsv4_config *c = &w->cfg;
    if (max_rows <= 0) max_rows = 64;
    if (c->hc_mult > 16) return dsv4_errf(err, "model: hc_mult %d > 16 is not supported", c->hc_mult);
    if (c->rope_dim % 2 || c->rope_dim > c->head_dim || c->rope_dim > c->index_head_dim)
        return dsv4_errf(err, "model: qk_rope_head_dim %d must be even and fit head_dim %d and index_head_dim %d",
                         c->rope_dim, c->head_dim, c->index_head_dim);
    if (c->n_heads % c->o_groups)
        return dsv4_errf(err, "model: num_attention_heads %d not divisible by o_groups %d", c->n_heads, c->o_groups);
    if (num->indexer_sim_fp4 && !is_pow2(c->index_head_dim))
        return dsv4_errf(err, "model: indexer.sim=fp4 needs a power-of-two index_head_dim (got %d)",
                         c->index_head_dim);
    for (int l = 0; l < dsv4_config_total_layers(c); l++) {
        int r = c->compress_ratio[l];
        if (r > 1 && 2 * r > 1024)
            return dsv4_errf(err, "model: compress ratio %d of layer %d exceeds 512 (pool pointer table)", r, l);
    }
    dsv4_model *m = calloc(1, sizeof *m);
    if (!m) return dsv4_errf(err, "model: out of memory");
    m->w = w;
    m->cfg = c;
    m->be = be;
    m->num = *num;
    m->max_rows = max_rows;
    m->n_all = w->n_layers;
    const char *sl = getenv("DSV4_SEG_LAYERS");
    m->seg_layers = sl && atoi(sl) >= 1 && atoi(sl) <= 64 ? atoi(sl) : 1;
    /* 4 since 2026-12-04: greedy 3.07 against 3.10-3.11 ms a step on the H200 (20 Flash layers, 2K,
     * two rounds each), where the step API, whose host waits for each step's logits, was slower
     * with 4 (3.23-3.42 against 3.14-3.22) and 20 (4.15-4.41) */
    const char *sg = getenv("DSV4_GREEDY_SEG_LAYERS");
    m->seg_layers_greedy = sg && atoi(sg) >= 1 && atoi(sg) <= 64 ? atoi(sg) : 4;
    m->l0_split = 1;
    const char *l0 = getenv("DSV4_GREEDY_L0_SPLIT");
    m->l0_split_greedy = l0 && !strcmp(l0, "1");
    const char *sh = getenv("DSV4_SEG_AT_HC");
    /* default 2 since 2026-12-04: 3.210 against 3.260 ms a step on the H200, logits identical to
     * graphs off (test_cuda_e2e) and flash-2's unchanged; "0" gives the old placement */
    m->seg_at_hc = sh && sh[0] >= '0' && sh[0] <= '3' ? sh[0] - '0' : 2;
    const char *sc = getenv("DSV4_SIDE_CHAIN");
    m->side_chain = !(sc && !strcmp(sc, "0"));
    const char *hd = getenv("DSV4_HC_DEFER");
    m->hc_defer = hd && !strcmp(hd, "1");
    const char *wf = getenv("DSV4_WQB_FIRST");
    m->wqb_first = !(wf && !strcmp(wf, "0"));
    const char *el = getenv("DSV4_EMIT_LIST");
    m->emit_list = !(el && !strcmp(el, "0"));
    const char *pm = getenv("DSV4_POOL_MULTI");
    m->pool_multi = !(pm && !strcmp(pm, "0"));
    m->hc_ready = -1;
    int half = c->rope_dim / 2;
    m->freq_main = malloc(sizeof(double) * (size_t)(half ? half : 1));
    m->freq_comp = malloc(sizeof(double) * (size_t)(half ? half : 1));
    m->bias = calloc((size_t)m->n_all, sizeof(float *));
    m->sink = calloc((size_t)m->n_all, sizeof(float *));
    m->ape = calloc((size_t)m->n_all, sizeof(float *));
    m->iape = calloc((size_t)m->n_all, sizeof(float *));
    if (!m->freq_main || !m->freq_comp || !m->bias || !m->sink || !m->ape || !m->iape) goto oom;
    rope_table(m->freq_main, c->rope_dim, c->rope_theta, c, 0);
    rope_table(m->freq_comp, c->rope_dim, c->compress_rope_theta, c, 1);
    for (int l = 0; l < m->n_all; l++) {
        const dsv4_layer_w *L = &w->layers[l];
        m->sink[l] = host_vec(&L->attn_sink);
        if (!m->sink[l]) goto oom;
        if (!L->is_hash && L->gate_bias.fmt != DSV4_WF_NONE && !(m->bias[l] = host_vec(&L->gate_bias))) goto oom;
        if (L->has_comp && !(m->ape[l] = backend_vec(be, &L->comp.ape))) goto oom;
        if (L->has_indexer && !(m->iape[l] = backend_vec(be, &L->idx.comp.ape))) goto oom;
        if (L->is_hash) {
            const dsv4_weight *t = &L->tid2eid;
            if (t->cols != c->n_active || t->rows != c->vocab_size) {
                dsv4_model_free(m);
                return dsv4_errf(err, "model: %s has shape [%lld, %lld], expected [%d, %d]",
                                 t->name ? t->name : "tid2eid", (long long)t->rows, (long long)t->cols,
                                 c->vocab_size, c->n_active);
            }
            for (int64_t i = 0; i < t->rows * t->cols; i++) {
                int64_t e = t->fmt == DSV4_WF_I64 ? ((const int64_t *)t->data)[i] : ((const int32_t *)t->data)[i];
                if (e < 0 || e >= c->n_routed) {
                    dsv4_model_free(m);
                    return dsv4_errf(err, "model: %s entry [%lld][%lld] = %lld is not an expert id in [0, %d)",
                                     t->name ? t->name : "tid2eid", (long long)(i / t->cols),
                                     (long long)(i % t->cols), (long long)e, c->n_routed);
                }
            }
        }
    }
    size_t R = (size_t)max_rows, hcd = (size_t)c->hc_mult * c->dim, D = (size_t)c->dim;
    size_t qd = (size_t)c->n_heads * c->head_dim, k = (size_t)c->n_active;
#define AL(p, n) (((p) = calloc(nz(n), sizeof *(p))) == NULL)
#define AB(p, n) (((p) = be->ops->alloc(be, nz(n) * sizeof *(p))) == NULL) /* backend memory, zeroed */
    if (AB(m->X, R * hcd) || AB(m->Xb, R * hcd) || AB(m->Xs, R * hcd) || AB(m->y, R * D) ||
        AB(m->post, R * c->hc_mult) || AB(m->comb, R * c->hc_mult * c->hc_mult) || AB(m->fpost, R * c->hc_mult) ||
        AB(m->fcomb, R * c->hc_mult * c->hc_mult) || AB(m->qa, R * c->q_lora_rank) ||
        AB(m->q, R * qd) || AB(m->kvc, R * c->head_dim) || AB(m->ck, R * 2 * c->head_dim) ||
        AB(m->cg, R * 2 * c->head_dim) || AB(m->ick, R * 2 * c->index_head_dim) ||
        AB(m->icg, R * 2 * c->index_head_dim) || AB(m->iq, R * c->index_n_heads * c->index_head_dim) ||
        AB(m->iw, R * c->index_n_heads) || AB(m->o, R * qd) || AB(m->low, R * c->o_groups * c->o_lora_rank) ||
        AB(m->a, R * D) || AB(m->rl, R * c->n_routed) || AB(m->wts, R * k) || AB(m->experts, R * k) ||
        AL(m->h_wts, R * k) || AL(m->h_experts, R * k) || AL(m->hash, R * k) || AB(m->hx, R * D) ||
        AB(m->logits, R * (size_t)c->vocab_size) || AL(m->pos, R) || AL(m->mtp_x, hcd) || AL(m->mtp_a, D) ||
        AL(m->cpos, R + 1) || AL(m->epos, 2 * R) || AL(m->tok, R) || AL(m->seg_of, R) || AL(m->segs, R) ||
        AB(m->picks, R * (size_t)(c->index_topk > 0 ? c->index_topk : 1)) || AB(m->n_picks, R) ||
        AL(m->h_picks, R * (size_t)(c->index_topk > 0 ? c->index_topk : 1)) || AL(m->h_npicks, R) ||
        AL(m->win, R * (size_t)(c->window > 0 ? c->window : 1)) || AL(m->n_win, R) || AL(m->comp_base, R) ||
        AL(m->n_comp, R) || AL(m->key_base, R) || AL(m->n_keys, R) || AL(m->cl_dst, 2 * R) ||
        AL(m->cl_src, 2 * R) || AL(m->cl_bytes, 2 * R) || AL(m->ol, 6 * R + 8))
        goto oom;
    /* a decode step's longest lists: 2 tasks + 2 copies per row per compressor (lists 1 and 2), 2 copies and a
     * norm per row per compressor (the closed windows' tails, emit_list) */
    m->ol_cap = (int)(6 * R + 8);
    if (!(m->hash_slot = malloc(sizeof(int) * (size_t)(m->n_all > 0 ? m->n_all : 1)))) goto oom;
    m->n_hash = 0;
    for (int l = 0; l < m->n_all; l++) m->hash_slot[l] = l < c->n_layers && w->layers[l].is_hash ? m->n_hash++ : -1;
    if (m->n_hash && (AL(m->hash_all, (size_t)m->n_hash * R * k) || AB(m->hash_dev, (size_t)m->n_hash * R * k)))
        goto oom;
#undef AL
#undef AB
    *out = m;
    return 0;
oom:
    dsv4_model_free(m);
    return dsv4_errf(err, "model: out of memory for run-state buffers (max_rows %d)", max_rows);
}

/* Grows the indexer score buffer to `need_keys` columns and `rows` rows (amortised doubling of
 * both: no allocation once the context and the batch stop growing).  A growth of the columns
 * sizes the rows for this call only (a power of two): decode at long context, where the columns
 * grow, keeps rows x columns instead of max_rows x columns (1 GiB at 1M tokens and 1024 rows).
 * The attention and indexer key lists are per-row (pointer, count) pairs of fixed size,
 * allocated at init. */
static int ensure_scores(dsv4_model *m, int rows, int need_keys, dsv4_err *err) {
    if (need_keys <= m->max_keys && rows <= m->score_rows) return 0;
    int cap = m->max_keys ? m->max_keys : 64;
    while (cap < need_keys) cap *= 2;
    int r = need_keys > m->max_keys ? 1 : m->score_rows;
    while (r < rows) r *= 2;
    if (r > m->max_rows) r = m->max_rows;
    /* scores are written before they are read in each layer: no contents to keep */
    float *s = OPS(m)->alloc(B_(m), sizeof *s * (size_t)r * (size_t)cap);
    if (!s) return dsv4_errf(err, "forward: out of memory for indexer scores (%d rows x %d keys)", r, cap);
    if (m->scores) OPS(m)->free(B_(m), m->scores);
    m->scores = s;
    m->max_keys = cap;
    m->score_rows = r;
    return 0;
}

/* ----- compressor (spec §2.5) ----- */
/* Pools the window that position p closes from the decode-state buffers into `out`
 * (backend memory), then, for ratio 4, moves the current window to the previous one. */
/* the copy list (m->cl_*, 2 max_rows entries): entry n, then its flush (copy_list where the backend
 * has it, else one copy each); a full list is flushed before the next entry, so a list of any length
 * works (its entries' ranges must not overlap one another, as for copy_list) */
static void cl_flush(dsv4_model *m, int *n);
static void cl_add(dsv4_model *m, int *n, void *dst, const void *src, size_t bytes) {
    if (*n == 2 * m->max_rows) cl_flush(m, n);
    m->cl_dst[*n] = dst, m->cl_src[*n] = src, m->cl_bytes[*n] = bytes;
    (*n)++;
}
static void cl_flush(dsv4_model *m, int *n) {
    const dsv4_backend_ops *op = OPS(m);
    if (*n > 0 && op->copy_list)
        op->copy_list(B_(m), *n, m->cl_dst, (const void *const *)m->cl_src, m->cl_bytes);
    else
        for (int i = 0; i < *n; i++) op->copy(B_(m), m->cl_dst[i], m->cl_src[i], m->cl_bytes[i]);
    *n = 0;
}

/* The held window-end pools (DSV4_POOL_MULTI) as one pool_multi call (one held: pool); ol_flush calls it
 * first, so a pool always precedes the op list that holds its shift and its row's norm */
static void pool_flush(dsv4_model *m) {
    const float *const *kv[PJ_JOBS], *const *g[PJ_JOBS];
    for (int j = 0; j < m->n_pj; j++) kv[j] = m->pj_kv[j], g[j] = m->pj_g[j];
    if (m->n_pj == 1) OPS(m)->pool(B_(m), m->pj_out[0], kv[0], g[0], m->pj_n[0], m->pj_w[0]);
    else if (m->n_pj > 1) OPS(m)->pool_multi(B_(m), m->n_pj, m->pj_out, kv, g, m->pj_n, m->pj_w);
    m->n_pj = 0;
}

/* A window's end: pools the state rows into out, then (ratio 4, two halves) adds the shift of
 * the current window into the previous one's place to the copy list, or with `ol` to the op list, as copy
 * tasks (the caller flushes it before the state is written again).  hold (<= PJ_ROWS entries): the pool waits
 * in the model's jobs for pool_flush instead of being issued here. */
static void ol_add(dsv4_model *m, dsv4_op_task t);
static void comp_emit(dsv4_model *m, dsv4_comp_state *cs, float *out, int *ncl, int ol, int hold) {
    int r = cs->ratio, d = cs->dim, wd = cs->coff * d;
    int n = 0;
    if (cs->coff == 2) {
        /* previous window, first half of the channels; current window, second half */
        for (int t = 0; t < r; t++, n++) {
            m->poolkv[n] = cs->kv + (size_t)t * wd;
            m->poolg[n] = cs->score + (size_t)t * wd;
        }
        for (int t = r; t < 2 * r; t++, n++) {
            m->poolkv[n] = cs->kv + (size_t)t * wd + d;
            m->poolg[n] = cs->score + (size_t)t * wd + d;
        }
    } else {
        for (int t = 0; t < r; t++, n++) {
            m->poolkv[n] = cs->kv + (size_t)t * wd;
            m->poolg[n] = cs->score + (size_t)t * wd;
        }
    }
    if (hold && n <= PJ_ROWS) {
        if (m->n_pj == PJ_JOBS) pool_flush(m);
        int j = m->n_pj++;
        memcpy(m->pj_kv[j], m->poolkv, sizeof(m->poolkv[0]) * (size_t)n);
        memcpy(m->pj_g[j], m->poolg, sizeof(m->poolg[0]) * (size_t)n);
        m->pj_out[j] = out, m->pj_n[j] = n, m->pj_w[j] = d;
    } else {
        OPS(m)->pool(B_(m), out, m->poolkv, m->poolg, n, d);
    }
    if (cs->coff == 2 && ol) {
        size_t bytes = sizeof(float) * (size_t)r * wd;
        ol_add(m, (dsv4_op_task){.kind = DSV4_TASK_COPY, .out = cs->kv, .in = cs->kv + (size_t)r * wd, .n = bytes});
        ol_add(m, (dsv4_op_task){.kind = DSV4_TASK_COPY, .out = cs->score, .in = cs->score + (size_t)r * wd,
                                 .n = bytes});
    } else if (cs->coff == 2) {
        cl_add(m, ncl, cs->kv, cs->kv + (size_t)r * wd, sizeof(float) * (size_t)r * wd);
        cl_add(m, ncl, cs->score, cs->score + (size_t)r * wd, sizeof(float) * (size_t)r * wd);
    }
}

/* ----- fused pairs -----
 * rmsnorm then RoPE, and hc_pre then rmsnorm of y, as one backend op where the backend has
 * it (the same bits as the two ops: backend.h), else the two ops. */
static void norm_rope(dsv4_model *m, float *x, int rows, int n_heads, int head_dim, const dsv4_weight *w, float eps,
                      int rope_dim, const int64_t *pos, const double *freq, int bf) {
    const dsv4_backend_ops *op = OPS(m);
    if (op->norm_rope) {
        op->norm_rope(B_(m), x, rows, n_heads, head_dim, w, eps, rope_dim, pos, freq, bf);
        return;
    }
    op->rmsnorm(B_(m), x, x, rows * n_heads, head_dim, w, eps, bf);
    op->rope(B_(m), x, rows, n_heads, head_dim, rope_dim, pos, freq, 0, bf);
}

/* hc_pre into m->y, post, comb, the trace of y as hc_pre left it (`tag`), then y normed
 * by y_norm; with a layer-diff trace the two ops run apart, so the trace sees y unnormed */
/* 1 when every comb an hc op writes for a fused hc_post_pre_norm to read is left as logits
 * (DSV4_HC_COMB_LOGITS) and that reader forms the matrix: DSV4_HC_DEFER, both fused hc ops, no
 * layer-diff trace (which takes the plain ops).  Constant over a pass, so whether comb or fcomb
 * holds logits follows from it and from whether a next layer reads fcomb. */
static int hc_defers(const dsv4_model *m) {
    return m->hc_defer && OPS(m)->hc_pre_norm && OPS(m)->hc_post_pre_norm && !m->op_trace;
}

static void hc_pre_norm(dsv4_model *m, const float *X, int rows, const dsv4_weight *fn, const dsv4_weight *base,
                        const dsv4_weight *scale, const dsv4_weight *y_norm, float *post, float *comb, const char *tag,
                        int layer, int defer) {
    const dsv4_config *c = m->cfg;
    const dsv4_backend_ops *op = OPS(m);
    int hc = c->hc_mult, D = c->dim, bf = m->num.act_bf16;
    float eps = (float)c->norm_eps, heps = (float)c->hc_eps;
    if (op->hc_pre_norm && !m->op_trace) { /* the path hc_defers requires */
        op->hc_pre_norm(B_(m), m->y, post, comb, X, rows, hc, D, fn, base, scale,
                        c->hc_sinkhorn_iters | (defer ? DSV4_HC_COMB_LOGITS : 0), eps, heps, m->num.mhc_gemm_bf16,
                        bf, y_norm, eps);
        return;
    }
    op->hc_pre(B_(m), m->y, post, comb, X, rows, hc, D, fn, base, scale, c->hc_sinkhorn_iters, eps, heps,
               m->num.mhc_gemm_bf16, bf);
    op_trace(m, tag, layer, rows, D, m->y, NULL, NULL, m->pos);
    op->rmsnorm(B_(m), m->y, m->y, rows, D, y_norm, eps, bf);
}

/* hc_post of a half (o = m->a) from R into Xout with post_in / comb_in, then the next half's
 * hc_pre_norm on Xout into m->y, post, comb (weights fn, base, scale, y_norm), as one backend
 * op.  Returns 0 where the backend has none or a layer-diff trace is set (it must see the
 * hc_post output and y before its norm): the caller then runs the ops apart. */
static int hc_post_pre_norm(dsv4_model *m, float *Xout, const float *R, const float *post_in, const float *comb_in,
                            int comb_in_lg, int rows, const dsv4_weight *fn, const dsv4_weight *base,
                            const dsv4_weight *scale, const dsv4_weight *y_norm, float *post, float *comb,
                            int comb_lg) {
    const dsv4_config *c = m->cfg;
    const dsv4_backend_ops *op = OPS(m);
    float eps = (float)c->norm_eps;
    if (!op->hc_post_pre_norm || m->op_trace) return 0;
    int iters = c->hc_sinkhorn_iters | (comb_in_lg ? DSV4_HC_COMBIN_LOGITS : 0) | (comb_lg ? DSV4_HC_COMB_LOGITS : 0);
    op->hc_post_pre_norm(B_(m), Xout, m->a, R, post_in, comb_in, m->num.hc_state_bf16, m->y, post, comb, rows,
                         c->hc_mult, c->dim, fn, base, scale, iters, eps, (float)c->hc_eps, m->num.mhc_gemm_bf16,
                         m->num.act_bf16, y_norm, eps);
    return 1;
}

/* ----- op lists -----
 * Independent small ops collected into one op_list call where the backend has it (the same
 * bits as the ops one by one: backend.h).  Without op_list, with a layer-diff trace (which
 * sees every op apart), and for a norm_rope the backend runs as two ops (no fused pairs), a
 * task runs at once as its op: the tasks of a list are independent, so running one early, or
 * flushing a full list in two, changes nothing. */
static void ol_run(dsv4_model *m, const dsv4_op_task *t) { dsv4_op_task_run(OPS(m), B_(m), t); }
static void ol_flush(dsv4_model *m) {
    pool_flush(m);
    if (m->n_ol) OPS(m)->op_list(B_(m), m->ol, m->n_ol);
    m->n_ol = 0;
}
static void ol_add(dsv4_model *m, dsv4_op_task t) {
    const dsv4_backend_ops *op = OPS(m);
    if (!op->op_list || m->op_trace || (t.kind == DSV4_TASK_NORM_ROPE && !op->norm_rope)) {
        ol_run(m, &t);
        return;
    }
    if (m->n_ol == m->ol_cap) ol_flush(m);
    m->ol[m->n_ol++] = t;
}

/* A decode step (every segment one row: no run of positions crosses a window end) stages its
 * compressor rows through the op lists instead of run_compressor's first round: comp_stage
 * (list 1) copies each row's K and G into its window slot of the state, comp_bias (list 2)
 * adds the position bias to the G row now in the state: the values of add-then-copy.  Then
 * run_compressor(..., staged = 1) pools the windows those rows closed. */
#define CSTATE(sg) (is_idx ? &(sg)->st->layers[layer].icomp : &(sg)->st->layers[layer].comp)
static void comp_stage(dsv4_model *m, int layer, int is_idx, int nseg) {
    const float *K = is_idx ? m->ick : m->ck, *G = is_idx ? m->icg : m->cg;
    for (int s = 0; s < nseg; s++) {
        segment *sg = &m->segs[s];
        dsv4_comp_state *cs = CSTATE(sg);
        int r = cs->ratio, wd = cs->coff * cs->dim, slot = (cs->coff == 2 ? r : 0) + (int)(sg->pos0 % r);
        size_t row = (size_t)sg->row0 * wd, at = (size_t)slot * wd, bytes = sizeof(float) * (size_t)wd;
        ol_add(m, (dsv4_op_task){.kind = DSV4_TASK_COPY, .out = cs->kv + at, .in = K + row, .n = bytes});
        ol_add(m, (dsv4_op_task){.kind = DSV4_TASK_COPY, .out = cs->score + at, .in = G + row, .n = bytes});
    }
}
static void comp_bias(dsv4_model *m, int layer, int is_idx, int nseg) {
    const float *ape = is_idx ? m->iape[layer] : m->ape[layer];
    for (int s = 0; s < nseg; s++) {
        segment *sg = &m->segs[s];
        dsv4_comp_state *cs = CSTATE(sg);
        int r = cs->ratio, wd = cs->coff * cs->dim, in_win = (int)(sg->pos0 % r);
        int slot = (cs->coff == 2 ? r : 0) + in_win;
        ol_add(m, (dsv4_op_task){.kind = DSV4_TASK_ADD_CYCLIC, .out = cs->score + (size_t)slot * wd, .in = ape,
                                 .rows = 1, .dim = wd, .period = r, .first = in_win});
    }
}
#undef CSTATE

/* Runs one compressor over the rows of the sub-batch: projections for all rows, the
 * position biases (ape) added on the backend, then the recurrence per segment as
 * backend copies into the state buffers (one copy per run of positions inside a
 * window) and a pool at each window's end; emitted rows are post-processed together
 * (bf16, norm, RoPE at the window's first position, simulation).  staged: a decode step
 * whose rows comp_stage and comp_bias already put in the state (the first round's copies
 * and the biases are done).
 * el (DSV4_EMIT_LIST, a staged step with op_list and norm_rope and no simulation or bf16 step around the
 * norm): a closed window's shift copies and its row's norm and RoPE go into the op list instead of a copy
 * list and a norm_rope op, one launch after the pools where there were two; they read only what the pool
 * before them wrote or read, so the list's order changes nothing.  keep: leave those tasks in the list for
 * the caller's next run_compressor (the attention's compressor's, held for the indexer's: one list for
 * both, whose ops in between touch neither).  hold (DSV4_POOL_MULTI, on by default, with el): the pools wait
 * too, and go out as one pool_multi call just before that list (ol_flush). */
static void run_compressor(dsv4_model *m, int layer, const dsv4_compressor_w *cw, int is_idx, int rows, int nseg,
                           int staged, int keep) {
    const dsv4_config *c = m->cfg;
    const dsv4_numerics *nm = &m->num;
    const int el = staged && m->emit_list && OPS(m)->op_list && OPS(m)->norm_rope && !m->op_trace &&
                   !nm->act_bf16 && !(is_idx ? nm->indexer_sim_fp4 || nm->indexer_keys : nm->kv_sim_fp8);
    const int hold = el && m->pool_multi && OPS(m)->pool_multi; /* the pools wait for the list's flush */
    float *K = is_idx ? m->ick : m->ck, *G = is_idx ? m->icg : m->cg;
    const float *ape = is_idx ? m->iape[layer] : m->ape[layer];
    int d = cw->dim, wd = cw->coff * d, r = cw->ratio;
    /* K = wkv y, G = wgate y (fp32 linears, spec §2.0) are computed with y's other projections
     * (y_projections) */
    const dsv4_backend_ops *op = OPS(m);
    if (!staged && op->add_cyclic_pos) {
        op->add_cyclic_pos(B_(m), G, ape, rows, wd, r, m->pos); /* every sequence at once */
    } else if (!staged) {
        for (int s = 0; s < nseg; s++) {
            segment *sg = &m->segs[s];
            op->add_cyclic(B_(m), G + (size_t)sg->row0 * wd, ape, sg->n, wd, r, (int)(sg->pos0 % r));
        }
    }
#define CSTATE(sg) (is_idx ? &(sg)->st->layers[layer].icomp : &(sg)->st->layers[layer].comp)
    for (int s = 0; s < nseg; s++) {
        segment *sg = &m->segs[s];
        sg->ci = 0, sg->cne = 0, sg->cfirst = CSTATE(sg)->n_rows;
    }
    /* Round by round: round k takes the k-th run of positions inside one window of every
     * sequence (decode: one round), copies them into the state rows (one copy list), then pools
     * each window that run closed and shifts the ratio-4 state (one more list).  A sequence's
     * steps keep their order; sequences have their own state, so interleaving them changes
     * nothing. */
    for (;; staged = 0) { /* staged: only the first round is done */
        int ncl = 0, runs = 0;
        for (int s = 0; s < nseg; s++) {
            segment *sg = &m->segs[s];
            if (sg->ci >= sg->n) continue;
            runs++;
            if (staged) continue; /* in the state already */
            dsv4_comp_state *cs = CSTATE(sg);
            int64_t p = sg->pos0 + sg->ci;
            int in_win = (int)(p % r), take = r - in_win; /* positions left in this window */
            if (take > sg->n - sg->ci) take = sg->n - sg->ci;
            int slot = (cs->coff == 2 ? r : 0) + in_win, row = sg->row0 + sg->ci;
            size_t bytes = sizeof(float) * (size_t)take * wd;
            cl_add(m, &ncl, cs->kv + (size_t)slot * wd, K + (size_t)row * wd, bytes);
            cl_add(m, &ncl, cs->score + (size_t)slot * wd, G + (size_t)row * wd, bytes);
        }
        if (!runs) break;
        cl_flush(m, &ncl);
        for (int s = 0; s < nseg; s++) {
            segment *sg = &m->segs[s];
            if (sg->ci >= sg->n) continue;
            dsv4_comp_state *cs = CSTATE(sg);
            int64_t p = sg->pos0 + sg->ci;
            int take = r - (int)(p % r);
            if (take > sg->n - sg->ci) take = sg->n - sg->ci;
            sg->ci += take;
            if ((p + take) % r == 0) /* the run closed its window */
                comp_emit(m, cs, cs->rows + (size_t)(sg->cfirst + sg->cne++) * d, &ncl, el, hold);
        }
        cl_flush(m, &ncl);
    }
    for (int s = 0; s < nseg; s++) {
        segment *sg = &m->segs[s];
        dsv4_comp_state *cs = CSTATE(sg);
        int ne = sg->cne;
        if (!ne) continue;
        /* RoPE at each closed window's first position: the first window end at or after pos0,
         * then every r */
        int64_t e0 = (sg->pos0 / r + 1) * r - 1;
        float *rw = cs->rows + (size_t)sg->cfirst * d;
        if (el && ne == 1) { /* a staged step's one row a segment */
            int64_t *ep = m->epos + (size_t)is_idx * m->max_rows + s;
            *ep = e0 + 1 - r;
            ol_add(m, (dsv4_op_task){.kind = DSV4_TASK_NORM_ROPE, .out = rw, .rows = 1, .n_heads = 1, .dim = d,
                                     .rope_dim = c->rope_dim, .w = &cw->norm, .eps = (float)c->norm_eps, .pos = ep,
                                     .freq = m->freq_comp});
            cs->n_rows = sg->cfirst + ne;
            continue;
        }
        for (int j = 0; j < ne; j++) m->cpos[j] = e0 + (int64_t)j * r + 1 - r;
        if (nm->act_bf16) op->sim(B_(m), rw, ne, d, 0, d, DSV4_SIM_BF16);
        norm_rope(m, rw, ne, 1, d, &cw->norm, (float)c->norm_eps, c->rope_dim, m->cpos, m->freq_comp, nm->act_bf16);
        if (!is_idx) {
            if (nm->kv_sim_fp8) op->sim(B_(m), rw, ne, d, 0, d - c->rope_dim, DSV4_SIM_FP8_B64);
        } else {
            if (nm->indexer_sim_fp4) op->sim(B_(m), rw, ne, d, 0, d, DSV4_SIM_HAD_FP4_B32);
            static const int key_mode[] = {0, DSV4_SIM_BF16, DSV4_SIM_FP8_ROW, DSV4_SIM_FP4_B32};
            if (nm->indexer_keys) op->sim(B_(m), rw, ne, d, 0, d, key_mode[nm->indexer_keys]);
        }
        op_trace(m, is_idx ? "indexer.keys" : "attn.comp_rows", layer, ne, d, rw, NULL, NULL, m->cpos);
        cs->n_rows = sg->cfirst + ne;
    }
    if (!keep) ol_flush(m); /* this call's tasks, and those a call before it kept */
#undef CSTATE
}

/* The projections of the attention half's input y, in one backend call (matmul_multi: a
 * device backend streams them in one launch): q's low rank (wq_a), kv (wkv), the compressor's
 * kv and gate (fp32 linears, spec §2.0) and the indexer's compressor kv / gate and head
 * weights (weights_proj). */
static void y_projections(dsv4_model *m, const dsv4_layer_w *L, int rows) {
    const dsv4_backend_ops *op = OPS(m);
    int lf = lin_flags(&m->num), bf = m->num.act_bf16, n = 0;
    float *outs[7];
    const dsv4_weight *ws[7];
    int af[7], ob[7];
#define YP(o, w, a, b) (outs[n] = (o), ws[n] = (w), af[n] = (a), ob[n] = (b), n++)
    YP(m->qa, &L->wq_a, lf, bf);
    YP(m->kvc, &L->wkv, lf, bf);
    if (L->has_comp) YP(m->ck, &L->comp.wkv, 0, 0), YP(m->cg, &L->comp.wgate, 0, 0);
    if (L->has_indexer)
        YP(m->ick, &L->idx.comp.wkv, 0, 0), YP(m->icg, &L->idx.comp.wgate, 0, 0),
            YP(m->iw, &L->idx.weights_proj, 0, bf);
#undef YP
    if (op->matmul_multi) {
        op->matmul_multi(B_(m), n, outs, m->y, rows, ws, af, ob);
        return;
    }
    for (int i = 0; i < n; i++) op->matmul(B_(m), outs[i], m->y, rows, ws[i], af[i], ob[i]);
}

/* ----- one block (spec §2.2) ----- */
static void mark_segment(dsv4_model *m, int key);

/* 1 if layer l (>= 1) begins a segment: every seg_layers layers after layer 0 */
static int seg_first(const dsv4_model *m, int l) { return l >= 1 && (l - 1) % m->seg_layers == 0; }

/* where the segment of layer l (>= 1) starts (DSV4_SEG_AT_HC): 0 at its y projections, 1 at the
 * previous layer's last hc kernel, 2 at the previous layer's router gate; 3 is 2 but for layer 1,
 * which starts at 0's place (at a step's start the host is behind the device: with 2, layer 0's
 * FFN segment is only its hc kernel, and the device waits for the host to build layer 0's MoE and
 * layer 1's attention before the gate can run; the traces of 2026-12-04 show ~45 us there) */
static int seg_at(const dsv4_model *m, int l) { return m->seg_at_hc == 3 ? (l == 1 ? 0 : 2) : m->seg_at_hc; }

/* the hash ids of layer L's rows (tid2eid[token]) into dst [rows][k] */
static void hash_ids(const dsv4_model *m, const dsv4_layer_w *L, int rows, int32_t *dst) {
    const dsv4_weight *t = &L->tid2eid;
    int k = m->cfg->n_active;
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < k; j++) {
            int64_t at = (int64_t)m->tok[i] * k + j;
            dst[i * k + j] =
                (int32_t)(t->fmt == DSV4_WF_I64 ? ((const int64_t *)t->data)[at] : ((const int32_t *)t->data)[at]);
        }
}

/* The lightning indexer's last step on a ratio-4 layer (after its compressor and q's projection
 * into m->iq): the scores and the picks per row into m->picks / m->n_picks.  0, or -1 with err set. */
static int indexer_picks(dsv4_model *m, int layer, const dsv4_layer_w *L, int rows, dsv4_err *err) {
    const dsv4_config *c = m->cfg;
    const dsv4_numerics *nm = &m->num;
    const dsv4_backend_ops *op = OPS(m);
    dsv4_backend *b = B_(m);
    int rd = c->rope_dim, ratio = L->ratio, bf = nm->act_bf16, topk = c->index_topk;
    const double *freq = ratio ? m->freq_comp : m->freq_main;
    int inh = c->index_n_heads, ihd = c->index_head_dim;
    float iw_scale = (float)(1.0 / sqrt((double)ihd) / sqrt((double)inh));
    /* the rope of q and the scale of w folded into the scores op (the same bits; q and w stay
     * as the projections left them, which nothing reads after the scores) unless a sim runs
     * between or the layer-diff trace wants q as rotated */
    int fuse_rs = op->indexer_scores_rs && !m->op_trace && !nm->indexer_sim_fp4;
    if (!fuse_rs) {
        op->rope(b, m->iq, rows, inh, ihd, rd, m->pos, freq, 0, bf);
        if (nm->indexer_sim_fp4) op->sim(b, m->iq, rows * inh, ihd, 0, ihd, DSV4_SIM_HAD_FP4_B32);
        op->scale(b, m->iw, (size_t)rows * inh, iw_scale, bf);
    }
    int need = 1;
    for (int i = 0; i < rows; i++) {
        int64_t vis = (m->pos[i] + 1) / ratio;
        if (vis > need) need = (int)vis;
    }
    if (ensure_scores(m, rows, need, err)) return -1;
    for (int i = 0; i < rows; i++) { /* row i's keys: its sequence's indexer rows, contiguous */
        segment *sg = &m->segs[m->seg_of[i]];
        m->key_base[i] = sg->st->layers[layer].icomp.rows;
        m->n_keys[i] = (int)((m->pos[i] + 1) / ratio);
    }
    if (fuse_rs)
        op->indexer_scores_rs(b, m->scores, m->iq, m->iw, rows, inh, ihd, m->key_base, m->n_keys, m->max_keys,
                              nm->indexer_score_bf16, rd, m->pos, freq, iw_scale, bf);
    else
        op->indexer_scores(b, m->scores, m->iq, m->iw, rows, inh, ihd, m->key_base, m->n_keys, m->max_keys,
                           nm->indexer_score_bf16);
    op->topk(b, m->picks, m->n_picks, m->scores, rows, m->max_keys, m->n_keys, topk);
    op_trace(m, "indexer.q", layer, rows, inh * ihd, m->iq, NULL, NULL, m->pos);
    op_trace(m, "indexer.scores", layer, rows, m->max_keys, m->scores, NULL, m->n_keys, m->pos);
    if (m->op_trace || m->trace) { /* host copies only for the traces: the step itself never waits */
        op->download(b, m->h_picks, m->picks, sizeof(int32_t) * (size_t)rows * topk);
        op->download(b, m->h_npicks, m->n_picks, sizeof(int) * (size_t)rows);
    }
    if (m->op_trace) op_trace(m, "indexer.picks", layer, rows, topk, NULL, m->h_picks, m->h_npicks, m->pos);
    return 0;
}

/* next: the layer that follows this one in the same pass (-1: none, the head or the MTP
 * follows); its attention hc_pre then runs inside this layer's last hc_post where the backend
 * fuses them (hc_post_pre_norm) and that layer skips its own (m->hc_ready) */
static int layer_forward(dsv4_model *m, int layer, int rows, int nseg, int next, dsv4_err *err) {
    const dsv4_config *c = m->cfg;
    const dsv4_numerics *nm = &m->num;
    const dsv4_layer_w *L = &m->w->layers[layer];
    const dsv4_backend_ops *op = OPS(m);
    dsv4_backend *b = B_(m);
    int hc = c->hc_mult, D = c->dim, hd = c->head_dim, nh = c->n_heads, rd = c->rope_dim, W = c->window;
    int ratio = L->ratio, bf = nm->act_bf16, a8 = nm->linear_act_fp8, lf = lin_flags(nm);
    const double *freq = ratio ? m->freq_comp : m->freq_main;
    float eps = (float)c->norm_eps;
    double lt = fwd_now(), ln_;
#define LAY_LAP(i) (ln_ = fwd_now(), m->lay_t[i] += ln_ - lt, lt = ln_)

    /* ----- attention ----- */
    if (m->hc_ready != layer)
        hc_pre_norm(m, m->X, rows, &L->hc_attn_fn, &L->hc_attn_base, &L->hc_attn_scale, &L->attn_norm, m->post,
                    m->comb, "attn.hc_pre", layer, hc_defers(m)); /* its reader: this layer's MoE half */
    m->hc_ready = -1;
    y_projections(m, L, rows);
    /* A decode step (every segment one row) issues the small ops around wq_b as two op lists
     * (op_list: one launch each on a device): what reads only y's projections before wq_b,
     * what reads the first list's outputs after it.  The ring row is written before attention
     * here: its slot held position p - W, outside row p's window (p - W, p], and attention reads
     * row p itself from kvc.  Prefill and multi-row segments keep the ops in this order below. */
    int dec = 1;
    for (int s = 0; s < nseg; s++) dec &= m->segs[s].n == 1;
    dsv4_op_task qa_norm = {.kind = DSV4_TASK_RMSNORM, .out = m->qa, .in = m->qa, .rows = rows,
                            .dim = c->q_lora_rank, .w = &L->q_norm, .eps = eps, .out_bf16 = bf};
    dsv4_op_task q_rope = {.kind = DSV4_TASK_NORM_ROPE, .out = m->q, .rows = rows, .n_heads = nh, .dim = hd,
                           .rope_dim = rd, .eps = eps, .pos = m->pos, .freq = freq,
                           .out_bf16 = bf ? 1 | DSV4_NORM_BF16_STEPS : 0}; /* unweighted; on bf16, torch's steps */
    dsv4_op_task kv_rope = {.kind = DSV4_TASK_NORM_ROPE, .out = m->kvc, .rows = rows, .n_heads = 1, .dim = hd,
                            .rope_dim = rd, .w = &L->kv_norm, .eps = eps, .pos = m->pos, .freq = freq,
                            .out_bf16 = bf};
    /* side: at a decode step the compressors' position biases and windows and the indexer's
     * scores and top-k run as a side chain (ops->side) beside the indexer's q projection, wq_b and
     * the second list, joined before the attention: they read qa, iq, y's projections and the
     * sequence's state, and write only the compressor state and rows, the indexer's scores and
     * the picks, none of which the main chain touches.  The indexer's q projection stays in the
     * main chain (the scores continue the side chain after it): two weight streams side by side
     * slowed wq_b more than the overlap gave (H200 trace, 2026-12-04).  A layer with a compressor
     * but no indexer forks only at a step that closes its window (else its chain is one short op
     * list, and the fork cost more than it hid).  The same ops with the same arguments as the
     * order below, so the same values (test_forward test_side_chain); the CPU backend runs them in
     * order. */
    int emits = 0;
    for (int s = 0; s < nseg && L->has_comp; s++) emits |= (m->segs[s].pos0 + 1) % L->comp.ratio == 0;
    int side = dec && m->side_chain && op->side && op->join && !m->op_trace && !m->trace &&
               (L->has_indexer || emits);
    /* rn: qa's norm inside wq_b (matmul_rn) where wq_b is qa's only reader (no indexer, no side chain):
     * list 1 then holds nothing wq_b reads.  Only where the backend forms the norm inside the matmul
     * (matmul_rn_takes: one row of Flash's wq_b; not with act_quant's flags, the reference profile):
     * elsewhere the op would run two kernels where the list had one task */
    int rn = dec && !side && !L->has_indexer && op->matmul_rn && op->matmul_rn_takes && !m->op_trace && !lf &&
             op->matmul_rn_takes(b, &L->wq_b, rows, lf);
    /* first (DSV4_WQB_FIRST, on by default): wq_b ahead of list 1, which then runs beside it (op_list_beside):
     * wq_b's blocks start as y's projections end instead of behind the list.  The list reads only y's
     * projections and writes kv and the state rows, none of which wq_b touches */
    int first = rn && m->wqb_first && op->op_list_beside;
    if (dec) {
        if (first) op->matmul_rn(b, m->q, m->qa, rows, &L->wq_b, lf, bf, &L->q_norm, eps, bf);
        if (!rn) ol_add(m, qa_norm); /* list 1: y's projections -> qa, kv, the compressors' state rows */
        ol_add(m, kv_rope);
        if (L->has_comp) comp_stage(m, layer, 0, nseg);
        if (L->has_indexer) comp_stage(m, layer, 1, nseg);
        if (first && m->n_ol) op->op_list_beside(b, m->ol, m->n_ol), m->n_ol = 0;
        ol_flush(m);
        /* layer 0's attention half is two segments at a decode step: the device starts on y's
         * projections while the host builds the rest (the device waits at the start of a step until
         * the first segment is built; the MoE half below is a third).  Measured (trace, H200,
         * 2026-12-02 08:01Z): 12 us idle at the step's start instead of 39, but 15 us here while
         * the host built wq_b and the attention; a split before the attention instead (branch
         * next-split) has not run on a device */
        if (layer == 0 && m->l0_split) mark_segment(m, m->n_all + 3);
        if (side) {
            op->side(b, 1);
            if (L->has_comp) comp_bias(m, layer, 0, nseg);
            if (L->has_indexer) comp_bias(m, layer, 1, nseg);
            ol_flush(m);
            if (L->has_comp) run_compressor(m, layer, &L->comp, 0, rows, nseg, dec, L->has_indexer);
            if (L->has_indexer) run_compressor(m, layer, &L->idx.comp, 1, rows, nseg, dec, 0);
            op->side(b, 0);
            if (L->has_indexer) {
                op->matmul(b, m->iq, m->qa, rows, &L->idx.wq_b, lf, bf);
                op->side(b, 1); /* the scores after iq and the indexer's new keys */
                if (indexer_picks(m, layer, L, rows, err)) {
                    op->join(b);
                    return -1;
                }
                op->side(b, 0);
            }
        }
        if (rn && !first) op->matmul_rn(b, m->q, m->qa, rows, &L->wq_b, lf, bf, &L->q_norm, eps, bf);
        else if (!rn) op->matmul(b, m->q, m->qa, rows, &L->wq_b, lf, bf);
        if (nm->kv_sim_fp8) op->sim(b, m->kvc, rows, hd, 0, hd - rd, DSV4_SIM_FP8_B64);
        ol_add(m, q_rope); /* list 2: q, the state rows' position biases, the ring rows */
        if (L->has_comp && !side) comp_bias(m, layer, 0, nseg);
        if (L->has_indexer && !side) comp_bias(m, layer, 1, nseg);
        for (int s = 0; s < nseg; s++) {
            segment *sg = &m->segs[s];
            dsv4_layer_state *ls = &sg->st->layers[layer];
            int slot = (int)(sg->pos0 % W);
            ol_add(m, (dsv4_op_task){.kind = DSV4_TASK_COPY, .out = ls->ring + (size_t)slot * hd,
                                     .in = m->kvc + (size_t)sg->row0 * hd, .n = sizeof(float) * hd});
            ls->ring_pos[slot] = sg->pos0;
        }
        ol_flush(m);
        if (side) op->join(b);
    } else {
        ol_run(m, &qa_norm);
        op->matmul(b, m->q, m->qa, rows, &L->wq_b, lf, bf);
        ol_run(m, &q_rope);
        ol_run(m, &kv_rope);
        if (nm->kv_sim_fp8) op->sim(b, m->kvc, rows, hd, 0, hd - rd, DSV4_SIM_FP8_B64);
    }
    op_trace(m, "attn.q", layer, rows, nh * hd, m->q, NULL, NULL, m->pos);
    op_trace(m, "attn.kv", layer, rows, hd, m->kvc, NULL, NULL, m->pos);

    LAY_LAP(0);
    if (L->has_comp && !side) run_compressor(m, layer, &L->comp, 0, rows, nseg, dec, 0);

    LAY_LAP(1);
    /* lightning indexer (ratio 4): picks per row (in the side chain at a decode step) */
    int topk = c->index_topk;
    if (L->has_indexer && !side) {
        run_compressor(m, layer, &L->idx.comp, 1, rows, nseg, dec, 0);
        op->matmul(b, m->iq, m->qa, rows, &L->idx.wq_b, lf, bf);
        if (indexer_picks(m, layer, L, rows, err)) return -1;
    }

    LAY_LAP(2);
    /* key lists: window (fresh rows or ring) per row, then compressed rows (picked on the
     * backend by the indexer, or all visible ones) */
    for (int i = 0; i < rows; i++) {
        segment *sg = &m->segs[m->seg_of[i]];
        const dsv4_layer_state *ls = &sg->st->layers[layer];
        const float **kl = m->win + (size_t)i * W;
        int n = 0;
        int64_t p = m->pos[i], lo = p - W + 1 < 0 ? 0 : p - W + 1;
        for (int64_t qp = lo; qp <= p; qp++) {
            if (qp >= sg->pos0) {
                kl[n++] = m->kvc + (size_t)(sg->row0 + (qp - sg->pos0)) * hd;
            } else {
                int slot = (int)(qp % W);
                if (ls->ring_pos[slot] == qp) kl[n++] = ls->ring + (size_t)slot * hd;
            }
        }
        m->n_win[i] = n;
        m->comp_base[i] = ratio ? ls->comp.rows : NULL;
        m->n_comp[i] = ratio ? (int)((p + 1) / ratio) : 0; /* with the indexer: the bound of a pick */
    }
    /* then the inverse RoPE at the query position (in the attention's epilogue where the backend
     * has the fused op: the same bits) */
    const int32_t *picks = L->has_indexer ? m->picks : NULL;
    const int *n_picks = L->has_indexer ? m->n_picks : NULL;
    float ascale = (float)(1.0 / sqrt((double)hd));
    if (op->sparse_attn_rope && !m->op_trace) {
        op->sparse_attn_rope(b, m->o, m->q, rows, nh, hd, m->win, m->n_win, W, m->comp_base, m->n_comp, picks, n_picks,
                             topk, m->sink[layer], ascale, nm->attn_prob_bf16, bf, rd, m->pos, freq);
    } else {
        op->sparse_attn(b, m->o, m->q, rows, nh, hd, m->win, m->n_win, W, m->comp_base, m->n_comp, picks, n_picks,
                        topk, m->sink[layer], ascale, nm->attn_prob_bf16, bf);
        op->rope(b, m->o, rows, nh, hd, rd, m->pos, freq, 1, bf);
    }
    op->matmul_grouped(b, m->low, m->o, rows, &L->wo_a, c->o_groups, bf, bf, lf & DSV4_LIN_DOT_MMA);
    op->matmul(b, m->a, m->low, rows, &L->wo_b, lf, bf);
    op_trace(m, "attn.out", layer, rows, D, m->a, NULL, NULL, m->pos);

    LAY_LAP(3);
    /* the ring keeps the last `window` rows of each segment (a decode step wrote them in list 2) */
    int ncl = 0; /* one copy list for every sequence (at most rows entries) */
    for (int s = 0; s < nseg && !dec; s++) {
        segment *sg = &m->segs[s];
        dsv4_layer_state *ls = &sg->st->layers[layer];
        int from = sg->n > W ? sg->n - W : 0;
        for (int i = from; i < sg->n; i++) {
            int64_t p = sg->pos0 + i;
            int slot = (int)(p % W);
            cl_add(m, &ncl, ls->ring + (size_t)slot * hd, m->kvc + (size_t)(sg->row0 + i) * hd, sizeof(float) * hd);
            ls->ring_pos[slot] = p;
        }
    }
    cl_flush(m, &ncl);
    /* layer 0's MoE half is a segment of its own: a device backend then starts the first
     * layer's attention while the host is still building the rest (the device idles at the
     * start of a step until the first segment is built); it starts with the attention half's
     * hc_post, which the MoE half's hc_pre may be fused into */
    if (layer == 0 && m->l0_split) mark_segment(m, m->n_all + 2);
    /* comb holds logits iff hc_defers; fcomb's reader is the next layer's fused op, or the last hc_post */
    if (!hc_post_pre_norm(m, m->Xb, m->X, m->post, m->comb, hc_defers(m), rows, &L->hc_ffn_fn, &L->hc_ffn_base,
                          &L->hc_ffn_scale, &L->ffn_norm, m->fpost, m->fcomb, next >= 0 && hc_defers(m))) {
        /* not fused, so hc_defers is 0: comb holds the matrix, and fcomb will */
        op->hc_post(b, m->Xb, m->a, m->X, m->post, m->comb, rows, hc, D, nm->hc_state_bf16);
        op_trace(m, "attn.hc_post", layer, rows, hc * D, m->Xb, NULL, NULL, m->pos);
        hc_pre_norm(m, m->Xb, rows, &L->hc_ffn_fn, &L->hc_ffn_base, &L->hc_ffn_scale, &L->ffn_norm, m->fpost,
                    m->fcomb, "ffn.hc_pre", layer, 0);
    }

    LAY_LAP(4);
    /* ----- MoE (spec §2.6) ----- */
    /* DSV4_SEG_AT_HC=2: the next layer's segment starts at this router gate (a small weight with
     * little to load before its wait), so the combine, the hc kernel and the next y projections
     * all launch early inside one graph */
    if (seg_at(m, next) == 2 && seg_first(m, next)) mark_segment(m, next);
    op->matmul(b, m->rl, m->y, rows, &L->gate, 0, 0); /* fp32 router */
    op_trace(m, "moe.router_logits", layer, rows, c->n_routed, m->rl, NULL, NULL, m->pos);
    int k = c->n_active;
    const int32_t *hash = NULL;
    if (L->is_hash && m->hash_slot[layer] >= 0) { /* a main layer: uploaded with this pass's embedding */
        hash = m->hash_dev + (size_t)m->hash_slot[layer] * rows * k;
    } else if (L->is_hash) { /* an MTP block (dsv4_forward_mtp): looked up here */
        hash_ids(m, L, rows, m->hash);
        hash = m->hash;
    }
    float rs = (float)c->routed_scale;
    float router_scale = nm->route_scale == DSV4_RSCALE_OUTPUT ? 1.0f : rs;
    float out_scale = nm->route_scale == DSV4_RSCALE_ROUTER ? 1.0f : rs;
    const float *rbias = hash ? NULL : m->bias[layer];
    const dsv4_ffn_w *shared = c->n_shared > 0 ? &L->shared : NULL;
    /* route then moe, in one call where the backend fuses them (a device backend may route and
     * plan in one launch; it falls back to the two ops itself, e.g. for hash layers); nothing is
     * traced between the two, but the layer-diff trace keeps the separate ops, as elsewhere */
    int mf = (a8 ? DSV4_MOE_ACT_FP8 : 0) | (nm->moe_dot_mma == 1 ? DSV4_MOE_DOT_MMA : 0) |
             (nm->moe_dot_mma == 2 ? DSV4_MOE_DOT_E4M3 : 0);
    if (op->route_moe && !m->op_trace) {
        op->route_moe(b, m->experts, m->wts, m->rl, rows, c->n_routed, k, rbias, hash, router_scale, m->a, m->y,
                      L->experts, shared, (float)c->swiglu_limit, nm->moe_before_w2, mf, bf, out_scale);
    } else {
        op->route(b, m->experts, m->wts, m->rl, rows, c->n_routed, k, rbias, hash, router_scale);
        op->moe(b, m->a, m->y, rows, L->experts, c->n_routed, m->experts, m->wts, k, shared, (float)c->swiglu_limit,
                nm->moe_before_w2, mf, bf, out_scale);
    }
    if (m->op_trace || m->trace) { /* host copies only for the traces */
        op->download(b, m->h_experts, m->experts, sizeof(int32_t) * (size_t)rows * k);
        op->download(b, m->h_wts, m->wts, sizeof(float) * (size_t)rows * k);
    }
    if (m->op_trace) { /* the routing weights as applied (router scale x output scale), with the experts */
        size_t nw = (size_t)rows * k;
        if (nw > m->trace_wcap) {
            float *nb = realloc(m->trace_w, sizeof(float) * nw);
            if (nb) m->trace_w = nb, m->trace_wcap = nw;
        }
        if (nw <= m->trace_wcap)
            for (size_t i = 0; i < nw; i++) m->trace_w[i] = m->h_wts[i] * out_scale;
        dsv4_op_info info = {.op = "moe.route", .layer = layer, .rows = rows, .width = nw <= m->trace_wcap ? k : 0,
                             .f = m->trace_w, .ids = m->h_experts, .pos = m->pos};
        m->op_trace(m->op_trace_user, &info);
        op_trace(m, "moe.out", layer, rows, D, m->a, NULL, NULL, m->pos);
    }
    if (m->trace) {
        float applied[64];
        for (int i = 0; i < rows; i++) {
            for (int j = 0; j < k && j < 64; j++) applied[j] = m->h_wts[i * k + j] * out_scale;
            dsv4_route_info info = {
                .tag = NULL, .layer = layer, .pos = m->pos[i], .token = m->tok[i], .is_hash = L->is_hash,
                .k = k, .experts = m->h_experts + (size_t)i * k, .weights = applied,
                .n_picks = L->has_indexer ? m->h_npicks[i] : 0,
                .picks = L->has_indexer ? m->h_picks + (size_t)i * topk : NULL,
            };
            info.tag = m->segs[m->seg_of[i]].item >= 0 ? (void *)&m->segs[m->seg_of[i]] : NULL;
            m->trace(m->trace_user, &info);
        }
    }
    /* DSV4_SEG_AT_HC: the next layer's segment starts here, so that its first weight kernel
     * (y's projections) is launched early behind this hc kernel inside one graph */
    if (seg_at(m, next) == 1 && seg_first(m, next)) mark_segment(m, next);
    /* the next layer's attention hc_pre, fused into this hc_post where the backend can */
    const dsv4_layer_w *N = next >= 0 ? &m->w->layers[next] : NULL;
    if (N && hc_post_pre_norm(m, m->X, m->Xb, m->fpost, m->fcomb, hc_defers(m), rows, &N->hc_attn_fn,
                              &N->hc_attn_base, &N->hc_attn_scale, &N->attn_norm, m->post, m->comb, hc_defers(m))) {
        m->hc_ready = next; /* comb's reader: layer next's MoE half */
    } else {
        /* fcomb holds the matrix here: logits only with a next layer and hc_defers */
        op->hc_post(b, m->X, m->a, m->Xb, m->fpost, m->fcomb, rows, hc, D, nm->hc_state_bf16);
        op_trace(m, "ffn.hc_post", layer, rows, hc * D, m->X, NULL, NULL, m->pos);
    }
    LAY_LAP(5);
#undef LAY_LAP
    return 0;
}

/* Segment marks (backend.h): a device backend may capture the ops between two marks and
 * replay them as one unit; keys are the first layer of the segment, n_all for the head,
 * n_all + 1 for the embedding, n_all + 2 for layer 0's MoE half, -1 = end. */
static void mark_segment(dsv4_model *m, int key) {
    if (OPS(m)->segment) OPS(m)->segment(B_(m), key);
}

/* hc_head -> norm -> head for `rows` HC states in X (spec §2.7), logits into m->logits. */
static void head_rows(dsv4_model *m, const float *X, int rows, const dsv4_weight *fn, const dsv4_weight *base,
                      const dsv4_weight *scale, const dsv4_weight *norm) {
    const dsv4_config *c = m->cfg;
    int bf = m->num.act_bf16;
    OPS(m)->hc_head(B_(m), m->hx, X, rows, c->hc_mult, c->dim, fn, base, scale, (float)c->norm_eps,
                    (float)c->hc_eps, m->num.mhc_gemm_bf16, bf);
    OPS(m)->rmsnorm(B_(m), m->hx, m->hx, rows, c->dim, norm, (float)c->norm_eps, bf);
    OPS(m)->matmul(B_(m), m->logits, m->hx, rows, &m->w->head, 0, 0); /* fp32 head */
    op_trace(m, "head.logits", -1, rows, c->vocab_size, m->logits, NULL, NULL, NULL);
}

/* ----- the batch driver ----- */
static void *item_tag_of(dsv4_fwd_item *items, const segment *sg) { return items[sg->item].tag; }

typedef struct {
    dsv4_route_trace_fn fn;
    void *user;
    dsv4_fwd_item *items;
} trace_shim;

static void shim_fn(void *user, const dsv4_route_info *info) {
    trace_shim *t = user;
    dsv4_route_info c = *info;
    c.tag = info->tag ? item_tag_of(t->items, (const segment *)info->tag) : NULL;
    t->fn(t->user, &c);
}

/* err's message, then "; WHAT failed too: " e2's */
static void err_also(dsv4_err *err, const char *what, const dsv4_err *e2) {
    if (!err) return;
    char first[DSV4_ERR_MAX];
    snprintf(first, sizeof first, "%s", err->msg);
    dsv4_errf(err, "%s; %s failed too: %s", first, what, e2->msg);
}

/* ----- undoing a failed call -----
 * A failed call commits nothing: the state goes back to length len, which its device writes from
 * position len on (n positions) must not have disturbed.  One position that closes no compressor
 * window is undone by the counts alone: its ring slot held a position outside every later window
 * and its compressor row sits past the count (n_rows = len / ratio, which run_compressor
 * advanced).  More positions overwrote ring slots inside len's window, and a closed window shifts
 * the ratio-4 state in place: then the state is truncated to len (dsv4_forward_truncate: its last
 * checkpoint at or below len, then the history's tokens up to len again).  0, or -1 with e2 set
 * when that re-run failed too. */
static int state_undo(dsv4_model *m, dsv4_state *st, int64_t len, int64_t n, dsv4_err *e2) {
    int full = n > 1;
    for (int l = 0; l < st->n_layers && n == 1; l++) {
        const dsv4_layer_state *L = &st->layers[l];
        full |= (L->has_comp && (len + 1) % L->comp.ratio == 0) || (L->has_idx && (len + 1) % L->icomp.ratio == 0);
    }
    if (!full || n < 1) {
        dsv4_state_set_len(st, len);
        return 0;
    }
    if (st->len < len + n) st->len = len + n; /* what the failed call may have written: the truncate drops it */
    return dsv4_forward_truncate(m, st, len, e2);
}

int dsv4_forward_truncate(dsv4_model *m, dsv4_state *st, int64_t len, dsv4_err *err) {
    int64_t from = 0;
    if (len < 0 || len > st->len)
        return dsv4_errf(err, "truncate: length %lld is outside [0, %lld]", (long long)len, (long long)st->len);
    if (len == st->len && !st->broken) return 0;
    if (dsv4_state_rewind(st, len, &from, err)) return -1;
    /* the history's tokens in place: a chunk's reserve needs no more than len <= the history's
     * capacity (no realloc under the pointer), and the pass writes back the values it reads */
    while (st->len < len) {
        int64_t k = len - st->len;
        dsv4_fwd_item it = {.st = st, .tokens = st->tokens + st->len, .n = k > (1 << 20) ? 1 << 20 : (int)k};
        if (dsv4_forward(m, &it, 1, err)) return dsv4_err_prefix(err, "truncate: re-running tokens from the checkpoint");
    }
    return 0;
}

int dsv4_forward(dsv4_model *m, dsv4_fwd_item *items, int n_items, dsv4_err *err) {
    const dsv4_config *c = m->cfg;
    double tt = fwd_now(), tn;
    m->fwd_calls++;
#define FWD_LAP(i) (tn = fwd_now(), m->fwd_t[i] += tn - tt, tt = tn)
    /* validate everything first: on error nothing has changed */
    for (int i = 0; i < n_items; i++) {
        if (!items[i].st || items[i].n < 1 || !items[i].tokens)
            return dsv4_errf(err, "forward: item %d has no tokens", i);
        if (items[i].st->broken)
            return dsv4_errf(err, "forward: item %d's sequence is unusable (a failed step could not be undone); "
                                  "truncate it to 0 or free it", i);
        for (int j = 0; j < i; j++)
            if (items[j].st == items[i].st) return dsv4_errf(err, "forward: a sequence appears twice in one step");
        for (int j = 0; j < items[i].n; j++)
            if (items[i].tokens[j] < 0 || items[i].tokens[j] >= c->vocab_size)
                return dsv4_errf(err, "forward: token %d at index %d of item %d is outside the vocabulary [0, %d)",
                                 items[i].tokens[j], j, i, c->vocab_size);
        if (items[i].st->len + items[i].n > (int64_t)INT32_MAX)
            return dsv4_errf(err, "forward: sequence would exceed 2^31 tokens");
        if (items[i].st->len + items[i].n > c->max_position)
            return dsv4_errf(err,
                             "forward: item %d would reach %lld tokens, past the model's max_position_embeddings "
                             "(%lld)",
                             i, (long long)(items[i].st->len + items[i].n), (long long)c->max_position);
    }
    for (int i = 0; i < n_items; i++)
        if (dsv4_state_reserve(items[i].st, items[i].n, err)) return -1;

    FWD_LAP(0);
    trace_shim shim = {m->trace, m->trace_user, items};
    dsv4_route_trace_fn saved = m->trace;
    void *saved_user = m->trace_user;
    if (saved) {
        m->trace = shim_fn;
        m->trace_user = &shim;
    }
    if (n_items > m->done_cap) { /* grows only when a call has more items than any before */
        int *p = realloc(m->done, sizeof(int) * (size_t)n_items);
        if (!p) return dsv4_errf(err, "forward: out of memory");
        m->done = p;
        m->done_cap = n_items;
    }
    int *done = m->done;
    memset(done, 0, sizeof(int) * (size_t)n_items);
    int rc = 0, unchecked = 0, n_undo = 0;
    size_t hcd = (size_t)c->hc_mult * c->dim;
    for (;;) {
        /* ----- build one sub-batch ----- */
        int rows = 0, nseg = 0;
        for (int i = 0; i < n_items && rows < m->max_rows; i++) {
            dsv4_fwd_item *it = &items[i];
            int left = it->n - done[i];
            if (left <= 0) continue;
            int64_t len = it->st->len, every = it->st->snapshot_every;
            int64_t to_ckpt = every - len % every; /* stop at the next checkpoint */
            int take = left;
            if (take > m->max_rows - rows) take = m->max_rows - rows;
            if (take > to_ckpt) take = (int)to_ckpt;
            segment *sg = &m->segs[nseg];
            *sg = (segment){.item = i, .st = it->st, .tok = it->tokens + done[i], .n = take, .row0 = rows, .pos0 = len};
            for (int j = 0; j < take; j++) {
                m->pos[rows + j] = len + j;
                m->tok[rows + j] = sg->tok[j];
                m->seg_of[rows + j] = nseg;
            }
            rows += take;
            nseg++;
        }
        if (!rows) break;
        /* ----- embedding into hc_mult streams (spec §2.1) ----- */
        FWD_LAP(0);
        mark_segment(m, m->n_all + 1);
        OPS(m)->embed(B_(m), m->y, m->tok, rows, &m->w->embed);
        int ncl = 0; /* y into each stream: one copy_list launch, not rows x hc_mult copies */
        for (int r = 0; r < rows; r++)
            for (int k = 0; k < c->hc_mult; k++)
                cl_add(m, &ncl, m->X + r * hcd + (size_t)k * c->dim, m->y + (size_t)r * c->dim,
                       sizeof(float) * c->dim);
        cl_flush(m, &ncl);
        if (m->n_hash) { /* every hash layer's ids of this pass, one upload */
            size_t per = (size_t)rows * c->n_active;
            for (int l = 0; l < c->n_layers; l++)
                if (m->hash_slot[l] >= 0) hash_ids(m, &m->w->layers[l], rows, m->hash_all + m->hash_slot[l] * per);
            OPS(m)->upload(B_(m), m->hash_dev, m->hash_all, sizeof(int32_t) * per * m->n_hash);
        }
        FWD_LAP(1);
        /* segments: layer 0 alone, then seg_layers layers each (DSV4_SEG_LAYERS: fewer
         * boundaries, at which a device drains; 2 measured no faster than 1 on 20 Flash layers,
         * H200, 2026-12-01: 3.92 against 3.90 ms per decode step); the key is the segment's
         * first layer */
        m->hc_ready = -1;
        for (int l = 0; l < c->n_layers && !rc; l++) {
            if (l == 0 || (seg_first(m, l) && seg_at(m, l) == 0)) mark_segment(m, l);
            rc = layer_forward(m, l, rows, nseg, l + 1 < c->n_layers ? l + 1 : -1, err);
        }
        mark_segment(m, -1);
        FWD_LAP(2);
        if (rc) {
            n_undo = nseg;
            break;
        }
        /* ----- bookkeeping, then logits for the rows that want them ----- */
        int nl = 0;
        for (int s = 0; s < nseg; s++) {
            segment *sg = &m->segs[s];
            dsv4_fwd_item *it = &items[sg->item];
            for (int j = 0; j < sg->n; j++) sg->st->tokens[sg->pos0 + j] = sg->tok[j];
            cl_add(m, &ncl, sg->st->last_x, m->X + (size_t)(sg->row0 + sg->n - 1) * hcd, sizeof(float) * hcd);
            for (int j = 0; j < sg->n; j++) {
                int global = done[sg->item] + j;
                if (!it->logits) continue;
                if (!it->all_logits && global != it->n - 1) continue;
                cl_add(m, &ncl, m->Xs + (size_t)nl * hcd, m->X + (size_t)(sg->row0 + j) * hcd, sizeof(float) * hcd);
                m->cpos[nl] = (int64_t)sg->item * ((int64_t)1 << 32) + global; /* where the row goes */
                nl++;
            }
        }
        cl_flush(m, &ncl); /* the states' last rows and the head's rows: one copy_list launch */
        FWD_LAP(4);
        if (nl) {
            mark_segment(m, m->n_all);
            head_rows(m, m->Xs, nl, &m->w->hc_head_fn, &m->w->hc_head_base, &m->w->hc_head_scale, &m->w->norm);
            for (int i = 0; i < nl; i++) {
                int item = (int)(m->cpos[i] >> 32), global = (int)(m->cpos[i] & 0xffffffff);
                dsv4_fwd_item *it = &items[item];
                float *dst = it->logits + (it->all_logits ? (size_t)global * c->vocab_size : 0);
                OPS(m)->download(B_(m), dst, m->logits + (size_t)i * c->vocab_size, sizeof(float) * c->vocab_size);
            }
        }
        FWD_LAP(5);
        /* ops cannot fail; a device backend keeps its first error until asked (backend.h), and
         * every op after a failure is a no-op, so one check after the head covers the layers
         * too (one wait per sub-batch instead of two); no length moves before it (a failed
         * step's device writes, KV rows and last_x among them, are past the state's length or
         * rewritten by the next step) */
        if (OPS(m)->check && (rc = OPS(m)->check(B_(m), err))) {
            n_undo = nseg;
            break;
        }
        FWD_LAP(3);
        /* every segment is committed before a failed checkpoint ends the call: its compressors
         * have emitted their rows already, and the undo below takes each sequence back whole */
        for (int s = 0; s < nseg; s++) {
            segment *sg = &m->segs[s];
            sg->st->len += sg->n;
            done[sg->item] += sg->n;
            if (sg->st->len % sg->st->snapshot_every == 0) {
                unchecked = 1; /* the snapshot may issue backend copies */
                if (!rc) rc = dsv4_state_checkpoint(sg->st, err);
            }
        }
        if (rc) break;
    }
    m->trace = saved;
    m->trace_user = saved_user;
    if (rc) { /* on error every sequence goes back to its length before the call */
        dsv4_err e2 = {{0}};
        /* the lengths first: the undos below re-run tokens through dsv4_forward, which reuses
         * m->done and m->segs (a failed sub-batch's lengths have not moved: len - done is the
         * length before the call for every item) */
        struct back {
            dsv4_state *st;
            int64_t len;
        } *bk = malloc(sizeof *bk * (size_t)n_items);
        segment *u = n_undo ? malloc(sizeof *u * (size_t)n_undo) : NULL;
        if (!bk || (n_undo && !u)) dsv4_errf(&e2, "out of memory");
        for (int i = 0; bk && i < n_items; i++) bk[i] = (struct back){items[i].st, items[i].st->len - done[i]};
        if (u) memcpy(u, m->segs, sizeof *u * (size_t)n_undo);
        /* the failed sub-batch's states, then the sub-batches committed before it (a chunk cut
         * at a checkpoint, rows past max_rows); each state on its own: one that cannot be
         * restored is marked broken, so no later call uses it as if it were whole (the first
         * such error joins the call's) */
        if (!bk || (n_undo && !u)) /* which states to take back to where is not known */
            for (int i = 0; i < n_items; i++) items[i].st->broken = 1;
        for (int s = 0; u && s < n_undo; s++) {
            dsv4_err e3 = {{0}};
            if (u[s].st->broken || !state_undo(m, u[s].st, u[s].pos0, u[s].n, &e3)) continue;
            u[s].st->broken = 1;
            if (!e2.msg[0]) e2 = e3;
        }
        for (int i = 0; bk && i < n_items; i++) {
            dsv4_err e3 = {{0}};
            dsv4_state *st = bk[i].st;
            if (st->broken || st->len <= bk[i].len || !dsv4_forward_truncate(m, st, bk[i].len, &e3)) continue;
            st->broken = 1;
            if (!e2.msg[0]) e2 = e3;
        }
        free(u);
        free(bk);
        if (e2.msg[0]) err_also(err, "restoring the sequences to their lengths", &e2);
    }
    if (!rc && unchecked && OPS(m)->check) rc = OPS(m)->check(B_(m), err);
    return rc;
}

/* ----- greedy decoding (forward.h) -----
 * Step s embeds gtok[s] and writes its argmax to gtok[s + 1], both in backend memory, so the
 * host records step s + 1 while the device still runs step s: no logits come back and nothing
 * waits until the tokens are downloaded at the end (or a checkpoint's copies).  The hash layers'
 * ids come from gather_ids on the same token.  What each step runs is dsv4_forward's one-row
 * sub-batch: the same ops and arguments, so the same values; only its graph segments are longer
 * (seg_layers_greedy layers: the host is ahead of the device here, so a boundary buys nothing). */
static int greedy_host(dsv4_model *m, dsv4_state *st, int32_t first, int n_steps, int32_t *out, dsv4_err *err) {
    const dsv4_config *c = m->cfg;
    if (!m->glog && !(m->glog = malloc(sizeof(float) * (size_t)c->vocab_size)))
        return dsv4_errf(err, "greedy: out of memory");
    int32_t tok = first;
    for (int s = 0; s < n_steps; s++) {
        dsv4_fwd_item it = {.st = st, .tokens = &tok, .n = 1, .logits = m->glog, .all_logits = 0, .tag = NULL};
        if (dsv4_forward(m, &it, 1, err)) return -1;
        out[s] = tok = dsv4_argmax_row(m->glog, c->vocab_size);
    }
    return 0;
}

static int greedy_device(dsv4_model *m, dsv4_state *st, int32_t first, int n_steps, int32_t *out, dsv4_err *err) {
    const dsv4_config *c = m->cfg;
    const dsv4_backend_ops *op = OPS(m);
    dsv4_backend *b = B_(m);
    if (n_steps + 1 > m->gtok_cap) {
        if (m->gtok) op->free(b, m->gtok);
        m->gtok_cap = 0;
        if (!(m->gtok = op->alloc(b, sizeof(int32_t) * (size_t)(n_steps + 1))))
            return dsv4_errf(err, "greedy: out of backend memory for %d tokens", n_steps + 1);
        m->gtok_cap = n_steps + 1;
    }
    if (dsv4_state_reserve(st, n_steps, err)) return -1;
    m->fwd_calls++;
    const int64_t len0 = st->len;
    size_t hcd = (size_t)c->hc_mult * c->dim;
    int k = c->n_active, rc = 0, synced = 0, issued = 0; /* synced: tokens [0, synced) of out are on the host */
    op->upload(b, m->gtok, &first, sizeof(int32_t));
    for (int s = 0; s < n_steps && !rc; s++) {
        int64_t len = st->len;
        issued = s + 1; /* a step that fails part way has written device state too */
        m->pos[0] = len;
        m->tok[0] = -1; /* not known on the host (no trace reads it here) */
        m->seg_of[0] = 0;
        m->segs[0] = (segment){.item = 0, .st = st, .tok = &m->tok[0], .n = 1, .row0 = 0, .pos0 = len};
        mark_segment(m, m->n_all + 1);
        op->embed(b, m->y, m->gtok + s, 1, &m->w->embed);
        int ncl = 0; /* y into each stream: one copy_list launch (kernels chain early; copies do not) */
        for (int j = 0; j < c->hc_mult; j++) cl_add(m, &ncl, m->X + (size_t)j * c->dim, m->y, sizeof(float) * c->dim);
        cl_flush(m, &ncl);
        for (int l = 0; l < c->n_layers; l++)
            if (m->hash_slot[l] >= 0)
                op->gather_ids(b, m->hash_dev + (size_t)m->hash_slot[l] * k, m->gtok + s, 1,
                               &m->w->layers[l].tid2eid, k);
        m->hc_ready = -1;
        for (int l = 0; l < c->n_layers && !rc; l++) {
            if ((l == 0 && m->l0_split) || (seg_first(m, l) && seg_at(m, l) == 0)) mark_segment(m, l);
            rc = layer_forward(m, l, 1, 1, l + 1 < c->n_layers ? l + 1 : -1, err);
        }
        mark_segment(m, -1);
        if (rc) break;
        /* the head's segment starts with the state's last row (a copy_list launch, so the head's first
         * kernel starts early behind it) and reads X itself: nothing writes X before the next step */
        mark_segment(m, m->n_all);
        cl_add(m, &ncl, st->last_x, m->X, sizeof(float) * hcd);
        cl_flush(m, &ncl);
        head_rows(m, m->X, 1, &m->w->hc_head_fn, &m->w->hc_head_base, &m->w->hc_head_scale, &m->w->norm);
        op->argmax(b, m->gtok + s + 1, m->logits, 1, c->vocab_size);
        st->len++;
        if (st->len % st->snapshot_every == 0) { /* its copies wait for the device anyway */
            op->download(b, out + synced, m->gtok + 1 + synced, sizeof(int32_t) * (size_t)(s + 1 - synced));
            synced = s + 1;
            if (op->check && (rc = op->check(b, err))) break;
            rc = dsv4_state_checkpoint(st, err);
        }
    }
    if (!rc && synced < n_steps)
        op->download(b, out + synced, m->gtok + 1 + synced, sizeof(int32_t) * (size_t)(n_steps - synced));
    if (!rc && op->check) rc = op->check(b, err);
    if (rc) { /* every step issued is undone */
        dsv4_err e2 = {{0}};
        if (state_undo(m, st, len0, issued, &e2)) err_also(err, "restoring the sequence to its length", &e2);
        return -1;
    }
    for (int s = 0; s < n_steps; s++) st->tokens[len0 + s] = s ? out[s - 1] : first;
    return 0;
}

int dsv4_forward_greedy(dsv4_model *m, dsv4_state *st, int32_t first, int n_steps, int32_t *out, dsv4_err *err) {
    const dsv4_config *c = m->cfg;
    const dsv4_backend_ops *op = OPS(m);
    if (!st || !out || n_steps < 1) return dsv4_errf(err, "greedy: no sequence, output or steps");
    if (st->broken) return dsv4_errf(err, "greedy: the sequence is unusable (a failed step could not be undone)");
    if (first < 0 || first >= c->vocab_size)
        return dsv4_errf(err, "greedy: token %d is outside the vocabulary [0, %d)", first, c->vocab_size);
    if (st->len + n_steps > (int64_t)INT32_MAX) return dsv4_errf(err, "greedy: sequence would exceed 2^31 tokens");
    if (st->len + n_steps > c->max_position)
        return dsv4_errf(err,
                         "greedy: %d steps would reach %lld tokens, past the model's max_position_embeddings (%lld)",
                         n_steps, (long long)(st->len + n_steps), (long long)c->max_position);
    /* traces want host copies of each step's tokens and routing: the host loop */
    if (!op->argmax || !op->gather_ids || m->trace || m->op_trace) return greedy_host(m, st, first, n_steps, out, err);
    int keep = m->seg_layers; /* segments change only where graphs begin, never an op */
    m->seg_layers = m->seg_layers_greedy;
    m->l0_split = m->l0_split_greedy;
    int rc = greedy_device(m, st, first, n_steps, out, err);
    m->seg_layers = keep;
    m->l0_split = 1;
    return rc;
}

/* ----- MTP (spec §2.8) ----- */
int dsv4_forward_mtp(dsv4_model *m, dsv4_state *st, int mtp_index, int32_t token, float *logits, dsv4_err *err) {
    const dsv4_config *c = m->cfg;
    if (mtp_index < 0 || mtp_index >= c->n_mtp) return dsv4_errf(err, "mtp: the model has %d MTP blocks", c->n_mtp);
    if (st->len < 1) return dsv4_errf(err, "mtp: the sequence is empty (nothing to draft from)");
    if (st->broken) return dsv4_errf(err, "mtp: the sequence is unusable (a failed step could not be undone)");
    if (token < 0 || token >= c->vocab_size)
        return dsv4_errf(err, "mtp: token %d is outside the vocabulary [0, %d)", token, c->vocab_size);
    int layer = c->n_layers + mtp_index;
    const dsv4_layer_w *L = &m->w->layers[layer];
    const dsv4_backend_ops *op = OPS(m);
    dsv4_backend *b = B_(m);
    int bf = m->num.act_bf16, lf = lin_flags(&m->num), D = c->dim, hc = c->hc_mult;
    float eps = (float)c->norm_eps;
    /* one row at position len-1: e = enorm(embed[token]); X'_k = e_proj e + h_proj hnorm(X_k) */
    m->tok[0] = token;
    m->pos[0] = st->len - 1;
    m->segs[0] = (segment){.item = -1, .st = st, .tok = &m->tok[0], .n = 1, .row0 = 0, .pos0 = st->len - 1};
    m->seg_of[0] = 0;
    op->embed(b, m->y, m->tok, 1, &m->w->embed);
    op->rmsnorm(b, m->y, m->y, 1, D, &L->enorm, eps, bf);
    op->matmul(b, m->a, m->y, 1, &L->e_proj, lf, bf);
    op->copy(b, m->Xb, st->last_x, sizeof(float) * (size_t)hc * D); /* state memory is backend memory */
    op->rmsnorm(b, m->Xb, m->Xb, hc, D, &L->hnorm, eps, bf);
    op->matmul(b, m->X, m->Xb, hc, &L->h_proj, lf, bf); /* the hc streams are rows here */
    op->download(b, m->mtp_x, m->X, sizeof(float) * (size_t)hc * D);
    op->download(b, m->mtp_a, m->a, sizeof(float) * (size_t)D);
    for (int k = 0; k < hc; k++)
        for (int d = 0; d < D; d++) {
            float v = m->mtp_x[(size_t)k * D + d] + m->mtp_a[d];
            m->mtp_x[(size_t)k * D + d] = bf ? dsv4_round_bf16(v) : v;
        }
    op->upload(b, m->X, m->mtp_x, sizeof(float) * (size_t)hc * D);
    dsv4_route_trace_fn saved = m->trace;
    m->trace = NULL;
    m->hc_ready = -1;
    int rc = layer_forward(m, layer, 1, 1, -1, err);
    m->trace = saved;
    if (rc) return -1;
    head_rows(m, m->X, 1, &L->hc_head_fn, &L->hc_head_base, &L->hc_head_scale, &L->norm);
    op->download(b, logits, m->logits, sizeof(float) * c->vocab_size);
    return op->check ? op->check(b, err) : 0;
}
