/* server/http: the HTTP front of `dsv4 serve` (libmicrohttpd glue).
 *
 * Owns: a libmicrohttpd daemon in thread-per-connection mode, the routing
 * table (/v1/chat/completions, /v1/completions, /v1/messages, /v1/models, /health,
 * /metrics), API-key checking, request bodies (bounded), and the streaming of
 * scheduler events to clients as SSE.  HTTP threads only parse, submit to the
 * scheduler and stream (STYLE §14); the scheduler's engine thread alone runs
 * the model.  A client that disconnects is noticed while its handler waits
 * for events (the socket is polled for hang-up) and its request is cancelled,
 * which frees its sequence.
 *
 * Lifetime: dsv4_server_start .. dsv4_server_stop.  The scheduler and the
 * tokenizer are borrowed and must outlive the server; stop the server before
 * the scheduler.  Threads: start/stop from one controlling thread; the rest
 * runs on libmicrohttpd's threads.  Errors: start returns -1 naming the
 * address or option at fault.
 */
#ifndef DSV4_SERVER_HTTP_H
#define DSV4_SERVER_HTTP_H

#include <stddef.h>

#include "engine/scheduler.h"
#include "server/metrics.h"
#include "text/tokenizer.h"
#include "util/err.h"

typedef struct dsv4_server dsv4_server;

typedef struct dsv4_server_opts {
    const char *host;        /* numeric IPv4 or IPv6 address; default "127.0.0.1" */
    int port;                /* default 8000; 0 = any free port (read it back with dsv4_server_port) */
    const char *api_key;     /* NULL = no authentication; else "Authorization: Bearer KEY" or "x-api-key: KEY" on the /v1 routes */
    size_t max_body;         /* request bodies above this are 413; default 8 MiB */
    const char *model_id;    /* the name /v1/models lists and responses carry by default */
    const char *think_model; /* a model name that turns thinking on; default "deepseek-reasoner" */
    int max_connections;     /* concurrent connections (threads); default 256 */
    int retry_after_s;       /* Retry-After on 429; default 1 */
    int test_hooks;          /* 1: honour "dsv4_forced_output" in requests (tests only) */
} dsv4_server_opts;

void dsv4_server_opts_default(dsv4_server_opts *o);

int dsv4_server_start(dsv4_server **out, const dsv4_server_opts *o, dsv4_sched *sched, const dsv4_tokenizer *tok,
                      dsv4_err *err);

/* The bound TCP port. */
int dsv4_server_port(const dsv4_server *s);

/* Generation requests in flight (submitted and not yet answered). */
int dsv4_server_inflight(dsv4_server *s);

/* Graceful stop: closes the listening socket, answers new requests on open
 * connections with 503, waits up to grace_s seconds for requests in flight to
 * finish, cancels the rest, joins every connection thread and frees the
 * server.  The scheduler is left running (stop it afterwards).  NULL is a no-op. */
void dsv4_server_stop(dsv4_server *s, double grace_s);

#endif
