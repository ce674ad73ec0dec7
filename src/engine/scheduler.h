/* engine/scheduler: continuous batching, chunked prefill and prefix reuse over
 * one engine (STYLE §14; issue 5).  docs/SCHEDULER.md explains the policy.
 *
 * Owns: one engine thread, which alone touches the engine and every sequence;
 * a bounded queue of waiting requests; the running requests (sampler, stop
 * matcher, streaming detokenizer, DSML output parser each); a prefix cache of
 * finished conversations' sequences (LRU, bounded by bytes and by count).
 * The engine itself stays the caller's: open it, hand it to dsv4_sched_start,
 * do not touch it until dsv4_sched_stop returns, then close it.  The tokenizer
 * is borrowed too (it is thread-safe after load) and must outlive the scheduler.
 *
 * Requests and threads: any thread (HTTP handler, CLI) may submit.  A request
 * is reference counted: the submitter holds one reference, the engine thread
 * another until the request has finished.  The submitter pops events from the
 * request's own queue (mutex + condvar; blocking with a timeout or polling),
 * may cancel it from any thread at any time, and must release it exactly once
 * when done with it (release also cancels if it is still running).  Events
 * arrive in order: deltas / tokens / tool calls ..., then exactly one FINISHED.
 * After FINISHED has been popped, no more events come.  Freed memory is never
 * touched: the request outlives the scheduler if the submitter still holds it.
 *
 * Errors: submit returns DSV4_SCHED_OK, DSV4_SCHED_EINVAL (bad request: the
 * message names the field, e.g. the prompt and context lengths),
 * DSV4_SCHED_EBUSY (queue full: retry later, HTTP 429) or DSV4_SCHED_ECLOSED
 * (shutting down, HTTP 503).  Submissions racing dsv4_sched_stop get ECLOSED;
 * after stop returns the scheduler is freed and must not be used at all.
 * Failures during generation (an engine error) end the request with FINISHED /
 * DSV4_FINISH_ERROR and a message; the scheduler keeps serving the others.
 *
 * OpenMP: the engine thread uses the OpenMP thread count of the thread that
 * calls dsv4_sched_start (the engine applies --threads on the thread that
 * opens it), so open the engine and start the scheduler on one thread.
 */
#ifndef DSV4_ENGINE_SCHEDULER_H
#define DSV4_ENGINE_SCHEDULER_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "text/chat.h"
#include "text/sampler.h"
#include "text/stop.h"
#include "text/tokenizer.h"
#include "util/err.h"

typedef struct dsv4_sched dsv4_sched;
typedef struct dsv4_request dsv4_request;

enum {
    DSV4_SCHED_OK = 0,
    DSV4_SCHED_EINVAL = -1, /* bad request; err names the field */
    DSV4_SCHED_EBUSY = -2,  /* the waiting queue is full */
    DSV4_SCHED_ECLOSED = -3 /* dsv4_sched_stop has begun */
};

/* ----- starting and stopping ----- */
typedef struct dsv4_sched_opts {
    int max_seqs;       /* running sequences at most (default 8); others wait in the queue */
    int queue_cap;      /* requests waiting beyond the free slots, at most (default 64); beyond: DSV4_SCHED_EBUSY */
    int prefill_chunk;  /* prompt tokens per sequence per iteration (default 256) */
    int prefill_budget; /* prompt tokens per iteration over all sequences (default 512) */
    int64_t ctx;        /* context limit: prompt + max_tokens; 0 = the model's max_position */
    size_t cache_bytes; /* prefix cache state budget (default 1 GiB; 0 keeps nothing) */
    int cache_max_seqs; /* prefix cache entries at most (default 64) */
    int cache_off;      /* 1: no prefix reuse at all */
} dsv4_sched_opts;

/* Fills the defaults above. */
void dsv4_sched_opts_default(dsv4_sched_opts *o);

/* Starts the engine thread.  E and TOK are borrowed (see the contract above).
 * opts NULL = defaults.  Fails on bad options (naming them) or if the thread
 * cannot start. */
int dsv4_sched_start(dsv4_sched **out, dsv4_engine *e, const dsv4_tokenizer *tok, const dsv4_sched_opts *opts,
                     dsv4_err *err);

/* Graceful shutdown: refuses new submissions (ECLOSED), then either lets the
 * queued and running requests finish (cancel_inflight 0) or ends them with
 * DSV4_FINISH_CANCELLED (1), joins the engine thread, frees every sequence
 * (running and cached) and the scheduler.  Requests still held by submitters
 * stay valid until released.  NULL is a no-op. */
void dsv4_sched_stop(dsv4_sched *s, int cancel_inflight);

/* Model facts copied at start (read-only; safe from any thread). */
const dsv4_engine_info *dsv4_sched_engine_info(const dsv4_sched *s);
int64_t dsv4_sched_ctx(const dsv4_sched *s);

/* Empties the prefix cache (frees its sequences) on the engine thread; returns
 * once done.  For tests and memory pressure. */
void dsv4_sched_flush_cache(dsv4_sched *s);

/* ----- requests ----- */
typedef enum {
    DSV4_OUTPUT_RAW = 0,  /* all generated text is CONTENT (completions endpoint) */
    DSV4_OUTPUT_CHAT = 1, /* DSML parsing: REASONING / CONTENT deltas and TOOL_CALL events */
} dsv4_output_mode;

typedef void (*dsv4_request_notify_fn)(void *user);

typedef struct dsv4_request_params {
    /* The prompt: token ids (copied), or, when prompt_ids is NULL, text
     * tokenized at submit with text_flags (dsv4_tokenizer_encode flags; e.g. a
     * rendered chat prompt needs added tokens, so 0).  Must not be empty. */
    const int32_t *prompt_ids;
    int n_prompt;
    const char *prompt_text;
    size_t prompt_text_len; /* 0 = strlen */
    unsigned text_flags;

    dsv4_sampling_params sampling; /* copied (logit_bias arrays too); no seed = one is drawn and reported */
    int max_tokens;                /* new tokens at most; 0 = up to the context limit */

    /* Stop strings (copied; at most DSV4_STOP_MAX_STRINGS) and extra stop ids;
     * the model's EOS stops too unless ignore_eos. */
    const char *const *stop;
    int n_stop;
    const int32_t *stop_ids;
    int n_stop_ids;
    int ignore_eos;

    dsv4_output_mode output;
    dsv4_chat_mode start_mode; /* CHAT output: THINKING when the prompt ends inside <think>
                                  (dsv4_chat_prompt_opens_thinking), else CHAT */
    int parse_tools;           /* CHAT output: 1 = DSML tool calls become TOOL_CALL events and finish
                                  "tool_calls"; 0 = they stay in the content text */
    int want_tokens;           /* 1 = a TOKEN event per generated token (ids; logprobs when sampling asks) */
    int want_progress;         /* 1 = PROGRESS events during prefill */

    /* Testing hook: generate exactly these tokens (copied) instead of sampling,
     * still running each through the model; when they run out, sampling goes on. */
    const int32_t *forced_ids;
    int n_forced;

    const char *client; /* a name for the log line (copied); NULL = "-" */

    /* Optional: called on the engine thread (no lock held) after events were
     * queued, e.g. to resume a suspended HTTP connection.  Must not block and
     * must not call back into the scheduler except dsv4_request_cancel. */
    dsv4_request_notify_fn notify;
    void *notify_user;
} dsv4_request_params;

/* Zero prompt, default sampling, no stops, raw output, no hooks. */
void dsv4_request_params_default(dsv4_request_params *p);

/* Validates and queues a request; *out gets the submitter's reference.  The
 * context check happens here: prompt + max_tokens > ctx is DSV4_SCHED_EINVAL
 * naming both lengths and the limit. */
int dsv4_sched_submit(dsv4_sched *s, const dsv4_request_params *p, dsv4_request **out, dsv4_err *err);

/* Asks the request to end (FINISHED with DSV4_FINISH_CANCELLED, unless it had
 * already finished).  Any thread, any time, idempotent. */
void dsv4_request_cancel(dsv4_request *r);

/* Drops the submitter's reference (cancelling first if not finished).  The
 * request must not be used afterwards.  NULL is a no-op. */
void dsv4_request_release(dsv4_request *r);

/* Prompt tokens after tokenization (known at submit). */
int dsv4_request_prompt_len(const dsv4_request *r);

/* ----- events ----- */
typedef enum {
    DSV4_EV_REASONING = 1, /* text: reasoning delta (valid UTF-8) */
    DSV4_EV_CONTENT,       /* text: content delta (valid UTF-8) */
    DSV4_EV_TOOL_CALL,     /* tool_index, tool_id, tool_name, text = the arguments JSON object */
    DSV4_EV_TOKEN,         /* sample: id, logprob, top logprobs; text = the token's raw bytes */
    DSV4_EV_PROGRESS,      /* prefill: progress_done of progress_total prompt tokens */
    DSV4_EV_FINISHED,      /* finish, message (errors), usage */
} dsv4_event_type;

typedef enum {
    DSV4_FINISH_STOP = 0,   /* EOS, a stop id or a stop string */
    DSV4_FINISH_LENGTH,     /* max_tokens or the context limit */
    DSV4_FINISH_TOOL_CALLS, /* the model called tools (CHAT output with parse_tools) */
    DSV4_FINISH_CANCELLED,  /* dsv4_request_cancel, release, or shutdown */
    DSV4_FINISH_ERROR,      /* message says why */
    DSV4_FINISH_COUNT
} dsv4_finish_reason;

/* "stop", "length", "tool_calls", "cancelled", "error" */
const char *dsv4_finish_reason_name(dsv4_finish_reason r);

typedef struct dsv4_usage {
    int64_t prompt_tokens;
    int64_t completion_tokens;
    int64_t cached_tokens; /* prompt tokens served from the prefix cache */
    uint64_t seed;         /* the sampler seed actually used */
    double queue_s;        /* submit -> admitted to a running slot */
    double ttft_s;         /* submit -> first generated token */
    double total_s;        /* submit -> finished */
    double decode_tps;     /* generated tokens after the first / time since the first; 0 if < 2 tokens */
    double prefill_tps;    /* prompt tokens actually computed / prefill time */
} dsv4_usage;

typedef struct dsv4_event {
    dsv4_event_type type;
    char *text; /* owned by the event (NUL-terminated); NULL if none */
    size_t len;
    /* TOOL_CALL */
    int tool_index;
    char tool_id[32];
    char *tool_name; /* owned */
    /* TOKEN */
    dsv4_sample sample;
    /* PROGRESS */
    int64_t progress_done, progress_total;
    /* FINISHED */
    dsv4_finish_reason finish;
    char *message; /* owned; error text for DSV4_FINISH_ERROR, else NULL */
    dsv4_usage usage;
} dsv4_event;

/* Pops the next event into *ev (the caller frees it with dsv4_event_clear).
 * Waits up to timeout_s seconds (< 0: forever; 0: poll).  Returns 1 with an
 * event, 0 on timeout, -1 once FINISHED has already been popped (no more). */
int dsv4_request_next_event(dsv4_request *r, dsv4_event *ev, double timeout_s);
void dsv4_event_clear(dsv4_event *ev);

/* ----- statistics (a consistent snapshot; any thread) ----- */
#define DSV4_SCHED_N_BUCKETS 14
/* Upper bounds in seconds of the latency histogram buckets (the last is +inf). */
extern const double dsv4_sched_latency_bounds[DSV4_SCHED_N_BUCKETS];

typedef struct dsv4_sched_histogram {
    uint64_t le[DSV4_SCHED_N_BUCKETS]; /* cumulative: observations <= bound (Prometheus style) */
    uint64_t count;
    double sum;
} dsv4_sched_histogram;

typedef struct dsv4_sched_stats {
    int queue_depth;    /* waiting requests */
    int running;        /* requests holding a sequence */
    int cached_seqs;    /* prefix cache entries */
    size_t state_bytes; /* state held by running and cached sequences */
    size_t cache_bytes; /* of which in the prefix cache */
    uint64_t submitted, rejected_busy;
    uint64_t prompt_tokens;  /* total prompt tokens of finished+running requests */
    uint64_t prefill_tokens; /* prompt tokens actually computed */
    uint64_t cached_tokens;  /* prompt tokens served from the prefix cache */
    uint64_t generated_tokens;
    uint64_t finished[DSV4_FINISH_COUNT];
    uint64_t iterations;       /* engine steps */
    dsv4_sched_histogram ttft; /* submit -> first token */
    dsv4_sched_histogram itl;  /* between consecutive tokens of one request */
} dsv4_sched_stats;

void dsv4_sched_get_stats(dsv4_sched *s, dsv4_sched_stats *out);

#endif
