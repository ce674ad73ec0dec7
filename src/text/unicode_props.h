/* text/unicode_props: Unicode general-category sets from utf8proc, written out
 * as PCRE2 character-class text.
 *
 * Why: the pre-tokenizer regexes of a tokenizer.json are written for Hugging
 * Face's engines (Oniguruma, Rust regex), whose Unicode tables are version 15;
 * Debian 12's PCRE2 10.42 carries version 14 tables, so its \p{L}, \p{M}, ...
 * miss every character assigned in 15.0 (Kawi, Nag Mundari, U+1E030...).
 * utf8proc 2.8 is Unicode 15.0: the tokenizer rewrites each general-category
 * escape into an explicit list of code-point ranges built here.
 *
 * Owns: two run-length tables of the general category of every code point,
 * utf8proc's and PCRE2's (read by matching its \p escapes), built once on
 * first use (pthread_once, ~30 ms) and kept for the life of the process.
 * Threads: every function may be called from any thread.
 * Errors: out of memory is reported through dsv4_err; names are checked by the
 * caller (dsv4_uprop_category_mask returns 0 for a name that is not a general
 * category).
 */
#ifndef DSV4_TEXT_UNICODE_PROPS_H
#define DSV4_TEXT_UNICODE_PROPS_H

#include <stddef.h>
#include <stdint.h>

#include "util/err.h"

/* The set of general categories NAME[0..n) stands for, one bit per utf8proc
 * category (bit UTF8PROC_CATEGORY_LU for "Lu", ...), or 0 if NAME is not a
 * general category.  Accepts the short names ("L", "Lu", "LC", "L&") and the
 * long ones ("Letter", "Uppercase_Letter", "Cased_Letter", "Combining_Mark",
 * "digit", "punct", "cntrl"...), matched loosely as Oniguruma and PCRE2 do:
 * case, spaces, '_' and '-' are ignored. */
uint64_t dsv4_uprop_category_mask(const char *name, size_t n);

/* The bit of the surrogate category (code points U+D800..U+DFFF, which valid
 * UTF-8 never contains and PCRE2 rejects in a class). */
uint64_t dsv4_uprop_surrogate_mask(void);

/* A PCRE2 class body ("\x{41}-\x{5a}\x{61}-\x{7a}...", no brackets) listing
 * the code points whose category is in MASK, or with NEGATE those whose
 * category is not; surrogates are never listed.  Ranges come out sorted and
 * merged.  Returns a malloc'd NUL-terminated string (the caller frees it; it is
 * "" for an empty set) and its length in *len, or NULL on out of memory. */
char *dsv4_uprop_class_body(uint64_t mask, int negate, size_t *len, dsv4_err *err);

/* The PCRE2 text for the code points whose Unicode 15 category is in MASK
 * (with NEGATE: is not), surrogates aside: a class body to splice into [...]
 * when IN_CLASS, else a whole bracketed class.  Where PCRE2's own (Unicode 14)
 * escapes cover a subset of the set, the text is those escapes plus the ranges
 * they lack ("\p{L}\x{1e030}-\x{1e06d}..."): the JIT tests a property with one
 * table lookup but a range list one range at a time, and a full list of
 * \p{L} is about 650 ranges.  Otherwise (PCRE2 would match too much, e.g. a
 * \P spliced into a class) it is the full range list.  Malloc'd, NUL
 * terminated, *len bytes; NULL on out of memory. */
char *dsv4_uprop_pcre2_set(uint64_t mask, int negate, int in_class, size_t *len, dsv4_err *err);

/* For tests: the category of CP by PCRE2's tables (-1 if they could not be
 * read) and by utf8proc's. */
void dsv4_uprop_debug_categories(uint32_t cp, int *pcre2_cat, int *utf8proc_cat);

/* The Unicode version of the tables ("15.0.0"), from utf8proc. */
const char *dsv4_uprop_unicode_version(void);

#endif
