/* text/stop: see stop.h for the contract. */
#include "text/stop.h"

#include <string.h>

int dsv4_stop_init(dsv4_stop *st, int32_t eos_id, const char *const *strings, const size_t *lens,
                   int n_strings, int include_stop_str, dsv4_err *err) {
    if (!st) return dsv4_errf(err, "stop init: NULL stop object");
    memset(st, 0, sizeof *st);
    if (n_strings < 0 || n_strings > DSV4_STOP_MAX_STRINGS)
        return dsv4_errf(err, "stop: %d stop strings (at most %d)", n_strings, DSV4_STOP_MAX_STRINGS);
    if (n_strings > 0 && !strings) return dsv4_errf(err, "stop: %d stop strings but no array", n_strings);
    for (int i = 0; i < n_strings; i++) {
        if (!strings[i]) return dsv4_errf(err, "stop: stop string %d is NULL", i);
        size_t n = lens ? lens[i] : strlen(strings[i]);
        if (n == 0) return dsv4_errf(err, "stop: stop string %d is empty", i);
        if (n > DSV4_STOP_MAX_LEN)
            return dsv4_errf(err, "stop: stop string %d is %zu bytes (at most %d)", i, n, DSV4_STOP_MAX_LEN);
        memcpy(st->str[i], strings[i], n);
        st->len[i] = n;
    }
    st->n_strings = n_strings;
    st->include_stop_str = include_stop_str ? 1 : 0;
    if (eos_id >= 0)
        st->ids[st->n_ids++] = eos_id;
    else if (eos_id != -1)
        return dsv4_errf(err, "stop: eos id %ld is negative (use -1 for none)", (long)eos_id);
    return 0;
}

int dsv4_stop_add_id(dsv4_stop *st, int32_t id, dsv4_err *err) {
    if (!st) return dsv4_errf(err, "stop add_id: NULL stop object");
    if (id < 0) return dsv4_errf(err, "stop: stop token id %ld is negative", (long)id);
    if (dsv4_stop_is_stop_id(st, id)) return 0;
    if (st->n_ids >= DSV4_STOP_MAX_IDS)
        return dsv4_errf(err, "stop: more than %d stop token ids (adding %ld)", DSV4_STOP_MAX_IDS, (long)id);
    st->ids[st->n_ids++] = id;
    return 0;
}

int dsv4_stop_is_stop_id(const dsv4_stop *st, int32_t id) {
    if (!st) return 0;
    for (int i = 0; i < st->n_ids; i++)
        if (st->ids[i] == id) return 1;
    return 0;
}

/* Length of the longest suffix of b[0..n) that is a proper prefix of some stop
 * string: those bytes could still become a match, so they wait. */
static size_t holdback(const dsv4_stop *st, const char *b, size_t n) {
    size_t best = 0;
    for (int i = 0; i < st->n_strings; i++) {
        size_t L = st->len[i];
        size_t kmax = L - 1 < n ? L - 1 : n;
        for (size_t k = kmax; k > best; k--) { /* longest first; stop at what we already hold */
            if (b[n - k] == st->str[i][0] && memcmp(b + n - k, st->str[i], k) == 0) {
                best = k;
                break;
            }
        }
    }
    return best;
}

int dsv4_stop_feed(dsv4_stop *st, const char *piece, size_t len, char *out, size_t out_cap,
                   dsv4_stop_result *res, dsv4_err *err) {
    if (!st || !out || !res || (len > 0 && !piece)) return dsv4_errf(err, "stop feed: NULL argument");
    res->emit_len = 0;
    res->stopped = 0;
    res->which = -1;
    if (st->stopped) return dsv4_errf(err, "stop: text fed after a stop string already ended the sequence");
    size_t need;
    if (dsv4_add_size(st->n_held, len, &need) != 0 || need > out_cap)
        return dsv4_errf(err, "stop: output buffer of %zu bytes is too small (need %zu held + %zu new)",
                         out_cap, st->n_held, len);
    /* b = held text + piece.  The held text contains no complete stop string
     * (we would have stopped), so any match ends inside the new piece. */
    char *b = out;
    memcpy(b, st->held, st->n_held);
    if (len) memcpy(b + st->n_held, piece, len);
    size_t n = need;

    /* the match that completes first (smallest end), ties to the longer one */
    int which = -1;
    size_t m_start = 0, m_end = (size_t)-1;
    for (int i = 0; i < st->n_strings; i++) {
        const char *hit = memmem(b, n, st->str[i], st->len[i]);
        if (!hit) continue;
        size_t start = (size_t)(hit - b), end = start + st->len[i];
        if (end < m_end || (end == m_end && start < m_start)) {
            which = i;
            m_start = start;
            m_end = end;
        }
    }
    if (which >= 0) {
        st->stopped = 1;
        st->n_held = 0;
        res->stopped = 1;
        res->which = which;
        res->emit_len = st->include_stop_str ? m_end : m_start;
        return 0;
    }
    size_t h = holdback(st, b, n);
    memcpy(st->held, b + n - h, h);
    st->n_held = h;
    res->emit_len = n - h;
    return 0;
}

long dsv4_stop_flush(dsv4_stop *st, char *out, size_t out_cap, dsv4_err *err) {
    if (!st || (!out && st->n_held > 0)) return dsv4_errf(err, "stop flush: NULL argument");
    if (out_cap < st->n_held)
        return dsv4_errf(err, "stop flush: output buffer of %zu bytes is too small (need %zu)", out_cap,
                         st->n_held);
    size_t n = st->n_held;
    if (n) memcpy(out, st->held, n);
    st->n_held = 0;
    return (long)n;
}
