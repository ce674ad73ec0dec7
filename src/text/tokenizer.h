/* text/tokenizer: byte-level BPE from a Hugging Face tokenizer.json (spec §5.1).
 *
 * Owns: the vocabulary, the ranked merges, the added-token table, the compiled
 * pre-tokenizer regexes (PCRE2, UTF + UCP + JIT) and a small cache of encoded
 * pieces.  Encoding follows Hugging Face `tokenizers` step by step: added tokens
 * are cut out of the text first (longest match, leftmost first), the remaining
 * pieces go through the pre-tokenizer Sequence (Split steps, then ByteLevel),
 * then each piece through BPE merges by rank.  Encoding never adds BOS/EOS (the
 * post_processor is ignored: the chat renderer writes special tokens itself).
 * Decoding maps ids back to bytes through the inverse GPT-2 byte map; added
 * tokens decode to their content.  See docs/TOKENIZER.md for what is supported
 * and where we knowingly differ from the Rust library.
 *
 * Lifetime: dsv4_tokenizer_load allocates, dsv4_tokenizer_free releases.
 * Threads: after load every function may be called from any number of threads
 * at once (the piece cache is sharded and locked); a dsv4_tok_stream belongs to
 * one thread.
 * Errors: fallible functions return 0 / -1 and fill a dsv4_err naming the file,
 * key, id or byte offset at fault.  Bad input never aborts.
 */
#ifndef DSV4_TEXT_TOKENIZER_H
#define DSV4_TEXT_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "util/err.h"

typedef struct dsv4_tokenizer dsv4_tokenizer;

/* A growable array of token ids owned by the caller.  Zero-initialize it, pass
 * it to encode (which appends), free it with dsv4_ids_free. */
typedef struct dsv4_ids {
    int32_t *ids;
    size_t len, cap;
} dsv4_ids;

/* A growable byte buffer owned by the caller (decode appends; data stays
 * NUL-terminated after every append for convenience, the NUL is not counted). */
typedef struct dsv4_bytes {
    char *data;
    size_t len, cap;
} dsv4_bytes;

void dsv4_ids_free(dsv4_ids *v);
void dsv4_bytes_free(dsv4_bytes *b);
int dsv4_ids_push(dsv4_ids *v, int32_t id, dsv4_err *err);
int dsv4_bytes_append(dsv4_bytes *b, const void *data, size_t n, dsv4_err *err);

/* Loads PATH: a tokenizer.json file, or a directory that contains one. */
int dsv4_tokenizer_load(dsv4_tokenizer **out, const char *path, dsv4_err *err);
void dsv4_tokenizer_free(dsv4_tokenizer *tok);

/* ----- encoding ----- */

enum {
    /* Replace each maximal invalid UTF-8 subpart by U+FFFD (exactly as Python's
     * bytes.decode('utf-8', 'replace')) instead of failing. */
    DSV4_TOK_LOSSY = 1 << 0,
    /* Do not match any added token (special or not): the whole text is plain
     * text.  Use for untrusted input so it cannot forge <｜User｜> and friends. */
    DSV4_TOK_NO_ADDED = 1 << 1,
    /* Hugging Face's encode_special_tokens: only added tokens marked special are
     * treated as plain text; non-special added tokens still match. */
    DSV4_TOK_NO_SPECIAL = 1 << 2,
};

/* Appends the ids of TEXT[0..len) to OUT.  Invalid UTF-8 is an error naming the
 * byte offset unless DSV4_TOK_LOSSY.  On error OUT keeps its old length. */
int dsv4_tokenizer_encode(const dsv4_tokenizer *tok, const char *text, size_t len, unsigned flags,
                          dsv4_ids *out, dsv4_err *err);

/* The pieces the encoder hands to BPE (after added-token extraction and the
 * pre-tokenizer), reported in order.  OFFSET/LEN locate the piece in TEXT (for a
 * piece that received a prefix space, the space is not in TEXT: PREFIXED is 1);
 * ADDED_ID is the id when the piece is an added token, else -1.  TEXT must be
 * valid UTF-8 (no lossy mode here).  The callback returns 0 to go on. */
typedef int (*dsv4_tok_piece_fn)(void *ud, size_t offset, size_t len, int prefixed, int32_t added_id);
int dsv4_tokenizer_pieces(const dsv4_tokenizer *tok, const char *text, size_t len, unsigned flags,
                          dsv4_tok_piece_fn fn, void *ud, dsv4_err *err);

/* ----- decoding ----- */

enum {
    DSV4_TOK_SKIP_SPECIAL = 1 << 0, /* drop ids of added tokens marked special */
    DSV4_TOK_RAW = 1 << 1,          /* append the raw bytes, even if not valid UTF-8 */
};

/* Appends the text of IDS to OUT.  Without DSV4_TOK_RAW the result is valid
 * UTF-8: invalid bytes become U+FFFD (maximal subparts, like Rust's
 * from_utf8_lossy).  An id out of range or without a token is an error. */
int dsv4_tokenizer_decode(const dsv4_tokenizer *tok, const int32_t *ids, size_t n, unsigned flags,
                          dsv4_bytes *out, dsv4_err *err);

/* Streaming decoder: feed one id at a time; only complete UTF-8 comes out.  An
 * incomplete sequence is held back until it completes; bytes that can no longer
 * become valid come out as U+FFFD at once; _finish flushes what is held as
 * U+FFFD.  Concatenated output == dsv4_tokenizer_decode of the same ids. */
typedef struct dsv4_tok_stream {
    const dsv4_tokenizer *tok;
    unsigned flags; /* DSV4_TOK_SKIP_SPECIAL only */
    unsigned char held[4];
    int n_held;
} dsv4_tok_stream;

void dsv4_tok_stream_init(dsv4_tok_stream *s, const dsv4_tokenizer *tok, unsigned flags);
int dsv4_tok_stream_push(dsv4_tok_stream *s, int32_t id, dsv4_bytes *out, dsv4_err *err);
int dsv4_tok_stream_finish(dsv4_tok_stream *s, dsv4_bytes *out, dsv4_err *err);

/* ----- vocabulary ----- */

/* Number of ids: 1 + the largest id of the vocab and the added tokens (129280
 * for DeepSeek-V4). */
int32_t dsv4_tokenizer_n_vocab(const dsv4_tokenizer *tok);

/* The token as written in tokenizer.json ("Ġthe", "<｜User｜>"), NUL-terminated,
 * owned by the tokenizer; NULL for an id out of range or without a token. */
const char *dsv4_tokenizer_id_to_piece(const dsv4_tokenizer *tok, int32_t id);

/* The bytes the id decodes to (content for added tokens); NULL if no token. */
const char *dsv4_tokenizer_id_bytes(const dsv4_tokenizer *tok, int32_t id, size_t *len);

/* Id of a token written as in tokenizer.json (added tokens by content, e.g.
 * "<｜User｜>"; vocab entries in byte-level form, e.g. "Ġthe"); -1 if none. */
int32_t dsv4_tokenizer_piece_to_id(const dsv4_tokenizer *tok, const char *piece);

/* 1 if ID is an added token, 2 if it is an added token marked special, else 0. */
int dsv4_tokenizer_id_kind(const dsv4_tokenizer *tok, int32_t id);

/* Maps raw bytes to their byte-level (GPT-2) form and back; exposed for tests
 * and tools.  dsv4_byte_to_unicode returns the code point for byte B. */
uint32_t dsv4_byte_to_unicode(uint8_t b);

/* Checks UTF-8: returns 0, or -1 with *bad_offset = the first invalid byte. */
int dsv4_utf8_validate(const char *s, size_t n, size_t *bad_offset);

/* Appends S with each maximal invalid subpart replaced by U+FFFD (Python's
 * 'replace' / Rust's from_utf8_lossy). */
int dsv4_utf8_lossy(const char *s, size_t n, dsv4_bytes *out, dsv4_err *err);

#endif
