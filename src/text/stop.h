/* text/stop: when generation ends -- stop token ids and stop strings.
 *
 * Owns: up to DSV4_STOP_MAX_IDS stop token ids (the model's EOS by default) and
 * up to DSV4_STOP_MAX_STRINGS stop strings of 1..DSV4_STOP_MAX_LEN bytes, plus
 * the text held back because it might be the start of a stop string.
 * The caller feeds each decoded text piece; feed() says how many bytes are safe
 * to emit now and whether a stop string completed.  A stop string may span any
 * number of pieces.  Matching is on bytes: feed whole UTF-8 characters (the
 * detokenizer holds back partial ones) and the emitted text never splits one,
 * since a held-back suffix always begins like a stop string does.
 * When several stop strings could match, the one that completes first in the
 * byte stream wins (ties: the longer), so the result does not depend on how
 * the text was cut into pieces.  docs/SAMPLING.md has the details.
 *
 * Lifetime: a plain struct with no heap; embed it in a request and init it per
 * request.  One thread at a time.  Errors: 0 / -1 and a message in `err`.
 */
#ifndef DSV4_TEXT_STOP_H
#define DSV4_TEXT_STOP_H

#include <stddef.h>
#include <stdint.h>

#include "util/err.h"

#define DSV4_STOP_MAX_STRINGS 16
#define DSV4_STOP_MAX_LEN 256 /* bytes per stop string */
#define DSV4_STOP_MAX_IDS 16

typedef struct dsv4_stop {
    int n_strings;
    size_t len[DSV4_STOP_MAX_STRINGS];
    char str[DSV4_STOP_MAX_STRINGS][DSV4_STOP_MAX_LEN];
    int n_ids;
    int32_t ids[DSV4_STOP_MAX_IDS];
    int include_stop_str; /* 1: the emitted text ends with the matched stop string */
    int stopped;          /* a stop string matched; feed() refuses more text */
    size_t n_held;
    char held[DSV4_STOP_MAX_LEN]; /* a proper prefix of some stop string, never longer than 255 */
} dsv4_stop;

typedef struct dsv4_stop_result {
    size_t emit_len; /* bytes written to the caller's buffer: safe to send now */
    int stopped;     /* 1: a stop string matched; emit_len bytes are the final text */
    int which;       /* index of the matched stop string, or -1 */
} dsv4_stop_result;

/* Sets up st: eos_id (>= 0) becomes the first stop id, or -1 for none (e.g.
 * ignore_eos).  strings[i] has lens[i] bytes (lens NULL: NUL-terminated).  An
 * empty string, one over DSV4_STOP_MAX_LEN bytes or more than
 * DSV4_STOP_MAX_STRINGS strings is an error naming it. */
int dsv4_stop_init(dsv4_stop *st, int32_t eos_id, const char *const *strings, const size_t *lens,
                   int n_strings, int include_stop_str, dsv4_err *err);

/* Adds another stop token id (vLLM's stop_token_ids).  Negative ids and more
 * than DSV4_STOP_MAX_IDS ids are errors; a repeated id is ignored. */
int dsv4_stop_add_id(dsv4_stop *st, int32_t id, dsv4_err *err);

/* 1 if generating `id` ends the sequence. */
int dsv4_stop_is_stop_id(const dsv4_stop *st, int32_t id);

/* Feeds the next decoded piece (len bytes, may be 0).  Writes the bytes safe
 * to emit now into out and fills *res.  out_cap must hold the held text plus
 * the piece: len + DSV4_STOP_MAX_LEN always suffices.  After a stop string
 * matched, the held text is dropped and further feeds are an error. */
int dsv4_stop_feed(dsv4_stop *st, const char *piece, size_t len, char *out, size_t out_cap,
                   dsv4_stop_result *res, dsv4_err *err);

/* The sequence ended without a stop string (a stop id, max_tokens, cancel):
 * writes the held-back text (< DSV4_STOP_MAX_LEN bytes) into out and returns
 * its length, or -1 if out_cap is too small. */
long dsv4_stop_flush(dsv4_stop *st, char *out, size_t out_cap, dsv4_err *err);

#endif
