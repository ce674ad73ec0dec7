/* text/unicode_props: general-category range lists from utf8proc.  Contract in
 * unicode_props.h; why this exists in docs/TOKENIZER.md ("Unicode version"). */
#include "text/unicode_props.h"

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
 * [run_start[i], run_start[i + 1]) (run_start[n_runs] == CP_LIMIT).  Unicode
 * 15 has about 3,300 runs, so walking them per escape is cheap and only this
 * table is cached.  Surrogates form their own run whatever utf8proc says, so
 * they can be skipped by category. */
static uint32_t *run_start;
static uint8_t *run_cat;
static size_t n_runs;
static pthread_once_t runs_once = PTHREAD_ONCE_INIT;

static int category_of(uint32_t cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) return UTF8PROC_CATEGORY_CS;
    return (int)utf8proc_category((utf8proc_int32_t)cp);
}

static void build_runs(void) {
    size_t n = 0;
    int prev = -1;
    for (uint32_t cp = 0; cp < CP_LIMIT; cp++) {
        int c = category_of(cp);
        if (c != prev) n++;
        prev = c;
    }
    uint32_t *start = malloc((n + 1) * sizeof *start);
    uint8_t *cat = malloc(n);
    if (!start || !cat) { /* left NULL: every caller reports out of memory */
        free(start);
        free(cat);
        return;
    }
    size_t k = 0;
    prev = -1;
    for (uint32_t cp = 0; cp < CP_LIMIT; cp++) {
        int c = category_of(cp);
        if (c != prev) {
            start[k] = cp;
            cat[k++] = (uint8_t)c;
        }
        prev = c;
    }
    start[n] = CP_LIMIT;
    run_start = start;
    run_cat = cat;
    n_runs = n;
}

/* ------------------------------------------------------------------------ */
/* class text                                                                */
/* ------------------------------------------------------------------------ */

char *dsv4_uprop_class_body(uint64_t mask, int negate, size_t *len, dsv4_err *err) {
    pthread_once(&runs_once, build_runs);
    if (!run_start) {
        dsv4_errf(err, "out of memory building the Unicode category table");
        return NULL;
    }
    /* at most one range per run, 24 bytes each ("\x{10ffff}-\x{10ffff}") */
    size_t cap = n_runs * 24 + 1, o = 0;
    char *out = malloc(cap);
    if (!out) {
        dsv4_errf(err, "out of memory writing a Unicode class (%zu bytes)", cap);
        return NULL;
    }
    uint64_t want = (negate ? ~mask : mask) & ~BIT(UTF8PROC_CATEGORY_CS);
    size_t i = 0;
    while (i < n_runs) {
        if (!(want & BIT(run_cat[i]))) {
            i++;
            continue;
        }
        size_t j = i + 1; /* merge neighbouring runs that are also in the set */
        while (j < n_runs && (want & BIT(run_cat[j]))) j++;
        uint32_t lo = run_start[i], hi = run_start[j] - 1;
        int w = lo == hi ? snprintf(out + o, cap - o, "\\x{%x}", (unsigned)lo)
                         : snprintf(out + o, cap - o, "\\x{%x}-\\x{%x}", (unsigned)lo, (unsigned)hi);
        o += (size_t)w;
        i = j;
    }
    out[o] = '\0';
    *len = o;
    return out;
}
