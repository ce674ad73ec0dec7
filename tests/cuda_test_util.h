/* tests/cuda_test_util.h: what the GPU op tests share (included by tests/test_cuda_*.c
 * only; every function is static): a seeded generator (CUDA_TEST_SEED), the CPU and CUDA
 * backends and the SKIP line when there is no device (CUDA_TEST_NAME), the relative L2
 * error, and test weights in every stored format (f32, bf16, FP8 with e8m0 or f32 128x128
 * block scales, MXFP4, NVFP4), parked until exit because the CUDA backend keys its device
 * copies by the host data pointer. */
#ifndef DSV4_TESTS_CUDA_TEST_UTIL_H
#define DSV4_TESTS_CUDA_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "model/quant.h"
#include "test.h"

#ifndef CUDA_TEST_SEED
#define CUDA_TEST_SEED 12345
#endif
#ifndef CUDA_TEST_NAME
#define CUDA_TEST_NAME "test_cuda"
#endif

static uint32_t rng = CUDA_TEST_SEED;
static float frand(void) {
    rng = rng * 1664525u + 1013904223u;
    return ((rng >> 8) / 16777216.0f) * 2.0f - 1.0f;
}
static uint32_t urand(void) {
    rng = rng * 1664525u + 1013904223u;
    return rng >> 8;
}
static void fill(float *x, size_t n, float s) {
    for (size_t i = 0; i < n; i++) x[i] = frand() * s;
}

static dsv4_backend cpu, gpu;
static int have_gpu = -1;
static int ready(void) {
    if (have_gpu < 0) {
        dsv4_err err;
        have_gpu = 0;
        if (dsv4_backend_cpu_init(&cpu, 2, &err)) return 0;
        if (dsv4_backend_cuda_init(&gpu, 0, &err) == 0) have_gpu = 1;
        else { /* no PASS lines without a device: a skipped GPU test must not count as passed */
            printf("SKIP %s: %s\n# 0 passed, 0 failed\n", CUDA_TEST_NAME, err.msg);
            exit(0);
        }
    }
    return have_gpu;
}
#define NEED_GPU()                                                                                                   \
    do {                                                                                                             \
        if (!ready()) return;                                                                                        \
    } while (0)

/* dsv4_backend_cuda_init(g, 0) with the environment variable name set to value during the call,
 * then name as it was (for the switches the backend reads at init: the op table's); 0 on success,
 * else the error printed */
static inline int cuda_init_env(dsv4_backend *g, const char *name, const char *value) {
    const char *was = getenv(name);
    char saved[256];
    int had = was != NULL;
    if (had) snprintf(saved, sizeof saved, "%s", was); /* setenv may free what getenv returned */
    setenv(name, value, 1);
    dsv4_err err;
    int rc = dsv4_backend_cuda_init(g, 0, &err);
    if (had) setenv(name, saved, 1);
    else unsetenv(name);
    if (rc) fprintf(stderr, "  backend with %s=%s: %s\n", name, value, err.msg);
    return rc;
}

static int gpu_ok(void) {
    dsv4_err err;
    if (gpu.ops->check(&gpu, &err)) {
        fprintf(stderr, "  cuda error: %s\n", err.msg);
        return 0;
    }
    return 1;
}

static double rel(const float *a, const float *ref, size_t n) {
    double d = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) != isnan(ref[i])) return INFINITY;
        if (isnan(ref[i])) continue;
        if (isinf(ref[i]) || isinf(a[i])) { /* equal infinities are a match */
            if (a[i] != ref[i]) return INFINITY;
            continue;
        }
        d += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        s += (double)ref[i] * ref[i];
    }
    return s > 0 ? sqrt(d / s) : sqrt(d);
}

/* ----- weights in every format ----- */
typedef struct {
    dsv4_weight w;
    void *data, *scale;
} tw;

static uint8_t rand_e4m3(void) {
    uint8_t c;
    do c = (uint8_t)urand();
    while ((c & 0x7f) == 0x7f);
    return c;
}

static tw make_w(dsv4_wfmt fmt, int64_t rows, int64_t cols, int scale_f32) {
    tw t;
    memset(&t, 0, sizeof t);
    t.w.fmt = fmt;
    t.w.rows = rows;
    t.w.cols = cols;
    t.w.name = "test";
    size_t n = (size_t)(rows * cols);
    if (fmt == DSV4_WF_F32) {
        float *d = malloc(sizeof(float) * n);
        fill(d, n, 0.5f);
        t.data = d;
    } else if (fmt == DSV4_WF_BF16) {
        uint16_t *d = malloc(2 * n);
        for (size_t i = 0; i < n; i++) d[i] = dsv4_f32_to_bf16(frand() * 0.5f);
        t.data = d;
    } else if (fmt == DSV4_WF_FP8) {
        uint8_t *d = malloc(n);
        for (size_t i = 0; i < n; i++) d[i] = rand_e4m3();
        int64_t sb = ((rows + 127) / 128) * ((cols + 127) / 128);
        if (scale_f32) {
            float *s = malloc(sizeof(float) * sb);
            for (int64_t i = 0; i < sb; i++) s[i] = ldexpf(1.0f + 0.5f * frand(), -9);
            t.scale = s;
        } else {
            uint8_t *s = malloc(sb);
            for (int64_t i = 0; i < sb; i++) s[i] = (uint8_t)(127 - 9 + (int)(urand() % 4));
            t.scale = s;
        }
        t.data = d;
        t.w.block = 128;
        t.w.scale_f32 = scale_f32;
    } else { /* MXFP4 / NVFP4 */
        size_t nb = (size_t)(rows * ((cols + 1) / 2));
        uint8_t *d = malloc(nb);
        for (size_t i = 0; i < nb; i++) d[i] = (uint8_t)urand();
        int g = fmt == DSV4_WF_MXFP4 ? 32 : 16;
        size_t ns = (size_t)(rows * ((cols + g - 1) / g));
        uint8_t *s = malloc(ns);
        for (size_t i = 0; i < ns; i++)
            s[i] = fmt == DSV4_WF_MXFP4 ? (uint8_t)(127 - 4 + (int)(urand() % 3))
                                        : dsv4_f32_to_e4m3(0.05f + 0.1f * (frand() + 1));
        t.data = d;
        t.scale = s;
        t.w.scale2 = 0.75f;
    }
    t.w.data = t.data;
    t.w.scale = t.scale;
    return t;
}
/* x for the act_quant paths: blocks of 128 at scales 2^-24 .. 2^24, a block below act_quant's
 * amax floor (1e-4), a block whose values fall on e4m3 rounding ties at scale 1 (amax 448: the
 * midpoints between neighbours, subnormal ones included, round to even), exact zeros and -0.
 * static inline: files that do not call it compile without a warning. */
static inline void fill_aq(float *x, int64_t K) {
    for (int64_t b = 0; b < K / 128; b++) {
        float sc = ldexpf(1.0f, (int)(b * 7 % 49) - 24);
        for (int64_t i = 0; i < 128; i++) x[b * 128 + i] = sc * (2.0f * frand() - 1.0f);
    }
    if (K >= 512) {
        for (int64_t i = 0; i < 128; i++) x[128 + i] = 1e-6f * (2.0f * frand() - 1.0f);
        float *t = x + 256;
        t[0] = 448.0f;
        for (int i = 1; i < 128; i++) { /* the midpoint above e4m3 value c (codes 0..125, both signs) */
            int c = (i * 37) % 126;
            float lo = (c >> 3) ? ldexpf(1.0f + (c & 7) / 8.0f, (c >> 3) - 7) : ldexpf((float)(c & 7), -9);
            float hi = ((c + 1) >> 3) ? ldexpf(1.0f + ((c + 1) & 7) / 8.0f, ((c + 1) >> 3) - 7)
                                      : ldexpf((float)((c + 1) & 7), -9);
            t[i] = (i & 1 ? -0.5f : 0.5f) * (lo + hi);
        }
        x[384] = 0.0f, x[385] = -0.0f;
    }
}

/* ne routed experts of rfmt (inter ri) and a shared one of sfmt (inter si), hidden d, their
 * weights in parts[3 (ne + 1)] (w1, w2, w3 of each, made in that order); sf32: FP8 f32 scales.
 * static inline: files that do not call it compile without a warning. */
static inline void make_ffns(tw *parts, dsv4_ffn_w *ex, dsv4_ffn_w *sh, int ne, int64_t d, dsv4_wfmt rfmt, int64_t ri,
                             dsv4_wfmt sfmt, int64_t si, int sf32) {
    for (int x = 0; x <= ne; x++) {
        dsv4_wfmt f = x < ne ? rfmt : sfmt;
        int64_t in = x < ne ? ri : si;
        parts[3 * x] = make_w(f, in, d, sf32);
        parts[3 * x + 1] = make_w(f, d, in, sf32);
        parts[3 * x + 2] = make_w(f, in, d, sf32);
        dsv4_ffn_w fw = {.w1 = parts[3 * x].w, .w2 = parts[3 * x + 1].w, .w3 = parts[3 * x + 2].w};
        if (x < ne) ex[x] = fw;
        else *sh = fw;
    }
}

/* The CUDA backend keys its device copies by the host data pointer, so a weight's
 * memory must outlive the backend (as a mapped checkpoint does): freed test weights
 * are parked here and released at exit. */
static void *parked[4096];
static int n_parked;
static void free_w(tw *t) {
    if (n_parked + 2 <= 4096) {
        parked[n_parked++] = t->data;
        parked[n_parked++] = t->scale;
    }
}

/* CUDA matmul_grouped against the CPU op on random inputs: G groups of R x C weights in fmt,
 * rows rows; in/out_bf16 as the profile's flags.  Tolerance 2e-6 relative (4e-3 with bf16
 * rounding).  static inline: files that do not call it compile without a warning. */
static inline void cuda_check_grouped(dsv4_wfmt fmt, int G, int64_t R, int64_t C, int rows, int in_bf16,
                                      const char *what) {
    tw t = make_w(fmt, (int64_t)G * R, C, 0);
    size_t nx = (size_t)rows * G * C, no = (size_t)rows * G * R;
    float *x = malloc(sizeof(float) * nx), *a = malloc(sizeof(float) * no), *g = malloc(sizeof(float) * no);
    REQUIRE(x && a && g);
    fill(x, nx, 1);
    cpu.ops->matmul_grouped(&cpu, a, x, rows, &t.w, G, in_bf16, in_bf16, 0);
    for (size_t i = 0; i < no; i++) g[i] = NAN;
    gpu.ops->matmul_grouped(&gpu, g, x, rows, &t.w, G, in_bf16, in_bf16, 0);
    int ok = gpu_ok();
    double r = rel(g, a, no), tol = in_bf16 ? 4e-3 : 2e-6;
    printf("  %-14s %-6s %d x [%5lld x %5lld] rows %d in/out_bf16 %d: rel %.2e (tol %.0e)\n", what,
           dsv4_wfmt_name(fmt), G, (long long)R, (long long)C, rows, in_bf16, r, tol);
    CHECKF(ok && r <= tol, "grouped %s %s rel %g", what, dsv4_wfmt_name(fmt), r);
    free(x), free(a), free(g);
    free_w(&t);
}

#endif
