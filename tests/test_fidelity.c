/* tests/test_fidelity: the pieces of the fidelity tools that need no model:
 * grading, SPEC parsing, token lists, recall bookkeeping, deterministic prompt
 * builders (and that the multi-turn conversation renders in the V4 chat format
 * with its tools), report escaping.  The CLI paths are in tests/cli_fidelity.sh. */
#include "test.h"

#include <unistd.h>

#include "../src/fidelity/suite.c"

static void test_grade_exact_six_digits(void) {
    CHECK(grade("The answer is 123456.", "123456"));
    CHECK(grade("123456", "123456"));
    CHECK(!grade("1234567", "123456"));      /* seven digits is not the number */
    CHECK(grade("12345 then 123456", "123456")); /* 5-digit runs are skipped */
    CHECK(!grade("654321 or 123456", "123456")); /* only the first 6-digit run counts */
    CHECK(!grade("", "123456"));
    CHECK(!grade("no digits", "123456"));
}

static void test_spec_parse(void) {
    fid_spec s;
    dsv4_err err = {{0}};
    CHECK(fid_spec_parse(&s, "exact", &err) == 0);
    CHECK_EQ_INT(s.n_sets, 0);
    CHECK_STR(s.backend, "cpu");
    CHECK(fid_spec_parse(&s, "reference,mhc.gemm=bf16,indexer.keys=fp8,backend=cpu", &err) == 0);
    CHECK_EQ_INT(s.n_sets, 2);
    CHECK_STR(s.sets[1], "indexer.keys=fp8");
    CHECK_STR(s.profile, "reference");
    CHECK(fid_spec_parse(&s, "mhc.gemm=bf16", &err) == -1 && strstr(err.msg, "profile"));
    CHECK(fid_spec_parse(&s, "exact,mhc.gemm", &err) == -1 && strstr(err.msg, "not name=value"));
    CHECK(fid_spec_parse(&s, "exact,mhc.gemm=fp16", &err) == -1 && strstr(err.msg, "mhc.gemm"));
    CHECK(fid_spec_parse(&s, "fast", &err) == -1);
    CHECK(fid_spec_parse(&s, "", &err) == -1);
    CHECK(fid_spec_parse(&s, "exact,backend=tpu", &err) == -1 && strstr(err.msg, "unknown backend"));
#ifndef DSV4_HAVE_CUDA
    CHECK(fid_spec_parse(&s, "exact,backend=cuda", &err) == -1 && strstr(err.msg, "backend cuda not built"));
#endif
}

static void test_ids(void) {
    int32_t *v = NULL;
    int n = 0;
    dsv4_err err = {{0}};
    CHECK(fid_parse_ids(" 5,17\n42 ", "t", &v, &n, &err) == 0);
    CHECK_EQ_INT(n, 3);
    if (v) CHECK_EQ_INT(v[2], 42);
    free(v);
    CHECK(fid_parse_ids("5,-1", "t", &v, &n, &err) == -1 && strstr(err.msg, "'-1'"));
    CHECK(fid_parse_ids(" , ", "t", &v, &n, &err) == -1 && strstr(err.msg, "no token ids"));
    int32_t a[16], b[16];
    fid_synthetic_ids(a, 16, 7, 100, 200);
    fid_synthetic_ids(b, 16, 7, 100, 200);
    CHECK(!memcmp(a, b, sizeof a));
    for (int i = 0; i < 16; i++) CHECK(a[i] >= 100 && a[i] < 200);
}

static void test_picks_recall(void) {
    fid_picks r, g;
    dsv4_err err = {{0}};
    REQUIRE(fid_picks_init(&r, 2, 2, 40, 1.5, &err) == 0);
    REQUIRE(fid_picks_init(&g, 2, 2, 40, 1.5, &err) == 0);
    int experts[2] = {0, 1};
    float w_ok[2] = {1.0f, 0.5f}, w_bad[2] = {1.5f, 0.75f};
    for (int p = 0; p < 40; p++) {
        int32_t pr[2] = {1, 3}, pg[2] = {1, p < 20 ? 3 : 4}; /* half the rows lose one pick */
        dsv4_trace_event e = {.layer = 1, .pos = p, .n_experts = 2, .experts = experts, .weights = w_ok,
                              .n_picks = 2, .picks = pr};
        fid_picks_trace(&e, &r);
        e.picks = pg;
        e.weights = p == 7 ? w_bad : w_ok;
        fid_picks_trace(&e, &g);
    }
    int64_t hit = 0, tot = 0;
    fid_picks_recall(&r, &g, 1, 0, 40, 4, &hit, &tot);
    /* rows with (p+1)/4 <= topk 2 (p <= 10) see everything and are skipped: 29 rows x 2 picks;
     * p 11..19 keep both picks, p 20..39 keep one */
    CHECK_EQ_INT(tot, 58);
    CHECK_EQ_INT(hit, 9 * 2 + 20 * 1);
    CHECK_EQ_INT(r.route_bad, 0);
    CHECK_EQ_INT(g.route_bad, 1);
    CHECK_NEAR(g.route_worst, 0.75, 1e-6);
    fid_picks_free(&r);
    fid_picks_free(&g);
}

static fid_results *make_results(int needle) {
    static fid_results r;
    static fid_item items[8];
    memset(&r, 0, sizeof r);
    memset(items, 0, sizeof items);
    r.suite = needle ? "needle" : "multiturn";
    r.items = items;
    r.axis_a[0] = 300, r.axis_a[1] = 3, r.n_a = 2;
    r.axis_b[0] = 50, r.n_b = 1;
    r.tool_tokens = 200;
    r.n_items = 2;
    uint64_t rng = 5;
    for (int i = 0; i < 2; i++) {
        items[i].a = i;
        new_secret(&r, i, &rng, items[i].key, sizeof items[i].key, items[i].expect, sizeof items[i].expect);
    }
    return &r;
}

static void test_needle_prompt(void) {
    fid_results *r = make_results(1);
    CHECK(strcmp(r->items[0].key, r->items[1].key) || strcmp(r->items[0].expect, r->items[1].expect));
    json_t *a = needle_messages(r, &r->items[0], 9), *b = needle_messages(r, &r->items[0], 9);
    REQUIRE(a && b);
    const char *ta = json_string_value(json_object_get(json_array_get(a, 0), "content"));
    const char *tb = json_string_value(json_object_get(json_array_get(b, 0), "content"));
    REQUIRE(ta && tb);
    CHECK_STR(ta, tb); /* deterministic */
    char needle[160];
    snprintf(needle, sizeof needle, "The secret code for %s is %s.", r->items[0].key, r->items[0].expect);
    const char *at = strstr(ta, needle);
    CHECK(at != NULL);
    CHECK(strstr(ta, r->items[0].expect) == strrchr(ta, r->items[0].expect[0]) || at); /* planted */
    size_t len = strlen(ta);
    CHECK(len > 1000 && len < 1600); /* ~300 tokens of 4 characters */
    if (at) CHECK_NEAR((double)(at - ta) / len, 0.5, 0.1);
    json_decref(a);
    json_decref(b);
}

static void test_multiturn_renders_with_tools(void) {
    fid_results *r = make_results(0);
    json_t *m = multiturn_messages(r, &r->items[1], 3), *tools = search_tool();
    REQUIRE(m && tools);
    /* system, user (fact), assistant, 3 x (user, assistant+call, tool, assistant), question */
    CHECK_EQ_INT(json_array_size(m), 3 + 3 * 4 + 1);
    dsv4_chat_opts o;
    dsv4_chat_opts_default(&o);
    char *text = NULL;
    dsv4_err err = {{0}};
    int rc = dsv4_chat_render(m, tools, &o, &text, NULL, &err);
    CHECKF(rc == 0, "%s", err.msg);
    if (!rc) {
        CHECK(strstr(text, "search_docs") != NULL);
        CHECK(strstr(text, r->items[1].expect) != NULL);
        CHECK(strstr(text, DSV4_CHAT_DSML) != NULL); /* tool calls in DSML */
    }
    free(text);
    json_decref(m);
    json_decref(tools);
}

static void test_report_escapes(void) {
    fid_results *r = make_results(1);
    r->items[0].done = 1;
    snprintf(r->items[0].answer, sizeof r->items[0].answer, "<script>alert(1)</script> & \"x\"");
    r->meaningless = 1;
    char path[] = "/tmp/dsv4-test-fidelity-XXXXXX";
    int fd = mkstemp(path);
    REQUIRE(fd >= 0);
    close(fd);
    dsv4_err err = {{0}};
    CHECK(fid_results_write_html(r, path, &err) == 0);
    size_t n = 0;
    char *html = fid_read_file(path, &n, &err);
    REQUIRE(html);
    CHECK(!strstr(html, "<script>"));
    CHECK(strstr(html, "&lt;script&gt;") != NULL);
    CHECK(strstr(html, "id=\"meaningless\"") != NULL);
    CHECK(strstr(html, "<svg") != NULL);
    free(html);
    CHECK(fid_results_write_json(r, path, &err) == 0);
    html = fid_read_file(path, &n, &err);
    REQUIRE(html);
    json_error_t je;
    json_t *doc = json_loads(html, 0, &je);
    CHECKF(doc != NULL, "%s", je.text);
    CHECK(json_is_true(json_object_get(doc, "meaningless")));
    json_decref(doc);
    free(html);
    unlink(path);
    CHECK(fid_results_write_html(r, "/nonexistent-dir/x.html", &err) == -1 && strstr(err.msg, "/nonexistent-dir"));
}

TEST_MAIN(test_grade_exact_six_digits, test_spec_parse, test_ids, test_picks_recall, test_needle_prompt,
          test_multiturn_renders_with_tools, test_report_escapes)
