/* fidelity/client: endpoint (libcurl) or local engine (contract in client.h). */
#include "fidelity/client.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "text/chat.h"
#include "text/tokenizer.h"

struct fid_client {
    int local;
    char desc[4400];
    /* endpoint */
    char url[2048];
    char model[256];
    char auth[1100];
    double timeout;
    CURL *curl;
    /* local */
    dsv4_engine *e;
    dsv4_tokenizer *tok;
    dsv4_engine_info info;
    float *logits;
    int max_tokens;
};

/* ----- opening ----- */
int fid_client_open(fid_client **out, const fid_client_opts *o, dsv4_err *err) {
    *out = NULL;
    fid_client *c = calloc(1, sizeof *c);
    if (!c) return dsv4_errf(err, "out of memory");
    c->max_tokens = o->max_tokens > 0 ? o->max_tokens : 32;
    c->timeout = o->request_timeout > 0 ? o->request_timeout : 120;
    if (o->endpoint) {
        const char *u = o->endpoint;
        size_t n = strlen(u);
        if (strncmp(u, "http://", 7) && strncmp(u, "https://", 8)) {
            free(c);
            return dsv4_errf(err, "--endpoint '%s': expected an http:// or https:// URL", u);
        }
        if (!o->model || !*o->model) {
            free(c);
            return dsv4_errf(err, "--endpoint %s needs --model NAME (the name the server serves)", u);
        }
        while (n && u[n - 1] == '/') n--;
        const char *tail = "/v1/chat/completions";
        if (n >= 17 && !strncmp(u + n - 17, "/chat/completions", 17)) tail = "";
        else if (n >= 3 && !strncmp(u + n - 3, "/v1", 3)) tail = "/chat/completions";
        if (n + strlen(tail) >= sizeof c->url) {
            free(c);
            return dsv4_errf(err, "--endpoint: URL too long");
        }
        snprintf(c->url, sizeof c->url, "%.*s%s", (int)n, u, tail);
        snprintf(c->model, sizeof c->model, "%s", o->model);
        if (o->api_key) snprintf(c->auth, sizeof c->auth, "Authorization: Bearer %s", o->api_key);
        if (curl_global_init(CURL_GLOBAL_DEFAULT) || !(c->curl = curl_easy_init())) {
            free(c);
            return dsv4_errf(err, "libcurl failed to initialise");
        }
        snprintf(c->desc, sizeof c->desc, "%s (model %s)", c->url, c->model);
        *out = c;
        return 0;
    }
    c->local = 1;
    dsv4_engine_opts eo = {.model_dir = o->model, .sets = o->sets, .n_sets = o->n_sets};
    if (dsv4_engine_open(&c->e, &eo, err)) goto fail;
    dsv4_engine_get_info(c->e, &c->info);
    char tp[4200];
    snprintf(tp, sizeof tp, "%s/tokenizer.json", c->info.model_dir);
    if (dsv4_tokenizer_load(&c->tok, tp, err)) goto fail;
    if (!(c->logits = malloc(sizeof(float) * (size_t)c->info.vocab_size))) {
        dsv4_errf(err, "out of memory");
        goto fail;
    }
    snprintf(c->desc, sizeof c->desc, "local model %s (%s)", c->info.model_dir, c->info.numerics);
    *out = c;
    return 0;
fail:
    fid_client_close(c);
    return -1;
}

void fid_client_close(fid_client *c) {
    if (!c) return;
    if (c->curl) {
        curl_easy_cleanup(c->curl);
        curl_global_cleanup();
    }
    free(c->logits);
    dsv4_tokenizer_free(c->tok);
    dsv4_engine_close(c->e);
    free(c);
}

int fid_client_is_local(const fid_client *c) { return c->local; }
const char *fid_client_describe(const fid_client *c) { return c->desc; }

/* ----- endpoint ----- */
typedef struct {
    char *data;
    size_t len, cap;
    int oom;
} grow_buf;

static size_t on_body(char *p, size_t size, size_t n, void *user) {
    grow_buf *b = user;
    size_t add = size * n;
    if (b->len + add + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 4096;
        while (nc < b->len + add + 1) nc *= 2;
        if (nc > ((size_t)64 << 20)) { /* a chat answer is never this large */
            b->oom = 1;
            return 0;
        }
        char *nd = realloc(b->data, nc);
        if (!nd) {
            b->oom = 1;
            return 0;
        }
        b->data = nd;
        b->cap = nc;
    }
    memcpy(b->data + b->len, p, add);
    b->len += add;
    b->data[b->len] = 0;
    return add;
}

static void excerpt(char *dst, size_t n, const char *s, size_t len) {
    size_t j = 0;
    for (size_t i = 0; i < len && j + 4 < n; i++) dst[j++] = (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '.';
    if (len > n - 4 && j + 4 <= n) memcpy(dst + j, "...", 3), j += 3;
    dst[j] = 0;
}

static int endpoint_chat(fid_client *c, const json_t *messages, const json_t *tools, char **answer, int64_t *pt,
                         dsv4_err *err) {
    json_t *req = json_pack("{s:s, s:O, s:i, s:f, s:b}", "model", c->model, "messages", messages, "max_tokens",
                            c->max_tokens, "temperature", 0.0, "stream", 0);
    if (!req) return dsv4_errf(err, "%s: cannot build the request JSON", c->url);
    if (tools && json_is_array(tools)) json_object_set(req, "tools", (json_t *)tools);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    if (!body) return dsv4_errf(err, "%s: cannot serialise the request", c->url);
    grow_buf rb = {0};
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    if (c->auth[0]) h = curl_slist_append(h, c->auth);
    CURL *cu = c->curl;
    curl_easy_reset(cu);
    curl_easy_setopt(cu, CURLOPT_URL, c->url);
    curl_easy_setopt(cu, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(cu, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(cu, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(cu, CURLOPT_WRITEDATA, &rb);
    curl_easy_setopt(cu, CURLOPT_TIMEOUT_MS, (long)(c->timeout * 1000));
    curl_easy_setopt(cu, CURLOPT_CONNECTTIMEOUT_MS, (long)(c->timeout * 1000 < 10000 ? c->timeout * 1000 : 10000));
    curl_easy_setopt(cu, CURLOPT_NOSIGNAL, 1L);
    CURLcode cc = curl_easy_perform(cu);
    long status = 0;
    curl_easy_getinfo(cu, CURLINFO_RESPONSE_CODE, &status);
    curl_slist_free_all(h);
    free(body);
    int rc = -1;
    json_t *doc = NULL;
    char ex[200];
    if (cc == CURLE_OPERATION_TIMEDOUT) {
        dsv4_errf(err, "%s: no complete answer within %.0f s (timed out)", c->url, c->timeout);
        goto done;
    }
    if (cc == CURLE_COULDNT_CONNECT || cc == CURLE_COULDNT_RESOLVE_HOST) {
        dsv4_errf(err, "%s: cannot reach the endpoint (%s)", c->url, curl_easy_strerror(cc));
        goto done;
    }
    if (rb.oom) {
        dsv4_errf(err, "%s: response larger than 64 MiB or out of memory", c->url);
        goto done;
    }
    if (cc != CURLE_OK) {
        dsv4_errf(err, "%s: request failed: %s", c->url, curl_easy_strerror(cc));
        goto done;
    }
    excerpt(ex, sizeof ex, rb.data ? rb.data : "", rb.len);
    if (status != 200) {
        dsv4_errf(err, "%s: HTTP %ld: %s", c->url, status, ex);
        goto done;
    }
    json_error_t je;
    doc = json_loadb(rb.data ? rb.data : "", rb.len, 0, &je);
    if (!doc) {
        dsv4_errf(err, "%s: response is not JSON (%s): %s", c->url, je.text, ex);
        goto done;
    }
    json_t *msg = json_object_get(json_array_get(json_object_get(doc, "choices"), 0), "message");
    if (!json_is_object(msg)) {
        dsv4_errf(err, "%s: response has no choices[0].message: %s", c->url, ex);
        goto done;
    }
    json_t *content = json_object_get(msg, "content");
    if (content && !json_is_string(content) && !json_is_null(content)) {
        dsv4_errf(err, "%s: choices[0].message.content is neither a string nor null: %s", c->url, ex);
        goto done;
    }
    *answer = dsv4_xstrdup(json_is_string(content) ? json_string_value(content) : "");
    json_t *u = json_object_get(json_object_get(doc, "usage"), "prompt_tokens");
    *pt = json_is_integer(u) ? (int64_t)json_integer_value(u) : -1;
    rc = 0;
done:
    json_decref(doc);
    free(rb.data);
    return rc;
}

/* ----- local model ----- */
static int local_chat(fid_client *c, const json_t *messages, const json_t *tools, char **answer, int64_t *pt,
                      dsv4_err *err) {
    dsv4_chat_opts co;
    dsv4_chat_opts_default(&co);
    char *prompt = NULL;
    size_t plen = 0;
    dsv4_ids ids = {0}, gen = {0};
    dsv4_bytes out = {0};
    dsv4_seq *s = NULL;
    int rc = -1;
    if (dsv4_chat_render(messages, tools && json_is_array(tools) ? tools : NULL, &co, &prompt, &plen, err)) {
        dsv4_err_prefix(err, "rendering the conversation");
        goto done;
    }
    if (dsv4_tokenizer_encode(c->tok, prompt, plen, 0, &ids, err)) goto done;
    if ((int64_t)ids.len + c->max_tokens > c->info.max_position) {
        dsv4_errf(err, "prompt of %zu tokens exceeds the model's %lld positions", ids.len,
                  (long long)c->info.max_position);
        goto done;
    }
    *pt = (int64_t)ids.len;
    if (dsv4_seq_new(c->e, &s, err)) goto done;
    if (dsv4_seq_append(s, ids.ids, (int)ids.len, c->logits, 0, err)) goto done;
    for (int t = 0; t < c->max_tokens; t++) {
        int32_t best = 0;
        for (int v = 1; v < c->info.vocab_size; v++)
            if (c->logits[v] > c->logits[best]) best = v;
        if (best == c->info.eos_id) break;
        if (dsv4_ids_push(&gen, best, err)) goto done;
        if (t + 1 < c->max_tokens && dsv4_seq_append(s, &best, 1, c->logits, 0, err)) goto done;
    }
    /* decoded at once: a character may span tokens */
    if (gen.len && dsv4_tokenizer_decode(c->tok, gen.ids, gen.len, DSV4_TOK_SKIP_SPECIAL, &out, err)) goto done;
    *answer = malloc(out.len + 1);
    if (!*answer) {
        dsv4_errf(err, "out of memory");
        goto done;
    }
    if (out.len) memcpy(*answer, out.data, out.len);
    (*answer)[out.len] = 0;
    rc = 0;
done:
    dsv4_seq_free(s);
    dsv4_bytes_free(&out);
    dsv4_ids_free(&ids);
    dsv4_ids_free(&gen);
    free(prompt);
    return rc;
}

int fid_client_chat(fid_client *c, const json_t *messages, const json_t *tools, char **answer,
                    int64_t *prompt_tokens, dsv4_err *err) {
    *answer = NULL;
    *prompt_tokens = -1;
    return c->local ? local_chat(c, messages, tools, answer, prompt_tokens, err)
                    : endpoint_chat(c, messages, tools, answer, prompt_tokens, err);
}
