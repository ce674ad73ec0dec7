/* util/err: errors as values.
 *
 * Every fallible function takes a `dsv4_err *` (may be NULL) and returns 0 on
 * success or -1 on failure, having written a message that names the file,
 * tensor, key or request part at fault (STYLE §7).  Messages are plain text,
 * one line, no trailing newline.  Thread-safe: the buffer belongs to the caller.
 */
#ifndef DSV4_UTIL_ERR_H
#define DSV4_UTIL_ERR_H

#include <stddef.h>
#include <stdint.h>

#define DSV4_ERR_MAX 1024

typedef struct dsv4_err {
    char msg[DSV4_ERR_MAX];
} dsv4_err;

/* Writes a formatted message into err (if non-NULL) and returns -1. */
int dsv4_errf(dsv4_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prepends "prefix: " to an existing message (context on the way up). Returns -1. */
int dsv4_err_prefix(dsv4_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Overflow-checked size arithmetic: return 0 and write *out, or -1 on overflow. */
static inline int dsv4_mul_size(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a) return -1;
    *out = a * b;
    return 0;
}
static inline int dsv4_add_size(size_t a, size_t b, size_t *out) {
    if (b > SIZE_MAX - a) return -1;
    *out = a + b;
    return 0;
}

/* Logging: level 0 = errors only, 1 = info (default), 2 = debug. Writes to stderr. */
extern int dsv4_log_level;
void dsv4_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Allocation that aborts on out-of-memory for small internal objects only;
 * large buffers sized from input must use plain malloc and report errors. */
void *dsv4_xcalloc(size_t n, size_t size);
char *dsv4_xstrdup(const char *s);

/* Monotonic time in seconds. */
double dsv4_now(void);

#endif
