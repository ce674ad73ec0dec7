/* text/dsml: parses DeepSeek-V4 output text back into reasoning, content and
 * tool calls, incrementally (spec §5.2; docs/CHAT_FORMAT.md "Parsing").
 *
 * Owns: a streaming parser fed decoded text pieces as the sampler produces them.
 * It reports events through a callback: reasoning and content deltas, a tool
 * call (start, then its whole arguments JSON) each time an invoke closes, the
 * markup it consumed, and the end.  Markup is never leaked into content: a
 * suffix that could still become "</think>", "<｜DSML｜tool_calls>" (with its
 * leading "\n\n") or "<｜end▁of▁sentence｜>" is held back until decided, and an
 * incomplete UTF-8 sequence is held back from deltas.
 *
 * Accounting: the `raw` bytes of all events, concatenated in order, equal the
 * input exactly (reasoning/content deltas carry their own text, markup events the
 * tags, a tool call start the text of its invoke).  Malformed markup from the
 * model (bad attribute, garbage or EOS inside a tool_calls block, an unclosed
 * block at the end) comes back as content with `malformed` set; nothing is lost.
 *
 * Lifetime: _init / _free.  Threads: a parser belongs to one thread.  Errors:
 * only out-of-memory fails (-1 with a message); bad model output never does.
 */
#ifndef DSV4_TEXT_DSML_H
#define DSV4_TEXT_DSML_H

#include <stddef.h>
#include <stdint.h>

#include "text/chat.h"
#include "util/err.h"

typedef enum {
    DSV4_DSML_REASONING = 1, /* text: a reasoning delta */
    DSV4_DSML_CONTENT,       /* text: a content delta (malformed: recovered markup) */
    DSV4_DSML_CALL_START,    /* index, id, name; raw: the invoke's text */
    DSV4_DSML_CALL_ARGS,     /* index; text: the whole arguments JSON object */
    DSV4_DSML_MARKUP,        /* raw: tags and separators consumed, text after the end */
    DSV4_DSML_END,           /* eos: ended by <｜end▁of▁sentence｜>; malformed: anything was */
} dsv4_dsml_event_type;

typedef struct dsv4_dsml_event {
    dsv4_dsml_event_type type;
    const char *text; /* delta or arguments JSON; valid during the callback only */
    size_t len;
    const char *raw; /* the input bytes this event accounts for */
    size_t raw_len;
    int index;        /* tool call index, 0-based, for CALL_START / CALL_ARGS */
    const char *id;   /* CALL_START: "call_" + 24 hex digits */
    const char *name; /* CALL_START: the tool name */
    int malformed;    /* CONTENT: this text is markup that did not parse;
                         CALL_ARGS: a string="false" value was not JSON (kept as a string);
                         END: something in the output was malformed */
    int eos;          /* END only */
} dsv4_dsml_event;

typedef void (*dsv4_dsml_event_fn)(void *user, const dsv4_dsml_event *ev);

typedef struct dsv4_dsml_parser dsv4_dsml_parser;

/* MODE: DSV4_CHAT_MODE_THINKING when the prompt ended with "<think>" (the output
 * starts as reasoning, until "</think>"), else chat (it starts as content; see
 * dsv4_chat_prompt_opens_thinking).  ID_SEED makes the generated tool call ids
 * (the same seed gives the same ids).  FN may be NULL. */
int dsv4_dsml_parser_init(dsv4_dsml_parser **out, dsv4_chat_mode mode, uint64_t id_seed,
                          dsv4_dsml_event_fn fn, void *user, dsv4_err *err);
void dsv4_dsml_parser_free(dsv4_dsml_parser *p);

/* Feeds the next piece of decoded output.  Events for whatever is decided are
 * reported before it returns. */
int dsv4_dsml_parser_feed(dsv4_dsml_parser *p, const char *text, size_t len, dsv4_err *err);

/* End of output: flushes what was held back (an unfinished tool block becomes
 * malformed content) and reports END.  Feeding after finish is ignored. */
int dsv4_dsml_parser_finish(dsv4_dsml_parser *p, dsv4_err *err);

/* 1 once anything malformed was seen. */
int dsv4_dsml_parser_malformed(const dsv4_dsml_parser *p);

/* ----- whole completions ----- */

typedef struct dsv4_dsml_call {
    char *id, *name, *arguments; /* arguments: a JSON object text */
    int malformed;
} dsv4_dsml_call;

typedef struct dsv4_dsml_message {
    char *reasoning, *content; /* never NULL */
    dsv4_dsml_call *calls;
    size_t ncalls;
    int malformed; /* some markup did not parse (it is in content) */
    int eos;       /* the text ended with <｜end▁of▁sentence｜> */
} dsv4_dsml_message;

/* Parses a complete output TEXT[0..len) with the same machinery (fed in one
 * piece).  Free the result with dsv4_dsml_message_free. */
int dsv4_chat_parse_completion(const char *text, size_t len, dsv4_chat_mode mode, uint64_t id_seed,
                               dsv4_dsml_message *out, dsv4_err *err);
void dsv4_dsml_message_free(dsv4_dsml_message *m);

/* Collects events into a message: the callback used by parse_completion,
 * exposed so a caller feeding pieces can build the same result.  USER is a
 * dsv4_dsml_collector zero-initialised; take the result with _take. */
typedef struct dsv4_dsml_collector {
    dsv4_chat_buf reasoning, content;
    dsv4_dsml_call *calls;
    size_t ncalls, cap;
    int malformed, eos, oom;
} dsv4_dsml_collector;
void dsv4_dsml_collect(void *collector, const dsv4_dsml_event *ev);
int dsv4_dsml_collector_take(dsv4_dsml_collector *c, dsv4_dsml_message *out, dsv4_err *err);
void dsv4_dsml_collector_free(dsv4_dsml_collector *c);

#endif
