#define _POSIX_C_SOURCE 200809L
#include "util/err.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int dsv4_log_level = 1;

/* Keeps a message on one line (err.h's contract) whatever its arguments quote: a control byte
 * (a newline inside a JSON parser's excerpt of the input, say) becomes \n, \r, \t or \xHH;
 * what no longer fits is cut. */
static void err_one_line(char *msg) {
    size_t n = strnlen(msg, DSV4_ERR_MAX - 1), i = 0;
    while (i < n && (unsigned char)msg[i] >= 0x20 && msg[i] != 0x7f) i++;
    if (i == n) return; /* the common case: nothing to escape */
    char out[DSV4_ERR_MAX];
    size_t k = 0;
    for (size_t j = 0; j < n; j++) {
        unsigned char c = (unsigned char)msg[j];
        char esc[5] = {(char)c, 0};
        if (c == '\n') strcpy(esc, "\\n");
        else if (c == '\r') strcpy(esc, "\\r");
        else if (c == '\t') strcpy(esc, "\\t");
        else if (c < 0x20 || c == 0x7f) snprintf(esc, sizeof esc, "\\x%02x", c);
        size_t len = strlen(esc);
        if (k + len > DSV4_ERR_MAX - 1) break;
        memcpy(out + k, esc, len);
        k += len;
    }
    memcpy(msg, out, k);
    msg[k] = 0;
}

int dsv4_errf(dsv4_err *err, const char *fmt, ...) {
    if (!err) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    err_one_line(err->msg);
    return -1;
}

int dsv4_err_prefix(dsv4_err *err, const char *fmt, ...) {
    if (!err) return -1;
    char prefix[DSV4_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    /* Build "prefix: old" by hand: snprintf("%s: %s") of two full-size buffers
     * trips -Wformat-truncation, and truncation is what we want anyway. */
    char old[DSV4_ERR_MAX];
    memcpy(old, err->msg, sizeof old);
    size_t np = strlen(prefix), no = strnlen(old, sizeof old - 1), cap = sizeof err->msg - 1;
    size_t k = 0;
    for (size_t i = 0; i < np && k < cap; i++) err->msg[k++] = prefix[i];
    for (const char *sep = ": "; *sep && k < cap; sep++) err->msg[k++] = *sep;
    for (size_t i = 0; i < no && k < cap; i++) err->msg[k++] = old[i];
    err->msg[k] = 0;
    err_one_line(err->msg);
    return -1;
}

void dsv4_log(int level, const char *fmt, ...) {
    if (level > dsv4_log_level) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

void *dsv4_xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "dsv4: out of memory allocating %zu x %zu bytes\n", n, size);
        abort();
    }
    return p;
}

char *dsv4_xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = dsv4_xcalloc(n, 1);
    memcpy(p, s, n);
    return p;
}

double dsv4_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
