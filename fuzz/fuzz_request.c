/* fuzz/fuzz_request: libFuzzer harness for the OpenAI request parser
 * (dsv4_api_parse, both endpoints).  The first byte picks the endpoint; the
 * rest is the body.  Checks: never crashes or leaks; an error always carries
 * a 4xx/5xx status and a message; an accepted chat request has a rendered
 * prompt, and its error/SSE builders produce output. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_openai.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
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
