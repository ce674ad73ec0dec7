/* engine/engine: the public API over model/forward and model/state (contract in engine.h). */
#include "engine/engine.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/backend.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/numerics.h"
#include "model/safetensors.h"
#include "model/state.h"
#include "model/weights.h"

struct dsv4_engine {
    dsv4_config cfg;
    dsv4_st *st;
    dsv4_model_w w;
    int w_bound;
    dsv4_backend be;
    int be_init;
    int be_cuda;            /* be is the CUDA backend */
    dsv4_model *model;
    dsv4_numerics num;
    char numerics_name[256];
    char dir[4096];
    int64_t snapshot_every;
    int n_seqs;
    dsv4_trace_fn trace;
    void *trace_user;
    dsv4_op_trace_fn op_trace;
    void *op_trace_user;
    uint64_t tag;           /* model shape + numerics, guards snapshots */
};

struct dsv4_seq {
    dsv4_engine *e;
    dsv4_state *st;
};

/* ----- opening ----- */
static int has_config(const char *dir) {
    char p[4400];
    struct stat sb;
    snprintf(p, sizeof p, "%s/config.json", dir);
    return stat(p, &sb) == 0;
}

int dsv4_engine_default_model(char *buf, size_t n, dsv4_err *err) {
    const char *env = getenv("DSV4_DEFAULT_MODEL");
    if (env && *env) {
        if (!has_config(env))
            return dsv4_errf(err, "DSV4_DEFAULT_MODEL=%s has no config.json", env);
        snprintf(buf, n, "%s", env);
        return 0;
    }
    char exe[4096];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len <= 0) return dsv4_errf(err, "default model: cannot resolve /proc/self/exe");
    exe[len] = 0;
    char *slash = strrchr(exe, '/');
    if (slash) *slash = 0;
    char cand[4200];
    snprintf(cand, sizeof cand, "%s/default-model", exe);
    if (!has_config(cand))
        return dsv4_errf(err, "no default model: %s/config.json is missing (run `make default-model`, "
                              "set DSV4_DEFAULT_MODEL, or pass --model DIR)", cand);
    snprintf(buf, n, "%s", cand);
    return 0;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ull;
    return h;
}

void dsv4_engine_close(dsv4_engine *e) {
    if (!e) return;
    dsv4_model_free(e->model);
    if (e->be_init) {
        if (e->be_cuda) dsv4_backend_cuda_free(&e->be);
        else dsv4_backend_cpu_free(&e->be);
    }
    if (e->w_bound) dsv4_weights_free(&e->w);
    if (e->st) dsv4_st_close(e->st);
    free(e);
}

static void route_trace(void *user, const dsv4_route_info *ri);

int dsv4_engine_open(dsv4_engine **out, const dsv4_engine_opts *opts, dsv4_err *err) {
    *out = NULL;
    dsv4_engine_opts o = {0};
    if (opts) o = *opts;
    /* backend: cpu (default), cuda, or auto = cuda when this build has it and a device answers */
    int want_cuda = 0;
    if (o.backend && !strcmp(o.backend, "cuda")) want_cuda = 1;
    else if (o.backend && !strcmp(o.backend, "auto")) want_cuda = dsv4_backend_cuda_available();
    else if (o.backend && strcmp(o.backend, "cpu"))
        return dsv4_errf(err, "unknown backend '%s' (expected cpu, cuda or auto; this build has: cpu%s)", o.backend,
                         dsv4_backend_cuda_available() ? ", cuda" : "");
    dsv4_engine *e = calloc(1, sizeof *e);
    if (!e) return dsv4_errf(err, "engine: out of memory");
    if (o.model_dir) snprintf(e->dir, sizeof e->dir, "%s", o.model_dir);
    else if (dsv4_engine_default_model(e->dir, sizeof e->dir, err)) goto fail;
    if (dsv4_numerics_profile(&e->num, o.numerics, err)) goto fail;
    snprintf(e->numerics_name, sizeof e->numerics_name, "%s", o.numerics ? o.numerics : "exact");
    for (int i = 0; i < o.n_sets; i++) {
        if (dsv4_numerics_set(&e->num, o.sets[i], err)) goto fail;
        size_t l = strlen(e->numerics_name);
        snprintf(e->numerics_name + l, sizeof e->numerics_name - l, " %s", o.sets[i]);
    }
    char cfgp[4200];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", e->dir);
    if (dsv4_config_load(&e->cfg, cfgp, err)) goto fail;
    if (dsv4_st_open(&e->st, e->dir, err)) goto fail;
    if (dsv4_weights_bind(&e->w, &e->cfg, e->st, err)) {
        dsv4_err_prefix(err, "%s", e->dir);
        goto fail;
    }
    e->w_bound = 1;
    if (want_cuda) {
        if (dsv4_backend_cuda_init(&e->be, 0, err)) goto fail;
        e->be_cuda = 1;
    } else if (dsv4_backend_cpu_init(&e->be, o.n_threads, err)) {
        goto fail;
    }
    e->be_init = 1;
    if (e->be.ops->load_weights && e->be.ops->load_weights(&e->be, &e->w, err)) goto fail;
    /* rows per sub-batch: the GPU streams every weight once per chunk, so it wants big chunks
     * (results do not depend on the cut) */
    if (dsv4_model_init(&e->model, &e->w, &e->be, &e->num, e->be_cuda ? 1024 : 64, err)) goto fail;
    /* the model's routing trace is installed only while the user has one (set_trace): with it
     * the forward pass downloads picks and routing every layer, which serializes a device
     * backend with the host */
    int64_t period = dsv4_state_period(&e->cfg);
    e->snapshot_every = o.snapshot_every > 0 ? o.snapshot_every : 0;
    if (e->snapshot_every) e->snapshot_every = (e->snapshot_every + period - 1) / period * period;
    uint64_t h = 1469598103934665603ull;
    h = fnv(h, &e->cfg, sizeof e->cfg);
    h = fnv(h, &e->num, sizeof e->num);
    e->tag = h;
    *out = e;
    return 0;
fail:
    dsv4_engine_close(e);
    return -1;
}

void dsv4_engine_get_info(const dsv4_engine *e, dsv4_engine_info *out) {
    memset(out, 0, sizeof *out);
    snprintf(out->model_name, sizeof out->model_name, "%s", e->cfg.name);
    snprintf(out->model_dir, sizeof out->model_dir, "%s", e->dir);
    snprintf(out->numerics, sizeof out->numerics, "%s", e->numerics_name);
    out->vocab_size = e->cfg.vocab_size;
    out->bos_id = e->cfg.bos_id;
    out->eos_id = e->cfg.eos_id;
    out->n_layers = e->cfg.n_layers;
    out->n_mtp = e->cfg.n_mtp;
    out->max_position = e->cfg.max_position;
    out->state_period = (int)dsv4_state_period(&e->cfg);
}

/* ----- backend introspection (dsv4 bench) ----- */
const char *dsv4_engine_backend_name(const dsv4_engine *e) { return e->be.ops->name; }

void dsv4_engine_profile(dsv4_engine *e, int on) {
    if (e->be.ops->profile) e->be.ops->profile(&e->be, on);
}

void dsv4_engine_perf(dsv4_engine *e, dsv4_engine_perf_info *out) {
    memset(out, 0, sizeof *out);
    if (!e->be.ops->stats) return;
    dsv4_backend_stats st;
    e->be.ops->stats(&e->be, &st);
    snprintf(out->device, sizeof out->device, "%s", st.device);
    out->mem_used = st.mem_used;
    out->mem_total = st.mem_total;
    out->weight_bytes = st.weight_bytes;
    out->n_ops = st.n_ops < DSV4_ENGINE_MAX_OPS ? st.n_ops : DSV4_ENGINE_MAX_OPS;
    for (int i = 0; i < out->n_ops; i++) {
        out->op[i] = st.op[i];
        out->ms[i] = st.ms[i];
        out->host_ms[i] = st.host_ms[i];
        out->calls[i] = st.calls[i];
    }
    out->weight_bytes_read = st.weight_bytes_read;
    out->graph_launches = st.graph_launches;
    out->graph_updates = st.graph_updates;
    out->graph_inst = st.graph_inst;
    out->side_forks = st.side_forks;
    out->side_forced = st.side_forced;
    out->comb_fused = st.comb_fused;
    out->comb_alone = st.comb_alone;
    out->wait_s = st.wait_s;
    out->graph_gpu_s = st.graph_gpu_s;
    out->issue_s = st.issue_s;
    out->segment_s = st.segment_s;
}

double dsv4_engine_copy_bandwidth(dsv4_engine *e, size_t bytes) {
    return e->be.ops->copy_bandwidth ? e->be.ops->copy_bandwidth(&e->be, bytes) : -1.0;
}

/* host buffers carry a one-word header before the user's bytes saying which allocator
 * made them, so host_free frees them right even if the backend changed its mind (a failed
 * pinned allocation falls back to malloc) */
enum { HOST_HDR = 64 }; /* keeps the user's pointer 64-byte aligned */
void *dsv4_engine_host_alloc(dsv4_engine *e, size_t bytes) {
    const dsv4_backend_ops *op = e->be.ops;
    if (bytes > SIZE_MAX - 2 * HOST_HDR) return NULL;
    /* DSV4_HOST_PAGEABLE=1: malloc even where the backend pins (A/B of the logits download) */
    const char *pg = getenv("DSV4_HOST_PAGEABLE");
    int want_pin = op->host_alloc && !(pg && pg[0] == '1');
    unsigned char *p = want_pin ? op->host_alloc(&e->be, bytes + HOST_HDR) : NULL;
    int pinned = p != NULL;
    if (!p) p = aligned_alloc(HOST_HDR, (bytes + 2 * HOST_HDR - 1) / HOST_HDR * HOST_HDR); /* size: a multiple */
    if (!p) return NULL;
    memset(p, 0, bytes + HOST_HDR);
    p[0] = (unsigned char)pinned;
    return p + HOST_HDR;
}

void dsv4_engine_host_free(dsv4_engine *e, void *q) {
    if (!q) return;
    unsigned char *p = (unsigned char *)q - HOST_HDR;
    if (p[0]) e->be.ops->host_free(&e->be, p);
    else free(p);
}

void dsv4_engine_numerics_string(const dsv4_engine *e, char *buf, size_t n) { dsv4_numerics_format(&e->num, buf, n); }

/* ----- tracing ----- */
static void route_trace(void *user, const dsv4_route_info *ri) {
    dsv4_engine *e = user;
    if (!e->trace) return;
    dsv4_trace_event ev = {
        .seq = ri->tag, .layer = ri->layer, .pos = ri->pos, .token = ri->token, .is_hash = ri->is_hash,
        .n_experts = ri->k, .experts = ri->experts, .weights = ri->weights, .n_picks = ri->n_picks,
        .picks = ri->picks,
    };
    e->trace(&ev, e->trace_user);
}

void dsv4_engine_set_trace(dsv4_engine *e, dsv4_trace_fn fn, void *user) {
    e->trace = fn;
    e->trace_user = user;
    dsv4_model_set_trace(e->model, fn ? route_trace : NULL, e);
}

static void op_trace_fwd(void *user, const dsv4_op_info *oi) {
    dsv4_engine *e = user;
    dsv4_op_event ev = {.op = oi->op, .layer = oi->layer, .rows = oi->rows, .width = oi->width, .f = oi->f,
                        .ids = oi->ids, .n_valid = oi->n_valid, .pos = oi->pos};
    e->op_trace(&ev, e->op_trace_user);
}

void dsv4_engine_set_op_trace(dsv4_engine *e, dsv4_op_trace_fn fn, void *user) {
    e->op_trace = fn;
    e->op_trace_user = user;
    dsv4_model_set_op_trace(e->model, fn ? op_trace_fwd : NULL, e);
}

/* ----- sequences ----- */
int dsv4_seq_new(dsv4_engine *e, dsv4_seq **out, dsv4_err *err) {
    *out = NULL;
    dsv4_seq *s = calloc(1, sizeof *s);
    if (!s) return dsv4_errf(err, "sequence: out of memory");
    if (dsv4_state_new_on(&s->st, &e->cfg, e->snapshot_every, &e->be, err)) {
        free(s);
        return -1;
    }
    s->e = e;
    e->n_seqs++;
    *out = s;
    return 0;
}

void dsv4_seq_free(dsv4_seq *s) {
    if (!s) return;
    s->e->n_seqs--;
    dsv4_state_free(s->st);
    free(s);
}

int64_t dsv4_seq_len(const dsv4_seq *s) { return s->st->len; }
size_t dsv4_seq_state_bytes(const dsv4_seq *s) { return dsv4_state_bytes(s->st); }

int dsv4_seq_append(dsv4_seq *s, const int32_t *tokens, int n, float *logits, int all_logits, dsv4_err *err) {
    if (n < 1) return dsv4_errf(err, "append: no tokens");
    dsv4_fwd_item it = {.st = s->st, .tokens = tokens, .n = n, .logits = logits, .all_logits = all_logits, .tag = s};
    return dsv4_forward(s->e->model, &it, 1, err);
}

int dsv4_engine_step(dsv4_engine *e, dsv4_step_item *items, int n_items, dsv4_err *err) {
    if (n_items <= 0) return 0;
    dsv4_fwd_item stack[16];
    dsv4_fwd_item *fi = n_items <= 16 ? stack : malloc(sizeof *fi * (size_t)n_items);
    if (!fi) return dsv4_errf(err, "step: out of memory");
    int rc = 0;
    for (int i = 0; i < n_items && !rc; i++) {
        if (!items[i].seq || items[i].seq->e != e) rc = dsv4_errf(err, "step: item %d has no sequence of this engine", i);
        else if (items[i].n < 1) rc = dsv4_errf(err, "step: item %d has no tokens", i);
        else
            fi[i] = (dsv4_fwd_item){.st = items[i].seq->st, .tokens = items[i].tokens, .n = items[i].n,
                                    .logits = items[i].logits, .all_logits = 0, .tag = items[i].seq};
    }
    if (!rc) rc = dsv4_forward(e->model, fi, n_items, err);
    if (fi != stack) free(fi);
    return rc;
}

int dsv4_seq_greedy(dsv4_seq *s, int32_t first, int n, int32_t *out, dsv4_err *err) {
    return dsv4_forward_greedy(s->e->model, s->st, first, n, out, err);
}

int dsv4_seq_truncate(dsv4_seq *s, int64_t len, dsv4_err *err) {
    return dsv4_forward_truncate(s->e->model, s->st, len, err);
}

int dsv4_seq_clone(dsv4_seq *src, int64_t len, dsv4_seq **out, dsv4_err *err) {
    *out = NULL;
    if (len < 0 || len > src->st->len)
        return dsv4_errf(err, "clone: length %lld is outside [0, %lld]", (long long)len, (long long)src->st->len);
    dsv4_seq *s = calloc(1, sizeof *s);
    if (!s) return dsv4_errf(err, "clone: out of memory");
    if (dsv4_state_clone(src->st, &s->st, err)) {
        free(s);
        return -1;
    }
    s->e = src->e;
    s->e->n_seqs++;
    if (dsv4_seq_truncate(s, len, err)) {
        dsv4_seq_free(s);
        return -1;
    }
    *out = s;
    return 0;
}

int dsv4_seq_snapshot(const dsv4_seq *s, void **blob, size_t *n, dsv4_err *err) {
    return dsv4_state_serialize(s->st, s->e->tag, blob, n, err);
}

int dsv4_seq_restore(dsv4_seq *s, const void *blob, size_t n, dsv4_err *err) {
    if (!blob) return dsv4_errf(err, "restore: no snapshot");
    return dsv4_state_deserialize(s->st, s->e->tag, blob, n, err);
}

int dsv4_seq_draft(dsv4_seq *s, int32_t next_token, float *logits, dsv4_err *err) {
    if (s->e->cfg.n_mtp < 1) return dsv4_errf(err, "draft: this model has no MTP block");
    return dsv4_forward_mtp(s->e->model, s->st, 0, next_token, logits, err);
}
