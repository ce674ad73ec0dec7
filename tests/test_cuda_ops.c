/* tests/test_cuda_ops: every CUDA op against the CPU reference op on random inputs.
 *
 * Tolerances (stated per op; "rel" = ||gpu - cpu||_2 / ||cpu||_2 over the output):
 *   fp32-output linears, norms, mHC, attention, indexer, pool: rel <= 2e-6 .. 1e-5
 *     (accumulation order is the only difference: lane-strided sums and warp trees
 *     against the CPU's 8-way partial sums);
 *   outputs rounded to bf16: rel <= 4e-3 (an order difference can flip one bf16 ulp);
 *   sim (bf16, fp8 b64, Hadamard+fp4, fp8 row, fp4): bit-exact;
 *   topk, route (experts): identical ids; route weights rel <= 1e-6.
 * Without a CUDA device (or in a CPU-only build) the binary prints SKIP and reports no tests
 * nothing.  Weights are built here in every stored format (f32, bf16, FP8 with e8m0
 * and f32 block scales, MXFP4, NVFP4), including partial blocks. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "model/quant.h"
#include "test.h"

static uint32_t rng = 12345;
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
            printf("SKIP test_cuda_ops: %s\n# 0 passed, 0 failed\n", err.msg);
            exit(0);
        }
    }
    return have_gpu;
}
#define NEED_GPU()                                                                                                   \
    do {                                                                                                             \
        if (!ready()) return;                                                                                        \
    } while (0)

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

/* ----- linears ----- */
static void check_matmul(dsv4_wfmt fmt, int64_t O, int64_t K, int rows, int act_fp8, int out_bf16, int sf32,
                         double tol) {
    tw t = make_w(fmt, O, K, sf32);
    float *x = malloc(sizeof(float) * rows * K), *a = malloc(sizeof(float) * rows * O),
          *g = malloc(sizeof(float) * rows * O);
    fill(x, (size_t)rows * K, 2);
    cpu.ops->matmul(&cpu, a, x, rows, &t.w, act_fp8, out_bf16);
    for (int64_t i = 0; i < rows * O; i++) g[i] = NAN;
    gpu.ops->matmul(&gpu, g, x, rows, &t.w, act_fp8, out_bf16);
    CHECK(gpu_ok());
    double r = rel(g, a, (size_t)rows * O);
    printf("  matmul %-6s [%lld x %lld] rows %2d act_fp8 %d out_bf16 %d: rel %.2e (tol %.0e)\n", dsv4_wfmt_name(fmt),
           (long long)O, (long long)K, rows, act_fp8, out_bf16, r, tol);
    CHECKF(r <= tol, "matmul %s rel %g", dsv4_wfmt_name(fmt), r);
    free(x), free(a), free(g);
    free_w(&t);
}

static void test_matmul(void) {
    NEED_GPU();
    const dsv4_wfmt fmts[] = {DSV4_WF_F32, DSV4_WF_BF16, DSV4_WF_FP8, DSV4_WF_MXFP4, DSV4_WF_NVFP4};
    for (size_t f = 0; f < 5; f++) {
        check_matmul(fmts[f], 300, 512, 1, 0, 0, 0, 2e-6);
        check_matmul(fmts[f], 300, 512, 11, 1, 0, 0, 2e-6); /* > 8 rows: chunked; act_fp8 for quantized */
        check_matmul(fmts[f], 37, 300, 3, 1, 0, 0, 2e-6);   /* odd shapes: partial blocks, scalar path */
        check_matmul(fmts[f], 256, 1024, 5, 0, 1, 0, 4e-3);
        check_matmul(fmts[f], 40, 4096, 3, 1, 0, 0, 2e-6);  /* few features: split-K */
        check_matmul(fmts[f], 24, 16384, 9, 0, 1, 0, 4e-3); /* split-K over 16 slices, > 8 rows */
    }
    check_matmul(DSV4_WF_FP8, 256, 384, 4, 1, 0, 1, 2e-6); /* f32 block scales (Flash-Base) */
}

static void test_matmul_grouped(void) {
    NEED_GPU();
    for (int in_bf16 = 0; in_bf16 < 2; in_bf16++) {
        int G = 4, R = 64, C = 256, rows = 3;
        tw t = make_w(DSV4_WF_FP8, G * R, C, 0);
        float x[3 * 4 * 256], a[3 * 256], g[3 * 256];
        fill(x, sizeof x / 4, 1);
        cpu.ops->matmul_grouped(&cpu, a, x, rows, &t.w, G, in_bf16, in_bf16);
        gpu.ops->matmul_grouped(&gpu, g, x, rows, &t.w, G, in_bf16, in_bf16);
        CHECK(gpu_ok());
        double r = rel(g, a, (size_t)rows * G * R), tol = in_bf16 ? 4e-3 : 2e-6;
        printf("  matmul_grouped in/out_bf16 %d: rel %.2e (tol %.0e)\n", in_bf16, r, tol);
        CHECK(r <= tol);
        free_w(&t);
    }
}

static void test_embed(void) {
    NEED_GPU();
    tw t = make_w(DSV4_WF_BF16, 100, 96, 0);
    int32_t tok[4] = {0, 99, 17, 17};
    float a[4 * 96], g[4 * 96];
    cpu.ops->embed(&cpu, a, tok, 4, &t.w);
    gpu.ops->embed(&gpu, g, tok, 4, &t.w);
    CHECK(gpu_ok());
    CHECK(memcmp(a, g, sizeof a) == 0);
    free_w(&t);
}

/* ----- norms, rope, scale, sim ----- */
static void test_norm_rope_scale(void) {
    NEED_GPU();
    enum { R = 5, D = 512 };
    float x[R * D], a[R * D], g[R * D];
    tw w = make_w(DSV4_WF_BF16, 1, D, 0);
    for (int bf = 0; bf < 2; bf++) {
        fill(x, R * D, 3);
        cpu.ops->rmsnorm(&cpu, a, x, R, D, &w.w, 1e-6f, bf);
        gpu.ops->rmsnorm(&gpu, g, x, R, D, &w.w, 1e-6f, bf);
        CHECK(gpu_ok());
        double r = rel(g, a, R * D);
        printf("  rmsnorm out_bf16 %d: rel %.2e\n", bf, r);
        CHECK(r <= (bf ? 4e-3 : 1e-6));
        cpu.ops->rmsnorm(&cpu, a, x, R * 8, D / 8, NULL, 1e-6f, bf); /* per-head, unweighted */
        gpu.ops->rmsnorm(&gpu, g, x, R * 8, D / 8, NULL, 1e-6f, bf);
        CHECK(rel(g, a, R * D) <= (bf ? 4e-3 : 1e-6));
    }
    int64_t pos[R] = {0, 1, 77, 4095, 1000000};
    double freq[32];
    for (int i = 0; i < 32; i++) freq[i] = 1.0 / pow(10000.0, 2.0 * i / 64);
    for (int inv = 0; inv < 2; inv++) {
        fill(x, R * D, 1);
        memcpy(a, x, sizeof x);
        memcpy(g, x, sizeof x);
        cpu.ops->rope(&cpu, a, R, 4, 128, 64, pos, freq, inv, 0);
        gpu.ops->rope(&gpu, g, R, 4, 128, 64, pos, freq, inv, 0);
        CHECK(gpu_ok());
        double r = rel(g, a, R * D);
        printf("  rope inverse %d: rel %.2e (tol 1e-6)\n", inv, r);
        CHECK(r <= 1e-6);
    }
    fill(x, R * D, 1);
    memcpy(a, x, sizeof x);
    memcpy(g, x, sizeof x);
    cpu.ops->scale(&cpu, a, R * D, 0.37f, 1);
    gpu.ops->scale(&gpu, g, R * D, 0.37f, 1);
    CHECK(gpu_ok());
    CHECK(memcmp(a, g, sizeof a) == 0);
    free_w(&w);
}

static void test_sim_exact(void) {
    NEED_GPU();
    enum { R = 6, S = 200 };
    float x[R * S], a[R * S], g[R * S];
    for (int mode = DSV4_SIM_BF16; mode <= DSV4_SIM_FP4_B32; mode++) {
        int col0 = mode == DSV4_SIM_HAD_FP4_B32 ? 8 : 3, width = mode == DSV4_SIM_HAD_FP4_B32 ? 128 : 190;
        fill(x, R * S, 4);
        x[5] = 1e-7f; /* tiny values and a zero block edge */
        memcpy(a, x, sizeof x);
        memcpy(g, x, sizeof x);
        cpu.ops->sim(&cpu, a, R, S, col0, width, mode);
        gpu.ops->sim(&gpu, g, R, S, col0, width, mode);
        CHECK(gpu_ok());
        int diff = 0;
        for (int i = 0; i < R * S; i++) diff += memcmp(&a[i], &g[i], 4) != 0;
        printf("  sim mode %d: %d of %d values differ (must be 0)\n", mode, diff, R * S);
        CHECK(diff == 0);
    }
}

/* ----- mHC ----- */
static void test_mhc(void) {
    NEED_GPU();
    enum { R = 3, HC = 4, D = 256, NM = (2 + HC) * HC };
    float *X = malloc(sizeof(float) * R * HC * D), ya[R * D], yg[R * D], pa[R * HC], pg[R * HC], ca[R * HC * HC],
          cg[R * HC * HC];
    tw fn = make_w(DSV4_WF_F32, NM, HC * D, 0), hfn = make_w(DSV4_WF_F32, HC, HC * D, 0);
    float base[NM], sc[3] = {0.7f, 1.1f, 0.9f};
    fill(base, NM, 1);
    dsv4_weight wb = {.fmt = DSV4_WF_F32, .rows = 1, .cols = NM, .data = base},
                ws = {.fmt = DSV4_WF_F32, .rows = 1, .cols = 3, .data = sc},
                hb = {.fmt = DSV4_WF_F32, .rows = 1, .cols = HC, .data = base + 1},
                hs = {.fmt = DSV4_WF_F32, .rows = 1, .cols = 1, .data = sc + 1};
    for (int bf = 0; bf < 2; bf++) {
        fill(X, R * HC * D, 2);
        cpu.ops->hc_pre(&cpu, ya, pa, ca, X, R, HC, D, &fn.w, &wb, &ws, 20, 1e-6f, 1e-6f, bf, bf);
        gpu.ops->hc_pre(&gpu, yg, pg, cg, X, R, HC, D, &fn.w, &wb, &ws, 20, 1e-6f, 1e-6f, bf, bf);
        CHECK(gpu_ok());
        double ry = rel(yg, ya, R * D), rp = rel(pg, pa, R * HC), rc = rel(cg, ca, R * HC * HC);
        printf("  hc_pre bf16 %d: y rel %.2e, post %.2e, comb %.2e\n", bf, ry, rp, rc);
        CHECK(ry <= (bf ? 4e-3 : 1e-5) && rp <= 1e-5 && rc <= 1e-5);
        float o[R * D], Xa[R * HC * D], Xg[R * HC * D];
        fill(o, R * D, 1);
        cpu.ops->hc_post(&cpu, Xa, o, X, pa, ca, R, HC, D, bf);
        gpu.ops->hc_post(&gpu, Xg, o, X, pa, ca, R, HC, D, bf);
        CHECK(gpu_ok());
        double rx = rel(Xg, Xa, R * HC * D);
        printf("  hc_post bf16 %d: rel %.2e\n", bf, rx);
        CHECK(rx <= (bf ? 4e-3 : 1e-6));
        cpu.ops->hc_head(&cpu, ya, X, R, HC, D, &hfn.w, &hb, &hs, 1e-6f, 1e-6f, bf, bf);
        gpu.ops->hc_head(&gpu, yg, X, R, HC, D, &hfn.w, &hb, &hs, 1e-6f, 1e-6f, bf, bf);
        CHECK(gpu_ok());
        double rh = rel(yg, ya, R * D);
        printf("  hc_head bf16 %d: rel %.2e\n", bf, rh);
        CHECK(rh <= (bf ? 4e-3 : 1e-5));
    }
    free(X);
    free_w(&fn);
    free_w(&hfn);
}

/* ----- attention, indexer, top-k, pool ----- */
static void test_sparse_attn(void) {
    NEED_GPU();
    enum { R = 3, NH = 4, HD = 128, NK = 150, MAXKV = 160 };
    float *keys = malloc(sizeof(float) * NK * HD), q[R * NH * HD], a[R * NH * HD], g[R * NH * HD], sink[NH];
    const float *kv[R * MAXKV];
    int n_kv[R] = {1, 97, 150};
    fill(keys, NK * HD, 1);
    fill(q, R * NH * HD, 1);
    fill(sink, NH, 2);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < n_kv[r]; j++) kv[r * MAXKV + j] = keys + (size_t)((j * 7 + r) % NK) * HD;
    for (int bf = 0; bf < 2; bf++) {
        cpu.ops->sparse_attn(&cpu, a, q, R, NH, HD, kv, n_kv, MAXKV, sink, 0.088f, bf, bf);
        gpu.ops->sparse_attn(&gpu, g, q, R, NH, HD, kv, n_kv, MAXKV, sink, 0.088f, bf, bf);
        CHECK(gpu_ok());
        double r = rel(g, a, R * NH * HD);
        printf("  sparse_attn bf16 %d: rel %.2e\n", bf, r);
        CHECK(r <= (bf ? 4e-3 : 2e-6));
    }
    free(keys);
}

static void test_indexer_topk(void) {
    NEED_GPU();
    enum { R = 3, NH = 8, HD = 128, NK = 300, MAXK = 320, K = 64 };
    float *keys = malloc(sizeof(float) * NK * HD), q[R * NH * HD], w[R * NH];
    float a[R * MAXK], g[R * MAXK];
    const float *kp[R * MAXK];
    int nk[R] = {10, 200, 300};
    fill(keys, NK * HD, 1);
    fill(q, R * NH * HD, 1);
    fill(w, R * NH, 1);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nk[r]; j++) kp[r * MAXK + j] = keys + (size_t)j * HD;
    for (int bf = 0; bf < 2; bf++) {
        for (int i = 0; i < R * MAXK; i++) a[i] = g[i] = -1234.5f; /* entries past n[r] must stay */
        cpu.ops->indexer_scores(&cpu, a, q, w, R, NH, HD, kp, nk, MAXK, bf);
        gpu.ops->indexer_scores(&gpu, g, q, w, R, NH, HD, kp, nk, MAXK, bf);
        CHECK(gpu_ok());
        double r = rel(g, a, R * MAXK);
        printf("  indexer_scores bf16 %d: rel %.2e\n", bf, r);
        CHECK(r <= (bf ? 8e-3 : 2e-6));
        CHECK(g[0 * MAXK + 10] == -1234.5f && g[1 * MAXK + 250] == -1234.5f);
    }
    /* top-k on identical scores: the CPU's */
    fill(a, R * MAXK, 1);
    for (int j = 0; j < 40; j++) a[MAXK + j * 3] = 0.5f; /* ties */
    int32_t ia[R * K], ig[R * K];
    int na[R], ng[R];
    memset(ig, 0xff, sizeof ig);
    cpu.ops->topk(&cpu, ia, na, a, R, MAXK, nk, K);
    gpu.ops->topk(&gpu, ig, ng, a, R, MAXK, nk, K);
    CHECK(gpu_ok());
    int same = 1;
    for (int r = 0; r < R; r++) {
        same &= na[r] == ng[r];
        for (int j = 0; j < na[r]; j++) same &= ia[r * K + j] == ig[r * K + j];
    }
    printf("  topk: %s\n", same ? "identical" : "DIFFERENT");
    CHECK(same);
    free(keys);
}

static void test_pool(void) {
    NEED_GPU();
    enum { N = 8, W = 300 };
    float kvb[N * W], gb[N * W], a[W], g[W];
    const float *kv[N], *gt[N];
    fill(kvb, N * W, 2);
    fill(gb, N * W, 3);
    for (int t = 0; t < N; t++) kv[t] = kvb + (N - 1 - t) * W, gt[t] = gb + t * W;
    cpu.ops->pool(&cpu, a, kv, gt, N, W);
    gpu.ops->pool(&gpu, g, kv, gt, N, W);
    CHECK(gpu_ok());
    double r = rel(g, a, W);
    printf("  pool: rel %.2e\n", r);
    CHECK(r <= 1e-6);
}

/* ----- router and experts ----- */
static void test_route(void) {
    NEED_GPU();
    enum { R = 4, NR = 64, K = 6 };
    float lg[R * NR], bias[NR], wa[R * K], wg[R * K];
    int32_t ea[R * K], eg[R * K], hash[R * K];
    fill(lg, R * NR, 4);
    fill(bias, NR, 0.1f);
    for (int i = 0; i < R * K; i++) hash[i] = (i * 11) % NR;
    for (int h = 0; h < 2; h++) {
        cpu.ops->route(&cpu, ea, wa, lg, R, NR, K, h ? NULL : bias, h ? hash : NULL, 1.5f);
        gpu.ops->route(&gpu, eg, wg, lg, R, NR, K, h ? NULL : bias, h ? hash : NULL, 1.5f);
        CHECK(gpu_ok());
        CHECK(memcmp(ea, eg, sizeof ea) == 0);
        double r = rel(wg, wa, R * K);
        printf("  route hash %d: experts %s, weights rel %.2e\n", h, memcmp(ea, eg, sizeof ea) ? "DIFFER" : "same", r);
        CHECK(r <= 1e-6);
    }
}

static void test_moe(void) {
    NEED_GPU();
    enum { R = 3, D = 256, I = 128, NE = 8, K = 2 };
    dsv4_ffn_w ex[NE], sh;
    tw parts[NE * 3 + 3];
    for (int e = 0; e < NE; e++) {
        parts[3 * e] = make_w(DSV4_WF_MXFP4, I, D, 0);
        parts[3 * e + 1] = make_w(DSV4_WF_MXFP4, D, I, 0);
        parts[3 * e + 2] = make_w(DSV4_WF_MXFP4, I, D, 0);
        ex[e] = (dsv4_ffn_w){.w1 = parts[3 * e].w, .w2 = parts[3 * e + 1].w, .w3 = parts[3 * e + 2].w};
    }
    parts[3 * NE] = make_w(DSV4_WF_FP8, I, D, 0);
    parts[3 * NE + 1] = make_w(DSV4_WF_FP8, D, I, 0);
    parts[3 * NE + 2] = make_w(DSV4_WF_FP8, I, D, 0);
    sh = (dsv4_ffn_w){.w1 = parts[3 * NE].w, .w2 = parts[3 * NE + 1].w, .w3 = parts[3 * NE + 2].w};
    float x[R * D], a[R * D], g[R * D], wgt[R * K] = {0.6f, 0.4f, 0.3f, 0.7f, 0.5f, 0.5f};
    int32_t e[R * K] = {5, 1, 1, 7, 0, 3};
    fill(x, R * D, 1);
    for (int v = 0; v < 8; v++) {
        int before = v & 1, a8 = (v >> 1) & 1, bf = (v >> 2) & 1;
        cpu.ops->moe(&cpu, a, x, R, ex, e, wgt, K, &sh, 10.0f, before, a8, bf, 1.5f);
        gpu.ops->moe(&gpu, g, x, R, ex, e, wgt, K, &sh, 10.0f, before, a8, bf, 1.5f);
        CHECK(gpu_ok());
        double r = rel(g, a, R * D), tol = bf ? 8e-3 : 1e-5;
        printf("  moe before_w2 %d act_fp8 %d act_bf16 %d: rel %.2e (tol %.0e)\n", before, a8, bf, r, tol);
        CHECK(r <= tol);
    }
    for (int i = 0; i < NE * 3 + 3; i++) free_w(&parts[i]);
}

/* Device arguments (what the forward pass hands the ops: buffers from ops->alloc) give the
 * same results as host ones, in place and out of place, and upload/download/copy move
 * data both ways. */
static void test_device_buffers(void) {
    NEED_GPU();
    enum { R = 3, O = 96, K = 4096 };
    tw t = make_w(DSV4_WF_FP8, O, K, 0);
    float *x = malloc(sizeof(float) * R * K), a[R * O], g[R * O], h[R * O];
    fill(x, (size_t)R * K, 1);
    float *xd = gpu.ops->alloc(&gpu, sizeof(float) * R * K), *od = gpu.ops->alloc(&gpu, sizeof(float) * R * O),
          *od2 = gpu.ops->alloc(&gpu, sizeof(float) * R * O);
    REQUIRE(xd && od && od2);
    gpu.ops->upload(&gpu, xd, x, sizeof(float) * R * K);
    cpu.ops->matmul(&cpu, a, x, R, &t.w, 1, 0);
    gpu.ops->matmul(&gpu, od, xd, R, &t.w, 1, 0); /* act_fp8 must not quantize xd in place */
    gpu.ops->rmsnorm(&gpu, od2, od, R, O, NULL, 1e-6f, 0);
    gpu.ops->rmsnorm(&gpu, od, od, R, O, NULL, 1e-6f, 0);
    gpu.ops->download(&gpu, g, od, sizeof g);
    gpu.ops->download(&gpu, h, od2, sizeof h);
    float *xb = malloc(sizeof(float) * R * K);
    gpu.ops->download(&gpu, xb, xd, sizeof(float) * R * K);
    CHECK(gpu_ok());
    CHECK(memcmp(xb, x, sizeof(float) * R * K) == 0);
    cpu.ops->rmsnorm(&cpu, a, a, R, O, NULL, 1e-6f, 0);
    double r = rel(g, a, R * O);
    printf("  device buffers: matmul+rmsnorm rel %.2e; in place == out of place: %s\n", r,
           memcmp(g, h, sizeof g) ? "NO" : "yes");
    CHECK(r <= 2e-6);
    CHECK(memcmp(g, h, sizeof g) == 0);
    gpu.ops->copy(&gpu, od2, od, sizeof(float) * R * O); /* device to device */
    memset(h, 0, sizeof h);
    gpu.ops->download(&gpu, h, od2, sizeof h);
    CHECK(memcmp(g, h, sizeof g) == 0);
    gpu.ops->free(&gpu, xd);
    gpu.ops->free(&gpu, od);
    gpu.ops->free(&gpu, od2);
    free(x);
    free(xb);
    free_w(&t);
}

/* ----- kern: the shapes the decode paths of linear.cu and mhc.cu take ----- */
/* wo_a-like grouped projections in one launch (several groups; 1, 2 and 5 rows pick
 * different kernels), and a group size that is not a multiple of 4 (element-wise path) */
static void check_grouped(dsv4_wfmt fmt, int G, int R, int C, int rows, int in_bf16) {
    tw t = make_w(fmt, (int64_t)G * R, C, 0);
    size_t nx = (size_t)rows * G * C, no = (size_t)rows * G * R;
    float *x = malloc(sizeof(float) * nx), *a = malloc(sizeof(float) * no), *g = malloc(sizeof(float) * no);
    fill(x, nx, 1);
    cpu.ops->matmul_grouped(&cpu, a, x, rows, &t.w, G, in_bf16, in_bf16);
    for (size_t i = 0; i < no; i++) g[i] = NAN;
    gpu.ops->matmul_grouped(&gpu, g, x, rows, &t.w, G, in_bf16, in_bf16);
    CHECK(gpu_ok());
    double r = rel(g, a, no), tol = in_bf16 ? 4e-3 : 2e-6;
    printf("  matmul_grouped %-6s %d x [%d x %d] rows %d in/out_bf16 %d: rel %.2e (tol %.0e)\n", dsv4_wfmt_name(fmt), G,
           R, C, rows, in_bf16, r, tol);
    CHECKF(r <= tol, "matmul_grouped %s rel %g", dsv4_wfmt_name(fmt), r);
    free(x), free(a), free(g);
    free_w(&t);
}

static void test_kern_grouped(void) {
    NEED_GPU();
    check_grouped(DSV4_WF_FP8, 8, 128, 2048, 1, 0); /* split-K over 2 slices */
    check_grouped(DSV4_WF_FP8, 8, 128, 512, 2, 1);
    check_grouped(DSV4_WF_FP8, 8, 128, 512, 5, 0);
    check_grouped(DSV4_WF_MXFP4, 4, 64, 1024, 1, 0);
    check_grouped(DSV4_WF_BF16, 4, 64, 256, 3, 1);
    check_grouped(DSV4_WF_FP8, 3, 6, 128, 2, 0); /* R % 4 != 0: element-wise */
}

/* hc_pre / hc_head at V4-Flash's width (hc 4, dim 4096) for decode (1 row) and a batch
 * that leaves a partial group of 8 rows (17); the GPU result must also repeat exactly */
static void check_hc(int rows, int bf) {
    enum { HC = 4, D = 4096, NM = (2 + HC) * HC };
    size_t nx = (size_t)rows * HC * D;
    float *X = malloc(sizeof(float) * nx), *ya = malloc(sizeof(float) * rows * D), *yg = malloc(sizeof(float) * rows * D),
          *y2 = malloc(sizeof(float) * rows * D), pa[17 * HC], pg[17 * HC], ca[17 * HC * HC], cg[17 * HC * HC];
    tw fn = make_w(DSV4_WF_F32, NM, HC * D, 0), hfn = make_w(DSV4_WF_F32, HC, HC * D, 0);
    /* fn scaled so the mixes stay O(1) (sigmoid, softmax and Sinkhorn away from saturation,
     * where the fp32 order difference of a 16384-term dot product is amplified) */
    for (size_t i = 0; i < (size_t)NM * HC * D; i++) ((float *)fn.data)[i] *= 1.0f / 32;
    for (size_t i = 0; i < (size_t)HC * HC * D; i++) ((float *)hfn.data)[i] *= 1.0f / 32;
    /* base and scale on the heap, parked like the other weights: the backend keys device
     * copies by host pointer, so a stack array reused by the next call would stay stale */
    float *base = malloc(sizeof(float) * NM), *sc = malloc(sizeof(float) * 3);
    sc[0] = 0.7f, sc[1] = 1.1f, sc[2] = 0.9f;
    fill(base, NM, 1);
    dsv4_weight wb = {.fmt = DSV4_WF_F32, .rows = 1, .cols = NM, .data = base},
                ws = {.fmt = DSV4_WF_F32, .rows = 1, .cols = 3, .data = sc},
                hb = {.fmt = DSV4_WF_F32, .rows = 1, .cols = HC, .data = base + 1},
                hs = {.fmt = DSV4_WF_F32, .rows = 1, .cols = 1, .data = sc + 1};
    tw small = {.data = base, .scale = sc};
    fill(X, nx, 2);
    cpu.ops->hc_pre(&cpu, ya, pa, ca, X, rows, HC, D, &fn.w, &wb, &ws, 20, 1e-6f, 1e-6f, bf, bf);
    gpu.ops->hc_pre(&gpu, yg, pg, cg, X, rows, HC, D, &fn.w, &wb, &ws, 20, 1e-6f, 1e-6f, bf, bf);
    CHECK(gpu_ok());
    double ry = rel(yg, ya, (size_t)rows * D), rp = rel(pg, pa, (size_t)rows * HC),
           rc = rel(cg, ca, (size_t)rows * HC * HC);
    printf("  hc_pre rows %2d hc %d dim %d bf16 %d: y rel %.2e, post %.2e, comb %.2e\n", rows, HC, D, bf, ry, rp, rc);
    CHECK(ry <= (bf ? 4e-3 : 1e-5) && rp <= 1e-5 && rc <= 1e-5);
    gpu.ops->hc_pre(&gpu, y2, pg, cg, X, rows, HC, D, &fn.w, &wb, &ws, 20, 1e-6f, 1e-6f, bf, bf);
    CHECK(gpu_ok());
    CHECK(memcmp(y2, yg, sizeof(float) * rows * D) == 0); /* deterministic: no atomics */
    cpu.ops->hc_head(&cpu, ya, X, rows, HC, D, &hfn.w, &hb, &hs, 1e-6f, 1e-6f, bf, bf);
    gpu.ops->hc_head(&gpu, yg, X, rows, HC, D, &hfn.w, &hb, &hs, 1e-6f, 1e-6f, bf, bf);
    CHECK(gpu_ok());
    double rh = rel(yg, ya, (size_t)rows * D);
    printf("  hc_head rows %2d bf16 %d: rel %.2e\n", rows, bf, rh);
    CHECK(rh <= (bf ? 4e-3 : 1e-5));
    free(X), free(ya), free(yg), free(y2);
    free_w(&fn);
    free_w(&hfn);
    free_w(&small);
}

static void test_kern_hc(void) {
    NEED_GPU();
    for (int bf = 0; bf < 2; bf++) {
        check_hc(1, bf);
        check_hc(17, bf);
    }
}

static void test_zz_release(void) {
    for (int i = 0; i < n_parked; i++) free(parked[i]);
    n_parked = 0;
}

static void test_errors_are_reported(void) {
    NEED_GPU();
    /* a bad device index is an error, not a crash */
    dsv4_backend b2;
    dsv4_err err;
    CHECK(dsv4_backend_cuda_init(&b2, 999, &err) == -1);
    CHECK(strstr(err.msg, "999") != NULL);
}

TEST_MAIN(test_matmul, test_matmul_grouped, test_embed, test_norm_rope_scale, test_sim_exact, test_mhc,
          test_sparse_attn, test_indexer_topk, test_pool, test_route, test_moe, test_errors_are_reported,
          test_device_buffers, test_kern_grouped, test_kern_hc, test_zz_release)
