/* fidelity/client: one chat turn against the model under test.
 *
 * Owns: either an OpenAI-compatible endpoint (POST {URL}/v1/chat/completions,
 * non-streaming, temperature 0, through libcurl) or the local model in-process
 * (the messages rendered in the DeepSeek-V4 chat format with text/chat, the
 * prompt run through the engine, greedy decoding).  The suites do not care
 * which: they send OpenAI-shaped messages (+ tools) and get the answer text.
 * Lifetime: fid_client_open .. fid_client_close.  Threads: one caller at a time.
 * Errors: 0 / -1 with a message naming the URL and what was wrong (cannot
 * connect, timed out after N s, HTTP status and body excerpt, not JSON, no
 * choices[0].message) or, locally, the file/step at fault.
 */
#ifndef DSV4_FIDELITY_CLIENT_H
#define DSV4_FIDELITY_CLIENT_H

#include <jansson.h>
#include <stdint.h>

#include "util/err.h"

typedef struct fid_client fid_client;

typedef struct fid_client_opts {
    const char *endpoint;       /* base URL; NULL = local model */
    const char *model;          /* endpoint: the model name; local: the checkpoint dir (NULL = default) */
    const char *api_key;        /* endpoint: Bearer token or NULL */
    double request_timeout;     /* seconds per request (endpoint), 0 = 120 */
    int max_tokens;             /* answer length cap; 0 = 32 */
    const char *const *sets;    /* local: numerics switch overrides */
    int n_sets;
} fid_client_opts;

int fid_client_open(fid_client **out, const fid_client_opts *o, dsv4_err *err);
void fid_client_close(fid_client *c);

/* Sends MESSAGES (JSON array) with TOOLS (NULL or an OpenAI tools array) and
 * returns the assistant's content (malloc'd; "" if it answered with no text) and
 * the prompt length in tokens (-1 when the endpoint does not say). */
int fid_client_chat(fid_client *c, const json_t *messages, const json_t *tools, char **answer,
                    int64_t *prompt_tokens, dsv4_err *err);

int fid_client_is_local(const fid_client *c);
/* "http://host:port/v1/chat/completions (model NAME)" or "local model DIR". */
const char *fid_client_describe(const fid_client *c);

#endif
