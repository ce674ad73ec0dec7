/* tests/test_state: state layout, checkpoints and rewinding, clone, serialization
 * (without the forward pass: buffers are filled by hand). */
#include <string.h>

#include "model/config.h"
#include "model/state.h"
#include "test.h"

static void fill_state(dsv4_state *s, float v) {
    for (int l = 0; l < s->n_layers; l++) {
        dsv4_layer_state *L = &s->layers[l];
        for (int i = 0; i < s->window * s->head_dim; i++) L->ring[i] = v + (float)i;
        for (int i = 0; i < s->window; i++) L->ring_pos[i] = s->len - s->window + i;
        dsv4_comp_state *cs[2] = {L->has_comp ? &L->comp : NULL, L->has_idx ? &L->icomp : NULL};
        for (int k = 0; k < 2; k++) {
            if (!cs[k]) continue;
            size_t n = (size_t)cs[k]->coff * cs[k]->ratio * cs[k]->coff * cs[k]->dim;
            for (size_t i = 0; i < n; i++) cs[k]->kv[i] = cs[k]->score[i] = v * 2 + (float)i;
            cs[k]->n_rows = s->len / cs[k]->ratio;
            for (int64_t i = 0; i < cs[k]->n_rows * cs[k]->dim; i++) cs[k]->rows[i] = v + (float)i;
        }
    }
    for (int i = 0; i < s->hc_dim; i++) s->last_x[i] = v;
    for (int64_t i = 0; i < s->len; i++) s->tokens[i] = (int32_t)(i * 7 + (int)v);
}

static void test_layout_and_period(void) {
    dsv4_config c;
    dsv4_err err;
    REQUIRE(dsv4_config_builtin(&c, "tiny", &err) == 0);
    CHECK_EQ_INT(dsv4_state_period(&c), 16); /* lcm(16, 4, 8) */
    dsv4_config f;
    REQUIRE(dsv4_config_builtin(&f, "flash", &err) == 0);
    CHECK_EQ_INT(dsv4_state_period(&f), 128);
    dsv4_state *s = NULL;
    REQUIRE(dsv4_state_new(&s, &c, 20, &err) == 0);
    CHECK_EQ_INT(s->snapshot_every, 32); /* rounded up to the period */
    CHECK_EQ_INT(s->n_layers, 6);
    CHECK(!s->layers[0].has_comp && s->layers[1].has_comp && s->layers[1].has_idx && s->layers[2].has_comp &&
          !s->layers[2].has_idx && !s->layers[5].has_comp);
    CHECK_EQ_INT(s->layers[1].comp.coff, 2);
    CHECK_EQ_INT(s->layers[2].comp.coff, 1);
    CHECK(isinf(s->layers[1].comp.score[0]) && s->layers[1].comp.score[0] < 0); /* absent = -inf */
    for (int i = 0; i < s->window; i++) CHECK_EQ_INT(s->layers[0].ring_pos[i], -1);
    size_t b0 = dsv4_state_bytes(s);
    s->len = 0;
    REQUIRE(dsv4_state_reserve(s, 1000, &err) == 0);
    CHECK(dsv4_state_bytes(s) > b0);
    dsv4_state_free(s);
}

static void test_checkpoint_rewind(void) {
    dsv4_config c;
    dsv4_err err;
    REQUIRE(dsv4_config_builtin(&c, "tiny", &err) == 0);
    dsv4_state *s = NULL;
    REQUIRE(dsv4_state_new(&s, &c, 16, &err) == 0);
    REQUIRE(dsv4_state_reserve(s, 100, &err) == 0);
    s->len = 32;
    fill_state(s, 1);
    REQUIRE(dsv4_state_checkpoint(s, &err) == 0);
    s->len = 48;
    fill_state(s, 2);
    REQUIRE(dsv4_state_checkpoint(s, &err) == 0);
    s->len = 57;
    fill_state(s, 3);
    int64_t from = -1;
    REQUIRE(dsv4_state_rewind(s, 40, &from, &err) == 0);
    CHECK_EQ_INT(from, 32);
    CHECK_EQ_INT(s->len, 32);
    CHECK(s->layers[0].ring[0] == 1.0f); /* restored from the 32 checkpoint */
    CHECK(s->last_x[0] == 1.0f);
    CHECK_EQ_INT(s->layers[1].comp.n_rows, 8);
    CHECK_EQ_INT(s->layers[2].comp.n_rows, 4);
    CHECK_EQ_INT(s->n_ckpt, 1); /* the 48 one is gone */
    /* ratio-4 previous-window rows restored; current-window rows reset */
    dsv4_comp_state *cs = &s->layers[1].comp;
    CHECK(cs->kv[0] == 2.0f);
    size_t half = (size_t)cs->ratio * cs->coff * cs->dim;
    CHECK(cs->kv[half] == 0.0f && isinf(cs->score[half]));
    REQUIRE(dsv4_state_rewind(s, 5, &from, &err) == 0);
    CHECK_EQ_INT(from, 0);
    CHECK_EQ_INT(s->len, 0);
    CHECK_EQ_INT(s->layers[0].ring_pos[0], -1);
    CHECK(dsv4_state_rewind(s, 1, &from, &err) != 0); /* beyond the length */
    CHECK(strstr(err.msg, "outside [0, 0]") != NULL);
    dsv4_state_free(s);
}

/* Checkpoints are thinned as a sequence grows: after each of 1000 intervals the set is exactly
 * the newest DSV4_CKPT_DENSE plus, further back, the multiples of 2^j at distances in
 * [D 2^(j-1), D 2^j) intervals (checked against that rule written out here, not the code's
 * loop); the count stays logarithmic; a rewind restores the newest kept checkpoint at or below
 * the target (its ring values show which), and the gap it leaves to re-run is <= 2 d / D + 1. */
static int want_kept(int64_t k, int64_t K) {
    int64_t d = K - k, D = DSV4_CKPT_DENSE;
    if (d < D) return 1;
    for (int j = 1; j < 40; j++)
        if (d >= D << (j - 1) && d < D << j) return k % ((int64_t)1 << j) == 0;
    return 0;
}

static void test_checkpoint_thinning(void) {
    dsv4_config c;
    dsv4_err err;
    REQUIRE(dsv4_config_builtin(&c, "tiny", &err) == 0);
    dsv4_state *s = NULL;
    REQUIRE(dsv4_state_new(&s, &c, 16, &err) == 0);
    int64_t E = s->snapshot_every;
    enum { N = 1000 };
    REQUIRE(dsv4_state_reserve(s, N * E, &err) == 0);
    int bad = 0, most = 0;
    for (int64_t K = 1; K <= N; K++) {
        s->len = K * E;
        fill_state(s, (float)K);
        REQUIRE(dsv4_state_checkpoint(s, &err) == 0);
        int i = 0;
        for (int64_t k = 1; k <= K; k++) {
            if (!want_kept(k, K)) continue;
            if (i >= s->n_ckpt || s->ckpt[i].pos != k * E) bad++;
            i++;
        }
        if (i != s->n_ckpt) bad++;
        if (s->n_ckpt > most) most = s->n_ckpt;
    }
    printf("  1000 intervals of %lld tokens: %d checkpoints kept (most %d), %d mismatches with the rule\n",
           (long long)E, s->n_ckpt, most, bad);
    CHECK(bad == 0);
    CHECK(s->n_ckpt <= DSV4_CKPT_DENSE * 7); /* D + D/2 log2(1000 / 16) = 64 */
    CHECK(s->ckpt[s->n_ckpt - 1].pos == N * E);
    /* rewinds: the newest kept checkpoint at or below the target */
    static const int64_t targets[] = {N * 16 - 3, 700 * 16 + 5, 333 * 16, 100 * 16 + 1, 17};
    for (size_t t = 0; t < sizeof targets / sizeof targets[0]; t++) {
        int64_t L = targets[t] * E / 16, from = -1, want = 0;
        for (int i = 0; i < s->n_ckpt; i++)
            if (s->ckpt[i].pos <= L) want = s->ckpt[i].pos;
        int64_t d = (N * E - L) / E; /* from the newest checkpoint when the set was thinned */
        REQUIRE(dsv4_state_rewind(s, L, &from, &err) == 0);
        CHECKF(from == want, "rewind to %lld: from %lld, expected %lld", (long long)L, (long long)from,
               (long long)want);
        CHECKF((L - from) / E <= 2 * d / DSV4_CKPT_DENSE + 1, "rewind to %lld leaves %lld tokens to re-run",
               (long long)L, (long long)(L - from));
        if (from > 0) CHECK(s->layers[0].ring[0] == (float)(from / E)); /* that checkpoint's contents */
        printf("  rewind to %lld: from checkpoint %lld (%lld tokens to re-run)\n", (long long)L, (long long)from,
               (long long)(L - from));
    }
    dsv4_state_free(s);
}

static void test_clone_serialize(void) {
    dsv4_config c;
    dsv4_err err;
    REQUIRE(dsv4_config_builtin(&c, "tiny", &err) == 0);
    dsv4_state *s = NULL, *d = NULL, *t = NULL;
    REQUIRE(dsv4_state_new(&s, &c, 16, &err) == 0);
    REQUIRE(dsv4_state_reserve(s, 100, &err) == 0);
    s->len = 16;
    fill_state(s, 4);
    REQUIRE(dsv4_state_checkpoint(s, &err) == 0);
    s->len = 37;
    fill_state(s, 5);
    REQUIRE(dsv4_state_clone(s, &d, &err) == 0);
    CHECK_EQ_INT(d->len, 37);
    CHECK(d->layers[3].comp.rows[5] == s->layers[3].comp.rows[5]);
    CHECK(d->layers[3].comp.rows != s->layers[3].comp.rows);
    CHECK_EQ_INT(d->n_ckpt, 1);
    void *blob = NULL;
    size_t n = 0;
    REQUIRE(dsv4_state_serialize(s, 42, &blob, &n, &err) == 0);
    REQUIRE(dsv4_state_new(&t, &c, 0, &err) == 0);
    REQUIRE(dsv4_state_deserialize(t, 42, blob, n, &err) == 0);
    CHECK_EQ_INT(t->len, 37);
    CHECK_EQ_INT(t->n_ckpt, 1);
    CHECK_EQ_INT(t->snapshot_every, 16);
    CHECK(t->tokens[36] == s->tokens[36]);
    CHECK(memcmp(t->layers[1].icomp.rows, s->layers[1].icomp.rows, sizeof(float) * 9 * 32) == 0);
    CHECK(dsv4_state_deserialize(t, 43, blob, n, &err) != 0); /* wrong tag */
    for (size_t cut = 0; cut < n; cut += n / 13 + 1) CHECK(dsv4_state_deserialize(t, 42, blob, cut, &err) != 0);
    CHECK_EQ_INT(t->len, 37); /* unchanged by the failures */
    free(blob);
    dsv4_state_free(s);
    dsv4_state_free(d);
    dsv4_state_free(t);
}

TEST_MAIN(test_layout_and_period, test_checkpoint_rewind, test_checkpoint_thinning, test_clone_serialize)
