/* text/chat: the DeepSeek-V4 prompt renderer and a Python-compatible JSON writer.
 * Rules: spec §5.2 and docs/CHAT_FORMAT.md (which follows DeepSeek's
 * encoding_dsv4.py, April release, step by step). */
#include "text/chat.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------- */
/* growable string                                                           */
/* ------------------------------------------------------------------------- */

void dsv4_chat_buf_put(dsv4_chat_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) {
            if (cap > SIZE_MAX / 2) {
                b->oom = 1;
                return;
            }
            cap *= 2;
        }
        char *p = realloc(b->data, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->data = p;
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
}

void dsv4_chat_buf_puts(dsv4_chat_buf *b, const char *s) {
    dsv4_chat_buf_put(b, s, strlen(s));
}

void dsv4_chat_buf_printf(dsv4_chat_buf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof tmp) {
        dsv4_chat_buf_put(b, tmp, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = 1;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    dsv4_chat_buf_put(b, big, (size_t)n);
    free(big);
}

void dsv4_chat_buf_free(dsv4_chat_buf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

/* ------------------------------------------------------------------------- */
/* JSON as Python's json.dumps(v, ensure_ascii=False) writes it              */
/* ------------------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if the bytes there are
 * not one (overlongs, surrogates and code points above U+10FFFF are invalid). */
static size_t utf8_seq_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
        len = 2;
    else if (c == 0xE0)
        len = 3, lo = 0xA0;
    else if (c >= 0xE1 && c <= 0xEC)
        len = 3;
    else if (c == 0xED)
        len = 3, hi = 0x9F;
    else if (c >= 0xEE && c <= 0xEF)
        len = 3;
    else if (c == 0xF0)
        len = 4, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3)
        len = 4;
    else if (c == 0xF4)
        len = 4, hi = 0x8F;
    else
        return 0;
    if (n < len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return len;
}

void dsv4_chat_json_py_string(dsv4_chat_buf *b, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    dsv4_chat_buf_put(b, "\"", 1);
    size_t run = 0; /* start of the pending run of bytes copied verbatim */
    size_t i = 0;
    while (i < n) {
        unsigned c = u[i];
        const char *esc = NULL;
        char tmp[8];
        size_t adv = 1;
        if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c == '\n')
            esc = "\\n";
        else if (c == '\r')
            esc = "\\r";
        else if (c == '\t')
            esc = "\\t";
        else if (c == '\b')
            esc = "\\b";
        else if (c == '\f')
            esc = "\\f";
        else if (c < 0x20) {
            snprintf(tmp, sizeof tmp, "\\u%04x", c); /* Python writes lower-case hex */
            esc = tmp;
        } else if (c >= 0x80) {
            adv = utf8_seq_len(u + i, n - i);
            if (!adv) {
                esc = "\xEF\xBF\xBD"; /* U+FFFD for a byte that is not valid UTF-8 */
                adv = 1;
            }
        }
        if (esc) {
            dsv4_chat_buf_put(b, s + run, i - run);
            dsv4_chat_buf_puts(b, esc);
            run = i + adv;
        }
        i += adv;
    }
    dsv4_chat_buf_put(b, s + run, n - run);
    dsv4_chat_buf_put(b, "\"", 1);
}

/* float.__repr__: the shortest digit string that reads back to the same double,
 * in fixed notation when the decimal exponent is in [-4, 16), else d.ddde+XX. */
static void py_float_repr(dsv4_chat_buf *b, double d) {
    if (isnan(d)) return dsv4_chat_buf_puts(b, "NaN");
    if (isinf(d)) return dsv4_chat_buf_puts(b, d < 0 ? "-Infinity" : "Infinity");
    if (d == 0) return dsv4_chat_buf_puts(b, signbit(d) ? "-0.0" : "0.0");
    char tmp[64];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, d);
        if (strtod(tmp, NULL) == d) break;
    }
    /* tmp is [-]D[.DDD]e[+-]XX */
    char digits[32];
    int nd = 0, neg = 0;
    const char *p = tmp;
    if (*p == '-') neg = 1, p++;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9' && nd < 31) digits[nd++] = *p;
    int e = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    char out[96];
    int o = 0;
    if (neg) out[o++] = '-';
    if (e < -4 || e >= 16) {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (int i = 1; i < nd; i++)
                out[o++] = digits[i];
        }
        o += snprintf(out + o, sizeof out - (size_t)o, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    } else if (e < 0) {
        out[o++] = '0';
        out[o++] = '.';
        for (int i = 0; i < -e - 1; i++)
            out[o++] = '0';
        for (int i = 0; i < nd; i++)
            out[o++] = digits[i];
    } else {
        int ipart = e + 1; /* digits before the point */
        for (int i = 0; i < ipart; i++)
            out[o++] = i < nd ? digits[i] : '0';
        out[o++] = '.';
        if (nd > ipart)
            for (int i = ipart; i < nd; i++)
                out[o++] = digits[i];
        else
            out[o++] = '0';
    }
    dsv4_chat_buf_put(b, out, (size_t)o);
}

void dsv4_chat_json_py(dsv4_chat_buf *b, const json_t *v) {
    char tmp[32];
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        const char *k;
        json_t *x;
        int first = 1;
        dsv4_chat_buf_put(b, "{", 1);
        json_object_foreach((json_t *)v, k, x) {
            if (!first) dsv4_chat_buf_put(b, ", ", 2);
            first = 0;
            dsv4_chat_json_py_string(b, k, strlen(k));
            dsv4_chat_buf_put(b, ": ", 2);
            dsv4_chat_json_py(b, x);
        }
        dsv4_chat_buf_put(b, "}", 1);
        break;
    }
    case JSON_ARRAY:
        dsv4_chat_buf_put(b, "[", 1);
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) dsv4_chat_buf_put(b, ", ", 2);
            dsv4_chat_json_py(b, json_array_get(v, i));
        }
        dsv4_chat_buf_put(b, "]", 1);
        break;
    case JSON_STRING:
        dsv4_chat_json_py_string(b, json_string_value(v), json_string_length(v));
        break;
    case JSON_INTEGER:
        snprintf(tmp, sizeof tmp, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        dsv4_chat_buf_puts(b, tmp);
        break;
    case JSON_REAL:
        py_float_repr(b, json_real_value(v));
        break;
    case JSON_TRUE:
        dsv4_chat_buf_puts(b, "true");
        break;
    case JSON_FALSE:
        dsv4_chat_buf_puts(b, "false");
        break;
    case JSON_NULL:
        dsv4_chat_buf_puts(b, "null");
        break;
    }
}

/* Python truthiness of a JSON value (absent counts as false): the reference
 * tests `if tools:`, `if response_format:`, `if tool_calls:`. */
static int py_truthy(const json_t *v) {
    if (!v) return 0;
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return json_object_size(v) > 0;
    case JSON_ARRAY:
        return json_array_size(v) > 0;
    case JSON_STRING:
        return json_string_length(v) > 0;
    case JSON_INTEGER:
        return json_integer_value(v) != 0;
    case JSON_REAL:
        return json_real_value(v) != 0;
    case JSON_TRUE:
        return 1;
    default:
        return 0;
    }
}

/* ------------------------------------------------------------------------- */
/* templates (encoding_dsv4.py constants)                                     */
/* ------------------------------------------------------------------------- */

#define DSML DSV4_CHAT_DSML

static const char REASONING_EFFORT_MAX[] =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/* The tool block; the schemas (one JSON line per function) go between HEAD and TAIL. */
static const char TOOLS_HEAD[] =
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<" DSML "tool_calls>\" block like the following:\n\n"
    "<" DSML "tool_calls>\n"
    "<" DSML "invoke name=\"$TOOL_NAME\">\n"
    "<" DSML "parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</" DSML "parameter>\n"
    "...\n"
    "</" DSML "invoke>\n"
    "<" DSML "invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</" DSML "invoke>\n"
    "</" DSML "tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n";
static const char TOOLS_TAIL[] =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

static const char RESPONSE_FORMAT_HEAD[] =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

static const char *const TASK_NAMES[] = {"action", "query", "authority", "domain", "title", "read_url"};
static const char *const TASK_TOKENS[] = {"<｜action｜>", "<｜query｜>", "<｜authority｜>",
                                          "<｜domain｜>", "<｜title｜>", "<｜read_url｜>"};
#define N_TASKS 6
#define TASK_ACTION 0

enum { R_SYSTEM, R_USER, R_ASSISTANT, R_TOOL, R_DEVELOPER, R_LATEST_REMINDER, N_ROLES };
static const char *const ROLE_NAMES[N_ROLES] = {"system", "user",      "assistant",
                                                "tool",   "developer", "latest_reminder"};

/* ------------------------------------------------------------------------- */
/* validated messages                                                         */
/* ------------------------------------------------------------------------- */

typedef struct {
    int is_tool; /* tool_result block, else text */
    const char *text;
    size_t len;
    const char *tool_use_id; /* "" when the tool message had none */
} block;

typedef struct {
    int role;
    int src; /* index in the caller's array; -1 for the inserted system message */
    const char *content;
    size_t content_len;
    int has_content;
    block *blocks; /* user messages after the tool merge */
    int nblocks, capblocks;
    const json_t *tools; /* the OpenAI list, only when truthy */
    const json_t *response_format;
    const json_t *tool_calls; /* only when truthy */
    const char *reasoning;
    size_t reasoning_len;
    const char *tool_call_id;
    int task; /* index into TASK_NAMES, -1 for none */
    int wo_eos;
} msg;

typedef struct {
    msg *m;
    int n, cap;
    char **owned; /* strings built while flattening content parts */
    int nowned, capowned;
} msgs;

static void msgs_free(msgs *l) {
    for (int i = 0; i < l->n; i++)
        free(l->m[i].blocks);
    free(l->m);
    for (int i = 0; i < l->nowned; i++)
        free(l->owned[i]);
    free(l->owned);
    memset(l, 0, sizeof *l);
}

static int grow(void **p, int *cap, int need, size_t elem, dsv4_err *err) {
    if (need <= *cap) return 0;
    int c = *cap ? *cap * 2 : 8;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    if (!q) return dsv4_errf(err, "chat: out of memory");
    *p = q;
    *cap = c;
    return 0;
}

static msg *msgs_push(msgs *l, dsv4_err *err) {
    if (grow((void **)&l->m, &l->cap, l->n + 1, sizeof(msg), err)) return NULL;
    msg *m = &l->m[l->n++];
    memset(m, 0, sizeof *m);
    m->task = -1;
    return m;
}

static int msg_add_block(msg *m, block b, dsv4_err *err) {
    if (grow((void **)&m->blocks, &m->capblocks, m->nblocks + 1, sizeof(block), err)) return -1;
    m->blocks[m->nblocks++] = b;
    return 0;
}

static int keep_owned(msgs *l, char *s, dsv4_err *err) {
    if (grow((void **)&l->owned, &l->capowned, l->nowned + 1, sizeof(char *), err)) {
        free(s);
        return -1;
    }
    l->owned[l->nowned++] = s;
    return 0;
}

/* A content value: a string, null/absent, or a list of parts.  Text parts are
 * joined with "\n\n" (as the reference joins the parts of a tool result).  A
 * part of another type is an error, except in tool results where the reference
 * writes "[Unsupported TYPE]". */
static int flatten_content(msgs *l, const json_t *c, int idx, int tool_style, msg *m, dsv4_err *err) {
    if (!c || json_is_null(c)) return 0;
    if (json_is_string(c)) {
        m->content = json_string_value(c);
        m->content_len = json_string_length(c);
        m->has_content = 1;
        return 0;
    }
    if (!json_is_array(c))
        return dsv4_errf(err, "messages[%d].content: must be a string or a list of parts, got %s", idx,
                         json_is_object(c) ? "an object" : "a scalar");
    dsv4_chat_buf b = {0};
    for (size_t j = 0; j < json_array_size(c); j++) {
        const json_t *part = json_array_get(c, j);
        const char *type = json_string_value(json_object_get(part, "type"));
        if (!json_is_object(part) || !type) {
            dsv4_chat_buf_free(&b);
            return dsv4_errf(err, "messages[%d].content[%zu]: must be an object with a string \"type\"", idx,
                             j);
        }
        if (j) dsv4_chat_buf_put(&b, "\n\n", 2);
        if (!strcmp(type, "text")) {
            const json_t *t = json_object_get(part, "text");
            if (!json_is_string(t)) {
                dsv4_chat_buf_free(&b);
                return dsv4_errf(err, "messages[%d].content[%zu].text: missing or not a string", idx, j);
            }
            dsv4_chat_buf_put(&b, json_string_value(t), json_string_length(t));
        } else if (tool_style) {
            dsv4_chat_buf_puts(&b, "[Unsupported ");
            dsv4_chat_buf_puts(&b, type);
            dsv4_chat_buf_puts(&b, "]");
        } else {
            dsv4_chat_buf_free(&b);
            return dsv4_errf(err, "messages[%d].content[%zu]: unsupported part type \"%s\" (only \"text\")",
                             idx, j, type);
        }
    }
    dsv4_chat_buf_put(&b, "", 0); /* make data non-NULL for an empty list */
    if (b.oom) {
        dsv4_chat_buf_free(&b);
        return dsv4_errf(err, "chat: out of memory");
    }
    if (keep_owned(l, b.data, err)) return -1;
    m->content = b.data;
    m->content_len = b.len;
    m->has_content = 1;
    return 0;
}

/* Checks an OpenAI tools list: [{type: "function", function: {name, ...}}]. */
static int check_tools(const json_t *tools, const char *where, dsv4_err *err) {
    if (!json_is_array(tools)) return dsv4_errf(err, "%s: must be a list of tool objects", where);
    for (size_t j = 0; j < json_array_size(tools); j++) {
        const json_t *t = json_array_get(tools, j);
        if (!json_is_object(t)) return dsv4_errf(err, "%s[%zu]: must be an object", where, j);
        const json_t *type = json_object_get(t, "type");
        if (type && !(json_is_string(type) && !strcmp(json_string_value(type), "function")))
            return dsv4_errf(err, "%s[%zu].type: must be \"function\"", where, j);
        const json_t *f = json_object_get(t, "function");
        if (!json_is_object(f)) return dsv4_errf(err, "%s[%zu].function: missing or not an object", where, j);
        if (!json_is_string(json_object_get(f, "name")))
            return dsv4_errf(err, "%s[%zu].function.name: missing or not a string", where, j);
    }
    return 0;
}

/* Parses tool_calls[j].function.arguments into an object of parameters (new
 * reference).  A JSON string is parsed; an empty string means no arguments; a
 * value that is not an object becomes the single parameter "arguments". */
static json_t *call_arguments(const json_t *args, int idx, size_t j, dsv4_err *err) {
    json_t *v;
    if (json_is_string(args)) {
        const char *s = json_string_value(args);
        size_t n = json_string_length(args), k = 0;
        while (k < n && (s[k] == ' ' || s[k] == '\t' || s[k] == '\n' || s[k] == '\r'))
            k++;
        if (k == n) return json_object();
        json_error_t je;
        v = json_loadb(s, n, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &je);
        if (!v) {
            dsv4_errf(err, "messages[%d].tool_calls[%zu].function.arguments: not valid JSON: %s (at %d:%d)",
                      idx, j, je.text, je.line, je.column);
            return NULL;
        }
    } else if (args && !json_is_null(args)) {
        v = json_incref((json_t *)args);
    } else {
        dsv4_errf(err, "messages[%d].tool_calls[%zu].function.arguments: missing", idx, j);
        return NULL;
    }
    if (json_is_object(v)) return v;
    json_t *o = json_object();
    if (!o || json_object_set_new(o, "arguments", v)) {
        json_decref(o);
        dsv4_errf(err, "chat: out of memory");
        return NULL;
    }
    return o;
}

static int check_tool_calls(const json_t *tc, int idx, dsv4_err *err) {
    if (!json_is_array(tc)) return dsv4_errf(err, "messages[%d].tool_calls: must be a list", idx);
    for (size_t j = 0; j < json_array_size(tc); j++) {
        const json_t *c = json_array_get(tc, j);
        if (!json_is_object(c))
            return dsv4_errf(err, "messages[%d].tool_calls[%zu]: must be an object", idx, j);
        const json_t *type = json_object_get(c, "type");
        if (type && !(json_is_string(type) && !strcmp(json_string_value(type), "function")))
            return dsv4_errf(err, "messages[%d].tool_calls[%zu].type: must be \"function\"", idx, j);
        const json_t *id = json_object_get(c, "id");
        if (id && !json_is_string(id) && !json_is_null(id))
            return dsv4_errf(err, "messages[%d].tool_calls[%zu].id: must be a string", idx, j);
        const json_t *f = json_object_get(c, "function");
        if (!json_is_object(f))
            return dsv4_errf(err, "messages[%d].tool_calls[%zu].function: missing or not an object", idx, j);
        const json_t *name = json_object_get(f, "name");
        if (!json_is_string(name) || !json_string_length(name))
            return dsv4_errf(err, "messages[%d].tool_calls[%zu].function.name: missing or empty", idx, j);
        json_t *a = call_arguments(json_object_get(f, "arguments"), idx, j, err);
        if (!a) return -1;
        json_decref(a);
    }
    return 0;
}

static int optional_string(const json_t *o, const char *key, int idx, const char **out, size_t *len,
                           dsv4_err *err) {
    const json_t *v = json_object_get(o, key);
    *out = NULL;
    if (len) *len = 0;
    if (!v || json_is_null(v)) return 0;
    if (!json_is_string(v)) return dsv4_errf(err, "messages[%d].%s: must be a string", idx, key);
    *out = json_string_value(v);
    if (len) *len = json_string_length(v);
    return 0;
}

/* Reads and checks messages[idx] into *m (fields borrowed from the JSON). */
static int read_message(msgs *l, const json_t *jm, int idx, msg *m, dsv4_err *err) {
    if (!json_is_object(jm)) return dsv4_errf(err, "messages[%d]: must be an object", idx);
    const json_t *jrole = json_object_get(jm, "role");
    if (!json_is_string(jrole)) return dsv4_errf(err, "messages[%d].role: missing or not a string", idx);
    const char *role = json_string_value(jrole);
    m->role = -1;
    for (int r = 0; r < N_ROLES; r++)
        if (!strcmp(role, ROLE_NAMES[r])) m->role = r;
    if (m->role < 0)
        return dsv4_errf(err,
                         "messages[%d].role: unknown role \"%s\" (system, user, assistant, tool, developer, "
                         "latest_reminder)",
                         idx, role);
    m->src = idx;
    if (flatten_content(l, json_object_get(jm, "content"), idx, m->role == R_TOOL, m, err)) return -1;
    int r = m->role;
    if ((r == R_USER || r == R_TOOL || r == R_LATEST_REMINDER) && !m->has_content)
        return dsv4_errf(err, "messages[%d].content: missing (required for role %s)", idx, role);
    /* the reference asserts truthy content for developer */
    if (r == R_DEVELOPER && (!m->has_content || !m->content_len))
        return dsv4_errf(err, "messages[%d].content: missing or empty (required for role developer)", idx);

    const json_t *tools = json_object_get(jm, "tools");
    if (tools && !json_is_null(tools)) {
        char where[64];
        snprintf(where, sizeof where, "messages[%d].tools", idx);
        if (check_tools(tools, where, err)) return -1;
        if (py_truthy(tools)) m->tools = tools;
    }
    const json_t *rf = json_object_get(jm, "response_format");
    if (py_truthy(rf)) m->response_format = rf;

    const json_t *tc = json_object_get(jm, "tool_calls");
    if (tc && !json_is_null(tc)) {
        if (r != R_ASSISTANT)
            return dsv4_errf(err, "messages[%d].tool_calls: only assistant messages carry tool calls", idx);
        if (check_tool_calls(tc, idx, err)) return -1;
        if (py_truthy(tc)) m->tool_calls = tc;
    }
    /* reasoning_content (DeepSeek/OpenAI-compatible name) or reasoning (vLLM's) */
    if (optional_string(jm, "reasoning_content", idx, &m->reasoning, &m->reasoning_len, err)) return -1;
    if (!m->reasoning && optional_string(jm, "reasoning", idx, &m->reasoning, &m->reasoning_len, err))
        return -1;
    if (optional_string(jm, "tool_call_id", idx, &m->tool_call_id, NULL, err)) return -1;

    const json_t *task = json_object_get(jm, "task");
    if (task && !json_is_null(task)) {
        const char *t = json_string_value(task);
        for (int k = 0; t && k < N_TASKS; k++)
            if (!strcmp(t, TASK_NAMES[k])) m->task = k;
        if (m->task < 0)
            return dsv4_errf(
                err, "messages[%d].task: must be one of action, query, authority, domain, title, read_url",
                idx);
    }
    const json_t *wo = json_object_get(jm, "wo_eos");
    if (wo && !json_is_boolean(wo) && !json_is_null(wo))
        return dsv4_errf(err, "messages[%d].wo_eos: must be a boolean", idx);
    m->wo_eos = json_is_true(wo);
    return 0;
}

/* ------------------------------------------------------------------------- */
/* preprocessing: merge tool messages, order results, drop old thinking       */
/* ------------------------------------------------------------------------- */

/* Tool messages become tool_result blocks of a user message; a user message
 * joins the previous merged user message unless that one has a task
 * (encoding_dsv4 merge_tool_messages). */
static int merge_tool_messages(const msgs *in, msgs *out, dsv4_err *err) {
    for (int i = 0; i < in->n; i++) {
        const msg *m = &in->m[i];
        msg *last = out->n ? &out->m[out->n - 1] : NULL;
        if (m->role == R_TOOL) {
            block b = {1, m->content, m->content_len, m->tool_call_id ? m->tool_call_id : ""};
            if (!(last && last->role == R_USER)) {
                last = msgs_push(out, err);
                if (!last) return -1;
                last->role = R_USER;
                last->src = m->src;
            }
            if (msg_add_block(last, b, err)) return -1;
        } else if (m->role == R_USER) {
            block b = {0, m->content, m->content_len, NULL};
            if (!(last && last->role == R_USER && last->task < 0)) {
                last = msgs_push(out, err);
                if (!last) return -1;
                last->role = R_USER;
                last->src = m->src;
                last->task = m->task;
                last->wo_eos = m->wo_eos;
                last->content = m->content;
                last->content_len = m->content_len;
                last->has_content = 1;
            }
            if (msg_add_block(last, b, err)) return -1;
        } else {
            msg *c = msgs_push(out, err);
            if (!c) return -1;
            *c = *m;
            c->blocks = NULL;
            c->nblocks = c->capblocks = 0;
        }
    }
    return 0;
}

static const char *call_id(const json_t *call) {
    const char *id = json_string_value(json_object_get(call, "id"));
    if (id && *id) return id;
    id = json_string_value(json_object_get(json_object_get(call, "function"), "id"));
    return id ? id : "";
}

/* Reorders each user message's tool_result blocks to the order of the latest
 * assistant tool_calls ids (a stable sort; unknown ids rank 0, as the
 * reference's dict.get(id, 0) does). */
static void sort_tool_results(msgs *l) {
    const json_t *calls = NULL;
    for (int i = 0; i < l->n; i++) {
        msg *m = &l->m[i];
        if (m->role == R_ASSISTANT && m->tool_calls) {
            calls = m->tool_calls;
            continue;
        }
        if (m->role != R_USER || !calls) continue;
        int has_ids = 0;
        for (size_t j = 0; j < json_array_size(calls); j++)
            if (*call_id(json_array_get(calls, j))) has_ids = 1;
        int ntool = 0;
        for (int k = 0; k < m->nblocks; k++)
            ntool += m->blocks[k].is_tool;
        if (ntool < 2 || !has_ids) continue;
        /* rank = index of the last call with that id (later duplicates overwrite, like a dict) */
        block *tools = calloc((size_t)ntool, sizeof(block));
        int *trank = calloc((size_t)ntool, sizeof(int));
        if (!tools || !trank) {
            free(tools), free(trank);
            continue; /* out of memory: leave the order as given */
        }
        int t = 0;
        for (int k = 0; k < m->nblocks; k++) {
            if (!m->blocks[k].is_tool) continue;
            int r = 0;
            for (size_t j = 0; j < json_array_size(calls); j++) {
                const char *id = call_id(json_array_get(calls, j));
                if (*id && !strcmp(id, m->blocks[k].tool_use_id)) r = (int)j;
            }
            tools[t] = m->blocks[k];
            trank[t++] = r;
        }
        for (int a = 1; a < ntool; a++) { /* insertion sort: stable */
            block b = tools[a];
            int r = trank[a], c = a - 1;
            while (c >= 0 && trank[c] > r) {
                tools[c + 1] = tools[c];
                trank[c + 1] = trank[c];
                c--;
            }
            tools[c + 1] = b;
            trank[c + 1] = r;
        }
        t = 0;
        for (int k = 0; k < m->nblocks; k++)
            if (m->blocks[k].is_tool) m->blocks[k] = tools[t++];
        free(tools), free(trank);
    }
}

static int last_user_index(const msgs *l) {
    for (int i = l->n - 1; i >= 0; i--)
        if (l->m[i].role == R_USER || l->m[i].role == R_DEVELOPER) return i;
    return -1;
}

/* Thinking mode with drop_thinking: developer messages before the last
 * user/developer message are removed (assistant reasoning there is not rendered
 * anyway). */
static void drop_thinking_messages(msgs *l) {
    int last = last_user_index(l), o = 0;
    for (int i = 0; i < l->n; i++) {
        if (l->m[i].role == R_DEVELOPER && i < last) {
            free(l->m[i].blocks);
            continue;
        }
        l->m[o++] = l->m[i];
    }
    l->n = o;
}

/* ------------------------------------------------------------------------- */
/* rendering                                                                  */
/* ------------------------------------------------------------------------- */

static void render_tools(dsv4_chat_buf *b, const json_t *tools) {
    dsv4_chat_buf_puts(b, TOOLS_HEAD);
    for (size_t j = 0; j < json_array_size(tools); j++) {
        if (j) dsv4_chat_buf_put(b, "\n", 1);
        dsv4_chat_json_py(b, json_object_get(json_array_get(tools, j), "function"));
    }
    dsv4_chat_buf_puts(b, TOOLS_TAIL);
}

static void render_extras(dsv4_chat_buf *b, const msg *m) {
    if (m->tools) {
        dsv4_chat_buf_puts(b, "\n\n");
        render_tools(b, m->tools);
    }
    if (m->response_format) {
        dsv4_chat_buf_puts(b, "\n\n");
        dsv4_chat_buf_puts(b, RESPONSE_FORMAT_HEAD);
        dsv4_chat_json_py(b, m->response_format);
    }
}

static int render_tool_calls(dsv4_chat_buf *b, const msg *m, dsv4_err *err) {
    dsv4_chat_buf_puts(b, "\n\n<" DSML "tool_calls>\n");
    for (size_t j = 0; j < json_array_size(m->tool_calls); j++) {
        const json_t *f = json_object_get(json_array_get(m->tool_calls, j), "function");
        if (j) dsv4_chat_buf_put(b, "\n", 1);
        dsv4_chat_buf_puts(b, "<" DSML "invoke name=\"");
        dsv4_chat_buf_puts(b, json_string_value(json_object_get(f, "name")));
        dsv4_chat_buf_puts(b, "\">\n");
        json_t *args = call_arguments(json_object_get(f, "arguments"), m->src, j, err);
        if (!args) return -1;
        const char *k;
        json_t *v;
        int first = 1;
        json_object_foreach(args, k, v) {
            if (!first) dsv4_chat_buf_put(b, "\n", 1);
            first = 0;
            dsv4_chat_buf_puts(b, "<" DSML "parameter name=\"");
            dsv4_chat_buf_puts(b, k);
            dsv4_chat_buf_puts(b, json_is_string(v) ? "\" string=\"true\">" : "\" string=\"false\">");
            if (json_is_string(v))
                dsv4_chat_buf_put(b, json_string_value(v), json_string_length(v));
            else
                dsv4_chat_json_py(b, v);
            dsv4_chat_buf_puts(b, "</" DSML "parameter>");
        }
        json_decref(args);
        dsv4_chat_buf_puts(b, "\n</" DSML "invoke>");
    }
    dsv4_chat_buf_puts(b, "\n</" DSML "tool_calls>");
    return 0;
}

/* encoding_dsv4 render_message: message IDX of L, then the transition tokens. */
static int render_message(dsv4_chat_buf *b, const msgs *l, int idx, const dsv4_chat_opts *o, int drop,
                          dsv4_err *err) {
    const msg *m = &l->m[idx];
    int thinking = o->mode == DSV4_CHAT_MODE_THINKING;
    int last_user = last_user_index(l);

    if (idx == 0 && thinking && o->effort == DSV4_EFFORT_MAX) dsv4_chat_buf_puts(b, REASONING_EFFORT_MAX);

    switch (m->role) {
    case R_SYSTEM:
        dsv4_chat_buf_put(b, m->content, m->content_len);
        render_extras(b, m);
        break;
    case R_DEVELOPER:
        dsv4_chat_buf_puts(b, DSV4_CHAT_USER);
        dsv4_chat_buf_put(b, m->content, m->content_len);
        render_extras(b, m);
        break;
    case R_USER:
        dsv4_chat_buf_puts(b, DSV4_CHAT_USER);
        for (int k = 0; k < m->nblocks; k++) {
            if (k) dsv4_chat_buf_put(b, "\n\n", 2);
            if (m->blocks[k].is_tool) dsv4_chat_buf_puts(b, "<tool_result>");
            dsv4_chat_buf_put(b, m->blocks[k].text, m->blocks[k].len);
            if (m->blocks[k].is_tool) dsv4_chat_buf_puts(b, "</tool_result>");
        }
        break;
    case R_LATEST_REMINDER:
        dsv4_chat_buf_puts(b, DSV4_CHAT_LATEST_REMINDER);
        dsv4_chat_buf_put(b, m->content, m->content_len);
        break;
    case R_ASSISTANT: {
        /* an assistant answering a task (e.g. the action verdict) has no thinking part */
        int prev_task = idx > 0 && l->m[idx - 1].task >= 0;
        if (thinking && !prev_task && (!drop || idx > last_user)) {
            if (m->reasoning) dsv4_chat_buf_put(b, m->reasoning, m->reasoning_len);
            dsv4_chat_buf_puts(b, DSV4_CHAT_THINK_CLOSE);
        }
        if (m->has_content) dsv4_chat_buf_put(b, m->content, m->content_len);
        if (m->tool_calls && render_tool_calls(b, m, err)) return -1;
        if (!m->wo_eos) dsv4_chat_buf_puts(b, DSV4_CHAT_EOS);
        break;
    }
    default: /* R_TOOL never reaches here: merged into user messages */
        return dsv4_errf(err, "messages[%d]: internal error: unmerged tool message", m->src);
    }

    if (idx + 1 < l->n && l->m[idx + 1].role != R_ASSISTANT && l->m[idx + 1].role != R_LATEST_REMINDER)
        return 0;
    if (m->task >= 0) {
        if (m->task != TASK_ACTION) {
            dsv4_chat_buf_puts(b, TASK_TOKENS[m->task]);
        } else {
            dsv4_chat_buf_puts(b, DSV4_CHAT_ASSISTANT);
            dsv4_chat_buf_puts(b, thinking ? DSV4_CHAT_THINK_OPEN : DSV4_CHAT_THINK_CLOSE);
            dsv4_chat_buf_puts(b, TASK_TOKENS[m->task]);
        }
    } else if (m->role == R_USER || m->role == R_DEVELOPER) {
        dsv4_chat_buf_puts(b, DSV4_CHAT_ASSISTANT);
        int open = thinking && (!drop || idx >= last_user);
        dsv4_chat_buf_puts(b, open ? DSV4_CHAT_THINK_OPEN : DSV4_CHAT_THINK_CLOSE);
    }
    return 0;
}

void dsv4_chat_opts_default(dsv4_chat_opts *o) {
    memset(o, 0, sizeof *o);
    o->mode = DSV4_CHAT_MODE_CHAT;
    o->drop_thinking = 1;
    o->effort = DSV4_EFFORT_NONE;
    o->add_bos = 1;
}

int dsv4_chat_effort_parse(const char *s, dsv4_effort *out, dsv4_err *err) {
    if (!s || !strcmp(s, "none"))
        *out = DSV4_EFFORT_NONE;
    else if (!strcmp(s, "high"))
        *out = DSV4_EFFORT_HIGH;
    else if (!strcmp(s, "max"))
        *out = DSV4_EFFORT_MAX;
    else
        return dsv4_errf(err, "reasoning_effort: \"%s\" is not one of none, high, max", s);
    return 0;
}

int dsv4_chat_prompt_opens_thinking(const char *prompt, size_t len) {
    size_t n = strlen(DSV4_CHAT_THINK_OPEN);
    return len >= n && !memcmp(prompt + len - n, DSV4_CHAT_THINK_OPEN, n);
}

int dsv4_chat_render(const json_t *messages, const json_t *tools, const dsv4_chat_opts *opts, char **out,
                     size_t *out_len, dsv4_err *err) {
    dsv4_chat_opts def;
    if (!opts) {
        dsv4_chat_opts_default(&def);
        opts = &def;
    }
    *out = NULL;
    if (out_len) *out_len = 0;
    if (!json_is_array(messages)) return dsv4_errf(err, "messages: must be a list of message objects");
    if (opts->mode != DSV4_CHAT_MODE_CHAT && opts->mode != DSV4_CHAT_MODE_THINKING)
        return dsv4_errf(err, "chat: invalid thinking mode %d", (int)opts->mode);
    if (opts->effort < DSV4_EFFORT_NONE || opts->effort > DSV4_EFFORT_MAX)
        return dsv4_errf(err, "chat: invalid reasoning effort %d", (int)opts->effort);
    if (tools && json_is_null(tools)) tools = NULL;
    if (tools && check_tools(tools, "tools", err)) return -1;

    msgs in = {0}, l = {0};
    dsv4_chat_buf b = {0};
    int rc = -1;
    size_t n = json_array_size(messages);
    if (n > (size_t)INT32_MAX / 2) {
        dsv4_errf(err, "messages: too many messages (%zu)", n);
        goto done;
    }
    /* the request-level tools / response_format ride on a system message */
    int attach = py_truthy(tools) || py_truthy(opts->response_format);
    const json_t *first = json_array_get(messages, 0);
    const json_t *first_role = json_object_get(first, "role");
    int first_is_system = json_is_string(first_role) && !strcmp(json_string_value(first_role), "system");
    if (attach && !first_is_system) {
        msg *s = msgs_push(&in, err);
        if (!s) goto done;
        s->role = R_SYSTEM;
        s->src = -1;
    }
    for (size_t i = 0; i < n; i++) {
        msg *m = msgs_push(&in, err);
        if (!m || read_message(&in, json_array_get(messages, i), (int)i, m, err)) goto done;
    }
    if (attach) {
        msg *s = &in.m[0];
        if (py_truthy(tools)) {
            if (s->tools) {
                dsv4_errf(err, "tools: given both for the request and on messages[0]; give them once");
                goto done;
            }
            s->tools = tools;
        }
        if (py_truthy(opts->response_format)) {
            if (s->response_format) {
                dsv4_errf(err,
                          "response_format: given both for the request and on messages[0]; give it once");
                goto done;
            }
            s->response_format = opts->response_format;
        }
    }

    if (merge_tool_messages(&in, &l, err)) goto done;
    sort_tool_results(&l);
    int drop = opts->drop_thinking;
    for (int i = 0; i < l.n; i++)
        if (l.m[i].tools) drop = 0;
    if (opts->mode == DSV4_CHAT_MODE_THINKING && drop) drop_thinking_messages(&l);

    if (opts->add_bos) dsv4_chat_buf_puts(&b, DSV4_CHAT_BOS);
    for (int i = 0; i < l.n; i++)
        if (render_message(&b, &l, i, opts, drop, err)) goto done;
    dsv4_chat_buf_put(&b, "", 0);
    if (b.oom) {
        dsv4_errf(err, "chat: out of memory rendering the prompt");
        goto done;
    }
    *out = b.data;
    if (out_len) *out_len = b.len;
    b.data = NULL;
    rc = 0;
done:
    dsv4_chat_buf_free(&b);
    /* l's messages alias in's owned strings; l owns only its block arrays */
    msgs_free(&l);
    msgs_free(&in);
    return rc;
}

int dsv4_chat_render_doc(const json_t *doc, const json_t *tools, const dsv4_chat_opts *opts, char **out,
                         size_t *out_len, dsv4_err *err) {
    dsv4_chat_opts o;
    if (opts)
        o = *opts;
    else
        dsv4_chat_opts_default(&o);
    *out = NULL;
    if (json_is_array(doc)) return dsv4_chat_render(doc, tools, &o, out, out_len, err);
    if (!json_is_object(doc))
        return dsv4_errf(err, "request: must be a list of messages or an object with \"messages\"");
    const json_t *messages = json_object_get(doc, "messages");
    if (!json_is_array(messages)) return dsv4_errf(err, "messages: missing or not a list");
    const json_t *t = json_object_get(doc, "tools");
    if (t && !json_is_null(t)) {
        if (tools && !json_is_null(tools))
            return dsv4_errf(err, "tools: given twice (in the request and apart)");
        tools = t;
    }
    const json_t *v;
    if ((v = json_object_get(doc, "thinking"))) {
        if (!json_is_boolean(v)) return dsv4_errf(err, "thinking: must be true or false");
        o.mode = json_is_true(v) ? DSV4_CHAT_MODE_THINKING : DSV4_CHAT_MODE_CHAT;
    }
    if ((v = json_object_get(doc, "thinking_mode"))) {
        const char *s = json_string_value(v);
        if (s && !strcmp(s, "thinking"))
            o.mode = DSV4_CHAT_MODE_THINKING;
        else if (s && !strcmp(s, "chat"))
            o.mode = DSV4_CHAT_MODE_CHAT;
        else
            return dsv4_errf(err, "thinking_mode: must be \"chat\" or \"thinking\"");
    }
    if ((v = json_object_get(doc, "reasoning_effort")) && !json_is_null(v)) {
        if (!json_is_string(v)) return dsv4_errf(err, "reasoning_effort: must be a string");
        if (dsv4_chat_effort_parse(json_string_value(v), &o.effort, err)) return -1;
    }
    if ((v = json_object_get(doc, "drop_thinking"))) {
        if (!json_is_boolean(v)) return dsv4_errf(err, "drop_thinking: must be true or false");
        o.drop_thinking = json_is_true(v);
    }
    if ((v = json_object_get(doc, "add_bos"))) {
        if (!json_is_boolean(v)) return dsv4_errf(err, "add_bos: must be true or false");
        o.add_bos = json_is_true(v);
    }
    if ((v = json_object_get(doc, "response_format")) && !json_is_null(v)) o.response_format = v;
    return dsv4_chat_render(messages, tools, &o, out, out_len, err);
}
