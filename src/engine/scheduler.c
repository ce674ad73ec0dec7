/* engine/scheduler: the engine thread, its queue and its prefix cache.
 * Contract in scheduler.h; the policy is explained in docs/SCHEDULER.md.
 *
 * Locks, in the only order they are ever taken:
 *   s->mu   the waiting queue, shutdown/flush flags, statistics;
 *   r->mu   one request's event queue, reference count and cancel flag.
 * The engine thread holds neither while it computes.  Everything reached only
 * from the engine thread (running slots, sequences, samplers, the prefix cache)
 * has no lock at all.
 */
#include "engine/scheduler.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "text/dsml.h"

const double dsv4_sched_latency_bounds[DSV4_SCHED_N_BUCKETS] = {
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, INFINITY};

const char *dsv4_finish_reason_name(dsv4_finish_reason r) {
    switch (r) {
    case DSV4_FINISH_STOP:
        return "stop";
    case DSV4_FINISH_LENGTH:
        return "length";
    case DSV4_FINISH_TOOL_CALLS:
        return "tool_calls";
    case DSV4_FINISH_CANCELLED:
        return "cancelled";
    case DSV4_FINISH_ERROR:
        return "error";
    default:
        return "unknown";
    }
}

/* ----- requests: what the submitter and the engine thread share ----- */
typedef struct ev_node {
    struct ev_node *next;
    dsv4_event ev;
} ev_node;

struct dsv4_request {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;            /* submitter + engine thread */
    atomic_int cancel;   /* set by any thread, read by the engine thread */
    int finished_queued; /* FINISHED is in (or went through) the event queue */
    int finished_popped;
    ev_node *head, *tail;

    /* fixed at submit */
    int32_t *prompt;
    int n_prompt;
    int max_tokens;
    dsv4_sampling_params sp;
    int32_t *bias_ids;
    float *bias_values;
    dsv4_stop stop;
    dsv4_output_mode output;
    dsv4_chat_mode start_mode;
    int parse_tools, want_tokens, want_progress;
    int32_t *forced;
    int n_forced;
    char client[64];
    dsv4_request_notify_fn notify;
    void *notify_user;
    double t_submit;
    struct dsv4_request *qnext; /* waiting queue link (under s->mu) */

    /* engine thread only */
    dsv4_seq *seq;
    int64_t fed;    /* prompt tokens in seq so far */
    int64_t cached; /* of which came from the prefix cache */
    int slot;
    int n_gen;
    int32_t *gen;    /* generated tokens (max_tokens) */
    int32_t pending; /* last sampled token, not yet in seq */
    int n_forced_used;
    dsv4_tok_stream ts;
    dsv4_dsml_parser *parser;
    int n_calls;
    char call_name[256];
    char call_id[32];
    int notify_pending;
    double t_admit, t_first, t_last, t_prefill0, prefill_s;
    int64_t computed; /* prompt tokens actually run */
    int done;         /* finished on the engine side */
};

static void ev_free_fields(dsv4_event *ev) {
    free(ev->text);
    free(ev->tool_name);
    free(ev->message);
    ev->text = ev->tool_name = ev->message = NULL;
}

void dsv4_event_clear(dsv4_event *ev) {
    if (!ev) return;
    ev_free_fields(ev);
    memset(ev, 0, sizeof *ev);
}

static void request_free(dsv4_request *r) {
    for (ev_node *n = r->head, *nx; n; n = nx) {
        nx = n->next;
        ev_free_fields(&n->ev);
        free(n);
    }
    free(r->prompt);
    free(r->bias_ids);
    free(r->bias_values);
    free(r->forced);
    free(r->gen);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

static void request_unref(dsv4_request *r) {
    pthread_mutex_lock(&r->mu);
    int left = --r->refs;
    pthread_mutex_unlock(&r->mu);
    if (left == 0) request_free(r);
}

void dsv4_request_cancel(dsv4_request *r) {
    if (r) atomic_store(&r->cancel, 1);
}

void dsv4_request_release(dsv4_request *r) {
    if (!r) return;
    dsv4_request_cancel(r);
    request_unref(r);
}

int dsv4_request_prompt_len(const dsv4_request *r) {
    return r->n_prompt;
}

/* Queues an event (ownership of its strings moves to the queue).  Returns -1
 * only if the node cannot be allocated; the fields are freed then. */
static int push_event(dsv4_request *r, dsv4_event *ev) {
    ev_node *n = malloc(sizeof *n);
    if (!n) {
        ev_free_fields(ev);
        return -1;
    }
    n->next = NULL;
    n->ev = *ev;
    pthread_mutex_lock(&r->mu);
    if (r->tail)
        r->tail->next = n;
    else
        r->head = n;
    r->tail = n;
    if (ev->type == DSV4_EV_FINISHED) r->finished_queued = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    r->notify_pending = 1;
    return 0;
}

int dsv4_request_next_event(dsv4_request *r, dsv4_event *ev, double timeout_s) {
    memset(ev, 0, sizeof *ev);
    struct timespec until;
    if (timeout_s > 0) {
        clock_gettime(CLOCK_REALTIME, &until);
        double whole = floor(timeout_s);
        until.tv_sec += (time_t)whole;
        until.tv_nsec += (long)((timeout_s - whole) * 1e9);
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&r->mu);
    for (;;) {
        if (r->head) {
            ev_node *n = r->head;
            r->head = n->next;
            if (!r->head) r->tail = NULL;
            if (n->ev.type == DSV4_EV_FINISHED) r->finished_popped = 1;
            pthread_mutex_unlock(&r->mu);
            *ev = n->ev;
            free(n);
            return 1;
        }
        if (r->finished_popped) {
            pthread_mutex_unlock(&r->mu);
            return -1;
        }
        if (timeout_s == 0) break;
        if (timeout_s < 0)
            pthread_cond_wait(&r->cv, &r->mu);
        else if (pthread_cond_timedwait(&r->cv, &r->mu, &until) == ETIMEDOUT)
            break;
    }
    pthread_mutex_unlock(&r->mu);
    return 0;
}

/* ----- the scheduler ----- */
typedef struct slot {
    dsv4_request *r; /* NULL = free */
    dsv4_sampler *sampler;
    float *logits; /* vocab floats */
} slot;

typedef struct cache_entry {
    dsv4_seq *seq;
    int32_t *tokens; /* the tokens seq holds */
    int64_t len;
    size_t bytes;
    uint64_t used; /* LRU clock */
} cache_entry;

struct dsv4_sched {
    dsv4_engine *e;
    const dsv4_tokenizer *tok;
    dsv4_sched_opts o;
    dsv4_engine_info info;
    int64_t ctx;
    pthread_t thread;
    int thread_started;
    int omp_threads; /* the starting thread's OpenMP thread count, carried over */

    pthread_mutex_t mu;
    pthread_cond_t cv;      /* wakes the engine thread */
    pthread_cond_t done_cv; /* flush completion */
    dsv4_request *q_head, *q_tail;
    int q_len;
    int n_held; /* slots held by admitted, unfinished requests (n_running as the submitters see it) */
    int stopping, cancel_all;
    uint64_t flush_req, flush_done;
    dsv4_sched_stats st;
    uint64_t seed_counter;

    /* engine thread only */
    slot *slots;
    int n_running;
    dsv4_request **order; /* running requests in admission order */
    cache_entry *cache;
    int n_cache;
    uint64_t lru_clock;
    dsv4_step_item *items;
    int *item_slot;
    char *text; /* scratch for decoded text + stop hold-back */
    size_t text_cap;
};

void dsv4_sched_opts_default(dsv4_sched_opts *o) {
    memset(o, 0, sizeof *o);
    o->max_seqs = 8;
    o->queue_cap = 64;
    o->prefill_chunk = 256;
    o->prefill_budget = 512;
    o->ctx = 0;
    o->cache_bytes = (size_t)1 << 30;
    o->cache_max_seqs = 64;
}

void dsv4_request_params_default(dsv4_request_params *p) {
    memset(p, 0, sizeof *p);
    dsv4_sampling_params_default(&p->sampling);
    p->output = DSV4_OUTPUT_RAW;
    p->start_mode = DSV4_CHAT_MODE_CHAT;
}

const dsv4_engine_info *dsv4_sched_engine_info(const dsv4_sched *s) {
    return &s->info;
}
int64_t dsv4_sched_ctx(const dsv4_sched *s) {
    return s->ctx;
}

static void hist_observe(dsv4_sched_histogram *h, double v) {
    for (int i = 0; i < DSV4_SCHED_N_BUCKETS; i++)
        if (v <= dsv4_sched_latency_bounds[i]) h->le[i]++;
    h->count++;
    h->sum += v;
}

void dsv4_sched_get_stats(dsv4_sched *s, dsv4_sched_stats *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    out->queue_depth = s->q_len;
    pthread_mutex_unlock(&s->mu);
}

/* Recomputes the gauges from the engine thread's own structures. */
static void update_gauges(dsv4_sched *s) {
    size_t run = 0, cache = 0;
    for (int i = 0; i < s->o.max_seqs; i++)
        if (s->slots[i].r && s->slots[i].r->seq) run += dsv4_seq_state_bytes(s->slots[i].r->seq);
    for (int i = 0; i < s->n_cache; i++)
        cache += s->cache[i].bytes;
    pthread_mutex_lock(&s->mu);
    s->st.running = s->n_running;
    s->st.cached_seqs = s->n_cache;
    s->st.cache_bytes = cache;
    s->st.state_bytes = run + cache;
    pthread_mutex_unlock(&s->mu);
}

/* ----- submit ----- */
static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

int dsv4_sched_submit(dsv4_sched *s, const dsv4_request_params *p, dsv4_request **out, dsv4_err *err) {
    *out = NULL;
    if (!p) return dsv4_errf(err, "request: no parameters"), DSV4_SCHED_EINVAL;
    dsv4_request *r = calloc(1, sizeof *r);
    if (!r) return dsv4_errf(err, "request: out of memory"), DSV4_SCHED_EINVAL;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->refs = 2;
    r->slot = -1;
    r->t_submit = dsv4_now();
    snprintf(r->client, sizeof r->client, "%s", p->client ? p->client : "-");

    /* the prompt */
    if (p->prompt_ids) {
        if (p->n_prompt < 1) goto empty;
        r->prompt = malloc(sizeof(int32_t) * (size_t)p->n_prompt);
        if (!r->prompt) goto oom;
        memcpy(r->prompt, p->prompt_ids, sizeof(int32_t) * (size_t)p->n_prompt);
        r->n_prompt = p->n_prompt;
    } else if (p->prompt_text) {
        dsv4_ids ids = {0};
        size_t len = p->prompt_text_len ? p->prompt_text_len : strlen(p->prompt_text);
        if (dsv4_tokenizer_encode(s->tok, p->prompt_text, len, p->text_flags, &ids, err)) {
            dsv4_err_prefix(err, "prompt");
            goto bad;
        }
        if (ids.len > (size_t)INT32_MAX / 2) {
            dsv4_ids_free(&ids);
            dsv4_errf(err, "prompt: %zu tokens is too long", ids.len);
            goto bad;
        }
        r->prompt = ids.ids;
        r->n_prompt = (int)ids.len;
        if (r->n_prompt < 1) goto empty;
    } else {
        goto empty;
    }
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= s->info.vocab_size) {
            dsv4_errf(err, "prompt: token %d (id %d) is outside the vocabulary [0, %d)", i, r->prompt[i],
                      s->info.vocab_size);
            goto bad;
        }

    /* the context limit */
    if (p->max_tokens < 0) {
        dsv4_errf(err, "max_tokens: %d is negative", p->max_tokens);
        goto bad;
    }
    if (r->n_prompt >= s->ctx) {
        dsv4_errf(err, "prompt: %d tokens leave no room in the context of %lld tokens", r->n_prompt,
                  (long long)s->ctx);
        goto bad;
    }
    if (p->max_tokens == 0)
        r->max_tokens = (int)(s->ctx - r->n_prompt);
    else if ((int64_t)r->n_prompt + p->max_tokens > s->ctx) {
        dsv4_errf(err, "prompt (%d tokens) + max_tokens (%d) = %lld exceeds the context limit of %lld tokens",
                  r->n_prompt, p->max_tokens, (long long)r->n_prompt + p->max_tokens, (long long)s->ctx);
        goto bad;
    } else
        r->max_tokens = p->max_tokens;
    r->gen = malloc(sizeof(int32_t) * (size_t)r->max_tokens);
    if (!r->gen) goto oom;

    /* sampling: validated now so the engine thread never fails on it */
    r->sp = p->sampling;
    if (dsv4_sampling_params_check(&r->sp, s->info.vocab_size, err)) {
        dsv4_err_prefix(err, "sampling");
        goto bad;
    }
    if (r->sp.n_logit_bias > 0) {
        r->bias_ids = malloc(sizeof(int32_t) * (size_t)r->sp.n_logit_bias);
        r->bias_values = malloc(sizeof(float) * (size_t)r->sp.n_logit_bias);
        if (!r->bias_ids || !r->bias_values) goto oom;
        memcpy(r->bias_ids, r->sp.logit_bias_ids, sizeof(int32_t) * (size_t)r->sp.n_logit_bias);
        memcpy(r->bias_values, r->sp.logit_bias_values, sizeof(float) * (size_t)r->sp.n_logit_bias);
        r->sp.logit_bias_ids = r->bias_ids;
        r->sp.logit_bias_values = r->bias_values;
    }
    if (!r->sp.has_seed) {
        pthread_mutex_lock(&s->mu);
        uint64_t c = ++s->seed_counter;
        pthread_mutex_unlock(&s->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        r->sp.seed = mix64(((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^ mix64(c));
        r->sp.has_seed = 1;
    }

    /* stops */
    if (p->n_stop < 0 || (p->n_stop > 0 && !p->stop)) {
        dsv4_errf(err, "stop: %d strings given without a list", p->n_stop);
        goto bad;
    }
    if (dsv4_stop_init(&r->stop, p->ignore_eos ? -1 : s->info.eos_id, p->stop, NULL, p->n_stop, 0, err)) {
        dsv4_err_prefix(err, "stop");
        goto bad;
    }
    for (int i = 0; i < p->n_stop_ids; i++) {
        if (!p->stop_ids || p->stop_ids[i] >= s->info.vocab_size) {
            dsv4_errf(err, "stop_token_ids[%d]: not a token id of this model (vocabulary %d)", i,
                      s->info.vocab_size);
            goto bad;
        }
        if (dsv4_stop_add_id(&r->stop, p->stop_ids[i], err)) {
            dsv4_err_prefix(err, "stop_token_ids[%d]", i);
            goto bad;
        }
    }

    if (p->output != DSV4_OUTPUT_RAW && p->output != DSV4_OUTPUT_CHAT) {
        dsv4_errf(err, "output: unknown mode %d", (int)p->output);
        goto bad;
    }
    if (p->start_mode != DSV4_CHAT_MODE_CHAT && p->start_mode != DSV4_CHAT_MODE_THINKING) {
        dsv4_errf(err, "thinking mode: unknown value %d", (int)p->start_mode);
        goto bad;
    }
    r->output = p->output;
    r->start_mode = p->start_mode;
    r->parse_tools = !!p->parse_tools;
    r->want_tokens = !!p->want_tokens;
    r->want_progress = !!p->want_progress;
    if (p->n_forced > 0) {
        if (!p->forced_ids) {
            dsv4_errf(err, "forced tokens: %d ids given without a list", p->n_forced);
            goto bad;
        }
        for (int i = 0; i < p->n_forced; i++)
            if (p->forced_ids[i] < 0 || p->forced_ids[i] >= s->info.vocab_size) {
                dsv4_errf(err, "forced tokens[%d]: id %d is outside the vocabulary", i, p->forced_ids[i]);
                goto bad;
            }
        r->forced = malloc(sizeof(int32_t) * (size_t)p->n_forced);
        if (!r->forced) goto oom;
        memcpy(r->forced, p->forced_ids, sizeof(int32_t) * (size_t)p->n_forced);
        r->n_forced = p->n_forced;
    }
    r->notify = p->notify;
    r->notify_user = p->notify_user;

    /* enqueue */
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        request_free(r);
        dsv4_errf(err, "the scheduler is shutting down");
        return DSV4_SCHED_ECLOSED;
    }
    /* the queue also holds requests the engine thread has not yet moved into free slots (it
     * may be busy with a step): only those beyond the free slots count against the capacity,
     * so a burst that fits the free slots is never refused */
    int free_slots = s->o.max_seqs - s->n_held;
    if (s->q_len - (free_slots > 0 ? free_slots : 0) >= s->o.queue_cap) {
        s->st.rejected_busy++;
        int q = s->q_len;
        pthread_mutex_unlock(&s->mu);
        request_free(r);
        dsv4_errf(err, "busy: %d requests are already waiting (queue capacity %d, %d free slots)", q, s->o.queue_cap,
                  free_slots);
        return DSV4_SCHED_EBUSY;
    }
    if (s->q_tail)
        s->q_tail->qnext = r;
    else
        s->q_head = r;
    s->q_tail = r;
    s->q_len++;
    s->st.submitted++;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    *out = r;
    return DSV4_SCHED_OK;

empty:
    dsv4_errf(err, "prompt: empty (at least one token is needed)");
    goto bad;
oom:
    dsv4_errf(err, "request: out of memory");
bad:
    request_free(r);
    return DSV4_SCHED_EINVAL;
}

/* ----- the prefix cache (engine thread) ----- */
static void cache_remove(dsv4_sched *s, int i) {
    dsv4_seq_free(s->cache[i].seq);
    free(s->cache[i].tokens);
    s->cache[i] = s->cache[--s->n_cache];
}

static void cache_clear(dsv4_sched *s) {
    while (s->n_cache)
        cache_remove(s, s->n_cache - 1);
}

static void cache_evict(dsv4_sched *s) {
    for (;;) {
        size_t total = 0;
        for (int i = 0; i < s->n_cache; i++)
            total += s->cache[i].bytes;
        if (s->n_cache == 0 || (s->n_cache <= s->o.cache_max_seqs && total <= s->o.cache_bytes)) return;
        int lru = 0;
        for (int i = 1; i < s->n_cache; i++)
            if (s->cache[i].used < s->cache[lru].used) lru = i;
        cache_remove(s, lru);
    }
}

static int64_t common_prefix(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
    int64_t n = na < nb ? na : nb, i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

/* Takes ownership of seq, which holds tokens[0..len). */
static void cache_insert(dsv4_sched *s, dsv4_seq *seq, const int32_t *tokens, int64_t len) {
    if (s->o.cache_off || s->o.cache_max_seqs == 0 || len < 1) {
        dsv4_seq_free(seq);
        return;
    }
    /* an entry whose tokens are a prefix of these is dominated by the new one */
    for (int i = 0; i < s->n_cache;) {
        if (s->cache[i].len <= len &&
            common_prefix(s->cache[i].tokens, s->cache[i].len, tokens, len) == s->cache[i].len)
            cache_remove(s, i);
        else
            i++;
    }
    int32_t *copy = malloc(sizeof(int32_t) * (size_t)len);
    if (!copy || s->n_cache >= s->o.cache_max_seqs + 1) {
        free(copy);
        dsv4_seq_free(seq);
        return;
    }
    memcpy(copy, tokens, sizeof(int32_t) * (size_t)len);
    s->cache[s->n_cache++] = (cache_entry){
        .seq = seq, .tokens = copy, .len = len, .bytes = dsv4_seq_state_bytes(seq), .used = ++s->lru_clock};
    cache_evict(s);
}

/* A sequence for the prompt of r, reusing the longest cached prefix (never the
 * whole prompt: the last token must run to give logits). */
static int cache_lookup(dsv4_sched *s, dsv4_request *r, dsv4_err *err) {
    int best = -1;
    int64_t best_len = 0, limit = r->n_prompt - 1;
    if (!s->o.cache_off)
        for (int i = 0; i < s->n_cache; i++) {
            int64_t l = common_prefix(s->cache[i].tokens, s->cache[i].len, r->prompt, limit);
            if (l > best_len) {
                best_len = l;
                best = i;
            }
        }
    if (best < 0) {
        r->cached = 0;
        return dsv4_seq_new(s->e, &r->seq, err);
    }
    cache_entry *ce = &s->cache[best];
    if (best_len == ce->len) {
        /* the prompt extends this conversation: take its sequence as it is */
        r->seq = ce->seq;
        ce->seq = NULL;
        free(ce->tokens);
        s->cache[best] = s->cache[--s->n_cache];
    } else {
        ce->used = ++s->lru_clock;
        if (dsv4_seq_clone(ce->seq, best_len, &r->seq, err)) return -1;
    }
    r->cached = best_len;
    return 0;
}

/* ----- output: tokens -> text -> events (engine thread) ----- */
static char *dup_n(const char *p, size_t n) {
    char *d = malloc(n + 1);
    if (!d) return NULL;
    if (n) memcpy(d, p, n);
    d[n] = 0;
    return d;
}

static void emit_text(dsv4_request *r, dsv4_event_type type, const char *p, size_t n) {
    if (n == 0) return;
    dsv4_event ev = {.type = type, .text = dup_n(p, n), .len = n};
    if (ev.text) push_event(r, &ev);
}

static void on_dsml(void *user, const dsv4_dsml_event *de) {
    dsv4_request *r = user;
    switch (de->type) {
    case DSV4_DSML_REASONING:
        emit_text(r, DSV4_EV_REASONING, de->text, de->len);
        break;
    case DSV4_DSML_CONTENT:
        emit_text(r, DSV4_EV_CONTENT, de->text, de->len);
        break;
    case DSV4_DSML_CALL_START:
        if (r->parse_tools) {
            snprintf(r->call_name, sizeof r->call_name, "%s", de->name ? de->name : "");
            snprintf(r->call_id, sizeof r->call_id, "%s", de->id ? de->id : "");
        } else
            emit_text(r, DSV4_EV_CONTENT, de->raw, de->raw_len);
        break;
    case DSV4_DSML_CALL_ARGS:
        if (r->parse_tools) {
            dsv4_event ev = {.type = DSV4_EV_TOOL_CALL,
                             .text = dup_n(de->text, de->len),
                             .len = de->len,
                             .tool_index = de->index,
                             .tool_name = dup_n(r->call_name, strlen(r->call_name))};
            snprintf(ev.tool_id, sizeof ev.tool_id, "%s", r->call_id);
            if (ev.text && ev.tool_name) {
                push_event(r, &ev);
                r->n_calls++;
            } else
                ev_free_fields(&ev);
        } else
            emit_text(r, DSV4_EV_CONTENT, de->raw, de->raw_len);
        break;
    case DSV4_DSML_MARKUP:
        /* without tool parsing, the tool block's tags stay in the content; the
         * reasoning close and the end-of-sentence tag never appear as text */
        if (!r->parse_tools && de->raw_len &&
            memmem(de->raw, de->raw_len, DSV4_CHAT_DSML, strlen(DSV4_CHAT_DSML)))
            emit_text(r, DSV4_EV_CONTENT, de->raw, de->raw_len);
        break;
    case DSV4_DSML_END:
        break;
    }
}

/* Passes text that survived the stop matcher to the output. */
static int output_text(dsv4_request *r, const char *p, size_t n, dsv4_err *err) {
    if (n == 0) return 0;
    if (r->output == DSV4_OUTPUT_RAW) {
        emit_text(r, DSV4_EV_CONTENT, p, n);
        return 0;
    }
    return dsv4_dsml_parser_feed(r->parser, p, n, err);
}

static int ensure_text(dsv4_sched *s, size_t n) {
    if (n <= s->text_cap) return 0;
    char *t = realloc(s->text, n);
    if (!t) return -1;
    s->text = t;
    s->text_cap = n;
    return 0;
}

/* Flushes the detokenizer, the stop matcher and the parser at the end. */
static void output_flush(dsv4_sched *s, dsv4_request *r) {
    dsv4_err err;
    dsv4_bytes b = {0};
    if (!r->stop.stopped) {
        if (!dsv4_tok_stream_finish(&r->ts, &b, &err) && b.len) {
            dsv4_stop_result res;
            if (!ensure_text(s, b.len + DSV4_STOP_MAX_LEN) &&
                !dsv4_stop_feed(&r->stop, b.data, b.len, s->text, s->text_cap, &res, &err))
                output_text(r, s->text, res.emit_len, &err);
        }
        if (!r->stop.stopped && !ensure_text(s, DSV4_STOP_MAX_LEN)) {
            long n = dsv4_stop_flush(&r->stop, s->text, s->text_cap, &err);
            if (n > 0) output_text(r, s->text, (size_t)n, &err);
        }
    }
    dsv4_bytes_free(&b);
    if (r->parser) dsv4_dsml_parser_finish(r->parser, &err);
}

/* ----- finishing (engine thread) ----- */
static void finish(dsv4_sched *s, dsv4_request *r, dsv4_finish_reason why, const char *msg) {
    if (r->done) return;
    r->done = 1;
    double now = dsv4_now();
    if (why != DSV4_FINISH_CANCELLED && why != DSV4_FINISH_ERROR) output_flush(s, r);
    if (why == DSV4_FINISH_STOP && r->parse_tools && r->n_calls > 0) why = DSV4_FINISH_TOOL_CALLS;
    if (r->parser) {
        dsv4_dsml_parser_free(r->parser);
        r->parser = NULL;
    }
    /* the sequence: a cleanly finished conversation goes to the prefix cache */
    if (r->seq) {
        if (why == DSV4_FINISH_CANCELLED || why == DSV4_FINISH_ERROR ||
            dsv4_seq_len(r->seq) != r->fed + r->n_gen - (r->n_gen > 0)) {
            dsv4_seq_free(r->seq);
        } else {
            int64_t len = dsv4_seq_len(r->seq);
            int32_t *toks = malloc(sizeof(int32_t) * (size_t)(len ? len : 1));
            if (toks) {
                memcpy(toks, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt);
                if (len > r->n_prompt)
                    memcpy(toks + r->n_prompt, r->gen, sizeof(int32_t) * (size_t)(len - r->n_prompt));
                cache_insert(s, r->seq, toks, len);
                free(toks);
            } else
                dsv4_seq_free(r->seq);
        }
        r->seq = NULL;
    }
    if (r->slot >= 0) {
        s->slots[r->slot].r = NULL;
        r->slot = -1;
        pthread_mutex_lock(&s->mu);
        s->n_held--;
        pthread_mutex_unlock(&s->mu);
        for (int i = 0; i < s->n_running; i++)
            if (s->order[i] == r) {
                memmove(s->order + i, s->order + i + 1, sizeof *s->order * (size_t)(s->n_running - i - 1));
                s->n_running--;
                break;
            }
    }
    dsv4_event ev = {.type = DSV4_EV_FINISHED, .finish = why};
    if (msg) ev.message = dup_n(msg, strlen(msg));
    ev.usage.prompt_tokens = r->n_prompt;
    ev.usage.completion_tokens = r->n_gen;
    ev.usage.cached_tokens = r->cached;
    ev.usage.seed = r->sp.seed;
    ev.usage.queue_s = r->t_admit > 0 ? r->t_admit - r->t_submit : now - r->t_submit;
    ev.usage.ttft_s = r->t_first > 0 ? r->t_first - r->t_submit : 0;
    ev.usage.total_s = now - r->t_submit;
    if (r->n_gen >= 2 && r->t_last > r->t_first)
        ev.usage.decode_tps = (r->n_gen - 1) / (r->t_last - r->t_first);
    if (r->prefill_s > 0) ev.usage.prefill_tps = (double)r->computed / r->prefill_s;
    pthread_mutex_lock(&s->mu);
    s->st.finished[why]++;
    pthread_mutex_unlock(&s->mu);
    update_gauges(s);
    dsv4_log(2, "request %s: %s, %d prompt (%lld cached) + %d generated tokens, ttft %.3f s, %.1f tok/s",
             r->client, dsv4_finish_reason_name(why), r->n_prompt, (long long)r->cached, r->n_gen,
             ev.usage.ttft_s, ev.usage.decode_tps);
    push_event(r, &ev);
    if (r->notify) r->notify(r->notify_user);
    r->notify_pending = 0;
    request_unref(r);
}

/* Handles a token just chosen for r.  Returns 1 if r finished. */
static int take_token(dsv4_sched *s, dsv4_request *r, const dsv4_sample *smp, double now) {
    dsv4_err err = {{0}};
    slot *sl = &s->slots[r->slot];
    int32_t id = smp->token;
    if (r->n_gen == 0) {
        r->t_first = now;
        pthread_mutex_lock(&s->mu);
        hist_observe(&s->st.ttft, now - r->t_submit);
        pthread_mutex_unlock(&s->mu);
    } else {
        pthread_mutex_lock(&s->mu);
        hist_observe(&s->st.itl, now - r->t_last);
        pthread_mutex_unlock(&s->mu);
    }
    r->t_last = now;
    r->gen[r->n_gen++] = id;
    pthread_mutex_lock(&s->mu);
    s->st.generated_tokens++;
    pthread_mutex_unlock(&s->mu);
    if (dsv4_sampler_accept(sl->sampler, id, &err)) return finish(s, r, DSV4_FINISH_ERROR, err.msg), 1;
    if (r->want_tokens) {
        size_t n = 0;
        const char *b = dsv4_tokenizer_id_bytes(s->tok, id, &n);
        dsv4_event ev = {
            .type = DSV4_EV_TOKEN, .sample = *smp, .text = dup_n(b ? b : "", b ? n : 0), .len = b ? n : 0};
        push_event(r, &ev);
    }
    if (dsv4_stop_is_stop_id(&r->stop, id)) return finish(s, r, DSV4_FINISH_STOP, NULL), 1;
    dsv4_bytes b = {0};
    if (dsv4_tok_stream_push(&r->ts, id, &b, &err)) {
        dsv4_bytes_free(&b);
        return finish(s, r, DSV4_FINISH_ERROR, err.msg), 1;
    }
    dsv4_stop_result res = {0};
    int rc = 0;
    if (b.len) {
        if (ensure_text(s, b.len + DSV4_STOP_MAX_LEN))
            rc = dsv4_errf(&err, "output: out of memory");
        else if (!(rc = dsv4_stop_feed(&r->stop, b.data, b.len, s->text, s->text_cap, &res, &err)))
            rc = output_text(r, s->text, res.emit_len, &err);
    }
    dsv4_bytes_free(&b);
    if (rc) return finish(s, r, DSV4_FINISH_ERROR, err.msg), 1;
    if (res.stopped) return finish(s, r, DSV4_FINISH_STOP, NULL), 1;
    if (r->n_gen >= r->max_tokens) return finish(s, r, DSV4_FINISH_LENGTH, NULL), 1;
    r->pending = id;
    return 0;
}

/* ----- admission (engine thread) ----- */
static void admit(dsv4_sched *s, dsv4_request *r) {
    dsv4_err err = {{0}};
    int si = 0;
    while (s->slots[si].r)
        si++;
    slot *sl = &s->slots[si];
    sl->r = r;
    r->slot = si;
    s->order[s->n_running++] = r;
    r->t_admit = dsv4_now();
    if (dsv4_sampler_reset(sl->sampler, &r->sp, &err) ||
        dsv4_sampler_add_prompt(sl->sampler, r->prompt, (size_t)r->n_prompt, &err)) {
        finish(s, r, DSV4_FINISH_ERROR, err.msg);
        return;
    }
    dsv4_tok_stream_init(&r->ts, s->tok, 0);
    if (r->output == DSV4_OUTPUT_CHAT &&
        dsv4_dsml_parser_init(&r->parser, r->start_mode, r->sp.seed, on_dsml, r, &err)) {
        finish(s, r, DSV4_FINISH_ERROR, err.msg);
        return;
    }
    if (cache_lookup(s, r, &err)) {
        dsv4_err_prefix(&err, "prefix reuse");
        finish(s, r, DSV4_FINISH_ERROR, err.msg);
        return;
    }
    r->fed = r->cached;
    pthread_mutex_lock(&s->mu);
    s->st.prompt_tokens += (uint64_t)r->n_prompt;
    s->st.cached_tokens += (uint64_t)r->cached;
    pthread_mutex_unlock(&s->mu);
    r->t_prefill0 = dsv4_now();
}

/* ----- one iteration: gather, step, sample ----- */
static void run_iteration(dsv4_sched *s) {
    int n = 0, budget = s->o.prefill_budget;
    for (int i = 0; i < s->n_running; i++) {
        dsv4_request *r = s->order[i];
        slot *sl = &s->slots[r->slot];
        if (r->fed < r->n_prompt) {
            int64_t left = r->n_prompt - r->fed;
            int chunk = (int)(left < s->o.prefill_chunk ? left : s->o.prefill_chunk);
            if (chunk > budget) chunk = budget;
            if (chunk <= 0) continue;
            budget -= chunk;
            s->items[n] = (dsv4_step_item){.seq = r->seq,
                                           .tokens = r->prompt + r->fed,
                                           .n = chunk,
                                           .logits = r->fed + chunk == r->n_prompt ? sl->logits : NULL};
        } else {
            s->items[n] =
                (dsv4_step_item){.seq = r->seq, .tokens = &r->pending, .n = 1, .logits = sl->logits};
        }
        s->item_slot[n++] = r->slot;
    }
    if (n == 0) return;
    dsv4_err err = {{0}};
    double t0 = dsv4_now();
    int rc = dsv4_engine_step(s->e, s->items, n, &err);
    int *failed = NULL;
    if (rc) {
        /* find the culprit: run the items one by one, end those that fail */
        failed = calloc((size_t)n, sizeof *failed);
        for (int k = 0; k < n; k++) {
            dsv4_err e1 = {{0}};
            if (dsv4_seq_append(s->items[k].seq, s->items[k].tokens, s->items[k].n, s->items[k].logits, 0,
                                &e1)) {
                dsv4_request *r = s->slots[s->item_slot[k]].r;
                if (failed) failed[k] = 1;
                finish(s, r, DSV4_FINISH_ERROR, e1.msg);
            }
        }
    }
    double now = dsv4_now();
    pthread_mutex_lock(&s->mu);
    s->st.iterations++;
    pthread_mutex_unlock(&s->mu);
    /* gauges first: a client that sees this step's events sees its state counted */
    update_gauges(s);
    for (int k = 0; k < n; k++) {
        if (failed && failed[k]) continue;
        dsv4_request *r = s->slots[s->item_slot[k]].r;
        if (!r) continue;
        slot *sl = &s->slots[r->slot];
        if (r->fed < r->n_prompt) {
            r->fed += s->items[k].n;
            r->computed += s->items[k].n;
            r->prefill_s += now - t0;
            pthread_mutex_lock(&s->mu);
            s->st.prefill_tokens += (uint64_t)s->items[k].n;
            pthread_mutex_unlock(&s->mu);
            if (r->want_progress) {
                dsv4_event ev = {
                    .type = DSV4_EV_PROGRESS, .progress_done = r->fed, .progress_total = r->n_prompt};
                push_event(r, &ev);
            }
            if (r->fed < r->n_prompt) continue;
        }
        if (atomic_load(&r->cancel)) continue; /* handled before the next step */
        dsv4_sample smp;
        memset(&smp, 0, sizeof smp);
        if (r->n_forced_used < r->n_forced) {
            smp.token = r->forced[r->n_forced_used++];
        } else if (dsv4_sampler_sample(sl->sampler, sl->logits, &smp, &err)) {
            finish(s, r, DSV4_FINISH_ERROR, err.msg);
            continue;
        }
        take_token(s, r, &smp, now);
    }
    free(failed);
    for (int i = 0; i < s->n_running; i++) {
        dsv4_request *r = s->order[i];
        if (r->notify_pending && r->notify) r->notify(r->notify_user);
        r->notify_pending = 0;
    }
    update_gauges(s);
}

/* ----- the engine thread ----- */
static void *engine_main(void *arg) {
    dsv4_sched *s = arg;
    /* OpenMP's thread count is per thread: the engine's --threads was set on
     * the thread that opened it, so carry it over to this one */
    omp_set_num_threads(s->omp_threads);
    for (;;) {
        pthread_mutex_lock(&s->mu);
        /* drop cancelled waiters; cancel everything at a hard shutdown */
        dsv4_request *cancelled = NULL, **pp = &s->q_head;
        s->q_tail = NULL;
        while (*pp) {
            dsv4_request *r = *pp;
            if (atomic_load(&r->cancel) || s->cancel_all) {
                *pp = r->qnext;
                r->qnext = cancelled;
                cancelled = r;
                s->q_len--;
            } else {
                s->q_tail = r;
                pp = &r->qnext;
            }
        }
        /* admit waiters into free slots */
        dsv4_request *admitted = NULL, **ap = &admitted;
        int free_slots = s->o.max_seqs - s->n_held;
        while (free_slots > 0 && s->q_head) {
            dsv4_request *r = s->q_head;
            s->q_head = r->qnext;
            if (!s->q_head) s->q_tail = NULL;
            s->q_len--;
            r->qnext = NULL;
            *ap = r;
            ap = &r->qnext;
            free_slots--;
            s->n_held++; /* admit() gives it a slot; finish() gives it back */
        }
        int flush = s->flush_req != s->flush_done;
        uint64_t flush_ticket = s->flush_req;
        int cancel_all = s->cancel_all;
        int idle = !cancelled && !admitted && s->n_running == 0 && !flush;
        if (idle && s->stopping) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        if (idle) {
            pthread_cond_wait(&s->cv, &s->mu);
            pthread_mutex_unlock(&s->mu);
            continue;
        }
        pthread_mutex_unlock(&s->mu);

        while (cancelled) {
            dsv4_request *r = cancelled;
            cancelled = r->qnext;
            finish(s, r, DSV4_FINISH_CANCELLED, NULL);
        }
        while (admitted) {
            dsv4_request *r = admitted;
            admitted = r->qnext;
            r->qnext = NULL;
            admit(s, r);
        }
        for (int i = 0; i < s->n_running;) {
            dsv4_request *r = s->order[i];
            if (cancel_all || atomic_load(&r->cancel))
                finish(s, r, DSV4_FINISH_CANCELLED, NULL);
            else
                i++;
        }
        if (flush) {
            cache_clear(s);
            update_gauges(s);
            pthread_mutex_lock(&s->mu);
            s->flush_done = flush_ticket;
            pthread_cond_broadcast(&s->done_cv);
            pthread_mutex_unlock(&s->mu);
        }
        run_iteration(s);
    }
    /* shutdown: nothing is running; free the cache */
    cache_clear(s);
    update_gauges(s);
    pthread_mutex_lock(&s->mu);
    s->flush_done = s->flush_req;
    pthread_cond_broadcast(&s->done_cv);
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

void dsv4_sched_flush_cache(dsv4_sched *s) {
    pthread_mutex_lock(&s->mu);
    if (!s->thread_started || s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    uint64_t ticket = ++s->flush_req;
    pthread_cond_signal(&s->cv);
    while (s->flush_done < ticket)
        pthread_cond_wait(&s->done_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

static void sched_free(dsv4_sched *s) {
    if (s->slots)
        for (int i = 0; i < s->o.max_seqs; i++) {
            dsv4_sampler_free(s->slots[i].sampler);
            dsv4_engine_host_free(s->e, s->slots[i].logits);
        }
    free(s->slots);
    free(s->order);
    free(s->cache);
    free(s->items);
    free(s->item_slot);
    free(s->text);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_cond_destroy(&s->done_cv);
    free(s);
}

int dsv4_sched_start(dsv4_sched **out, dsv4_engine *e, const dsv4_tokenizer *tok, const dsv4_sched_opts *opts,
                     dsv4_err *err) {
    *out = NULL;
    if (!e || !tok) return dsv4_errf(err, "scheduler: an engine and a tokenizer are needed");
    dsv4_sched *s = calloc(1, sizeof *s);
    if (!s) return dsv4_errf(err, "scheduler: out of memory");
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->done_cv, NULL);
    if (opts)
        s->o = *opts;
    else
        dsv4_sched_opts_default(&s->o);
    s->e = e;
    s->tok = tok;
    dsv4_engine_get_info(e, &s->info);
    const dsv4_sched_opts *o = &s->o;
    int rc = 0;
    if (o->max_seqs < 1 || o->max_seqs > 4096)
        rc = dsv4_errf(err, "max-seqs: %d is outside [1, 4096]", o->max_seqs);
    else if (o->queue_cap < 0 || o->queue_cap > 1 << 20)
        rc = dsv4_errf(err, "queue capacity: %d is outside [0, %d]", o->queue_cap, 1 << 20);
    else if (o->prefill_chunk < 1)
        rc = dsv4_errf(err, "prefill chunk: %d must be at least 1", o->prefill_chunk);
    else if (o->prefill_budget < 1)
        rc = dsv4_errf(err, "prefill budget: %d must be at least 1", o->prefill_budget);
    else if (o->ctx < 0 || o->ctx > s->info.max_position)
        rc = dsv4_errf(err, "ctx: %lld is outside [1, %lld] (the model's max_position_embeddings)",
                       (long long)o->ctx, (long long)s->info.max_position);
    else if (o->cache_max_seqs < 0 || o->cache_max_seqs > 1 << 16)
        rc = dsv4_errf(err, "prefix cache entries: %d is outside [0, 65536]", o->cache_max_seqs);
    if (rc) {
        sched_free(s);
        return -1;
    }
    s->ctx = o->ctx ? o->ctx : s->info.max_position;
    if (s->ctx > INT32_MAX / 2) s->ctx = INT32_MAX / 2;
    s->slots = calloc((size_t)o->max_seqs, sizeof *s->slots);
    s->order = calloc((size_t)o->max_seqs, sizeof *s->order);
    s->cache = calloc((size_t)o->cache_max_seqs + 1, sizeof *s->cache);
    s->items = calloc((size_t)o->max_seqs, sizeof *s->items);
    s->item_slot = calloc((size_t)o->max_seqs, sizeof *s->item_slot);
    if (!s->slots || !s->order || !s->cache || !s->items || !s->item_slot) {
        sched_free(s);
        return dsv4_errf(err, "scheduler: out of memory");
    }
    for (int i = 0; i < o->max_seqs; i++) {
        /* pinned on a device backend: the logits' download is then one DMA (engine.h) */
        s->slots[i].logits = dsv4_engine_host_alloc(s->e, sizeof(float) * (size_t)s->info.vocab_size);
        if (!s->slots[i].logits) {
            sched_free(s);
            return dsv4_errf(err, "scheduler: out of memory for %d logits rows", o->max_seqs);
        }
        if (dsv4_sampler_init(&s->slots[i].sampler, s->info.vocab_size, NULL, err)) {
            sched_free(s);
            return -1;
        }
    }
    s->omp_threads = omp_get_max_threads();
    if (pthread_create(&s->thread, NULL, engine_main, s)) {
        sched_free(s);
        return dsv4_errf(err, "scheduler: cannot start the engine thread: %s", strerror(errno));
    }
    s->thread_started = 1;
    *out = s;
    return 0;
}

void dsv4_sched_stop(dsv4_sched *s, int cancel_inflight) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    if (cancel_inflight) s->cancel_all = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->thread_started) pthread_join(s->thread, NULL);
    sched_free(s);
}
