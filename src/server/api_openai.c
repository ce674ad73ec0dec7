/* server/api_openai: request parsing/validation and response building.  See
 * api_openai.h for the contract and docs/SERVER.md for the field table. */
#include "server/api_openai.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int dsv4_api_errorf(dsv4_api_error *e, int status, const char *type, const char *param, const char *code,
                    const char *fmt, ...) {
    if (!e) return -1;
    e->status = status;
    snprintf(e->type, sizeof e->type, "%s", type ? type : "invalid_request_error");
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    snprintf(e->code, sizeof e->code, "%s", code ? code : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

/* A 400 naming the field. */
#define BAD(e, param, ...) dsv4_api_errorf((e), 400, "invalid_request_error", (param), NULL, __VA_ARGS__)

/* ------------------------------------------------------------------------- */
/* JSON output: a small escaper (hot path of streaming)                      */
/* ------------------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s[0..n), 0 if invalid there. */
static size_t utf8_len_at(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t need;
    unsigned cp, min;
    if (c >= 0xC2 && c <= 0xDF) need = 2, cp = c & 0x1F, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) need = 3, cp = c & 0x0F, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) need = 4, cp = c & 0x07, min = 0x10000;
    else return 0;
    if (n < need) return 0;
    for (size_t i = 1; i < need; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return need;
}

void dsv4_api_json_string(dsv4_chat_buf *b, const char *s, size_t n) {
    static const char HEX[] = "0123456789abcdef";
    const unsigned char *u = (const unsigned char *)s;
    dsv4_chat_buf_put(b, "\"", 1);
    size_t run = 0; /* start of the pending plain run */
    size_t i = 0;
    while (i < n) {
        unsigned c = u[i];
        if (c >= 0x20 && c != '"' && c != '\\' && c < 0x80) {
            i++;
            continue;
        }
        size_t l = c >= 0x80 ? utf8_len_at(u + i, n - i) : 0;
        if (l) {
            i += l;
            continue;
        }
        dsv4_chat_buf_put(b, s + run, i - run);
        char esc[8];
        const char *e = esc;
        size_t el = 2;
        esc[0] = '\\';
        switch (c) {
        case '"': esc[1] = '"'; break;
        case '\\': esc[1] = '\\'; break;
        case '\n': esc[1] = 'n'; break;
        case '\r': esc[1] = 'r'; break;
        case '\t': esc[1] = 't'; break;
        case '\b': esc[1] = 'b'; break;
        case '\f': esc[1] = 'f'; break;
        default:
            if (c < 0x20) {
                memcpy(esc, "\\u00", 4);
                esc[4] = HEX[c >> 4];
                esc[5] = HEX[c & 15];
                el = 6;
            } else {
                e = "\xEF\xBF\xBD"; /* an invalid byte: U+FFFD */
                el = 3;
            }
        }
        dsv4_chat_buf_put(b, e, el);
        i++;
        run = i;
    }
    dsv4_chat_buf_put(b, s + run, n - run);
    dsv4_chat_buf_put(b, "\"", 1);
}

static void put_str(dsv4_chat_buf *b, const char *s) { dsv4_api_json_string(b, s, strlen(s)); }


/* A float as JSON (finite: %.9g; -inf logprobs become -9999, as OpenAI reports
 * impossible tokens). */
static void put_float(dsv4_chat_buf *b, double v) {
    if (!isfinite(v)) v = v < 0 ? -9999.0 : 0.0;
    dsv4_chat_buf_printf(b, "%.9g", v);
}

void dsv4_api_error_json(dsv4_chat_buf *b, const dsv4_api_error *e) {
    dsv4_chat_buf_puts(b, "{\"error\":{\"message\":");
    put_str(b, e->message);
    dsv4_chat_buf_puts(b, ",\"type\":");
    put_str(b, e->type[0] ? e->type : "invalid_request_error");
    dsv4_chat_buf_puts(b, ",\"param\":");
    if (e->param[0]) put_str(b, e->param);
    else dsv4_chat_buf_puts(b, "null");
    dsv4_chat_buf_puts(b, ",\"code\":");
    if (e->code[0]) put_str(b, e->code);
    else dsv4_chat_buf_puts(b, "null");
    dsv4_chat_buf_puts(b, "}}");
}

/* ------------------------------------------------------------------------- */
/* Field readers: null counts as absent (clients send explicit nulls)        */
/* ------------------------------------------------------------------------- */

const char *dsv4_api_json_kind(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

static const json_t *field(const json_t *o, const char *key) {
    const json_t *v = json_object_get(o, key);
    return v && !json_is_null(v) ? v : NULL;
}

/* 0 = absent (out untouched), 1 = read, -1 = error. */
static int get_bool(const json_t *o, const char *key, int *out, dsv4_api_error *e) {
    const json_t *v = field(o, key);
    if (!v) return 0;
    if (!json_is_boolean(v)) return BAD(e, key, "%s: must be a boolean, got %s", key, dsv4_api_json_kind(v));
    *out = json_is_true(v);
    return 1;
}

static int get_number(const json_t *o, const char *key, double lo, double hi, double *out, dsv4_api_error *e) {
    const json_t *v = field(o, key);
    if (!v) return 0;
    if (!json_is_number(v)) return BAD(e, key, "%s: must be a number, got %s", key, dsv4_api_json_kind(v));
    double d = json_number_value(v);
    if (!(d >= lo && d <= hi)) return BAD(e, key, "%s: %g is out of range [%g, %g]", key, d, lo, hi);
    *out = d;
    return 1;
}

static int get_int(const json_t *o, const char *key, long long lo, long long hi, long long *out,
                   dsv4_api_error *e) {
    const json_t *v = field(o, key);
    if (!v) return 0;
    long long x;
    if (json_is_integer(v)) x = json_integer_value(v);
    else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
             fabs(json_real_value(v)) < 9.0e15)
        x = (long long)json_real_value(v); /* 5.0 is an integer to JavaScript clients */
    else return BAD(e, key, "%s: must be an integer, got %s", key, dsv4_api_json_kind(v));
    if (x < lo || x > hi) return BAD(e, key, "%s: %lld is out of range [%lld, %lld]", key, x, lo, hi);
    *out = x;
    return 1;
}

static int get_string(const json_t *o, const char *key, const char **out, dsv4_api_error *e) {
    const json_t *v = field(o, key);
    if (!v) return 0;
    if (!json_is_string(v)) return BAD(e, key, "%s: must be a string, got %s", key, dsv4_api_json_kind(v));
    *out = json_string_value(v);
    return 1;
}

/* ------------------------------------------------------------------------- */
/* Sampling and stop fields shared by both endpoints                          */
/* ------------------------------------------------------------------------- */

static int parse_stop(const json_t *root, dsv4_api_request *r, dsv4_api_error *e) {
    const json_t *v = field(root, "stop");
    if (v) {
        if (json_is_string(v)) {
            if (json_string_length(v) == 0) return BAD(e, "stop", "stop: must not be an empty string");
            if (json_string_length(v) > DSV4_STOP_MAX_LEN)
                return BAD(e, "stop", "stop: longer than %d bytes", DSV4_STOP_MAX_LEN);
            r->stop[r->n_stop++] = dsv4_xstrdup(json_string_value(v));
        } else if (json_is_array(v)) {
            if (json_array_size(v) > DSV4_STOP_MAX_STRINGS)
                return BAD(e, "stop", "stop: %zu strings given, at most %d", json_array_size(v),
                           DSV4_STOP_MAX_STRINGS);
            size_t i;
            const json_t *s;
            json_array_foreach(v, i, s) {
                char p[32];
                snprintf(p, sizeof p, "stop[%zu]", i);
                if (!json_is_string(s)) return BAD(e, p, "%s: must be a string, got %s", p, dsv4_api_json_kind(s));
                if (json_string_length(s) == 0) return BAD(e, p, "%s: must not be empty", p);
                if (json_string_length(s) > DSV4_STOP_MAX_LEN)
                    return BAD(e, p, "%s: longer than %d bytes", p, DSV4_STOP_MAX_LEN);
                r->stop[r->n_stop++] = dsv4_xstrdup(json_string_value(s));
            }
        } else {
            return BAD(e, "stop", "stop: must be a string or an array of strings, got %s", dsv4_api_json_kind(v));
        }
    }
    v = field(root, "stop_token_ids"); /* vLLM's extension */
    if (v) {
        if (!json_is_array(v)) return BAD(e, "stop_token_ids", "stop_token_ids: must be an array of token ids");
        if (json_array_size(v) > DSV4_STOP_MAX_IDS - 1)
            return BAD(e, "stop_token_ids", "stop_token_ids: at most %d ids", DSV4_STOP_MAX_IDS - 1);
        size_t i;
        const json_t *s;
        json_array_foreach(v, i, s) {
            if (!json_is_integer(s) || json_integer_value(s) < 0)
                return BAD(e, "stop_token_ids", "stop_token_ids[%zu]: must be a non-negative integer", i);
            r->stop_ids[r->n_stop_ids++] = (int32_t)(json_integer_value(s) > INT32_MAX ? INT32_MAX
                                                                                        : json_integer_value(s));
        }
    }
    return 0;
}

static int parse_logit_bias(const json_t *root, int vocab, dsv4_api_request *r, dsv4_api_error *e) {
    const json_t *v = field(root, "logit_bias");
    if (!v) return 0;
    if (!json_is_object(v)) return BAD(e, "logit_bias", "logit_bias: must be an object of token id -> bias");
    size_t n = json_object_size(v);
    if (n == 0) return 0;
    if (n > DSV4_SAMPLER_MAX_LOGIT_BIAS)
        return BAD(e, "logit_bias", "logit_bias: %zu entries, at most %d", n, DSV4_SAMPLER_MAX_LOGIT_BIAS);
    r->bias_ids = dsv4_xcalloc(n, sizeof *r->bias_ids);
    r->bias_values = dsv4_xcalloc(n, sizeof *r->bias_values);
    const char *key;
    const json_t *val;
    int k = 0;
    json_object_foreach((json_t *)v, key, val) {
        char *end = NULL;
        errno = 0;
        long id = strtol(key, &end, 10);
        if (!key[0] || *end || errno || id < 0 || id >= vocab)
            return BAD(e, "logit_bias", "logit_bias: key \"%s\" is not a token id in [0, %d)", key, vocab);
        if (!json_is_number(val))
            return BAD(e, "logit_bias", "logit_bias[\"%s\"]: must be a number, got %s", key, dsv4_api_json_kind(val));
        double b = json_number_value(val);
        if (!(b >= -100 && b <= 100))
            return BAD(e, "logit_bias", "logit_bias[\"%s\"]: %g is out of range [-100, 100]", key, b);
        r->bias_ids[k] = (int32_t)id;
        r->bias_values[k] = (float)b;
        k++;
    }
    r->sampling.n_logit_bias = k;
    r->sampling.logit_bias_ids = r->bias_ids;
    r->sampling.logit_bias_values = r->bias_values;
    return 0;
}

static int parse_sampling(const json_t *root, const dsv4_api_limits *lim, dsv4_api_request *r,
                          dsv4_api_error *e) {
    dsv4_sampling_params *p = &r->sampling;
    double d;
    long long x;
    int rc;
    if ((rc = get_number(root, "temperature", 0, 2, &d, e)) < 0) return -1;
    if (rc) p->temperature = (float)d;
    if ((rc = get_number(root, "top_p", 0, 1, &d, e)) < 0) return -1;
    if (rc) p->top_p = (float)d;
    if ((rc = get_int(root, "top_k", -1, INT32_MAX, &x, e)) < 0) return -1;
    if (rc) p->top_k = (int)x;
    if ((rc = get_number(root, "min_p", 0, 1, &d, e)) < 0) return -1;
    if (rc) p->min_p = (float)d;
    if ((rc = get_number(root, "presence_penalty", -2, 2, &d, e)) < 0) return -1;
    if (rc) p->presence_penalty = (float)d;
    if ((rc = get_number(root, "frequency_penalty", -2, 2, &d, e)) < 0) return -1;
    if (rc) p->frequency_penalty = (float)d;
    if ((rc = get_number(root, "repetition_penalty", 1e-6, 100, &d, e)) < 0) return -1;
    if (rc) p->repetition_penalty = (float)d;
    if ((rc = get_int(root, "seed", INT64_MIN, INT64_MAX, &x, e)) < 0) return -1;
    if (rc) {
        p->has_seed = 1;
        p->seed = (uint64_t)x;
    }
    if ((rc = get_int(root, "n", 1, 1, &x, e)) < 0) {
        if (field(root, "n") && json_is_integer(field(root, "n")))
            return BAD(e, "n", "n: only n = 1 is supported (one choice per request)");
        return -1;
    }
    if (get_bool(root, "ignore_eos", &r->ignore_eos, e) < 0) return -1;
    if (parse_logit_bias(root, lim->vocab_size, r, e) < 0) return -1;
    if (parse_stop(root, r, e) < 0) return -1;

    /* max_completion_tokens is the newer name; given both, it wins */
    long long mt = 0;
    if ((rc = get_int(root, "max_tokens", 1, INT32_MAX, &mt, e)) < 0) return -1;
    if ((rc = get_int(root, "max_completion_tokens", 1, INT32_MAX, &mt, e)) < 0) return -1;
    r->max_tokens = (int)mt;

    if (get_bool(root, "stream", &r->stream, e) < 0) return -1;
    const json_t *so = field(root, "stream_options");
    if (so) {
        if (!json_is_object(so))
            return BAD(e, "stream_options", "stream_options: must be an object, got %s", dsv4_api_json_kind(so));
        const json_t *iu = field(so, "include_usage");
        if (iu && !json_is_boolean(iu))
            return BAD(e, "stream_options.include_usage", "stream_options.include_usage: must be a boolean, got %s",
                       dsv4_api_json_kind(iu));
        r->include_usage = iu && json_is_true(iu);
    }
    const char *model = NULL;
    if (get_string(root, "model", &model, e) < 0) return -1;
    snprintf(r->model, sizeof r->model, "%s", model ? model : (lim->model_id ? lim->model_id : "dsv4"));
    const char *user = NULL;
    if (get_string(root, "user", &user, e) < 0) return -1;
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Chat completions                                                           */
/* ------------------------------------------------------------------------- */

/* Every tool must be {type: "function", function: {name, parameters: object}}.
 * The renderer checks the outer shape too; the schema being an object is ours. */
static int check_tools(const json_t *tools, dsv4_api_error *e) {
    if (!json_is_array(tools)) return BAD(e, "tools", "tools: must be an array of tool objects, got %s", dsv4_api_json_kind(tools));
    size_t i;
    const json_t *t;
    json_array_foreach(tools, i, t) {
        char p[64];
        snprintf(p, sizeof p, "tools[%zu]", i);
        if (!json_is_object(t)) return BAD(e, p, "%s: must be an object, got %s", p, dsv4_api_json_kind(t));
        const json_t *type = field(t, "type");
        if (!json_is_string(type) || strcmp(json_string_value(type), "function"))
            return BAD(e, p, "%s.type: must be \"function\"", p);
        const json_t *f = field(t, "function");
        snprintf(p, sizeof p, "tools[%zu].function", i);
        if (!json_is_object(f)) return BAD(e, p, "%s: must be an object, got %s", p, f ? dsv4_api_json_kind(f) : "nothing");
        const json_t *name = field(f, "name");
        if (!json_is_string(name) || json_string_length(name) == 0)
            return BAD(e, p, "%s.name: must be a non-empty string", p);
        const json_t *params = field(f, "parameters");
        if (params && !json_is_object(params)) {
            snprintf(p, sizeof p, "tools[%zu].function.parameters", i);
            return BAD(e, p, "%s: must be a JSON Schema object, got %s", p, dsv4_api_json_kind(params));
        }
    }
    return 0;
}

/* tool_choice: "none" | "auto" | "required" | {type: function, function: {name}}.
 * Sets *use_tools to 0 for "none".  "required" and a named tool are accepted
 * but not enforced (no constrained decoding; docs/SERVER.md). */
static int check_tool_choice(const json_t *root, const json_t *tools, int *use_tools, dsv4_api_error *e) {
    const json_t *tc = field(root, "tool_choice");
    *use_tools = tools != NULL && json_array_size(tools) > 0;
    if (!tc) return 0;
    if (json_is_string(tc)) {
        const char *s = json_string_value(tc);
        if (!strcmp(s, "none")) *use_tools = 0;
        else if (strcmp(s, "auto") && strcmp(s, "required"))
            return BAD(e, "tool_choice", "tool_choice: \"%s\" is not one of none, auto, required or a function", s);
        if (!strcmp(s, "required") && !*use_tools)
            return BAD(e, "tool_choice", "tool_choice: \"required\" needs a non-empty tools list");
        return 0;
    }
    if (!json_is_object(tc)) return BAD(e, "tool_choice", "tool_choice: must be a string or an object, got %s", dsv4_api_json_kind(tc));
    const json_t *f = field(tc, "function");
    const json_t *name = f ? field(f, "name") : NULL;
    if (!json_is_string(name))
        return BAD(e, "tool_choice", "tool_choice: an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
    if (!tools) return BAD(e, "tool_choice", "tool_choice: names function \"%s\" but no tools were given", json_string_value(name));
    size_t i;
    const json_t *t;
    json_array_foreach(tools, i, t) {
        const json_t *tn = field(field(t, "function"), "name");
        if (tn && json_is_string(tn) && !strcmp(json_string_value(tn), json_string_value(name))) return 0;
    }
    return BAD(e, "tool_choice", "tool_choice: function \"%s\" is not in tools", json_string_value(name));
}

/* Thinking: explicit switches win (thinking.type, chat_template_kwargs.thinking),
 * then reasoning_effort (given and not "none" turns it on), then the model name
 * (lim->think_model, like DeepSeek's deepseek-reasoner).  Default: off. */
static int parse_thinking(const json_t *root, const dsv4_api_limits *lim, dsv4_api_request *r, dsv4_api_error *e) {
    int explicit_on = -1;
    const json_t *th = field(root, "thinking");
    if (th) {
        const json_t *type = json_is_object(th) ? field(th, "type") : NULL;
        if (json_is_boolean(th)) explicit_on = json_is_true(th);
        else if (json_is_string(type) && !strcmp(json_string_value(type), "enabled")) explicit_on = 1;
        else if (json_is_string(type) && !strcmp(json_string_value(type), "disabled")) explicit_on = 0;
        else return BAD(e, "thinking", "thinking: must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}");
    }
    const json_t *kw = field(root, "chat_template_kwargs");
    if (kw) {
        if (!json_is_object(kw)) return BAD(e, "chat_template_kwargs", "chat_template_kwargs: must be an object");
        const json_t *t = field(kw, "thinking");
        if (!t) t = field(kw, "enable_thinking");
        if (t) {
            if (!json_is_boolean(t))
                return BAD(e, "chat_template_kwargs.thinking", "chat_template_kwargs.thinking: must be a boolean");
            if (explicit_on < 0) explicit_on = json_is_true(t);
        }
    }
    const char *effort = NULL;
    if (get_string(root, "reasoning_effort", &effort, e) < 0) return -1;
    r->effort = DSV4_EFFORT_NONE;
    int effort_on = -1;
    if (effort) {
        /* OpenAI's names map onto V4's two levels; V4 only renders "max" differently */
        if (!strcmp(effort, "none")) effort_on = 0;
        else if (!strcmp(effort, "minimal") || !strcmp(effort, "low") || !strcmp(effort, "medium") ||
                 !strcmp(effort, "high"))
            effort_on = 1, r->effort = DSV4_EFFORT_HIGH;
        else if (!strcmp(effort, "max") || !strcmp(effort, "xhigh")) effort_on = 1, r->effort = DSV4_EFFORT_MAX;
        else
            return BAD(e, "reasoning_effort",
                       "reasoning_effort: \"%s\" is not one of none, minimal, low, medium, high, max", effort);
    }
    if (explicit_on >= 0) r->thinking = explicit_on;
    else if (effort_on >= 0) r->thinking = effort_on;
    else r->thinking = lim->think_model && !strcmp(r->model, lim->think_model);
    if (!r->thinking) r->effort = DSV4_EFFORT_NONE;
    return 0;
}

static int parse_chat(const json_t *root, const dsv4_api_limits *lim, dsv4_api_request *r, dsv4_api_error *e) {
    const json_t *msgs = json_object_get(root, "messages");
    if (!msgs || json_is_null(msgs)) return BAD(e, "messages", "messages: required");
    if (!json_is_array(msgs)) return BAD(e, "messages", "messages: must be an array, got %s", dsv4_api_json_kind(msgs));
    if (json_array_size(msgs) == 0) return BAD(e, "messages", "messages: must not be empty");
    size_t i;
    const json_t *m;
    json_array_foreach(msgs, i, m) {
        char p[48];
        snprintf(p, sizeof p, "messages[%zu]", i);
        if (!json_is_object(m)) return BAD(e, p, "%s: must be an object, got %s", p, dsv4_api_json_kind(m));
        const json_t *role = json_object_get(m, "role");
        snprintf(p, sizeof p, "messages[%zu].role", i);
        if (!json_is_string(role)) return BAD(e, p, "%s: missing or not a string", p);
    }

    if (get_bool(root, "logprobs", &r->logprobs, e) < 0) return -1;
    long long tl = 0;
    int rc = get_int(root, "top_logprobs", 0, DSV4_SAMPLER_MAX_TOP_LOGPROBS, &tl, e);
    if (rc < 0) return -1;
    if (rc && tl > 0 && !r->logprobs) return BAD(e, "top_logprobs", "top_logprobs: requires logprobs: true");
    r->top_logprobs = (int)tl;

    const json_t *tools = field(root, "tools");
    if (tools && check_tools(tools, e) < 0) return -1;
    int use_tools = 0;
    if (check_tool_choice(root, tools, &use_tools, e) < 0) return -1;
    r->parse_tools = use_tools;
    if (parse_thinking(root, lim, r, e) < 0) return -1;

    const json_t *rf = field(root, "response_format"), *schema = NULL;
    if (rf) {
        const json_t *type = json_is_object(rf) ? field(rf, "type") : NULL;
        if (!json_is_string(type))
            return BAD(e, "response_format", "response_format: must be an object with a string \"type\"");
        const char *t = json_string_value(type);
        if (!strcmp(t, "json_object")) schema = rf;
        else if (!strcmp(t, "json_schema")) {
            const json_t *js = field(rf, "json_schema");
            if (!json_is_object(js))
                return BAD(e, "response_format.json_schema", "response_format.json_schema: must be an object");
            const json_t *sc = field(js, "schema");
            if (sc && !json_is_object(sc))
                return BAD(e, "response_format.json_schema.schema", "response_format.json_schema.schema: must be an object");
            schema = sc ? sc : js;
        } else if (strcmp(t, "text"))
            return BAD(e, "response_format.type", "response_format.type: \"%s\" is not one of text, json_object, json_schema", t);
    }

    dsv4_chat_opts o;
    dsv4_chat_opts_default(&o);
    o.mode = r->thinking ? DSV4_CHAT_MODE_THINKING : DSV4_CHAT_MODE_CHAT;
    o.effort = r->effort;
    o.response_format = schema;
    dsv4_err err;
    if (dsv4_chat_render(msgs, use_tools ? tools : NULL, &o, &r->prompt, &r->prompt_len, &err) < 0) {
        /* the renderer's messages name the field first: "messages[3].role: ..." */
        char p[128];
        size_t k = strcspn(err.msg, ": ");
        snprintf(p, sizeof p, "%.*s", (int)(k < sizeof p - 1 ? k : sizeof p - 1), err.msg);
        if (strstr(err.msg, "out of memory"))
            return dsv4_api_errorf(e, 500, "server_error", NULL, NULL, "%s", err.msg);
        return BAD(e, p, "%s", err.msg);
    }
    r->opens_thinking = dsv4_chat_prompt_opens_thinking(r->prompt, r->prompt_len);
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Completions                                                                */
/* ------------------------------------------------------------------------- */

static int parse_ids(const json_t *arr, const char *param, int vocab, dsv4_api_request *r, dsv4_api_error *e) {
    size_t n = json_array_size(arr);
    if (n > INT32_MAX / 2) return BAD(e, param, "%s: too many tokens", param);
    r->prompt_ids = dsv4_xcalloc(n ? n : 1, sizeof *r->prompt_ids);
    size_t i;
    const json_t *v;
    json_array_foreach(arr, i, v) {
        if (!json_is_integer(v))
            return BAD(e, param, "%s[%zu]: must be an integer token id, got %s", param, i, dsv4_api_json_kind(v));
        json_int_t id = json_integer_value(v);
        if (id < 0 || id >= vocab)
            return BAD(e, param, "%s[%zu]: token id %" JSON_INTEGER_FORMAT " is out of range [0, %d)", param, i, id,
                       vocab);
        r->prompt_ids[i] = (int32_t)id;
    }
    r->n_prompt_ids = (int)n;
    r->prompt_is_ids = 1;
    return 0;
}

static int parse_completions(const json_t *root, const dsv4_api_limits *lim, dsv4_api_request *r,
                             dsv4_api_error *e) {
    const json_t *p = json_object_get(root, "prompt");
    if (!p || json_is_null(p)) return BAD(e, "prompt", "prompt: required");
    if (json_is_array(p) && json_array_size(p) > 0 &&
        (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0)))) {
        /* a batch of prompts: one per request here */
        if (json_array_size(p) != 1)
            return BAD(e, "prompt", "prompt: %zu prompts given; this server takes one per request",
                       json_array_size(p));
        p = json_array_get(p, 0);
    }
    if (json_is_string(p)) {
        r->prompt_len = json_string_length(p);
        r->prompt = malloc(r->prompt_len + 1);
        if (!r->prompt) return dsv4_api_errorf(e, 500, "server_error", NULL, NULL, "out of memory");
        memcpy(r->prompt, json_string_value(p), r->prompt_len + 1);
    } else if (json_is_array(p)) {
        if (parse_ids(p, "prompt", lim->vocab_size, r, e) < 0) return -1;
    } else {
        return BAD(e, "prompt", "prompt: must be a string or an array of token ids, got %s", dsv4_api_json_kind(p));
    }
    /* logprobs here is an integer: how many alternatives (0 = just the chosen) */
    const json_t *lp = field(root, "logprobs");
    if (lp) {
        long long x;
        if (json_is_boolean(lp)) {
            r->logprobs = json_is_true(lp);
        } else {
            if (get_int(root, "logprobs", 0, DSV4_SAMPLER_MAX_TOP_LOGPROBS, &x, e) < 0) return -1;
            r->logprobs = 1;
            r->top_logprobs = (int)x;
        }
    }
    int echo = 0;
    if (get_bool(root, "echo", &echo, e) < 0) return -1;
    if (echo) return BAD(e, "echo", "echo: true is not supported");
    long long best_of = 1;
    if (get_int(root, "best_of", 1, 1, &best_of, e) < 0) return BAD(e, "best_of", "best_of: only 1 is supported");
    const char *suffix = NULL;
    if (get_string(root, "suffix", &suffix, e) < 0) return -1;
    if (suffix && suffix[0]) return BAD(e, "suffix", "suffix: insertion is not supported");
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Entry points                                                               */
/* ------------------------------------------------------------------------- */

int dsv4_api_parse(dsv4_api_kind kind, const char *body, size_t len, const dsv4_api_limits *lim,
                   dsv4_api_request *out, dsv4_api_error *e) {
    memset(out, 0, sizeof *out);
    out->kind = kind;
    dsv4_sampling_params_default(&out->sampling);
    if (len == 0) return BAD(e, NULL, "request body: empty; expected a JSON object");
    size_t bad = 0;
    if (dsv4_utf8_validate(body, len, &bad) < 0)
        return BAD(e, NULL, "request body: invalid UTF-8 at byte %zu", bad);
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return BAD(e, NULL, "request body: malformed JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    int rc = dsv4_api_parse_value(kind, root, lim, out, e);
    json_decref(root);
    return rc;
}

int dsv4_api_parse_value(dsv4_api_kind kind, struct json_t *root, const dsv4_api_limits *lim,
                         dsv4_api_request *out, dsv4_api_error *e) {
    memset(out, 0, sizeof *out);
    out->kind = kind;
    dsv4_sampling_params_default(&out->sampling);
    int rc = -1;
    if (!json_is_object(root)) {
        BAD(e, NULL, "request body: must be a JSON object, got %s", dsv4_api_json_kind(root));
        goto done;
    }
    if (parse_sampling(root, lim, out, e) < 0) goto done;
    const json_t *fo = field(root, "dsv4_forced_output");
    if (fo && lim->test_hooks) {
        if (!json_is_string(fo) || json_string_length(fo) == 0) {
            BAD(e, "dsv4_forced_output", "dsv4_forced_output: must be a non-empty string");
            goto done;
        }
        out->forced = dsv4_xstrdup(json_string_value(fo));
    }
    if (kind == DSV4_API_CHAT ? parse_chat(root, lim, out, e) : parse_completions(root, lim, out, e)) goto done;
    out->sampling.logprobs = out->logprobs;
    out->sampling.top_logprobs = out->top_logprobs;
    dsv4_err err;
    if (dsv4_sampling_params_check(&out->sampling, lim->vocab_size, &err) < 0) {
        BAD(e, NULL, "%s", err.msg);
        goto done;
    }
    rc = 0;
done:
    if (rc < 0) dsv4_api_request_free(out);
    return rc;
}

int dsv4_api_prepare(dsv4_api_request *r, const dsv4_tokenizer *tok, const dsv4_api_limits *lim,
                     dsv4_api_error *e) {
    if (!r->prompt_is_ids) {
        dsv4_ids ids = {0};
        dsv4_err err;
        if (dsv4_tokenizer_encode(tok, r->prompt, r->prompt_len, 0, &ids, &err) < 0) {
            dsv4_ids_free(&ids);
            return BAD(e, r->kind == DSV4_API_CHAT ? "messages" : "prompt", "prompt: %s", err.msg);
        }
        if (ids.len > INT32_MAX) {
            dsv4_ids_free(&ids);
            return BAD(e, NULL, "prompt: too long");
        }
        free(r->prompt_ids);
        r->prompt_ids = ids.ids;
        r->n_prompt_ids = (int)ids.len;
    }
    if (r->forced) {
        dsv4_ids ids = {0};
        dsv4_err err;
        if (dsv4_tokenizer_encode(tok, r->forced, strlen(r->forced), 0, &ids, &err) < 0) {
            dsv4_ids_free(&ids);
            return BAD(e, "dsv4_forced_output", "dsv4_forced_output: %s", err.msg);
        }
        r->forced_ids = ids.ids;
        r->n_forced = (int)ids.len;
    }
    const char *param = r->kind == DSV4_API_CHAT ? "messages" : "prompt";
    if (r->n_prompt_ids == 0) return BAD(e, param, "prompt: empty (0 tokens)");
    if ((int64_t)r->n_prompt_ids >= lim->ctx)
        return dsv4_api_errorf(e, 400, "invalid_request_error", param, "context_length_exceeded",
                               "prompt is %d tokens, but the context is %" PRId64
                               " tokens (and at least one must be left to generate)",
                               r->n_prompt_ids, lim->ctx);
    if (r->max_tokens > 0 && (int64_t)r->n_prompt_ids + r->max_tokens > lim->ctx)
        return dsv4_api_errorf(e, 400, "invalid_request_error", "max_tokens", "context_length_exceeded",
                               "prompt (%d tokens) + max_tokens (%d) = %" PRId64
                               " tokens exceeds the context of %" PRId64 " tokens",
                               r->n_prompt_ids, r->max_tokens, (int64_t)r->n_prompt_ids + r->max_tokens, lim->ctx);
    return 0;
}

void dsv4_api_request_free(dsv4_api_request *r) {
    if (!r) return;
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->bias_ids);
    free(r->bias_values);
    free(r->prompt);
    free(r->prompt_ids);
    free(r->forced);
    free(r->forced_ids);
    dsv4_api_kind k = r->kind;
    memset(r, 0, sizeof *r);
    r->kind = k;
}

/* ------------------------------------------------------------------------- */
/* Collecting a whole response                                               */
/* ------------------------------------------------------------------------- */

void dsv4_api_result_add(dsv4_api_result *r, const dsv4_event *ev, int want_lp) {
    switch (ev->type) {
    case DSV4_EV_REASONING: dsv4_chat_buf_put(&r->reasoning, ev->text ? ev->text : "", ev->len); break;
    case DSV4_EV_CONTENT: dsv4_chat_buf_put(&r->content, ev->text ? ev->text : "", ev->len); break;
    case DSV4_EV_TOOL_CALL: {
        if (r->n_calls == r->cap_calls) {
            size_t cap = r->cap_calls ? r->cap_calls * 2 : 4;
            dsv4_api_call *c = realloc(r->calls, cap * sizeof *c);
            if (!c) {
                r->oom = 1;
                break;
            }
            r->calls = c;
            r->cap_calls = cap;
        }
        dsv4_api_call *c = &r->calls[r->n_calls++];
        memset(c, 0, sizeof *c);
        c->index = ev->tool_index;
        snprintf(c->id, sizeof c->id, "%s", ev->tool_id);
        c->name = dsv4_xstrdup(ev->tool_name ? ev->tool_name : "");
        c->arguments = dsv4_xstrdup(ev->text ? ev->text : "{}");
        break;
    }
    case DSV4_EV_TOKEN:
        if (!want_lp) break;
        if (r->n_lp == r->cap_lp) {
            size_t cap = r->cap_lp ? r->cap_lp * 2 : 64;
            dsv4_sample *p = realloc(r->lp, cap * sizeof *p);
            if (!p) {
                r->oom = 1;
                break;
            }
            r->lp = p;
            r->cap_lp = cap;
        }
        r->lp[r->n_lp++] = ev->sample;
        break;
    case DSV4_EV_FINISHED:
        r->finished = 1;
        r->finish = ev->finish;
        r->usage = ev->usage;
        free(r->message);
        r->message = ev->message ? dsv4_xstrdup(ev->message) : NULL;
        break;
    default: break;
    }
}

void dsv4_api_result_free(dsv4_api_result *r) {
    dsv4_chat_buf_free(&r->reasoning);
    dsv4_chat_buf_free(&r->content);
    for (size_t i = 0; i < r->n_calls; i++) {
        free(r->calls[i].name);
        free(r->calls[i].arguments);
    }
    free(r->calls);
    free(r->lp);
    free(r->message);
    memset(r, 0, sizeof *r);
}

const char *dsv4_api_finish_name(dsv4_finish_reason f) {
    switch (f) {
    case DSV4_FINISH_LENGTH: return "length";
    case DSV4_FINISH_TOOL_CALLS: return "tool_calls";
    case DSV4_FINISH_ERROR: return "error";
    default: return "stop";
    }
}

/* ------------------------------------------------------------------------- */
/* Building responses                                                         */
/* ------------------------------------------------------------------------- */

static void put_token_text(dsv4_chat_buf *b, const dsv4_api_reply *rp, int32_t id) {
    size_t n = 0;
    const char *s = rp->tok ? dsv4_tokenizer_id_bytes(rp->tok, id, &n) : NULL;
    if (!s) {
        s = "";
        n = 0;
    }
    dsv4_api_json_string(b, s, n);
}

static void put_token_bytes(dsv4_chat_buf *b, const dsv4_api_reply *rp, int32_t id) {
    size_t n = 0;
    const char *s = rp->tok ? dsv4_tokenizer_id_bytes(rp->tok, id, &n) : NULL;
    dsv4_chat_buf_put(b, "[", 1);
    for (size_t i = 0; s && i < n; i++) dsv4_chat_buf_printf(b, i ? ",%u" : "%u", (unsigned char)s[i]);
    dsv4_chat_buf_put(b, "]", 1);
}

/* Chat: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}. */
static void put_chat_logprobs(dsv4_chat_buf *b, const dsv4_api_reply *rp, const dsv4_sample *lp, size_t n) {
    dsv4_chat_buf_puts(b, "{\"content\":[");
    for (size_t i = 0; i < n; i++) {
        if (i) dsv4_chat_buf_put(b, ",", 1);
        dsv4_chat_buf_puts(b, "{\"token\":");
        put_token_text(b, rp, lp[i].token);
        dsv4_chat_buf_puts(b, ",\"logprob\":");
        put_float(b, lp[i].logprob);
        dsv4_chat_buf_puts(b, ",\"bytes\":");
        put_token_bytes(b, rp, lp[i].token);
        dsv4_chat_buf_puts(b, ",\"top_logprobs\":[");
        for (int k = 0; k < lp[i].n_top && k < rp->top_logprobs; k++) {
            if (k) dsv4_chat_buf_put(b, ",", 1);
            dsv4_chat_buf_puts(b, "{\"token\":");
            put_token_text(b, rp, lp[i].top_ids[k]);
            dsv4_chat_buf_puts(b, ",\"logprob\":");
            put_float(b, lp[i].top_logprobs[k]);
            dsv4_chat_buf_puts(b, ",\"bytes\":");
            put_token_bytes(b, rp, lp[i].top_ids[k]);
            dsv4_chat_buf_put(b, "}", 1);
        }
        dsv4_chat_buf_puts(b, "]}");
    }
    dsv4_chat_buf_puts(b, "]}");
}

/* Completions: {"tokens", "token_logprobs", "top_logprobs": [{tok: lp}], "text_offset"}.
 * Offsets count from the first token of this call. */
static void put_text_logprobs(dsv4_chat_buf *b, const dsv4_api_reply *rp, const dsv4_sample *lp, size_t n) {
    dsv4_chat_buf_puts(b, "{\"tokens\":[");
    for (size_t i = 0; i < n; i++) {
        if (i) dsv4_chat_buf_put(b, ",", 1);
        put_token_text(b, rp, lp[i].token);
    }
    dsv4_chat_buf_puts(b, "],\"token_logprobs\":[");
    for (size_t i = 0; i < n; i++) {
        if (i) dsv4_chat_buf_put(b, ",", 1);
        put_float(b, lp[i].logprob);
    }
    dsv4_chat_buf_puts(b, "],\"top_logprobs\":[");
    for (size_t i = 0; i < n; i++) {
        if (i) dsv4_chat_buf_put(b, ",", 1);
        dsv4_chat_buf_put(b, "{", 1);
        /* a JSON object keyed by token text: two tokens with the same text would
         * repeat a key, so only the first (the more likely) is kept */
        for (int k = 0; k < lp[i].n_top && k < rp->top_logprobs; k++) {
            int dup = 0;
            for (int j = 0; j < k && !dup; j++) {
                size_t na = 0, nb = 0;
                const char *a = dsv4_tokenizer_id_bytes(rp->tok, lp[i].top_ids[k], &na);
                const char *c = dsv4_tokenizer_id_bytes(rp->tok, lp[i].top_ids[j], &nb);
                dup = a && c && na == nb && !memcmp(a, c, na);
            }
            if (dup) continue;
            if (k) dsv4_chat_buf_put(b, ",", 1);
            put_token_text(b, rp, lp[i].top_ids[k]);
            dsv4_chat_buf_put(b, ":", 1);
            put_float(b, lp[i].top_logprobs[k]);
        }
        dsv4_chat_buf_put(b, "}", 1);
    }
    dsv4_chat_buf_puts(b, "],\"text_offset\":[");
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        dsv4_chat_buf_printf(b, i ? ",%zu" : "%zu", off);
        size_t l = 0;
        if (rp->tok && dsv4_tokenizer_id_bytes(rp->tok, lp[i].token, &l)) off += l;
    }
    dsv4_chat_buf_puts(b, "]}");
}

static void put_head(dsv4_chat_buf *b, const dsv4_api_reply *rp, int chunk) {
    dsv4_chat_buf_puts(b, "{\"id\":");
    put_str(b, rp->id);
    dsv4_chat_buf_puts(b, ",\"object\":");
    put_str(b, rp->kind == DSV4_API_CHAT ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion");
    dsv4_chat_buf_printf(b, ",\"created\":%lld,\"model\":", rp->created);
    put_str(b, rp->model);
    dsv4_chat_buf_puts(b, ",\"system_fingerprint\":\"dsv4\"");
}

static void put_usage(dsv4_chat_buf *b, const dsv4_usage *u) {
    dsv4_chat_buf_printf(b,
            "{\"prompt_tokens\":%" PRId64 ",\"completion_tokens\":%" PRId64 ",\"total_tokens\":%" PRId64
            ",\"prompt_tokens_details\":{\"cached_tokens\":%" PRId64 "}",
            u->prompt_tokens, u->completion_tokens, u->prompt_tokens + u->completion_tokens, u->cached_tokens);
    /* DeepSeek's API reports the cache split under these names as well */
    dsv4_chat_buf_printf(b, ",\"prompt_cache_hit_tokens\":%" PRId64 ",\"prompt_cache_miss_tokens\":%" PRId64 "}",
            u->cached_tokens, u->prompt_tokens - u->cached_tokens);
}

static void put_tool_call(dsv4_chat_buf *b, int index, int with_index, const char *id, const char *name,
                          const char *args, size_t args_len) {
    dsv4_chat_buf_put(b, "{", 1);
    if (with_index) dsv4_chat_buf_printf(b, "\"index\":%d,", index);
    dsv4_chat_buf_puts(b, "\"id\":");
    put_str(b, id);
    dsv4_chat_buf_puts(b, ",\"type\":\"function\",\"function\":{\"name\":");
    put_str(b, name);
    dsv4_chat_buf_puts(b, ",\"arguments\":");
    dsv4_api_json_string(b, args, args_len);
    dsv4_chat_buf_puts(b, "}}");
}

void dsv4_api_response_json(dsv4_chat_buf *b, const dsv4_api_reply *rp, const dsv4_api_result *res) {
    put_head(b, rp, 0);
    dsv4_chat_buf_puts(b, ",\"choices\":[{\"index\":0,");
    if (rp->kind == DSV4_API_CHAT) {
        dsv4_chat_buf_puts(b, "\"message\":{\"role\":\"assistant\",\"content\":");
        if (res->content.len || !res->n_calls)
            dsv4_api_json_string(b, res->content.data ? res->content.data : "", res->content.len);
        else dsv4_chat_buf_puts(b, "null");
        if (res->reasoning.len) {
            dsv4_chat_buf_puts(b, ",\"reasoning_content\":");
            dsv4_api_json_string(b, res->reasoning.data, res->reasoning.len);
        }
        if (res->n_calls) {
            dsv4_chat_buf_puts(b, ",\"tool_calls\":[");
            for (size_t i = 0; i < res->n_calls; i++) {
                if (i) dsv4_chat_buf_put(b, ",", 1);
                const dsv4_api_call *c = &res->calls[i];
                put_tool_call(b, c->index, 0, c->id, c->name, c->arguments, strlen(c->arguments));
            }
            dsv4_chat_buf_put(b, "]", 1);
        }
        dsv4_chat_buf_puts(b, "},\"logprobs\":");
        if (rp->logprobs) put_chat_logprobs(b, rp, res->lp, res->n_lp);
        else dsv4_chat_buf_puts(b, "null");
    } else {
        dsv4_chat_buf_puts(b, "\"text\":");
        dsv4_api_json_string(b, res->content.data ? res->content.data : "", res->content.len);
        dsv4_chat_buf_puts(b, ",\"logprobs\":");
        if (rp->logprobs) put_text_logprobs(b, rp, res->lp, res->n_lp);
        else dsv4_chat_buf_puts(b, "null");
    }
    dsv4_chat_buf_puts(b, ",\"finish_reason\":");
    put_str(b, dsv4_api_finish_name(res->finish));
    dsv4_chat_buf_puts(b, "}],\"usage\":");
    put_usage(b, &res->usage);
    dsv4_chat_buf_put(b, "}", 1);
}

/* ----- SSE ----- */

static void sse_open(dsv4_chat_buf *b, const dsv4_api_reply *rp) {
    dsv4_chat_buf_puts(b, "data: ");
    put_head(b, rp, 1);
    dsv4_chat_buf_puts(b, ",\"choices\":[{\"index\":0,");
}

static void sse_logprobs(dsv4_chat_buf *b, const dsv4_api_reply *rp, const dsv4_sample *lp, size_t n_lp) {
    dsv4_chat_buf_puts(b, ",\"logprobs\":");
    if (rp->logprobs && n_lp) {
        if (rp->kind == DSV4_API_CHAT) put_chat_logprobs(b, rp, lp, n_lp);
        else put_text_logprobs(b, rp, lp, n_lp);
    } else {
        dsv4_chat_buf_puts(b, "null");
    }
}

void dsv4_api_sse_role(dsv4_chat_buf *b, const dsv4_api_reply *rp) {
    if (rp->kind != DSV4_API_CHAT) return; /* completions have no role chunk */
    sse_open(b, rp);
    dsv4_chat_buf_puts(b, "\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
}

void dsv4_api_sse_text(dsv4_chat_buf *b, const dsv4_api_reply *rp, int reasoning, const char *text, size_t len,
                       const dsv4_sample *lp, size_t n_lp) {
    sse_open(b, rp);
    if (rp->kind == DSV4_API_CHAT) {
        dsv4_chat_buf_puts(b, reasoning ? "\"delta\":{\"reasoning_content\":" : "\"delta\":{\"content\":");
        dsv4_api_json_string(b, text, len);
        dsv4_chat_buf_put(b, "}", 1);
    } else {
        dsv4_chat_buf_puts(b, "\"text\":");
        dsv4_api_json_string(b, text, len);
    }
    sse_logprobs(b, rp, lp, n_lp);
    dsv4_chat_buf_puts(b, ",\"finish_reason\":null}]}\n\n");
}

void dsv4_api_sse_tool_call(dsv4_chat_buf *b, const dsv4_api_reply *rp, int index, const char *id, const char *name,
                            const char *arguments, size_t args_len) {
    sse_open(b, rp);
    dsv4_chat_buf_puts(b, "\"delta\":{\"tool_calls\":[");
    put_tool_call(b, index, 1, id, name, arguments ? arguments : "{}", arguments ? args_len : 2);
    dsv4_chat_buf_puts(b, "]},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
}

void dsv4_api_sse_finish(dsv4_chat_buf *b, const dsv4_api_reply *rp, dsv4_finish_reason f, const dsv4_sample *lp,
                         size_t n_lp) {
    sse_open(b, rp);
    dsv4_chat_buf_puts(b, rp->kind == DSV4_API_CHAT ? "\"delta\":{}" : "\"text\":\"\"");
    sse_logprobs(b, rp, lp, n_lp);
    dsv4_chat_buf_puts(b, ",\"finish_reason\":");
    put_str(b, dsv4_api_finish_name(f));
    dsv4_chat_buf_puts(b, "}]}\n\n");
}

void dsv4_api_sse_usage(dsv4_chat_buf *b, const dsv4_api_reply *rp, const dsv4_usage *u) {
    dsv4_chat_buf_puts(b, "data: ");
    put_head(b, rp, 1);
    dsv4_chat_buf_puts(b, ",\"choices\":[],\"usage\":");
    put_usage(b, u);
    dsv4_chat_buf_puts(b, "}\n\n");
}

void dsv4_api_sse_error(dsv4_chat_buf *b, const dsv4_api_error *e) {
    dsv4_chat_buf_puts(b, "data: ");
    dsv4_api_error_json(b, e);
    dsv4_chat_buf_puts(b, "\n\n");
}

void dsv4_api_sse_done(dsv4_chat_buf *b) { dsv4_chat_buf_puts(b, "data: [DONE]\n\n"); }
