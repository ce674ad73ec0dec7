/* tests/test_forward: the forward pass through the engine API on a tiny synth model.
 *
 * Consistency: prefill == chunked prefill == token-by-token decode (exact and
 * reference), batched sequences == separate runs, truncate + re-extend == fresh,
 * clone/snapshot/restore; hash routing follows tid2eid; the routing-weight
 * invariant (sum = routed_scaling_factor) holds and catches moe.route_scale=both;
 * the distance of every switch from exact is printed.  Sequences cross the window
 * (16), every compression boundary (4, 8) and index_topk (4) < visible rows.
 * The forward pass's contract with a device backend (segment marks, one check per step after
 * the head, nothing committed when the check fails) through a recording wrapper of the CPU
 * backend's ops.  The fused pair hc_post_pre_norm: the forward pass's bookkeeping around it
 * (two post/comb pairs, the next layer skipping its own hc_pre, the last layer and the MTP
 * block unfused, the separate ops under a layer-diff trace) gives the bits of the unfused
 * pass, with the op counts of each.  Greedy decoding (dsv4_forward_greedy) against the host loop,
 * and a failed call undone (test_segments_and_checks, test_greedy).  qa's norm inside wq_b (matmul_rn) and
 * wq_b ahead of the first op list (DSV4_WQB_FIRST) give the op list's bits, with the calls each layer should
 * make (test_qa_norm_in_wqb).  A closed compressor window's tail in the op list (DSV4_EMIT_LIST) gives the bits
 * of the copy list and norm_rope op, with a norm task for every window a decode step closes, and so do its pools
 * in one pool_multi call (DSV4_POOL_MULTI) (test_emit_list).
 * The checkpoint is made by `$DSV4_BIN synth --config tiny` into a temp dir.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cpu/cpu.h"
#include "engine/engine.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "test.h"

static char g_dir[256];
static int g_ready = -1;

static const char *model_dir(void) {
    if (g_ready >= 0) return g_ready ? g_dir : NULL;
    g_ready = 0;
    const char *bin = getenv("DSV4_BIN");
    if (!bin) bin = "build/dsv4";
    snprintf(g_dir, sizeof g_dir, "/tmp/dsv4-test-forward-%d", (int)getpid());
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s synth --config tiny --seed 7 --out %s >/dev/null", bin, g_dir);
    if (system(cmd) != 0) {
        fprintf(stderr, "  cannot run '%s'\n", cmd);
        return NULL;
    }
    g_ready = 1;
    return g_dir;
}

static void cleanup_dir(void) {
    if (g_ready == 1) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
        if (system(cmd)) {
        }
    }
}

static dsv4_engine *open_engine(const char *numerics, const char **sets, int n_sets, int snapshot_every) {
    const char *dir = model_dir();
    if (!dir) return NULL;
    dsv4_engine_opts o = {.model_dir = dir, .numerics = numerics, .sets = sets, .n_sets = n_sets,
                          .snapshot_every = snapshot_every};
    dsv4_engine *e = NULL;
    dsv4_err err = {{0}};
    if (dsv4_engine_open(&e, &o, &err)) fprintf(stderr, "  open: %s\n", err.msg);
    return e;
}

static void make_tokens(int32_t *t, int n, uint32_t seed, int vocab) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        t[i] = (int32_t)((seed >> 8) % (uint32_t)vocab);
    }
}

static double max_abs(const float *a, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) m = fmax(m, fabs(a[i]));
    return m;
}
static double max_diff(const float *a, const float *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

#define T_LONG 200

/* prefill all T, then compare chunked runs (logits at the end of every chunk) and
 * token-by-token decode (logits every 9th token) against the prefill's rows */
static void check_consistency(const char *numerics) {
    dsv4_engine *e = open_engine(numerics, NULL, 0, 0);
    REQUIRE(e);
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    int V = info.vocab_size, T = T_LONG;
    int32_t tok[T_LONG];
    make_tokens(tok, T, 11, V);
    float *ref = malloc(sizeof(float) * (size_t)T * V), *got = malloc(sizeof(float) * (size_t)V);
    dsv4_err err = {{0}};
    dsv4_seq *s = NULL;
    REQUIRE(dsv4_seq_new(e, &s, &err) == 0);
    REQUIRE(dsv4_seq_append(s, tok, T, ref, 1, &err) == 0);
    CHECK_EQ_INT(dsv4_seq_len(s), T);
    double scale = max_abs(ref, T * V);
    CHECK(scale > 0 && isfinite(scale));
    dsv4_seq_free(s);
    double tol = 2e-5 * scale, worst = 0;
    static const int chunks[] = {3, 7, 16, 37, 64};
    for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
        REQUIRE(dsv4_seq_new(e, &s, &err) == 0);
        for (int at = 0; at < T; at += chunks[c]) {
            int n = T - at < chunks[c] ? T - at : chunks[c];
            REQUIRE(dsv4_seq_append(s, tok + at, n, got, 0, &err) == 0);
            double d = max_diff(got, ref + (size_t)(at + n - 1) * V, V);
            worst = fmax(worst, d);
            CHECKF(d <= tol, "%s chunk %d at %d: diff %g (scale %g)", numerics, chunks[c], at + n - 1, d, scale);
        }
        dsv4_seq_free(s);
    }
    REQUIRE(dsv4_seq_new(e, &s, &err) == 0);
    for (int t = 0; t < T; t++) {
        int want = (t % 9 == 8) || t == T - 1;
        REQUIRE(dsv4_seq_append(s, tok + t, 1, want ? got : NULL, 0, &err) == 0);
        if (want) {
            double d = max_diff(got, ref + (size_t)t * V, V);
            worst = fmax(worst, d);
            CHECKF(d <= tol, "%s decode at %d: diff %g (scale %g)", numerics, t, d, scale);
        }
    }
    printf("  %s: T=%d, logit scale %.4g, worst |prefill - chunked/decode| = %.3g\n", numerics, T, scale, worst);
    dsv4_seq_free(s);
    free(ref);
    free(got);
    dsv4_engine_close(e);
}

static void test_consistency_exact(void) { check_consistency("exact"); }
static void test_consistency_reference(void) { check_consistency("reference"); }

/* several sequences in one step, of different lengths, in chunks and single tokens */
static void test_batch_equals_separate(void) {
    dsv4_engine *e = open_engine("exact", NULL, 0, 0);
    REQUIRE(e);
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    int V = info.vocab_size;
    enum { NS = 3, T = 60 };
    int32_t tok[NS][T];
    float *sep = malloc(sizeof(float) * NS * V), *bat = malloc(sizeof(float) * NS * V);
    for (int i = 0; i < NS; i++) make_tokens(tok[i], T, 100 + i, V);
    int lens[NS] = {60, 41, 23};
    dsv4_err err = {{0}};
    for (int i = 0; i < NS; i++) {
        dsv4_seq *s = NULL;
        REQUIRE(dsv4_seq_new(e, &s, &err) == 0);
        REQUIRE(dsv4_seq_append(s, tok[i], lens[i], sep + (size_t)i * V, 0, &err) == 0);
        dsv4_seq_free(s);
    }
    dsv4_seq *s[NS];
    for (int i = 0; i < NS; i++) REQUIRE(dsv4_seq_new(e, &s[i], &err) == 0);
    int done[NS] = {0};
    /* step pattern: uneven chunks per sequence; some steps are single-token decodes */
    static const int pat[] = {5, 1, 17, 1, 1, 9, 30, 2};
    for (int step = 0;; step++) {
        dsv4_step_item items[NS];
        int n = 0;
        for (int i = 0; i < NS; i++) {
            int want = pat[(step + i) % 8];
            int left = lens[i] - done[i];
            if (left <= 0) continue;
            int take = left < want ? left : want;
            items[n++] = (dsv4_step_item){s[i], tok[i] + done[i], take, bat + (size_t)i * V};
            done[i] += take;
        }
        if (!n) break;
        REQUIRE(dsv4_engine_step(e, items, n, &err) == 0);
    }
    double scale = max_abs(sep, NS * V), d = max_diff(sep, bat, NS * V);
    CHECKF(d <= 2e-5 * scale, "batched vs separate: %g (scale %g)", d, scale);
    printf("  batched vs separate: max diff %.3g (scale %.4g)\n", d, scale);
    /* a sequence appearing twice in one step is rejected, and nothing moves */
    int64_t before = dsv4_seq_len(s[0]);
    dsv4_step_item dup[2] = {{s[0], tok[0], 1, NULL}, {s[0], tok[0], 1, NULL}};
    CHECK(dsv4_engine_step(e, dup, 2, &err) != 0);
    CHECK_EQ_INT(dsv4_seq_len(s[0]), before);
    for (int i = 0; i < NS; i++) dsv4_seq_free(s[i]);
    free(sep);
    free(bat);
    dsv4_engine_close(e);
}

/* T tokens, truncated to each of cut[0..n_cut) and extended by 30 others, against a fresh run of
 * the same tokens; T = 800 at snapshot_every 16 leaves 50 checkpoints, thinned to 28
 * (state.h DSV4_CKPT_DENSE), so the far cuts rewind past gaps and re-run more tokens */
static void check_truncate_n(int snapshot_every, int T, const int *cut, int n_cut) {
    dsv4_engine *e = open_engine("reference", NULL, 0, snapshot_every);
    REQUIRE(e);
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    int V = info.vocab_size;
    int32_t *a = malloc(sizeof(int32_t) * T), *b = malloc(sizeof(int32_t) * 30),
            *mix = malloc(sizeof(int32_t) * (T + 30));
    REQUIRE(a && b && mix);
    make_tokens(a, T, 5, V);
    make_tokens(b, 30, 6, V);
    float *x = malloc(sizeof(float) * V), *y = malloc(sizeof(float) * V);
    dsv4_err err = {{0}};
    for (int c = 0; c < n_cut; c++) {
        int L = cut[c];
        /* fresh: a[0..L) then b[0..30) */
        memcpy(mix, a, sizeof(int32_t) * L);
        memcpy(mix + L, b, sizeof(int32_t) * 30);
        dsv4_seq *f = NULL, *s = NULL;
        REQUIRE(dsv4_seq_new(e, &f, &err) == 0);
        REQUIRE(dsv4_seq_append(f, mix, L + 30, x, 0, &err) == 0);
        REQUIRE(dsv4_seq_new(e, &s, &err) == 0);
        REQUIRE(dsv4_seq_append(s, a, T, NULL, 0, &err) == 0);
        REQUIRE(dsv4_seq_truncate(s, L, &err) == 0);
        CHECK_EQ_INT(dsv4_seq_len(s), L);
        REQUIRE(dsv4_seq_append(s, b, 30, y, 0, &err) == 0);
        double d = max_diff(x, y, V), sc = max_abs(x, V);
        CHECKF(d <= 2e-5 * sc, "truncate to %d (snapshot_every %d): diff %g (scale %g)", L, snapshot_every, d, sc);
        dsv4_seq_free(f);
        dsv4_seq_free(s);
    }
    /* errors: beyond the length, negative */
    dsv4_seq *s = NULL;
    REQUIRE(dsv4_seq_new(e, &s, &err) == 0);
    REQUIRE(dsv4_seq_append(s, a, 10, NULL, 0, &err) == 0);
    CHECK(dsv4_seq_truncate(s, 11, &err) != 0);
    CHECK(strstr(err.msg, "outside") != NULL);
    CHECK(dsv4_seq_truncate(s, -1, &err) != 0);
    CHECK_EQ_INT(dsv4_seq_len(s), 10);
    dsv4_seq_free(s);
    free(x);
    free(y);
    free(a), free(b), free(mix);
    dsv4_engine_close(e);
}

static void check_truncate(int snapshot_every) {
    static const int cut[] = {77, 64, 16, 0, 149};
    check_truncate_n(snapshot_every, 150, cut, 5);
}

static void test_truncate_checkpoints(void) { check_truncate(16); }
static void test_truncate_recompute(void) { check_truncate(0); }
static void test_truncate_thinned(void) {
    static const int cut[] = {795, 610, 403, 250, 37};
    check_truncate_n(16, 800, cut, 5);
}

/* clone at a length, snapshot/restore, corrupt blobs */
static void test_clone_snapshot(void) {
    dsv4_engine *e = open_engine("exact", NULL, 0, 32);
    REQUIRE(e);
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    int V = info.vocab_size;
    enum { T = 90 };
    int32_t a[T];
    make_tokens(a, T, 9, V);
    float *x = malloc(sizeof(float) * V), *y = malloc(sizeof(float) * V);
    dsv4_err err = {{0}};
    dsv4_seq *s = NULL, *c = NULL, *r = NULL, *f = NULL;
    REQUIRE(dsv4_seq_new(e, &s, &err) == 0);
    REQUIRE(dsv4_seq_append(s, a, T, NULL, 0, &err) == 0);
    REQUIRE(dsv4_seq_clone(s, 50, &c, &err) == 0);
    CHECK_EQ_INT(dsv4_seq_len(c), 50);
    CHECK_EQ_INT(dsv4_seq_len(s), T);
    REQUIRE(dsv4_seq_new(e, &f, &err) == 0);
    REQUIRE(dsv4_seq_append(f, a, 51, x, 0, &err) == 0);
    REQUIRE(dsv4_seq_append(c, a + 50, 1, y, 0, &err) == 0);
    CHECK(max_diff(x, y, V) <= 2e-5 * max_abs(x, V));
    /* snapshot the original, restore into a fresh sequence, extend both identically */
    void *blob = NULL;
    size_t nb = 0;
    REQUIRE(dsv4_seq_snapshot(s, &blob, &nb, &err) == 0);
    CHECK(nb > 0);
    REQUIRE(dsv4_seq_new(e, &r, &err) == 0);
    REQUIRE(dsv4_seq_restore(r, blob, nb, &err) == 0);
    CHECK_EQ_INT(dsv4_seq_len(r), T);
    int32_t next = 1234;
    REQUIRE(dsv4_seq_append(s, &next, 1, x, 0, &err) == 0);
    REQUIRE(dsv4_seq_append(r, &next, 1, y, 0, &err) == 0);
    CHECK(max_diff(x, y, V) == 0);
    /* truncating the restored copy uses its restored checkpoints */
    REQUIRE(dsv4_seq_truncate(r, 70, &err) == 0);
    CHECK_EQ_INT(dsv4_seq_len(r), 70);
    /* corrupt: truncated, flipped magic; the target is unchanged */
    int64_t before = dsv4_seq_len(r);
    CHECK(dsv4_seq_restore(r, blob, nb / 2, &err) != 0);
    CHECK(strstr(err.msg, "restore") != NULL);
    ((unsigned char *)blob)[0] ^= 0xff;
    CHECK(dsv4_seq_restore(r, blob, nb, &err) != 0);
    CHECK(strstr(err.msg, "magic") != NULL);
    CHECK_EQ_INT(dsv4_seq_len(r), before);
    free(blob);
    /* a snapshot from another numerics is refused */
    dsv4_engine *e2 = open_engine("reference", NULL, 0, 32);
    REQUIRE(e2);
    dsv4_seq *o = NULL;
    REQUIRE(dsv4_seq_new(e2, &o, &err) == 0);
    REQUIRE(dsv4_seq_append(o, a, 5, NULL, 0, &err) == 0);
    REQUIRE(dsv4_seq_snapshot(o, &blob, &nb, &err) == 0);
    CHECK(dsv4_seq_restore(r, blob, nb, &err) != 0);
    CHECK(strstr(err.msg, "different model or numerics") != NULL);
    free(blob);
    printf("  state bytes after %d tokens: %zu\n", T + 1, dsv4_seq_state_bytes(s));
    dsv4_seq_free(o);
    dsv4_engine_close(e2);
    dsv4_seq_free(s);
    dsv4_seq_free(c);
    dsv4_seq_free(r);
    dsv4_seq_free(f);
    free(x);
    free(y);
    dsv4_engine_close(e);
}

/* ----- tracing ----- */
typedef struct {
    int n, hash_checked, hash_bad, picks_seen, max_picks;
    double worst_sum_err;
    double expect;
    const int64_t *tid2eid;
    int k;
} trace_acc;

static void on_trace(const dsv4_trace_event *ev, void *user) {
    trace_acc *t = user;
    double s = 0;
    for (int i = 0; i < ev->n_experts; i++) s += ev->weights[i];
    t->worst_sum_err = fmax(t->worst_sum_err, fabs(s - t->expect));
    t->n++;
    if (ev->is_hash && t->tid2eid) {
        t->hash_checked++;
        for (int i = 0; i < ev->n_experts; i++)
            if (ev->experts[i] != t->tid2eid[(int64_t)ev->token * t->k + i]) t->hash_bad++;
    }
    if (ev->picks) {
        t->picks_seen++;
        if (ev->n_picks > t->max_picks) t->max_picks = ev->n_picks;
    }
}

static void run_traced(const char **sets, int n_sets, trace_acc *acc) {
    dsv4_engine *e = open_engine("exact", sets, n_sets, 0);
    REQUIRE(e);
    dsv4_engine_set_trace(e, on_trace, acc);
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    int32_t tok[80];
    make_tokens(tok, 80, 3, info.vocab_size);
    dsv4_err err = {{0}};
    dsv4_seq *s = NULL;
    REQUIRE(dsv4_seq_new(e, &s, &err) == 0);
    REQUIRE(dsv4_seq_append(s, tok, 50, NULL, 0, &err) == 0);
    for (int i = 50; i < 80; i++) REQUIRE(dsv4_seq_append(s, tok + i, 1, NULL, 0, &err) == 0);
    dsv4_seq_free(s);
    dsv4_engine_close(e);
}

static void test_trace_invariant(void) {
    const char *dir = model_dir();
    REQUIRE(dir);
    /* read tid2eid of layer 0 straight from the checkpoint, independently of the engine */
    dsv4_st *st = NULL;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_st_open(&st, dir, &err) == 0);
    const dsv4_tensor *t = dsv4_st_find(st, "layers.0.ffn.gate.tid2eid");
    REQUIRE(t && t->dtype == DSV4_DT_I64 && t->ndim == 2);
    trace_acc acc = {.expect = 1.5, .tid2eid = t->data, .k = (int)t->shape[1]};
    run_traced(NULL, 0, &acc);
    CHECK(acc.n == 80 * 5);                    /* 5 trunk layers x 80 tokens */
    CHECK(acc.hash_checked == 80 * 2);         /* 2 hash layers; layer 1 compared to layer 0's table below */
    CHECKF(acc.worst_sum_err < 1e-5, "routed weights sum off by %g", acc.worst_sum_err);
    CHECK(acc.picks_seen > 0 && acc.max_picks == 4); /* index_topk < visible rows at the end */
    printf("  trace: %d events, worst |sum - 1.5| = %.2g, hash events %d, max picks %d\n", acc.n,
           acc.worst_sum_err, acc.hash_checked, acc.max_picks);
    /* the same check catches the double application */
    const char *both[] = {"moe.route_scale=both"};
    trace_acc bad = {.expect = 1.5};
    run_traced(both, 1, &bad);
    CHECKF(bad.worst_sum_err > 0.5, "route_scale=both not caught: worst %g", bad.worst_sum_err);
    printf("  moe.route_scale=both: worst |sum - 1.5| = %.3g (caught)\n", bad.worst_sum_err);
    /* `output` applies the factor once, after the experts: still 1.5 as applied */
    const char *outp[] = {"moe.route_scale=output"};
    trace_acc o = {.expect = 1.5};
    run_traced(outp, 1, &o);
    CHECK(o.worst_sum_err < 1e-5);
    dsv4_st_close(st);
}

/* hash layer 1 uses its own table: check it too */
static void test_hash_routing_layer1(void) {
    const char *dir = model_dir();
    REQUIRE(dir);
    dsv4_st *st = NULL;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_st_open(&st, dir, &err) == 0);
    const dsv4_tensor *t0 = dsv4_st_find(st, "layers.0.ffn.gate.tid2eid");
    const dsv4_tensor *t1 = dsv4_st_find(st, "layers.1.ffn.gate.tid2eid");
    REQUIRE(t0 && t1);
    CHECK(memcmp(t0->data, t1->data, t0->nbytes) != 0); /* distinct tables, so the check below means something */
    dsv4_st_close(st);
}

/* ----- every switch's distance from exact ----- */
static void test_switch_distances(void) {
    dsv4_engine *e = open_engine("exact", NULL, 0, 0);
    REQUIRE(e);
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    int V = info.vocab_size;
    enum { T = 120 };
    int32_t tok[T];
    make_tokens(tok, T, 21, V);
    float *ex = malloc(sizeof(float) * V * 4), *sw = malloc(sizeof(float) * V * 4);
    dsv4_err err = {{0}};
    dsv4_seq *s = NULL;
    /* logits at 4 positions: 30, 60, 90, 119 */
    static const int at[4] = {30, 60, 90, 119};
#define RUN(eng, out)                                                                                  \
    do {                                                                                               \
        REQUIRE(dsv4_seq_new(eng, &s, &err) == 0);                                                     \
        int prev = 0;                                                                                  \
        for (int i = 0; i < 4; i++) {                                                                  \
            REQUIRE(dsv4_seq_append(s, tok + prev, at[i] + 1 - prev, (out) + (size_t)i * V, 0, &err) == 0); \
            prev = at[i] + 1;                                                                          \
        }                                                                                              \
        dsv4_seq_free(s);                                                                              \
    } while (0)
    RUN(e, ex);
    dsv4_engine_close(e);
    double scale = max_abs(ex, 4 * V);
    static const char *settings[] = {"linear.act=fp8",    "act.bf16=on",         "kv.sim=fp8",
                                     "indexer.sim=fp4",   "hc.state=bf16",       "moe.weight=before_w2",
                                     "attn.prob=bf16",    "indexer.score=bf16",  "mhc.gemm=bf16",
                                     "indexer.keys=bf16", "indexer.keys=fp8",    "indexer.keys=fp4",
                                     "moe.route_scale=output", "moe.route_scale=both"};
    printf("  distance from exact at 4 positions (T=%d, logit scale %.4g):\n", T, scale);
    for (size_t i = 0; i < sizeof settings / sizeof settings[0]; i++) {
        e = open_engine("exact", &settings[i], 1, 0);
        REQUIRE(e);
        RUN(e, sw);
        dsv4_engine_close(e);
        double mx = 0, mean = 0;
        for (int j = 0; j < 4 * V; j++) {
            double d = fabs((double)ex[j] - sw[j]);
            mx = fmax(mx, d);
            mean += d;
        }
        mean /= 4.0 * V;
        printf("    %-24s max %.4g  mean %.4g\n", settings[i], mx, mean);
        /* indexer.keys=bf16 only moves scores by bf16 rounding: it changes logits only if a
         * pick changes, which these positions need not show */
        if (strcmp(settings[i], "indexer.keys=bf16")) CHECKF(mx > 0, "%s had no effect", settings[i]);
        CHECK(isfinite(mx));
        if (!strcmp(settings[i], "moe.route_scale=both")) CHECK(mx > 1e-3 * scale);
    }
    e = open_engine("reference", NULL, 0, 0);
    REQUIRE(e);
    RUN(e, sw);
    dsv4_engine_close(e);
    printf("    %-24s max %.4g\n", "profile reference", max_diff(ex, sw, 4 * V));
#undef RUN
    free(ex);
    free(sw);
}

/* ----- bad input never crashes and leaves state unchanged ----- */
static void test_bad_input(void) {
    dsv4_engine *e = open_engine("exact", NULL, 0, 0);
    REQUIRE(e);
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    dsv4_err err = {{0}};
    dsv4_seq *s = NULL;
    REQUIRE(dsv4_seq_new(e, &s, &err) == 0);
    int32_t bad[3] = {1, info.vocab_size, 2};
    CHECK(dsv4_seq_append(s, bad, 3, NULL, 0, &err) != 0);
    CHECK(strstr(err.msg, "outside the vocabulary") != NULL);
    CHECK_EQ_INT(dsv4_seq_len(s), 0);
    int32_t neg = -5;
    CHECK(dsv4_seq_append(s, &neg, 1, NULL, 0, &err) != 0);
    CHECK(dsv4_seq_append(s, bad, 0, NULL, 0, &err) != 0);
    float *lg = malloc(sizeof(float) * info.vocab_size);
    CHECK(dsv4_seq_draft(s, 3, lg, &err) != 0); /* empty sequence */
    CHECK(strstr(err.msg, "empty") != NULL);
    int32_t ok[4] = {1, 2, 3, 4};
    REQUIRE(dsv4_seq_append(s, ok, 4, NULL, 0, &err) == 0);
    CHECK(dsv4_seq_draft(s, info.vocab_size + 3, lg, &err) != 0);
    /* the MTP draft is deterministic and does not move the sequence */
    float *lg2 = malloc(sizeof(float) * info.vocab_size);
    REQUIRE(dsv4_seq_draft(s, 7, lg, &err) == 0);
    REQUIRE(dsv4_seq_draft(s, 7, lg2, &err) == 0);
    CHECK(max_diff(lg, lg2, info.vocab_size) == 0);
    CHECK(isfinite(max_abs(lg, info.vocab_size)) && max_abs(lg, info.vocab_size) > 0);
    CHECK_EQ_INT(dsv4_seq_len(s), 4);
    dsv4_seq_free(s);
    dsv4_engine_close(e);
    free(lg);
    free(lg2);
    /* open errors */
    dsv4_engine_opts o = {.model_dir = model_dir(), .numerics = "fast"};
    CHECK(dsv4_engine_open(&e, &o, &err) != 0);
    CHECK(strstr(err.msg, "unknown numerics profile") != NULL);
    const char *set1[] = {"kv.sim=fp16"};
    o = (dsv4_engine_opts){.model_dir = model_dir(), .sets = set1, .n_sets = 1};
    CHECK(dsv4_engine_open(&e, &o, &err) != 0);
    CHECK(strstr(err.msg, "none|fp8") != NULL);
    const char *set2[] = {"nope=1"};
    o = (dsv4_engine_opts){.model_dir = model_dir(), .sets = set2, .n_sets = 1};
    CHECK(dsv4_engine_open(&e, &o, &err) != 0);
    CHECK(strstr(err.msg, "unknown switch 'nope'") != NULL);
    o = (dsv4_engine_opts){.model_dir = "/nonexistent/dir"};
    CHECK(dsv4_engine_open(&e, &o, &err) != 0);
    CHECK(strstr(err.msg, "/nonexistent/dir") != NULL);
    o = (dsv4_engine_opts){.model_dir = model_dir(), .backend = "tpu"};
    CHECK(dsv4_engine_open(&e, &o, &err) != 0);
    CHECK(strstr(err.msg, "tpu") != NULL);
}

/* the tiny model below the engine API (to see or wrap the backend): config, checkpoint, bound
 * weights, a CPU backend; 0 or -1 */
typedef struct {
    dsv4_config cfg;
    dsv4_st *st;
    dsv4_model_w w;
    dsv4_backend be;
} low_model;

static int low_open(low_model *lm) {
    memset(lm, 0, sizeof *lm);
    const char *dir = model_dir();
    dsv4_err err = {{0}};
    char cp[512];
    if (!dir) return -1;
    snprintf(cp, sizeof cp, "%s/config.json", dir);
    if (dsv4_config_load(&lm->cfg, cp, &err) || dsv4_st_open(&lm->st, dir, &err)) goto fail;
    if (dsv4_weights_bind(&lm->w, &lm->cfg, lm->st, &err)) goto fail_st;
    if (dsv4_backend_cpu_init(&lm->be, 0, &err)) goto fail_w;
    return 0;
fail_w:
    dsv4_weights_free(&lm->w);
fail_st:
    dsv4_st_close(lm->st);
fail:
    fprintf(stderr, "  low_open: %s\n", err.msg);
    return -1;
}

static void low_close(low_model *lm) {
    dsv4_backend_cpu_free(&lm->be);
    dsv4_weights_free(&lm->w);
    dsv4_st_close(lm->st);
}

/* STYLE §3: after warm-up a decode step allocates no scratch (the CPU arena has grown
 * to its high-water mark); driven below the engine API to see the backend. */
static void test_no_scratch_growth_in_decode(void) {
    dsv4_err err = {{0}};
    low_model lm;
    REQUIRE(low_open(&lm) == 0);
    dsv4_config cfg = lm.cfg;
    dsv4_backend *be = &lm.be;
    dsv4_model *m = NULL;
    REQUIRE(dsv4_model_init(&m, &lm.w, be, &DSV4_NUMERICS_REFERENCE, 64, &err) == 0);
    dsv4_state *s = NULL;
    REQUIRE(dsv4_state_new(&s, &cfg, 0, &err) == 0);
    int32_t tok[64];
    make_tokens(tok, 64, 77, cfg.vocab_size);
    float *lg = malloc(sizeof(float) * cfg.vocab_size);
    dsv4_fwd_item it = {.st = s, .tokens = tok, .n = 40, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0); /* prefill */
    for (int i = 40; i < 44; i++) {              /* warm-up decode */
        it = (dsv4_fwd_item){.st = s, .tokens = tok + i, .n = 1, .logits = lg};
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    }
    long before = dsv4_backend_cpu_spills(be);
    CHECK(before > 0); /* the first calls did grow the arena: the counter works */
    for (int i = 44; i < 64; i++) {
        it = (dsv4_fwd_item){.st = s, .tokens = tok + i, .n = 1, .logits = lg};
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    }
    CHECKF(dsv4_backend_cpu_spills(be) == before, "scratch spills grew from %ld to %ld during decode", before,
           dsv4_backend_cpu_spills(be));
    free(lg);
    dsv4_state_free(s);
    dsv4_model_free(m);
    low_close(&lm);
}

/* The forward pass's contract with a device backend, seen through the CPU backend with a
 * recording segment op and a check op that can fail on request (backend.h):
 * - segment marks of a decode step: embedding, layer 0, layer 0's MoE half, every other layer,
 *   end of the layers, head (one graph each on CUDA);
 * - one check per step, after the head (each check is a device wait), none at the end;
 * - a failing check fails the call and commits nothing: the sequence keeps its length and the
 *   same step run again gives the logits of a run that never failed. */
static struct {
    int keys[64], n_keys, checks, fail_at, fail_from; /* fail_from: every check from that one on */
} g_rec;

static void rec_segment(dsv4_backend *b, int key) {
    (void)b;
    if (g_rec.n_keys < 64) g_rec.keys[g_rec.n_keys] = key;
    g_rec.n_keys++;
}

static int rec_check(dsv4_backend *b, dsv4_err *err) {
    (void)b;
    g_rec.checks++;
    if (g_rec.checks == g_rec.fail_at || (g_rec.fail_from && g_rec.checks >= g_rec.fail_from))
        return dsv4_errf(err, "injected device failure");
    return 0;
}

static void test_segments_and_checks(void) {
    dsv4_err err = {{0}};
    low_model lm;
    REQUIRE(low_open(&lm) == 0);
    dsv4_config cfg = lm.cfg;
    dsv4_backend *be = &lm.be;
    dsv4_backend_ops ops = *be->ops; /* the CPU ops, plus the two under test */
    const dsv4_backend_ops *cpu_ops = be->ops;
    ops.segment = rec_segment;
    ops.check = rec_check;
    be->ops = &ops;
    dsv4_model *m = NULL;
    REQUIRE(dsv4_model_init(&m, &lm.w, be, &DSV4_NUMERICS_EXACT, 64, &err) == 0);
    dsv4_state *s = NULL, *ref = NULL;
    REQUIRE(dsv4_state_new(&s, &cfg, 0, &err) == 0);
    REQUIRE(dsv4_state_new(&ref, &cfg, 0, &err) == 0);
    int32_t tok[32];
    make_tokens(tok, 32, 91, cfg.vocab_size);
    float *lg = malloc(sizeof(float) * cfg.vocab_size), *lr = malloc(sizeof(float) * cfg.vocab_size);
    REQUIRE(lg && lr);
    memset(&g_rec, 0, sizeof g_rec);
    dsv4_fwd_item it = {.st = s, .tokens = tok, .n = 20, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    it = (dsv4_fwd_item){.st = ref, .tokens = tok, .n = 20, .logits = lr};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    /* one decode step: its marks and its checks */
    memset(&g_rec, 0, sizeof g_rec);
    it = (dsv4_fwd_item){.st = s, .tokens = tok + 20, .n = 1, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    int L = cfg.n_layers, n_all = dsv4_config_total_layers(&cfg), want[64], nw = 0;
    want[nw++] = n_all + 1;
    for (int l = 0; l < L && nw < 60; l++) {
        want[nw++] = l;
        if (l == 0) want[nw++] = n_all + 3; /* layer 0: wq_b onwards */
        if (l == 0) want[nw++] = n_all + 2; /* layer 0: the MoE half */
    }
    want[nw++] = -1;
    want[nw++] = n_all;
    CHECKF(g_rec.n_keys == nw, "%d segment marks in a decode step, expected %d", g_rec.n_keys, nw);
    for (int i = 0; i < nw && i < g_rec.n_keys && i < 64; i++)
        CHECKF(g_rec.keys[i] == want[i], "segment mark %d is %d, expected %d", i, g_rec.keys[i], want[i]);
    CHECKF(g_rec.checks == 1, "%d checks in a decode step, expected 1", g_rec.checks);
    /* the reference sequence takes the same step: same logits (nothing differs so far) */
    it = (dsv4_fwd_item){.st = ref, .tokens = tok + 20, .n = 1, .logits = lr};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    CHECK(memcmp(lg, lr, sizeof(float) * cfg.vocab_size) == 0);
    /* a failing check: the call fails, the length stays, the retry matches the reference */
    int64_t len = s->len;
    memset(&g_rec, 0, sizeof g_rec);
    g_rec.fail_at = 1;
    it = (dsv4_fwd_item){.st = s, .tokens = tok + 21, .n = 1, .logits = lg};
    CHECK(dsv4_forward(m, &it, 1, &err) != 0);
    CHECK(strstr(err.msg, "injected device failure") != NULL);
    CHECKF(s->len == len, "length %lld after a failed step, was %lld", (long long)s->len, (long long)len);
    g_rec.fail_at = 0;
    err.msg[0] = 0;
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    it = (dsv4_fwd_item){.st = ref, .tokens = tok + 21, .n = 1, .logits = lr};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    CHECK(s->len == ref->len);
    CHECK(memcmp(lg, lr, sizeof(float) * cfg.vocab_size) == 0);
    /* and the step after it still matches (the failed step's state writes were overwritten) */
    it = (dsv4_fwd_item){.st = s, .tokens = tok + 22, .n = 2, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    it = (dsv4_fwd_item){.st = ref, .tokens = tok + 22, .n = 2, .logits = lr};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    CHECK(memcmp(lg, lr, sizeof(float) * cfg.vocab_size) == 0);
    /* a failing step at a position that closes compressor windows (every ratio divides 28): the
     * retry and the steps after it still match */
    it = (dsv4_fwd_item){.st = s, .tokens = tok + 24, .n = 3, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    it = (dsv4_fwd_item){.st = ref, .tokens = tok + 24, .n = 3, .logits = lr};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    memset(&g_rec, 0, sizeof g_rec);
    g_rec.fail_at = 1;
    it = (dsv4_fwd_item){.st = s, .tokens = tok + 27, .n = 1, .logits = lg};
    CHECK(dsv4_forward(m, &it, 1, &err) != 0);
    CHECK(s->len == 27);
    g_rec.fail_at = 0;
    for (int p = 27; p < 32; p++) {
        it = (dsv4_fwd_item){.st = s, .tokens = tok + p, .n = 1, .logits = lg};
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
        it = (dsv4_fwd_item){.st = ref, .tokens = tok + p, .n = 1, .logits = lr};
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
        CHECKF(memcmp(lg, lr, sizeof(float) * cfg.vocab_size) == 0, "position %d after a failed emitting step", p);
    }
    free(lg), free(lr);
    dsv4_state_free(s);
    dsv4_state_free(ref);
    dsv4_model_free(m);
    be->ops = cpu_ops;
    low_close(&lm);
}

/* max_position_embeddings bounds every sequence (the scheduler's ctx did; the engine API did
 * not): a step that would pass it fails and changes nothing, up to it runs */
static void test_max_position(void) {
    dsv4_err err = {{0}};
    low_model lm;
    REQUIRE(low_open(&lm) == 0);
    lm.w.cfg.max_position = 40; /* the model reads the bound weights' copy of the config */
    dsv4_model *m = NULL;
    REQUIRE(dsv4_model_init(&m, &lm.w, &lm.be, &DSV4_NUMERICS_EXACT, 64, &err) == 0);
    dsv4_state *s = NULL;
    REQUIRE(dsv4_state_new(&s, &lm.cfg, 0, &err) == 0);
    int32_t tok[41], out[4];
    make_tokens(tok, 41, 5, lm.cfg.vocab_size);
    dsv4_fwd_item it = {.st = s, .tokens = tok, .n = 38};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    it = (dsv4_fwd_item){.st = s, .tokens = tok + 38, .n = 3};
    CHECK(dsv4_forward(m, &it, 1, &err) != 0);
    printf("  38 + 3 tokens at max_position 40: %s\n", err.msg);
    CHECK(strstr(err.msg, "max_position_embeddings") != NULL && strstr(err.msg, "41") != NULL);
    CHECK(s->len == 38);
    CHECK(dsv4_forward_greedy(m, s, tok[38], 3, out, &err) != 0);
    CHECK(strstr(err.msg, "max_position_embeddings") != NULL && s->len == 38);
    it = (dsv4_fwd_item){.st = s, .tokens = tok + 38, .n = 2};
    CHECK(dsv4_forward(m, &it, 1, &err) == 0 && s->len == 40);
    dsv4_state_free(s);
    dsv4_model_free(m);
    low_close(&lm);
}

/* A step whose second sub-batch fails (its check, after the first sub-batch committed): both
 * sequences must be back at their lengths, as the scheduler's per-item retry assumes, and the
 * retried step must give the logits of a run that never failed.  Sequence a's chunk crosses a
 * checkpoint (the cut into sub-batches), b decodes one token in the first sub-batch.  Before
 * the fix, a kept the part before the checkpoint and b its token, so the retry appended them
 * twice. */
static void test_failed_later_subbatch(void) {
    dsv4_err err = {{0}};
    low_model lm;
    REQUIRE(low_open(&lm) == 0);
    dsv4_config cfg = lm.cfg;
    dsv4_backend *be = &lm.be;
    dsv4_backend_ops ops = *be->ops;
    const dsv4_backend_ops *cpu_ops = be->ops;
    ops.check = rec_check;
    be->ops = &ops;
    dsv4_model *m = NULL;
    REQUIRE(dsv4_model_init(&m, &lm.w, be, &DSV4_NUMERICS_EXACT, 64, &err) == 0);
    dsv4_state *st[4] = {NULL, NULL, NULL, NULL}; /* a, b, and their references */
    for (int i = 0; i < 4; i++) REQUIRE(dsv4_state_new(&st[i], &cfg, 1, &err) == 0);
    int64_t P = st[0]->snapshot_every;
    REQUIRE(P >= 4 && P <= 200);
    int32_t tok[512];
    make_tokens(tok, 512, 77, cfg.vocab_size);
    size_t V = (size_t)cfg.vocab_size;
    float *lg = malloc(sizeof(float) * 4 * V);
    REQUIRE(lg);
    memset(&g_rec, 0, sizeof g_rec);
    for (int i = 0; i < 4; i++) { /* a: P - 2 tokens, b: 5 */
        dsv4_fwd_item it = {.st = st[i], .tokens = tok, .n = i % 2 ? 5 : (int)P - 2, .logits = lg};
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    }
    const int32_t *ta = tok + 300, *tb = tok + 400;
    dsv4_fwd_item step[2] = {{.st = st[0], .tokens = ta, .n = 5, .logits = lg}, {.st = st[1], .tokens = tb, .n = 1,
                                                                                  .logits = lg + V}};
    memset(&g_rec, 0, sizeof g_rec);
    g_rec.fail_at = 2; /* the second sub-batch's check */
    int rc = dsv4_forward(m, step, 2, &err);
    printf("  step of a (%lld + 5 tokens, checkpoint every %lld) and b (5 + 1), the second sub-batch failing: rc %d "
           "(%s), checks %d, lengths after: a %lld, b %lld\n",
           (long long)(P - 2), (long long)P, rc, rc ? err.msg : "", g_rec.checks, (long long)st[0]->len,
           (long long)st[1]->len);
    CHECK(rc != 0 && strstr(err.msg, "injected device failure") != NULL);
    CHECKF(st[0]->len == P - 2, "a's length %lld after the failed step, was %lld", (long long)st[0]->len,
           (long long)(P - 2));
    CHECKF(st[1]->len == 5, "b's length %lld after the failed step, was 5", (long long)st[1]->len);
    g_rec.fail_at = 0;
    err.msg[0] = 0;
    REQUIRE(dsv4_forward(m, step, 2, &err) == 0);
    dsv4_fwd_item refs[2] = {{.st = st[2], .tokens = ta, .n = 5, .logits = lg + 2 * V},
                             {.st = st[3], .tokens = tb, .n = 1, .logits = lg + 3 * V}};
    REQUIRE(dsv4_forward(m, refs, 2, &err) == 0);
    CHECK(st[0]->len == st[2]->len && st[1]->len == st[3]->len);
    CHECKF(memcmp(lg, lg + 2 * V, sizeof(float) * V) == 0, "a's logits after the retry differ from the reference");
    CHECKF(memcmp(lg + V, lg + 3 * V, sizeof(float) * V) == 0, "b's logits after the retry differ from the reference");
    for (int i = 0; i < 4; i++) { /* the next token of each: the states match too */
        dsv4_fwd_item it = {.st = st[i], .tokens = tok + 450 + i % 2, .n = 1, .logits = lg + (size_t)i * V};
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    }
    CHECK(memcmp(lg, lg + 2 * V, sizeof(float) * V) == 0);
    CHECK(memcmp(lg + V, lg + 3 * V, sizeof(float) * V) == 0);
    /* a device that keeps failing: the restores' re-runs fail too, so both sequences are marked
     * unusable; every later use says so, until a truncate to 0 resets them */
    int64_t la = st[0]->len;
    step[0].tokens = tok + 460, step[1].tokens = tok + 470;
    step[0].n = (int)(P - la % P) + 2; /* across the next checkpoint again */
    memset(&g_rec, 0, sizeof g_rec);
    g_rec.fail_from = 2;
    err.msg[0] = 0;
    CHECK(dsv4_forward(m, step, 2, &err) != 0);
    printf("  the same with every later check failing: %s; broken a %d b %d\n", err.msg, st[0]->broken,
           st[1]->broken);
    CHECK(strstr(err.msg, "restoring the sequences") != NULL);
    CHECK(st[0]->broken && st[1]->broken);
    g_rec.fail_from = 0;
    dsv4_fwd_item one = {.st = st[0], .tokens = tok, .n = 1, .logits = lg};
    CHECK(dsv4_forward(m, &one, 1, &err) != 0 && strstr(err.msg, "unusable") != NULL);
    int32_t gout[2];
    CHECK(dsv4_forward_greedy(m, st[1], tok[0], 2, gout, &err) != 0 && strstr(err.msg, "unusable") != NULL);
    dsv4_state *cl = NULL;
    CHECK(dsv4_state_clone(st[0], &cl, &err) != 0 && cl == NULL);
    CHECK(dsv4_forward_truncate(m, st[0], la > 0 ? 1 : 0, &err) != 0);
    CHECK(dsv4_forward_truncate(m, st[0], 0, &err) == 0 && !st[0]->broken && st[0]->len == 0);
    /* reset, a sequence runs as a fresh one */
    dsv4_state *fresh = NULL;
    REQUIRE(dsv4_state_new(&fresh, &cfg, 1, &err) == 0);
    one = (dsv4_fwd_item){.st = st[0], .tokens = tok, .n = 9, .logits = lg};
    REQUIRE(dsv4_forward(m, &one, 1, &err) == 0);
    one = (dsv4_fwd_item){.st = fresh, .tokens = tok, .n = 9, .logits = lg + V};
    REQUIRE(dsv4_forward(m, &one, 1, &err) == 0);
    CHECK(memcmp(lg, lg + V, sizeof(float) * V) == 0);
    dsv4_state_free(fresh);
    free(lg);
    for (int i = 0; i < 4; i++) dsv4_state_free(st[i]);
    dsv4_model_free(m);
    be->ops = cpu_ops;
    low_close(&lm);
}

/* ----- hc_post_pre_norm in the forward pass ----- */
static struct {
    long fused, pre, pre_norm, post, traced[4];
    long lg_out, lg_in, post_bad; /* calls writing / reading logits (DSV4_HC_COMB*_LOGITS); hc_post given no matrix */
} g_hc;
static const dsv4_backend_ops *g_hc_cpu;

static void cnt_fused(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post_in,
                      const float *comb_in, int state_bf16, float *y, float *post, float *comb, int rows, int hc,
                      int dim, const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                      float norm_eps, float hc_eps, int gemm_bf16, int out_bf16, const dsv4_weight *y_norm,
                      float y_eps) {
    g_hc.fused++;
    g_hc.lg_out += (iters & DSV4_HC_COMB_LOGITS) != 0;
    g_hc.lg_in += (iters & DSV4_HC_COMBIN_LOGITS) != 0;
    g_hc_cpu->hc_post_pre_norm(b, Xout, o, R, post_in, comb_in, state_bf16, y, post, comb, rows, hc, dim, fn, base,
                               scale, iters, norm_eps, hc_eps, gemm_bf16, out_bf16, y_norm, y_eps);
}

static void cnt_pre(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc, int dim,
                    const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                    float norm_eps, float hc_eps, int gemm_bf16, int out_bf16) {
    g_hc.pre++;
    g_hc_cpu->hc_pre(b, y, post, comb, X, rows, hc, dim, fn, base, scale, iters, norm_eps, hc_eps, gemm_bf16,
                     out_bf16);
}

static void cnt_pre_norm(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc,
                         int dim, const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                         float norm_eps, float hc_eps, int gemm_bf16, int out_bf16, const dsv4_weight *y_norm,
                         float y_eps) {
    g_hc.pre_norm++;
    g_hc.lg_out += (iters & DSV4_HC_COMB_LOGITS) != 0;
    g_hc_cpu->hc_pre_norm(b, y, post, comb, X, rows, hc, dim, fn, base, scale, iters, norm_eps, hc_eps, gemm_bf16,
                          out_bf16, y_norm, y_eps);
}

static void cnt_post(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post,
                     const float *comb, int rows, int hc, int dim, int state_bf16) {
    g_hc.post++;
    /* the plain hc_post must get Sinkhorn's matrix, never deferred logits: every column sums to ~1 */
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < hc; k++) {
            float cs = 0;
            for (int j = 0; j < hc; j++) cs += comb[(size_t)r * hc * hc + j * hc + k];
            g_hc.post_bad += !(fabsf(cs - 1.0f) < 1e-3f);
        }
    g_hc_cpu->hc_post(b, Xout, o, R, post, comb, rows, hc, dim, state_bf16);
}

static void hc_trace(void *user, const dsv4_op_info *info) {
    (void)user;
    static const char *const names[4] = {"attn.hc_pre", "attn.hc_post", "ffn.hc_pre", "ffn.hc_post"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(info->op, names[i])) g_hc.traced[i]++;
}

/* mode 0: the op missing (two ops), 1: fused, 2: fused op present with a layer-diff trace set,
 * 3: fused with Sinkhorn deferred to the fused op that reads comb (DSV4_HC_DEFER=1).
 * Runs a prefill of 19 tokens in sub-batches of 8 rows, two decode steps, a step of two
 * sequences and an MTP draft; logits of each into lg (5 x vocab); op counts of the decode
 * step into cnt (the g_hc of that step). */
static void hc_fused_run(low_model *lm, const dsv4_numerics *num, int mode, float *lg, long cnt[11]) {
    dsv4_err err = {{0}};
    dsv4_config *c = &lm->cfg;
    dsv4_backend_ops ops = *g_hc_cpu;
    ops.hc_post_pre_norm = mode ? cnt_fused : NULL;
    ops.hc_pre = cnt_pre;
    ops.hc_pre_norm = cnt_pre_norm;
    ops.hc_post = cnt_post;
    lm->be.ops = &ops;
    dsv4_model *m = NULL;
    dsv4_state *s = NULL, *s2 = NULL;
    if (mode == 3) setenv("DSV4_HC_DEFER", "1", 1);
    REQUIRE(dsv4_model_init(&m, &lm->w, &lm->be, num, 8, &err) == 0);
    unsetenv("DSV4_HC_DEFER");
    memset(&g_hc, 0, sizeof g_hc);
    if (mode == 2) dsv4_model_set_op_trace(m, hc_trace, NULL);
    REQUIRE(dsv4_state_new(&s, c, 0, &err) == 0);
    REQUIRE(dsv4_state_new(&s2, c, 0, &err) == 0);
    int32_t tok[32];
    make_tokens(tok, 32, 123, c->vocab_size);
    size_t V = (size_t)c->vocab_size;
    dsv4_fwd_item it = {.st = s, .tokens = tok, .n = 19, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    it = (dsv4_fwd_item){.st = s2, .tokens = tok + 19, .n = 5, .logits = lg + V};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    long bad = g_hc.post_bad;
    memset(&g_hc, 0, sizeof g_hc);
    it = (dsv4_fwd_item){.st = s, .tokens = tok + 24, .n = 1, .logits = lg + 2 * V};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    cnt[0] = g_hc.fused, cnt[1] = g_hc.pre, cnt[2] = g_hc.pre_norm, cnt[3] = g_hc.post;
    for (int i = 0; i < 4; i++) cnt[4 + i] = g_hc.traced[i];
    cnt[8] = g_hc.lg_out, cnt[9] = g_hc.lg_in;
    bad += g_hc.post_bad;
    g_hc.post_bad = 0;
    dsv4_fwd_item two[2] = {{.st = s, .tokens = tok + 25, .n = 1, .logits = lg + 3 * V},
                            {.st = s2, .tokens = tok + 26, .n = 3, .logits = lg + 4 * V}};
    REQUIRE(dsv4_forward(m, two, 2, &err) == 0);
    if (c->n_mtp > 0) REQUIRE(dsv4_forward_mtp(m, s, 0, tok[27], lg + 5 * V, &err) == 0);
    cnt[10] = bad + g_hc.post_bad;
    dsv4_state_free(s);
    dsv4_state_free(s2);
    dsv4_model_free(m);
    lm->be.ops = g_hc_cpu;
}

static void test_hc_fused_pair(void) {
    low_model lm;
    REQUIRE(low_open(&lm) == 0);
    g_hc_cpu = lm.be.ops;
    REQUIRE(g_hc_cpu->hc_post_pre_norm != NULL);
    size_t V = (size_t)lm.cfg.vocab_size;
    int L = lm.cfg.n_layers;
    const dsv4_numerics *nums[2] = {&DSV4_NUMERICS_EXACT, &DSV4_NUMERICS_REFERENCE};
    float *lg[4];
    for (int i = 0; i < 4; i++) REQUIRE((lg[i] = calloc(6 * V, sizeof(float))) != NULL);
    for (int p = 0; p < 2; p++) {
        long cnt[4][11];
        for (int mode = 0; mode < 4; mode++) hc_fused_run(&lm, nums[p], mode, lg[mode], cnt[mode]);
        size_t n = (lm.cfg.n_mtp > 0 ? 6 : 5) * V;
        int same_f = !memcmp(lg[1], lg[0], sizeof(float) * n), same_t = !memcmp(lg[2], lg[0], sizeof(float) * n);
        int same_d = !memcmp(lg[3], lg[0], sizeof(float) * n);
        CHECKF(same_f, "profile %d: fused logits differ from the two ops", p);
        CHECKF(same_t, "profile %d: logits under a trace differ", p);
        CHECKF(same_d, "profile %d: logits with Sinkhorn deferred differ", p);
        /* deferred: every comb but the last layer's MoE half's (read by the plain hc_post) is left
         * as logits, by layer 0's hc_pre_norm and 2L - 2 of the fused ops, and read by all 2L - 1;
         * without DSV4_HC_DEFER none; the plain hc_post never got logits (prefill, batches, MTP too) */
        CHECKF(cnt[3][8] == 2 * L - 1 && cnt[3][9] == 2 * L - 1 && cnt[3][0] == 2 * L - 1,
               "deferred: %ld ops wrote logits, %ld read them, %ld fused (L = %d)", cnt[3][8], cnt[3][9], cnt[3][0],
               L);
        for (int mode = 0; mode < 3; mode++)
            CHECKF(cnt[mode][8] == 0 && cnt[mode][9] == 0, "mode %d: logits without DSV4_HC_DEFER", mode);
        for (int mode = 0; mode < 4; mode++)
            CHECKF(cnt[mode][10] == 0, "mode %d: hc_post got %ld columns not summing to 1", mode, cnt[mode][10]);
        /* one decode step: unfused 2L hc_pre_norm + 2L hc_post; fused: 2L - 1 fused ops, layer
         * 0's hc_pre_norm and the last layer's hc_post; traced: hc_pre and hc_post apart */
        CHECKF(cnt[0][0] == 0 && cnt[0][2] == 2 * L && cnt[0][3] == 2 * L, "unfused counts %ld %ld %ld", cnt[0][0],
               cnt[0][2], cnt[0][3]);
        CHECKF(cnt[1][0] == 2 * L - 1 && cnt[1][1] == 0 && cnt[1][2] == 1 && cnt[1][3] == 1,
               "fused counts: %ld fused, %ld hc_pre, %ld hc_pre_norm, %ld hc_post (L = %d)", cnt[1][0], cnt[1][1],
               cnt[1][2], cnt[1][3], L);
        CHECKF(cnt[2][0] == 0 && cnt[2][1] == 2 * L && cnt[2][3] == 2 * L, "traced counts %ld %ld %ld", cnt[2][0],
               cnt[2][1], cnt[2][3]);
        for (int i = 0; i < 4; i++)
            CHECKF(cnt[2][4 + i] == L, "trace event %d seen %ld times, expected %d", i, cnt[2][4 + i], L);
        printf("  profile %d: logits (%zu floats) fused %s, traced %s the two ops'; decode step: %ld fused ops, %ld "
               "hc_pre_norm, %ld hc_post\n",
               p, n, same_f ? "=" : "!=", same_t ? "=" : "!=", cnt[1][0], cnt[1][2], cnt[1][3]);
        printf("  profile %d: Sinkhorn deferred: logits %s; decode step: %ld ops wrote logits, %ld read them\n", p,
               same_d ? "=" : "!=", cnt[3][8], cnt[3][9]);
    }
    for (int i = 0; i < 4; i++) free(lg[i]);
    low_close(&lm);
}

static void test_zz_cleanup(void) { cleanup_dir(); }

/* ----- where a decode step's device segments start (DSV4_SEG_AT_HC, forward.c's seg_at) -----
 * The CPU backend has no segment op; a copy of its table that records every segment mark (S<key>),
 * router gate (G<layer>), fused hc kernel carrying a layer's attention hc_pre (A<layer>) and first y
 * projection (wq_a, Y<layer>) in call order shows where each layer's segment begins: 0 before its y
 * projections, 1 before the hc kernel that carries its hc_pre, 2 before the previous layer's router
 * gate, 3 as 2 but layer 1 as 0.  The logits must not depend on it. */
static const dsv4_backend_ops *g_seg_cpu;
static const dsv4_model_w *g_seg_w;
static char g_seg_log[16384];
static size_t g_seg_len;

static void seg_note(const char *tag, int v) {
    int n = snprintf(g_seg_log + g_seg_len, sizeof g_seg_log - g_seg_len, "%s%d ", tag, v);
    if (n > 0 && g_seg_len + (size_t)n < sizeof g_seg_log) g_seg_len += (size_t)n;
}

static void seg_mark(dsv4_backend *b, int key) {
    (void)b;
    seg_note("S", key);
}

static void seg_matmul(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int act_fp8,
                       int out_bf16) {
    for (int l = 0; l < g_seg_w->n_layers; l++) {
        if (w == &g_seg_w->layers[l].gate) seg_note("G", l);
        if (w == &g_seg_w->layers[l].wq_a) seg_note("Y", l);
    }
    g_seg_cpu->matmul(b, out, x, rows, w, act_fp8, out_bf16);
}

static void seg_hc(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post_in,
                   const float *comb_in, int state_bf16, float *y, float *post, float *comb, int rows, int hc, int dim,
                   const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters, float norm_eps,
                   float hc_eps, int gemm_bf16, int out_bf16, const dsv4_weight *y_norm, float y_eps) {
    for (int l = 0; l < g_seg_w->n_layers; l++)
        if (fn == &g_seg_w->layers[l].hc_attn_fn) seg_note("A", l);
    g_seg_cpu->hc_post_pre_norm(b, Xout, o, R, post_in, comb_in, state_bf16, y, post, comb, rows, hc, dim, fn, base,
                                scale, iters, norm_eps, hc_eps, gemm_bf16, out_bf16, y_norm, y_eps);
}

/* a decode step's log and logits with DSV4_SEG_AT_HC=mode ("" = unset: the default) */
static void seg_run(low_model *lm, const char *mode, float *lg) {
    dsv4_err err = {{0}};
    dsv4_backend_ops ops = *g_seg_cpu;
    ops.segment = seg_mark;
    ops.matmul = seg_matmul;
    ops.hc_post_pre_norm = seg_hc;
    lm->be.ops = &ops;
    if (mode[0]) setenv("DSV4_SEG_AT_HC", mode, 1);
    else unsetenv("DSV4_SEG_AT_HC");
    dsv4_model *m = NULL;
    dsv4_state *s = NULL;
    REQUIRE(dsv4_model_init(&m, &lm->w, &lm->be, &DSV4_NUMERICS_EXACT, 8, &err) == 0);
    unsetenv("DSV4_SEG_AT_HC");
    REQUIRE(dsv4_state_new(&s, &lm->cfg, 0, &err) == 0);
    int32_t tok[8];
    make_tokens(tok, 8, 77, lm->cfg.vocab_size);
    dsv4_fwd_item it = {.st = s, .tokens = tok, .n = 7, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    g_seg_len = 0, g_seg_log[0] = 0;
    it = (dsv4_fwd_item){.st = s, .tokens = tok + 7, .n = 1, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    dsv4_state_free(s);
    dsv4_model_free(m);
    lm->be.ops = g_seg_cpu;
}

static void test_segment_starts(void) {
    low_model lm;
    REQUIRE(low_open(&lm) == 0);
    g_seg_cpu = lm.be.ops;
    g_seg_w = &lm.w;
    REQUIRE(g_seg_cpu->segment == NULL && g_seg_cpu->hc_post_pre_norm != NULL && lm.w.n_layers >= 3);
    size_t V = (size_t)lm.cfg.vocab_size;
    enum { NM = 5 };
    float *lg[NM];
    for (int i = 0; i < NM; i++) REQUIRE((lg[i] = calloc(V, sizeof(float))) != NULL);
    static const char *const modes[NM] = {"", "0", "1", "2", "3"};
    /* each mode: layer 1's and 2's starts, as the mark between the ops around it */
    static const char *const want[NM][2] = {{"S1 G0 ", "S2 G1 "},
                                            {"A1 S1 Y1 ", "A2 S2 Y2 "},
                                            {"S1 A1 Y1 ", "S2 A2 Y2 "},
                                            {"S1 G0 ", "S2 G1 "},
                                            {"A1 S1 Y1 ", "S2 G1 "}};
    for (int k = 0; k < NM; k++) {
        seg_run(&lm, modes[k], lg[k]);
        int ok1 = strstr(g_seg_log, want[k][0]) != NULL, ok2 = strstr(g_seg_log, want[k][1]) != NULL;
        int same = !memcmp(lg[k], lg[0], sizeof(float) * V);
        printf("  DSV4_SEG_AT_HC=%s: %.90s... (layer 1: %s, layer 2: %s), logits %s the default's\n",
               modes[k][0] ? modes[k] : "(unset)", g_seg_log, ok1 ? "as expected" : "WRONG", ok2 ? "as expected" : "WRONG",
               same ? "equal to" : "DIFFERENT from");
        CHECKF(ok1 && ok2, "mode %s: expected \"%s\" and \"%s\" in %s", modes[k], want[k][0], want[k][1], g_seg_log);
        CHECK(same);
    }
    for (int i = 0; i < NM; i++) free(lg[i]);
    low_close(&lm);
}

/* ----- the side chain (ops->side / ops->join) at a decode step -----
 * A copy of the CPU table logs, in call order, the chain marks (F = side(b, 1), M = side(b, 0),
 * J = join) and the ops that matter: wq_b (Q<l>), the indexer's wq_b (I<l>), top-k (T), the
 * compressors' position biases (C) and pools (P), attention (A).  At a decode step a layer with
 * an indexer forks after the first op list (its compressors in the chain, the indexer's q
 * projection and wq_b on the main chain, the scores and top-k in the chain again after I), a
 * layer with only a compressor forks at a step that closes its window; the attention comes after
 * the join; prefill never forks; DSV4_SIDE_CHAIN=0 never forks; the logits of every step are the
 * same bits either way. */
static const dsv4_backend_ops *g_sc_cpu;
static const dsv4_model_w *g_sc_w;
static char g_sc_log[65536];
static size_t g_sc_len;

static void sc_note(const char *tag, int v) {
    int n = v >= 0 ? snprintf(g_sc_log + g_sc_len, sizeof g_sc_log - g_sc_len, "%s%d ", tag, v)
                   : snprintf(g_sc_log + g_sc_len, sizeof g_sc_log - g_sc_len, "%s ", tag);
    if (n > 0 && g_sc_len + (size_t)n < sizeof g_sc_log) g_sc_len += (size_t)n;
}
static void sc_side(dsv4_backend *b, int on) {
    sc_note(on ? "F" : "M", -1);
    g_sc_cpu->side(b, on);
}
static void sc_join(dsv4_backend *b) {
    sc_note("J", -1);
    g_sc_cpu->join(b);
}
static void sc_matmul(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int act_fp8,
                      int out_bf16) {
    for (int l = 0; l < g_sc_w->n_layers; l++) {
        if (w == &g_sc_w->layers[l].wq_b) sc_note("Q", l);
        if (w == &g_sc_w->layers[l].idx.wq_b) sc_note("I", l);
    }
    g_sc_cpu->matmul(b, out, x, rows, w, act_fp8, out_bf16);
}
static void sc_topk(dsv4_backend *b, int32_t *idx, int *n_out, const float *score, int rows, int stride, const int *n,
                    int k) {
    sc_note("T", -1);
    g_sc_cpu->topk(b, idx, n_out, score, rows, stride, n, k);
}
static void sc_add_cyclic(dsv4_backend *b, float *x, const float *y, int rows, int width, int period, int first) {
    sc_note("C", -1);
    g_sc_cpu->add_cyclic(b, x, y, rows, width, period, first);
}
static void sc_pool(dsv4_backend *b, float *out, const float *const *kv, const float *const *g, int n, int width) {
    sc_note("P", -1);
    g_sc_cpu->pool(b, out, kv, g, n, width);
}
static void sc_attn(dsv4_backend *b, float *out, const float *q, int rows, int n_heads, int head_dim,
                    const float *const *win, const int *n_win, int max_win, const float *const *comp_base,
                    const int *n_comp, const int32_t *picks, const int *n_picks, int topk, const float *sink,
                    float scale, int prob_bf16, int out_bf16) {
    sc_note("A", -1);
    g_sc_cpu->sparse_attn(b, out, q, rows, n_heads, head_dim, win, n_win, max_win, comp_base, n_comp, picks, n_picks,
                          topk, sink, scale, prob_bf16, out_bf16);
}

/* the last chain mark (F, M or J) before position at in the log, '-' if none */
static char sc_mark_before(const char *at) {
    for (const char *p = at; p > g_sc_log; p--)
        if ((p[-1] == 'F' || p[-1] == 'M' || p[-1] == 'J') && (p - 1 == g_sc_log || p[-2] == ' ') && p[0] == ' ')
            return p[-1];
    return '-';
}

/* prefill of 7 tokens, then 9 decode steps (crossing the 4- and 8-token windows); each step's
 * logits into lg [9][V]; the log holds the decode steps only */
static void sc_run(low_model *lm, const char *mode, float *lg) {
    dsv4_err err = {{0}};
    dsv4_backend_ops ops = *g_sc_cpu;
    ops.side = sc_side, ops.join = sc_join, ops.matmul = sc_matmul, ops.topk = sc_topk;
    ops.add_cyclic = sc_add_cyclic, ops.pool = sc_pool, ops.sparse_attn = sc_attn;
    lm->be.ops = &ops;
    if (mode[0]) setenv("DSV4_SIDE_CHAIN", mode, 1);
    else unsetenv("DSV4_SIDE_CHAIN");
    dsv4_model *m = NULL;
    dsv4_state *s = NULL;
    REQUIRE(dsv4_model_init(&m, &lm->w, &lm->be, &DSV4_NUMERICS_EXACT, 8, &err) == 0);
    unsetenv("DSV4_SIDE_CHAIN");
    REQUIRE(dsv4_state_new(&s, &lm->cfg, 0, &err) == 0);
    int32_t tok[16];
    make_tokens(tok, 16, 91, lm->cfg.vocab_size);
    size_t V = (size_t)lm->cfg.vocab_size;
    g_sc_len = 0, g_sc_log[0] = 0;
    dsv4_fwd_item it = {.st = s, .tokens = tok, .n = 7, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    CHECKF(!strchr(g_sc_log, 'F'), "mode '%s': a prefill forked: %.200s", mode, g_sc_log);
    g_sc_len = 0, g_sc_log[0] = 0;
    for (int t = 0; t < 9; t++) {
        it = (dsv4_fwd_item){.st = s, .tokens = tok + 7 + t, .n = 1, .logits = lg + (size_t)t * V};
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    }
    dsv4_state_free(s);
    dsv4_model_free(m);
    lm->be.ops = g_sc_cpu;
}

/* ----- qa's norm inside wq_b (matmul_rn) and wq_b ahead of the first list (DSV4_WQB_FIRST), below the engine -----
 * The CPU backend has neither op nor op_list; the test supplies them from its ops (an op list runs its tasks
 * in order, matmul_rn norms into a copy and multiplies, taking every one-row call without flags), counts the
 * calls, and requires the logits of a prefill and 9 decode steps to be the bits of the run without
 * matmul_rn: with it (in every layer without an indexer or a side chain at that step), DSV4_WQB_FIRST=0, and
 * with DSV4_WQB_FIRST's default (the list after it through op_list_beside). */
static const dsv4_backend_ops *g_rn_cpu;
static long g_rn_calls, g_rn_beside; /* matmul_rn calls; op_list_beside calls */

static void rn_op_list(dsv4_backend *b, const dsv4_op_task *tasks, int n) {
    for (int i = 0; i < n; i++) dsv4_op_task_run(g_rn_cpu, b, &tasks[i]);
}
static void rn_beside(dsv4_backend *b, const dsv4_op_task *tasks, int n) {
    g_rn_beside++;
    rn_op_list(b, tasks, n);
}
static void rn_matmul_rn(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int flags,
                         int out_bf16, const dsv4_weight *norm_w, float eps, int norm_bf16) {
    float *t = malloc(sizeof(float) * (size_t)rows * w->cols);
    REQUIRE(t);
    g_rn_calls++;
    g_rn_cpu->rmsnorm(b, t, x, rows, (int)w->cols, norm_w, eps, norm_bf16);
    g_rn_cpu->matmul(b, out, t, rows, w, flags, out_bf16);
    free(t);
}
static int rn_takes(dsv4_backend *b, const dsv4_weight *w, int rows, int flags) {
    (void)b, (void)w;
    return rows == 1 && !flags;
}

/* A prefill of 7 tokens and 9 decode steps (positions 7..15) below the engine with the backend ops `ops` and, where
 * var is set, the environment variable var=val while the model is made; the 10 rows of logits into lg.  The
 * backend's ops are restored after. */
static void low_steps(low_model *lm, const dsv4_backend_ops *ops, const char *var, const char *val, uint32_t seed,
                      float *lg) {
    dsv4_err err = {{0}};
    const dsv4_backend_ops *was = lm->be.ops;
    lm->be.ops = ops;
    if (var) setenv(var, val, 1);
    dsv4_model *m = NULL;
    dsv4_state *s = NULL;
    REQUIRE(dsv4_model_init(&m, &lm->w, &lm->be, &DSV4_NUMERICS_EXACT, 8, &err) == 0);
    if (var) unsetenv(var);
    REQUIRE(dsv4_state_new(&s, &lm->cfg, 0, &err) == 0);
    int32_t tok[16];
    make_tokens(tok, 16, seed, lm->cfg.vocab_size);
    size_t V = (size_t)lm->cfg.vocab_size;
    dsv4_fwd_item it = {.st = s, .tokens = tok, .n = 7, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    for (int t = 0; t < 9; t++) {
        it = (dsv4_fwd_item){.st = s, .tokens = tok + 7 + t, .n = 1, .logits = lg + (size_t)(t + 1) * V};
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    }
    dsv4_state_free(s);
    dsv4_model_free(m);
    lm->be.ops = was;
}

/* mode 0: op_list only; 1: matmul_rn as well, DSV4_WQB_FIRST=0; 2: and op_list_beside (DSV4_WQB_FIRST's
 * default) */
static void rn_run(low_model *lm, int mode, float *lg) {
    dsv4_backend_ops ops = *g_rn_cpu;
    ops.op_list = rn_op_list;
    if (mode >= 1) ops.matmul_rn = rn_matmul_rn, ops.matmul_rn_takes = rn_takes;
    if (mode == 2) ops.op_list_beside = rn_beside;
    low_steps(lm, &ops, mode == 1 ? "DSV4_WQB_FIRST" : NULL, "0", 93, lg);
}

static void test_qa_norm_in_wqb(void) {
    low_model lm;
    REQUIRE(low_open(&lm) == 0);
    g_rn_cpu = lm.be.ops;
    size_t V = (size_t)lm.cfg.vocab_size;
    int L = lm.cfg.n_layers, want = 0; /* the trunk (the MTP layers run in no dsv4_forward) */
    for (int t = 0; t < 9; t++) /* decode steps at positions 7..15: layers without an indexer or a side chain */
        for (int l = 0; l < L; l++) {
            const dsv4_layer_w *ly = &lm.w.layers[l];
            want += !ly->has_indexer && !(ly->has_comp && (7 + t + 1) % ly->comp.ratio == 0);
        }
    float *a = calloc(10 * V, sizeof(float)), *b = calloc(10 * V, sizeof(float));
    REQUIRE(a && b && want > 0);
    rn_run(&lm, 0, a);
    for (int mode = 1; mode <= 2; mode++) {
        g_rn_calls = g_rn_beside = 0;
        rn_run(&lm, mode, b);
        int same = memcmp(a, b, sizeof(float) * 10 * V) == 0;
        printf("  matmul_rn mode %d: logits %s the op list's bits; %ld calls, %ld lists beside (expected %d)\n", mode,
               same ? "with" : "NOT", g_rn_calls, g_rn_beside, want);
        CHECK(same);
        CHECKF(g_rn_calls == want && g_rn_beside == (mode == 2 ? want : 0),
               "mode %d: %ld calls, %ld beside, expected %d", mode, g_rn_calls, g_rn_beside, want);
    }
    free(a), free(b);
    low_close(&lm);
}

/* ----- a closed window's tail in the op list (DSV4_EMIT_LIST), its pools in one call (DSV4_POOL_MULTI) -----
 * With an op list supplied (tasks run in order) and the CPU's norm_rope, the logits of a prefill and 9 decode
 * steps must be the bits of DSV4_EMIT_LIST=0 (the copy list and the norm_rope op), and the lists must have
 * carried one norm task for every window a decode step closed (each compressor of each layer) and none
 * with the switch off.  With a pool_multi supplied (each job through the CPU's pool) the same bits again: by
 * default (DSV4_POOL_MULTI on since stop 52) one pool_multi call of two jobs for every step that closes both of
 * a layer's windows, with DSV4_POOL_MULTI=0 none. */
static const dsv4_backend_ops *g_el_cpu;
static const dsv4_model_w *g_el_w;
static long g_el_norms, g_el_multi, g_el_jobs; /* compressor norms in lists; pool_multi calls, their jobs */

static void el_op_list(dsv4_backend *b, const dsv4_op_task *tasks, int n) {
    for (int i = 0; i < n; i++) {
        for (int l = 0; l < g_el_w->n_layers && tasks[i].kind == DSV4_TASK_NORM_ROPE; l++)
            g_el_norms += tasks[i].w == &g_el_w->layers[l].comp.norm || tasks[i].w == &g_el_w->layers[l].idx.comp.norm;
        dsv4_op_task_run(g_el_cpu, b, &tasks[i]);
    }
}

static void el_pool_multi(dsv4_backend *b, int n_jobs, float *const *outs, const float *const *const *kv,
                          const float *const *const *gate, const int *ns, const int *widths) {
    g_el_multi++, g_el_jobs += n_jobs;
    for (int j = 0; j < n_jobs; j++) g_el_cpu->pool(b, outs[j], kv[j], gate[j], ns[j], widths[j]);
}

/* mode 0: DSV4_EMIT_LIST=0; 1: its default (no pool_multi op); 2: and a pool_multi op (DSV4_POOL_MULTI's
 * default); 3: the op with DSV4_POOL_MULTI=0 */
static void el_run(low_model *lm, int mode, float *lg) {
    dsv4_backend_ops ops = *g_el_cpu;
    ops.op_list = el_op_list;
    if (mode >= 2) ops.pool_multi = el_pool_multi;
    low_steps(lm, &ops, mode == 0 ? "DSV4_EMIT_LIST" : mode == 3 ? "DSV4_POOL_MULTI" : NULL, "0", 97, lg);
}

static void test_emit_list(void) {
    low_model lm;
    REQUIRE(low_open(&lm) == 0);
    g_el_cpu = lm.be.ops, g_el_w = &lm.w;
    REQUIRE(g_el_cpu->norm_rope != NULL && g_el_cpu->pool_multi == NULL);
    size_t V = (size_t)lm.cfg.vocab_size;
    long want = 0, both = 0;
    for (int t = 0; t < 9; t++) /* decode positions 7..15 */
        for (int l = 0; l < lm.cfg.n_layers; l++) {
            const dsv4_layer_w *ly = &lm.w.layers[l];
            int c0 = ly->has_comp && (7 + t + 1) % ly->comp.ratio == 0;
            int c1 = ly->has_indexer && (7 + t + 1) % ly->idx.comp.ratio == 0;
            want += c0 + c1, both += c0 && c1;
        }
    float *a = calloc(10 * V, sizeof(float)), *b = calloc(10 * V, sizeof(float));
    REQUIRE(a && b && want > 0 && both > 0);
    long norms[4];
    for (int mode = 0; mode < 4; mode++) {
        g_el_norms = g_el_multi = g_el_jobs = 0;
        el_run(&lm, mode, mode ? b : a);
        norms[mode] = g_el_norms;
        if (!mode) continue;
        int same = memcmp(a, b, sizeof(float) * 10 * V) == 0;
        printf("  emit list mode %d: logits %s DSV4_EMIT_LIST=0's bits; %ld compressor norms in op lists (expected "
               "%ld; off: %ld); %ld pool_multi calls of %ld jobs (expected %ld)\n", mode, same ? "with" : "NOT",
               g_el_norms, want, norms[0], g_el_multi, g_el_jobs, mode == 2 ? both : 0L);
        CHECK(same);
        CHECKF(g_el_norms == want && norms[0] == 0, "%ld norms in lists, expected %ld (off: %ld)", g_el_norms, want,
               norms[0]);
        CHECKF(g_el_multi == (mode == 2 ? both : 0) && g_el_jobs == 2 * g_el_multi, "%ld pool_multi calls, %ld jobs",
               g_el_multi, g_el_jobs);
    }
    free(a), free(b);
    low_close(&lm);
}

static void test_side_chain(void) {
    low_model lm;
    REQUIRE(low_open(&lm) == 0);
    g_sc_cpu = lm.be.ops;
    g_sc_w = &lm.w;
    REQUIRE(g_sc_cpu->side != NULL && g_sc_cpu->join != NULL);
    size_t V = (size_t)lm.cfg.vocab_size;
    int L = lm.w.n_layers, n_comp = 0, n_idx = 0;
    for (int l = 0; l < L; l++) n_comp += lm.w.layers[l].has_comp || lm.w.layers[l].has_indexer,
                                n_idx += lm.w.layers[l].has_indexer;
    REQUIRE(n_comp > 0 && n_idx > 0); /* the tiny model has both kinds of layer */
    float *on = calloc(9 * V, sizeof(float)), *off = calloc(9 * V, sizeof(float));
    REQUIRE(on && off);
    /* the chains expected over the 9 steps (positions 7..15): every indexer layer, and a
     * compressor-only layer where the step closes its window */
    int want = 0;
    for (int t = 0; t < 9; t++)
        for (int l = 0; l < L; l++) {
            const dsv4_layer_w *ly = &lm.w.layers[l];
            want += ly->has_indexer || (ly->has_comp && (7 + t + 1) % ly->comp.ratio == 0);
        }
    long f0 = dsv4_backend_cpu_sides(&lm.be, 0), j0 = dsv4_backend_cpu_sides(&lm.be, 1);
    sc_run(&lm, "", on);
    long forks = dsv4_backend_cpu_sides(&lm.be, 0) - f0, joins = dsv4_backend_cpu_sides(&lm.be, 1) - j0;
    CHECKF(forks == want && joins == forks, "forks %ld, joins %ld, expected %d", forks, joins, want);
    int n_f = 0, n_m = 0, n_j = 0;
    for (const char *p = g_sc_log; *p; p++)
        if (p[1] == ' ' && (p == g_sc_log || p[-1] == ' ')) n_f += *p == 'F', n_m += *p == 'M', n_j += *p == 'J';
    /* an indexer layer enters its chain twice */
    CHECKF(n_j == want && n_f == want + 9 * n_idx && n_m == n_f, "log: %d F, %d M, %d J (expected %d chains)", n_f,
           n_m, n_j, want);
    /* where each op falls: Q and I on the main chain (after M), T and P in a chain (after F), A
     * never inside an open chain (after J, or where no chain was opened) */
    int bad = 0;
    for (const char *p = g_sc_log; *p; p++) {
        if (p != g_sc_log && p[-1] != ' ') continue;
        char k = *p, mb = sc_mark_before(p);
        int lay = (k == 'Q' || k == 'I') ? atoi(p + 1) : -1;
        if (k == 'Q' && (lm.w.layers[lay].has_indexer)) bad += mb != 'M';
        if (k == 'I') bad += mb != 'M';
        if ((k == 'T' || k == 'P') && p[1] == ' ') bad += mb != 'F';
        if (k == 'A' && p[1] == ' ') bad += mb == 'F' || mb == 'M';
    }
    CHECKF(bad == 0, "%d ops outside their chain in: %.300s", bad, g_sc_log);
    printf("  default: %ld side chains over 9 decode steps (%d layers with a compressor, %d with an indexer): "
           "%.120s...\n", forks, n_comp, n_idx, g_sc_log);
    f0 = dsv4_backend_cpu_sides(&lm.be, 0);
    sc_run(&lm, "0", off);
    CHECKF(dsv4_backend_cpu_sides(&lm.be, 0) == f0 && !strchr(g_sc_log, 'F'), "DSV4_SIDE_CHAIN=0 forked: %.200s",
           g_sc_log);
    int same = !memcmp(on, off, sizeof(float) * 9 * V);
    printf("  DSV4_SIDE_CHAIN=0: no chain; the 9 steps' logits %s\n", same ? "equal bit for bit" : "DIFFER");
    CHECK(same);
    free(on);
    free(off);
    low_close(&lm);
}

/* ----- greedy decoding (dsv4_forward_greedy) -----
 * Against the host loop (one dsv4_forward a token, the host's argmax): the same picks, token
 * history and state (the logits after the next token are the same bits), across two truncation
 * checkpoints.  A copy of the CPU table counts what a device would wait for: no logits row comes
 * back, one check per checkpoint plus one at the end, an argmax a step and a gather_ids a hash
 * layer a step.  Under an op trace it picks on the host (no argmax op), with the same picks.  A
 * failing check fails the call with the length unchanged; bad arguments are refused. */
static struct {
    long argmax, gather, checks, logit_dl;
    long layer_marks; /* segment marks keyed by a layer >= 1 (a graph that starts at that layer) */
    long l0_marks;    /* layer 0's own marks: its start (key 0), before its wq_b and its MoE half (n_all + 3, + 2) */
    int n_layers, n_all; /* the config's layers; the weights' (MTP included): n_all keys the head's marks */
    int fail_at;
    size_t vocab_bytes;
} g_gr;
static const dsv4_backend_ops *g_gr_cpu;

static void gr_download(dsv4_backend *b, void *dst, const void *src, size_t n) {
    g_gr.logit_dl += n == g_gr.vocab_bytes;
    g_gr_cpu->download(b, dst, src, n);
}
static int gr_check(dsv4_backend *b, dsv4_err *err) {
    (void)b;
    g_gr.checks++;
    return g_gr.checks == g_gr.fail_at ? dsv4_errf(err, "injected device failure") : 0;
}
static void gr_argmax(dsv4_backend *b, int32_t *out, const float *x, int rows, int n) {
    g_gr.argmax++;
    g_gr_cpu->argmax(b, out, x, rows, n);
}
static void gr_gather(dsv4_backend *b, int32_t *dst, const int32_t *tok, int rows, const dsv4_weight *t, int k) {
    g_gr.gather++;
    g_gr_cpu->gather_ids(b, dst, tok, rows, t, k);
}
static void gr_segment(dsv4_backend *b, int key) { /* the CPU table has no segment op */
    (void)b;
    g_gr.layer_marks += key >= 1 && key < g_gr.n_layers;
    g_gr.l0_marks += key == 0 || key == g_gr.n_all + 2 || key == g_gr.n_all + 3;
}
static void gr_noop_trace(void *user, const dsv4_op_info *info) { (void)user, (void)info; }

static void test_greedy(void) {
    dsv4_err err = {{0}};
    low_model lm;
    REQUIRE(low_open(&lm) == 0);
    dsv4_config cfg = lm.cfg;
    g_gr_cpu = lm.be.ops;
    REQUIRE(g_gr_cpu->argmax && g_gr_cpu->gather_ids);
    dsv4_backend_ops ops = *g_gr_cpu;
    ops.download = gr_download, ops.check = gr_check, ops.argmax = gr_argmax, ops.gather_ids = gr_gather;
    ops.segment = gr_segment;
    lm.be.ops = &ops;
    dsv4_model *m = NULL;
    REQUIRE(dsv4_model_init(&m, &lm.w, &lm.be, &DSV4_NUMERICS_EXACT, 64, &err) == 0);
    int V = cfg.vocab_size, n_hash = 0;
    for (int l = 0; l < cfg.n_layers; l++) n_hash += lm.w.layers[l].is_hash;
    CHECK(n_hash > 0); /* the tiny model has hash layers: gather_ids is exercised */
    enum { P = 19, N = 30 };
    int32_t prompt[P], out[N], host[N], out2[N];
    make_tokens(prompt, P, 41, V);
    float *lg = malloc(sizeof(float) * V), *lr = malloc(sizeof(float) * V);
    REQUIRE(lg && lr);
    g_gr.vocab_bytes = sizeof(float) * (size_t)V;
    dsv4_state *g = NULL, *r = NULL, *t = NULL;
    REQUIRE(dsv4_state_new(&g, &cfg, 16, &err) == 0);
    REQUIRE(dsv4_state_new(&r, &cfg, 16, &err) == 0);
    REQUIRE(dsv4_state_new(&t, &cfg, 16, &err) == 0);
    dsv4_fwd_item it = {.st = g, .tokens = prompt, .n = P, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    it.st = r;
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    it.st = t;
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    int32_t first = dsv4_argmax_row(lg, V);
    /* greedy on the device path */
    memset(&g_gr, 0, sizeof g_gr), g_gr.vocab_bytes = sizeof(float) * (size_t)V, g_gr.n_layers = cfg.n_layers;
    g_gr.n_all = lm.w.n_layers;
    REQUIRE(dsv4_forward_greedy(m, g, first, N, out, &err) == 0);
    int every = (int)g->snapshot_every, ckpts = (P + N) / every - P / every;
    /* the default segments: 4 layers after layer 0 in the greedy loop (layers 1, 5, 9, ... start
     * one), one a layer in the host loop below */
    REQUIRE(!getenv("DSV4_GREEDY_SEG_LAYERS") && !getenv("DSV4_SEG_LAYERS"));
    const int G = 4, H = 1;
    long gmarks = g_gr.layer_marks, want_g = 0, want_h = 0;
    for (int l = 1; l < cfg.n_layers; l++) want_g += (l - 1) % G == 0, want_h += (l - 1) % H == 0;
    printf("  greedy %d steps: argmax %ld, gather_ids %ld (%d hash layers), checks %ld (%d checkpoints), logits rows "
           "downloaded %ld, %ld graphs starting at a layer >= 1 (%ld a step expected: %d layers, %d a segment)\n", N,
           g_gr.argmax, g_gr.gather, n_hash, g_gr.checks, ckpts, g_gr.logit_dl, gmarks, want_g, cfg.n_layers, G);
    CHECK(cfg.n_layers > 2 && want_g < want_h); /* the tiny model shows the difference */
    CHECK_EQ_INT(gmarks, (long)N * want_g);
    /* the greedy loop keeps layer 0 in the step's first graph (its host runs ahead: no split needed) */
    printf("  greedy: %ld marks of layer 0's own segments (0 expected)\n", g_gr.l0_marks);
    CHECK_EQ_INT(g_gr.l0_marks, 0);
    CHECK(ckpts >= 1);
    CHECK_EQ_INT(g_gr.argmax, N);
    CHECK_EQ_INT(g_gr.gather, (long)N * n_hash);
    CHECK_EQ_INT(g_gr.checks, ckpts + 1);
    CHECK_EQ_INT(g_gr.logit_dl, 0);
    CHECK_EQ_INT(g->len, P + N);
    /* the host loop */
    int32_t tok = first;
    g_gr.layer_marks = 0, g_gr.l0_marks = 0;
    for (int s = 0; s < N; s++) {
        it = (dsv4_fwd_item){.st = r, .tokens = &tok, .n = 1, .logits = lr};
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
        host[s] = tok = dsv4_argmax_row(lr, V);
    }
    printf("  the host loop: %ld graphs starting at a layer >= 1 (%ld a step expected)\n", g_gr.layer_marks, want_h);
    CHECK_EQ_INT(g_gr.layer_marks, (long)N * want_h);
    printf("  the host loop: %ld marks of layer 0's own segments (%d expected)\n", g_gr.l0_marks, 3 * N);
    CHECK_EQ_INT(g_gr.l0_marks, 3L * N);
    int same = !memcmp(out, host, sizeof out), distinct = 0;
    for (int s = 1; s < N; s++) distinct += out[s] != out[s - 1];
    printf("  greedy picks %s the host loop's (%d changes of token in %d)\n", same ? "equal" : "DIFFER from", distinct,
           N);
    CHECK(same);
    CHECK(distinct > 0);
    CHECK_EQ_INT(r->len, g->len);
    CHECK(!memcmp(g->tokens, r->tokens, sizeof(int32_t) * (size_t)g->len)); /* what truncate re-runs */
    /* the state carries on identically */
    it = (dsv4_fwd_item){.st = g, .tokens = &out[N - 1], .n = 1, .logits = lg};
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    it.st = r, it.logits = lr;
    REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
    CHECK(!memcmp(lg, lr, sizeof(float) * (size_t)V));
    /* DSV4_GREEDY_L0_SPLIT=1 (read at init): layer 0's three segments in the greedy loop too, the same picks */
    {
        REQUIRE(!getenv("DSV4_GREEDY_L0_SPLIT"));
        setenv("DSV4_GREEDY_L0_SPLIT", "1", 1);
        dsv4_model *m2 = NULL;
        REQUIRE(dsv4_model_init(&m2, &lm.w, &lm.be, &DSV4_NUMERICS_EXACT, 64, &err) == 0);
        unsetenv("DSV4_GREEDY_L0_SPLIT");
        dsv4_state *s2 = NULL;
        REQUIRE(dsv4_state_new(&s2, &cfg, 16, &err) == 0);
        it = (dsv4_fwd_item){.st = s2, .tokens = prompt, .n = P, .logits = lr};
        REQUIRE(dsv4_forward(m2, &it, 1, &err) == 0);
        memset(&g_gr, 0, sizeof g_gr), g_gr.vocab_bytes = sizeof(float) * (size_t)V, g_gr.n_layers = cfg.n_layers;
        g_gr.n_all = lm.w.n_layers;
        REQUIRE(dsv4_forward_greedy(m2, s2, first, N, out2, &err) == 0);
        printf("  DSV4_GREEDY_L0_SPLIT=1: %ld marks of layer 0's own segments (%d expected), picks %s\n",
               g_gr.l0_marks, 3 * N, memcmp(out2, out, sizeof out) ? "DIFFER" : "equal");
        CHECK_EQ_INT(g_gr.l0_marks, 3L * N);
        CHECK(!memcmp(out2, out, sizeof out));
        dsv4_state_free(s2);
        dsv4_model_free(m2);
    }
    /* under an op trace: host picks, the same tokens */
    dsv4_model_set_op_trace(m, gr_noop_trace, NULL);
    memset(&g_gr, 0, sizeof g_gr), g_gr.vocab_bytes = sizeof(float) * (size_t)V;
    REQUIRE(dsv4_forward_greedy(m, t, first, N, out2, &err) == 0);
    dsv4_model_set_op_trace(m, NULL, NULL);
    CHECK_EQ_INT(g_gr.argmax, 0);
    CHECK(g_gr.logit_dl >= N); /* each step's row (and the trace's copies) */
    CHECK(!memcmp(out2, out, sizeof out));
    CHECK_EQ_INT(t->len, P + N);
    /* a failing check: an error, the length stays; after one step (undone by the length) and after
     * 21 (which overwrote window slots and compressor rows that the length's window reads: undone
     * from a checkpoint), the sequence then continues exactly as the reference */
    int64_t len = g->len;
    static const int fail_steps[2] = {1, 21};
    int32_t cont[8], cref[8];
    for (int f = 0; f < 2; f++) {
        memset(&g_gr, 0, sizeof g_gr), g_gr.fail_at = 1, g_gr.vocab_bytes = sizeof(float) * (size_t)V;
        err.msg[0] = 0;
        CHECK(dsv4_forward_greedy(m, g, out[N - 1], fail_steps[f], out2, &err) != 0);
        CHECK(strstr(err.msg, "injected device failure") != NULL);
        CHECK_EQ_INT(g->len, len);
        g_gr.fail_at = 0;
        REQUIRE(dsv4_forward_greedy(m, g, out[N - 1], 8, cont, &err) == 0);
        REQUIRE(dsv4_forward_greedy(m, r, out[N - 1], 8, cref, &err) == 0);
        it = (dsv4_fwd_item){.st = g, .tokens = &cont[7], .n = 1, .logits = lg};
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
        it.st = r, it.logits = lr;
        REQUIRE(dsv4_forward(m, &it, 1, &err) == 0);
        int cont_same = !memcmp(cont, cref, sizeof cont), next_same = !memcmp(lg, lr, sizeof(float) * (size_t)V);
        printf("  a check failing after %d greedy steps: length kept, then 8 steps %s the reference's, next logits %s\n",
               fail_steps[f], cont_same ? "equal to" : "DIFFER from", next_same ? "identical" : "DIFFERENT");
        CHECK(cont_same && next_same);
        len = g->len;
    }
    /* bad arguments */
    CHECK(dsv4_forward_greedy(m, g, V, 3, out2, &err) != 0);
    CHECK(strstr(err.msg, "outside the vocabulary") != NULL);
    CHECK(dsv4_forward_greedy(m, g, -1, 3, out2, &err) != 0);
    CHECK(dsv4_forward_greedy(m, g, first, 0, out2, &err) != 0);
    CHECK(dsv4_forward_greedy(m, g, first, 3, NULL, &err) != 0);
    CHECK_EQ_INT(g->len, len);
    free(lg), free(lr);
    dsv4_state_free(g), dsv4_state_free(r), dsv4_state_free(t);
    dsv4_model_free(m);
    lm.be.ops = g_gr_cpu;
    low_close(&lm);
}

TEST_MAIN(test_segments_and_checks, test_failed_later_subbatch, test_max_position, test_consistency_exact,
          test_consistency_reference, test_batch_equals_separate, test_truncate_checkpoints, test_truncate_recompute,
          test_truncate_thinned, test_clone_snapshot, test_trace_invariant, test_hash_routing_layer1,
          test_switch_distances, test_bad_input, test_no_scratch_growth_in_decode, test_hc_fused_pair,
          test_segment_starts, test_greedy, test_side_chain, test_qa_norm_in_wqb, test_emit_list,
          test_zz_cleanup)
