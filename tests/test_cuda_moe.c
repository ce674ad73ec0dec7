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

TEST_MAIN(test_moe_gemm, test_small_batch_keeps_slot_groups, test_bad_id_reported)
