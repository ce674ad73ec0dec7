/* backend/cpu: the reference backend.  Every op of backend.h in plain C + OpenMP.
 *
 * Threads go over output features (matmul), rows x heads (attention), rows x keys
 * (indexer) and rows (norms).  Weights stay mmap'd in their stored format: a
 * matmul dequantizes one weight row at a time into a per-thread buffer and uses
 * it for every row of the batch, so a prefill chunk streams the weights once.
 * Scratch memory comes from an arena reserved up front (ops->reserve is not in the
 * table: the CPU backend grows its arena on the first calls, then reuses it;
 * `spills` counts the calls that had to allocate, for tests).
 */
#include "backend/cpu/cpu.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "model/quant.h"

/* ----- scratch arena ----- */
typedef struct {
    char *base;
    size_t cap, top;
    size_t want;       /* high-water mark requested, grown into at the next empty point */
    void *spill[64];   /* allocations that did not fit, freed when popped */
    size_t spill_at[64];
    int n_spill;
    long spills;       /* how many allocations did not fit (0 after warm-up) */
} arena;

typedef struct {
    arena a;
    int n_threads;
    long sides[2]; /* side(b, 1) calls that opened a chain, join calls that closed one */
    int side_open;
} cpu_impl;

static void *arena_push(arena *a, size_t bytes) {
    bytes = (bytes + 63) & ~(size_t)63;
    if (a->top + bytes > a->want) a->want = a->top + bytes;
    if (a->top + bytes <= a->cap) {
        void *p = a->base + a->top;
        a->top += bytes;
        return p;
    }
    a->spills++;
    void *p = aligned_alloc(64, bytes);
    if (!p) abort(); /* out of memory for scratch: broken invariant (sizes come from the config) */
    if (a->n_spill >= 64) abort(); /* more than 64 nested scratch buffers: a bug */
    a->spill[a->n_spill] = p;
    a->spill_at[a->n_spill++] = a->top;
    a->top += bytes; /* spilled buffers still take their place in the stack order */
    return p;
}

static void arena_pop(arena *a, size_t mark) {
    while (a->n_spill > 0 && a->spill_at[a->n_spill - 1] >= mark) free(a->spill[--a->n_spill]);
    a->top = mark;
    if (mark == 0 && a->n_spill == 0 && a->want > a->cap) {
        /* grow at an empty point so later calls fit */
        free(a->base);
        size_t cap = a->want + a->want / 4;
        a->base = aligned_alloc(64, (cap + 63) & ~(size_t)63);
        if (!a->base) abort();
        a->cap = (cap + 63) & ~(size_t)63;
    }
}

static cpu_impl *impl(dsv4_backend *b) { return (cpu_impl *)b->impl; }
#define PUSH(b, n, T) ((T *)arena_push(&impl(b)->a, (size_t)(n) * sizeof(T)))
#define MARK(b) (impl(b)->a.top)
#define POP(b, m) arena_pop(&impl(b)->a, (m))

long dsv4_backend_cpu_spills(dsv4_backend *b) { return impl(b)->a.spills; }
long dsv4_backend_cpu_sides(dsv4_backend *b, int which) { return impl(b)->sides[which ? 1 : 0]; }

/* ----- small helpers ----- */
/* Parallel regions cost a fork/join and a barrier; below ~64K multiply-adds a
 * region is slower than one thread (and much slower when cores are shared and
 * OpenMP threads spin), so small ops run on the calling thread. */
#define PAR(work) ((work) >= 65536.0)

static inline float bf(float v) { return dsv4_round_bf16(v); }

/* dot product with 8 independent partial sums (vectorizes without -ffast-math) */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out[r*ldo + o] = W[o0+o] . x[r*ldx ...] for o < no.  Flags: round W rows to bf16, round out to bf16. */
static void mm(dsv4_backend *b, float *out, int64_t ldo, const float *x, int64_t ldx, int rows, const dsv4_weight *w,
               int64_t o0, int64_t no, int w_bf16, int out_bf16) {
    int64_t K = w->cols;
    int nt = omp_get_max_threads();
    size_t m = MARK(b);
    float *wrows = PUSH(b, (size_t)nt * (size_t)K, float);
#pragma omp parallel for schedule(static) if (PAR((double)no * K * rows))
    for (int64_t o = 0; o < no; o++) {
        float *wr = wrows + (size_t)omp_get_thread_num() * (size_t)K;
        if (w->fmt == DSV4_WF_BF16) { /* inline widening: the head and gates are bf16, this is their hot loop */
            const uint16_t *src = (const uint16_t *)w->data + (size_t)(o0 + o) * (size_t)K;
            uint32_t *dst = (uint32_t *)wr;
            for (int64_t i = 0; i < K; i++) dst[i] = (uint32_t)src[i] << 16;
        } else {
            dsv4_weight_row(w, o0 + o, wr);
        }
        if (w_bf16) dsv4_round_bf16_n(wr, K);
        for (int r = 0; r < rows; r++) {
            float v = dot(wr, x + (size_t)r * (size_t)ldx, K);
            out[(size_t)r * (size_t)ldo + (size_t)o] = out_bf16 ? bf(v) : v;
        }
    }
    POP(b, m);
}

/* act_quant copy of x rows (1x128 ue8m0 e4m3, spec §2.0) into scratch */
static const float *act_quant(dsv4_backend *b, const float *x, int rows, int64_t K) {
    float *q = PUSH(b, (size_t)rows * (size_t)K, float);
    for (int r = 0; r < rows; r++) dsv4_fp8_quant_dequant(x + (size_t)r * K, q + (size_t)r * K, K, 128, NULL);
    return q;
}

static int quantized(const dsv4_weight *w) {
    return w->fmt == DSV4_WF_FP8 || w->fmt == DSV4_WF_MXFP4 || w->fmt == DSV4_WF_NVFP4;
}

/* ----- memory ----- */
static void *cpu_alloc(dsv4_backend *b, size_t bytes) {
    (void)b;
    return calloc(1, bytes ? bytes : 1);
}
static void cpu_free(dsv4_backend *b, void *p) {
    (void)b;
    free(p);
}
static void cpu_copy(dsv4_backend *b, void *dst, const void *src, size_t bytes) {
    (void)b;
    if (bytes) memmove(dst, src, bytes);
}

/* ----- ops ----- */
static void cpu_embed(dsv4_backend *b, float *out, const int32_t *tokens, int rows, const dsv4_weight *w) {
    (void)b;
    for (int r = 0; r < rows; r++) dsv4_weight_row(w, tokens[r], out + (size_t)r * (size_t)w->cols);
}

/* DSV4_LIN_DOT_MMA names a device arithmetic: the CPU op is the fp32 reference it is measured against */
static void cpu_matmul(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int flags,
                       int out_bf16) {
    size_t m = MARK(b);
    if ((flags & DSV4_LIN_ACT_FP8) && quantized(w)) x = act_quant(b, x, rows, w->cols);
    mm(b, out, w->rows, x, w->cols, rows, w, 0, w->rows, 0, out_bf16);
    POP(b, m);
}

static void cpu_matmul_grouped(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w,
                               int groups, int in_bf16, int out_bf16, int flags) {
    (void)flags; /* DSV4_LIN_DOT_MMA: a device arithmetic (cpu_matmul) */
    int64_t R = w->rows / groups, C = w->cols;
    size_t m = MARK(b);
    if (in_bf16) {
        float *xb = PUSH(b, (size_t)rows * (size_t)(groups * C), float);
        for (int64_t i = 0; i < rows * groups * C; i++) xb[i] = bf(x[i]);
        x = xb;
    }
    for (int g = 0; g < groups; g++)
        mm(b, out + g * R, w->rows, x + g * C, groups * C, rows, w, g * R, R, in_bf16, out_bf16);
    POP(b, m);
}

static void cpu_rmsnorm(dsv4_backend *b, float *out, const float *x, int rows, int dim, const dsv4_weight *w,
                        float eps, int out_bf16) {
    size_t m = MARK(b);
    float *wv = NULL;
    if (w) {
        wv = PUSH(b, dim, float);
        dsv4_weight_row(w, 0, wv);
    }
#pragma omp parallel for schedule(static) if (PAR((double)rows * dim))
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *o = out + (size_t)r * dim;
        float ss = 0, s;
        if (out_bf16 & DSV4_NORM_BF16_STEPS) { /* torch on a bf16 tensor: every step rounded (q's per-head RMS) */
            for (int i = 0; i < dim; i++) ss += bf(xr[i] * xr[i]);
            s = bf(1.0f / sqrtf(bf(bf(ss / (float)dim) + eps)));
        } else {
            for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
            s = 1.0f / sqrtf(ss / (float)dim + eps);
        }
        for (int i = 0; i < dim; i++) {
            float v = xr[i] * s;
            if (wv) v *= wv[i];
            o[i] = out_bf16 ? bf(v) : v; /* reference: fp32 x*rsqrt*w, then cast to bf16 (spec §2.0) */
        }
    }
    POP(b, m);
}

static void cpu_rope(dsv4_backend *b, float *x, int rows, int n_heads, int head_dim, int rope_dim,
                     const int64_t *pos, const double *freq, int inverse, int out_bf16) {
    (void)b;
    int half = rope_dim / 2;
#pragma omp parallel for schedule(static) if (PAR((double)rows * n_heads * rope_dim * 4))
    for (int r = 0; r < rows; r++) {
        for (int i = 0; i < half; i++) {
            /* transformers and the reference form the angle as an fp32 product pos * inv_freq */
            float a = (float)pos[r] * (float)freq[i];
            float c = cosf(a), s = sinf(a);
            if (inverse) s = -s;
            for (int h = 0; h < n_heads; h++) {
                float *p = x + (size_t)r * n_heads * head_dim + (size_t)h * head_dim + (head_dim - rope_dim) + 2 * i;
                float x0 = p[0], x1 = p[1];
                float y0 = x0 * c - x1 * s, y1 = x1 * c + x0 * s;
                p[0] = out_bf16 ? bf(y0) : y0;
                p[1] = out_bf16 ? bf(y1) : y1;
            }
        }
    }
}

/* the fused pairs: the two ops, so they are equal by construction */
static void cpu_norm_rope(dsv4_backend *b, float *x, int rows, int n_heads, int head_dim, const dsv4_weight *w,
                          float eps, int rope_dim, const int64_t *pos, const double *freq, int out_bf16) {
    cpu_rmsnorm(b, x, x, rows * n_heads, head_dim, w, eps, out_bf16);
    cpu_rope(b, x, rows, n_heads, head_dim, rope_dim, pos, freq, 0, out_bf16);
}

static void cpu_scale(dsv4_backend *b, float *x, size_t n, float s, int out_bf16) {
    (void)b;
    for (size_t i = 0; i < n; i++) x[i] = out_bf16 ? bf(x[i] * s) : x[i] * s;
}

static void cpu_sim(dsv4_backend *b, float *x, int rows, int stride, int col0, int width, int mode) {
    (void)b;
#pragma omp parallel for schedule(static) if (PAR((double)rows * width * 8))
    for (int r = 0; r < rows; r++) {
        float *p = x + (size_t)r * stride + col0;
        switch (mode) {
        case DSV4_SIM_BF16: dsv4_round_bf16_n(p, width); break;
        case DSV4_SIM_FP8_B64: dsv4_fp8_quant_dequant(p, p, width, 64, NULL); break;
        case DSV4_SIM_HAD_FP4_B32: /* rotate_activation is bf16 in and out, then fp4_act_quant */
            dsv4_hadamard(p, width);
            dsv4_round_bf16_n(p, width);
            dsv4_fp4_quant_dequant(p, p, width, 32);
            break;
        case DSV4_SIM_FP8_ROW: dsv4_fp8_quant_dequant(p, p, width, width, NULL); break;
        case DSV4_SIM_FP4_B32: dsv4_fp4_quant_dequant(p, p, width, 32); break;
        default: break;
        }
    }
}

static inline float sigmoidf_(float v) { return 1.0f / (1.0f + expf(-v)); }

/* m[r][0..nm) = (fn . xf) * rsqrt(mean(xf^2) + eps) for the HC mixes */
static void hc_mix(dsv4_backend *b, float *mix, const float *X, int rows, int64_t width, const dsv4_weight *fn,
                   float norm_eps, int gemm_bf16) {
    size_t m = MARK(b);
    const float *xs = X;
    if (gemm_bf16) {
        float *xb = PUSH(b, (size_t)rows * width, float);
        for (int64_t i = 0; i < rows * width; i++) xb[i] = bf(X[i]);
        xs = xb;
    }
    mm(b, mix, fn->rows, xs, width, rows, fn, 0, fn->rows, gemm_bf16, 0);
    for (int r = 0; r < rows; r++) {
        const float *xr = X + (size_t)r * width;
        float ss = 0;
        for (int64_t i = 0; i < width; i++) ss += xr[i] * xr[i];
        float s = 1.0f / sqrtf(ss / (float)width + norm_eps);
        for (int64_t j = 0; j < fn->rows; j++) mix[r * fn->rows + j] *= s;
    }
    POP(b, m);
}

/* comb from hc_pre's logits in place: row softmax + eps, then Sinkhorn (spec §2.3) */
static void hc_comb_form(float *C, int hc, int iters, float hc_eps) {
    for (int j = 0; j < hc; j++) { /* row softmax, + eps */
        float mx = -INFINITY;
        for (int k = 0; k < hc; k++)
            if (C[j * hc + k] > mx) mx = C[j * hc + k];
        float s = 0;
        for (int k = 0; k < hc; k++) s += (C[j * hc + k] = expf(C[j * hc + k] - mx));
        for (int k = 0; k < hc; k++) C[j * hc + k] = C[j * hc + k] / s + hc_eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0)
            for (int j = 0; j < hc; j++) { /* rows */
                float s = 0;
                for (int k = 0; k < hc; k++) s += C[j * hc + k];
                for (int k = 0; k < hc; k++) C[j * hc + k] /= s + hc_eps;
            }
        for (int k = 0; k < hc; k++) { /* columns */
            float s = 0;
            for (int j = 0; j < hc; j++) s += C[j * hc + k];
            for (int j = 0; j < hc; j++) C[j * hc + k] /= s + hc_eps;
        }
    }
}

static void cpu_hc_pre(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc,
                       int dim, const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                       float norm_eps, float hc_eps, int gemm_bf16, int out_bf16) {
    int nm = (2 + hc) * hc;
    size_t m = MARK(b);
    float *mix = PUSH(b, (size_t)rows * nm, float);
    float *bs = PUSH(b, nm, float), *sc = PUSH(b, 3, float);
    dsv4_weight_row(base, 0, bs);
    dsv4_weight_row(scale, 0, sc);
    hc_mix(b, mix, X, rows, (int64_t)hc * dim, fn, norm_eps, gemm_bf16);
    for (int r = 0; r < rows; r++) {
        const float *mr = mix + (size_t)r * nm;
        float pre[16];
        for (int j = 0; j < hc; j++) {
            pre[j] = sigmoidf_(mr[j] * sc[0] + bs[j]) + hc_eps;
            post[r * hc + j] = 2.0f * sigmoidf_(mr[hc + j] * sc[1] + bs[hc + j]);
        }
        float *C = comb + (size_t)r * hc * hc;
        for (int e = 0; e < hc * hc; e++) C[e] = mr[2 * hc + e] * sc[2] + bs[2 * hc + e];
        if (!(iters & DSV4_HC_COMB_LOGITS)) hc_comb_form(C, hc, iters & DSV4_HC_ITERS, hc_eps);
        const float *xr = X + (size_t)r * hc * dim;
        float *yr = y + (size_t)r * dim;
        for (int d = 0; d < dim; d++) {
            float s = 0;
            for (int j = 0; j < hc; j++) s += pre[j] * xr[(size_t)j * dim + d];
            yr[d] = out_bf16 ? bf(s) : s;
        }
    }
    POP(b, m);
}

static void cpu_hc_pre_norm(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc,
                            int dim, const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale,
                            int iters, float norm_eps, float hc_eps, int gemm_bf16, int out_bf16,
                            const dsv4_weight *y_norm, float y_eps) {
    cpu_hc_pre(b, y, post, comb, X, rows, hc, dim, fn, base, scale, iters, norm_eps, hc_eps, gemm_bf16, out_bf16);
    cpu_rmsnorm(b, y, y, rows, dim, y_norm, y_eps, out_bf16);
}

static void cpu_hc_post(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post,
                        const float *comb, int rows, int hc, int dim, int state_bf16) {
    (void)b;
#pragma omp parallel for schedule(static) if (PAR((double)rows * hc * hc * dim))
    for (int r = 0; r < rows; r++) {
        const float *C = comb + (size_t)r * hc * hc, *Rr = R + (size_t)r * hc * dim, *orow = o + (size_t)r * dim;
        float *Xr = Xout + (size_t)r * hc * dim;
        for (int k = 0; k < hc; k++)
            for (int d = 0; d < dim; d++) {
                float v = post[r * hc + k] * orow[d];
                for (int j = 0; j < hc; j++) v += C[j * hc + k] * Rr[(size_t)j * dim + d];
                Xr[(size_t)k * dim + d] = state_bf16 ? bf(v) : v;
            }
    }
}

static void cpu_hc_head(dsv4_backend *b, float *y, const float *X, int rows, int hc, int dim, const dsv4_weight *fn,
                        const dsv4_weight *base, const dsv4_weight *scale, float norm_eps, float hc_eps,
                        int gemm_bf16, int out_bf16) {
    size_t m = MARK(b);
    float *mix = PUSH(b, (size_t)rows * hc, float);
    float *bs = PUSH(b, hc, float), *sc = PUSH(b, 1, float);
    dsv4_weight_row(base, 0, bs);
    dsv4_weight_row(scale, 0, sc);
    hc_mix(b, mix, X, rows, (int64_t)hc * dim, fn, norm_eps, gemm_bf16);
    for (int r = 0; r < rows; r++) {
        float pre[16];
        for (int j = 0; j < hc; j++) pre[j] = sigmoidf_(mix[r * hc + j] * sc[0] + bs[j]) + hc_eps;
        const float *xr = X + (size_t)r * hc * dim;
        for (int d = 0; d < dim; d++) {
            float s = 0;
            for (int j = 0; j < hc; j++) s += pre[j] * xr[(size_t)j * dim + d];
            y[(size_t)r * dim + d] = out_bf16 ? bf(s) : s;
        }
    }
    POP(b, m);
}

/* The key list of each row (window pointers, then compressed rows by pick or in order) is
 * built first; the arithmetic over it is the reference order: scores in key order, the
 * sink in the max and the denominator, p_j K_j summed in key order. */
static void cpu_sparse_attn(dsv4_backend *b, float *out, const float *q, int rows, int n_heads, int head_dim,
                            const float *const *win, const int *n_win, int max_win, const float *const *comp_base,
                            const int *n_comp, const int32_t *picks, const int *n_picks, int topk,
                            const float *sink, float scale, int prob_bf16, int out_bf16) {
    int max_kv = 1;
    for (int r = 0; r < rows; r++) {
        int nc = !comp_base || !comp_base[r] ? 0 : picks ? n_picks[r] : n_comp[r];
        if (n_win[r] + nc > max_kv) max_kv = n_win[r] + nc;
    }
    int nt = omp_get_max_threads();
    size_t m = MARK(b);
    const float **kv = PUSH(b, (size_t)rows * (size_t)max_kv, const float *);
    int *n_kv = PUSH(b, rows, int);
    for (int r = 0; r < rows; r++) {
        const float **kl = kv + (size_t)r * max_kv;
        int n = 0;
        for (int j = 0; j < n_win[r]; j++) kl[n++] = win[(size_t)r * max_win + j];
        if (comp_base && comp_base[r]) {
            if (picks)
                for (int j = 0; j < n_picks[r]; j++)
                    kl[n++] = comp_base[r] + (size_t)picks[(size_t)r * topk + j] * head_dim;
            else
                for (int t = 0; t < n_comp[r]; t++) kl[n++] = comp_base[r] + (size_t)t * head_dim;
        }
        n_kv[r] = n;
    }
    float *sbuf = PUSH(b, (size_t)nt * (size_t)max_kv, float);
#pragma omp parallel for schedule(dynamic, 1) if (PAR((double)rows * n_heads * head_dim * max_kv))
    for (int rh = 0; rh < rows * n_heads; rh++) {
        int r = rh / n_heads, h = rh % n_heads;
        const float *qh = q + ((size_t)r * n_heads + h) * head_dim;
        float *oh = out + ((size_t)r * n_heads + h) * head_dim;
        float *s = sbuf + (size_t)omp_get_thread_num() * (size_t)max_kv;
        const float *const *kr = kv + (size_t)r * max_kv;
        int n = n_kv[r];
        float mx = sink[h];
        for (int j = 0; j < n; j++) {
            s[j] = dot(qh, kr[j], head_dim) * scale;
            if (s[j] > mx) mx = s[j];
        }
        float den = expf(sink[h] - mx);
        for (int j = 0; j < n; j++) den += (s[j] = expf(s[j] - mx));
        for (int d = 0; d < head_dim; d++) oh[d] = 0;
        for (int j = 0; j < n; j++) {
            float p = s[j] / den;
            if (prob_bf16) p = bf(p);
            for (int d = 0; d < head_dim; d++) oh[d] += p * kr[j][d];
        }
        if (out_bf16) dsv4_round_bf16_n(oh, head_dim);
    }
    POP(b, m);
}

static void cpu_indexer_scores(dsv4_backend *b, float *score, const float *q, const float *w, int rows, int n_heads,
                               int head_dim, const float *const *key_base, const int *n_keys, int max_keys,
                               int score_bf16) {
    (void)b;
#pragma omp parallel for schedule(dynamic, 4) if (PAR((double)rows * max_keys * n_heads * head_dim))
    for (int64_t rj = 0; rj < (int64_t)rows * max_keys; rj++) {
        int r = (int)(rj / max_keys), j = (int)(rj % max_keys);
        if (j >= n_keys[r]) continue;
        const float *k = key_base[r] + (size_t)j * head_dim;
        float s = 0;
        for (int h = 0; h < n_heads; h++) {
            float d = dot(q + ((size_t)r * n_heads + h) * head_dim, k, head_dim);
            if (d < 0) d = 0;
            /* bf16: the reference's einsum rounds each dot, the weight multiply each product, and
             * its .sum over heads accumulates in fp32 and rounds once (spec §2.5) */
            if (score_bf16) s += bf(bf(d) * w[r * n_heads + h]);
            else s += d * w[r * n_heads + h];
        }
        score[(size_t)r * max_keys + j] = score_bf16 ? bf(s) : s;
    }
}

typedef struct {
    float v;
    int32_t i;
} scored;

static int cmp_desc(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->v > y->v) return -1;
    if (x->v < y->v) return 1;
    return (x->i > y->i) - (x->i < y->i); /* ties: lower index first */
}
static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static void cpu_topk(dsv4_backend *b, int32_t *idx, int *n_out, const float *score, int rows, int stride,
                     const int *n, int k) {
    size_t m = MARK(b);
    scored *buf = PUSH(b, stride > 0 ? stride : 1, scored);
    for (int r = 0; r < rows; r++) {
        int nr = n[r], take = nr < k ? nr : k;
        int32_t *ir = idx + (size_t)r * k;
        if (nr <= k) {
            for (int j = 0; j < nr; j++) ir[j] = j;
        } else {
            for (int j = 0; j < nr; j++) buf[j] = (scored){score[(size_t)r * stride + j], j};
            qsort(buf, (size_t)nr, sizeof *buf, cmp_desc);
            for (int j = 0; j < take; j++) ir[j] = buf[j].i;
            qsort(ir, (size_t)take, sizeof *ir, cmp_i32);
        }
        n_out[r] = take;
    }
    POP(b, m);
}

static void cpu_add_cyclic(dsv4_backend *b, float *x, const float *y, int rows, int width, int period,
                           int first) {
    (void)b;
    for (int i = 0; i < rows; i++) {
        const float *yr = y + (size_t)((first + i) % period) * width;
        float *xr = x + (size_t)i * width;
        for (int c = 0; c < width; c++) xr[c] += yr[c];
    }
}

static void cpu_add_cyclic_pos(dsv4_backend *b, float *x, const float *y, int rows, int width, int period,
                               const int64_t *pos) {
    (void)b;
    for (int i = 0; i < rows; i++) {
        const float *yr = y + (size_t)(pos[i] % period) * width;
        float *xr = x + (size_t)i * width;
        for (int c = 0; c < width; c++) xr[c] += yr[c];
    }
}

static void cpu_copy_list(dsv4_backend *b, int n, void *const *dst, const void *const *src, const size_t *bytes) {
    (void)b;
    for (int i = 0; i < n; i++) memmove(dst[i], src[i], bytes[i]);
}

static void cpu_pool(dsv4_backend *b, float *out, const float *const *kv, const float *const *gate, int n,
                     int width) {
    (void)b;
    for (int c = 0; c < width; c++) {
        float mx = -INFINITY;
        for (int t = 0; t < n; t++)
            if (gate[t][c] > mx) mx = gate[t][c];
        float den = 0, acc = 0;
        for (int t = 0; t < n; t++) {
            float e = expf(gate[t][c] - mx);
            den += e;
            acc += e * kv[t][c];
        }
        out[c] = acc / den;
    }
}

static inline float sqrt_softplus(float z) {
    float sp = z > 20.0f ? z : log1pf(expf(z)); /* torch softplus threshold 20 */
    return sqrtf(sp);
}

static void cpu_route(dsv4_backend *b, int32_t *experts, float *weights, const float *logits, int rows,
                      int n_routed, int k, const float *bias, const int32_t *hash_ids, float scale) {
    size_t m = MARK(b);
    float *s = PUSH(b, n_routed, float);
    scored *sel = PUSH(b, n_routed, scored);
    for (int r = 0; r < rows; r++) {
        for (int e = 0; e < n_routed; e++) s[e] = sqrt_softplus(logits[(size_t)r * n_routed + e]);
        int32_t *er = experts + (size_t)r * k;
        if (hash_ids) {
            for (int j = 0; j < k; j++) er[j] = hash_ids[(size_t)r * k + j];
        } else {
            for (int e = 0; e < n_routed; e++) sel[e] = (scored){s[e] + (bias ? bias[e] : 0.0f), e};
            qsort(sel, (size_t)n_routed, sizeof *sel, cmp_desc);
            for (int j = 0; j < k; j++) er[j] = sel[j].i;
        }
        float sum = 0;
        for (int j = 0; j < k; j++) sum += s[er[j]];
        for (int j = 0; j < k; j++) weights[(size_t)r * k + j] = s[er[j]] / (sum + 1e-20f) * scale;
    }
    POP(b, m);
}

/* clamped SwiGLU of one FFN on nr gathered rows: h = silu(min(g, L)) * clamp(u, -L, L) */
static void ffn_rows(dsv4_backend *b, float *y, const float *x, int nr, const dsv4_ffn_w *f, float limit,
                     const float *pre_w2, int act_fp8, int act_bf16) {
    int64_t inter = f->w1.rows, dim = f->w1.cols;
    size_t m = MARK(b);
    const float *xq = (act_fp8 && quantized(&f->w1)) ? act_quant(b, x, nr, dim) : x;
    float *g = PUSH(b, (size_t)nr * inter, float), *u = PUSH(b, (size_t)nr * inter, float);
    mm(b, g, inter, xq, dim, nr, &f->w1, 0, inter, 0, act_bf16);
    mm(b, u, inter, xq, dim, nr, &f->w3, 0, inter, 0, act_bf16);
    for (int r = 0; r < nr; r++)
        for (int64_t i = 0; i < inter; i++) {
            float gv = g[r * inter + i], uv = u[r * inter + i];
            if (limit > 0) {
                if (gv > limit) gv = limit;
                if (uv > limit) uv = limit;
                if (uv < -limit) uv = -limit;
            }
            float h = gv / (1.0f + expf(-gv)) * uv;
            if (pre_w2) h *= pre_w2[r];
            g[r * inter + i] = act_bf16 ? bf(h) : h;
        }
    const float *hq = (act_fp8 && quantized(&f->w2)) ? act_quant(b, g, nr, inter) : g;
    mm(b, y, dim, hq, inter, nr, &f->w2, 0, dim, 0, act_bf16);
    POP(b, m);
}

static void cpu_moe(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_ffn_w *experts,
                    int n_routed, const int32_t *e, const float *wgt, int k, const dsv4_ffn_w *shared, float limit,
                    int before_w2, int flags, int act_bf16, float out_scale) {
    /* DSV4_MOE_DOT_MMA names a device arithmetic: the CPU op is the fp32 reference it is measured against */
    int act_fp8 = flags & DSV4_MOE_ACT_FP8;
    (void)n_routed; /* the ids index experts[] directly (the forward pass checked the hash tables) */
    int64_t dim = shared ? shared->w1.cols : experts[e[0]].w1.cols;
    size_t m = MARK(b);
    float *acc = PUSH(b, (size_t)rows * dim, float);
    memset(acc, 0, sizeof(float) * (size_t)rows * dim);
    float *xg = PUSH(b, (size_t)rows * dim, float), *yg = PUSH(b, (size_t)rows * dim, float);
    float *wg = PUSH(b, rows, float);
    int *rid = PUSH(b, rows, int);
    /* visit the experts in id order; each gathers its rows so its weights stream once.  An id
     * repeated within a row (a hash table may hold one) counts as two slots: the buffers hold
     * `rows` gathered rows, so a pass that fills them runs and the gather goes on. */
    int max_e = -1;
    for (int i = 0; i < rows * k; i++)
        if (e[i] > max_e) max_e = e[i];
    for (int ex = 0; ex <= max_e; ex++) {
        int nr = 0;
        for (int s = 0; s <= rows * k; s++) {
            if (s < rows * k && e[s] == ex) {
                rid[nr] = s / k;
                wg[nr] = wgt[s];
                memcpy(xg + (size_t)nr * dim, x + (size_t)(s / k) * dim, sizeof(float) * dim);
                nr++;
            }
            if (!nr || (nr < rows && s < rows * k)) continue;
            ffn_rows(b, yg, xg, nr, &experts[ex], limit, before_w2 ? wg : NULL, act_fp8, act_bf16);
            for (int i = 0; i < nr; i++) {
                float w = before_w2 ? 1.0f : wg[i];
                float *a = acc + (size_t)rid[i] * dim;
                const float *yy = yg + (size_t)i * dim;
                for (int64_t d = 0; d < dim; d++) a[d] += w * yy[d];
            }
            nr = 0;
        }
    }
    if (shared) ffn_rows(b, yg, x, rows, shared, limit, NULL, act_fp8, act_bf16);
    for (int r = 0; r < rows; r++)
        for (int64_t d = 0; d < dim; d++) {
            float v = acc[(size_t)r * dim + d] * out_scale + (shared ? yg[(size_t)r * dim + d] : 0.0f);
            out[(size_t)r * dim + d] = act_bf16 ? bf(v) : v;
        }
    POP(b, m);
}

/* the two ops, as the contract says (backend.h): the forward pass takes the same path on
 * either backend, so the CPU tests run its fused-pair bookkeeping too */
static void cpu_hc_post_pre_norm(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post_in,
                                 const float *comb_in, int state_bf16, float *y, float *post, float *comb, int rows,
                                 int hc, int dim, const dsv4_weight *fn, const dsv4_weight *base,
                                 const dsv4_weight *scale, int iters, float norm_eps, float hc_eps, int gemm_bf16,
                                 int out_bf16, const dsv4_weight *y_norm, float y_eps) {
    size_t m = MARK(b);
    if (iters & DSV4_HC_COMBIN_LOGITS) { /* comb_in holds logits (backend.h): form the matrix first */
        float *C = PUSH(b, (size_t)rows * hc * hc, float);
        memcpy(C, comb_in, sizeof(float) * rows * hc * hc);
        for (int r = 0; r < rows; r++) hc_comb_form(C + (size_t)r * hc * hc, hc, iters & DSV4_HC_ITERS, hc_eps);
        comb_in = C;
    }
    cpu_hc_post(b, Xout, o, R, post_in, comb_in, rows, hc, dim, state_bf16);
    POP(b, m);
    cpu_hc_pre_norm(b, y, post, comb, Xout, rows, hc, dim, fn, base, scale, iters & ~DSV4_HC_COMBIN_LOGITS, norm_eps,
                    hc_eps, gemm_bf16, out_bf16, y_norm, y_eps);
}

static void cpu_upload(dsv4_backend *b, void *dst, const void *src, size_t n) { cpu_copy(b, dst, src, n); }

static void cpu_argmax(dsv4_backend *b, int32_t *out, const float *x, int rows, int n) {
    (void)b;
    for (int r = 0; r < rows; r++) out[r] = dsv4_argmax_row(x + (size_t)r * (size_t)n, n);
}

static void cpu_gather_ids(dsv4_backend *b, int32_t *dst, const int32_t *tokens, int rows, const dsv4_weight *tb,
                           int k) {
    (void)b;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < k; j++) { /* a token outside the contract reads row 0, as the CUDA kernel */
            int64_t tok = tokens[r], at = (tok >= 0 && tok < tb->rows ? tok : 0) * k + j;
            dst[r * k + j] = (int32_t)(tb->fmt == DSV4_WF_I64 ? ((const int64_t *)tb->data)[at]
                                                               : ((const int32_t *)tb->data)[at]);
        }
}

/* the side chain runs in order with the rest on the CPU: only the calls are counted (the tests
 * check that the forward pass opened and closed its chains) */
static void cpu_side(dsv4_backend *b, int on) {
    cpu_impl *c = impl(b);
    if (on && !c->side_open) c->side_open = 1, c->sides[0]++;
}
static void cpu_join(dsv4_backend *b) {
    cpu_impl *c = impl(b);
    if (c->side_open) c->side_open = 0, c->sides[1]++;
}

static const dsv4_backend_ops CPU_OPS = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_upload,
    .download = cpu_upload,
    .copy = cpu_copy,
    .embed = cpu_embed,
    .matmul = cpu_matmul,
    .matmul_grouped = cpu_matmul_grouped,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .scale = cpu_scale,
    .sim = cpu_sim,
    .hc_pre = cpu_hc_pre,
    .hc_post = cpu_hc_post,
    .hc_head = cpu_hc_head,
    .sparse_attn = cpu_sparse_attn,
    .indexer_scores = cpu_indexer_scores,
    .topk = cpu_topk,
    .add_cyclic = cpu_add_cyclic,
    .add_cyclic_pos = cpu_add_cyclic_pos,
    .copy_list = cpu_copy_list,
    .pool = cpu_pool,
    .route = cpu_route,
    .moe = cpu_moe,
    .norm_rope = cpu_norm_rope,
    .hc_pre_norm = cpu_hc_pre_norm,
    .hc_post_pre_norm = cpu_hc_post_pre_norm,
    .argmax = cpu_argmax,
    .gather_ids = cpu_gather_ids,
    .side = cpu_side,
    .join = cpu_join,
};

int dsv4_backend_cpu_init(dsv4_backend *b, int n_threads, dsv4_err *err) {
    memset(b, 0, sizeof *b);
    cpu_impl *c = calloc(1, sizeof *c);
    if (!c) return dsv4_errf(err, "cpu backend: out of memory");
    if (n_threads > 0) omp_set_num_threads(n_threads);
    c->n_threads = n_threads;
    b->ops = &CPU_OPS;
    b->impl = c;
    b->n_threads = n_threads;
    return 0;
}

void dsv4_backend_cpu_free(dsv4_backend *b) {
    if (!b || !b->impl) return;
    cpu_impl *c = impl(b);
    while (c->a.n_spill > 0) free(c->a.spill[--c->a.n_spill]);
    free(c->a.base);
    free(c);
    b->impl = NULL;
}
