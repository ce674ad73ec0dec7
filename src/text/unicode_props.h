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
 * Owns: a run-length table of the general category of every code point, built
 * once on first use (pthread_once) and kept for the life of the process.
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

/* The Unicode version of the tables ("15.0.0"), from utf8proc. */
const char *dsv4_uprop_unicode_version(void);

#endif
