/* text/unicode_props: general-category range lists from utf8proc.  Contract in
 * unicode_props.h; why this exists in docs/TOKENIZER.md ("Unicode version"). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/unicode_props.h"

#include <pcre2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#define CP_LIMIT 0x110000u
#define BIT(c) (UINT64_C(1) << (c))

/* ------------------------------------------------------------------------ */
/* category names                                                            */
/* ------------------------------------------------------------------------ */

#define M_L (BIT(UTF8PROC_CATEGORY_LU) | BIT(UTF8PROC_CATEGORY_LL) | BIT(UTF8PROC_CATEGORY_LT) | \
             BIT(UTF8PROC_CATEGORY_LM) | BIT(UTF8PROC_CATEGORY_LO))
#define M_LC (BIT(UTF8PROC_CATEGORY_LU) | BIT(UTF8PROC_CATEGORY_LL) | BIT(UTF8PROC_CATEGORY_LT))
#define M_M (BIT(UTF8PROC_CATEGORY_MN) | BIT(UTF8PROC_CATEGORY_MC) | BIT(UTF8PROC_CATEGORY_ME))
#define M_N (BIT(UTF8PROC_CATEGORY_ND) | BIT(UTF8PROC_CATEGORY_NL) | BIT(UTF8PROC_CATEGORY_NO))
#define M_P (BIT(UTF8PROC_CATEGORY_PC) | BIT(UTF8PROC_CATEGORY_PD) | BIT(UTF8PROC_CATEGORY_PS) | \
             BIT(UTF8PROC_CATEGORY_PE) | BIT(UTF8PROC_CATEGORY_PI) | BIT(UTF8PROC_CATEGORY_PF) | \
             BIT(UTF8PROC_CATEGORY_PO))
#define M_S (BIT(UTF8PROC_CATEGORY_SM) | BIT(UTF8PROC_CATEGORY_SC) | BIT(UTF8PROC_CATEGORY_SK) | \
             BIT(UTF8PROC_CATEGORY_SO))
#define M_Z (BIT(UTF8PROC_CATEGORY_ZS) | BIT(UTF8PROC_CATEGORY_ZL) | BIT(UTF8PROC_CATEGORY_ZP))
#define M_C (BIT(UTF8PROC_CATEGORY_CC) | BIT(UTF8PROC_CATEGORY_CF) | BIT(UTF8PROC_CATEGORY_CS) | \
             BIT(UTF8PROC_CATEGORY_CO) | BIT(UTF8PROC_CATEGORY_CN))

/* Names already in loose form (lower case, no space, '_' or '-'): the short
 * and long names of UCD PropertyValueAliases.txt for General_Category, plus
 * the "L&" spelling that PCRE2 and Perl accept. */
static const struct {
    const char *name;
    uint64_t mask;
} CATEGORY_NAMES[] = {
    {"l", M_L},
    {"letter", M_L},
    {"lc", M_LC},
    {"l&", M_LC},
    {"casedletter", M_LC},
    {"lu", BIT(UTF8PROC_CATEGORY_LU)},
    {"uppercaseletter", BIT(UTF8PROC_CATEGORY_LU)},
    {"ll", BIT(UTF8PROC_CATEGORY_LL)},
    {"lowercaseletter", BIT(UTF8PROC_CATEGORY_LL)},
    {"lt", BIT(UTF8PROC_CATEGORY_LT)},
    {"titlecaseletter", BIT(UTF8PROC_CATEGORY_LT)},
    {"lm", BIT(UTF8PROC_CATEGORY_LM)},
    {"modifierletter", BIT(UTF8PROC_CATEGORY_LM)},
    {"lo", BIT(UTF8PROC_CATEGORY_LO)},
    {"otherletter", BIT(UTF8PROC_CATEGORY_LO)},
    {"m", M_M},
    {"mark", M_M},
    {"combiningmark", M_M},
    {"mn", BIT(UTF8PROC_CATEGORY_MN)},
    {"nonspacingmark", BIT(UTF8PROC_CATEGORY_MN)},
    {"mc", BIT(UTF8PROC_CATEGORY_MC)},
    {"spacingmark", BIT(UTF8PROC_CATEGORY_MC)},
    {"me", BIT(UTF8PROC_CATEGORY_ME)},
    {"enclosingmark", BIT(UTF8PROC_CATEGORY_ME)},
    {"n", M_N},
    {"number", M_N},
    {"nd", BIT(UTF8PROC_CATEGORY_ND)},
    {"decimalnumber", BIT(UTF8PROC_CATEGORY_ND)},
    {"digit", BIT(UTF8PROC_CATEGORY_ND)},
    {"nl", BIT(UTF8PROC_CATEGORY_NL)},
    {"letternumber", BIT(UTF8PROC_CATEGORY_NL)},
    {"no", BIT(UTF8PROC_CATEGORY_NO)},
    {"othernumber", BIT(UTF8PROC_CATEGORY_NO)},
    {"p", M_P},
    {"punctuation", M_P},
    {"punct", M_P},
    {"pc", BIT(UTF8PROC_CATEGORY_PC)},
    {"connectorpunctuation", BIT(UTF8PROC_CATEGORY_PC)},
    {"pd", BIT(UTF8PROC_CATEGORY_PD)},
    {"dashpunctuation", BIT(UTF8PROC_CATEGORY_PD)},
    {"ps", BIT(UTF8PROC_CATEGORY_PS)},
    {"openpunctuation", BIT(UTF8PROC_CATEGORY_PS)},
    {"pe", BIT(UTF8PROC_CATEGORY_PE)},
    {"closepunctuation", BIT(UTF8PROC_CATEGORY_PE)},
    {"pi", BIT(UTF8PROC_CATEGORY_PI)},
    {"initialpunctuation", BIT(UTF8PROC_CATEGORY_PI)},
    {"pf", BIT(UTF8PROC_CATEGORY_PF)},
    {"finalpunctuation", BIT(UTF8PROC_CATEGORY_PF)},
    {"po", BIT(UTF8PROC_CATEGORY_PO)},
    {"otherpunctuation", BIT(UTF8PROC_CATEGORY_PO)},
    {"s", M_S},
    {"symbol", M_S},
    {"sm", BIT(UTF8PROC_CATEGORY_SM)},
    {"mathsymbol", BIT(UTF8PROC_CATEGORY_SM)},
    {"sc", BIT(UTF8PROC_CATEGORY_SC)},
    {"currencysymbol", BIT(UTF8PROC_CATEGORY_SC)},
    {"sk", BIT(UTF8PROC_CATEGORY_SK)},
    {"modifiersymbol", BIT(UTF8PROC_CATEGORY_SK)},
    {"so", BIT(UTF8PROC_CATEGORY_SO)},
    {"othersymbol", BIT(UTF8PROC_CATEGORY_SO)},
    {"z", M_Z},
    {"separator", M_Z},
    {"zs", BIT(UTF8PROC_CATEGORY_ZS)},
    {"spaceseparator", BIT(UTF8PROC_CATEGORY_ZS)},
    {"zl", BIT(UTF8PROC_CATEGORY_ZL)},
    {"lineseparator", BIT(UTF8PROC_CATEGORY_ZL)},
    {"zp", BIT(UTF8PROC_CATEGORY_ZP)},
    {"paragraphseparator", BIT(UTF8PROC_CATEGORY_ZP)},
    {"c", M_C},
    {"other", M_C},
    {"cc", BIT(UTF8PROC_CATEGORY_CC)},
    {"control", BIT(UTF8PROC_CATEGORY_CC)},
    {"cntrl", BIT(UTF8PROC_CATEGORY_CC)},
    {"cf", BIT(UTF8PROC_CATEGORY_CF)},
    {"format", BIT(UTF8PROC_CATEGORY_CF)},
    {"cs", BIT(UTF8PROC_CATEGORY_CS)},
    {"surrogate", BIT(UTF8PROC_CATEGORY_CS)},
    {"co", BIT(UTF8PROC_CATEGORY_CO)},
    {"privateuse", BIT(UTF8PROC_CATEGORY_CO)},
    {"cn", BIT(UTF8PROC_CATEGORY_CN)},
    {"unassigned", BIT(UTF8PROC_CATEGORY_CN)},
};

uint64_t dsv4_uprop_category_mask(const char *name, size_t n) {
    char loose[32];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (c == ' ' || c == '_' || c == '-') continue;
        if (k + 1 >= sizeof loose) return 0; /* longer than any category name */
        loose[k++] = (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
    }
    loose[k] = '\0';
    for (size_t i = 0; i < sizeof CATEGORY_NAMES / sizeof CATEGORY_NAMES[0]; i++)
        if (!strcmp(loose, CATEGORY_NAMES[i].name)) return CATEGORY_NAMES[i].mask;
    return 0;
}

uint64_t dsv4_uprop_surrogate_mask(void) {
    return BIT(UTF8PROC_CATEGORY_CS);
}

const char *dsv4_uprop_unicode_version(void) {
    return utf8proc_unicode_version();
}

/* ------------------------------------------------------------------------ */
/* the run table                                                             */
/* ------------------------------------------------------------------------ */

/* Maximal runs of code points with one category: run i covers
 * [start[i], start[i + 1]) (start[n] == CP_LIMIT).  Unicode 15 has about
 * 3,300 runs, so walking them per escape is cheap and only the tables are
 * cached.  Surrogates form their own run whatever the source says. */
typedef struct {
    uint32_t *start;
    uint8_t *cat;
    size_t n;
} run_table;

static run_table u15;  /* utf8proc: Unicode 15, the truth */
static run_table p14;  /* PCRE2's own \p tables (Unicode 14); n == 0 if they could not be read */
static pthread_once_t runs_once = PTHREAD_ONCE_INIT;

static const char CATEGORY_SHORT[30][3] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                           "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                           "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};
#define N_CATEGORIES 30

static int category_of(uint32_t cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) return UTF8PROC_CATEGORY_CS;
    return (int)utf8proc_category((utf8proc_int32_t)cp);
}

static int runs_push(run_table *t, size_t *cap, uint32_t cp, int cat) {
    if (t->n && t->cat[t->n - 1] == cat) return 0;
    if (t->n + 1 >= *cap) {
        size_t nc = *cap ? *cap * 2 : 4096;
        uint32_t *s = realloc(t->start, nc * sizeof *s);
        if (!s) return -1;
        t->start = s;
        uint8_t *c = realloc(t->cat, nc);
        if (!c) return -1;
        t->cat = c;
        *cap = nc;
    }
    t->start[t->n] = cp;
    t->cat[t->n++] = (uint8_t)cat;
    return 0;
}

static void runs_free(run_table *t) {
    free(t->start);
    free(t->cat);
    memset(t, 0, sizeof *t);
}

static size_t utf8_put(uint32_t cp, unsigned char *o) {
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

static uint32_t utf8_get(const unsigned char *s) {
    if (s[0] < 0x80) return s[0];
    if (s[0] < 0xE0) return (uint32_t)(s[0] & 0x1F) << 6 | (s[1] & 0x3F);
    if (s[0] < 0xF0) return (uint32_t)(s[0] & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
    return (uint32_t)(s[0] & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 | (uint32_t)(s[2] & 0x3F) << 6 |
           (s[3] & 0x3F);
}

/* PCRE2 keeps its tables private, so they are read by matching: every code
 * point in order as one UTF-8 string, cut into runs by
 * (\p{Cn}+)|(\p{Lu}+)|... whose group number is the category.  About 4 MB
 * scanned once, a few milliseconds. */
static int read_pcre2_runs(run_table *t) {
    size_t cap = 0, blen = 0;
    unsigned char *buf = malloc((size_t)CP_LIMIT * 4);
    char pattern[N_CATEGORIES * 10 + 1];
    size_t pl = 0;
    for (int c = 0; c < N_CATEGORIES; c++)
        pl += (size_t)snprintf(pattern + pl, sizeof pattern - pl, "%s(\\p{%s}+)", c ? "|" : "", CATEGORY_SHORT[c]);
    int ecode;
    PCRE2_SIZE eoff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, pl, PCRE2_UTF | PCRE2_UCP, &ecode, &eoff, NULL);
    pcre2_match_data *md = re ? pcre2_match_data_create_from_pattern(re, NULL) : NULL;
    int ok = buf && md;
    if (ok) {
        pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
        for (uint32_t cp = 0; cp < CP_LIMIT; cp++)
            if (cp < 0xD800 || cp > 0xDFFF) blen += utf8_put(cp, buf + blen);
    }
    uint32_t expect = 0;
    for (size_t pos = 0; ok && pos < blen;) {
        int rc = pcre2_match(re, buf, blen, pos, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, md, NULL);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (rc < 2 || ov[1] <= pos) {
            ok = 0;
            break;
        }
        uint32_t cp = utf8_get(buf + pos);
        if (cp != expect) ok = runs_push(t, &cap, expect, UTF8PROC_CATEGORY_CS) == 0; /* the surrogate gap */
        ok = ok && runs_push(t, &cap, cp, rc - 2) == 0; /* rc - 1 = the group that matched */
        pos = ov[1];
        /* expect the code point after the match's last one */
        size_t k = pos - 1;
        while (k > 0 && (buf[k] & 0xC0) == 0x80) k--;
        expect = utf8_get(buf + k) + 1;
    }
    if (ok) ok = runs_push(t, &cap, CP_LIMIT, 0xFF) == 0; /* room for the end mark */
    if (ok) {
        t->n--;
        t->start[t->n] = CP_LIMIT;
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    free(buf);
    if (!ok) runs_free(t);
    return ok ? 0 : -1;
}

static void build_runs(void) {
    size_t cap = 0;
    int ok = 1;
    for (uint32_t cp = 0; ok && cp < CP_LIMIT; cp++) ok = runs_push(&u15, &cap, cp, category_of(cp)) == 0;
    if (ok) ok = runs_push(&u15, &cap, CP_LIMIT, 0xFF) == 0;
    if (!ok) { /* left empty: every caller reports out of memory */
        runs_free(&u15);
        return;
    }
    u15.n--;
    u15.start[u15.n] = CP_LIMIT;
    read_pcre2_runs(&p14); /* on failure every set is written as plain ranges */
}

/* ------------------------------------------------------------------------ */
/* class text                                                                */
/* ------------------------------------------------------------------------ */

typedef struct {
    char *s;
    size_t len, cap;
    uint32_t lo, hi; /* the range not written yet; lo > hi: none */
} class_text;

static void ct_flush(class_text *t) {
    if (t->lo > t->hi) return;
    int w = t->lo == t->hi ? snprintf(t->s + t->len, t->cap - t->len, "\\x{%x}", (unsigned)t->lo)
                           : snprintf(t->s + t->len, t->cap - t->len, "\\x{%x}-\\x{%x}", (unsigned)t->lo,
                                      (unsigned)t->hi);
    t->len += (size_t)w;
    t->lo = 1;
    t->hi = 0;
}

/* adds [lo, hi] to the text, merged with the previous range if they touch */
static void ct_range(class_text *t, uint32_t lo, uint32_t hi) {
    if (t->lo <= t->hi && t->hi + 1 == lo) {
        t->hi = hi;
        return;
    }
    ct_flush(t);
    t->lo = lo;
    t->hi = hi;
}

static void ct_str(class_text *t, const char *s) {
    ct_flush(t);
    t->len += (size_t)snprintf(t->s + t->len, t->cap - t->len, "%s", s);
}

static int ct_init(class_text *t, dsv4_err *err) {
    pthread_once(&runs_once, build_runs);
    if (!u15.n) return dsv4_errf(err, "out of memory building the Unicode category table");
    /* at most one range per run of either table (24 bytes each, "\x{10ffff}-\x{10ffff}"),
     * and at most 30 escapes ("\p{Lu}") and two brackets */
    t->cap = (u15.n + p14.n) * 24 + N_CATEGORIES * 8 + 8;
    t->len = 0;
    t->lo = 1;
    t->hi = 0;
    t->s = malloc(t->cap);
    if (!t->s) return dsv4_errf(err, "out of memory writing a Unicode class (%zu bytes)", t->cap);
    t->s[0] = '\0';
    return 0;
}

char *dsv4_uprop_class_body(uint64_t mask, int negate, size_t *len, dsv4_err *err) {
    class_text t;
    if (ct_init(&t, err)) return NULL;
    uint64_t want = (negate ? ~mask : mask) & ~BIT(UTF8PROC_CATEGORY_CS);
    for (size_t i = 0; i < u15.n; i++)
        if (want & BIT(u15.cat[i])) ct_range(&t, u15.start[i], u15.start[i + 1] - 1);
    ct_flush(&t);
    *len = t.len;
    return t.s;
}

/* PCRE2 escapes for the categories of MASK: a whole major class as one escape */
static void ct_escapes(class_text *t, uint64_t mask) {
    static const struct {
        uint64_t mask;
        const char *esc;
    } MAJOR[] = {{M_L, "\\p{L}"}, {M_M, "\\p{M}"}, {M_N, "\\p{N}"}, {M_P, "\\p{P}"},
                 {M_S, "\\p{S}"}, {M_Z, "\\p{Z}"}, {M_C, "\\p{C}"}};
    for (size_t k = 0; k < sizeof MAJOR / sizeof MAJOR[0]; k++)
        if ((mask & MAJOR[k].mask) == MAJOR[k].mask) {
            ct_str(t, MAJOR[k].esc);
            mask &= ~MAJOR[k].mask;
        }
    for (int c = 0; c < N_CATEGORIES; c++)
        if (mask & BIT(c)) {
            char e[8];
            snprintf(e, sizeof e, "\\p{%s}", CATEGORY_SHORT[c]);
            ct_str(t, e);
        }
}

char *dsv4_uprop_pcre2_set(uint64_t mask, int negate, int in_class, size_t *len, dsv4_err *err) {
    class_text t;
    if (ct_init(&t, err)) return NULL;
    /* walk both tables at once: ADD = in the Unicode 15 set but not PCRE2's,
     * and whether PCRE2's set has anything Unicode 15's lacks */
    int has_removed = !p14.n;
    if (p14.n) {
        if (!in_class) ct_str(&t, negate ? "[^" : "[");
        else if (negate) has_removed = 1; /* \P{X} spliced into a class: plain ranges */
        ct_escapes(&t, mask);
        size_t i = 0, j = 0;
        for (uint32_t cp = 0; cp < CP_LIMIT && !has_removed;) {
            uint32_t end = u15.start[i + 1] < p14.start[j + 1] ? u15.start[i + 1] : p14.start[j + 1];
            int in15 = (mask >> u15.cat[i]) & 1, in14 = (mask >> p14.cat[j]) & 1;
            if (in15 && !in14 && u15.cat[i] != UTF8PROC_CATEGORY_CS) ct_range(&t, cp, end - 1);
            if (in14 && !in15) has_removed = 1;
            cp = end;
            if (u15.start[i + 1] == cp) i++;
            if (p14.start[j + 1] == cp) j++;
        }
        if (!in_class) ct_str(&t, "]");
        ct_flush(&t);
    }
    if (has_removed) { /* PCRE2's escape would match too much: list every range */
        free(t.s);
        size_t body_len;
        char *body = dsv4_uprop_class_body(mask, negate, &body_len, err);
        if (!body) return NULL;
        if (in_class) {
            *len = body_len;
            return body;
        }
        t.s = malloc(body_len + 3);
        if (!t.s) {
            free(body);
            dsv4_errf(err, "out of memory writing a Unicode class (%zu bytes)", body_len + 3);
            return NULL;
        }
        t.len = (size_t)snprintf(t.s, body_len + 3, "[%s]", body);
        free(body);
    }
    *len = t.len;
    return t.s;
}

/* For tests: the category PCRE2 (-1 if its tables could not be read) and
 * utf8proc give CP. */
void dsv4_uprop_debug_categories(uint32_t cp, int *pcre2_cat, int *utf8proc_cat) {
    pthread_once(&runs_once, build_runs);
    *pcre2_cat = *utf8proc_cat = -1;
    for (size_t i = 0; i < u15.n; i++)
        if (cp >= u15.start[i] && cp < u15.start[i + 1]) *utf8proc_cat = u15.cat[i];
    for (size_t i = 0; i < p14.n; i++)
        if (cp >= p14.start[i] && cp < p14.start[i + 1]) *pcre2_cat = p14.cat[i];
}
