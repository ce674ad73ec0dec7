/* server/metrics: Prometheus text for GET /metrics.  See metrics.h. */
#include "server/metrics.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "util/err.h"

/* Request durations span milliseconds (errors, /health) to minutes (long
 * generations on the CPU), so their buckets reach further than the
 * scheduler's latency buckets. */
static const double DURATION_BOUNDS[DSV4_SCHED_N_BUCKETS] = {0.005, 0.025, 0.1, 0.25, 0.5, 1,   2.5,
                                                             5,     10,    20,  40,   80,  160, INFINITY};

void dsv4_metrics_init(dsv4_metrics *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    m->started = dsv4_now();
}

void dsv4_metrics_free(dsv4_metrics *m) { pthread_mutex_destroy(&m->mu); }

void dsv4_metrics_record(dsv4_metrics *m, int status, double seconds, int disconnected) {
    pthread_mutex_lock(&m->mu);
    int i = 0;
    while (i < m->n_codes && m->codes[i] != status) i++;
    if (i == m->n_codes && m->n_codes < DSV4_METRICS_MAX_CODES) {
        /* keep the table sorted so the output is stable */
        int j = m->n_codes++;
        while (j > 0 && m->codes[j - 1] > status) {
            m->codes[j] = m->codes[j - 1];
            m->by_code[j] = m->by_code[j - 1];
            j--;
        }
        m->codes[j] = status;
        m->by_code[j] = 0;
        i = j;
    }
    if (i < m->n_codes) m->by_code[i]++;
    else m->other_codes++;
    if (!(seconds >= 0)) seconds = 0;
    for (int b = 0; b < DSV4_SCHED_N_BUCKETS; b++)
        if (seconds <= DURATION_BOUNDS[b]) m->duration.le[b]++;
    m->duration.count++;
    m->duration.sum += seconds;
    if (disconnected) m->disconnects++;
    pthread_mutex_unlock(&m->mu);
}

uint64_t dsv4_metrics_count(dsv4_metrics *m, int status) {
    pthread_mutex_lock(&m->mu);
    uint64_t n = 0;
    for (int i = 0; i < m->n_codes; i++)
        if (m->codes[i] == status) n = m->by_code[i];
    pthread_mutex_unlock(&m->mu);
    return n;
}

/* ----- rendering ----- */


static void family(dsv4_chat_buf *b, const char *name, const char *type, const char *help) {
    dsv4_chat_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void scalar(dsv4_chat_buf *b, const char *name, const char *type, const char *help, double v) {
    family(b, name, type, help);
    dsv4_chat_buf_printf(b, "%s %.17g\n", name, v);
}

static void bound(char *s, size_t n, double v) {
    if (isinf(v)) snprintf(s, n, "+Inf");
    else snprintf(s, n, "%g", v);
}

static void histogram(dsv4_chat_buf *b, const char *name, const char *help, const dsv4_sched_histogram *h,
                      const double *bounds) {
    family(b, name, "histogram", help);
    for (int i = 0; i < DSV4_SCHED_N_BUCKETS; i++) {
        char le[32];
        bound(le, sizeof le, bounds[i]);
        if (isinf(bounds[i])) continue; /* +Inf is written from count below */
        dsv4_chat_buf_printf(b, "%s_bucket{le=\"%s\"} %" PRIu64 "\n", name, le, h->le[i]);
    }
    dsv4_chat_buf_printf(b, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name, h->count);
    dsv4_chat_buf_printf(b, "%s_sum %.9g\n%s_count %" PRIu64 "\n", name, h->sum, name, h->count);
}

void dsv4_metrics_render(dsv4_metrics *m, const dsv4_sched_stats *st, dsv4_chat_buf *b) {
    pthread_mutex_lock(&m->mu);
    family(b, "dsv4_http_requests_total", "counter", "HTTP responses by status code.");
    for (int i = 0; i < m->n_codes; i++)
        dsv4_chat_buf_printf(b, "dsv4_http_requests_total{status=\"%d\"} %" PRIu64 "\n", m->codes[i], m->by_code[i]);
    if (m->other_codes) dsv4_chat_buf_printf(b, "dsv4_http_requests_total{status=\"other\"} %" PRIu64 "\n", m->other_codes);
    histogram(b, "dsv4_http_request_duration_seconds", "Time from request to the end of its response.",
              &m->duration, DURATION_BOUNDS);
    scalar(b, "dsv4_client_disconnects_total", "counter", "Clients that left before their response was complete.",
           (double)m->disconnects);
    scalar(b, "dsv4_uptime_seconds", "gauge", "Seconds since the server started.", dsv4_now() - m->started);
    pthread_mutex_unlock(&m->mu);
    if (!st) return;

    scalar(b, "dsv4_queue_depth", "gauge", "Requests waiting for a running slot.", st->queue_depth);
    scalar(b, "dsv4_running_sequences", "gauge", "Requests holding a sequence on the engine thread.", st->running);
    scalar(b, "dsv4_state_memory_bytes", "gauge",
           "Sequence state (KV, window rings, compressor and indexer rows) held by running and cached sequences.",
           (double)st->state_bytes);
    scalar(b, "dsv4_prefix_cache_bytes", "gauge", "Of dsv4_state_memory_bytes, the part in the prefix cache.",
           (double)st->cache_bytes);
    scalar(b, "dsv4_prefix_cache_sequences", "gauge", "Sequences kept in the prefix cache.", st->cached_seqs);
    scalar(b, "dsv4_requests_submitted_total", "counter", "Requests accepted by the scheduler.",
           (double)st->submitted);
    scalar(b, "dsv4_requests_rejected_busy_total", "counter", "Requests refused because the queue was full (429).",
           (double)st->rejected_busy);
    family(b, "dsv4_requests_finished_total", "counter", "Finished requests by finish reason.");
    for (int f = 0; f < DSV4_FINISH_COUNT; f++)
        dsv4_chat_buf_printf(b, "dsv4_requests_finished_total{reason=\"%s\"} %" PRIu64 "\n",
             dsv4_finish_reason_name((dsv4_finish_reason)f), st->finished[f]);
    scalar(b, "dsv4_prompt_tokens_total", "counter", "Prompt tokens of all requests.", (double)st->prompt_tokens);
    scalar(b, "dsv4_prefill_tokens_total", "counter", "Prompt tokens actually computed (not served from the cache).",
           (double)st->prefill_tokens);
    scalar(b, "dsv4_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
           (double)st->cached_tokens);
    scalar(b, "dsv4_generation_tokens_total", "counter", "Generated tokens.", (double)st->generated_tokens);
    scalar(b, "dsv4_engine_steps_total", "counter", "Batched engine steps.", (double)st->iterations);
    histogram(b, "dsv4_time_to_first_token_seconds", "Time from submission to the first generated token.",
              &st->ttft, dsv4_sched_latency_bounds);
    histogram(b, "dsv4_inter_token_latency_seconds", "Time between consecutive generated tokens of one request.",
              &st->itl, dsv4_sched_latency_bounds);
}
