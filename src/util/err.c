#define _POSIX_C_SOURCE 200809L
#include "util/err.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int dsv4_log_level = 1;

/* byte c as it appears in a message or a log line: itself, or for a control byte \n, \r, \t or
 * \xHH (esc holds 5 bytes); returns the length */
static size_t esc_byte(unsigned char c, char *esc) {
    esc[0] = (char)c, esc[1] = 0;
    if (c == '\n') strcpy(esc, "\\n");
    else if (c == '\r') strcpy(esc, "\\r");
    else if (c == '\t') strcpy(esc, "\\t");
    else if (c < 0x20 || c == 0x7f) snprintf(esc, 5, "\\x%02x", c);
    return strlen(esc);
}

static int has_control(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) return 1;
    return 0;
}

/* Keeps a message on one line (err.h's contract) whatever its arguments quote: a control byte
 * (a newline inside a JSON parser's excerpt of the input, say) is escaped (esc_byte); what no
 * longer fits is cut. */
static void err_one_line(char *msg) {
    size_t n = strnlen(msg, DSV4_ERR_MAX - 1);
    if (!has_control(msg, n)) return; /* the common case */
    char out[DSV4_ERR_MAX];
    size_t k = 0;
    for (size_t j = 0; j < n; j++) {
        char esc[5];
        size_t len = esc_byte((unsigned char)msg[j], esc);
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

/* One line per call, whatever the arguments hold: a server logs request paths, which a client
 * can fill with %0a after URL decoding, so control bytes are escaped (esc_byte) and the line is
 * written under stderr's lock (threads do not interleave inside it). */
void dsv4_log(int level, const char *fmt, ...) {
    if (level > dsv4_log_level) return;
    char stack[1024], *msg = stack;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(stack, sizeof stack, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof stack) {
        char *heap = malloc((size_t)n + 1);
        if (heap) {
            va_start(ap, fmt);
            vsnprintf(heap, (size_t)n + 1, fmt, ap);
            va_end(ap);
            msg = heap;
        } else {
            n = (int)sizeof stack - 1; /* the cut line rather than none */
        }
    }
    flockfile(stderr);
    if (!has_control(msg, (size_t)n)) {
        fwrite(msg, 1, (size_t)n, stderr);
    } else {
        for (int i = 0; i < n; i++) {
            char esc[5];
            fwrite(esc, 1, esc_byte((unsigned char)msg[i], esc), stderr);
        }
    }
    fputc('\n', stderr);
    funlockfile(stderr);
    if (msg != stack) free(msg);
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
