/* libFuzzer harness for text/dsml, the incremental output parser.
 *
 * Input layout: byte 0 bit 0 = mode (1: thinking); byte 1 = L (mod 16), the
 * number of chunk lengths that follow; then L bytes of chunk lengths (0 counts
 * as 1), used in turn to cut the rest, the model output, into pieces.
 * Invariants: no crash or sanitizer report; the raw bytes of all events, in
 * order, equal the output; exactly one END; and the collected result equals the
 * one from feeding the output whole. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "text/dsml.h"

typedef struct {
    dsv4_dsml_collector c;
    dsv4_chat_buf raw;
    int ends;
} tap;

static void tap_fn(void *user, const dsv4_dsml_event *ev) {
    tap *t = user;
    if (ev->raw_len) dsv4_chat_buf_put(&t->raw, ev->raw, ev->raw_len);
    if (ev->type == DSV4_DSML_END) t->ends++;
    dsv4_dsml_collect(&t->c, ev);
}

static void check(int ok) {
    if (!ok) __builtin_trap();
}

static void run(const uint8_t *text, size_t n, dsv4_chat_mode mode, const uint8_t *lens, size_t nlens,
                dsv4_dsml_message *out) {
    tap t;
    memset(&t, 0, sizeof t);
    dsv4_dsml_parser *p = NULL;
    check(dsv4_dsml_parser_init(&p, mode, 5, tap_fn, &t, NULL) == 0);
    size_t at = 0, k = 0;
    while (at < n) {
        size_t len = n;
        if (nlens) {
            len = lens[k++ % nlens];
            if (!len) len = 1;
        }
        if (len > n - at) len = n - at;
        check(dsv4_dsml_parser_feed(p, (const char *)text + at, len, NULL) == 0);
        at += len;
    }
    check(dsv4_dsml_parser_finish(p, NULL) == 0);
    check(t.ends == 1);
    check(t.raw.len == n && (n == 0 || memcmp(t.raw.data, text, n) == 0));
    dsv4_dsml_parser_free(p);
    dsv4_chat_buf_free(&t.raw);
    check(dsv4_dsml_collector_take(&t.c, out, NULL) == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    dsv4_chat_mode mode = (data[0] & 1) ? DSV4_CHAT_MODE_THINKING : DSV4_CHAT_MODE_CHAT;
    size_t nlens = data[1] % 16;
    if (size < 2 + nlens) return 0;
    const uint8_t *lens = data + 2, *text = data + 2 + nlens;
    size_t n = size - 2 - nlens;
    dsv4_dsml_message a, b;
    run(text, n, mode, lens, nlens, &a);
    run(text, n, mode, NULL, 0, &b);
    check(strcmp(a.reasoning, b.reasoning) == 0 && strcmp(a.content, b.content) == 0);
    check(a.ncalls == b.ncalls && a.malformed == b.malformed && a.eos == b.eos);
    for (size_t i = 0; i < a.ncalls; i++)
        check(!strcmp(a.calls[i].id, b.calls[i].id) && !strcmp(a.calls[i].name, b.calls[i].name) &&
              !strcmp(a.calls[i].arguments, b.calls[i].arguments) &&
              a.calls[i].malformed == b.calls[i].malformed);
    dsv4_dsml_message_free(&a);
    dsv4_dsml_message_free(&b);
    return 0;
}
