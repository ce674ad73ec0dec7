#include "model/state.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

/* ----- float buffers: the backend's memory, or host memory when there is no backend ----- */
static float *fb_alloc(const dsv4_state *s, size_t n) {
    if (!n) n = 1;
    return s->be ? s->be->ops->alloc(s->be, n * sizeof(float)) : calloc(n, sizeof(float));
}
static void fb_free(const dsv4_state *s, float *p) {
    if (!p) return;
    if (s->be) s->be->ops->free(s->be, p);
    else free(p);
}
/* host -> buffer, buffer -> host, buffer -> buffer (n floats) */
static void fb_put(const dsv4_state *s, float *dst, const float *src, size_t n) {
    if (!n) return;
    if (s->be) s->be->ops->upload(s->be, dst, src, n * sizeof(float));
    else memcpy(dst, src, n * sizeof(float));
}
static void fb_get(const dsv4_state *s, float *dst, const float *src, size_t n) {
    if (!n) return;
    if (s->be) s->be->ops->download(s->be, dst, src, n * sizeof(float));
    else memcpy(dst, src, n * sizeof(float));
}
static void fb_copy(const dsv4_state *s, float *dst, const float *src, size_t n) {
    if (!n) return;
    if (s->be) s->be->ops->copy(s->be, dst, src, n * sizeof(float));
    else memcpy(dst, src, n * sizeof(float));
}
/* Fills n floats of a buffer with v (through a host vector for a backend). */
static int fb_fill(const dsv4_state *s, float *dst, size_t n, float v) {
    if (!s->be) {
        for (size_t i = 0; i < n; i++) dst[i] = v;
        return 0;
    }
    float h[1024];
    for (size_t i = 0; i < 1024; i++) h[i] = v;
    for (size_t at = 0; at < n; at += 1024) fb_put(s, dst + at, h, n - at < 1024 ? n - at : 1024);
    return 0;
}

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

int64_t dsv4_state_period(const dsv4_config *cfg) {
    int64_t p = cfg->window > 0 ? cfg->window : 1;
    for (int l = 0; l < dsv4_config_total_layers(cfg); l++) {
        int r = cfg->compress_ratio[l];
        if (r > 1) p = p / gcd64(p, r) * r;
    }
    return p;
}

static size_t comp_buf_floats(const dsv4_comp_state *c) {
    return (size_t)c->coff * c->ratio * (size_t)c->coff * c->dim;
}

/* Floats [from, n) of both buffers back to empty: kv 0, score -inf (absent entries get
 * softmax weight 0, spec §2.5). */
static void comp_clear(const dsv4_state *s, dsv4_comp_state *c, size_t from) {
    size_t n = comp_buf_floats(c);
    if (from >= n) return;
    fb_fill(s, c->kv + from, n - from, 0.0f);
    fb_fill(s, c->score + from, n - from, -INFINITY);
}

static void comp_reset(const dsv4_state *s, dsv4_comp_state *c) {
    comp_clear(s, c, 0);
    c->n_rows = 0;
}

static int comp_init(const dsv4_state *s, dsv4_comp_state *c, int ratio, int dim, dsv4_err *err) {
    c->ratio = ratio;
    c->coff = ratio == 4 ? 2 : 1;
    c->dim = dim;
    size_t n = comp_buf_floats(c);
    c->kv = fb_alloc(s, n);
    c->score = fb_alloc(s, n);
    c->cap = 16;
    c->rows = fb_alloc(s, (size_t)c->cap * dim);
    if (!c->kv || !c->score || !c->rows) return dsv4_errf(err, "state: out of memory for compressor buffers");
    return 0;
}

static void comp_free(const dsv4_state *s, dsv4_comp_state *c) {
    fb_free(s, c->kv);
    fb_free(s, c->score);
    fb_free(s, c->rows);
}

void dsv4_state_free(dsv4_state *s) {
    if (!s) return;
    for (int l = 0; s->layers && l < s->n_layers; l++) {
        dsv4_layer_state *L = &s->layers[l];
        fb_free(s, L->ring);
        free(L->ring_pos);
        if (L->has_comp) comp_free(s, &L->comp);
        if (L->has_idx) comp_free(s, &L->icomp);
    }
    free(s->layers);
    for (int i = 0; i < s->n_ckpt; i++) {
        free(s->ckpt[i].f);
        free(s->ckpt[i].ipos);
    }
    free(s->ckpt);
    free(s->tokens);
    fb_free(s, s->last_x);
    free(s);
}

void dsv4_state_reset(dsv4_state *s) {
    for (int l = 0; l < s->n_layers; l++) {
        dsv4_layer_state *L = &s->layers[l];
        fb_fill(s, L->ring, (size_t)s->window * s->head_dim, 0.0f);
        for (int i = 0; i < s->window; i++) L->ring_pos[i] = -1;
        if (L->has_comp) comp_reset(s, &L->comp);
        if (L->has_idx) comp_reset(s, &L->icomp);
    }
    fb_fill(s, s->last_x, (size_t)s->hc_dim, 0.0f);
    for (int i = 0; i < s->n_ckpt; i++) {
        free(s->ckpt[i].f);
        free(s->ckpt[i].ipos);
    }
    s->n_ckpt = 0;
    s->len = 0;
    s->broken = 0;
}

int dsv4_state_new(dsv4_state **out, const dsv4_config *cfg, int64_t snapshot_every, dsv4_err *err) {
    return dsv4_state_new_on(out, cfg, snapshot_every, NULL, err);
}

int dsv4_state_new_on(dsv4_state **out, const dsv4_config *cfg, int64_t snapshot_every, dsv4_backend *be,
                      dsv4_err *err) {
    *out = NULL;
    dsv4_state *s = calloc(1, sizeof *s);
    if (!s) return dsv4_errf(err, "state: out of memory");
    s->be = be;
    s->n_layers = dsv4_config_total_layers(cfg);
    s->window = cfg->window;
    s->head_dim = cfg->head_dim;
    s->hc_dim = cfg->hc_mult * cfg->dim;
    int64_t period = dsv4_state_period(cfg);
    if (snapshot_every <= 0) snapshot_every = 512;
    s->snapshot_every = (snapshot_every + period - 1) / period * period;
    s->tok_cap = 64;
    s->tokens = malloc(sizeof(int32_t) * (size_t)s->tok_cap);
    s->last_x = fb_alloc(s, (size_t)s->hc_dim);
    s->layers = calloc((size_t)s->n_layers, sizeof *s->layers);
    if (!s->tokens || !s->last_x || !s->layers) {
        dsv4_state_free(s);
        return dsv4_errf(err, "state: out of memory");
    }
    for (int l = 0; l < s->n_layers; l++) {
        dsv4_layer_state *L = &s->layers[l];
        L->ring = fb_alloc(s, (size_t)s->window * s->head_dim);
        L->ring_pos = malloc(sizeof(int64_t) * (size_t)s->window);
        if (!L->ring || !L->ring_pos) {
            dsv4_state_free(s);
            return dsv4_errf(err, "state: out of memory for window rings");
        }
        int r = cfg->compress_ratio[l];
        if (r > 1) {
            L->has_comp = 1;
            if (comp_init(s, &L->comp, r, cfg->head_dim, err)) {
                dsv4_state_free(s);
                return -1;
            }
        }
        if (r == 4) {
            L->has_idx = 1;
            if (comp_init(s, &L->icomp, r, cfg->index_head_dim, err)) {
                dsv4_state_free(s);
                return -1;
            }
        }
    }
    dsv4_state_reset(s);
    *out = s;
    return 0;
}

static int grow_rows(const dsv4_state *s, dsv4_comp_state *c, int64_t need, dsv4_err *err) {
    if (need <= c->cap) return 0;
    int64_t cap = c->cap;
    while (cap < need) cap *= 2;
    float *p = fb_alloc(s, (size_t)cap * c->dim);
    if (!p) return dsv4_errf(err, "state: out of memory growing compressed rows to %lld", (long long)cap);
    fb_copy(s, p, c->rows, (size_t)c->n_rows * c->dim);
    fb_free(s, c->rows);
    c->rows = p;
    c->cap = cap;
    return 0;
}

int dsv4_state_reserve(dsv4_state *s, int64_t more, dsv4_err *err) {
    int64_t need = s->len + more;
    if (need > s->tok_cap) {
        int64_t cap = s->tok_cap;
        while (cap < need) cap *= 2;
        int32_t *p = realloc(s->tokens, sizeof(int32_t) * (size_t)cap);
        if (!p) return dsv4_errf(err, "state: out of memory for the token history");
        s->tokens = p;
        s->tok_cap = cap;
    }
    for (int l = 0; l < s->n_layers; l++) {
        dsv4_layer_state *L = &s->layers[l];
        if (L->has_comp && grow_rows(s, &L->comp, need / L->comp.ratio + 1, err)) return -1;
        if (L->has_idx && grow_rows(s, &L->icomp, need / L->icomp.ratio + 1, err)) return -1;
    }
    return 0;
}

/* ----- checkpoints ----- */
/* The part of a compressor buffer that survives a window boundary: ratio-4 rows [0, r)
 * (the previous window, read by the next emit).  Other ratios are fully rewritten
 * before their next emit, so nothing is kept. */
static size_t comp_keep_floats(const dsv4_comp_state *c) {
    return c->coff == 2 ? (size_t)c->ratio * (size_t)c->coff * c->dim : 0;
}

static size_t ckpt_floats(const dsv4_state *s) {
    size_t n = (size_t)s->hc_dim;
    for (int l = 0; l < s->n_layers; l++) {
        const dsv4_layer_state *L = &s->layers[l];
        n += (size_t)s->window * s->head_dim;
        if (L->has_comp) n += 2 * comp_keep_floats(&L->comp);
        if (L->has_idx) n += 2 * comp_keep_floats(&L->icomp);
    }
    return n;
}

static void ckpt_io(dsv4_state *s, dsv4_checkpoint *c, int save) {
    float *f = c->f;
    int64_t *ip = c->ipos;
#define MOVE(dst_save, src_save, n)                                        \
    do {                                                                   \
        if (save) fb_get(s, dst_save, src_save, n);                        \
        else fb_put(s, src_save, dst_save, n);                             \
    } while (0)
    MOVE(f, s->last_x, (size_t)s->hc_dim);
    f += s->hc_dim;
    for (int l = 0; l < s->n_layers; l++) {
        dsv4_layer_state *L = &s->layers[l];
        size_t nr = (size_t)s->window * s->head_dim;
        MOVE(f, L->ring, nr);
        f += nr;
        if (save) memcpy(ip, L->ring_pos, sizeof(int64_t) * (size_t)s->window);
        else memcpy(L->ring_pos, ip, sizeof(int64_t) * (size_t)s->window);
        ip += s->window;
        dsv4_comp_state *cs[2] = {L->has_comp ? &L->comp : NULL, L->has_idx ? &L->icomp : NULL};
        for (int k = 0; k < 2; k++) {
            if (!cs[k]) continue;
            size_t nk = comp_keep_floats(cs[k]);
            MOVE(f, cs[k]->kv, nk);
            f += nk;
            MOVE(f, cs[k]->score, nk);
            f += nk;
        }
    }
#undef MOVE
}

/* Appends a checkpoint at len (no thinning: clone and restore copy a thinned set as it is). */
static int ckpt_add(dsv4_state *s, dsv4_err *err) {
    if (s->len == 0) return 0; /* position 0 is the reset state */
    if (s->n_ckpt > 0 && s->ckpt[s->n_ckpt - 1].pos >= s->len) return 0;
    if (s->n_ckpt == s->ckpt_cap) {
        int cap = s->ckpt_cap ? 2 * s->ckpt_cap : 8;
        dsv4_checkpoint *p = realloc(s->ckpt, sizeof *p * (size_t)cap);
        if (!p) return dsv4_errf(err, "state: out of memory for checkpoints");
        s->ckpt = p;
        s->ckpt_cap = cap;
    }
    dsv4_checkpoint *c = &s->ckpt[s->n_ckpt];
    c->pos = s->len;
    c->nf = ckpt_floats(s);
    c->ni = (size_t)s->n_layers * s->window;
    c->f = malloc(c->nf * sizeof(float));
    c->ipos = malloc(c->ni * sizeof(int64_t));
    if (!c->f || !c->ipos) {
        free(c->f);
        free(c->ipos);
        return dsv4_errf(err, "state: out of memory for a checkpoint");
    }
    ckpt_io(s, c, 1);
    s->n_ckpt++;
    return 0;
}

/* 1 if the checkpoint k intervals of snapshot_every from position 0 stays while the newest is
 * at K: the DSV4_CKPT_DENSE newest all stay; from there each doubling of the distance keeps half
 * as many (at d in [D 2^(j-1), D 2^j) the multiples of 2^j).  The rule only gets stricter as K
 * grows, so a dropped checkpoint is never wanted back. */
static int ckpt_keep(int64_t k, int64_t K) {
    int64_t d = K - k;
    if (d < DSV4_CKPT_DENSE) return 1;
    int64_t step = 2;
    for (int64_t q = d / DSV4_CKPT_DENSE; q > 1; q >>= 1) step <<= 1;
    return k % step == 0;
}

/* Drops the checkpoints ckpt_keep no longer keeps: a sequence of N intervals holds about
 * DSV4_CKPT_DENSE (1 + log2(N / DSV4_CKPT_DENSE) / 2) of them instead of N (V4-Flash at 1M tokens:
 * ~72 of 12.5 MB instead of 2048), and a rewind d intervals back re-runs at most about
 * 2 d / DSV4_CKPT_DENSE of them. */
static void ckpt_thin(dsv4_state *s) {
    if (s->n_ckpt < 2) return;
    int64_t every = s->snapshot_every, K = s->ckpt[s->n_ckpt - 1].pos / every;
    int w = 0;
    for (int i = 0; i < s->n_ckpt; i++) {
        dsv4_checkpoint *c = &s->ckpt[i];
        if (c->pos % every || ckpt_keep(c->pos / every, K)) {
            s->ckpt[w++] = *c;
        } else {
            free(c->f);
            free(c->ipos);
        }
    }
    s->n_ckpt = w;
}

int dsv4_state_checkpoint(dsv4_state *s, dsv4_err *err) {
    if (ckpt_add(s, err)) return -1;
    ckpt_thin(s);
    return 0;
}

int dsv4_state_rewind(dsv4_state *s, int64_t len, int64_t *resume_from, dsv4_err *err) {
    if (len < 0 || len > s->len)
        return dsv4_errf(err, "truncate: length %lld is outside [0, %lld]", (long long)len, (long long)s->len);
    if (s->broken && len > 0)
        return dsv4_errf(err, "truncate: the sequence is unusable (a failed step could not be undone); only a "
                              "truncate to 0 resets it");
    *resume_from = len;
    if (len == s->len && !s->broken) return 0;
    while (s->n_ckpt > 0 && s->ckpt[s->n_ckpt - 1].pos > len) {
        s->n_ckpt--;
        free(s->ckpt[s->n_ckpt].f);
        free(s->ckpt[s->n_ckpt].ipos);
    }
    int64_t c = s->n_ckpt > 0 ? s->ckpt[s->n_ckpt - 1].pos : 0;
    if (c == 0) {
        dsv4_state_reset(s); /* no checkpoint left: back to the empty sequence */
    } else {
        ckpt_io(s, &s->ckpt[s->n_ckpt - 1], 0);
        /* reset the non-kept compressor rows so the buffers equal a fresh run's */
        for (int l = 0; l < s->n_layers; l++) {
            dsv4_layer_state *L = &s->layers[l];
            dsv4_comp_state *cs[2] = {L->has_comp ? &L->comp : NULL, L->has_idx ? &L->icomp : NULL};
            for (int k = 0; k < 2; k++) {
                if (!cs[k]) continue;
                comp_clear(s, cs[k], comp_keep_floats(cs[k]));
            }
        }
    }
    dsv4_state_set_len(s, c);
    *resume_from = c;
    return 0;
}

void dsv4_state_set_len(dsv4_state *s, int64_t len) {
    s->len = len;
    for (int l = 0; l < s->n_layers; l++) {
        dsv4_layer_state *L = &s->layers[l];
        if (L->has_comp) L->comp.n_rows = len / L->comp.ratio;
        if (L->has_idx) L->icomp.n_rows = len / L->icomp.ratio;
    }
}

/* ----- copy, size, serialization ----- */
size_t dsv4_state_bytes(const dsv4_state *s) {
    size_t n = sizeof *s + (size_t)s->tok_cap * sizeof(int32_t) + (size_t)s->hc_dim * sizeof(float);
    for (int l = 0; l < s->n_layers; l++) {
        const dsv4_layer_state *L = &s->layers[l];
        n += (size_t)s->window * (s->head_dim * sizeof(float) + sizeof(int64_t));
        const dsv4_comp_state *cs[2] = {L->has_comp ? &L->comp : NULL, L->has_idx ? &L->icomp : NULL};
        for (int k = 0; k < 2; k++)
            if (cs[k]) n += 2 * comp_buf_floats(cs[k]) * sizeof(float) + (size_t)cs[k]->cap * cs[k]->dim * sizeof(float);
    }
    for (int i = 0; i < s->n_ckpt; i++) n += s->ckpt[i].nf * sizeof(float) + s->ckpt[i].ni * sizeof(int64_t);
    return n;
}

/* A tiny writer/reader over a byte buffer; `buf` NULL only counts. */
typedef struct {
    uint8_t *buf;
    size_t at, cap;
    int bad;
} io;

static void io_put(io *w, const void *p, size_t n) {
    if (w->buf) memcpy(w->buf + w->at, p, n);
    w->at += n;
}
static void io_get(io *r, void *p, size_t n) {
    if (r->bad || n > r->cap - r->at) {
        r->bad = 1;
        memset(p, 0, n);
        return;
    }
    memcpy(p, r->buf + r->at, n);
    r->at += n;
}

/* The same for n floats of a state buffer (backend memory: download / upload). */
static void io_put_f(io *w, const dsv4_state *s, const float *p, size_t n) {
    if (w->buf) fb_get(s, (float *)(void *)(w->buf + w->at), p, n);
    w->at += n * sizeof(float);
}
static void io_get_f(io *r, const dsv4_state *s, float *p, size_t n) {
    size_t bytes = n * sizeof(float);
    if (r->bad || bytes > r->cap - r->at) {
        r->bad = 1; /* the scratch state is dropped; nothing to clear */
        return;
    }
    fb_put(s, p, (const float *)(const void *)(r->buf + r->at), n);
    r->at += bytes;
}

#define STATE_MAGIC 0x31535644u /* "DVS1" */

static void write_all(const dsv4_state *s, uint64_t tag, io *w) {
    uint32_t magic = STATE_MAGIC;
    io_put(w, &magic, 4);
    io_put(w, &tag, 8);
    int32_t shape[4] = {s->n_layers, s->window, s->head_dim, s->hc_dim};
    io_put(w, shape, sizeof shape);
    io_put(w, &s->len, 8);
    io_put(w, &s->snapshot_every, 8);
    io_put(w, s->tokens, sizeof(int32_t) * (size_t)s->len);
    io_put_f(w, s, s->last_x, (size_t)s->hc_dim);
    for (int l = 0; l < s->n_layers; l++) {
        const dsv4_layer_state *L = &s->layers[l];
        io_put_f(w, s, L->ring, (size_t)s->window * s->head_dim);
        io_put(w, L->ring_pos, sizeof(int64_t) * (size_t)s->window);
        const dsv4_comp_state *cs[2] = {L->has_comp ? &L->comp : NULL, L->has_idx ? &L->icomp : NULL};
        for (int k = 0; k < 2; k++) {
            if (!cs[k]) continue;
            io_put_f(w, s, cs[k]->kv, comp_buf_floats(cs[k]));
            io_put_f(w, s, cs[k]->score, comp_buf_floats(cs[k]));
            io_put(w, &cs[k]->n_rows, 8);
            io_put_f(w, s, cs[k]->rows, (size_t)cs[k]->n_rows * cs[k]->dim);
        }
    }
    int32_t nc = s->n_ckpt;
    io_put(w, &nc, 4);
    for (int i = 0; i < s->n_ckpt; i++) {
        io_put(w, &s->ckpt[i].pos, 8);
        io_put(w, s->ckpt[i].f, sizeof(float) * s->ckpt[i].nf);
        io_put(w, s->ckpt[i].ipos, sizeof(int64_t) * s->ckpt[i].ni);
    }
}

int dsv4_state_serialize(const dsv4_state *s, uint64_t tag, void **blob, size_t *n, dsv4_err *err) {
    if (s->broken) return dsv4_errf(err, "snapshot: the sequence is unusable (a failed step could not be undone)");
    io w = {0};
    write_all(s, tag, &w);
    w.buf = malloc(w.at ? w.at : 1);
    if (!w.buf) return dsv4_errf(err, "snapshot: out of memory for %zu bytes", w.at);
    w.cap = w.at;
    w.at = 0;
    write_all(s, tag, &w);
    *blob = w.buf;
    *n = w.at;
    return 0;
}

int dsv4_state_deserialize(dsv4_state *s, uint64_t tag, const void *blob, size_t n, dsv4_err *err) {
    io r = {.buf = (uint8_t *)blob, .cap = n};
    uint32_t magic = 0;
    uint64_t t = 0;
    int32_t shape[4];
    io_get(&r, &magic, 4);
    if (r.bad || magic != STATE_MAGIC) return dsv4_errf(err, "restore: not a dsv4 sequence snapshot (bad magic)");
    io_get(&r, &t, 8);
    if (t != tag) return dsv4_errf(err, "restore: snapshot was made with a different model or numerics");
    io_get(&r, shape, sizeof shape);
    if (r.bad || shape[0] != s->n_layers || shape[1] != s->window || shape[2] != s->head_dim || shape[3] != s->hc_dim)
        return dsv4_errf(err, "restore: snapshot shape does not match this model");
    int64_t len = 0, every = 0;
    io_get(&r, &len, 8);
    io_get(&r, &every, 8);
    if (r.bad || len < 0 || (uint64_t)len > n / 4 || every <= 0)
        return dsv4_errf(err, "restore: corrupt snapshot header (length %lld)", (long long)len);
    /* parse into a scratch state first so a corrupt blob leaves s unchanged */
    dsv4_state *tmp = NULL;
    if (dsv4_state_clone(s, &tmp, err)) return -1;
    dsv4_state_reset(tmp);
    tmp->snapshot_every = every;
    int ok = dsv4_state_reserve(tmp, len, err) == 0;
    if (ok) {
        io_get(&r, tmp->tokens, sizeof(int32_t) * (size_t)len);
        io_get_f(&r, tmp, tmp->last_x, (size_t)tmp->hc_dim);
        for (int l = 0; l < tmp->n_layers && !r.bad; l++) {
            dsv4_layer_state *L = &tmp->layers[l];
            io_get_f(&r, tmp, L->ring, (size_t)tmp->window * tmp->head_dim);
            io_get(&r, L->ring_pos, sizeof(int64_t) * (size_t)tmp->window);
            dsv4_comp_state *cs[2] = {L->has_comp ? &L->comp : NULL, L->has_idx ? &L->icomp : NULL};
            for (int k = 0; k < 2 && !r.bad; k++) {
                if (!cs[k]) continue;
                io_get_f(&r, tmp, cs[k]->kv, comp_buf_floats(cs[k]));
                io_get_f(&r, tmp, cs[k]->score, comp_buf_floats(cs[k]));
                int64_t nr = 0;
                io_get(&r, &nr, 8);
                if (r.bad || nr != len / cs[k]->ratio) {
                    r.bad = 1;
                    break;
                }
                cs[k]->n_rows = nr;
                if (nr > cs[k]->cap) { /* reserve(len) made room for len / ratio + 1 rows */
                    r.bad = 1;
                    break;
                }
                io_get_f(&r, tmp, cs[k]->rows, (size_t)nr * cs[k]->dim);
            }
        }
        int32_t nc = 0;
        io_get(&r, &nc, 4);
        if (nc < 0 || nc > 1 << 24) r.bad = 1;
        for (int i = 0; i < nc && !r.bad; i++) {
            int64_t pos = 0;
            io_get(&r, &pos, 8);
            if (r.bad || pos <= 0 || pos > len || pos % every) {
                r.bad = 1;
                break;
            }
            tmp->len = pos; /* ckpt_add records at len */
            if (ckpt_add(tmp, err)) {
                ok = 0;
                break;
            }
            dsv4_checkpoint *c = &tmp->ckpt[tmp->n_ckpt - 1];
            io_get(&r, c->f, sizeof(float) * c->nf);
            io_get(&r, c->ipos, sizeof(int64_t) * c->ni);
        }
        if (r.at != n) r.bad = 1;
        tmp->len = len;
    }
    if (!ok || r.bad) {
        dsv4_state_free(tmp);
        return ok ? dsv4_errf(err, "restore: truncated or corrupt snapshot (%zu bytes)", n) : -1;
    }
    /* swap contents */
    dsv4_state keep = *s;
    *s = *tmp;
    *tmp = keep;
    dsv4_state_free(tmp);
    return 0;
}

int dsv4_state_clone(const dsv4_state *src, dsv4_state **out, dsv4_err *err) {
    *out = NULL;
    if (src->broken) return dsv4_errf(err, "clone: the sequence is unusable (a failed step could not be undone)");
    dsv4_state *s = calloc(1, sizeof *s);
    if (!s) return dsv4_errf(err, "clone: out of memory");
    *s = *src;
    s->tokens = NULL;
    s->last_x = NULL;
    s->layers = NULL;
    s->ckpt = NULL;
    s->n_ckpt = s->ckpt_cap = 0;
    s->tokens = malloc(sizeof(int32_t) * (size_t)src->tok_cap);
    s->last_x = fb_alloc(s, (size_t)src->hc_dim);
    s->layers = calloc((size_t)src->n_layers, sizeof *s->layers);
    if (!s->tokens || !s->last_x || !s->layers) goto oom;
    memcpy(s->tokens, src->tokens, sizeof(int32_t) * (size_t)src->len);
    fb_copy(s, s->last_x, src->last_x, (size_t)src->hc_dim);
    for (int l = 0; l < src->n_layers; l++) {
        const dsv4_layer_state *A = &src->layers[l];
        dsv4_layer_state *B = &s->layers[l];
        *B = *A;
        B->ring = fb_alloc(s, (size_t)src->window * src->head_dim);
        B->ring_pos = malloc(sizeof(int64_t) * (size_t)src->window);
        B->comp.kv = B->comp.score = B->comp.rows = NULL;
        B->icomp.kv = B->icomp.score = B->icomp.rows = NULL;
        if (!B->ring || !B->ring_pos) goto oom;
        fb_copy(s, B->ring, A->ring, (size_t)src->window * src->head_dim);
        memcpy(B->ring_pos, A->ring_pos, sizeof(int64_t) * (size_t)src->window);
        const dsv4_comp_state *ca[2] = {A->has_comp ? &A->comp : NULL, A->has_idx ? &A->icomp : NULL};
        dsv4_comp_state *cb[2] = {&B->comp, &B->icomp};
        for (int k = 0; k < 2; k++) {
            if (!ca[k]) continue;
            size_t nb = comp_buf_floats(ca[k]);
            cb[k]->kv = fb_alloc(s, nb);
            cb[k]->score = fb_alloc(s, nb);
            cb[k]->rows = fb_alloc(s, (size_t)ca[k]->cap * ca[k]->dim);
            if (!cb[k]->kv || !cb[k]->score || !cb[k]->rows) goto oom;
            fb_copy(s, cb[k]->kv, ca[k]->kv, nb);
            fb_copy(s, cb[k]->score, ca[k]->score, nb);
            fb_copy(s, cb[k]->rows, ca[k]->rows, (size_t)ca[k]->n_rows * ca[k]->dim);
        }
    }
    for (int i = 0; i < src->n_ckpt; i++) {
        int64_t keep = s->len;
        s->len = src->ckpt[i].pos;
        /* allocate via ckpt_add then overwrite with the source's contents */
        if (ckpt_add(s, err)) {
            s->len = keep;
            dsv4_state_free(s);
            return -1;
        }
        s->len = keep;
        memcpy(s->ckpt[i].f, src->ckpt[i].f, src->ckpt[i].nf * sizeof(float));
        memcpy(s->ckpt[i].ipos, src->ckpt[i].ipos, src->ckpt[i].ni * sizeof(int64_t));
    }
    *out = s;
    return 0;
oom:
    dsv4_state_free(s);
    return dsv4_errf(err, "clone: out of memory");
}
