/* server/http: libmicrohttpd glue, routing and SSE streaming.  See http.h. */
#include "server/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "server/api_anthropic.h"
#include "server/api_openai.h"

/* How often a waiting handler looks at its socket for a hang-up. */
#define WAIT_SLICE_S 0.1

typedef enum { R_NONE, R_CHAT, R_COMPLETIONS, R_MESSAGES, R_MODELS, R_MODEL, R_HEALTH, R_METRICS } route_id;

#define IS_GENERATION(r) ((r) == R_CHAT || (r) == R_COMPLETIONS || (r) == R_MESSAGES)

typedef struct conn conn;

struct dsv4_server {
    struct MHD_Daemon *d;
    dsv4_server_opts o;
    char host[64], model_id[128], think_model[128], api_key[256];
    dsv4_sched *sched;
    const dsv4_tokenizer *tok;
    dsv4_api_limits lim;
    dsv4_metrics metrics;
    int port;
    atomic_int closing;
    atomic_ullong next_id;
    unsigned long long id_salt;
    long long started;
    /* connections with a request in the scheduler, so stop can cancel them */
    pthread_mutex_t mu;
    conn *active;
    int n_active;
};

struct conn {
    dsv4_server *srv;
    struct MHD_Connection *mc;
    route_id route;
    char method[8];
    char url[96];
    double t0;
    char *body;
    size_t len, cap;
    int too_large;
    int status;
    int disconnected;
    /* generation */
    dsv4_request *req;
    conn *next, *prev;
    int linked;
    dsv4_api_request ar;
    dsv4_api_reply rp;
    int stream, include_usage;
    int finished;
    dsv4_finish_reason finish;
    dsv4_usage usage;
    int prompt_tokens;
    /* streaming */
    dsv4_chat_buf out;
    size_t out_off;
    int sent_done;
    dsv4_sample *pend;
    size_t n_pend, cap_pend;
    /* Anthropic's /v1/messages: its reply and error shapes, its stream state,
     * and the text of the generated tokens (to name a matched stop sequence) */
    int anth;
    dsv4_anth_stream ast;
    dsv4_chat_buf raw;
};

/* ------------------------------------------------------------------------- */
/* Responses                                                                  */
/* ------------------------------------------------------------------------- */

static enum MHD_Result reply(conn *c, int status, const char *ctype, const char *data, size_t len) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, (void *)data, MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", ctype);
    if (status == 429) {
        char ra[16];
        snprintf(ra, sizeof ra, "%d", c->srv->o.retry_after_s);
        MHD_add_response_header(r, "Retry-After", ra);
    }
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    if (status == 405) {
        const char *allow = IS_GENERATION(c->route) ? "POST" : "GET";
        MHD_add_response_header(r, "Allow", allow);
    }
    c->status = status;
    enum MHD_Result rc = MHD_queue_response(c->mc, (unsigned)status, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result reply_buf(conn *c, int status, dsv4_chat_buf *b) {
    if (b->oom) {
        dsv4_chat_buf_free(b);
        static const char OOM[] =
            "{\"error\":{\"message\":\"out of memory building the response\",\"type\":\"server_error\","
            "\"param\":null,\"code\":null}}";
        return reply(c, 500, "application/json", OOM, sizeof OOM - 1);
    }
    enum MHD_Result rc = reply(c, status, "application/json", b->data ? b->data : "", b->len);
    dsv4_chat_buf_free(b);
    return rc;
}

static enum MHD_Result reply_error(conn *c, const dsv4_api_error *e) {
    dsv4_chat_buf b = {0};
    if (c->anth) dsv4_anth_error_json(&b, e);
    else dsv4_api_error_json(&b, e);
    return reply_buf(c, e->status, &b);
}

static enum MHD_Result fail(conn *c, int status, const char *type, const char *param, const char *code,
                            const char *msg) {
    dsv4_api_error e;
    dsv4_api_errorf(&e, status, type, param, code, "%s", msg);
    return reply_error(c, &e);
}

/* ------------------------------------------------------------------------- */
/* Tracking requests in flight                                                */
/* ------------------------------------------------------------------------- */

static void link_conn(conn *c) {
    dsv4_server *s = c->srv;
    pthread_mutex_lock(&s->mu);
    c->prev = NULL;
    c->next = s->active;
    if (s->active) s->active->prev = c;
    s->active = c;
    s->n_active++;
    c->linked = 1;
    pthread_mutex_unlock(&s->mu);
}

/* Unlinks and drops the request (release cancels it if it is still running). */
static void drop_request(conn *c) {
    dsv4_server *s = c->srv;
    if (c->linked) {
        pthread_mutex_lock(&s->mu);
        if (c->prev) c->prev->next = c->next;
        else s->active = c->next;
        if (c->next) c->next->prev = c->prev;
        s->n_active--;
        c->linked = 0;
        pthread_mutex_unlock(&s->mu);
    }
    dsv4_request_release(c->req);
    c->req = NULL;
}

int dsv4_server_inflight(dsv4_server *s) {
    pthread_mutex_lock(&s->mu);
    int n = s->n_active;
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* 1 when the client has hung up: its socket reports hang-up or EOF. */
static int client_gone(conn *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c->mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return 0;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return 0;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return 1;
    if (p.revents & POLLIN) {
        char ch;
        ssize_t n = recv(ci->connect_fd, &ch, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0) return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Streaming                                                                  */
/* ------------------------------------------------------------------------- */

static void pend_push(conn *c, const dsv4_sample *s) {
    if (c->n_pend == c->cap_pend) {
        size_t cap = c->cap_pend ? c->cap_pend * 2 : 16;
        dsv4_sample *p = realloc(c->pend, cap * sizeof *p);
        if (!p) return; /* logprobs of this token are lost; the text is not */
        c->pend = p;
        c->cap_pend = cap;
    }
    c->pend[c->n_pend++] = *s;
}

/* Turns one event into SSE chunks in c->out. */
static void raw_token(conn *c, const dsv4_event *ev) {
    size_t n = 0;
    const char *s = dsv4_tokenizer_id_bytes(c->srv->tok, ev->sample.token, &n);
    if (s) dsv4_chat_buf_put(&c->raw, s, n);
}

/* Anthropic's events for one scheduler event. */
static void stream_event_anth(conn *c, const dsv4_event *ev) {
    switch (ev->type) {
    case DSV4_EV_REASONING:
    case DSV4_EV_CONTENT:
        if (ev->len) dsv4_anth_sse_text(&c->out, &c->ast, ev->type == DSV4_EV_REASONING, ev->text, ev->len);
        break;
    case DSV4_EV_TOOL_CALL:
        dsv4_anth_sse_tool_use(&c->out, &c->ast, ev->tool_id, ev->tool_name ? ev->tool_name : "", ev->text,
                               ev->text ? ev->len : 0);
        break;
    case DSV4_EV_TOKEN: raw_token(c, ev); break;
    case DSV4_EV_FINISHED:
        c->finished = 1;
        c->finish = ev->finish;
        c->usage = ev->usage;
        if (ev->finish == DSV4_FINISH_ERROR || ev->finish == DSV4_FINISH_CANCELLED) {
            dsv4_api_error e;
            if (ev->finish == DSV4_FINISH_ERROR)
                dsv4_api_errorf(&e, 500, "server_error", NULL, NULL, "generation failed: %s",
                                ev->message ? ev->message : "unknown error");
            else
                dsv4_api_errorf(&e, 503, "server_error", NULL, NULL, "the request was cancelled (server shutting down)");
            dsv4_anth_sse_error(&c->out, &e);
        } else {
            const char *seq = dsv4_anth_matched_stop(&c->ar, c->raw.data, c->raw.len);
            dsv4_anth_sse_finish(&c->out, &c->ast, ev->finish, seq, &c->usage);
        }
        c->sent_done = 1;
        break;
    default: break;
    }
}

static void stream_event(conn *c, const dsv4_event *ev) {
    if (c->anth) {
        stream_event_anth(c, ev);
        return;
    }
    switch (ev->type) {
    case DSV4_EV_REASONING:
    case DSV4_EV_CONTENT:
        if (!ev->len) break;
        dsv4_api_sse_text(&c->out, &c->rp, ev->type == DSV4_EV_REASONING, ev->text, ev->len, c->pend, c->n_pend);
        c->n_pend = 0;
        break;
    case DSV4_EV_TOOL_CALL:
        dsv4_api_sse_tool_call(&c->out, &c->rp, ev->tool_index, ev->tool_id, ev->tool_name ? ev->tool_name : "",
                               ev->text, ev->text ? ev->len : 0);
        break;
    case DSV4_EV_TOKEN:
        if (c->rp.logprobs) pend_push(c, &ev->sample);
        break;
    case DSV4_EV_FINISHED:
        c->finished = 1;
        c->finish = ev->finish;
        c->usage = ev->usage;
        if (ev->finish == DSV4_FINISH_ERROR || (ev->finish == DSV4_FINISH_CANCELLED && atomic_load(&c->srv->closing))) {
            dsv4_api_error e;
            if (ev->finish == DSV4_FINISH_ERROR)
                dsv4_api_errorf(&e, 500, "server_error", NULL, NULL, "generation failed: %s",
                                ev->message ? ev->message : "unknown error");
            else
                dsv4_api_errorf(&e, 503, "server_error", NULL, NULL, "the server is shutting down");
            dsv4_api_sse_error(&c->out, &e);
        } else {
            dsv4_api_sse_finish(&c->out, &c->rp, ev->finish, c->pend, c->n_pend);
        }
        c->n_pend = 0;
        if (c->include_usage) dsv4_api_sse_usage(&c->out, &c->rp, &c->usage);
        dsv4_api_sse_done(&c->out);
        c->sent_done = 1;
        break;
    default: break;
    }
}

/* libmicrohttpd pulls the SSE body from here.  In thread-per-connection mode
 * the callback may block: it waits for the next events in slices, looking at
 * the socket between them so a vanished client is cancelled promptly. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    conn *c = cls;
    for (;;) {
        if (c->out_off < c->out.len) {
            size_t n = c->out.len - c->out_off;
            if (n > max) n = max;
            memcpy(buf, c->out.data + c->out_off, n);
            c->out_off += n;
            if (c->out_off == c->out.len) c->out_off = c->out.len = 0;
            return (ssize_t)n;
        }
        if (c->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (c->sent_done) return MHD_CONTENT_READER_END_OF_STREAM;
        if (!c->req) return MHD_CONTENT_READER_END_WITH_ERROR;
        dsv4_event ev;
        int rc = dsv4_request_next_event(c->req, &ev, WAIT_SLICE_S);
        if (rc < 0) { /* finished already popped: cannot happen before sent_done */
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (rc == 0) {
            if (client_gone(c)) {
                c->disconnected = 1;
                dsv4_request_cancel(c->req);
                return MHD_CONTENT_READER_END_WITH_ERROR;
            }
            continue;
        }
        stream_event(c, &ev);
        dsv4_event_clear(&ev);
        /* batch what is already queued into this write */
        while (!c->sent_done && c->out.len < 65536 && dsv4_request_next_event(c->req, &ev, 0) == 1) {
            stream_event(c, &ev);
            dsv4_event_clear(&ev);
        }
    }
}

/* ------------------------------------------------------------------------- */
/* Generation endpoints                                                       */
/* ------------------------------------------------------------------------- */

static void make_id(dsv4_server *s, dsv4_api_kind kind, char *out, size_t n) {
    unsigned long long k = atomic_fetch_add(&s->next_id, 1);
    /* a counter mixed with a per-process salt: unique here, unguessable enough for logs */
    unsigned long long x = (k + 1) * 0x9E3779B97F4A7C15ull ^ s->id_salt;
    snprintf(out, n, "%s%016llx%08llx", kind == DSV4_API_CHAT ? "chatcmpl-" : kind == DSV4_API_COMPLETIONS ? "cmpl-" : "msg_",
             x, k & 0xffffffffull);
}

/* KIND is the endpoint's request format: chat or completions; c->anth marks
 * /v1/messages, which is parsed into a chat request. */
static enum MHD_Result generate(conn *c, dsv4_api_kind kind) {
    dsv4_server *s = c->srv;
    dsv4_api_error e;
    make_id(s, c->anth ? (dsv4_api_kind)0 : kind, c->rp.id, sizeof c->rp.id);
    int prc = c->anth ? dsv4_anth_parse(c->body, c->len, &s->lim, &c->ar, &e)
                      : dsv4_api_parse(kind, c->body, c->len, &s->lim, &c->ar, &e);
    if (prc < 0) return reply_error(c, &e);
    if (dsv4_api_prepare(&c->ar, s->tok, &s->lim, &e) < 0) return reply_error(c, &e);
    c->prompt_tokens = c->ar.n_prompt_ids;
    if (atomic_load(&s->closing)) return fail(c, 503, "server_error", NULL, NULL, "the server is shutting down");

    dsv4_request_params p;
    dsv4_request_params_default(&p);
    p.prompt_ids = c->ar.prompt_ids;
    p.n_prompt = c->ar.n_prompt_ids;
    p.sampling = c->ar.sampling;
    p.max_tokens = c->ar.max_tokens;
    p.stop = (const char *const *)c->ar.stop;
    p.n_stop = c->ar.n_stop;
    p.stop_ids = c->ar.stop_ids;
    p.n_stop_ids = c->ar.n_stop_ids;
    p.ignore_eos = c->ar.ignore_eos;
    p.output = kind == DSV4_API_CHAT ? DSV4_OUTPUT_CHAT : DSV4_OUTPUT_RAW;
    p.start_mode = c->ar.opens_thinking ? DSV4_CHAT_MODE_THINKING : DSV4_CHAT_MODE_CHAT;
    p.parse_tools = c->ar.parse_tools;
    p.want_tokens = c->ar.logprobs || (c->anth && c->ar.n_stop > 0);
    p.client = c->rp.id;
    p.forced_ids = c->ar.forced_ids;
    p.n_forced = c->ar.n_forced;

    dsv4_err err;
    int rc = dsv4_sched_submit(s->sched, &p, &c->req, &err);
    if (rc == DSV4_SCHED_EBUSY)
        return fail(c, 429, "rate_limit_error", NULL, "queue_full", "the server is busy (request queue full); retry later");
    if (rc == DSV4_SCHED_ECLOSED) return fail(c, 503, "server_error", NULL, NULL, "the server is shutting down");
    if (rc != DSV4_SCHED_OK) {
        c->req = NULL;
        return fail(c, 400, "invalid_request_error", NULL, NULL, err.msg);
    }
    link_conn(c);

    c->rp.kind = kind;
    c->rp.created = (long long)time(NULL);
    snprintf(c->rp.model, sizeof c->rp.model, "%s", c->ar.model);
    c->rp.tok = s->tok;
    c->rp.logprobs = c->ar.logprobs;
    c->rp.top_logprobs = c->ar.top_logprobs;
    c->stream = c->ar.stream;
    c->include_usage = c->ar.include_usage;

    if (c->stream) {
        if (c->anth) dsv4_anth_sse_start(&c->out, &c->ast, &c->rp, c->prompt_tokens);
        else dsv4_api_sse_role(&c->out, &c->rp);
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, c, NULL);
        if (!r) return MHD_NO;
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        c->status = 200;
        enum MHD_Result q = MHD_queue_response(c->mc, 200, r);
        MHD_destroy_response(r);
        return q;
    }

    /* whole response: wait here (this is the connection's own thread) */
    dsv4_api_result res = {0};
    while (!res.finished) {
        dsv4_event ev;
        int g = dsv4_request_next_event(c->req, &ev, WAIT_SLICE_S);
        if (g < 0) break;
        if (g == 0) {
            if (client_gone(c)) {
                c->disconnected = 1;
                dsv4_request_cancel(c->req);
                dsv4_api_result_free(&res);
                c->status = 499; /* nginx's "client closed request", for the log and metrics */
                return MHD_NO;
            }
            continue;
        }
        if (c->anth && ev.type == DSV4_EV_TOKEN) raw_token(c, &ev);
        dsv4_api_result_add(&res, &ev, c->rp.logprobs);
        dsv4_event_clear(&ev);
    }
    c->finished = res.finished;
    c->finish = res.finish;
    c->usage = res.usage;
    enum MHD_Result q;
    if (!res.finished || res.finish == DSV4_FINISH_ERROR) {
        char msg[DSV4_ERR_MAX];
        snprintf(msg, sizeof msg, "generation failed: %s", res.message ? res.message : "no result");
        q = fail(c, 500, "server_error", NULL, NULL, msg);
    } else if (res.finish == DSV4_FINISH_CANCELLED) {
        q = fail(c, 503, "server_error", NULL, NULL, "the request was cancelled (server shutting down)");
    } else if (res.oom) {
        q = fail(c, 500, "server_error", NULL, NULL, "out of memory collecting the response");
    } else {
        dsv4_chat_buf b = {0};
        if (c->anth)
            dsv4_anth_response_json(&b, &c->rp, &res, dsv4_anth_matched_stop(&c->ar, c->raw.data, c->raw.len));
        else dsv4_api_response_json(&b, &c->rp, &res);
        q = reply_buf(c, 200, &b);
    }
    dsv4_api_result_free(&res);
    return q;
}

/* ------------------------------------------------------------------------- */
/* Other endpoints                                                            */
/* ------------------------------------------------------------------------- */

static void put_model(dsv4_chat_buf *b, const dsv4_server *s, const char *id) {
    dsv4_chat_buf_puts(b, "{\"id\":");
    dsv4_api_json_string(b, id, strlen(id));
    char tail[128];
    snprintf(tail, sizeof tail, ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"dsv4\"", s->started);
    dsv4_chat_buf_puts(b, tail);
    snprintf(tail, sizeof tail, ",\"max_model_len\":%" PRId64 "}", s->lim.ctx);
    dsv4_chat_buf_puts(b, tail);
}

static enum MHD_Result models(conn *c) {
    dsv4_server *s = c->srv;
    dsv4_chat_buf b = {0};
    dsv4_chat_buf_puts(&b, "{\"object\":\"list\",\"data\":[");
    put_model(&b, s, s->model_id);
    if (s->think_model[0] && strcmp(s->think_model, s->model_id)) {
        dsv4_chat_buf_puts(&b, ",");
        put_model(&b, s, s->think_model);
    }
    dsv4_chat_buf_puts(&b, "]}");
    return reply_buf(c, 200, &b);
}

static enum MHD_Result model_one(conn *c) {
    dsv4_server *s = c->srv;
    const char *id = c->url + strlen("/v1/models/");
    if (strcmp(id, s->model_id) && strcmp(id, s->think_model)) {
        char msg[256];
        snprintf(msg, sizeof msg, "model \"%.100s\" does not exist", id);
        return fail(c, 404, "invalid_request_error", "model", "model_not_found", msg);
    }
    dsv4_chat_buf b = {0};
    put_model(&b, s, id);
    return reply_buf(c, 200, &b);
}

static enum MHD_Result health(conn *c) {
    if (atomic_load(&c->srv->closing)) {
        static const char BYE[] = "{\"status\":\"shutting down\"}";
        return reply(c, 503, "application/json", BYE, sizeof BYE - 1);
    }
    static const char OK[] = "{\"status\":\"ok\"}";
    return reply(c, 200, "application/json", OK, sizeof OK - 1);
}

static enum MHD_Result metrics(conn *c) {
    dsv4_sched_stats st;
    dsv4_sched_get_stats(c->srv->sched, &st);
    dsv4_chat_buf b = {0};
    dsv4_metrics_render(&c->srv->metrics, &st, &b);
    if (b.oom) return reply_buf(c, 500, &b);
    enum MHD_Result rc = reply(c, 200, "text/plain; version=0.0.4; charset=utf-8", b.data ? b.data : "", b.len);
    dsv4_chat_buf_free(&b);
    return rc;
}

/* ------------------------------------------------------------------------- */
/* Routing                                                                    */
/* ------------------------------------------------------------------------- */

static route_id route_of(const char *url, const char **method_wanted) {
    *method_wanted = "GET";
    if (!strcmp(url, "/v1/chat/completions") || !strcmp(url, "/chat/completions")) {
        *method_wanted = "POST";
        return R_CHAT;
    }
    if (!strcmp(url, "/v1/completions") || !strcmp(url, "/completions")) {
        *method_wanted = "POST";
        return R_COMPLETIONS;
    }
    if (!strcmp(url, "/v1/messages") || !strcmp(url, "/messages")) {
        *method_wanted = "POST";
        return R_MESSAGES;
    }
    if (!strcmp(url, "/v1/models") || !strcmp(url, "/models")) return R_MODELS;
    if (!strncmp(url, "/v1/models/", 11) && url[11]) return R_MODEL;
    if (!strcmp(url, "/health") || !strcmp(url, "/v1/health")) return R_HEALTH;
    if (!strcmp(url, "/metrics")) return R_METRICS;
    return R_NONE;
}

/* Constant-time comparison of the key: "Authorization: Bearer KEY", or
 * "x-api-key: KEY" as Anthropic's clients send it. */
static int key_ok(const dsv4_server *s, struct MHD_Connection *mc) {
    if (!s->api_key[0]) return 1;
    const char *h = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, "Authorization");
    if (h && !strncasecmp(h, "Bearer ", 7)) {
        h += 7;
        while (*h == ' ') h++;
    } else {
        h = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, "x-api-key");
        if (!h) return 0;
    }
    size_t a = strlen(h), b = strlen(s->api_key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < b; i++) diff |= (unsigned char)s->api_key[i] ^ (unsigned char)(i < a ? h[i] : 0);
    return diff == 0;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    dsv4_server *s = cls;
    conn *c = *con_cls;
    if (!c) {
        c = calloc(1, sizeof *c);
        if (!c) return MHD_NO;
        c->srv = s;
        c->mc = mc;
        c->t0 = dsv4_now();
        snprintf(c->method, sizeof c->method, "%s", method);
        snprintf(c->url, sizeof c->url, "%s", url);
        *con_cls = c;
        const char *want;
        c->route = route_of(url, &want);
        c->anth = c->route == R_MESSAGES;
        if (c->route == R_NONE) {
            char msg[160];
            snprintf(msg, sizeof msg, "no route %.16s %.100s", method, url);
            return fail(c, 404, "invalid_request_error", NULL, "not_found", msg);
        }
        int is_head = !strcmp(method, "HEAD") && !strcmp(want, "GET");
        if (strcmp(method, want) && !is_head) {
            char msg[160];
            snprintf(msg, sizeof msg, "method %.16s is not allowed on %.100s (use %s)", method, url, want);
            return fail(c, 405, "invalid_request_error", NULL, "method_not_allowed", msg);
        }
        if (!strncmp(url, "/v1/", 4) && !key_ok(s, mc))
            return fail(c, 401, "authentication_error", NULL, "invalid_api_key",
                        "invalid or missing API key (send \"Authorization: Bearer KEY\" or \"x-api-key: KEY\")");
        const char *cl = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, "Content-Length");
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long n = strtoull(cl, &end, 10);
            if (errno || *end || n > s->o.max_body) {
                char msg[160];
                snprintf(msg, sizeof msg, "request body of %.30s bytes is over the limit of %zu bytes", cl,
                         s->o.max_body);
                return fail(c, 413, "invalid_request_error", NULL, "request_too_large", msg);
            }
        }
        return MHD_YES;
    }
    if (*upload_size) {
        /* accumulate the body; past the limit keep reading but drop it, then 413 */
        if (!c->too_large) {
            size_t need;
            if (dsv4_add_size(c->len, *upload_size, &need) < 0 || need > s->o.max_body) {
                c->too_large = 1;
                free(c->body);
                c->body = NULL;
                c->len = c->cap = 0;
            } else {
                if (need + 1 > c->cap) {
                    size_t cap = c->cap ? c->cap : 4096;
                    while (cap < need + 1) cap *= 2;
                    char *p = realloc(c->body, cap);
                    if (!p) return MHD_NO;
                    c->body = p;
                    c->cap = cap;
                }
                memcpy(c->body + c->len, upload, *upload_size);
                c->len = need;
                c->body[c->len] = 0;
            }
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (c->too_large) {
        char msg[128];
        snprintf(msg, sizeof msg, "request body is over the limit of %zu bytes", s->o.max_body);
        return fail(c, 413, "invalid_request_error", NULL, "request_too_large", msg);
    }
    switch (c->route) {
    case R_CHAT: return generate(c, DSV4_API_CHAT);
    case R_COMPLETIONS: return generate(c, DSV4_API_COMPLETIONS);
    case R_MESSAGES: return generate(c, DSV4_API_CHAT);
    case R_MODELS: return models(c);
    case R_MODEL: return model_one(c);
    case R_HEALTH: return health(c);
    case R_METRICS: return metrics(c);
    default: return fail(c, 404, "invalid_request_error", NULL, "not_found", "no such route");
    }
}

static void on_completed(void *cls, struct MHD_Connection *mc, void **con_cls, enum MHD_RequestTerminationCode toe) {
    dsv4_server *s = cls;
    conn *c = *con_cls;
    if (!c) return;
    *con_cls = NULL;
    int gone = c->disconnected || (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK && !c->sent_done &&
                                   IS_GENERATION(c->route) && c->req);
    if (c->req) drop_request(c); /* cancels an unfinished generation: its sequence is freed */
    double dt = dsv4_now() - c->t0;
    int status = c->status ? c->status : 500;
    if (gone && status == 200 && !c->sent_done) status = 499;
    dsv4_metrics_record(&s->metrics, status, dt, gone);
    if (IS_GENERATION(c->route)) {
        double tps = c->usage.decode_tps;
        dsv4_log(1,
                 "%s %s %s status=%d in=%d out=%" PRId64 " cached=%" PRId64 " ttft=%.3fs tok/s=%.1f total=%.3fs "
                 "finish=%s%s",
                 c->rp.id[0] ? c->rp.id : "-", c->method, c->url, status, c->prompt_tokens,
                 c->usage.completion_tokens, c->usage.cached_tokens, c->usage.ttft_s, tps, dt,
                 c->finished ? dsv4_finish_reason_name(c->finish) : "-", gone ? " client-gone" : "");
    } else {
        dsv4_log(status >= 400 ? 1 : 2, "- %s %s status=%d total=%.3fs", c->method, c->url, status, dt);
    }
    dsv4_api_request_free(&c->ar);
    dsv4_chat_buf_free(&c->out);
    dsv4_chat_buf_free(&c->raw);
    free(c->pend);
    free(c->body);
    free(c);
}

/* ------------------------------------------------------------------------- */
/* Start and stop                                                             */
/* ------------------------------------------------------------------------- */

void dsv4_server_opts_default(dsv4_server_opts *o) {
    memset(o, 0, sizeof *o);
    o->host = "127.0.0.1";
    o->port = 8000;
    o->max_body = DSV4_API_MAX_BODY_DEFAULT;
    o->model_id = "deepseek-chat";
    o->think_model = "deepseek-reasoner";
    o->max_connections = 256;
    o->retry_after_s = 1;
}

int dsv4_server_start(dsv4_server **out, const dsv4_server_opts *opts, dsv4_sched *sched, const dsv4_tokenizer *tok,
                      dsv4_err *err) {
    *out = NULL;
    dsv4_server_opts o;
    if (opts) o = *opts;
    else dsv4_server_opts_default(&o);
    if (!o.host) o.host = "127.0.0.1";
    if (o.port < 0 || o.port > 65535) return dsv4_errf(err, "--port: %d is not a TCP port (0..65535)", o.port);
    if (!o.max_body) o.max_body = DSV4_API_MAX_BODY_DEFAULT;
    if (o.max_connections <= 0) o.max_connections = 256;
    if (o.retry_after_s <= 0) o.retry_after_s = 1;
    if (!o.model_id) o.model_id = "deepseek-chat";
    if (!o.think_model) o.think_model = "";
    if (o.api_key && strlen(o.api_key) >= 256) return dsv4_errf(err, "--api-key: longer than 255 bytes");

    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC;
    struct sockaddr_in *v4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, o.host, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons((uint16_t)o.port);
    } else if (inet_pton(AF_INET6, o.host, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons((uint16_t)o.port);
        flags |= MHD_USE_IPv6;
    } else {
        return dsv4_errf(err, "--host: \"%s\" is not a numeric IPv4 or IPv6 address", o.host);
    }

    dsv4_server *s = calloc(1, sizeof *s);
    if (!s) return dsv4_errf(err, "server: out of memory");
    s->o = o;
    snprintf(s->host, sizeof s->host, "%s", o.host);
    snprintf(s->model_id, sizeof s->model_id, "%s", o.model_id);
    snprintf(s->think_model, sizeof s->think_model, "%s", o.think_model);
    snprintf(s->api_key, sizeof s->api_key, "%s", o.api_key ? o.api_key : "");
    s->o.host = s->host;
    s->o.model_id = s->model_id;
    s->o.think_model = s->think_model;
    s->o.api_key = s->api_key;
    s->sched = sched;
    s->tok = tok;
    const dsv4_engine_info *info = dsv4_sched_engine_info(sched);
    s->lim.vocab_size = info->vocab_size;
    s->lim.ctx = dsv4_sched_ctx(sched);
    s->lim.model_id = s->model_id;
    s->lim.think_model = s->think_model[0] ? s->think_model : NULL;
    s->lim.test_hooks = o.test_hooks;
    s->started = (long long)time(NULL);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    s->id_salt = ((unsigned long long)ts.tv_nsec << 20) ^ (unsigned long long)ts.tv_sec ^ ((unsigned long long)getpid() << 40);
    pthread_mutex_init(&s->mu, NULL);
    dsv4_metrics_init(&s->metrics);

    s->d = MHD_start_daemon(flags, (uint16_t)o.port, NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR, &ss,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_CONNECTION_LIMIT,
                            (unsigned)o.max_connections, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)600,
                            MHD_OPTION_END);
    if (!s->d) {
        int e = errno;
        dsv4_metrics_free(&s->metrics);
        pthread_mutex_destroy(&s->mu);
        free(s);
        return dsv4_errf(err, "cannot listen on %s port %d: %s", o.host, o.port,
                         e ? strerror(e) : "libmicrohttpd failed to start");
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : o.port;
    *out = s;
    return 0;
}

int dsv4_server_port(const dsv4_server *s) { return s->port; }

void dsv4_server_stop(dsv4_server *s, double grace_s) {
    if (!s) return;
    atomic_store(&s->closing, 1);
    MHD_socket ls = MHD_quiesce_daemon(s->d);
    if (ls != MHD_INVALID_SOCKET) close(ls);
    double t_end = dsv4_now() + (grace_s > 0 ? grace_s : 0);
    while (dsv4_server_inflight(s) > 0 && dsv4_now() < t_end) usleep(20000);
    /* whatever is left is cancelled; each handler then sees FINISHED and ends */
    pthread_mutex_lock(&s->mu);
    for (conn *c = s->active; c; c = c->next) dsv4_request_cancel(c->req);
    pthread_mutex_unlock(&s->mu);
    /* let the handlers write their last chunks ([DONE] or the 503) before the
     * daemon closes every connection */
    t_end = dsv4_now() + 3;
    while (dsv4_server_inflight(s) > 0 && dsv4_now() < t_end) usleep(10000);
    MHD_stop_daemon(s->d);
    dsv4_metrics_free(&s->metrics);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
