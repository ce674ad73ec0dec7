/* tests/test_cuda_attn: the CUDA sparse_attn, indexer_scores and topk against the CPU ops on
 * random inputs.
 *
 * sparse_attn cases: V4-Flash's decode shape (64 heads x 512, window 128, up to 512 picks of
 * 600 compressed rows; rows 1 and 4, picks read from device memory), rows walking every
 * compressed row (no picks), V4-Pro's (128 heads x 512, window 128 + 1024 picks of 1100, rows 1
 * and 4; every row of 1100 and 700), rows without compressed rows (n_comp 0, base NULL), empty
 * windows, small odd shapes (5 heads, head_dim 36 and 67, head_dim 384 and 1024), keys in host
 * memory (the staging slow path), device keys at addresses that are not 16-byte aligned
 * (the scalar kernels), rows 12 (host arrays staged instead of passed as a kernel
 * parameter), a device sink, and a corrupt pick or pick count on a backend of its own
 * (skipped, reported by ops->check; the output equals the CPU's without that pick).
 * Tolerances (rel = ||gpu - cpu||_2 / ||cpu||_2 over the output): 2e-6 in fp32 (only the
 * grouping of the dot products and of the sum over keys differs, plus nvcc's FMA
 * contraction, see docs/CUDA.md "Numerics"); 4e-3 when p and the output are rounded to
 * bf16 (an order difference in the denominator can move a p across a bf16 rounding
 * boundary: one ulp, 2^-8 relative).  Two runs of the same call must be bit-identical.
 * indexer_scores: Flash's indexer (64 heads x 128) over 8192 compressed rows (32K context),
 * 516 and 2052 (2K, 8K: the split kernel, 4 and 16 keys per block), 48 heads over 9 and 1
 * keys, and odd shapes (head_dim 36, unaligned keys, host keys, 40 rows); rel 2e-6 in fp32, 8e-3
 * with bf16 scores (the order of a dot product can flip one bf16 ulp).  topk: ids and
 * counts identical to the CPU's, on the indexer's scores at 8192 keys, on scores with many
 * ties (few distinct values, -0 and +0, -inf), all-equal rows, n <= k, n = k + 1, n = 0,
 * 40 rows, 516 and 2052 entries (random and 3 values), 9000, 8198 and 40000 entries (above
 * the register kernel's 8192: the shared-memory one, random and 5 values, k 512 and 2000) and
 * 60000 (above its 49152: the general one), all equal at 49152 and 40000 (more than 2^15 entries
 * tied at the cut); V4-Pro's k 1024 over 1100, 4100 and 8192 entries
 * (random and 4 values), 1025 and 1024; host and device outputs.  Indexer shapes of the tile
 * kernel (k_indexer_t, 32 or 64 keys a block by default): 8192 keys at head_dim 128 and 256, 4100
 * keys at rows 1 and 2, 8 rows of <= 600 keys; at 16 keys a block (2052 keys, and every shape with
 * DSV4_CUDA_IX_TILE=4) when run with DSV4_CUDA_IX_TILE=16 or 4 (bench/cuda_device.sh ops does).
 * sparse_attn_rope and indexer_scores_rs (the fused forms: sparse_attn then the inverse RoPE of
 * the output; rope of q and scale of w folded into the indexer's scores): memcmp against the
 * separate ops on the CUDA backend (bit-identical: every path, including the fallbacks of odd
 * head_dim), and against the CPU's separate ops within the tolerances above; q and w must come
 * back unwritten.  Shapes: Flash decode (64 x 512, rope 64, 640 keys) at rows 1, 4 and 8, Pro's
 * (128 x 512, 1152 keys) at rows 1 and 4, the Flash indexer (64 x 128, rope 64) over 516, 2052
 * and 8192 keys at rows 1, 3 and 8, odd shapes
 * (rope 12 of 36, rope 13, the whole head rotated, head_dim 67, host and unaligned keys, rows 40:
 * positions staged); positions from 0 to 2^31 - 1000 (the sine and cosine's slow argument
 * reduction).  DSV4_CUDA_ATTN_FUSE=0 must leave both ops NULL.
 * DSV4_ATTN_BENCH=1 adds timings at the Flash shapes: sparse_attn at rows 1 and 4 (200
 * back-to-back calls issued eagerly (host clock), per op with a sync each (ops->profile,
 * events), captured as one CUDA graph (events around the graph launch, ops->stats), and its
 * kernels alone in a graph through dsv4_cuda_attn_kernel_us: both, scores only, p.V only);
 * indexer_scores and topk over 8192 keys (rows 1 and 4), 516, 2052, 4100 and 8198 keys (rows 1)
 * and 516 keys at rows 8, in a graph, each alone and the two together (graph times need
 * DSV4_CUDA_GRAPH_TIMES=1; -1 without).
 * Without a CUDA device the binary prints SKIP. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CUDA_TEST_SEED 4242
#define CUDA_TEST_NAME "test_cuda_attn"
#include "backend/cuda/cuda.h"
/* the shared helpers include weight builders this file does not use */
#pragma GCC diagnostic ignored "-Wunused-function"
#include "cuda_test_util.h"
#pragma GCC diagnostic warning "-Wunused-function"

/* attn.cu's test hook (not in a header: only this test calls it); weak, so this file also
 * links against an attn.cu without it (then the kernel-only timing prints n/a) */
int dsv4_cuda_attn_kernel_us(dsv4_backend *b, float *out, const float *q, int rows, int n_heads, int head_dim,
                             const float *const *win, const int *n_win, int max_win, const float *const *comp_base,
                             const int *n_comp, const int32_t *picks, const int *n_picks, int topk, const float *sink,
                             float scale, int reps, double *us) __attribute__((weak));

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
    int dsink; /* the sink in device memory (the forward pass passes a host array) */
} acase;

typedef struct {
    acase k;
    size_t nq;
    float *q, *ring, *comp, *sink, *a, *g;
    const float **win, **base, **wind, **based;
    int32_t *picks, *na;
    float *q_d, *ring_d, *comp_d, *o_d, *q_d0, *ring_d0, *comp_d0, *sink_d;
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
    if (k->dsink && !(s->sink_d = dev_copy(s->sink, sizeof(float) * k->nh))) return -1;
    if (k->mode == MODE_PICKS) {
        s->p_d = dev_copy(s->picks, sizeof(int32_t) * (size_t)R * k->topk);
        s->np_d = dev_copy(s->na, sizeof(int) * R);
        if (!s->p_d || !s->np_d) return -1;
    }
    return 0;
}

static void aset_free(aset *s) {
    void *dv[] = {s->q_d0, s->ring_d0, s->comp_d0, s->o_d, s->p_d, s->np_d, s->sink_d};
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
                         pk ? s->np_d : NULL, pk ? k->topk : 0, k->dsink ? s->sink_d : s->sink, SCALE, bf, bf);
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
               f_win, f_comp, f_pick, 0};
    check_case(&k);
    k.name = "flash rows 4, picks 512/512/100/0";
    k.rows = 4;
    check_case(&k);
}

static void test_flash_no_picks(void) {
    NEED_GPU();
    static const int w[4] = {128, 0, 64, 128}, nc[4] = {600, 600, 0, 1}, np[4] = {0, 0, 0, 0};
    acase k = {"flash rows 4, every compressed row in order", 4, FH, FD, FW, FW, FNC, 0, MODE_ALL, 1, 0, w, nc, np, 0};
    check_case(&k);
    k.name = "flash rows 4, no compressed rows (base NULL)";
    k.mode = MODE_NONE;
    check_case(&k);
}

/* ----- V4-Pro shapes: 128 heads x 512, window 128 + up to 1024 picks (1152 keys: more than one
 * p.V tile of AP_TILE keys), rows 1 and 4 ----- */
static void test_pro_picks(void) {
    NEED_GPU();
    static const int w[4] = {128, 128, 37, 1}, nc[4] = {1100, 1099, 300, 1100}, np[4] = {1024, 1024, 300, 0};
    acase k = {"pro rows 1, window 128 + 1024 picks", 1, 128, 512, 128, 128, 1100, 1024, MODE_PICKS, 1, 0,
               w, nc, np, 0};
    check_case(&k);
    k.name = "pro rows 4, picks 1024/1024/300/0";
    k.rows = 4;
    check_case(&k);
    static const int w2[2] = {128, 64}, nc2[2] = {1100, 700}, np2[2] = {0, 0};
    acase a = {"pro rows 2, every compressed row (1100, 700)", 2, 128, 512, 128, 128, 1100, 0, MODE_ALL, 1, 0,
               w2, nc2, np2, 0};
    check_case(&a);
}

/* two identical calls give identical bits (fixed summation order, no atomics in the sums) */
static void test_flash_deterministic(void) {
    NEED_GPU();
    acase k = {"flash rows 1", 1, FH, FD, FW, FW, FNC, FTK, MODE_PICKS, 1, 0, f_win, f_comp, f_pick, 0};
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
        {"5 heads x 36, picks, device keys", 3, 5, 36, 20, 23, 300, 24, MODE_PICKS, 1, 0, w3, c3, p3, 0},
        {"5 heads x 36, picks, keys 4 bytes off 16", 3, 5, 36, 20, 23, 300, 24, MODE_PICKS, 1, 1, w3, c3, p3, 0},
        {"5 heads x 67, all compressed, device keys", 3, 5, 67, 20, 23, 300, 0, MODE_ALL, 1, 0, w3, c3, p3, 0},
        {"5 heads x 67, picks, host keys", 3, 5, 67, 20, 23, 300, 24, MODE_PICKS, 0, 0, w3, c3, p3, 0},
        {"17 heads x 128, all compressed, host keys", 3, 17, 128, 20, 20, 300, 0, MODE_ALL, 0, 0, w3, c3, p3, 0},
        {"17 heads x 128, no compressed, host keys", 3, 17, 128, 20, 20, 300, 0, MODE_NONE, 0, 0, w3, c3, p3, 0},
        {"3 heads x 1024, picks, device keys", 1, 3, 1024, 9, 9, 40, 64, MODE_PICKS, 1, 0, w1, c1, p1, 0},
        /* the scores stage at head_dim 384 is exactly 48 KB: with the kernel's static 128 bytes it
         * needs the shared-memory opt-in; first of its kernel instance (scalar, blob) in the binary */
        {"4 heads x 384, picks, keys 4 bytes off 16", 1, 4, 384, 9, 9, 40, 64, MODE_PICKS, 1, 1, w1, c1, p1, 0},
        {"64 heads x 512, picks, keys 4 bytes off 16", 1, FH, FD, 9, 9, 40, 64, MODE_PICKS, 1, 1, w1, c1, p1, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i]);
}

/* rows 12 at window 128: the host arrays exceed the kernel-parameter blob and are staged;
 * and a sink in device memory (read in place) on the blob path */
static void test_staged_arrays(void) {
    NEED_GPU();
    static const int w[12] = {128, 128, 0, 5, 128, 77, 128, 128, 1, 128, 128, 64};
    static const int nc[12] = {200, 199, 200, 64, 0, 200, 150, 200, 200, 70, 200, 200};
    static const int np[12] = {64, 64, 64, 64, 0, 10, 64, 1, 64, 64, 33, 64};
    acase k = {"rows 12, 16 heads x 128, picks (arrays staged)", 12, 16, 128, 128, 128, 200, 64, MODE_PICKS, 1, 0,
               w, nc, np, 0};
    check_case(&k);
    acase k2 = {"flash rows 1, device sink", 1, FH, FD, FW, FW, FNC, FTK, MODE_PICKS, 1, 0, f_win, f_comp, f_pick, 1};
    check_case(&k2);
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

/* ----- indexer scores and top-k ----- */
enum { IH = 64, ID = 128, IK = 8192, ITK = 512 }; /* Flash's indexer; 32K context / ratio 4 = 8192 rows */

/* Row r scores its nk[r] keys (a block of its own, max_keys rows apart).  dev: keys in
 * device memory (else host: the slow path); skew: device keys one float past 16 bytes
 * (the general kernel).  Entries past nk[r] are never written by either op: both start 0. */
static void check_indexer(const char *name, int rows, int nh, int hd, int max_keys, const int *nk, int dev, int skew) {
    size_t nq = (size_t)rows * nh * hd, nkey = (size_t)rows * max_keys * hd, ns = (size_t)rows * max_keys;
    float *q = malloc(sizeof(float) * nq), *w = malloc(sizeof(float) * rows * nh), *keys = malloc(sizeof(float) * nkey);
    float *a = malloc(sizeof(float) * ns), *g = malloc(sizeof(float) * ns), *kd = NULL, *sd = NULL;
    const float **kb = malloc(sizeof(float *) * rows), **kbd = malloc(sizeof(float *) * rows);
    REQUIRE(q && w && keys && a && g && kb && kbd);
    fill(q, nq, 1);
    fill(w, (size_t)rows * nh, 1);
    fill(keys, nkey, 1);
    if (dev) {
        kd = gpu.ops->alloc(&gpu, sizeof(float) * (nkey + 1));
        sd = gpu.ops->alloc(&gpu, sizeof(float) * ns);
        REQUIRE(kd && sd);
        gpu.ops->upload(&gpu, kd + (skew ? 1 : 0), keys, sizeof(float) * nkey);
    }
    for (int r = 0; r < rows; r++) {
        kb[r] = keys + (size_t)r * max_keys * hd;
        kbd[r] = dev ? kd + (skew ? 1 : 0) + (size_t)r * max_keys * hd : kb[r];
    }
    for (int bf = 0; bf < 2; bf++) {
        memset(a, 0, sizeof(float) * ns);
        memset(g, 0, sizeof(float) * ns);
        cpu.ops->indexer_scores(&cpu, a, q, w, rows, nh, hd, kb, nk, max_keys, bf);
        if (dev) {
            gpu.ops->upload(&gpu, sd, g, sizeof(float) * ns);
            gpu.ops->indexer_scores(&gpu, sd, q, w, rows, nh, hd, kbd, nk, max_keys, bf);
            gpu.ops->download(&gpu, g, sd, sizeof(float) * ns);
        } else {
            gpu.ops->indexer_scores(&gpu, g, q, w, rows, nh, hd, kbd, nk, max_keys, bf);
        }
        CHECK(gpu_ok());
        double r = rel(g, a, ns), tol = bf ? 8e-3 : 2e-6;
        printf("  indexer %-38s bf16 %d: rel %.2e (tol %.0e)\n", name, bf, r, tol);
        CHECKF(r <= tol, "indexer %s bf16 %d: rel %.3e", name, bf, r);
    }
    if (kd) gpu.ops->free(&gpu, kd);
    if (sd) gpu.ops->free(&gpu, sd);
    free(q), free(w), free(keys), free(a), free(g), free(kb), free(kbd);
}

static void test_indexer(void) {
    NEED_GPU();
    static const int n1[1] = {IK}, n3[3] = {IK, 5000, 77}, o3[3] = {300, 0, 129};
    static int n40[40];
    for (int r = 0; r < 40; r++) n40[r] = (r * 37) % 150;
    check_indexer("flash 64 x 128, 8192 keys, rows 1", 1, IH, ID, IK, n1, 1, 0);
    check_indexer("flash 64 x 128, rows 3 (8192/5000/77)", 3, IH, ID, IK, n3, 1, 0);
    static const int n516[1] = {516}, n2052[1] = {2052}, n9[2] = {9, 1};
    check_indexer("flash 64 x 128, 516 keys (4 per block)", 1, IH, ID, 600, n516, 1, 0);
    check_indexer("flash 64 x 128, 2052 keys (16 a block)", 1, IH, ID, 2100, n2052, 1, 0);
    static const int n4100[2] = {4100, 4097}, n8r[8] = {516, 520, 511, 3, 0, 516, 600, 17};
    check_indexer("flash 64 x 128, 4100 keys (32 a block)", 1, IH, ID, 4100, n4100, 1, 0);
    check_indexer("flash 64 x 128, rows 2, 4100 keys (64 a block)", 2, IH, ID, 4100, n4100, 1, 0);
    check_indexer("flash 64 x 128, rows 8 of <= 600 keys (32 a block)", 8, IH, ID, 600, n8r, 1, 0);
    static const int n256[1] = {8192};
    check_indexer("64 x 256, 8192 keys", 1, IH, 256, IK, n256, 1, 0);
    check_indexer("48 x 128, rows 2 (9/1 keys)", 2, 48, ID, 16, n9, 1, 0);
    check_indexer("64 x 128, keys 4 bytes off 16", 3, IH, ID, 300, o3, 1, 1);
    check_indexer("5 x 36, device keys", 3, 5, 36, 300, o3, 1, 0);
    check_indexer("7 x 64, host keys", 3, 7, 64, 300, o3, 0, 0);
    check_indexer("8 x 256, rows 40 (arrays staged)", 40, 8, 256, 150, n40, 1, 0);
}

/* ids and counts must equal the CPU's exactly; dev: outputs in device memory */
/* topk on backend g (the CPU's ids and counts required, bit for bit) */
static void check_topk_on(dsv4_backend *g, const char *name, const float *score, int rows, int stride, const int *n,
                          int k, int dev) {
    int32_t *ia = malloc(sizeof(int32_t) * rows * k), *ig = malloc(sizeof(int32_t) * rows * k);
    int *na = malloc(sizeof(int) * rows), *ng = malloc(sizeof(int) * rows);
    REQUIRE(ia && ig && na && ng);
    memset(ia, 0xff, sizeof(int32_t) * rows * k);
    memset(ig, 0xff, sizeof(int32_t) * rows * k);
    cpu.ops->topk(&cpu, ia, na, score, rows, stride, n, k);
    int guard_ok = 1;
    if (dev) {
        /* the ids land after a guard of TG ints (all bits set) that must come back untouched: a
         * kernel that writes before a row's output (a negative offset) shows */
        enum { TG = 65536 };
        int32_t *guard = malloc(sizeof(int32_t) * TG);
        REQUIRE(guard);
        memset(guard, 0xff, sizeof(int32_t) * TG);
        float *s_d = g->ops->alloc(g, sizeof(float) * rows * stride); /* g's own memory: a backend knows only its own */
        if (s_d) g->ops->upload(g, s_d, score, sizeof(float) * rows * stride);
        int32_t *g_d = g->ops->alloc(g, sizeof(int32_t) * ((size_t)TG + (size_t)rows * k)), *i_d = g_d + TG;
        int *n_d = g->ops->alloc(g, sizeof(int) * rows);
        REQUIRE(s_d && g_d && n_d);
        g->ops->upload(g, g_d, guard, sizeof(int32_t) * TG);
        g->ops->topk(g, i_d, n_d, s_d, rows, stride, n, k);
        g->ops->download(g, ig, i_d, sizeof(int32_t) * rows * k);
        g->ops->download(g, ng, n_d, sizeof(int) * rows);
        g->ops->download(g, guard, g_d, sizeof(int32_t) * TG);
        for (int i = 0; i < TG; i++) guard_ok &= guard[i] == -1;
        g->ops->free(g, s_d), g->ops->free(g, g_d), g->ops->free(g, n_d);
        free(guard);
    } else {
        g->ops->topk(g, ig, ng, score, rows, stride, n, k);
    }
    dsv4_err gerr;
    int g_ok = !g->ops->check(g, &gerr);
    if (!g_ok) fprintf(stderr, "  cuda error: %s\n", gerr.msg);
    CHECK(g_ok);
    int same = 1;
    for (int r = 0; r < rows && same; r++) {
        same = na[r] == ng[r];
        for (int j = 0; j < na[r] && same; j++) same = ia[(size_t)r * k + j] == ig[(size_t)r * k + j];
    }
    printf("  topk %-44s %s: %s%s\n", name, dev ? "device out" : "host out", same ? "identical" : "DIFFERENT",
           guard_ok ? "" : ", WROTE BEFORE THE OUTPUT");
    CHECKF(same && guard_ok, "topk %s", name);
    free(ia), free(ig), free(na), free(ng);
}

static void check_topk(const char *name, const float *score, int rows, int stride, const int *n, int k, int dev) {
    check_topk_on(&gpu, name, score, rows, stride, n, k, dev);
}

static void test_topk(void) {
    NEED_GPU();
    enum { R = 40, S = IK };
    float *sc = malloc(sizeof(float) * R * S);
    REQUIRE(sc);
    fill(sc, (size_t)R * S, 10);
    int n1[3] = {IK, IK - 1, 4000};
    for (int dev = 0; dev < 2; dev++) check_topk("random, 8192 keys, k 512, rows 3", sc, 3, S, n1, ITK, dev);
    /* few distinct values: ties decided by index; -0 equals +0; -inf below everything */
    for (size_t i = 0; i < (size_t)R * S; i++) {
        uint32_t u = urand() % 11;
        sc[i] = u == 9 ? -0.0f : u == 10 ? -INFINITY : (float)((int)u - 4) * 0.5f;
    }
    for (int dev = 0; dev < 2; dev++) check_topk("ties (9 values, -0, -inf), 8192 keys", sc, 3, S, n1, ITK, dev);
    int n2[4] = {ITK, ITK + 1, 0, 3};
    check_topk("ties, n = k, k + 1, 0, 3", sc, 4, S, n2, ITK, 1);
    for (size_t i = 0; i < (size_t)S; i++) sc[i] = 1.0f;
    check_topk("all equal, 8192 keys", sc, 1, S, n1, ITK, 1);
    int n40[R];
    for (int r = 0; r < R; r++) n40[r] = (r * 997) % 3000;
    fill(sc, (size_t)R * S, 1);
    check_topk("40 rows (counts staged), k 100", sc, R, S, n40, 100, 1);
    check_topk("random, 988 keys, k 1", sc, 1, S, n40 + 4, 1, 0);
    /* decode shapes (2K, 8K context) and a row above 8192 entries (the general kernel) */
    int n516[2] = {516, 2052}, n9000[1] = {9000};
    check_topk("random, 516 and 2052 keys, k 512", sc, 2, 2100, n516, ITK, 1);
    check_topk("random, 9000 keys, k 512", sc, 1, 9000, n9000, ITK, 1);
    free(sc);
    /* past 8192 entries: shared-memory kernel up to 49152, the general one above */
    enum { BIG = 60000 };
    sc = malloc(sizeof(float) * 2 * BIG);
    REQUIRE(sc);
    fill(sc, (size_t)2 * BIG, 3);
    int nb[2] = {40000, 8198}, nh[1] = {BIG};
    check_topk("random, 40000 and 8198 keys, k 512", sc, 2, BIG, nb, ITK, 1);
    check_topk("random, 60000 keys, k 512", sc, 1, BIG, nh, ITK, 1);
    for (size_t i = 0; i < (size_t)2 * BIG; i++) sc[i] = (float)(urand() % 5) - 2.0f; /* ties across the cut */
    check_topk("5 values, 40000 and 8198 keys, k 512", sc, 2, BIG, nb, ITK, 1);
    check_topk("5 values, 40000 and 8198 keys, k 2000", sc, 2, BIG, nb, 2000, 0);
    /* all equal past 32768 entries: k_topk_s's packed count of the entries equal to the cut passes
     * 2^15 (an int scan turned it negative: writes before the row's output) */
    for (size_t i = 0; i < (size_t)2 * BIG; i++) sc[i] = 0.25f;
    int ne[2] = {49152, 40000};
    check_topk("all equal, 49152 and 40000 keys, k 512", sc, 2, BIG, ne, ITK, 1);
    check_topk("all equal, 49152 and 40000 keys, k 1024", sc, 2, BIG, ne, 1024, 0);
    free(sc);
    sc = malloc(sizeof(float) * R * S);
    REQUIRE(sc);
    fill(sc, (size_t)R * S, 1);
    for (size_t i = 0; i < 2 * 2100; i++) sc[i] = (float)(urand() % 3) - 1.0f; /* ties across the cut */
    check_topk("3 values, 516 and 2052 keys, k 512", sc, 2, 2100, n516, ITK, 1);
    /* V4-Pro: k 1024 on the decode kernels (4100 keys = 16K context, 8192 = 32K), 1025 and 1024
     * keys (one dropped, none), ties across the cut */
    fill(sc, (size_t)R * S, 4);
    int np1[3] = {1100, 4100, 8192}, np2[2] = {1025, 1024};
    check_topk("pro: random, 1100 / 4100 / 8192 keys, k 1024", sc, 3, S, np1, 1024, 1);
    check_topk("pro: random, 1025 and 1024 keys, k 1024", sc, 2, S, np2, 1024, 0);
    for (size_t i = 0; i < (size_t)3 * S; i++) sc[i] = (float)(urand() % 4) - 1.5f;
    check_topk("pro: 4 values, 1100 / 4100 / 8192 keys, k 1024", sc, 3, S, np1, 1024, 1);
    free(sc);
}

/* k_topk_w: by default rows of 8193..16384 entries (k_topk_s's before stop 62); DSV4_CUDA_TOPK_W=2 (read at
 * backend init) every row up to 16384.  On a second backend at =2: the CPU's ids for the decode shapes (516 at
 * 2K, 2052, 8192 at 32K, 8193 and 8198 just past it, 12000, 16384 at 64K, mixed rows), random values, ties
 * across the cut (5 values), all equal, and scores of one sign with many exact zeros (relu'd sums), k 512 and
 * 1024, device and host outputs, n <= k taken whole; the kernel taken exactly where the longest row has at most
 * 16384 entries (its call counter), and rows past it (16385) on the kernels they take without the switch.  On
 * the default backend: the kernel taken for 8193 and 16384 only, not for 8192 or 16385. */
static void test_topk_w(void) {
    NEED_GPU();
    dsv4_backend g2;
    if (cuda_init_env(&g2, "DSV4_CUDA_TOPK_W", "2")) {
        CHECKF(0, "a backend with DSV4_CUDA_TOPK_W=2");
        return;
    }
    enum { S = 16400 };
    float *sc = malloc(sizeof(float) * 3 * S);
    REQUIRE(sc);
    long c0 = dsv4_cuda_topk_w_calls(&g2);
    int n1[3] = {516, 2052, 8192}, n3[3] = {8198, 12000, 16384}, n4[2] = {8193, 300};
    int calls = 0;
    for (int pass = 0; pass < 4; pass++) {
        const char *what = pass == 0 ? "random" : pass == 1 ? "5 values" : pass == 2 ? "all equal" : "zeros";
        for (size_t i = 0; i < (size_t)3 * S; i++) {
            float z = frand();
            sc[i] = pass == 0 ? z * 3.0f : pass == 1 ? (float)(urand() % 5) - 2.0f : pass == 2 ? 0.5f
                  : urand() % 3 ? 0.0f : fabsf(z) * 0.01f; /* two thirds exact zeros, the rest small positives */
        }
        char nm[96];
        snprintf(nm, sizeof nm, "topk_w %s, 516 / 2052 / 8192 keys, k 512", what);
        check_topk_on(&g2, nm, sc, 3, S, n1, ITK, 1);
        snprintf(nm, sizeof nm, "topk_w %s, 8193 and 300 keys, k 512", what);
        check_topk_on(&g2, nm, sc, 2, S, n4, ITK, 0);
        snprintf(nm, sizeof nm, "topk_w %s, 8198 / 12000 / 16384 keys, k 512", what);
        check_topk_on(&g2, nm, sc, 3, S, n3, ITK, 1);
        snprintf(nm, sizeof nm, "topk_w %s, 8198 / 12000 / 16384 keys, k 1024", what);
        check_topk_on(&g2, nm, sc, 3, S, n3, 1024, pass == 0 ? 0 : 1);
        calls += 4;
    }
    long c1 = dsv4_cuda_topk_w_calls(&g2);
    fill(sc, (size_t)3 * S, 2);
    int nout[2] = {8192, 16385};
    check_topk_on(&g2, "topk_w random, 8192 and 16385 keys (past its range)", sc, 2, S, nout, ITK, 1);
    long c2 = dsv4_cuda_topk_w_calls(&g2);
    printf("  k_topk_w calls at =2: %ld in range (%d expected), %ld past it (0 expected)\n", c1 - c0, calls, c2 - c1);
    CHECK_EQ_INT(c1 - c0, calls);
    CHECK_EQ_INT(c2 - c1, 0);
    /* the default backend: k_topk_w only where the longest row is past k_topk_r's 8192 and within 16384 (one
     * launch each for 8193 and for 16384, none for 8192 or 16385), the CPU's ids every time.  With the switch in
     * the process's environment the default backend follows it, so the counts are not checked then. */
    fill(sc, (size_t)3 * S, 3);
    int d1[2] = {8192, 300}, d2[2] = {8193, 300}, d3[2] = {16384, 8000}, d4[2] = {16385, 516};
    long w0 = dsv4_cuda_topk_w_calls(&gpu);
    check_topk_on(&gpu, "topk default, 8192 and 300 keys (k_topk_r)", sc, 2, S, d1, ITK, 1);
    long w1 = dsv4_cuda_topk_w_calls(&gpu);
    check_topk_on(&gpu, "topk default, 8193 and 300 keys (k_topk_w)", sc, 2, S, d2, ITK, 1);
    check_topk_on(&gpu, "topk default, 16384 and 8000 keys (k_topk_w)", sc, 2, S, d3, ITK, 0);
    long w2 = dsv4_cuda_topk_w_calls(&gpu);
    check_topk_on(&gpu, "topk default, 16385 and 516 keys (k_topk_s)", sc, 2, S, d4, ITK, 1);
    long w3 = dsv4_cuda_topk_w_calls(&gpu);
    printf("  default backend's k_topk_w calls: %ld at 8192 (0 expected), %ld at 8193 and 16384 (2), %ld at 16385 "
           "(0)\n", w1 - w0, w2 - w1, w3 - w2);
    if (!getenv("DSV4_CUDA_TOPK_W")) {
        CHECK_EQ_INT(w1 - w0, 0);
        CHECK_EQ_INT(w2 - w1, 2);
        CHECK_EQ_INT(w3 - w2, 0);
    }
    free(sc);
    /* a prefill chunk past 32K context: more rows than the launch's parameter block holds (ROW_PARAMS 32), so the
     * kernel reads the counts staged on the device; 40 rows of 8193..16384 entries (and one of 600), one launch */
    enum { RP = 40 };
    sc = malloc(sizeof(float) * RP * S);
    REQUIRE(sc);
    fill(sc, (size_t)RP * S, 4);
    int np[RP];
    for (int r = 0; r < RP; r++) np[r] = r == 7 ? 600 : 8193 + (r * 2003) % 8192;
    long w4 = dsv4_cuda_topk_w_calls(&gpu);
    check_topk_on(&gpu, "topk default, 40 rows of 600..16384 keys (counts staged)", sc, RP, S, np, ITK, 1);
    long w5 = dsv4_cuda_topk_w_calls(&gpu);
    printf("  default backend's k_topk_w calls for the 40 staged rows: %ld (1 expected)\n", w5 - w4);
    if (!getenv("DSV4_CUDA_TOPK_W")) CHECK_EQ_INT(w5 - w4, 1);
    free(sc);
    dsv4_backend_cuda_free(&g2);
}

/* ----- the fused forms: sparse_attn_rope, indexer_scores_rs ----- */
/* RoPE frequencies base^(-2i/rd) (forward.c's table without YaRN; the values do not matter
 * here, only that both sides use the same) */
static void rope_freqs(double *f, int rd, double base) {
    for (int i = 0; i < rd / 2; i++) f[i] = 1.0 / pow(base, (2.0 * i) / rd);
}

/* sparse_attn then rope(out, inverse) as two GPU ops (fused 0) or one (fused 1); result in res */
static void run_gpu_rope(aset *s, int bf, int fused, int rd, const int64_t *pos, const double *freq, float *res) {
    const acase *k = &s->k;
    int pk = k->mode == MODE_PICKS;
    float *out = k->dev ? s->o_d : res;
    memset(res, 0xff, sizeof(float) * s->nq); /* NaN: an output the kernels skipped shows */
    if (k->dev) gpu.ops->upload(&gpu, s->o_d, res, sizeof(float) * s->nq);
    const float *q = k->dev ? s->q_d : s->q, *sink = k->dsink ? s->sink_d : s->sink;
    const float *const *base = k->mode == MODE_NONE ? NULL : s->based;
    if (fused) {
        gpu.ops->sparse_attn_rope(&gpu, out, q, k->rows, k->nh, k->hd, s->wind, k->n_win, k->max_win, base, k->n_comp,
                                  pk ? s->p_d : NULL, pk ? s->np_d : NULL, pk ? k->topk : 0, sink, SCALE, bf, bf, rd,
                                  pos, freq);
    } else {
        gpu.ops->sparse_attn(&gpu, out, q, k->rows, k->nh, k->hd, s->wind, k->n_win, k->max_win, base, k->n_comp,
                             pk ? s->p_d : NULL, pk ? s->np_d : NULL, pk ? k->topk : 0, sink, SCALE, bf, bf);
        gpu.ops->rope(&gpu, out, k->rows, k->nh, k->hd, rd, pos, freq, 1, bf);
    }
    if (k->dev) gpu.ops->download(&gpu, res, s->o_d, sizeof(float) * s->nq);
}

static void check_rope_case(const acase *k, int rd, const int64_t *pos) {
    double freq[512];
    rope_freqs(freq, rd, 10000.0);
    aset s;
    float *sep = malloc(sizeof(float) * (size_t)k->rows * k->nh * k->hd);
    if (!sep || aset_make(&s, k)) {
        CHECKF(0, "%s: out of memory", k->name);
        aset_free(&s);
        free(sep);
        return;
    }
    for (int bf = 0; bf < 2; bf++) {
        run_cpu(&s, bf);
        cpu.ops->rope(&cpu, s.a, k->rows, k->nh, k->hd, rd, pos, freq, 1, bf);
        run_gpu_rope(&s, bf, 0, rd, pos, freq, sep);
        run_gpu_rope(&s, bf, 1, rd, pos, freq, s.g);
        CHECK(gpu_ok());
        int same = memcmp(sep, s.g, sizeof(float) * s.nq) == 0;
        double r = rel(s.g, s.a, s.nq), tol = bf ? 4e-3 : 2e-6;
        printf("  attn+rope %-40s rope %2d bf16 %d: %s the two ops, rel %.2e to the CPU (tol %.0e)\n", k->name, rd,
               bf, same ? "bit-identical to" : "DIFFERENT from", r, tol);
        CHECKF(same, "%s bf16 %d: fused differs from sparse_attn + rope", k->name, bf);
        CHECKF(r <= tol, "%s bf16 %d: rel %.3e", k->name, bf, r);
    }
    aset_free(&s);
    free(sep);
}

/* A call cut into row chunks (the scratch budget at 1 MB: Flash's 640 keys x 64 heads make 6 rows a
 * launch, Pro's 1152 x 128 one) gives the bits of the whole call, plain and with the rope, and the
 * launch counter shows the cut (attn.cu attn_rows_per_call) */
static void check_chunks(const acase *k, int rope) {
    static const int64_t pos[8] = {5, 1, 7, 2047, 65537, 1000003, 123456789, 2147482647};
    double freq[512];
    rope_freqs(freq, 64, 10000.0);
    aset s;
    float *whole = malloc(sizeof(float) * (size_t)k->rows * k->nh * k->hd);
    REQUIRE(whole && aset_make(&s, k) == 0);
    for (int bf = 0; bf < 2; bf++) {
        long parts[2];
        for (int cut = 0; cut < 2; cut++) {
            size_t old = cut ? dsv4_cuda_set_attn_scratch(&gpu, (size_t)1 << 20) : 0;
            long p0 = dsv4_cuda_attn_parts(&gpu);
            if (rope) {
                run_gpu_rope(&s, bf, 1, 64, pos, freq, cut ? s.g : whole);
            } else {
                memset(s.g, 0xff, sizeof(float) * s.nq);
                if (k->dev) gpu.ops->upload(&gpu, s.o_d, s.g, sizeof(float) * s.nq);
                run_gpu(&s, bf);
                if (!cut) memcpy(whole, s.g, sizeof(float) * s.nq);
            }
            parts[cut] = dsv4_cuda_attn_parts(&gpu) - p0;
            if (cut) dsv4_cuda_set_attn_scratch(&gpu, old);
        }
        CHECK(gpu_ok());
        int same = memcmp(whole, s.g, sizeof(float) * s.nq) == 0;
        printf("  %s%-40s bf16 %d: %ld launch(es) whole, %ld cut at 1 MB: %s\n", rope ? "attn+rope " : "attn ",
               k->name, bf, parts[0], parts[1], same ? "bit-identical" : "DIFFERENT");
        CHECKF(same && parts[0] == 1 && parts[1] > 1, "%s bf16 %d: cut into %ld, same %d", k->name, bf, parts[1],
               same);
    }
    aset_free(&s);
    free(whole);
}

static void test_row_chunks(void) {
    NEED_GPU();
    static const int w8[8] = {128, 128, 37, 1, 128, 64, 128, 2}, c8[8] = {600, 599, 100, 600, 600, 300, 512, 1},
                     p8[8] = {512, 512, 100, 0, 512, 300, 512, 1};
    acase k = {"flash rows 8, 128 + 512 picks", 8, FH, FD, FW, FW, FNC, FTK, MODE_PICKS, 1, 0, w8, c8, p8, 0};
    check_chunks(&k, 0);
    check_chunks(&k, 1);
    acase kn = {"flash rows 8, every compressed row", 8, FH, FD, FW, FW, FNC, 0, MODE_ALL, 1, 0, w8, c8, p8, 0};
    check_chunks(&kn, 0);
    static const int wp[4] = {128, 128, 37, 1}, cp[4] = {1100, 1099, 300, 1100}, pp[4] = {1024, 1024, 300, 0};
    acase kp = {"pro rows 4, 128 + 1024 picks", 4, 128, 512, 128, 128, 1100, 1024, MODE_PICKS, 1, 0, wp, cp, pp, 0};
    check_chunks(&kp, 0);
    check_chunks(&kp, 1);
}

static void test_attn_rope(void) {
    NEED_GPU();
    if (!gpu.ops->sparse_attn_rope) {
        printf("  sparse_attn_rope is NULL (DSV4_CUDA_ATTN_FUSE=0?): nothing to compare\n");
        return;
    }
    static const int w8[8] = {128, 128, 37, 1, 128, 64, 128, 2}, c8[8] = {600, 599, 100, 600, 600, 300, 512, 1},
                     p8[8] = {512, 512, 100, 0, 512, 300, 512, 1};
    static const int64_t pos1[1] = {2047}, pos1b[1] = {0}, pos1c[1] = {2147482647};
    static const int64_t pos8[8] = {0, 1, 7, 2047, 65537, 1000003, 123456789, 2147482647};
    acase k = {"flash rows 1, 128 + 512 picks", 1, FH, FD, FW, FW, FNC, FTK, MODE_PICKS, 1, 0, w8, c8, p8, 0};
    check_rope_case(&k, 64, pos1);
    check_rope_case(&k, 64, pos1b);
    check_rope_case(&k, 64, pos1c);
    k.name = "flash rows 4";
    k.rows = 4;
    check_rope_case(&k, 64, pos8 + 3);
    k.name = "flash rows 8";
    k.rows = 8;
    check_rope_case(&k, 64, pos8);
    acase kn = {"flash rows 8, every compressed row", 8, FH, FD, FW, FW, FNC, 0, MODE_ALL, 1, 0, w8, c8, p8, 0};
    check_rope_case(&kn, 64, pos8);
    kn.name = "flash rows 8, no compressed rows";
    kn.mode = MODE_NONE;
    check_rope_case(&kn, 64, pos8);
    /* V4-Pro: 128 heads, 128 + 1024 picks (two p.V tiles), rows 1 and 4 */
    static const int wp[4] = {128, 128, 37, 1}, cp[4] = {1100, 1099, 300, 1100}, pp[4] = {1024, 1024, 300, 0};
    acase kp = {"pro rows 1, 128 + 1024 picks", 1, 128, 512, 128, 128, 1100, 1024, MODE_PICKS, 1, 0, wp, cp, pp, 0};
    check_rope_case(&kp, 64, pos1);
    kp.name = "pro rows 4";
    kp.rows = 4;
    check_rope_case(&kp, 64, pos8 + 3);
    /* odd shapes: a rope part that starts inside a 32-dim block, head_dim 67 (the two ops), the
     * whole head rotated, host keys, unaligned keys, a device sink, rows 12 and 40 */
    static const int w3[3] = {0, 7, 20}, c3[3] = {13, 0, 300}, p3[3] = {5, 0, 17};
    static const int w1[1] = {9}, c1[1] = {40}, p1[1] = {40};
    static int w40[40], c40[40], p40[40];
    static int64_t pos40[40];
    for (int r = 0; r < 40; r++) w40[r] = r % 21, c40[r] = (r * 7) % 50, p40[r] = c40[r] < 24 ? c40[r] : 24,
                                pos40[r] = (int64_t)r * 999983;
    struct {
        acase k;
        int rd;
    } cases[] = {
        {{"5 heads x 36, picks, device keys", 3, 5, 36, 20, 23, 300, 24, MODE_PICKS, 1, 0, w3, c3, p3, 0}, 12},
        {{"5 heads x 36, keys 4 bytes off 16", 3, 5, 36, 20, 23, 300, 24, MODE_PICKS, 1, 1, w3, c3, p3, 0}, 36},
        {{"5 heads x 67, all compressed (two ops)", 3, 5, 67, 20, 23, 300, 0, MODE_ALL, 1, 0, w3, c3, p3, 0}, 64},
        {{"17 heads x 128, all compressed, host keys", 3, 17, 128, 20, 20, 300, 0, MODE_ALL, 0, 0, w3, c3, p3, 0}, 64},
        {{"3 heads x 1024, picks, device keys", 1, 3, 1024, 9, 9, 40, 64, MODE_PICKS, 1, 0, w1, c1, p1, 0}, 64},
        {{"64 heads x 512, keys 4 bytes off 16", 1, FH, FD, 9, 9, 40, 64, MODE_PICKS, 1, 1, w1, c1, p1, 0}, 64},
        {{"flash rows 1, device sink", 1, FH, FD, FW, FW, FNC, FTK, MODE_PICKS, 1, 0, w8, c8, p8, 1}, 64},
        {{"rows 40, 8 heads x 64 (positions staged)", 40, 8, 64, 20, 21, 50, 24, MODE_PICKS, 1, 0, w40, c40, p40, 0},
         64},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_rope_case(&cases[i].k, cases[i].rd, cases[i].k.rows == 40 ? pos40 : pos8 + 4);
}

/* Fused indexer: rope(q) and scale(w) folded into the scores, against the three ops on the
 * GPU (memcmp) and on the CPU; q and w must be left as they were.  dev: keys, q, w and the
 * scores in device memory (else host memory: the slow paths); skew: keys one float past 16. */
static void check_indexer_rs(const char *name, int rows, int nh, int hd, int max_keys, const int *nk, int dev,
                             int skew, int rd, const int64_t *pos) {
    size_t nq = (size_t)rows * nh * hd, nw = (size_t)rows * nh, nkey = (size_t)rows * max_keys * hd,
           ns = (size_t)rows * max_keys;
    double freq[512];
    rope_freqs(freq, rd, 160000.0);
    float ws = (float)(1.0 / sqrt((double)hd) / sqrt((double)nh));
    float *q = malloc(sizeof(float) * nq), *w = malloc(sizeof(float) * nw), *keys = malloc(sizeof(float) * nkey);
    float *qc = malloc(sizeof(float) * nq), *wc = malloc(sizeof(float) * nw);
    float *a = malloc(sizeof(float) * ns), *g = malloc(sizeof(float) * ns), *sep = malloc(sizeof(float) * ns);
    const float **kb = malloc(sizeof(float *) * rows), **kbd = malloc(sizeof(float *) * rows);
    REQUIRE(q && w && keys && qc && wc && a && g && sep && kb && kbd);
    fill(q, nq, 1);
    fill(w, nw, 1);
    fill(keys, nkey, 1);
    float *kd = NULL, *sd = NULL, *qd = NULL, *wd = NULL;
    if (dev) {
        kd = gpu.ops->alloc(&gpu, sizeof(float) * (nkey + 1));
        sd = gpu.ops->alloc(&gpu, sizeof(float) * ns);
        qd = gpu.ops->alloc(&gpu, sizeof(float) * nq);
        wd = gpu.ops->alloc(&gpu, sizeof(float) * nw);
        REQUIRE(kd && sd && qd && wd);
        gpu.ops->upload(&gpu, kd + (skew ? 1 : 0), keys, sizeof(float) * nkey);
    }
    for (int r = 0; r < rows; r++) {
        kb[r] = keys + (size_t)r * max_keys * hd;
        kbd[r] = dev ? kd + (skew ? 1 : 0) + (size_t)r * max_keys * hd : kb[r];
    }
    static const int combos[3][2] = {{0, 0}, {1, 1}, {0, 1}}; /* score_bf16, out_bf16 (rope and scale) */
    for (int ci = 0; ci < 3; ci++) {
        int sbf = combos[ci][0], obf = combos[ci][1];
        /* CPU: the three ops */
        memcpy(qc, q, sizeof(float) * nq);
        memcpy(wc, w, sizeof(float) * nw);
        cpu.ops->rope(&cpu, qc, rows, nh, hd, rd, pos, freq, 0, obf);
        cpu.ops->scale(&cpu, wc, nw, ws, obf);
        memset(a, 0, sizeof(float) * ns);
        cpu.ops->indexer_scores(&cpu, a, qc, wc, rows, nh, hd, kb, nk, max_keys, sbf);
        for (int fused = 0; fused < 2; fused++) {
            float *res = fused ? g : sep;
            memset(res, 0, sizeof(float) * ns);
            memcpy(qc, q, sizeof(float) * nq);
            memcpy(wc, w, sizeof(float) * nw);
            float *qx = qc, *wx = wc, *sx = res;
            if (dev) {
                gpu.ops->upload(&gpu, qd, q, sizeof(float) * nq);
                gpu.ops->upload(&gpu, wd, w, sizeof(float) * nw);
                gpu.ops->upload(&gpu, sd, res, sizeof(float) * ns);
                qx = qd, wx = wd, sx = sd;
            }
            if (fused) {
                gpu.ops->indexer_scores_rs(&gpu, sx, qx, wx, rows, nh, hd, kbd, nk, max_keys, sbf, rd, pos, freq, ws,
                                           obf);
            } else {
                gpu.ops->rope(&gpu, qx, rows, nh, hd, rd, pos, freq, 0, obf);
                gpu.ops->scale(&gpu, wx, nw, ws, obf);
                gpu.ops->indexer_scores(&gpu, sx, qx, wx, rows, nh, hd, kbd, nk, max_keys, sbf);
            }
            if (dev) {
                gpu.ops->download(&gpu, res, sd, sizeof(float) * ns);
                gpu.ops->download(&gpu, qc, qd, sizeof(float) * nq);
                gpu.ops->download(&gpu, wc, wd, sizeof(float) * nw);
            }
            CHECK(gpu_ok());
            if (fused) {
                int kept = !memcmp(qc, q, sizeof(float) * nq) && !memcmp(wc, w, sizeof(float) * nw);
                CHECKF(kept, "indexer+rs %s: q or w was written", name);
            }
        }
        int same = memcmp(sep, g, sizeof(float) * ns) == 0;
        double r = rel(g, a, ns), tol = sbf || obf ? 8e-3 : 2e-6;
        printf("  indexer+rs %-36s rope %2d bf16 %d/%d: %s the three ops, rel %.2e to the CPU (tol %.0e)\n", name, rd,
               sbf, obf, same ? "bit-identical to" : "DIFFERENT from", r, tol);
        CHECKF(same, "indexer+rs %s bf16 %d/%d: fused differs from rope + scale + indexer_scores", name, sbf, obf);
        CHECKF(r <= tol, "indexer+rs %s bf16 %d/%d: rel %.3e", name, sbf, obf, r);
    }
    void *dv[] = {kd, sd, qd, wd};
    for (size_t i = 0; i < sizeof dv / sizeof dv[0]; i++)
        if (dv[i]) gpu.ops->free(&gpu, dv[i]);
    free(q), free(w), free(keys), free(qc), free(wc), free(a), free(g), free(sep), free(kb), free(kbd);
}

static void test_indexer_rs(void) {
    NEED_GPU();
    if (!gpu.ops->indexer_scores_rs) {
        printf("  indexer_scores_rs is NULL (DSV4_CUDA_ATTN_FUSE=0?): nothing to compare\n");
        return;
    }
    static const int64_t pos8[8] = {2063, 0, 7, 8191, 65537, 1000003, 123456789, 2147482647};
    static const int n516[8] = {516, 516, 516, 516, 516, 516, 516, 516}, n2052[1] = {2052},
                     n3[3] = {IK, 5000, 77}, n9[2] = {9, 1}, o3[3] = {300, 0, 129};
    static int n40[40];
    static int64_t pos40[40];
    for (int r = 0; r < 40; r++) n40[r] = (r * 37) % 150, pos40[r] = (int64_t)r * 999983;
    check_indexer_rs("flash 64 x 128, 516 keys, rows 1", 1, IH, ID, 600, n516, 1, 0, 64, pos8);
    check_indexer_rs("flash 64 x 128, 516 keys, rows 1, pos 2^31", 1, IH, ID, 600, n516, 1, 0, 64, pos8 + 7);
    check_indexer_rs("flash 64 x 128, 516 keys, rows 8", 8, IH, ID, 600, n516, 1, 0, 64, pos8);
    check_indexer_rs("flash 64 x 128, 2052 keys", 1, IH, ID, 2100, n2052, 1, 0, 64, pos8 + 3);
    check_indexer_rs("flash 64 x 128, rows 3 (8192/5000/77)", 3, IH, ID, IK, n3, 1, 0, 64, pos8 + 2);
    check_indexer_rs("48 x 128, rows 2 (9/1 keys)", 2, 48, ID, 16, n9, 1, 0, 64, pos8 + 4);
    check_indexer_rs("64 x 128, keys 4 bytes off 16", 3, IH, ID, 300, o3, 1, 1, 64, pos8 + 1);
    check_indexer_rs("5 x 36, rope 13, device keys", 3, 5, 36, 300, o3, 1, 0, 13, pos8 + 3);
    check_indexer_rs("7 x 64, whole head, host keys", 3, 7, 64, 300, o3, 0, 0, 64, pos8 + 4);
    check_indexer_rs("8 x 256, rows 40 (positions staged)", 40, 8, 256, 150, n40, 1, 0, 64, pos40);
}

/* DSV4_CUDA_ATTN_FUSE=0 takes the fused attention ops out of the table (and only them) */
static void test_attn_fuse_switch(void) {
    NEED_GPU();
    dsv4_backend g2;
    REQUIRE(cuda_init_env(&g2, "DSV4_CUDA_ATTN_FUSE", "0") == 0);
    printf("  DSV4_CUDA_ATTN_FUSE=0: sparse_attn_rope %s, indexer_scores_rs %s, norm_rope %s\n",
           g2.ops->sparse_attn_rope ? "set" : "NULL", g2.ops->indexer_scores_rs ? "set" : "NULL",
           g2.ops->norm_rope ? "set" : "NULL");
    CHECK(g2.ops->sparse_attn_rope == NULL && g2.ops->indexer_scores_rs == NULL);
    CHECK(g2.ops->norm_rope == gpu.ops->norm_rope && g2.ops->hc_pre_norm == gpu.ops->hc_pre_norm);
    dsv4_backend_cuda_free(&g2);
}

/* ----- timing (DSV4_ATTN_BENCH=1) ----- */
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void bench_rows(int rows) {
    enum { N = 200 };
    acase k = {"bench", rows, FH, FD, FW, FW, FNC, FTK, MODE_PICKS, 1, 0, f_win, f_comp, f_pick, 0};
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
    double kus[3] = {-1, -1, -1};
    if (dsv4_cuda_attn_kernel_us) {
        int rc = dsv4_cuda_attn_kernel_us(&gpu, s.o_d, s.q_d, rows, FH, FD, s.wind, k.n_win, FW, s.based, k.n_comp,
                                          s.p_d, s.np_d, FTK, s.sink, SCALE, N, kus);
        CHECK(rc == 0);
        CHECK(gpu_ok());
        printf("  bench sparse_attn flash rows %d kernels alone (%d in one graph): scores + p.V %.1f us, scores %.1f us, "
               "p.V %.1f us\n",
               rows, N, kus[0], kus[1], kus[2]);
    } else {
        printf("  bench sparse_attn flash rows %d kernels alone: n/a (no dsv4_cuda_attn_kernel_us in this build)\n",
               rows);
    }
    aset_free(&s);
}

/* graph time per call of f(ctx): n calls captured as one segment (the first capture
 * instantiates, the second, timed, updates); -1 without graphs */
static double graph_us(void (*f)(void *), void *ctx, int n) {
    dsv4_backend_stats st;
    if (!gpu.ops->segment || !gpu.ops->stats) return -1;
    double g0 = 0;
    for (int rep = 0; rep < 2; rep++) {
        gpu.ops->stats(&gpu, &st);
        g0 = st.graph_gpu_s;
        gpu.ops->segment(&gpu, 0);
        for (int i = 0; i < n; i++) f(ctx);
        gpu.ops->segment(&gpu, -1);
        CHECK(gpu_ok());
    }
    gpu.ops->stats(&gpu, &st);
    return st.graph_gpu_s > g0 ? (st.graph_gpu_s - g0) / n * 1e6 : -1;
}

enum { IBK = IK + 64 }; /* room for 8198 keys (32K context and a few steps) */
typedef struct {
    int rows, nk[8];
    float *q_d, *w_d, *k_d, *s_d;
    int32_t *p_d;
    int *np_d;
    const float *kb[8];
} ibench;

static void ib_indexer(void *p) {
    ibench *c = p;
    gpu.ops->indexer_scores(&gpu, c->s_d, c->q_d, c->w_d, c->rows, IH, ID, c->kb, c->nk, IBK, 0);
}
static void ib_topk(void *p) {
    ibench *c = p;
    gpu.ops->topk(&gpu, c->p_d, c->np_d, c->s_d, c->rows, IBK, c->nk, ITK);
}
static void ib_both(void *p) {
    ib_indexer(p);
    ib_topk(p);
}

static void bench_indexer(int rows, int nk) {
    enum { N = 100 };
    ibench c;
    memset(&c, 0, sizeof c);
    c.rows = rows;
    size_t nq = (size_t)rows * IH * ID, nkey = (size_t)rows * IBK * ID;
    float *h = malloc(sizeof(float) * (nkey > nq ? nkey : nq));
    REQUIRE(h);
    fill(h, nkey, 1);
    c.k_d = dev_copy(h, sizeof(float) * nkey);
    fill(h, nq, 1);
    c.q_d = dev_copy(h, sizeof(float) * nq);
    c.w_d = dev_copy(h, sizeof(float) * rows * IH);
    c.s_d = gpu.ops->alloc(&gpu, sizeof(float) * rows * IBK);
    c.p_d = gpu.ops->alloc(&gpu, sizeof(int32_t) * rows * ITK);
    c.np_d = gpu.ops->alloc(&gpu, sizeof(int) * rows);
    REQUIRE(c.k_d && c.q_d && c.w_d && c.s_d && c.p_d && c.np_d);
    for (int r = 0; r < rows; r++) c.nk[r] = nk, c.kb[r] = c.k_d + (size_t)r * IBK * ID;
    for (int i = 0; i < 3; i++) ib_both(&c);
    CHECK(gpu_ok());
    double per[2] = {-1, -1};
    if (gpu.ops->profile && gpu.ops->stats) {
        dsv4_backend_stats st;
        gpu.ops->profile(&gpu, 1);
        for (int i = 0; i < N; i++) ib_both(&c);
        CHECK(gpu_ok());
        gpu.ops->stats(&gpu, &st);
        for (int i = 0; i < st.n_ops; i++) {
            if (!st.op[i] || st.calls[i] <= 0) continue;
            if (!strcmp(st.op[i], "indexer_scores")) per[0] = st.ms[i] / st.calls[i] * 1e3;
            if (!strcmp(st.op[i], "topk")) per[1] = st.ms[i] / st.calls[i] * 1e3;
        }
        gpu.ops->profile(&gpu, 0);
    }
    double gi = graph_us(ib_indexer, &c, N), gt = graph_us(ib_topk, &c, N), gb = graph_us(ib_both, &c, N);
    printf("  bench indexer+topk flash (64 x 128, %d keys, k 512) rows %d: per op (sync each) indexer %.1f us, "
           "topk %.1f us; one CUDA graph (%d calls): indexer %.1f us, topk %.1f us, both %.1f us/call\n",
           nk, rows, per[0], per[1], N, gi, gt, gb);
    void *dv[] = {c.k_d, c.q_d, c.w_d, c.s_d, c.p_d, c.np_d};
    for (size_t i = 0; i < sizeof dv / sizeof dv[0]; i++) gpu.ops->free(&gpu, dv[i]);
    free(h);
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
    bench_indexer(1, IK);
    bench_indexer(4, IK);
    bench_indexer(1, 516); /* 2K context: 516 compressed rows, k 512 */
    bench_indexer(1, 2052); /* 8K context */
    bench_indexer(1, 4100); /* 16K context */
    bench_indexer(1, 8198); /* 32K context after a few steps: above k_topk_r's 8192 (k_topk_w; with
                             * DSV4_CUDA_TOPK_W=0 k_topk_s) */
    bench_indexer(8, 516);  /* batch 8 at 2K */
}

TEST_MAIN(test_flash_picks, test_flash_no_picks, test_pro_picks, test_flash_deterministic, test_odd_shapes,
          test_staged_arrays, test_bad_picks, test_indexer, test_topk, test_topk_w, test_attn_rope, test_row_chunks,
          test_indexer_rs, test_attn_fuse_switch, test_zz_bench)
