/* text/chat: renders a conversation into the DeepSeek-V4 prompt text (spec §5.2).
 *
 * Owns: the V4 chat encoding (the rules of DeepSeek's encoding_dsv4.py, April
 * release, re-implemented here; see docs/CHAT_FORMAT.md), and a serialiser that
 * writes JSON exactly as Python's json.dumps(v, ensure_ascii=False) does, because
 * the prompt embeds tool schemas and tool-call arguments in that form.
 * Parsing the model's output back is text/dsml.h.
 *
 * Input is OpenAI-shaped JSON (jansson values): messages with roles system, user,
 * assistant, tool, developer, latest_reminder; an optional OpenAI `tools` list.
 * Output is a malloc'd NUL-terminated string (the caller frees it).
 * Lifetime: nothing is kept between calls.  Threads: every function is
 * reentrant.  Errors: 0 / -1 with a dsv4_err naming the message index and field
 * ("messages[3].tool_calls[0].function.arguments: not valid JSON: ...").
 */
#ifndef DSV4_TEXT_CHAT_H
#define DSV4_TEXT_CHAT_H

#include <jansson.h>
#include <stddef.h>

#include "util/err.h"

/* The special strings of the V4 format (written as text; the tokenizer maps
 * them to single ids).  Note the full-width bar U+FF5C and U+2581. */
#define DSV4_CHAT_BOS "<｜begin▁of▁sentence｜>"
#define DSV4_CHAT_EOS "<｜end▁of▁sentence｜>"
#define DSV4_CHAT_USER "<｜User｜>"
#define DSV4_CHAT_ASSISTANT "<｜Assistant｜>"
#define DSV4_CHAT_LATEST_REMINDER "<｜latest_reminder｜>"
#define DSV4_CHAT_THINK_OPEN "<think>"
#define DSV4_CHAT_THINK_CLOSE "</think>"
#define DSV4_CHAT_DSML "｜DSML｜"

typedef enum { DSV4_CHAT_MODE_CHAT = 0, DSV4_CHAT_MODE_THINKING = 1 } dsv4_chat_mode;

/* Only "max" changes the April-release prompt; "high" renders like none. */
typedef enum { DSV4_EFFORT_NONE = 0, DSV4_EFFORT_HIGH = 1, DSV4_EFFORT_MAX = 2 } dsv4_effort;

typedef struct dsv4_chat_opts {
    dsv4_chat_mode mode;
    int drop_thinking; /* default 1; forced off when any message carries tools */
    dsv4_effort effort;
    int add_bos; /* default 1 */
    /* JSON schema appended to the system prompt ("## Response Format: ...");
     * NULL for none.  Borrowed. */
    const json_t *response_format;
} dsv4_chat_opts;

/* Fills the defaults: chat mode, drop_thinking 1, no effort, add_bos 1. */
void dsv4_chat_opts_default(dsv4_chat_opts *o);

/* Renders MESSAGES (a JSON array) with the OpenAI TOOLS list (NULL or JSON null
 * for none) into *OUT (malloc'd, NUL-terminated; length in *OUT_LEN if
 * non-NULL).  TOOLS and opts->response_format are attached to the first message
 * when it is a system message; otherwise an empty system message carrying them
 * is put in front (what vLLM's V4 tokenizer wrapper does).  A message that
 * already has its own `tools` keeps them (TOOLS then is an error). */
int dsv4_chat_render(const json_t *messages, const json_t *tools, const dsv4_chat_opts *opts, char **out,
                     size_t *out_len, dsv4_err *err);

/* Renders a request document: either a messages array, or an object with
 * "messages" and optionally "tools", "thinking" (bool), "thinking_mode"
 * ("chat"|"thinking"), "reasoning_effort" (null|"none"|"high"|"max"),
 * "drop_thinking" (bool), "add_bos" (bool), "response_format".  Fields found in
 * DOC override OPTS.  TOOLS, if non-NULL, is used when DOC has no "tools" (both
 * given is an error). */
int dsv4_chat_render_doc(const json_t *doc, const json_t *tools, const dsv4_chat_opts *opts, char **out,
                         size_t *out_len, dsv4_err *err);

/* Parses an effort name: "none" (or NULL), "high", "max". */
int dsv4_chat_effort_parse(const char *s, dsv4_effort *out, dsv4_err *err);

/* 1 when a rendered prompt leaves the model inside a reasoning block (it ends
 * with "<think>"): start the output parser in thinking mode then. */
int dsv4_chat_prompt_opens_thinking(const char *prompt, size_t len);

/* ----- Python-compatible JSON ----- */

/* A growable string.  Zero-initialise; appends never fail loudly: on
 * out-of-memory `oom` is set and later appends are dropped, so check it once at
 * the end.  data is NUL-terminated whenever it is non-NULL. */
typedef struct dsv4_chat_buf {
    char *data;
    size_t len, cap;
    int oom;
} dsv4_chat_buf;

void dsv4_chat_buf_put(dsv4_chat_buf *b, const char *s, size_t n);
void dsv4_chat_buf_puts(dsv4_chat_buf *b, const char *s);
/* Appends printf-formatted text (any length). */
void dsv4_chat_buf_printf(dsv4_chat_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void dsv4_chat_buf_free(dsv4_chat_buf *b);

/* Appends V as Python's json.dumps(V, ensure_ascii=False): separators ", " and
 * ": ", key order as stored, floats as repr() writes them, non-ASCII as UTF-8. */
void dsv4_chat_json_py(dsv4_chat_buf *b, const json_t *v);

/* Appends S[0..n) as a JSON string literal the way json.dumps writes it
 * (ensure_ascii=False).  Bytes that are not valid UTF-8 become U+FFFD. */
void dsv4_chat_json_py_string(dsv4_chat_buf *b, const char *s, size_t n);

#endif
