/* backend/cuda/backend.cu: the CUDA backend's table, memory, weights and errors.
 *
 * Memory model (see common.cuh): ops->alloc returns device memory (the forward
 * pass's activations); sequence state and index lists are host memory.  Ops use
 * device arguments in place and stage host ones through a pinned arena (emptied only
 * when the stream is idle, so no op waits for the previous op's uploads) and a device
 * scratch arena, all on one stream; only outputs bound for the host wait.  Weights are
 * device-resident: load_weights
 * uploads the whole model once, in stored formats, into one allocation, after
 * checking that it fits (required vs available bytes).  Weights an op meets that
 * were not loaded (op tests) are uploaded on first use.
 * Target: sm_90a.  Threading: one caller at a time, like every backend.
 */
#include <cuda_profiler_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "backend/cuda/common.cuh"

extern "C" {
#include "model/weights.h"
}

/* op implementations (one kernel family per file) */
void cu_embed(dsv4_backend *, float *, const int32_t *, int, const dsv4_weight *);
void cu_argmax(dsv4_backend *, int32_t *, const float *, int, int); /* linear.cu */
void cu_gather_ids(dsv4_backend *, int32_t *, const int32_t *, int, const dsv4_weight *, int);
void cu_matmul_any(dsv4_backend *, float *, const float *, int, const dsv4_weight *, int, int); /* gemm.cu */
void cu_matmul_rn(dsv4_backend *, float *, const float *, int, const dsv4_weight *, int, int, const dsv4_weight *,
                  float, int); /* linear.cu */
int cu_matmul_rn_takes(dsv4_backend *, const dsv4_weight *, int, int);
void cu_op_list_beside(dsv4_backend *, const struct dsv4_op_task *, int); /* oplist.cu */
void cu_matmul_grouped(dsv4_backend *, float *, const float *, int, const dsv4_weight *, int, int, int, int);
void cu_matmul_multi(dsv4_backend *, int, float *const *, const float *, int, const dsv4_weight *const *, const int *,
                     const int *);
void cu_rmsnorm(dsv4_backend *, float *, const float *, int, int, const dsv4_weight *, float, int);
void cu_rope(dsv4_backend *, float *, int, int, int, int, const int64_t *, const double *, int, int);
void cu_scale(dsv4_backend *, float *, size_t, float, int);
void cu_sim(dsv4_backend *, float *, int, int, int, int, int);
void cu_hc_pre(dsv4_backend *, float *, float *, float *, const float *, int, int, int, const dsv4_weight *,
               const dsv4_weight *, const dsv4_weight *, int, float, float, int, int);
void cu_hc_pre_norm(dsv4_backend *, float *, float *, float *, const float *, int, int, int, const dsv4_weight *,
                    const dsv4_weight *, const dsv4_weight *, int, float, float, int, int, const dsv4_weight *, float);
void cu_norm_rope(dsv4_backend *, float *, int, int, int, const dsv4_weight *, float, int, const int64_t *,
                  const double *, int);
void cu_hc_post_pre_norm(dsv4_backend *, float *, const float *, const float *, const float *, const float *, int,
                         float *, float *, float *, int, int, int, const dsv4_weight *, const dsv4_weight *,
                         const dsv4_weight *, int, float, float, int, int, const dsv4_weight *, float);
void cu_hc_post(dsv4_backend *, float *, const float *, const float *, const float *, const float *, int, int, int,
                int);
void cu_hc_head(dsv4_backend *, float *, const float *, int, int, int, const dsv4_weight *, const dsv4_weight *,
                const dsv4_weight *, float, float, int, int);
void cu_sparse_attn(dsv4_backend *, float *, const float *, int, int, int, const float *const *, const int *, int,
                    const float *const *, const int *, const int32_t *, const int *, int, const float *, float, int,
                    int);
void cu_indexer_scores(dsv4_backend *, float *, const float *, const float *, int, int, int, const float *const *,
                       const int *, int, int);
void cu_sparse_attn_rope(dsv4_backend *, float *, const float *, int, int, int, const float *const *, const int *,
                         int, const float *const *, const int *, const int32_t *, const int *, int, const float *,
                         float, int, int, int, const int64_t *, const double *);
void cu_indexer_scores_rs(dsv4_backend *, float *, const float *, const float *, int, int, int, const float *const *,
                          const int *, int, int, int, const int64_t *, const double *, float, int);
void cu_topk(dsv4_backend *, int32_t *, int *, const float *, int, int, const int *, int);
void cu_add_cyclic(dsv4_backend *, float *, const float *, int, int, int, int);
void cu_add_cyclic_pos(dsv4_backend *, float *, const float *, int, int, int, const int64_t *);
void cu_op_list(dsv4_backend *, const dsv4_op_task *, int); /* oplist.cu */
void cu_pool(dsv4_backend *, float *, const float *const *, const float *const *, int, int);
void cu_pool_multi(dsv4_backend *, int, float *const *, const float *const *const *, const float *const *const *,
                   const int *, const int *);
void cu_route(dsv4_backend *, int32_t *, float *, const float *, int, int, int, const float *, const int32_t *,
              float);
void cu_moe(dsv4_backend *, float *, const float *, int, const dsv4_ffn_w *, int, const int32_t *, const float *,
            int, const dsv4_ffn_w *, float, int, int, int, float);
void cu_route_moe(dsv4_backend *, int32_t *, float *, const float *, int, int, int, const float *, const int32_t *,
                  float, float *, const float *, const dsv4_ffn_w *, const dsv4_ffn_w *, float, int, int, int, float);

/* host clock in milliseconds (per-op issue time, capture ends) */
static double host_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

int dsv4_cuda_pdl = 1; /* common.cuh: launches carry the PDL attribute unless DSV4_CUDA_PDL=0 */
int dsv4_cuda_gemv_early = 1; /* common.cuh: k_gemv's weights before its wait unless DSV4_CUDA_GEMV_EARLY=0 */
int dsv4_cuda_l2pf = 1;       /* common.cuh: older activations into L2 before the wait unless DSV4_CUDA_L2PF=0 */
int dsv4_cuda_gm_early = 2;   /* common.cuh: half of k_gemv_multi's blocks ask for weights before their wait */
int dsv4_cuda_hc_stamp = 0;   /* common.cuh: k_hc_dec's phase stamps with DSV4_CUDA_HC_STAMP=1 */

/* ----- errors ----- */
int dsv4_cuda_fail(dsv4_backend *b, const char *expr, const char *file, int line, cudaError_t e) {
    cuda_impl *c = CI(b);
    if (!c->failed) {
        snprintf(c->errmsg, sizeof c->errmsg, "cuda: %s failed at %s:%d: %s", expr, file, line,
                 e == cudaSuccess ? "error" : cudaGetErrorString(e));
        c->failed = 1;
        c->recoverable = e == cudaErrorMemoryAllocation;
    } else if (e != cudaErrorMemoryAllocation) {
        c->recoverable = 0;
    }
    return 1;
}

/* After an allocation that ran out of memory (and nothing worse): the context is intact, so the
 * backend need not stay failed (every later op a no-op, every request an error until a restart).
 * The ops since the failure did nothing; what they left open is closed here: a capture (its graph
 * discarded), a side chain; both streams are drained, the spills freed, and the scratch arenas
 * forget the high-water mark that failed (the next op grows them to what it needs, not to that).
 * The caller of check has the error and undoes the step (forward.c), so nothing half-done is
 * used.  An error while draining (a kernel fault) leaves the backend failed. */
static void cu_recover(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    dsv4_cuda_seg_end(b);
    if (!c->recoverable) return; /* ending a capture found a worse error */
    (void)cudaGetLastError();
    cudaError_t e = cudaStreamSynchronize(c->stream);
    if (e == cudaSuccess && c->side_ok) e = cudaStreamSynchronize(c->side_stream);
    if (e != cudaSuccess) {
        c->recoverable = 0;
        size_t n = strlen(c->errmsg);
        snprintf(c->errmsg + n, sizeof c->errmsg - n, "; then draining the streams: %s", cudaGetErrorString(e));
        return;
    }
    while (c->n_spill > 0) cudaFree(c->spill[--c->n_spill]);
    c->scratch_top = 0;
    c->scratch_floor = 0;
    c->comb_pend.on = 0;
    c->scratch_want = c->scratch_cap;
    c->side_top = 0;
    c->side_want = c->side_cap;
    c->n_gev = 0;
    c->failed = 0;
    c->recoverable = 0;
    c->errmsg[0] = 0;
    c->recovered++;
}

long dsv4_cuda_recovered(dsv4_backend *b) { return CI(b)->recovered; }

/* a runtime error left by a call nobody checked is reported where it is noticed, named */
static int last_error(dsv4_backend *b, const char *where) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return 0;
    return dsv4_cuda_fail(b, where, __FILE__, __LINE__, e);
}

int dsv4_cuda_fail_if(dsv4_backend *b, const char *file, int line) {
    dsv4_cuda_seg_note(b, DSV4_SEG_KERNEL); /* called after every kernel launch */
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return 0;
    return dsv4_cuda_fail(b, "kernel launch", file, line, e);
}

/* One wait: the device flags (index checks of attn.cu and moe.cu) are fetched with whatever
 * else is queued, then checked; with no op since the last check they cannot have changed. */
static int cu_check(dsv4_backend *b, dsv4_err *err) {
    cuda_impl *c = CI(b);
    dsv4_cuda_comb_flush(b);
    int ops = c->ops_since_check > 0, fetched = c->flags_fetched;
    c->ops_since_check = 0;
    c->flags_fetched = 0;
    if (!c->failed && ops) dsv4_cuda_devside_fetch(b);
    if (!c->failed) dsv4_cuda_sync(b);
    if (!c->failed && (ops || fetched)) dsv4_cuda_devside_check(b);
    if (!c->failed) return 0;
    int rc = dsv4_errf(err, "%s", c->errmsg);
    if (c->recoverable) cu_recover(b);
    return rc;
}

/* ----- CUDA graphs for segments -----
 * forward.c marks segment boundaries (ops->segment(key): one key per layer, one for the
 * head).  While graphs are on, every op between two marks is captured from the stream
 * instead of launched; at the next mark the captured graph is matched against the
 * executables cached for that key: same structure (signature over the node count and
 * node types) -> cudaGraphExecUpdate (new arguments, positions, pointers) and launch;
 * otherwise a new executable (the least recently used of DSV4_CUDA_GVARIANTS is
 * replaced: a ratio-4 layer has an emitting and a non-emitting shape).  The host builds
 * segment l+1 while the device runs segment l.  Anything that must wait for the device
 * (a download, a free, a full pinned arena, a check) ends the capture first
 * (dsv4_cuda_sync), so the rest of that segment runs eagerly: results never depend on
 * whether a graph was used.  Kernels, their order and their arguments are the same
 * either way. */
/* The signature of a capture is kept by the host as it is made (cudaGraphGetNodes answered
 * "invalid argument" on the H200 with CUDA 13): each op's id, each kernel launch and each
 * copy, in order.  Two captures with the same signature have the same nodes in the same
 * order; if cudaGraphExecUpdate still refuses one, it is instantiated anew. */
void dsv4_cuda_seg_note(dsv4_backend *b, unsigned what) {
    cuda_impl *c = CI(b);
    if (!c->capturing) return;
    c->seg_sig = (c->seg_sig ^ (what + 1)) * 1099511628211ull;
    if (what < 16) c->seg_nodes++;
}

static int seg_cache(cuda_impl *c, int key) {
    if (key < c->gkeys) return 0;
    int nk = key + 16;
    cuda_impl::gvariant *t = (cuda_impl::gvariant *)realloc(c->gcache, sizeof *t * (size_t)nk * DSV4_CUDA_GVARIANTS);
    if (!t) return -1;
    memset(t + (size_t)c->gkeys * DSV4_CUDA_GVARIANTS, 0, sizeof *t * (size_t)(nk - c->gkeys) * DSV4_CUDA_GVARIANTS);
    c->gcache = t;
    c->gkeys = nk;
    return 0;
}

static void seg_end_timed(dsv4_backend *b);
void dsv4_cuda_seg_end(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    dsv4_cuda_comb_flush(b); /* into the capture it belongs to (and before every wait: sync comes here) */
    dsv4_cuda_side_close(b); /* a capture must end joined */
    if (!c->capturing) return;
    double t0 = host_ms();
    seg_end_timed(b);
    c->segment_s += (host_ms() - t0) * 1e-3;
}

static void seg_end_timed(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    c->capturing = 0;
    if (last_error(b, "an unchecked call inside a graph capture")) { /* still end the capture */
        cudaGraph_t g0 = NULL;
        cudaStreamEndCapture(c->stream, &g0);
        if (g0) cudaGraphDestroy(g0);
        cudaGetLastError();
        return;
    }
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (e != cudaSuccess || !g) {
        if (g) cudaGraphDestroy(g);
        dsv4_cuda_fail(b, "cudaStreamEndCapture", __FILE__, __LINE__, e);
        return;
    }
    if (c->failed) { /* an op failed while capturing: nothing of this segment runs */
        cudaGraphDestroy(g);
        return;
    }
    uint64_t sig = c->seg_sig;
    if (c->seg_nodes == 0) {
        cudaGraphDestroy(g);
        return;
    }
    if (seg_cache(c, c->seg_key)) {
        cudaGraphDestroy(g);
        dsv4_cuda_fail(b, "graph cache: out of host memory", __FILE__, __LINE__, cudaSuccess);
        return;
    }
    cuda_impl::gvariant *v = c->gcache + (size_t)c->seg_key * DSV4_CUDA_GVARIANTS, *use = NULL, *lru = v;
    for (int i = 0; i < DSV4_CUDA_GVARIANTS; i++) {
        if (v[i].exec && v[i].sig == sig && !use) use = &v[i];
        if (v[i].used < lru->used) lru = &v[i];
    }
    int refused = -1;
    if (use) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(use->exec, g, &info) == cudaSuccess) {
            c->g_update++;
        } else {
            refused = (int)info.result;
            cudaGetLastError(); /* a refused update is not an error: instantiate instead */
            cudaGraphExecDestroy(use->exec);
            use->exec = NULL;
            lru = use;
            use = NULL;
        }
    }
    if (!use) {
        if (lru->exec) cudaGraphExecDestroy(lru->exec);
        lru->exec = NULL;
        /* node priorities as captured (the side chain's stream has the highest: its kernels take
         * SM slots first as the main chain's blocks retire) */
        if (CK(b, cudaGraphInstantiate(&lru->exec, g, cudaGraphInstantiateFlagUseNodePriority))) {
            lru->exec = NULL;
            cudaGraphDestroy(g);
            return;
        }
        lru->sig = sig;
        use = lru;
        c->g_inst++;
        if (c->graph_log && refused >= 0) /* DSV4_CUDA_GRAPH_LOG=1: why a segment needed a new executable */
            fprintf(stderr, "cuda graph: segment %d: new executable (%ld nodes, signature %016llx): the cached one "
                    "refused the update (cudaGraphExecUpdateResult %d)\n", c->seg_key, c->seg_nodes,
                    (unsigned long long)sig, refused);
        else if (c->graph_log)
            fprintf(stderr, "cuda graph: segment %d: new executable (%ld nodes, signature %016llx): no cached one "
                    "of this signature\n", c->seg_key, c->seg_nodes, (unsigned long long)sig);
    }
    use->used = ++c->gclock;
    cudaGraphDestroy(g);
    int ev = c->n_gev < 64 && c->gev[0][0];
    if (ev && CK(b, cudaEventRecord(c->gev[0][c->n_gev], c->stream))) return;
    if (CK(b, cudaGraphLaunch(use->exec, c->stream))) return;
    c->g_launch++;
    if (ev && !CK(b, cudaEventRecord(c->gev[1][c->n_gev], c->stream))) c->n_gev++;
}

int dsv4_cuda_sync(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    dsv4_cuda_seg_end(b); /* which closes a side chain first: the main stream then follows it */
    if (c->failed) return -1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    cudaError_t e = cudaStreamSynchronize(c->stream);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    c->wait_s += (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (e != cudaSuccess) return dsv4_cuda_fail(b, "cudaStreamSynchronize(c->stream)", __FILE__, __LINE__, e), -1;
    for (int i = 0; i < c->n_gev; i++) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, c->gev[0][i], c->gev[1][i]) == cudaSuccess) c->graph_gpu_s += ms * 1e-3;
    }
    c->n_gev = 0;
    dsv4_cuda_idle(b);
    return 0;
}

/* ops->segment: ends the segment in progress (launching it) and, with key >= 0, starts
 * capturing the next one */
static void cu_segment(dsv4_backend *b, int key) {
    cuda_impl *c = CI(b);
    dsv4_cuda_seg_end(b);
    if (key < 0 || !c->graphs || c->timing || c->failed) return;
    dsv4_cuda_flush(b);
    if (last_error(b, "an unchecked call before a graph capture")) return;
    if (CK(b, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed))) return;
    c->capturing = 1;
    c->seg_sig = 1469598103934665603ull;
    c->seg_nodes = 0;
    c->seg_key = key;
}

static void graphs_free(cuda_impl *c) {
    for (size_t i = 0; i < (size_t)c->gkeys * DSV4_CUDA_GVARIANTS; i++)
        if (c->gcache[i].exec) cudaGraphExecDestroy(c->gcache[i].exec);
    free(c->gcache);
    c->gcache = NULL;
    c->gkeys = 0;
}

/* ----- scratch ----- */
/* A bump arena; what does not fit is a separate allocation ("spill") freed at the
 * next op, and the arena grows to the high-water mark at that empty point, so after
 * warm-up no op allocates. */
void dsv4_cuda_scratch_reset(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    /* a taken combine's inputs stay (dsv4_cuda_comb_take: only when nothing below makes the arena
     * move), for this one reset */
    c->scratch_top = c->scratch_floor;
    c->scratch_floor = 0;
    /* the side's arena grows only at a fork (cu_side: side_grow), where waiting is allowed; here
     * a spill or the main arena's growth waits, which closes the side chain and brings the main
     * arena back */
    if (c->n_spill || (c->side_state != 1 && c->scratch_want > c->scratch_cap)) dsv4_cuda_sync(b);
    while (c->n_spill > 0) cudaFree(c->spill[--c->n_spill]);
    if (c->scratch_want > c->scratch_cap && !c->failed) {
        size_t cap = c->scratch_want + c->scratch_want / 4 + (1 << 20);
        if (c->scratch) cudaFree(c->scratch);
        c->scratch = NULL;
        c->scratch_cap = 0;
        if (CK(b, cudaMalloc((void **)&c->scratch, cap))) return;
        c->scratch_cap = cap;
    }
}

void *dsv4_cuda_scratch(dsv4_backend *b, size_t bytes) {
    cuda_impl *c = CI(b);
    if (c->failed) return NULL;
    bytes = (bytes + 255) & ~(size_t)255;
    if (c->side_state == 1 && c->scratch_top + bytes > c->scratch_cap) {
        /* the side's arena is full: note its size for the next fork, then run the rest of the
         * chain in order on the main stream, from the main arena (what this op took from the
         * side's stays valid) */
        if (c->scratch_top + bytes > c->scratch_want) c->scratch_want = c->scratch_top + bytes;
        dsv4_cuda_side_close(b);
    }
    if (c->scratch_top + bytes > c->scratch_want) c->scratch_want = c->scratch_top + bytes;
    if (c->scratch_top + bytes <= c->scratch_cap) {
        void *p = c->scratch + c->scratch_top;
        c->scratch_top += bytes;
        return p;
    }
    c->scratch_top += bytes;
    if (c->n_spill >= (int)(sizeof c->spill / sizeof c->spill[0])) {
        dsv4_cuda_fail(b, "more than 64 scratch buffers in one op (internal)", __FILE__, __LINE__, cudaSuccess);
        return NULL;
    }
    void *p = NULL;
    dsv4_cuda_seg_end(b); /* allocations are made outside a graph capture */
    if (CK(b, cudaMalloc(&p, bytes))) return NULL;
    c->spill[c->n_spill++] = p;
    return p;
}

void *dsv4_cuda_hbuf(dsv4_backend *b, size_t bytes) {
    cuda_impl *c = CI(b);
    /* copies queued by an earlier op may still read it: a slow path, so wait */
    if (dsv4_cuda_sync(b)) return NULL;
    if (bytes <= c->hbuf_cap) return c->hbuf;
    if (c->hbuf) cudaFreeHost(c->hbuf);
    c->hbuf = NULL;
    c->hbuf_cap = 0;
    size_t cap = bytes + bytes / 2;
    if (CK(b, cudaMallocHost((void **)&c->hbuf, cap))) return NULL;
    c->hbuf_cap = cap;
    return c->hbuf;
}

/* The pinned arena is a bump allocator emptied only when the stream is known to be
 * idle (after a synchronisation the engine makes anyway: a download, ops->check at the
 * end of a sub-batch, a fetched output), so an upload's pinned source stays untouched
 * until its copy has run without any op waiting for the previous one.  When it is full,
 * one synchronisation empties it, and it grows (doubling) at that point.
 * NULL = no room could be made (the caller takes the pageable path). */
static uint8_t *pin_take(dsv4_backend *b, size_t bytes) {
    cuda_impl *c = CI(b);
    bytes = (bytes + 63) & ~(size_t)63;
    if (c->pin_top + bytes > c->pin_cap) {
        if (c->failed || dsv4_cuda_sync(b)) return NULL;
        if (bytes > c->pin_cap) {
            size_t cap = c->pin_cap ? 2 * c->pin_cap : (size_t)8 << 20;
            while (cap < bytes) cap *= 2;
            if (c->pin) cudaFreeHost(c->pin);
            c->pin = NULL;
            c->pin_cap = 0;
            if (CK(b, cudaMallocHost((void **)&c->pin, cap))) return NULL;
            c->pin_cap = cap;
        }
    }
    uint8_t *p = c->pin + c->pin_top;
    c->pin_top += bytes;
    return p;
}

void dsv4_cuda_idle(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    if (!c->failed)
        for (int i = 0; i < c->n_pend; i++) memcpy(c->pend[i].dst, c->pend[i].src, c->pend[i].n);
    c->n_pend = 0;
    c->pin_top = 0;
}

void *dsv4_cuda_stage(dsv4_backend *b, const void *host, size_t bytes) {
    cuda_impl *c = CI(b);
    void *d = dsv4_cuda_scratch(b, bytes ? bytes : 1);
    if (!d || !bytes) return d;
    uint8_t *p = (host >= (const void *)c->hbuf && host < (const void *)(c->hbuf + c->hbuf_cap)) ? NULL
                                                                                                : pin_take(b, bytes);
    if (p) {
        memcpy(p, host, bytes);
        dsv4_cuda_seg_note(b, DSV4_SEG_COPY);
        if (CK(b, cudaMemcpyAsync(d, p, bytes, cudaMemcpyHostToDevice, c->stream))) return NULL;
    } else if (CK(b, cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, c->stream))) {
        return NULL;
    }
    return d;
}

int dsv4_cuda_is_dev(dsv4_backend *b, const void *p) {
    cuda_impl *c = CI(b);
    uintptr_t q = (uintptr_t)p;
    int lo = 0, hi = c->n_dev; /* first range with base > q is at lo */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (c->dev[mid].base <= q) lo = mid + 1;
        else hi = mid;
    }
    return lo > 0 && q - c->dev[lo - 1].base < c->dev[lo - 1].size;
}

void *dsv4_cuda_in(dsv4_backend *b, const void *p, size_t bytes) {
    if (dsv4_cuda_is_dev(b, p)) return (void *)p;
    return dsv4_cuda_stage(b, p, bytes);
}

void *dsv4_cuda_out(dsv4_backend *b, void *p, size_t bytes) {
    if (dsv4_cuda_is_dev(b, p)) return p;
    return dsv4_cuda_scratch(b, bytes ? bytes : 1);
}

void dsv4_cuda_commit(dsv4_backend *b, void *p, const void *d, size_t bytes) {
    if (p != d) dsv4_cuda_fetch(b, p, d, bytes);
}

/* Outputs: queued into the pinned arena and copied out by dsv4_cuda_flush (op end).
 * The host buffer is valid only after the op returns. */
void dsv4_cuda_fetch(dsv4_backend *b, void *host, const void *dev, size_t bytes) {
    cuda_impl *c = CI(b);
    if (c->failed || !bytes) return;
    if (c->n_pend == 32) dsv4_cuda_flush(b);
    uint8_t *p = pin_take(b, bytes);
    if (p) {
        dsv4_cuda_seg_note(b, DSV4_SEG_COPY);
        if (CK(b, cudaMemcpyAsync(p, dev, bytes, cudaMemcpyDeviceToHost, c->stream))) return;
        c->pend[c->n_pend].dst = host;
        c->pend[c->n_pend].src = p;
        c->pend[c->n_pend].n = bytes;
        c->n_pend++;
        return;
    }
    if (CK(b, cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, c->stream))) return;
    dsv4_cuda_sync(b);
}

void dsv4_cuda_flush(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    if (!c->n_pend) return;
    dsv4_cuda_sync(b);
    c->n_pend = 0;
}

/* ----- timing ----- */
void dsv4_cuda_op_begin(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    dsv4_cuda_comb_flush(b); /* a pending combine runs before any op but the one that takes it */
    c->op_t0 = host_ms();
    c->ops_since_check++; /* at the start: an op that returns early may still have launched */
    c->op_seq++;
    if (!c->failed) last_error(b, c->capturing ? "an unchecked call (capturing), before this op" : "an unchecked call, before this op");
    dsv4_cuda_flush(b); /* an op that returned early may have left outputs queued */
    dsv4_cuda_scratch_reset(b);
    if (c->timing && !c->failed) CK(b, cudaEventRecord(c->ev0, c->stream));
}

void dsv4_cuda_op_end(dsv4_backend *b, int op) {
    cuda_impl *c = CI(b);
    dsv4_cuda_seg_note(b, 16 + (unsigned)op);
    double dt = host_ms() - c->op_t0;
    c->issue_s += dt * 1e-3;
    dsv4_cuda_flush(b);
    if (!c->timing || c->failed) return;
    c->op_host_ms[op] += dt;
    CK(b, cudaEventRecord(c->ev1, c->stream));
    CK(b, cudaEventSynchronize(c->ev1));
    float ms = 0;
    cudaEventElapsedTime(&ms, c->ev0, c->ev1);
    c->op_ms[op] += ms;
    c->op_calls[op]++;
}

static const char *OP_NAMES[DSV4_CUDA_N_OPS] = {
    "embed", "matmul", "matmul_grouped", "rmsnorm", "rope",  "scale", "sim",   "hc_pre",
    "hc_post", "hc_head", "sparse_attn", "indexer_scores", "topk", "pool", "route", "moe", "add_cyclic", "matmul_multi",
    "op_list", "route_moe", "argmax", "gather_ids"};

static void cu_profile(dsv4_backend *b, int on) {
    cuda_impl *c = CI(b);
    dsv4_cuda_sync(b);
    /* also brackets the profiled steps for Nsight Systems (--capture-range=cudaProfilerApi) */
    if (on && !c->timing) cudaProfilerStart();
    if (!on && c->timing) cudaProfilerStop();
    c->timing = on;
    memset(c->op_ms, 0, sizeof c->op_ms);
    memset(c->op_calls, 0, sizeof c->op_calls);
    memset(c->op_host_ms, 0, sizeof c->op_host_ms);
    c->weight_bytes_read = 0;
    dsv4_cuda_devside_weight_bytes(b, 1); /* moe's device counter too */
}

static void cu_stats(dsv4_backend *b, dsv4_backend_stats *out) {
    cuda_impl *c = CI(b);
    memset(out, 0, sizeof *out);
    cudaDeviceProp p;
    /* the build's L2 hint flags (Makefile CUDA_EVF, CUDA_EVF_CP; common.cuh) in the device line of bench and
     * the like: two builds' figures are told apart by it */
    if (cudaGetDeviceProperties(&p, c->device) == cudaSuccess)
        snprintf(out->device, sizeof out->device, "%.60s (sm_%d%d, %d SMs, %.0f GiB; build CUDA_EVF=%d CUDA_EVF_CP=%d)",
                 p.name, p.major, p.minor, p.multiProcessorCount, (double)p.totalGlobalMem / (1 << 30), DSV4_CUDA_EVF,
                 DSV4_CUDA_EVF_CP);
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) {
        out->mem_used = tot - fr;
        out->mem_total = tot;
    }
    out->weight_bytes = c->pool_used;
    out->n_ops = DSV4_CUDA_N_OPS;
    for (int i = 0; i < DSV4_CUDA_N_OPS; i++) {
        out->op[i] = OP_NAMES[i];
        out->ms[i] = c->op_ms[i];
        out->host_ms[i] = c->op_host_ms[i];
        out->calls[i] = c->op_calls[i];
    }
    out->weight_bytes_read = (double)c->weight_bytes_read + dsv4_cuda_devside_weight_bytes(b, 0);
    out->graph_launches = c->g_launch;
    out->graph_updates = c->g_update;
    out->graph_inst = c->g_inst;
    out->side_forks = c->side_forks;
    out->side_forced = c->side_forced;
    out->comb_fused = c->hc_comb_taken;
    out->comb_alone = c->hc_comb_flushed;
    out->wait_s = c->wait_s;
    out->graph_gpu_s = c->graph_gpu_s;
    out->issue_s = c->issue_s;
    out->segment_s = c->segment_s;
}

static double cu_copy_bandwidth(dsv4_backend *b, size_t bytes) {
    cuda_impl *c = CI(b);
    if (dsv4_cuda_sync(b)) return -1;
    void *x = NULL, *y = NULL;
    if (CK(b, cudaMalloc(&x, bytes))) return -1;
    if (CK(b, cudaMalloc(&y, bytes))) {
        cudaFree(x);
        return -1;
    }
    double best = -1;
    CK(b, cudaMemsetAsync(x, 1, bytes, c->stream));
    for (int i = 0; i < 12 && !c->failed; i++) {
        CK(b, cudaEventRecord(c->ev0, c->stream));
        CK(b, cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice, c->stream));
        CK(b, cudaEventRecord(c->ev1, c->stream));
        CK(b, cudaEventSynchronize(c->ev1));
        float ms = 0;
        cudaEventElapsedTime(&ms, c->ev0, c->ev1);
        double gbs = 2.0 * (double)bytes / (ms * 1e-3) / 1e9;
        if (i >= 2 && gbs > best) best = gbs; /* first two are warm-up */
    }
    cudaFree(x);
    cudaFree(y);
    return c->failed ? -1 : best;
}

/* ----- weights ----- */
static size_t ptr_hash(const void *p, size_t cap) {
    uint64_t v = (uint64_t)(uintptr_t)p;
    v ^= v >> 33;
    v *= 0xff51afd7ed558ccdull;
    v ^= v >> 33;
    return (size_t)(v & (cap - 1));
}

static wentry *map_find(cuda_impl *c, const void *key) {
    if (!c->map_cap) return NULL;
    for (size_t i = ptr_hash(key, c->map_cap);; i = (i + 1) & (c->map_cap - 1)) {
        if (c->map[i].key == key) return &c->map[i];
        if (!c->map[i].key) return NULL;
    }
}

static int map_insert(cuda_impl *c, const void *key, uint8_t *data, uint8_t *scale) {
    if ((c->map_n + 1) * 2 > c->map_cap) {
        size_t cap = c->map_cap ? c->map_cap * 2 : 1024;
        wentry *m = (wentry *)calloc(cap, sizeof *m);
        if (!m) return -1;
        for (size_t i = 0; i < c->map_cap; i++)
            if (c->map[i].key) {
                size_t j = ptr_hash(c->map[i].key, cap);
                while (m[j].key) j = (j + 1) & (cap - 1);
                m[j] = c->map[i];
            }
        free(c->map);
        c->map = m;
        c->map_cap = cap;
    }
    size_t j = ptr_hash(key, c->map_cap);
    while (c->map[j].key) j = (j + 1) & (c->map_cap - 1);
    c->map[j] = wentry{key, data, scale, 0};
    c->map_n++;
    return 0;
}

static size_t data_bytes(const dsv4_weight *w) {
    int64_t n = w->rows * w->cols;
    switch (w->fmt) {
    case DSV4_WF_F32: case DSV4_WF_I32: return (size_t)n * 4;
    case DSV4_WF_I64: return (size_t)n * 8;
    case DSV4_WF_BF16: return (size_t)n * 2;
    case DSV4_WF_FP8: return (size_t)n;
    case DSV4_WF_MXFP4: case DSV4_WF_NVFP4: return (size_t)(w->rows * ((w->cols + 1) / 2));
    default: return 0;
    }
}

static size_t scale_bytes(const dsv4_weight *w) {
    switch (w->fmt) {
    case DSV4_WF_FP8: {
        int64_t n = ((w->rows + w->block - 1) / w->block) * ((w->cols + w->block - 1) / w->block);
        return (size_t)n * (w->scale_f32 ? 4 : 1);
    }
    case DSV4_WF_MXFP4: return (size_t)(w->rows * ((w->cols + 31) / 32));
    case DSV4_WF_NVFP4: return (size_t)(w->rows * ((w->cols + 15) / 16));
    default: return 0;
    }
}

static size_t al256(size_t n) { return (n + 255) & ~(size_t)255; }

/* uploads w into dst (pool space) or a fresh allocation; records it in the map */
static int upload_weight(dsv4_backend *b, const dsv4_weight *w) {
    cuda_impl *c = CI(b);
    if (w->fmt == DSV4_WF_NONE || !w->data || map_find(c, w->data)) return 0;
    dsv4_cuda_seg_end(b);
    size_t db = data_bytes(w), sb = scale_bytes(w), need = al256(db) + al256(sb);
    uint8_t *base = NULL;
    if (c->pool && c->pool_used + need <= c->pool_bytes) {
        base = c->pool + c->pool_used;
        c->pool_used += need;
    } else if (CK(b, cudaMalloc((void **)&base, need ? need : 1))) {
        return -1;
    }
    /* On c->stream, not the legacy default stream: a cudaMemcpy from pageable memory may
     * return before its last DMA chunk lands, and c->stream (non-blocking) does not wait for
     * the legacy stream, so a kernel could read the tail of a fresh weight before it arrived
     * (seen on the H200: test_matmul read zeros for the last ~90 KB of a 1 MB weight, 1 run
     * in 5).  cudaMemcpyAsync stages pageable memory before it returns, so the host buffer may
     * change afterwards; stream order makes every later op see the bytes. */
    if (db && CK(b, cudaMemcpyAsync(base, w->data, db, cudaMemcpyHostToDevice, c->stream))) return -1;
    uint8_t *sc = NULL;
    if (sb) {
        sc = base + al256(db);
        if (CK(b, cudaMemcpyAsync(sc, w->scale, sb, cudaMemcpyHostToDevice, c->stream))) return -1;
    }
    if (map_insert(c, w->data, base, sc)) return dsv4_cuda_fail(b, "weight map: out of host memory", __FILE__,
                                                                __LINE__, cudaSuccess), -1;
    /* FP8 with e8m0 scales: is every code in [3, 246]?  Then each weight value times its scale
     * (an e4m3 value has <= 4 significant bits, its smallest bit 2^-9, its magnitude <= 448 < 2^9)
     * has its last bit at or above 2^-133 and stays below 2^128 (finite), so it is exact in bf16:
     * rounding it to bf16 (w_bf16, the reference's bf16 dequantization) changes nothing, and the
     * GEMVs may factor the scale out as at w_bf16 0.  Codes 247..254 can overflow (448 * 2^120),
     * 0..2 can fall below bf16's subnormals, 255 is NaN: those weights keep the per-weight path */
    if (w->fmt == DSV4_WF_FP8 && !w->scale_f32 && w->scale && sb) {
        int ok = 1;
        const uint8_t *s8 = (const uint8_t *)w->scale;
        for (size_t i = 0; i < sb && ok; i++) ok = s8[i] >= 3 && s8[i] <= 246;
        map_find(c, w->data)->e8_bf16 = ok;
    }
    return 0;
}

int dsv4_cuda_weight(dsv4_backend *b, const dsv4_weight *w, dweight *out) {
    cuda_impl *c = CI(b);
    memset(out, 0, sizeof *out);
    if (c->failed) return -1;
    wentry *e = map_find(c, w->data);
    if (!e) {
        if (upload_weight(b, w)) return -1;
        e = map_find(c, w->data);
        if (!e) return -1;
    }
    out->fmt = w->fmt;
    out->rows = w->rows;
    out->cols = w->cols;
    out->data = e->data;
    out->scale = e->scale;
    out->scale_f32 = w->scale_f32;
    out->block = w->block > 0 ? w->block : 128;
    out->scale2 = w->scale2;
    out->e8_bf16 = e->e8_bf16;
    return 0;
}

/* visits every weight of the model */
typedef int (*wvisit)(dsv4_backend *b, const dsv4_weight *w, void *user);
static int visit_ffn(dsv4_backend *b, const dsv4_ffn_w *f, wvisit fn, void *u) {
    return fn(b, &f->w1, u) || fn(b, &f->w2, u) || fn(b, &f->w3, u);
}
static int visit_comp(dsv4_backend *b, const dsv4_compressor_w *cw, wvisit fn, void *u) {
    return fn(b, &cw->wkv, u) || fn(b, &cw->wgate, u) || fn(b, &cw->ape, u) || fn(b, &cw->norm, u);
}
static int visit_all(dsv4_backend *b, const dsv4_model_w *m, wvisit fn, void *u) {
    const dsv4_weight *g[] = {&m->embed, &m->head, &m->norm, &m->hc_head_fn, &m->hc_head_base, &m->hc_head_scale};
    for (size_t i = 0; i < sizeof g / sizeof g[0]; i++)
        if (fn(b, g[i], u)) return -1;
    for (int l = 0; l < m->n_layers; l++) {
        const dsv4_layer_w *L = &m->layers[l];
        const dsv4_weight *ws[] = {&L->attn_norm, &L->ffn_norm, &L->hc_attn_fn, &L->hc_attn_base, &L->hc_attn_scale,
                                   &L->hc_ffn_fn, &L->hc_ffn_base, &L->hc_ffn_scale, &L->wq_a, &L->q_norm,
                                   &L->wq_b, &L->wkv, &L->kv_norm, &L->wo_a, &L->wo_b, &L->attn_sink, &L->gate,
                                   &L->gate_bias, &L->e_proj, &L->h_proj, &L->enorm, &L->hnorm, &L->norm,
                                   &L->hc_head_fn, &L->hc_head_base, &L->hc_head_scale};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            if (fn(b, ws[i], u)) return -1;
        if (L->has_comp && visit_comp(b, &L->comp, fn, u)) return -1;
        if (L->has_indexer && (fn(b, &L->idx.wq_b, u) || fn(b, &L->idx.weights_proj, u) ||
                               visit_comp(b, &L->idx.comp, fn, u)))
            return -1;
        if (L->experts)
            for (int e = 0; e < m->cfg.n_routed; e++)
                if (visit_ffn(b, &L->experts[e], fn, u)) return -1;
        if (m->cfg.n_shared > 0 && visit_ffn(b, &L->shared, fn, u)) return -1;
    }
    return 0;
}

static int count_bytes(dsv4_backend *b, const dsv4_weight *w, void *user) {
    (void)b;
    if (w->fmt != DSV4_WF_NONE && w->data) *(size_t *)user += al256(data_bytes(w)) + al256(scale_bytes(w));
    return 0;
}

typedef struct {
    size_t done, total, next_report;
    double t0;
} upload_progress;

static int upload_one(dsv4_backend *b, const dsv4_weight *w, void *user) {
    upload_progress *p = (upload_progress *)user;
    if (upload_weight(b, w)) return -1;
    size_t n = w->fmt != DSV4_WF_NONE && w->data ? al256(data_bytes(w)) + al256(scale_bytes(w)) : 0;
    p->done += n;
    if (p->done >= p->next_report || p->done == p->total) {
        fprintf(stderr, "\rcuda: uploading weights %.2f / %.2f GB", p->done / 1e9, p->total / 1e9);
        p->next_report = p->done + p->total / 50 + 1;
    }
    return 0;
}

static int cu_load_weights(dsv4_backend *b, const dsv4_model_w *m, dsv4_err *err) {
    cuda_impl *c = CI(b);
    dsv4_cuda_seg_end(b);
    size_t total = 0;
    visit_all(b, m, count_bytes, &total);
    size_t fr = 0, tot = 0;
    if (CK(b, cudaMemGetInfo(&fr, &tot))) return cu_check(b, err);
    size_t reserve = (size_t)2 << 30; /* activations, scratch, sequence state */
    if (total + reserve > fr)
        return dsv4_errf(err,
                         "cuda: the model needs %.2f GB of GPU memory for its weights (+%.1f GB working space), "
                         "the device has %.2f GB free of %.2f GB",
                         total / 1e9, reserve / 1e9, fr / 1e9, tot / 1e9);
    if (CK(b, cudaMalloc((void **)&c->pool, total ? total : 1))) return cu_check(b, err);
    c->pool_bytes = total;
    c->pool_used = 0;
    upload_progress p = {0, total, 0, 0};
    int rc = visit_all(b, m, upload_one, &p);
    fprintf(stderr, "\n");
    if (rc || c->failed) return cu_check(b, err) ? -1 : dsv4_errf(err, "cuda: weight upload failed");
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess)
        fprintf(stderr, "cuda: %.2f GB of weights on the GPU; %.2f GB used of %.2f GB\n", c->pool_used / 1e9,
                (tot - fr) / 1e9, tot / 1e9);
    return 0;
}

/* ----- memory: ops->alloc gives device memory (the forward pass's activations) ----- */
static void *cu_alloc(dsv4_backend *b, size_t bytes) {
    cuda_impl *c = CI(b);
    dsv4_cuda_seg_end(b);
    if (c->n_dev == c->dev_cap) {
        int cap = c->dev_cap ? 2 * c->dev_cap : 256;
        cuda_impl::dev_range *t = (cuda_impl::dev_range *)realloc(c->dev, sizeof *t * (size_t)cap);
        if (!t) return NULL;
        c->dev = t;
        c->dev_cap = cap;
    }
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError(); /* an allocation failure is reported by the caller, not sticky */
        return NULL;
    }
    /* zeroed on c->stream: the legacy stream's cudaMemset is not ordered with it */
    if (cudaMemsetAsync(p, 0, bytes ? bytes : 1, c->stream) != cudaSuccess) {
        cudaGetLastError();
        cudaFree(p);
        return NULL;
    }
    int at = c->n_dev;
    while (at > 0 && c->dev[at - 1].base > (uintptr_t)p) at--;
    memmove(c->dev + at + 1, c->dev + at, sizeof *c->dev * (size_t)(c->n_dev - at));
    c->dev[at].base = (uintptr_t)p;
    c->dev[at].size = bytes ? bytes : 1;
    c->n_dev++;
    return p;
}
static void cu_free(dsv4_backend *b, void *p) {
    cuda_impl *c = CI(b);
    dsv4_cuda_comb_flush(b);
    for (int i = 0; i < c->n_dev; i++)
        if (c->dev[i].base == (uintptr_t)p) {
            dsv4_cuda_sync(b);
            cudaFree(p);
            memmove(c->dev + i, c->dev + i + 1, sizeof *c->dev * (size_t)(c->n_dev - i - 1));
            c->n_dev--;
            return;
        }
    free(p);
}
/* upload, download and copy: either side may be host or device (unified addressing);
 * a copy that lands in host memory waits for it */
static void cu_copy(dsv4_backend *b, void *dst, const void *src, size_t bytes) {
    cuda_impl *c = CI(b);
    dsv4_cuda_comb_flush(b); /* the copy may read the pending combine's out */
    if (!bytes || c->failed) return;
    int dd = dsv4_cuda_is_dev(b, dst), sd = dsv4_cuda_is_dev(b, src);
    if (!dd && !sd) {
        memmove(dst, src, bytes);
        return;
    }
    if (!dd || !sd) dsv4_cuda_seg_end(b); /* host memory may be pageable: not capturable */
    dsv4_cuda_seg_note(b, DSV4_SEG_COPY);
    if (CK(b, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream))) return;
    if (dd) return;
    /* a download waits for the device; the device flags come back in the same wait, so the
     * ops->check that follows the logits' download (forward.c) needs no second round trip
     * (a 4-byte copy the device started only after the host had seen the logits) */
    if (c->ops_since_check > 0 && c->devside) {
        dsv4_cuda_devside_fetch(b);
        c->ops_since_check = 0;
        c->flags_fetched = 1;
    }
    dsv4_cuda_sync(b);
}

/* copy_list: up to CL_MAX device-to-device copies a launch, grid.y = the entry (16-byte words
 * where both ends and the size allow, else bytes); entries with a host end go through cu_copy.
 * The list's ranges do not overlap (backend.h), so their order does not matter. */
#define CL_MAX 96
struct cl_table {
    uint8_t *dst[CL_MAX];
    const uint8_t *src[CL_MAX];
    uint32_t bytes[CL_MAX];
};
__global__ void k_copy_list(const cl_table t) {
    pdl_enter();
    uint8_t *d = t.dst[blockIdx.y];
    const uint8_t *s = t.src[blockIdx.y];
    size_t nb = t.bytes[blockIdx.y], i = (size_t)blockIdx.x * blockDim.x + threadIdx.x,
           stride = (size_t)gridDim.x * blockDim.x;
    if (((uintptr_t)d | (uintptr_t)s | nb) % 16 == 0)
        for (size_t v = i; v < nb / 16; v += stride) ((uint4 *)d)[v] = ((const uint4 *)s)[v];
    else
        for (size_t v = i; v < nb; v += stride) d[v] = s[v];
}
static void cl_launch(dsv4_backend *b, const cl_table &t, int k, size_t most) {
    size_t blocks = (most / 16 + 255) / 256;
    if (blocks < 1) blocks = 1;
    if (blocks > 16) blocks = 16;
    dsv4_launch(k_copy_list, dim3((unsigned)blocks, (unsigned)k), 256, 0, CI(b)->stream, t);
    CKL(b);
}
static void cu_copy_list(dsv4_backend *b, int n, void *const *dst, const void *const *src, const size_t *bytes) {
    cuda_impl *c = CI(b);
    dsv4_cuda_comb_flush(b);
    cl_table t;
    int k = 0;
    size_t most = 0;
    for (int i = 0; i < n && !c->failed; i++) {
        if (!bytes[i]) continue;
        if (bytes[i] > 0xffffffffu || !dsv4_cuda_is_dev(b, dst[i]) || !dsv4_cuda_is_dev(b, src[i])) {
            cu_copy(b, dst[i], src[i], bytes[i]);
            continue;
        }
        t.dst[k] = (uint8_t *)dst[i], t.src[k] = (const uint8_t *)src[i], t.bytes[k] = (uint32_t)bytes[i];
        if (bytes[i] > most) most = bytes[i];
        if (++k == CL_MAX) cl_launch(b, t, k, most), k = 0, most = 0;
    }
    if (k && !c->failed) cl_launch(b, t, k, most);
}

/* host_alloc / host_free: page-locked host memory (logits rows: one DMA per download, no
 * staging copy by the driver on the host) */
static void *cu_host_alloc(dsv4_backend *b, size_t bytes) {
    (void)b;
    void *p = NULL;
    if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError(); /* a failed pinned allocation is not sticky: the caller mallocs */
        return NULL;
    }
    return p;
}
static void cu_host_free(dsv4_backend *b, void *p) {
    (void)b;
    if (p) cudaFreeHost(p);
}

/* ----- the side chain (ops->side, ops->join) -----
 * side(b, 1) records an event on the main stream, makes the side stream (created at init with
 * the device's highest priority) wait for it, and points c->stream and the scratch fields at
 * the side's; side(b, 0) points them back, the side stream running on; join records an event
 * on the side stream for the main stream to wait on.  In a capture the events become graph
 * edges (two branches, instantiated with their node priorities).  Whatever must wait for the
 * device (dsv4_cuda_sync, the end of a capture, a spill) closes the chain first, so the ops
 * after it run in order on the main stream: slower, never different.  With per-op timing
 * (profile) or without the stream, side chains run in order.  Each op draws its scratch from
 * the arena of the stream it runs on: the two chains never share a buffer. */
static void side_swap(cuda_impl *c) {
    uint8_t *p = c->scratch;
    size_t cap = c->scratch_cap, top = c->scratch_top, want = c->scratch_want;
    c->scratch = c->side_scratch, c->scratch_cap = c->side_cap, c->scratch_top = c->side_top;
    c->scratch_want = c->side_want;
    c->side_scratch = p, c->side_cap = cap, c->side_top = top, c->side_want = want;
}

static void side_to_main(cuda_impl *c) {
    if (c->side_state != 1) return;
    c->stream = c->main_stream;
    side_swap(c);
    c->side_state = 2;
}

void dsv4_cuda_side_close(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    if (!c->side_state) return;
    int early = c->side_state == 1;
    side_to_main(c);
    c->side_state = 0;
    c->side_forced += early;
    dsv4_cuda_seg_note(b, DSV4_SEG_SIDE_JOIN);
    if (c->failed) return;
    if (CK(b, cudaEventRecord(c->side_join, c->side_stream))) return;
    CK(b, cudaStreamWaitEvent(c->stream, c->side_join, 0));
}

/* the side arena at its high-water mark (outside any chain: waits for the device) */
static int side_grow(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    if (c->side_want <= c->side_cap) return 0;
    if (dsv4_cuda_sync(b)) return -1;
    size_t cap = c->side_want + c->side_want / 4 + (1 << 20);
    if (c->side_scratch) cudaFree(c->side_scratch);
    c->side_scratch = NULL;
    c->side_cap = 0;
    if (CK(b, cudaMalloc((void **)&c->side_scratch, cap))) return -1;
    c->side_cap = cap;
    return 0;
}

static void cu_side(dsv4_backend *b, int on) {
    cuda_impl *c = CI(b);
    dsv4_cuda_comb_flush(b); /* on the main stream, before the chains part */
    if (!on) {
        side_to_main(c);
        return;
    }
    if (c->side_state == 2 && !c->failed) { /* the open chain continues after the main chain's ops so far */
        if (CK(b, cudaEventRecord(c->side_fork, c->stream)) ||
            CK(b, cudaStreamWaitEvent(c->side_stream, c->side_fork, 0)))
            return;
        c->stream = c->side_stream;
        side_swap(c);
        c->side_state = 1;
        dsv4_cuda_seg_note(b, DSV4_SEG_SIDE_AGAIN);
        return;
    }
    if (c->side_state || !c->side_ok || c->timing || c->failed) return; /* in order */
    if (side_grow(b)) return;
    if (CK(b, cudaEventRecord(c->side_fork, c->stream)) || CK(b, cudaStreamWaitEvent(c->side_stream, c->side_fork, 0)))
        return;
    c->main_stream = c->stream;
    c->stream = c->side_stream;
    side_swap(c);
    c->scratch_top = 0;
    c->side_state = 1;
    c->side_forks++;
    dsv4_cuda_seg_note(b, DSV4_SEG_SIDE_FORK);
}

static void cu_join(dsv4_backend *b) {
    dsv4_cuda_comb_flush(b);
    dsv4_cuda_side_close(b);
}

static const dsv4_backend_ops CUDA_OPS = {
    "cuda",
    cu_alloc,
    cu_free,
    cu_copy,
    cu_copy,
    cu_copy,
    cu_embed,
    cu_matmul_any,
    cu_matmul_grouped,
    cu_rmsnorm,
    cu_rope,
    cu_scale,
    cu_sim,
    cu_hc_pre,
    cu_hc_post,
    cu_hc_head,
    cu_sparse_attn,
    cu_indexer_scores,
    cu_topk,
    cu_add_cyclic,
    cu_pool,
    cu_route,
    cu_moe,
    cu_load_weights,
    cu_check,
    cu_profile,
    cu_stats,
    cu_copy_bandwidth,
    cu_segment,
    cu_norm_rope,
    cu_hc_pre_norm,
    cu_hc_post_pre_norm,
    cu_matmul_multi,
    cu_sparse_attn_rope,
    cu_indexer_scores_rs,
    cu_copy_list,
    cu_add_cyclic_pos,
    cu_op_list,
    cu_route_moe,
    cu_host_alloc,
    cu_host_free,
    cu_argmax,
    cu_gather_ids,
    cu_side,
    cu_join,
    cu_matmul_rn,
    cu_matmul_rn_takes,
    cu_op_list_beside,
    cu_pool_multi,
};

/* The table less what the A/B switches take out (the forward pass then calls the separate ops:
 * same results, for A/B timing): DSV4_CUDA_FUSE=0 the fused pairs (norm_rope, hc_pre_norm,
 * hc_post_pre_norm), DSV4_CUDA_HC_FUSE=0 hc_post_pre_norm, DSV4_CUDA_ATTN_FUSE=0
 * sparse_attn_rope and indexer_scores_rs, DSV4_CUDA_OPLIST=0 op_list (every task its own op),
 * DSV4_CUDA_ROUTE_PLAN=0 route_moe (route and moe as two ops: the router and plan two launches),
 * DSV4_CUDA_QA_FUSE=0 matmul_rn (qa's norm back in the op list before wq_b).
 * Each backend keeps its own copy (cuda_impl.ops), read from the environment at init. */
static int env_off(const char *name) {
    const char *v = getenv(name);
    return v && !strcmp(v, "0");
}
static void ops_select(dsv4_backend_ops *o) {
    *o = CUDA_OPS;
    if (env_off("DSV4_CUDA_FUSE")) o->norm_rope = NULL, o->hc_pre_norm = NULL, o->hc_post_pre_norm = NULL;
    if (env_off("DSV4_CUDA_HC_FUSE")) o->hc_post_pre_norm = NULL;
    if (env_off("DSV4_CUDA_ATTN_FUSE")) o->sparse_attn_rope = NULL, o->indexer_scores_rs = NULL;
    if (env_off("DSV4_CUDA_OPLIST")) o->op_list = NULL;
    if (env_off("DSV4_CUDA_ROUTE_PLAN")) o->route_moe = NULL;
    if (env_off("DSV4_CUDA_SIDE")) o->side = NULL, o->join = NULL;
    if (env_off("DSV4_CUDA_QA_FUSE")) o->matmul_rn = NULL, o->matmul_rn_takes = NULL;
    if (!o->op_list) o->op_list_beside = NULL;
}

extern "C" int dsv4_backend_cuda_built(void) { return 1; }

extern "C" int dsv4_backend_cuda_available(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

extern "C" int dsv4_backend_cuda_init(dsv4_backend *b, int device, dsv4_err *err) {
    memset(b, 0, sizeof *b);
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return dsv4_errf(err, "backend 'cuda': no usable CUDA device (%s)",
                         e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    if (device < 0 || device >= n) return dsv4_errf(err, "backend 'cuda': device %d does not exist (%d found)", device, n);
    cudaDeviceProp p;
    if ((e = cudaGetDeviceProperties(&p, device)) != cudaSuccess)
        return dsv4_errf(err, "backend 'cuda': cudaGetDeviceProperties: %s", cudaGetErrorString(e));
    if (p.major < 9)
        return dsv4_errf(err, "backend 'cuda': %s is sm_%d%d; this build targets sm_90a (Hopper)", p.name, p.major,
                         p.minor);
    cuda_impl *c = (cuda_impl *)calloc(1, sizeof *c);
    if (!c) return dsv4_errf(err, "backend 'cuda': out of memory");
    c->device = device;
    c->nsm = p.multiProcessorCount;
    const char *gl = getenv("DSV4_CUDA_GRAPH_LOG");
    c->graph_log = gl && !strcmp(gl, "1");
    const char *pd = getenv("DSV4_CUDA_PDL");
    dsv4_cuda_pdl = !(pd && !strcmp(pd, "0"));
    const char *ge = getenv("DSV4_CUDA_GEMV_EARLY");
    dsv4_cuda_gemv_early = !(ge && !strcmp(ge, "0"));
    const char *l2 = getenv("DSV4_CUDA_L2PF");
    dsv4_cuda_l2pf = !(l2 && !strcmp(l2, "0"));
    const char *gme = getenv("DSV4_CUDA_GM_EARLY");
    /* 2 since stop 48 (H100, 20 Flash layers, 2K): greedy 3.18 against 3.20 ms a step in two A/Bs of 3 rounds
     * (ranges apart), batch 8 12.94 against 13.07; the trace: k_hc_dec 54 us a step less exposed, k_gemv_multi2
     * 26 more.  Not yet timed on an H200 */
    dsv4_cuda_gm_early = 2;
    if (gme && *gme) { /* 0, 1, or N >= 2 (common.cuh); anything else keeps the default, said once */
        char *end;
        long v = strtol(gme, &end, 10);
        if (*end || v < 0 || v > 1024)
            fprintf(stderr, "dsv4: DSV4_CUDA_GM_EARLY=%s is not 0, 1 or 2..1024; keeping 2\n", gme);
        else
            dsv4_cuda_gm_early = (int)v;
    }
    const char *hse = getenv("DSV4_CUDA_HC_STAMP");
    dsv4_cuda_hc_stamp = hse && !strcmp(hse, "1");
    const char *g = getenv("DSV4_CUDA_GRAPHS");
    c->graphs = !(g && !strcmp(g, "0"));
    /* DSV4_CUDA_HC_COMB=1: the MoE's combine inside the next hc kernel (moe.cu, "the combine into hc") */
    const char *hcc = getenv("DSV4_CUDA_HC_COMB");
    c->hc_comb = !hcc ? 0 : !strcmp(hcc, "1") ? 1 : !strcmp(hcc, "2") ? 2 : 0; /* 2: its hc launch without PDL */
    /* k_hc_dec's y and its norm formed by the blocks, a run of 128 columns each (mhc.cu; the default since
     * stop 45, same bits); DSV4_CUDA_HC_DIST=0: block 0 alone forms them, as before */
    const char *hcd = getenv("DSV4_CUDA_HC_DIST");
    c->hc_dist = !(hcd && !strcmp(hcd, "0"));
    /* k_topk_w (attn.cu cu_topk; the same set and order as k_topk_r / k_topk_s by construction, test_cuda_attn
     * test_topk_w): by default (1) for top-k rows of 8193..16384 entries (32K-64K context) instead of k_topk_s
     * (stop 62: faster there); DSV4_CUDA_TOPK_W=0 off, =2 for every row up to 16384 (A/B: slower at 516) */
    const char *tw = getenv("DSV4_CUDA_TOPK_W");
    c->topk_w = !tw ? 1 : !strcmp(tw, "0") ? 0 : !strcmp(tw, "2") ? 2 : 1;
    /* DSV4_CUDA_POOL_PRE (default 1 since stop 52; "0" off): a pool of <= 16 device rows asks for all its rows
     * at once (attn.cu k_pool_tab; the default kernel's bits, test_cuda_ops test_pool_pre) */
    const char *pp = getenv("DSV4_CUDA_POOL_PRE");
    c->pool_pre = !(pp && !strcmp(pp, "0"));
    /* DSV4_CUDA_ATTN_SC_MB: sparse attention's scratch per launch in MB (default 256; tests set 1
     * to cut small calls into row chunks) */
    const char *am = getenv("DSV4_CUDA_ATTN_SC_MB");
    long amb = am ? strtol(am, NULL, 10) : 256;
    c->attn_sc_max = (size_t)(amb > 0 && amb <= (1L << 20) ? amb : 256) << 20;
    b->impl = c;
    ops_select(&c->ops);
    b->ops = &c->ops;
    if (CK(b, cudaSetDevice(device)) || CK(b, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) ||
        CK(b, cudaEventCreate(&c->ev0)) || CK(b, cudaEventCreate(&c->ev1))) {
        dsv4_errf(err, "%s", c->errmsg);
        dsv4_backend_cuda_free(b);
        return -1;
    }
    /* the side chain's stream (highest priority), events and a first 4 MB arena; without them
     * side chains run in order (the same values) */
    int lo = 0, hi = 0;
    if (cudaDeviceGetStreamPriorityRange(&lo, &hi) == cudaSuccess &&
        cudaStreamCreateWithPriority(&c->side_stream, cudaStreamNonBlocking, hi) == cudaSuccess &&
        cudaEventCreateWithFlags(&c->side_fork, cudaEventDisableTiming) == cudaSuccess &&
        cudaEventCreateWithFlags(&c->side_join, cudaEventDisableTiming) == cudaSuccess &&
        cudaMalloc((void **)&c->side_scratch, (size_t)4 << 20) == cudaSuccess) {
        c->side_cap = (size_t)4 << 20;
        c->side_ok = 1;
    }
    cudaGetLastError();
    /* graph timing (an event pair per graph, read at every sync: ~44 event queries per decode
     * step on the host between steps, while the device waits) only when asked for */
    const char *gt = getenv("DSV4_CUDA_GRAPH_TIMES");
    for (int i = 0; i < 64 && gt && !strcmp(gt, "1"); i++)
        if (cudaEventCreate(&c->gev[0][i]) != cudaSuccess || cudaEventCreate(&c->gev[1][i]) != cudaSuccess) {
            cudaGetLastError(); /* graph timing is optional: without events it is not measured */
            for (int j = 0; j <= i; j++) {
                if (c->gev[0][j]) cudaEventDestroy(c->gev[0][j]);
                if (c->gev[1][j]) cudaEventDestroy(c->gev[1][j]);
                c->gev[0][j] = c->gev[1][j] = NULL;
            }
            break;
        }
    return 0;
}

extern "C" void dsv4_backend_cuda_free(dsv4_backend *b) {
    if (!b || !b->impl) return;
    cuda_impl *c = CI(b);
    if (c->capturing) { /* end a capture left open (an error path): its graph is dropped */
        cudaGraph_t g = NULL;
        cudaStreamEndCapture(c->stream, &g);
        if (g) cudaGraphDestroy(g);
        c->capturing = 0;
    }
    dsv4_cuda_side_close(b);
    if (c->stream) cudaStreamSynchronize(c->stream);
    dsv4_cuda_hc_stamp_dump();
    dsv4_cuda_devside_free(b);
    graphs_free(c);
    if (c->pool) cudaFree(c->pool);
    for (size_t i = 0; i < c->map_cap; i++) /* weights uploaded outside the pool */
        if (c->map[i].key && !(c->pool && c->map[i].data >= c->pool && c->map[i].data < c->pool + c->pool_bytes))
            cudaFree(c->map[i].data);
    free(c->map);
    while (c->n_spill > 0) cudaFree(c->spill[--c->n_spill]);
    if (c->scratch) cudaFree(c->scratch);
    if (c->hbuf) cudaFreeHost(c->hbuf);
    if (c->pin) cudaFreeHost(c->pin);
    if (c->ev0) cudaEventDestroy(c->ev0);
    for (int i = 0; i < 64; i++) {
        if (c->gev[0][i]) cudaEventDestroy(c->gev[0][i]);
        if (c->gev[1][i]) cudaEventDestroy(c->gev[1][i]);
    }
    if (c->ev1) cudaEventDestroy(c->ev1);
    for (int i = 0; i < c->n_dev; i++) cudaFree((void *)c->dev[i].base);
    free(c->dev);
    if (c->stream) cudaStreamDestroy(c->stream);
    if (c->side_stream) cudaStreamDestroy(c->side_stream);
    if (c->side_fork) cudaEventDestroy(c->side_fork);
    if (c->side_join) cudaEventDestroy(c->side_join);
    if (c->side_scratch) cudaFree(c->side_scratch);
    free(c);
    b->impl = NULL;
    b->ops = NULL;
}

/* The L2 policy createpolicy.fractional.L2::evict_first 1.0 forms on this device (out[0]), and the one the
 * weight streams carry in this build (out[1], d_pol_stream: that instruction under DSV4_CUDA_EVF=1, a constant
 * under =2).  test_cuda_ops test_evf_policy checks that the constant is what the instruction forms. */
__global__ void k_pol_probe(unsigned long long *out) {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    out[0] = p;
    out[1] = d_pol_stream();
}

extern "C" int dsv4_cuda_pol_probe(dsv4_backend *b, unsigned long long out[2]) {
    dsv4_cuda_seg_end(b); /* not inside a capture */
    unsigned long long *d = NULL;
    cudaError_t e = cudaMalloc((void **)&d, 2 * sizeof *d);
    if (e == cudaSuccess) {
        k_pol_probe<<<1, 1, 0, CI(b)->stream>>>(d);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaMemcpyAsync(out, d, 2 * sizeof *d, cudaMemcpyDeviceToHost, CI(b)->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(CI(b)->stream);
    if (d) cudaFree(d);
    if (e != cudaSuccess) return dsv4_cuda_fail(b, "dsv4_cuda_pol_probe", __FILE__, __LINE__, e), -1;
    return 0;
}
