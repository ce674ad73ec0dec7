/* tests/test_cuda_attn: the CUDA sparse_attn against the CPU op on random inputs.
 *
 * Cases: V4-Flash's decode shape (64 heads x 512, window 128, up to 512 picks of 600
 * compressed rows; rows 1 and 4, picks read from device memory), rows walking every
 * compressed row (no picks), rows without compressed rows (n_comp 0, base NULL), empty
 * windows, small odd shapes (5 heads, head_dim 36 and 67, head_dim 1024), keys in host
 * memory (the staging slow path), device keys at addresses that are not 16-byte aligned
 * (the scalar kernels), and a corrupt pick or pick count on a backend of its own (skipped,
 * reported by ops->check; the output equals the CPU's without that pick).
 * Tolerances (rel = ||gpu - cpu||_2 / ||cpu||_2 over the output): 2e-6 in fp32 (only the
 * grouping of the dot products and of the sum over keys differs, plus nvcc's FMA
 * contraction, see docs/CUDA.md "Numerics"); 4e-3 when p and the output are rounded to
 * bf16 (an order difference in the denominator can move a p across a bf16 rounding
 * boundary: one ulp, 2^-8 relative).  Two runs of the same call must be bit-identical.
 * DSV4_ATTN_BENCH=1 adds timings at the Flash shape (rows 1 and 4): 200 back-to-back
 * calls issued eagerly (host clock), per op with a sync each (ops->profile, events), and
 * captured as one CUDA graph (events around the graph launch, ops->stats).
 * Without a CUDA device the binary prints SKIP. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CUDA_TEST_SEED 4242
#define CUDA_TEST_NAME "test_cuda_attn"
/* the shared helpers include weight builders this file does not use */
#pragma GCC diagnostic ignored "-Wunused-function"
#include "cuda_test_util.h"
#pragma GCC diagnostic warning "-Wunused-function"

static void *dev_copy(const void *h, size_t n) {
    void *d = gpu.ops->alloc(&gpu, n);
    if (d) gpu.ops->upload(&gpu, d, h, n);
    return d;
}

enum { MODE_PICKS, MODE_ALL, MODE_NONE };

/* One case.  Row r has n_win[r] window keys (slots of a shared ring, in a row-dependent
 * order) and, by mode, n_pick[r] picks (ascending, distinct, random) of its n_comp[r]
 * compressed rows, all of them in order, or none (base NULL).  dev: keys and q in device
 * memory (else host memory: the slow path); skew: device keys and q one float past a
 * 16-byte boundary. */
typedef struct {
    const char *name;
    int rows, nh, hd, max_win, ring, nc, topk, mode, dev, skew;
    const int *n_win, *n_comp, *n_pick;
} acase;

typedef struct {
    acase k;
    size_t nq;
    float *q, *ring, *comp, *sink, *a, *g;
    const float **win, **base, **wind, **based;
    int32_t *picks, *na;
    float *q_d, *ring_d, *comp_d, *o_d, *q_d0, *ring_d0, *comp_d0;
    int32_t *p_d;
    int *np_d;
} aset;

static int aset_make(aset *s, const acase *k) {
    memset(s, 0, sizeof *s);
    s->k = *k;
    int R = k->rows, HD = k->hd;
    s->nq = (size_t)R * k->nh * HD;
    s->q = malloc(sizeof(float) * s->nq);
    s->a = malloc(sizeof(float) * s->nq);
    s->g = malloc(sizeof(float) * s->nq);
    s->ring = malloc(sizeof(float) * (size_t)k->ring * HD);
    s->comp = malloc(sizeof(float) * ((size_t)R * k->nc * HD + 1));
    s->sink = malloc(sizeof(float) * k->nh);
    s->win = malloc(sizeof(float *) * (size_t)R * k->max_win);
    s->wind = malloc(sizeof(float *) * (size_t)R * k->max_win);
    s->base = malloc(sizeof(float *) * R);
    s->based = malloc(sizeof(float *) * R);
    s->picks = malloc(sizeof(int32_t) * (size_t)R * (k->topk > 0 ? k->topk : 1));
    s->na = malloc(sizeof(int32_t) * R);
    if (!s->q || !s->a || !s->g || !s->ring || !s->comp || !s->sink || !s->win || !s->wind || !s->base || !s->based ||
        !s->picks || !s->na)
        return -1;
    fill(s->q, s->nq, 1);
    fill(s->ring, (size_t)k->ring * HD, 1);
    fill(s->comp, (size_t)R * k->nc * HD, 1);
    fill(s->sink, k->nh, 2);
    int off = k->skew ? 1 : 0;
    if (k->dev) { /* skewed copies start one float into their allocation */
        s->q_d0 = gpu.ops->alloc(&gpu, sizeof(float) * (s->nq + 1));
        s->ring_d0 = gpu.ops->alloc(&gpu, sizeof(float) * ((size_t)k->ring * HD + 1));
        s->comp_d0 = gpu.ops->alloc(&gpu, sizeof(float) * ((size_t)R * k->nc * HD + 1));
        s->o_d = gpu.ops->alloc(&gpu, sizeof(float) * s->nq);
        if (!s->q_d0 || !s->ring_d0 || !s->comp_d0 || !s->o_d) return -1;
        s->q_d = s->q_d0 + off, s->ring_d = s->ring_d0 + off, s->comp_d = s->comp_d0 + off;
        gpu.ops->upload(&gpu, s->q_d, s->q, sizeof(float) * s->nq);
        gpu.ops->upload(&gpu, s->ring_d, s->ring, sizeof(float) * (size_t)k->ring * HD);
        gpu.ops->upload(&gpu, s->comp_d, s->comp, sizeof(float) * (size_t)R * k->nc * HD);
    }
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < k->max_win; j++) {
            size_t slot = (size_t)((j * 5 + r * 3) % k->ring) * HD;
            s->win[(size_t)r * k->max_win + j] = s->ring + slot;
            s->wind[(size_t)r * k->max_win + j] = k->dev ? s->ring_d + slot : s->ring + slot;
        }
        s->base[r] = k->mode == MODE_NONE ? NULL : s->comp + (size_t)r * k->nc * HD;
        s->based[r] = k->mode == MODE_NONE ? NULL : k->dev ? s->comp_d + (size_t)r * k->nc * HD : s->base[r];
        int nc = k->n_comp[r], np = k->mode == MODE_PICKS ? k->n_pick[r] : 0;
        s->na[r] = np;
        /* np distinct indices of [0, nc), ascending (as topk writes them) */
        int32_t *pr = s->picks + (size_t)r * k->topk;
        int m = 0;
        for (int i = 0; i < nc && m < np; i++)
            if ((int)(urand() % (uint32_t)(nc - i)) < np - m) pr[m++] = i;
    }
    if (k->mode == MODE_PICKS) {
        s->p_d = dev_copy(s->picks, sizeof(int32_t) * (size_t)R * k->topk);
        s->np_d = dev_copy(s->na, sizeof(int) * R);
        if (!s->p_d || !s->np_d) return -1;
    }
    return 0;
}

static void aset_free(aset *s) {
    void *dv[] = {s->q_d0, s->ring_d0, s->comp_d0, s->o_d, s->p_d, s->np_d};
    for (size_t i = 0; i < sizeof dv / sizeof dv[0]; i++)
        if (dv[i]) gpu.ops->free(&gpu, dv[i]);
    free(s->q), free(s->a), free(s->g), free(s->ring), free(s->comp), free(s->sink);
    free(s->win), free(s->wind), free(s->base), free(s->based), free(s->picks), free(s->na);
}

static const float SCALE = 0.0441941738f; /* 1/sqrt(512) */

static void run_cpu(aset *s, int bf) {
    const acase *k = &s->k;
    int pk = k->mode == MODE_PICKS;
    cpu.ops->sparse_attn(&cpu, s->a, s->q, k->rows, k->nh, k->hd, s->win, k->n_win, k->max_win,
                         k->mode == MODE_NONE ? NULL : s->base, k->n_comp, pk ? s->picks : NULL, pk ? s->na : NULL,
                         pk ? k->topk : 0, s->sink, SCALE, bf, bf);
}

/* the GPU output lands in s->g */
static void run_gpu(aset *s, int bf) {
    const acase *k = &s->k;
    int pk = k->mode == MODE_PICKS;
    float *out = k->dev ? s->o_d : s->g;
    gpu.ops->sparse_attn(&gpu, out, k->dev ? s->q_d : s->q, k->rows, k->nh, k->hd, s->wind, k->n_win, k->max_win,
                         k->mode == MODE_NONE ? NULL : s->based, k->n_comp, pk ? s->p_d : NULL,
                         pk ? s->np_d : NULL, pk ? k->topk : 0, s->sink, SCALE, bf, bf);
    if (k->dev) gpu.ops->download(&gpu, s->g, s->o_d, sizeof(float) * s->nq);
}

static void check_case(const acase *k) {
    aset s;
    if (aset_make(&s, k)) {
        CHECKF(0, "%s: out of memory", k->name);
        aset_free(&s);
        return;
    }
    for (int bf = 0; bf < 2; bf++) {
        run_cpu(&s, bf);
        memset(s.g, 0xff, sizeof(float) * s.nq); /* NaN: an output the kernel skipped shows */
        if (k->dev) gpu.ops->upload(&gpu, s.o_d, s.g, sizeof(float) * s.nq);
        run_gpu(&s, bf);
        CHECK(gpu_ok());
        double r = rel(s.g, s.a, s.nq), tol = bf ? 4e-3 : 2e-6;
        printf("  %-44s bf16 %d: rel %.2e (tol %.0e)\n", k->name, bf, r, tol);
        CHECKF(r <= tol, "%s bf16 %d: rel %.3e", k->name, bf, r);
    }
    aset_free(&s);
}

/* ----- V4-Flash shapes ----- */
enum { FH = 64, FD = 512, FW = 128, FNC = 600, FTK = 512 };
static const int f_win[4] = {128, 128, 37, 1}, f_comp[4] = {600, 599, 100, 600}, f_pick[4] = {512, 512, 100, 0};

static void test_flash_picks(void) {
    NEED_GPU();
    acase k = {"flash rows 1, window 128 + 512 picks", 1, FH, FD, FW, FW, FNC, FTK, MODE_PICKS, 1, 0,
               f_win, f_comp, f_pick};
    check_case(&k);
    k.name = "flash rows 4, picks 512/512/100/0";
    k.rows = 4;
    check_case(&k);
}

static void test_flash_no_picks(void) {
    NEED_GPU();
    static const int w[4] = {128, 0, 64, 128}, nc[4] = {600, 600, 0, 1}, np[4] = {0, 0, 0, 0};
    acase k = {"flash rows 4, every compressed row in order", 4, FH, FD, FW, FW, FNC, 0, MODE_ALL, 1, 0, w, nc, np};
    check_case(&k);
    k.name = "flash rows 4, no compressed rows (base NULL)";
    k.mode = MODE_NONE;
    check_case(&k);
}

/* two identical calls give identical bits (fixed summation order, no atomics in the sums) */
static void test_flash_deterministic(void) {
    NEED_GPU();
    acase k = {"flash rows 1", 1, FH, FD, FW, FW, FNC, FTK, MODE_PICKS, 1, 0, f_win, f_comp, f_pick};
    aset s;
    REQUIRE(aset_make(&s, &k) == 0);
    float *g1 = malloc(sizeof(float) * s.nq);
    REQUIRE(g1);
    run_gpu(&s, 0);
    memcpy(g1, s.g, sizeof(float) * s.nq);
    run_gpu(&s, 0);
    CHECK(gpu_ok());
    int same = memcmp(g1, s.g, sizeof(float) * s.nq) == 0;
    printf("  flash rows 1, two runs: %s\n", same ? "bit-identical" : "DIFFERENT");
    CHECK(same);
    free(g1);
    aset_free(&s);
}

/* ----- small and odd shapes, host keys, unaligned keys ----- */
static void test_odd_shapes(void) {
    NEED_GPU();
    static const int w3[3] = {0, 7, 20}, c3[3] = {13, 0, 300}, p3[3] = {5, 0, 17};
    static const int w1[1] = {9}, c1[1] = {40}, p1[1] = {40};
    acase cases[] = {
        {"5 heads x 36, picks, device keys", 3, 5, 36, 20, 23, 300, 24, MODE_PICKS, 1, 0, w3, c3, p3},
        {"5 heads x 36, picks, keys 4 bytes off 16", 3, 5, 36, 20, 23, 300, 24, MODE_PICKS, 1, 1, w3, c3, p3},
        {"5 heads x 67, all compressed, device keys", 3, 5, 67, 20, 23, 300, 0, MODE_ALL, 1, 0, w3, c3, p3},
        {"5 heads x 67, picks, host keys", 3, 5, 67, 20, 23, 300, 24, MODE_PICKS, 0, 0, w3, c3, p3},
        {"17 heads x 128, all compressed, host keys", 3, 17, 128, 20, 20, 300, 0, MODE_ALL, 0, 0, w3, c3, p3},
        {"17 heads x 128, no compressed, host keys", 3, 17, 128, 20, 20, 300, 0, MODE_NONE, 0, 0, w3, c3, p3},
        {"3 heads x 1024, picks, device keys", 1, 3, 1024, 9, 9, 40, 64, MODE_PICKS, 1, 0, w1, c1, p1},
        {"64 heads x 512, picks, keys 4 bytes off 16", 1, FH, FD, 9, 9, 40, 64, MODE_PICKS, 1, 1, w1, c1, p1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i]);
}

/* ----- corrupt device indices ----- */
/* A pick >= the row's compressed rows is skipped and reported; the output is the CPU's
 * over the other keys.  A pick count above topk is clamped and reported.  Each on a
 * backend of its own (the error is sticky). */
static void test_bad_picks(void) {
    NEED_GPU();
    enum { NH = 3, HD = 64, NC = 8, TK = 4, NW = 2 };
    float keys[NC * HD], q[NH * HD], out[NH * HD], ref[NH * HD], sink[NH];
    fill(keys, NC * HD, 1);
    fill(q, NH * HD, 1);
    fill(sink, NH, 1);
    int32_t picks[TK] = {0, 3, 9999, 5}, good[TK] = {0, 3, 5, 0};
    int n_win = NW, n_comp = NC, n_good = 3;
    const float *winh[NW] = {keys + 6 * HD, keys + 7 * HD}, *baseh[1] = {keys};
    cpu.ops->sparse_attn(&cpu, ref, q, 1, NH, HD, winh, &n_win, NW, baseh, &n_comp, good, &n_good, TK, sink, 0.125f,
                         0, 0);
    for (int bad_count = 0; bad_count < 2; bad_count++) {
        dsv4_backend g2;
        dsv4_err err;
        REQUIRE(dsv4_backend_cuda_init(&g2, 0, &err) == 0);
        int np = bad_count ? TK + 5 : TK;
        float *k_d = g2.ops->alloc(&g2, sizeof keys);
        int32_t *p_d = g2.ops->alloc(&g2, sizeof picks);
        int *n_d = g2.ops->alloc(&g2, sizeof(int));
        REQUIRE(k_d && p_d && n_d);
        g2.ops->upload(&g2, k_d, keys, sizeof keys);
        g2.ops->upload(&g2, p_d, bad_count ? good : picks, sizeof picks);
        g2.ops->upload(&g2, n_d, &np, sizeof(int));
        const float *win[NW] = {k_d + 6 * HD, k_d + 7 * HD}, *base[1] = {k_d};
        CHECK(g2.ops->check(&g2, &err) == 0);
        g2.ops->sparse_attn(&g2, out, q, 1, NH, HD, win, &n_win, NW, base, &n_comp, p_d, n_d, TK, sink, 0.125f, 0, 0);
        int rc = g2.ops->check(&g2, &err);
        printf("  corrupt pick %s: check -> %d (%s)\n", bad_count ? "count" : "index", rc, rc ? err.msg : "no error");
        CHECK(rc != 0 && strstr(err.msg, "pick") != NULL);
        if (!bad_count) { /* the output was fetched before the check reported */
            double r = rel(out, ref, NH * HD);
            printf("  corrupt pick skipped: rel %.2e to the CPU without it (tol 2e-6)\n", r);
            CHECK(r <= 2e-6);
        }
        dsv4_backend_cuda_free(&g2);
    }
}

/* ----- timing (DSV4_ATTN_BENCH=1) ----- */
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void bench_rows(int rows) {
    enum { N = 200 };
    acase k = {"bench", rows, FH, FD, FW, FW, FNC, FTK, MODE_PICKS, 1, 0, f_win, f_comp, f_pick};
    aset s;
    if (aset_make(&s, &k)) {
        CHECKF(0, "bench: out of memory");
        aset_free(&s);
        return;
    }
#define CALL()                                                                                                       \
    gpu.ops->sparse_attn(&gpu, s.o_d, s.q_d, rows, FH, FD, s.wind, k.n_win, FW, s.based, k.n_comp, s.p_d, s.np_d, FTK, \
                         s.sink, SCALE, 0, 0)
    for (int i = 0; i < 5; i++) CALL();
    CHECK(gpu_ok());
    double t0 = now_s();
    for (int i = 0; i < N; i++) CALL();
    CHECK(gpu_ok());
    double eager = (now_s() - t0) / N * 1e6;
    dsv4_backend_stats st;
    double per_op = -1;
    if (gpu.ops->profile && gpu.ops->stats) {
        gpu.ops->profile(&gpu, 1);
        for (int i = 0; i < N; i++) CALL();
        CHECK(gpu_ok());
        gpu.ops->stats(&gpu, &st);
        for (int i = 0; i < st.n_ops; i++)
            if (st.op[i] && !strcmp(st.op[i], "sparse_attn") && st.calls[i] > 0) per_op = st.ms[i] / st.calls[i] * 1e3;
        gpu.ops->profile(&gpu, 0);
    }
    double graph = -1;
    if (gpu.ops->segment && gpu.ops->stats) {
        double g0 = 0;
        for (int rep = 0; rep < 2; rep++) { /* the first capture instantiates, the second updates */
            gpu.ops->stats(&gpu, &st);
            g0 = st.graph_gpu_s;
            gpu.ops->segment(&gpu, 0);
            for (int i = 0; i < N; i++) CALL();
            gpu.ops->segment(&gpu, -1);
            CHECK(gpu_ok());
        }
        gpu.ops->stats(&gpu, &st);
        if (st.graph_gpu_s > g0) graph = (st.graph_gpu_s - g0) / N * 1e6;
    }
#undef CALL
    printf("  bench sparse_attn flash rows %d (%d calls): eager %.1f us/call, per op (sync each) %.1f us, "
           "one CUDA graph %.1f us/call\n",
           rows, N, eager, per_op, graph);
    aset_free(&s);
}

static void test_zz_bench(void) {
    NEED_GPU();
    const char *e = getenv("DSV4_ATTN_BENCH");
    if (!e || !*e || *e == '0') {
        printf("  (timings: DSV4_ATTN_BENCH=1)\n");
        return;
    }
    bench_rows(1);
    bench_rows(4);
}

TEST_MAIN(test_flash_picks, test_flash_no_picks, test_flash_deterministic, test_odd_shapes, test_bad_picks,
          test_zz_bench)
