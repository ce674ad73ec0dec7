/* util/paths: locating the files that ship beside the binary.
 *
 * The build tree keeps `dsv4` in build/ (or another BUILD directory) and the vendored data in
 * data/ at the repository root, so data is found relative to the running
 * executable (/proc/self/exe), after an environment variable override.
 * Pure functions; thread-safe.
 */
#ifndef DSV4_UTIL_PATHS_H
#define DSV4_UTIL_PATHS_H

#include <stddef.h>

/* Writes the directory holding the running executable into out. Returns 0, or -1. */
int dsv4_exe_dir(char *out, size_t cap);

/* The default tokenizer.json: $DSV4_TOKENIZER if set, else
 * <exe dir>/../data/tokenizer/tokenizer.json or <exe dir>/../../data/... (first readable).
 * Returns 0 with the path in out, or -1 if none is found. */
int dsv4_default_tokenizer_path(char *out, size_t cap);

#endif
