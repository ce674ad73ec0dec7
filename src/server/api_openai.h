/* server/api_openai: the OpenAI-compatible request and response formats.
 *
 * Owns: parsing and validating a request body (POST /v1/chat/completions,
 * POST /v1/completions) into a dsv4_api_request -- every field checked for
 * type and range, the chat prompt rendered through text/chat, the prompt
 * tokenized and checked against the context -- and building the replies: the
 * whole-response JSON, the SSE chunks of a stream (with a small escaper, no
 * jansson on the hot path), and OpenAI error JSON.  docs/SERVER.md lists the
 * fields, their ranges and the thinking-mode rules.
 *
 * No I/O and no engine: the HTTP layer (server/http) feeds it bytes and
 * scheduler events.  Threads: every function is reentrant; a request, result
 * or stream belongs to one thread.  Errors: parse/prepare return 0 / -1 and
 * fill a dsv4_api_error with the HTTP status, OpenAI's error type, the
 * offending parameter and a message naming it.
 */
#ifndef DSV4_SERVER_API_OPENAI_H
#define DSV4_SERVER_API_OPENAI_H

#include <stddef.h>
#include <stdint.h>

#include "engine/scheduler.h"
#include "text/chat.h"
#include "text/sampler.h"
#include "text/stop.h"
#include "text/tokenizer.h"

#define DSV4_API_MAX_BODY_DEFAULT ((size_t)8 << 20) /* 8 MiB */

typedef enum { DSV4_API_CHAT = 1, DSV4_API_COMPLETIONS = 2 } dsv4_api_kind;

/* An error as OpenAI reports it: {"error": {"message", "type", "param", "code"}}. */
typedef struct dsv4_api_error {
    int status;      /* HTTP status: 400, 401, 404, 405, 413, 429, 500, 503 */
    char type[40];   /* "invalid_request_error", "authentication_error", ... */
    char param[128]; /* the offending field ("messages[2].role"), "" = null */
    char code[48];   /* "context_length_exceeded", ... "" = null */
    char message[DSV4_ERR_MAX];
} dsv4_api_error;

/* Fills E (status, type, param and code may be NULL/"" for null) and returns -1. */
int dsv4_api_errorf(dsv4_api_error *e, int status, const char *type, const char *param, const char *code,
                    const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* Facts about the served model the parser needs. */
typedef struct dsv4_api_limits {
    int vocab_size;         /* token ids and logit_bias keys must be below it */
    int64_t ctx;            /* prompt + max_tokens must fit */
    const char *model_id;   /* reported when the request names no model */
    const char *think_model;/* a model name that turns thinking on ("deepseek-reasoner") */
    int test_hooks;         /* accept "dsv4_forced_output" (tests only; `serve --test-hooks`) */
} dsv4_api_limits;

/* A validated request.  Everything it points to is owned by it. */
typedef struct dsv4_api_request {
    dsv4_api_kind kind;
    char model[128]; /* echoed in responses */
    int stream, include_usage;
    int max_tokens; /* 0 = not given (up to the context) */
    dsv4_sampling_params sampling; /* logit_bias arrays point into bias_ids / bias_values */
    int32_t *bias_ids;
    float *bias_values;
    int n_stop;
    char *stop[DSV4_STOP_MAX_STRINGS];
    int32_t stop_ids[DSV4_STOP_MAX_IDS];
    int n_stop_ids;
    int ignore_eos;
    int logprobs;     /* report logprobs of chosen tokens */
    int top_logprobs; /* and this many alternatives */
    /* chat */
    int thinking;         /* thinking mode rendered */
    dsv4_effort effort;
    int parse_tools;      /* tools given and tool_choice is not "none" */
    int opens_thinking;   /* the prompt ends inside <think>: output starts as reasoning */
    /* the prompt: rendered chat text or the completion string, then its ids */
    char *prompt;
    size_t prompt_len;
    int prompt_is_ids;    /* completions given token ids: prompt is NULL */
    int32_t *prompt_ids;
    int n_prompt_ids;
    /* test hook: text the model is made to generate (tokenized by prepare) */
    char *forced;
    int32_t *forced_ids;
    int n_forced;
} dsv4_api_request;

/* Parses BODY[0..len) for endpoint KIND: UTF-8 check, JSON (duplicate keys
 * rejected), field types and ranges, and for chat the rendered prompt.  Unknown
 * fields are ignored.  On failure *out is empty (nothing to free). */
int dsv4_api_parse(dsv4_api_kind kind, const char *body, size_t len, const dsv4_api_limits *lim,
                   dsv4_api_request *out, dsv4_api_error *e);

/* The same on a parsed JSON value (borrowed; jansson's json_t).  The
 * Anthropic endpoint (server/api_anthropic) translates its body into a chat
 * request tree and parses it here. */
struct json_t;
int dsv4_api_parse_value(dsv4_api_kind kind, struct json_t *root, const dsv4_api_limits *lim,
                         dsv4_api_request *out, dsv4_api_error *e);

/* Tokenizes the prompt (chat prompts with their special tokens; completion
 * text as plain text plus special tokens) and checks it against the context:
 * an empty prompt, or prompt + max_tokens beyond lim->ctx, is a 400 naming the
 * lengths (code "context_length_exceeded"). */
int dsv4_api_prepare(dsv4_api_request *r, const dsv4_tokenizer *tok, const dsv4_api_limits *lim,
                     dsv4_api_error *e);

void dsv4_api_request_free(dsv4_api_request *r);

/* Writes `{"error": {...}}` for E into B. */
void dsv4_api_error_json(dsv4_chat_buf *b, const dsv4_api_error *e);

/* Appends S[0..n) as a JSON string literal; bytes that are not valid UTF-8
 * become U+FFFD so the output is always valid JSON. */
void dsv4_api_json_string(dsv4_chat_buf *b, const char *s, size_t n);
/* "an object", "a string", ... for error messages about a JSON value of the wrong type. */
const char *dsv4_api_json_kind(const json_t *v);

/* ----- collecting a whole response ----- */
typedef struct dsv4_api_call {
    int index;
    char id[32];
    char *name, *arguments;
} dsv4_api_call;

typedef struct dsv4_api_result {
    dsv4_chat_buf reasoning, content;
    dsv4_api_call *calls;
    size_t n_calls, cap_calls;
    dsv4_sample *lp; /* one per generated token, when logprobs were asked */
    size_t n_lp, cap_lp;
    int finished;
    dsv4_finish_reason finish;
    char *message; /* error text when finish is DSV4_FINISH_ERROR */
    dsv4_usage usage;
    int oom;
} dsv4_api_result;

/* Adds one scheduler event (TOKEN events only when want_lp). */
void dsv4_api_result_add(dsv4_api_result *r, const dsv4_event *ev, int want_lp);
void dsv4_api_result_free(dsv4_api_result *r);

/* OpenAI's finish_reason for a scheduler finish ("stop", "length", "tool_calls";
 * cancellations report "stop", errors "error"). */
const char *dsv4_api_finish_name(dsv4_finish_reason f);

/* Identity of one response, shared by all its chunks. */
typedef struct dsv4_api_reply {
    dsv4_api_kind kind;
    char id[64];      /* "chatcmpl-..." / "cmpl-..." */
    long long created;
    char model[128];
    const dsv4_tokenizer *tok; /* token strings for logprobs */
    int logprobs, top_logprobs;
} dsv4_api_reply;

/* The whole non-streaming response body. */
void dsv4_api_response_json(dsv4_chat_buf *b, const dsv4_api_reply *rp, const dsv4_api_result *res);

/* ----- SSE chunks: each call appends one "data: {...}\n\n" event ----- */
void dsv4_api_sse_role(dsv4_chat_buf *b, const dsv4_api_reply *rp);
/* A text delta (REASONING -> "reasoning_content", CONTENT -> "content"; the
 * completions endpoint has only "text"), with logprobs of LP[0..n_lp) if any. */
void dsv4_api_sse_text(dsv4_chat_buf *b, const dsv4_api_reply *rp, int reasoning, const char *text, size_t len,
                       const dsv4_sample *lp, size_t n_lp);
void dsv4_api_sse_tool_call(dsv4_chat_buf *b, const dsv4_api_reply *rp, int index, const char *id, const char *name,
                            const char *arguments, size_t args_len);
void dsv4_api_sse_finish(dsv4_chat_buf *b, const dsv4_api_reply *rp, dsv4_finish_reason f, const dsv4_sample *lp,
                         size_t n_lp);
/* The usage chunk of stream_options.include_usage (empty choices). */
void dsv4_api_sse_usage(dsv4_chat_buf *b, const dsv4_api_reply *rp, const dsv4_usage *u);
/* An error inside a stream: data: {"error": ...}. */
void dsv4_api_sse_error(dsv4_chat_buf *b, const dsv4_api_error *e);
void dsv4_api_sse_done(dsv4_chat_buf *b);

#endif
