/* text/dsml: the incremental parser of DeepSeek-V4 output (reasoning, content,
 * DSML tool calls).  See dsml.h for the contract and docs/CHAT_FORMAT.md for the
 * grammar and the recovery rules. */
#include "text/dsml.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#define T_THINK_CLOSE "</think>"
#define T_EOS DSV4_CHAT_EOS
#define T_BLOCK_OPEN "<" DSV4_CHAT_DSML "tool_calls>"
#define T_BLOCK_OPEN_NL "\n\n" T_BLOCK_OPEN
#define T_BLOCK_CLOSE "</" DSV4_CHAT_DSML "tool_calls>"
#define T_INV_OPEN "<" DSV4_CHAT_DSML "invoke"
#define T_INV_CLOSE "</" DSV4_CHAT_DSML "invoke>"
#define T_PARAM_OPEN "<" DSV4_CHAT_DSML "parameter"
#define T_PARAM_CLOSE "</" DSV4_CHAT_DSML "parameter>"
#define LIT(s) s, (sizeof s - 1)

/* Longest tool or parameter name we wait for; longer is malformed (it also
 * bounds how much an attribute parse re-reads while it waits for more). */
#define NAME_MAX_BYTES 512

enum { P_REASONING, P_CONTENT, P_BLOCK, P_DONE };
/* inside a tool_calls block */
enum { B_ITEM, B_INV_NAME, B_INV_BODY, B_PARAM_ATTR, B_PARAM_VAL };

struct dsv4_dsml_parser {
    int state, bstate;
    uint64_t seed;
    dsv4_dsml_event_fn fn;
    void *user;
    /* Bytes not yet reported.  In a block they start at the first byte not yet
     * accounted for (the block opening, or the end of the last invoke). */
    dsv4_chat_buf pend;
    size_t cur;       /* block: bytes of pend already parsed */
    size_t inv_start; /* block: where the current invoke's tag starts */
    size_t val_start, scan_from;
    dsv4_chat_buf name, key, keys, args; /* keys: the invoke's parameter names, NUL-separated */
    int pstring, nparams, call_malformed;
    int ncalls, malformed, eos, finished;
};

/* ----- events ----- */

static void emit(dsv4_dsml_parser *p, dsv4_dsml_event *ev) {
    if (p->fn) p->fn(p->user, ev);
}

static void emit_text(dsv4_dsml_parser *p, dsv4_dsml_event_type t, const char *s, size_t n, int malformed) {
    if (!n) return;
    dsv4_dsml_event ev = {.type = t, .text = s, .len = n, .raw = s, .raw_len = n, .malformed = malformed};
    emit(p, &ev);
}

static void emit_markup(dsv4_dsml_parser *p, const char *s, size_t n) {
    if (!n) return;
    dsv4_dsml_event ev = {.type = DSV4_DSML_MARKUP, .raw = s, .raw_len = n};
    emit(p, &ev);
}

static void consume(dsv4_dsml_parser *p, size_t k) {
    dsv4_chat_buf *b = &p->pend;
    if (!k) return;
    memmove(b->data, b->data + k, b->len - k);
    b->len -= k;
    if (b->data) b->data[b->len] = 0;
}

/* ----- small matchers ----- */

static int is_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* 1: S starts with TAG; 0: S is a proper prefix of TAG (need more); -1: no. */
static int lit(const char *s, size_t n, const char *tag, size_t tn) {
    size_t k = n < tn ? n : tn;
    if (memcmp(s, tag, k)) return -1;
    return n >= tn ? 1 : 0;
}

/* Length of the longest suffix of S that is a proper prefix of one of TAGS. */
static size_t hold_len(const char *s, size_t n, const char *const *tags, int ntags) {
    size_t best = 0;
    for (int t = 0; t < ntags; t++) {
        size_t tn = strlen(tags[t]);
        for (size_t k = (n < tn - 1 ? n : tn - 1); k > best; k--)
            if (!memcmp(s + n - k, tags[t], k)) {
                best = k;
                break;
            }
    }
    return best;
}

/* The largest e <= n such that S[0..e) does not end inside a UTF-8 sequence
 * that more bytes could still complete. */
static size_t utf8_cut(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned c = u[n - back];
        if ((c & 0xC0) == 0x80) continue; /* continuation byte: look further back */
        size_t need = c >= 0xC2 && c <= 0xDF   ? 2
                      : c >= 0xE0 && c <= 0xEF ? 3
                      : c >= 0xF0 && c <= 0xF4 ? 4
                                               : 1;
        return need > back ? n - back : n;
    }
    return n;
}

static const char *find_first(const char *s, size_t n, const char *const *tags, int ntags, int *which) {
    const char *best = NULL;
    if (!n) return NULL; /* s may be NULL then */
    for (int t = 0; t < ntags; t++) {
        const char *q = memmem(s, n, tags[t], strlen(tags[t]));
        if (q && (!best || q < best)) best = q, *which = t;
    }
    return best;
}

/* ----- reasoning and content ----- */

static const char *const REASONING_TAGS[] = {T_THINK_CLOSE, T_EOS};
static const char *const CONTENT_STOPS[] = {T_BLOCK_OPEN, T_EOS};
static const char *const CONTENT_HOLDS[] = {T_BLOCK_OPEN_NL, T_BLOCK_OPEN, T_EOS};

static void to_done(dsv4_dsml_parser *p) {
    p->eos = 1;
    p->state = P_DONE;
}

/* Returns 1 when it changed state (call again), 0 when it waits for more. */
static int step_text(dsv4_dsml_parser *p) {
    const char *s = p->pend.data;
    size_t n = p->pend.len;
    int reasoning = p->state == P_REASONING;
    dsv4_dsml_event_type t = reasoning ? DSV4_DSML_REASONING : DSV4_DSML_CONTENT;
    int which = 0;
    const char *q = find_first(s, n, reasoning ? REASONING_TAGS : CONTENT_STOPS, 2, &which);
    if (!q) {
        size_t e =
            utf8_cut(s, n - hold_len(s, n, reasoning ? REASONING_TAGS : CONTENT_HOLDS, reasoning ? 2 : 3));
        emit_text(p, t, s, e, 0);
        consume(p, e);
        return 0;
    }
    size_t pos = (size_t)(q - s);
    if (which == 1) { /* EOS */
        emit_text(p, t, s, pos, 0);
        emit_markup(p, q, strlen(T_EOS));
        if (reasoning) p->malformed = 1; /* the reasoning block never closed */
        consume(p, pos + strlen(T_EOS));
        to_done(p);
        return 1;
    }
    if (reasoning) {
        emit_text(p, t, s, pos, 0);
        emit_markup(p, q, strlen(T_THINK_CLOSE));
        consume(p, pos + strlen(T_THINK_CLOSE));
        p->state = P_CONTENT;
        return 1;
    }
    /* a tool_calls block: the "\n\n" before it is markup, not content */
    size_t cend = pos >= 2 && s[pos - 2] == '\n' && s[pos - 1] == '\n' ? pos - 2 : pos;
    emit_text(p, t, s, cend, 0);
    consume(p, cend);
    p->state = P_BLOCK;
    p->bstate = B_ITEM;
    p->cur = pos - cend + strlen(T_BLOCK_OPEN);
    return 1;
}

/* ----- the tool_calls block ----- */

/* The block does not parse from byte AT on: what is pending before AT comes back
 * as malformed content, and the rest is read again as content. */
static int fail(dsv4_dsml_parser *p, size_t at) {
    p->malformed = 1;
    emit_text(p, DSV4_DSML_CONTENT, p->pend.data, at, 1);
    consume(p, at);
    p->state = P_CONTENT;
    return 1;
}

static void skip_ws(dsv4_dsml_parser *p) {
    while (p->cur < p->pend.len && is_ws(p->pend.data[p->cur]))
        p->cur++;
}

/* Reads `name="VALUE"` at S[*i..n) (leading white space allowed).  Returns 1 and
 * writes *vs and *vn, 0 for need more, -1 for malformed. */
static int attr(const char *s, size_t n, size_t *i, const char *key, size_t keylen, size_t *vs, size_t *vn) {
    size_t k = *i;
    while (k < n && is_ws(s[k]))
        k++;
    if (k == n) return 0;
    int m = lit(s + k, n - k, key, keylen);
    if (m <= 0) return m;
    k += keylen;
    size_t start = k;
    for (; k < n && s[k] != '"'; k++)
        if (s[k] == '<' || s[k] == '>' || s[k] == '\n' || s[k] == 0 || k - start >= NAME_MAX_BYTES) return -1;
    if (k == n) return 0;
    *vs = start;
    *vn = k - start;
    *i = k + 1;
    return 1;
}

static void put_id(char *id, uint64_t seed, int index) {
    /* splitmix64 over (seed, index): distinct, reproducible ids */
    uint64_t x = seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(index + 1));
    static const char HEX[] = "0123456789abcdef";
    memcpy(id, "call_", 5);
    for (int w = 0; w < 2; w++) {
        x += 0x9E3779B97F4A7C15ull;
        uint64_t z = x;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        for (int k = 0; k < 12; k++)
            id[5 + w * 12 + k] = HEX[(z >> (4 * k)) & 15];
    }
    id[29] = 0;
}

/* One parameter closed: add `"key": value` to the arguments being built. */
static int add_param(dsv4_dsml_parser *p, const char *v, size_t vn) {
    for (size_t o = 0; o < p->keys.len; o += strlen(p->keys.data + o) + 1)
        if (!strcmp(p->keys.data + o, p->key.data)) return -1; /* duplicate name: malformed */
    dsv4_chat_buf_put(&p->keys, p->key.data, p->key.len + 1);
    dsv4_chat_buf_put(&p->args, p->nparams ? ", " : "{", p->nparams ? 2 : 1);
    p->nparams++;
    dsv4_chat_json_py_string(&p->args, p->key.data, p->key.len);
    dsv4_chat_buf_put(&p->args, ": ", 2);
    if (p->pstring) {
        dsv4_chat_json_py_string(&p->args, v, vn);
        return 0;
    }
    json_error_t je;
    json_t *j = json_loadb(v, vn, JSON_DECODE_ANY, &je);
    if (j) {
        dsv4_chat_buf_put(&p->args, v, vn); /* valid JSON: inserted as written */
        json_decref(j);
    } else {
        dsv4_chat_json_py_string(&p->args, v, vn); /* kept as a string, flagged */
        p->call_malformed = 1;
        p->malformed = 1;
    }
    return 0;
}

static void complete_invoke(dsv4_dsml_parser *p) {
    const char *s = p->pend.data;
    emit_markup(p, s, p->inv_start);
    if (!p->nparams) dsv4_chat_buf_put(&p->args, "{", 1);
    dsv4_chat_buf_put(&p->args, "}", 1);
    char id[32];
    put_id(id, p->seed, p->ncalls);
    dsv4_dsml_event ev = {.type = DSV4_DSML_CALL_START,
                          .raw = s + p->inv_start,
                          .raw_len = p->cur - p->inv_start,
                          .index = p->ncalls,
                          .id = id,
                          .name = p->name.data ? p->name.data : ""};
    emit(p, &ev);
    dsv4_dsml_event ea = {.type = DSV4_DSML_CALL_ARGS,
                          .text = p->args.data ? p->args.data : "{}",
                          .len = p->args.data ? p->args.len : 2,
                          .index = p->ncalls,
                          .id = id,
                          .name = ev.name,
                          .malformed = p->call_malformed};
    emit(p, &ea);
    p->ncalls++;
    consume(p, p->cur);
    p->cur = 0;
    p->bstate = B_ITEM;
}

static int step_block(dsv4_dsml_parser *p) {
    const char *s = p->pend.data;
    size_t n = p->pend.len;
    switch (p->bstate) {
    case B_ITEM: { /* an invoke, or the end of the block */
        skip_ws(p);
        if (p->cur == n) return 0;
        int a = lit(s + p->cur, n - p->cur, LIT(T_INV_OPEN)),
            b = lit(s + p->cur, n - p->cur, LIT(T_BLOCK_CLOSE));
        if (a == 1) {
            p->inv_start = p->cur;
            p->cur += strlen(T_INV_OPEN);
            p->name.len = p->keys.len = p->args.len = 0;
            p->nparams = p->call_malformed = 0;
            p->bstate = B_INV_NAME;
            return 1;
        }
        if (b == 1) {
            p->cur += strlen(T_BLOCK_CLOSE);
            emit_markup(p, s, p->cur);
            consume(p, p->cur);
            p->cur = 0;
            p->state = P_CONTENT; /* text after the block is content again */
            return 1;
        }
        return a == 0 || b == 0 ? 0 : fail(p, p->cur);
    }
    case B_INV_NAME: { /* name="NAME"> */
        size_t i = p->cur, vs = 0, vn = 0;
        int r = attr(s, n, &i, LIT("name=\""), &vs, &vn);
        if (r == 0) return 0;
        if (r < 0 || vn == 0) return fail(p, p->cur);
        if (i == n) return 0;
        if (s[i] != '>') return fail(p, p->cur);
        p->name.len = 0;
        dsv4_chat_buf_put(&p->name, s + vs, vn);
        p->cur = i + 1;
        p->bstate = B_INV_BODY;
        return 1;
    }
    case B_INV_BODY: { /* a parameter, or the end of the invoke */
        skip_ws(p);
        if (p->cur == n) return 0;
        int a = lit(s + p->cur, n - p->cur, LIT(T_PARAM_OPEN)),
            b = lit(s + p->cur, n - p->cur, LIT(T_INV_CLOSE));
        if (a == 1) {
            p->cur += strlen(T_PARAM_OPEN);
            p->bstate = B_PARAM_ATTR;
            return 1;
        }
        if (b == 1) {
            p->cur += strlen(T_INV_CLOSE);
            complete_invoke(p);
            return 1;
        }
        return a == 0 || b == 0 ? 0 : fail(p, p->cur);
    }
    case B_PARAM_ATTR: { /* name="KEY" string="true|false"> */
        size_t i = p->cur, ks = 0, kn = 0, vs = 0, vn = 0;
        if (i == n) return 0;
        if (!is_ws(s[i])) return fail(p, p->cur);
        int r = attr(s, n, &i, LIT("name=\""), &ks, &kn);
        if (r == 0) return 0;
        if (r < 0 || kn == 0) return fail(p, p->cur);
        if (i == n) return 0;
        if (!is_ws(s[i])) return fail(p, p->cur);
        r = attr(s, n, &i, LIT("string=\""), &vs, &vn);
        if (r == 0) return 0;
        int is_true = r > 0 && vn == 4 && !memcmp(s + vs, "true", 4);
        int is_false = r > 0 && vn == 5 && !memcmp(s + vs, "false", 5);
        if (!is_true && !is_false) return fail(p, p->cur);
        while (i < n && is_ws(s[i]))
            i++;
        if (i == n) return 0;
        if (s[i] != '>') return fail(p, p->cur);
        p->key.len = 0;
        dsv4_chat_buf_put(&p->key, s + ks, kn);
        if (!p->key.data) return fail(p, p->cur); /* out of memory: give the text back */
        p->pstring = is_true;
        p->cur = p->val_start = p->scan_from = i + 1;
        p->bstate = B_PARAM_VAL;
        return 1;
    }
    case B_PARAM_VAL: { /* raw value up to </｜DSML｜parameter> */
        static const char *const tags[] = {T_PARAM_CLOSE, T_EOS};
        int which = 0;
        const char *q = find_first(s + p->scan_from, n - p->scan_from, tags, 2, &which);
        if (!q) {
            size_t keep = strlen(T_PARAM_CLOSE) > strlen(T_EOS) ? strlen(T_PARAM_CLOSE) : strlen(T_EOS);
            p->scan_from = n > p->val_start + keep ? n - keep : p->val_start;
            return 0;
        }
        if (which == 1) return fail(p, p->cur); /* the output ended inside a parameter */
        size_t vend = (size_t)(q - s);
        if (add_param(p, s + p->val_start, vend - p->val_start)) return fail(p, p->cur);
        p->cur = vend + strlen(T_PARAM_CLOSE);
        p->bstate = B_INV_BODY;
        return 1;
    }
    }
    return fail(p, p->cur);
}

static void run(dsv4_dsml_parser *p) {
    for (;;) {
        int progress;
        switch (p->state) {
        case P_REASONING:
        case P_CONTENT:
            progress = step_text(p);
            break;
        case P_BLOCK:
            progress = step_block(p);
            break;
        default: /* after EOS: text is accounted for and ignored */
            emit_markup(p, p->pend.data, p->pend.len);
            consume(p, p->pend.len);
            progress = 0;
        }
        if (!progress) return;
    }
}

/* ----- public API ----- */

int dsv4_dsml_parser_init(dsv4_dsml_parser **out, dsv4_chat_mode mode, uint64_t id_seed,
                          dsv4_dsml_event_fn fn, void *user, dsv4_err *err) {
    dsv4_dsml_parser *p = calloc(1, sizeof *p);
    if (!p) return dsv4_errf(err, "dsml: out of memory");
    p->state = mode == DSV4_CHAT_MODE_THINKING ? P_REASONING : P_CONTENT;
    p->seed = id_seed;
    p->fn = fn;
    p->user = user;
    *out = p;
    return 0;
}

void dsv4_dsml_parser_free(dsv4_dsml_parser *p) {
    if (!p) return;
    dsv4_chat_buf_free(&p->pend);
    dsv4_chat_buf_free(&p->name);
    dsv4_chat_buf_free(&p->key);
    dsv4_chat_buf_free(&p->keys);
    dsv4_chat_buf_free(&p->args);
    free(p);
}

static int check_oom(dsv4_dsml_parser *p, dsv4_err *err) {
    if (p->pend.oom || p->name.oom || p->key.oom || p->keys.oom || p->args.oom)
        return dsv4_errf(err, "dsml: out of memory (%zu bytes pending)", p->pend.len);
    return 0;
}

int dsv4_dsml_parser_feed(dsv4_dsml_parser *p, const char *text, size_t len, dsv4_err *err) {
    if (p->finished || !len) return 0;
    dsv4_chat_buf_put(&p->pend, text, len);
    if (check_oom(p, err)) return -1;
    run(p);
    return check_oom(p, err);
}

int dsv4_dsml_parser_finish(dsv4_dsml_parser *p, dsv4_err *err) {
    if (p->finished) return 0;
    p->finished = 1;
    run(p);
    if (p->state == P_BLOCK) {
        /* an unfinished tool_calls block: all of it comes back as content */
        fail(p, p->pend.len);
        run(p);
    }
    if (p->state == P_REASONING || p->state == P_CONTENT)
        emit_text(p, p->state == P_REASONING ? DSV4_DSML_REASONING : DSV4_DSML_CONTENT, p->pend.data,
                  p->pend.len, 0);
    else
        emit_markup(p, p->pend.data, p->pend.len);
    consume(p, p->pend.len);
    dsv4_dsml_event ev = {.type = DSV4_DSML_END, .malformed = p->malformed, .eos = p->eos};
    emit(p, &ev);
    return check_oom(p, err);
}

int dsv4_dsml_parser_malformed(const dsv4_dsml_parser *p) {
    return p->malformed;
}

/* ----- collecting a whole message ----- */

void dsv4_dsml_collect(void *user, const dsv4_dsml_event *ev) {
    dsv4_dsml_collector *c = user;
    switch (ev->type) {
    case DSV4_DSML_REASONING:
        dsv4_chat_buf_put(&c->reasoning, ev->text, ev->len);
        break;
    case DSV4_DSML_CONTENT:
        dsv4_chat_buf_put(&c->content, ev->text, ev->len);
        break;
    case DSV4_DSML_CALL_START: {
        if (c->ncalls == c->cap) {
            size_t cap = c->cap ? c->cap * 2 : 4;
            dsv4_dsml_call *q = realloc(c->calls, cap * sizeof *q);
            if (!q) {
                c->oom = 1;
                return;
            }
            c->calls = q;
            c->cap = cap;
        }
        dsv4_dsml_call *k = &c->calls[c->ncalls++];
        memset(k, 0, sizeof *k);
        k->id = strdup(ev->id);
        k->name = strdup(ev->name);
        if (!k->id || !k->name) c->oom = 1;
        break;
    }
    case DSV4_DSML_CALL_ARGS:
        if (ev->index >= 0 && (size_t)ev->index < c->ncalls) {
            dsv4_dsml_call *k = &c->calls[ev->index];
            free(k->arguments);
            k->arguments = strndup(ev->text, ev->len);
            k->malformed = ev->malformed;
            if (!k->arguments) c->oom = 1;
        }
        break;
    case DSV4_DSML_END:
        c->malformed = ev->malformed;
        c->eos = ev->eos;
        break;
    case DSV4_DSML_MARKUP:
        break;
    }
}

void dsv4_dsml_collector_free(dsv4_dsml_collector *c) {
    dsv4_chat_buf_free(&c->reasoning);
    dsv4_chat_buf_free(&c->content);
    for (size_t i = 0; i < c->ncalls; i++) {
        free(c->calls[i].id);
        free(c->calls[i].name);
        free(c->calls[i].arguments);
    }
    free(c->calls);
    memset(c, 0, sizeof *c);
}

void dsv4_dsml_message_free(dsv4_dsml_message *m) {
    if (!m) return;
    free(m->reasoning);
    free(m->content);
    for (size_t i = 0; i < m->ncalls; i++) {
        free(m->calls[i].id);
        free(m->calls[i].name);
        free(m->calls[i].arguments);
    }
    free(m->calls);
    memset(m, 0, sizeof *m);
}

int dsv4_dsml_collector_take(dsv4_dsml_collector *c, dsv4_dsml_message *out, dsv4_err *err) {
    memset(out, 0, sizeof *out);
    dsv4_chat_buf_put(&c->reasoning, "", 0);
    dsv4_chat_buf_put(&c->content, "", 0);
    for (size_t i = 0; i < c->ncalls; i++)
        if (!c->calls[i].arguments && !(c->calls[i].arguments = strdup("{}"))) c->oom = 1;
    if (c->oom || c->reasoning.oom || c->content.oom) {
        dsv4_dsml_collector_free(c);
        return dsv4_errf(err, "dsml: out of memory collecting the message");
    }
    out->reasoning = c->reasoning.data;
    out->content = c->content.data;
    out->calls = c->calls;
    out->ncalls = c->ncalls;
    out->malformed = c->malformed;
    out->eos = c->eos;
    memset(c, 0, sizeof *c);
    return 0;
}

int dsv4_chat_parse_completion(const char *text, size_t len, dsv4_chat_mode mode, uint64_t id_seed,
                               dsv4_dsml_message *out, dsv4_err *err) {
    dsv4_dsml_collector c = {0};
    dsv4_dsml_parser *p = NULL;
    memset(out, 0, sizeof *out);
    if (dsv4_dsml_parser_init(&p, mode, id_seed, dsv4_dsml_collect, &c, err)) return -1;
    int rc = dsv4_dsml_parser_feed(p, text, len, err);
    if (!rc) rc = dsv4_dsml_parser_finish(p, err);
    dsv4_dsml_parser_free(p);
    if (rc) {
        dsv4_dsml_collector_free(&c);
        return -1;
    }
    return dsv4_dsml_collector_take(&c, out, err);
}
