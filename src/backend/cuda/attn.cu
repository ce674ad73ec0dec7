/* backend/cuda/attn.cu: sparse sink attention, indexer scores, top-k, compressor pooling.
 *
 * Keys are read in place from backend (device) memory: the sequence state and the
 * fresh kv rows live there.  What travels per op is small and built by the host from
 * positions: per-row window key pointers, per-row bases of the compressed rows, counts
 * and the sink.  Small batches pass them as a kernel parameter (Hopper takes up to 32 KB:
 * sparse_attn's blob up to 12 KB, the indexer's and topk's bases/counts up to 32 rows),
 * so a decode call is only kernel nodes in a graph; larger batches stage them through the
 * pinned arena.  The top-k picks stay on the device and sparse_attn reads them there, so
 * no op here waits for the device.  A key pointer that is not device memory (op tests
 * passing host rows) takes a slow path that stages the rows first.  An index read from
 * device memory (a pick) is checked against the row's compressed-row count; a bad one is
 * skipped and leaves a sticky device flag (DSV4_DEVFLAG_PICK) that ops->check reports.
 *
 * sparse_attn: two kernels, no host wait, fp32 throughout.  The heads of a row share its
 *   keys (<= 128 window + <= 512 picked rows of head_dim floats at V4-Flash), so a key row
 *   is brought on chip once per group of heads, not once per head.  k_attn_scores: block
 *   (16-key chunk, 16-head group, row), keys and q rows in shared memory by cp.async,
 *   warp = 2 heads x 16 keys, lanes over dims, scores (x scale) to scratch; group 0 also
 *   writes the resolved key pointers (picks checked there) and each row's key count, and
 *   block (0, 0, 0) the sink, for p.V.  k_attn_pv: block (32 dims, 8 heads, row), warp per
 *   head for the max over sink and scores and the denominator (each block recomputes its
 *   heads' sums identically; a row of <= 768 keys keeps its scores in registers from the
 *   max to p), p_j = exp(s_j - max) / den (bf16 if asked) per 768-key tile in shared
 *   memory, thread = 8 heads x 4 dims x keys j = kl mod 32, key lanes summed in a fixed
 *   order.  Same arithmetic as the CPU op (p exactly as it forms it, no online
 *   rescaling); only the grouping of the dot products and of the sum over keys differ.
 *   Flash batch 1 (64 x 512, 640 keys): 160 + 128 blocks.
 * indexer_scores: head_dim 32/64/128/256 with 16-byte aligned rows: 4 lanes per key (a
 *   quarter of the key in registers) against one copy of q in shared memory; when a block
 *   of 64 keys would leave fewer than 128 blocks (decode below ~32K context: 516 keys at
 *   2K make 9 blocks) a block takes 4..32 keys and splits the heads among its threads
 *   (k_indexer_s), the relu'd dots meeting in shared memory for the weighted sum in head
 *   order; with 64 heads and 32 or 64 keys a block (decode from ~16K context, batched decode)
 *   a block is an fp32 GEMM tile of 64 heads x 32..64 keys (k_indexer_t); other head_dims or
 *   alignments: one warp per (row, key).  Per head a dot, relu, weighted sum in head order
 *   (score_bf16 rounds like the CPU).
 * topk: one block per row, radix select (up to four 8-bit passes) of the k-th largest
 *   value, then a block scan writes the entries above it and the lowest-index ties, in
 *   ascending index order (the CPU's choice: value descending, ties to the lower index),
 *   straight into the caller's device buffers.  O(n) per row.  Rows of <= 8192 entries
 *   keep their keys in registers and stop the passes once the digit holding the k-th
 *   largest is taken whole (k_topk_r); rows of up to 49152 in shared memory, the same way,
 *   with one scan over contiguous runs at the end (k_topk_s).  Rows of 8193..16384 take k_topk_w
 *   instead (11-bit digits, runs in registers, no per-entry warp match; DSV4_CUDA_TOPK_W=0 off, =2 for
 *   every row up to 16384).
 * pool: one thread per channel, softmax over the window in entry order.
 * Target: sm_90a.
 */
#include <stdlib.h>

#include "backend/cuda/rope.cuh"

/* 1 if [p, p + bytes) lies inside one buffer of ops->alloc; *hint keeps the index of the
 * last buffer found (key pointers come in runs into the same ring or rows buffer, so
 * most lookups are one comparison). */
static int dev_span(cuda_impl *c, const void *p, size_t bytes, int *hint) {
    uintptr_t a = (uintptr_t)p;
    if (!bytes) bytes = 1;
    int i = *hint;
    if (i >= 0 && i < c->n_dev && a >= c->dev[i].base && a - c->dev[i].base + bytes <= c->dev[i].size) return 1;
    int lo = 0, hi = c->n_dev; /* first buffer with base > a is at lo */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (c->dev[mid].base <= a) lo = mid + 1;
        else hi = mid;
    }
    i = lo - 1;
    if (i < 0 || a - c->dev[i].base + bytes > c->dev[i].size) return 0;
    *hint = i;
    return 1;
}

/* Slow path for keys in host memory: copies the `n` rows of `width` floats at host
 * pointers *ptrs[t] into pinned memory, stages them and rewrites each pointer to its
 * device copy.  0 or -1 (sticky error set). */
static int stage_host_rows(dsv4_backend *b, const float ***ptrs, int n, int width) {
    if (n <= 0) return 0;
    size_t rb = sizeof(float) * (size_t)width;
    float *h = (float *)dsv4_cuda_hbuf(b, rb * (size_t)n);
    if (!h) return -1;
    for (int t = 0; t < n; t++) memcpy(h + (size_t)t * width, *ptrs[t], rb);
    float *d = (float *)dsv4_cuda_stage(b, h, rb * (size_t)n);
    if (!d) return -1;
    for (int t = 0; t < n; t++) *ptrs[t] = d + (size_t)t * width;
    return 0;
}

/* ----- sparse attention ----- */
#define ATTN_THREADS 256
#define AS_KEYS 16  /* scores: keys per block (staged in shared memory) */
#define AS_HEADS 16 /* scores: heads per block, two per warp (2 x 16 = 32 (head, key) pairs per warp) */
#define AP_HEADS 8  /* p.V: heads per block, one per warp for the softmax statistics */
#define AP_DIMS 32  /* p.V: output dims per block (8 threads x 4) */
#define AP_TILE 768 /* p.V: keys per tile of p and key pointers in shared memory (Flash: 128 + 512 fit one) */
#define AP_SREG (AP_TILE / 32) /* p.V: scores per lane kept in registers when a row fits one tile */
#define AP_LANES 32 /* p.V: key lanes; thread (kl, quad) sums keys j = kl mod 32 */
#define AP_UNROLL 8 /* p.V: key loads in flight per thread */
/* The host arrays (window pointers, compressed bases, counts, sink) travel as one kernel
 * parameter when they fit (Hopper takes up to 32 KB of parameters): no staged copy, so a
 * batch-1 call is two kernel nodes in a graph.  Above AB_LARGE they are staged. */
#define AB_SMALL 2048  /* rows 1 at window 128: 1 KB of pointers + counts + 64 sinks */
#define AB_LARGE 12288 /* up to ~10 rows at window 128 */
static_assert(AS_HEADS == 2 * (ATTN_THREADS / 32) && 2 * AS_KEYS == 32, "scores: 32 (head, key) pairs per warp");
static_assert(AP_HEADS == ATTN_THREADS / 32, "p.V: a warp per head");
static_assert(ATTN_THREADS == 16 * AS_KEYS, "attn_prefetch_keys: 16 threads a key");
static_assert(AP_DIMS == 32 && AP_LANES * 8 == ATTN_THREADS, "p.V: 8 quads of dims x 32 key lanes");

template <int BYTES> struct attn_blob {
    alignas(16) unsigned char b[BYTES];
};

struct attn_args {
    const float *q;                  /* [rows*heads][head_dim] */
    const float *const *win;         /* [rows][max_win] window key pointers (staged; NULL: in the blob) */
    const int *n_win;                /* [rows] */
    const float *const *comp_base;   /* [rows] or NULL */
    const int *n_comp;               /* [rows] (with comp_base) */
    const int32_t *picks;            /* [rows][topk] or NULL */
    const int *n_picks;              /* [rows] (with picks) */
    const float *sink;               /* [heads] */
    float *sc;                       /* [rows*heads][max_n] scores */
    const float **kp;                /* [rows][max_n] resolved key pointers (NULL: skipped key) */
    int *rown;                       /* [rows] keys per row, from the scores kernel to p.V */
    float *sinkd;                    /* [heads] the sink, copied by the scores kernel for p.V */
    float *out;                      /* [rows*heads][head_dim] */
    unsigned *flags;                 /* sticky device flags */
    int blob;                        /* 1: win, n_win, comp_base, n_comp, sink are in the blob at: */
    int l2pf;                        /* 1 (blob only): the scores kernel asks for its keys before its PDL wait */
    int off_win, off_nwin, off_base, off_ncomp, off_sink; /* byte offsets (< 0: none / a device sink) */
    int max_win, topk, n_heads, head_dim, max_n, prob_bf16, out_bf16;
    float scale;
};

/* RoPE folded into an attention kernel (sparse_attn_rope: the inverse RoPE of the output in
 * p.V's epilogue; indexer_scores_rs: the RoPE of q, and w's scale, as the scores kernel loads
 * them): positions and frequencies by value (pd NULL) or staged (rope_inputs, rope.cuh) */
struct fused_rope {
    rope_args ra;
    const int64_t *pd; /* [rows] or NULL: ra.pos */
    const float *fd;   /* [rope_dim / 2] or NULL: ra.freq */
    int rope_dim;      /* <= head_dim (even for p.V); pairs on the last rope_dim dims of each head */
    int out_bf16;      /* rope's (and scale's) rounding of what they write */
    float w_scale;     /* indexer_scores_rs: scale's factor for w */
};

/* the fp32 angle of pair i at row r's position, as k_rope forms it */
__device__ __forceinline__ float fr_angle(const fused_rope &f, int64_t r, int i) {
    return f.pd ? (float)f.pd[r] * f.fd[i] : (float)f.ra.pos[r] * f.ra.freq[i];
}

/* points the host arrays of a at the kernel-parameter blob (its generic address) */
template <int PB> __device__ __forceinline__ void attn_bind(attn_args &a, const attn_blob<PB> &p) {
    if (!a.blob) return;
    const unsigned char *b = p.b;
    a.win = (const float *const *)(b + a.off_win);
    a.n_win = (const int *)(b + a.off_nwin);
    if (a.off_base >= 0) {
        a.comp_base = (const float *const *)(b + a.off_base);
        a.n_comp = (const int *)(b + a.off_ncomp);
    }
    if (a.off_sink >= 0) a.sink = (const float *)(b + a.off_sink);
}

/* keys of row r: nw window keys, then n - nw compressed ones (a count read from device
 * memory is clamped to what the scratch was sized for, and flagged) */
__device__ __forceinline__ void attn_counts(const attn_args &a, int r, int &nw, int &n) {
    nw = min(max(a.n_win[r], 0), a.max_win);
    int nc = 0;
    if (a.comp_base && a.comp_base[r]) {
        int lim = max(a.n_comp[r], 0);
        if (a.picks) {
            int cap = min(a.topk, lim);
            nc = a.n_picks[r];
            if (nc < 0 || nc > cap) {
                atomicOr(a.flags, DSV4_DEVFLAG_PICK);
                nc = nc < 0 ? 0 : cap;
            }
        } else {
            nc = lim;
        }
    }
    n = min(nw + nc, a.max_n);
}

/* key j of row r (NULL: a pick out of range, skipped and flagged) */
__device__ __forceinline__ const float *attn_key(const attn_args &a, int r, int j, int nw) {
    if (j < nw) return a.win[(int64_t)r * a.max_win + j];
    int t = j - nw;
    int i = a.picks ? a.picks[(int64_t)r * a.topk + t] : t;
    if (i < 0 || i >= a.n_comp[r]) {
        atomicOr(a.flags, DSV4_DEVFLAG_PICK);
        return NULL;
    }
    return a.comp_base[r] + (int64_t)i * a.head_dim;
}

/* the L2 prefetch of key j0 + t / 16 of row r (the thread's 128-byte lines t % 16, + 16, ...), from the
 * blob's arrays only: the window's keys, and the compressed rows in order where there are no picks */
__device__ __forceinline__ void attn_prefetch_keys(const attn_args &a, int r, int j0, int t) {
    int j = j0 + t / 16, nw = min(max(a.n_win[r], 0), a.max_win);
    if (j >= a.max_n) return;
    const float *k = NULL;
    if (j < nw) k = a.win[(int64_t)r * a.max_win + j];
    else if (!a.picks && a.comp_base && a.comp_base[r] && j - nw < a.n_comp[r])
        k = a.comp_base[r] + (int64_t)(j - nw) * a.head_dim;
    if (!k) return;
    for (int l = t % 16; l * 32 < a.head_dim; l += 16) d_prefetch_l2(k + l * 32);
}

__device__ __forceinline__ void attn_cp_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

/* one step of a transposed butterfly over 2*O values: the lane keeps the O whose index has
 * its bit O, summed with its partner's (constant indices: the values stay in registers) */
template <int O> __device__ __forceinline__ void attn_fold(float *v, int lane) {
    int up = lane & O;
#pragma unroll
    for (int i = 0; i < O; i++) {
        float send = up ? v[i] : v[i + O], keep = up ? v[i + O] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}

/* Scores.  Block (key chunk c, head group g, row r): the chunk's AS_KEYS key rows and the
 * group's AS_HEADS query rows are copied into shared memory once (cp.async: every copy of
 * the block is in flight at once), so a key row is read from memory by ceil(heads /
 * AS_HEADS) blocks instead of once per head.  Warp w forms the 32 dot products of heads
 * 2w, 2w+1 with the 16 keys, lanes striding over dims, and one transposed butterfly (31
 * shuffles) leaves pair `lane` in lane `lane`.  Group 0 also records the resolved key
 * pointers and (chunk 0) the row's key count for the p.V pass; block (0, 0, 0) copies the
 * sink.  VEC 4: head_dim % 4 == 0 and every row 16-byte aligned.  PB: the size of the
 * parameter blob holding the host arrays (16 when they were staged). */
template <int VEC, int PB>
__global__ void __launch_bounds__(ATTN_THREADS) k_attn_scores(attn_args a0, const __grid_constant__ attn_blob<PB> p) {
    extern __shared__ float4 attn_sm4[];
    float *ks = (float *)attn_sm4;             /* [AS_KEYS][hd] */
    float *qs = ks + (size_t)AS_KEYS * a0.head_dim; /* [AS_HEADS][hd] */
    __shared__ const float *kptr[AS_KEYS];
    attn_args a = a0;
    attn_bind(a, p);
    int c = blockIdx.x, g = blockIdx.y, r = blockIdx.z, hd = a.head_dim, t = threadIdx.x;
    /* the keys of this chunk into L2 before the wait: the window's pointers and, without picks, the
     * compressed rows are kernel parameters (the blob), known at launch; the keys themselves were
     * written steps ago (the newest by the kernel before, which a prefetch may precede: common.cuh) */
    if (a.l2pf && g == 0) attn_prefetch_keys(a, r, c * AS_KEYS, t);
    pdl_enter();
    int nw, n;
    attn_counts(a, r, nw, n);
    if (c == 0 && g == 0) {
        if (t == 0) a.rown[r] = n;
        if (r == 0)
            for (int h = t; h < a.n_heads; h += blockDim.x) a.sinkd[h] = a.sink[h];
    }
    int j0 = c * AS_KEYS;
    if (j0 >= n) return; /* uniform over the block */
    int h0 = g * AS_HEADS, nh = min(AS_HEADS, a.n_heads - h0);
    const float *qg = a.q + ((int64_t)r * a.n_heads + h0) * hd;
    if (VEC == 4)
        for (int i = t; i < nh * hd / 4; i += blockDim.x) d_cp_async16(qs + 4 * i, qg + 4 * i);
    else
        for (int i = t; i < nh * hd; i += blockDim.x) qs[i] = qg[i];
    if (t < AS_KEYS) {
        int j = j0 + t;
        const float *k = j < n ? attn_key(a, r, j, nw) : NULL;
        kptr[t] = k;
        if (g == 0 && j < n) a.kp[(int64_t)r * a.max_n + j] = k;
    }
    __syncthreads();
    int per = hd / VEC;
    for (int i = t; i < AS_KEYS * per; i += blockDim.x) {
        int kk = i / per, o = (i - kk * per) * VEC;
        const float *k = kptr[kk];
        float *dst = ks + kk * hd + o;
        if (VEC == 4) {
            if (k) d_cp_async16(dst, k + o);
            else *(float4 *)dst = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        } else {
            *dst = k ? k[o] : 0.0f;
        }
    }
    attn_cp_wait();
    __syncthreads();
    int warp = t >> 5, lane = t & 31;
    if (2 * warp >= nh) return;
    const float *q0 = qs + (size_t)(2 * warp) * hd, *q1 = q0 + hd; /* q1 unused when 2w + 1 == nh */
    float v[32];
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = 0.0f;
    if (VEC == 4) {
        for (int d = lane * 4; d < hd; d += 128) {
            float4 x0 = *(const float4 *)(q0 + d), x1 = *(const float4 *)(q1 + d);
#pragma unroll
            for (int k = 0; k < AS_KEYS; k++) {
                float4 y = *(const float4 *)(ks + k * hd + d);
                v[k] += x0.x * y.x + x0.y * y.y + x0.z * y.z + x0.w * y.w;
                v[AS_KEYS + k] += x1.x * y.x + x1.y * y.y + x1.z * y.z + x1.w * y.w;
            }
        }
    } else {
        for (int d = lane; d < hd; d += 32) {
            float x0 = q0[d], x1 = q1[d];
#pragma unroll
            for (int k = 0; k < AS_KEYS; k++) {
                float y = ks[k * hd + d];
                v[k] += x0 * y;
                v[AS_KEYS + k] += x1 * y;
            }
        }
    }
    /* transposed butterfly: lane l ends with pair l (head 2w + l / 16, key l mod 16) */
    attn_fold<16>(v, lane);
    attn_fold<8>(v, lane);
    attn_fold<4>(v, lane);
    attn_fold<2>(v, lane);
    attn_fold<1>(v, lane);
    int hh = 2 * warp + (lane >> 4), j = j0 + (lane & 15);
    if (hh < nh && j < n)
        a.sc[((int64_t)r * a.n_heads + h0 + hh) * a.max_n + j] = kptr[lane & 15] ? v[0] * a.scale : -INFINITY;
}

/* p.V over one tile of m keys (pointers kt, p as [key][8 heads]): thread (kl, quad) adds
 * p_j K_j[d0 .. d0+3] for its 8 heads over keys j = kl mod AP_LANES, AP_UNROLL loads
 * issued before the first is used */
template <int VEC>
__device__ __forceinline__ void attn_pv_tile(float *acc, const float *const *kt, const float4 *pt4, int m, int kl,
                                             int d0, int hd) {
    for (int i0 = kl; i0 < m; i0 += AP_LANES * AP_UNROLL) {
        float4 kv[AP_UNROLL];
#pragma unroll
        for (int u = 0; u < AP_UNROLL; u++) {
            int i = i0 + u * AP_LANES;
            const float *k = i < m ? kt[i] : NULL;
            kv[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (VEC == 4) {
                if (k && d0 < hd) kv[u] = __ldg((const float4 *)(k + d0));
            } else if (k) {
                if (d0 < hd) kv[u].x = __ldg(k + d0);
                if (d0 + 1 < hd) kv[u].y = __ldg(k + d0 + 1);
                if (d0 + 2 < hd) kv[u].z = __ldg(k + d0 + 2);
                if (d0 + 3 < hd) kv[u].w = __ldg(k + d0 + 3);
            }
        }
#pragma unroll
        for (int u = 0; u < AP_UNROLL; u++) {
            int i = i0 + u * AP_LANES;
            if (i >= m) break;
            float4 pa = pt4[i * 2], pb = pt4[i * 2 + 1];
            float p[8] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
            for (int h = 0; h < AP_HEADS; h++) {
                acc[h * 4 + 0] += p[h] * kv[u].x;
                acc[h * 4 + 1] += p[h] * kv[u].y;
                acc[h * 4 + 2] += p[h] * kv[u].z;
                acc[h * 4 + 3] += p[h] * kv[u].w;
            }
        }
    }
}

/* Softmax and p.V.  Block (dim slice of AP_DIMS, head group of AP_HEADS, row): warp w
 * finds head w's max over the sink and every score and its denominator (every block of
 * that head computes them the same way, so they agree bit for bit); p_j = exp(s_j - max) /
 * den (bf16 if asked) goes to shared memory with the key pointers, and attn_pv_tile sums
 * p_j K_j.  A row of <= AP_TILE keys (the decode case) is one tile and its scores stay in
 * registers from the max to p (one pass over memory); longer rows take strided passes
 * and recompute exp per tile (the same expression, so the same bits).  The 32 key lanes
 * are summed in a fixed order (shuffles within the warp, then warps in order): only the
 * grouping of the sum over keys differs from the CPU's. */
template <int VEC, int ROPE>
__global__ void __launch_bounds__(ATTN_THREADS) k_attn_pv(attn_args a, const __grid_constant__ fused_rope fr) {
    pdl_enter();
    __shared__ float4 pt4[AP_TILE * AP_HEADS / 4]; /* p [key][head] */
    __shared__ const float *kt[AP_TILE];
    __shared__ float red[(ATTN_THREADS / 32) * 8 * 33]; /* [warp][quad][8 heads x 4 dims], padded */
    float *pt = (float *)pt4;
    int g = blockIdx.y, r = blockIdx.z, hd = a.head_dim, H = a.n_heads, t = threadIdx.x;
    int warp = t >> 5, lane = t & 31;
    int n = a.rown[r];
    int h0 = g * AP_HEADS, hw = h0 + warp;
    const float *sw = a.sc + ((int64_t)r * H + (hw < H ? hw : 0)) * a.max_n;
    const float *const *kpr = a.kp + (int64_t)r * a.max_n;
    int qd = t & 7, kl = t >> 3, d0 = blockIdx.x * AP_DIMS + qd * 4;
    float acc[AP_HEADS * 4];
#pragma unroll
    for (int i = 0; i < AP_HEADS * 4; i++) acc[i] = 0.0f;
    if (n <= AP_TILE) {
        for (int i = t; i < n; i += blockDim.x) kt[i] = kpr[i];
        if (hw < H) {
            float e[AP_SREG], mx = -INFINITY; /* lane-strided max, in j order per lane */
#pragma unroll
            for (int k = 0; k < AP_SREG; k++) {
                int j = lane + 32 * k;
                e[k] = j < n ? sw[j] : -INFINITY;
                mx = fmaxf(mx, e[k]);
            }
            float sk = a.sinkd[hw];
            mx = fmaxf(warp_max(mx), sk);
            float den = 0.0f;
#pragma unroll
            for (int k = 0; k < AP_SREG; k++)
                if (lane + 32 * k < n) {
                    e[k] = expf(e[k] - mx);
                    den += e[k];
                }
            den = warp_sum(den) + expf(sk - mx);
#pragma unroll
            for (int k = 0; k < AP_SREG; k++) {
                int j = lane + 32 * k;
                if (j < n) {
                    float pj = e[k] / den;
                    pt[j * AP_HEADS + warp] = a.prob_bf16 ? d_round_bf16(pj) : pj;
                }
            }
        } else {
            for (int i = lane; i < n; i += 32) pt[i * AP_HEADS + warp] = 0.0f;
        }
        __syncthreads();
        attn_pv_tile<VEC>(acc, kt, pt4, n, kl, d0, hd);
    } else {
        float mx = -INFINITY, den = 0.0f;
        if (hw < H) {
#pragma unroll 4
            for (int j = lane; j < n; j += 32) mx = fmaxf(mx, sw[j]);
            float sk = a.sinkd[hw];
            mx = fmaxf(warp_max(mx), sk);
#pragma unroll 4
            for (int j = lane; j < n; j += 32) den += expf(sw[j] - mx);
            den = warp_sum(den) + expf(sk - mx);
        }
        for (int t0 = 0; t0 < n; t0 += AP_TILE) {
            int m = min(AP_TILE, n - t0);
            __syncthreads(); /* the previous tile is consumed */
            for (int i = t; i < m; i += blockDim.x) kt[i] = kpr[t0 + i];
            if (hw < H) {
                for (int i = lane; i < m; i += 32) {
                    float pj = expf(sw[t0 + i] - mx) / den;
                    pt[i * AP_HEADS + warp] = a.prob_bf16 ? d_round_bf16(pj) : pj;
                }
            } else {
                for (int i = lane; i < m; i += 32) pt[i * AP_HEADS + warp] = 0.0f;
            }
            __syncthreads();
            attn_pv_tile<VEC>(acc, kt, pt4, m, kl, d0, hd);
        }
    }
    /* lane = (kl mod 4) * 8 + quad: the warp's 4 key lanes by two butterfly steps, then the
     * 8 warps in order */
#pragma unroll
    for (int i = 0; i < AP_HEADS * 4; i++) {
        acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 8);
        acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 16);
    }
    if (lane < 8)
#pragma unroll
        for (int i = 0; i < AP_HEADS * 4; i++) red[(warp * 8 + qd) * 33 + i] = acc[i];
    __syncthreads();
    int hh = t >> 5, dd = t & 31; /* one output per thread: 8 heads x 32 dims */
    float o = 0.0f;
    for (int w = 0; w < ATTN_THREADS / 32; w++) o += red[(w * 8 + (dd >> 2)) * 33 + hh * 4 + (dd & 3)];
    int h = h0 + hh, d = blockIdx.x * AP_DIMS + dd;
    float v = a.out_bf16 ? d_round_bf16(o) : o; /* sparse_attn's output */
    if (ROPE) {
        /* then rope(out, inverse) of pair (d & ~1, d | 1) from the rounded values, as k_rope
         * forms it: the pair's dims are lanes dd & ~1 and dd | 1 of this warp (the rope part
         * starts at an even dim, the host checked), each lane rotates and keeps its own */
        float u = __shfl_xor_sync(0xffffffffu, v, 1);
        int c0 = d - (hd - fr.rope_dim);
        if (c0 >= 0 && d < hd) {
            float ang = fr_angle(fr, r, c0 >> 1);
            float2 y = dd & 1 ? d_rope_rot(u, v, ang, 1, fr.out_bf16) : d_rope_rot(v, u, ang, 1, fr.out_bf16);
            v = dd & 1 ? y.y : y.x;
        }
    }
    if (h < H && d < hd) a.out[((int64_t)r * H + h) * hd + d] = v;
}

/* Slow path: some key is host memory.  Builds each row's full key list on the host
 * (picks read back: this path waits), stages the host rows and returns the list as
 * window pointers only.  0 or -1. */
static int attn_host_keys(dsv4_backend *b, int rows, int head_dim, const float *const *win, const int *n_win,
                          int max_win, const float *const *comp_base, const int *n_comp, const int32_t *picks,
                          const int *n_picks, int topk, const float ***list, int **n_list, int *max_list) {
    cuda_impl *c = CI(b);
    int32_t *hp = NULL;
    int *hn = NULL;
    if (picks) {
        dsv4_cuda_seg_end(b); /* slow path: copies to pageable memory and a wait (not capturable) */
        hp = (int32_t *)malloc(sizeof(int32_t) * (size_t)rows * (topk > 0 ? topk : 1));
        hn = (int *)malloc(sizeof(int) * (size_t)rows);
        if (!hp || !hn) goto oom;
        if (CK(b, cudaMemcpyAsync(hp, picks, sizeof(int32_t) * (size_t)rows * topk, cudaMemcpyDefault, c->stream)) ||
            CK(b, cudaMemcpyAsync(hn, n_picks, sizeof(int) * (size_t)rows, cudaMemcpyDefault, c->stream)) ||
            dsv4_cuda_sync(b)) {
            free(hp), free(hn);
            return -1;
        }
    }
    {
        int mx = 1;
        for (int r = 0; r < rows; r++) {
            int nc = !comp_base || !comp_base[r] ? 0 : picks ? hn[r] : n_comp[r];
            if (picks && (nc < 0 || nc > topk)) nc = 0;
            if (n_win[r] + nc > mx) mx = n_win[r] + nc;
        }
        const float **l = (const float **)malloc(sizeof(float *) * (size_t)rows * mx);
        const float ***host = (const float ***)malloc(sizeof(float **) * (size_t)rows * mx);
        int *nl = (int *)malloc(sizeof(int) * (size_t)rows);
        if (!l || !host || !nl) {
            free(l), free(host), free(nl);
            goto oom;
        }
        int nh = 0, hint = -1;
        for (int r = 0; r < rows; r++) {
            const float **lr = l + (size_t)r * mx;
            int n = 0;
            for (int j = 0; j < n_win[r]; j++) lr[n++] = win[(size_t)r * max_win + j];
            if (comp_base && comp_base[r]) {
                int nc = picks ? hn[r] : n_comp[r];
                if (picks && (nc < 0 || nc > topk)) nc = 0;
                for (int j = 0; j < nc; j++) {
                    int i = picks ? hp[(size_t)r * topk + j] : j;
                    if (i < 0 || i >= n_comp[r]) continue; /* as the device path: skipped */
                    lr[n++] = comp_base[r] + (size_t)i * head_dim;
                }
            }
            nl[r] = n;
            for (int j = 0; j < n; j++)
                if (!dev_span(c, lr[j], sizeof(float) * head_dim, &hint)) host[nh++] = &lr[j];
        }
        int rc = stage_host_rows(b, host, nh, head_dim);
        free(host), free(hp), free(hn);
        if (rc) {
            free(l), free(nl);
            return -1;
        }
        *list = l;
        *n_list = nl;
        *max_list = mx;
        return 0;
    }
oom:
    free(hp), free(hn);
    dsv4_cuda_fail(b, "attention key lists: out of host memory", __FILE__, __LINE__, cudaSuccess);
    return -1;
}


/* What one sparse_attn call launches: arguments, the parameter blob, geometry. */
struct attn_plan {
    attn_args a;
    int vec4, pb;    /* pb: 0 = host arrays staged, 1 = blob of AB_SMALL bytes, 2 = AB_LARGE */
    size_t smem;     /* scores: dynamic shared memory */
    dim3 gs, gp;     /* scores, p.V grids */
    attn_blob<AB_LARGE> blob;
};

/* keys of the longest row (window rows, then the picked or all compressed rows), from host counts */
static int attn_max_keys(int rows, const int *n_win, int max_win, const float *const *comp_base, const int *n_comp,
                         const int32_t *picks, int topk) {
    int max_n = 1;
    for (int r = 0; r < rows; r++) {
        int nw = n_win[r] < 0 ? 0 : n_win[r] > max_win ? max_win : n_win[r], nc = 0;
        if (comp_base && comp_base[r]) nc = picks ? (topk < n_comp[r] ? topk : n_comp[r]) : n_comp[r];
        if (nw + (nc > 0 ? nc : 0) > max_n) max_n = nw + (nc > 0 ? nc : 0);
    }
    return max_n;
}

/* Everything of the op before its launches: key lists (slow path for host keys), the host
 * arrays as a parameter blob or staged, scratch.  0 or -1 (sticky error set). */
static int attn_setup(dsv4_backend *b, attn_plan *P, float *out, const float *q, int rows, int n_heads, int head_dim,
                      const float *const *win, const int *n_win, int max_win, const float *const *comp_base,
                      const int *n_comp, const int32_t *picks, const int *n_picks, int topk, const float *sink,
                      float scale, int prob_bf16, int out_bf16) {
    cuda_impl *c = CI(b);
    if (head_dim <= 0 || head_dim > 1024) { /* scores stage (16 keys + 16 heads) x head_dim floats: 128 KB */
        dsv4_cuda_fail(b, "sparse_attn: head_dim above 1024 is not supported", __FILE__, __LINE__, cudaSuccess);
        return -1;
    }
    if (!picks) topk = 0;
    /* are all keys device memory?  (the forward pass's always are) */
    int all_dev = 1, hint = -1;
    for (int r = 0; r < rows && all_dev; r++) {
        for (int j = 0; j < n_win[r] && all_dev; j++)
            all_dev = dev_span(c, win[(size_t)r * max_win + j], sizeof(float) * head_dim, &hint);
        if (comp_base && comp_base[r] && n_comp[r] > 0)
            all_dev = all_dev && dev_span(c, comp_base[r], sizeof(float) * (size_t)n_comp[r] * head_dim, &hint);
    }
    const float **hl = NULL;
    int *hnl = NULL;
    if (!all_dev) { /* slow path: explicit lists, host rows staged */
        int ml = 0;
        if (attn_host_keys(b, rows, head_dim, win, n_win, max_win, comp_base, n_comp, picks, n_picks, topk, &hl,
                           &hnl, &ml))
            return -1;
        win = hl, n_win = hnl, max_win = ml;
        comp_base = NULL, n_comp = NULL, picks = NULL, n_picks = NULL, topk = 0;
    }
    int max_n = attn_max_keys(rows, n_win, max_win, comp_base, n_comp, picks, topk);
    int rh = rows * n_heads;
    attn_args *a = &P->a;
    memset(a, 0, sizeof *a);
    size_t nq = (size_t)rh * head_dim;
    a->q = (const float *)dsv4_cuda_in(b, q, sizeof(float) * nq);
    /* 16-byte vectors when every row (q, window keys, compressed bases) is 16-byte aligned */
    P->vec4 = head_dim % 4 == 0 && ((uintptr_t)a->q & 15) == 0;
    for (int r = 0; r < rows && P->vec4; r++) {
        int nw = n_win[r] < 0 ? 0 : n_win[r] > max_win ? max_win : n_win[r];
        for (int j = 0; j < nw && P->vec4; j++) P->vec4 = ((uintptr_t)win[(size_t)r * max_win + j] & 15) == 0;
        if (comp_base && comp_base[r]) P->vec4 = P->vec4 && ((uintptr_t)comp_base[r] & 15) == 0;
    }
    /* blob layout: window pointers, compressed bases, n_win, n_comp, sink */
    size_t nwp = (size_t)rows * (max_win > 0 ? max_win : 1);
    size_t o_base = sizeof(float *) * nwp, o_nwin = o_base + (comp_base ? sizeof(float *) * rows : 0);
    size_t o_ncomp = o_nwin + sizeof(int) * rows, o_sink = o_ncomp + (comp_base ? sizeof(int) * rows : 0);
    size_t bytes = o_sink + sizeof(float) * n_heads;
    const float *sink_d = dsv4_cuda_is_dev(b, sink) ? sink : NULL; /* a device sink is read in place */
    if (sink_d) bytes = o_sink;
    P->pb = bytes <= AB_SMALL ? 1 : bytes <= AB_LARGE ? 2 : 0;
    if (P->pb) {
        unsigned char *u = P->blob.b;
        memcpy(u, win, sizeof(float *) * nwp);
        if (comp_base) {
            memcpy(u + o_base, comp_base, sizeof(float *) * rows);
            memcpy(u + o_ncomp, n_comp, sizeof(int) * rows);
        }
        memcpy(u + o_nwin, n_win, sizeof(int) * rows);
        if (!sink_d) memcpy(u + o_sink, sink, sizeof(float) * n_heads);
        a->blob = 1;
        a->off_win = 0;
        a->off_base = comp_base ? (int)o_base : -1;
        a->off_nwin = (int)o_nwin;
        a->off_ncomp = (int)o_ncomp;
        a->off_sink = sink_d ? -1 : (int)o_sink;
        a->sink = sink_d; /* NULL: the blob's */
        a->l2pf = dsv4_cuda_l2pf;
        size_t cap = P->pb == 1 ? AB_SMALL : AB_LARGE; /* the launched prefix holds no stale bytes */
        memset(u + bytes, 0, cap - bytes);
    } else {
        a->win = (const float *const *)dsv4_cuda_stage(b, win, sizeof(float *) * nwp);
        a->n_win = (const int *)dsv4_cuda_stage(b, n_win, sizeof(int) * rows);
        if (comp_base) {
            a->comp_base = (const float *const *)dsv4_cuda_stage(b, comp_base, sizeof(float *) * rows);
            a->n_comp = (const int *)dsv4_cuda_stage(b, n_comp, sizeof(int) * rows);
        }
        a->sink = (const float *)dsv4_cuda_in(b, sink, sizeof(float) * n_heads);
    }
    free(hl); /* copied above (pageable copies are taken when cudaMemcpyAsync returns) */
    free(hnl);
    if (picks) {
        a->picks = (const int32_t *)dsv4_cuda_in(b, picks, sizeof(int32_t) * (size_t)rows * topk);
        a->n_picks = (const int *)dsv4_cuda_in(b, n_picks, sizeof(int) * rows);
    }
    a->out = (float *)dsv4_cuda_out(b, out, sizeof(float) * nq);
    a->sc = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rh * max_n);
    a->kp = (const float **)dsv4_cuda_scratch(b, sizeof(float *) * (size_t)rows * max_n);
    a->rown = (int *)dsv4_cuda_scratch(b, sizeof(int) * rows);
    a->sinkd = (float *)dsv4_cuda_scratch(b, sizeof(float) * n_heads);
    a->flags = dsv4_cuda_devflags(b);
    if (!a->q || (!P->pb && (!a->win || !a->n_win || (comp_base && (!a->comp_base || !a->n_comp)) || !a->sink)) ||
        (picks && (!a->picks || !a->n_picks)) || !a->out || !a->sc || !a->kp || !a->rown || !a->sinkd || !a->flags)
        return -1;
    a->max_win = max_win;
    a->topk = topk;
    a->n_heads = n_heads;
    a->head_dim = head_dim;
    a->max_n = max_n;
    a->prob_bf16 = prob_bf16;
    a->out_bf16 = out_bf16;
    a->scale = scale;
    P->smem = sizeof(float) * (size_t)(AS_KEYS + AS_HEADS) * head_dim;
    P->gs = dim3((unsigned)((max_n + AS_KEYS - 1) / AS_KEYS), (unsigned)((n_heads + AS_HEADS - 1) / AS_HEADS),
                 (unsigned)rows);
    P->gp = dim3((unsigned)((head_dim + AP_DIMS - 1) / AP_DIMS), (unsigned)((n_heads + AP_HEADS - 1) / AP_HEADS),
                 (unsigned)rows);
    return 0;
}

template <int VEC, int PB> static int attn_launch_scores(dsv4_backend *b, const attn_plan *P) {
    const attn_blob<PB> *blob = (const attn_blob<PB> *)P->blob.b; /* a prefix of the plan's blob */
    /* the 48 KB allowed without the opt-in hold the static shared memory too (kptr: 128 bytes): at
     * head_dim 384 the stage is exactly 48 KB and the launch failed without it (test_odd_shapes) */
    if (P->smem + sizeof(const float *) * AS_KEYS > 48 * 1024 &&
        CK(b, cudaFuncSetAttribute(k_attn_scores<VEC, PB>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)P->smem)))
        return -1;
    dsv4_launch(k_attn_scores<VEC, PB>, P->gs, ATTN_THREADS, P->smem, CI(b)->stream, P->a, *blob);
    return CKL(b);
}

/* launches the scores kernel (what & 1) and the p.V kernel (what & 2), the latter with the
 * inverse RoPE of its output in the epilogue when fr is given; 0 or -1 */
static int attn_launch(dsv4_backend *b, const attn_plan *P, int what, const fused_rope *fr = NULL) {
    static_assert(AB_LARGE >= AB_SMALL && AB_SMALL >= 16, "blob prefixes");
    if (what & 1) {
        int rc = P->vec4 ? (P->pb == 1 ? attn_launch_scores<4, AB_SMALL>(b, P)
                            : P->pb == 2 ? attn_launch_scores<4, AB_LARGE>(b, P)
                                         : attn_launch_scores<4, 16>(b, P))
                         : (P->pb == 1 ? attn_launch_scores<1, AB_SMALL>(b, P)
                            : P->pb == 2 ? attn_launch_scores<1, AB_LARGE>(b, P)
                                         : attn_launch_scores<1, 16>(b, P));
        if (rc) return -1;
    }
    if (what & 2) {
        fused_rope none;
        memset(&none, 0, sizeof none);
        const fused_rope &f = fr ? *fr : none;
        if (P->vec4)
            dsv4_launch(fr ? k_attn_pv<4, 1> : k_attn_pv<4, 0>, P->gp, ATTN_THREADS, 0, CI(b)->stream, P->a, f);
        else
            dsv4_launch(fr ? k_attn_pv<1, 1> : k_attn_pv<1, 0>, P->gp, ATTN_THREADS, 0, CI(b)->stream, P->a, f);
        if (CKL(b)) return -1;
    }
    return 0;
}

/* The rows one launch takes so that its scratch (the scores, rows x heads x the longest row's keys
 * floats, and the key pointers) stays within the backend's attn_sc_max: a long prefill at long
 * context needs GBs at once (512 rows x 64 heads x 8320 keys at 1M tokens: 1.1 GB), which a
 * device holding most of its memory in weights may not have.  Rows are independent and each row's
 * sums run in the same order whatever the launch (the scratch stride aside), so a cut call gives
 * the same bits (test_cuda_attn test_row_chunks) where every part takes the kernels the whole call
 * took: a part whose keys are all 16-byte aligned, of a call with an unaligned one elsewhere, takes
 * the float4 kernels instead (the forward pass's keys are all aligned). */
static int attn_rows_per_call(dsv4_backend *b, int rows, int n_heads, const int *n_win, int max_win,
                              const float *const *comp_base, const int *n_comp, const int32_t *picks, int topk) {
    int max_n = attn_max_keys(rows, n_win, max_win, comp_base, n_comp, picks, topk);
    size_t per_row = (size_t)max_n * (sizeof(float) * (size_t)n_heads + sizeof(float *));
    size_t per = CI(b)->attn_sc_max / per_row;
    return per < 1 ? 1 : per > (size_t)rows ? rows : (int)per;
}

extern "C" size_t dsv4_cuda_set_attn_scratch(dsv4_backend *b, size_t bytes) {
    size_t old = CI(b)->attn_sc_max;
    CI(b)->attn_sc_max = bytes;
    return old;
}
extern "C" long dsv4_cuda_attn_parts(dsv4_backend *b) { return CI(b)->attn_parts; }
extern "C" long dsv4_cuda_topk_w_calls(dsv4_backend *b) { return CI(b)->topk_w_calls; }

/* sparse_attn, and with rope_dim > 0 the inverse RoPE of its output in k_attn_pv's epilogue: one
 * launch pair per part of at most attn_rows_per_call rows (each part with its rows' positions) */
static void attn_op(dsv4_backend *b, float *out, const float *q, int rows, int n_heads, int head_dim,
                    const float *const *win, const int *n_win, int max_win, const float *const *comp_base,
                    const int *n_comp, const int32_t *picks, const int *n_picks, int topk, const float *sink,
                    float scale, int prob_bf16, int out_bf16, int rope_dim, const int64_t *pos, const double *freq) {
    int per = rows > 1 ? attn_rows_per_call(b, rows, n_heads, n_win, max_win, comp_base, n_comp, picks, topk) : rows;
    if (per < rows) {
        for (int r0 = 0; r0 < rows; r0 += per) {
            int n = rows - r0 < per ? rows - r0 : per;
            size_t o = (size_t)r0 * n_heads * head_dim;
            attn_op(b, out + o, q + o, n, n_heads, head_dim, win ? win + (size_t)r0 * max_win : NULL, n_win + r0,
                    max_win, comp_base ? comp_base + r0 : NULL, n_comp ? n_comp + r0 : NULL,
                    picks ? picks + (size_t)r0 * topk : NULL, n_picks ? n_picks + r0 : NULL, topk, sink, scale,
                    prob_bf16, out_bf16, rope_dim, pos ? pos + r0 : NULL, freq);
        }
        return;
    }
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || n_heads <= 0) return;
    CI(b)->attn_parts++;
    attn_plan plan; /* 12 KB on the stack: decode allocates nothing */
    attn_plan *P = &plan;
    fused_rope fr;
    memset(&fr, 0, sizeof fr);
    fr.rope_dim = rope_dim;
    fr.out_bf16 = out_bf16;
    if (!attn_setup(b, P, out, q, rows, n_heads, head_dim, win, n_win, max_win, comp_base, n_comp, picks, n_picks,
                    topk, sink, scale, prob_bf16, out_bf16) &&
        (!rope_dim || !rope_inputs(b, rows, rope_dim / 2, pos, freq, &fr.ra, &fr.pd, &fr.fd)) &&
        !attn_launch(b, P, 3, rope_dim ? &fr : NULL)) {
        dsv4_cuda_commit(b, out, P->a.out, sizeof(float) * (size_t)rows * n_heads * head_dim);
        dsv4_cuda_op_end(b, DSV4_CUDA_OP_SPARSE_ATTN);
    }
}

void cu_sparse_attn(dsv4_backend *b, float *out, const float *q, int rows, int n_heads, int head_dim,
                    const float *const *win, const int *n_win, int max_win, const float *const *comp_base,
                    const int *n_comp, const int32_t *picks, const int *n_picks, int topk, const float *sink,
                    float scale, int prob_bf16, int out_bf16) {
    attn_op(b, out, q, rows, n_heads, head_dim, win, n_win, max_win, comp_base, n_comp, picks, n_picks, topk, sink,
            scale, prob_bf16, out_bf16, 0, NULL, NULL);
}

void cu_rope(dsv4_backend *, float *, int, int, int, int, const int64_t *, const double *, int, int); /* norm.cu */

/* sparse_attn then rope(out, inverse) (backend.h): the rotation in k_attn_pv's epilogue, from
 * the output as sparse_attn rounds it, so one launch less and the same bits.  A head_dim or
 * rope_dim that is odd (a pair could straddle two p.V blocks), or no rope part: the two ops.
 * In profiles it counts as sparse_attn. */
void cu_sparse_attn_rope(dsv4_backend *b, float *out, const float *q, int rows, int n_heads, int head_dim,
                         const float *const *win, const int *n_win, int max_win, const float *const *comp_base,
                         const int *n_comp, const int32_t *picks, const int *n_picks, int topk, const float *sink,
                         float scale, int prob_bf16, int out_bf16, int rope_dim, const int64_t *pos,
                         const double *freq) {
    if (head_dim % 2 || rope_dim % 2 || rope_dim <= 0 || rope_dim > head_dim) {
        cu_sparse_attn(b, out, q, rows, n_heads, head_dim, win, n_win, max_win, comp_base, n_comp, picks, n_picks,
                       topk, sink, scale, prob_bf16, out_bf16);
        cu_rope(b, out, rows, n_heads, head_dim, rope_dim, pos, freq, 1, out_bf16);
        return;
    }
    attn_op(b, out, q, rows, n_heads, head_dim, win, n_win, max_win, comp_base, n_comp, picks, n_picks, topk, sink,
            scale, prob_bf16, out_bf16, rope_dim, pos, freq);
}

/* Test hook (tests/test_cuda_attn.c, DSV4_ATTN_BENCH, which declares it): sets up one
 * sparse_attn call with these arguments as the op does, waits, then times its kernels
 * without the op's host work or copies: `reps` launches captured into one CUDA graph,
 * timed by events around one launch of it (after a warm-up launch).  us[0]: scores + p.V,
 * us[1]: scores alone, us[2]: p.V alone, microseconds per call.  0 or -1. */
extern "C" int dsv4_cuda_attn_kernel_us(dsv4_backend *b, float *out, const float *q, int rows, int n_heads,
                                        int head_dim, const float *const *win, const int *n_win, int max_win,
                                        const float *const *comp_base, const int *n_comp, const int32_t *picks,
                                        const int *n_picks, int topk, const float *sink, float scale, int reps,
                                        double *us) {
    cuda_impl *c = CI(b);
    dsv4_cuda_op_begin(b);
    attn_plan plan;
    if (rows <= 0 || n_heads <= 0 || reps <= 0 ||
        attn_setup(b, &plan, out, q, rows, n_heads, head_dim, win, n_win, max_win, comp_base, n_comp, picks, n_picks,
                   topk, sink, scale, 0, 0) ||
        dsv4_cuda_sync(b))
        return -1;
    cudaEvent_t e0 = NULL, e1 = NULL;
    if (CK(b, cudaEventCreate(&e0)) || CK(b, cudaEventCreate(&e1))) return -1;
    int rc = 0;
    for (int w = 0; w < 3 && !rc; w++) { /* both first: p.V alone then reads its scores */
        cudaGraph_t g = NULL;
        cudaGraphExec_t x = NULL;
        rc = CK(b, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed));
        for (int i = 0; i < reps && !rc; i++) rc = attn_launch(b, &plan, w ? w : 3);
        cudaError_t ec = cudaStreamEndCapture(c->stream, &g); /* always ends the capture */
        if (!rc && ec != cudaSuccess) rc = dsv4_cuda_fail(b, "cudaStreamEndCapture", __FILE__, __LINE__, ec);
        if (!rc) rc = CK(b, cudaGraphInstantiate(&x, g, 0));
        float ms = 0;
        if (!rc)
            rc = CK(b, cudaGraphLaunch(x, c->stream)) || CK(b, cudaEventRecord(e0, c->stream)) ||
                 CK(b, cudaGraphLaunch(x, c->stream)) || CK(b, cudaEventRecord(e1, c->stream)) ||
                 CK(b, cudaEventSynchronize(e1)) || CK(b, cudaEventElapsedTime(&ms, e0, e1));
        if (!rc) us[w] = 1e3 * ms / reps;
        if (x) cudaGraphExecDestroy(x);
        if (g) cudaGraphDestroy(g);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return rc ? -1 : 0;
}

/* ----- indexer scores ----- */
/* Up to ROW_PARAMS rows, per-row bases and counts travel as a kernel parameter (no staged
 * copy); more rows stage them. */
#define ROW_PARAMS 32
struct row_params {
    const float *base[ROW_PARAMS];
    int n[ROW_PARAMS];
};

/* ----- indexer_scores_rs: rope(q) and scale(w) as the scores kernels load them -----
 * RS = 1 instances of the kernels below: each block forms its row's rope_dim / 2 cosines and
 * sines once (cosf / sinf of k_rope's angle) into shared memory, rotates the row's q there after
 * loading it (d_rope_rot_cs: k_rope's rounded products and sums, and its bf16 rounding), and
 * scales w as it loads it (k_scale's product and rounding), so the scores are those of the
 * three ops; q and w in memory are not written.  Shared memory: 2 * (rope_dim / 2) floats
 * more, after the kernel's own arrays. */
#define IX_RS_SMEM(fr) (sizeof(float) * (size_t)((fr).rope_dim / 2) * 2)

/* w[i] as scale(w, w_scale, out_bf16) leaves it (RS), else as stored */
template <int RS> __device__ __forceinline__ float ix_w(const float *w, int64_t i, const fused_rope &fr) {
    float v = w[i];
    if (!RS) return v;
    v = __fmul_rn(v, fr.w_scale);
    return fr.out_bf16 ? d_round_bf16(v) : v;
}

/* row r's cosines and sines into cs[0 .. half), sn[0 .. half) (the block's threads) */
__device__ __forceinline__ void ix_rope_angles(const fused_rope &fr, int r, float *cs, float *sn) {
    for (int i = threadIdx.x; i < fr.rope_dim / 2; i += blockDim.x) {
        float a = fr_angle(fr, r, i);
        cs[i] = cosf(a);
        sn[i] = sinf(a);
    }
}

/* the row's q in shared memory (n_heads x hd floats) rotated in place, every pair of every
 * head's last rope_dim dims as rope(inverse 0) rotates it; the caller syncs before and after */
__device__ __forceinline__ void ix_rope_q(float *qs, int n_heads, int hd, const fused_rope &fr, const float *cs,
                                          const float *sn, int ld = 0) {
    int half = fr.rope_dim / 2, off = hd - fr.rope_dim;
    if (!ld) ld = hd; /* floats from one head's q to the next (k_indexer_t pads its rows) */
    for (int t = threadIdx.x; t < n_heads * half; t += blockDim.x) {
        int h = t / half, i = t - h * half;
        float *p = qs + h * ld + off + 2 * i;
        float2 y = d_rope_rot_cs(p[0], p[1], cs[i], sn[i], fr.out_bf16);
        p[0] = y.x;
        p[1] = y.y;
    }
}

/* General kernel (any head_dim, any alignment): one warp per (row, key), q of the row in
 * shared memory; per head a warp dot, relu, weighted sum in head order.  RS: rope and scale
 * folded in (above). */
template <int RS>
__global__ void k_indexer(float *score, const float *q, const float *w, int n_heads, int head_dim,
                          const float *const *key_base, const int *n_keys, const __grid_constant__ row_params rp,
                          int max_keys, int score_bf16, const __grid_constant__ fused_rope fr) {
    pdl_enter();
    extern __shared__ float qs[];
    int r = blockIdx.y;
    int64_t nq = (int64_t)n_heads * head_dim;
    float *cs = qs + nq, *sn = cs + fr.rope_dim / 2; /* RS */
    if (RS) ix_rope_angles(fr, r, cs, sn);
    for (int64_t i = threadIdx.x; i < nq; i += blockDim.x) qs[i] = q[r * nq + i];
    __syncthreads();
    if (RS) {
        ix_rope_q(qs, n_heads, head_dim, fr, cs, sn);
        __syncthreads();
    }
    int lane = threadIdx.x & 31;
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int nk = key_base ? n_keys[r] : rp.n[r];
    if (j >= nk || j >= max_keys) return;
    const float *k = (key_base ? key_base[r] : rp.base[r]) + (int64_t)j * head_dim;
    float kr[8];
    int nd = (head_dim + 31) / 32;
#pragma unroll
    for (int t = 0; t < 8; t++) kr[t] = (t < nd && lane + 32 * t < head_dim) ? k[lane + 32 * t] : 0.0f;
    float s = 0.0f;
    for (int h = 0; h < n_heads; h++) {
        const float *qh = qs + (int64_t)h * head_dim;
        float a = 0.0f;
#pragma unroll
        for (int t = 0; t < 8; t++)
            if (t < nd && lane + 32 * t < head_dim) a += qh[lane + 32 * t] * kr[t];
        for (int d = lane + 256; d < head_dim; d += 32) a += qh[d] * k[d]; /* head_dim > 256 */
        a = warp_sum(a);
        if (a < 0) a = 0;
        float wh = ix_w<RS>(w, (int64_t)r * n_heads + h, fr);
        if (score_bf16) s += d_round_bf16(d_round_bf16(a) * wh); /* the sum rounded once, at the store */
        else s += a * wh;
    }
    if (lane == 0) score[(int64_t)r * max_keys + j] = score_bf16 ? d_round_bf16(s) : s;
}

/* Decode kernel (head_dim = 16 NV, q and key rows 16-byte aligned): IX_LANES lanes per key,
 * so a block of 256 threads scores 64 keys against one copy of q in shared memory (the
 * general kernel copied q once per 8 keys).  Lane quarter qt keeps float4s qt, qt + 4, ...
 * of its key in registers (the 4 lanes of a key read 64 contiguous bytes of q at a time:
 * no bank conflict, broadcast across keys); per head: its partial dot, two butterfly
 * shuffles (every lane of the key gets the same sum), relu, then the weighted sum in head
 * order exactly as the general kernel. */
#define IX_THREADS 256
#define IX_LANES 4
#define IX_KEYS (IX_THREADS / IX_LANES)
template <int NV, int RS>
__global__ void __launch_bounds__(IX_THREADS)
    k_indexer_v(float *score, const float *q, const float *w, int n_heads, const float *const *key_base,
                const int *n_keys, const __grid_constant__ row_params rp, int max_keys, int score_bf16,
                const __grid_constant__ fused_rope fr) {
    pdl_enter();
    extern __shared__ float4 ix_sm4[];
    const int hd = 16 * NV;
    float4 *qs = ix_sm4;                          /* [n_heads][hd / 4] */
    float *ws = (float *)(ix_sm4 + n_heads * (hd / 4)); /* [n_heads] */
    float *cs = ws + n_heads, *sn = cs + fr.rope_dim / 2; /* RS: [rope_dim / 2] each */
    int r = blockIdx.y, t = threadIdx.x, qt = t & (IX_LANES - 1);
    int nk = min(key_base ? n_keys[r] : rp.n[r], max_keys);
    if ((int)blockIdx.x * IX_KEYS >= nk) return; /* uniform over the block */
    int j = blockIdx.x * IX_KEYS + t / IX_LANES;
    const float *kb = key_base ? key_base[r] : rp.base[r];
    float4 kr[NV];
    const float4 *k = (const float4 *)(kb + (int64_t)(j < nk ? j : 0) * hd) + qt;
#pragma unroll
    for (int v = 0; v < NV; v++) kr[v] = j < nk ? __ldg(k + 4 * v) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4 *qg = (const float4 *)(q + (int64_t)r * n_heads * hd);
    if (RS) ix_rope_angles(fr, r, cs, sn);
    for (int i = t; i < n_heads * (hd / 4); i += blockDim.x) qs[i] = qg[i];
    for (int i = t; i < n_heads; i += blockDim.x) ws[i] = ix_w<RS>(w, (int64_t)r * n_heads + i, fr);
    __syncthreads();
    if (RS) {
        ix_rope_q((float *)qs, n_heads, hd, fr, cs, sn);
        __syncthreads();
    }
    float s = 0.0f;
#pragma unroll 4
    for (int h = 0; h < n_heads; h++) {
        const float4 *qh = qs + h * (hd / 4) + qt;
        float a = 0.0f;
#pragma unroll
        for (int v = 0; v < NV; v++) {
            float4 x = qh[4 * v];
            a += x.x * kr[v].x + x.y * kr[v].y + x.z * kr[v].z + x.w * kr[v].w;
        }
        a += __shfl_xor_sync(0xffffffffu, a, 1);
        a += __shfl_xor_sync(0xffffffffu, a, 2);
        if (a < 0) a = 0;
        float wh = ws[h];
        if (score_bf16) s += d_round_bf16(d_round_bf16(a) * wh); /* the sum rounded once, at the store */
        else s += a * wh;
    }
    if (qt == 0 && j < nk) score[(int64_t)r * max_keys + j] = score_bf16 ? d_round_bf16(s) : s;
}
static_assert(IX_LANES == 4, "k_indexer_v: two butterfly steps");

/* Decode kernel with keys spread over the grid (head_dim = 16 NV, q and key rows 16-byte
 * aligned): a block of IX_THREADS scores kb keys (4..64, a power of two chosen by the
 * host so that a batch-1 row of a few hundred keys still fills >= 128 blocks); the
 * IX_THREADS / (IX_LANES kb) = hg head groups of a key split its heads (head hg + hg_n i).
 * q of the row is copied into shared memory by cp.async (every 16-byte copy in flight at
 * once).  Lane quarter qt keeps float4s qt, qt + 4, ... of its key in registers; per head
 * its partial dot and two butterfly shuffles, relu; with one head group the thread sums
 * in head order itself, otherwise each relu'd dot goes to shared memory [key][head] and
 * one thread per key sums them in head order: the CPU's order of the weighted sum (and
 * its bf16 roundings) is kept whatever the split.  The host launches it for kb <= 32
 * (at kb = 64, one head group, k_indexer_v measured faster). */
template <int NV, int RS>
__global__ void __launch_bounds__(IX_THREADS)
    k_indexer_s(float *score, const float *q, const float *w, int n_heads, const float *const *key_base,
                const int *n_keys, const __grid_constant__ row_params rp, int max_keys, int score_bf16, int kb,
                const __grid_constant__ fused_rope fr) {
    pdl_enter();
    extern __shared__ float4 ix_sm4[];
    const int hd = 16 * NV;
    float4 *qs = ix_sm4;                                /* [n_heads][hd / 4] */
    float *ws = (float *)(ix_sm4 + n_heads * (hd / 4)); /* [n_heads] */
    float *dots = ws + n_heads;                         /* [kb][n_heads + 1] when hg_n > 1 */
    float *cs = dots + kb * (n_heads + 1), *sn = cs + fr.rope_dim / 2; /* RS: [rope_dim / 2] each */
    int r = blockIdx.y, t = threadIdx.x, qt = t & (IX_LANES - 1);
    int nk = min(key_base ? n_keys[r] : rp.n[r], max_keys);
    if ((int)blockIdx.x * kb >= nk) return; /* uniform over the block */
    int kk = (t / IX_LANES) & (kb - 1), hg = t / (IX_LANES * kb), hg_n = IX_THREADS / (IX_LANES * kb);
    int j = blockIdx.x * kb + kk;
    const float4 *qg = (const float4 *)(q + (int64_t)r * n_heads * hd);
    for (int i = t; i < n_heads * (hd / 4); i += IX_THREADS) d_cp_async16(qs + i, qg + i);
    for (int i = t; i < n_heads; i += IX_THREADS) ws[i] = ix_w<RS>(w, (int64_t)r * n_heads + i, fr);
    if (RS) ix_rope_angles(fr, r, cs, sn);
    const float *kbase = key_base ? key_base[r] : rp.base[r];
    float4 kr[NV];
    const float4 *k = (const float4 *)(kbase + (int64_t)(j < nk ? j : 0) * hd) + qt;
#pragma unroll
    for (int v = 0; v < NV; v++) kr[v] = j < nk ? __ldg(k + 4 * v) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    attn_cp_wait();
    __syncthreads();
    if (RS) {
        ix_rope_q((float *)qs, n_heads, hd, fr, cs, sn);
        __syncthreads();
    }
    /* the 4 lanes of a key (head groups of one warp may run different head counts) */
    unsigned gmask = 0xfu << (t & 28);
    float s = 0.0f;
#pragma unroll 4
    for (int h = hg; h < n_heads; h += hg_n) {
        const float4 *qh = qs + h * (hd / 4) + qt;
        float a = 0.0f;
#pragma unroll
        for (int v = 0; v < NV; v++) {
            float4 x = qh[4 * v];
            a += x.x * kr[v].x + x.y * kr[v].y + x.z * kr[v].z + x.w * kr[v].w;
        }
        a += __shfl_xor_sync(gmask, a, 1);
        a += __shfl_xor_sync(gmask, a, 2);
        if (a < 0) a = 0;
        if (hg_n > 1) {
            if (qt == 0) dots[kk * (n_heads + 1) + h] = a;
        } else {
            float wh = ws[h];
            if (score_bf16) s += d_round_bf16(d_round_bf16(a) * wh); /* the sum rounded once, at the store */
            else s += a * wh;
        }
    }
    if (hg_n > 1) {
        __syncthreads();
        if (t >= kb) return;
        j = blockIdx.x * kb + t;
        const float *dk = dots + t * (n_heads + 1);
#pragma unroll 8
        for (int h = 0; h < n_heads; h++) {
            float a = dk[h], wh = ws[h];
            if (score_bf16) s += d_round_bf16(d_round_bf16(a) * wh); /* the sum rounded once, at the store */
            else s += a * wh;
        }
        if (j < nk) score[(int64_t)r * max_keys + j] = score_bf16 ? d_round_bf16(s) : s;
    } else if (qt == 0 && j < nk) {
        score[(int64_t)r * max_keys + j] = score_bf16 ? d_round_bf16(s) : s;
    }
}

/* Decode kernel for rows of many keys (64 heads, head_dim a multiple of 4 up to 256, q and key
 * rows 16-byte aligned): a block of IX_THREADS scores KT keys (16, 32 or 64) of one row as a small
 * fp32 GEMM tile, 64 heads x KT keys.  q of the row and the block's keys are copied into shared
 * memory (cp.async, rows padded by 4 floats so that the float4 reads of 16 consecutive keys fall
 * on distinct banks); thread (hy = t / 16, kx = t % 16) holds the dots of heads hy + 16 i (i < 4)
 * with keys kx + 16 m (m < KT / 16), each one fma chain over the dims in ascending order, so
 * every float4 of q read from shared memory feeds KT / 4 fmas and every float4 of a key 16
 * (k_indexer_v: 4 fmas per float4 of q; it took ~33 us a call at 8192 keys in the decode trace
 * of 2026-12-02 05:54Z, this kernel ~13-15 us, neither explained by counters yet).  The relu'd dots meet in shared memory [key][head] and one
 * thread per key forms the weighted sum in head order with k_indexer_s's expressions (its
 * bf16 roundings too): only the order inside each dot product differs from the other kernels.
 * RS as k_indexer_s (the rotation on the padded rows: same arithmetic). */
#define IXT_HEADS 64
#define IXT_PAD 4
#define IXT_SMEM(hd, kt) (sizeof(float) * ((size_t)(IXT_HEADS + (kt)) * ((hd) + IXT_PAD) + (size_t)(kt) * (IXT_HEADS + 1) + IXT_HEADS))
template <int KT, int RS>
__global__ void __launch_bounds__(IX_THREADS)
    k_indexer_t(float *score, const float *q, const float *w, int hd, const float *const *key_base, const int *n_keys,
                const __grid_constant__ row_params rp, int max_keys, int score_bf16,
                const __grid_constant__ fused_rope fr) {
    constexpr int M = KT / 16;
    static_assert(KT == 16 || KT == 32 || KT == 64, "k_indexer_t: 16, 32 or 64 keys a block");
    pdl_enter();
    extern __shared__ float4 ix_sm4[];
    const int ld = hd + IXT_PAD, nv4 = hd / 4;
    float *qs = (float *)ix_sm4;              /* [64][ld] */
    float *ks = qs + IXT_HEADS * ld;          /* [KT][ld] */
    float *red = ks + KT * ld;                /* [KT][65]: relu'd dots */
    float *ws = red + KT * (IXT_HEADS + 1);   /* [64] */
    float *cs = ws + IXT_HEADS, *sn = cs + fr.rope_dim / 2; /* RS: [rope_dim / 2] each */
    int r = blockIdx.y, t = threadIdx.x;
    int nk = min(key_base ? n_keys[r] : rp.n[r], max_keys);
    int j0 = blockIdx.x * KT;
    if (j0 >= nk) return; /* uniform over the block */
    const float *qg = q + (int64_t)r * IXT_HEADS * hd;
    for (int i = t; i < IXT_HEADS * nv4; i += IX_THREADS) {
        int h = i / nv4, c = i - h * nv4;
        d_cp_async16(qs + h * ld + 4 * c, qg + (int64_t)h * hd + 4 * c);
    }
    const float *kb = (key_base ? key_base[r] : rp.base[r]) + (int64_t)j0 * hd;
    int nkb = min(KT, nk - j0); /* keys of this block; rows past them are zero */
    for (int i = t; i < KT * nv4; i += IX_THREADS) {
        int jj = i / nv4, c = i - jj * nv4;
        if (jj < nkb) d_cp_async16(ks + jj * ld + 4 * c, kb + (int64_t)jj * hd + 4 * c);
        else *(float4 *)(ks + jj * ld + 4 * c) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    for (int i = t; i < IXT_HEADS; i += IX_THREADS) ws[i] = ix_w<RS>(w, (int64_t)r * IXT_HEADS + i, fr);
    if (RS) ix_rope_angles(fr, r, cs, sn);
    attn_cp_wait();
    __syncthreads();
    if (RS) {
        ix_rope_q(qs, IXT_HEADS, hd, fr, cs, sn, ld);
        __syncthreads();
    }
    int hy = t >> 4, kx = t & 15;
    float acc[4][M];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[i][m] = 0.0f;
    const float4 *qp = (const float4 *)(qs + hy * ld), *kp = (const float4 *)(ks + kx * ld);
    const int step = 16 * ld / 4; /* float4s from head (key) hy + 16 i to hy + 16 (i + 1) */
#pragma unroll 2
    for (int c = 0; c < nv4; c++) {
        float4 a[4], b[M];
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = qp[i * step + c];
#pragma unroll
        for (int m = 0; m < M; m++) b[m] = kp[m * step + c];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int m = 0; m < M; m++) {
                float v = acc[i][m];
                v = fmaf(a[i].x, b[m].x, v);
                v = fmaf(a[i].y, b[m].y, v);
                v = fmaf(a[i].z, b[m].z, v);
                acc[i][m] = fmaf(a[i].w, b[m].w, v);
            }
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int m = 0; m < M; m++) {
            float a = acc[i][m];
            if (a < 0) a = 0;
            red[(kx + 16 * m) * (IXT_HEADS + 1) + hy + 16 * i] = a;
        }
    __syncthreads();
    if (t >= nkb) return;
    const float *dk = red + t * (IXT_HEADS + 1);
    float s = 0.0f;
#pragma unroll 8
    for (int h = 0; h < IXT_HEADS; h++) {
        float a = dk[h], wh = ws[h];
        if (score_bf16) s += d_round_bf16(d_round_bf16(a) * wh); /* the sum rounded once, at the store */
        else s += a * wh;
    }
    score[(int64_t)r * max_keys + j0 + t] = score_bf16 ? d_round_bf16(s) : s;
}

/* an integer switch (the caller reads it once): the variable's value when it is one of
 * ok[0 .. n) (n 0: any value above 0), else dflt */
static int env_choice(const char *name, int dflt, const int *ok, int n) {
    const char *e = getenv(name);
    if (!e || !*e) return dflt;
    int v = atoi(e);
    if (!n) return v > 0 ? v : dflt;
    for (int i = 0; i < n; i++)
        if (v == ok[i]) return v;
    return dflt;
}

/* the smallest keys-per-block at which indexer_scores takes k_indexer_t (DSV4_CUDA_IX_TILE=N,
 * read once: 16, 32 or 64; 4 also below 16, at 16 keys a block, for A/B runs; 0 never),
 * default 32.  H200, one CUDA graph of 100 calls each (test_cuda_attn's bench, 2026-12-02
 * 06:14Z), us per call, k_indexer_t against the kernel it replaces: 8192 keys 8.5 (64 a block)
 * / 12.7 (k_indexer_v), rows 4 x 8192 24.6 / 42.0, 4100 keys 6.5 (32) / 8.6 (k_indexer_s),
 * rows 8 x 516 8.0 (32) / 12.6, but 2052 keys 6.2 (16) / 5.6: slower at 16 keys a block. */
static int ix_tile_min(void) {
    static const int ok[] = {0, 4, 16, 32, 64};
    static int v = -1;
    if (v < 0) v = env_choice("DSV4_CUDA_IX_TILE", 32, ok, 5);
    return v;
}

/* the most keys a block of the indexer takes (DSV4_CUDA_IX_KBMAX=N, read once: 4..64, a power
 * of two; default 64), for A/B runs of the block size at long contexts */
static int ix_kb_max(void) {
    static const int ok[] = {4, 8, 16, 32, 64};
    static int v = -1;
    if (v < 0) v = env_choice("DSV4_CUDA_IX_KBMAX", 64, ok, 5);
    return v;
}

/* the indexer kernels' signatures (k_indexer_t and k_indexer_v share one), and their launch:
 * the dynamic shared memory allowed, then dsv4_launch; 1 on a CUDA error (recorded) */
typedef void (*ixt_fn)(float *, const float *, const float *, int, const float *const *, const int *,
                       const row_params, int, int, const fused_rope);
typedef void (*ixs_fn)(float *, const float *, const float *, int, const float *const *, const int *,
                       const row_params, int, int, int, const fused_rope);
template <typename... P, typename... A>
static int ix_go(dsv4_backend *b, void (*k)(P...), dim3 grid, int threads, size_t sm, A &&...args) {
    if (CK(b, cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm))) return 1;
    dsv4_launch(k, grid, threads, sm, CI(b)->stream, static_cast<A &&>(args)...);
    return 0;
}

/* indexer_scores, and with fr (its positions and frequencies still to be filled from pos and
 * freq) indexer_scores_rs: the RS instances of the same kernels */
static void indexer_scores(dsv4_backend *b, float *score, const float *q, const float *w, int rows, int n_heads,
                           int head_dim, const float *const *key_base, const int *n_keys, int max_keys, int score_bf16,
                           fused_rope *fr, const int64_t *pos, const double *freq) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0) return;
    cuda_impl *c = CI(b);
    fused_rope none;
    memset(&none, 0, sizeof none);
    if (fr && fr->rope_dim && rope_inputs(b, rows, fr->rope_dim / 2, pos, freq, &fr->ra, &fr->pd, &fr->fd)) return;
    const fused_rope &f = fr ? *fr : none;
    size_t rs_sm = IX_RS_SMEM(f); /* 0 without RS */
    size_t smem = sizeof(float) * (size_t)n_heads * head_dim;
    if (smem > 200 * 1024) {
        dsv4_cuda_fail(b, "indexer: q of one row exceeds 200 KB of shared memory", __FILE__, __LINE__, cudaSuccess);
        return;
    }
    int maxn = 0, all_dev = 1, hint = -1;
    for (int r = 0; r < rows; r++) {
        int n = n_keys[r] < max_keys ? n_keys[r] : max_keys;
        if (n > maxn) maxn = n;
        if (n > 0 && !dev_span(c, key_base[r], sizeof(float) * (size_t)n * head_dim, &hint)) all_dev = 0;
    }
    const float **kb = NULL;
    if (!all_dev) { /* slow path (op tests): every row's key block copied through pinned memory */
        kb = (const float **)malloc(sizeof(float *) * rows);
        size_t *at = (size_t *)malloc(sizeof(size_t) * rows);
        if (!kb || !at) {
            free(kb), free(at);
            dsv4_cuda_fail(b, "indexer: out of host memory", __FILE__, __LINE__, cudaSuccess);
            return;
        }
        size_t total = 0;
        for (int r = 0; r < rows; r++) {
            at[r] = total;
            total += n_keys[r] > 0 ? (size_t)n_keys[r] * head_dim : 0;
        }
        float *h = (float *)dsv4_cuda_hbuf(b, sizeof(float) * (total ? total : 1));
        float *d = NULL;
        if (h) {
            int bad = 0;
            for (int r = 0; r < rows && !bad; r++) {
                size_t nb = n_keys[r] > 0 ? sizeof(float) * (size_t)n_keys[r] * head_dim : 0;
                if (!nb) continue;
                if (dsv4_cuda_is_dev(b, key_base[r]))
                    bad = CK(b, cudaMemcpyAsync(h + at[r], key_base[r], nb, cudaMemcpyDeviceToHost, c->stream));
                else
                    memcpy(h + at[r], key_base[r], nb);
            }
            if (!bad && !dsv4_cuda_sync(b))
                d = (float *)dsv4_cuda_stage(b, h, sizeof(float) * (total ? total : 1));
        }
        if (d)
            for (int r = 0; r < rows; r++) kb[r] = d + at[r];
        free(at);
        if (!d) {
            free(kb);
            return;
        }
        key_base = kb;
    }
    row_params rp;
    memset(&rp, 0, sizeof rp);
    const float *const *kd = NULL;
    const int *nd = NULL;
    if (rows <= ROW_PARAMS) {
        for (int r = 0; r < rows; r++) rp.base[r] = key_base[r], rp.n[r] = n_keys[r];
    } else {
        kd = (const float *const *)dsv4_cuda_stage(b, key_base, sizeof(float *) * rows);
        nd = (const int *)dsv4_cuda_stage(b, n_keys, sizeof(int) * rows);
    }
    int nv = head_dim % 16 == 0 ? head_dim / 16 : 0, vec = nv == 2 || nv == 4 || nv == 8 || nv == 16;
    for (int r = 0; r < rows && vec; r++) vec = ((uintptr_t)key_base[r] & 15) == 0;
    free(kb);
    float *qd = (float *)dsv4_cuda_in(b, q, sizeof(float) * rows * n_heads * head_dim);
    float *wd = (float *)dsv4_cuda_in(b, w, sizeof(float) * rows * n_heads);
    int dev_out = dsv4_cuda_is_dev(b, score);
    /* device scores are written in place (only j < n_keys[r]); host ones go through scratch */
    float *sd = dev_out ? score : (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rows * (max_keys > 0 ? max_keys : 1));
    if ((rows > ROW_PARAMS && (!kd || !nd)) || !qd || !wd || !sd) return;
    vec = vec && ((uintptr_t)qd & 15) == 0;
    if (maxn > 0) {
        /* keys per block: the largest power of two in 4..64 that still gives >= 128 blocks.
         * From ix_tile_min() (32) on, with 64 heads, the tile kernel; below it the split kernel;
         * other shapes at 64 k_indexer_v (faster there than the split kernel: 13.0 against
         * 15.9 us at 8192 keys, H200) */
        int kb = ix_kb_max();
        while (kb > 4 && (long)((maxn + kb - 1) / kb) * rows < 128) kb /= 2;
        size_t sm = smem + sizeof(float) * n_heads + sizeof(float) * (size_t)kb * (n_heads + 1) + rs_sm;
        if (sm > 220 * 1024) kb = 64; /* no room for the dots */
        int tmin = ix_tile_min(), rsi = fr ? 1 : 0, nvi = nv == 2 ? 0 : nv == 4 ? 1 : nv == 8 ? 2 : 3;
        size_t smt = IXT_SMEM(head_dim, kb < 16 ? 16 : kb) + rs_sm;
        if (vec && n_heads == IXT_HEADS && head_dim % 4 == 0 && tmin && kb >= tmin && smt <= 220 * 1024) {
            if (kb < 16) kb = 16; /* DSV4_CUDA_IX_TILE=4 */
            static ixt_fn const kt[3][2] = {{k_indexer_t<16, 0>, k_indexer_t<16, 1>},
                                            {k_indexer_t<32, 0>, k_indexer_t<32, 1>},
                                            {k_indexer_t<64, 0>, k_indexer_t<64, 1>}};
            if (ix_go(b, kt[kb == 16 ? 0 : kb == 32 ? 1 : 2][rsi], dim3((unsigned)((maxn + kb - 1) / kb), (unsigned)rows),
                      IX_THREADS, smt, sd, qd, wd, head_dim, kd, nd, rp, max_keys, score_bf16, f))
                return;
        } else if (vec && kb < 64) {
            static ixs_fn const ks[4][2] = {{k_indexer_s<2, 0>, k_indexer_s<2, 1>}, {k_indexer_s<4, 0>, k_indexer_s<4, 1>},
                                            {k_indexer_s<8, 0>, k_indexer_s<8, 1>},
                                            {k_indexer_s<16, 0>, k_indexer_s<16, 1>}};
            if (ix_go(b, ks[nvi][rsi], dim3((unsigned)((maxn + kb - 1) / kb), (unsigned)rows), IX_THREADS, sm, sd, qd,
                      wd, n_heads, kd, nd, rp, max_keys, score_bf16, kb, f))
                return;
        } else if (vec) {
            static ixt_fn const kv[4][2] = {{k_indexer_v<2, 0>, k_indexer_v<2, 1>}, {k_indexer_v<4, 0>, k_indexer_v<4, 1>},
                                            {k_indexer_v<8, 0>, k_indexer_v<8, 1>},
                                            {k_indexer_v<16, 0>, k_indexer_v<16, 1>}};
            if (ix_go(b, kv[nvi][rsi], dim3((unsigned)((maxn + IX_KEYS - 1) / IX_KEYS), (unsigned)rows), IX_THREADS,
                      smem + sizeof(float) * n_heads + rs_sm, sd, qd, wd, n_heads, kd, nd, rp, max_keys, score_bf16, f))
                return;
        } else if (ix_go(b, fr ? k_indexer<1> : k_indexer<0>, dim3((unsigned)((maxn + 7) / 8), (unsigned)rows), 256,
                         smem + rs_sm, sd, qd, wd, n_heads, head_dim, kd, nd, rp, max_keys, score_bf16, f)) {
            return;
        }
        if (CKL(b)) return;
    }
    if (!dev_out) {
        if (rows <= 24) { /* one queued copy per row */
            for (int r = 0; r < rows; r++)
                if (n_keys[r] > 0)
                    dsv4_cuda_fetch(b, score + (size_t)r * max_keys, sd + (size_t)r * max_keys,
                                    sizeof(float) * n_keys[r]);
        } else {
            dsv4_cuda_seg_end(b); /* copies into pageable memory: not capturable */
            for (int r = 0; r < rows && !c->failed; r++)
                if (n_keys[r] > 0)
                    CK(b, cudaMemcpyAsync(score + (size_t)r * max_keys, sd + (size_t)r * max_keys,
                                          sizeof(float) * n_keys[r], cudaMemcpyDeviceToHost, c->stream));
            dsv4_cuda_sync(b);
        }
    }
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_INDEXER);
}

void cu_indexer_scores(dsv4_backend *b, float *score, const float *q, const float *w, int rows, int n_heads,
                       int head_dim, const float *const *key_base, const int *n_keys, int max_keys, int score_bf16) {
    indexer_scores(b, score, q, w, rows, n_heads, head_dim, key_base, n_keys, max_keys, score_bf16, NULL, NULL, NULL);
}

/* rope(q), scale(w), then indexer_scores (backend.h), in the scores kernel: the same bits, q
 * and w not written, two launches less.  The pairs are k_rope's for any rope_dim <= head_dim
 * (odd: the last dim stays; < 2: none).  In profiles it counts as indexer_scores. */
void cu_indexer_scores_rs(dsv4_backend *b, float *score, const float *q, const float *w, int rows, int n_heads,
                          int head_dim, const float *const *key_base, const int *n_keys, int max_keys, int score_bf16,
                          int rope_dim, const int64_t *pos, const double *freq, float w_scale, int out_bf16) {
    if (rope_dim > head_dim) { /* rope would reach into the previous head: not a shape of the model */
        dsv4_cuda_op_begin(b);
        dsv4_cuda_fail(b, "indexer_scores_rs: rope_dim above head_dim", __FILE__, __LINE__, cudaSuccess);
        return;
    }
    fused_rope fr;
    memset(&fr, 0, sizeof fr);
    fr.rope_dim = rope_dim < 2 ? 0 : rope_dim;
    fr.out_bf16 = out_bf16;
    fr.w_scale = w_scale;
    indexer_scores(b, score, q, w, rows, n_heads, head_dim, key_base, n_keys, max_keys, score_bf16, &fr, pos, freq);
}

/* ----- top-k ----- */
/* One block per row, radix select: scores map to order-preserving 32-bit keys (-0 as +0,
 * NaN above +inf), four 8-bit passes (a histogram of the entries that match the bits
 * found so far, warp-aggregated shared atomics; warp 0 finds the digit holding the k-th
 * largest) give the k-th largest key T and how many entries equal to T to take; a block
 * scan then writes, in ascending index order, every entry above T and the first `need`
 * entries equal to T: the entries of the CPU's order (value descending, ties to the lower
 * index), for any n.  Integer counts only: the result does not depend on timing. */
#define TK_THREADS 1024

__device__ __forceinline__ uint32_t tk_key(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu; /* NaN */
    if ((u & 0x7fffffffu) == 0) return 0x80000000u;          /* -0 == +0 */
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* exclusive block scan of x (blockDim.x = TK_THREADS); *total = the block's sum.  Unsigned: the
 * callers pack two counts as lo | hi << 16, and k_topk_s's hi field (entries equal to the cut,
 * up to TK_SMAX) passes 32767, which made the int sum negative and the field read back by an
 * arithmetic shift negative (an index before the row's output). */
__device__ __forceinline__ unsigned tk_scan(unsigned x, unsigned *wsum, unsigned *total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned inc = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        unsigned y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == 31) wsum[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        unsigned v = wsum[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            unsigned y = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += y;
        }
        wsum[lane] = v;
    }
    __syncthreads();
    unsigned off = warp ? wsum[warp - 1] : 0u;
    *total = wsum[31];
    __syncthreads(); /* wsum is reused by the next call */
    return off + inc - x;
}

/* The last step of a top-k block over one run of blockDim.x entries, entry i this thread's: gt, it
 * lies above the cut; eq, at it.  It goes after every earlier entry above the cut and, at the cut,
 * only the first `need` of them are taken (the lower indices, the CPU's choice); the bases carry
 * the counts of earlier runs. */
__device__ __forceinline__ void tk_place(int32_t *ir, int i, int gt, int eq, int need, unsigned *wsum, int *gt_base,
                                         int *eq_base) {
    unsigned tot, ex = tk_scan((unsigned)gt | (unsigned)eq << 16, wsum, &tot); /* <= 1024 a field */
    int eb = *eq_base + (int)(ex >> 16);
    if (gt || (eq && eb < need)) ir[*gt_base + (int)(ex & 0xffffu) + min(eb, need)] = i;
    *gt_base += (int)(tot & 0xffffu);
    *eq_base += (int)(tot >> 16);
}

/* Warp 0 of a top-k block, after a radix pass's histogram: the digit (255 down) that holds the
 * need-th largest remaining entry.  Lane l holds digits 8l .. 8l+7 and the count above them by a
 * suffix scan; the lane whose digits contain it writes *s_prefix = prefix | digit << shift,
 * *s_need = what is still needed inside that digit and, when s_done is given, whether the
 * digit's entries are exactly that many. */
__device__ __forceinline__ void tk_pick_digit(const int *hist, int lane, int need, uint32_t prefix, int shift,
                                              uint32_t *s_prefix, int *s_need, int *s_done) {
    int c8[8], tot = 0;
#pragma unroll
    for (int d = 0; d < 8; d++) tot += (c8[d] = hist[lane * 8 + d]);
    int incl = tot;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_down_sync(0xffffffffu, incl, o);
        if (lane + o < 32) incl += y;
    }
    int above = incl - tot;
    if (above < need && need <= incl) {
        int acc = above;
        for (int d = 7; d >= 0; d--) {
            if (acc + c8[d] >= need) {
                *s_prefix = prefix | ((uint32_t)(lane * 8 + d) << shift);
                *s_need = need - acc;
                if (s_done) *s_done = acc + c8[d] == need;
                break;
            }
            acc += c8[d];
        }
    }
}

/* counts digit dg (256: none) of this thread's entry into hist: one shared atomic per distinct
 * digit of the warp (every lane of the warp calls it) */
__device__ __forceinline__ void tk_hist_add(int *hist, int dg, int lane) {
    unsigned grp = __match_any_sync(0xffffffffu, dg);
    if (dg < 256 && lane == __ffs(grp) - 1) atomicAdd(&hist[dg], __popc(grp));
}

/* the end of a radix pass (after the histogram): warp 0 finds the digit (tk_pick_digit; s_done
 * NULL for k_topk, which runs every pass), then every thread takes the new prefix and need */
__device__ __forceinline__ void tk_pass_end(const int *hist, int warp, int lane, int shift, uint32_t &prefix,
                                            int &need, uint32_t *s_prefix, int *s_need, int *s_done) {
    __syncthreads();
    if (warp == 0) tk_pick_digit(hist, lane, need, prefix, shift, s_prefix, s_need, s_done);
    __syncthreads();
    prefix = *s_prefix;
    need = *s_need;
}

/* a row of nr <= k entries takes every one, in order (ir: its k slots); 1 if so */
__device__ __forceinline__ int tk_whole(int32_t *ir, int *n_out, int r, int nr, int k) {
    if (nr > k) return 0;
    for (int i = threadIdx.x; i < nr; i += blockDim.x) ir[i] = i;
    if (threadIdx.x == 0) n_out[r] = nr;
    return 1;
}

/* The placement of k_topk_s / k_topk_w, whose threads own contiguous runs of entries: tk_run_bases turns a run's
 * counts above the cut (gt) and at it (eq) into *g / *e, the counts of the runs before it (one block scan; the sums
 * over the block must stay below 2^16 a field), and tk_put places the run's entry i of masked key km in index order:
 * after every earlier entry above the cut and, at the cut, only the first `need` of them (the lower indices). */
__device__ __forceinline__ void tk_run_bases(int gt, int eq, unsigned *wsum, int *g, int *e) {
    unsigned utot, ex = tk_scan((unsigned)gt | (unsigned)eq << 16, wsum, &utot);
    *g = (int)(ex & 0xffffu), *e = (int)(ex >> 16);
}
__device__ __forceinline__ void tk_put(int32_t *ir, uint32_t km, uint32_t prefix, int need, int i, int &g, int &e) {
    if (km > prefix) ir[g++ + min(e, need)] = i;
    else if (km == prefix) {
        if (e < need) ir[g + e] = i;
        e++;
    }
}

__global__ void __launch_bounds__(TK_THREADS) k_topk(int32_t *idx, int *n_out, const float *score, int stride,
                                                     const int *n, const __grid_constant__ row_params rp, int k) {
    pdl_enter();
    __shared__ int hist[256];
    __shared__ unsigned wsum[32];
    __shared__ int s_need;
    __shared__ uint32_t s_prefix;
    int r = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    int nr = n ? n[r] : rp.n[r];
    const float *s = score + (int64_t)r * stride;
    int32_t *ir = idx + (int64_t)r * k;
    if (tk_whole(ir, n_out, r, nr, k)) return;
    uint32_t prefix = 0;
    int need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        uint32_t hmask = shift == 24 ? 0u : ~0u << (shift + 8);
        if (t < 256) hist[t] = 0;
        __syncthreads();
        for (int base = 0; base < nr; base += blockDim.x) { /* uniform trip count: shuffles below */
            int i = base + t;
            uint32_t key = i < nr ? tk_key(s[i]) : 0u;
            int dg = (i < nr && (key & hmask) == prefix) ? (int)((key >> shift) & 255u) : 256;
            tk_hist_add(hist, dg, lane);
        }
        tk_pass_end(hist, warp, lane, shift, prefix, need, &s_prefix, &s_need, NULL);
    }
    /* prefix = T: take every key > T and the first `need` keys == T, in index order */
    int gt_base = 0, eq_base = 0;
    for (int base = 0; base < nr; base += blockDim.x) {
        int i = base + t;
        uint32_t key = i < nr ? tk_key(s[i]) : 0u;
        tk_place(ir, i, i < nr && key > prefix, i < nr && key == prefix, need, wsum, &gt_base, &eq_base);
    }
    if (t == 0) n_out[r] = k;
}

/* Rows of n <= TK_THREADS PER (the decode case: a few hundred to 8192 candidates at PER = TK_PER): the
 * same selection with each thread's keys (entries t + TK_THREADS u) read once into
 * registers, and the radix passes stop as soon as the digit holding the k-th largest is
 * taken whole (its count equals what is still needed): then every entry whose determined
 * bits are above the prefix and every one equal to it is taken, the same set as after all
 * four passes.  Output as k_topk (ascending index order).  PER 16 (stop 59's DSV4_CUDA_TOPK_R16=1, rows of
 * 8193..16384 entries) ran in stop 61 on an H200: the same ids as the CPU in every case of its test, but the
 * top-k alone at 8198 entries took 21.7 us a call against k_topk_s's 18.2 (per op, synchronised each) and the
 * 20-layer greedy step at 32K 3.06 against 3.04 ms (one round), so it was removed for k_topk_w below. */
#define TK_PER 8
template <int PER>
__global__ void __launch_bounds__(TK_THREADS) k_topk_r(int32_t *idx, int *n_out, const float *score, int stride,
                                                       const int *n, const __grid_constant__ row_params rp, int k) {
    pdl_enter();
    __shared__ int hist[256];
    __shared__ unsigned wsum[32];
    __shared__ int s_need, s_done;
    __shared__ uint32_t s_prefix;
    int r = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    int nr = n ? n[r] : rp.n[r];
    const float *s = score + (int64_t)r * stride;
    int32_t *ir = idx + (int64_t)r * k;
    if (tk_whole(ir, n_out, r, nr, k)) return;
    int nu = (nr + TK_THREADS - 1) / TK_THREADS; /* <= PER, uniform */
    uint32_t key[PER];
#pragma unroll
    for (int u = 0; u < PER; u++) {
        int i = u * TK_THREADS + t;
        key[u] = u < nu && i < nr ? tk_key(s[i]) : 0u;
    }
    uint32_t prefix = 0, mask = 0;
    int need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (t < 256) hist[t] = 0;
        __syncthreads();
#pragma unroll
        for (int u = 0; u < PER; u++) {
            if (u >= nu) break; /* uniform */
            int i = u * TK_THREADS + t;
            int dg = (i < nr && (key[u] & mask) == prefix) ? (int)((key[u] >> shift) & 255u) : 256;
            tk_hist_add(hist, dg, lane);
        }
        /* s_done: the digit's entries are all taken (read after tk_pass_end's second barrier) */
        tk_pass_end(hist, warp, lane, shift, prefix, need, &s_prefix, &s_need, &s_done);
        mask |= 255u << shift;
        if (s_done) break; /* uniform */
    }
    /* take every key whose determined bits are above the prefix and the first `need` equal
     * to it, in index order (after an early stop all of the equal ones: need = their count) */
    int gt_base = 0, eq_base = 0;
#pragma unroll
    for (int u = 0; u < PER; u++) {
        if (u >= nu) break;
        int i = u * TK_THREADS + t;
        uint32_t km = key[u] & mask;
        tk_place(ir, i, i < nr && km > prefix, i < nr && km == prefix, need, wsum, &gt_base, &eq_base);
    }
    if (t == 0) n_out[r] = k;
}

/* k_topk_w<PER> (built in stop 61; the default for rows of 8193..16384 entries since stop 62, DSV4_CUDA_TOPK_W=0
 * off, =2 for every row up to 16384, where it is slower than k_topk_r at 516): rows of up to TK_THREADS PER entries
 * (PER 8 or 16) with each thread's keys a contiguous run of entries in registers, and neither the per-entry
 * __match_any_sync nor the per-1024-entry block scans of k_topk_r.  Why: one block on one SM selects a row,
 * and the H200's 32K greedy trace (stop 61) put k_topk_s at 25.8 us a call, 12.3 of them exposed, 111 us a
 * step in all (k_topk_r at 2K: 28.9), the largest part of what 32K adds to the step.
 *   - Three radix passes of 11, 11 and 10 bits (2048, 2048 and 1024 shared bins) instead of up to four of 8,
 *     each entry counted by a plain shared atomicAdd; a thread first merges its run's equal digits (so a row
 *     of equal values costs one add a thread, not one a key).
 *   - The bin holding the need-th largest: every thread takes 2 (1) bins from the top and one block scan
 *     gives each the count above them, where k_topk_r's warp 0 walks 256 bins alone.
 *   - The passes stop once that bin's entries are exactly what is still needed (as k_topk_r), and the
 *     entries go out as k_topk_s's: a run's counts, one block scan, each run in index order.
 * The same set in the same order as k_topk_r / k_topk_s (every key above the cut, then the lowest-index ties;
 * the digits' widths do not change which key is the k-th), so the same ids: test_cuda_attn test_topk_w against
 * the CPU's. */
#define TK_WBINS 2048
template <int PER>
__global__ void __launch_bounds__(TK_THREADS) k_topk_w(int32_t *idx, int *n_out, const float *score, int stride,
                                                       const int *n, const __grid_constant__ row_params rp, int k) {
    pdl_enter();
    __shared__ int hist[TK_WBINS];
    __shared__ unsigned wsum[32];
    __shared__ int s_need, s_done;
    __shared__ uint32_t s_prefix;
    const int r = blockIdx.x, t = threadIdx.x;
    const int nr = n ? n[r] : rp.n[r];
    const float *s = score + (int64_t)r * stride;
    int32_t *ir = idx + (int64_t)r * k;
    if (tk_whole(ir, n_out, r, nr, k)) return;
    const int per = (nr + TK_THREADS - 1) / TK_THREADS, i0 = t * per; /* per <= PER, uniform */
    const int cnt = max(0, min(per, nr - i0));                         /* this run's entries */
    uint32_t key[PER];
#pragma unroll
    for (int u = 0; u < PER; u++) key[u] = u < cnt ? tk_key(s[i0 + u]) : 0u;
    uint32_t prefix = 0, mask = 0;
    int need = k;
    for (int pass = 0; pass < 3; pass++) {
        const int sh = pass == 0 ? 21 : pass == 1 ? 10 : 0, nb = pass == 2 ? TK_WBINS / 2 : TK_WBINS;
        for (int b = t; b < nb; b += TK_THREADS) hist[b] = 0;
        __syncthreads();
        int cur = -1, run = 0; /* the run's digits, equal neighbours merged into one add */
#pragma unroll
        for (int u = 0; u < PER; u++) {
            int dg = u < cnt && (key[u] & mask) == prefix ? (int)((key[u] >> sh) & (uint32_t)(nb - 1)) : -1;
            if (dg >= 0 && dg == cur) {
                run++;
            } else if (dg >= 0) {
                if (run) atomicAdd(&hist[cur], run);
                cur = dg, run = 1;
            }
        }
        if (run) atomicAdd(&hist[cur], run);
        __syncthreads();
        /* this thread's bins, from the top: nb / TK_THREADS of them; the entries in every higher bin by one scan */
        const int bpt = nb / TK_THREADS, top = nb - 1 - t * bpt;
        const int c0 = hist[top], c1 = bpt == 2 ? hist[top - 1] : 0;
        unsigned tot;
        const int above = (int)tk_scan((unsigned)(c0 + c1), wsum, &tot);
        if (above < need && need <= above + c0 + c1) { /* exactly one thread: the bins hold >= need entries */
            const int in0 = need <= above + c0, before = in0 ? above : above + c0, c = in0 ? c0 : c1;
            s_prefix = prefix | ((uint32_t)(in0 ? top : top - 1) << sh);
            s_need = need - before;
            s_done = before + c == need;
        }
        __syncthreads();
        prefix = s_prefix, need = s_need;
        mask |= (uint32_t)(nb - 1) << sh;
        if (s_done) break; /* uniform */
    }
    int gt = 0, eq = 0;
#pragma unroll
    for (int u = 0; u < PER; u++) {
        uint32_t km = key[u] & mask;
        gt += u < cnt && km > prefix;
        eq += u < cnt && km == prefix;
    }
    int g, e;
    tk_run_bases(gt, eq, wsum, &g, &e); /* <= nr < 2^16 a field */
#pragma unroll
    for (int u = 0; u < PER; u++) {
        if (u >= cnt) break;
        tk_put(ir, key[u] & mask, prefix, need, i0 + u, g, e);
    }
    if (t == 0) n_out[r] = k;
}
static_assert(TK_THREADS * 16 < 65536, "k_topk_w packs two counts of up to 16 TK_THREADS into 16 bits each");

/* Rows above k_topk_r's 8192 entries (decode past 32K context) up to TK_SMAX: k_topk_r's
 * selection with the keys read once into shared memory (dynamic, 4 bytes an entry) instead
 * of registers, and the final pass over contiguous runs -- thread t owns entries
 * [t per, (t + 1) per) -- so that one block scan of the runs' counts places every entry,
 * where k_topk scans once per 1024 entries and reads the scores from global memory in each
 * of its five passes (at 8198 entries it ran ~18 us after the indexer ended, decode trace of
 * 2026-12-02 05:54Z; this kernel ~11 us).  Same set, same ascending index order.
 * Tried and removed (2026-12-04): listing the first pass's digit's entries once, so that the
 * later passes histogram only those (DSV4_CUDA_TOPK_CAND=1): the same picks, and no time gained
 * (8192 keys in a graph: 13.5 us a call either way; the 20-layer step at 32K: 3.27 ms either way,
 * picks on the device), so the passes are not where this kernel's time goes.
 * Tried and removed (2026-12-05): tk_key by selects instead of early returns (the same key for
 * all 2^32 bit patterns) and the scores loaded 8 a thread before any key is formed, here and in
 * k_topk_r, since the PTX put each load behind branches on the value before it: test_topk passed
 * (and with DSV4_CUDA_TOPK_SMEM=1), but the 20-layer step at 32K took 3.23 ms either way (greedy,
 * two rounds each; main 3.22 / 3.22), so ptxas had already predicated those loads. */
#define TK_SMAX 49152
static_assert(TK_SMAX < 65536, "k_topk_s packs two counts of up to TK_SMAX into 16 bits each");
__global__ void __launch_bounds__(TK_THREADS) k_topk_s(int32_t *idx, int *n_out, const float *score, int stride,
                                                       const int *n, const __grid_constant__ row_params rp, int k) {
    pdl_enter();
    extern __shared__ uint32_t tk_keys[];
    __shared__ int hist[256];
    __shared__ unsigned wsum[32];
    __shared__ int s_need, s_done;
    __shared__ uint32_t s_prefix;
    int r = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    int nr = n ? n[r] : rp.n[r];
    const float *s = score + (int64_t)r * stride;
    int32_t *ir = idx + (int64_t)r * k;
    if (tk_whole(ir, n_out, r, nr, k)) return;
    for (int i = t; i < nr; i += TK_THREADS) tk_keys[i] = tk_key(s[i]);
    int nu = (nr + TK_THREADS - 1) / TK_THREADS; /* uniform */
    uint32_t prefix = 0, mask = 0;
    int need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (t < 256) hist[t] = 0;
        __syncthreads(); /* also: the keys are in shared memory (first pass) */
        for (int u = 0; u < nu; u++) {
            int i = u * TK_THREADS + t;
            uint32_t key = i < nr ? tk_keys[i] : 0u;
            int dg = (i < nr && (key & mask) == prefix) ? (int)((key >> shift) & 255u) : 256;
            tk_hist_add(hist, dg, lane);
        }
        tk_pass_end(hist, warp, lane, shift, prefix, need, &s_prefix, &s_need, &s_done);
        mask |= 255u << shift;
        if (s_done) break; /* uniform */
    }
    /* contiguous runs: counts, one scan, then each run writes its entries in index order */
    int per = nu, i0 = t * per, i1 = min(nr, i0 + per), gt = 0, eq = 0;
    for (int i = i0; i < i1; i++) {
        uint32_t km = tk_keys[i] & mask;
        gt += km > prefix;
        eq += km == prefix;
    }
    /* the sums of gt and of eq over the block are <= nr <= TK_SMAX < 2^16: 16 bits each, unsigned */
    int g, e;
    tk_run_bases(gt, eq, wsum, &g, &e);
    for (int i = i0; i < i1; i++) tk_put(ir, tk_keys[i] & mask, prefix, need, i, g, e);
    if (t == 0) n_out[r] = k;
}

/* the smallest row count at which cu_topk takes k_topk_s (DSV4_CUDA_TOPK_SMEM=N, read once;
 * default just above k_topk_r's 8192 entries) */
static int tk_smem_min(void) {
    static int v = -1;
    if (v < 0) v = env_choice("DSV4_CUDA_TOPK_SMEM", TK_THREADS * TK_PER + 1, NULL, 0);
    return v;
}

void cu_topk(dsv4_backend *b, int32_t *idx, int *n_out, const float *score, int rows, int stride, const int *n,
             int k) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || k <= 0) return;
    cuda_impl *c = CI(b);
    for (int r = 0; r < rows; r++)
        if (n[r] > stride) { /* a host count: the caller's bug, not a device fault */
            dsv4_cuda_fail(b, "topk: a row's count exceeds its stride", __FILE__, __LINE__, cudaSuccess);
            return;
        }
    const float *sd = (const float *)dsv4_cuda_in(b, score, sizeof(float) * (size_t)rows * stride);
    row_params rp;
    memset(&rp, 0, sizeof rp);
    const int *nd = NULL;
    if (rows <= ROW_PARAMS)
        for (int r = 0; r < rows; r++) rp.n[r] = n[r];
    else
        nd = (const int *)dsv4_cuda_stage(b, n, sizeof(int) * rows);
    /* device outputs (the forward pass's) are written in place: nothing comes back to the host */
    int idx_dev = dsv4_cuda_is_dev(b, idx), n_dev = dsv4_cuda_is_dev(b, n_out);
    int32_t *id = idx_dev ? idx : (int32_t *)dsv4_cuda_scratch(b, sizeof(int32_t) * (size_t)rows * k);
    int *no = n_dev ? n_out : (int *)dsv4_cuda_scratch(b, sizeof(int) * rows);
    if (!sd || (rows > ROW_PARAMS && !nd) || !id || !no) return;
    int maxn = 0;
    for (int r = 0; r < rows; r++) maxn = n[r] > maxn ? n[r] : maxn;
    /* k_topk_w: rows past k_topk_r's registers (8193..16384 entries, 32K-64K context) by default, where it beat
     * k_topk_s (stop 62); at DSV4_CUDA_TOPK_W=2 every row up to 16384, where k_topk_r was faster at 516 */
    if (maxn <= TK_THREADS * 2 * TK_PER && (c->topk_w == 2 || (c->topk_w == 1 && maxn > TK_THREADS * TK_PER))) {
        if (maxn <= TK_THREADS * TK_PER)
            dsv4_launch(k_topk_w<TK_PER>, rows, TK_THREADS, 0, c->stream, id, no, sd, stride, nd, rp, k);
        else
            dsv4_launch(k_topk_w<2 * TK_PER>, rows, TK_THREADS, 0, c->stream, id, no, sd, stride, nd, rp, k);
        c->topk_w_calls++;
    } else if (maxn >= tk_smem_min() && maxn <= TK_SMAX) {
        size_t sm = sizeof(uint32_t) * (size_t)maxn;
        if (CK(b, cudaFuncSetAttribute(k_topk_s, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm))) return;
        dsv4_launch(k_topk_s, rows, TK_THREADS, sm, c->stream, id, no, sd, stride, nd, rp, k);
    } else if (maxn <= TK_THREADS * TK_PER)
        dsv4_launch(k_topk_r<TK_PER>, rows, TK_THREADS, 0, c->stream, id, no, sd, stride, nd, rp, k);
    else
        dsv4_launch(k_topk, rows, TK_THREADS, 0, c->stream, id, no, sd, stride, nd, rp, k);
    if (CKL(b)) return;
    if (!idx_dev)
        for (int r = 0; r < rows && !c->failed; r++) { /* min(k, n[r]) entries, as the kernel writes */
            int take = n[r] < k ? (n[r] > 0 ? n[r] : 0) : k;
            if (take > 0) dsv4_cuda_fetch(b, idx + (size_t)r * k, id + (size_t)r * k, sizeof(int32_t) * take);
        }
    if (!n_dev) dsv4_cuda_fetch(b, n_out, no, sizeof(int) * rows);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_TOPK);
}

/* ----- compressor pooling ----- */
__global__ void k_pool(float *out, const float *kv, const float *g, int n, int width) {
    pdl_enter();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    float mx = -INFINITY;
    for (int t = 0; t < n; t++) mx = fmaxf(mx, g[(int64_t)t * width + c]);
    float den = 0.0f, acc = 0.0f;
    for (int t = 0; t < n; t++) {
        float e = expf(g[(int64_t)t * width + c] - mx);
        den += e;
        acc += e * kv[(int64_t)t * width + c];
    }
    out[c] = acc / den;
}

/* pooling from rows addressed by pointer (sequence state in device memory) */
__global__ void k_pool_ptr(float *out, const float *const *kv, const float *const *g, int n, int width) {
    pdl_enter();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    float mx = -INFINITY;
    for (int t = 0; t < n; t++) mx = fmaxf(mx, g[t][c]);
    float den = 0.0f, acc = 0.0f;
    for (int t = 0; t < n; t++) {
        float e = expf(g[t][c] - mx);
        den += e;
        acc += e * kv[t][c];
    }
    out[c] = acc / den;
}

/* the same with the pointer tables as a kernel parameter (n <= P): no host-to-device copy.  A
 * decode step's window-end pools (ratio 4: 8 entries, ratio 128: 128) had each staged two
 * 64-byte tables, and in the kernel traces the pool started 3-50 us after those copies.
 * PRE (P <= 16, DSV4_CUDA_POOL_PRE, on by default since stop 52): a thread asks for its n gate and
 * n kv values at once into registers, then runs the same loops over them (the same operations in the
 * same order, so the same bits).  Why: a decode step's window-end pool is one of a few dependent
 * kernels of the indexer layers' side chain, which ran 9.3 us past the main chain at the steps that
 * close a window in stop 50's trace; the plain loops' loads come in a few unrolled groups, each a
 * round trip (~6 us after the wait for 8 rows there, while wq_b streams). */
template <int P> struct pool_tab {
    const float *kv[P], *g[P];
};
/* k_pool_tab's value at column c (n <= P entries of the tables kv, g): pool's arithmetic in k_pool's order */
template <int P, int PRE>
__device__ __forceinline__ float d_pool_col(const float *const *kvt, const float *const *gt, int n, int c) {
    if constexpr (PRE) {
        static_assert(P <= 16, "k_pool_tab: PRE holds P rows in registers");
        float gv[P], kv[P];
#pragma unroll
        for (int t = 0; t < P; t++) gv[t] = t < n ? gt[t][c] : 0.0f, kv[t] = t < n ? kvt[t][c] : 0.0f;
        float mx = -INFINITY;
#pragma unroll
        for (int t = 0; t < P; t++)
            if (t < n) mx = fmaxf(mx, gv[t]);
        float den = 0.0f, acc = 0.0f;
#pragma unroll
        for (int t = 0; t < P; t++)
            if (t < n) {
                float e = expf(gv[t] - mx);
                den += e;
                acc += e * kv[t];
            }
        return acc / den;
    }
    float mx = -INFINITY;
    for (int t = 0; t < n; t++) mx = fmaxf(mx, gt[t][c]);
    float den = 0.0f, acc = 0.0f;
    for (int t = 0; t < n; t++) {
        float e = expf(gt[t][c] - mx);
        den += e;
        acc += e * kvt[t][c];
    }
    return acc / den;
}

template <int P, int PRE>
__global__ void k_pool_tab(float *out, const __grid_constant__ pool_tab<P> tb, int n, int width) {
    pdl_enter();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    out[c] = d_pool_col<P, PRE>(tb.kv, tb.g, n, c);
}

/* pool_multi's jobs (<= POOL_JOBS of <= 16 entries each, device rows): job j = blockIdx.y, k_pool_tab<16>'s
 * columns and arithmetic (so each output has that pool's bits) */
enum { POOL_JOBS = 4 };
struct pool_jobs {
    const float *kv[POOL_JOBS][16], *g[POOL_JOBS][16];
    float *out[POOL_JOBS];
    int n[POOL_JOBS], width[POOL_JOBS];
};
template <int PRE>
__global__ void k_pool_jobs(const __grid_constant__ pool_jobs pj) {
    pdl_enter();
    int j = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= pj.width[j]) return;
    pj.out[j][c] = d_pool_col<16, PRE>(pj.kv[j], pj.g[j], pj.n[j], c);
}

template <int P>
static void pool_by_param(dsv4_backend *b, float *od, const float *const *kv, const float *const *gate, int n,
                          int width) {
    pool_tab<P> tb;
    for (int t = 0; t < n; t++) tb.kv[t] = kv[t], tb.g[t] = gate[t];
    for (int t = n; t < P; t++) tb.kv[t] = tb.g[t] = NULL;
    if constexpr (P <= 16) {
        if (CI(b)->pool_pre) {
            dsv4_launch(k_pool_tab<P, 1>, (width + 127) / 128, 128, 0, CI(b)->stream, od, tb, n, width);
            return;
        }
    }
    dsv4_launch(k_pool_tab<P, 0>, (width + 127) / 128, 128, 0, CI(b)->stream, od, tb, n, width);
}

void cu_pool(dsv4_backend *b, float *out, const float *const *kv, const float *const *gate, int n, int width) {
    dsv4_cuda_op_begin(b);
    if (n <= 0 || width <= 0) return;
    int all_dev = 1;
    for (int t = 0; t < n && all_dev; t++) all_dev = dsv4_cuda_is_dev(b, kv[t]) && dsv4_cuda_is_dev(b, gate[t]);
    if (all_dev && n <= 256) { /* device rows, tables in the kernel parameters */
        float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * width);
        if (!od) return;
        if (n <= 16) pool_by_param<16>(b, od, kv, gate, n, width);
        else pool_by_param<256>(b, od, kv, gate, n, width);
        if (CKL(b)) return;
        dsv4_cuda_commit(b, out, od, sizeof(float) * width);
        dsv4_cuda_op_end(b, DSV4_CUDA_OP_POOL);
        return;
    }
    if (all_dev) { /* device rows: only the pointer tables travel, no wait */
        const float **kd = (const float **)dsv4_cuda_stage(b, kv, sizeof(float *) * n);
        const float **gd = (const float **)dsv4_cuda_stage(b, gate, sizeof(float *) * n);
        float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * width);
        if (!kd || !gd || !od) return;
        dsv4_launch(k_pool_ptr, (width + 127) / 128, 128, 0, CI(b)->stream, od, kd, gd, n, width);
        if (CKL(b)) return;
        dsv4_cuda_commit(b, out, od, sizeof(float) * width);
        dsv4_cuda_op_end(b, DSV4_CUDA_OP_POOL);
        return;
    }
    if (n <= 0 || width <= 0) return;
    size_t rb = sizeof(float) * (size_t)n * width;
    float *h = (float *)dsv4_cuda_hbuf(b, 2 * rb);
    if (!h) return;
    for (int t = 0; t < n; t++) {
        memcpy(h + (size_t)t * width, kv[t], sizeof(float) * width);
        memcpy(h + (size_t)(n + t) * width, gate[t], sizeof(float) * width);
    }
    float *d = (float *)dsv4_cuda_stage(b, h, 2 * rb);
    float *od = (float *)dsv4_cuda_scratch(b, sizeof(float) * width);
    if (!d || !od) return;
    dsv4_launch(k_pool, (width + 127) / 128, 128, 0, CI(b)->stream, od, d, d + (size_t)n * width, n, width);
    if (CKL(b)) return;
    dsv4_cuda_fetch(b, out, od, sizeof(float) * width);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_POOL);
}

/* pool_multi (backend.h): one k_pool_jobs launch where every job has <= 16 entries in device memory and a
 * device output (a decode step's two window-end pools of an indexer layer), else cu_pool for each job */
static long pool_jobs_calls; /* k_pool_jobs launches, for the tests (dsv4_cuda_pool_multi_calls) */
extern "C" long dsv4_cuda_pool_multi_calls(void) { return pool_jobs_calls; }
void cu_pool_multi(dsv4_backend *b, int n_jobs, float *const *outs, const float *const *const *kv,
                   const float *const *const *gate, const int *ns, const int *widths) {
    int one = n_jobs >= 1 && n_jobs <= POOL_JOBS, wmax = 0;
    for (int j = 0; j < n_jobs && one; j++) {
        one = ns[j] >= 1 && ns[j] <= 16 && widths[j] > 0 && dsv4_cuda_is_dev(b, outs[j]);
        for (int t = 0; t < ns[j] && one; t++) one = dsv4_cuda_is_dev(b, kv[j][t]) && dsv4_cuda_is_dev(b, gate[j][t]);
        if (widths[j] > wmax) wmax = widths[j];
    }
    if (!one) {
        for (int j = 0; j < n_jobs; j++) cu_pool(b, outs[j], kv[j], gate[j], ns[j], widths[j]);
        return;
    }
    dsv4_cuda_op_begin(b);
    pool_jobs pj;
    memset(&pj, 0, sizeof pj);
    for (int j = 0; j < n_jobs; j++) {
        for (int t = 0; t < ns[j]; t++) pj.kv[j][t] = kv[j][t], pj.g[j][t] = gate[j][t];
        pj.out[j] = outs[j], pj.n[j] = ns[j], pj.width[j] = widths[j];
    }
    dim3 grid((unsigned)((wmax + 127) / 128), (unsigned)n_jobs);
    pool_jobs_calls++;
    if (CI(b)->pool_pre) dsv4_launch(k_pool_jobs<1>, grid, 128, 0, CI(b)->stream, pj);
    else dsv4_launch(k_pool_jobs<0>, grid, 128, 0, CI(b)->stream, pj);
    if (CKL(b)) return;
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_POOL);
}

/* ----- compressor position biases ----- */
__global__ void k_add_cyclic(float *x, const float *y, int width, int period, int first) {
    pdl_enter();
    int i = blockIdx.y;
    const float *yr = y + (int64_t)((first + i) % period) * width;
    float *xr = x + (int64_t)i * width;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x) xr[c] += yr[c];
}

/* add_cyclic_pos: each row's phase (pos mod period) travels in the kernel's arguments, ACP_MAX
 * rows a launch */
#define ACP_MAX 64
struct acp_phase {
    int32_t ph[ACP_MAX];
};
__global__ void k_add_cyclic_ph(float *x, const float *y, int width, const acp_phase a) {
    pdl_enter();
    const float *yr = y + (int64_t)a.ph[blockIdx.y] * width;
    float *xr = x + (int64_t)blockIdx.y * width;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x) xr[c] += yr[c];
}

/* the op start both add_cyclic ops share: x and y on the device (*xd, *yd), x's bytes in *xb; 0 =
 * nothing to launch (empty, or a staging failure left the sticky error) */
static int add_cyclic_begin(dsv4_backend *b, float *x, const float *y, int rows, int width, int period, float **xd,
                            const float **yd, size_t *xb) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || width <= 0 || period <= 0) return 0;
    *xb = sizeof(float) * (size_t)rows * width;
    *xd = (float *)dsv4_cuda_in(b, x, *xb);
    *yd = (const float *)dsv4_cuda_in(b, y, sizeof(float) * (size_t)period * width);
    return *xd && *yd;
}

void cu_add_cyclic_pos(dsv4_backend *b, float *x, const float *y, int rows, int width, int period,
                       const int64_t *pos) {
    float *xd;
    const float *yd;
    size_t xb;
    if (!add_cyclic_begin(b, x, y, rows, width, period, &xd, &yd, &xb)) return;
    for (int r0 = 0; r0 < rows; r0 += ACP_MAX) {
        int nr = rows - r0 < ACP_MAX ? rows - r0 : ACP_MAX;
        acp_phase a;
        for (int i = 0; i < nr; i++) a.ph[i] = (int32_t)(pos[r0 + i] % period);
        dsv4_launch(k_add_cyclic_ph, dim3((unsigned)((width + 255) / 256), (unsigned)nr), 256, 0, CI(b)->stream,
                    xd + (size_t)r0 * width, yd, width, a);
        if (CKL(b)) return;
    }
    dsv4_cuda_commit(b, x, xd, xb);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_ADD);
}

void cu_add_cyclic(dsv4_backend *b, float *x, const float *y, int rows, int width, int period, int first) {
    float *xd;
    const float *yd;
    size_t xb;
    if (!add_cyclic_begin(b, x, y, rows, width, period, &xd, &yd, &xb)) return;
    dsv4_launch(k_add_cyclic, dim3((unsigned)((width + 255) / 256), (unsigned)rows), 256, 0, CI(b)->stream, xd, yd,
                width, period, first);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, x, xd, xb);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_ADD);
}
