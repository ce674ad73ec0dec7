/* fuzz/fuzz_request: libFuzzer harness for the request parsers: OpenAI's
 * (dsv4_api_parse, both endpoints) and Anthropic's (dsv4_anth_parse).  The
 * first byte picks the endpoint ('A': /v1/messages, else odd: completions,
 * even: chat); the rest is the body.  Checks: never crashes or leaks; an error always carries
 * a 4xx/5xx status and a message; an accepted chat request has a rendered
 * prompt, and its error/SSE builders produce output. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_anthropic.h"
#include "server/api_openai.h"

/* /v1/messages: an error has a status and a message and writes Anthropic's
 * error JSON; an accepted request has a rendered prompt and its stop strings
 * are searchable. */
static int one_messages(const uint8_t *data, size_t size, const dsv4_api_limits *lim) {
    dsv4_api_request r;
    dsv4_api_error e;
    memset(&e, 0, sizeof e);
    dsv4_chat_buf b = {0};
    if (dsv4_anth_parse((const char *)data, size, lim, &r, &e) < 0) {
        if (e.status < 400 || e.status > 599 || !e.message[0]) abort();
        dsv4_anth_error_json(&b, &e);
        if (!b.oom && (!b.data || b.data[0] != '{')) abort();
        dsv4_chat_buf_free(&b);
        return 0;
    }
    if (!r.prompt || r.prompt_len != strlen(r.prompt) || r.max_tokens < 1) abort();
    if (r.n_stop > DSV4_STOP_MAX_STRINGS) abort();
    (void)dsv4_anth_matched_stop(&r, r.prompt, r.prompt_len);
    dsv4_api_reply rp = {.kind = DSV4_API_CHAT, .id = "msg_x", .created = 1};
    memcpy(rp.model, r.model, sizeof rp.model);
    dsv4_anth_stream st;
    dsv4_anth_sse_start(&b, &st, &rp, 1);
    dsv4_anth_sse_text(&b, &st, 0, r.prompt, r.prompt_len);
    dsv4_anth_sse_tool_use(&b, &st, "t", "f", r.prompt, r.prompt_len);
    dsv4_chat_buf_free(&b);
    dsv4_api_request_free(&r);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (data[0] == 'A') {
        const dsv4_api_limits lim = {.vocab_size = 129280, .ctx = 4096, .model_id = "m",
                                     .think_model = "deepseek-reasoner", .test_hooks = 1};
        return one_messages(data + 1, size - 1, &lim);
    }
    dsv4_api_kind kind = (data[0] & 1) ? DSV4_API_COMPLETIONS : DSV4_API_CHAT;
    const dsv4_api_limits lim = {.vocab_size = 129280, .ctx = 4096, .model_id = "m", .think_model = "deepseek-reasoner",
                                 .test_hooks = 1};
    dsv4_api_request r;
    dsv4_api_error e;
    memset(&e, 0, sizeof e);
    if (dsv4_api_parse(kind, (const char *)data + 1, size - 1, &lim, &r, &e) < 0) {
        if (e.status < 400 || e.status > 599 || !e.message[0]) abort();
        dsv4_chat_buf b = {0};
        dsv4_api_error_json(&b, &e);
        if (!b.oom && (!b.data || b.data[0] != '{')) abort();
        dsv4_chat_buf_free(&b);
        return 0;
    }
    if (kind == DSV4_API_CHAT && (!r.prompt || r.prompt_len != strlen(r.prompt))) abort();
    if (r.max_tokens < 0 || r.n_stop > DSV4_STOP_MAX_STRINGS) abort();
    /* echo the model name and prompt through the escaper */
    dsv4_chat_buf b = {0};
    dsv4_api_reply rp = {.kind = kind, .id = "x", .created = 1};
    memcpy(rp.model, r.model, sizeof rp.model);
    if (r.prompt) dsv4_api_sse_text(&b, &rp, 0, r.prompt, r.prompt_len, NULL, 0);
    dsv4_chat_buf_free(&b);
    dsv4_api_request_free(&r);
    return 0;
}
