/* tests/test_cuda_linear: the decode GEMVs of linear.cu (matmul, matmul_grouped at rows <= 8)
 * against the CPU backend, on the shapes of a Flash decode step and on shapes chosen to hit
 * the edges of a tiled streaming path (bulk-copy tiles of whole weight rows, 16-byte vector
 * columns per thread; docs: the "lin" report, patch kept outside the tree):
 *   test_stream_shapes: wq_b FP8 32768 x 1024, wo_b FP8 4096 x 8192, 4096 x 4096 with e8m0 and
 *     f32 block scales, bf16 head-like and compressor rows, f32, grouped wo_a 8 x 1024 x 4096,
 *     rows 1-4; a partial last tile (4100 / 4099 rows of K 1024), FP8 K 7168 (448 vectors: a
 *     partial second column set) and K 16384, act_fp8, bf16 K 256 / 768 (several rows per
 *     256-thread block, idle warps), w_bf16 on FP8 (grouped in_bf16: scaled then rounded per
 *     weight) and out_bf16;
 *   test_gemv8: the FP8 GEMVs of one row (k_gemv8, k_gemv8x) on each geometry they pick, e8m0
 *     and f32 scales, out_bf16, w_bf16, act_fp8, row counts not a multiple of the rows per
 *     pass, pass counts not a multiple of k_gemv8x's grid, groups that change inside a block;
 *   test_fused_input: grouped wo_a's bf16 input rounded inside k_gemv8x and its bf16 weights
 *     factored where exact: the same bits as the copy and the per-weight rounding, the counter
 *     proving the fused path ran, shapes it declines, a low scale code that keeps SCL 2;
 *   test_batched: the GEMV of 2..8 rows a launch (k_gemvn) at rows 2, 3, 5, 8, 13, 32 (see there);
 *   test_other_shapes: rows 5, 7, 8, odd shapes (element-wise path), few features, 32 KB
 *     rows, MXFP4, split-K, a group size that is not a multiple of 8, grouped rows 7.
 * Tolerances (rel = ||gpu - cpu||_2 / ||cpu||_2 over the output):
 *   fp32 outputs 2e-6: summation order is the only difference allowed (a kernel that applies
 *     an FP8 block scale to a 16-value partial instead of each weight is exact for e8m0
 *     scales and rounds differently by ~1 ulp of the partial for f32 scales);
 *   outputs rounded to bf16 (out_bf16, grouped in/out_bf16) 4e-3: one bf16 ulp may flip.
 * Every output is preset to NaN so an unwritten row fails.
 * test_pro_shapes: V4-Pro's decode linears (wq_a 1536 x 7168, wq_b 65536 x 1536, wkv, the
 *   indexer's wq_b 8192 x 1536 with act_fp8, wo_b 7168 x 16384, grouped wo_a 16 x 1024 x 4096,
 *   bf16 compressors, weights_proj and the 129280 x 7168 head) at rows 1, 2, 4, 8 (head 1, 4),
 *   and with linear.dot=mma at one row (taken or declined);
 * test_matmul_rn: matmul_rn (qa's norm inside wq_b) against the GPU's rmsnorm then matmul bit for bit and
 *   the CPU's two ops (tolerances as above), on the fused kernel (norm weights bf16 / f32 / none, the bf16
 *   roundings, a partial last pass) and on shapes the kernel declines; counters prove each path, and
 *   matmul_rn_takes must say which.
 * test_list_beside: op_list_beside after a waiting matmul_rn (DSV4_WQB_FIRST's order): early where nothing
 *   is shared, late where a task reads the matmul's output or writes its input or where no matmul_rn is
 *   before it; the bits of the same ops in order every time.
 * test_fresh_weights: weights never seen before, used at once (the upload must be complete
 *   before the kernel reads it), 24 calls of F32 [64..4096 x 1024] rows 5 out_bf16 (4e-3).
 * test_gemv_mma: linear.dot=mma (k_gemv_mma, gemv_mma.cu, FP8 one row on f16 tensor cores) on
 *   each geometry it picks (K 512 .. 8192: 1, 2, 4, 8 warps a tile), row counts not a multiple of
 *   16, grouped wo_a with and without bf16 input, out_bf16, act_fp8, x over 2^-24 .. 2^24 and
 *   within-block spreads, zeros, a NaN and an inf; the launch counter proves the path ran (and
 *   that f32 scales, K 7168, small weights and two rows decline it, the fp32 kernels then
 *   giving the answer); tolerance 2e-6 as above (the MMA's own summation; docs/NUMERICS.md);
 * test_timing: the Flash decode shapes (wq_b, grouped wo_a, wo_b, wq_a, wkv, indexer wq_b,
 *   bf16 compressor / gate / weights_proj-like) at rows 1, 2, 4, 8, 32, cold (a 256 MB device
 *   copy before each of 20 calls), device time per call from the backend's per-op events;
 *   prints us, GB/s and the fraction of the device copy bandwidth, and checks the timed
 *   outputs against the CPU op (2e-6).  Run it under tools/device/ktrace.c for kernel times.
 * Without a CUDA device (or in a CPU-only build) the binary prints SKIP. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_TEST_SEED 4242
#define CUDA_TEST_NAME "test_cuda_linear"
#include "backend/cuda/cuda.h"
#include "cuda_test_util.h"

static int check_mm(dsv4_wfmt fmt, int64_t O, int64_t K, int rows, int sf32, int act_fp8, int out_bf16,
                    const char *what) {
    tw t = make_w(fmt, O, K, sf32);
    size_t nx = (size_t)rows * K, no = (size_t)rows * O;
    float *x = malloc(sizeof(float) * nx), *a = malloc(sizeof(float) * no), *g = malloc(sizeof(float) * no);
    fill(x, nx, 2);
    cpu.ops->matmul(&cpu, a, x, rows, &t.w, act_fp8, out_bf16);
    for (size_t i = 0; i < no; i++) g[i] = NAN;
    gpu.ops->matmul(&gpu, g, x, rows, &t.w, act_fp8, out_bf16);
    int ok = gpu_ok();
    double r = rel(g, a, no), tol = out_bf16 ? 4e-3 : 2e-6;
    printf("  %-10s %-6s%s [%6lld x %5lld] rows %d act_fp8 %d out_bf16 %d: rel %.2e (tol %.0e)\n", what,
           dsv4_wfmt_name(fmt), sf32 ? "/f32s" : "", (long long)O, (long long)K, rows, act_fp8, out_bf16, r, tol);
    CHECKF(ok && r <= tol, "%s %s [%lld x %lld] rows %d rel %g", what, dsv4_wfmt_name(fmt), (long long)O,
           (long long)K, rows, r);
    free(x), free(a), free(g);
    free_w(&t);
    return ok && r <= tol;
}

/* decode shapes and the edges of a tiled streaming path (see the header) */
static void test_stream_shapes(void) {
    NEED_GPU();
    static const int rs[] = {1, 2, 3, 4};
    for (int i = 0; i < 4; i++) {
        int rows = rs[i];
        check_mm(DSV4_WF_FP8, 32768, 1024, rows, 0, 0, 0, "wq_b");
        check_mm(DSV4_WF_FP8, 4096, 8192, rows, 0, 0, 0, "wo_b");
        check_mm(DSV4_WF_FP8, 4096, 4096, rows, 0, 0, 0, "4096^2");
        check_mm(DSV4_WF_FP8, 4096, 4096, rows, 1, 0, 0, "f32 scale");
        check_mm(DSV4_WF_BF16, 8192, 4096, rows, 0, 0, 0, "head-like");
        check_mm(DSV4_WF_BF16, 1024, 4096, rows, 0, 0, 1, "compressor");
        check_mm(DSV4_WF_F32, 2048, 2048, rows, 0, 0, 0, "f32");
        cuda_check_grouped(DSV4_WF_FP8, 8, 1024, 4096, rows, 0, "wo_a");
    }
    check_mm(DSV4_WF_FP8, 4100, 1024, 1, 0, 0, 0, "last tile"); /* 4100 = 512 tiles of 8 + 4 */
    check_mm(DSV4_WF_FP8, 4099, 1024, 3, 0, 0, 0, "last tile");
    check_mm(DSV4_WF_FP8, 2048, 7168, 1, 0, 0, 0, "K 7168");   /* 448 vectors: idle warps in column 2 */
    check_mm(DSV4_WF_FP8, 2048, 7168, 2, 1, 0, 0, "K 7168");
    check_mm(DSV4_WF_FP8, 2048, 16384, 1, 0, 0, 0, "FP8 16K");   /* 16 KB rows: 4 columns per thread */
    check_mm(DSV4_WF_FP8, 8192, 1024, 1, 0, 1, 0, "act_fp8");   /* indexer wq_b with act_quant */
    check_mm(DSV4_WF_BF16, 4096, 256, 1, 0, 0, 0, "K 256");    /* 512-byte rows: 8 row parts */
    check_mm(DSV4_WF_BF16, 4096, 768, 2, 0, 0, 0, "K 768");    /* 96 vectors: 2 parts, 2 idle warps */
    cuda_check_grouped(DSV4_WF_FP8, 8, 1024, 4096, 1, 1, "wo_a bf16"); /* w_bf16 on FP8: per-weight scale */
    cuda_check_grouped(DSV4_WF_BF16, 4, 512, 2048, 2, 1, "grp bf16");
}

/* k_gemv8 (FP8 at one row): each CPT x RPP x row-part geometry its launcher picks (the label
 * gives it, tN: N threads per row, else 32; docs in linear.cu), e8m0 scales (factored out of
 * a vector's partial sum) and f32 scales (per weight) on every shape, out_bf16, w_bf16
 * (grouped in_bf16), act_fp8 and row counts that are not a multiple of RPP (last rows
 * clamped).  Labels "x ...": k_gemv8x (the large weights: persistent grid of 2 blocks per SM,
 * two passes or more per block), odd pass counts (the loop's second buffer idle at the end),
 * RPP cut by the group size.  The same shapes at two rows (k_gemv). */
static void test_gemv8(void) {
    NEED_GPU();
    static const struct {
        int64_t O, K;
        const char *what;
    } sh[] = {
        {16384, 512, "c1 r4"},       {8000, 512, "c1 r2"},        {4096, 512, "c1 r1"},
        {8000, 1024, "c2 r2"},       {4096, 1024, "c2 r1"},       {8192, 2048, "c4 r2"},
        {4096, 2048, "c4 r1"},       {4096, 4096, "c4 r2 t64"},   {1024, 4096, "c2 r1 t128"},
        {512, 4096, "c1 r1 t256"},   {2048, 16384, "c4 r2 t256"},
        {4097, 1024, "4097 rows"},   {4098, 1024, "4098 rows"},   {96, 1024, "96 rows"},
        {32768, 1024, "c2 r4"},      {32770, 1024, "c2 r2 tail"}, {16384, 2048, "c4 r2"},
        /* k_gemv8x on 132 SMs (K 4096..8192, >= 528 passes): tN threads a row, rN rows a pass */
        {8192, 4096, "x t128 r4"},   {4096, 8192, "x t256 r4"},   {4097, 8192, "x t256 r1 tail"},
    };
    for (int rows = 1; rows <= 2; rows++)
        for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++)
            for (int sf32 = 0; sf32 <= 1; sf32++)
                check_mm(DSV4_WF_FP8, sh[i].O, sh[i].K, rows, sf32, 0, 0, sh[i].what);
    for (int rows = 1; rows <= 2; rows++) {
        check_mm(DSV4_WF_FP8, 32768, 1024, rows, 0, 0, 1, "out_bf16");
        check_mm(DSV4_WF_FP8, 4096, 4096, rows, 1, 0, 1, "out_bf16");
        check_mm(DSV4_WF_FP8, 8192, 1024, rows, 0, 1, 0, "act_fp8");
        cuda_check_grouped(DSV4_WF_FP8, 8, 1024, 4096, rows, 1, "wo_a bf16");
        cuda_check_grouped(DSV4_WF_FP8, 8, 1024, 1024, rows, 0, "grp K 1024");
        cuda_check_grouped(DSV4_WF_FP8, 6, 1022, 1024, rows, 1, "grp 1022 bf16");
        cuda_check_grouped(DSV4_WF_FP8, 6, 1022, 4096, rows, 0, "x grp 1022"); /* groups change in a block */
        cuda_check_grouped(DSV4_WF_FP8, 6, 1022, 4096, rows, 1, "x grp 1022 bf16");
    }
}

/* linear.dot=mma against the CPU's fp32 op: G groups (0: plain matmul) of O x K, x by mode (0
 * fill, 1 fill_aq's block scales, 2 a spread of 2^-20 .. 2^20 inside every block, 3 zeros);
 * taken: whether k_gemv_mma must run (its counter; -1: either, the answer is checked all the same) */
static void check_mma(int G, int64_t O, int64_t K, int rows, int sf32, int in_bf16, int out_bf16, int act_fp8,
                      int mode, int taken, const char *what) {
    int64_t R = G ? (int64_t)G * O : O, xc = G ? (int64_t)G * K : K;
    tw t = make_w(DSV4_WF_FP8, R, K, sf32);
    size_t nx = (size_t)rows * xc, no = (size_t)rows * R;
    float *x = malloc(sizeof(float) * nx), *a = malloc(sizeof(float) * no), *g = malloc(sizeof(float) * no);
    REQUIRE(x && a && g);
    if (mode == 1) {
        for (int r = 0; r < rows; r++)
            for (int64_t c = 0; c < xc; c += K) fill_aq(x + (size_t)r * xc + c, K);
    } else if (mode == 2) {
        for (size_t i = 0; i < nx; i++) x[i] = ldexpf(frand(), (int)(urand() % 41) - 20);
    } else if (mode == 3) {
        memset(x, 0, sizeof(float) * nx);
    } else {
        fill(x, nx, 2);
    }
    const int fl = (act_fp8 ? DSV4_LIN_ACT_FP8 : 0) | DSV4_LIN_DOT_MMA;
    if (G) cpu.ops->matmul_grouped(&cpu, a, x, rows, &t.w, G, in_bf16, out_bf16, 0);
    else cpu.ops->matmul(&cpu, a, x, rows, &t.w, fl, out_bf16); /* the CPU ignores DOT_MMA: its fp32 op */
    for (size_t i = 0; i < no; i++) g[i] = NAN;
    long n0 = dsv4_cuda_gemv_mma_calls();
    if (G) gpu.ops->matmul_grouped(&gpu, g, x, rows, &t.w, G, in_bf16, out_bf16, fl);
    else gpu.ops->matmul(&gpu, g, x, rows, &t.w, fl, out_bf16);
    int ok = gpu_ok(), ran = dsv4_cuda_gemv_mma_calls() > n0;
    double r = rel(g, a, no), tol = in_bf16 || out_bf16 ? 4e-3 : 2e-6;
    int zero_ok = 1;
    if (mode == 3)
        for (size_t i = 0; i < no; i++) zero_ok &= g[i] == 0.0f;
    printf("  mma %-14s %d x [%6lld x %5lld] rows %d%s in/out_bf16 %d/%d act_fp8 %d x %d: %s, rel %.2e (tol %.0e)\n",
           what, G, (long long)O, (long long)K, rows, sf32 ? " f32s" : "", in_bf16, out_bf16, act_fp8, mode,
           ran ? "k_gemv_mma" : "declined", r, tol);
    CHECKF(ok && (taken < 0 || ran == taken) && zero_ok && (mode == 3 || r <= tol),
           "mma %s ran %d (want %d) rel %g zeros %d", what, ran, taken, r, zero_ok);
    free(x), free(a), free(g);
    free_w(&t);
}

/* a NaN or an inf in x: every output non-finite, as the CPU's (k_gemv_mma gives NaN for both) */
static void check_mma_nonfinite(float bad, int64_t at) {
    tw t = make_w(DSV4_WF_FP8, 32768, 1024, 0);
    float *x = malloc(sizeof(float) * 1024), *a = malloc(sizeof(float) * 32768), *g = malloc(sizeof(float) * 32768);
    REQUIRE(x && a && g);
    fill(x, 1024, 1);
    x[at] = bad;
    cpu.ops->matmul(&cpu, a, x, 1, &t.w, 0, 0);
    long n0 = dsv4_cuda_gemv_mma_calls();
    gpu.ops->matmul(&gpu, g, x, 1, &t.w, DSV4_LIN_DOT_MMA, 0);
    int ok = gpu_ok(), ran = dsv4_cuda_gemv_mma_calls() > n0, nf_cpu = 0, nf_gpu = 0, nan_gpu = 0;
    for (int i = 0; i < 32768; i++) nf_cpu += !isfinite(a[i]), nf_gpu += !isfinite(g[i]), nan_gpu += isnan(g[i]);
    printf("  mma x[%lld] = %g: non-finite outputs cpu %d gpu %d (NaN %d) of 32768\n", (long long)at, bad, nf_cpu,
           nf_gpu, nan_gpu);
    CHECKF(ok && ran && nf_cpu == 32768 && nf_gpu == 32768 && nan_gpu == 32768, "mma non-finite x %g: %d %d %d", bad,
           nf_cpu, nf_gpu, nan_gpu);
    free(x), free(a), free(g);
    free_w(&t);
}

static void test_gemv_mma(void) {
    NEED_GPU();
    check_mma(0, 32768, 1024, 1, 0, 0, 0, 0, 0, 1, "wq_b");          /* 1 warp a tile, 8 tiles a block */
    check_mma(0, 4096, 8192, 1, 0, 0, 0, 0, 0, 1, "wo_b");           /* 8 warps a tile */
    check_mma(0, 8192, 4096, 1, 0, 0, 0, 0, 0, 1, "K 4096");         /* 4 warps a tile */
    check_mma(0, 16384, 2048, 1, 0, 0, 0, 0, 0, 1, "K 2048");        /* 2 warps a tile */
    check_mma(0, 32768, 512, 1, 0, 0, 0, 0, 0, 1, "K 512");          /* 4 steps a warp */
    check_mma(0, 32770, 1024, 1, 0, 0, 0, 0, 0, 1, "tail 2");        /* last tile 2 rows */
    check_mma(0, 4100, 8192, 1, 0, 0, 0, 0, 0, 1, "tail 4 x8");      /* last tile 4 rows, 8 warps */
    check_mma(0, 32760, 1024, 1, 0, 0, 0, 0, 0, 1, "tail 8");        /* rows 8..15 of the last tile past the end */
    check_mma(0, 32768, 1024, 1, 0, 0, 0, 0, 1, 1, "wq_b aq-x");     /* block scales 2^-24 .. 2^24 */
    check_mma(0, 4096, 8192, 1, 0, 0, 0, 0, 2, 1, "wo_b spread");    /* 2^-20 .. 2^20 inside blocks */
    check_mma(0, 32768, 1024, 1, 0, 0, 0, 0, 3, 1, "zeros");
    check_mma(0, 32768, 1024, 1, 0, 0, 1, 0, 0, 1, "out_bf16");
    check_mma(0, 32768, 1024, 1, 0, 0, 0, 1, 1, 1, "act_fp8");
    check_mma(8, 1024, 4096, 1, 0, 0, 0, 0, 0, 1, "wo_a");           /* 2 tiles a block, one group */
    check_mma(8, 1024, 4096, 1, 0, 0, 0, 0, 1, 1, "wo_a aq-x");
    check_mma(8, 1024, 4096, 1, 0, 1, 1, 0, 0, 1, "wo_a bf16");      /* x rounded inside; exact bf16 weights */
    check_mma(32, 1024, 1024, 1, 0, 0, 0, 0, 0, 1, "grp K 1024");    /* 8 tiles a block in one group */
    /* declined: the fp32 kernels answer */
    check_mma(0, 4096, 4096, 1, 1, 0, 0, 0, 0, 0, "f32 scales");
    check_mma(0, 2048, 7168, 1, 0, 0, 0, 0, 0, 0, "K 7168");         /* 56 steps: 7 warps a tile */
    check_mma(0, 1024, 4096, 1, 0, 0, 0, 0, 0, 0, "small");          /* 32 blocks < the SMs */
    check_mma(0, 32768, 1024, 2, 0, 0, 0, 0, 0, 0, "two rows");
    check_mma(6, 1022, 4096, 1, 0, 0, 0, 0, 0, 0, "grp 1022");       /* a block would span two groups */
    check_mma_nonfinite(NAN, 700);
    check_mma_nonfinite(INFINITY, 3);
    check_mma_nonfinite(-INFINITY, 1023);
}

/* grouped wo_a's bf16 input rounded inside k_gemv8x (linear.cu gemv_bf16in) and its bf16
 * weights factored like e8m0 FP8 (SCL 0, exact in bf16 for codes 3..246): the same bits as the
 * copy + k_round_bf16 and the per-weight rounding (SCL 2) of dsv4_cuda_set_aq_fuse(0), the call
 * counter proving which path ran, and the CPU op; x from fill_aq (cuda_test_util.h: scales 2^-24
 * .. 2^24, ties, a tiny block, zeros) */
static int fp_low_scale; /* fused_pair: the weight's first e8m0 code 2 (no exact bf16 weights: SCL 2 stays) */
static void fused_pair(int64_t O, int64_t K, int G, int want_fused, const char *what) {
    tw t = make_w(DSV4_WF_FP8, (int64_t)G * O, K, 0);
    if (fp_low_scale) ((uint8_t *)t.scale)[0] = 2;
    size_t nx = (size_t)G * K, no = (size_t)G * O;
    float *x = malloc(sizeof(float) * nx), *a = malloc(sizeof(float) * no), *g[2];
    g[0] = malloc(sizeof(float) * no), g[1] = malloc(sizeof(float) * no);
    REQUIRE(x && a && g[0] && g[1]);
    for (int gi = 0; gi < G; gi++) fill_aq(x + (size_t)gi * K, K);
    cpu.ops->matmul_grouped(&cpu, a, x, 1, &t.w, G, 1, 1, 0);
    long took[2];
    const int fz0 = dsv4_cuda_aq_fuse();
    for (int f = 0; f < 2; f++) {
        dsv4_cuda_set_aq_fuse(f ? DSV4_CUDA_AQ_ALL : 0);
        for (size_t i = 0; i < no; i++) g[f][i] = NAN;
        long c0 = dsv4_cuda_aq_fused_calls();
        gpu.ops->matmul_grouped(&gpu, g[f], x, 1, &t.w, G, 1, 1, 0);
        CHECK(gpu_ok());
        took[f] = dsv4_cuda_aq_fused_calls() - c0;
    }
    dsv4_cuda_set_aq_fuse(fz0);
    int same = !memcmp(g[0], g[1], sizeof(float) * no);
    double r = rel(g[1], a, no);
    printf("  %-12s FP8 %d x [%5lld x %5lld] in/out_bf16, scale codes %s: fused calls %ld / %ld (want %d / 0), "
           "bits %s, rel %.2e (tol 4e-03)\n",
           what, G, (long long)O, (long long)K, fp_low_scale ? "with a 2" : "118..121", took[1], took[0], want_fused,
           same ? "identical" : "DIFFER", r);
    CHECKF(same && took[1] == want_fused && took[0] == 0 && r <= 4e-3, "fused input %s [%lld x %lld]", what,
           (long long)O, (long long)K);
    free(x), free(a), free(g[0]), free(g[1]);
    free_w(&t);
}

static void test_fused_input(void) {
    NEED_GPU();
    /* k_gemv8x takes the weight (8 x 1024 x 4096: 528+ passes; 6 x 1020: RPP cut by the group);
     * it does not at 6 x 1022 (gR % 4: the element-wise kernel), at 4 x 512 (too few passes:
     * k_gemv8, which keeps the copy) or at K 1024 (k_gemv8) */
    fused_pair(1024, 4096, 8, 1, "wo_a");
    fused_pair(1020, 4096, 6, 1, "grp 1020");
    fused_pair(1022, 4096, 6, 0, "grp 1022");
    fused_pair(512, 4096, 4, 0, "grp small");
    fused_pair(1024, 1024, 8, 0, "grp K 1024"); /* k_gemv8 at SCL 0 against SCL 2 */
    /* a scale code of 2 (2^-125): value * scale not exact in bf16, so the per-weight rounding
     * (SCL 2) stays, with x rounded inside k_gemv8x; and through k_gemv8 */
    fp_low_scale = 1;
    fused_pair(1024, 4096, 8, 1, "wo_a lo sc");
    fused_pair(1024, 1024, 8, 0, "grp K 1024");
    fp_low_scale = 0;
}

/* k_gemvn (2..8 rows a launch; larger batches in chunks of 8, 13 = 8 + 5, 32 = 4 x 8): FP8 with
 * e8m0 and f32 scales, bf16, out_bf16, act_fp8, w_bf16 (grouped in_bf16) and the grouped
 * wo_a-like projection, at shapes that take each warp split (kw 1: wq_b; 4 or 8: the
 * others), a row count that leaves the last warp's rows past the end (1004 = 125 x 8 + 4),
 * K 768 (6 steps: kw 2 at most), and a group size that is not a multiple of 8 (RPP 4). */
static void test_batched(void) {
    NEED_GPU();
    static const int rs[] = {2, 3, 5, 8, 13, 32};
    for (int i = 0; i < 6; i++) {
        int rows = rs[i];
        check_mm(DSV4_WF_FP8, 8192, 1024, rows, 0, 0, 0, "bn 8192");
        check_mm(DSV4_WF_FP8, 4096, 4096, rows, 1, 0, 0, "bn f32s");
        check_mm(DSV4_WF_FP8, 1004, 8192, rows, 0, 0, 0, "bn tail");
        check_mm(DSV4_WF_FP8, 1004, 8192, rows, 1, 0, 1, "bn tail");
        check_mm(DSV4_WF_FP8, 2048, 1024, rows, 0, 1, 0, "bn act_fp8");
        check_mm(DSV4_WF_BF16, 1024, 4096, rows, 0, 0, 1, "bn bf16");
        check_mm(DSV4_WF_BF16, 300, 768, rows, 0, 0, 0, "bn bf16 K768");
        cuda_check_grouped(DSV4_WF_FP8, 8, 1024, 4096, rows, 0, "bn wo_a");
        cuda_check_grouped(DSV4_WF_FP8, 8, 1024, 4096, rows, 1, "bn wo_a bf16");
        cuda_check_grouped(DSV4_WF_FP8, 6, 1020, 1024, rows, 0, "bn grp 1020");
    }
    check_mm(DSV4_WF_FP8, 32768, 1024, 2, 0, 0, 0, "bn wq_b");
    check_mm(DSV4_WF_FP8, 32768, 1024, 8, 0, 0, 0, "bn wq_b");
    check_mm(DSV4_WF_FP8, 4096, 8192, 8, 0, 0, 0, "bn wo_b");
}

/* shapes outside such a path (more rows, odd shapes, long rows, FP4) */
static void test_other_shapes(void) {
    NEED_GPU();
    check_mm(DSV4_WF_FP8, 4096, 4096, 8, 0, 0, 0, "rows 8");
    check_mm(DSV4_WF_FP8, 4096, 4096, 7, 1, 0, 0, "rows 7");
    check_mm(DSV4_WF_BF16, 4096, 4096, 5, 0, 0, 1, "rows 5");
    check_mm(DSV4_WF_FP8, 37, 300, 1, 0, 0, 0, "odd");
    check_mm(DSV4_WF_BF16, 301, 1000, 7, 0, 0, 0, "odd");
    check_mm(DSV4_WF_BF16, 64, 4096, 1, 0, 0, 0, "few rows");
    check_mm(DSV4_WF_BF16, 512, 16384, 1, 0, 0, 0, "32K rows");
    check_mm(DSV4_WF_FP8, 2048, 16384, 2, 0, 0, 0, "FP8 16K");
    check_mm(DSV4_WF_MXFP4, 4096, 4096, 1, 0, 0, 0, "MXFP4");
    check_mm(DSV4_WF_FP8, 40, 4096, 3, 0, 0, 0, "split-K");
    cuda_check_grouped(DSV4_WF_FP8, 6, 1022, 1024, 1, 0, "grp 1022"); /* 1022 % 8: not whole tiles */
    cuda_check_grouped(DSV4_WF_FP8, 8, 1024, 4096, 7, 0, "wo_a r7");
}

/* A weight the backend has never seen is uploaded by the op that first uses it and must be
 * read complete by that op's kernel (a 1 MB F32 weight at rows 5 once read wrong values in
 * test_cuda_ops, 2 of 6 runs): fresh weights of several sizes, each used once. */
static void test_fresh_weights(void) {
    NEED_GPU();
    static const int64_t os[] = {64, 256, 1024, 4096};
    int bad = 0, runs = 0;
    for (int rep = 0; rep < 6; rep++)
        for (int i = 0; i < 4; i++) {
            char what[32];
            snprintf(what, sizeof what, "fresh %d", rep);
            bad += !check_mm(DSV4_WF_F32, os[i], 1024, 5, 0, 0, 1, what);
            runs++;
        }
    printf("  fresh weights: %d of %d calls wrong\n", bad, runs);
}

/* ----- timing (figures only) ----- */
/* Cold: every call is preceded by a 256 MB device copy (L2 is 50-60 MB), so the weights
 * come from DRAM as in a decode step; device time per op from the backend's event pair
 * (ops->profile), which brackets the op's kernels.  A ktrace run (tools/device) gives the
 * kernel times alone. */
static double wbytes(const tw *t) {
    const dsv4_weight *w = &t->w;
    double n = (double)w->rows * w->cols;
    switch (w->fmt) {
    case DSV4_WF_F32: return 4 * n;
    case DSV4_WF_BF16: return 2 * n;
    case DSV4_WF_FP8: return n + n / (128.0 * 128.0) * (w->scale_f32 ? 4 : 1);
    default: return n / 2;
    }
}

static void test_timing(void) {
    NEED_GPU();
    enum { REPS = 20 };
    size_t fb = (size_t)256 << 20;
    void *fa = gpu.ops->alloc(&gpu, fb), *fc = gpu.ops->alloc(&gpu, fb);
    REQUIRE(fa && fc);
    double copy_gbs = gpu.ops->copy_bandwidth ? gpu.ops->copy_bandwidth(&gpu, fb) : 0;
    printf("  timing: device copy %.0f GB/s (read + written)\n", copy_gbs);
    static const struct {
        dsv4_wfmt fmt;
        int64_t O, K;
        int groups;
        const char *what;
    } sh[] = {
        {DSV4_WF_FP8, 32768, 1024, 1, "wq_b"},    {DSV4_WF_FP8, 8192, 4096, 8, "wo_a grouped"},
        {DSV4_WF_FP8, 4096, 8192, 1, "wo_b"},     {DSV4_WF_FP8, 1024, 4096, 1, "wq_a"},
        {DSV4_WF_FP8, 512, 4096, 1, "wkv"},       {DSV4_WF_FP8, 8192, 1024, 1, "idx wq_b"},
        {DSV4_WF_BF16, 1024, 4096, 1, "compressor"}, {DSV4_WF_BF16, 256, 4096, 1, "gate"},
        {DSV4_WF_BF16, 64, 4096, 1, "weights_proj"},
    };
    static const int rs[] = {1, 2, 4, 8, 32};
    for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) {
        tw t = make_w(sh[i].fmt, sh[i].O, sh[i].K, 0);
        int64_t xc = sh[i].groups > 1 ? sh[i].K * sh[i].groups : sh[i].K;
        for (int j = 0; j < 5; j++) {
            int rows = rs[j];
            float *x = malloc(sizeof(float) * rows * xc), *a = malloc(sizeof(float) * rows * sh[i].O),
                  *g = malloc(sizeof(float) * rows * sh[i].O);
            float *xd = gpu.ops->alloc(&gpu, sizeof(float) * rows * xc),
                  *od = gpu.ops->alloc(&gpu, sizeof(float) * rows * sh[i].O);
            REQUIRE(x && a && g && xd && od);
            fill(x, (size_t)rows * xc, 1);
            gpu.ops->upload(&gpu, xd, x, sizeof(float) * rows * xc);
            gpu.ops->profile(&gpu, 1);
            for (int k = 0; k < REPS; k++) {
                gpu.ops->copy(&gpu, fc, fa, fb);
                if (sh[i].groups > 1) gpu.ops->matmul_grouped(&gpu, od, xd, rows, &t.w, sh[i].groups, 0, 0, 0);
                else gpu.ops->matmul(&gpu, od, xd, rows, &t.w, 0, 0);
            }
            dsv4_backend_stats st;
            gpu.ops->stats(&gpu, &st);
            gpu.ops->profile(&gpu, 0);
            int ok = gpu_ok();
            /* the timed calls are checked against the CPU op too (2e-6, as above) */
            gpu.ops->download(&gpu, g, od, sizeof(float) * rows * sh[i].O);
            if (sh[i].groups > 1) cpu.ops->matmul_grouped(&cpu, a, x, rows, &t.w, sh[i].groups, 0, 0, 0);
            else cpu.ops->matmul(&cpu, a, x, rows, &t.w, 0, 0);
            double r = rel(g, a, (size_t)rows * sh[i].O);
            int op = sh[i].groups > 1 ? 2 : 1; /* DSV4_CUDA_OP_MATMUL_GROUPED : _MATMUL */
            double us = st.calls[op] ? 1e3 * st.ms[op] / st.calls[op] : -1, gbs = wbytes(&t) / (us * 1e3);
            printf("  timing %-12s %-5s [%5lld x %4lld] rows %d: %6.2f us cold, %5.0f GB/s, %5.1f %% of copy, "
                   "rel %.1e\n",
                   sh[i].what, dsv4_wfmt_name(sh[i].fmt), (long long)sh[i].O, (long long)sh[i].K, rows, us, gbs,
                   copy_gbs > 0 ? 100.0 * gbs / copy_gbs : 0.0, r);
            CHECKF(ok && r <= 2e-6, "timed %s rows %d rel %g", sh[i].what, rows, r);
            gpu.ops->free(&gpu, xd);
            gpu.ops->free(&gpu, od);
            free(x), free(a), free(g);
        }
        free_w(&t);
    }
    gpu.ops->free(&gpu, fa);
    gpu.ops->free(&gpu, fc);
}

/* V4-Pro's decode linears (hidden 7168, q_lora 1536, 128 heads x 512, 16 groups of wo_a) at rows 1,
 * 2, 4 and 8, and at one row with linear.dot=mma (taken or declined, the answer checked): no test
 * shape elsewhere has K 1536 or wq_b's 65536 rows, wo_b's K 16384 at 7168 rows, or 16 groups */
/* ----- matmul_rn: qa's norm inside wq_b -----
 * One case: x (rows x K) normed by nw (NULL, bf16 or f32; norm_bf16 0, 1 or 1 | DSV4_NORM_BF16_STEPS) and
 * multiplied by W (O x K).  The answer must have the bits of the GPU's own rmsnorm (into a copy) then
 * matmul, and be within 2e-6 (4e-3 with bf16 rounding) of the CPU's two ops.  want: the path that must
 * run by the counters, 'f' the fused kernel, 'a' the two kernels; matmul_rn_takes must answer 1 exactly
 * where the kernel is fused. */
static void check_rn(dsv4_wfmt fmt, int64_t O, int64_t K, int rows, int sf32, dsv4_wfmt nfmt, int norm_bf16,
                     int out_bf16, int flags, char want, const char *what) {
    tw t = make_w(fmt, O, K, sf32), nw = make_w(nfmt ? nfmt : DSV4_WF_F32, 1, K, 0);
    const dsv4_weight *nwp = nfmt ? &nw.w : NULL;
    size_t nx = (size_t)rows * K, no = (size_t)rows * O;
    float *x = malloc(sizeof(float) * nx), *tn = malloc(sizeof(float) * nx);
    float *a = malloc(sizeof(float) * no), *g0 = malloc(sizeof(float) * no), *g1 = malloc(sizeof(float) * no);
    float *xd = gpu.ops->alloc(&gpu, sizeof(float) * nx), *td = gpu.ops->alloc(&gpu, sizeof(float) * nx);
    float *od = gpu.ops->alloc(&gpu, sizeof(float) * no);
    REQUIRE(x && tn && a && g0 && g1 && xd && td && od);
    fill(x, nx, 3);
    gpu.ops->upload(&gpu, xd, x, sizeof(float) * nx);
    cpu.ops->rmsnorm(&cpu, tn, x, rows, (int)K, nwp, 1e-6f, norm_bf16);
    cpu.ops->matmul(&cpu, a, tn, rows, &t.w, flags, out_bf16);
    /* the reference bits: the GPU's two ops */
    gpu.ops->rmsnorm(&gpu, td, xd, rows, (int)K, nwp, 1e-6f, norm_bf16);
    gpu.ops->matmul(&gpu, od, td, rows, &t.w, flags, out_bf16);
    gpu.ops->download(&gpu, g0, od, sizeof(float) * no);
    for (size_t i = 0; i < no; i++) g1[i] = NAN;
    gpu.ops->upload(&gpu, od, g1, sizeof(float) * no);
    long f0, a0, f1, a1;
    int takes = gpu.ops->matmul_rn_takes(&gpu, &t.w, rows, flags); /* the forward pass's question */
    dsv4_cuda_rn_counts(&gpu, &f0, &a0);
    gpu.ops->matmul_rn(&gpu, od, xd, rows, &t.w, flags, out_bf16, nwp, 1e-6f, norm_bf16);
    dsv4_cuda_rn_counts(&gpu, &f1, &a1);
    gpu.ops->download(&gpu, g1, od, sizeof(float) * no);
    int ok = gpu_ok();
    char ran = f1 > f0 ? 'f' : a1 > a0 ? 'a' : '?';
    int same = memcmp(g0, g1, sizeof(float) * no) == 0;
    double r = rel(g1, a, no), tol = out_bf16 || norm_bf16 ? 4e-3 : 2e-6;
    printf("  rn %-14s %s%s [%6lld x %5lld] rows %d norm %s/%d out_bf16 %d flags %d: ran %c (want %c), takes %d, "
           "%s the two ops' bits, rel %.2e (tol %.0e)\n", what, dsv4_wfmt_name(fmt), sf32 ? "/f32s" : "",
           (long long)O, (long long)K, rows, nfmt ? dsv4_wfmt_name(nfmt) : "none", norm_bf16, out_bf16, flags, ran,
           want, takes, same ? "with" : "NOT", r, tol);
    CHECKF(ok && same && r <= tol && ran == want && takes == (want == 'f'), "rn %s: ran %c want %c takes %d same %d "
           "rel %g", what, ran, want, takes, same, r);
    gpu.ops->free(&gpu, xd), gpu.ops->free(&gpu, td), gpu.ops->free(&gpu, od);
    free(x), free(tn), free(a), free(g0), free(g1);
    free_w(&t), free_w(&nw);
}

static void test_matmul_rn(void) {
    NEED_GPU();
    REQUIRE(gpu.ops->matmul_rn != NULL && gpu.ops->matmul_rn_takes != NULL);
    const int steps = 1 | DSV4_NORM_BF16_STEPS;
    /* Flash's wq_b: the fused kernel, each norm weight and rounding */
    check_rn(DSV4_WF_FP8, 32768, 1024, 1, 0, DSV4_WF_BF16, 0, 0, 0, 'f', "wq_b");
    check_rn(DSV4_WF_FP8, 32768, 1024, 1, 0, DSV4_WF_F32, 0, 0, 0, 'f', "wq_b f32 norm");
    check_rn(DSV4_WF_FP8, 32768, 1024, 1, 0, DSV4_WF_NONE, 0, 0, 0, 'f', "wq_b no norm w");
    check_rn(DSV4_WF_FP8, 32768, 1024, 1, 0, DSV4_WF_BF16, 1, 1, 0, 'f', "wq_b bf16");
    check_rn(DSV4_WF_FP8, 32768, 1024, 1, 0, DSV4_WF_BF16, steps, 0, 0, 'f', "wq_b steps");
    check_rn(DSV4_WF_FP8, 32768 + 32, 1024, 1, 0, DSV4_WF_BF16, 0, 0, 0, 'f', "wq_b 1025 passes");
    /* what the kernel does not take: the two kernels, the same bits */
    check_rn(DSV4_WF_FP8, 32770, 1024, 1, 0, DSV4_WF_BF16, 0, 0, 0, 'a', "rows % 4 != 0");
    check_rn(DSV4_WF_FP8, 32768, 1024, 1, 1, DSV4_WF_BF16, 0, 0, 0, 'a', "f32 scales");
    check_rn(DSV4_WF_FP8, 8192, 1024, 1, 0, DSV4_WF_BF16, 0, 0, 0, 'a', "fewer passes");
    check_rn(DSV4_WF_FP8, 32768, 1024, 1, 0, DSV4_WF_BF16, 0, 0, DSV4_LIN_ACT_FP8, 'a', "act_fp8");
    check_rn(DSV4_WF_FP8, 32768, 1024, 2, 0, DSV4_WF_BF16, 0, 0, 0, 'a', "two rows");
    check_rn(DSV4_WF_FP8, 16384, 1536, 1, 0, DSV4_WF_BF16, 0, 0, 0, 'a', "K 1536");
    check_rn(DSV4_WF_BF16, 8192, 1024, 1, 0, DSV4_WF_BF16, 0, 0, 0, 'a', "bf16 weight");
}

/* op_list_beside after a matmul_rn (DSV4_WQB_FIRST's order): y's projections (a matmul_multi of x and a
 * second output z), wq_b (matmul_rn of x, waiting), then a list: z's rmsnorm into u and a copy of z into v.
 * case 0: the list may run early (counter) and u, v and wq_b's output have the bits of the same ops in
 * order; 1: a task reads wq_b's output (into a buffer not compared; late); 2: a task writes x (late);
 * 3: the op before is not a matmul_rn (late).  Every case must give the same bits. */
static void check_beside(int mode) {
    const int64_t K = 1024, O = 32768, Z = 512;
    tw t = make_w(DSV4_WF_FP8, O, K, 0), nw = make_w(DSV4_WF_BF16, 1, K, 0), zn = make_w(DSV4_WF_BF16, 1, Z, 0);
    tw wa = make_w(DSV4_WF_FP8, K, 4096, 0), wb = make_w(DSV4_WF_FP8, Z, 4096, 0);
    float *y = malloc(sizeof(float) * 4096), *r[3], *g[3];
    size_t nb[3] = {sizeof(float) * O, sizeof(float) * Z, sizeof(float) * Z};
    for (int i = 0; i < 3; i++) r[i] = malloc(nb[i]), g[i] = malloc(nb[i]);
    float *xd = gpu.ops->alloc(&gpu, sizeof(float) * K), *zd = gpu.ops->alloc(&gpu, sizeof(float) * Z);
    float *od = gpu.ops->alloc(&gpu, nb[0]), *ud = gpu.ops->alloc(&gpu, nb[1]), *vd = gpu.ops->alloc(&gpu, nb[2]);
    float *sd = gpu.ops->alloc(&gpu, 64);
    REQUIRE(y && xd && zd && od && ud && vd && sd && r[0] && r[1] && r[2] && g[0] && g[1] && g[2]);
    fill(y, 4096, 1);
    int fl[2] = {0, 0}, ob[2] = {0, 0};
    const dsv4_weight *wl[2] = {&wa.w, &wb.w};
    float *outs[2] = {xd, zd};
    dsv4_op_task tk[2] = {{.kind = DSV4_TASK_RMSNORM, .out = ud, .in = zd, .rows = 1, .dim = (int)Z, .w = &zn.w,
                           .eps = 1e-6f},
                          {.kind = DSV4_TASK_COPY, .out = vd, .in = zd, .n = nb[2]}};
    float *dst[3] = {od, ud, vd};
    for (int pass = 0; pass < 2; pass++) { /* 0: the reference, ops in order; 1: the case */
        for (int i = 0; i < 3; i++) {
            for (size_t j = 0; j < nb[i] / sizeof(float); j++) g[i][j] = NAN;
            gpu.ops->upload(&gpu, dst[i], g[i], nb[i]);
        }
        gpu.ops->matmul_multi(&gpu, 2, outs, y, 1, wl, fl, ob);
        if (pass == 0 || mode != 3) gpu.ops->matmul_rn(&gpu, od, xd, 1, &t.w, 0, 0, &nw.w, 1e-6f, 0);
        dsv4_op_task c2[3] = {tk[0], tk[1]};
        int n2 = 2;
        if (pass == 1 && mode == 1) c2[n2++] = (dsv4_op_task){.kind = DSV4_TASK_COPY, .out = sd, .in = od, .n = 16};
        if (pass == 1 && mode == 2) c2[n2++] = (dsv4_op_task){.kind = DSV4_TASK_SCALE, .out = xd, .n = K, .s = 1.0f};
        long e0, l0, e1, l1;
        dsv4_cuda_ol_beside_counts(&gpu, &e0, &l0);
        if (pass == 0) gpu.ops->op_list(&gpu, c2, n2);
        else gpu.ops->op_list_beside(&gpu, c2, n2);
        if (pass == 1 && mode == 3) gpu.ops->matmul_rn(&gpu, od, xd, 1, &t.w, 0, 0, &nw.w, 1e-6f, 0);
        dsv4_cuda_ol_beside_counts(&gpu, &e1, &l1);
        for (int i = 0; i < 3; i++) gpu.ops->download(&gpu, pass ? g[i] : r[i], dst[i], nb[i]);
        if (pass == 1) {
            int ok = gpu_ok(), same = 1, early = e1 > e0, late = l1 > l0;
            for (int i = 0; i < 3; i++) same &= memcmp(r[i], g[i], nb[i]) == 0;
            int want = mode == 0;
            printf("  beside case %d: %s, %s the ops in order's bits\n", mode, early ? "early" : late ? "late" : "?",
                   same ? "with" : "NOT");
            CHECKF(ok && same && early == want && late == !want, "beside case %d: early %d late %d same %d", mode,
                   early, late, same);
        }
    }
    gpu.ops->free(&gpu, xd), gpu.ops->free(&gpu, zd), gpu.ops->free(&gpu, od), gpu.ops->free(&gpu, ud),
        gpu.ops->free(&gpu, vd), gpu.ops->free(&gpu, sd);
    free(y);
    for (int i = 0; i < 3; i++) free(r[i]), free(g[i]);
    free_w(&t), free_w(&nw), free_w(&zn), free_w(&wa), free_w(&wb);
}

static void test_list_beside(void) {
    NEED_GPU();
    REQUIRE(gpu.ops->op_list_beside != NULL);
    for (int mode = 0; mode < 4; mode++) check_beside(mode);
}

static void test_pro_shapes(void) {
    NEED_GPU();
    static const int rs[] = {1, 2, 4, 8};
    for (int i = 0; i < 4; i++) {
        int rows = rs[i];
        check_mm(DSV4_WF_FP8, 1536, 7168, rows, 0, 0, 0, "pro wq_a");
        check_mm(DSV4_WF_FP8, 65536, 1536, rows, 0, 0, 0, "pro wq_b");
        check_mm(DSV4_WF_FP8, 512, 7168, rows, 0, 0, 0, "pro wkv");
        check_mm(DSV4_WF_FP8, 8192, 1536, rows, 0, 1, 0, "pro ix wq_b");
        check_mm(DSV4_WF_FP8, 7168, 16384, rows, 0, 0, 0, "pro wo_b");
        check_mm(DSV4_WF_BF16, 1024, 7168, rows, 0, 0, 1, "pro cmp");
        check_mm(DSV4_WF_BF16, 256, 7168, rows, 0, 0, 1, "pro ix cmp");
        check_mm(DSV4_WF_BF16, 64, 7168, rows, 0, 0, 0, "pro w_proj");
        cuda_check_grouped(DSV4_WF_FP8, 16, 1024, 4096, rows, 0, "pro wo_a");
    }
    check_mm(DSV4_WF_BF16, 129280, 7168, 1, 0, 0, 0, "pro head");
    check_mm(DSV4_WF_BF16, 129280, 7168, 4, 0, 0, 0, "pro head");
    cuda_check_grouped(DSV4_WF_FP8, 16, 1024, 4096, 1, 1, "pro wo_a bf16");
    check_mma(0, 65536, 1536, 1, 0, 0, 0, 0, 0, -1, "pro wq_b");
    check_mma(0, 1536, 7168, 1, 0, 0, 0, 0, 0, -1, "pro wq_a");
    check_mma(0, 7168, 16384, 1, 0, 0, 0, 0, 0, -1, "pro wo_b");
    check_mma(16, 1024, 4096, 1, 0, 0, 0, 0, 0, -1, "pro wo_a");
    check_mma(16, 1024, 4096, 1, 0, 1, 1, 0, 0, -1, "pro wo_a bf16");
}

TEST_MAIN(test_stream_shapes, test_pro_shapes, test_gemv8, test_matmul_rn, test_list_beside, test_gemv_mma,
          test_fused_input, test_batched, test_other_shapes, test_fresh_weights, test_timing)
