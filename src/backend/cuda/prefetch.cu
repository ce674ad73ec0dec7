/* backend/cuda/prefetch.cu: ops->prefetch, weights into L2 ahead of the op that reads them
 * (k_l2pf).
 *
 * A decode step alternates between kernels that stream weights (wq_b, wo_a / wo_b, the MoE) and
 * chains of small kernels that read almost nothing from memory (hc_post / hc_pre, y's projections'
 * norms, the attention, the router): during those the DRAM idles.  The forward pass names the
 * weights its next big op reads (backend.h, DSV4_PF_*); here a kernel on a side stream asks for
 * them in L2, so the streaming kernel then reads L2 instead of DRAM.
 *
 * Only while a segment is captured (a CUDA graph): the side branch is forked from the capture at
 * the hint (an event record on the main stream, waited on by the side stream), so its kernel
 * starts when the kernel before the hint ends and runs beside the main chain; the branch is joined
 * at the segment's end (dsv4_cuda_pf_join, before cudaStreamEndCapture), which adds no edge into
 * the chain.  The kernel reads nothing and writes nothing: values never change, only where the
 * weight bytes come from.  Eager ops (no capture) ignore the hint.
 *
 * The backend has two sites of its own (moe.cu, k_l2pf_moe, after the router's plan): the w2 of the
 * experts it chose, while their gate/up runs (DSV4_CUDA_PF_MOE_DOWN, bit 4), and their w1 / w3, ahead of
 * gate/up's own loads (DSV4_CUDA_PF_MOE_UP, bit 5).
 *
 * DSV4_CUDA_L2PF: bit s acts on site s (0 = off, the default until measured); _MODE 1 one
 * cp.async.bulk.prefetch.L2 per chunk (default), 2 one prefetch.global.L2 per 128-byte line;
 * _BLOCKS blocks of 128 threads (default 32); _CHUNK kilobytes a bulk prefetch (default 16).
 * Target: sm_90a. */
#include "backend/cuda/common.cuh"

#define PF_RANGES 16 /* 8 weights, data and scales */

struct pf_table {
    const char *p[PF_RANGES];
    unsigned long long n[PF_RANGES];
    unsigned long long chunk; /* bytes, a multiple of 16 */
    int k;
};

/* range r's chunks (MODE 1) or lines (MODE 2) go round the grid's threads, starting at a thread
 * that moves with r, so small ranges (scales) do not all land on thread 0 */
template <int MODE>
__global__ void __launch_bounds__(128) k_l2pf(pf_table t) {
    unsigned long long g = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long G = (unsigned long long)gridDim.x * blockDim.x;
    for (int r = 0; r < t.k; r++) {
        const char *p = t.p[r];
        unsigned long long n = t.n[r], me = (g + G - (unsigned long long)r * 97 % G) % G;
        if (MODE == 1) {
            unsigned long long nc = (n + t.chunk - 1) / t.chunk;
            for (unsigned long long c = me; c < nc; c += G) {
                unsigned long long off = c * t.chunk, left = n - off;
                l2_prefetch_bulk(p + off, (unsigned)(left < t.chunk ? left : t.chunk));
            }
        } else {
            unsigned long long nl = (n + 127) / 128;
            for (unsigned long long l = me; l < nl; l += G)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(p + l * 128) : "memory");
        }
    }
}

static unsigned env_uint(const char *name, unsigned dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    unsigned long x = strtoul(v, &end, 0);
    return *end ? dflt : (unsigned)x;
}

/* read at backend init (backend.cu); the side stream and its events exist only when a site is on */
int dsv4_cuda_pf_init(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    c->pf_sites = env_uint("DSV4_CUDA_L2PF", 0) & ((1u << DSV4_CUDA_PF_SITES) - 1);
    c->pf_mode = env_uint("DSV4_CUDA_L2PF_MODE", 1) == 2 ? 2 : 1;
    unsigned nb = env_uint("DSV4_CUDA_L2PF_BLOCKS", 32), kb = env_uint("DSV4_CUDA_L2PF_CHUNK", 16);
    c->pf_blocks = nb < 1 ? 1 : nb > 1024 ? 1024 : (int)nb;
    c->pf_chunk = (kb < 1 ? 1 : kb > 1024 ? 1024 : (int)kb) * 1024;
    if (!c->pf_sites) return 0;
    return CK(b, cudaStreamCreateWithFlags(&c->pf_stream, cudaStreamNonBlocking)) ||
           CK(b, cudaEventCreateWithFlags(&c->pf_fork, cudaEventDisableTiming)) ||
           CK(b, cudaEventCreateWithFlags(&c->pf_done, cudaEventDisableTiming));
}

void dsv4_cuda_pf_free(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    if (c->pf_stream) cudaStreamSynchronize(c->pf_stream), cudaStreamDestroy(c->pf_stream);
    if (c->pf_fork) cudaEventDestroy(c->pf_fork);
    if (c->pf_done) cudaEventDestroy(c->pf_done);
    c->pf_stream = NULL;
    c->pf_fork = c->pf_done = NULL;
}

int dsv4_cuda_pf_on(dsv4_backend *b, int site) {
    cuda_impl *c = CI(b);
    return c->capturing && !c->failed && site >= 0 && site < DSV4_CUDA_PF_SITES && (c->pf_sites >> site & 1u);
}

/* the side stream, forked from the capture here, if site is on; NULL otherwise */
cudaStream_t dsv4_cuda_pf_fork(dsv4_backend *b, int site) {
    cuda_impl *c = CI(b);
    if (!dsv4_cuda_pf_on(b, site)) return NULL;
    if (CK(b, cudaEventRecord(c->pf_fork, c->stream)) || CK(b, cudaStreamWaitEvent(c->pf_stream, c->pf_fork, 0)))
        return NULL;
    c->pf_open = 1; /* the side stream is in the capture now: it must be joined even if a launch fails */
    return c->pf_stream;
}

/* after a launch on dsv4_cuda_pf_fork's stream: checked, counted, in the capture's signature */
void dsv4_cuda_pf_launched(dsv4_backend *b, int site) {
    if (CKL(b)) return;
    dsv4_cuda_seg_note(b, 16 + DSV4_CUDA_N_OPS + (unsigned)site);
    CI(b)->pf_launches++;
}

void cu_prefetch(dsv4_backend *b, int site, int n, const dsv4_weight *const *w) {
    cuda_impl *c = CI(b);
    if (!c->capturing || c->failed || site < 0 || site >= DSV4_PF_SITES || !(c->pf_sites >> site & 1u)) return;
    pf_table t;
    memset(&t, 0, sizeof t);
    t.chunk = (unsigned long long)c->pf_chunk;
    for (int i = 0; i < n && t.k + 2 <= PF_RANGES; i++) {
        const void *d, *s;
        size_t db, sb;
        if (!w[i] || dsv4_cuda_weight_bytes(b, w[i], &d, &db, &s, &sb)) continue; /* absent or not resident */
        if (db) t.p[t.k] = (const char *)d, t.n[t.k++] = db;
        if (sb) t.p[t.k] = (const char *)s, t.n[t.k++] = sb;
    }
    cudaStream_t st = t.k ? dsv4_cuda_pf_fork(b, site) : NULL;
    if (!st) return;
    if (c->pf_mode == 2)
        k_l2pf<2><<<c->pf_blocks, 128, 0, st>>>(t);
    else
        k_l2pf<1><<<c->pf_blocks, 128, 0, st>>>(t);
    dsv4_cuda_pf_launched(b, site);
}

void dsv4_cuda_pf_join(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    if (!c->pf_open) return;
    c->pf_open = 0;
    CK(b, cudaEventRecord(c->pf_done, c->pf_stream));
    CK(b, cudaStreamWaitEvent(c->stream, c->pf_done, 0));
}

long dsv4_cuda_pf_launches(struct dsv4_backend *b) { return b && b->impl ? CI(b)->pf_launches : 0; }
