/* tests/test_cuda_moe: the many-row MoE of prefill (moe_gemm.cu, from 128 rows) against
 * the CPU op on random inputs.
 *
 * Tolerances ("rel" = ||gpu - cpu||_2 / ||cpu||_2): 1e-5 in fp32 (the GEMM's single fma chain
 * per output against the CPU's 8 partial sums is the only difference); 2e-3 with act_fp8 (an
 * element of h that the summation order moves across an e4m3 rounding boundary changes by one
 * e4m3 step, as in test_cuda_ops' moe cases); 4e-3 with act_bf16 (one bf16 ulp flips).
 * Covered: MXFP4 / NVFP4 / FP8 routed experts with an FP8 or bf16 shared expert or none,
 * weights before or after w2, an expert id repeated within a row (both slots count), experts
 * that get no row and experts with more than one 64-slot tile, a corrupt id (skipped and
 * reported by ops->check), the path actually taken (dsv4_cuda_moe_gemm_calls).
 * One row (test_one_row): the default (k_moe_b1r: the grid of the real blocks, e2m1 through e4m3
 * bytes, gate/up's stage loop rolled) and k_moe_b1_prev for both (DSV4_CUDA_MOE_B1G=3), and k_moe_b1r
 * with both stage loops rolled (=4) and both unrolled (=5), which must give the default's bits;
 * MXFP4, NVFP4, FP8 with e8m0 or f32 block scales; each
 * against the CPU op with the tolerances above; e8m0 codes 0 (2^-127) and 255 (NaN) and an NVFP4
 * NaN scale among the block scales (the NaN outputs must be the CPU's), routed experts of inter
 * 1024 and 2048 beside a shared one of 2048 (different chunk counts in k_moe_b1r's map), and FP8
 * w2 of 32 vectors per row (128 rows per block at M 16: one scale block).
 * 2..32 rows (test_batch): k_moe_bnr (groups of <= 4 slots of one expert: one-slot groups on
 * k_moe_b1r's per-block work, larger ones decoding each weight once for all their slots) at 2, 3,
 * 8, 17 and 32 rows, on the default, with DSV4_CUDA_MOE_BN=2 (groups of one slot only) and =0
 * (the kernels before it: k_moe_bulk up to 8 rows, the slot-group kernels above), each against the
 * CPU op with the tolerances above; MXFP4 / NVFP4 / FP8 (e8m0 or f32 scales) routed experts, an
 * FP8 shared expert (groups of 2, 3, 4 rows and a last group of 1 at 17 rows), an expert id
 * repeated within a row, experts with more than 4 slots (two groups), weights before or after w2,
 * act_fp8, act_bf16; the path taken (dsv4_cuda_moe_bn_calls); k_moe_bnr's stage loops rolled or not
 * (DSV4_CUDA_MOE_BNR=0..15 by instance, read as set: dsv4_cuda_moe_bnr), which must give the default's bits.
 * moe.dot=mma (DSV4_MOE_DOT_MMA, one row): k_moe_b1r with MMA = 1 (MXFP4 dots on f16 tensor cores, x in three
 * f16 parts) in every one-row case above, against the CPU's fp32 op with the same tolerances
 * (1e-5 exact: measured 7.3e-7 against 7.6e-7 for k_moe_b1r), the edge scales' NaN rows, the
 * path taken (dsv4_cuda_moe_mma_calls: once for MXFP4 experts, never for NVFP4 / FP8, where the
 * flag changes nothing); Flash's shapes (hidden 4096, inter 2048) with x ~ N(0, 1), with x from
 * 1e-6 to 1e4 in every 32-wide block (no clamp), and with a NaN in x under act_fp8 (all outputs
 * NaN, as the CPU's: this case found the SwiGLU clamp's fminf, which turned a NaN gate into the
 * limit on every GPU path).
 * moe.dot=e4m3 (DSV4_MOE_DOT_E4M3, one row, under act_fp8): test_one_row_e4m3, below.
 * V4-Pro's expert shapes (test_pro_moe: hidden 7168, inter 3072, MXFP4 routed, FP8 shared): one row
 * by default, with moe.dot=mma, with the reference profile's flags (with and without moe.dot=e4m3),
 * and 2, 8 (act_fp8) and 32 rows, against the CPU op with the tolerances above.
 * route_moe (test_route_moe): the router and the plan in one launch (k_route_plan_w) against route
 * then moe on the GPU, memcmp of out, experts and weights, at 1..5 rows of Flash's router (256
 * experts, k 6, hidden 4096, MXFP4 experts, FP8 shared), with and without bias, before w2,
 * act_fp8, host outputs; hash ids at one row (k_route_plan_h, counted as DSV4_RP_HASH; also
 * with ids outside the experts, which both paths weigh 0, skip and report) and at two rows and 36
 * slots (the op falls back to the two ops; a hash row also with DSV4_CUDA_RP1=0); k > n_routed
 * (ids -1 skipped and reported by both, at 1 and 2 rows); against the CPU's route then moe; the
 * path taken (dsv4_cuda_route_plan_calls; one row: k_route_plan_1, DSV4_RP_ONE,
 * and with DSV4_CUDA_RP1=0 k_route_plan_w, the same bits); DSV4_CUDA_ROUTE_PLAN=0 leaves the op
 * NULL.
 * Without a CUDA device the binary prints SKIP. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_TEST_SEED 4242
#define CUDA_TEST_NAME "test_cuda_moe"
#include "backend/cuda/cuda.h"
#include "cuda_test_util.h"

enum { D = 1024, I = 512, NE = 24 };

typedef struct {
    tw parts[3 * NE + 3];
    dsv4_ffn_w ex[NE], sh;
} ffn_set;

static void make_set(ffn_set *s, dsv4_wfmt rfmt, dsv4_wfmt sfmt) {
    for (int x = 0; x <= NE; x++) {
        dsv4_wfmt f = x < NE ? rfmt : sfmt;
        s->parts[3 * x] = make_w(f, I, D, 0);
        s->parts[3 * x + 1] = make_w(f, D, I, 0);
        s->parts[3 * x + 2] = make_w(f, I, D, 0);
        dsv4_ffn_w fw = {.w1 = s->parts[3 * x].w, .w2 = s->parts[3 * x + 1].w, .w3 = s->parts[3 * x + 2].w};
        if (x < NE) s->ex[x] = fw;
        else s->sh = fw;
    }
}

static void free_set(ffn_set *s) {
    for (int i = 0; i < 3 * NE + 3; i++) free_w(&s->parts[i]);
}

/* ids: row r takes experts (r * 7 + j * 5) mod NE, except that rows r % 11 == 3 repeat
 * their first expert in slot 1 and experts NE-1 and NE-2 are never used (ids wrap at
 * NE - 2); expert 0 gets the most rows (every 4th row starts there) */
static void make_ids(int32_t *e, float *w, int R, int K) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < K; j++) {
            int x = (r * 7 + j * 5) % (NE - 2);
            if (r % 4 == 0 && j == 0) x = 0;
            if (r % 11 == 3 && j == 1) x = e[r * K];
            e[r * K + j] = x;
            w[r * K + j] = 0.2f + 0.05f * (float)((r + j) % 7);
        }
}

static void check_case(dsv4_wfmt rfmt, dsv4_wfmt sfmt, int with_shared, int R, int K, int before_w2, int act_fp8,
                       int act_bf16) {
    ffn_set s;
    make_set(&s, rfmt, sfmt);
    float *x = malloc(sizeof(float) * R * D), *a = malloc(sizeof(float) * R * D), *g = malloc(sizeof(float) * R * D),
          *w = malloc(sizeof(float) * R * K);
    int32_t *e = malloc(sizeof(int32_t) * R * K);
    REQUIRE(x && a && g && w && e);
    fill(x, (size_t)R * D, 1);
    make_ids(e, w, R, K);
    const dsv4_ffn_w *sh = with_shared ? &s.sh : NULL;
    cpu.ops->moe(&cpu, a, x, R, s.ex, NE, e, w, K, sh, 6.0f, before_w2, act_fp8, act_bf16, 1.5f);
    for (int i = 0; i < R * D; i++) g[i] = NAN;
    long n0 = dsv4_cuda_moe_gemm_calls(&gpu);
    gpu.ops->moe(&gpu, g, x, R, s.ex, NE, e, w, K, sh, 6.0f, before_w2, act_fp8, act_bf16, 1.5f);
    CHECK(gpu_ok());
    long took = dsv4_cuda_moe_gemm_calls(&gpu) - n0;
    double r = rel(g, a, (size_t)R * D);
    double tol = act_bf16 ? 4e-3 : act_fp8 ? 2e-3 : 1e-5;
    printf("  moe gemm %s routed, %s shared, rows %d, k %d, before_w2 %d, act_fp8 %d, act_bf16 %d: rel %.2e (tol %.0e), "
           "%s path\n",
           dsv4_wfmt_name(rfmt), with_shared ? dsv4_wfmt_name(sfmt) : "no", R, K, before_w2, act_fp8, act_bf16, r, tol,
           took ? "gemm" : "slot-group");
    CHECKF(r <= tol, "moe gemm rel %g", r);
    CHECKF(took == 1, "the gemm path ran %ld times, expected once", took);
    free_set(&s);
    free(x), free(a), free(g), free(w), free(e);
}

static void test_moe_gemm(void) {
    NEED_GPU();
    check_case(DSV4_WF_MXFP4, DSV4_WF_FP8, 1, 150, 6, 0, 0, 0);
    check_case(DSV4_WF_MXFP4, DSV4_WF_FP8, 1, 150, 6, 0, 1, 0);
    check_case(DSV4_WF_NVFP4, DSV4_WF_BF16, 1, 130, 4, 1, 0, 0);
    check_case(DSV4_WF_FP8, DSV4_WF_FP8, 0, 200, 2, 0, 0, 0);
    check_case(DSV4_WF_MXFP4, DSV4_WF_FP8, 1, 300, 6, 1, 1, 1);
}

/* below the threshold the slot-group kernels run */
static void test_small_batch_keeps_slot_groups(void) {
    NEED_GPU();
    ffn_set s;
    make_set(&s, DSV4_WF_MXFP4, DSV4_WF_FP8);
    enum { R = 40, K = 6 };
    float *x = malloc(sizeof(float) * R * D), *g = malloc(sizeof(float) * R * D), w[R * K];
    int32_t e[R * K];
    REQUIRE(x && g);
    fill(x, (size_t)R * D, 1);
    make_ids(e, w, R, K);
    long n0 = dsv4_cuda_moe_gemm_calls(&gpu);
    gpu.ops->moe(&gpu, g, x, R, s.ex, NE, e, w, K, &s.sh, 6.0f, 0, 0, 0, 1.0f);
    CHECK(gpu_ok());
    CHECK_EQ_INT((int)(dsv4_cuda_moe_gemm_calls(&gpu) - n0), 0);
    free_set(&s);
    free(x), free(g);
}

/* a corrupt id (device routing) is skipped and reported; its own backend: the error is sticky */
static void test_bad_id_reported(void) {
    NEED_GPU();
    ffn_set s;
    make_set(&s, DSV4_WF_MXFP4, DSV4_WF_FP8);
    enum { R = 140, K = 2 };
    dsv4_backend g2;
    dsv4_err err;
    REQUIRE(dsv4_backend_cuda_init(&g2, 0, &err) == 0);
    float *x = malloc(sizeof(float) * R * D), *g = malloc(sizeof(float) * R * D), w[R * K];
    int32_t e[R * K];
    REQUIRE(x && g);
    fill(x, (size_t)R * D, 1);
    make_ids(e, w, R, K);
    e[17] = NE + 5;
    int32_t *e_d = g2.ops->alloc(&g2, sizeof e);
    REQUIRE(e_d);
    g2.ops->upload(&g2, e_d, e, sizeof e);
    g2.ops->moe(&g2, g, x, R, s.ex, NE, e_d, w, K, &s.sh, 6.0f, 0, 0, 0, 1.0f);
    int rc = g2.ops->check(&g2, &err);
    printf("  corrupt expert id, %d rows: check -> %d (%s), gemm path %ld\n", R, rc, rc ? err.msg : "no error",
           dsv4_cuda_moe_gemm_calls(&g2));
    CHECK(rc != 0 && strstr(err.msg, "expert id") != NULL);
    CHECK(dsv4_cuda_moe_gemm_calls(&g2) == 1);
    dsv4_backend_cuda_free(&g2);
    free_set(&s);
    free(x), free(g);
}

/* ----- one row: k_moe_b1r and the kernel it is A/B'd against ----- */
enum { D1 = 2048, NE1 = 8, K1 = 6 };

typedef struct {
    tw parts[3 * NE1 + 3];
    dsv4_ffn_w ex[NE1], sh;
} ffn_set1;

/* routed experts of fmt rfmt and inter features ri, a shared expert of sfmt and 2048; sf32: FP8
 * weights carry f32 block scales (with e8m0 scales the one-row kernels need K >= 2048: 16 scale
 * bytes per row of blocks) */
static void make_set1(ffn_set1 *s, dsv4_wfmt rfmt, dsv4_wfmt sfmt, int64_t ri, int sf32) {
    make_ffns(s->parts, s->ex, &s->sh, NE1, D1, rfmt, ri, sfmt, 2048, sf32);
}

/* Edge block scales in routed expert 1 (row 0 routes to it): MXFP4 e8m0 0 in every block of w1
 * row 7 and in block 3 of w3 row 9 (2^-127: those features come out ~0), 255 (NaN) in block 0 of
 * w2 rows 5 and 300 (outputs 5 and 300 NaN); NVFP4 the e4m3 NaN code in w2 rows 5 and 300 */
static int edge_scales(ffn_set1 *s) {
    tw *w1 = &s->parts[3], *w2 = &s->parts[4], *w3 = &s->parts[5];
    uint8_t *s1 = w1->scale, *s2 = w2->scale, *s3 = w3->scale;
    if (w1->w.fmt == DSV4_WF_MXFP4) {
        int64_t b1 = w1->w.cols / 32, b2 = w2->w.cols / 32;
        for (int64_t j = 0; j < b1; j++) s1[7 * b1 + j] = 0;
        s3[9 * b1 + 3] = 0;
        s2[5 * b2] = 255, s2[300 * b2] = 255;
        return 1;
    }
    if (w1->w.fmt == DSV4_WF_NVFP4) {
        int64_t b2 = w2->w.cols / 16;
        s2[5 * b2 + 1] = 0x7f, s2[300 * b2 + 7] = 0xff;
        return 1;
    }
    return 0;
}

/* how many of the n floats of a and b differ in their bits */
static int n_differ(const float *a, const float *b, size_t n) {
    int nd = 0;
    for (size_t i = 0; i < n; i++) nd += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return nd;
}

/* the one-row MoE on backend b with DSV4_CUDA_MOE_B1G = geom ("" = unset: the default); the
 * geometry is read once per backend, at its first one-row call, so every call sets it */
static void one_row_on(dsv4_backend *b, const char *geom, float *g, const float *x, const ffn_set1 *s,
                       const int32_t *e, const float *w, int before_w2, int act_fp8, int act_bf16) {
    if (geom[0]) setenv("DSV4_CUDA_MOE_B1G", geom, 1);
    else unsetenv("DSV4_CUDA_MOE_B1G");
    for (int i = 0; i < D1; i++) g[i] = NAN;
    b->ops->moe(b, g, x, 1, s->ex, NE1, e, w, K1, &s->sh, 6.0f, before_w2, act_fp8, act_bf16, 1.5f);
    unsetenv("DSV4_CUDA_MOE_B1G");
}

/* the A/B geometries, each on its own backend (the geometry is read once per backend) */
enum { NAB = 3 };
static const struct {
    const char *geom, *what;
    int same; /* 1: must give the default's bits (the same sums in the same order) */
} ab_runs[NAB] = {{"3", "k_moe_b1_prev", 0},
                  {"4", "k_moe_b1r, both stage loops rolled", 1},
                  {"5", "k_moe_b1r, both stage loops unrolled", 1}};
static dsv4_backend g_ab[NAB];
static int have_ab;

static void check_one_row(dsv4_wfmt rfmt, dsv4_wfmt sfmt, int64_t ri, int sf32, int edges, int before_w2,
                          int act_fp8, int act_bf16) {
    ffn_set1 s;
    make_set1(&s, rfmt, sfmt, ri, sf32);
    int ne = edges ? edge_scales(&s) : 0;
    float x[D1], a[D1], g[D1], g0[D1], w[K1];
    static const int32_t e[K1] = {1, 4, 6, 0, 3, 7};
    fill(x, D1, 1);
    for (int j = 0; j < K1; j++) w[j] = 0.15f + 0.05f * (float)j;
    cpu.ops->moe(&cpu, a, x, 1, s.ex, NE1, e, w, K1, &s.sh, 6.0f, before_w2, act_fp8, act_bf16, 1.5f);
    int nan_cpu = 0;
    for (int i = 0; i < D1; i++) nan_cpu += isnan(a[i]) != 0;
    double tol = act_bf16 ? 4e-3 : act_fp8 ? 2e-3 : 1e-5;
    struct {
        dsv4_backend *b;
        const char *geom, *what;
        int same;
    } runs[1 + NAB] = {{&gpu, "", "default: k_moe_b1r, e4m3 decode, gate/up's stage loop rolled", 0}};
    for (int k = 0; k < NAB; k++)
        runs[1 + k].b = &g_ab[k], runs[1 + k].geom = ab_runs[k].geom, runs[1 + k].what = ab_runs[k].what,
        runs[1 + k].same = ab_runs[k].same;
    for (int k = 0; k < (have_ab ? 1 + NAB : 1); k++) {
        dsv4_err err;
        long n0 = dsv4_cuda_moe_bulk_calls(runs[k].b);
        one_row_on(runs[k].b, runs[k].geom, g, x, &s, e, w, before_w2, act_fp8, act_bf16);
        int rc = runs[k].b->ops->check(runs[k].b, &err);
        long took = dsv4_cuda_moe_bulk_calls(runs[k].b) - n0;
        double r = rel(g, a, D1);
        printf("  one row %s routed (inter %lld), %s shared%s%s, before_w2 %d, act_fp8 %d, act_bf16 %d, %s: rel %.2e "
               "(tol %.0e), %d NaN outputs\n",
               dsv4_wfmt_name(rfmt), (long long)ri, dsv4_wfmt_name(sfmt), sf32 ? " (f32 scales)" : "",
               ne ? ", edge scales" : "", before_w2, act_fp8, act_bf16, runs[k].what, r, tol, nan_cpu);
        CHECKF(rc == 0, "one row: %s", rc ? err.msg : "");
        CHECKF(r <= tol, "one row %s rel %g", runs[k].what, r);
        CHECKF(took == 1, "one row %s: the one-row kernels ran %ld times, expected once", runs[k].what, took);
        int geom = dsv4_cuda_moe_b1_geom(runs[k].b), want = runs[k].geom[0] ? atoi(runs[k].geom) : 0;
        CHECKF(geom == want, "one row %s: geometry %d set, %d asked for", runs[k].what, geom, want);
        if (k == 0) memcpy(g0, g, sizeof g0);
        if (runs[k].same) {
            int nd = n_differ(g, g0, D1);
            printf("    %s: %d of %d outputs differ from the default's bits\n", runs[k].what, nd, D1);
            CHECKF(nd == 0, "%s: %d outputs differ from the default's", runs[k].what, nd);
        }
    }
    CHECK(!ne || nan_cpu == 2); /* the edge case's NaN rows reached the output */
    /* moe.dot=mma (DSV4_MOE_DOT_MMA): k_moe_b1r's MMA instances when the routed experts are MXFP4 (the shared one
     * on k_moe_b1r's path in the same launch), else the flag changes nothing */
    {
        dsv4_err err;
        long m0 = dsv4_cuda_moe_mma_calls(&gpu);
        for (int i = 0; i < D1; i++) g[i] = NAN;
        gpu.ops->moe(&gpu, g, x, 1, s.ex, NE1, e, w, K1, &s.sh, 6.0f, before_w2, act_fp8 | DSV4_MOE_DOT_MMA, act_bf16,
                     1.5f);
        int rc = gpu.ops->check(&gpu, &err);
        long took = dsv4_cuda_moe_mma_calls(&gpu) - m0;
        double r = rel(g, a, D1);
        printf("  one row %s routed (inter %lld)%s, before_w2 %d, act_fp8 %d, act_bf16 %d, moe.dot=mma: rel %.2e "
               "(tol %.0e), MMA kernels %ld\n",
               dsv4_wfmt_name(rfmt), (long long)ri, ne ? ", edge scales" : "", before_w2, act_fp8, act_bf16, r, tol,
               took);
        CHECKF(rc == 0, "one row mma: %s", rc ? err.msg : "");
        CHECKF(r <= tol, "one row moe.dot=mma rel %g", r);
        CHECKF(took == (rfmt == DSV4_WF_MXFP4), "the MMA kernels ran %ld times", took);
    }
    for (int i = 0; i < 3 * NE1 + 3; i++) free_w(&s.parts[i]);
}

/* backends with DSV4_CUDA_MOE_BM=2 (bm2_run), =3 (bm3_run) and =4 (bm3_run with the records staged), read at
 * each one's first MoE call */
enum { NFORM = 3 };
static dsv4_backend g_form[NFORM];
static const char *const form_env[NFORM] = {"2", "3", "4"};
static const char *const form_name[NFORM] = {"bm2_run", "bm3_run", "bm3_run, records staged"};

/* the one-row MoE under moe.dot=mma on each g_form backend must give ref, bm_run's output on the
 * default backend, bit for bit, and must have taken that backend's form */
static void forms_same(const float *ref, const float *x, const dsv4_ffn_w *ex, int ne, const int32_t *e,
                       const float *w, const dsv4_ffn_w *sh, float lim, int before_w2, int act_fp8, int act_bf16,
                       int d) {
    for (int f = 0; f < NFORM; f++) {
        dsv4_backend *gb = &g_form[f];
        const char *form = form_env[f];
        float *g = malloc(sizeof(float) * (size_t)d);
        REQUIRE(g);
        for (int i = 0; i < d; i++) g[i] = -1.0f;
        long n0 = dsv4_cuda_moe_bm_form_calls(gb);
        setenv("DSV4_CUDA_MOE_BM", form, 1);
        gb->ops->moe(gb, g, x, 1, ex, ne, e, w, K1, sh, lim, before_w2, act_fp8 | DSV4_MOE_DOT_MMA, act_bf16, 1.5f);
        unsetenv("DSV4_CUDA_MOE_BM");
        dsv4_err err;
        int rc = gb->ops->check(gb, &err);
        long took = dsv4_cuda_moe_bm_form_calls(gb) - n0;
        int diff = 0, first = -1;
        for (int i = 0; i < d; i++)
            if (memcmp(&g[i], &ref[i], sizeof(float))) {
                if (first < 0) first = i;
                diff++;
            }
        printf("    %s (before_w2 %d, act_fp8 %d, act_bf16 %d): %d of %d outputs differ from bm_run's%s, "
               "calls %ld\n",
               form_name[f], before_w2, act_fp8, act_bf16, diff, d, diff ? " (first below)" : "", took);
        if (first >= 0) printf("    [%d] %.9g against %.9g\n", first, g[first], ref[first]);
        CHECKF(rc == 0, "DSV4_CUDA_MOE_BM=%s: %s", form, rc ? err.msg : "");
        CHECKF(took == 1, "%s ran %ld times, expected once", form_name[f], took);
        CHECKF(diff == 0, "%s: %d outputs differ from bm_run's", form_name[f], diff);
        free(g);
    }
}

/* moe.dot=mma on Flash's expert shapes (hidden 4096, inter 2048: one pass of 64 rows a block,
 * the kernel's decode shape) and on inputs with a wide range (values from 1e-6 to 1e4 in every
 * 32-wide block: the three f16 parts after the block's power-of-two scale must still carry
 * fp32's precision), against the CPU op; also a NaN in x under act_fp8 (every output NaN, as
 * the CPU's: the SwiGLU clamp must keep a NaN, which fminf did not).  Each case runs again on
 * backends with DSV4_CUDA_MOE_BM=2, 3 and 4 (bm2_run, bm3_run, bm3_run with staged records): their outputs
 * must be bm_run's, bit for bit, and the form must have run (dsv4_cuda_moe_bm_form_calls); with before_w2 and
 * act_bf16 too, and with an MXFP4 shared expert (the forms take both its halves). */
static void test_one_row_mma_flash(void) {
    NEED_GPU();
    dsv4_err e2;
    for (int f = 0; f < NFORM; f++) REQUIRE(dsv4_backend_cuda_init(&g_form[f], 0, &e2) == 0);
    enum { DF = 4096, IF = 2048, NEF = 8 };
    tw parts[3 * NEF + 3];
    dsv4_ffn_w ex[NEF], sh;
    make_ffns(parts, ex, &sh, NEF, DF, DSV4_WF_MXFP4, IF, DSV4_WF_FP8, IF, 0);
    static const int32_t e[K1] = {2, 5, 7, 1, 0, 6};
    float w[K1];
    for (int j = 0; j < K1; j++) w[j] = 0.1f + 0.07f * (float)j;
    float *x = malloc(sizeof(float) * DF), *a = malloc(sizeof(float) * DF), *g = malloc(sizeof(float) * DF);
    REQUIRE(x && a && g);
    for (int c = 0; c < 3; c++) {
        fill(x, DF, 7 + c);
        if (c == 1) /* magnitudes from 1e-6 to 1e4 */
            for (int i = 0; i < DF; i++) x[i] *= powf(10.0f, (float)(i % 11) - 6.0f);
        if (c == 2) x[1234] = NAN;
        /* the wide inputs without the clamp: gates of 1e6 clamped at 6 would leave the few
         * gates near 0 to decide the outputs, where any summation order moves them */
        int act_fp8 = c == 2;
        float lim = c == 1 ? 0.0f : 6.0f;
        cpu.ops->moe(&cpu, a, x, 1, ex, NEF, e, w, K1, &sh, lim, 0, act_fp8, 0, 1.5f);
        dsv4_err err;
        long m0 = dsv4_cuda_moe_mma_calls(&gpu);
        for (int i = 0; i < DF; i++) g[i] = 0.0f;
        gpu.ops->moe(&gpu, g, x, 1, ex, NEF, e, w, K1, &sh, lim, 0, act_fp8 | DSV4_MOE_DOT_MMA, 0, 1.5f);
        int rc = gpu.ops->check(&gpu, &err);
        long took = dsv4_cuda_moe_mma_calls(&gpu) - m0;
        int nan_cpu = 0, nan_gpu = 0;
        for (int i = 0; i < DF; i++) nan_cpu += isnan(a[i]) != 0, nan_gpu += isnan(g[i]) != 0;
        double r = rel(g, a, DF), tol = act_fp8 ? 2e-3 : 1e-5;
        printf("  one row Flash shapes, moe.dot=mma, %s, act_fp8 %d: rel %.2e (tol %.0e), NaN outputs %d / %d, "
               "MMA kernels %ld\n",
               c == 0 ? "x ~ N(0,1)" : c == 1 ? "x from 1e-6 to 1e4" : "a NaN in x", act_fp8, r, tol, nan_gpu,
               nan_cpu, took);
        CHECKF(rc == 0, "mma flash: %s", rc ? err.msg : "");
        CHECKF(r <= tol, "mma flash rel %g", r);
        CHECK(took == 1);
        CHECK(nan_gpu == nan_cpu && (c != 2 || nan_cpu == DF));
        forms_same(g, x, ex, NEF, e, w, &sh, lim, 0, act_fp8, 0, DF);
    }
    /* before_w2 and act_bf16 (the pre-weight and h's rounding in the forms' epilogue) */
    fill(x, DF, 11);
    for (int i = 0; i < DF; i++) g[i] = 0.0f;
    gpu.ops->moe(&gpu, g, x, 1, ex, NEF, e, w, K1, &sh, 6.0f, 1, DSV4_MOE_DOT_MMA, 1, 1.5f);
    forms_same(g, x, ex, NEF, e, w, &sh, 6.0f, 1, 0, 1, DF);
    for (int i = 0; i < 3 * NEF + 3; i++) free_w(&parts[i]);
    /* an MXFP4 shared expert: the forms take its gate/up and down blocks too */
    make_ffns(parts, ex, &sh, NEF, DF, DSV4_WF_MXFP4, IF, DSV4_WF_MXFP4, IF, 0);
    fill(x, DF, 12);
    cpu.ops->moe(&cpu, a, x, 1, ex, NEF, e, w, K1, &sh, 6.0f, 0, 0, 0, 1.5f);
    for (int i = 0; i < DF; i++) g[i] = 0.0f;
    gpu.ops->moe(&gpu, g, x, 1, ex, NEF, e, w, K1, &sh, 6.0f, 0, DSV4_MOE_DOT_MMA, 0, 1.5f);
    double r = rel(g, a, DF);
    printf("  one row Flash shapes, MXFP4 shared expert, moe.dot=mma: rel %.2e\n", r);
    CHECKF(r <= 1e-5, "mma flash, MXFP4 shared: rel %g", r);
    forms_same(g, x, ex, NEF, e, w, &sh, 6.0f, 0, 0, 0, DF);
    for (int i = 0; i < 3 * NEF + 3; i++) free_w(&parts[i]);
    for (int f = 0; f < NFORM; f++) dsv4_backend_cuda_free(&g_form[f]);
    free(x), free(a), free(g);
}

/* moe.dot=e4m3 (DSV4_MOE_DOT_E4M3, under act_fp8 only): k_moe_q8 (e4m3 tensor-core dots of the
 * act-quantized input and the stored codes) on Flash's expert shapes (hidden 4096, inter 2048)
 * with MXFP4 and FP8 routed experts and an FP8 shared expert, against the CPU op (act_fp8: the
 * same quantized numbers, fp32 sums), beside the default GPU path's distance from it; the
 * reference profile's flags (before w2, act_bf16); a NaN in x (every output NaN, as the CPU's);
 * without act_fp8 the flag changes nothing (the path is not taken, the default's bits) */
static void test_one_row_e4m3(void) {
    NEED_GPU();
    enum { DF = 4096, IF = 2048, NEF = 8 };
    static const int32_t e[K1] = {2, 5, 7, 1, 0, 6};
    float w[K1];
    for (int j = 0; j < K1; j++) w[j] = 0.1f + 0.07f * (float)j;
    float *x = malloc(sizeof(float) * DF), *a = malloc(sizeof(float) * DF), *g = malloc(sizeof(float) * DF),
          *d = malloc(sizeof(float) * DF), *d0 = malloc(sizeof(float) * DF);
    REQUIRE(x && a && g && d && d0);
    for (int f = 0; f < 2; f++) {
        tw parts[3 * NEF + 3];
        dsv4_ffn_w ex[NEF], sh;
        dsv4_wfmt rf = f == 0 ? DSV4_WF_MXFP4 : DSV4_WF_FP8;
        make_ffns(parts, ex, &sh, NEF, DF, rf, IF, DSV4_WF_FP8, IF, 0);
        for (int c = 0; c < 4; c++) {
            fill(x, DF, 11 + c);
            if (c == 2) x[777] = NAN;
            int act_fp8 = c != 3, before_w2 = c == 1, act_bf16 = c == 1;
            cpu.ops->moe(&cpu, a, x, 1, ex, NEF, e, w, K1, &sh, 6.0f, before_w2, act_fp8, act_bf16, 1.5f);
            gpu.ops->moe(&gpu, d, x, 1, ex, NEF, e, w, K1, &sh, 6.0f, before_w2, act_fp8, act_bf16, 1.5f);
            /* the default path with DSV4_CUDA_AQ_FUSE=0 (h's routed and shared rows quantized by
             * two launches instead of one): the same bits */
            const int fz0 = dsv4_cuda_aq_fuse();
            dsv4_cuda_set_aq_fuse(0);
            gpu.ops->moe(&gpu, d0, x, 1, ex, NEF, e, w, K1, &sh, 6.0f, before_w2, act_fp8, act_bf16, 1.5f);
            dsv4_cuda_set_aq_fuse(fz0);
            CHECKF(gpu_ok() && memcmp(d, d0, sizeof(float) * DF) == 0, "moe with act_quant launches merged differs");
            dsv4_err err;
            long m0 = dsv4_cuda_moe_q8_calls(&gpu);
            for (int i = 0; i < DF; i++) g[i] = 0.0f;
            gpu.ops->moe(&gpu, g, x, 1, ex, NEF, e, w, K1, &sh, 6.0f, before_w2, act_fp8 | DSV4_MOE_DOT_E4M3, act_bf16,
                         1.5f);
            int rc = gpu.ops->check(&gpu, &err);
            long took = dsv4_cuda_moe_q8_calls(&gpu) - m0;
            int nan_cpu = 0, nan_gpu = 0;
            for (int i = 0; i < DF; i++) nan_cpu += isnan(a[i]) != 0, nan_gpu += isnan(g[i]) != 0;
            double r = rel(g, a, DF), rd = rel(d, a, DF), tol = act_bf16 ? 4e-3 : act_fp8 ? 2e-3 : 1e-5;
            printf("  one row Flash shapes, %s routed, FP8 shared, moe.dot=e4m3, %s, act_fp8 %d, before_w2 %d, "
                   "act_bf16 %d: rel %.2e (default path %.2e, tol %.0e), NaN outputs %d / %d, q8 kernels %ld\n",
                   dsv4_wfmt_name(rf), c == 2 ? "a NaN in x" : "x ~ N(0,1)", act_fp8, before_w2, act_bf16, r, rd, tol,
                   nan_gpu, nan_cpu, took);
            CHECKF(rc == 0, "e4m3: %s", rc ? err.msg : "");
            CHECKF(r <= tol, "e4m3 rel %g", r);
            CHECK(took == (act_fp8 ? 1 : 0));
            CHECK(nan_gpu == nan_cpu && (c != 2 || nan_cpu == DF));
            if (!act_fp8) CHECK(memcmp(g, d, sizeof(float) * DF) == 0);
        }
        for (int i = 0; i < 3 * NEF + 3; i++) free_w(&parts[i]);
    }
    free(x), free(a), free(g), free(d), free(d0);
}

/* n more CUDA backends for the A/B runs (each reads its switches at its first MoE call); 1 if all
 * opened, else none is left open */
static int open_backends(dsv4_backend *bs, int n) {
    dsv4_err err;
    int k = 0;
    while (k < n && dsv4_backend_cuda_init(&bs[k], 0, &err) == 0) k++;
    if (k < n)
        while (k > 0) dsv4_backend_cuda_free(&bs[--k]);
    CHECKF(k == n, "second backends: %s", k == n ? "" : err.msg);
    return k == n;
}

static void test_one_row(void) {
    NEED_GPU();
    have_ab = open_backends(g_ab, NAB);
    check_one_row(DSV4_WF_MXFP4, DSV4_WF_FP8, 1024, 0, 1, 0, 0, 0);
    check_one_row(DSV4_WF_MXFP4, DSV4_WF_FP8, 1024, 0, 0, 1, 1, 0);
    check_one_row(DSV4_WF_MXFP4, DSV4_WF_FP8, 2048, 0, 0, 0, 0, 1);
    check_one_row(DSV4_WF_NVFP4, DSV4_WF_FP8, 1024, 0, 1, 1, 0, 0);
    check_one_row(DSV4_WF_NVFP4, DSV4_WF_FP8, 1024, 1, 0, 0, 1, 0);
    check_one_row(DSV4_WF_FP8, DSV4_WF_FP8, 2048, 0, 0, 0, 0, 0);
    check_one_row(DSV4_WF_FP8, DSV4_WF_FP8, 2048, 1, 0, 1, 0, 0);
    /* w2 of 32 vectors per row: at M 16 128 rows per block, one scale block: k_moe_b1r.  f32 scales: with e8m0 ones
     * a row of w2's scale blocks is 4 bytes, not the 16-byte multiple the one-row kernels take (mb_ok) */
    check_one_row(DSV4_WF_FP8, DSV4_WF_FP8, 512, 1, 0, 0, 0, 0);
    /* an MXFP4 shared expert (inter 2048) beside MXFP4 routed ones of 1024: two chunk counts of one format in
     * k_moe_b1r's map (the routed groups' and the shared one's) */
    check_one_row(DSV4_WF_MXFP4, DSV4_WF_MXFP4, 1024, 0, 1, 0, 0, 0);
    if (have_ab)
        for (int k = 0; k < NAB; k++) dsv4_backend_cuda_free(&g_ab[k]);
}

/* ----- V4-Pro's expert shapes: hidden 7168, inter 3072 (MXFP4 routed, FP8 shared) ----- */

/* one row on the default path, with moe.dot=mma, and the reference profile's flags with and
 * without moe.dot=e4m3; then 2, 8 and 32 rows: nothing else runs the MoE kernels' dispatch at
 * K 7168 (56 scale blocks of FP8, 224 of MXFP4) and inter 3072.  The one-row and 2..32-row
 * kernels (k_moe_b1r, k_moe_bnr, the MMA and e4m3 forms) take rows of 32..256 16-byte vectors, a
 * power of two (mb_ok); Pro's are 224 / 96 / 448, so every call here runs the slot-group kernels
 * and the dot switches change nothing: the counters of the fast paths are printed, not required,
 * so that a kernel that learns Pro's rows shows up here */
static void test_pro_moe(void) {
    NEED_GPU();
    enum { DP = 7168, IP = 3072, NEP = 8, RP = 32 };
    tw parts[3 * NEP + 3];
    dsv4_ffn_w ex[NEP], sh;
    make_ffns(parts, ex, &sh, NEP, DP, DSV4_WF_MXFP4, IP, DSV4_WF_FP8, IP, 0);
    float *x = malloc(sizeof(float) * RP * DP), *a = malloc(sizeof(float) * RP * DP),
          *g = malloc(sizeof(float) * RP * DP), *w = malloc(sizeof(float) * RP * K1);
    int32_t *e = malloc(sizeof(int32_t) * RP * K1);
    REQUIRE(x && a && g && w && e);
    fill(x, (size_t)RP * DP, 21);
    for (int r = 0; r < RP; r++)
        for (int j = 0; j < K1; j++) {
            e[r * K1 + j] = (r * 3 + j * 5) % NEP; /* 6 distinct experts a row (5 and 8 coprime) */
            w[r * K1 + j] = 0.1f + 0.06f * (float)((r + j) % 5);
        }
    static const struct {
        int rows, flags, before_w2, act_fp8, act_bf16;
        const char *what;
    } cs[] = {
        {1, 0, 0, 0, 0, "default"},
        {1, DSV4_MOE_DOT_MMA, 0, 0, 0, "moe.dot=mma"},
        {1, 0, 1, 1, 1, "reference flags"},
        {1, DSV4_MOE_DOT_E4M3, 1, 1, 1, "reference flags, moe.dot=e4m3"},
        {2, 0, 0, 0, 0, "default"},
        {8, 0, 0, 1, 0, "act_fp8"},
        {32, 0, 0, 0, 0, "default"},
    };
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        int R = cs[c].rows;
        cpu.ops->moe(&cpu, a, x, R, ex, NEP, e, w, K1, &sh, 10.0f, cs[c].before_w2, cs[c].act_fp8, cs[c].act_bf16,
                     2.5f);
        for (size_t i = 0; i < (size_t)R * DP; i++) g[i] = NAN;
        dsv4_err err;
        long c0[4] = {dsv4_cuda_moe_bulk_calls(&gpu), dsv4_cuda_moe_bn_calls(&gpu), dsv4_cuda_moe_mma_calls(&gpu),
                      dsv4_cuda_moe_q8_calls(&gpu)};
        gpu.ops->moe(&gpu, g, x, R, ex, NEP, e, w, K1, &sh, 10.0f, cs[c].before_w2, cs[c].act_fp8 | cs[c].flags,
                     cs[c].act_bf16, 2.5f);
        int rc = gpu.ops->check(&gpu, &err);
        double r = rel(g, a, (size_t)R * DP), tol = cs[c].act_bf16 ? 4e-3 : cs[c].act_fp8 ? 2e-3 : 1e-5;
        printf("  pro experts [%d x %d], rows %d, %s: rel %.2e (tol %.0e); fast kernels: one-row %ld, k_moe_bnr "
               "%ld, mma %ld, e4m3 %ld\n",
               IP, DP, R, cs[c].what, r, tol, dsv4_cuda_moe_bulk_calls(&gpu) - c0[0],
               dsv4_cuda_moe_bn_calls(&gpu) - c0[1], dsv4_cuda_moe_mma_calls(&gpu) - c0[2],
               dsv4_cuda_moe_q8_calls(&gpu) - c0[3]);
        CHECKF(rc == 0, "pro moe: %s", rc ? err.msg : "");
        CHECKF(r <= tol, "pro moe rows %d %s rel %g", R, cs[c].what, r);
    }
    for (int i = 0; i < 3 * NEP + 3; i++) free_w(&parts[i]);
    free(x), free(a), free(g), free(w), free(e);
}

/* ----- 2..32 rows: k_moe_bnr and the kernels it is A/B'd against ----- */

enum { NE2 = 16 };

typedef struct {
    tw parts[3 * NE2 + 3];
    dsv4_ffn_w ex[NE2], sh;
} ffn_set2;

/* make_set1's experts, NE2 of them */
static void make_set2(ffn_set2 *s, dsv4_wfmt rfmt, dsv4_wfmt sfmt, int64_t ri, int sf32) {
    make_ffns(s->parts, s->ex, &s->sh, NE2, D1, rfmt, ri, sfmt, 2048, sf32);
}

/* row r takes experts (5 r + 3 j) mod (NE2 - 2), expert 0 first in every third row (more than 4
 * slots from 8 rows: several groups), rows r % 5 == 2 repeat their first expert in slot 2;
 * at 2 rows experts 0, 3 and 6 get two slots, the others one */
static void make_ids2(int32_t *e, float *w, int R) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < K1; j++) {
            int x = (r * 5 + j * 3) % (NE2 - 2);
            if (r % 3 == 0 && j == 0) x = 0;
            if (r % 5 == 2 && j == 2) x = e[r * K1];
            e[r * K1 + j] = x;
            w[r * K1 + j] = 0.15f + 0.05f * (float)((r + j) % 7);
        }
}

/* backends with DSV4_CUDA_MOE_BN = 2 and 0, and DSV4_CUDA_MOE_BNR by instance (read once per backend: every call
 * sets it) */
enum { NBN = 8 };
static const struct {
    const char *var, *env, *what;
    int took; /* calls of k_moe_bnr expected per moe call */
    int same; /* 1: must give the default's bits (the stage loops rolled or not: the same sums) */
} bn_runs[1 + NBN] = {{"", "", "default: k_moe_bnr", 1, 0},
                      {"DSV4_CUDA_MOE_BN", "2", "k_moe_bnr one-slot groups", 1, 0},
                      {"DSV4_CUDA_MOE_BN", "0", "before", 0, 0},
                      {"DSV4_CUDA_MOE_BNR", "0", "k_moe_bnr, stage loops unrolled", 1, 1},
                      {"DSV4_CUDA_MOE_BNR", "5", "k_moe_bnr, gate/up's stage loops rolled", 1, 1},
                      {"DSV4_CUDA_MOE_BNR", "10", "k_moe_bnr, down's stage loops rolled", 1, 1},
                      {"DSV4_CUDA_MOE_BNR", "3", "k_moe_bnr, both halves' one-slot stage loops rolled", 1, 1},
                      {"DSV4_CUDA_MOE_BNR", "8", "k_moe_bnr, the multi-slot down's stage loop rolled", 1, 1},
                      {"DSV4_CUDA_MOE_BNR", "15", "k_moe_bnr, every stage loop rolled", 1, 1}};
static dsv4_backend g_bn[NBN];
static int have_bn;

static void check_batch(dsv4_wfmt rfmt, dsv4_wfmt sfmt, int64_t ri, int sf32, int R, int before_w2, int act_fp8,
                        int act_bf16) {
    ffn_set2 s;
    make_set2(&s, rfmt, sfmt, ri, sf32);
    float *x = malloc(sizeof(float) * R * D1), *a = malloc(sizeof(float) * R * D1),
          *g = malloc(sizeof(float) * R * D1), *w = malloc(sizeof(float) * R * K1),
          *g0 = malloc(sizeof(float) * R * D1);
    int32_t *e = malloc(sizeof(int32_t) * R * K1);
    REQUIRE(x && a && g && w && e && g0);
    fill(x, (size_t)R * D1, 1);
    make_ids2(e, w, R);
    cpu.ops->moe(&cpu, a, x, R, s.ex, NE2, e, w, K1, &s.sh, 6.0f, before_w2, act_fp8, act_bf16, 1.5f);
    double tol = act_bf16 ? 4e-3 : act_fp8 ? 2e-3 : 1e-5;
    for (int k = 0; k < (have_bn ? 1 + NBN : 1); k++) {
        dsv4_backend *b = k ? &g_bn[k - 1] : &gpu;
        dsv4_err err;
        if (k) setenv(bn_runs[k].var, bn_runs[k].env, 1);
        for (int i = 0; i < R * D1; i++) g[i] = NAN;
        long n0 = dsv4_cuda_moe_bn_calls(b);
        b->ops->moe(b, g, x, R, s.ex, NE2, e, w, K1, &s.sh, 6.0f, before_w2, act_fp8, act_bf16, 1.5f);
        if (k) unsetenv(bn_runs[k].var);
        int rc = b->ops->check(b, &err);
        long took = dsv4_cuda_moe_bn_calls(b) - n0;
        double r = rel(g, a, (size_t)R * D1);
        printf("  batch %s routed (inter %lld), %s shared%s, rows %d, before_w2 %d, act_fp8 %d, act_bf16 %d, %s: rel "
               "%.2e (tol %.0e), k_moe_bnr %ld\n",
               dsv4_wfmt_name(rfmt), (long long)ri, dsv4_wfmt_name(sfmt), sf32 ? " (f32 scales)" : "", R, before_w2,
               act_fp8, act_bf16, bn_runs[k].what, r, tol, took);
        CHECKF(rc == 0, "batch: %s", rc ? err.msg : "");
        CHECKF(r <= tol, "batch %d rows %s rel %g", R, bn_runs[k].what, r);
        CHECKF(took == bn_runs[k].took, "batch %s: k_moe_bnr ran %ld times, expected %d", bn_runs[k].what, took,
               bn_runs[k].took);
        if (k && !strcmp(bn_runs[k].var, "DSV4_CUDA_MOE_BNR"))
            CHECKF(dsv4_cuda_moe_bnr(b) == atoi(bn_runs[k].env), "batch %s: DSV4_CUDA_MOE_BNR %d set, %s asked for",
                   bn_runs[k].what, dsv4_cuda_moe_bnr(b), bn_runs[k].env);
        if (k == 0) memcpy(g0, g, sizeof(float) * R * D1);
        if (bn_runs[k].same) {
            int nd = n_differ(g, g0, (size_t)R * D1);
            printf("    %s: %d of %d outputs differ from the default's bits\n", bn_runs[k].what, nd, R * D1);
            CHECKF(nd == 0, "batch %s: %d outputs differ from the default's", bn_runs[k].what, nd);
        }
    }
    for (int i = 0; i < 3 * NE2 + 3; i++) free_w(&s.parts[i]);
    free(x), free(a), free(g), free(w), free(e), free(g0);
}

static void test_batch(void) {
    NEED_GPU();
    have_bn = open_backends(g_bn, NBN);
    check_batch(DSV4_WF_MXFP4, DSV4_WF_FP8, 1024, 0, 2, 0, 0, 0);
    check_batch(DSV4_WF_MXFP4, DSV4_WF_FP8, 1024, 0, 3, 1, 1, 0);
    check_batch(DSV4_WF_NVFP4, DSV4_WF_FP8, 1024, 0, 8, 0, 0, 1);
    check_batch(DSV4_WF_FP8, DSV4_WF_FP8, 2048, 0, 8, 1, 0, 0);
    check_batch(DSV4_WF_MXFP4, DSV4_WF_FP8, 2048, 0, 17, 0, 1, 0);
    check_batch(DSV4_WF_NVFP4, DSV4_WF_FP8, 1024, 1, 17, 1, 0, 0);
    check_batch(DSV4_WF_MXFP4, DSV4_WF_FP8, 1024, 0, 32, 1, 0, 0);
    check_batch(DSV4_WF_FP8, DSV4_WF_FP8, 1024, 1, 32, 0, 1, 0);
    if (have_bn)
        for (int k = 0; k < NBN; k++) dsv4_backend_cuda_free(&g_bn[k]);
}

/* ----- route_moe: the router and the plan in one launch (k_route_plan_w) ----- */

/* Flash's router (hidden 4096, 256 routed experts, k 6) over MXFP4 experts of inter 1024 (Flash:
 * 2048; 1024 keeps the 768 weights at 1.5 GB, and k_moe_b1r / k_moe_bnr still take them) and an
 * FP8 shared expert of 2048, every expert its own weights (a wrong group shows in out) */
enum { DR = 4096, NER = 256, KR = 6, IR = 1024 };
static tw rm_parts[3 * NER + 3];
static dsv4_ffn_w rm_ex[NER], rm_sh;
static int rm_made;

static void make_rm(void) {
    if (rm_made) return;
    rm_made = 1;
    make_ffns(rm_parts, rm_ex, &rm_sh, NER, DR, DSV4_WF_MXFP4, IR, DSV4_WF_FP8, 2048, 0);
}

/* One call's buffers on the GPU backend g: logits and x uploaded, experts / weights / out device
 * outputs (as the forward pass's) */
typedef struct {
    float *lg, *x, *w, *o;
    int32_t *e;
} rm_dev;

static int rm_alloc(dsv4_backend *g, rm_dev *d, const float *lg, const float *x, int R, int NR) {
    *d = (rm_dev){g->ops->alloc(g, sizeof(float) * R * NR), g->ops->alloc(g, sizeof(float) * R * DR),
                  g->ops->alloc(g, sizeof(float) * R * KR), g->ops->alloc(g, sizeof(float) * R * DR),
                  g->ops->alloc(g, sizeof(int32_t) * R * KR)};
    if (!d->lg || !d->x || !d->w || !d->o || !d->e) return 1;
    g->ops->upload(g, d->lg, lg, sizeof(float) * R * NR);
    g->ops->upload(g, d->x, x, sizeof(float) * R * DR);
    return 0;
}

static void rm_free(dsv4_backend *g, rm_dev *d) {
    void *p[] = {d->lg, d->x, d->w, d->o, d->e};
    for (int i = 0; i < 5; i++) g->ops->free(g, p[i]);
}

/* the results of one call, downloaded */
typedef struct {
    float o[8 * DR], w[8 * KR];
    int32_t e[8 * KR];
} rm_out;

static void rm_get(dsv4_backend *g, const rm_dev *d, rm_out *h, int R) {
    g->ops->download(g, h->o, d->o, sizeof(float) * R * DR);
    g->ops->download(g, h->w, d->w, sizeof(float) * R * KR);
    g->ops->download(g, h->e, d->e, sizeof(int32_t) * R * KR);
}

static int rm_same(const rm_out *a, const rm_out *b, int R) {
    return !memcmp(a->o, b->o, sizeof(float) * R * DR) && !memcmp(a->w, b->w, sizeof(float) * R * KR) &&
           !memcmp(a->e, b->e, sizeof(int32_t) * R * KR);
}

/* route_moe against route then moe on the GPU (memcmp of out, experts and weights: the same
 * bits), with device outputs and once more with host ones; against the CPU's route then moe
 * (ids identical, weights rel <= 1e-6 as test_cuda_ops' route, out as the tolerances above);
 * fused: 1 if k_route_plan_w must have run (else the op falls back to the two ops) */
static void check_route_moe_fused(int R, int with_bias, int hash, int before_w2, int act_fp8, int fused) {
    static rm_out sep, fus, hst, ref;
    float *lg = malloc(sizeof(float) * R * NER), *x = malloc(sizeof(float) * R * DR), bias[NER];
    int32_t hid[8 * KR];
    REQUIRE(lg && x && R <= 8);
    fill(lg, (size_t)R * NER, 4);
    fill(x, (size_t)R * DR, 1);
    fill(bias, NER, 0.1f);
    for (int i = 0; i < R * KR; i++) hid[i] = (int32_t)((i / KR * 37 + (i % KR) * 11) % NER);
    const float *bp = with_bias && !hash ? bias : NULL;
    const int32_t *hp = hash ? hid : NULL;
    REQUIRE(gpu.ops->route_moe);
    rm_dev a, f;
    REQUIRE(!rm_alloc(&gpu, &a, lg, x, R, NER) && !rm_alloc(&gpu, &f, lg, x, R, NER));
    gpu.ops->route(&gpu, a.e, a.w, a.lg, R, NER, KR, bp, hp, 1.5f);
    gpu.ops->moe(&gpu, a.o, a.x, R, rm_ex, NER, a.e, a.w, KR, &rm_sh, 6.0f, before_w2, act_fp8, 0, 2.5f);
    long n0 = dsv4_cuda_route_plan_calls(&gpu, DSV4_RP_ALL), n1 = dsv4_cuda_route_plan_calls(&gpu, DSV4_RP_ONE),
         nh = dsv4_cuda_route_plan_calls(&gpu, DSV4_RP_HASH);
    gpu.ops->route_moe(&gpu, f.e, f.w, f.lg, R, NER, KR, bp, hp, 1.5f, f.o, f.x, rm_ex, &rm_sh, 6.0f, before_w2,
                       act_fp8, 0, 2.5f);
    long took = dsv4_cuda_route_plan_calls(&gpu, DSV4_RP_ALL) - n0,
         took1 = dsv4_cuda_route_plan_calls(&gpu, DSV4_RP_ONE) - n1,
         tookh = dsv4_cuda_route_plan_calls(&gpu, DSV4_RP_HASH) - nh;
    /* host outputs (the op stages them and copies them back at its end) */
    gpu.ops->route_moe(&gpu, hst.e, hst.w, f.lg, R, NER, KR, bp, hp, 1.5f, hst.o, f.x, rm_ex, &rm_sh, 6.0f,
                       before_w2, act_fp8, 0, 2.5f);
    rm_get(&gpu, &a, &sep, R);
    rm_get(&gpu, &f, &fus, R);
    CHECK(gpu_ok());
    cpu.ops->route(&cpu, ref.e, ref.w, lg, R, NER, KR, bp, hp, 1.5f);
    cpu.ops->moe(&cpu, ref.o, x, R, rm_ex, NER, ref.e, ref.w, KR, &rm_sh, 6.0f, before_w2, act_fp8, 0, 2.5f);
    int same = rm_same(&sep, &fus, R), same_h = rm_same(&sep, &hst, R);
    int ids = !memcmp(ref.e, fus.e, sizeof(int32_t) * R * KR);
    double rw = rel(fus.w, ref.w, (size_t)R * KR), ro = rel(fus.o, ref.o, (size_t)R * DR);
    double tol = act_fp8 ? 2e-3 : 1e-5;
    printf("  route_moe rows %d%s%s, before_w2 %d, act_fp8 %d: %s, vs two ops %s (host outputs %s); vs cpu ids %s, "
           "weights rel %.2e, out rel %.2e (tol %.0e)\n",
           R, hash ? ", hash ids" : "", bp ? ", bias" : "", before_w2, act_fp8,
           tookh ? "k_route_plan_h" : took1 ? "k_route_plan_1" : took ? "k_route_plan_w" : "fallback",
           same ? "same bits" : "DIFFER", same_h ? "same" : "DIFFER",
           ids ? "same" : "DIFFER", rw, ro, tol);
    CHECK(same);
    CHECK(same_h);
    CHECK(ids);
    CHECKF(rw <= 1e-6, "route_moe weights rel %g", rw);
    CHECKF(ro <= tol, "route_moe out rel %g", ro);
    CHECKF(took == fused, "k_route_plan_w ran %ld times, expected %d", took, fused);
    CHECKF(took1 == (fused && R == 1 && !hash), "k_route_plan_1 ran %ld times at %d rows", took1, R);
    CHECKF(tookh == (fused && hash), "k_route_plan_h ran %ld times at %d rows", tookh, R);
    rm_free(&gpu, &a);
    rm_free(&gpu, &f);
    free(lg), free(x);
}

/* k > n_routed (4 experts, k 6): picks 4 and 5 are no expert (id -1, weight 0); the plan skips
 * them and reports it.  Two ops on one backend, route_moe on another (the error is sticky):
 * the same bits and the same report */
static void check_route_moe_bad_ids(int R) {
    enum { NR = 4 };
    dsv4_backend g2, g3;
    dsv4_err err;
    REQUIRE(dsv4_backend_cuda_init(&g2, 0, &err) == 0);
    REQUIRE(dsv4_backend_cuda_init(&g3, 0, &err) == 0);
    static rm_out sep, fus;
    static float lg[2 * NR], x[2 * DR];
    REQUIRE(R >= 1 && R <= 2);
    fill(lg, R * NR, 4);
    fill(x, R * DR, 1);
    rm_dev a, f;
    REQUIRE(!rm_alloc(&g2, &a, lg, x, R, NR) && !rm_alloc(&g3, &f, lg, x, R, NR));
    g2.ops->route(&g2, a.e, a.w, a.lg, R, NR, KR, NULL, NULL, 1.5f);
    g2.ops->moe(&g2, a.o, a.x, R, rm_ex, NR, a.e, a.w, KR, &rm_sh, 6.0f, 0, 0, 0, 2.5f);
    g3.ops->route_moe(&g3, f.e, f.w, f.lg, R, NR, KR, NULL, NULL, 1.5f, f.o, f.x, rm_ex, &rm_sh, 6.0f, 0, 0, 0, 2.5f);
    long took = dsv4_cuda_route_plan_calls(&g3, DSV4_RP_ALL), took1 = dsv4_cuda_route_plan_calls(&g3, DSV4_RP_ONE);
    rm_get(&g2, &a, &sep, R);
    rm_get(&g3, &f, &fus, R);
    int rc2 = g2.ops->check(&g2, &err), rc3 = g3.ops->check(&g3, &err);
    int same = rm_same(&sep, &fus, R);
    printf("  route_moe rows %d, k 6 of 4 experts: %s, vs two ops %s, ids %d %d, check %d / %d (%s)\n", R,
           took1 ? "k_route_plan_1" : took ? "k_route_plan_w" : "fallback", same ? "same bits" : "DIFFER", fus.e[4],
           fus.e[5], rc2, rc3, rc3 ? err.msg : "no error");
    CHECK(same);
    CHECK(took == 1);
    CHECK(took1 == (R == 1));
    CHECK(fus.e[4] == -1 && fus.e[5] == -1 && fus.w[5] == 0.0f);
    CHECK(rc2 != 0 && rc3 != 0 && strstr(err.msg, "expert id") != NULL);
    dsv4_backend_cuda_free(&g2);
    dsv4_backend_cuda_free(&g3);
}

/* one row of hash ids with two ids outside the experts (NER + 5, -2): route then moe on one
 * backend, route_moe (k_route_plan_h) on another: the same bits (those picks weigh 0 and are
 * skipped) and both report the bad id */
static void check_route_moe_hash_bad(void) {
    dsv4_backend g2, g3;
    dsv4_err err;
    REQUIRE(dsv4_backend_cuda_init(&g2, 0, &err) == 0);
    REQUIRE(dsv4_backend_cuda_init(&g3, 0, &err) == 0);
    static rm_out sep, fus;
    static float lg[NER], x[DR];
    int32_t hid[KR];
    fill(lg, NER, 4);
    fill(x, DR, 1);
    for (int i = 0; i < KR; i++) hid[i] = (int32_t)(i * 29 % NER);
    hid[1] = NER + 5, hid[4] = -2;
    rm_dev a, f;
    REQUIRE(!rm_alloc(&g2, &a, lg, x, 1, NER) && !rm_alloc(&g3, &f, lg, x, 1, NER));
    g2.ops->route(&g2, a.e, a.w, a.lg, 1, NER, KR, NULL, hid, 1.5f);
    g2.ops->moe(&g2, a.o, a.x, 1, rm_ex, NER, a.e, a.w, KR, &rm_sh, 6.0f, 0, 0, 0, 2.5f);
    g3.ops->route_moe(&g3, f.e, f.w, f.lg, 1, NER, KR, NULL, hid, 1.5f, f.o, f.x, rm_ex, &rm_sh, 6.0f, 0, 0, 0, 2.5f);
    long tookh = dsv4_cuda_route_plan_calls(&g3, DSV4_RP_HASH);
    rm_get(&g2, &a, &sep, 1);
    rm_get(&g3, &f, &fus, 1);
    int rc2 = g2.ops->check(&g2, &err), rc3 = g3.ops->check(&g3, &err);
    int same = rm_same(&sep, &fus, 1);
    printf("  route_moe rows 1, hash ids %d and %d outside %d experts: %s, vs two ops %s, weights %g %g, check %d / %d "
           "(%s)\n",
           hid[1], hid[4], NER, tookh ? "k_route_plan_h" : "fallback", same ? "same bits" : "DIFFER", fus.w[1],
           fus.w[4], rc2, rc3, rc3 ? err.msg : "no error");
    CHECK(same);
    CHECK(tookh == 1);
    CHECK(fus.e[1] == NER + 5 && fus.e[4] == -2 && fus.w[1] == 0.0f && fus.w[4] == 0.0f);
    CHECK(rc2 != 0 && rc3 != 0 && strstr(err.msg, "expert id") != NULL);
    rm_free(&g2, &a);
    rm_free(&g3, &f);
    dsv4_backend_cuda_free(&g2);
    dsv4_backend_cuda_free(&g3);
}

/* one row through route_moe on the default backend (a) and on g2 (f), the same inputs */
static void rm_both(dsv4_backend *g2, rm_dev *a, rm_dev *f, const float *bias, const int32_t *hid) {
    gpu.ops->route_moe(&gpu, a->e, a->w, a->lg, 1, NER, KR, bias, hid, 1.5f, a->o, a->x, rm_ex, &rm_sh, 6.0f, 0, 0, 0,
                       2.5f);
    g2->ops->route_moe(g2, f->e, f->w, f->lg, 1, NER, KR, bias, hid, 1.5f, f->o, f->x, rm_ex, &rm_sh, 6.0f, 0, 0, 0,
                       2.5f);
}

/* DSV4_CUDA_RP1=0: one row takes k_route_plan_w instead of k_route_plan_1, with the same bits
 * (out, experts, weights) as the default backend's */
static void check_route_moe_rp1_off(void) {
    enum { R = 1 };
    dsv4_backend g2;
    dsv4_err err;
    /* moe.cu reads its switches when a backend first routes (its device-side state), not at init:
     * the variable stays set until g2's first call */
    REQUIRE(getenv("DSV4_CUDA_RP1") == NULL);
    setenv("DSV4_CUDA_RP1", "0", 1);
    REQUIRE(dsv4_backend_cuda_init(&g2, 0, &err) == 0);
    static rm_out on, off;
    float *lg = malloc(sizeof(float) * NER), *x = malloc(sizeof(float) * DR), bias[NER];
    REQUIRE(lg && x);
    fill(lg, NER, 4);
    fill(x, DR, 1);
    fill(bias, NER, 0.1f);
    rm_dev a, f;
    REQUIRE(!rm_alloc(&gpu, &a, lg, x, R, NER) && !rm_alloc(&g2, &f, lg, x, R, NER));
    long n1 = dsv4_cuda_route_plan_calls(&gpu, DSV4_RP_ONE);
    rm_both(&g2, &a, &f, bias, NULL);
    /* a hash row on the RP1=0 backend: route then moe (k_route_plan_h off with k_route_plan_1) */
    int32_t hid[KR];
    for (int i = 0; i < KR; i++) hid[i] = (int32_t)(i * 41 % NER);
    static rm_out hon, hoff;
    rm_dev ha, hf;
    REQUIRE(!rm_alloc(&gpu, &ha, lg, x, R, NER) && !rm_alloc(&g2, &hf, lg, x, R, NER));
    long nh = dsv4_cuda_route_plan_calls(&gpu, DSV4_RP_HASH);
    rm_both(&g2, &ha, &hf, NULL, hid);
    rm_get(&gpu, &ha, &hon, R);
    rm_get(&g2, &hf, &hoff, R);
    long onh = dsv4_cuda_route_plan_calls(&gpu, DSV4_RP_HASH) - nh,
         offh = dsv4_cuda_route_plan_calls(&g2, DSV4_RP_HASH);
    int hsame = rm_same(&hon, &hoff, R);
    printf("  route_moe rows 1, hash ids: k_route_plan_h (%ld call) against DSV4_CUDA_RP1=0 (%ld calls of it): %s\n",
           onh, offh, hsame ? "same bits" : "DIFFER");
    CHECK(hsame);
    CHECK(onh == 1 && offh == 0);
    rm_free(&gpu, &ha);
    rm_free(&g2, &hf);
    unsetenv("DSV4_CUDA_RP1");
    rm_get(&gpu, &a, &on, R);
    rm_get(&g2, &f, &off, R);
    CHECK(gpu_ok());
    long on1 = dsv4_cuda_route_plan_calls(&gpu, DSV4_RP_ONE) - n1,
         off1 = dsv4_cuda_route_plan_calls(&g2, DSV4_RP_ONE), off_w = dsv4_cuda_route_plan_calls(&g2, DSV4_RP_ALL);
    int same = rm_same(&on, &off, R);
    printf("  route_moe rows 1: k_route_plan_1 (%ld call) against DSV4_CUDA_RP1=0 (k_route_plan_w, %ld call): %s\n",
           on1, off_w, same ? "same bits" : "DIFFER");
    CHECK(same);
    CHECK(on1 == 1 && off1 == 0 && off_w == 1);
    rm_free(&gpu, &a);
    rm_free(&g2, &f);
    dsv4_backend_cuda_free(&g2);
    free(lg), free(x);
}

/* ----- the combine into hc (DSV4_CUDA_HC_COMB=1, moe.cu): the MoE's combine formed inside the next
 * hc_post_pre_norm's k_hc_dec ----- */
static tw hcw_fn, hcw_base, hcw_sc, hcw_norm;
static int hcw_made;

static void make_hcw(void) { /* Flash's attention hc_pre: hc 4, fn f32 [24][16384], its norm bf16 [4096] */
    if (hcw_made) return;
    hcw_made = 1;
    hcw_fn = make_w(DSV4_WF_F32, 24, 4 * DR, 0);
    float s = 4.0f / sqrtf(4.0f * DR);
    for (int64_t i = 0; i < 24 * 4 * DR; i++) ((float *)hcw_fn.data)[i] *= s;
    hcw_base = make_w(DSV4_WF_F32, 1, 24, 0);
    hcw_sc = make_w(DSV4_WF_F32, 1, 3, 0);
    hcw_norm = make_w(DSV4_WF_BF16, 1, DR, 0);
}

/* One pass: route_moe into o, then (how: 0 nothing between, 1 an unrelated op between, 2 o
 * downloaded between into mid, 3 both inside one graph segment) hc_post_pre_norm of o with the
 * state R; out: o, Xout, y, post, comb back to back (6 R DR + 20 R floats) */
static void hcc_pass(rm_dev *d, float *Rd, float *pind, float *cind, float *buf, float *tick, int R, int bf, int how,
                     float *out, float *mid) {
    size_t nx = (size_t)R * 4 * DR, ny = (size_t)R * DR;
    float *X = buf, *y = X + nx, *po = y + ny, *co = po + 4 * R;
    if (how == 3) gpu.ops->segment(&gpu, 7);
    gpu.ops->route_moe(&gpu, d->e, d->w, d->lg, R, NER, KR, NULL, NULL, 1.5f, d->o, d->x, rm_ex, &rm_sh, 6.0f, 0, 0,
                       bf, 2.5f);
    if (how == 1) gpu.ops->scale(&gpu, tick, 64, 1.0f, 0);
    if (how == 2) gpu.ops->download(&gpu, mid, d->o, sizeof(float) * ny);
    gpu.ops->hc_post_pre_norm(&gpu, X, d->o, Rd, pind, cind, bf, y, po, co, R, 4, DR, &hcw_fn.w, &hcw_base.w,
                              &hcw_sc.w, 20, 1e-6f, 1e-6f, bf, bf, &hcw_norm.w, 1e-6f);
    if (how == 3) gpu.ops->segment(&gpu, -1);
    gpu.ops->download(&gpu, out, d->o, sizeof(float) * ny);
    gpu.ops->download(&gpu, out + ny, buf, sizeof(float) * (nx + ny + 20 * R));
}

/* Every output (o, Xout, y, post, comb) with the switch on must have the bits of the separate
 * combine, for each way of calling; the combine is taken only where nothing comes between
 * (and R <= 4), else launched on its own */
static void check_hc_comb(int R, int bf) {
    size_t nx = (size_t)R * 4 * DR, ny = (size_t)R * DR, nout = ny + nx + ny + 20 * (size_t)R;
    float *lg = malloc(sizeof(float) * R * NER), *x = malloc(sizeof(float) * R * DR),
          *st = malloc(sizeof(float) * nx), *y0 = malloc(sizeof(float) * ny), *pin = malloc(sizeof(float) * 4 * R),
          *cin = malloc(sizeof(float) * 16 * R), *ref = malloc(sizeof(float) * nout),
          *got = malloc(sizeof(float) * nout);
    float *mid = malloc(sizeof(float) * ny);
    REQUIRE(lg && x && st && y0 && pin && cin && ref && got && mid);
    fill(lg, (size_t)R * NER, 4);
    fill(x, (size_t)R * DR, 1);
    fill(st, nx, 2);
    cpu.ops->hc_pre(&cpu, y0, pin, cin, st, R, 4, DR, &hcw_fn.w, &hcw_base.w, &hcw_sc.w, 20, 1e-6f, 1e-6f, 0, 0);
    rm_dev d;
    REQUIRE(!rm_alloc(&gpu, &d, lg, x, R, NER));
    float *Rd = gpu.ops->alloc(&gpu, sizeof(float) * nx), *pind = gpu.ops->alloc(&gpu, sizeof(float) * 4 * R),
          *cind = gpu.ops->alloc(&gpu, sizeof(float) * 16 * R), *buf = gpu.ops->alloc(&gpu, sizeof(float) * nout),
          *tick = gpu.ops->alloc(&gpu, sizeof(float) * 64);
    REQUIRE(Rd && pind && cind && buf && tick);
    gpu.ops->upload(&gpu, Rd, st, sizeof(float) * nx);
    gpu.ops->upload(&gpu, pind, pin, sizeof(float) * 4 * R);
    gpu.ops->upload(&gpu, cind, cin, sizeof(float) * 16 * R);
    gpu.ops->upload(&gpu, tick, (float[64]){0}, sizeof(float) * 64);
    dsv4_cuda_set_hc_comb(&gpu, 0);
    hcc_pass(&d, Rd, pind, cind, buf, tick, R, bf, 0, ref, NULL);
    CHECK(gpu_ok());
    dsv4_cuda_set_hc_comb(&gpu, 1);
    static const char *hows[4] = {"back to back", "an op between", "o downloaded between", "in a graph"};
    for (int how = 0; how < 4; how++) {
        long t0, f0, t1, f1;
        dsv4_cuda_hc_comb_counts(&gpu, &t0, &f0);
        /* a graph's first capture instantiates; the second replays an updated executable */
        for (int rep = 0; rep < (how == 3 ? 2 : 1); rep++) {
            memset(got, 0xff, sizeof(float) * nout);
            if (how == 2) memset(mid, 0xff, sizeof(float) * ny);
            gpu.ops->upload(&gpu, d.o, (float[1]){NAN}, sizeof(float)); /* o's first value stale: must be rewritten */
            hcc_pass(&d, Rd, pind, cind, buf, tick, R, bf, how, got, how == 2 ? mid : NULL);
            CHECK(gpu_ok());
            int same = !memcmp(got, ref, sizeof(float) * nout) && (how != 2 || !memcmp(mid, ref, sizeof(float) * ny));
            dsv4_cuda_hc_comb_counts(&gpu, &t1, &f1);
            long want_t = R <= 4 && (how == 0 || how == 3) ? rep + 1 : 0;
            printf("  combine into hc, rows %d bf16 %d, %s%s: %s the separate combine's bits; taken %ld, launched "
                   "alone %ld\n", R, bf, hows[how], rep ? " (replay)" : "", same ? "give" : "DIFFER from",
                   t1 - t0, f1 - f0);
            CHECKF(same, "combine into hc rows %d bf16 %d (%s): bits differ", R, bf, hows[how]);
            CHECKF(t1 - t0 == want_t, "combine into hc rows %d (%s): taken %ld times, expected %ld", R, hows[how],
                   t1 - t0, want_t);
            CHECKF(t1 - t0 + f1 - f0 == (R <= 4 ? rep + 1 : 0), "rows %d (%s): %ld combines left pending", R,
                   hows[how], t1 - t0 + f1 - f0);
            if (!same)
                for (size_t i = 0, shown = 0; i < nout && shown < 4; i++)
                    if (memcmp(got + i, ref + i, sizeof(float)))
                        printf("    [%zu] separate %.9g fused %.9g\n", i, ref[i], got[i]), shown++;
        }
    }
    dsv4_cuda_set_hc_comb(&gpu, 0);
    rm_free(&gpu, &d);
    gpu.ops->free(&gpu, Rd), gpu.ops->free(&gpu, pind), gpu.ops->free(&gpu, cind), gpu.ops->free(&gpu, buf);
    gpu.ops->free(&gpu, tick);
    free(lg), free(x), free(st), free(y0), free(pin), free(cin), free(ref), free(got), free(mid);
}

static void test_hc_comb(void) {
    NEED_GPU();
    make_rm();
    make_hcw();
    for (int bf = 0; bf < 2; bf++)
        for (int R = 1; R <= 5; R++) check_hc_comb(R, bf);
}

static void test_route_moe(void) {
    NEED_GPU();
    make_rm();
    for (int R = 1; R <= 5; R++) check_route_moe_fused(R, 1, 0, 0, 0, 1);
    check_route_moe_fused(1, 0, 0, 1, 0, 1);  /* no bias, weights before w2 */
    check_route_moe_fused(3, 1, 0, 0, 1, 1);  /* act_fp8 */
    check_route_moe_fused(1, 1, 1, 0, 0, 1);  /* hash ids, one row: k_route_plan_h */
    check_route_moe_fused(1, 0, 1, 1, 1, 1);  /* the same before w2, act_fp8 */
    check_route_moe_fused(2, 1, 1, 0, 0, 0);  /* hash ids, two rows: route then moe */
    check_route_moe_hash_bad();
    check_route_moe_fused(6, 1, 0, 0, 0, 0);  /* 36 slots: past the one-warp plan */
    check_route_moe_bad_ids(1);
    check_route_moe_bad_ids(2);
    check_route_moe_rp1_off();
    /* DSV4_CUDA_ROUTE_PLAN=0: the op is left out (the forward pass calls route and moe) */
    dsv4_backend g2;
    REQUIRE(cuda_init_env(&g2, "DSV4_CUDA_ROUTE_PLAN", "0") == 0);
    CHECK(g2.ops->route_moe == NULL);
    CHECK(gpu.ops->route_moe != NULL);
    dsv4_backend_cuda_free(&g2);
    for (int i = 0; i < 3 * NER + 3; i++) free_w(&rm_parts[i]);
    rm_made = 0;
}

TEST_MAIN(test_moe_gemm, test_small_batch_keeps_slot_groups, test_bad_id_reported, test_one_row, test_one_row_mma_flash,
          test_one_row_e4m3, test_pro_moe, test_batch, test_hc_comb,
          test_route_moe)
