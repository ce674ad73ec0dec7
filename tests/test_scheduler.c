/* tests/test_scheduler: continuous batching, prefix reuse, cancellation,
 * back-pressure and shutdown of engine/scheduler on the tiny model.
 *
 * The model: $DSV4_DEFAULT_MODEL, else $DSV4_BUILD/default-model, else one
 * synthesized into a temp dir with `$DSV4_BIN synth --config tiny`.  Compute is
 * kept to a few hundred tokens in all (the CI machine has 2 shared cores).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/scheduler.h"
#include "test.h"

static dsv4_engine *g_engine;
static dsv4_tokenizer *g_tok;
static char g_model[4096];
static int g_vocab;

static int find_model(void) {
    const char *env = getenv("DSV4_DEFAULT_MODEL");
    char cfg[4200];
    if (env) {
        snprintf(g_model, sizeof g_model, "%s", env);
        return 0;
    }
    const char *b = getenv("DSV4_BUILD");
    if (b) {
        snprintf(g_model, sizeof g_model, "%s/default-model", b);
        snprintf(cfg, sizeof cfg, "%s/config.json", g_model);
        if (access(cfg, R_OK) == 0) return 0;
    }
    const char *bin = getenv("DSV4_BIN");
    char tmpl[] = "/tmp/dsv4_sched_XXXXXX";
    if (!bin || !mkdtemp(tmpl)) return -1;
    snprintf(g_model, sizeof g_model, "%s/m", tmpl);
    char cmd[8400];
    snprintf(cmd, sizeof cmd,
             "'%s' synth --config tiny --seed 1 --out '%s' --tokenizer data/tokenizer >/dev/null", bin,
             g_model);
    return system(cmd) == 0 ? 0 : -1;
}

static int setup(void) {
    if (g_engine) return 0;
    dsv4_err err = {{0}};
    if (find_model()) {
        fprintf(stderr, "no model: set DSV4_BUILD or DSV4_BIN (tests/run.sh does)\n");
        return -1;
    }
    dsv4_engine_opts o = {.model_dir = g_model, .n_threads = 1}; /* the CI machine is small and shared */
    if (dsv4_engine_open(&g_engine, &o, &err) || dsv4_tokenizer_load(&g_tok, g_model, &err)) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    dsv4_engine_info info;
    dsv4_engine_get_info(g_engine, &info);
    g_vocab = info.vocab_size;
    return 0;
}

static dsv4_sched *start(int max_seqs, int queue_cap, int chunk, int budget, int64_t ctx, int cache) {
    dsv4_sched_opts o;
    dsv4_sched_opts_default(&o);
    o.max_seqs = max_seqs;
    o.queue_cap = queue_cap;
    o.prefill_chunk = chunk;
    o.prefill_budget = budget;
    o.ctx = ctx;
    o.cache_off = !cache;
    dsv4_sched *s = NULL;
    dsv4_err err = {{0}};
    if (dsv4_sched_start(&s, g_engine, g_tok, &o, &err)) fprintf(stderr, "start: %s\n", err.msg);
    return s;
}

/* A pseudo-random but fixed prompt. */
static void make_prompt(int32_t *p, int n, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (int32_t)(100 + (seed >> 8) % 20000);
    }
}

typedef struct result {
    int32_t toks[64];
    int n;
    dsv4_finish_reason why;
    dsv4_usage usage;
    char content[1024];
    char reasoning[1024];
    int n_calls;
    char call_name[64], call_args[256];
    int finished;
} result;

/* Pops every event of r into res until FINISHED (or a 60 s safety timeout). */
static void drain(dsv4_request *r, result *res) {
    memset(res, 0, sizeof *res);
    double t0 = dsv4_now();
    for (;;) {
        dsv4_event ev;
        int got = dsv4_request_next_event(r, &ev, 1.0);
        if (got < 0) break;
        if (got == 0) {
            if (dsv4_now() - t0 > 60) break;
            continue;
        }
        switch (ev.type) {
        case DSV4_EV_TOKEN:
            if (res->n < 64) res->toks[res->n++] = ev.sample.token;
            break;
        case DSV4_EV_CONTENT:
            strncat(res->content, ev.text, sizeof res->content - strlen(res->content) - 1);
            break;
        case DSV4_EV_REASONING:
            strncat(res->reasoning, ev.text, sizeof res->reasoning - strlen(res->reasoning) - 1);
            break;
        case DSV4_EV_TOOL_CALL:
            res->n_calls++;
            snprintf(res->call_name, sizeof res->call_name, "%s", ev.tool_name);
            snprintf(res->call_args, sizeof res->call_args, "%s", ev.text);
            break;
        case DSV4_EV_FINISHED:
            res->why = ev.finish;
            res->usage = ev.usage;
            res->finished = 1;
            if (ev.message) fprintf(stderr, "  (finished: %s)\n", ev.message);
            break;
        default:
            break;
        }
        dsv4_event_clear(&ev);
        if (res->finished) break;
    }
}

static void greedy_params(dsv4_request_params *p, const int32_t *prompt, int n, int max_tokens) {
    dsv4_request_params_default(p);
    p->prompt_ids = prompt;
    p->n_prompt = n;
    p->sampling.temperature = 0;
    p->max_tokens = max_tokens;
    p->ignore_eos = 1;
    p->want_tokens = 1;
}

static int run_one(dsv4_sched *s, const int32_t *prompt, int n, int max_tokens, result *res) {
    dsv4_request_params p;
    greedy_params(&p, prompt, n, max_tokens);
    dsv4_request *r = NULL;
    dsv4_err err = {{0}};
    if (dsv4_sched_submit(s, &p, &r, &err)) {
        fprintf(stderr, "submit: %s\n", err.msg);
        return -1;
    }
    drain(r, res);
    dsv4_request_release(r);
    return 0;
}

/* ----- continuous batching = one at a time ----- */
#define NB 5
static void test_batch_equals_serial(void) {
    REQUIRE(setup() == 0);
    static const int lens[NB] = {3, 11, 6, 1, 9};
    int32_t prompts[NB][16];
    for (int i = 0; i < NB; i++)
        make_prompt(prompts[i], lens[i], 7u + (uint32_t)i);
    result serial[NB], batch[NB];
    dsv4_sched *s = start(1, 16, 256, 512, 0, 0);
    REQUIRE(s);
    for (int i = 0; i < NB; i++)
        REQUIRE(run_one(s, prompts[i], lens[i], 5, &serial[i]) == 0);
    dsv4_sched_stop(s, 0);

    /* small chunks and budget so prefill interleaves with other streams' decode */
    s = start(8, 16, 4, 6, 0, 0);
    REQUIRE(s);
    dsv4_request *rs[NB];
    for (int i = 0; i < NB; i++) {
        dsv4_request_params p;
        greedy_params(&p, prompts[i], lens[i], 5);
        dsv4_err err = {{0}};
        REQUIRE(dsv4_sched_submit(s, &p, &rs[i], &err) == DSV4_SCHED_OK);
    }
    for (int i = 0; i < NB; i++) {
        drain(rs[i], &batch[i]);
        dsv4_request_release(rs[i]);
    }
    dsv4_sched_stats st;
    dsv4_sched_get_stats(s, &st);
    CHECK(st.iterations >= 5);
    CHECK_EQ_INT(st.generated_tokens, NB * 5);
    CHECK_EQ_INT(st.finished[DSV4_FINISH_LENGTH], NB);
    dsv4_sched_stop(s, 0);
    for (int i = 0; i < NB; i++) {
        CHECK_EQ_INT(serial[i].why, DSV4_FINISH_LENGTH);
        CHECK_EQ_INT(batch[i].why, DSV4_FINISH_LENGTH);
        CHECK_EQ_INT(serial[i].n, 5);
        CHECK_EQ_INT(batch[i].n, 5);
        CHECKF(memcmp(serial[i].toks, batch[i].toks, sizeof(int32_t) * 5) == 0, "request %d differs", i);
        CHECK_STR(serial[i].content, batch[i].content);
        CHECK_EQ_INT(batch[i].usage.prompt_tokens, lens[i]);
        CHECK_EQ_INT(batch[i].usage.completion_tokens, 5);
    }
}

/* A long prompt is prefilled in chunks that share steps with another stream's
 * decode: the iterations add up to about the longer of the two, not the sum. */
static void test_chunked_prefill_interleaves(void) {
    REQUIRE(setup() == 0);
    dsv4_sched *s = start(4, 8, 4, 4, 0, 0);
    REQUIRE(s);
    int32_t pa[3], pb[40];
    make_prompt(pa, 3, 61);
    make_prompt(pb, 40, 62);
    dsv4_request_params rp;
    dsv4_err err = {{0}};
    dsv4_request *a = NULL, *b = NULL;
    greedy_params(&rp, pa, 3, 12);
    REQUIRE(dsv4_sched_submit(s, &rp, &a, &err) == DSV4_SCHED_OK);
    dsv4_event ev;
    CHECK_EQ_INT(dsv4_request_next_event(a, &ev, 30), 1);
    dsv4_event_clear(&ev);
    greedy_params(&rp, pb, 40, 3);
    rp.want_progress = 1;
    REQUIRE(dsv4_sched_submit(s, &rp, &b, &err) == DSV4_SCHED_OK);
    int progress = 0;
    result ra, rb;
    memset(&rb, 0, sizeof rb);
    rb.why = DSV4_FINISH_ERROR;
    drain(a, &ra);
    for (;;) { /* count b's prefill chunks */
        int got = dsv4_request_next_event(b, &ev, 30);
        if (got != 1) break;
        if (ev.type == DSV4_EV_PROGRESS) {
            progress++;
            CHECK(ev.progress_done <= ev.progress_total && ev.progress_total == 40);
        }
        int fin = ev.type == DSV4_EV_FINISHED;
        if (fin) rb.why = ev.finish;
        dsv4_event_clear(&ev);
        if (fin) break;
    }
    dsv4_request_release(a);
    dsv4_request_release(b);
    dsv4_sched_stats st;
    dsv4_sched_get_stats(s, &st);
    dsv4_sched_stop(s, 0);
    CHECK_EQ_INT(ra.why, DSV4_FINISH_LENGTH);
    CHECK_EQ_INT(rb.why, DSV4_FINISH_LENGTH);
    CHECK_EQ_INT(progress, 10); /* 40 tokens in chunks of 4 */
    /* serial: 12 (a) + 10 + 2 (b) = 24 steps; interleaved: about 13 */
    CHECKF(st.iterations <= 16, "%llu iterations", (unsigned long long)st.iterations);
}

/* ----- prefix reuse through the engine: bit-exact logits ----- */
/* A holds a conversation of T tokens; B shares its first L tokens then
 * diverges.  B served from clone(A, L) + the rest must give the same logits
 * rows as B prefilled from nothing (in chunks, as the scheduler does). */
enum { PT = 36 };
static int prefix_case(dsv4_seq *sa, const int32_t *a, int L, int chunk, float *fresh, float *reuse) {
    int32_t b[PT];
    memcpy(b, a, sizeof(int32_t) * (size_t)L);
    make_prompt(b + L, PT - L, 1234u + (uint32_t)L);
    if (L < PT) b[L] = a[L] == 500 ? 501 : 500; /* diverge exactly at L */
    dsv4_err err = {{0}};
    size_t V = (size_t)g_vocab;
    dsv4_seq *sb = NULL, *sc = NULL;
    int bad = -1;
    if (dsv4_seq_new(g_engine, &sb, &err)) goto out;
    for (int at = 0; at < PT; at += chunk) {
        int n = PT - at < chunk ? PT - at : chunk;
        if (n > L - at && at < L) n = L - at; /* rows from L on get logits */
        if (dsv4_seq_append(sb, b + at, n, at >= L ? fresh + (size_t)(at - L) * V : NULL, at >= L, &err))
            goto out;
        if (at < L && at + n == L) at = L - chunk; /* continue exactly at L */
    }
    if (dsv4_seq_len(sb) != PT) goto out;
    if (dsv4_seq_clone(sa, L, &sc, &err)) goto out;
    if (dsv4_seq_len(sc) != L) goto out;
    if (dsv4_seq_append(sc, b + L, PT - L, reuse, 1, &err)) goto out;
    bad = 0;
    for (int t = L; t < PT; t++)
        if (memcmp(fresh + (size_t)(t - L) * V, reuse + (size_t)(t - L) * V, sizeof(float) * V) != 0) {
            fprintf(stderr, "  L=%d chunk=%d: logits row %d differ\n", L, chunk, t);
            bad = 1;
            break;
        }
out:
    if (bad < 0) fprintf(stderr, "  L=%d: %s\n", L, err.msg[0] ? err.msg : "wrong length");
    dsv4_seq_free(sb);
    dsv4_seq_free(sc);
    return bad;
}

static void test_prefix_reuse_bit_exact(void) {
    REQUIRE(setup() == 0);
    int32_t a[PT];
    make_prompt(a, PT, 99);
    dsv4_err err = {{0}};
    dsv4_seq *sa = NULL;
    REQUIRE(dsv4_seq_new(g_engine, &sa, &err) == 0);
    REQUIRE(dsv4_seq_append(sa, a, PT, NULL, 0, &err) == 0);
    size_t V = (size_t)g_vocab;
    float *fresh = malloc(sizeof(float) * V * PT), *reuse = malloc(sizeof(float) * V * PT);
    REQUIRE(fresh && reuse);
    /* tiny: compression ratios 4 and 8, window 16: cut right after a boundary
     * (33, 17, 9 = 8k+1), on one (32, 16) and right before one (31) */
    static const int cuts[] = {32, 33, 17, 9, 31, 16};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++)
        CHECKF(prefix_case(sa, a, cuts[i], i % 2 ? 5 : PT, fresh, reuse) == 0, "shared prefix of %d tokens",
               cuts[i]);
    dsv4_seq_free(sa);
    free(fresh);
    free(reuse);
}

/* ----- prefix reuse through the scheduler ----- */
static void test_prefix_reuse_sched(void) {
    REQUIRE(setup() == 0);
    int32_t p1[24], p2[40], p3[40];
    make_prompt(p1, 24, 5);
    dsv4_sched *s = start(4, 16, 256, 512, 0, 1);
    REQUIRE(s);
    result r1, r2, r3, f2, f3;
    REQUIRE(run_one(s, p1, 24, 4, &r1) == 0);
    CHECK_EQ_INT(r1.usage.cached_tokens, 0);
    /* next turn: p1 + the answer (all but the last token is in the cached sequence) + more */
    memcpy(p2, p1, sizeof p1);
    memcpy(p2 + 24, r1.toks, sizeof(int32_t) * 4);
    make_prompt(p2 + 28, 12, 77);
    REQUIRE(run_one(s, p2, 40, 4, &r2) == 0);
    CHECK_EQ_INT(r2.usage.cached_tokens, 27);
    /* a branch: shares only the first 17 tokens (right after a ratio-4/8 and window boundary + 1) */
    memcpy(p3, p2, sizeof(int32_t) * 17);
    make_prompt(p3 + 17, 23, 4242);
    REQUIRE(run_one(s, p3, 40, 4, &r3) == 0);
    CHECK_EQ_INT(r3.usage.cached_tokens, 17);
    dsv4_sched_stats st;
    dsv4_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.cached_tokens, 27 + 17);
    CHECK(st.cached_seqs >= 1);
    CHECK(st.cache_bytes > 0);
    dsv4_sched_flush_cache(s);
    dsv4_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.cached_seqs, 0);
    CHECK_EQ_INT(st.state_bytes, 0);
    dsv4_sched_stop(s, 0);

    s = start(4, 16, 256, 512, 0, 0);
    REQUIRE(s);
    REQUIRE(run_one(s, p2, 40, 4, &f2) == 0);
    REQUIRE(run_one(s, p3, 40, 4, &f3) == 0);
    dsv4_sched_stop(s, 0);
    CHECK_EQ_INT(f2.usage.cached_tokens, 0);
    CHECK(memcmp(r2.toks, f2.toks, sizeof(int32_t) * 4) == 0);
    CHECK(memcmp(r3.toks, f3.toks, sizeof(int32_t) * 4) == 0);
}

/* ----- cancellation, busy, context, shutdown ----- */
static void test_cancel_frees_state(void) {
    REQUIRE(setup() == 0);
    dsv4_sched *s = start(2, 4, 256, 512, 0, 1);
    REQUIRE(s);
    int32_t p[8];
    make_prompt(p, 8, 3);
    dsv4_request_params rp;
    greedy_params(&rp, p, 8, 10000);
    dsv4_request *r = NULL;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_sched_submit(s, &rp, &r, &err) == DSV4_SCHED_OK);
    dsv4_event ev;
    int got = dsv4_request_next_event(r, &ev, 30);
    CHECK_EQ_INT(got, 1);
    CHECK_EQ_INT(ev.type, DSV4_EV_TOKEN);
    dsv4_event_clear(&ev);
    dsv4_sched_stats st;
    dsv4_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.running, 1);
    CHECK(st.state_bytes > 0);
    dsv4_request_cancel(r);
    result res;
    drain(r, &res);
    CHECK(res.finished);
    CHECK_EQ_INT(res.why, DSV4_FINISH_CANCELLED);
    CHECK(dsv4_request_next_event(r, &ev, 0) == -1);
    dsv4_request_release(r);
    dsv4_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.running, 0);
    CHECK_EQ_INT(st.cached_seqs, 0); /* a cancelled sequence is not kept */
    CHECK_EQ_INT(st.state_bytes, 0);
    CHECK_EQ_INT(st.finished[DSV4_FINISH_CANCELLED], 1);
    dsv4_sched_stop(s, 0);
}

static void test_busy_and_context(void) {
    REQUIRE(setup() == 0);
    dsv4_sched *s = start(1, 1, 256, 512, 64, 0);
    REQUIRE(s);
    int32_t p[80];
    make_prompt(p, 80, 11);
    dsv4_request_params rp;
    dsv4_err err = {{0}};
    dsv4_request *a = NULL, *b = NULL, *c = NULL;
    /* context: prompt + max_tokens beyond --ctx names both lengths */
    greedy_params(&rp, p, 10, 60);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &c, &err), DSV4_SCHED_EINVAL);
    CHECK(strstr(err.msg, "10 tokens") && strstr(err.msg, "60") && strstr(err.msg, "64"));
    CHECK(c == NULL);
    greedy_params(&rp, p, 70, 0);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &c, &err), DSV4_SCHED_EINVAL);
    CHECK(strstr(err.msg, "70 tokens") && strstr(err.msg, "64"));
    /* bad requests */
    greedy_params(&rp, p, 0, 4);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &c, &err), DSV4_SCHED_EINVAL);
    CHECK(strstr(err.msg, "empty") != NULL);
    int32_t bad_id = g_vocab + 5;
    greedy_params(&rp, &bad_id, 1, 4);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &c, &err), DSV4_SCHED_EINVAL);
    CHECK(strstr(err.msg, "vocabulary") != NULL);
    greedy_params(&rp, p, 4, 4);
    rp.sampling.top_p = 2;
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &c, &err), DSV4_SCHED_EINVAL);
    CHECK(strstr(err.msg, "top_p") != NULL);
    greedy_params(&rp, p, 4, -3);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &c, &err), DSV4_SCHED_EINVAL);
    const char *empty_stop[] = {""};
    greedy_params(&rp, p, 4, 4);
    rp.stop = empty_stop;
    rp.n_stop = 1;
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &c, &err), DSV4_SCHED_EINVAL);
    CHECK(strstr(err.msg, "stop") != NULL);

    /* queue full: one running, one waiting, the third is refused */
    greedy_params(&rp, p, 4, 50);
    REQUIRE(dsv4_sched_submit(s, &rp, &a, &err) == DSV4_SCHED_OK);
    dsv4_event ev;
    CHECK_EQ_INT(dsv4_request_next_event(a, &ev, 30), 1); /* a is running now */
    dsv4_event_clear(&ev);
    REQUIRE(dsv4_sched_submit(s, &rp, &b, &err) == DSV4_SCHED_OK);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &c, &err), DSV4_SCHED_EBUSY);
    CHECK(strstr(err.msg, "busy") != NULL);
    dsv4_sched_stats st;
    dsv4_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.queue_depth, 1);
    CHECK_EQ_INT(st.rejected_busy, 1);
    /* releasing cancels: the waiting one never runs */
    dsv4_request_release(b);
    dsv4_request_release(a);
    dsv4_sched_stop(s, 0);
}

/* A burst that fits the free slots is accepted whether or not the engine thread has moved the
 * first requests into their slots yet (queue capacity 0: nothing may wait beyond the free
 * slots); the request after them is refused either way.  Before, the capacity counted every
 * request the engine had not yet admitted, so with capacity 0 every submission was refused,
 * and a burst of max_seqs requests into an idle server got 429 when the engine thread was
 * slow to wake (tests/cli_server.sh's concurrent case, on a loaded machine). */
static void test_burst_fits_free_slots(void) {
    REQUIRE(setup() == 0);
    dsv4_sched *s = start(2, 0, 64, 64, 128, 0);
    REQUIRE(s != NULL);
    int32_t p[4];
    make_prompt(p, 4, 5);
    dsv4_request_params rp;
    dsv4_err err = {{0}};
    dsv4_request *a = NULL, *b = NULL, *c = NULL;
    greedy_params(&rp, p, 4, 50);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &a, &err), DSV4_SCHED_OK);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &b, &err), DSV4_SCHED_OK);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &c, &err), DSV4_SCHED_EBUSY);
    CHECK(strstr(err.msg, "busy") != NULL);
    result ra, rb;
    REQUIRE(a && b);
    drain(a, &ra);
    drain(b, &rb);
    CHECK(ra.finished && rb.finished);
    CHECK_EQ_INT(ra.n, 50);
    CHECK_EQ_INT(rb.n, 50);
    /* both slots are free again: a new burst of two is accepted */
    dsv4_request *d = NULL, *e = NULL;
    greedy_params(&rp, p, 4, 2);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &d, &err), DSV4_SCHED_OK);
    CHECK_EQ_INT(dsv4_sched_submit(s, &rp, &e, &err), DSV4_SCHED_OK);
    result rd, re;
    REQUIRE(d && e);
    drain(d, &rd);
    drain(e, &re);
    CHECK(rd.finished && re.finished);
    dsv4_sched_stats st;
    dsv4_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.rejected_busy, 1);
    dsv4_request_release(a);
    dsv4_request_release(b);
    dsv4_request_release(d);
    dsv4_request_release(e);
    dsv4_sched_stop(s, 0);
}

static void test_shutdown_in_flight(void) {
    REQUIRE(setup() == 0);
    int32_t p[8];
    make_prompt(p, 8, 21);
    dsv4_request_params rp;
    dsv4_err err = {{0}};
    /* hard stop: every request ends cancelled, the caller's references stay valid */
    dsv4_sched *s = start(2, 8, 256, 512, 0, 1);
    REQUIRE(s);
    dsv4_request *r[4];
    greedy_params(&rp, p, 8, 10000);
    for (int i = 0; i < 4; i++)
        REQUIRE(dsv4_sched_submit(s, &rp, &r[i], &err) == DSV4_SCHED_OK);
    dsv4_event ev;
    CHECK_EQ_INT(dsv4_request_next_event(r[0], &ev, 30), 1);
    dsv4_event_clear(&ev);
    dsv4_sched_stop(s, 1);
    for (int i = 0; i < 4; i++) {
        result res;
        drain(r[i], &res);
        CHECK(res.finished);
        CHECK_EQ_INT(res.why, DSV4_FINISH_CANCELLED);
        dsv4_request_release(r[i]);
    }
    /* graceful stop: queued and running requests complete, new ones are refused */
    s = start(1, 8, 256, 512, 0, 1);
    REQUIRE(s);
    greedy_params(&rp, p, 8, 3);
    for (int i = 0; i < 3; i++)
        REQUIRE(dsv4_sched_submit(s, &rp, &r[i], &err) == DSV4_SCHED_OK);
    dsv4_sched_stop(s, 0);
    for (int i = 0; i < 3; i++) {
        result res;
        drain(r[i], &res);
        CHECK_EQ_INT(res.why, DSV4_FINISH_LENGTH);
        CHECK_EQ_INT(res.n, 3);
        dsv4_request_release(r[i]);
    }
}

/* ----- output parsing with forced tokens: reasoning, content, tool calls, stop strings ----- */
static int encode(const char *text, int32_t *out, int cap) {
    dsv4_ids ids = {0};
    dsv4_err err = {{0}};
    if (dsv4_tokenizer_encode(g_tok, text, strlen(text), 0, &ids, &err) || (int)ids.len > cap) {
        dsv4_ids_free(&ids);
        return -1;
    }
    memcpy(out, ids.ids, sizeof(int32_t) * ids.len);
    int n = (int)ids.len;
    dsv4_ids_free(&ids);
    return n;
}

static void test_output_events(void) {
    REQUIRE(setup() == 0);
    dsv4_sched *s = start(4, 8, 256, 512, 0, 0);
    REQUIRE(s);
    int32_t p[4], forced[128];
    make_prompt(p, 4, 8);
    dsv4_err err = {{0}};
    dsv4_request_params rp;
    dsv4_request *r;
    result res;

    /* thinking, then an answer, then EOS */
    int n = encode("why not</think>Because." DSV4_CHAT_EOS, forced, 128);
    REQUIRE(n > 0);
    greedy_params(&rp, p, 4, 64);
    rp.ignore_eos = 0;
    rp.output = DSV4_OUTPUT_CHAT;
    rp.start_mode = DSV4_CHAT_MODE_THINKING;
    rp.forced_ids = forced;
    rp.n_forced = n;
    REQUIRE(dsv4_sched_submit(s, &rp, &r, &err) == DSV4_SCHED_OK);
    drain(r, &res);
    dsv4_request_release(r);
    CHECK_STR(res.reasoning, "why not");
    CHECK_STR(res.content, "Because.");
    CHECK_EQ_INT(res.why, DSV4_FINISH_STOP);
    CHECK_EQ_INT(res.usage.completion_tokens, n);

    /* a tool call */
    n = encode("ok\n\n<" DSV4_CHAT_DSML "tool_calls>\n<" DSV4_CHAT_DSML
               "invoke name=\"get\">\n<" DSV4_CHAT_DSML
               "parameter name=\"x\" string=\"false\">12</" DSV4_CHAT_DSML "parameter>\n</" DSV4_CHAT_DSML
               "invoke>\n</" DSV4_CHAT_DSML "tool_calls>" DSV4_CHAT_EOS,
               forced, 128);
    REQUIRE(n > 0);
    rp.start_mode = DSV4_CHAT_MODE_CHAT;
    rp.parse_tools = 1;
    rp.n_forced = n;
    REQUIRE(dsv4_sched_submit(s, &rp, &r, &err) == DSV4_SCHED_OK);
    drain(r, &res);
    dsv4_request_release(r);
    CHECK_STR(res.content, "ok");
    CHECK_EQ_INT(res.n_calls, 1);
    CHECK_STR(res.call_name, "get");
    CHECK(strstr(res.call_args, "\"x\"") && strstr(res.call_args, "12"));
    CHECK_EQ_INT(res.why, DSV4_FINISH_TOOL_CALLS);

    /* the same without tool parsing: the block stays text */
    rp.parse_tools = 0;
    REQUIRE(dsv4_sched_submit(s, &rp, &r, &err) == DSV4_SCHED_OK);
    drain(r, &res);
    dsv4_request_release(r);
    CHECK_EQ_INT(res.n_calls, 0);
    CHECK(strstr(res.content, "invoke name=\"get\"") != NULL);
    CHECK_EQ_INT(res.why, DSV4_FINISH_STOP);

    /* a stop string across tokens, raw output; UTF-8 stays whole */
    n = encode("héllo wörld STOP more text", forced, 128);
    REQUIRE(n > 0);
    const char *stops[] = {"STOP"};
    greedy_params(&rp, p, 4, 64);
    rp.forced_ids = forced;
    rp.n_forced = n;
    rp.stop = stops;
    rp.n_stop = 1;
    REQUIRE(dsv4_sched_submit(s, &rp, &r, &err) == DSV4_SCHED_OK);
    drain(r, &res);
    dsv4_request_release(r);
    CHECK_STR(res.content, "héllo wörld ");
    CHECK_EQ_INT(res.why, DSV4_FINISH_STOP);

    /* seeds: an unseeded request reports the seed it drew; replaying it gives the same tokens */
    result a, b;
    greedy_params(&rp, p, 4, 4);
    rp.sampling.temperature = 1.0f;
    REQUIRE(dsv4_sched_submit(s, &rp, &r, &err) == DSV4_SCHED_OK);
    drain(r, &a);
    dsv4_request_release(r);
    rp.sampling.has_seed = 1;
    rp.sampling.seed = a.usage.seed;
    REQUIRE(dsv4_sched_submit(s, &rp, &r, &err) == DSV4_SCHED_OK);
    drain(r, &b);
    dsv4_request_release(r);
    CHECK_EQ_INT(a.n, 4);
    CHECK(memcmp(a.toks, b.toks, sizeof(int32_t) * 4) == 0);

    /* logprobs ride on TOKEN events */
    greedy_params(&rp, p, 4, 2);
    rp.sampling.logprobs = 1;
    rp.sampling.top_logprobs = 3;
    REQUIRE(dsv4_sched_submit(s, &rp, &r, &err) == DSV4_SCHED_OK);
    int n_tok = 0;
    for (;;) {
        dsv4_event ev;
        if (dsv4_request_next_event(r, &ev, 30) != 1) break;
        int fin = ev.type == DSV4_EV_FINISHED;
        if (ev.type == DSV4_EV_TOKEN) {
            n_tok++;
            CHECK_EQ_INT(ev.sample.n_top, 3);
            CHECK(ev.sample.logprob <= 0 && ev.sample.top_logprobs[0] >= ev.sample.top_logprobs[2]);
            CHECK_EQ_INT(ev.sample.top_ids[0], ev.sample.token); /* greedy: the best one */
            CHECK(ev.text != NULL);
        }
        dsv4_event_clear(&ev);
        if (fin) break;
    }
    dsv4_request_release(r);
    CHECK_EQ_INT(n_tok, 2);
    dsv4_sched_stop(s, 0);
}

/* ----- bounded load: many short requests from several threads ----- */
typedef struct load_arg {
    dsv4_sched *s;
    int id, n, ok, busy;
} load_arg;

static void *load_thread(void *p) {
    load_arg *a = p;
    for (int i = 0; i < a->n; i++) {
        int32_t prompt[8];
        int len = 2 + (a->id + i) % 5;
        make_prompt(prompt, len, (uint32_t)((a->id * 31 + i) % 7)); /* repeats: prefix hits */
        dsv4_request_params rp;
        greedy_params(&rp, prompt, len, 1 + i % 3);
        dsv4_request *r = NULL;
        dsv4_err err = {{0}};
        int rc = dsv4_sched_submit(a->s, &rp, &r, &err);
        if (rc == DSV4_SCHED_EBUSY) {
            a->busy++;
            continue;
        }
        if (rc) continue;
        if (i % 4 == 3) dsv4_request_cancel(r); /* some clients go away */
        result res;
        drain(r, &res);
        if (res.finished) a->ok++;
        dsv4_request_release(r);
    }
    return NULL;
}

static void test_load_returns_to_baseline(void) {
    REQUIRE(setup() == 0);
    dsv4_sched *s = start(6, 64, 256, 512, 0, 1);
    REQUIRE(s);
    enum { NT = 5, PER = 10 };
    pthread_t th[NT];
    load_arg args[NT];
    for (int i = 0; i < NT; i++) {
        args[i] = (load_arg){.s = s, .id = i, .n = PER};
        REQUIRE(pthread_create(&th[i], NULL, load_thread, &args[i]) == 0);
    }
    int ok = 0, busy = 0;
    for (int i = 0; i < NT; i++) {
        pthread_join(th[i], NULL);
        ok += args[i].ok;
        busy += args[i].busy;
    }
    CHECK_EQ_INT(ok + busy, NT * PER);
    CHECK_EQ_INT(busy, 0);
    dsv4_sched_stats st;
    dsv4_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.running, 0);
    CHECK_EQ_INT(st.queue_depth, 0);
    CHECK_EQ_INT(st.submitted, NT * PER);
    uint64_t fin = 0;
    for (int i = 0; i < DSV4_FINISH_COUNT; i++)
        fin += st.finished[i];
    CHECK_EQ_INT(fin, NT * PER);
    CHECK(st.cached_tokens > 0);
    CHECK(st.ttft.count > 0);
    CHECK_EQ_INT(st.ttft.le[DSV4_SCHED_N_BUCKETS - 1], st.ttft.count);
    dsv4_sched_flush_cache(s);
    dsv4_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.state_bytes, 0);
    dsv4_sched_stop(s, 0);
}

static void test_bad_options(void) {
    REQUIRE(setup() == 0);
    dsv4_sched_opts o;
    dsv4_sched_opts_default(&o);
    o.max_seqs = 0;
    dsv4_sched *s = NULL;
    dsv4_err err = {{0}};
    CHECK(dsv4_sched_start(&s, g_engine, g_tok, &o, &err) == -1);
    CHECK(strstr(err.msg, "max-seqs") != NULL);
    dsv4_sched_opts_default(&o);
    o.ctx = -5;
    CHECK(dsv4_sched_start(&s, g_engine, g_tok, &o, &err) == -1);
    CHECK(strstr(err.msg, "ctx") != NULL);
    CHECK(s == NULL);
    dsv4_sched_stop(NULL, 0);
    dsv4_request_release(NULL);
}

/* dsv4_engine_host_alloc: zero-filled, 64-byte aligned, writable, freed by its own allocator
 * whichever it was (malloc here; page-locked on a device backend), NULL freed as a no-op; the
 * logits of a step land in it as in a malloc'd row */
static void test_host_buffers(void) {
    REQUIRE(setup() == 0);
    size_t sizes[] = {1, 63, 64, 4096, (size_t)g_vocab * sizeof(float)};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        unsigned char *p = dsv4_engine_host_alloc(g_engine, sizes[i]);
        REQUIRE(p != NULL);
        CHECK(((uintptr_t)p & 63) == 0);
        size_t nz = 0;
        for (size_t j = 0; j < sizes[i]; j++) nz += p[j] != 0;
        CHECK(nz == 0);
        memset(p, 0xab, sizes[i]);
        dsv4_engine_host_free(g_engine, p);
    }
    dsv4_engine_host_free(g_engine, NULL);
    setenv("DSV4_HOST_PAGEABLE", "1", 1); /* the malloc path, asked for */
    float *q = dsv4_engine_host_alloc(g_engine, sizeof(float) * (size_t)g_vocab);
    unsetenv("DSV4_HOST_PAGEABLE");
    float *h = dsv4_engine_host_alloc(g_engine, sizeof(float) * (size_t)g_vocab);
    float *m = malloc(sizeof(float) * (size_t)g_vocab);
    REQUIRE(q && h && m);
    int32_t tok[5] = {11, 12, 13, 14, 15};
    dsv4_seq *s1 = NULL, *s2 = NULL, *s3 = NULL;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_seq_new(g_engine, &s1, &err) == 0 && dsv4_seq_new(g_engine, &s2, &err) == 0 &&
            dsv4_seq_new(g_engine, &s3, &err) == 0);
    CHECK(dsv4_seq_append(s1, tok, 5, h, 0, &err) == 0);
    CHECK(dsv4_seq_append(s2, tok, 5, m, 0, &err) == 0);
    CHECK(dsv4_seq_append(s3, tok, 5, q, 0, &err) == 0);
    CHECK(memcmp(h, m, sizeof(float) * (size_t)g_vocab) == 0);
    CHECK(memcmp(q, m, sizeof(float) * (size_t)g_vocab) == 0);
    float amax = 0;
    for (int i = 0; i < g_vocab; i++) amax = fmaxf(amax, fabsf(h[i]));
    CHECK(amax > 0); /* the row was written, not left at the allocation's zeros */
    dsv4_seq_free(s1), dsv4_seq_free(s2), dsv4_seq_free(s3);
    dsv4_engine_host_free(g_engine, q);
    dsv4_engine_host_free(g_engine, h);
    free(m);
}

TEST_MAIN(test_host_buffers, test_batch_equals_serial, test_chunked_prefill_interleaves, test_prefix_reuse_bit_exact,
          test_prefix_reuse_sched, test_cancel_frees_state, test_busy_and_context, test_burst_fits_free_slots, test_shutdown_in_flight,
          test_output_events, test_load_returns_to_baseline, test_bad_options)
