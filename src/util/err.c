#define _POSIX_C_SOURCE 200809L
#include "util/err.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int dsv4_log_level = 1;

int dsv4_errf(dsv4_err *err, const char *fmt, ...) {
    if (!err) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return -1;
}

int dsv4_err_prefix(dsv4_err *err, const char *fmt, ...) {
    if (!err) return -1;
    char prefix[DSV4_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    char old[DSV4_ERR_MAX];
    memcpy(old, err->msg, sizeof old);
    snprintf(err->msg, sizeof err->msg, "%s: %s", prefix, old);
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
