/* server/api_anthropic: Anthropic Messages API <-> the chat request tree and
 * Anthropic's reply shapes.  See api_anthropic.h and docs/SERVER.md. */
#include "server/api_anthropic.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BAD(e, param, ...) dsv4_api_errorf((e), 400, "invalid_request_error", (param), NULL, __VA_ARGS__)

/* A present, non-null member. */
static json_t *member(const json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return v && !json_is_null(v) ? v : NULL;
}

/* Sets KEY of OUT to V (new reference consumed); 0 / -1 on out of memory. */
static int put(json_t *out, const char *key, json_t *v, dsv4_api_error *e) {
    if (!v || json_object_set_new(out, key, v))
        return dsv4_api_errorf(e, 500, "server_error", NULL, NULL, "out of memory translating the request");
    return 0;
}

static int push(json_t *arr, json_t *v, dsv4_api_error *e) {
    if (!v || json_array_append_new(arr, v))
        return dsv4_api_errorf(e, 500, "server_error", NULL, NULL, "out of memory translating the request");
    return 0;
}

/* Copies KEY from SRC to DST as is when present (the chat parser checks type and range). */
static int copy_field(json_t *dst, const json_t *src, const char *key, dsv4_api_error *e) {
    json_t *v = member(src, key);
    return v ? put(dst, key, json_incref(v), e) : 0;
}

/* Appends the text of a string, or of an array of {type: "text", text} blocks,
 * to B.  P names the field for errors. */
static int text_of(const json_t *v, const char *p, dsv4_chat_buf *b, dsv4_api_error *e) {
    if (json_is_string(v)) {
        dsv4_chat_buf_put(b, json_string_value(v), json_string_length(v));
        return 0;
    }
    if (!json_is_array(v)) return BAD(e, p, "%s: must be a string or an array of text blocks, got %s", p, dsv4_api_json_kind(v));
    size_t i;
    const json_t *blk;
    json_array_foreach(v, i, blk) {
        const json_t *type = json_is_object(blk) ? member(blk, "type") : NULL;
        const json_t *text = json_is_object(blk) ? member(blk, "text") : NULL;
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") || !json_is_string(text))
            return BAD(e, p, "%s[%zu]: must be a {\"type\": \"text\", \"text\": string} block", p, i);
        if (i && b->len) dsv4_chat_buf_put(b, "\n\n", 2);
        dsv4_chat_buf_put(b, json_string_value(text), json_string_length(text));
    }
    return 0;
}

static json_t *buf_string(dsv4_chat_buf *b) {
    json_t *s = json_stringn(b->data ? b->data : "", b->len);
    dsv4_chat_buf_free(b);
    return s;
}

/* One user turn: tool_result blocks become "tool" messages (in order), the
 * text blocks one user message after them. */
static int user_turn(const json_t *content, size_t idx, json_t *msgs, dsv4_api_error *e) {
    char p[96];
    snprintf(p, sizeof p, "messages[%zu].content", idx);
    if (json_is_string(content)) {
        json_t *m = json_object();
        if (put(m, "role", json_string("user"), e) || put(m, "content", json_incref((json_t *)content), e)) {
            json_decref(m);
            return -1;
        }
        return push(msgs, m, e);
    }
    if (!json_is_array(content)) return BAD(e, p, "%s: must be a string or an array of content blocks, got %s", p, dsv4_api_json_kind(content));
    if (json_array_size(content) == 0) return BAD(e, p, "%s: must not be empty", p);
    dsv4_chat_buf text = {0};
    int have_text = 0;
    size_t i;
    const json_t *blk;
    json_array_foreach(content, i, blk) {
        char q[128];
        snprintf(q, sizeof q, "%s[%zu]", p, i);
        const json_t *type = json_is_object(blk) ? member(blk, "type") : NULL;
        if (!json_is_string(type)) {
            dsv4_chat_buf_free(&text);
            return BAD(e, q, "%s: must be an object with a string \"type\"", q);
        }
        const char *t = json_string_value(type);
        if (!strcmp(t, "text")) {
            const json_t *s = member(blk, "text");
            if (!json_is_string(s)) {
                dsv4_chat_buf_free(&text);
                return BAD(e, q, "%s.text: must be a string", q);
            }
            if (have_text) dsv4_chat_buf_put(&text, "\n\n", 2);
            dsv4_chat_buf_put(&text, json_string_value(s), json_string_length(s));
            have_text = 1;
        } else if (!strcmp(t, "tool_result")) {
            const json_t *id = member(blk, "tool_use_id");
            if (!json_is_string(id) || json_string_length(id) == 0) {
                dsv4_chat_buf_free(&text);
                return BAD(e, q, "%s.tool_use_id: must be a non-empty string", q);
            }
            dsv4_chat_buf out = {0};
            const json_t *c = member(blk, "content");
            char qc[160];
            snprintf(qc, sizeof qc, "%s.content", q);
            if (c && text_of(c, qc, &out, e) < 0) {
                dsv4_chat_buf_free(&out);
                dsv4_chat_buf_free(&text);
                return -1;
            }
            const json_t *is_err = member(blk, "is_error");
            if (is_err && !json_is_boolean(is_err)) {
                dsv4_chat_buf_free(&out);
                dsv4_chat_buf_free(&text);
                return BAD(e, q, "%s.is_error: must be a boolean", q);
            }
            if (is_err && json_is_true(is_err)) {
                /* V4's format has no error flag: say so in the text the model reads */
                dsv4_chat_buf err = {0};
                dsv4_chat_buf_puts(&err, "Error: ");
                dsv4_chat_buf_put(&err, out.data ? out.data : "", out.len);
                dsv4_chat_buf_free(&out);
                out = err;
            }
            json_t *m = json_object(), *cs = buf_string(&out);
            if (!cs || put(m, "role", json_string("tool"), e) || put(m, "tool_call_id", json_incref((json_t *)id), e) ||
                put(m, "content", json_incref(cs), e)) {
                json_decref(cs);
                json_decref(m);
                dsv4_chat_buf_free(&text);
                return dsv4_api_errorf(e, 500, "server_error", NULL, NULL, "out of memory translating the request");
            }
            json_decref(cs);
            if (push(msgs, m, e)) {
                dsv4_chat_buf_free(&text);
                return -1;
            }
        } else if (!strcmp(t, "image") || !strcmp(t, "document")) {
            dsv4_chat_buf_free(&text);
            return BAD(e, q, "%s: \"%s\" blocks are not supported (the model reads text only)", q, t);
        } else {
            dsv4_chat_buf_free(&text);
            return BAD(e, q, "%s.type: \"%s\" is not a user content block (text, tool_result)", q, t);
        }
    }
    if (!have_text) {
        dsv4_chat_buf_free(&text);
        return 0;
    }
    json_t *m = json_object();
    if (put(m, "role", json_string("user"), e) || put(m, "content", buf_string(&text), e)) {
        json_decref(m);
        return -1;
    }
    return push(msgs, m, e);
}

/* One assistant turn: text -> content, thinking -> reasoning_content,
 * tool_use -> tool_calls (arguments as the input object). */
static int assistant_turn(const json_t *content, size_t idx, json_t *msgs, dsv4_api_error *e) {
    char p[96];
    snprintf(p, sizeof p, "messages[%zu].content", idx);
    json_t *m = json_object();
    if (put(m, "role", json_string("assistant"), e)) {
        json_decref(m);
        return -1;
    }
    if (json_is_string(content)) {
        if (put(m, "content", json_incref((json_t *)content), e)) goto fail;
        return push(msgs, m, e);
    }
    if (!json_is_array(content)) {
        BAD(e, p, "%s: must be a string or an array of content blocks, got %s", p, dsv4_api_json_kind(content));
        goto fail;
    }
    dsv4_chat_buf text = {0}, thinking = {0};
    json_t *calls = json_array();
    size_t i;
    const json_t *blk;
    json_array_foreach(content, i, blk) {
        char q[128];
        snprintf(q, sizeof q, "%s[%zu]", p, i);
        const json_t *type = json_is_object(blk) ? member(blk, "type") : NULL;
        if (!json_is_string(type)) {
            BAD(e, q, "%s: must be an object with a string \"type\"", q);
            goto fail_turn;
        }
        const char *t = json_string_value(type);
        if (!strcmp(t, "text")) {
            const json_t *s = member(blk, "text");
            if (!json_is_string(s)) {
                BAD(e, q, "%s.text: must be a string", q);
                goto fail_turn;
            }
            dsv4_chat_buf_put(&text, json_string_value(s), json_string_length(s));
        } else if (!strcmp(t, "thinking")) {
            const json_t *s = member(blk, "thinking");
            if (!json_is_string(s)) {
                BAD(e, q, "%s.thinking: must be a string", q);
                goto fail_turn;
            }
            dsv4_chat_buf_put(&thinking, json_string_value(s), json_string_length(s));
        } else if (!strcmp(t, "redacted_thinking")) {
            /* nothing readable to pass back */
        } else if (!strcmp(t, "tool_use")) {
            const json_t *id = member(blk, "id"), *name = member(blk, "name"), *input = member(blk, "input");
            if (!json_is_string(id) || json_string_length(id) == 0) {
                BAD(e, q, "%s.id: must be a non-empty string", q);
                goto fail_turn;
            }
            if (!json_is_string(name) || json_string_length(name) == 0) {
                BAD(e, q, "%s.name: must be a non-empty string", q);
                goto fail_turn;
            }
            if (input && !json_is_object(input)) {
                BAD(e, q, "%s.input: must be an object, got %s", q, dsv4_api_json_kind(input));
                goto fail_turn;
            }
            json_t *fn = json_object(), *call = json_object();
            int bad = put(fn, "name", json_incref((json_t *)name), e) ||
                      put(fn, "arguments", input ? json_incref((json_t *)input) : json_object(), e);
            bad = bad || put(call, "id", json_incref((json_t *)id), e) || put(call, "type", json_string("function"), e);
            if (bad) {
                json_decref(fn);
                json_decref(call);
                goto fail_turn;
            }
            if (put(call, "function", fn, e)) {
                json_decref(call);
                goto fail_turn;
            }
            if (push(calls, call, e)) goto fail_turn;
        } else {
            BAD(e, q, "%s.type: \"%s\" is not an assistant content block (text, thinking, tool_use)", q, t);
            goto fail_turn;
        }
    }
    if (put(m, "content", buf_string(&text), e)) goto fail_turn;
    if (thinking.len && put(m, "reasoning_content", buf_string(&thinking), e)) goto fail_turn;
    dsv4_chat_buf_free(&thinking);
    if (json_array_size(calls)) {
        if (put(m, "tool_calls", calls, e)) {
            json_decref(m);
            return -1;
        }
    } else {
        json_decref(calls);
    }
    return push(msgs, m, e);
fail_turn:
    dsv4_chat_buf_free(&text);
    dsv4_chat_buf_free(&thinking);
    json_decref(calls);
fail:
    json_decref(m);
    return -1;
}

/* tools: [{name, description, input_schema}] -> function tools. */
static int translate_tools(const json_t *tools, json_t *out, dsv4_api_error *e) {
    if (!json_is_array(tools)) return BAD(e, "tools", "tools: must be an array of tool objects, got %s", dsv4_api_json_kind(tools));
    json_t *arr = json_array();
    if (put(out, "tools", arr, e)) return -1;
    size_t i;
    const json_t *t;
    json_array_foreach(tools, i, t) {
        char p[64];
        snprintf(p, sizeof p, "tools[%zu]", i);
        if (!json_is_object(t)) return BAD(e, p, "%s: must be an object, got %s", p, dsv4_api_json_kind(t));
        const json_t *type = member(t, "type");
        if (type && (!json_is_string(type) || strcmp(json_string_value(type), "custom")))
            return BAD(e, p, "%s.type: only custom tools (no \"type\", or \"custom\") are supported", p);
        const json_t *name = member(t, "name"), *desc = member(t, "description"), *schema = member(t, "input_schema");
        if (!json_is_string(name) || json_string_length(name) == 0)
            return BAD(e, p, "%s.name: must be a non-empty string", p);
        if (desc && !json_is_string(desc)) return BAD(e, p, "%s.description: must be a string", p);
        if (!schema) return BAD(e, p, "%s.input_schema: required", p);
        if (!json_is_object(schema)) {
            snprintf(p, sizeof p, "tools[%zu].input_schema", i);
            return BAD(e, p, "%s: must be a JSON Schema object, got %s", p, dsv4_api_json_kind(schema));
        }
        json_t *fn = json_object();
        if (put(fn, "name", json_incref((json_t *)name), e) ||
            (desc && put(fn, "description", json_incref((json_t *)desc), e)) ||
            put(fn, "parameters", json_incref((json_t *)schema), e)) {
            json_decref(fn);
            return -1;
        }
        json_t *tool = json_object();
        if (put(tool, "type", json_string("function"), e) || put(tool, "function", fn, e) || push(arr, tool, e))
            return -1;
    }
    return 0;
}

/* tool_choice: {type: auto|any|tool|none, name} -> "auto" | "required" | named | "none". */
static int translate_tool_choice(const json_t *tc, json_t *out, dsv4_api_error *e) {
    const json_t *type = json_is_object(tc) ? member(tc, "type") : NULL;
    if (!json_is_string(type))
        return BAD(e, "tool_choice", "tool_choice: must be an object {\"type\": \"auto\"|\"any\"|\"tool\"|\"none\"}");
    const char *t = json_string_value(type);
    if (!strcmp(t, "auto")) return put(out, "tool_choice", json_string("auto"), e);
    if (!strcmp(t, "any")) return put(out, "tool_choice", json_string("required"), e);
    if (!strcmp(t, "none")) return put(out, "tool_choice", json_string("none"), e);
    if (!strcmp(t, "tool")) {
        const json_t *name = member(tc, "name");
        if (!json_is_string(name) || json_string_length(name) == 0)
            return BAD(e, "tool_choice.name", "tool_choice.name: a non-empty string is required with type \"tool\"");
        json_t *fn = json_object(), *o = json_object();
        if (put(fn, "name", json_incref((json_t *)name), e) || put(o, "type", json_string("function"), e) ||
            put(o, "function", fn, e)) {
            json_decref(o);
            return -1;
        }
        return put(out, "tool_choice", o, e);
    }
    return BAD(e, "tool_choice.type", "tool_choice.type: \"%s\" is not one of auto, any, tool, none", t);
}

/* Builds the chat-completions tree for ROOT into OUT. */
static int translate(const json_t *root, json_t *out, int test_hooks, dsv4_api_error *e) {
    const json_t *model = member(root, "model");
    if (!model) return BAD(e, "model", "model: required");
    if (!json_is_string(model)) return BAD(e, "model", "model: must be a string, got %s", dsv4_api_json_kind(model));
    if (put(out, "model", json_incref((json_t *)model), e)) return -1;

    const json_t *mt = member(root, "max_tokens");
    if (!mt) return BAD(e, "max_tokens", "max_tokens: required");
    if (!json_is_integer(mt) || json_integer_value(mt) < 1)
        return BAD(e, "max_tokens", "max_tokens: must be an integer >= 1, got %s", dsv4_api_json_kind(mt));
    if (put(out, "max_tokens", json_incref((json_t *)mt), e)) return -1;

    const json_t *temp = member(root, "temperature");
    if (temp) {
        if (!json_is_number(temp)) return BAD(e, "temperature", "temperature: must be a number, got %s", dsv4_api_json_kind(temp));
        double d = json_number_value(temp);
        if (!(d >= 0 && d <= 1)) return BAD(e, "temperature", "temperature: %g is out of range [0, 1]", d);
    }
    if (copy_field(out, root, "temperature", e) || copy_field(out, root, "top_p", e) ||
        copy_field(out, root, "top_k", e) || copy_field(out, root, "stream", e))
        return -1;
    if (test_hooks && copy_field(out, root, "dsv4_forced_output", e)) return -1;

    const json_t *ss = member(root, "stop_sequences");
    if (ss) {
        if (!json_is_array(ss))
            return BAD(e, "stop_sequences", "stop_sequences: must be an array of strings, got %s", dsv4_api_json_kind(ss));
        size_t i;
        const json_t *s;
        json_array_foreach(ss, i, s) {
            if (!json_is_string(s) || json_string_length(s) == 0)
                return BAD(e, "stop_sequences", "stop_sequences[%zu]: must be a non-empty string", i);
        }
        if (json_array_size(ss) > DSV4_STOP_MAX_STRINGS)
            return BAD(e, "stop_sequences", "stop_sequences: %zu given, at most %d", json_array_size(ss),
                       DSV4_STOP_MAX_STRINGS);
        if (json_array_size(ss) && put(out, "stop", json_incref((json_t *)ss), e)) return -1;
    }

    const json_t *th = member(root, "thinking");
    if (th) {
        const json_t *type = json_is_object(th) ? member(th, "type") : NULL;
        if (!json_is_string(type) ||
            (strcmp(json_string_value(type), "enabled") && strcmp(json_string_value(type), "disabled")))
            return BAD(e, "thinking", "thinking: must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}");
        int on = !strcmp(json_string_value(type), "enabled");
        const json_t *bt = member(th, "budget_tokens");
        if (on && !bt) return BAD(e, "thinking.budget_tokens", "thinking.budget_tokens: required when thinking is enabled");
        if (bt && (!json_is_integer(bt) || json_integer_value(bt) < 1))
            return BAD(e, "thinking.budget_tokens", "thinking.budget_tokens: must be an integer >= 1");
        json_t *o = json_object();
        if (put(o, "type", json_string(on ? "enabled" : "disabled"), e)) {
            json_decref(o);
            return -1;
        }
        if (put(out, "thinking", o, e)) return -1;
    }

    const json_t *tools = member(root, "tools");
    if (tools && translate_tools(tools, out, e) < 0) return -1;
    const json_t *tc = member(root, "tool_choice");
    if (tc && translate_tool_choice(tc, out, e) < 0) return -1;

    json_t *msgs = json_array();
    if (put(out, "messages", msgs, e)) return -1;
    const json_t *sys = member(root, "system");
    if (sys) {
        dsv4_chat_buf b = {0};
        if (text_of(sys, "system", &b, e) < 0) {
            dsv4_chat_buf_free(&b);
            return -1;
        }
        json_t *m = json_object();
        if (put(m, "role", json_string("system"), e) || put(m, "content", buf_string(&b), e)) {
            json_decref(m);
            return -1;
        }
        if (push(msgs, m, e)) return -1;
    }
    const json_t *in = json_object_get(root, "messages");
    if (!in || json_is_null(in)) return BAD(e, "messages", "messages: required");
    if (!json_is_array(in)) return BAD(e, "messages", "messages: must be an array, got %s", dsv4_api_json_kind(in));
    if (json_array_size(in) == 0) return BAD(e, "messages", "messages: must not be empty");
    size_t i;
    const json_t *m;
    json_array_foreach(in, i, m) {
        char p[64];
        snprintf(p, sizeof p, "messages[%zu]", i);
        if (!json_is_object(m)) return BAD(e, p, "%s: must be an object, got %s", p, dsv4_api_json_kind(m));
        const json_t *role = member(m, "role"), *content = member(m, "content");
        snprintf(p, sizeof p, "messages[%zu].role", i);
        if (!json_is_string(role)) return BAD(e, p, "%s: missing or not a string", p);
        const char *r = json_string_value(role);
        if (!content) {
            snprintf(p, sizeof p, "messages[%zu].content", i);
            return BAD(e, p, "%s: required", p);
        }
        int rc;
        if (!strcmp(r, "user")) rc = user_turn(content, i, msgs, e);
        else if (!strcmp(r, "assistant")) rc = assistant_turn(content, i, msgs, e);
        else return BAD(e, p, "%s: unknown role \"%s\" (user or assistant; the system prompt is the top-level \"system\")", p, r);
        if (rc < 0) return -1;
    }
    return 0;
}

int dsv4_anth_parse(const char *body, size_t len, const dsv4_api_limits *lim, dsv4_api_request *out,
                    dsv4_api_error *e) {
    memset(out, 0, sizeof *out);
    out->kind = DSV4_API_CHAT;
    if (len == 0) return BAD(e, NULL, "request body: empty; expected a JSON object");
    size_t bad = 0;
    if (dsv4_utf8_validate(body, len, &bad) < 0) return BAD(e, NULL, "request body: invalid UTF-8 at byte %zu", bad);
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return BAD(e, NULL, "request body: malformed JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    if (!json_is_object(root)) {
        BAD(e, NULL, "request body: must be a JSON object, got %s", dsv4_api_json_kind(root));
        json_decref(root);
        return -1;
    }
    json_t *chat = json_object();
    int rc = chat ? translate(root, chat, lim->test_hooks, e)
                  : dsv4_api_errorf(e, 500, "server_error", NULL, NULL, "out of memory translating the request");
    json_decref(root);
    if (rc == 0) rc = dsv4_api_parse_value(DSV4_API_CHAT, chat, lim, out, e);
    json_decref(chat);
    return rc;
}

/* ------------------------------------------------------------------------- */
/* Replies                                                                    */
/* ------------------------------------------------------------------------- */

const char *dsv4_anth_error_type(int status) {
    switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503: return "overloaded_error";
    default: return status >= 500 ? "api_error" : "invalid_request_error";
    }
}

static void put_str(dsv4_chat_buf *b, const char *s) { dsv4_api_json_string(b, s, strlen(s)); }


void dsv4_anth_error_json(dsv4_chat_buf *b, const dsv4_api_error *e) {
    dsv4_chat_buf_puts(b, "{\"type\":\"error\",\"error\":{\"type\":");
    put_str(b, dsv4_anth_error_type(e->status));
    dsv4_chat_buf_puts(b, ",\"message\":");
    put_str(b, e->message);
    dsv4_chat_buf_puts(b, "}}");
}

const char *dsv4_anth_stop_reason(dsv4_finish_reason f, const char *stop_seq) {
    switch (f) {
    case DSV4_FINISH_LENGTH: return "max_tokens";
    case DSV4_FINISH_TOOL_CALLS: return "tool_use";
    default: return stop_seq ? "stop_sequence" : "end_turn";
    }
}

const char *dsv4_anth_matched_stop(const dsv4_api_request *r, const char *raw, size_t n) {
    const char *best = NULL;
    size_t best_at = (size_t)-1;
    for (int i = 0; i < r->n_stop; i++) {
        size_t l = strlen(r->stop[i]);
        if (!l || l > n) continue;
        for (size_t at = 0; at + l <= n && at < best_at; at++) {
            if (!memcmp(raw + at, r->stop[i], l)) {
                best = r->stop[i];
                best_at = at;
                break;
            }
        }
    }
    return best;
}

/* The tool input object: the arguments text when it is a JSON object, else
 * {"arguments": text} so the field is always an object. */
static void put_input(dsv4_chat_buf *b, const char *args, size_t n) {
    json_t *v = n ? json_loadb(args, n, JSON_REJECT_DUPLICATES, NULL) : json_object();
    if (v && json_is_object(v)) dsv4_chat_buf_put(b, args && n ? args : "{}", n ? n : 2);
    else {
        dsv4_chat_buf_puts(b, "{\"arguments\":");
        dsv4_api_json_string(b, args ? args : "", n);
        dsv4_chat_buf_puts(b, "}");
    }
    json_decref(v);
}

static void put_usage(dsv4_chat_buf *b, const dsv4_usage *u) {
    dsv4_chat_buf_printf(b,
            "{\"input_tokens\":%" PRId64 ",\"output_tokens\":%" PRId64 ",\"cache_read_input_tokens\":%" PRId64
            ",\"cache_creation_input_tokens\":0}",
            u->prompt_tokens - u->cached_tokens, u->completion_tokens, u->cached_tokens);
}

void dsv4_anth_response_json(dsv4_chat_buf *b, const dsv4_api_reply *rp, const dsv4_api_result *res,
                             const char *stop_seq) {
    dsv4_chat_buf_puts(b, "{\"id\":");
    put_str(b, rp->id);
    dsv4_chat_buf_puts(b, ",\"type\":\"message\",\"role\":\"assistant\",\"model\":");
    put_str(b, rp->model);
    dsv4_chat_buf_puts(b, ",\"content\":[");
    int n = 0;
    if (res->reasoning.len) {
        dsv4_chat_buf_puts(b, "{\"type\":\"thinking\",\"thinking\":");
        dsv4_api_json_string(b, res->reasoning.data, res->reasoning.len);
        dsv4_chat_buf_puts(b, ",\"signature\":\"\"}");
        n++;
    }
    if (res->content.len || !res->n_calls) {
        if (n++) dsv4_chat_buf_put(b, ",", 1);
        dsv4_chat_buf_puts(b, "{\"type\":\"text\",\"text\":");
        dsv4_api_json_string(b, res->content.data ? res->content.data : "", res->content.len);
        dsv4_chat_buf_puts(b, "}");
    }
    for (size_t i = 0; i < res->n_calls; i++) {
        const dsv4_api_call *c = &res->calls[i];
        if (n++) dsv4_chat_buf_put(b, ",", 1);
        dsv4_chat_buf_puts(b, "{\"type\":\"tool_use\",\"id\":");
        put_str(b, c->id);
        dsv4_chat_buf_puts(b, ",\"name\":");
        put_str(b, c->name);
        dsv4_chat_buf_puts(b, ",\"input\":");
        put_input(b, c->arguments, strlen(c->arguments));
        dsv4_chat_buf_puts(b, "}");
    }
    dsv4_chat_buf_puts(b, "],\"stop_reason\":");
    put_str(b, dsv4_anth_stop_reason(res->finish, stop_seq));
    dsv4_chat_buf_puts(b, ",\"stop_sequence\":");
    if (stop_seq && res->finish == DSV4_FINISH_STOP) put_str(b, stop_seq);
    else dsv4_chat_buf_puts(b, "null");
    dsv4_chat_buf_puts(b, ",\"usage\":");
    put_usage(b, &res->usage);
    dsv4_chat_buf_puts(b, "}");
}

/* ----- SSE ----- */

static void event_open(dsv4_chat_buf *b, const char *name) {
    dsv4_chat_buf_puts(b, "event: ");
    dsv4_chat_buf_puts(b, name);
    dsv4_chat_buf_puts(b, "\ndata: ");
}

static void close_block(dsv4_chat_buf *b, dsv4_anth_stream *st) {
    if (!st->open) return;
    event_open(b, "content_block_stop");
    dsv4_chat_buf_printf(b, "{\"type\":\"content_block_stop\",\"index\":%d}\n\n", st->next_index - 1);
    st->open = 0;
}

void dsv4_anth_sse_start(dsv4_chat_buf *b, dsv4_anth_stream *st, const dsv4_api_reply *rp, int64_t input_tokens) {
    memset(st, 0, sizeof *st);
    event_open(b, "message_start");
    dsv4_chat_buf_puts(b, "{\"type\":\"message_start\",\"message\":{\"id\":");
    put_str(b, rp->id);
    dsv4_chat_buf_puts(b, ",\"type\":\"message\",\"role\":\"assistant\",\"model\":");
    put_str(b, rp->model);
    dsv4_chat_buf_printf(b,
            ",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":%" PRId64
            ",\"output_tokens\":0}}}\n\n",
            input_tokens);
}

void dsv4_anth_sse_text(dsv4_chat_buf *b, dsv4_anth_stream *st, int reasoning, const char *text, size_t len) {
    int want = reasoning ? 2 : 1;
    if (st->open != want) {
        close_block(b, st);
        event_open(b, "content_block_start");
        dsv4_chat_buf_printf(b, "{\"type\":\"content_block_start\",\"index\":%d,\"content_block\":", st->next_index);
        dsv4_chat_buf_puts(b, reasoning ? "{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n"
                                        : "{\"type\":\"text\",\"text\":\"\"}}\n\n");
        st->next_index++;
        st->open = want;
    }
    event_open(b, "content_block_delta");
    dsv4_chat_buf_printf(b, "{\"type\":\"content_block_delta\",\"index\":%d,\"delta\":", st->next_index - 1);
    dsv4_chat_buf_puts(b, reasoning ? "{\"type\":\"thinking_delta\",\"thinking\":" : "{\"type\":\"text_delta\",\"text\":");
    dsv4_api_json_string(b, text, len);
    dsv4_chat_buf_puts(b, "}}\n\n");
}

void dsv4_anth_sse_tool_use(dsv4_chat_buf *b, dsv4_anth_stream *st, const char *id, const char *name,
                            const char *args, size_t args_len) {
    close_block(b, st);
    int idx = st->next_index++;
    event_open(b, "content_block_start");
    dsv4_chat_buf_printf(b, "{\"type\":\"content_block_start\",\"index\":%d,\"content_block\":{\"type\":\"tool_use\",\"id\":", idx);
    put_str(b, id);
    dsv4_chat_buf_puts(b, ",\"name\":");
    put_str(b, name);
    dsv4_chat_buf_puts(b, ",\"input\":{}}}\n\n");
    dsv4_chat_buf tmp = {0};
    put_input(&tmp, args, args ? args_len : 0);
    event_open(b, "content_block_delta");
    dsv4_chat_buf_printf(b, "{\"type\":\"content_block_delta\",\"index\":%d,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":",
            idx);
    dsv4_api_json_string(b, tmp.data ? tmp.data : "{}", tmp.data ? tmp.len : 2);
    dsv4_chat_buf_free(&tmp);
    dsv4_chat_buf_puts(b, "}}\n\n");
    event_open(b, "content_block_stop");
    dsv4_chat_buf_printf(b, "{\"type\":\"content_block_stop\",\"index\":%d}\n\n", idx);
}

void dsv4_anth_sse_finish(dsv4_chat_buf *b, dsv4_anth_stream *st, dsv4_finish_reason f, const char *stop_seq,
                          const dsv4_usage *u) {
    close_block(b, st);
    event_open(b, "message_delta");
    dsv4_chat_buf_puts(b, "{\"type\":\"message_delta\",\"delta\":{\"stop_reason\":");
    put_str(b, dsv4_anth_stop_reason(f, stop_seq));
    dsv4_chat_buf_puts(b, ",\"stop_sequence\":");
    if (stop_seq && f == DSV4_FINISH_STOP) put_str(b, stop_seq);
    else dsv4_chat_buf_puts(b, "null");
    dsv4_chat_buf_puts(b, "},\"usage\":");
    put_usage(b, u);
    dsv4_chat_buf_puts(b, "}\n\n");
    event_open(b, "message_stop");
    dsv4_chat_buf_puts(b, "{\"type\":\"message_stop\"}\n\n");
}

void dsv4_anth_sse_error(dsv4_chat_buf *b, const dsv4_api_error *e) {
    event_open(b, "error");
    dsv4_anth_error_json(b, e);
    dsv4_chat_buf_puts(b, "\n\n");
}
