/* text/tokenizer: byte-level BPE from tokenizer.json.  Contract in tokenizer.h;
 * behaviour notes and known differences in docs/TOKENIZER.md. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/tokenizer.h"
#include "text/unicode_props.h"

#include <errno.h>
#include <jansson.h>
#include <pcre2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ------------------------------------------------------------------------ */
/* growable buffers                                                          */
/* ------------------------------------------------------------------------ */

void dsv4_ids_free(dsv4_ids *v) {
    if (!v) return;
    free(v->ids);
    v->ids = NULL;
    v->len = v->cap = 0;
}

void dsv4_bytes_free(dsv4_bytes *b) {
    if (!b) return;
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

static int ids_reserve(dsv4_ids *v, size_t extra, dsv4_err *err) {
    size_t need;
    if (dsv4_add_size(v->len, extra, &need)) return dsv4_errf(err, "token buffer size overflow");
    if (need <= v->cap) return 0;
    size_t cap = v->cap ? v->cap : 64;
    while (cap < need) {
        if (cap > SIZE_MAX / 2 / sizeof(int32_t)) return dsv4_errf(err, "token buffer size overflow");
        cap *= 2;
    }
    int32_t *p = realloc(v->ids, cap * sizeof *p);
    if (!p) return dsv4_errf(err, "out of memory growing the token buffer to %zu ids", cap);
    v->ids = p;
    v->cap = cap;
    return 0;
}

int dsv4_ids_push(dsv4_ids *v, int32_t id, dsv4_err *err) {
    if (v->len == v->cap && ids_reserve(v, 1, err)) return -1;
    v->ids[v->len++] = id;
    return 0;
}

int dsv4_bytes_append(dsv4_bytes *b, const void *data, size_t n, dsv4_err *err) {
    size_t need;
    if (dsv4_add_size(b->len, n, &need) || dsv4_add_size(need, 1, &need))
        return dsv4_errf(err, "byte buffer size overflow");
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < need) {
            if (cap > SIZE_MAX / 2) return dsv4_errf(err, "byte buffer size overflow");
            cap *= 2;
        }
        char *p = realloc(b->data, cap);
        if (!p) return dsv4_errf(err, "out of memory growing a byte buffer to %zu bytes", cap);
        b->data = p;
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, data, n);
    b->len += n;
    b->data[b->len] = '\0';
    return 0;
}

/* ------------------------------------------------------------------------ */
/* UTF-8                                                                     */
/* ------------------------------------------------------------------------ */

/* Classifies the sequence at S[0..n): returns 1 with *len = its length for a
 * valid character; 0 with *len = the maximal subpart (>= 1 byte) for invalid
 * bytes; -1 with *len = n when S is a valid but truncated prefix (more bytes
 * could complete it).  The ranges are those of Unicode Table 3-7, which is what
 * makes "maximal subpart" match Python's 'replace' and Rust's lossy decoding. */
static int utf8_scan(const unsigned char *s, size_t n, size_t *len) {
    unsigned c = s[0];
    if (c < 0x80) {
        *len = 1;
        return 1;
    }
    size_t need;
    unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF)
        need = 2;
    else if (c == 0xE0)
        need = 3, lo = 0xA0;
    else if (c == 0xED)
        need = 3, hi = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF)
        need = 3;
    else if (c == 0xF0)
        need = 4, lo = 0x90;
    else if (c == 0xF4)
        need = 4, hi = 0x8F;
    else if (c >= 0xF1 && c <= 0xF3)
        need = 4;
    else {
        *len = 1;
        return 0;
    }
    for (size_t k = 1; k < need; k++) {
        if (k >= n) {
            *len = n;
            return -1;
        }
        unsigned b = s[k];
        unsigned l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (b < l || b > h) {
            *len = k;
            return 0;
        }
    }
    *len = need;
    return 1;
}

static uint32_t utf8_decode_at(const unsigned char *s, size_t len) {
    if (len == 1) return s[0];
    if (len == 2) return ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F);
    if (len == 3) return ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    return ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
           ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
}

static size_t utf8_encode(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

int dsv4_utf8_validate(const char *s, size_t n, size_t *bad_offset) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) { /* ASCII fast path */
            i++;
            continue;
        }
        size_t l;
        if (utf8_scan(u + i, n - i, &l) != 1) {
            if (bad_offset) *bad_offset = i;
            return -1;
        }
        i += l;
    }
    return 0;
}

static const char REPLACEMENT[3] = {(char)0xEF, (char)0xBF, (char)0xBD}; /* U+FFFD */

int dsv4_utf8_lossy(const char *s, size_t n, dsv4_bytes *out, dsv4_err *err) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, run = 0; /* run: start of the pending valid bytes */
    while (i < n) {
        size_t l;
        int r = u[i] < 0x80 ? (l = 1, 1) : utf8_scan(u + i, n - i, &l);
        if (r == 1) {
            i += l;
            continue;
        }
        if (dsv4_bytes_append(out, s + run, i - run, err) || dsv4_bytes_append(out, REPLACEMENT, 3, err))
            return -1;
        i += l;
        run = i;
    }
    return dsv4_bytes_append(out, s + run, n - run, err);
}

/* Rust's char::is_whitespace (the Unicode White_Space property): used by the
 * lstrip/rstrip flags of added tokens. */
static int is_white_space(uint32_t c) {
    return (c >= 9 && c <= 13) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
           c == 0x3000;
}

/* ------------------------------------------------------------------------ */
/* the GPT-2 byte <-> unicode map                                            */
/* ------------------------------------------------------------------------ */

/* Printable bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) stand for
 * themselves; the other 68 bytes take code points 256, 257, ... in byte order,
 * so that every byte has a visible, non-space character. */
uint32_t dsv4_byte_to_unicode(uint8_t b) {
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE) return b;
    uint32_t k = 0;
    for (unsigned x = 0; x < b; x++)
        if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) k++;
    return 256 + k;
}

/* ------------------------------------------------------------------------ */
/* the tokenizer                                                             */
/* ------------------------------------------------------------------------ */

enum { BEHAVIOR_REMOVED, BEHAVIOR_ISOLATED, BEHAVIOR_MERGED_PREV, BEHAVIOR_MERGED_NEXT, BEHAVIOR_CONTIGUOUS };
enum { STEP_SPLIT, STEP_PREFIX_SPACE };

typedef struct {
    int kind;
    pcre2_code *re;
    int jit; /* re has JIT code: use the fast entry point */
    int behavior;
    int invert;
} pretok_step;

#define MAX_STEPS 16

typedef struct {
    char *content;
    size_t len;
    int32_t id;
    unsigned char special, lstrip, rstrip, single_word, normalized;
} added_token;

/* string -> id, open addressing; keys point into the tokenizer's own copies */
typedef struct {
    const char **key;
    uint32_t *klen;
    int32_t *val;
    size_t cap; /* power of two */
} str_map;

/* (left id, right id) -> (rank, merged id); one 16-byte slot per entry so a
 * probe touches one cache line */
typedef struct {
    uint64_t key; /* MERGE_EMPTY = free */
    uint32_t rank;
    int32_t out;
} merge_slot;
typedef struct {
    merge_slot *slot;
    size_t cap;
} merge_map;
#define MERGE_EMPTY UINT64_MAX

/* ----- the piece cache: sharded, direct-mapped, locked per shard ----- */
#define CACHE_SHARDS 64
#define CACHE_SLOTS 1024 /* per shard: 64K entries of 64 bytes, 4 MiB */
#define CACHE_MAXP 22    /* longest piece cached, bytes */
#define CACHE_MAXI 8     /* most ids of a cached piece */
typedef struct {
    uint64_t h;
    uint8_t n, nids;
    char s[CACHE_MAXP];
    int32_t ids[CACHE_MAXI];
} cache_entry;
typedef struct {
    pthread_mutex_t mu;
    cache_entry e[CACHE_SLOTS];
} cache_shard;

struct dsv4_tokenizer {
    char *path;
    int32_t n_vocab;
    char **piece;        /* [n_vocab] token as in the file (added: content) or NULL */
    char **bytes;        /* [n_vocab] decoded bytes */
    uint32_t *bytes_len; /* [n_vocab] */
    unsigned char *kind; /* [n_vocab] 0 vocab, 1 added, 2 added+special, 255 no token */
    str_map vocab;       /* model.vocab only: what BPE may produce */
    merge_map merges;
    int32_t byte_id[256]; /* id of the one-byte token, -1 if the vocab lacks it */
    int32_t unk_id;       /* -1: unknown bytes are dropped (as HF does) */
    int fuse_unk, ignore_merges;

    added_token *added;
    size_t n_added;
    /* a byte trie of the added contents: (node << 32 | byte) -> child node */
    merge_map trie;
    int32_t *trie_tok;            /* [2 * nodes]: index into added of the token ending here, per pass; -1 */
    unsigned char can_start[256]; /* a byte that begins some added token */
    pcre2_code *word_re;          /* one word character, for single_word */

    pretok_step steps[MAX_STEPS];
    int n_steps;
    pcre2_match_context *mctx;
    uint32_t max_ovec;

    cache_shard *cache;
};

/* 8 bytes at a time: pieces and tokens are short, so the tail matters */
static uint64_t hash_bytes(const void *p, size_t n) {
    const unsigned char *s = p;
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
        h ^= h >> 31;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    h = (h ^ w) * 0x94D049BB133111EBULL;
    return h ^ (h >> 29);
}

static int str_map_init(str_map *m, size_t n) {
    size_t cap = 16;
    while (cap < n * 2)
        cap *= 2;
    m->cap = cap;
    m->key = calloc(cap, sizeof *m->key);
    m->klen = calloc(cap, sizeof *m->klen);
    m->val = calloc(cap, sizeof *m->val);
    return m->key && m->klen && m->val ? 0 : -1;
}

static void str_map_free(str_map *m) {
    free(m->key);
    free(m->klen);
    free(m->val);
}

static int32_t str_map_get(const str_map *m, const char *s, size_t n) {
    if (!m->cap) return -1;
    size_t i = hash_bytes(s, n) & (m->cap - 1);
    while (m->key[i]) {
        if (m->klen[i] == n && !memcmp(m->key[i], s, n)) return m->val[i];
        i = (i + 1) & (m->cap - 1);
    }
    return -1;
}

/* Inserts; returns the previous value if the key was present (no change), else -1. */
static int32_t str_map_put(str_map *m, const char *s, size_t n, int32_t v) {
    size_t i = hash_bytes(s, n) & (m->cap - 1);
    while (m->key[i]) {
        if (m->klen[i] == n && !memcmp(m->key[i], s, n)) return m->val[i];
        i = (i + 1) & (m->cap - 1);
    }
    m->key[i] = s;
    m->klen[i] = (uint32_t)n;
    m->val[i] = v;
    return -1;
}

static uint64_t hash_pair(uint64_t k) {
    k *= 0x9E3779B97F4A7C15ULL;
    return k ^ (k >> 31);
}

static int merge_map_init(merge_map *m, size_t n) {
    size_t cap = 16;
    while (cap < n * 2)
        cap *= 2;
    m->cap = cap;
    m->slot = malloc(cap * sizeof *m->slot);
    if (!m->slot) return -1;
    for (size_t i = 0; i < cap; i++)
        m->slot[i].key = MERGE_EMPTY;
    return 0;
}

static void merge_map_free(merge_map *m) {
    free(m->slot);
}

/* A later duplicate of a merge replaces the earlier one (what a Rust HashMap
 * built from the list does). */
static void merge_map_put(merge_map *m, int32_t a, int32_t b, uint32_t rank, int32_t out) {
    uint64_t k = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = hash_pair(k) & (m->cap - 1);
    while (m->slot[i].key != MERGE_EMPTY && m->slot[i].key != k)
        i = (i + 1) & (m->cap - 1);
    m->slot[i] = (merge_slot){k, rank, out};
}

static inline int merge_map_get(const merge_map *m, int32_t a, int32_t b, uint32_t *rank, int32_t *out) {
    uint64_t k = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = hash_pair(k) & (m->cap - 1);
    for (;;) {
        const merge_slot *sl = &m->slot[i];
        if (sl->key == k) {
            *rank = sl->rank;
            *out = sl->out;
            return 1;
        }
        if (sl->key == MERGE_EMPTY) return 0;
        i = (i + 1) & (m->cap - 1);
    }
}

void dsv4_tokenizer_free(dsv4_tokenizer *tok) {
    if (!tok) return;
    if (tok->piece)
        for (int32_t i = 0; i < tok->n_vocab; i++)
            free(tok->piece[i]);
    if (tok->bytes)
        for (int32_t i = 0; i < tok->n_vocab; i++)
            free(tok->bytes[i]);
    free(tok->piece);
    free(tok->bytes);
    free(tok->bytes_len);
    free(tok->kind);
    str_map_free(&tok->vocab);
    merge_map_free(&tok->merges);
    for (size_t i = 0; i < tok->n_added; i++)
        free(tok->added[i].content);
    free(tok->added);
    merge_map_free(&tok->trie);
    free(tok->trie_tok);
    pcre2_code_free(tok->word_re);
    for (int i = 0; i < tok->n_steps; i++)
        pcre2_code_free(tok->steps[i].re);
    pcre2_match_context_free(tok->mctx);
    if (tok->cache) {
        for (int i = 0; i < CACHE_SHARDS; i++)
            pthread_mutex_destroy(&tok->cache[i].mu);
        free(tok->cache);
    }
    free(tok->path);
    free(tok);
}

/* ------------------------------------------------------------------------ */
/* loading: regexes                                                          */
/* ------------------------------------------------------------------------ */

/* The file's regexes are written for Oniguruma (what the Rust library uses).
 * Three rewrites make PCRE2 (UTF + UCP) see the same sets:
 *  - \s lacks U+0085 in PCRE2 (Oniguruma's \s is the White_Space property:
 *    \t..\r, U+0085 and the Z categories, the same in Unicode 14 and 15);
 *  - \h is a hex digit in Oniguruma, horizontal space in PCRE2;
 *  - general-category escapes (\p{L}, \P{N}, \p{^M}, \pS, \p{Letter}...) become
 *    the Unicode 15 set from utf8proc, because PCRE2 10.42's own tables are
 *    Unicode 14: PCRE2's escape plus the ranges it lacks, or a full range list
 *    (text/unicode_props.h).  Inside [...] the text is spliced into the class
 *    (a \P there lists the complement); outside, it gets its own brackets.
 * Other property names (scripts, Alphabetic, Any...) are left to PCRE2, after
 * checking that it knows them. */
#define ONIG_SPACE "\\t\\n\\x0B\\f\\r\\x{85}\\p{Z}"

/* Appends the rewrite of the property escape at SRC[i] ('\\' then 'p' or 'P')
 * and returns the index of its last byte, or 0 with ERR set.  CLASS_DASH: the
 * class so far ends in a '-' that would make a range with this escape. */
static size_t translate_property(const char *src, size_t n, size_t i, int in_class, int class_dash,
                                 dsv4_bytes *out, const char *where, dsv4_err *err) {
    int negate = src[i + 1] == 'P';
    size_t name_at, name_len, last;
    if (i + 2 >= n) {
        dsv4_errf(err, "%s: \\%c at the end of the regex", where, src[i + 1]);
        return 0;
    }
    if (src[i + 2] == '{') {
        const char *close = memchr(src + i + 3, '}', n - (i + 3));
        if (!close) {
            dsv4_errf(err, "%s: \\%c{ without a closing '}' at offset %zu of the regex", where, src[i + 1], i);
            return 0;
        }
        name_at = i + 3;
        last = (size_t)(close - src);
        name_len = last - name_at;
        if (name_len > 0 && src[name_at] == '^') { /* \p{^L} == \P{L} */
            negate = !negate;
            name_at++;
            name_len--;
        }
    } else { /* \pL: a one-letter name */
        name_at = i + 2;
        name_len = 1;
        last = i + 2;
    }
    size_t esc_len = last + 1 - i;
    uint64_t mask = dsv4_uprop_category_mask(src + name_at, name_len);
    if (!mask) {
        /* not a general category: PCRE2 must know it (a script or a binary
         * property); checked alone so the error names the escape */
        int ecode;
        PCRE2_SIZE eoff;
        pcre2_code *probe = pcre2_compile((PCRE2_SPTR)(src + i), esc_len, PCRE2_UTF | PCRE2_UCP, &ecode, &eoff, NULL);
        if (!probe) {
            dsv4_errf(err,
                      "%s: unknown Unicode property \"%.*s\" in %.*s at offset %zu of the regex (not a general "
                      "category, nor a script or binary property that PCRE2 knows)",
                      where, (int)name_len, src + name_at, (int)esc_len, src + i, i);
            return 0;
        }
        pcre2_code_free(probe);
        return dsv4_bytes_append(out, src + i, esc_len, err) ? 0 : last;
    }
    if (in_class && (class_dash || (last + 2 < n && src[last + 1] == '-' && src[last + 2] != ']'))) {
        dsv4_errf(err, "%s: a class range cannot start or end at %.*s (offset %zu of the regex)", where, (int)esc_len,
                  src + i, i);
        return 0;
    }
    if (mask == dsv4_uprop_surrogate_mask() && !negate) /* empty in valid UTF-8; PCRE2 has it */
        return dsv4_bytes_append(out, "\\p{Cs}", 6, err) ? 0 : last;
    size_t set_len;
    char *set = dsv4_uprop_pcre2_set(mask, negate, in_class, &set_len, err);
    if (!set) return 0;
    int rc = dsv4_bytes_append(out, set, set_len, err);
    free(set);
    return rc ? 0 : last;
}

/* Returns the PCRE2 form of the Oniguruma regex SRC[0..n) (malloc'd, NUL
 * terminated, *out_len bytes), or NULL with ERR set. */
static char *translate_regex(const char *src, size_t n, size_t *out_len, const char *where, dsv4_err *err) {
    dsv4_bytes out = {0};
    int in_class = 0, class_items = 0, class_dash = 0;
    if (dsv4_bytes_append(&out, "", 0, err)) return NULL;
    for (size_t i = 0; i < n; i++) {
        char c = src[i];
        int rc = 0;
        if (c == '\\' && i + 1 < n) {
            char d = src[i + 1];
            const char *rep = NULL;
            if (d == 'p' || d == 'P') {
                size_t last = translate_property(src, n, i, in_class, class_dash, &out, where, err);
                if (!last) goto fail;
                i = last;
                class_items++;
                class_dash = 0;
                continue;
            }
            if (d == 's')
                rep = in_class ? ONIG_SPACE : "[" ONIG_SPACE "]";
            else if (d == 'S' && !in_class)
                rep = "[^" ONIG_SPACE "]";
            else if (d == 'h')
                rep = in_class ? "0-9a-fA-F" : "[0-9a-fA-F]";
            else if (d == 'H' && !in_class)
                rep = "[^0-9a-fA-F]";
            rc = rep ? dsv4_bytes_append(&out, rep, strlen(rep), err) : dsv4_bytes_append(&out, src + i, 2, err);
            if (rc) goto fail;
            i++;
            class_items++;
            class_dash = 0;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = 1;
            class_items = class_dash = 0;
            size_t from = i;
            /* a ']' right after '[' or '[^' is a literal */
            if (i + 1 < n && src[i + 1] == '^') i++;
            if (i + 1 < n && src[i + 1] == ']') {
                i++;
                class_items++;
            }
            if (dsv4_bytes_append(&out, src + from, i + 1 - from, err)) goto fail;
            continue;
        }
        if (in_class && c == '[' && i + 1 < n && src[i + 1] == ':') { /* [:alpha:] */
            const char *end = strstr(src + i + 2, ":]");
            if (end && (size_t)(end - src) < n) {
                size_t l = (size_t)(end - (src + i)) + 2;
                if (dsv4_bytes_append(&out, src + i, l, err)) goto fail;
                i += l - 1;
                class_items++;
                class_dash = 0;
                continue;
            }
        }
        if (in_class && c == ']') in_class = 0;
        if (in_class) {
            /* a '-' after an item and before another makes a range */
            int dash = c == '-' && class_items > 0 && !(i + 1 < n && src[i + 1] == ']');
            if (!dash) class_items++;
            class_dash = dash;
        }
        if (dsv4_bytes_append(&out, &c, 1, err)) goto fail;
    }
    *out_len = out.len;
    return out.data;
fail:
    dsv4_bytes_free(&out);
    return NULL;
}

static pcre2_code *compile_regex(const char *pattern, size_t n, int literal, const char *where,
                                 dsv4_err *err) {
    size_t tr_len = 0;
    char *tr = literal ? NULL : translate_regex(pattern, n, &tr_len, where, err);
    if (!literal && !tr) return NULL;
    int ecode;
    PCRE2_SIZE eoff;
    /* MULTILINE: Oniguruma's ^ and $ are line anchors by default. */
    uint32_t opts = PCRE2_UTF | PCRE2_NO_UTF_CHECK | (literal ? PCRE2_LITERAL : PCRE2_UCP | PCRE2_MULTILINE);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)(literal ? pattern : tr), literal ? n : tr_len, opts,
                                   &ecode, &eoff, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ecode, msg, sizeof msg);
        /* the offset is in the rewritten pattern when a rewrite happened */
        int same = literal || (tr_len == n && !memcmp(tr, pattern, n));
        dsv4_errf(err, "%s: cannot compile regex \"%.200s\" at offset %zu%s: %s", where, pattern, (size_t)eoff,
                  same ? "" : " of its PCRE2 rewrite", (char *)msg);
        free(tr);
        return NULL;
    }
    free(tr);
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* failure is fine: the interpreter runs it */
    return re;
}

/* ------------------------------------------------------------------------ */
/* loading: JSON sections                                                    */
/* ------------------------------------------------------------------------ */

static int json_flag(json_t *obj, const char *key, int def, const char *where, int *out, dsv4_err *err) {
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (!json_is_boolean(v)) return dsv4_errf(err, "%s.%s: expected true or false", where, key);
    *out = json_is_true(v);
    return 0;
}

static int add_step(dsv4_tokenizer *tok, pretok_step st, const char *where, dsv4_err *err) {
    size_t jit_size = 0;
    if (st.re && pcre2_pattern_info(st.re, PCRE2_INFO_JITSIZE, &jit_size) == 0 && jit_size > 0) st.jit = 1;
    if (tok->n_steps >= MAX_STEPS) {
        pcre2_code_free(st.re);
        return dsv4_errf(err, "%s: more than %d pre-tokenizer steps", where, MAX_STEPS);
    }
    tok->steps[tok->n_steps++] = st;
    return 0;
}

/* Rust: is_alphanumeric || '_'.  \p{Alphabetic} is PCRE2's (Unicode 14);
 * \p{L} adds the letters new in 15.0 (docs/TOKENIZER.md) */
static const char WORD_REGEX[] = "^[\\p{Alphabetic}\\p{L}\\p{N}_]";
static const char GPT2_REGEX[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* One pre-tokenizer (Split, Digits or ByteLevel); *saw_bytelevel is set by the
 * ByteLevel one, which must come last. */
static int parse_pretok(dsv4_tokenizer *tok, json_t *p, const char *where, int *saw_bytelevel,
                        dsv4_err *err) {
    if (!json_is_object(p)) return dsv4_errf(err, "%s: expected an object", where);
    const char *type = json_string_value(json_object_get(p, "type"));
    if (!type) return dsv4_errf(err, "%s: missing \"type\"", where);
    if (*saw_bytelevel)
        return dsv4_errf(err,
                         "%s: a %s pre-tokenizer after ByteLevel is not supported (ByteLevel must be last)",
                         where, type);
    char w[300];
    if (!strcmp(type, "Split")) {
        json_t *pat = json_object_get(p, "pattern");
        json_t *rx = json_object_get(pat, "Regex"), *lit = json_object_get(pat, "String");
        if (!json_is_string(rx) && !json_is_string(lit))
            return dsv4_errf(err, "%s.pattern: expected {\"Regex\": \"...\"} or {\"String\": \"...\"}",
                             where);
        const char *b = json_string_value(json_object_get(p, "behavior"));
        pretok_step st = {.kind = STEP_SPLIT};
        if (!b) return dsv4_errf(err, "%s: missing \"behavior\"", where);
        if (!strcmp(b, "Removed"))
            st.behavior = BEHAVIOR_REMOVED;
        else if (!strcmp(b, "Isolated"))
            st.behavior = BEHAVIOR_ISOLATED;
        else if (!strcmp(b, "MergedWithPrevious"))
            st.behavior = BEHAVIOR_MERGED_PREV;
        else if (!strcmp(b, "MergedWithNext"))
            st.behavior = BEHAVIOR_MERGED_NEXT;
        else if (!strcmp(b, "Contiguous"))
            st.behavior = BEHAVIOR_CONTIGUOUS;
        else
            return dsv4_errf(err, "%s.behavior: unknown value \"%s\"", where, b);
        if (json_flag(p, "invert", 0, where, &st.invert, err)) return -1;
        json_t *ps = json_is_string(rx) ? rx : lit;
        snprintf(w, sizeof w, "%s.pattern", where);
        st.re = compile_regex(json_string_value(ps), json_string_length(ps), !json_is_string(rx), w, err);
        if (!st.re) return -1;
        return add_step(tok, st, where, err);
    }
    if (!strcmp(type, "Digits")) {
        int individual = 0;
        if (json_flag(p, "individual_digits", 0, where, &individual, err)) return -1;
        /* Rust's char::is_numeric is the N category; runs of it (Contiguous)
         * are the matches of \p{N}+. */
        const char *rx = individual ? "\\p{N}" : "\\p{N}+";
        pretok_step st = {.kind = STEP_SPLIT, .behavior = BEHAVIOR_ISOLATED};
        st.re = compile_regex(rx, strlen(rx), 0, where, err);
        if (!st.re) return -1;
        return add_step(tok, st, where, err);
    }
    if (!strcmp(type, "ByteLevel")) {
        int prefix = 0, use_regex = 1;
        if (json_flag(p, "add_prefix_space", 0, where, &prefix, err)) return -1;
        if (json_flag(p, "use_regex", 1, where, &use_regex, err)) return -1;
        *saw_bytelevel = 1;
        if (prefix && add_step(tok, (pretok_step){.kind = STEP_PREFIX_SPACE}, where, err)) return -1;
        if (use_regex) {
            pretok_step st = {.kind = STEP_SPLIT, .behavior = BEHAVIOR_ISOLATED};
            st.re = compile_regex(GPT2_REGEX, strlen(GPT2_REGEX), 0, where, err);
            if (!st.re) return -1;
            if (add_step(tok, st, where, err)) return -1;
        }
        return 0;
    }
    return dsv4_errf(
        err, "%s: unsupported pre-tokenizer type \"%s\" (supported: Sequence, Split, Digits, ByteLevel)",
        where, type);
}

static int parse_pretokenizer(dsv4_tokenizer *tok, json_t *root, dsv4_err *err) {
    json_t *p = json_object_get(root, "pre_tokenizer");
    if (!p || json_is_null(p))
        return dsv4_errf(err, "pre_tokenizer: missing; a byte-level BPE needs a ByteLevel pre-tokenizer");
    int saw = 0;
    const char *type = json_string_value(json_object_get(p, "type"));
    if (type && !strcmp(type, "Sequence")) {
        json_t *list = json_object_get(p, "pretokenizers");
        if (!json_is_array(list)) return dsv4_errf(err, "pre_tokenizer.pretokenizers: expected an array");
        for (size_t i = 0; i < json_array_size(list); i++) {
            char w[64];
            snprintf(w, sizeof w, "pre_tokenizer.pretokenizers[%zu]", i);
            if (parse_pretok(tok, json_array_get(list, i), w, &saw, err)) return -1;
        }
    } else if (parse_pretok(tok, p, "pre_tokenizer", &saw, err)) {
        return -1;
    }
    if (!saw)
        return dsv4_errf(err,
                         "pre_tokenizer: no ByteLevel step; only byte-level BPE tokenizers are supported");
    return 0;
}

static int check_decoder(json_t *root, dsv4_err *err) {
    json_t *d = json_object_get(root, "decoder");
    const char *type = json_string_value(json_object_get(d, "type"));
    if (!d || json_is_null(d))
        return dsv4_errf(err, "decoder: missing; a byte-level BPE needs a ByteLevel decoder");
    if (type && !strcmp(type, "ByteLevel")) return 0;
    if (type && !strcmp(type, "Sequence")) {
        json_t *list = json_object_get(d, "decoders");
        size_t n = json_array_size(list);
        for (size_t i = 0; i < n; i++) {
            const char *t = json_string_value(json_object_get(json_array_get(list, i), "type"));
            if (!t || strcmp(t, "ByteLevel"))
                return dsv4_errf(err, "decoder.decoders[%zu]: unsupported decoder type \"%s\"", i,
                                 t ? t : "?");
        }
        if (n) return 0;
    }
    return dsv4_errf(err, "decoder: unsupported type \"%s\" (expected ByteLevel)", type ? type : "?");
}

static int check_normalizer(json_t *root, dsv4_err *err) {
    json_t *n = json_object_get(root, "normalizer");
    if (!n || json_is_null(n)) return 0;
    const char *type = json_string_value(json_object_get(n, "type"));
    if (type && !strcmp(type, "Sequence") && json_array_size(json_object_get(n, "normalizers")) == 0)
        return 0;
    return dsv4_errf(err, "normalizer: type \"%s\" is not supported (only a null normalizer)",
                     type ? type : "?");
}

/* Token string (byte-level form) -> bytes.  A string with a character outside
 * the byte map decodes to its own UTF-8 (what the ByteLevel decoder does). */
static int piece_to_bytes(const char *s, size_t n, const int16_t *inv, char **out, uint32_t *out_len) {
    char *b = malloc(n + 1);
    if (!b) return -1;
    size_t o = 0, i = 0;
    const unsigned char *u = (const unsigned char *)s;
    while (i < n) {
        size_t l;
        if (utf8_scan(u + i, n - i, &l) != 1) break;
        uint32_t cp = utf8_decode_at(u + i, l);
        if (cp >= 512 || inv[cp] < 0) break;
        b[o++] = (char)inv[cp];
        i += l;
    }
    if (i < n) { /* not byte-level: keep the text */
        memcpy(b, s, n);
        o = n;
    }
    b[o] = '\0';
    *out = b;
    *out_len = (uint32_t)o;
    return 0;
}

#define MAX_VOCAB (1 << 24)

static int load_model(dsv4_tokenizer *tok, json_t *root, const int16_t *inv, dsv4_err *err) {
    json_t *model = json_object_get(root, "model");
    if (!json_is_object(model)) return dsv4_errf(err, "missing object \"model\"");
    json_t *type = json_object_get(model, "type");
    if (type && !json_is_null(type) && (!json_is_string(type) || strcmp(json_string_value(type), "BPE")))
        return dsv4_errf(err, "model.type: unsupported model type \"%s\" (only BPE)",
                         json_is_string(type) ? json_string_value(type) : "?");
    json_t *vocab = json_object_get(model, "vocab");
    if (!json_is_object(vocab)) return dsv4_errf(err, "missing object \"model.vocab\"");
    json_t *merges = json_object_get(model, "merges");
    if (!json_is_array(merges)) return dsv4_errf(err, "missing array \"model.merges\"");
    if (json_object_size(vocab) == 0) return dsv4_errf(err, "model.vocab: empty");

    json_t *v;
    double dropout = json_number_value(json_object_get(model, "dropout"));
    if (json_object_get(model, "dropout") && !json_is_null(json_object_get(model, "dropout")) &&
        dropout != 0.0)
        return dsv4_errf(err, "model.dropout: BPE dropout (%g) is not supported at inference", dropout);
    const char *keys[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++) {
        v = json_object_get(model, keys[k]);
        if (v && !json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
            return dsv4_errf(err, "model.%s: not supported for byte-level BPE", keys[k]);
    }
    int byte_fallback = 0;
    if (json_flag(model, "byte_fallback", 0, "model", &byte_fallback, err)) return -1;
    if (byte_fallback) return dsv4_errf(err, "model.byte_fallback: not supported for byte-level BPE");
    if (json_flag(model, "fuse_unk", 0, "model", &tok->fuse_unk, err)) return -1;
    if (json_flag(model, "ignore_merges", 0, "model", &tok->ignore_merges, err)) return -1;

    /* the id range covers the vocab and the added tokens */
    int64_t max_id = -1;
    const char *key;
    json_object_foreach(vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= MAX_VOCAB)
            return dsv4_errf(err, "model.vocab[\"%.100s\"]: id must be an integer in [0, %d)", key,
                             MAX_VOCAB);
        if (json_integer_value(v) > max_id) max_id = json_integer_value(v);
    }
    json_t *added = json_object_get(root, "added_tokens");
    if (added && !json_is_null(added) && !json_is_array(added))
        return dsv4_errf(err, "added_tokens: expected an array");
    for (size_t i = 0; i < json_array_size(added); i++) {
        json_t *a = json_array_get(added, i), *id = json_object_get(a, "id");
        if (!json_is_object(a)) return dsv4_errf(err, "added_tokens[%zu]: expected an object", i);
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= MAX_VOCAB)
            return dsv4_errf(err, "added_tokens[%zu].id: must be an integer in [0, %d)", i, MAX_VOCAB);
        if (!json_is_string(json_object_get(a, "content")) ||
            json_string_length(json_object_get(a, "content")) == 0)
            return dsv4_errf(err, "added_tokens[%zu].content: must be a non-empty string", i);
        if (json_integer_value(id) > max_id) max_id = json_integer_value(id);
    }
    tok->n_vocab = (int32_t)(max_id + 1);
    size_t nv = (size_t)tok->n_vocab;
    tok->piece = calloc(nv, sizeof *tok->piece);
    tok->bytes = calloc(nv, sizeof *tok->bytes);
    tok->bytes_len = calloc(nv, sizeof *tok->bytes_len);
    tok->kind = malloc(nv);
    if (!tok->piece || !tok->bytes || !tok->bytes_len || !tok->kind ||
        str_map_init(&tok->vocab, json_object_size(vocab)))
        return dsv4_errf(err, "out of memory for a vocabulary of %zu ids", nv);
    memset(tok->kind, 255, nv);

    json_object_foreach(vocab, key, v) {
        int32_t id = (int32_t)json_integer_value(v);
        if (tok->piece[id])
            return dsv4_errf(err, "model.vocab: id %d is used by both \"%.100s\" and \"%.100s\"", id,
                             tok->piece[id], key);
        size_t kl = strlen(key);
        tok->piece[id] = strdup(key);
        if (!tok->piece[id] || piece_to_bytes(key, kl, inv, &tok->bytes[id], &tok->bytes_len[id]))
            return dsv4_errf(err, "out of memory");
        tok->kind[id] = 0;
        str_map_put(&tok->vocab, tok->piece[id], kl, id);
    }

    /* merges: "a b" strings or ["a", "b"] pairs; rank = position */
    if (json_array_size(merges) >= UINT32_MAX) return dsv4_errf(err, "model.merges: too many merges");
    if (merge_map_init(&tok->merges, json_array_size(merges)))
        return dsv4_errf(err, "out of memory for merges");
    char *buf = NULL;
    size_t bufcap = 0;
    for (size_t i = 0; i < json_array_size(merges); i++) {
        json_t *m = json_array_get(merges, i);
        const char *a, *b;
        size_t al, bl;
        if (json_is_string(m)) {
            const char *s = json_string_value(m), *sp = strchr(s, ' ');
            if (!sp || sp == s || sp[1] == '\0') {
                free(buf);
                return dsv4_errf(err, "model.merges[%zu]: \"%.100s\" is not of the form \"a b\"", i, s);
            }
            a = s, al = (size_t)(sp - s), b = sp + 1, bl = strlen(b);
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0)), al = strlen(a);
            b = json_string_value(json_array_get(m, 1)), bl = strlen(b);
        } else {
            free(buf);
            return dsv4_errf(err, "model.merges[%zu]: expected \"a b\" or [\"a\", \"b\"]", i);
        }
        int32_t ia = str_map_get(&tok->vocab, a, al), ib = str_map_get(&tok->vocab, b, bl);
        if (ia < 0 || ib < 0) {
            free(buf);
            return dsv4_errf(err, "model.merges[%zu]: unknown token \"%.*s\"", i, (int)(ia < 0 ? al : bl),
                             ia < 0 ? a : b);
        }
        if (al + bl + 1 > bufcap) {
            bufcap = (al + bl + 1) * 2;
            char *p = realloc(buf, bufcap);
            if (!p) {
                free(buf);
                return dsv4_errf(err, "out of memory");
            }
            buf = p;
        }
        memcpy(buf, a, al);
        memcpy(buf + al, b, bl);
        int32_t io = str_map_get(&tok->vocab, buf, al + bl);
        if (io < 0) {
            dsv4_errf(err, "model.merges[%zu]: merged token \"%.*s\" is not in model.vocab", i,
                      (int)(al + bl), buf);
            free(buf);
            return -1;
        }
        merge_map_put(&tok->merges, ia, ib, (uint32_t)i, io);
    }
    free(buf);

    for (int b = 0; b < 256; b++) {
        char s[4];
        size_t l = utf8_encode(dsv4_byte_to_unicode((uint8_t)b), s);
        tok->byte_id[b] = str_map_get(&tok->vocab, s, l);
    }
    tok->unk_id = -1;
    v = json_object_get(model, "unk_token");
    if (v && !json_is_null(v)) {
        if (!json_is_string(v)) return dsv4_errf(err, "model.unk_token: expected a string");
        tok->unk_id = str_map_get(&tok->vocab, json_string_value(v), json_string_length(v));
        if (tok->unk_id < 0)
            return dsv4_errf(err, "model.unk_token: \"%.100s\" is not in model.vocab", json_string_value(v));
    }
    return 0;
}

static int load_added(dsv4_tokenizer *tok, json_t *root, dsv4_err *err) {
    json_t *added = json_object_get(root, "added_tokens");
    size_t n = json_array_size(added);
    tok->added = calloc(n ? n : 1, sizeof *tok->added);
    if (!tok->added) return dsv4_errf(err, "out of memory");
    str_map seen;
    if (str_map_init(&seen, n)) return dsv4_errf(err, "out of memory");
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        json_t *a = json_array_get(added, i), *c = json_object_get(a, "content");
        added_token *t = &tok->added[tok->n_added];
        char w[64];
        snprintf(w, sizeof w, "added_tokens[%zu]", i);
        int special = 0, lstrip = 0, rstrip = 0, single_word = 0, normalized = 0;
        if (json_flag(a, "special", 0, w, &special, err) || json_flag(a, "lstrip", 0, w, &lstrip, err) ||
            json_flag(a, "rstrip", 0, w, &rstrip, err) ||
            json_flag(a, "single_word", 0, w, &single_word, err) ||
            json_flag(a, "normalized", !special, w, &normalized, err)) {
            rc = -1;
            break;
        }
        t->len = json_string_length(c);
        t->content = malloc(t->len + 1);
        if (!t->content) {
            rc = dsv4_errf(err, "out of memory");
            break;
        }
        memcpy(t->content, json_string_value(c), t->len + 1);
        tok->n_added++;
        t->id = (int32_t)json_integer_value(json_object_get(a, "id"));
        t->special = (unsigned char)special, t->lstrip = (unsigned char)lstrip,
        t->rstrip = (unsigned char)rstrip;
        t->single_word = (unsigned char)single_word, t->normalized = (unsigned char)normalized;
        if (memchr(t->content, '\0', t->len)) {
            rc = dsv4_errf(err, "%s.content: contains a NUL character", w);
            break;
        }
        int32_t prev = str_map_put(&seen, t->content, t->len, t->id);
        if (prev >= 0) {
            rc = dsv4_errf(err, "%s: content \"%.100s\" appears twice (ids %d and %d)", w, t->content, prev,
                           t->id);
            break;
        }
        if (tok->kind[t->id] != 255 && tok->kind[t->id] != 0) {
            rc = dsv4_errf(err, "%s: id %d is used by two added tokens", w, t->id);
            break;
        }
        /* an added token's id decodes to its content and prints as it */
        free(tok->piece[t->id]);
        free(tok->bytes[t->id]);
        tok->piece[t->id] = strdup(t->content);
        tok->bytes[t->id] = strdup(t->content);
        tok->bytes_len[t->id] = (uint32_t)t->len;
        tok->kind[t->id] = special ? 2 : 1;
        if (!tok->piece[t->id] || !tok->bytes[t->id]) rc = dsv4_errf(err, "out of memory");
    }
    str_map_free(&seen);
    if (rc) return -1;
    size_t total = 1;
    for (size_t i = 0; i < tok->n_added; i++)
        total += tok->added[i].len;
    tok->trie_tok = malloc(2 * total * sizeof *tok->trie_tok);
    if (!tok->trie_tok || merge_map_init(&tok->trie, total)) return dsv4_errf(err, "out of memory");
    for (size_t i = 0; i < 2 * total; i++)
        tok->trie_tok[i] = -1;
    int32_t nodes = 1;
    for (size_t i = 0; i < tok->n_added; i++) {
        const added_token *t = &tok->added[i];
        int32_t node = 0;
        for (size_t k = 0; k < t->len; k++) {
            unsigned char b = (unsigned char)t->content[k];
            uint32_t unused;
            int32_t child;
            if (!merge_map_get(&tok->trie, node, b, &unused, &child)) {
                child = nodes++;
                merge_map_put(&tok->trie, node, b, 0, child);
            }
            node = child;
        }
        tok->trie_tok[2 * node + (t->normalized ? 1 : 0)] = (int32_t)i;
        tok->can_start[(unsigned char)t->content[0]] = 1;
    }
    return 0;
}

int dsv4_tokenizer_load(dsv4_tokenizer **out, const char *path, dsv4_err *err) {
    *out = NULL;
    if (!path || !*path) return dsv4_errf(err, "tokenizer: empty path");
    struct stat st;
    if (stat(path, &st)) return dsv4_errf(err, "%s: %s", path, strerror(errno));
    size_t pl = strlen(path) + 32;
    char *file = malloc(pl);
    if (!file) return dsv4_errf(err, "out of memory");
    if (S_ISDIR(st.st_mode))
        snprintf(file, pl, "%s/tokenizer.json", path);
    else
        snprintf(file, pl, "%s", path);

    json_error_t jerr;
    json_t *root = json_load_file(file, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        dsv4_errf(err, "%s: not valid JSON (line %d, column %d): %s", file, jerr.line, jerr.column,
                  jerr.text);
        free(file);
        return -1; /* the message names the file already */
    }
    dsv4_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) {
        json_decref(root);
        free(file);
        return dsv4_errf(err, "out of memory");
    }
    tok->path = file;
    int16_t inv[512];
    for (int i = 0; i < 512; i++)
        inv[i] = -1;
    for (int b = 0; b < 256; b++)
        inv[dsv4_byte_to_unicode((uint8_t)b)] = (int16_t)b;

    int rc = -1;
    if (!json_is_object(root)) {
        dsv4_errf(err, "top level is not a JSON object");
        goto done;
    }
    if (check_normalizer(root, err) || check_decoder(root, err) || load_model(tok, root, inv, err) ||
        load_added(tok, root, err) || parse_pretokenizer(tok, root, err))
        goto done;
    tok->word_re = compile_regex(WORD_REGEX, strlen(WORD_REGEX), 0, "single_word", err);
    tok->mctx = pcre2_match_context_create(NULL);
    tok->cache = calloc(CACHE_SHARDS, sizeof *tok->cache);
    if (!tok->word_re || !tok->mctx || !tok->cache) {
        if (!tok->word_re) goto done;
        dsv4_errf(err, "out of memory");
        goto done;
    }
    /* bound pathological regex work on hostile input; the file's regexes need
     * a few steps per character */
    pcre2_set_match_limit(tok->mctx, 50u * 1000 * 1000);
    pcre2_set_depth_limit(tok->mctx, 100u * 1000);
    for (int i = 0; i < CACHE_SHARDS; i++)
        pthread_mutex_init(&tok->cache[i].mu, NULL);
    rc = 0;
done:
    json_decref(root);
    if (rc) {
        dsv4_err_prefix(err, "%s", file);
        dsv4_tokenizer_free(tok);
        return -1;
    }
    *out = tok;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* BPE                                                                       */
/* ------------------------------------------------------------------------ */

typedef struct {
    uint32_t rank;
    int32_t pos, out;
} merge_cand;

/* per-call working memory, grown as needed and freed at the end of the call */
typedef struct {
    int32_t *sym, *prev, *next;
    merge_cand *heap;
    size_t cap, heap_len, heap_cap;
} bpe_scratch;

static inline int cand_less(merge_cand a, merge_cand b) {
    return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos);
}

static int heap_push(bpe_scratch *s, merge_cand c) {
    if (s->heap_len == s->heap_cap) { /* grows on demand: most pieces need far less than the 3n bound */
        size_t hc = s->heap_cap ? s->heap_cap * 2 : 256;
        merge_cand *h = realloc(s->heap, hc * sizeof *h);
        if (!h) return -1;
        s->heap = h;
        s->heap_cap = hc;
    }
    size_t i = s->heap_len++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(c, s->heap[p])) break;
        s->heap[i] = s->heap[p];
        i = p;
    }
    s->heap[i] = c;
    return 0;
}

static merge_cand heap_pop(bpe_scratch *s) {
    merge_cand top = s->heap[0], last = s->heap[--s->heap_len];
    size_t i = 0, n = s->heap_len;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        merge_cand best = last;
        if (l < n && cand_less(s->heap[l], best)) m = l, best = s->heap[l];
        if (r < n && cand_less(s->heap[r], best)) m = r;
        if (m == i) break;
        s->heap[i] = s->heap[m];
        i = m;
    }
    if (n) s->heap[i] = last;
    return top;
}

static int scratch_reserve(bpe_scratch *s, size_t n, dsv4_err *err) {
    if (n <= s->cap) return 0;
    size_t cap = n < 256 ? 256 : n + n / 4;
    int32_t *a = realloc(s->sym, cap * sizeof *a);
    if (a) s->sym = a;
    int32_t *b = realloc(s->prev, cap * sizeof *b);
    if (b) s->prev = b;
    int32_t *c = realloc(s->next, cap * sizeof *c);
    if (c) s->next = c;
    if (!a || !b || !c) return dsv4_errf(err, "out of memory for a piece of %zu bytes", n);
    s->cap = cap;
    return 0;
}

static void scratch_free(bpe_scratch *s) {
    free(s->sym);
    free(s->prev);
    free(s->next);
    free(s->heap);
}

static inline int try_pair(const dsv4_tokenizer *tok, bpe_scratch *s, int32_t left) {
    int32_t right = s->next[left];
    if (right < 0) return 0;
    uint32_t rank;
    int32_t out;
    if (merge_map_get(&tok->merges, s->sym[left], s->sym[right], &rank, &out))
        return heap_push(s, (merge_cand){rank, left, out});
    return 0;
}

/* Short pieces: the rank of each live pair sits beside its left symbol and the
 * lowest (rank, position) is found by a scan, which beats a heap below a few
 * dozen symbols.  Same order as the heap: a pair's span only grows when a
 * neighbour merges, so a stale heap entry can never match the current pair. */
#define SHORT_PIECE 48
#define NO_RANK UINT32_MAX
static void bpe_short(const dsv4_tokenizer *tok, bpe_scratch *s, int32_t m) {
    uint32_t rank[SHORT_PIECE];
    int32_t out[SHORT_PIECE];
    for (int32_t i = 0; i < m; i++) {
        rank[i] = NO_RANK;
        if (i + 1 < m && !merge_map_get(&tok->merges, s->sym[i], s->sym[i + 1], &rank[i], &out[i]))
            rank[i] = NO_RANK;
    }
    for (;;) {
        uint32_t best = NO_RANK;
        int32_t at = -1;
        for (int32_t i = 0; i >= 0; i = s->next[i])
            if (rank[i] < best) best = rank[i], at = i;
        if (at < 0) return;
        int32_t right = s->next[at];
        s->sym[at] = out[at];
        s->sym[right] = -1;
        s->next[at] = s->next[right];
        if (s->next[right] >= 0) s->prev[s->next[right]] = at;
        int32_t nb[2] = {s->prev[at], at}; /* the two pairs that changed */
        for (int k = 0; k < 2; k++) {
            int32_t l = nb[k];
            if (l < 0) continue;
            rank[l] = NO_RANK;
            if (s->next[l] >= 0 &&
                !merge_map_get(&tok->merges, s->sym[l], s->sym[s->next[l]], &rank[l], &out[l]))
                rank[l] = NO_RANK;
        }
    }
}

/* Merges the byte symbols of P by rank, lowest rank first and leftmost among
 * equal ranks (the order of the Rust library's priority queue), and appends the
 * resulting ids. */
static int bpe_piece(const dsv4_tokenizer *tok, const unsigned char *p, size_t n, bpe_scratch *s,
                     dsv4_ids *out, dsv4_err *err) {
    if (tok->ignore_merges && n > 0) { /* a piece that is already a token is taken whole */
        char small[256] = {0}, *bl = n * 2 <= sizeof small ? small : malloc(n * 2);
        if (!bl) return dsv4_errf(err, "out of memory");
        size_t o = 0;
        for (size_t i = 0; i < n; i++)
            o += utf8_encode(dsv4_byte_to_unicode(p[i]), bl + o);
        int32_t id = str_map_get(&tok->vocab, bl, o);
        if (bl != small) free(bl);
        if (id >= 0) return dsv4_ids_push(out, id, err);
    }
    if (scratch_reserve(s, n, err)) return -1;
    int32_t m = 0;
    int last_unk = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = tok->byte_id[p[i]];
        if (id < 0) {
            if (tok->unk_id < 0) continue; /* dropped, as the Rust library does without unk */
            if (last_unk && tok->fuse_unk) continue;
            id = tok->unk_id;
            last_unk = 1;
        } else {
            last_unk = 0;
        }
        s->sym[m] = id;
        s->prev[m] = m - 1;
        s->next[m] = m + 1;
        m++;
    }
    if (m == 0) return 0;
    s->next[m - 1] = -1;
    if (m <= SHORT_PIECE) {
        bpe_short(tok, s, m);
    } else {
        s->heap_len = 0;
        for (int32_t i = 0; i + 1 < m; i++)
            if (try_pair(tok, s, i)) return dsv4_errf(err, "out of memory for a piece of %zu bytes", n);
        while (s->heap_len) {
            merge_cand c = heap_pop(s);
            if (s->sym[c.pos] < 0) continue; /* merged away */
            int32_t right = s->next[c.pos];
            if (right < 0) continue;
            uint32_t rank;
            int32_t merged;
            if (!merge_map_get(&tok->merges, s->sym[c.pos], s->sym[right], &rank, &merged) || merged != c.out)
                continue; /* stale: a neighbour changed */
            s->sym[c.pos] = merged;
            s->sym[right] = -1;
            s->next[c.pos] = s->next[right];
            if (s->next[right] >= 0) s->prev[s->next[right]] = c.pos;
            if ((s->prev[c.pos] >= 0 && try_pair(tok, s, s->prev[c.pos])) || try_pair(tok, s, c.pos))
                return dsv4_errf(err, "out of memory for a piece of %zu bytes", n);
        }
    }
    if (ids_reserve(out, (size_t)m, err)) return -1;
    for (int32_t i = 0; i >= 0; i = s->next[i])
        out->ids[out->len++] = s->sym[i];
    return 0;
}

/* BPE through the cache: pieces up to CACHE_MAXP bytes are remembered. */
static int bpe_cached(const dsv4_tokenizer *tok, const unsigned char *p, size_t n, bpe_scratch *s,
                      dsv4_ids *out, dsv4_err *err) {
    if (n > CACHE_MAXP) return bpe_piece(tok, p, n, s, out, err);
    uint64_t h = hash_bytes(p, n);
    cache_shard *sh = &tok->cache[h % CACHE_SHARDS];
    cache_entry *e = &sh->e[(h / CACHE_SHARDS) % CACHE_SLOTS];
    int32_t ids[CACHE_MAXI];
    int hit = 0, nids = 0;
    pthread_mutex_lock(&sh->mu);
    if (e->h == h && e->n == n && !memcmp(e->s, p, n)) {
        hit = 1;
        nids = e->nids;
        memcpy(ids, e->ids, (size_t)nids * sizeof *ids);
    }
    pthread_mutex_unlock(&sh->mu);
    if (hit) {
        if (ids_reserve(out, (size_t)nids, err)) return -1;
        memcpy(out->ids + out->len, ids, (size_t)nids * sizeof *ids);
        out->len += (size_t)nids;
        return 0;
    }
    size_t before = out->len;
    if (bpe_piece(tok, p, n, s, out, err)) return -1;
    size_t got = out->len - before;
    if (got > CACHE_MAXI) return 0;
    pthread_mutex_lock(&sh->mu);
    e->h = h;
    e->n = (uint8_t)n;
    e->nids = (uint8_t)got;
    memcpy(e->s, p, n);
    memcpy(e->ids, out->ids + before, got * sizeof *ids);
    pthread_mutex_unlock(&sh->mu);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* pre-tokenization                                                          */
/* ------------------------------------------------------------------------ */

typedef struct {
    size_t s, e;
    int match;
} span;

typedef struct {
    const dsv4_tokenizer *tok;
    pcre2_match_data *md;
    span *lv[MAX_STEPS];
    size_t lvcap[MAX_STEPS];
    char *pfx; /* " " + piece, for add_prefix_space */
    size_t pfxcap;
    bpe_scratch bpe;
    dsv4_ids *out;        /* encode: ids go here */
    dsv4_tok_piece_fn fn; /* pieces: or to this callback */
    void *ud;
    dsv4_err *err;
} enc_ctx;

static void enc_free(enc_ctx *c) {
    pcre2_match_data_free(c->md);
    for (int i = 0; i < MAX_STEPS; i++)
        free(c->lv[i]);
    free(c->pfx);
    scratch_free(&c->bpe);
}

static int lv_push(enc_ctx *c, int level, size_t *n, span sp) {
    if (*n == c->lvcap[level]) {
        size_t cap = c->lvcap[level] ? c->lvcap[level] * 2 : 64;
        span *p = realloc(c->lv[level], cap * sizeof *p);
        if (!p) return dsv4_errf(c->err, "out of memory");
        c->lv[level] = p;
        c->lvcap[level] = cap;
    }
    c->lv[level][(*n)++] = sp;
    return 0;
}

/* Finds every match of RE in S[0..n) the way the Rust onig crate iterates:
 * an empty match right where the previous match ended is skipped by advancing
 * one character.  Fills level LEVEL with matches and the gaps between them. */
static int find_matches(enc_ctx *c, int level, const pcre2_code *re, int jit, const char *s, size_t n,
                        size_t *count) {
    *count = 0;
    if (n == 0) return lv_push(c, level, count, (span){0, 0, 0});
    size_t pos = 0, prev = 0;
    int64_t last_end = -1;
    while (pos <= n) {
        int rc = jit ? pcre2_jit_match(re, (PCRE2_SPTR)s, n, pos, 0, c->md, c->tok->mctx)
                     : pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, c->md, c->tok->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[200];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return dsv4_errf(c->err, "pre-tokenizer regex failed on a piece of %zu bytes: %s", n,
                             (char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t ms = ov[0], me = ov[1];
        if (ms == me && last_end == (int64_t)me) {
            if (pos >= n) break;
            size_t l;
            utf8_scan((const unsigned char *)s + pos, n - pos, &l);
            pos += l;
            continue;
        }
        if (prev != ms && lv_push(c, level, count, (span){prev, ms, 0})) return -1;
        if (lv_push(c, level, count, (span){ms, me, 1})) return -1;
        prev = me;
        pos = me;
        last_end = (int64_t)me;
    }
    if (prev != n && lv_push(c, level, count, (span){prev, n, 0})) return -1;
    return 0;
}

/* Applies a Split behavior to the match list in place (the folds of the Rust
 * library's NormalizedString::split); returns the new count.  Spans flagged
 * match=1 afterwards are to be removed. */
static size_t apply_behavior(span *m, size_t n, int behavior) {
    size_t w = 0;
    int prev_match = 0;
    switch (behavior) {
    case BEHAVIOR_REMOVED:
        return n; /* match flag = remove */
    case BEHAVIOR_ISOLATED:
        for (size_t i = 0; i < n; i++)
            m[i].match = 0;
        return n;
    case BEHAVIOR_CONTIGUOUS:
        for (size_t i = 0; i < n; i++) {
            span x = m[i];
            if (x.match == prev_match && w > 0)
                m[w - 1].e = x.e;
            else
                m[w++] = (span){x.s, x.e, 0};
            prev_match = x.match;
        }
        return w;
    case BEHAVIOR_MERGED_PREV:
        for (size_t i = 0; i < n; i++) {
            span x = m[i];
            if (x.match && !prev_match && w > 0)
                m[w - 1].e = x.e;
            else
                m[w++] = (span){x.s, x.e, 0};
            prev_match = x.match;
        }
        return w;
    case BEHAVIOR_MERGED_NEXT: {
        size_t r = n; /* output grows downward from n */
        for (size_t i = n; i-- > 0;) {
            span x = m[i];
            if (x.match && !prev_match && r < n)
                m[r].s = x.s;
            else
                m[--r] = (span){x.s, x.e, 0};
            prev_match = x.match;
        }
        memmove(m, m + r, (n - r) * sizeof *m);
        return n - r;
    }
    }
    return n;
}

static int emit_piece(enc_ctx *c, const char *p, size_t n, size_t offset, int prefixed) {
    if (c->fn) {
        if (c->fn(c->ud, offset, n - (prefixed ? 1 : 0), prefixed, -1))
            return dsv4_errf(c->err, "piece callback stopped the walk");
        return 0;
    }
    return bpe_cached(c->tok, (const unsigned char *)p, n, &c->bpe, c->out, c->err);
}

/* Runs pre-tokenizer steps LEVEL.. on BASE[s..e).  ORIG is the offset of BASE[0]
 * in the caller's text; PFX says BASE starts with an added prefix space. */
static int pretok(enc_ctx *c, int level, const char *base, size_t s, size_t e, size_t orig, int pfx) {
    const dsv4_tokenizer *tok = c->tok;
    if (level == tok->n_steps) {
        int has_pfx = pfx && s == 0;
        size_t off = orig + s - (pfx && s > 0 ? 1 : 0);
        return emit_piece(c, base + s, e - s, off, has_pfx);
    }
    const pretok_step *st = &tok->steps[level];
    if (st->kind == STEP_PREFIX_SPACE) {
        if (e > s && base[s] == ' ') return pretok(c, level + 1, base, s, e, orig, pfx);
        size_t n = e - s + 1;
        if (n > c->pfxcap) {
            char *p = realloc(c->pfx, n);
            if (!p) return dsv4_errf(c->err, "out of memory");
            c->pfx = p;
            c->pfxcap = n;
        }
        c->pfx[0] = ' ';
        memcpy(c->pfx + 1, base + s, e - s);
        /* the steps after the prefix space are splits only, so pfx stays put */
        return pretok(c, level + 1, c->pfx, 0, n, orig + s, 1);
    }
    size_t n;
    if (find_matches(c, level, st->re, st->jit, base + s, e - s, &n)) return -1;
    span *m = c->lv[level];
    if (st->invert)
        for (size_t i = 0; i < n; i++)
            m[i].match = !m[i].match;
    n = apply_behavior(m, n, st->behavior);
    for (size_t i = 0; i < n; i++) {
        span x = c->lv[level][i]; /* re-read: deeper levels use their own arrays */
        if (x.match || x.e == x.s) continue;
        if (pretok(c, level + 1, base, s + x.s, s + x.e, orig, pfx)) return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* added tokens                                                              */
/* ------------------------------------------------------------------------ */

static int word_char_at(const dsv4_tokenizer *tok, pcre2_match_data *md, const char *s, size_t n) {
    return pcre2_match(tok->word_re, (PCRE2_SPTR)s, n, 0, PCRE2_NO_UTF_CHECK, md, tok->mctx) >= 0;
}

/* the offset where the last character of S[0..n) starts */
static size_t last_char(const char *s, size_t n) {
    size_t i = n;
    while (i > 0 && ((unsigned char)s[i - 1] & 0xC0) == 0x80)
        i--;
    return i > 0 ? i - 1 : 0;
}

/* Cuts the added tokens of one pass (non-normalized first, then normalized:
 * the Rust library's two tries) out of TEXT[s..e) and hands on the pieces in
 * order: added ones as ids, text ones to the next pass / the pre-tokenizer. */
static int split_added(enc_ctx *c, const char *text, size_t s, size_t e, int pass, unsigned flags) {
    const dsv4_tokenizer *tok = c->tok;
    size_t start_off = s, i = s;
    while (i < e) {
        if (!tok->can_start[(unsigned char)text[i]]) {
            i++;
            continue;
        }
        const added_token *hit = NULL;
        int32_t node = 0;
        for (size_t j = i; j < e; j++) { /* walk the trie; the deepest token wins */
            uint32_t unused;
            if (!merge_map_get(&tok->trie, node, (unsigned char)text[j], &unused, &node)) break;
            if (tok->trie_tok[2 * node + pass] >= 0) hit = &tok->added[tok->trie_tok[2 * node + pass]];
        }
        if (!hit) {
            i++;
            continue;
        }
        size_t ms = i, me = i + hit->len;
        i = me;
        if (hit->special && (flags & DSV4_TOK_NO_SPECIAL)) continue;
        if (hit->single_word) {
            size_t lc = s + last_char(text + s, ms - s);
            int start_ok = ms == s || !word_char_at(tok, c->md, text + lc, ms - lc);
            int stop_ok = me == e || !word_char_at(tok, c->md, text + me, e - me);
            if (!start_ok || !stop_ok) continue;
        }
        if (hit->lstrip) {
            size_t ns = ms;
            while (ns > s) {
                size_t p = s + last_char(text + s, ns - s);
                size_t l;
                utf8_scan((const unsigned char *)text + p, ns - p, &l);
                if (!is_white_space(utf8_decode_at((const unsigned char *)text + p, l))) break;
                ns = p;
            }
            ms = ns > start_off ? ns : start_off;
        }
        if (hit->rstrip) {
            while (me < e) {
                size_t l;
                utf8_scan((const unsigned char *)text + me, e - me, &l);
                if (!is_white_space(utf8_decode_at((const unsigned char *)text + me, l))) break;
                me += l;
            }
            i = me;
        }
        if (start_off < ms) {
            int r = pass == 0 ? split_added(c, text, start_off, ms, 1, flags)
                              : pretok(c, 0, text, start_off, ms, 0, 0);
            if (r) return -1;
        }
        if (c->fn) {
            if (c->fn(c->ud, ms, me - ms, 0, hit->id))
                return dsv4_errf(c->err, "piece callback stopped the walk");
        } else if (dsv4_ids_push(c->out, hit->id, c->err)) {
            return -1;
        }
        start_off = me;
    }
    if (start_off < e)
        return pass == 0 ? split_added(c, text, start_off, e, 1, flags)
                         : pretok(c, 0, text, start_off, e, 0, 0);
    return 0;
}

static int run_encoder(enc_ctx *c, const char *text, size_t len, unsigned flags) {
    uint32_t ovec = 0;
    for (int i = 0; i < c->tok->n_steps; i++) {
        uint32_t cap = 0;
        if (c->tok->steps[i].re) pcre2_pattern_info(c->tok->steps[i].re, PCRE2_INFO_CAPTURECOUNT, &cap);
        if (cap > ovec) ovec = cap;
    }
    c->md = pcre2_match_data_create(ovec + 1, NULL);
    if (!c->md) return dsv4_errf(c->err, "out of memory");
    if (len == 0) return 0;
    if (flags & DSV4_TOK_NO_ADDED || c->tok->n_added == 0) return pretok(c, 0, text, 0, len, 0, 0);
    return split_added(c, text, 0, len, 0, flags);
}

int dsv4_tokenizer_encode(const dsv4_tokenizer *tok, const char *text, size_t len, unsigned flags,
                          dsv4_ids *out, dsv4_err *err) {
    if (!text && len) return dsv4_errf(err, "encode: NULL text");
    dsv4_bytes clean = {0};
    size_t bad;
    if (dsv4_utf8_validate(text, len, &bad)) {
        if (!(flags & DSV4_TOK_LOSSY))
            return dsv4_errf(err, "input is not valid UTF-8: bad byte 0x%02X at byte offset %zu",
                             (unsigned char)text[bad], bad);
        if (dsv4_utf8_lossy(text, len, &clean, err)) {
            dsv4_bytes_free(&clean);
            return -1;
        }
        text = clean.data;
        len = clean.len;
    }
    size_t old = out->len;
    enc_ctx c = {.tok = tok, .out = out, .err = err};
    int rc = run_encoder(&c, text, len, flags);
    enc_free(&c);
    dsv4_bytes_free(&clean);
    if (rc) out->len = old;
    return rc;
}

int dsv4_tokenizer_pieces(const dsv4_tokenizer *tok, const char *text, size_t len, unsigned flags,
                          dsv4_tok_piece_fn fn, void *ud, dsv4_err *err) {
    size_t bad;
    if (!fn) return dsv4_errf(err, "pieces: NULL callback");
    if (dsv4_utf8_validate(text, len, &bad))
        return dsv4_errf(err, "input is not valid UTF-8: bad byte 0x%02X at byte offset %zu",
                         (unsigned char)text[bad], bad);
    enc_ctx c = {.tok = tok, .fn = fn, .ud = ud, .err = err};
    int rc = run_encoder(&c, text, len, flags);
    enc_free(&c);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* decoding                                                                  */
/* ------------------------------------------------------------------------ */

int32_t dsv4_tokenizer_n_vocab(const dsv4_tokenizer *tok) {
    return tok->n_vocab;
}

const char *dsv4_tokenizer_id_to_piece(const dsv4_tokenizer *tok, int32_t id) {
    return id >= 0 && id < tok->n_vocab ? tok->piece[id] : NULL;
}

const char *dsv4_tokenizer_id_bytes(const dsv4_tokenizer *tok, int32_t id, size_t *len) {
    if (id < 0 || id >= tok->n_vocab || !tok->bytes[id]) return NULL;
    if (len) *len = tok->bytes_len[id];
    return tok->bytes[id];
}

int32_t dsv4_tokenizer_piece_to_id(const dsv4_tokenizer *tok, const char *piece) {
    size_t n = strlen(piece);
    for (size_t i = 0; i < tok->n_added; i++) /* added tokens win, as in the Rust library */
        if (tok->added[i].len == n && !memcmp(tok->added[i].content, piece, n)) return tok->added[i].id;
    return str_map_get(&tok->vocab, piece, n);
}

int dsv4_tokenizer_id_kind(const dsv4_tokenizer *tok, int32_t id) {
    if (id < 0 || id >= tok->n_vocab || tok->kind[id] == 255) return 0;
    return tok->kind[id];
}

static int check_id(const dsv4_tokenizer *tok, int32_t id, dsv4_err *err) {
    if (id < 0 || id >= tok->n_vocab)
        return dsv4_errf(err, "token id %d is out of range [0, %d)", id, tok->n_vocab);
    if (!tok->bytes[id]) return dsv4_errf(err, "token id %d has no token in this vocabulary", id);
    return 0;
}

void dsv4_tok_stream_init(dsv4_tok_stream *s, const dsv4_tokenizer *tok, unsigned flags) {
    memset(s, 0, sizeof *s);
    s->tok = tok;
    s->flags = flags & DSV4_TOK_SKIP_SPECIAL;
}

/* Appends complete characters of HELD + P to OUT; keeps a valid but
 * incomplete tail in HELD. */
static int stream_feed(dsv4_tok_stream *s, const char *p, size_t n, dsv4_bytes *out, dsv4_err *err) {
    /* finish the held sequence byte by byte first */
    size_t i = 0;
    while (s->n_held > 0 && i < n) {
        s->held[s->n_held++] = (unsigned char)p[i++];
        size_t l;
        int r = utf8_scan(s->held, (size_t)s->n_held, &l);
        if (r == -1) continue;
        if (r == 1) {
            if (dsv4_bytes_append(out, s->held, l, err)) return -1;
        } else if (dsv4_bytes_append(out, REPLACEMENT, 3, err)) {
            return -1;
        }
        /* bytes after the maximal subpart go back to be scanned afresh */
        int rest = s->n_held - (int)l;
        i -= (size_t)rest;
        s->n_held = 0;
    }
    if (i >= n) return 0;
    const unsigned char *u = (const unsigned char *)p;
    size_t run = i;
    while (i < n) {
        size_t l;
        int r = u[i] < 0x80 ? (l = 1, 1) : utf8_scan(u + i, n - i, &l);
        if (r == 1) {
            i += l;
            continue;
        }
        if (dsv4_bytes_append(out, p + run, i - run, err)) return -1;
        if (r == -1) {
            memcpy(s->held, u + i, l);
            s->n_held = (int)l;
            return 0;
        }
        if (dsv4_bytes_append(out, REPLACEMENT, 3, err)) return -1;
        i += l;
        run = i;
    }
    return dsv4_bytes_append(out, p + run, n - run, err);
}

int dsv4_tok_stream_push(dsv4_tok_stream *s, int32_t id, dsv4_bytes *out, dsv4_err *err) {
    if (check_id(s->tok, id, err)) return -1;
    if ((s->flags & DSV4_TOK_SKIP_SPECIAL) && s->tok->kind[id] == 2) return 0;
    return stream_feed(s, s->tok->bytes[id], s->tok->bytes_len[id], out, err);
}

int dsv4_tok_stream_finish(dsv4_tok_stream *s, dsv4_bytes *out, dsv4_err *err) {
    int held = s->n_held;
    s->n_held = 0;
    if (held && dsv4_bytes_append(out, REPLACEMENT, 3, err)) return -1;
    /* make sure out->data exists even when nothing was written */
    return dsv4_bytes_append(out, "", 0, err);
}

int dsv4_tokenizer_decode(const dsv4_tokenizer *tok, const int32_t *ids, size_t n, unsigned flags,
                          dsv4_bytes *out, dsv4_err *err) {
    size_t old = out->len;
    for (size_t i = 0; i < n; i++)
        if (check_id(tok, ids[i], err)) return dsv4_err_prefix(err, "decode: ids[%zu]", i);
    if (flags & DSV4_TOK_RAW) {
        for (size_t i = 0; i < n; i++) {
            if ((flags & DSV4_TOK_SKIP_SPECIAL) && tok->kind[ids[i]] == 2) continue;
            if (dsv4_bytes_append(out, tok->bytes[ids[i]], tok->bytes_len[ids[i]], err)) goto fail;
        }
        return dsv4_bytes_append(out, "", 0, err);
    }
    dsv4_tok_stream s;
    dsv4_tok_stream_init(&s, tok, flags);
    for (size_t i = 0; i < n; i++)
        if (dsv4_tok_stream_push(&s, ids[i], out, err)) goto fail;
    if (dsv4_tok_stream_finish(&s, out, err)) goto fail;
    return 0;
fail:
    out->len = old;
    return -1;
}
