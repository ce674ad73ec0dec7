/* Tests for text/chat (rendering the V4 prompt) and text/dsml (parsing output).
 * The four official cases live in tests/data/chat (copied from DeepSeek's
 * encoding/tests); DeepSeek's own test script renders 1-3 in thinking mode and 4
 * in chat mode, with case 1's "tools" attached to its first (system) message. */
#include <jansson.h>

#include "test.h"
#include "text/chat.h"
#include "text/dsml.h"

#define U DSV4_CHAT_USER
#define A DSV4_CHAT_ASSISTANT
#define BOS DSV4_CHAT_BOS
#define EOS DSV4_CHAT_EOS
#define D DSV4_CHAT_DSML

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s) s[n] = 0;
    if (len) *len = (size_t)n;
    fclose(f);
    return s;
}

static json_t *J(const char *text) {
    json_error_t e;
    json_t *v = json_loads(text, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &e);
    if (!v) fprintf(stderr, "  bad test JSON: %s: %s\n", e.text, text);
    return v;
}

/* Renders MESSAGES (JSON text) with options; returns malloc'd prompt or NULL (error in *err). */
static char *render(const char *messages, const char *tools, dsv4_chat_mode mode, int drop,
                    dsv4_effort effort, dsv4_err *err) {
    json_t *m = J(messages), *t = tools ? J(tools) : NULL;
    dsv4_chat_opts o;
    dsv4_chat_opts_default(&o);
    o.mode = mode;
    o.drop_thinking = drop;
    o.effort = effort;
    char *out = NULL;
    if (m) dsv4_chat_render(m, t, &o, &out, NULL, err);
    json_decref(m);
    json_decref(t);
    return out;
}

/* ----- the official cases ----- */

static void check_official(int n, dsv4_chat_mode mode) {
    char path[256];
    snprintf(path, sizeof path, "tests/data/chat/test_input_%d.json", n);
    json_error_t je;
    json_t *doc = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    REQUIRE(doc);
    snprintf(path, sizeof path, "tests/data/chat/test_output_%d.txt", n);
    size_t want_len;
    char *want = read_file(path, &want_len);
    REQUIRE(want);
    dsv4_chat_opts o;
    dsv4_chat_opts_default(&o);
    o.mode = mode;
    char *got = NULL;
    size_t got_len = 0;
    dsv4_err err = {{0}};
    int rc = dsv4_chat_render_doc(doc, NULL, &o, &got, &got_len, &err);
    CHECKF(rc == 0, "%s", err.msg);
    if (got) {
        CHECK_EQ_INT(got_len, want_len);
        size_t i = 0;
        while (i < got_len && i < want_len && got[i] == want[i])
            i++;
        CHECKF(got_len == want_len && i == want_len, "case %d differs at byte %zu: got \"%.60s\"", n, i,
               got + i);
    }
    free(got);
    free(want);
    json_decref(doc);
}

static void test_official_1(void) {
    check_official(1, DSV4_CHAT_MODE_THINKING);
}
static void test_official_2(void) {
    check_official(2, DSV4_CHAT_MODE_THINKING);
}
static void test_official_3(void) {
    check_official(3, DSV4_CHAT_MODE_THINKING);
}
static void test_official_4(void) {
    check_official(4, DSV4_CHAT_MODE_CHAT);
}

/* ----- Python json.dumps ----- */

static void check_py(const char *in, const char *want) {
    json_t *v = J(in);
    REQUIRE(v);
    dsv4_chat_buf b = {0};
    dsv4_chat_json_py(&b, v);
    CHECK_STR(b.data, want);
    dsv4_chat_buf_free(&b);
    json_decref(v);
}

static void test_json_py(void) {
    check_py("{\"b\":1,\"a\":[1,2,{}],\"c\":[]}", "{\"b\": 1, \"a\": [1, 2, {}], \"c\": []}");
    check_py("[1.0, 0.1, 1e16, 1e15, 1e-5, 0.0001, -0.0, 1.5e300, 123456789.125, 2.5e-7, 1e22, 3.14159]",
             "[1.0, 0.1, 1e+16, 1000000000000000.0, 1e-05, 0.0001, -0.0, 1.5e+300, 123456789.125, 2.5e-07, "
             "1e+22, 3.14159]");
    check_py("[5e-324, 1.7976931348623157e308, 0.30000000000000004, 100.0, 12345678901234567.0]",
             "[5e-324, 1.7976931348623157e+308, 0.30000000000000004, 100.0, 1.2345678901234568e+16]");
    check_py("[-9223372036854775808, true, false, null]", "[-9223372036854775808, true, false, null]");
    check_py("\"q\\\" b\\\\ n\\n t\\t r\\r \\u0001 \\u001f \\u007f é 中 \\ud83d\\ude00 /\"",
             "\"q\\\" b\\\\ n\\n t\\t r\\r \\u0001 \\u001f \x7f é 中 😀 /\"");
    /* bytes that are not UTF-8 (model output) become U+FFFD */
    dsv4_chat_buf b = {0};
    dsv4_chat_json_py_string(&b, "a\xff\xc3", 3);
    CHECK_STR(b.data, "\"a\xEF\xBF\xBD\xEF\xBF\xBD\"");
    dsv4_chat_buf_free(&b);
}

/* ----- rendering rules ----- */

static void expect_render(const char *messages, const char *tools, dsv4_chat_mode mode, int drop,
                          dsv4_effort eff, const char *want) {
    dsv4_err err = {{0}};
    char *got = render(messages, tools, mode, drop, eff, &err);
    CHECKF(got != NULL, "%s", err.msg);
    if (got) CHECK_STR(got, want);
    free(got);
}

static void expect_error(const char *messages, const char *tools, const char *needle) {
    dsv4_err err = {{0}};
    char *got = render(messages, tools, DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_NONE, &err);
    CHECKF(got == NULL, "rendered instead of failing: %s", messages);
    CHECKF(strstr(err.msg, needle) != NULL, "error \"%s\" lacks \"%s\"", err.msg, needle);
    free(got);
}

static void test_basic_modes(void) {
    const char *m = "[{\"role\":\"user\",\"content\":\"Hi\"}]";
    expect_render(m, NULL, DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_NONE, BOS U "Hi" A "</think>");
    expect_render(m, NULL, DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_NONE, BOS U "Hi" A "<think>");
    /* no BOS */
    json_t *v = J(m);
    dsv4_chat_opts o;
    dsv4_chat_opts_default(&o);
    o.add_bos = 0;
    char *out = NULL;
    REQUIRE(dsv4_chat_render(v, NULL, &o, &out, NULL, NULL) == 0);
    CHECK_STR(out, U "Hi" A "</think>");
    free(out);
    json_decref(v);
    CHECK(dsv4_chat_prompt_opens_thinking("x<think>", 8));
    CHECK(!dsv4_chat_prompt_opens_thinking("x</think>", 9));
}

static void test_drop_thinking(void) {
    const char *m = "[{\"role\":\"user\",\"content\":\"q1\"},"
                    "{\"role\":\"assistant\",\"reasoning_content\":\"r1\",\"content\":\"a1\"},"
                    "{\"role\":\"user\",\"content\":\"q2\"}]";
    expect_render(m, NULL, DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_NONE,
                  BOS U "q1" A "</think>a1" EOS U "q2" A "<think>");
    expect_render(m, NULL, DSV4_CHAT_MODE_THINKING, 0, DSV4_EFFORT_NONE,
                  BOS U "q1" A "<think>r1</think>a1" EOS U "q2" A "<think>");
    expect_render(m, NULL, DSV4_CHAT_MODE_CHAT, 0, DSV4_EFFORT_NONE,
                  BOS U "q1" A "</think>a1" EOS U "q2" A "</think>");
    /* tools anywhere turn drop_thinking off */
    const char *mt = "[{\"role\":\"system\",\"content\":\"S\",\"tools\":[{\"type\":\"function\",\"function\":"
                     "{\"name\":\"f\"}}]},{\"role\":\"user\",\"content\":\"q1\"},"
                     "{\"role\":\"assistant\",\"reasoning_content\":\"r1\",\"content\":\"a1\"},"
                     "{\"role\":\"user\",\"content\":\"q2\"}]";
    dsv4_err err = {{0}};
    char *got = render(mt, NULL, DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_NONE, &err);
    REQUIRE(got);
    CHECK(strstr(got, U "q1" A "<think>r1</think>a1" EOS U "q2" A "<think>") != NULL);
    CHECK(strstr(got, "{\"name\": \"f\"}\n\nYou MUST strictly follow") != NULL);
    free(got);
    /* reasoning under vLLM's key name */
    expect_render("[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"reasoning\":\"r\","
                  "\"content\":\"a\"}]",
                  NULL, DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_NONE, BOS U "q" A "<think>r</think>a" EOS);
}

static void test_effort(void) {
    const char *m = "[{\"role\":\"user\",\"content\":\"q\"}]";
    dsv4_err err = {{0}};
    char *got = render(m, NULL, DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_MAX, &err);
    REQUIRE(got);
    const char *head =
        BOS "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough";
    CHECK(!strncmp(got, head, strlen(head)));
    const char *tail = "no assumption is left unchecked.\n\n" U "q" A "<think>";
    CHECK(strlen(got) > strlen(tail) && !strcmp(got + strlen(got) - strlen(tail), tail));
    free(got);
    /* high renders like none; max does nothing in chat mode */
    expect_render(m, NULL, DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_HIGH, BOS U "q" A "<think>");
    expect_render(m, NULL, DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_MAX, BOS U "q" A "</think>");
    dsv4_effort e;
    CHECK(dsv4_chat_effort_parse("max", &e, NULL) == 0 && e == DSV4_EFFORT_MAX);
    CHECK(dsv4_chat_effort_parse("medium", &e, &err) == -1 && strstr(err.msg, "medium"));
}

static void test_tool_results_order(void) {
    const char *m = "[{\"role\":\"user\",\"content\":\"q\"},"
                    "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":["
                    "{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{"
                    "\\\"x\\\": 1}\"}},"
                    "{\"id\":\"c2\",\"type\":\"function\",\"function\":{\"name\":\"g\",\"arguments\":\"{"
                    "\\\"s\\\": \\\"v\\\"}\"}}]},"
                    "{\"role\":\"tool\",\"tool_call_id\":\"c2\",\"content\":\"R2\"},"
                    "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"R1\"}]";
    expect_render(m, NULL, DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_NONE,
                  BOS U "q" A "</think>\n\n<" D "tool_calls>\n<" D "invoke name=\"f\">\n<" D
                        "parameter name=\"x\" string=\"false\">1</" D "parameter>\n</" D "invoke>\n<" D
                        "invoke name=\"g\">\n<" D "parameter name=\"s\" string=\"true\">v</" D
                        "parameter>\n</" D "invoke>\n</" D "tool_calls>" EOS U
                        "<tool_result>R1</tool_result>\n\n<tool_result>R2</tool_result>" A "</think>");
    /* a user message after tool results joins them; content parts are joined with \n\n */
    const char *m2 =
        "[{\"role\":\"tool\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"image\"}]},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"b\"},{\"type\":\"text\",\"text\":"
        "\"c\"}]}]";
    expect_render(m2, NULL, DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_NONE,
                  BOS U "<tool_result>a\n\n[Unsupported image]</tool_result>\n\nb\n\nc" A "</think>");
    /* consecutive user messages merge too (the reference does) */
    expect_render("[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"user\",\"content\":\"b\"}]", NULL,
                  DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_NONE, BOS U "a\n\nb" A "</think>");
}

static void test_arguments_forms(void) {
    /* arguments as an object, as a non-object, empty, with nested/unicode values */
    const char *m =
        "[{\"role\":\"assistant\",\"content\":\"c\",\"tool_calls\":["
        "{\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":{\"a\":[1,2.5],\"b\":\"é\"}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"g\",\"arguments\":\"[1]\"}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"h\",\"arguments\":\"\"}}]}]";
    expect_render(m, NULL, DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_NONE,
                  BOS "c\n\n<" D "tool_calls>\n<" D "invoke name=\"f\">\n<" D
                      "parameter name=\"a\" string=\"false\">[1, 2.5]</" D "parameter>\n<" D
                      "parameter name=\"b\" string=\"true\">é</" D "parameter>\n</" D "invoke>\n<" D
                      "invoke name=\"g\">\n<" D "parameter name=\"arguments\" string=\"false\">[1]</" D
                      "parameter>\n</" D "invoke>\n<" D "invoke name=\"h\">\n\n</" D "invoke>\n</" D
                      "tool_calls>" EOS);
    /* wo_eos leaves the turn open (prefill) */
    expect_render("[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"Sure\",\"wo_"
                  "eos\":true}]",
                  NULL, DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_NONE, BOS U "q" A "</think>Sure");
}

static void test_developer_reminder(void) {
    const char *m = "[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"developer\",\"content\":\"d1\"},"
                    "{\"role\":\"assistant\",\"reasoning_content\":\"r\",\"content\":\"a\"},"
                    "{\"role\":\"latest_reminder\",\"content\":\"2026-01-01\"},"
                    "{\"role\":\"user\",\"content\":\"q\"}]";
    /* thinking + drop: the developer message before the last user is dropped */
    expect_render(m, NULL, DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_NONE,
                  BOS "S"
                      "a" EOS "<｜latest_reminder｜>2026-01-01" U "q" A "<think>");
    expect_render(m, NULL, DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_NONE,
                  BOS "S" U "d1" A "</think>a" EOS "<｜latest_reminder｜>2026-01-01" U "q" A "</think>");
    /* a user followed by latest_reminder still opens the assistant turn */
    expect_render("[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"latest_reminder\",\"content\":\"x\"}]",
                  NULL, DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_NONE,
                  BOS U "q" A "</think><｜latest_reminder｜>x");
}

static void test_tasks(void) {
    expect_render("[{\"role\":\"user\",\"content\":\"q\",\"task\":\"query\"}]", NULL, DSV4_CHAT_MODE_THINKING,
                  1, DSV4_EFFORT_NONE, BOS U "q<｜query｜>");
    expect_render("[{\"role\":\"user\",\"content\":\"q\",\"task\":\"action\"}]", NULL,
                  DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_NONE, BOS U "q" A "<think><｜action｜>");
    expect_render("[{\"role\":\"user\",\"content\":\"q\",\"task\":\"action\"}]", NULL, DSV4_CHAT_MODE_CHAT, 1,
                  DSV4_EFFORT_NONE, BOS U "q" A "</think><｜action｜>");
    expect_render("[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"a\",\"task\":"
                  "\"title\"}]",
                  NULL, DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_NONE, BOS U "q" A "</think>a" EOS "<｜title｜>");
    /* the assistant answering a task has no thinking part even in thinking mode */
    expect_render("[{\"role\":\"user\",\"content\":\"q\",\"task\":\"domain\"},{\"role\":\"assistant\","
                  "\"content\":\"Law\"}]",
                  NULL, DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_NONE, BOS U "q<｜domain｜>Law" EOS);
    expect_error("[{\"role\":\"user\",\"content\":\"q\",\"task\":\"nope\"}]", NULL, "messages[0].task");
}

static void test_response_format_and_tools(void) {
    json_t *m = J("[{\"role\":\"user\",\"content\":\"q\"}]"), *rf = J("{\"type\":\"object\",\"x\":1.5}");
    json_t *tools = J("[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":\"d\"}}]");
    dsv4_chat_opts o;
    dsv4_chat_opts_default(&o);
    o.response_format = rf;
    char *out = NULL;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_chat_render(m, NULL, &o, &out, NULL, &err) == 0);
    CHECK_STR(out,
              BOS "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                  "{\"type\": \"object\", \"x\": 1.5}" U "q" A "</think>");
    free(out);
    /* tools with no system message: an empty system message carries them */
    o.response_format = NULL;
    REQUIRE(dsv4_chat_render(m, tools, &o, &out, NULL, &err) == 0);
    CHECK(
        !strncmp(out, BOS "\n\n## Tools\n\nYou have access", strlen(BOS "\n\n## Tools\n\nYou have access")));
    CHECK(
        strstr(out, "### Available Tool Schemas\n\n{\"name\": \"f\", \"description\": \"d\"}\n\nYou MUST") !=
        NULL);
    free(out);
    json_decref(m);
    json_decref(rf);
    json_decref(tools);
    /* given twice */
    expect_error("[{\"role\":\"system\",\"content\":\"s\",\"tools\":[{\"function\":{\"name\":\"g\"}}]}]",
                 "[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]", "given both");
}

static void test_render_errors(void) {
    expect_error("{\"role\":\"user\"}", NULL, "messages: must be a list");
    expect_error("[{\"role\":\"robot\",\"content\":\"x\"}]", NULL,
                 "messages[0].role: unknown role \"robot\"");
    expect_error("[{\"content\":\"x\"}]", NULL, "messages[0].role: missing");
    expect_error("[{\"role\":\"user\"}]", NULL, "messages[0].content: missing");
    expect_error("[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"developer\",\"content\":\"\"}]", NULL,
                 "messages[1].content");
    expect_error("[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]", NULL,
                 "messages[0].content[0]: unsupported part type \"image_url\"");
    expect_error("[{\"role\":\"user\",\"content\":5}]", NULL, "messages[0].content");
    expect_error("[{\"role\":\"assistant\",\"tool_calls\":{}}]", NULL,
                 "messages[0].tool_calls: must be a list");
    expect_error("[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"arguments\":\"{}\"}}]}]", NULL,
                 "messages[0].tool_calls[0].function.name");
    expect_error("[{\"role\":\"assistant\",\"tool_calls\":[{\"type\":\"function\"}]}]", NULL,
                 "messages[0].tool_calls[0].function: missing");
    expect_error(
        "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"tool_calls\":[{\"function\":"
        "{\"name\":\"f\",\"arguments\":\"{oops\"}}]}]",
        NULL, "messages[1].tool_calls[0].function.arguments: not valid JSON");
    expect_error("[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\"}}]}]", NULL,
                 "function.arguments: missing");
    expect_error("[{\"role\":\"user\",\"content\":\"q\",\"tool_calls\":[]}]", NULL, "only assistant");
    expect_error("[{\"role\":\"user\",\"content\":\"q\"}]", "{\"type\":\"function\"}",
                 "tools: must be a list");
    expect_error("[{\"role\":\"user\",\"content\":\"q\"}]", "[\"f\"]", "tools[0]: must be an object");
    expect_error("[{\"role\":\"system\",\"content\":\"q\",\"tools\":[{\"type\":\"function\"}]}]", NULL,
                 "messages[0].tools[0].function");
    expect_error("[{\"role\":\"assistant\",\"reasoning_content\":7}]", NULL, "messages[0].reasoning_content");
    expect_error("[7]", NULL, "messages[0]: must be an object");
    /* a tool result with no preceding tool call renders as the reference does */
    expect_render("[{\"role\":\"tool\",\"content\":\"r\"}]", NULL, DSV4_CHAT_MODE_CHAT, 1, DSV4_EFFORT_NONE,
                  BOS U "<tool_result>r</tool_result>" A "</think>");
    /* render_doc options and errors */
    json_t *doc = J("{\"messages\":[{\"role\":\"user\",\"content\":\"q\"}],\"thinking\":true,\"reasoning_"
                    "effort\":\"high\"}");
    char *out = NULL;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_chat_render_doc(doc, NULL, NULL, &out, NULL, &err) == 0);
    CHECK_STR(out, BOS U "q" A "<think>");
    free(out);
    json_decref(doc);
    doc = J("{\"messages\":[],\"reasoning_effort\":\"extreme\"}");
    CHECK(dsv4_chat_render_doc(doc, NULL, NULL, &out, NULL, &err) == -1 && strstr(err.msg, "extreme"));
    json_decref(doc);
    doc = J("{\"msgs\":[]}");
    CHECK(dsv4_chat_render_doc(doc, NULL, NULL, &out, NULL, &err) == -1 && strstr(err.msg, "messages"));
    json_decref(doc);
}

/* ----- the output parser ----- */

typedef struct {
    dsv4_dsml_collector c;
    dsv4_chat_buf raw; /* concatenated raw bytes of every event */
    int leaked;        /* a non-malformed content delta contained a tag */
    int ends;
} tap;

static void tap_fn(void *user, const dsv4_dsml_event *ev) {
    tap *t = user;
    dsv4_chat_buf_put(&t->raw, ev->raw ? ev->raw : "", ev->raw_len);
    if ((ev->type == DSV4_DSML_CONTENT || ev->type == DSV4_DSML_REASONING) && !ev->malformed) {
        dsv4_chat_buf tmp = {0};
        dsv4_chat_buf_put(&tmp, ev->text, ev->len);
        if (tmp.data && (strstr(tmp.data, EOS) || strstr(tmp.data, "<" D "tool_calls>"))) t->leaked = 1;
        dsv4_chat_buf_free(&tmp);
    }
    if (ev->type == DSV4_DSML_END) t->ends++;
    dsv4_dsml_collect(&t->c, ev);
}

/* Parses TEXT fed in pieces cut at CUTS (sorted offsets); checks accounting. */
static int parse_split(const char *text, size_t n, dsv4_chat_mode mode, const size_t *cuts, int ncuts,
                       dsv4_dsml_message *out) {
    tap t = {0};
    dsv4_dsml_parser *p = NULL;
    if (dsv4_dsml_parser_init(&p, mode, 42, tap_fn, &t, NULL)) return -1;
    size_t at = 0;
    for (int i = 0; i <= ncuts; i++) {
        size_t end = i < ncuts ? cuts[i] : n;
        if (dsv4_dsml_parser_feed(p, text + at, end - at, NULL)) return -1;
        at = end;
    }
    if (dsv4_dsml_parser_finish(p, NULL)) return -1;
    int ok = t.raw.len == n && (n == 0 || !memcmp(t.raw.data, text, n)) && t.ends == 1;
    if (!t.c.malformed && t.leaked) ok = 0;
    dsv4_dsml_parser_free(p);
    dsv4_chat_buf_free(&t.raw);
    if (dsv4_dsml_collector_take(&t.c, out, NULL)) return -1;
    return ok ? 0 : 1;
}

static int same_message(const dsv4_dsml_message *a, const dsv4_dsml_message *b) {
    if (strcmp(a->reasoning, b->reasoning) || strcmp(a->content, b->content)) return 0;
    if (a->ncalls != b->ncalls || a->malformed != b->malformed || a->eos != b->eos) return 0;
    for (size_t i = 0; i < a->ncalls; i++)
        if (strcmp(a->calls[i].id, b->calls[i].id) || strcmp(a->calls[i].name, b->calls[i].name) ||
            strcmp(a->calls[i].arguments, b->calls[i].arguments) ||
            a->calls[i].malformed != b->calls[i].malformed)
            return 0;
    return 1;
}

/* Whole, every 2-way split, byte at a time, and a few 3-way splits must agree. */
static void check_splits(const char *text, dsv4_chat_mode mode, dsv4_dsml_message *whole) {
    size_t n = strlen(text);
    REQUIRE(parse_split(text, n, mode, NULL, 0, whole) == 0);
    int bad = 0;
    for (size_t i = 0; i <= n && bad < 3; i++) {
        dsv4_dsml_message m;
        int rc = parse_split(text, n, mode, &i, 1, &m);
        if (rc || !same_message(&m, whole)) {
            fprintf(stderr, "  split at %zu differs (rc %d)\n", i, rc);
            bad++;
        }
        dsv4_dsml_message_free(&m);
    }
    size_t *cuts = malloc((n + 1) * sizeof *cuts);
    for (size_t i = 0; i < n; i++)
        cuts[i] = i + 1;
    dsv4_dsml_message m;
    int rc = parse_split(text, n, mode, cuts, n ? (int)n - 1 : 0, &m);
    CHECKF(rc == 0 && same_message(&m, whole), "byte-at-a-time differs");
    dsv4_dsml_message_free(&m);
    for (size_t i = 1; i + 7 < n; i += 5) {
        size_t c3[2] = {i, i + 7};
        rc = parse_split(text, n, mode, c3, 2, &m);
        if (rc || !same_message(&m, whole)) bad++;
        dsv4_dsml_message_free(&m);
    }
    free(cuts);
    CHECK_EQ_INT(bad, 0);
}

static void test_parse_reasoning_content(void) {
    dsv4_dsml_message m;
    check_splits("Simple arithmetic.</think>2 + 2 = 4." EOS, DSV4_CHAT_MODE_THINKING, &m);
    CHECK_STR(m.reasoning, "Simple arithmetic.");
    CHECK_STR(m.content, "2 + 2 = 4.");
    CHECK(m.eos && !m.malformed && m.ncalls == 0);
    dsv4_dsml_message_free(&m);
    /* chat mode: it is all content; a stray </think> stays content */
    check_splits("a</think>b <x> \xe4\xb8\xad" EOS "ignored", DSV4_CHAT_MODE_CHAT, &m);
    CHECK_STR(m.reasoning, "");
    CHECK_STR(m.content, "a</think>b <x> \xe4\xb8\xad");
    CHECK(m.eos && !m.malformed);
    dsv4_dsml_message_free(&m);
    /* cut off without EOS (length limit): not malformed */
    check_splits("thinking still", DSV4_CHAT_MODE_THINKING, &m);
    CHECK_STR(m.reasoning, "thinking still");
    CHECK(!m.eos && !m.malformed);
    dsv4_dsml_message_free(&m);
    /* EOS inside reasoning: malformed */
    check_splits("r" EOS, DSV4_CHAT_MODE_THINKING, &m);
    CHECK(m.eos && m.malformed);
    CHECK_STR(m.reasoning, "r");
    dsv4_dsml_message_free(&m);
    /* a partial tag at the end is content once the output ends */
    check_splits("x\n\n<" D "tool_ca", DSV4_CHAT_MODE_CHAT, &m);
    CHECK_STR(m.content, "x\n\n<" D "tool_ca");
    dsv4_dsml_message_free(&m);
}

#define CALLS(body) "\n\n<" D "tool_calls>\n" body "</" D "tool_calls>"
#define INVOKE(name, params) "<" D "invoke name=\"" name "\">\n" params "</" D "invoke>\n"
#define PARAM(k, s, v) "<" D "parameter name=\"" k "\" string=\"" s "\">" v "</" D "parameter>\n"

static void test_parse_tool_calls(void) {
    dsv4_dsml_message m;
    const char *text = "Reason.</think>Let me look." CALLS(
        INVOKE("get_weather", PARAM("location", "true", "Bei\"jing\n") PARAM("days", "false", "3")
                                  PARAM("opts", "false", "{\"a\": [1, 2.5]}"))
            INVOKE("search", PARAM("q", "true", "a < b & </x>"))) EOS;
    check_splits(text, DSV4_CHAT_MODE_THINKING, &m);
    CHECK_STR(m.reasoning, "Reason.");
    CHECK_STR(m.content, "Let me look.");
    CHECK(m.eos && !m.malformed);
    REQUIRE(m.ncalls == 2);
    CHECK_STR(m.calls[0].name, "get_weather");
    CHECK_STR(m.calls[0].arguments,
              "{\"location\": \"Bei\\\"jing\\n\", \"days\": 3, \"opts\": {\"a\": [1, 2.5]}}");
    CHECK_STR(m.calls[1].name, "search");
    CHECK_STR(m.calls[1].arguments, "{\"q\": \"a < b & </x>\"}");
    CHECK(!strncmp(m.calls[0].id, "call_", 5) && strlen(m.calls[0].id) == 29);
    CHECK(strcmp(m.calls[0].id, m.calls[1].id) != 0);
    dsv4_dsml_message_free(&m);
    /* no parameters, no "\n\n" before the block, text after the block is content */
    check_splits("<" D "tool_calls>\n<" D "invoke name=\"now\">\n\n</" D "invoke>\n</" D
                 "tool_calls>\ntail" EOS,
                 DSV4_CHAT_MODE_CHAT, &m);
    REQUIRE(m.ncalls == 1);
    CHECK_STR(m.calls[0].arguments, "{}");
    CHECK_STR(m.content, "\ntail");
    CHECK(!m.malformed);
    dsv4_dsml_message_free(&m);
}

static void test_parse_malformed(void) {
    dsv4_dsml_message m;
    /* invalid JSON in a string="false" value: kept as a string, flagged */
    check_splits(CALLS(INVOKE("f", PARAM("n", "false", "tru"))) EOS, DSV4_CHAT_MODE_CHAT, &m);
    REQUIRE(m.ncalls == 1);
    CHECK_STR(m.calls[0].arguments, "{\"n\": \"tru\"}");
    CHECK(m.calls[0].malformed && m.malformed);
    dsv4_dsml_message_free(&m);

    struct {
        const char *text, *content;
        int ncalls;
    } cases[] = {
        /* unclosed invoke, then EOS */
        {"hi" CALLS("<" D "invoke name=\"f\">\n" PARAM("a", "true", "1")) EOS, NULL, 0},
        /* EOS in the middle of a parameter value */
        {"hi\n\n<" D "tool_calls>\n<" D "invoke name=\"f\">\n<" D
         "parameter name=\"a\" string=\"true\">12" EOS,
         NULL, 0},
        /* bad attribute */
        {"hi" CALLS(INVOKE("f", "<" D "parameter name=\"a\" string=\"maybe\">1</" D "parameter>\n")) EOS,
         NULL, 0},
        {"hi" CALLS("<" D "invoke nam=\"f\">\n</" D "invoke>\n") EOS, NULL, 0},
        /* garbage inside the block */
        {"hi" CALLS("garbage\n") EOS, NULL, 0},
        /* duplicate parameter */
        {"hi" CALLS(INVOKE("f", PARAM("a", "true", "1") PARAM("a", "true", "2"))) EOS, NULL, 0},
        /* first call good, then garbage: one call, rest is content */
        {"hi" CALLS(INVOKE("f", PARAM("a", "true", "1")) "junk") EOS, "hi\njunk</" D "tool_calls>", 1},
        /* unclosed block at the end of output (no EOS) */
        {"hi" CALLS(INVOKE("f", PARAM("a", "true", "1")) "<" D "invoke name=\"g\">\n"), NULL, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        check_splits(cases[i].text, DSV4_CHAT_MODE_CHAT, &m);
        CHECKF(m.malformed, "case %zu not flagged", i);
        CHECKF((int)m.ncalls == cases[i].ncalls, "case %zu: %zu calls", i, m.ncalls);
        if (cases[i].content) {
            CHECK_STR(m.content, cases[i].content);
        } else if (cases[i].ncalls == 0) {
            /* every byte but the final EOS comes back as content */
            size_t n = strlen(cases[i].text), e = strlen(EOS);
            if (n >= e && !strcmp(cases[i].text + n - e, EOS)) n -= e;
            CHECKF(strlen(m.content) == n && !strncmp(m.content, cases[i].text, n), "case %zu content \"%s\"",
                   i, m.content);
        }
        dsv4_dsml_message_free(&m);
    }
}

static void test_parse_utf8_holdback(void) {
    /* a piece ending inside a UTF-8 sequence is held until it completes */
    tap t = {0};
    dsv4_dsml_parser *p = NULL;
    REQUIRE(dsv4_dsml_parser_init(&p, DSV4_CHAT_MODE_CHAT, 1, tap_fn, &t, NULL) == 0);
    REQUIRE(dsv4_dsml_parser_feed(p, "a\xe4\xb8", 3, NULL) == 0);
    CHECK_EQ_INT(t.c.content.len, 1);
    REQUIRE(dsv4_dsml_parser_feed(p, "\xad", 1, NULL) == 0);
    CHECK_EQ_INT(t.c.content.len, 4);
    REQUIRE(dsv4_dsml_parser_feed(p, "<", 1, NULL) == 0); /* could start EOS: held */
    CHECK_EQ_INT(t.c.content.len, 4);
    REQUIRE(dsv4_dsml_parser_feed(p, "b", 1, NULL) == 0);
    CHECK_EQ_INT(t.c.content.len, 6);
    REQUIRE(dsv4_dsml_parser_finish(p, NULL) == 0);
    CHECK(dsv4_dsml_parser_feed(p, "x", 1, NULL) == 0); /* ignored after finish */
    dsv4_dsml_parser_free(p);
    dsv4_chat_buf_free(&t.raw);
    dsv4_dsml_collector_free(&t.c);
}

/* render(assistant with tool calls) -> parse -> the same calls */
static void test_round_trip(void) {
    const char *msgs =
        "[{\"role\":\"system\",\"content\":\"S\",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":"
        "\"f\"}}]},"
        "{\"role\":\"user\",\"content\":\"q\"},"
        "{\"role\":\"assistant\",\"reasoning_content\":\"think\",\"content\":\"ok\",\"tool_calls\":["
        "{\"id\":\"x\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":"
        "\"{\\\"s\\\": \\\"line1\\\\nline2 \\\\u00e9\\\", \\\"n\\\": -1.5e-7, \\\"b\\\": true, \\\"o\\\": "
        "{\\\"k\\\": [null, \\\"v\\\"]}}\"}},"
        "{\"id\":\"y\",\"type\":\"function\",\"function\":{\"name\":\"g_2\",\"arguments\":\"{}\"}}]}]";
    dsv4_err err = {{0}};
    char *prompt = render(msgs, NULL, DSV4_CHAT_MODE_THINKING, 1, DSV4_EFFORT_NONE, &err);
    REQUIRE(prompt);
    const char *mark = A "<think>";
    char *start = strstr(prompt, mark);
    REQUIRE(start);
    start += strlen(mark);
    dsv4_dsml_message m;
    check_splits(start, DSV4_CHAT_MODE_THINKING, &m);
    CHECK_STR(m.reasoning, "think");
    CHECK_STR(m.content, "ok");
    CHECK(!m.malformed && m.eos);
    REQUIRE(m.ncalls == 2);
    json_t *in = J(msgs);
    for (size_t i = 0; i < 2; i++) {
        json_t *f = json_object_get(json_array_get(json_object_get(json_array_get(in, 2), "tool_calls"), i),
                                    "function");
        CHECK_STR(m.calls[i].name, json_string_value(json_object_get(f, "name")));
        json_t *want = J(json_string_value(json_object_get(f, "arguments")));
        json_t *got = J(m.calls[i].arguments);
        CHECKF(got && want && json_equal(got, want), "call %zu arguments %s", i, m.calls[i].arguments);
        json_decref(want);
        json_decref(got);
    }
    json_decref(in);
    dsv4_dsml_message_free(&m);
    free(prompt);
    /* the official case 1's first assistant turn parses to its call */
    size_t n;
    char *out1 = read_file("tests/data/chat/test_output_1.txt", &n);
    REQUIRE(out1);
    start = strstr(out1, mark);
    REQUIRE(start);
    start += strlen(mark);
    char *end = strstr(start, U);
    REQUIRE(end);
    REQUIRE(dsv4_chat_parse_completion(start, (size_t)(end - start), DSV4_CHAT_MODE_THINKING, 7, &m, &err) ==
            0);
    CHECK_STR(m.content, "");
    REQUIRE(m.ncalls == 1);
    CHECK_STR(m.calls[0].arguments, "{\"location\": \"Beijing\", \"unit\": \"celsius\"}");
    dsv4_dsml_message_free(&m);
    free(out1);
}

TEST_MAIN(test_official_1, test_official_2, test_official_3, test_official_4, test_json_py, test_basic_modes,
          test_drop_thinking, test_effort, test_tool_results_order, test_arguments_forms,
          test_developer_reminder, test_tasks, test_response_format_and_tools, test_render_errors,
          test_parse_reasoning_content, test_parse_tool_calls, test_parse_malformed, test_parse_utf8_holdback,
          test_round_trip)
