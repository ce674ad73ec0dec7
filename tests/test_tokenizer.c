/* tests/test_tokenizer.c: byte-level BPE against published DeepSeek-V4 vectors,
 * the spec's special ids, round trips, streaming decode, UTF-8 handling,
 * malformed files, the Split behaviors on tiny generated tokenizers, threads,
 * and the large HF-generated corpus when it is present. */
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "text/tokenizer.h"
#include "text/unicode_props.h"

#define REAL_TOKENIZER "data/tokenizer/tokenizer.json"

static dsv4_tokenizer *real_tok(void) {
    static dsv4_tokenizer *tok;
    static int tried;
    if (!tried) {
        tried = 1;
        dsv4_err err;
        if (dsv4_tokenizer_load(&tok, REAL_TOKENIZER, &err)) {
            fprintf(stderr, "  cannot load %s: %s\n", REAL_TOKENIZER, err.msg);
            tok = NULL;
        }
    }
    return tok;
}

static int encode(const dsv4_tokenizer *tok, const char *s, size_t n, unsigned flags, dsv4_ids *ids) {
    dsv4_err err;
    ids->len = 0;
    if (dsv4_tokenizer_encode(tok, s, n, flags, ids, &err)) {
        fprintf(stderr, "  encode failed: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int roundtrip_ok(const dsv4_tokenizer *tok, const char *s, size_t n) {
    dsv4_ids ids = {0};
    dsv4_bytes out = {0};
    dsv4_err err;
    int ok = encode(tok, s, n, 0, &ids) == 0 &&
             dsv4_tokenizer_decode(tok, ids.ids, ids.len, 0, &out, &err) == 0 && out.len == n &&
             (n == 0 || !memcmp(out.data, s, n));
    dsv4_ids_free(&ids);
    dsv4_bytes_free(&out);
    return ok;
}

/* ----- published vectors and spec ids ----- */

static void test_published_vectors(void) {
    dsv4_tokenizer *tok = real_tok();
    REQUIRE(tok);
    json_error_t jerr;
    json_t *root = json_load_file("tests/data/tokenizer_vectors.json", 0, &jerr);
    REQUIRE(root);
    json_t *vecs = json_object_get(root, "vectors");
    REQUIRE(json_array_size(vecs) >= 10);
    dsv4_ids ids = {0};
    for (size_t i = 0; i < json_array_size(vecs); i++) {
        json_t *v = json_array_get(vecs, i), *want = json_object_get(v, "ids");
        const char *text = json_string_value(json_object_get(v, "text"));
        size_t tl = json_string_length(json_object_get(v, "text"));
        CHECK(encode(tok, text, tl, 0, &ids) == 0);
        int same = ids.len == json_array_size(want);
        for (size_t k = 0; same && k < ids.len; k++)
            same = ids.ids[k] == json_integer_value(json_array_get(want, k));
        CHECKF(same, "vector %zu (\"%.40s\"): got %zu ids, want %zu", i, text, ids.len,
               json_array_size(want));
        CHECKF(roundtrip_ok(tok, text, tl), "vector %zu does not round-trip", i);
    }
    dsv4_ids_free(&ids);
    json_decref(root);
}

static void test_special_ids(void) {
    dsv4_tokenizer *tok = real_tok();
    REQUIRE(tok);
    struct {
        const char *s;
        int32_t id;
    } want[] = {
        {"<｜begin▁of▁sentence｜>", 0}, {"<｜end▁of▁sentence｜>", 1}, {"<｜▁pad▁｜>", 2},
        {"<｜User｜>", 128803},         {"<｜Assistant｜>", 128804},  {"<think>", 128821},
        {"</think>", 128822},           {"｜DSML｜", 128825},         {"<｜latest_reminder｜>", 128828},
        {"<｜action｜>", 128829},       {"<｜query｜>", 128830},      {"<｜authority｜>", 128831},
        {"<｜domain｜>", 128832},       {"<｜title｜>", 128836},      {"<｜read_url｜>", 128845},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        CHECKF(dsv4_tokenizer_piece_to_id(tok, want[i].s) == want[i].id, "%s -> %d, want %d", want[i].s,
               dsv4_tokenizer_piece_to_id(tok, want[i].s), want[i].id);
        CHECK_STR(dsv4_tokenizer_id_to_piece(tok, want[i].id), want[i].s);
        size_t n;
        const char *b = dsv4_tokenizer_id_bytes(tok, want[i].id, &n);
        CHECK(b && n == strlen(want[i].s) && !memcmp(b, want[i].s, n));
        CHECK(dsv4_tokenizer_id_kind(tok, want[i].id) >= 1);
    }
    CHECK_EQ_INT(dsv4_tokenizer_n_vocab(tok), 129280);
    CHECK_EQ_INT(dsv4_tokenizer_id_kind(tok, 0), 2);      /* BOS is special */
    CHECK_EQ_INT(dsv4_tokenizer_id_kind(tok, 128803), 1); /* <｜User｜> is added, not special */
    CHECK_EQ_INT(dsv4_tokenizer_id_kind(tok, 1000), 0);
    CHECK_STR(dsv4_tokenizer_id_to_piece(tok, 19923), "Hello");
    CHECK_EQ_INT(dsv4_tokenizer_piece_to_id(tok, "Hello"), 19923);
    CHECK_EQ_INT(dsv4_tokenizer_piece_to_id(tok, "no such token at all"), -1);
    CHECK(dsv4_tokenizer_id_to_piece(tok, -1) == NULL);
    CHECK(dsv4_tokenizer_id_to_piece(tok, 129280) == NULL);
}

/* ----- flags: plain-text specials ----- */

static void test_no_added_flags(void) {
    dsv4_tokenizer *tok = real_tok();
    REQUIRE(tok);
    const char *s = "<｜begin▁of▁sentence｜><｜User｜>hi";
    dsv4_ids a = {0}, b = {0}, c = {0};
    REQUIRE(encode(tok, s, strlen(s), 0, &a) == 0);
    REQUIRE(a.len >= 3);
    CHECK_EQ_INT(a.ids[0], 0);
    CHECK_EQ_INT(a.ids[1], 128803);
    /* untrusted text: nothing becomes an added token */
    REQUIRE(encode(tok, s, strlen(s), DSV4_TOK_NO_ADDED, &b) == 0);
    for (size_t i = 0; i < b.len; i++)
        CHECK(dsv4_tokenizer_id_kind(tok, b.ids[i]) == 0);
    CHECK(b.len > a.len);
    /* HF encode_special_tokens: BOS (special) is text, <｜User｜> (not special) still matches */
    REQUIRE(encode(tok, s, strlen(s), DSV4_TOK_NO_SPECIAL, &c) == 0);
    int saw_user = 0, saw_bos = 0;
    for (size_t i = 0; i < c.len; i++)
        saw_user |= c.ids[i] == 128803, saw_bos |= c.ids[i] == 0;
    CHECK(saw_user && !saw_bos);
    dsv4_bytes out = {0};
    dsv4_err err;
    CHECK(dsv4_tokenizer_decode(tok, b.ids, b.len, 0, &out, &err) == 0);
    CHECK_STR(out.data, s);
    out.len = 0;
    CHECK(dsv4_tokenizer_decode(tok, a.ids, a.len, DSV4_TOK_SKIP_SPECIAL, &out, &err) == 0);
    CHECK_STR(out.data, "<｜User｜>hi");
    dsv4_bytes_free(&out);
    dsv4_ids_free(&a);
    dsv4_ids_free(&b);
    dsv4_ids_free(&c);
}

/* ----- round trips ----- */

static const char *const SAMPLES[] = {
    "",
    " ",
    "   ",
    "\n",
    "\r\n",
    "a\r\nb\r\n\r\nc",
    "\t\tindented\twith tabs\t",
    "trailing spaces   ",
    "   leading spaces",
    "multiple   spaces  between\n\n\nwords",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "你好，世界！这是一个测试。",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 텍스트도 있습니다.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈",
    "combining: e\xcc\x81 a\xcc\x8a n\xcc\x83 Z\xcd\x91\xcd\x97\xcd\x83",
    "Ελληνικά και русский текст и עברית ו-العربية",
    "math: ∑_{i=1}^{n} x² ≤ ∞ ≠ √2",
    "code: for (int i = 0; i < n; i++) { x[i] += y[i] * 2; }",
    "URLs https://example.com/a?b=c&d=e#f and emails a.b@c.de",
    "numbers 3.14159 -42 1e-9 0x1F 12,345,678",
    "mixed中文English混合123abc",
    "\xc2\xa0nbsp\xe2\x80\x83"
    "em-space\xe3\x80\x80ideographic",
    "nel\xc2\x85next line\xe2\x80\xa8line sep",
    "zero\xe2\x80\x8bwidth\xef\xbb\xbf bom",
    "<｜User｜>question<｜Assistant｜><think>reason</think>answer<｜end▁of▁sentence｜>",
    "<｜User <think <｜ partial specials </think",
    "!!!???...,,,;;;",
    "'s 't 're I'm we'll they'd",
    "\x01\x02\x7f control chars \x1b[0m",
    "ＦＵＬＬ－ＷＩＤＴＨ　ｆｏｒｍｓ　１２３",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𐍈 gothic",
};

static void test_roundtrip(void) {
    dsv4_tokenizer *tok = real_tok();
    REQUIRE(tok);
    for (size_t i = 0; i < sizeof SAMPLES / sizeof SAMPLES[0]; i++)
        CHECKF(roundtrip_ok(tok, SAMPLES[i], strlen(SAMPLES[i])), "sample %zu \"%s\"", i, SAMPLES[i]);
    /* random valid UTF-8 built from code points of many ranges */
    static const uint32_t ranges[][2] = {{0x20, 0x7E},     {0x09, 0x0D},     {0xA0, 0x24F},
                                         {0x300, 0x36F},   {0x400, 0x4FF},   {0x4E00, 0x9FFF},
                                         {0x3040, 0x30FF}, {0x2000, 0x206F}, {0x1F300, 0x1F6FF},
                                         {0xFF00, 0xFFEF}, {0x80, 0x9F}};
    unsigned seed = 12345;
    char buf[512];
    int bad = 0;
    for (int t = 0; t < 2000; t++) {
        size_t n = 0;
        int len = (int)(rand_r(&seed) % 40);
        for (int k = 0; k < len; k++) {
            const uint32_t *r = ranges[rand_r(&seed) % (sizeof ranges / sizeof ranges[0])];
            uint32_t cp = r[0] + (uint32_t)rand_r(&seed) % (r[1] - r[0] + 1);
            if (cp < 0x80)
                buf[n++] = (char)cp;
            else if (cp < 0x800)
                buf[n++] = (char)(0xC0 | cp >> 6), buf[n++] = (char)(0x80 | (cp & 63));
            else if (cp < 0x10000)
                buf[n++] = (char)(0xE0 | cp >> 12), buf[n++] = (char)(0x80 | ((cp >> 6) & 63)),
                buf[n++] = (char)(0x80 | (cp & 63));
            else
                buf[n++] = (char)(0xF0 | cp >> 18), buf[n++] = (char)(0x80 | ((cp >> 12) & 63)),
                buf[n++] = (char)(0x80 | ((cp >> 6) & 63)), buf[n++] = (char)(0x80 | (cp & 63));
        }
        if (!roundtrip_ok(tok, buf, n)) bad++;
    }
    CHECK_EQ_INT(bad, 0);
}

/* ----- streaming decode ----- */

static int stream_equals_whole(const dsv4_tokenizer *tok, const int32_t *ids, size_t n, unsigned flags) {
    dsv4_bytes whole = {0}, streamed = {0}, raw = {0}, lossy = {0};
    dsv4_err err;
    int ok = dsv4_tokenizer_decode(tok, ids, n, flags, &whole, &err) == 0;
    dsv4_tok_stream s;
    dsv4_tok_stream_init(&s, tok, flags);
    for (size_t i = 0; ok && i < n; i++) {
        size_t before = streamed.len;
        ok = dsv4_tok_stream_push(&s, ids[i], &streamed, &err) == 0;
        /* every chunk on its own is valid UTF-8 */
        size_t bad;
        if (ok && dsv4_utf8_validate(streamed.data + before, streamed.len - before, &bad)) ok = 0;
    }
    ok = ok && dsv4_tok_stream_finish(&s, &streamed, &err) == 0;
    ok = ok && whole.len == streamed.len && !memcmp(whole.data, streamed.data, whole.len);
    /* and both equal the lossy conversion of the raw bytes */
    ok = ok && dsv4_tokenizer_decode(tok, ids, n, flags | DSV4_TOK_RAW, &raw, &err) == 0 &&
         dsv4_utf8_lossy(raw.data, raw.len, &lossy, &err) == 0 && lossy.len == whole.len &&
         !memcmp(lossy.data, whole.data, whole.len);
    dsv4_bytes_free(&whole);
    dsv4_bytes_free(&streamed);
    dsv4_bytes_free(&raw);
    dsv4_bytes_free(&lossy);
    return ok;
}

static void test_stream_decode(void) {
    dsv4_tokenizer *tok = real_tok();
    REQUIRE(tok);
    dsv4_ids ids = {0};
    for (size_t i = 0; i < sizeof SAMPLES / sizeof SAMPLES[0]; i++) {
        REQUIRE(encode(tok, SAMPLES[i], strlen(SAMPLES[i]), 0, &ids) == 0);
        CHECKF(stream_equals_whole(tok, ids.ids, ids.len, 0), "sample %zu", i);
    }
    /* "🎸🎶" splits the emoji over byte tokens (published vector): the stream
     * must hold the partial bytes back */
    const char *emoji = "🎸🎶";
    REQUIRE(encode(tok, emoji, strlen(emoji), 0, &ids) == 0);
    CHECK(ids.len >= 3);
    dsv4_tok_stream s;
    dsv4_bytes out = {0};
    dsv4_err err;
    dsv4_tok_stream_init(&s, tok, 0);
    REQUIRE(dsv4_tok_stream_push(&s, ids.ids[0], &out, &err) == 0);
    size_t first_len;
    dsv4_tokenizer_id_bytes(tok, ids.ids[0], &first_len);
    CHECK(first_len < 4 && out.len == 0); /* an incomplete prefix: nothing out yet */
    for (size_t i = 1; i < ids.len; i++)
        CHECK(dsv4_tok_stream_push(&s, ids.ids[i], &out, &err) == 0);
    CHECK(dsv4_tok_stream_finish(&s, &out, &err) == 0);
    CHECK_STR(out.data, emoji);
    /* random sequences of single-byte tokens: arbitrary byte streams, valid or not */
    unsigned seed = 7;
    int32_t seq[64];
    int bad = 0;
    for (int t = 0; t < 3000; t++) {
        size_t n = (size_t)(rand_r(&seed) % 24);
        for (size_t k = 0; k < n; k++) {
            int r = rand_r(&seed) % 10;
            uint8_t b = r < 3   ? (uint8_t)(0x80 + rand_r(&seed) % 64)
                        : r < 5 ? (uint8_t)(0xC0 + rand_r(&seed) % 64)
                        : r < 7 ? (uint8_t)(rand_r(&seed) % 128)
                                : (uint8_t)(rand_r(&seed) % 256);
            char one[4];
            uint32_t cp = dsv4_byte_to_unicode(b);
            /* the single-byte token of b, spelled in byte-level form */
            if (cp < 0x80)
                one[0] = (char)cp, one[1] = 0;
            else
                one[0] = (char)(0xC0 | cp >> 6), one[1] = (char)(0x80 | (cp & 63)), one[2] = 0;
            seq[k] = dsv4_tokenizer_piece_to_id(tok, one);
            if (seq[k] < 0) seq[k] = 19923;
        }
        /* mix in multi-byte tokens and a special one */
        if (n > 2) seq[n / 2] = rand_r(&seed) % 2 ? 30594 : 128803;
        if (!stream_equals_whole(tok, seq, n, 0)) bad++;
        if (!stream_equals_whole(tok, seq, n, DSV4_TOK_SKIP_SPECIAL)) bad++;
    }
    CHECK_EQ_INT(bad, 0);
    /* a truncated sequence at the end is flushed as one U+FFFD */
    int32_t cut[1];
    cut[0] = dsv4_tokenizer_piece_to_id(tok, "ð"); /* byte 0xF0 */
    REQUIRE(cut[0] >= 0);
    out.len = 0;
    CHECK(dsv4_tokenizer_decode(tok, cut, 1, 0, &out, &err) == 0);
    CHECK_STR(out.data, "\xef\xbf\xbd");
    out.len = 0;
    CHECK(dsv4_tokenizer_decode(tok, cut, 1, DSV4_TOK_RAW, &out, &err) == 0);
    CHECK(out.len == 1 && (unsigned char)out.data[0] == 0xF0);
    /* ids out of range are errors naming the id */
    int32_t badids[2] = {19923, 129280};
    out.len = 0;
    CHECK(dsv4_tokenizer_decode(tok, badids, 2, 0, &out, &err) == -1);
    CHECK(strstr(err.msg, "129280") && strstr(err.msg, "out of range"));
    CHECK(out.len == 0);
    dsv4_tok_stream_init(&s, tok, 0);
    CHECK(dsv4_tok_stream_push(&s, -5, &out, &err) == -1);
    dsv4_bytes_free(&out);
    dsv4_ids_free(&ids);
}

/* ----- invalid UTF-8 ----- */

static void test_invalid_utf8(void) {
    dsv4_tokenizer *tok = real_tok();
    REQUIRE(tok);
    dsv4_ids ids = {0}, want = {0};
    dsv4_err err;
    const char bad[] = "abc\xff def";
    CHECK(dsv4_tokenizer_encode(tok, bad, sizeof bad - 1, 0, &ids, &err) == -1);
    CHECKF(strstr(err.msg, "offset 3") != NULL, "%s", err.msg);
    CHECK(ids.len == 0);
    /* expected outputs from Python: bytes.decode('utf-8', 'replace') */
    struct {
        const char *in, *out;
    } cases[] = {
        {"\xe0\x80", "\xef\xbf\xbd\xef\xbf\xbd"},
        {"\xe0\xa0", "\xef\xbf\xbd"},
        {"\xf0\x90\x80", "\xef\xbf\xbd"},
        {"\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},
        {"\xc0\xaf", "\xef\xbf\xbd\xef\xbf\xbd"},
        {"\xf4\x90\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},
        {"\xf8"
         "a",
         "\xef\xbf\xbd"
         "a"},
        {"a\xff"
         "b",
         "a\xef\xbf\xbd"
         "b"},
        {"\xe2\x82\xac\xe2\x82", "\xe2\x82\xac\xef\xbf\xbd"},
        {"\xf1\x80\x80\xe1\x80\xc2", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        dsv4_bytes b = {0};
        CHECK(dsv4_utf8_lossy(cases[i].in, strlen(cases[i].in), &b, &err) == 0);
        CHECKF(b.data && !strcmp(b.data, cases[i].out), "lossy case %zu", i);
        size_t off;
        CHECK(dsv4_utf8_validate(cases[i].in, strlen(cases[i].in), &off) == -1);
        /* lossy encoding == encoding of the replaced text */
        CHECK(dsv4_tokenizer_encode(tok, cases[i].in, strlen(cases[i].in), DSV4_TOK_LOSSY, &ids, &err) == 0);
        CHECK(encode(tok, cases[i].out, strlen(cases[i].out), 0, &want) == 0);
        CHECK(ids.len == want.len && !memcmp(ids.ids, want.ids, ids.len * sizeof *ids.ids));
        ids.len = 0;
        dsv4_bytes_free(&b);
    }
    /* surrogates and overlongs are invalid; the largest code point is fine */
    size_t off;
    CHECK(dsv4_utf8_validate("\xf4\x8f\xbf\xbf", 4, &off) == 0);
    CHECK(dsv4_utf8_validate("x\xed\xbf\xbf", 4, &off) == -1 && off == 1);
    CHECK(dsv4_utf8_validate("\xc1\xbf", 2, &off) == -1 && off == 0);
    CHECK(dsv4_utf8_validate("ok\0ok", 5, &off) == 0); /* NUL is valid UTF-8 */
    CHECK(roundtrip_ok(tok, "nul\0inside", 10));
    dsv4_ids_free(&ids);
    dsv4_ids_free(&want);
}

/* ----- tiny generated tokenizers ----- */

static char tmpdir_[256];

/* a scratch directory, made on first use */
static const char *tmpdir_get(void) {
    if (!tmpdir_[0]) {
        snprintf(tmpdir_, sizeof tmpdir_, "/tmp/dsv4_test_tokenizer_XXXXXX");
        if (!mkdtemp(tmpdir_)) {
            perror("mkdtemp");
            exit(1);
        }
    }
    return tmpdir_;
}
#define tmpdir tmpdir_get()

static void json_escape(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            fprintf(f, "\\%c", *s);
        else
            fputc(*s, f);
    }
    fputc('"', f);
}

/* Writes a byte-level tokenizer: ids 0..255 are the single bytes, EXTRA are
 * more vocab entries (ids 256...) and merges "a b" given in byte-level form. */
static const char *write_tiny(const char *name, const char *const *extra, const char *merges,
                              const char *pretok, const char *added) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s.json", tmpdir, name);
    FILE *f = fopen(path, "w");
    if (!f) return NULL;
    fprintf(f, "{\"version\":\"1.0\",\"normalizer\":null,\"added_tokens\":%s,\"pre_tokenizer\":%s,",
            added ? added : "[]", pretok);
    fprintf(f, "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{");
    for (int b = 0; b < 256; b++) {
        char s[4] = {0};
        uint32_t cp = dsv4_byte_to_unicode((uint8_t)b);
        if (cp < 0x80)
            s[0] = (char)cp;
        else
            s[0] = (char)(0xC0 | cp >> 6), s[1] = (char)(0x80 | (cp & 63));
        json_escape(f, s);
        fprintf(f, ":%d,", b);
    }
    int id = 256;
    for (; extra && *extra; extra++) {
        json_escape(f, *extra);
        fprintf(f, ":%d,", id++);
    }
    fseek(f, -1, SEEK_CUR); /* drop the last comma */
    fprintf(f, "},\"merges\":%s}}", merges);
    fclose(f);
    return path;
}

typedef struct {
    char buf[1024];
    const char *text;
} piece_log;

static int log_piece(void *ud, size_t off, size_t len, int prefixed, int32_t added) {
    piece_log *l = ud;
    size_t n = strlen(l->buf);
    snprintf(l->buf + n, sizeof l->buf - n, "%s%s%.*s%s", n ? "|" : "", prefixed ? "^" : "", (int)len,
             l->text + off, added >= 0 ? "*" : "");
    return 0;
}

static const char *pieces_of(const dsv4_tokenizer *tok, const char *text, unsigned flags) {
    static piece_log l;
    l.buf[0] = 0;
    l.text = text;
    dsv4_err err;
    if (dsv4_tokenizer_pieces(tok, text, strlen(text), flags, log_piece, &l, &err))
        snprintf(l.buf, sizeof l.buf, "ERR %.900s", err.msg);
    return l.buf;
}

static dsv4_tokenizer *load_tiny(const char *path) {
    dsv4_tokenizer *tok = NULL;
    dsv4_err err;
    if (!path || dsv4_tokenizer_load(&tok, path, &err)) {
        fprintf(stderr, "  load %s: %s\n", path ? path : "?", path ? err.msg : "write failed");
        return NULL;
    }
    return tok;
}

static const char *split_pretok(const char *behavior, int invert) {
    static char buf[512];
    snprintf(buf, sizeof buf,
             "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"String\":\"-\"},"
             "\"behavior\":\"%s\",\"invert\":%s},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_"
             "regex\":false}]}",
             behavior, invert ? "true" : "false");
    return buf;
}

static void test_split_behaviors(void) {
    /* the examples of the Hugging Face documentation for SplitDelimiterBehavior */
    struct {
        const char *behavior, *want;
    } cases[] = {
        {"Removed", "the|final|countdown"},
        {"Isolated", "the|-|final|-|-|countdown"},
        {"MergedWithPrevious", "the-|final-|-|countdown"},
        {"MergedWithNext", "the|-final|-|-countdown"},
        {"Contiguous", "the|-|final|--|countdown"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        dsv4_tokenizer *tok =
            load_tiny(write_tiny("split", NULL, "[]", split_pretok(cases[i].behavior, 0), NULL));
        REQUIRE(tok);
        CHECK_STR(pieces_of(tok, "the-final--countdown", 0), cases[i].want);
        dsv4_tokenizer_free(tok);
    }
    /* invert: the non-matches are the delimiters */
    dsv4_tokenizer *tok = load_tiny(write_tiny("inv", NULL, "[]", split_pretok("Removed", 1), NULL));
    REQUIRE(tok);
    CHECK_STR(pieces_of(tok, "a-b--c", 0), "-|-|-");
    dsv4_tokenizer_free(tok);

    /* plain ByteLevel with the GPT-2 regex and a prefix space */
    tok = load_tiny(write_tiny(
        "gpt2", NULL, "[]", "{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"use_regex\":true}", NULL));
    REQUIRE(tok);
    CHECK_STR(pieces_of(tok, "Hello world", 0), "^Hello| world");
    CHECK_STR(pieces_of(tok, "I'm fine  ok\n", 0), "^I|'m| fine| | ok|\n");
    CHECK_STR(pieces_of(tok, " x123 4.5", 0), " x|123| 4|.|5");
    dsv4_tokenizer_free(tok);

    /* Digits, then a regex split with \s and a lookahead */
    tok = load_tiny(write_tiny(
        "digits", NULL, "[]",
        "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\",\"individual_digits\":true},"
        "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\s+(?!\\\\S)|\\\\s+|\\\\S+\"},\"behavior\":"
        "\"Isolated\"},"
        "{\"type\":\"ByteLevel\",\"use_regex\":false}]}",
        NULL));
    REQUIRE(tok);
    CHECK_STR(pieces_of(tok, "ab12  c", 0), "ab|1|2| | |c");
    /* U+0085 (NEL) is \s for Oniguruma (and PCRE2); U+180E is not White_Space
     * (Oniguruma) although PCRE2's own \s counts it: it must not split */
    CHECK_STR(pieces_of(tok, "a\xc2\x85 b", 0), "a|\xc2\x85| |b");
    CHECK_STR(pieces_of(tok, "a\xe1\xa0\x8e b", 0), "a\xe1\xa0\x8e| |b");
    dsv4_tokenizer_free(tok);
}

/* ----- Unicode 15 general categories (PCRE2 10.42's own tables are 14) ----- */

/* A tiny tokenizer whose pre-tokenizer is Split(REGEX, Isolated) then ByteLevel. */
static const char *write_regex_tok(const char *name, const char *regex) {
    json_t *pt = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b}]}", "type", "Sequence",
                           "pretokenizers", "type", "Split", "pattern", "Regex", regex, "behavior", "Isolated",
                           "invert", 0, "type", "ByteLevel", "use_regex", 0);
    char *js = json_dumps(pt, JSON_COMPACT);
    const char *path = write_tiny(name, NULL, "[]", js, NULL);
    free(js);
    json_decref(pt);
    return path;
}

#define U1E030 "\xf0\x9e\x80\xb0" /* CYRILLIC SMALL LETTER A MODIFIER (Lm, new in 15.0) */
#define U11F50 "\xf0\x91\xbd\x90" /* KAWI DIGIT ZERO (Nd, new in 15.0) */
#define U1F6DC "\xf0\x9f\x9b\x9c" /* WIRELESS (So, new in 15.0) */

static void expect_pieces(const char *regex, const char *text, const char *want) {
    dsv4_tokenizer *tok = load_tiny(write_regex_tok("uprop", regex));
    CHECKF(tok != NULL, "regex %s did not load", regex);
    if (!tok) return;
    const char *got = pieces_of(tok, text, 0);
    CHECKF(!strcmp(got, want), "regex %s on \"%s\": got \"%s\", want \"%s\"", regex, text, got, want);
    dsv4_tokenizer_free(tok);
}

static void test_unicode15_props(void) {
    CHECK_STR(dsv4_uprop_unicode_version(), "15.0.0");
    /* \p{L} matches U+1E030, in every spelling, inside and outside a class */
    expect_pieces("\\p{L}+", "a" U1E030 "b 1", "a" U1E030 "b| 1");
    expect_pieces("\\pL+", "a" U1E030 "b 1", "a" U1E030 "b| 1");
    expect_pieces("[\\p{Letter}]+", "a" U1E030 "b 1", "a" U1E030 "b| 1");
    expect_pieces("\\p{modifier_letter}+", "a" U1E030 "b", "a|" U1E030 "|b");
    expect_pieces("[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+", " " U1E030, " " U1E030);
    /* negations: \P, \p{^..}, [^..], and \P spliced into a class */
    expect_pieces("\\P{L}+", "1" U1E030 "2", "1|" U1E030 "|2");
    expect_pieces("\\p{^L}+", "1" U1E030 "2", "1|" U1E030 "|2");
    expect_pieces("[^\\p{L}]+", "1" U1E030 "2", "1|" U1E030 "|2");
    expect_pieces("[\\P{L}x]+", "ab1" U1E030 "2x", "ab|1|" U1E030 "|2x");
    /* numbers and symbols new in 15.0 */
    expect_pieces("\\p{N}+", "a" U11F50 "7b", "a|" U11F50 "7|b");
    expect_pieces("\\p{Nd}+", "a" U11F50 "b", "a|" U11F50 "|b");
    expect_pieces("[\\p{S}]+", "a" U1F6DC "b", "a|" U1F6DC "|b");
    /* names that are not general categories are PCRE2's (scripts, binary properties) */
    expect_pieces("\\p{Greek}+", "\xce\xb1\xce\xb2" "c", "\xce\xb1\xce\xb2|c");
    expect_pieces("\\p{Cs}|a", "bab", "b|a|b"); /* empty in valid UTF-8, still compiles */

    /* White_Space (what \s becomes) is \t..\r, U+0085 and Z: Z must be the same set in
     * PCRE2's tables and utf8proc's, i.e. the rewrite adds nothing to \p{Z} */
    size_t len = 0;
    char *z = dsv4_uprop_pcre2_set(dsv4_uprop_category_mask("Z", 1), 0, 0, &len, NULL);
    REQUIRE(z);
    CHECK_STR(z, "[\\p{Z}]");
    free(z);
    int pc, uc;
    dsv4_uprop_debug_categories(0x1E030, &pc, &uc);
    CHECK_EQ_INT(pc, 0); /* Cn for PCRE2 10.42 ... */
    CHECK_EQ_INT(uc, 4); /* ... Lm for utf8proc */
    dsv4_uprop_debug_categories('A', &pc, &uc);
    CHECK_EQ_INT(pc, 1);
    CHECK_EQ_INT(uc, 1);
    dsv4_uprop_debug_categories(0xDC00, &pc, &uc);
    CHECK_EQ_INT(pc, 28);
    CHECK_EQ_INT(uc, 28);

    /* names: loose matching, and unknown names are 0 */
    CHECK(dsv4_uprop_category_mask("Uppercase Letter", 16) == dsv4_uprop_category_mask("lu", 2));
    CHECK(dsv4_uprop_category_mask("L&", 2) == dsv4_uprop_category_mask("Cased_Letter", 12));
    CHECK(dsv4_uprop_category_mask("Foo", 3) == 0);
    CHECK(dsv4_uprop_category_mask("Letterxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", 45) == 0);

    /* bad escapes are load errors that name the escape */
    struct {
        const char *regex, *needle;
    } bad[] = {
        {"\\p{Foo}+", "unknown Unicode property \"Foo\" in \\p{Foo} at offset 0"},
        {"a|[\\P{NotAThing}]", "unknown Unicode property \"NotAThing\""},
        {"\\p{L", "without a closing '}'"},
        {"x\\p", "\\p at the end of the regex"},
        {"[a-\\p{L}]", "a class range cannot start or end at \\p{L}"},
        {"[\\p{L}-z]", "a class range cannot start or end at \\p{L}"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *path = write_regex_tok("uprop_bad", bad[i].regex);
        REQUIRE(path);
        dsv4_tokenizer *tok = NULL;
        dsv4_err err;
        int rc = dsv4_tokenizer_load(&tok, path, &err);
        CHECKF(rc == -1 && tok == NULL, "regex %s loaded", bad[i].regex);
        if (rc == -1)
            CHECKF(strstr(err.msg, bad[i].needle) != NULL, "regex %s: message \"%s\" lacks \"%s\"", bad[i].regex,
                   err.msg, bad[i].needle);
        dsv4_tokenizer_free(tok);
    }
}

static void test_bpe_merges(void) {
    /* merges in rank order: "a a" (0), "b c" (1), "aa a" (2), "a bc" (3) */
    const char *extra[] = {"aa", "bc", "aaa", "abc", NULL};
    const char *merges = "[\"a a\", [\"b\", \"c\"], \"aa a\", \"a bc\"]";
    dsv4_tokenizer *tok =
        load_tiny(write_tiny("bpe", extra, merges, "{\"type\":\"ByteLevel\",\"use_regex\":false}", NULL));
    REQUIRE(tok);
    dsv4_ids ids = {0};
    struct {
        const char *text;
        int32_t want[6];
        size_t n;
    } cases[] = {
        {"aaa", {256, 'a'}, 2},  /* (a a) leftmost first, then no "aa a" at rank 2? it exists: see next */
        {"abc", {259}, 1},       /* b c -> bc, then a bc -> abc */
        {"aabc", {256, 257}, 2}, /* a a (rank 0) first, then bc; "aa bc" is no merge */
        {"ab", {'a', 'b'}, 2},
    };
    /* "aaa": a a -> aa (pos 0, rank 0) beats pos 1; then "aa a" rank 2 -> aaa */
    cases[0].want[0] = 258, cases[0].n = 1;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        REQUIRE(encode(tok, cases[i].text, strlen(cases[i].text), 0, &ids) == 0);
        int same = ids.len == cases[i].n;
        for (size_t k = 0; same && k < ids.len; k++)
            same = ids.ids[k] == cases[i].want[k];
        CHECKF(same, "\"%s\": got %zu ids, first %d", cases[i].text, ids.len, ids.len ? ids.ids[0] : -1);
    }
    CHECK(roundtrip_ok(tok, "aaaa bcabc \xe4\xbd\xa0", 14));
    dsv4_ids_free(&ids);
    dsv4_tokenizer_free(tok);
}

static dsv4_tokenizer *load_text(const char *name, const char *json) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.json", tmpdir, name);
    FILE *f = fopen(path, "w");
    if (!f) return NULL;
    fputs(json, f);
    fclose(f);
    return load_tiny(path);
}

static int ids_are(const dsv4_tokenizer *tok, const char *text, const int32_t *want, size_t n) {
    dsv4_ids ids = {0};
    int ok = encode(tok, text, strlen(text), 0, &ids) == 0 && ids.len == n &&
             (n == 0 || !memcmp(ids.ids, want, n * sizeof *want));
    dsv4_ids_free(&ids);
    return ok;
}

/* unk_token / fuse_unk (bytes missing from the vocab) and ignore_merges */
static void test_unk_and_ignore_merges(void) {
    const char *fmt = "{\"decoder\":{\"type\":\"ByteLevel\"},\"pre_tokenizer\":{\"type\":\"ByteLevel\","
                      "\"use_regex\":false},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,"
                      "\"<unk>\":2,\"ab\":3,\"xy\":4},\"merges\":[\"a b\"],%s}}";
    char json[1024];
    snprintf(json, sizeof json, fmt, "\"unk_token\":\"<unk>\",\"fuse_unk\":true");
    dsv4_tokenizer *tok = load_text("unkfuse", json);
    REQUIRE(tok);
    CHECK(ids_are(tok, "abzzab", (const int32_t[]){3, 2, 3}, 3));
    dsv4_tokenizer_free(tok);
    snprintf(json, sizeof json, fmt, "\"unk_token\":\"<unk>\",\"fuse_unk\":false");
    tok = load_text("unk", json);
    REQUIRE(tok);
    CHECK(ids_are(tok, "abzzab", (const int32_t[]){3, 2, 2, 3}, 4));
    dsv4_tokenizer_free(tok);
    snprintf(json, sizeof json, fmt, "\"unk_token\":null");
    tok = load_text("nounk", json);
    REQUIRE(tok);
    CHECK(ids_are(tok, "abzzab", (const int32_t[]){3, 3}, 2)); /* unknown bytes dropped, as HF does */
    dsv4_tokenizer_free(tok);
    /* "xy" has no merge: only ignore_merges finds it (x and y are not in this vocab) */
    snprintf(json, sizeof json, fmt, "\"ignore_merges\":true,\"unk_token\":\"<unk>\"");
    tok = load_text("ignore", json);
    REQUIRE(tok);
    CHECK(ids_are(tok, "xy", (const int32_t[]){4}, 1));
    dsv4_tokenizer_free(tok);
    snprintf(json, sizeof json, fmt, "\"ignore_merges\":false,\"unk_token\":\"<unk>\",\"fuse_unk\":true");
    tok = load_text("noignore", json);
    REQUIRE(tok);
    CHECK(ids_are(tok, "xy", (const int32_t[]){2}, 1));
    dsv4_tokenizer_free(tok);
}

static void test_added_token_flags(void) {
    const char *added =
        "[{\"id\":300,\"content\":\"<sp>\",\"special\":true,\"lstrip\":true,\"rstrip\":true,\"normalized\":"
        "false},"
        "{\"id\":301,\"content\":\"word\",\"special\":false,\"single_word\":true,\"normalized\":true},"
        "{\"id\":302,\"content\":\"<sp>x\",\"special\":false,\"normalized\":false}]";
    dsv4_tokenizer *tok =
        load_tiny(write_tiny("added", NULL, "[]", "{\"type\":\"ByteLevel\",\"use_regex\":true}", added));
    REQUIRE(tok);
    CHECK_EQ_INT(dsv4_tokenizer_n_vocab(tok), 303);
    CHECK_STR(pieces_of(tok, "a  <sp>  b", 0), "a|  <sp>  *|b"); /* lstrip + rstrip eat the spaces */
    CHECK_STR(pieces_of(tok, "<sp>xy", 0), "<sp>x*|y");          /* longest match */
    CHECK_STR(pieces_of(tok, "a word b", 0), "a| |word*| b");    /* single_word: whole word */
    CHECK_STR(pieces_of(tok, "a words b", 0), "a| words| b");    /* not a whole word: plain text */
    CHECK_STR(pieces_of(tok, "x<sp>", DSV4_TOK_NO_SPECIAL), "x|<|sp|>");
    CHECK_STR(pieces_of(tok, "x<sp>xword", DSV4_TOK_NO_ADDED), "x|<|sp|>|xword");
    dsv4_tokenizer_free(tok);
}

/* ----- malformed files ----- */

static void expect_load_error(const char *name, const char *content, const char *needle) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.json", tmpdir, name);
    FILE *f = fopen(path, "w");
    REQUIRE(f);
    fputs(content, f);
    fclose(f);
    dsv4_tokenizer *tok = NULL;
    dsv4_err err;
    int rc = dsv4_tokenizer_load(&tok, path, &err);
    CHECKF(rc == -1 && tok == NULL, "%s: loaded", name);
    if (rc == -1)
        CHECKF(strstr(err.msg, needle) != NULL, "%s: message \"%s\" lacks \"%s\"", name, err.msg, needle);
    dsv4_tokenizer_free(tok);
}

#define BL "\"decoder\":{\"type\":\"ByteLevel\"},\"pre_tokenizer\":{\"type\":\"ByteLevel\"}"

static void test_malformed(void) {
    expect_load_error("notjson", "{\"model\": ", "not valid JSON");
    expect_load_error("array", "[1,2]", "not a JSON object");
    expect_load_error("nomodel", "{" BL "}", "\"model\"");
    expect_load_error("novocab", "{" BL ",\"model\":{\"type\":\"BPE\",\"merges\":[]}}", "model.vocab");
    expect_load_error("nomerges", "{" BL ",\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0}}}",
                      "model.merges");
    expect_load_error("wordpiece",
                      "{" BL ",\"model\":{\"type\":\"WordPiece\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "unsupported model type \"WordPiece\"");
    expect_load_error(
        "unkmerge", "{" BL ",\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},\"merges\":[\"a z\"]}}",
        "model.merges[0]: unknown token \"z\"");
    expect_load_error(
        "mergeout", "{" BL ",\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},\"merges\":[\"a b\"]}}",
        "merged token \"ab\" is not in model.vocab");
    expect_load_error("badmerge",
                      "{" BL ",\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"ab\"]}}",
                      "model.merges[0]");
    expect_load_error("badid", "{" BL ",\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":-3},\"merges\":[]}}",
                      "model.vocab[\"a\"]");
    expect_load_error("dupid",
                      "{" BL ",\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":0},\"merges\":[]}}",
                      "id 0 is used by both");
    expect_load_error("dupkey",
                      "{" BL ",\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"a\":1},\"merges\":[]}}",
                      "duplicate");
    expect_load_error("metaspace",
                      "{\"decoder\":{\"type\":\"ByteLevel\"},\"pre_tokenizer\":{\"type\":\"Metaspace\"},"
                      "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "unsupported pre-tokenizer type \"Metaspace\"");
    expect_load_error(
        "badregex",
        "{\"decoder\":{\"type\":\"ByteLevel\"},\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":"
        "[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(unclosed\"},\"behavior\":\"Isolated\"},"
        "{\"type\":\"ByteLevel\"}]},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
        "pre_tokenizer.pretokenizers[0].pattern: cannot compile regex");
    expect_load_error(
        "badbehavior",
        "{\"decoder\":{\"type\":\"ByteLevel\"},\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":"
        "{\"Regex\":\"a\"},\"behavior\":\"Sideways\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},"
        "\"merges\":[]}}",
        "unknown value \"Sideways\"");
    expect_load_error(
        "nobytelevel",
        "{\"decoder\":{\"type\":\"ByteLevel\"},\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":"
        "{\"Regex\":\"a\"},\"behavior\":\"Isolated\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},"
        "\"merges\":[]}}",
        "no ByteLevel");
    expect_load_error("wpdecoder",
                      "{\"decoder\":{\"type\":\"WordPiece\"},\"pre_tokenizer\":{\"type\":\"ByteLevel\"},"
                      "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "decoder: unsupported type \"WordPiece\"");
    expect_load_error("nfc",
                      "{\"normalizer\":{\"type\":\"NFC\"}," BL
                      ",\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "normalizer: type \"NFC\"");
    expect_load_error("addedbad",
                      "{" BL ",\"added_tokens\":[{\"id\":\"x\",\"content\":\"<a>\"}],"
                      "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "added_tokens[0].id");
    expect_load_error("addeddup",
                      "{" BL
                      ",\"added_tokens\":[{\"id\":5,\"content\":\"<a>\"},{\"id\":6,\"content\":\"<a>\"}],"
                      "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "appears twice");
    expect_load_error("hugeid",
                      "{" BL ",\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":2000000000},\"merges\":[]}}",
                      "id must be an integer");
    dsv4_tokenizer *tok;
    dsv4_err err;
    CHECK(dsv4_tokenizer_load(&tok, "/nonexistent/tokenizer.json", &err) == -1);
    CHECK(strstr(err.msg, "/nonexistent/tokenizer.json") && strstr(err.msg, "No such file"));
    CHECK(dsv4_tokenizer_load(&tok, tmpdir, &err) == -1); /* a directory without tokenizer.json */
    CHECK(strstr(err.msg, "tokenizer.json") != NULL);
    /* a model directory works */
    CHECK(dsv4_tokenizer_load(&tok, "data/tokenizer", &err) == 0);
    dsv4_tokenizer_free(tok);
}

/* ----- threads ----- */

typedef struct {
    const dsv4_tokenizer *tok;
    int ok;
} thread_arg;

static void *thread_main(void *p) {
    thread_arg *a = p;
    dsv4_ids mine = {0}, ref = {0};
    dsv4_err err;
    a->ok = 1;
    for (int r = 0; r < 20; r++)
        for (size_t i = 0; i < sizeof SAMPLES / sizeof SAMPLES[0]; i++) {
            mine.len = ref.len = 0;
            if (dsv4_tokenizer_encode(a->tok, SAMPLES[i], strlen(SAMPLES[i]), 0, &mine, &err) ||
                dsv4_tokenizer_encode(a->tok, SAMPLES[(i + 1) % 10], strlen(SAMPLES[(i + 1) % 10]), 0, &ref,
                                      &err) ||
                !roundtrip_ok(a->tok, SAMPLES[i], strlen(SAMPLES[i])))
                a->ok = 0;
        }
    dsv4_ids_free(&mine);
    dsv4_ids_free(&ref);
    return NULL;
}

static void test_threads(void) {
    dsv4_tokenizer *tok = real_tok();
    REQUIRE(tok);
    pthread_t th[4];
    thread_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (thread_arg){tok, 0};
        REQUIRE(pthread_create(&th[i], NULL, thread_main, &args[i]) == 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK(args[i].ok);
    }
}

/* ----- the HF-generated corpus (tests/data/tokenizer_corpus.jsonl) ----- */

static int b64_value(int c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

static size_t b64_decode(const char *s, size_t n, char *out) {
    size_t o = 0;
    unsigned acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        int v = b64_value((unsigned char)s[i]);
        if (v < 0) continue; /* '=' and whitespace */
        acc = (acc << 6) | (unsigned)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (char)((acc >> bits) & 0xFF);
        }
    }
    return o;
}

/* Every line {"b64", "lossy", "ids"}: our ids must equal HF's, and valid
 * strings must round-trip. */
static void run_corpus(const char *path, const char *name) {
    FILE *f = fopen(path, "r");
    if (!f) {
        /* Both corpora are committed (made with HF tokenizers on the device machine):
         * a missing file is a failure, not a skip. */
        CHECKF(f != NULL, "%s: %s is missing", name, path);
        return;
    }
    dsv4_tokenizer *tok = real_tok();
    REQUIRE(tok);
    char *line = NULL;
    size_t cap = 0, lineno = 0, n_ok = 0, n_bad = 0, n_rt_bad = 0;
    ssize_t got;
    dsv4_ids ids = {0};
    while ((got = getline(&line, &cap, f)) > 0) {
        lineno++;
        json_error_t jerr;
        json_t *o = json_loadb(line, (size_t)got, 0, &jerr);
        if (!o) {
            CHECKF(0, "%s:%zu: not JSON: %s", path, lineno, jerr.text);
            continue;
        }
        json_t *b64 = json_object_get(o, "b64"), *want = json_object_get(o, "ids");
        int lossy = json_is_true(json_object_get(o, "lossy"));
        char *raw = malloc(json_string_length(b64) + 4);
        size_t n = b64_decode(json_string_value(b64), json_string_length(b64), raw);
        dsv4_err err;
        ids.len = 0;
        int rc = dsv4_tokenizer_encode(tok, raw, n, lossy ? DSV4_TOK_LOSSY : 0, &ids, &err);
        int same = rc == 0 && ids.len == json_array_size(want);
        for (size_t k = 0; same && k < ids.len; k++)
            same = ids.ids[k] == json_integer_value(json_array_get(want, k));
        if (same)
            n_ok++;
        else if (n_bad++ < 5) {
            size_t k = 0;
            while (rc == 0 && k < ids.len && k < json_array_size(want) &&
                   ids.ids[k] == json_integer_value(json_array_get(want, k)))
                k++;
            fprintf(stderr, "  %s:%zu: mismatch at id %zu (got %zu ids, want %zu)%s%s\n", path, lineno, k,
                    ids.len, json_array_size(want), rc ? ": " : "", rc ? err.msg : "");
        }
        if (!lossy && !roundtrip_ok(tok, raw, n)) n_rt_bad++;
        free(raw);
        json_decref(o);
    }
    free(line);
    fclose(f);
    dsv4_ids_free(&ids);
    printf("NOTE %s: %zu strings, %zu identical, %zu differ, %zu round-trip failures\n", name, lineno, n_ok,
           n_bad, n_rt_bad);
    CHECK(lineno > 0);
    CHECK_EQ_INT(n_bad, 0);
    CHECK_EQ_INT(n_rt_bad, 0);
}

static void test_hf_corpus(void) {
    run_corpus("tests/data/tokenizer_corpus.jsonl", "test_hf_corpus");
}

/* whitespace and recently assigned characters (tests/tokenizer_edges_inputs.py) */
static void test_hf_edges(void) {
    run_corpus("tests/data/tokenizer_edges.jsonl", "test_hf_edges");
}

static void test_cleanup(void) {
    if (tmpdir_[0]) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir_);
        CHECK(system(cmd) == 0);
    }
    dsv4_tokenizer_free(real_tok());
}

TEST_MAIN(test_published_vectors, test_special_ids, test_no_added_flags, test_roundtrip, test_stream_decode,
          test_invalid_utf8, test_split_behaviors, test_unicode15_props, test_bpe_merges, test_unk_and_ignore_merges,
          test_added_token_flags, test_malformed, test_threads, test_hf_corpus, test_hf_edges, test_cleanup)
