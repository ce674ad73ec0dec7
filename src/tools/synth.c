/* tools/synth: `dsv4 synth` writes a random checkpoint in the official layout.
 *
 * What it writes is exactly the inventory of the config (model/weights.h):
 * same names, dtypes and shapes as the real checkpoint, so every reader (our
 * binder, transformers) loads it unchanged.  Values are generated directly as
 * stored codes (e4m3 + e8m0, e2m1 + e8m0, bf16 ...), so what a reader
 * dequantizes is exactly what was meant: nothing is lost on the way to disk.
 *
 * Determinism: each tensor's bytes are a function of (seed, tensor name) only.
 * Row r of a tensor draws from a wyrand stream seeded by hash(seed, name, r),
 * so neither the order of tensors, nor the shard size, nor the thread count
 * changes a single byte.
 *
 * Speed and memory: rows are generated in parallel (OpenMP) into one bounded
 * chunk buffer and streamed to disk; a full-size Flash checkpoint never sits
 * in memory.  Gaussian draws come from a 65536-entry quantile table, and each
 * quantized tensor has a table mapping 16 random bits straight to a stored
 * code, so the inner loop is a random number and a lookup.
 *
 * Value scales (so activations stay well-behaved through many layers):
 *   linears, experts, gate, compressor projections, head: N(0, 1/fan_in)
 *   embedding N(0, 1); RMSNorm weights 1 + N(0, 0.1); attn_sink N(0, 1)
 *   hc_*_fn N(0, 0.25/(hc*dim)) so the mixing logits stay small (~0.5);
 *   hc bases N(0, 0.1); hc scales U(0.1, 1); compressor ape N(0, 0.5);
 *   gate bias N(0, 0.05); tid2eid: n_active distinct experts per token.
 * Quantized weights: each scale block gets a power-of-two scale 2^(e0+j) with
 * j in {-1,0,1} cycling over the blocks (so block indexing matters in every
 * reader) and codes with a fixed spread (std 32..64 for e4m3, 1..2 for e2m1)
 * chosen so that the dequantized std over the tensor is exactly 1/sqrt(fan_in).
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <dirent.h>
#include <unistd.h>

#include "model/config.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "tools/commands.h"
#include "util/err.h"

/* ----- random numbers ----- */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t name_key(uint64_t seed, const char *name) {
    uint64_t h = 0xcbf29ce484222325ull ^ mix64(seed + 0x9e3779b97f4a7c15ull);
    for (const char *s = name; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return mix64(h);
}

typedef struct {
    uint64_t s;
} rng;

/* wyrand: one 64x64->128 multiply per draw; the row seed comes from mix64. */
static inline uint64_t rng_next(rng *r) {
    r->s += 0xa0761d6478bd642full;
    __extension__ unsigned __int128 t = (unsigned __int128)r->s * (r->s ^ 0xe7037ed1a0b428dbull);
    return (uint64_t)(t >> 64) ^ (uint64_t)t;
}
static inline rng rng_row(uint64_t key, int64_t row) {
    rng r = {mix64(key ^ mix64((uint64_t)row + 0x632be59bd9b4e019ull))};
    return r;
}
static inline double rng_unit(rng *r) { return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }

/* Standard normal quantiles at (i + 0.5) / 65536: a 16-bit draw -> N(0,1). */
static float Z[65536];

static void z_table_init(void) {
    for (int i = 0; i < 32768; i++) {
        double p = (i + 0.5) / 65536.0, lo = -10, hi = 0;
        for (int it = 0; it < 60; it++) { /* bisection on the normal cdf */
            double mid = 0.5 * (lo + hi);
            if (0.5 * erfc(-mid / sqrt(2.0)) < p)
                lo = mid;
            else
                hi = mid;
        }
        Z[i] = (float)(0.5 * (lo + hi));
        Z[65535 - i] = -Z[i];
    }
}

/* ----- code tables: 16 random bits -> stored code ----- */
typedef enum { TAB_BF16, TAB_E4M3, TAB_E2M1 } tab_kind;

typedef struct {
    tab_kind kind;
    double mean, sigma;
    uint16_t code[65536];
} code_table;

static double code_value(tab_kind k, uint16_t c) {
    switch (k) {
    case TAB_BF16: return dsv4_bf16_to_f32(c);
    case TAB_E4M3: return dsv4_e4m3_to_f32((uint8_t)c);
    case TAB_E2M1: return dsv4_e2m1_to_f32((uint8_t)c);
    }
    return 0;
}

static uint16_t encode(tab_kind k, float v) {
    switch (k) {
    case TAB_BF16: return dsv4_f32_to_bf16(v);
    case TAB_E4M3: return dsv4_f32_to_e4m3(v);
    case TAB_E2M1: return dsv4_f32_to_e2m1(v) & 15;
    }
    return 0;
}

static void table_fill(code_table *t, double sig) {
    for (int i = 0; i < 65536; i++) t->code[i] = encode(t->kind, (float)(t->mean + sig * Z[i]));
}

/* For the coarse formats the quantized spread differs from the requested one;
 * a few fixed-point steps on the pre-quantization sigma fix the spread. */
static void table_build(code_table *t, tab_kind kind, double mean, double sigma) {
    t->kind = kind;
    t->mean = mean;
    t->sigma = sigma;
    double sig = sigma;
    for (int it = 0; it < (kind == TAB_BF16 ? 1 : 4); it++) {
        table_fill(t, sig);
        if (kind == TAB_BF16 || sigma <= 0) break;
        double ss = 0;
        for (int i = 0; i < 65536; i++) {
            double v = code_value(kind, t->code[i]);
            ss += v * v;
        }
        double rms = sqrt(ss / 65536.0);
        if (rms <= 0) break;
        sig *= sigma / rms;
    }
}

#define N_TABLES 8
typedef struct {
    code_table *t[N_TABLES];
    int next;
} table_cache;

static const code_table *table_get(table_cache *tc, tab_kind kind, double mean, double sigma) {
    for (int i = 0; i < N_TABLES; i++)
        if (tc->t[i] && tc->t[i]->kind == kind && tc->t[i]->mean == mean && tc->t[i]->sigma == sigma) return tc->t[i];
    int i = tc->next;
    tc->next = (tc->next + 1) % N_TABLES;
    if (!tc->t[i]) tc->t[i] = dsv4_xcalloc(1, sizeof(code_table));
    table_build(tc->t[i], kind, mean, sigma);
    return tc->t[i];
}

/* ----- what each tensor holds ----- */
typedef enum { D_NORMAL, D_UNIFORM, D_TID2EID } dist_kind;

typedef struct {
    dist_kind kind;
    double a, b; /* normal: mean, std; uniform: lo, hi */
} dist;

static dist weight_dist(const dsv4_config *cfg, const dsv4_inv_entry *e) {
    double fan_in = (double)e->cols, dim = cfg->dim;
    switch (e->role) {
    case DSV4_W_EMBED: return (dist){D_NORMAL, 0, 1};
    case DSV4_W_NORM: case DSV4_W_ATTN_NORM: case DSV4_W_FFN_NORM: case DSV4_W_Q_NORM: case DSV4_W_KV_NORM:
    case DSV4_W_COMP_NORM: case DSV4_W_IDX_COMP_NORM: case DSV4_W_ENORM: case DSV4_W_HNORM: case DSV4_W_MTP_NORM:
        return (dist){D_NORMAL, 1, 0.1};
    case DSV4_W_HC_HEAD_FN: case DSV4_W_HC_ATTN_FN: case DSV4_W_HC_FFN_FN: case DSV4_W_MTP_HC_HEAD_FN:
        return (dist){D_NORMAL, 0, 0.5 / sqrt(fan_in)};
    case DSV4_W_HC_HEAD_BASE: case DSV4_W_HC_ATTN_BASE: case DSV4_W_HC_FFN_BASE: case DSV4_W_MTP_HC_HEAD_BASE:
        return (dist){D_NORMAL, 0, 0.1};
    case DSV4_W_HC_HEAD_SCALE: case DSV4_W_HC_ATTN_SCALE: case DSV4_W_HC_FFN_SCALE: case DSV4_W_MTP_HC_HEAD_SCALE:
        return (dist){D_UNIFORM, 0.1, 1.0};
    case DSV4_W_ATTN_SINK: return (dist){D_NORMAL, 0, 1};
    case DSV4_W_COMP_APE: case DSV4_W_IDX_COMP_APE: return (dist){D_NORMAL, 0, 0.5};
    case DSV4_W_GATE_BIAS: return (dist){D_NORMAL, 0, 0.05};
    case DSV4_W_TID2EID: return (dist){D_TID2EID, 0, 0};
    case DSV4_W_HEAD: case DSV4_W_GATE: return (dist){D_NORMAL, 0, 1 / sqrt(dim)};
    default: return (dist){D_NORMAL, 0, 1 / sqrt(fan_in)}; /* every linear */
    }
}

/* Per-tensor generation plan. */
typedef struct {
    const dsv4_inv_entry *e;
    const dsv4_config *cfg;
    uint64_t key;
    dist d;
    const code_table *tab; /* NULL: values computed per element */
    int e0;                /* quantized: base scale exponent */
    int64_t rows, row_bytes;
} plan;

/* Scale-block jitter j in {-1, 0, 1}: a balanced pattern over the linear
 * block index, offset per tensor, so neighbouring blocks differ and the three
 * values occur equally often (the tensor's std does not depend on luck). */
static inline int jit(uint64_t key, int64_t i) { return (int)(((uint64_t)i + key % 3) % 3) - 1; }

/* E[4^j] over a tensor's n blocks, exactly. */
static double jit_mean_sq(uint64_t key, int64_t n) {
    double acc = 0;
    for (int r = 0; r < 3; r++) { /* blocks i with (i + key%3) % 3 == r: j = r - 1 */
        int64_t first = ((int64_t)r - (int64_t)(key % 3) + 3) % 3;
        int64_t cnt = first < n ? (n - first + 2) / 3 : 0;
        acc += (double)cnt * ldexp(1.0, 2 * (r - 1));
    }
    return n > 0 ? acc / (double)n : 1.0;
}

/* Number of scale blocks of a quantized weight. */
static int64_t n_blocks(const dsv4_config *cfg, const dsv4_inv_entry *e) {
    int64_t B = cfg->quant_block > 0 ? cfg->quant_block : 128;
    switch (e->fmt) {
    case DSV4_WF_FP8: return ((e->rows + B - 1) / B) * ((e->cols + B - 1) / B);
    case DSV4_WF_MXFP4: return e->rows * ((e->cols + 31) / 32);
    case DSV4_WF_NVFP4: return e->rows * ((e->cols + 15) / 16);
    default: return 1;
    }
}

static void plan_init(plan *p, const dsv4_config *cfg, const dsv4_inv_entry *e, uint64_t seed, table_cache *tc) {
    memset(p, 0, sizeof *p);
    p->e = e;
    p->cfg = cfg;
    p->key = name_key(seed, e->name);
    p->d = weight_dist(cfg, e);
    p->rows = e->ndim >= 2 ? e->shape[0] : 1;
    p->row_bytes = p->rows ? (int64_t)(e->bytes / (size_t)p->rows) : 0;
    int quant = e->fmt == DSV4_WF_FP8 || e->fmt == DSV4_WF_MXFP4 || e->fmt == DSV4_WF_NVFP4;
    if (quant) {
        /* Scales and codes are separate tensors: both derive the same jitter
         * pattern from the key of the weight tensor's name. */
        char wname[sizeof e->name];
        snprintf(wname, sizeof wname, "%s", e->name);
        char *dot = strrchr(wname, '.');
        if (dot && e->part != DSV4_PART_DATA) snprintf(dot, sizeof wname - (size_t)(dot - wname), ".weight");
        p->key = name_key(seed, wname);
        double lo = e->fmt == DSV4_WF_FP8 ? 32.0 : 1.0; /* code spread: e4m3 [32,64), e2m1 [1,2) */
        double rms = p->d.b / sqrt(jit_mean_sq(p->key, n_blocks(cfg, e)));
        p->e0 = (int)floor(log2(rms / lo));
        if (e->part == DSV4_PART_DATA)
            p->tab = table_get(tc, e->fmt == DSV4_WF_FP8 ? TAB_E4M3 : TAB_E2M1, 0, rms / ldexp(1.0, p->e0));
    } else if (e->dtype == DSV4_DT_BF16 && p->d.kind == D_NORMAL && e->bytes >= (1u << 20)) {
        p->tab = table_get(tc, TAB_BF16, p->d.a, p->d.b);
    }
}

static inline float draw(const plan *p, rng *r) {
    if (p->d.kind == D_UNIFORM) return (float)(p->d.a + (p->d.b - p->d.a) * rng_unit(r));
    /* two quantile lookups averaged over a fine offset would be smoother; one is plenty here */
    return (float)(p->d.a + p->d.b * Z[rng_next(r) & 0xffff]);
}

static uint8_t e8m0_of(int e) {
    int c = e + 127;
    return (uint8_t)(c < 0 ? 0 : c > 254 ? 254 : c);
}

/* Writes stored row r of the tensor (row_bytes bytes). */
static void gen_row(const plan *p, int64_t r, uint8_t *out) {
    const dsv4_inv_entry *e = p->e;
    rng g = rng_row(p->key, r);
    int64_t n = p->row_bytes / (int64_t)dsv4_dtype_size(e->dtype);
    if (e->part == DSV4_PART_DATA) {
        if (p->d.kind == D_TID2EID) {
            int64_t *v = (int64_t *)out;
            int nr = p->cfg->n_routed;
            for (int64_t k = 0; k < n; k++) {
                int64_t x;
                int dup;
                do { /* distinct experts per token; n_active <= n_routed is checked up front */
                    x = (int64_t)(rng_next(&g) % (uint64_t)nr);
                    dup = 0;
                    for (int64_t j = 0; j < k; j++) dup |= v[j] == x;
                } while (dup);
                v[k] = x;
            }
            return;
        }
        if (e->fmt == DSV4_WF_MXFP4 || e->fmt == DSV4_WF_NVFP4) {
            const uint16_t *t = p->tab->code;
            for (int64_t b = 0; b < n; b += 2) {
                uint64_t x = rng_next(&g);
                out[b] = (uint8_t)(t[x & 0xffff] | t[(x >> 16) & 0xffff] << 4);
                if (b + 1 < n) out[b + 1] = (uint8_t)(t[(x >> 32) & 0xffff] | t[x >> 48] << 4);
            }
            /* odd logical width: the unused high nibble of the last byte stays 0 */
            if (e->cols % 2) out[n - 1] &= 0x0f;
            return;
        }
        if (e->fmt == DSV4_WF_FP8) {
            const uint16_t *t = p->tab->code;
            for (int64_t b = 0; b < n; b += 4) {
                uint64_t x = rng_next(&g);
                for (int k = 0; k < 4 && b + k < n; k++) out[b + k] = (uint8_t)t[(x >> (16 * k)) & 0xffff];
            }
            return;
        }
        if (e->dtype == DSV4_DT_BF16) {
            uint16_t *o = (uint16_t *)out;
            if (p->tab) {
                const uint16_t *t = p->tab->code;
                for (int64_t b = 0; b < n; b += 4) {
                    uint64_t x = rng_next(&g);
                    for (int k = 0; k < 4 && b + k < n; k++) o[b + k] = t[(x >> (16 * k)) & 0xffff];
                }
            } else {
                for (int64_t i = 0; i < n; i++) o[i] = dsv4_f32_to_bf16(draw(p, &g));
            }
            return;
        }
        float *o = (float *)out; /* F32 */
        for (int64_t i = 0; i < n; i++) o[i] = draw(p, &g);
        return;
    }
    /* scale tensors: one power of two 2^(e0 + j) per block */
    int64_t ncols = n;
    if (e->part == DSV4_PART_SCALE) {
        for (int64_t c = 0; c < ncols; c++) {
            int ex = p->e0 + jit(p->key, r * ncols + c);
            if (e->fmt == DSV4_WF_NVFP4) /* e4m3 block scale 2^(6+j); 2^(e0-6) goes into weight_scale_2 */
                out[c] = dsv4_f32_to_e4m3(ldexpf(1.0f, 6 + ex - p->e0));
            else if (e->dtype == DSV4_DT_F32)
                ((float *)out)[c] = ldexpf(1.0f, ex);
            else
                out[c] = e8m0_of(ex);
        }
    } else if (e->part == DSV4_PART_SCALE2) {
        float v = ldexpf(1.0f, p->e0 - 6);
        memcpy(out, &v, 4);
    } else { /* input_scale: an activation amax of 4 over the e2m1 x e4m3 range; unused by bf16/fp8 paths */
        float v = 4.0f / (6.0f * 448.0f);
        memcpy(out, &v, 4);
    }
}

/* ----- writing: generate into one buffer while a thread writes the other ----- */
typedef struct {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint8_t *buf[2];
    size_t cap[2], len[2];
    dsv4_st_writer *w[2];
    int full[2];
    int head, tail; /* next buffer to fill / to write */
    int stop, failed;
    dsv4_err err;
    double t_write; /* seconds the writer thread spent in the writer */
} pipeline;

static void *pipeline_writer(void *arg) {
    pipeline *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->full[p->tail] && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
        if (!p->full[p->tail]) break;
        int i = p->tail;
        pthread_mutex_unlock(&p->mu);
        double t0 = dsv4_now();
        dsv4_err e;
        int rc = p->failed ? 0 : dsv4_st_writer_data(p->w[i], p->buf[i], p->len[i], &e);
        double dt = dsv4_now() - t0;
        pthread_mutex_lock(&p->mu);
        p->t_write += dt;
        if (rc && !p->failed) {
            p->failed = 1;
            p->err = e;
        }
        p->full[i] = 0;
        p->tail ^= 1;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static int pipeline_start(pipeline *p, size_t cap, dsv4_err *err) {
    memset(p, 0, sizeof *p);
    for (int i = 0; i < 2; i++) {
        p->buf[i] = malloc(cap);
        p->cap[i] = cap;
        if (!p->buf[i]) {
            free(p->buf[0]);
            return dsv4_errf(err, "out of memory for %zu-byte write buffers", cap);
        }
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (pthread_create(&p->th, NULL, pipeline_writer, p)) {
        free(p->buf[0]);
        free(p->buf[1]);
        return dsv4_errf(err, "cannot start the writer thread");
    }
    return 0;
}

/* The next free buffer, at least `need` bytes; NULL (err set) on failure. */
static uint8_t *pipeline_acquire(pipeline *p, size_t need, dsv4_err *err) {
    pthread_mutex_lock(&p->mu);
    while (p->full[p->head] && !p->failed) pthread_cond_wait(&p->cv, &p->mu);
    int failed = p->failed;
    if (failed && err) *err = p->err;
    pthread_mutex_unlock(&p->mu);
    if (failed) return NULL;
    int i = p->head; /* not full: the writer thread does not touch it */
    if (need > p->cap[i]) {
        uint8_t *nb = realloc(p->buf[i], need);
        if (!nb) {
            dsv4_errf(err, "out of memory for a %zu-byte chunk", need);
            return NULL;
        }
        p->buf[i] = nb;
        p->cap[i] = need;
    }
    return p->buf[i];
}

static void pipeline_submit(pipeline *p, dsv4_st_writer *w, size_t len) {
    pthread_mutex_lock(&p->mu);
    int i = p->head;
    p->w[i] = w;
    p->len[i] = len;
    p->full[i] = 1;
    p->head ^= 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Waits until everything submitted is written; returns -1 (err set) if a write failed. */
static int pipeline_drain(pipeline *p, dsv4_err *err) {
    pthread_mutex_lock(&p->mu);
    while (p->full[0] || p->full[1]) pthread_cond_wait(&p->cv, &p->mu);
    int failed = p->failed;
    if (failed && err) *err = p->err;
    pthread_mutex_unlock(&p->mu);
    return failed ? -1 : 0;
}

static void pipeline_stop(pipeline *p) {
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->th, NULL);
    free(p->buf[0]);
    free(p->buf[1]);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
}

typedef struct {
    const char *out_dir;
    uint64_t seed;
    size_t shard_bytes;
    pipeline pipe;
    table_cache tc;
    double t_gen, t_close; /* seconds generating / closing shards (reported) */
} synth_ctx;

static int write_tensor(synth_ctx *s, const dsv4_config *cfg, dsv4_st_writer *w, const dsv4_inv_entry *e,
                        dsv4_err *err) {
    plan p;
    plan_init(&p, cfg, e, s->seed, &s->tc);
    if (e->bytes == 0) return 0;
    int64_t rows_per = p.row_bytes > 0 ? (int64_t)(s->pipe.cap[0] / (size_t)p.row_bytes) : p.rows;
    if (rows_per < 1) rows_per = 1;
    for (int64_t r0 = 0; r0 < p.rows; r0 += rows_per) {
        int64_t r1 = r0 + rows_per < p.rows ? r0 + rows_per : p.rows;
        size_t need = (size_t)(r1 - r0) * (size_t)p.row_bytes;
        uint8_t *buf = pipeline_acquire(&s->pipe, need, err);
        if (!buf) return dsv4_err_prefix(err, "%s", e->name);
        int64_t rb = p.row_bytes;
        double t0 = dsv4_now();
#pragma omp parallel for schedule(static) if (r1 - r0 > 1 && need > (1u << 16))
        for (int64_t r = r0; r < r1; r++) gen_row(&p, r, buf + (size_t)(r - r0) * (size_t)rb);
        s->t_gen += dsv4_now() - t0;
        pipeline_submit(&s->pipe, w, need);
    }
    return 0;
}

static int path_join(char *out, size_t cap, const char *dir, const char *name, dsv4_err *err) {
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return dsv4_errf(err, "%s/%s: path too long", dir, name);
    return 0;
}

static int write_file(const char *path, const char *text, dsv4_err *err) {
    FILE *f = fopen(path, "wb");
    if (!f) return dsv4_errf(err, "%s: cannot create: %s", path, strerror(errno));
    size_t n = strlen(text);
    int bad = fwrite(text, 1, n, f) != n;
    bad |= fclose(f) != 0;
    if (bad) return dsv4_errf(err, "%s: write failed: %s", path, strerror(errno));
    return 0;
}

static int copy_file(const char *from, const char *to, dsv4_err *err) {
    FILE *in = fopen(from, "rb");
    if (!in) return dsv4_errf(err, "%s: cannot open: %s", from, strerror(errno));
    FILE *out = fopen(to, "wb");
    if (!out) {
        fclose(in);
        return dsv4_errf(err, "%s: cannot create: %s", to, strerror(errno));
    }
    char buf[1 << 16];
    size_t n;
    int bad = 0;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) bad = 1;
    bad |= ferror(in);
    fclose(in);
    bad |= fclose(out) != 0;
    if (bad) return dsv4_errf(err, "copying %s to %s failed: %s", from, to, strerror(errno));
    return 0;
}

/* Removes the checkpoint files an earlier synth may have left in dir, so a
 * stale index or shard cannot mix with the new one.  Only our own names. */
static void remove_old_checkpoint(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    char path[4096];
    while ((de = readdir(d))) {
        const char *n = de->d_name;
        unsigned a, b;
        char tail[32];
        int ours = !strcmp(n, "model.safetensors") || !strcmp(n, "model.safetensors.index.json") ||
                   (sscanf(n, "model-%5u-of-%5u.%31s", &a, &b, tail) == 3 && !strcmp(tail, "safetensors"));
        if (ours && (size_t)snprintf(path, sizeof path, "%s/%s", dir, n) < sizeof path) unlink(path);
    }
    closedir(d);
}

static int write_checkpoint(synth_ctx *s, const dsv4_config *cfg, int64_t *n_tensors, size_t *total, int *n_shards,
                            dsv4_err *err) {
    dsv4_inv_entry *inv;
    int64_t n;
    if (dsv4_inventory_list(cfg, &inv, &n, err)) return -1;
    /* plan shards: greedy, a new shard when the next tensor would overflow */
    int *shard = malloc((size_t)(n ? n : 1) * sizeof *shard);
    if (!shard) {
        free(inv);
        return dsv4_errf(err, "out of memory");
    }
    int ns = 1;
    size_t cur = 0, sum = 0;
    for (int64_t i = 0; i < n; i++) {
        if (cur > 0 && cur + inv[i].bytes > s->shard_bytes) {
            ns++;
            cur = 0;
        }
        cur += inv[i].bytes;
        sum += inv[i].bytes;
        shard[i] = ns - 1;
    }
    int rc = 0;
    char path[4096], fname[64];
    int64_t i0 = 0;
    for (int sh = 0; sh < ns && !rc; sh++) {
        if (ns == 1)
            snprintf(fname, sizeof fname, "model.safetensors");
        else
            snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", sh + 1, ns);
        if (path_join(path, sizeof path, s->out_dir, fname, err)) {
            rc = -1;
            break;
        }
        int64_t i1 = i0;
        while (i1 < n && shard[i1] == sh) i1++;
        dsv4_st_writer *w = NULL;
        if (dsv4_st_writer_open(&w, path, err)) {
            rc = -1;
            break;
        }
        for (int64_t i = i0; i < i1 && !rc; i++)
            rc = dsv4_st_writer_add(w, inv[i].name, inv[i].dtype, inv[i].ndim, inv[i].shape, err);
        if (!rc) rc = dsv4_st_writer_begin_data(w, err);
        for (int64_t i = i0; i < i1 && !rc; i++) rc = write_tensor(s, cfg, w, &inv[i], err);
        if (pipeline_drain(&s->pipe, rc ? NULL : err)) rc = -1; /* the writer must be idle before close */
        dsv4_err cerr;
        double tc0 = dsv4_now();
        int crc = dsv4_st_writer_close(w, &cerr);
        s->t_close += dsv4_now() - tc0;
        if (crc && !rc) {
            *err = cerr;
            rc = -1;
        }
        if (rc) dsv4_err_prefix(err, "%s", path);
        i0 = i1;
    }
    if (!rc && ns > 1) { /* model.safetensors.index.json; our names need no JSON escaping */
        size_t cap = 256 + (size_t)n * 160, o = 0;
        char *js = malloc(cap);
        if (!js) {
            rc = dsv4_errf(err, "out of memory");
        } else {
            o += (size_t)snprintf(js + o, cap - o, "{\n  \"metadata\": {\"total_size\": %zu},\n  \"weight_map\": {\n", sum);
            for (int64_t i = 0; i < n; i++)
                o += (size_t)snprintf(js + o, cap - o, "    \"%s\": \"model-%05d-of-%05d.safetensors\"%s\n", inv[i].name,
                                      shard[i] + 1, ns, i + 1 < n ? "," : "");
            snprintf(js + o, cap - o, "  }\n}\n");
            if (!path_join(path, sizeof path, s->out_dir, "model.safetensors.index.json", err))
                rc = write_file(path, js, err);
            else
                rc = -1;
            free(js);
        }
    }
    *n_tensors = n;
    *total = sum;
    *n_shards = ns;
    free(shard);
    free(inv);
    return rc;
}

/* mkdir -p: creates dir and any missing parents. */
static int mkdir_p(const char *dir) {
    char p[4096];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *q = p + 1; *q; q++) {
        if (*q != '/') continue;
        *q = 0;
        if (mkdir(p, 0777) && errno != EEXIST) return -1;
        *q = '/';
    }
    if (mkdir(p, 0777) && errno != EEXIST) return -1;
    struct stat st;
    if (stat(p, &st) || !S_ISDIR(st.st_mode)) {
        errno = ENOTDIR;
        return -1;
    }
    return 0;
}

/* ----- command line ----- */
static void synth_usage(FILE *f) {
    fprintf(f,
            "usage: dsv4 synth --config tiny|flash|pro|FILE --out DIR [options]\n"
            "Writes a random, deterministic checkpoint in the official layout (config.json + safetensors).\n"
            "  --config NAME|FILE   built-in config or a config.json (or a directory holding one)\n"
            "  --out DIR            output directory (created; earlier synth output there is replaced)\n"
            "  --seed N             random seed (default 0); bytes depend only on seed and tensor name\n"
            "  --layers N           keep the first N trunk layers of the config\n"
            "  --mtp N              number of MTP layers (0 drops MTP)\n"
            "  --experts FMT        routed expert format: mxfp4 | nvfp4 | fp8 | bf16\n"
            "  --scale-fmt FMT      FP8 block scales: e8m0 | f32\n"
            "  --tokenizer DIR      copy tokenizer.json (and tokenizer_config.json) from DIR\n"
            "  --shard-bytes N      maximum shard size in bytes (default 4 GiB; suffixes K M G)\n");
}

static int parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    int64_t mult = 1;
    if (*end == 'K' || *end == 'k') mult = 1024, end++;
    else if (*end == 'M' || *end == 'm') mult = 1024 * 1024, end++;
    else if (*end == 'G' || *end == 'g') mult = 1024LL * 1024 * 1024, end++;
    if (errno || *end || v < lo / mult || v > hi / mult) return -1;
    v *= mult;
    if (v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* Loads a built-in name, a config.json, or a directory holding one. */
static int load_config_arg(dsv4_config *cfg, const char *what, dsv4_err *err) {
    if (!strcmp(what, "tiny") || !strcmp(what, "flash") || !strcmp(what, "pro"))
        return dsv4_config_builtin(cfg, what, err);
    struct stat st;
    if (stat(what, &st) == 0 && S_ISDIR(st.st_mode)) {
        char p[4096];
        if (path_join(p, sizeof p, what, "config.json", err)) return -1;
        return dsv4_config_load(cfg, p, err);
    }
    return dsv4_config_load(cfg, what, err);
}

int dsv4_cmd_synth(int argc, char **argv) {
    const char *config = NULL, *out = NULL, *tok = NULL, *experts = NULL, *scale_fmt = NULL;
    int64_t seed = 0, layers = -1, mtp = -1, shard = (int64_t)4 << 30;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            synth_usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "dsv4 synth: %s: unknown option or missing value\n", a);
            synth_usage(stderr);
            return 2;
        }
        const char *v = argv[++i];
        int bad = 0;
        if (!strcmp(a, "--config")) config = v;
        else if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--tokenizer")) tok = v;
        else if (!strcmp(a, "--experts")) experts = v;
        else if (!strcmp(a, "--scale-fmt")) scale_fmt = v;
        else if (!strcmp(a, "--seed")) bad = parse_i64(v, 0, INT64_MAX, &seed);
        else if (!strcmp(a, "--layers")) bad = parse_i64(v, 1, DSV4_MAX_LAYERS, &layers);
        else if (!strcmp(a, "--mtp")) bad = parse_i64(v, 0, DSV4_MAX_LAYERS, &mtp);
        else if (!strcmp(a, "--shard-bytes")) bad = parse_i64(v, 1, INT64_MAX, &shard);
        else {
            fprintf(stderr, "dsv4 synth: unknown option %s\n", a);
            synth_usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "dsv4 synth: %s: invalid value \"%s\"\n", a, v);
            return 2;
        }
    }
    if (!config || !out) {
        fprintf(stderr, "dsv4 synth: --config and --out are required\n");
        synth_usage(stderr);
        return 2;
    }
    dsv4_err err;
    dsv4_config cfg;
    if (load_config_arg(&cfg, config, &err)) {
        fprintf(stderr, "dsv4 synth: %s\n", err.msg);
        return 1;
    }
    if (layers > 0 && dsv4_config_truncate(&cfg, (int)layers, &err)) {
        fprintf(stderr, "dsv4 synth: --layers: %s\n", err.msg);
        return 1;
    }
    if (mtp >= 0) {
        if (cfg.n_layers + mtp > DSV4_MAX_LAYERS) {
            fprintf(stderr, "dsv4 synth: --mtp %" PRId64 ": at most %d layers in all\n", mtp, DSV4_MAX_LAYERS);
            return 2;
        }
        for (int i = cfg.n_mtp; i < mtp; i++) cfg.compress_ratio[cfg.n_layers + i] = 0; /* new MTP layers: window only */
        for (int i = (int)mtp; i < cfg.n_mtp; i++) cfg.compress_ratio[cfg.n_layers + i] = 0;
        cfg.n_mtp = (int)mtp;
    }
    if (experts) {
        if (!strcmp(experts, "mxfp4") || !strcmp(experts, "fp4")) cfg.expert_dtype = DSV4_EXPERT_FP4;
        else if (!strcmp(experts, "nvfp4")) cfg.expert_dtype = DSV4_EXPERT_NVFP4;
        else if (!strcmp(experts, "fp8")) cfg.expert_dtype = DSV4_EXPERT_FP8;
        else if (!strcmp(experts, "bf16")) cfg.expert_dtype = DSV4_EXPERT_BF16;
        else {
            fprintf(stderr, "dsv4 synth: --experts \"%s\": expected mxfp4, nvfp4, fp8 or bf16\n", experts);
            return 2;
        }
        if (cfg.expert_dtype == DSV4_EXPERT_FP8 && cfg.quant_block < 1) cfg.quant_block = 128;
    }
    if (scale_fmt) {
        if (!strcmp(scale_fmt, "e8m0") || !strcmp(scale_fmt, "ue8m0")) cfg.scale_fmt = DSV4_SCALE_UE8M0;
        else if (!strcmp(scale_fmt, "f32")) cfg.scale_fmt = DSV4_SCALE_F32;
        else {
            fprintf(stderr, "dsv4 synth: --scale-fmt \"%s\": expected e8m0 or f32\n", scale_fmt);
            return 2;
        }
    }
    if (cfg.n_active > cfg.n_routed || cfg.n_routed < 1) {
        fprintf(stderr, "dsv4 synth: %s: num_experts_per_tok %d must be in [1, n_routed_experts %d]\n", cfg.name,
                cfg.n_active, cfg.n_routed);
        return 1;
    }
    /* the edited config must still be valid (and say what it is) */
    char *js = dsv4_config_to_json(&cfg);
    char cname[sizeof cfg.name];
    memcpy(cname, cfg.name, sizeof cname);
    if (!js || dsv4_config_parse(&cfg, js, strlen(js), "synth config", &err)) {
        fprintf(stderr, "dsv4 synth: the resulting config is invalid: %s\n", js ? err.msg : "out of memory");
        free(js);
        return 1;
    }

    memcpy(cfg.name, cname, sizeof cname);
    double t0 = dsv4_now();
    if (mkdir_p(out)) {
        fprintf(stderr, "dsv4 synth: %s: cannot create directory: %s\n", out, strerror(errno));
        free(js);
        return 1;
    }
    remove_old_checkpoint(out);
    char path[4096];
    int rc = path_join(path, sizeof path, out, "config.json", &err);
    if (!rc) rc = write_file(path, js, &err);
    free(js);
    if (!rc && tok) {
        char from[4096];
        rc = path_join(from, sizeof from, tok, "tokenizer.json", &err) || path_join(path, sizeof path, out, "tokenizer.json", &err) ||
             copy_file(from, path, &err);
        if (!rc && !path_join(from, sizeof from, tok, "tokenizer_config.json", &err) && access(from, F_OK) == 0)
            rc = path_join(path, sizeof path, out, "tokenizer_config.json", &err) || copy_file(from, path, &err);
    }
    int64_t n_tensors = 0;
    size_t total = 0;
    int n_shards = 0;
    synth_ctx s;
    memset(&s, 0, sizeof s);
    s.out_dir = out;
    s.seed = (uint64_t)seed;
    s.shard_bytes = (size_t)shard;
    if (!rc && !(rc = pipeline_start(&s.pipe, 32u << 20, &err))) {
        z_table_init();
        rc = write_checkpoint(&s, &cfg, &n_tensors, &total, &n_shards, &err);
        pipeline_stop(&s.pipe);
    }
    for (int i = 0; i < N_TABLES; i++) free(s.tc.t[i]);
    if (rc) {
        fprintf(stderr, "dsv4 synth: %s\n", err.msg);
        return 1;
    }
    printf("synth: %s -> %s: %" PRId64 " tensors, %zu bytes (%.2f GiB) in %d shard%s, %.1f s (generate %.1f s, write %.1f s, sync %.1f s)\n",
           cfg.name, out, n_tensors, total, (double)total / (1u << 30), n_shards, n_shards == 1 ? "" : "s",
           dsv4_now() - t0, s.t_gen, s.pipe.t_write, s.t_close);
    return 0;
}
