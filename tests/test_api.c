/* tests/test_api: the OpenAI request parser/validator, the response and SSE
 * builders, and the metrics text (server/api_openai, server/metrics). */
#include <jansson.h>

#include "server/api_anthropic.h"
#include "server/api_openai.h"
#include "server/metrics.h"
#include "test.h"

static const dsv4_api_limits LIM = {.vocab_size = 129280, .ctx = 64, .model_id = "m", .think_model = "deepseek-reasoner"};

static dsv4_tokenizer *tok_(void) {
    static dsv4_tokenizer *t;
    if (!t) {
        dsv4_err err;
        if (dsv4_tokenizer_load(&t, "data/tokenizer", &err) < 0) fprintf(stderr, "  tokenizer: %s\n", err.msg);
    }
    return t;
}

/* Parses BODY for KIND and expects failure with STATUS, a message containing
 * WANT and (if non-NULL) param PARAM. */
static int expect_err(dsv4_api_kind kind, const char *body, size_t len, int status, const char *want,
                      const char *param) {
    dsv4_api_request r;
    dsv4_api_error e;
    memset(&e, 0, sizeof e);
    int rc = dsv4_api_parse(kind, body, len ? len : strlen(body), &LIM, &r, &e);
    int parsed = rc == 0;
    if (rc == 0) rc = dsv4_api_prepare(&r, tok_(), &LIM, &e);
    int ok = rc < 0 && e.status == status && strstr(e.message, want) && (!param || !strcmp(e.param, param));
    if (!ok)
        fprintf(stderr, "  body %.80s: rc %d status %d param '%s' message '%s' (wanted %d '%s' '%s')\n", body, rc,
                e.status, e.param, e.message, status, want, param ? param : "");
    if (parsed) dsv4_api_request_free(&r);
    return ok;
}

#define CHAT_ERR(body, status, want, param) CHECK(expect_err(DSV4_API_CHAT, body, 0, status, want, param))
#define COMPL_ERR(body, status, want, param) CHECK(expect_err(DSV4_API_COMPLETIONS, body, 0, status, want, param))

static void test_malformed_and_types(void) {
    CHAT_ERR("", 400, "empty", NULL);
    CHAT_ERR("{\"messages\": [", 400, "malformed JSON", NULL);
    CHAT_ERR("[1,2]", 400, "must be a JSON object", NULL);
    CHAT_ERR("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"messages\":[]}", 400, "malformed JSON", NULL);
    CHAT_ERR("{\"messages\":\"hi\"}", 400, "messages: must be an array", "messages");
    CHAT_ERR("{}", 400, "messages: required", "messages");
    CHAT_ERR("{\"messages\":[]}", 400, "must not be empty", "messages");
    CHAT_ERR("{\"messages\":[3]}", 400, "messages[0]: must be an object", "messages[0]");
    CHAT_ERR("{\"messages\":[{\"content\":\"x\"}]}", 400, "messages[0].role", "messages[0].role");
    CHAT_ERR("{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", 400, "unknown role \"wizard\"",
             "messages[0].role");
    const char *u = "[{\"role\":\"user\",\"content\":\"hi\"}]";
    char b[512];
#define WITH(extra) (snprintf(b, sizeof b, "{\"messages\":%s,%s}", u, extra), b)
    CHAT_ERR(WITH("\"temperature\":\"hot\""), 400, "temperature: must be a number, got a string", "temperature");
    CHAT_ERR(WITH("\"temperature\":3"), 400, "temperature: 3 is out of range", "temperature");
    CHAT_ERR(WITH("\"top_p\":1.5"), 400, "top_p", "top_p");
    CHAT_ERR(WITH("\"max_tokens\":0"), 400, "max_tokens: 0 is out of range", "max_tokens");
    CHAT_ERR(WITH("\"max_tokens\":\"5\""), 400, "max_tokens: must be an integer", "max_tokens");
    CHAT_ERR(WITH("\"max_completion_tokens\":1.5"), 400, "must be an integer", "max_completion_tokens");
    CHAT_ERR(WITH("\"stream\":1"), 400, "stream: must be a boolean", "stream");
    CHAT_ERR(WITH("\"stream_options\":{\"include_usage\":\"yes\"}"), 400, "include_usage", NULL);
    CHAT_ERR(WITH("\"stop\":5"), 400, "stop: must be a string or an array", "stop");
    CHAT_ERR(WITH("\"stop\":[\"a\",7]"), 400, "stop[1]: must be a string", "stop[1]");
    CHAT_ERR(WITH("\"stop\":\"\""), 400, "empty", "stop");
    CHAT_ERR(WITH("\"n\":2"), 400, "only n = 1", "n");
    CHAT_ERR(WITH("\"seed\":\"x\""), 400, "seed: must be an integer", "seed");
    CHAT_ERR(WITH("\"logprobs\":\"yes\""), 400, "logprobs: must be a boolean", "logprobs");
    CHAT_ERR(WITH("\"top_logprobs\":3"), 400, "requires logprobs", "top_logprobs");
    CHAT_ERR(WITH("\"logprobs\":true,\"top_logprobs\":21"), 400, "top_logprobs: 21 is out of range", "top_logprobs");
    CHAT_ERR(WITH("\"logit_bias\":{\"abc\":1}"), 400, "not a token id", "logit_bias");
    CHAT_ERR(WITH("\"logit_bias\":{\"5\":500}"), 400, "out of range", "logit_bias");
    CHAT_ERR(WITH("\"reasoning_effort\":\"extreme\""), 400, "reasoning_effort: \"extreme\"", "reasoning_effort");
    CHAT_ERR(WITH("\"thinking\":{\"type\":\"sometimes\"}"), 400, "thinking:", "thinking");
    CHAT_ERR(WITH("\"response_format\":{\"type\":\"xml\"}"), 400, "response_format.type", "response_format.type");
    CHAT_ERR(WITH("\"model\":5"), 400, "model: must be a string", "model");
}

static void test_tools_validation(void) {
    const char *u = "[{\"role\":\"user\",\"content\":\"hi\"}]";
    char b[768];
    CHAT_ERR(WITH("\"tools\":{}"), 400, "tools: must be an array", "tools");
    CHAT_ERR(WITH("\"tools\":[\"f\"]"), 400, "tools[0]: must be an object", "tools[0]");
    CHAT_ERR(WITH("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":\"{}\"}}]"), 400,
             "tools[0].function.parameters: must be a JSON Schema object, got a string",
             "tools[0].function.parameters");
    CHAT_ERR(WITH("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":[1]}}]"), 400,
             "must be a JSON Schema object, got an array", "tools[0].function.parameters");
    CHAT_ERR(WITH("\"tools\":[{\"type\":\"function\",\"function\":{\"parameters\":{}}}]"), 400, "name", NULL);
    CHAT_ERR(WITH("\"tools\":[{\"type\":\"retrieval\"}]"), 400, "must be \"function\"", "tools[0]");
    const char *tool = "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":"
                       "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}}}}}]";
    char ex[512];
    snprintf(ex, sizeof ex, "%s,\"tool_choice\":\"sometimes\"", tool);
    CHAT_ERR(WITH(ex), 400, "tool_choice: \"sometimes\"", "tool_choice");
    snprintf(ex, sizeof ex, "%s,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}", tool);
    CHAT_ERR(WITH(ex), 400, "\"nope\" is not in tools", "tool_choice");
    CHAT_ERR(WITH("\"tool_choice\":\"required\""), 400, "needs a non-empty tools list", "tool_choice");

    /* accepted: tools rendered and parsed; tool_choice none: neither */
    dsv4_api_request r;
    dsv4_api_error e;
    snprintf(ex, sizeof ex, "%s,\"tool_choice\":\"auto\"", tool);
    WITH(ex);
    REQUIRE(dsv4_api_parse(DSV4_API_CHAT, b, strlen(b), &LIM, &r, &e) == 0);
    CHECK(r.parse_tools == 1);
    CHECK(strstr(r.prompt, "get_weather") != NULL);
    dsv4_api_request_free(&r);
    snprintf(ex, sizeof ex, "%s,\"tool_choice\":\"none\"", tool);
    WITH(ex);
    REQUIRE(dsv4_api_parse(DSV4_API_CHAT, b, strlen(b), &LIM, &r, &e) == 0);
    CHECK(r.parse_tools == 0);
    CHECK(strstr(r.prompt, "get_weather") == NULL);
    dsv4_api_request_free(&r);

    /* a tool round trip renders: assistant tool_calls then a tool result */
    const char *conv =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"weather?\"},"
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\","
        "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"sunny 21C\"}],"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\"}}}]}";
    REQUIRE(dsv4_api_parse(DSV4_API_CHAT, conv, strlen(conv), &LIM, &r, &e) == 0);
    CHECK(strstr(r.prompt, "sunny 21C") != NULL);
    CHECK(strstr(r.prompt, "Paris") != NULL);
    dsv4_api_request_free(&r);
#undef WITH
}

static void test_utf8_and_limits(void) {
    const char bad[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"caf\xC3\x28\"}]}";
    CHECK(expect_err(DSV4_API_CHAT, bad, sizeof bad - 1, 400, "invalid UTF-8 at byte 42", NULL));
    const char nul[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}";
    CHAT_ERR(nul, 400, "malformed JSON", NULL);
    /* prompt longer than the context: both lengths named */
    char big[4096];
    int n = snprintf(big, sizeof big, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    for (int i = 0; i < 100; i++) n += snprintf(big + n, sizeof big - (size_t)n, "word%d ", i);
    snprintf(big + n, sizeof big - (size_t)n, "\"}]}");
    CHECK(expect_err(DSV4_API_CHAT, big, 0, 400, "but the context is 64 tokens", "messages"));
    dsv4_api_request r;
    dsv4_api_error e;
    const char *ok = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":60}";
    REQUIRE(dsv4_api_parse(DSV4_API_CHAT, ok, strlen(ok), &LIM, &r, &e) == 0);
    CHECK(dsv4_api_prepare(&r, tok_(), &LIM, &e) < 0);
    CHECK(strstr(e.message, "+ max_tokens (60)") && strstr(e.message, "context of 64 tokens"));
    CHECK_STR(e.code, "context_length_exceeded");
    dsv4_api_request_free(&r);
}

static void test_completions(void) {
    COMPL_ERR("{}", 400, "prompt: required", "prompt");
    COMPL_ERR("{\"prompt\":5}", 400, "prompt: must be a string or an array", "prompt");
    COMPL_ERR("{\"prompt\":[1,\"a\"]}", 400, "prompt[1]: must be an integer", "prompt");
    COMPL_ERR("{\"prompt\":[1,999999]}", 400, "token id 999999 is out of range [0, 129280)", "prompt");
    COMPL_ERR("{\"prompt\":[\"a\",\"b\"]}", 400, "2 prompts given", "prompt");
    COMPL_ERR("{\"prompt\":\"\"}", 400, "empty (0 tokens)", "prompt");
    COMPL_ERR("{\"prompt\":\"x\",\"echo\":true}", 400, "echo", "echo");
    COMPL_ERR("{\"prompt\":\"x\",\"logprobs\":50}", 400, "logprobs: 50 is out of range", "logprobs");
    dsv4_api_request r;
    dsv4_api_error e;
    const char *b = "{\"prompt\":[[1,2,3]],\"max_tokens\":4,\"logprobs\":2,\"seed\":7,\"stop\":[\"\\n\"],"
                    "\"future_field\":{\"x\":1}}";
    REQUIRE(dsv4_api_parse(DSV4_API_COMPLETIONS, b, strlen(b), &LIM, &r, &e) == 0);
    CHECK(r.prompt_is_ids && r.n_prompt_ids == 3 && r.prompt_ids[2] == 3);
    CHECK(r.logprobs == 1 && r.top_logprobs == 2 && r.sampling.top_logprobs == 2);
    CHECK(r.sampling.has_seed && r.sampling.seed == 7);
    CHECK(r.n_stop == 1 && !strcmp(r.stop[0], "\n"));
    CHECK(dsv4_api_prepare(&r, tok_(), &LIM, &e) == 0);
    dsv4_api_request_free(&r);
    b = "{\"prompt\":\"Hello world\"}";
    REQUIRE(dsv4_api_parse(DSV4_API_COMPLETIONS, b, strlen(b), &LIM, &r, &e) == 0);
    REQUIRE(dsv4_api_prepare(&r, tok_(), &LIM, &e) == 0);
    CHECK(r.n_prompt_ids == 2); /* "Hello", " world" */
    dsv4_api_request_free(&r);
}

static void test_chat_fields_and_thinking(void) {
    dsv4_api_request r;
    dsv4_api_error e;
    const char *b = "{\"model\":\"x\",\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},"
                    "{\"role\":\"user\",\"content\":\"hi\"}],\"temperature\":0,\"top_p\":0.5,\"max_tokens\":9,"
                    "\"max_completion_tokens\":7,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
                    "\"logprobs\":true,\"top_logprobs\":3,\"logit_bias\":{\"100\":-100},\"unknown\":[1,{}],"
                    "\"user\":\"u\",\"parallel_tool_calls\":true}";
    REQUIRE(dsv4_api_parse(DSV4_API_CHAT, b, strlen(b), &LIM, &r, &e) == 0);
    CHECK_STR(r.model, "x");
    CHECK(r.sampling.temperature == 0 && fabsf(r.sampling.top_p - 0.5f) < 1e-7f);
    CHECK_EQ_INT(r.max_tokens, 7);
    CHECK(r.stream && r.include_usage && r.logprobs && r.top_logprobs == 3);
    CHECK(r.sampling.n_logit_bias == 1 && r.sampling.logit_bias_ids[0] == 100);
    CHECK(!r.thinking && !r.opens_thinking);
    CHECK(strstr(r.prompt, "be brief") && strstr(r.prompt, "</think>"));
    dsv4_api_request_free(&r);

    struct {
        const char *extra;
        int thinking;
        dsv4_effort effort;
    } cases[] = {
        {"\"model\":\"deepseek-reasoner\"", 1, DSV4_EFFORT_NONE},
        {"\"model\":\"deepseek-reasoner\",\"thinking\":{\"type\":\"disabled\"}", 0, DSV4_EFFORT_NONE},
        {"\"reasoning_effort\":\"high\"", 1, DSV4_EFFORT_HIGH},
        {"\"reasoning_effort\":\"max\"", 1, DSV4_EFFORT_MAX},
        {"\"reasoning_effort\":\"none\",\"model\":\"deepseek-reasoner\"", 0, DSV4_EFFORT_NONE},
        {"\"thinking\":{\"type\":\"enabled\"}", 1, DSV4_EFFORT_NONE},
        {"\"chat_template_kwargs\":{\"thinking\":true}", 1, DSV4_EFFORT_NONE},
        {"\"chat_template_kwargs\":{\"thinking\":false},\"reasoning_effort\":\"high\"", 0, DSV4_EFFORT_NONE},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char body[512];
        snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],%s}", cases[i].extra);
        if (dsv4_api_parse(DSV4_API_CHAT, body, strlen(body), &LIM, &r, &e) < 0) {
            CHECKF(0, "%s: %s", cases[i].extra, e.message);
            continue;
        }
        CHECKF(r.thinking == cases[i].thinking && r.effort == cases[i].effort, "case %zu: thinking %d effort %d", i,
               r.thinking, (int)r.effort);
        CHECKF(r.opens_thinking == cases[i].thinking, "case %zu: prompt opens thinking %d", i, r.opens_thinking);
        dsv4_api_request_free(&r);
    }

    /* multi-turn with reasoning_content passed back renders (dropped before the last user turn) */
    b = "{\"model\":\"deepseek-reasoner\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"},"
        "{\"role\":\"assistant\",\"content\":\"b\",\"reasoning_content\":\"thought\"},"
        "{\"role\":\"user\",\"content\":\"c\"}],\"response_format\":{\"type\":\"json_object\"}}";
    REQUIRE(dsv4_api_parse(DSV4_API_CHAT, b, strlen(b), &LIM, &r, &e) == 0);
    CHECK(r.opens_thinking);
    CHECK(strstr(r.prompt, "Response Format") != NULL);
    dsv4_api_request_free(&r);
}

/* Every SSE line must be "data: " + valid JSON (or [DONE]). */
static int sse_valid(const char *s, int *n_events) {
    *n_events = 0;
    const char *p = s;
    while (*p) {
        if (strncmp(p, "data: ", 6)) return 0;
        const char *end = strstr(p, "\n\n");
        if (!end) return 0;
        size_t n = (size_t)(end - p - 6);
        if (!(n == 6 && !strncmp(p + 6, "[DONE]", 6))) {
            json_error_t je;
            json_t *j = json_loadb(p + 6, n, 0, &je);
            if (!j) {
                fprintf(stderr, "  bad chunk %.*s: %s\n", (int)n, p + 6, je.text);
                return 0;
            }
            json_decref(j);
        }
        (*n_events)++;
        p = end + 2;
    }
    return 1;
}

static void test_builders(void) {
    dsv4_chat_buf b = {0};
    dsv4_api_json_string(&b, "a\"b\\c\n\x01\xff\xC3\xA9", 10);
    CHECK_STR(b.data, "\"a\\\"b\\\\c\\n\\u0001\xEF\xBF\xBD\xC3\xA9\"");
    dsv4_chat_buf_free(&b);

    dsv4_api_reply rp = {.kind = DSV4_API_CHAT, .id = "chatcmpl-1", .created = 5, .model = "m\"x", .tok = tok_(),
                         .logprobs = 1, .top_logprobs = 2};
    dsv4_sample s = {.token = 9906, .logprob = -0.5f, .n_top = 2, .top_ids = {9906, 13}, .top_logprobs = {-0.5f, -INFINITY}};
    dsv4_api_sse_role(&b, &rp);
    dsv4_api_sse_text(&b, &rp, 1, "think\n", 6, NULL, 0);
    dsv4_api_sse_text(&b, &rp, 0, "Hi \"there\"", 10, &s, 1);
    dsv4_api_sse_tool_call(&b, &rp, 0, "call_x", "f", "{\"a\":1}", 7);
    dsv4_api_sse_finish(&b, &rp, DSV4_FINISH_TOOL_CALLS, NULL, 0);
    dsv4_usage u = {.prompt_tokens = 10, .completion_tokens = 3, .cached_tokens = 4};
    dsv4_api_sse_usage(&b, &rp, &u);
    dsv4_api_error e;
    dsv4_api_errorf(&e, 500, "server_error", NULL, NULL, "boom \"x\"");
    dsv4_api_sse_error(&b, &e);
    dsv4_api_sse_done(&b);
    int n = 0;
    CHECK(sse_valid(b.data, &n));
    CHECK_EQ_INT(n, 8);
    CHECK(strstr(b.data, "\"reasoning_content\":\"think\\n\"") != NULL);
    CHECK(strstr(b.data, "\"finish_reason\":\"tool_calls\"") != NULL);
    CHECK(strstr(b.data, "\"cached_tokens\":4") != NULL);
    CHECK(strstr(b.data, "\"logprob\":-9999") != NULL);
    dsv4_chat_buf_free(&b);

    /* whole response */
    dsv4_api_result res = {0};
    dsv4_event ev = {.type = DSV4_EV_REASONING, .text = "r", .len = 1};
    dsv4_api_result_add(&res, &ev, 1);
    ev = (dsv4_event){.type = DSV4_EV_CONTENT, .text = "c", .len = 1};
    dsv4_api_result_add(&res, &ev, 1);
    ev = (dsv4_event){.type = DSV4_EV_TOKEN, .sample = s};
    dsv4_api_result_add(&res, &ev, 1);
    ev = (dsv4_event){.type = DSV4_EV_TOOL_CALL, .tool_index = 0, .tool_id = "call_9", .tool_name = "f", .text = "{}", .len = 2};
    dsv4_api_result_add(&res, &ev, 1);
    ev = (dsv4_event){.type = DSV4_EV_FINISHED, .finish = DSV4_FINISH_TOOL_CALLS, .usage = u};
    dsv4_api_result_add(&res, &ev, 1);
    dsv4_api_response_json(&b, &rp, &res);
    json_error_t je;
    json_t *j = json_loadb(b.data, b.len, 0, &je);
    REQUIRE(j != NULL);
    json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    CHECK_STR(json_string_value(json_object_get(msg, "reasoning_content")), "r");
    CHECK_STR(json_string_value(json_object_get(msg, "content")), "c");
    CHECK_STR(json_string_value(json_object_get(json_object_get(json_array_get(json_object_get(msg, "tool_calls"), 0),
                                                                "function"),
                                                "name")),
              "f");
    CHECK_EQ_INT(json_integer_value(json_object_get(json_object_get(j, "usage"), "total_tokens")), 13);
    json_decref(j);
    dsv4_chat_buf_free(&b);
    dsv4_api_result_free(&res);

    /* completions with logprobs */
    rp.kind = DSV4_API_COMPLETIONS;
    dsv4_api_sse_text(&b, &rp, 0, "x", 1, &s, 1);
    dsv4_api_sse_finish(&b, &rp, DSV4_FINISH_LENGTH, NULL, 0);
    CHECK(sse_valid(b.data, &n));
    CHECK(strstr(b.data, "\"token_logprobs\":[-0.5]") != NULL);
    CHECK(strstr(b.data, "\"finish_reason\":\"length\"") != NULL);
    dsv4_chat_buf_free(&b);

    dsv4_api_errorf(&e, 429, "rate_limit_error", NULL, "queue_full", "busy");
    dsv4_api_error_json(&b, &e);
    CHECK_STR(b.data, "{\"error\":{\"message\":\"busy\",\"type\":\"rate_limit_error\",\"param\":null,\"code\":\"queue_full\"}}");
    dsv4_chat_buf_free(&b);
}

static void test_metrics(void) {
    dsv4_metrics m;
    dsv4_metrics_init(&m);
    dsv4_metrics_record(&m, 200, 0.3, 0);
    dsv4_metrics_record(&m, 400, 0.001, 0);
    dsv4_metrics_record(&m, 200, 3, 1);
    CHECK_EQ_INT(dsv4_metrics_count(&m, 200), 2);
    dsv4_sched_stats st;
    memset(&st, 0, sizeof st);
    st.running = 2;
    st.queue_depth = 1;
    st.state_bytes = 12345;
    st.cached_tokens = 77;
    st.ttft.count = 1;
    st.ttft.sum = 0.2;
    for (int i = 0; i < DSV4_SCHED_N_BUCKETS; i++) st.ttft.le[i] = dsv4_sched_latency_bounds[i] >= 0.2;
    dsv4_chat_buf b = {0};
    dsv4_metrics_render(&m, &st, &b);
    CHECK(strstr(b.data, "dsv4_http_requests_total{status=\"200\"} 2\n") != NULL);
    CHECK(strstr(b.data, "dsv4_http_requests_total{status=\"400\"} 1\n") != NULL);
    CHECK(strstr(b.data, "dsv4_running_sequences 2\n") != NULL);
    CHECK(strstr(b.data, "dsv4_queue_depth 1\n") != NULL);
    CHECK(strstr(b.data, "dsv4_state_memory_bytes 12345\n") != NULL);
    CHECK(strstr(b.data, "dsv4_prefix_cache_hit_tokens_total 77\n") != NULL);
    CHECK(strstr(b.data, "dsv4_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1\n") != NULL);
    CHECK(strstr(b.data, "dsv4_http_request_duration_seconds_bucket{le=\"0.5\"} 2\n") != NULL);
    CHECK(strstr(b.data, "dsv4_client_disconnects_total 1\n") != NULL);
    CHECK(strstr(b.data, "# TYPE dsv4_inter_token_latency_seconds histogram\n") != NULL);
    /* every non-comment line is "name{labels} value" */
    int bad = 0;
    for (char *line = b.data; line && *line;) {
        char *nl = strchr(line, '\n');
        if (line[0] != '#') {
            char *sp = memchr(line, ' ', nl ? (size_t)(nl - line) : strlen(line));
            if (!sp) bad++;
        }
        line = nl ? nl + 1 : NULL;
    }
    CHECK_EQ_INT(bad, 0);
    dsv4_chat_buf_free(&b);
    dsv4_metrics_free(&m);
}

/* ----- Anthropic's /v1/messages (server/api_anthropic) ----- */

static int anth_err(const char *body, int status, const char *want, const char *param) {
    dsv4_api_request r;
    dsv4_api_error e;
    memset(&e, 0, sizeof e);
    int rc = dsv4_anth_parse(body, strlen(body), &LIM, &r, &e);
    int parsed = rc == 0;
    if (rc == 0) rc = dsv4_api_prepare(&r, tok_(), &LIM, &e);
    int ok = rc < 0 && e.status == status && strstr(e.message, want) && (!param || !strcmp(e.param, param));
    if (!ok)
        fprintf(stderr, "  body %.90s: rc %d status %d param '%s' message '%s' (wanted %d '%s' '%s')\n", body, rc,
                e.status, e.param, e.message, status, want, param ? param : "");
    if (parsed) dsv4_api_request_free(&r);
    return ok;
}

static void test_anthropic_parse(void) {
    dsv4_api_request r;
    dsv4_api_error e;
    const char *b = "{\"model\":\"claude-x\",\"max_tokens\":9,\"system\":[{\"type\":\"text\",\"text\":\"be brief\"}],"
                    "\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi there\"}]}],"
                    "\"temperature\":0.5,\"top_p\":0.9,\"top_k\":5,\"stop_sequences\":[\"END\",\"##\"],"
                    "\"stream\":true,\"metadata\":{\"user_id\":\"u\"}}";
    REQUIRE(dsv4_anth_parse(b, strlen(b), &LIM, &r, &e) == 0);
    CHECK_STR(r.model, "claude-x");
    CHECK_EQ_INT(r.max_tokens, 9);
    CHECK(r.stream && r.sampling.top_k == 5 && fabsf(r.sampling.temperature - 0.5f) < 1e-7f);
    CHECK(r.n_stop == 2 && !strcmp(r.stop[0], "END") && !strcmp(r.stop[1], "##"));
    CHECK(!r.thinking && r.prompt && strstr(r.prompt, "be brief") && strstr(r.prompt, "hi there"));
    CHECK(dsv4_anth_matched_stop(&r, "a ## b END", 10) == r.stop[1]); /* earliest occurrence wins */
    CHECK(dsv4_anth_matched_stop(&r, "a b c", 5) == NULL);
    dsv4_api_request_free(&r);

    /* thinking {enabled, budget_tokens} turns thinking mode on; disabled wins over the model name */
    b = "{\"model\":\"m\",\"max_tokens\":4,\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":1024},"
        "\"messages\":[{\"role\":\"user\",\"content\":\"q\"}]}";
    REQUIRE(dsv4_anth_parse(b, strlen(b), &LIM, &r, &e) == 0);
    CHECK(r.thinking && r.opens_thinking);
    dsv4_api_request_free(&r);
    b = "{\"model\":\"deepseek-reasoner\",\"max_tokens\":4,\"thinking\":{\"type\":\"disabled\"},"
        "\"messages\":[{\"role\":\"user\",\"content\":\"q\"}]}";
    REQUIRE(dsv4_anth_parse(b, strlen(b), &LIM, &r, &e) == 0);
    CHECK(!r.thinking);
    dsv4_api_request_free(&r);

    /* tool_choice none leaves the tools out; any/tool keep them */
    b = "{\"model\":\"m\",\"max_tokens\":4,\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\"}}],"
        "\"tool_choice\":{\"type\":\"none\"},\"messages\":[{\"role\":\"user\",\"content\":\"q\"}]}";
    REQUIRE(dsv4_anth_parse(b, strlen(b), &LIM, &r, &e) == 0);
    CHECK(!r.parse_tools);
    dsv4_api_request_free(&r);
    b = "{\"model\":\"m\",\"max_tokens\":4,\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\"}}],"
        "\"tool_choice\":{\"type\":\"tool\",\"name\":\"f\"},\"messages\":[{\"role\":\"user\",\"content\":\"q\"}]}";
    REQUIRE(dsv4_anth_parse(b, strlen(b), &LIM, &r, &e) == 0);
    CHECK(r.parse_tools && strstr(r.prompt, "\"f\""));
    dsv4_api_request_free(&r);
}

/* A conversation with tool_use, tool_result and thinking renders exactly as
 * the same conversation in chat-completions form. */
static void test_anthropic_renders_like_chat(void) {
    const char *a =
        "{\"model\":\"m\",\"max_tokens\":5,\"system\":\"sys\","
        "\"tools\":[{\"name\":\"get_weather\",\"description\":\"w\",\"input_schema\":{\"type\":\"object\","
        "\"properties\":{\"city\":{\"type\":\"string\"}}}}],"
        "\"messages\":[{\"role\":\"user\",\"content\":\"Weather?\"},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"thinking\",\"thinking\":\"look it up\",\"signature\":\"s\"},"
        "{\"type\":\"text\",\"text\":\"Checking.\"},"
        "{\"type\":\"tool_use\",\"id\":\"call_1\",\"name\":\"get_weather\",\"input\":{\"city\":\"Paris\"}}]},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":\"call_1\","
        "\"content\":[{\"type\":\"text\",\"text\":\"18 C\"}]},{\"type\":\"text\",\"text\":\"Thanks\"}]}]}";
    const char *o =
        "{\"model\":\"m\",\"max_tokens\":5,"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"w\","
        "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}}}}}],"
        "\"messages\":[{\"role\":\"system\",\"content\":\"sys\"},{\"role\":\"user\",\"content\":\"Weather?\"},"
        "{\"role\":\"assistant\",\"content\":\"Checking.\",\"reasoning_content\":\"look it up\","
        "\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
        "\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"18 C\"},"
        "{\"role\":\"user\",\"content\":\"Thanks\"}]}";
    dsv4_api_request ra, ro;
    dsv4_api_error e;
    REQUIRE(dsv4_anth_parse(a, strlen(a), &LIM, &ra, &e) == 0);
    REQUIRE(dsv4_api_parse(DSV4_API_CHAT, o, strlen(o), &LIM, &ro, &e) == 0);
    CHECK(ra.parse_tools && ro.parse_tools);
    CHECKF(ra.prompt_len == ro.prompt_len && !memcmp(ra.prompt, ro.prompt, ra.prompt_len), "anthropic:\n%s\nchat:\n%s",
           ra.prompt, ro.prompt);
    CHECK(strstr(ra.prompt, "18 C") && strstr(ra.prompt, "Paris"));
    dsv4_api_request_free(&ra);
    dsv4_api_request_free(&ro);
}

static void test_anthropic_errors(void) {
    const char *U = "\"messages\":[{\"role\":\"user\",\"content\":\"q\"}]";
    char b[1024];
#define AE(fmt, status, want, param)                                                                           \
    do {                                                                                                       \
        snprintf(b, sizeof b, fmt, U);                                                                         \
        CHECK(anth_err(b, status, want, param));                                                               \
    } while (0)
    AE("{\"max_tokens\":4,%s}", 400, "model: required", "model");
    AE("{\"model\":\"m\",%s}", 400, "max_tokens: required", "max_tokens");
    AE("{\"model\":\"m\",\"max_tokens\":0,%s}", 400, "max_tokens: must be an integer >= 1", "max_tokens");
    AE("{\"model\":\"m\",\"max_tokens\":\"4\",%s}", 400, "max_tokens: must be an integer", "max_tokens");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"temperature\":1.5,%s}", 400, "out of range [0, 1]", "temperature");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"top_p\":2,%s}", 400, "top_p", "top_p");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"stop_sequences\":\"x\",%s}", 400, "must be an array", "stop_sequences");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"stop_sequences\":[\"\"],%s}", 400, "non-empty string", "stop_sequences");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"system\":[{\"type\":\"image\"}],%s}", 400, "text", "system");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"system\":5,%s}", 400, "must be a string or an array", "system");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"thinking\":{\"type\":\"enabled\"},%s}", 400, "budget_tokens: required",
       "thinking.budget_tokens");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"thinking\":{\"type\":\"on\"},%s}", 400, "thinking: must be", "thinking");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"tools\":[{\"name\":\"f\"}],%s}", 400, "input_schema: required", "tools[0]");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"tools\":[{\"name\":\"f\",\"input_schema\":\"x\"}],%s}", 400,
       "must be a JSON Schema object", "tools[0].input_schema");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"tools\":[{\"type\":\"web_search_20250305\",\"name\":\"w\"}],%s}", 400,
       "only custom tools", "tools[0]");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"tool_choice\":{\"type\":\"some\"},%s}", 400, "not one of auto",
       "tool_choice.type");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"tool_choice\":{\"type\":\"tool\"},%s}", 400, "name", "tool_choice.name");
    AE("{\"model\":\"m\",\"max_tokens\":4,\"tools\":[{\"name\":\"f\",\"input_schema\":{}}],"
       "\"tool_choice\":{\"type\":\"tool\",\"name\":\"g\"},%s}", 400, "not in tools", "tool_choice");
    AE("{\"model\":\"m\",\"max_tokens\":5000,%s}", 400, "exceeds the context", "max_tokens");
#undef AE
    CHECK(anth_err("{\"model\":\"m\",\"max_tokens\":4}", 400, "messages: required", "messages"));
    CHECK(anth_err("{\"model\":\"m\",\"max_tokens\":4,\"messages\":[]}", 400, "must not be empty", "messages"));
    CHECK(anth_err("{\"model\":\"m\",\"max_tokens\":4,\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}", 400,
                   "unknown role \"tool\"", "messages[0].role"));
    CHECK(anth_err("{\"model\":\"m\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\"}]}", 400, "required",
                   "messages[0].content"));
    CHECK(anth_err("{\"model\":\"m\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\",\"content\":[]}]}", 400,
                   "must not be empty", "messages[0].content"));
    CHECK(anth_err("{\"model\":\"m\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":"
                   "\"tool_result\"}]}]}", 400, "tool_use_id", "messages[0].content[0]"));
    CHECK(anth_err("{\"model\":\"m\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":"
                   "\"image\",\"source\":{}}]}]}", 400, "not supported", "messages[0].content[0]"));
    CHECK(anth_err("{\"model\":\"m\",\"max_tokens\":4,\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":"
                   "\"tool_use\",\"id\":\"a\",\"name\":\"f\",\"input\":[1]}]}]}", 400, "input: must be an object",
                   "messages[0].content[0]"));
    CHECK(anth_err("{\"model\":\"m\",\"max_tokens\":4,\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":"
                   "\"tool_result\",\"tool_use_id\":\"a\"}]}]}", 400, "not an assistant content block",
                   "messages[0].content[0]"));
    CHECK(anth_err("{\"model\":", 400, "malformed JSON", NULL));
    CHECK(anth_err("[1]", 400, "must be a JSON object", NULL));
    CHECK(anth_err("{\"model\":\"m\",\"model\":\"n\"}", 400, "malformed JSON", NULL)); /* duplicate key */
    char inv[] = "{\"model\":\"\xc3\x28\"}";
    CHECK(anth_err(inv, 400, "invalid UTF-8 at byte", NULL));
}

static void test_anthropic_builders(void) {
    dsv4_api_reply rp = {.id = "msg_1", .model = "m"};
    dsv4_api_result res = {0};
    dsv4_chat_buf_puts(&res.reasoning, "think \"hard\"");
    dsv4_chat_buf_puts(&res.content, "Hi");
    res.calls = calloc(1, sizeof *res.calls);
    REQUIRE(res.calls);
    res.n_calls = res.cap_calls = 1;
    snprintf(res.calls[0].id, sizeof res.calls[0].id, "call_9");
    res.calls[0].name = dsv4_xstrdup("f");
    res.calls[0].arguments = dsv4_xstrdup("{\"a\": 1}");
    res.finished = 1;
    res.finish = DSV4_FINISH_TOOL_CALLS;
    res.usage.prompt_tokens = 10;
    res.usage.cached_tokens = 4;
    res.usage.completion_tokens = 3;
    dsv4_chat_buf b = {0};
    dsv4_anth_response_json(&b, &rp, &res, NULL);
    json_error_t je;
    json_t *j = json_loadb(b.data, b.len, 0, &je);
    REQUIRE(j);
    CHECK_STR(json_string_value(json_object_get(j, "type")), "message");
    CHECK_STR(json_string_value(json_object_get(j, "stop_reason")), "tool_use");
    json_t *c = json_object_get(j, "content");
    CHECK(json_array_size(c) == 3);
    CHECK_STR(json_string_value(json_object_get(json_array_get(c, 0), "thinking")), "think \"hard\"");
    CHECK_STR(json_string_value(json_object_get(json_array_get(c, 1), "text")), "Hi");
    CHECK(json_integer_value(json_object_get(json_object_get(json_array_get(c, 2), "input"), "a")) == 1);
    json_t *u = json_object_get(j, "usage");
    CHECK(json_integer_value(json_object_get(u, "input_tokens")) == 6 &&
          json_integer_value(json_object_get(u, "cache_read_input_tokens")) == 4 &&
          json_integer_value(json_object_get(u, "output_tokens")) == 3);
    json_decref(j);
    dsv4_chat_buf_free(&b);
    /* arguments that are not an object still give an object input */
    free(res.calls[0].arguments);
    res.calls[0].arguments = dsv4_xstrdup("not json");
    dsv4_anth_response_json(&b, &rp, &res, NULL);
    j = json_loadb(b.data, b.len, 0, &je);
    REQUIRE(j);
    CHECK_STR(json_string_value(json_object_get(
                  json_object_get(json_array_get(json_object_get(j, "content"), 2), "input"), "arguments")),
              "not json");
    json_decref(j);
    dsv4_chat_buf_free(&b);
    dsv4_api_result_free(&res);

    CHECK_STR(dsv4_anth_stop_reason(DSV4_FINISH_STOP, NULL), "end_turn");
    CHECK_STR(dsv4_anth_stop_reason(DSV4_FINISH_STOP, "x"), "stop_sequence");
    CHECK_STR(dsv4_anth_stop_reason(DSV4_FINISH_LENGTH, NULL), "max_tokens");
    CHECK_STR(dsv4_anth_error_type(429), "rate_limit_error");
    CHECK_STR(dsv4_anth_error_type(500), "api_error");
    dsv4_api_error e;
    dsv4_api_errorf(&e, 401, "authentication_error", NULL, NULL, "bad \"key\"");
    dsv4_anth_error_json(&b, &e);
    CHECK_STR(b.data, "{\"type\":\"error\",\"error\":{\"type\":\"authentication_error\",\"message\":\"bad \\\"key\\\"\"}}");
    dsv4_chat_buf_free(&b);

    /* stream: thinking block, text block, tool block, then the end */
    dsv4_anth_stream st;
    dsv4_anth_sse_start(&b, &st, &rp, 10);
    dsv4_anth_sse_text(&b, &st, 1, "a", 1);
    dsv4_anth_sse_text(&b, &st, 1, "b", 1);
    dsv4_anth_sse_text(&b, &st, 0, "c", 1);
    dsv4_anth_sse_tool_use(&b, &st, "call_1", "f", "{}", 2);
    dsv4_usage us = {.prompt_tokens = 10, .completion_tokens = 4};
    dsv4_anth_sse_finish(&b, &st, DSV4_FINISH_TOOL_CALLS, NULL, &us);
    REQUIRE(b.data);
    const char *want[] = {"message_start", "content_block_start", "content_block_delta", "content_block_delta",
                          "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
                          "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                          "message_stop"};
    const char *p = b.data;
    size_t k = 0;
    int order_ok = 1;
    while ((p = strstr(p, "event: "))) {
        p += 7;
        size_t l = strcspn(p, "\n");
        if (k >= sizeof want / sizeof *want || strlen(want[k]) != l || strncmp(p, want[k], l)) order_ok = 0;
        k++;
        /* the data line is JSON with the same type */
        const char *d = strstr(p, "\ndata: ");
        if (!d) { order_ok = 0; break; }
        d += 7;
        size_t dl = strcspn(d, "\n");
        json_t *ev = json_loadb(d, dl, 0, &je);
        if (!ev || strncmp(json_string_value(json_object_get(ev, "type")), p, l)) order_ok = 0;
        json_decref(ev);
    }
    CHECK(order_ok && k == sizeof want / sizeof *want);
    CHECK(strstr(b.data, "\"thinking_delta\"") && strstr(b.data, "\"text_delta\"") && strstr(b.data, "\"input_json_delta\""));
    CHECK(strstr(b.data, "\"index\":2,\"content_block\":{\"type\":\"tool_use\""));
    CHECK(strstr(b.data, "\"stop_reason\":\"tool_use\""));
    dsv4_chat_buf_free(&b);
}

TEST_MAIN(test_malformed_and_types, test_tools_validation, test_utf8_and_limits, test_completions,
          test_chat_fields_and_thinking, test_builders, test_metrics, test_anthropic_parse,
          test_anthropic_renders_like_chat, test_anthropic_errors, test_anthropic_builders)
