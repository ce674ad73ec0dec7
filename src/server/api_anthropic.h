/* server/api_anthropic: Anthropic's Messages API (POST /v1/messages).
 *
 * Owns: validating an Anthropic request body and translating it into the
 * chat-completions request tree that server/api_openai parses and renders
 * (so both endpoints share one validator, renderer and scheduler path), and
 * building Anthropic's replies: the whole `message` object, the SSE events of
 * a stream (message_start, content_block_start/delta/stop, message_delta,
 * message_stop) and `{"type":"error","error":{...}}`.  docs/SERVER.md lists
 * the fields and the mapping.
 *
 * No I/O and no engine.  Threads: reentrant; a stream state belongs to one
 * thread.  Errors: parse returns 0 / -1 and fills a dsv4_api_error (status,
 * message naming the field; the type is chosen from the status when the
 * error is written).
 */
#ifndef DSV4_SERVER_API_ANTHROPIC_H
#define DSV4_SERVER_API_ANTHROPIC_H

#include <stddef.h>

#include "server/api_openai.h"

/* Parses BODY[0..len) (UTF-8, JSON without duplicate keys, Anthropic fields)
 * into OUT, ready for dsv4_api_prepare.  OUT->stop holds stop_sequences. */
int dsv4_anth_parse(const char *body, size_t len, const dsv4_api_limits *lim, dsv4_api_request *out,
                    dsv4_api_error *e);

/* Anthropic's error type for an HTTP status ("invalid_request_error",
 * "authentication_error", "not_found_error", "request_too_large",
 * "rate_limit_error", "api_error", "overloaded_error"). */
const char *dsv4_anth_error_type(int status);

/* `{"type":"error","error":{"type","message"}}` for E. */
void dsv4_anth_error_json(dsv4_chat_buf *b, const dsv4_api_error *e);

/* The stop reason for a finish: end_turn, max_tokens, tool_use, or
 * stop_sequence when STOP_SEQ (the matched stop string) is non-NULL. */
const char *dsv4_anth_stop_reason(dsv4_finish_reason f, const char *stop_seq);

/* The first stop string of R that occurs in RAW[0..n) (the text of the
 * generated tokens), earliest position first; NULL if none. */
const char *dsv4_anth_matched_stop(const dsv4_api_request *r, const char *raw, size_t n);

/* The whole non-streaming response: {id, type: "message", role, model,
 * content: [thinking, text, tool_use...], stop_reason, stop_sequence, usage}. */
void dsv4_anth_response_json(dsv4_chat_buf *b, const dsv4_api_reply *rp, const dsv4_api_result *res,
                             const char *stop_seq);

/* ----- streaming: each call appends whole "event: X\ndata: {...}\n\n" events ----- */
typedef struct dsv4_anth_stream {
    int next_index; /* index of the next content block */
    int open;       /* the open block: 0 none, 1 text, 2 thinking */
} dsv4_anth_stream;

void dsv4_anth_sse_start(dsv4_chat_buf *b, dsv4_anth_stream *st, const dsv4_api_reply *rp, int64_t input_tokens);
/* Text (REASONING: a thinking block) continues the open block of its kind or opens one. */
void dsv4_anth_sse_text(dsv4_chat_buf *b, dsv4_anth_stream *st, int reasoning, const char *text, size_t len);
/* A whole tool_use block: start, one input_json_delta with ARGS, stop. */
void dsv4_anth_sse_tool_use(dsv4_chat_buf *b, dsv4_anth_stream *st, const char *id, const char *name,
                            const char *args, size_t args_len);
/* Closes the open block, then message_delta (stop reason, usage) and message_stop. */
void dsv4_anth_sse_finish(dsv4_chat_buf *b, dsv4_anth_stream *st, dsv4_finish_reason f, const char *stop_seq,
                          const dsv4_usage *u);
/* An error inside a stream: event: error. */
void dsv4_anth_sse_error(dsv4_chat_buf *b, const dsv4_api_error *e);

#endif
