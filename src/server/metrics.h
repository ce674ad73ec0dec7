/* server/metrics: the numbers an operator scrapes from GET /metrics.
 *
 * Owns: the HTTP-side counters (responses by status code, request durations)
 * and the Prometheus text rendering of those plus a scheduler stats snapshot
 * (queue depth, running sequences, state bytes, token counters, prefix-cache
 * hits, TTFT and inter-token latency histograms).  Format: Prometheus text
 * exposition 0.0.4 (# HELP / # TYPE lines, cumulative `le` buckets).
 *
 * Threads: record and render may be called from any thread at once (one
 * mutex).  Lifetime: _init / _free.  Nothing here fails except on
 * out-of-memory in the output buffer (its oom flag).
 */
#ifndef DSV4_SERVER_METRICS_H
#define DSV4_SERVER_METRICS_H

#include <pthread.h>
#include <stdint.h>

#include "engine/scheduler.h"
#include "text/chat.h"

#define DSV4_METRICS_MAX_CODES 24

typedef struct dsv4_metrics {
    pthread_mutex_t mu;
    int n_codes;
    int codes[DSV4_METRICS_MAX_CODES];
    uint64_t by_code[DSV4_METRICS_MAX_CODES];
    uint64_t other_codes;           /* codes beyond the table (never expected) */
    dsv4_sched_histogram duration;  /* request start -> response done, seconds */
    uint64_t disconnects;           /* clients that left before their answer was complete */
    double started;                 /* dsv4_now() at init */
} dsv4_metrics;

void dsv4_metrics_init(dsv4_metrics *m);
void dsv4_metrics_free(dsv4_metrics *m);

/* One finished HTTP request: its status and how long it took. */
void dsv4_metrics_record(dsv4_metrics *m, int status, double seconds, int disconnected);

/* Responses counted so far with this status (for tests). */
uint64_t dsv4_metrics_count(dsv4_metrics *m, int status);

/* Appends the whole exposition to OUT.  ST may be NULL (scheduler gone). */
void dsv4_metrics_render(dsv4_metrics *m, const dsv4_sched_stats *st, dsv4_chat_buf *out);

#endif
