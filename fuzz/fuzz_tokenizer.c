/* fuzz/fuzz_tokenizer.c: libFuzzer harness for text/tokenizer.
 *
 * The input is text.  For valid UTF-8: encoding succeeds (with and without
 * added-token matching), every id is in range, the raw decode gives back the
 * input byte for byte, the streaming decode equals the whole decode, and the
 * pre-tokenizer pieces tile the input.  For invalid UTF-8: strict encoding
 * fails, lossy encoding succeeds and decodes to Python's 'replace' text.
 * The real DeepSeek-V4 tokenizer is loaded once from
 * data/tokenizer/tokenizer.json (run from the repo root).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/tokenizer.h"

static dsv4_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    dsv4_err err;
    if (dsv4_tokenizer_load(&tok, "data/tokenizer/tokenizer.json", &err)) {
        fprintf(stderr, "fuzz_tokenizer: %s (run from the repository root)\n", err.msg);
        exit(1);
    }
    return 0;
}

#define FAIL(...)                                                                                            \
    do {                                                                                                     \
        fprintf(stderr, "fuzz_tokenizer: " __VA_ARGS__);                                                     \
        fputc('\n', stderr);                                                                                 \
        abort();                                                                                             \
    } while (0)

typedef struct {
    size_t next;
} tiling;

static int check_piece(void *ud, size_t offset, size_t len, int prefixed, int32_t added_id) {
    tiling *t = ud;
    if (prefixed || offset != t->next || len == 0) FAIL("pieces do not tile the input at offset %zu", offset);
    t->next = offset + len;
    return 0;
}

static void check_ids_and_decode(const char *text, size_t n, const dsv4_ids *ids) {
    dsv4_err err;
    for (size_t i = 0; i < ids->len; i++)
        if (ids->ids[i] < 0 || ids->ids[i] >= dsv4_tokenizer_n_vocab(tok))
            FAIL("id %d out of range", ids->ids[i]);
    dsv4_bytes raw = {0}, whole = {0}, streamed = {0};
    if (dsv4_tokenizer_decode(tok, ids->ids, ids->len, DSV4_TOK_RAW, &raw, &err))
        FAIL("raw decode: %s", err.msg);
    if (raw.len != n || memcmp(raw.data, text, n)) FAIL("round trip differs (%zu vs %zu bytes)", raw.len, n);
    if (dsv4_tokenizer_decode(tok, ids->ids, ids->len, 0, &whole, &err)) FAIL("decode: %s", err.msg);
    dsv4_tok_stream s;
    dsv4_tok_stream_init(&s, tok, 0);
    for (size_t i = 0; i < ids->len; i++)
        if (dsv4_tok_stream_push(&s, ids->ids[i], &streamed, &err)) FAIL("stream: %s", err.msg);
    if (dsv4_tok_stream_finish(&s, &streamed, &err)) FAIL("stream finish: %s", err.msg);
    if (streamed.len != whole.len || memcmp(streamed.data, whole.data, whole.len))
        FAIL("stream != whole decode");
    dsv4_bytes_free(&raw);
    dsv4_bytes_free(&whole);
    dsv4_bytes_free(&streamed);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 8192) return 0; /* long inputs add nothing but time */
    const char *text = (const char *)data;
    dsv4_ids ids = {0};
    dsv4_err err;
    size_t bad;
    if (dsv4_utf8_validate(text, size, &bad) == 0) {
        static const unsigned modes[] = {0, DSV4_TOK_NO_ADDED, DSV4_TOK_NO_SPECIAL};
        for (int m = 0; m < 3; m++) {
            ids.len = 0;
            if (dsv4_tokenizer_encode(tok, text, size, modes[m], &ids, &err))
                FAIL("encode valid text: %s", err.msg);
            check_ids_and_decode(text, size, &ids);
            tiling t = {0};
            if (dsv4_tokenizer_pieces(tok, text, size, modes[m], check_piece, &t, &err))
                FAIL("pieces: %s", err.msg);
            if (t.next != size) FAIL("pieces end at %zu of %zu", t.next, size);
        }
    } else {
        if (dsv4_tokenizer_encode(tok, text, size, 0, &ids, &err) == 0) FAIL("invalid UTF-8 accepted");
        if (ids.len) FAIL("failed encode left ids behind");
        if (!strstr(err.msg, "byte offset")) FAIL("error does not name the offset: %s", err.msg);
        dsv4_bytes clean = {0};
        if (dsv4_utf8_lossy(text, size, &clean, &err)) FAIL("lossy: %s", err.msg);
        if (dsv4_utf8_validate(clean.data, clean.len, &bad)) FAIL("lossy output is not valid UTF-8");
        if (dsv4_tokenizer_encode(tok, text, size, DSV4_TOK_LOSSY, &ids, &err))
            FAIL("lossy encode: %s", err.msg);
        check_ids_and_decode(clean.data, clean.len, &ids);
        dsv4_bytes_free(&clean);
    }
    dsv4_ids_free(&ids);
    return 0;
}
