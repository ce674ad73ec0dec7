/* text/sampler: see sampler.h for the contract and docs/SAMPLING.md for the
 * semantics of every parameter and the order they apply in. */
#include "text/sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Bit-reproducibility across machines needs a*b+c to round twice, as written.
 * gcc in -std=c11 mode already defaults to -ffp-contract=off; clang does not. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#define PROMPT_BIT 0x80000000u /* count[id]: token occurs in the prompt */
#define GEN_MASK 0x7fffffffu   /* count[id]: times generated (saturating) */
#define TOP_P_BUCKETS 2048     /* see select_top_p */

struct dsv4_sampler {
    int vocab;
    int ready;              /* 0 after a failed reset: sample() refuses */
    dsv4_sampling_params p; /* validated copy; logit_bias pointers cleared */
    uint64_t seed;
    uint64_t rng[4]; /* xoshiro256** state */
    uint64_t n_resets;

    /* history for the penalties */
    uint32_t *count; /* [vocab] PROMPT_BIT | generated count */
    int32_t *seen;   /* [vocab] ids with count != 0, in first-seen order */
    int n_seen;

    /* logit_bias, copied from the params */
    int32_t *bias_id; /* [DSV4_SAMPLER_MAX_LOGIT_BIAS] */
    float *bias_val;  /* [DSV4_SAMPLER_MAX_LOGIT_BIAS] */
    int n_bias;

    /* scratch for one sample() call */
    float *work;   /* [vocab] processed logits, then unnormalised probabilities */
    int32_t *cand; /* [vocab] candidate ids / heaps */
    double top_p_mass[TOP_P_BUCKETS];
};

/* ----- PRNG: splitmix64 for seeding, xoshiro256** for draws ----- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl64(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

static uint64_t xoshiro_next(uint64_t st[4]) {
    uint64_t result = rotl64(st[1] * 5, 7) * 9;
    uint64_t t = st[1] << 17;
    st[2] ^= st[0];
    st[3] ^= st[1];
    st[1] ^= st[2];
    st[0] ^= st[3];
    st[2] ^= t;
    st[3] = rotl64(st[3], 45);
    return result;
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t st[4]) {
    return (double)(xoshiro_next(st) >> 11) * 0x1.0p-53;
}

static void rng_seed(uint64_t st[4], uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        st[i] = splitmix64(&x);
}

/* ----- exp() of our own ----- */
/* libm's exp may differ in the last bit between libraries; the draw compares a
 * running sum of probabilities against a uniform, so one ulp could change the
 * token.  This uses only + - * and an exact power-of-two scale, so it gives
 * the same bits on every IEEE-754 machine (default rounding mode).  Relative
 * error ~2e-16: k = round(x/ln2) by the 1.5*2^52 trick, Cody-Waite
 * reduction, degree-12 Taylor on |r| <= ln2/2.  Domain x <= 0 (callers pass a
 * value minus the maximum; larger x is treated as 0).  x <= -708 (e^-708 ~
 * 3e-308), -inf and NaN give 0: such values are 0 as float probabilities and
 * add nothing to a sum that contains e^0 = 1.
 * det_exp4 is the same sequence of operations on 4 lanes (GCC/clang vector
 * extensions, plain C on targets without SIMD), so it gives the same bits;
 * test_det_exp_accuracy checks that. */
#define EXP_ROUND 6755399441055744.0          /* 1.5 * 2^52 */
#define EXP_LN2_HI 6.93147180369123816490e-01 /* low bits zero: k*ln2_hi exact */
#define EXP_LN2_LO 1.90821492927058770002e-10
#define EXP_LOG2E 1.44269504088896338700e+00
#define EXP_POLY(q, r)                                                                                       \
    do {                                                                                                     \
        q = q * r + 1.0 / 39916800.0;                                                                        \
        q = q * r + 1.0 / 3628800.0;                                                                         \
        q = q * r + 1.0 / 362880.0;                                                                          \
        q = q * r + 1.0 / 40320.0;                                                                           \
        q = q * r + 1.0 / 5040.0;                                                                            \
        q = q * r + 1.0 / 720.0;                                                                             \
        q = q * r + 1.0 / 120.0;                                                                             \
        q = q * r + 1.0 / 24.0;                                                                              \
        q = q * r + 1.0 / 6.0;                                                                               \
        q = q * r + 0.5;                                                                                     \
        q = q * r + 1.0;                                                                                     \
        q = q * r + 1.0;                                                                                     \
    } while (0)

static inline double det_exp(double x) {
    int live = x > -708.0; /* false for -inf and NaN too */
    double xc = live ? x : -708.0;
    xc = xc < 0.0 ? xc : 0.0;
    double t = xc * EXP_LOG2E + EXP_ROUND; /* k in the low mantissa bits */
    double kd = t - EXP_ROUND;
    double r = (xc - kd * EXP_LN2_HI) - kd * EXP_LN2_LO;
    double q = 1.0 / 479001600.0; /* 1/12! */
    EXP_POLY(q, r);
    uint64_t bits;
    memcpy(&bits, &t, sizeof bits);
    bits = (bits + 1023u) << 52; /* 2^k: k in [-1022, 0] is a normal exponent */
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return live ? q * scale : 0.0;
}

typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4i __attribute__((vector_size(32)));
typedef uint64_t v4u __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

#define v4d_splat(x) ((v4d){(x), (x), (x), (x)})

/* By pointer: passing 32-byte vectors by value changes the ABI on baseline x86-64. */
static inline void det_exp4(const v4d *in, v4d *out) {
    v4d x = *in;
    v4i live = x > v4d_splat(-708.0);
    v4d xc = (v4d)(((v4i)x & live) | ((v4i)v4d_splat(-708.0) & ~live));
    xc = (v4d)((v4i)xc & (xc < v4d_splat(0.0))); /* not negative -> +0 */
    v4d t = xc * EXP_LOG2E + EXP_ROUND;
    v4d kd = t - EXP_ROUND;
    v4d r = (xc - kd * EXP_LN2_HI) - kd * EXP_LN2_LO;
    v4d q = v4d_splat(1.0 / 479001600.0);
    EXP_POLY(q, r);
    v4u bits = ((v4u)t + 1023u) << 52;
    v4d res = q * (v4d)bits;
    *out = (v4d)((v4i)res & live);
}

/* Sum of floats in a fixed order: four interleaved partial sums (ids i = 4j+c
 * go to partial c), combined as (s0+s1)+(s2+s3).  Fixed order = same bits
 * everywhere; four chains instead of one make it ~4x faster. */
static double sum_f32(const float *v, int n) {
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += v[i];
        s1 += v[i + 1];
        s2 += v[i + 2];
        s3 += v[i + 3];
    }
    for (; i < n; i++)
        s0 += v[i];
    return (s0 + s1) + (s2 + s3);
}

/* dst[i] = det_exp((src[i] - m) / T) for n values (dst may be src), four
 * lanes at a time; the tail runs the same operations scalar. */
#define EXP_BLOCK 256
static void exp_shifted(float *dst, const float *src, int n, double m, double T) {
    int i = 0;
    const v4d vm = v4d_splat(m), vT = v4d_splat(T);
    for (; i + 4 <= n; i += 4) {
        v4f x;
        memcpy(&x, src + i, sizeof x);
        v4d y = (__builtin_convertvector(x, v4d) - vm) / vT;
        det_exp4(&y, &y);
        v4f f = __builtin_convertvector(y, v4f);
        memcpy(dst + i, &f, sizeof f);
    }
    for (; i < n; i++)
        dst[i] = (float)det_exp(((double)src[i] - m) / T);
}

/* log(sum(exp(v - m))) + m for the maximum m of v[0..n); -inf entries count
 * nothing.  One pass in blocks through a small stack buffer. */
static double logsumexp_with_max(const float *v, int n, double m) {
    float tmp[EXP_BLOCK];
    double s = 0.0;
    for (int i0 = 0; i0 < n; i0 += EXP_BLOCK) {
        int nb = n - i0 < EXP_BLOCK ? n - i0 : EXP_BLOCK;
        exp_shifted(tmp, v + i0, nb, m, 1.0);
        s += sum_f32(tmp, nb);
    }
    return m + log(s);
}

/* ----- ordering and heaps over token ids keyed by a value array ----- */

/* a ranks before b: higher value, ties to the lower id. */
static inline int ranks_before(const float *v, int32_t a, int32_t b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
}

/* Heap of ids: with best_at_root the root ranks first (max-heap), otherwise the
 * root ranks last (a min-heap that keeps the best n seen). */
static inline int heap_above(const float *v, int32_t a, int32_t b, int best_at_root) {
    return best_at_root ? ranks_before(v, a, b) : ranks_before(v, b, a);
}

static void heap_sift_down(int32_t *h, int n, int i, const float *v, int best_at_root) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, top = i;
        if (l < n && heap_above(v, h[l], h[top], best_at_root)) top = l;
        if (r < n && heap_above(v, h[r], h[top], best_at_root)) top = r;
        if (top == i) return;
        int32_t t = h[i];
        h[i] = h[top];
        h[top] = t;
        i = top;
    }
}

static void heap_sift_up(int32_t *h, int i, const float *v, int best_at_root) {
    while (i > 0) {
        int parent = (i - 1) / 2;
        if (!heap_above(v, h[i], h[parent], best_at_root)) return;
        int32_t t = h[i];
        h[i] = h[parent];
        h[parent] = t;
        i = parent;
    }
}

/* The best k of ids (ids == NULL: 0..n-1) by v into out[0..k'), best first;
 * returns k' = min(k, n).  O(n + k' log k') typical, O(n log k) worst. */
static int select_best(const float *v, const int32_t *ids, int n, int k, int32_t *out) {
    int m = 0;
    if (k <= 0) return 0;
    for (int j = 0; j < n; j++) {
        int32_t id = ids ? ids[j] : j;
        if (m < k) {
            out[m] = id;
            heap_sift_up(out, m, v, 0);
            m++;
        } else if (ranks_before(v, id, out[0])) {
            out[0] = id;
            heap_sift_down(out, m, 0, v, 0);
        }
    }
    /* heapsort: the root (worst) goes to the end each round -> best first */
    for (int e = m - 1; e > 0; e--) {
        int32_t t = out[0];
        out[0] = out[e];
        out[e] = t;
        heap_sift_down(out, e, 0, v, 0);
    }
    return m;
}

/* Buckets for top-p: the top 11 bits of a positive float (8 exponent bits and
 * 3 mantissa bits) order buckets like the values they hold. */
static inline int p_bucket(float p) {
    union {
        float f;
        uint32_t u;
    } b = {.f = p};
    return (int)(b.u >> 20);
}

/* The nucleus of unnormalised probabilities pv[0..V) with total Z: the
 * smallest set of top tokens whose mass reaches top_p * Z (at least one).
 * Its members need no order for the draw, only the boundary matters, so
 * instead of sorting the vocabulary: one pass adds up the mass per bucket; the
 * buckets above the one where the running mass (from the top) reaches the
 * target are wholly in; only the tokens of that boundary bucket are ordered,
 * by partial heap extraction, until the target is reached.  Writes the ids
 * into cand (whole buckets in id order, then the boundary tokens best first)
 * and returns their count. */
static int select_top_p(const float *pv, int V, double Z, double top_p, int32_t *cand, double *mass) {
    memset(mass, 0, TOP_P_BUCKETS * sizeof *mass);
    for (int i = 0; i < V; i++)
        if (pv[i] > 0.0f) mass[p_bucket(pv[i])] += pv[i];
    const double target = top_p * Z;
    double above = 0.0;
    int b = TOP_P_BUCKETS - 1;
    for (; b > 0; b--) {
        if (above + mass[b] >= target) break;
        above += mass[b];
    }
    /* whole buckets to the front (id order), boundary bucket to the back */
    int n = 0, nb = 0;
    for (int i = 0; i < V; i++) {
        if (!(pv[i] > 0.0f)) continue;
        int k = p_bucket(pv[i]);
        if (k > b)
            cand[n++] = i;
        else if (k == b)
            cand[V - 1 - nb++] = i;
    }
    double cum = 0.0;
    for (int j = 0; j < n; j++)
        cum += pv[cand[j]];
    int32_t *h = cand + V - nb; /* max-heap of the boundary bucket */
    for (int i = nb / 2 - 1; i >= 0; i--)
        heap_sift_down(h, nb, i, pv, 1);
    int hn = nb, m = 0;
    while (hn > 0 && (cum < target || n + m == 0)) { /* pop the best; it lands at h[hn-1] */
        int32_t best = h[0];
        cum += pv[best];
        h[0] = h[hn - 1];
        h[hn - 1] = best;
        hn--;
        heap_sift_down(h, hn, 0, pv, 1);
        m++;
    }
    /* the popped tokens sit at cand[V-m..V), worst first: best first, then
     * right after the whole buckets (the ranges may overlap: memmove) */
    for (int x = V - m, y = V - 1; x < y; x++, y--) {
        int32_t t = cand[x];
        cand[x] = cand[y];
        cand[y] = t;
    }
    memmove(cand + n, cand + V - m, (size_t)m * sizeof *cand);
    return n + m;
}

/* ----- parameters ----- */

void dsv4_sampling_params_default(dsv4_sampling_params *p) {
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
    p->logprobs_mode = DSV4_LOGPROBS_RAW;
}

int dsv4_sampling_params_check(const dsv4_sampling_params *p, int vocab_size, dsv4_err *err) {
    if (!p) return dsv4_errf(err, "sampling parameters: NULL");
    if (!isfinite(p->temperature) || p->temperature < 0)
        return dsv4_errf(err, "temperature: %g is not a finite number >= 0", (double)p->temperature);
    if (p->top_k < -1) return dsv4_errf(err, "top_k: %d is negative (use 0 or -1 for no limit)", p->top_k);
    if (!(p->top_p >= 0.0f && p->top_p <= 1.0f))
        return dsv4_errf(err, "top_p: %g is not in [0, 1]", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return dsv4_errf(err, "min_p: %g is not in [0, 1]", (double)p->min_p);
    if (!isfinite(p->presence_penalty))
        return dsv4_errf(err, "presence_penalty: %g is not finite", (double)p->presence_penalty);
    if (!isfinite(p->frequency_penalty))
        return dsv4_errf(err, "frequency_penalty: %g is not finite", (double)p->frequency_penalty);
    if (!isfinite(p->repetition_penalty) || p->repetition_penalty <= 0)
        return dsv4_errf(err, "repetition_penalty: %g is not a finite number > 0",
                         (double)p->repetition_penalty);
    if (p->logprobs != 0 && p->logprobs != 1)
        return dsv4_errf(err, "logprobs: %d is not 0 or 1", p->logprobs);
    if (p->top_logprobs < 0 || p->top_logprobs > DSV4_SAMPLER_MAX_TOP_LOGPROBS)
        return dsv4_errf(err, "top_logprobs: %d is not in [0, %d]", p->top_logprobs,
                         DSV4_SAMPLER_MAX_TOP_LOGPROBS);
    if (p->logprobs_mode != DSV4_LOGPROBS_RAW && p->logprobs_mode != DSV4_LOGPROBS_PROCESSED)
        return dsv4_errf(err, "logprobs_mode: %d is not raw (0) or processed (1)", (int)p->logprobs_mode);
    if (p->n_logit_bias < 0 || p->n_logit_bias > DSV4_SAMPLER_MAX_LOGIT_BIAS)
        return dsv4_errf(err, "logit_bias: %d entries (at most %d)", p->n_logit_bias,
                         DSV4_SAMPLER_MAX_LOGIT_BIAS);
    if (p->n_logit_bias > 0 && (!p->logit_bias_ids || !p->logit_bias_values))
        return dsv4_errf(err, "logit_bias: %d entries but no arrays", p->n_logit_bias);
    for (int i = 0; i < p->n_logit_bias; i++) {
        int32_t id = p->logit_bias_ids[i];
        if (id < 0 || id >= vocab_size)
            return dsv4_errf(err, "logit_bias: token id %ld is outside the vocabulary [0, %d)", (long)id,
                             vocab_size);
        if (!isfinite(p->logit_bias_values[i]))
            return dsv4_errf(err, "logit_bias: value for token id %ld is not finite", (long)id);
    }
    return 0;
}

/* ----- lifetime ----- */

int dsv4_sampler_init(dsv4_sampler **out, int vocab_size, const dsv4_sampling_params *p, dsv4_err *err) {
    if (!out) return dsv4_errf(err, "sampler init: NULL output pointer");
    *out = NULL;
    if (vocab_size < 1) return dsv4_errf(err, "sampler init: vocab_size %d is not >= 1", vocab_size);
    dsv4_sampler *s = calloc(1, sizeof *s);
    if (!s) return dsv4_errf(err, "sampler init: out of memory");
    size_t V = (size_t)vocab_size;
    s->vocab = vocab_size;
    s->count = calloc(V, sizeof *s->count);
    s->seen = malloc(V * sizeof *s->seen);
    s->work = malloc(V * sizeof *s->work);
    s->cand = malloc(V * sizeof *s->cand);
    s->bias_id = malloc(DSV4_SAMPLER_MAX_LOGIT_BIAS * sizeof *s->bias_id);
    s->bias_val = malloc(DSV4_SAMPLER_MAX_LOGIT_BIAS * sizeof *s->bias_val);
    if (!s->count || !s->seen || !s->work || !s->cand || !s->bias_id || !s->bias_val) {
        dsv4_sampler_free(s);
        return dsv4_errf(err, "sampler init: out of memory for a vocabulary of %d", vocab_size);
    }
    if (dsv4_sampler_reset(s, p, err) != 0) {
        dsv4_sampler_free(s);
        return -1;
    }
    *out = s;
    return 0;
}

void dsv4_sampler_free(dsv4_sampler *s) {
    if (!s) return;
    free(s->count);
    free(s->seen);
    free(s->work);
    free(s->cand);
    free(s->bias_id);
    free(s->bias_val);
    free(s);
}

static uint64_t clock_seed(dsv4_sampler *s) {
    struct timespec a, b;
    clock_gettime(CLOCK_REALTIME, &a);
    clock_gettime(CLOCK_MONOTONIC, &b);
    uint64_t x = (uint64_t)a.tv_sec * 1000000000ull + (uint64_t)a.tv_nsec;
    x ^= rotl64((uint64_t)b.tv_sec * 1000000000ull + (uint64_t)b.tv_nsec, 29);
    x ^= rotl64((uint64_t)(uintptr_t)s, 41) ^ (++s->n_resets * 0x9e3779b97f4a7c15ull);
    return splitmix64(&x);
}

int dsv4_sampler_reset(dsv4_sampler *s, const dsv4_sampling_params *p, dsv4_err *err) {
    if (!s) return dsv4_errf(err, "sampler reset: NULL sampler");
    dsv4_sampling_params def;
    if (!p) {
        dsv4_sampling_params_default(&def);
        p = &def;
    }
    s->ready = 0;
    for (int i = 0; i < s->n_seen; i++)
        s->count[s->seen[i]] = 0;
    s->n_seen = 0;
    s->n_bias = 0;
    if (dsv4_sampling_params_check(p, s->vocab, err) != 0) return dsv4_err_prefix(err, "sampler");
    /* logit_bias: reject repeated ids, using cand as a scratch mark table */
    for (int i = 0; i < p->n_logit_bias; i++)
        s->cand[p->logit_bias_ids[i]] = -1;
    for (int i = 0; i < p->n_logit_bias; i++) {
        int32_t id = p->logit_bias_ids[i];
        if (s->cand[id] == 1)
            return dsv4_errf(err, "sampler: logit_bias: token id %ld appears twice", (long)id);
        s->cand[id] = 1;
        s->bias_id[i] = id;
        s->bias_val[i] = p->logit_bias_values[i];
    }
    s->n_bias = p->n_logit_bias;
    s->p = *p;
    s->p.logit_bias_ids = NULL;
    s->p.logit_bias_values = NULL;
    if (s->p.top_logprobs > 0) s->p.logprobs = 1;
    s->seed = p->has_seed ? p->seed : clock_seed(s);
    rng_seed(s->rng, s->seed);
    s->ready = 1;
    return 0;
}

uint64_t dsv4_sampler_seed(const dsv4_sampler *s) {
    return s ? s->seed : 0;
}

/* ----- history ----- */

int dsv4_sampler_add_prompt(dsv4_sampler *s, const int32_t *ids, size_t n, dsv4_err *err) {
    if (!s || (n > 0 && !ids)) return dsv4_errf(err, "sampler add_prompt: NULL argument");
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= s->vocab)
            return dsv4_errf(err, "sampler: prompt token %zu has id %ld outside the vocabulary [0, %d)", i,
                             (long)ids[i], s->vocab);
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t c = s->count[ids[i]];
        if (c == 0) s->seen[s->n_seen++] = ids[i];
        s->count[ids[i]] = c | PROMPT_BIT;
    }
    return 0;
}

int dsv4_sampler_accept(dsv4_sampler *s, int32_t id, dsv4_err *err) {
    if (!s) return dsv4_errf(err, "sampler accept: NULL sampler");
    if (id < 0 || id >= s->vocab)
        return dsv4_errf(err, "sampler: accepted token id %ld is outside the vocabulary [0, %d)", (long)id,
                         s->vocab);
    uint32_t c = s->count[id];
    if (c == 0) s->seen[s->n_seen++] = id;
    uint32_t gen = c & GEN_MASK;
    if (gen < GEN_MASK) gen++;
    s->count[id] = (c & PROMPT_BIT) | gen;
    return 0;
}

/* ----- the sampler ----- */

/* A processed logit back to float: finite inputs stay finite (saturate), -inf stays -inf. */
static float to_logit(double x) {
    if (x > FLT_MAX) return FLT_MAX;
    if (x < -FLT_MAX) return x == -INFINITY ? -INFINITY : -FLT_MAX;
    return (float)x;
}

/* repetition penalty -> presence/frequency penalties -> logit_bias, on w.
 * Returns 1 if it may have changed anything. */
static int apply_penalties(dsv4_sampler *s, float *w) {
    const dsv4_sampling_params *p = &s->p;
    double rep = p->repetition_penalty, pres = p->presence_penalty, freq = p->frequency_penalty;
    int changed = s->n_bias > 0;
    if ((rep != 1.0 || pres != 0.0 || freq != 0.0) && s->n_seen > 0) {
        changed = 1;
        for (int i = 0; i < s->n_seen; i++) {
            int32_t id = s->seen[i];
            uint32_t gen = s->count[id] & GEN_MASK;
            double l = w[id];
            if (rep != 1.0) l = l > 0 ? l / rep : l * rep;
            if (gen > 0) l -= pres + freq * (double)gen;
            w[id] = to_logit(l);
        }
    }
    for (int i = 0; i < s->n_bias; i++)
        w[s->bias_id[i]] = to_logit((double)w[s->bias_id[i]] + s->bias_val[i]);
    return changed;
}

/* Fills out->logprob for token and out->top_* from values v whose
 * log-normaliser is lz (logprob = v - lz); ids/n restrict the alternatives
 * (ids NULL: 0..n-1). */
static void report_logprobs(const float *v, double lz, int log_of_v, const int32_t *ids, int n, int n_top,
                            int32_t token, dsv4_sample *out) {
    out->logprob = (float)((log_of_v ? log(v[token]) : (double)v[token]) - lz);
    out->n_top = select_best(v, ids, n, n_top, out->top_ids);
    for (int j = 0; j < out->n_top; j++) {
        double x = v[out->top_ids[j]];
        out->top_logprobs[j] = (float)((log_of_v ? log(x) : x) - lz);
    }
}

int dsv4_sampler_sample(dsv4_sampler *s, const float *logits, dsv4_sample *out, dsv4_err *err) {
    if (!s || !logits || !out) return dsv4_errf(err, "sampler sample: NULL argument");
    if (!s->ready) return dsv4_errf(err, "sampler: not usable: its last reset failed");
    const dsv4_sampling_params *p = &s->p;
    const int V = s->vocab;
    float *w = s->work;
    int32_t *cand = s->cand;
    memset(out, 0, sizeof *out);

    /* pass 1: validate, copy, maximum (ties keep the lowest id) */
    int32_t best = 0;
    float M = -INFINITY;
    for (int i = 0; i < V; i++) {
        float x = logits[i];
        if (isnan(x) || x == INFINITY)
            return dsv4_errf(err, "sampler: logit of token %d is %s", i, isnan(x) ? "NaN" : "+inf");
        w[i] = x;
        if (x > M) {
            M = x;
            best = i;
        }
    }
    if (M == -INFINITY) return dsv4_errf(err, "sampler: every logit is -inf");
    const int want_lp = p->logprobs, n_top = p->top_logprobs;
    const int raw = p->logprobs_mode == DSV4_LOGPROBS_RAW;
    const double raw_lse = want_lp && raw ? logsumexp_with_max(logits, V, M) : 0.0;
    if (want_lp && raw) report_logprobs(logits, raw_lse, 0, NULL, V, n_top, best, out);

    if (apply_penalties(s, w)) {
        best = 0;
        M = w[0];
        for (int i = 1; i < V; i++)
            if (w[i] > M) {
                M = w[i];
                best = i;
            }
        if (M == -INFINITY)
            return dsv4_errf(err, "sampler: every token has logit -inf after penalties and logit_bias");
    }

    int32_t token;
    if (p->temperature == 0.0f) {
        token = best;
        if (want_lp && !raw) report_logprobs(w, logsumexp_with_max(w, V, M), 0, NULL, V, n_top, token, out);
    } else {
        const double T = p->temperature;
        int32_t *kept = NULL; /* NULL: every token, in id order */
        int n_kept = V;
        if (p->top_k > 0 && p->top_k < V) {
            /* top-k on the logits (same order as the probabilities), then
             * probabilities for those k only */
            n_kept = select_best(w, NULL, V, p->top_k, cand);
            for (int j = 0; j < n_kept; j++)
                w[cand[j]] = (float)det_exp(((double)w[cand[j]] - M) / T);
            while (n_kept > 1 && w[cand[n_kept - 1]] == 0.0f)
                n_kept--;
            kept = cand;
            if (p->top_p < 1.0f) { /* already sorted: walk the prefix */
                double Z = 0.0, cum = 0.0;
                for (int j = 0; j < n_kept; j++)
                    Z += w[cand[j]];
                double target = (double)p->top_p * Z;
                int m = 0;
                do
                    cum += w[cand[m++]];
                while (m < n_kept && cum < target);
                n_kept = m;
            }
        } else {
            exp_shifted(w, w, V, M, T);
            if (p->top_p < 1.0f) {
                n_kept = select_top_p(w, V, sum_f32(w, V), p->top_p, cand, s->top_p_mass);
                kept = cand;
            }
        }
        if (p->min_p > 0.0f) {
            /* the best token has p = exp(0) = 1 exactly, so min_p * p_max = min_p */
            float thr = p->min_p;
            int m = 0;
            if (!kept) {
                for (int i = 0; i < V; i++)
                    if (w[i] >= thr) cand[m++] = i;
                kept = cand;
            } else {
                for (int j = 0; j < n_kept; j++)
                    if (w[kept[j]] >= thr) kept[m++] = kept[j];
            }
            n_kept = m; /* >= 1: the best token always passes */
        }
        /* the draw: one uniform against the running sum, in the kept order */
        double Z = 0.0;
        if (kept)
            for (int j = 0; j < n_kept; j++)
                Z += w[kept[j]];
        else
            Z = sum_f32(w, V);
        double r = rng_uniform(s->rng) * Z, cum = 0.0;
        token = -1;
        int32_t last_nonzero = best;
        for (int j = 0; j < n_kept; j++) {
            int32_t id = kept ? kept[j] : j;
            if (w[id] == 0.0f) continue;
            cum += w[id];
            last_nonzero = id;
            if (cum > r) {
                token = id;
                break;
            }
        }
        if (token < 0) token = last_nonzero; /* rounding: r at or past the last partial sum */
        if (want_lp && !raw) report_logprobs(w, log(Z), 1, kept, n_kept, n_top, token, out);
    }
    if (want_lp && raw) out->logprob = (float)((double)logits[token] - raw_lse);
    out->token = token;
    return 0;
}
