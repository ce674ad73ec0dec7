/* tests/test_cuda_mhc: the CUDA mHC ops (src/backend/cuda/mhc.cu) against the CPU ops.
 *
 * hc_pre, hc_post and hc_head at rows 1, 3 and 4 (the one-launch decode path) and 8 and 40
 * (part + fin), hc 4 at dim 4096 (V4-Flash) and at dim 50 (element-wise tails: dim % 4 != 0),
 * hc 2 at dim 64 (eight Sinkhorn matrices per warp, y for any hc) and hc 6 at dim 49 (the
 * shared-memory Sinkhorn; K = 294 is not a multiple of 4: every element-wise path) and hc 4
 * at dim 64 (k_hc_dec in one block), hc 4 at V4-Pro's dim 7168 (test_pro_hc4: k_hc_dec on 112
 * blocks, hc_pre_norm, hc_post_pre_norm, the norms of 7168 and 1536), each with the numerics flags off (exact) and on
 * (reference: gemm_bf16, out_bf16, state_bf16).  Tolerances, rel = ||gpu - cpu|| / ||cpu||:
 *   hc_pre y, post, comb and hc_head y: 1e-5 in fp32 (the mix dot products and the sum of
 *     squares are summed in another order, and expf differs by an ulp; Sinkhorn itself is the
 *     CPU's arithmetic); y rounded to bf16: 4e-3 (an order difference can flip one bf16 ulp);
 *   hc_post: 1e-6 in fp32 (fma contraction only), 4e-3 rounded to bf16.
 * Also: a second call gives the same bits (no atomics in the sums; the decode path's done
 * counter is back to 0 after each launch), device buffers give the same bits as host ones,
 * and a CUDA-graph capture (ops->segment) of the decode path gives the same bits as eager, also
 * when decode calls alternate between inputs, row counts and hc_pre / hc_head (k_hc_dec's
 * tagged partials: a launch must never take the previous launch's).
 * Each case prints an FNV-1a hash of the GPU's output bits, so two builds of mhc.cu can be
 * compared on the device (same inputs: the generator is seeded).
 * Also rmsnorm (src/backend/cuda/norm.cu) at every Flash norm shape, in and out of place, and
 * hc_pre_norm (y normed inside hc_pre's kernels), which must give the bits of hc_pre then
 * rmsnorm on every path (k_hc_dec, k_hc_fused, part + fin, and the two ops where it cannot),
 * and hc_post_pre_norm (hc_post inside k_hc_dec), which must give the bits of hc_post then
 * hc_pre_norm, alone and in a chain like the forward pass's, eager and in graphs.
 * DSV4_MHC_BENCH=2 runs decode-shape kernel phases for tools/device/ktrace.c (test_zy_phases;
 * hc_pre, hc_pre_norm at 20 and 0 Sinkhorn iterations, hc_head, hc_post, rmsnorm, rope).
 * DSV4_MHC_BENCH=1 adds a timing: 200 back-to-back calls at V4-Flash's shapes (hc 4, dim
 * 4096, fn f32 [24][16384], 20 Sinkhorn iterations) on device buffers, eager (host clock
 * around the calls and one ops->check) and inside one CUDA graph (device time between the
 * events around the graph launch, ops->stats' graph_gpu_s); fn stays in L2 between calls.
 * Without a device the binary prints SKIP. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CUDA_TEST_SEED 4242
#define CUDA_TEST_NAME "test_cuda_mhc"
#include "backend/cuda/cuda.h"
#include "cuda_test_util.h"

static uint32_t fnv(uint32_t h, const float *x, size_t n) {
    const uint8_t *p = (const uint8_t *)x;
    for (size_t i = 0; i < n * sizeof(float); i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

/* the weights of one hc_pre / hc_head shape: fn [nm][hc*dim] scaled so the mixes stay O(1)
 * (sigmoid, softmax and Sinkhorn away from saturation), base, scale; all heap, parked at exit
 * (the backend keys device copies by host pointer) */
typedef struct {
    tw fn, hfn;
    float *base, *sc;
    dsv4_weight wb, ws, hb, hs;
} hc_w;

static hc_w make_hc(int hc, int dim) {
    hc_w w;
    int nm = (2 + hc) * hc;
    int64_t K = (int64_t)hc * dim;
    w.fn = make_w(DSV4_WF_F32, nm, K, 0);
    w.hfn = make_w(DSV4_WF_F32, hc, K, 0);
    float s = 4.0f / sqrtf((float)K);
    for (int64_t i = 0; i < nm * K; i++) ((float *)w.fn.data)[i] *= s;
    for (int64_t i = 0; i < hc * K; i++) ((float *)w.hfn.data)[i] *= s;
    w.base = malloc(sizeof(float) * nm);
    w.sc = malloc(sizeof(float) * 3);
    fill(w.base, nm, 1);
    w.sc[0] = 0.7f, w.sc[1] = 1.1f, w.sc[2] = 0.9f;
    w.wb = (dsv4_weight){.fmt = DSV4_WF_F32, .rows = 1, .cols = nm, .data = w.base, .name = "base"};
    w.ws = (dsv4_weight){.fmt = DSV4_WF_F32, .rows = 1, .cols = 3, .data = w.sc, .name = "scale"};
    w.hb = (dsv4_weight){.fmt = DSV4_WF_F32, .rows = 1, .cols = hc, .data = w.base + 1, .name = "head base"};
    w.hs = (dsv4_weight){.fmt = DSV4_WF_F32, .rows = 1, .cols = 1, .data = w.sc + 1, .name = "head scale"};
    return w;
}

static void park_hc(hc_w *w) {
    free_w(&w->fn);
    free_w(&w->hfn);
    tw small = {.data = w->base, .scale = w->sc};
    free_w(&small);
}

static void check_case(int rows, int hc, int dim, int bf) {
    hc_w w = make_hc(hc, dim);
    size_t nx = (size_t)rows * hc * dim, ny = (size_t)rows * dim, np = (size_t)rows * hc, nc = np * hc;
    float *X = malloc(sizeof(float) * nx), *ya = malloc(sizeof(float) * ny), *yg = malloc(sizeof(float) * ny),
          *y2 = malloc(sizeof(float) * ny), *pa = malloc(sizeof(float) * np), *pg = malloc(sizeof(float) * np),
          *p2 = malloc(sizeof(float) * np), *ca = malloc(sizeof(float) * nc), *cg = malloc(sizeof(float) * nc),
          *c2 = malloc(sizeof(float) * nc), *o = malloc(sizeof(float) * ny), *Xa = malloc(sizeof(float) * nx),
          *Xg = malloc(sizeof(float) * nx);
    fill(X, nx, 2);
    fill(o, ny, 1);
    cpu.ops->hc_pre(&cpu, ya, pa, ca, X, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, bf, bf);
    gpu.ops->hc_pre(&gpu, yg, pg, cg, X, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, bf, bf);
    CHECK(gpu_ok());
    double ry = rel(yg, ya, ny), rp = rel(pg, pa, np), rc = rel(cg, ca, nc);
    uint32_t h = fnv(fnv(fnv(2166136261u, yg, ny), pg, np), cg, nc);
    CHECKF(ry <= (bf ? 4e-3 : 1e-5) && rp <= 1e-5 && rc <= 1e-5, "hc_pre rows %d hc %d dim %d bf16 %d", rows, hc,
           dim, bf);
    gpu.ops->hc_pre(&gpu, y2, p2, c2, X, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, bf, bf);
    CHECK(gpu_ok());
    CHECKF(!memcmp(y2, yg, sizeof(float) * ny) && !memcmp(p2, pg, sizeof(float) * np) &&
               !memcmp(c2, cg, sizeof(float) * nc),
           "hc_pre rows %d hc %d: a second call differs", rows, hc);
    /* hc_post on the CPU's post/comb, so only hc_post's own arithmetic is compared */
    cpu.ops->hc_post(&cpu, Xa, o, X, pa, ca, rows, hc, dim, bf);
    gpu.ops->hc_post(&gpu, Xg, o, X, pa, ca, rows, hc, dim, bf);
    CHECK(gpu_ok());
    double rx = rel(Xg, Xa, nx);
    uint32_t hx = fnv(2166136261u, Xg, nx);
    CHECKF(rx <= (bf ? 4e-3 : 1e-6), "hc_post rows %d hc %d dim %d bf16 %d", rows, hc, dim, bf);
    cpu.ops->hc_head(&cpu, ya, X, rows, hc, dim, &w.hfn.w, &w.hb, &w.hs, 1e-6f, 1e-6f, bf, bf);
    gpu.ops->hc_head(&gpu, yg, X, rows, hc, dim, &w.hfn.w, &w.hb, &w.hs, 1e-6f, 1e-6f, bf, bf);
    CHECK(gpu_ok());
    double rh = rel(yg, ya, ny);
    uint32_t hh = fnv(2166136261u, yg, ny);
    CHECKF(rh <= (bf ? 4e-3 : 1e-5), "hc_head rows %d hc %d dim %d bf16 %d", rows, hc, dim, bf);
    printf("  rows %2d hc %d dim %4d bf16 %d: pre y %.2e post %.2e comb %.2e | post %.2e | head %.2e"
           "  bits %08x %08x %08x\n",
           rows, hc, dim, bf, ry, rp, rc, rx, rh, h, hx, hh);
    free(X), free(ya), free(yg), free(y2), free(pa), free(pg), free(p2), free(ca), free(cg), free(c2), free(o);
    free(Xa), free(Xg);
    park_hc(&w);
}

static void test_flash_hc4(void) {
    NEED_GPU();
    int rows[] = {1, 3, 4, 8, 40};
    for (int bf = 0; bf < 2; bf++)
        for (int i = 0; i < 5; i++) check_case(rows[i], 4, 4096, bf);
}

static void test_small_dims(void) {
    NEED_GPU();
    int rows[] = {1, 3, 8, 40};
    for (int bf = 0; bf < 2; bf++)
        for (int i = 0; i < 4; i++) {
            check_case(rows[i], 4, 50, bf);
            check_case(rows[i], 2, 64, bf);
            check_case(rows[i], 6, 49, bf);
            check_case(rows[i], 4, 64, bf); /* K = 256: the decode kernel in one block */
        }
}

/* device buffers and a captured graph give the bits of the host-pointer path */
static void check_device_graph(int rows, int hc, int dim) {
    hc_w w = make_hc(hc, dim);
    size_t nx = (size_t)rows * hc * dim, ny = (size_t)rows * dim, np = (size_t)rows * hc, nc = np * hc;
    float *X = malloc(sizeof(float) * nx), *yh = malloc(sizeof(float) * ny), *ph = malloc(sizeof(float) * np),
          *ch = malloc(sizeof(float) * nc), *y = malloc(sizeof(float) * ny), *p = malloc(sizeof(float) * np),
          *c = malloc(sizeof(float) * nc);
    fill(X, nx, 2);
    gpu.ops->hc_pre(&gpu, yh, ph, ch, X, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, 0, 0);
    float *xd = gpu.ops->alloc(&gpu, sizeof(float) * nx), *yd = gpu.ops->alloc(&gpu, sizeof(float) * ny),
          *pd = gpu.ops->alloc(&gpu, sizeof(float) * np), *cd = gpu.ops->alloc(&gpu, sizeof(float) * nc);
    REQUIRE(xd && yd && pd && cd);
    gpu.ops->upload(&gpu, xd, X, sizeof(float) * nx);
    for (int pass = 0; pass < 3; pass++) { /* eager, a new graph, an updated graph */
        if (pass) gpu.ops->segment(&gpu, 0);
        gpu.ops->hc_pre(&gpu, yd, pd, cd, xd, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, 0, 0);
        gpu.ops->hc_pre(&gpu, yd, pd, cd, xd, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, 0, 0);
        if (pass) gpu.ops->segment(&gpu, -1);
        gpu.ops->download(&gpu, y, yd, sizeof(float) * ny);
        gpu.ops->download(&gpu, p, pd, sizeof(float) * np);
        gpu.ops->download(&gpu, c, cd, sizeof(float) * nc);
        CHECK(gpu_ok());
        CHECKF(!memcmp(y, yh, sizeof(float) * ny) && !memcmp(p, ph, sizeof(float) * np) &&
                   !memcmp(c, ch, sizeof(float) * nc),
               "rows %d hc %d dim %d pass %d: device buffers differ from the host path", rows, hc, dim, pass);
    }
    dsv4_backend_stats st;
    memset(&st, 0, sizeof st);
    gpu.ops->stats(&gpu, &st);
    printf("  device buffers + graphs rows %d hc %d dim %d: same bits (graph launches so far %ld)\n", rows, hc, dim,
           st.graph_launches);
    gpu.ops->free(&gpu, xd), gpu.ops->free(&gpu, yd), gpu.ops->free(&gpu, pd), gpu.ops->free(&gpu, cd);
    free(X), free(yh), free(ph), free(ch), free(y), free(p), free(c);
    park_hc(&w);
}

static void test_device_and_graph(void) {
    NEED_GPU();
    check_device_graph(1, 4, 4096);
    check_device_graph(3, 4, 4096);
    check_device_graph(40, 4, 4096);
    check_device_graph(1, 6, 96);
}

/* Back-to-back decode calls on alternating inputs, row counts 1 and 4 and hc_head between
 * them (another layout of the same partial words), eager and in graphs, each give the bits
 * of that input's first call: k_hc_dec's finisher must take this launch's partials, never
 * the previous launch's (which sit in the same words with other values). */
enum { ALT_N = 8 };
static void test_alternating(void) {
    NEED_GPU();
    const int hc = 4, dim = 4096, R = 4;
    hc_w w = make_hc(hc, dim);
    size_t nx = (size_t)R * hc * dim, ny = (size_t)R * dim, np = (size_t)R * hc, nc = np * hc;
    float *X = malloc(sizeof(float) * 2 * nx), *y = malloc(sizeof(float) * ny), *p = malloc(sizeof(float) * np),
          *c = malloc(sizeof(float) * nc), *h = malloc(sizeof(float) * ny),
          *ref = malloc(sizeof(float) * 4 * (ny + np + nc + ny));
    fill(X, 2 * nx, 5);
    float *xd = gpu.ops->alloc(&gpu, sizeof(float) * 2 * nx), *yd = gpu.ops->alloc(&gpu, sizeof(float) * ALT_N * ny),
          *pd = gpu.ops->alloc(&gpu, sizeof(float) * ALT_N * np),
          *cd = gpu.ops->alloc(&gpu, sizeof(float) * ALT_N * nc),
          *hd = gpu.ops->alloc(&gpu, sizeof(float) * ALT_N * ny);
    REQUIRE(X && y && p && c && h && ref && xd && yd && pd && cd && hd);
    gpu.ops->upload(&gpu, xd, X, sizeof(float) * 2 * nx);
    /* call i: input a = i & 1, rows 1 or 4 (i & 2); reference: the first call of each (a, rows), eager */
    for (int i = 0; i < 4; i++) {
        int a = i & 1, rows = i & 2 ? R : 1;
        float *r = ref + i * (ny + np + nc + ny);
        gpu.ops->hc_pre(&gpu, r, r + ny, r + ny + np, X + a * nx, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f,
                        1e-6f, 0, 0);
        gpu.ops->hc_head(&gpu, r + ny + np + nc, X + a * nx, rows, hc, dim, &w.hfn.w, &w.hb, &w.hs, 1e-6f, 1e-6f, 0,
                         0);
        CHECK(gpu_ok());
    }
    int bad = 0;
    for (int pass = 0; pass < 3; pass++) { /* eager, a new graph, an updated graph */
        if (pass) gpu.ops->segment(&gpu, 0);
        for (int i = 0; i < ALT_N; i++) {
            int a = i & 1, rows = i & 2 ? R : 1;
            gpu.ops->hc_pre(&gpu, yd + i * ny, pd + i * np, cd + i * nc, xd + a * nx, rows, hc, dim, &w.fn.w, &w.wb,
                            &w.ws, 20, 1e-6f, 1e-6f, 0, 0);
            gpu.ops->hc_head(&gpu, hd + i * ny, xd + a * nx, rows, hc, dim, &w.hfn.w, &w.hb, &w.hs, 1e-6f, 1e-6f, 0,
                             0);
        }
        if (pass) gpu.ops->segment(&gpu, -1);
        for (int i = 0; i < ALT_N; i++) {
            int rows = i & 2 ? R : 1;
            const float *r = ref + (i & 3) * (ny + np + nc + ny);
            gpu.ops->download(&gpu, y, yd + i * ny, sizeof(float) * rows * dim);
            gpu.ops->download(&gpu, p, pd + i * np, sizeof(float) * rows * hc);
            gpu.ops->download(&gpu, c, cd + i * nc, sizeof(float) * rows * hc * hc);
            gpu.ops->download(&gpu, h, hd + i * ny, sizeof(float) * rows * dim);
            CHECK(gpu_ok());
            bad += memcmp(y, r, sizeof(float) * rows * dim) || memcmp(p, r + ny, sizeof(float) * rows * hc) ||
                   memcmp(c, r + ny + np, sizeof(float) * rows * hc * hc) ||
                   memcmp(h, r + ny + np + nc, sizeof(float) * rows * dim);
        }
    }
    printf("  alternating inputs, rows 1 / 4, hc_pre + hc_head, eager and graphs: %d of %d calls differ\n", bad,
           3 * ALT_N);
    CHECKF(bad == 0, "alternating decode calls: %d differ from their input's first call", bad);
    gpu.ops->free(&gpu, xd), gpu.ops->free(&gpu, yd), gpu.ops->free(&gpu, pd), gpu.ops->free(&gpu, cd);
    gpu.ops->free(&gpu, hd);
    free(X), free(y), free(p), free(c), free(h), free(ref);
    park_hc(&w);
}

/* ----- timing (DSV4_MHC_BENCH=1) ----- */
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

enum { BENCH_N = 200 };

typedef struct {
    hc_w *w;
    float *xd, *yd, *pd, *cd, *od;
    int rows, bf, op; /* op 0 hc_pre, 1 hc_post, 2 hc_head */
} bench_args;

static void bench_call(const bench_args *a) {
    const int hc = 4, dim = 4096;
    if (a->op == 0)
        gpu.ops->hc_pre(&gpu, a->yd, a->pd, a->cd, a->xd, a->rows, hc, dim, &a->w->fn.w, &a->w->wb, &a->w->ws, 20,
                        1e-6f, 1e-6f, a->bf, a->bf);
    else if (a->op == 1)
        gpu.ops->hc_post(&gpu, a->od, a->yd, a->xd, a->pd, a->cd, a->rows, hc, dim, a->bf);
    else
        gpu.ops->hc_head(&gpu, a->yd, a->xd, a->rows, hc, dim, &a->w->hfn.w, &a->w->hb, &a->w->hs, 1e-6f, 1e-6f,
                         a->bf, a->bf);
}

/* us per call: eager (host clock, one check at the end) and in a graph (device time) */
static void bench_one(const bench_args *a, double *eager_us, double *graph_us) {
    for (int i = 0; i < 3; i++) bench_call(a); /* uploads, scratch, counters */
    CHECK(gpu_ok());
    double t0 = now_s();
    for (int i = 0; i < BENCH_N; i++) bench_call(a);
    CHECK(gpu_ok());
    *eager_us = (now_s() - t0) / BENCH_N * 1e6;
    *graph_us = INFINITY;
    for (int k = 0; k < 3; k++) { /* the first instantiates; best of the rest */
        dsv4_backend_stats s0, s1;
        memset(&s0, 0, sizeof s0), memset(&s1, 0, sizeof s1);
        gpu.ops->stats(&gpu, &s0);
        gpu.ops->segment(&gpu, 1);
        for (int i = 0; i < BENCH_N; i++) bench_call(a);
        gpu.ops->segment(&gpu, -1);
        CHECK(gpu_ok());
        gpu.ops->stats(&gpu, &s1);
        double us = (s1.graph_gpu_s - s0.graph_gpu_s) / BENCH_N * 1e6;
        if (k > 0 && us > 0 && us < *graph_us) *graph_us = us;
    }
}

static void test_zy_bench(void) {
    const char *e = getenv("DSV4_MHC_BENCH");
    if (!e || strcmp(e, "1") != 0) SKIP_TEST("timing: DSV4_MHC_BENCH=1");
    NEED_GPU();
    const int hc = 4, dim = 4096, R = 40;
    hc_w w = make_hc(hc, dim);
    size_t nx = (size_t)R * hc * dim;
    float *X = malloc(sizeof(float) * nx);
    fill(X, nx, 2);
    bench_args a = {.w = &w};
    a.xd = gpu.ops->alloc(&gpu, sizeof(float) * nx);
    a.od = gpu.ops->alloc(&gpu, sizeof(float) * nx);
    a.yd = gpu.ops->alloc(&gpu, sizeof(float) * R * dim);
    a.pd = gpu.ops->alloc(&gpu, sizeof(float) * R * hc);
    a.cd = gpu.ops->alloc(&gpu, sizeof(float) * R * hc * hc);
    REQUIRE(a.xd && a.od && a.yd && a.pd && a.cd);
    gpu.ops->upload(&gpu, a.xd, X, sizeof(float) * nx);
    /* post/comb inputs of hc_post: one eager hc_pre of all rows */
    gpu.ops->hc_pre(&gpu, a.yd, a.pd, a.cd, a.xd, R, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, 0, 0);
    CHECK(gpu_ok());
    static const char *names[] = {"hc_pre", "hc_post", "hc_head"};
    int rows[] = {1, 4, 8, 40};
    for (int op = 0; op < 3; op++)
        for (int i = 0; i < 4; i++)
            for (int bf = 0; bf < 2; bf++) {
                if (op > 0 && (rows[i] == 4 || rows[i] == 8)) continue;
                a.op = op, a.rows = rows[i], a.bf = bf;
                double eu, gu;
                bench_one(&a, &eu, &gu);
                printf("  BENCH %-7s rows %2d hc 4 dim 4096 bf16 %d: %.2f us/call eager, %.2f us/call in a graph\n",
                       names[op], rows[i], bf, eu, gu);
            }
    gpu.ops->free(&gpu, a.xd), gpu.ops->free(&gpu, a.od), gpu.ops->free(&gpu, a.yd);
    gpu.ops->free(&gpu, a.pd), gpu.ops->free(&gpu, a.cd);
    free(X);
    park_hc(&w);
}

/* ----- rmsnorm at V4-Flash's decode shapes (src/backend/cuda/norm.cu) -----
 * attn_norm / ffn_norm (4096), q_norm (1024), kv_norm (512) with bf16 and f32 weights, the
 * per-head unweighted norm (64 x 512), 1 and 3 rows, out of place and in place (the
 * forward pass normalizes y in place).  Tolerance as test_cuda_ops' norm test, 1e-6 in fp32
 * (the sum of squares is summed in another order), up to dim 1024; 2e-6 above, because the
 * CPU's serial fp32 sum of 4096 squares carries its own rounding error: the kernel before
 * this version measured 1.04e-6 on the 1-row f32-weight case (H200), the 1024-thread one
 * the same there and 1.04e-6 on 3 rows with bf16 weights.  4e-3 rounded to bf16. */
static void check_rmsnorm(int rows, int dim, int fmt, int bf) {
    size_t n = (size_t)rows * dim;
    float *x = malloc(sizeof(float) * n), *a = malloc(sizeof(float) * n), *g = malloc(sizeof(float) * n);
    tw w;
    memset(&w, 0, sizeof w);
    if (fmt >= 0) w = make_w((dsv4_wfmt)fmt, 1, dim, 0);
    const dsv4_weight *wp = fmt < 0 ? NULL : &w.w;
    fill(x, n, 3);
    cpu.ops->rmsnorm(&cpu, a, x, rows, dim, wp, 1e-6f, bf);
    gpu.ops->rmsnorm(&gpu, g, x, rows, dim, wp, 1e-6f, bf);
    CHECK(gpu_ok());
    double r = rel(g, a, n);
    gpu.ops->rmsnorm(&gpu, x, x, rows, dim, wp, 1e-6f, bf); /* in place */
    CHECK(gpu_ok());
    double ri = rel(x, a, n);
    printf("  rmsnorm rows %d dim %4d w %-4s bf16 %d: rel %.2e, in place %.2e\n", rows, dim,
           fmt < 0 ? "none" : fmt == DSV4_WF_BF16 ? "bf16" : "f32", bf, r, ri);
    double tol = bf ? 4e-3 : dim > 1024 ? 2e-6 : 1e-6;
    CHECKF(r <= tol && ri <= tol, "rmsnorm rows %d dim %d fmt %d bf16 %d", rows, dim, fmt, bf);
    free(x), free(a), free(g);
    if (fmt >= 0) free_w(&w);
}

static void test_rmsnorm_flash(void) {
    NEED_GPU();
    int dims[] = {4096, 1024, 512};
    for (int bf = 0; bf < 2; bf++)
        for (int rows = 1; rows <= 3; rows += 2) {
            for (int i = 0; i < 3; i++) {
                check_rmsnorm(rows, dims[i], DSV4_WF_BF16, bf);
                check_rmsnorm(rows, dims[i], DSV4_WF_F32, bf);
            }
            check_rmsnorm(rows * 64, 64, -1, bf);
            check_rmsnorm(rows, 2048, DSV4_WF_BF16, bf);
            check_rmsnorm(rows, 96, DSV4_WF_BF16, bf); /* not a multiple of 128: the scalar kernel */
        }
}

/* y's norm weight of format wfmt (< 0: none, NULL) in *nw */
static const dsv4_weight *norm_weight(tw *nw, int wfmt, int dim) {
    memset(nw, 0, sizeof *nw);
    if (wfmt < 0) return NULL;
    *nw = make_w((dsv4_wfmt)wfmt, 1, dim, 0);
    return &nw->w;
}

/* hc_pre_norm (y normed inside hc_pre's kernel) against hc_pre then rmsnorm on the GPU:
 * the same bits for y, post and comb, on host and device buffers; y within hc_pre's
 * tolerance of the CPU's pair (1e-5 fp32, 4e-3 rounded to bf16).  wfmt < 0: unweighted. */
static void check_pre_norm(int rows, int hc, int dim, int wfmt, int bf) {
    hc_w w = make_hc(hc, dim);
    tw nw;
    const dsv4_weight *np_ = norm_weight(&nw, wfmt, dim);
    size_t nx = (size_t)rows * hc * dim, ny = (size_t)rows * dim, np = (size_t)rows * hc, nc = np * hc;
    size_t nout = ny + np + nc;
    float *X = malloc(sizeof(float) * nx), *ref = malloc(sizeof(float) * nout), *a = malloc(sizeof(float) * nout),
          *b = malloc(sizeof(float) * nout), *c = malloc(sizeof(float) * nout);
    fill(X, nx, 2);
    /* y, post, comb of each run side by side in one buffer */
    cpu.ops->hc_pre_norm(&cpu, ref, ref + ny, ref + ny + np, X, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f,
                         1e-6f, bf, bf, np_, 1e-6f);
    gpu.ops->hc_pre(&gpu, a, a + ny, a + ny + np, X, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, bf, bf);
    gpu.ops->rmsnorm(&gpu, a, a, rows, dim, np_, 1e-6f, bf);
    gpu.ops->hc_pre_norm(&gpu, b, b + ny, b + ny + np, X, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, bf,
                         bf, np_, 1e-6f);
    float *xd = gpu.ops->alloc(&gpu, sizeof(float) * nx), *od = gpu.ops->alloc(&gpu, sizeof(float) * nout);
    REQUIRE(xd && od);
    gpu.ops->upload(&gpu, xd, X, sizeof(float) * nx);
    gpu.ops->hc_pre_norm(&gpu, od, od + ny, od + ny + np, xd, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f,
                         bf, bf, np_, 1e-6f);
    gpu.ops->download(&gpu, c, od, sizeof(float) * nout);
    CHECK(gpu_ok());
    double r = rel(b, ref, ny);
    int same = !memcmp(a, b, sizeof(float) * nout), same_d = !memcmp(a, c, sizeof(float) * nout);
    printf("  hc_pre_norm rows %2d hc %d dim %4d w %2d bf16 %d: y rel %.2e, fused %s, device %s\n", rows, hc, dim,
           wfmt, bf, r, same ? "same bits" : "DIFFERS", same_d ? "same bits" : "DIFFERS");
    CHECKF(same && same_d && r <= (bf ? 4e-3 : 1e-5), "hc_pre_norm rows %d hc %d dim %d w %d bf16 %d", rows, hc, dim,
           wfmt, bf);
    if (!same)
        for (size_t i = 0, shown = 0; i < nout && shown < 4; i++)
            if (memcmp(a + i, b + i, sizeof(float)))
                printf("    [%zu] two ops %.9g fused %.9g\n", i, a[i], b[i]), shown++;
    gpu.ops->free(&gpu, xd), gpu.ops->free(&gpu, od);
    free(X), free(ref), free(a), free(b), free(c);
    if (wfmt >= 0) free_w(&nw);
    park_hc(&w);
}

static void test_pre_norm_fused(void) {
    NEED_GPU();
    for (int bf = 0; bf < 2; bf++) {
        int rows[] = {1, 2, 3, 4, 8, 40}; /* k_hc_dec (4: y in several rounds), part + fin */
        for (int i = 0; i < 6; i++) check_pre_norm(rows[i], 4, 4096, DSV4_WF_BF16, bf);
        check_pre_norm(1, 4, 4096, DSV4_WF_F32, bf);
        check_pre_norm(3, 4, 4096, -1, bf);
        check_pre_norm(2, 4, 4096, DSV4_WF_FP8, bf); /* no vector weight loads: element-wise */
        check_pre_norm(1, 4, 512, DSV4_WF_BF16, bf);  /* k_hc_dec, 4 runs of 32 float4s */
        check_pre_norm(5, 4, 512, DSV4_WF_BF16, bf);
        check_pre_norm(1, 2, 256, DSV4_WF_BF16, bf);  /* k_hc_fused */
        check_pre_norm(3, 2, 256, -1, bf);
        check_pre_norm(2, 6, 128, DSV4_WF_F32, bf);   /* shared-memory Sinkhorn */
        check_pre_norm(9, 6, 128, DSV4_WF_BF16, bf);
        check_pre_norm(2, 4, 64, DSV4_WF_BF16, bf);   /* dim % 128 != 0: hc_pre, then rmsnorm */
        check_pre_norm(40, 4, 8192, DSV4_WF_BF16, bf); /* dim > 4096: likewise */
    }
}

/* ----- hc_post_pre_norm: hc_post, then the next hc_pre_norm on its output -----
 * Against the two ops on the GPU (hc_post, then hc_pre_norm): the same bits for Xout, y, post
 * and comb, on device buffers (one k_hc_dec launch where it takes the call) and host ones (the
 * two ops); which path ran is read from the op profile (fused: no hc_post call).  Against the
 * CPU, each half alone: Xout within hc_post's tolerance of the CPU's hc_post (1e-6 fp32, 4e-3
 * with the bf16 state), and y / post / comb within hc_pre's tolerance (1e-5, y 4e-3 in bf16)
 * of the CPU's hc_pre_norm on the GPU's Xout.  post_in / comb_in come from the CPU's hc_pre of
 * R (Sinkhorn-normalized, as in the forward pass).  wfmt < 0: unweighted norm. */
static long op_calls(const char *name) {
    dsv4_backend_stats st;
    memset(&st, 0, sizeof st);
    gpu.ops->stats(&gpu, &st);
    for (int i = 0; i < st.n_ops; i++)
        if (!strcmp(st.op[i], name)) return st.calls[i];
    return -1;
}

static void check_post_pre(int rows, int hc, int dim, int wfmt, int bf, int want_fused) {
    hc_w w = make_hc(hc, dim);
    tw nw;
    const dsv4_weight *np_ = norm_weight(&nw, wfmt, dim);
    size_t nx = (size_t)rows * hc * dim, ny = (size_t)rows * dim, np = (size_t)rows * hc, nc = np * hc;
    size_t nout = nx + ny + np + nc; /* Xout, y, post, comb side by side */
    float *R = malloc(sizeof(float) * nx), *o = malloc(sizeof(float) * ny), *y0 = malloc(sizeof(float) * ny),
          *pin = malloc(sizeof(float) * np), *cin = malloc(sizeof(float) * nc), *two = malloc(sizeof(float) * nout),
          *fd = malloc(sizeof(float) * nout), *fh = malloc(sizeof(float) * nout),
          *ref = malloc(sizeof(float) * nout);
    REQUIRE(R && o && y0 && pin && cin && two && fd && fh && ref);
    fill(R, nx, 2);
    fill(o, ny, 1);
    cpu.ops->hc_pre(&cpu, y0, pin, cin, R, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, bf, bf);
    float *Rd = gpu.ops->alloc(&gpu, sizeof(float) * nx), *od = gpu.ops->alloc(&gpu, sizeof(float) * ny),
          *pind = gpu.ops->alloc(&gpu, sizeof(float) * np), *cind = gpu.ops->alloc(&gpu, sizeof(float) * nc),
          *outd = gpu.ops->alloc(&gpu, sizeof(float) * nout), *twod = gpu.ops->alloc(&gpu, sizeof(float) * nout);
    REQUIRE(Rd && od && pind && cind && outd && twod);
    gpu.ops->upload(&gpu, Rd, R, sizeof(float) * nx);
    gpu.ops->upload(&gpu, od, o, sizeof(float) * ny);
    gpu.ops->upload(&gpu, pind, pin, sizeof(float) * np);
    gpu.ops->upload(&gpu, cind, cin, sizeof(float) * nc);
    /* the two ops on device buffers */
    float *X2 = twod, *y2 = twod + nx, *p2 = y2 + ny, *c2 = p2 + np;
    gpu.ops->hc_post(&gpu, X2, od, Rd, pind, cind, rows, hc, dim, bf);
    gpu.ops->hc_pre_norm(&gpu, y2, p2, c2, X2, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, bf, bf, np_,
                         1e-6f);
    /* fused, device buffers, under the op profile (which path ran) */
    float *Xf = outd, *yf = outd + nx, *pf = yf + ny, *cf = pf + np;
    CHECK(gpu_ok());
    gpu.ops->profile(&gpu, 1);
    gpu.ops->hc_post_pre_norm(&gpu, Xf, od, Rd, pind, cind, bf, yf, pf, cf, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20,
                              1e-6f, 1e-6f, bf, bf, np_, 1e-6f);
    long posts = op_calls("hc_post");
    gpu.ops->profile(&gpu, 0);
    gpu.ops->download(&gpu, two, twod, sizeof(float) * nout);
    gpu.ops->download(&gpu, fd, outd, sizeof(float) * nout);
    /* fused, host buffers (the two ops inside) */
    gpu.ops->hc_post_pre_norm(&gpu, fh, o, R, pin, cin, bf, fh + nx, fh + nx + ny, fh + nx + ny + np, rows, hc, dim,
                              &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, bf, bf, np_, 1e-6f);
    CHECK(gpu_ok());
    /* the CPU, each half alone */
    cpu.ops->hc_post(&cpu, ref, o, R, pin, cin, rows, hc, dim, bf);
    double rx = rel(fd, ref, nx);
    cpu.ops->hc_pre_norm(&cpu, ref + nx, ref + nx + ny, ref + nx + ny + np, fd, rows, hc, dim, &w.fn.w, &w.wb, &w.ws,
                         20, 1e-6f, 1e-6f, bf, bf, np_, 1e-6f);
    double ry = rel(fd + nx, ref + nx, ny), rp = rel(fd + nx + ny, ref + nx + ny, np),
           rc = rel(fd + nx + ny + np, ref + nx + ny + np, nc);
    int same = !memcmp(fd, two, sizeof(float) * nout), same_h = !memcmp(fh, two, sizeof(float) * nout);
    int fused = posts == 0;
    printf("  hc_post_pre_norm rows %d hc %d dim %4d w %2d bf16 %d: %s, %s, host %s | Xout %.2e y %.2e post %.2e "
           "comb %.2e  bits %08x\n",
           rows, hc, dim, wfmt, bf, fused ? "fused" : "two ops", same ? "same bits" : "DIFFERS",
           same_h ? "same bits" : "DIFFERS", rx, ry, rp, rc, fnv(2166136261u, fd, nout));
    CHECKF(same && same_h, "hc_post_pre_norm rows %d hc %d dim %d w %d bf16 %d: bits differ from the two ops", rows,
           hc, dim, wfmt, bf);
    CHECKF(fused == want_fused, "hc_post_pre_norm rows %d hc %d dim %d: %s, expected %s (hc_post calls %ld)", rows, hc,
           dim, fused ? "fused" : "two ops", want_fused ? "fused" : "two ops", posts);
    CHECKF(rx <= (bf ? 4e-3 : 1e-6) && ry <= (bf ? 4e-3 : 1e-5) && rp <= 1e-5 && rc <= 1e-5,
           "hc_post_pre_norm rows %d hc %d dim %d w %d bf16 %d against the CPU", rows, hc, dim, wfmt, bf);
    if (!same)
        for (size_t i = 0, shown = 0; i < nout && shown < 4; i++)
            if (memcmp(fd + i, two + i, sizeof(float)))
                printf("    [%zu] two ops %.9g fused %.9g\n", i, two[i], fd[i]), shown++;
    gpu.ops->free(&gpu, Rd), gpu.ops->free(&gpu, od), gpu.ops->free(&gpu, pind), gpu.ops->free(&gpu, cind);
    gpu.ops->free(&gpu, outd), gpu.ops->free(&gpu, twod);
    free(R), free(o), free(y0), free(pin), free(cin), free(two), free(fd), free(fh), free(ref);
    if (wfmt >= 0) free_w(&nw);
    park_hc(&w);
}

static void test_post_pre_fused(void) {
    NEED_GPU();
    for (int bf = 0; bf < 2; bf++) {
        for (int rows = 1; rows <= 4; rows++) check_post_pre(rows, 4, 4096, DSV4_WF_BF16, bf, 1); /* V4-Flash */
        check_post_pre(1, 4, 4096, DSV4_WF_F32, bf, 1);
        check_post_pre(3, 4, 4096, -1, bf, 1);
        check_post_pre(2, 4, 4096, DSV4_WF_FP8, bf, 1); /* element-wise norm weights */
        check_post_pre(2, 4, 384, DSV4_WF_BF16, bf, 1);  /* blocks of 256 columns straddle two streams */
        check_post_pre(4, 4, 512, DSV4_WF_BF16, bf, 1);  /* 8 blocks; y in runs of 32 float4s */
        check_post_pre(1, 4, 192, DSV4_WF_BF16, bf, 1);  /* dim % 128 != 0: the fused kernel, then rmsnorm */
        check_post_pre(3, 4, 64, DSV4_WF_BF16, bf, 1);   /* K = 256: one block */
        check_post_pre(5, 4, 4096, DSV4_WF_BF16, bf, 0); /* more rows than k_hc_dec: the two ops */
        check_post_pre(8, 4, 512, DSV4_WF_BF16, bf, 0);
        check_post_pre(2, 2, 256, DSV4_WF_BF16, bf, 0);  /* hc 2 */
        check_post_pre(3, 4, 50, DSV4_WF_BF16, bf, 0);   /* dim % 4 != 0 */
        check_post_pre(2, 6, 128, DSV4_WF_F32, bf, 0);   /* hc 6 */
    }
}

/* V4-Pro's shapes: hc 4 at dim 7168 (K 28672: k_hc_dec on 112 blocks where Flash uses 64; y's
 * norm, dim > 4096, then runs as norm.cu's own kernel), and the norms of dim 7168 and q_lora's 1536 */
static void test_pro_hc4(void) {
    NEED_GPU();
    int rows[] = {1, 3, 4, 8};
    for (int bf = 0; bf < 2; bf++) {
        for (int i = 0; i < 4; i++) check_case(rows[i], 4, 7168, bf);
        check_pre_norm(1, 4, 7168, DSV4_WF_BF16, bf);
        check_pre_norm(4, 4, 7168, DSV4_WF_BF16, bf);
        check_post_pre(1, 4, 7168, DSV4_WF_BF16, bf, 1);
        check_post_pre(4, 4, 7168, DSV4_WF_BF16, bf, 1);
        for (int r = 1; r <= 3; r += 2) {
            check_rmsnorm(r, 7168, DSV4_WF_BF16, bf);
            check_rmsnorm(r, 1536, DSV4_WF_BF16, bf);
        }
    }
}

/* A chain as the forward pass runs it (two post/comb pairs, X and Xb in turn): hc_pre_norm of
 * X, then post -> pre into Xb, X, Xb, X, with another o each time; fused against the two ops,
 * eager, in a new graph and in an updated one: the same bits for every output of the chain.
 * Then with Sinkhorn deferred (DSV4_HC_COMB_LOGITS / DSV4_HC_COMBIN_LOGITS, as forward.c's
 * DSV4_HC_DEFER=1: every comb but the last left as logits for the next call to form): with an
 * unrelated op between the calls (k_hc_dec forms comb_in before its PDL wait), in a new graph
 * and an updated one, and back to back (after the wait: its writer may still run); rows 5 takes
 * the two ops with comb_in formed by k_hc_comb_form.  Every output but the one comb left as
 * logits (cb) must have the bits of the undeferred two ops. */
static void test_post_pre_chain(void) {
    NEED_GPU();
    const int hc = 4, dim = 4096, steps = 4;
    static const int rows_of[3] = {1, 4, 5};
    float *tick = gpu.ops->alloc(&gpu, sizeof(float) * 64); /* the unrelated op's buffer */
    REQUIRE(tick);
    gpu.ops->upload(&gpu, tick, (float[64]){0}, sizeof(float) * 64);
    for (int ri = 0; ri < 3; ri++) {
        int rows = rows_of[ri];
        hc_w w = make_hc(hc, dim);
        tw nw = make_w(DSV4_WF_BF16, 1, dim, 0);
        size_t nx = (size_t)rows * hc * dim, ny = (size_t)rows * dim, np = (size_t)rows * hc, nc = np * hc;
        size_t nout = 2 * nx + ny + 2 * np + 2 * nc;
        float *X = malloc(sizeof(float) * nx), *o = malloc(sizeof(float) * steps * ny),
              *ref = malloc(sizeof(float) * nout), *got = malloc(sizeof(float) * nout);
        REQUIRE(X && o && ref && got);
        fill(X, nx, 2);
        fill(o, steps * ny, 1);
        float *buf = gpu.ops->alloc(&gpu, sizeof(float) * nout), *xin = gpu.ops->alloc(&gpu, sizeof(float) * nx),
              *od = gpu.ops->alloc(&gpu, sizeof(float) * steps * ny);
        REQUIRE(buf && xin && od);
        gpu.ops->upload(&gpu, xin, X, sizeof(float) * nx);
        gpu.ops->upload(&gpu, od, o, sizeof(float) * steps * ny);
        float *Xa = buf, *Xb = Xa + nx, *y = Xb + nx, *pa = y + ny, *pb = pa + np, *ca = pb + np, *cb = ca + nc;
        int bad = 0, bad_d = 0;
        long e0, l0, e1, l1;
        dsv4_cuda_hc_lg_counts(&gpu, &e0, &l0);
        /* 0: two ops (reference), 1: fused eager, 2: new graph, 3: updated; deferred: 4 eager with an op
         * between, 5 new graph, 6 updated, 7 eager back to back */
        for (int mode = 0; mode < 8; mode++) {
            int defer = mode >= 4, graph = mode == 2 || mode == 3 || mode == 5 || mode == 6, gap = defer && mode != 7;
            gpu.ops->copy(&gpu, Xa, xin, sizeof(float) * nx);
            if (graph) gpu.ops->segment(&gpu, defer ? 1 : 0);
            gpu.ops->hc_pre_norm(&gpu, y, pa, ca, Xa, rows, hc, dim, &w.fn.w, &w.wb, &w.ws,
                                 20 | (defer ? DSV4_HC_COMB_LOGITS : 0), 1e-6f, 1e-6f, 0, 0, &nw.w, 1e-6f);
            for (int s = 0; s < steps; s++) {
                float *R = s & 1 ? Xb : Xa, *Xo = s & 1 ? Xa : Xb, *pi = s & 1 ? pb : pa, *ci = s & 1 ? cb : ca;
                float *po = s & 1 ? pa : pb, *co = s & 1 ? ca : cb;
                if (gap) gpu.ops->scale(&gpu, tick, 64, 1.0f, 0);
                if (mode == 0) {
                    gpu.ops->hc_post(&gpu, Xo, od + s * ny, R, pi, ci, rows, hc, dim, 0);
                    gpu.ops->hc_pre_norm(&gpu, y, po, co, Xo, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f,
                                         0, 0, &nw.w, 1e-6f);
                } else {
                    int it = 20 | (defer ? DSV4_HC_COMBIN_LOGITS : 0) |
                             (defer && s + 1 < steps ? DSV4_HC_COMB_LOGITS : 0);
                    gpu.ops->hc_post_pre_norm(&gpu, Xo, od + s * ny, R, pi, ci, 0, y, po, co, rows, hc, dim, &w.fn.w,
                                              &w.wb, &w.ws, it, 1e-6f, 1e-6f, 0, 0, &nw.w, 1e-6f);
                }
            }
            if (graph) gpu.ops->segment(&gpu, -1);
            gpu.ops->download(&gpu, mode ? got : ref, buf, sizeof(float) * nout);
            CHECK(gpu_ok());
            /* deferred: cb (the last nc floats) keeps step 2's logits, which step 3 formed */
            if (mode) *(defer ? &bad_d : &bad) += memcmp(got, ref, sizeof(float) * (nout - (defer ? nc : 0))) != 0;
        }
        dsv4_cuda_hc_lg_counts(&gpu, &e1, &l1);
        /* k_hc_dec readers (rows <= 4): 3 runs x 4 steps formed comb_in early, 1 x 4 late */
        long we = rows <= 4 ? 3 * steps : 0, wl = rows <= 4 ? steps : 0;
        printf("  hc_post_pre_norm chain rows %d, %d steps: fused eager / new graph / updated graph %s the two ops' "
               "bits; Sinkhorn deferred (gap, new graph, updated, back to back) %s them (%ld formed before the wait, "
               "%ld after)\n",
               rows, steps, bad ? "DIFFER from" : "give", bad_d ? "DIFFER from" : "give", e1 - e0, l1 - l0);
        CHECKF(bad == 0, "hc_post_pre_norm chain rows %d: %d of 3 runs differ from the two ops", rows, bad);
        CHECKF(bad_d == 0, "hc_post_pre_norm chain rows %d: %d of 4 deferred runs differ from the two ops", rows,
               bad_d);
        CHECKF(e1 - e0 == we && l1 - l0 == wl, "rows %d: comb_in formed %ld times before the wait, %ld after; expected "
               "%ld, %ld", rows, e1 - e0, l1 - l0, we, wl);
        gpu.ops->free(&gpu, buf), gpu.ops->free(&gpu, xin), gpu.ops->free(&gpu, od);
        free(X), free(o), free(ref), free(got);
        free_w(&nw);
        park_hc(&w);
    }
    gpu.ops->free(&gpu, tick);
}

/* ----- kernel phases for ktrace (DSV4_MHC_BENCH=2) -----
 * Decode-shape calls in phases of PH_N, each phase opened by a 36-byte device-to-device copy
 * (the marker a trace reader cuts at; weight uploads are host-to-device, and a 4-byte one
 * exists: hc_head's scale) after 3 unmarked warm-up calls, which a reader sorts into the
 * phase before; "cold" phases copy 256 MB
 * between calls so every call's weights come from DRAM, as in a decode step.  Phase names
 * print in order.  Run under tools/device/ktrace.c to read each kernel's device time. */
enum { PH_N = 30 };
static float *ph_big_a, *ph_big_b, *ph_mark;
static const size_t PH_BIG = (size_t)256 << 20;

typedef struct {
    int op, rows, dim, fmt, iters; /* op: 0 hc_pre, 1 hc_head, 2 hc_post, 3 rmsnorm, 4 rope, 5 scale, 6 hc_pre_norm */
} ph_call;

static void ph_run(const char *name, const ph_call *c, int cold, hc_w *w, tw *nw, float *xd, float *yd, float *pd,
                   float *cd, float *od) {
    static int64_t pos[4] = {2048, 2049, 2050, 2051};
    static double freq[32];
    for (int i = 0; i < 32; i++) freq[i] = pow(10000.0, -2.0 * i / 64);
    for (int i = -3; i < PH_N; i++) {
        if (i == 0) gpu.ops->copy(&gpu, ph_mark + 32, ph_mark, 36);
        if (cold && i >= 0) gpu.ops->copy(&gpu, ph_big_a, ph_big_b, PH_BIG);
        switch (c->op) {
        case 0:
            gpu.ops->hc_pre(&gpu, yd, pd, cd, xd, c->rows, 4, 4096, &w->fn.w, &w->wb, &w->ws, c->iters, 1e-6f, 1e-6f,
                            0, 0);
            break;
        case 1: gpu.ops->hc_head(&gpu, yd, xd, c->rows, 4, 4096, &w->hfn.w, &w->hb, &w->hs, 1e-6f, 1e-6f, 0, 0); break;
        case 2: gpu.ops->hc_post(&gpu, od, yd, xd, pd, cd, c->rows, 4, 4096, 0); break;
        case 3: gpu.ops->rmsnorm(&gpu, yd, yd, c->rows, c->dim, c->fmt < 0 ? NULL : &nw->w, 1e-6f, 0); break;
        case 4: gpu.ops->rope(&gpu, yd, c->rows, 64, 512, 64, pos, freq, 0, 0); break;
        case 6:
            gpu.ops->hc_pre_norm(&gpu, yd, pd, cd, xd, c->rows, 4, 4096, &w->fn.w, &w->wb, &w->ws, c->iters, 1e-6f,
                                 1e-6f, 0, 0, &nw->w, 1e-6f);
            break;
        default: gpu.ops->scale(&gpu, yd, (size_t)c->dim, 1.0f, 0); break;
        }
    }
    CHECK(gpu_ok());
    printf("  PHASE %s\n", name);
}

static void test_zy_phases(void) {
    const char *e = getenv("DSV4_MHC_BENCH");
    if (!e || strcmp(e, "2") != 0) SKIP_TEST("kernel phases for ktrace: DSV4_MHC_BENCH=2");
    NEED_GPU();
    const int R = 4;
    hc_w w = make_hc(4, 4096);
    tw n4096 = make_w(DSV4_WF_BF16, 1, 4096, 0), n1024 = make_w(DSV4_WF_BF16, 1, 1024, 0),
       n512 = make_w(DSV4_WF_BF16, 1, 512, 0);
    size_t nx = (size_t)R * 4 * 4096;
    float *X = malloc(sizeof(float) * nx);
    fill(X, nx, 2);
    float *xd = gpu.ops->alloc(&gpu, sizeof(float) * nx), *od = gpu.ops->alloc(&gpu, sizeof(float) * nx),
          *yd = gpu.ops->alloc(&gpu, sizeof(float) * R * 64 * 512), *pd = gpu.ops->alloc(&gpu, sizeof(float) * R * 4),
          *cd = gpu.ops->alloc(&gpu, sizeof(float) * R * 16);
    ph_big_a = gpu.ops->alloc(&gpu, PH_BIG), ph_big_b = gpu.ops->alloc(&gpu, PH_BIG);
    ph_mark = gpu.ops->alloc(&gpu, 256);
    REQUIRE(xd && od && yd && pd && cd && ph_big_a && ph_big_b && ph_mark);
    gpu.ops->upload(&gpu, xd, X, sizeof(float) * nx);
    gpu.ops->upload(&gpu, yd, X, sizeof(float) * R * 4096);
    struct {
        const char *name;
        ph_call c;
        int cold;
        tw *nw;
    } ph[] = {
        {"hc_pre rows 1 cold", {0, 1, 0, 0, 20}, 1, NULL},
        {"hc_pre rows 1 warm", {0, 1, 0, 0, 20}, 0, NULL},
        {"hc_pre_norm rows 1 cold", {6, 1, 0, 0, 20}, 1, &n4096},
        {"hc_pre_norm rows 1 iters 0 cold", {6, 1, 0, 0, 0}, 1, &n4096},
        {"hc_pre rows 1 iters 0 cold", {0, 1, 0, 0, 0}, 1, NULL},
        {"hc_pre rows 4 cold", {0, 4, 0, 0, 20}, 1, NULL},
        {"hc_head rows 1 cold", {1, 1, 0, 0, 0}, 1, NULL},
        {"hc_post rows 1 warm", {2, 1, 0, 0, 0}, 0, NULL},
        {"rmsnorm 4096 bf16 cold", {3, 1, 4096, DSV4_WF_BF16, 0}, 1, &n4096},
        {"rmsnorm 4096 bf16 warm", {3, 1, 4096, DSV4_WF_BF16, 0}, 0, &n4096},
        {"rmsnorm 1024 bf16 cold", {3, 1, 1024, DSV4_WF_BF16, 0}, 1, &n1024},
        {"rmsnorm 512 bf16 cold", {3, 1, 512, DSV4_WF_BF16, 0}, 1, &n512},
        {"rmsnorm 64 x 64 heads", {3, 64, 64, -1, 0}, 0, NULL},
        {"rope 64 heads", {4, 1, 0, 0, 0}, 0, NULL},
        {"scale 1 (floor)", {5, 1, 1, 0, 0}, 0, NULL},
    };
    for (size_t i = 0; i < sizeof ph / sizeof ph[0]; i++)
        ph_run(ph[i].name, &ph[i].c, ph[i].cold, &w, ph[i].nw, xd, yd, pd, cd, od);
    gpu.ops->free(&gpu, xd), gpu.ops->free(&gpu, od), gpu.ops->free(&gpu, yd), gpu.ops->free(&gpu, pd);
    gpu.ops->free(&gpu, cd), gpu.ops->free(&gpu, ph_big_a), gpu.ops->free(&gpu, ph_big_b), gpu.ops->free(&gpu, ph_mark);
    free(X);
    free_w(&n4096), free_w(&n1024), free_w(&n512);
    park_hc(&w);
}

/* ----- k_hc_dec's y and norm formed by the blocks (DIST, the default; mhc.cu) -----
 * On two backends, DSV4_CUDA_HC_DIST=1 and =0 (block 0 alone, the finisher): hc_pre, hc_pre_norm and
 * hc_post_pre_norm on device buffers must give the same bits for every output (y, post, comb; Xout), and
 * the first take the DIST launch exactly where it applies (want: k_hc_dec, dim % 128 == 0, dim <= 4096;
 * counted by dsv4_cuda_hc_dist_count), the second never.  Then test_alternating and test_post_pre_chain
 * run on each: eager, graphs and updated graphs against their own first calls and the two ops (the other
 * tests run on the default backend, so on DIST where it applies). */
static void dist_calls(dsv4_backend *g, hc_w *w, const dsv4_weight *nwp, const float *X, const float *o,
                       const float *pin, const float *cin, int rows, int dim, int bf, float *out) {
    const int hc = 4;
    size_t nx = (size_t)rows * hc * dim, ny = (size_t)rows * dim, np = (size_t)rows * hc, nc = np * hc;
    size_t nout = 3 * (ny + np + nc) + nx; /* pre, pre_norm, post_pre_norm (y, post, comb), then Xout */
    float *xd = g->ops->alloc(g, sizeof(float) * nx), *od = g->ops->alloc(g, sizeof(float) * ny),
          *pi = g->ops->alloc(g, sizeof(float) * np), *ci = g->ops->alloc(g, sizeof(float) * nc),
          *d = g->ops->alloc(g, sizeof(float) * nout);
    REQUIRE(xd && od && pi && ci && d);
    g->ops->upload(g, xd, X, sizeof(float) * nx);
    g->ops->upload(g, od, o, sizeof(float) * ny);
    g->ops->upload(g, pi, pin, sizeof(float) * np);
    g->ops->upload(g, ci, cin, sizeof(float) * nc);
    float *a = d, *b = a + ny + np + nc, *c = b + ny + np + nc, *xo = c + ny + np + nc;
    g->ops->hc_pre(g, a, a + ny, a + ny + np, xd, rows, hc, dim, &w->fn.w, &w->wb, &w->ws, 20, 1e-6f, 1e-6f, bf, bf);
    g->ops->hc_pre_norm(g, b, b + ny, b + ny + np, xd, rows, hc, dim, &w->fn.w, &w->wb, &w->ws, 20, 1e-6f, 1e-6f, bf,
                        bf, nwp, 1e-6f);
    g->ops->hc_post_pre_norm(g, xo, od, xd, pi, ci, bf, c, c + ny, c + ny + np, rows, hc, dim, &w->fn.w, &w->wb,
                             &w->ws, 20, 1e-6f, 1e-6f, bf, bf, nwp, 1e-6f);
    g->ops->download(g, out, d, sizeof(float) * nout);
    dsv4_err err;
    CHECK(g->ops->check(g, &err) == 0);
    g->ops->free(g, xd), g->ops->free(g, od), g->ops->free(g, pi), g->ops->free(g, ci), g->ops->free(g, d);
}

static void check_dist(dsv4_backend *g0, dsv4_backend *g2, int rows, int dim, int wfmt, int bf, int want) {
    const int hc = 4;
    hc_w w = make_hc(hc, dim);
    tw nw;
    const dsv4_weight *nwp = norm_weight(&nw, wfmt, dim);
    size_t nx = (size_t)rows * hc * dim, ny = (size_t)rows * dim, np = (size_t)rows * hc, nc = np * hc;
    size_t nout = 3 * (ny + np + nc) + nx;
    float *X = malloc(sizeof(float) * nx), *o = malloc(sizeof(float) * ny), *pin = malloc(sizeof(float) * np),
          *cin = malloc(sizeof(float) * nc), *y0 = malloc(sizeof(float) * ny), *ref = malloc(sizeof(float) * nout),
          *got = malloc(sizeof(float) * nout);
    REQUIRE(X && o && pin && cin && y0 && ref && got);
    fill(X, nx, 2);
    fill(o, ny, 1);
    cpu.ops->hc_pre(&cpu, y0, pin, cin, X, rows, hc, dim, &w.fn.w, &w.wb, &w.ws, 20, 1e-6f, 1e-6f, bf, bf);
    long f0 = dsv4_cuda_hc_dist_count(g0);
    dist_calls(g0, &w, nwp, X, o, pin, cin, rows, dim, bf, ref);
    CHECKF(dsv4_cuda_hc_dist_count(g0) == f0, "DSV4_CUDA_HC_DIST=0 rows %d dim %d: took the DIST launch", rows, dim);
    long n0 = dsv4_cuda_hc_dist_count(g2);
    dist_calls(g2, &w, nwp, X, o, pin, cin, rows, dim, bf, got);
    long took = dsv4_cuda_hc_dist_count(g2) - n0;
    size_t ndiff = 0, first = nout;
    for (size_t i = 0; i < nout; i++)
        if (memcmp(ref + i, got + i, sizeof(float))) ndiff++, first = first < i ? first : i;
    printf("  DIST rows %d dim %4d w %2d bf16 %d: %ld of 3 calls took it, %zu of %zu outputs differ from =0\n", rows,
           dim, wfmt, bf, took, ndiff, nout);
    if (ndiff) printf("    first [%zu] =0 %.9g DIST %.9g\n", first, ref[first], got[first]);
    CHECKF(ndiff == 0, "DIST rows %d dim %d w %d bf16 %d: %zu outputs differ from DSV4_CUDA_HC_DIST=0", rows, dim,
           wfmt, bf, ndiff);
    CHECKF(took == (want ? 3 : 0), "DIST rows %d dim %d: %ld launches took it, expected %d", rows, dim, took,
           want ? 3 : 0);
    free(X), free(o), free(pin), free(cin), free(y0), free(ref), free(got);
    if (wfmt >= 0) free_w(&nw);
    park_hc(&w);
}

/* test_alternating and test_post_pre_chain on backend g (as the global gpu they use): how many launches took DIST */
static long dist_chain(dsv4_backend *g) {
    dsv4_backend keep = gpu;
    gpu = *g;
    long n0 = dsv4_cuda_hc_dist_count(&gpu);
    test_alternating();
    test_post_pre_chain();
    long took = dsv4_cuda_hc_dist_count(&gpu) - n0;
    *g = gpu;
    gpu = keep;
    return took;
}

static void test_hc_dist(void) {
    NEED_GPU();
    dsv4_backend g0, g2;
    REQUIRE(cuda_init_env(&g0, "DSV4_CUDA_HC_DIST", "0") == 0);
    REQUIRE(cuda_init_env(&g2, "DSV4_CUDA_HC_DIST", "1") == 0);
    for (int bf = 0; bf < 2; bf++) {
        for (int rows = 1; rows <= 4; rows++) check_dist(&g0, &g2, rows, 4096, DSV4_WF_BF16, bf, 1); /* V4-Flash */
        check_dist(&g0, &g2, 1, 4096, DSV4_WF_F32, bf, 1);
        check_dist(&g0, &g2, 3, 4096, -1, bf, 1);           /* unweighted norm */
        check_dist(&g0, &g2, 2, 4096, DSV4_WF_FP8, bf, 1);  /* element-wise norm weights */
        check_dist(&g0, &g2, 3, 384, DSV4_WF_BF16, bf, 1);  /* 6 blocks, 9 runs: two in blocks 0-2 */
        check_dist(&g0, &g2, 4, 512, DSV4_WF_BF16, bf, 1);  /* 8 blocks, 16 runs */
        check_dist(&g0, &g2, 1, 192, DSV4_WF_BF16, bf, 0);  /* dim % 128 != 0: the finisher */
        check_dist(&g0, &g2, 5, 4096, DSV4_WF_BF16, bf, 0); /* more rows than k_hc_dec */
    }
    /* the tag protocol with the second area, eager and in graphs, on each backend */
    long took = dist_chain(&g2), took0 = dist_chain(&g0);
    printf("  test_alternating and test_post_pre_chain took DIST in %ld launches (=1), %ld (=0)\n", took, took0);
    CHECK(took > 0);
    CHECK(took0 == 0);
    dsv4_backend_cuda_free(&g2);
    dsv4_backend_cuda_free(&g0);
}

static void test_zz_release(void) {
    for (int i = 0; i < n_parked; i++) free(parked[i]);
    n_parked = 0;
}

TEST_MAIN(test_flash_hc4, test_pro_hc4, test_small_dims, test_device_and_graph, test_alternating, test_rmsnorm_flash,
          test_pre_norm_fused, test_post_pre_fused, test_post_pre_chain, test_hc_dist, test_zy_bench, test_zy_phases,
          test_zz_release)
