/* tests/test_numerics: profiles, --set parsing and its errors, the switch table. */
#include <string.h>

#include "model/numerics.h"
#include "test.h"

static void test_profiles(void) {
    dsv4_numerics n;
    dsv4_err err;
    REQUIRE(dsv4_numerics_profile(&n, "exact", &err) == 0);
    CHECK(memcmp(&n, &DSV4_NUMERICS_EXACT, sizeof n) == 0);
    REQUIRE(dsv4_numerics_profile(&n, NULL, &err) == 0); /* default */
    CHECK(memcmp(&n, &DSV4_NUMERICS_EXACT, sizeof n) == 0);
    REQUIRE(dsv4_numerics_profile(&n, "reference", &err) == 0);
    CHECK(n.linear_act_fp8 && n.act_bf16 && n.kv_sim_fp8 && n.indexer_sim_fp4 && n.hc_state_bf16 &&
          n.moe_before_w2 && n.attn_prob_bf16 && n.indexer_score_bf16);
    CHECK(dsv4_numerics_profile(&n, "fast", &err) != 0);
    CHECK(strstr(err.msg, "'fast'") && strstr(err.msg, "exact, reference"));
    /* exact = no simulation at all: every switch at its first value except nothing */
    for (int i = 0; i < dsv4_numerics_n_switches(); i++) {
        const dsv4_switch_info *s = dsv4_numerics_switch(i);
        CHECK(s && s->name && s->values && s->meaning && s->spec);
        CHECK(strncmp(s->values, dsv4_numerics_value(&DSV4_NUMERICS_EXACT, i),
                      strlen(dsv4_numerics_value(&DSV4_NUMERICS_EXACT, i))) == 0);
    }
}

static void test_set(void) {
    dsv4_numerics n = DSV4_NUMERICS_EXACT;
    dsv4_err err;
    REQUIRE(dsv4_numerics_set(&n, "kv.sim=fp8", &err) == 0);
    CHECK(n.kv_sim_fp8 == 1);
    REQUIRE(dsv4_numerics_set(&n, "indexer.keys=fp4", &err) == 0);
    CHECK(n.indexer_keys == DSV4_IKEYS_FP4);
    REQUIRE(dsv4_numerics_set(&n, "moe.route_scale=both", &err) == 0);
    CHECK(n.route_scale == DSV4_RSCALE_BOTH);
    dsv4_numerics before = n;
    CHECK(dsv4_numerics_set(&n, "kv.sim=fp16", &err) != 0);
    CHECK(strstr(err.msg, "no value 'fp16'") && strstr(err.msg, "none|fp8"));
    CHECK(dsv4_numerics_set(&n, "kv.simx=fp8", &err) != 0);
    CHECK(strstr(err.msg, "unknown switch 'kv.simx'") && strstr(err.msg, "linear.act"));
    CHECK(dsv4_numerics_set(&n, "kv.sim", &err) != 0);
    CHECK(strstr(err.msg, "NAME=VALUE"));
    CHECK(dsv4_numerics_set(&n, "=fp8", &err) != 0);
    CHECK(dsv4_numerics_set(&n, "kv.sim=", &err) != 0);
    CHECK(dsv4_numerics_set(&n, NULL, &err) != 0);
    CHECK(memcmp(&n, &before, sizeof n) == 0); /* unchanged on error */
    /* every listed value of every switch round-trips through set/value */
    for (int i = 0; i < dsv4_numerics_n_switches(); i++) {
        const dsv4_switch_info *s = dsv4_numerics_switch(i);
        char vals[128];
        snprintf(vals, sizeof vals, "%s", s->values);
        for (char *v = strtok(vals, "|"); v; v = strtok(NULL, "|")) {
            char a[160];
            snprintf(a, sizeof a, "%s=%s", s->name, v);
            CHECK(dsv4_numerics_set(&n, a, &err) == 0);
            CHECK_STR(dsv4_numerics_value(&n, i), v);
        }
    }
    char buf[1024];
    dsv4_numerics_format(&DSV4_NUMERICS_REFERENCE, buf, sizeof buf);
    CHECK(strstr(buf, "kv.sim=fp8") && strstr(buf, "moe.weight=before_w2"));
    dsv4_numerics_format(&DSV4_NUMERICS_REFERENCE, buf, 8); /* truncates safely */
    CHECK(strlen(buf) < 8);
}

TEST_MAIN(test_profiles, test_set)
