/* backend/cuda/attn.cu: sparse sink attention, indexer scores, top-k, compressor pooling.
 *
 * Keys are read in place from backend (device) memory: the sequence state and the
 * fresh kv rows live there.  What travels per op is small and built by the host from
 * positions: per-row window key pointers, per-row bases of the compressed rows and
 * counts (staged through the pinned arena); the top-k picks stay on the device and
 * sparse_attn reads them there, so no op here waits for the device.  A key pointer
 * that is not device memory (op tests passing host rows) takes a slow path that
 * stages the rows first.  An index read from device memory (a pick) is checked
 * against the row's compressed-row count; a bad one is skipped and leaves a sticky
 * device flag (DSV4_DEVFLAG_PICK) that ops->check reports.
 *
 * sparse_attn, flash-decoding style: keys of a (row, head) are cut into `nsplit`
 *   slices (nsplit > 1 only when rows*heads would leave SMs idle, e.g. a batch-1
 *   decode: 64 heads on 132 SMs).  k_attn_scores: block (256 threads) per (row, head,
 *   slice), q in shared memory, one warp per key, scores to scratch and the slice max;
 *   k_attn_pv: the row's max over slices and the sink, the denominator over every key
 *   (each block computes the same sum in the same order), p_j = e_j / den (bf16 if
 *   asked), then each thread owns output dims and sums p_j K_j over its slice in key
 *   order; k_attn_combine adds the slices' partial outputs in slice order.  With one
 *   slice the output is written directly and the order is the CPU's (key order);
 *   with several, only the grouping of that sum differs.
 * indexer_scores: one warp per (row, key), q of the row in shared memory; key j of
 *   row r is key_base[r] + j*head_dim; per head a warp dot, relu, weighted sum in head
 *   order (score_bf16 rounds like the CPU).
 * topk: rank of each entry = #entries greater, ties to the lower index (the CPU's
 *   order); entries of rank < k are kept; a block scan writes them in ascending
 *   index order, straight into the caller's device buffers.  O(n^2 / threads) per
 *   row: fine to a few 10^4 keys.
 * pool: one thread per channel, softmax over the window in entry order.
 * Target: sm_90a.
 */
#include <stdlib.h>

#include "backend/cuda/common.cuh"

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
#define ATTN_TILE 256       /* keys per shared-memory tile in the p.V pass */
#define ATTN_DPT 4          /* output dims per thread: head_dim <= ATTN_THREADS * ATTN_DPT */
#define ATTN_SPLIT_KEYS 64  /* fewest keys per slice when splitting */

struct attn_args {
    const float *q;                  /* [rows*heads][head_dim] */
    const float *const *win;         /* [rows][max_win] window key pointers */
    const int *n_win;                /* [rows] */
    const float *const *comp_base;   /* [rows] or NULL */
    const int *n_comp;               /* [rows] (with comp_base) */
    const int32_t *picks;            /* [rows][topk] or NULL */
    const int *n_picks;              /* [rows] (with picks) */
    const float *sink;               /* [heads] */
    float *sc;                       /* [rows*heads][max_n] scores (then p when nsplit == 1) */
    float *pb;                       /* [rows*heads][max_n] p when nsplit > 1 */
    float *pmax;                     /* [rows*heads][nsplit] slice maxima */
    float *part;                     /* [rows*heads][nsplit][head_dim] slice outputs (nsplit > 1) */
    float *out;                      /* [rows*heads][head_dim] */
    unsigned *flags;                 /* sticky device flags */
    int max_win, topk, n_heads, head_dim, max_n, nsplit, chunk, prob_bf16, out_bf16;
    float scale;
};

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

__global__ void __launch_bounds__(ATTN_THREADS) k_attn_scores(attn_args a) {
    extern __shared__ float4 qs4[]; /* q of this (row, head) */
    float *qs = (float *)qs4;
    __shared__ float red[32];
    int rh = blockIdx.x, r = rh / a.n_heads, split = blockIdx.y, hd = a.head_dim;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarp = blockDim.x >> 5;
    const float *qh = a.q + (int64_t)rh * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qh[d];
    __syncthreads();
    int nw, n;
    attn_counts(a, r, nw, n);
    int j0 = split * a.chunk, j1 = min(n, j0 + a.chunk);
    float *s = a.sc + (int64_t)rh * a.max_n;
    float mx = -INFINITY;
    for (int j = j0 + warp; j < j1; j += nwarp) {
        const float *k = attn_key(a, r, j, nw);
        float v = -INFINITY; /* a skipped key weighs exp(-inf) = 0 */
        if (k) {             /* uniform over the warp */
            float acc = 0.0f;
            if ((hd & 127) == 0) { /* rows are 16-byte aligned (head_dim multiple of 4 floats) */
                for (int d = lane * 4; d < hd; d += 128) {
                    float4 kv = *(const float4 *)(k + d), qv = *(const float4 *)(qs + d);
                    acc += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
                }
            } else {
                for (int d = lane; d < hd; d += 32) acc += qs[d] * k[d];
            }
            v = warp_sum(acc) * a.scale;
        }
        if (lane == 0) s[j] = v;
        mx = fmaxf(mx, v);
    }
    mx = block_max(mx, red);
    if (threadIdx.x == 0) a.pmax[(int64_t)rh * a.nsplit + split] = mx;
}

__global__ void __launch_bounds__(ATTN_THREADS) k_attn_pv(attn_args a) {
    __shared__ float red[32];
    __shared__ const float *kt[ATTN_TILE];
    __shared__ float pt[ATTN_TILE];
    int rh = blockIdx.x, r = rh / a.n_heads, h = rh % a.n_heads, split = blockIdx.y, hd = a.head_dim;
    int nw, n;
    attn_counts(a, r, nw, n);
    float sk = a.sink[h], mx = sk;
    for (int t = 0; t < a.nsplit; t++) mx = fmaxf(mx, a.pmax[(int64_t)rh * a.nsplit + t]);
    const float *s = a.sc + (int64_t)rh * a.max_n;
    float den = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) den += expf(s[j] - mx);
    den = block_sum(den, red) + expf(sk - mx); /* every read of s is done past this barrier */
    int j0 = split * a.chunk, j1 = min(n, j0 + a.chunk);
    float *p = (a.nsplit == 1 ? a.sc : a.pb) + (int64_t)rh * a.max_n;
    for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
        float v = expf(s[j] - mx) / den;
        p[j] = a.prob_bf16 ? d_round_bf16(v) : v;
    }
    __syncthreads();
    float acc[ATTN_DPT];
#pragma unroll
    for (int u = 0; u < ATTN_DPT; u++) acc[u] = 0.0f;
    for (int t0 = j0; t0 < j1; t0 += ATTN_TILE) {
        int m = min(ATTN_TILE, j1 - t0);
        for (int i = threadIdx.x; i < m; i += blockDim.x) {
            kt[i] = attn_key(a, r, t0 + i, nw);
            pt[i] = p[t0 + i];
        }
        __syncthreads();
        for (int i = 0; i < m; i++) { /* key order */
            const float *k = kt[i];
            if (!k) continue;
            float pv = pt[i];
#pragma unroll
            for (int u = 0; u < ATTN_DPT; u++) {
                int d = threadIdx.x + u * blockDim.x;
                if (d < hd) acc[u] += pv * k[d];
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < ATTN_DPT; u++) {
        int d = threadIdx.x + u * blockDim.x;
        if (d >= hd) break;
        if (a.nsplit == 1) a.out[(int64_t)rh * hd + d] = a.out_bf16 ? d_round_bf16(acc[u]) : acc[u];
        else a.part[((int64_t)rh * a.nsplit + split) * hd + d] = acc[u];
    }
}

__global__ void k_attn_combine(attn_args a) {
    int rh = blockIdx.x, hd = a.head_dim;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float v = 0.0f;
        for (int t = 0; t < a.nsplit; t++) v += a.part[((int64_t)rh * a.nsplit + t) * hd + d]; /* slice order */
        a.out[(int64_t)rh * hd + d] = a.out_bf16 ? d_round_bf16(v) : v;
    }
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

void cu_sparse_attn(dsv4_backend *b, float *out, const float *q, int rows, int n_heads, int head_dim,
                    const float *const *win, const int *n_win, int max_win, const float *const *comp_base,
                    const int *n_comp, const int32_t *picks, const int *n_picks, int topk, const float *sink,
                    float scale, int prob_bf16, int out_bf16) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || n_heads <= 0) return;
    cuda_impl *c = CI(b);
    if (head_dim <= 0 || head_dim > ATTN_THREADS * ATTN_DPT) {
        dsv4_cuda_fail(b, "sparse_attn: head_dim above 1024 is not supported", __FILE__, __LINE__, cudaSuccess);
        return;
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
            return;
        win = hl, n_win = hnl, max_win = ml;
        comp_base = NULL, n_comp = NULL, picks = NULL, n_picks = NULL, topk = 0;
    }
    int max_n = 1; /* keys of the longest row, from host counts */
    for (int r = 0; r < rows; r++) {
        int nw = n_win[r] < 0 ? 0 : n_win[r] > max_win ? max_win : n_win[r], nc = 0;
        if (comp_base && comp_base[r]) nc = picks ? (topk < n_comp[r] ? topk : n_comp[r]) : n_comp[r];
        if (nw + (nc > 0 ? nc : 0) > max_n) max_n = nw + (nc > 0 ? nc : 0);
    }
    int rh = rows * n_heads, nsplit = 1;
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c->device) != cudaSuccess || sms <= 0)
        sms = 132; /* only a launch-shape hint: an H200's count */
    if (rh < 2 * sms) { /* too few (row, head) blocks to fill the GPU: split the keys */
        nsplit = (2 * sms + rh - 1) / rh;
        if (nsplit > max_n / ATTN_SPLIT_KEYS) nsplit = max_n / ATTN_SPLIT_KEYS;
        if (nsplit > 32) nsplit = 32;
        if (nsplit < 1) nsplit = 1;
    }
    attn_args a;
    memset(&a, 0, sizeof a);
    size_t nq = (size_t)rh * head_dim;
    a.q = (const float *)dsv4_cuda_in(b, q, sizeof(float) * nq);
    a.win = (const float *const *)dsv4_cuda_stage(b, win, sizeof(float *) * (size_t)rows * (max_win > 0 ? max_win : 1));
    a.n_win = (const int *)dsv4_cuda_stage(b, n_win, sizeof(int) * rows);
    if (comp_base) {
        a.comp_base = (const float *const *)dsv4_cuda_stage(b, comp_base, sizeof(float *) * rows);
        a.n_comp = (const int *)dsv4_cuda_stage(b, n_comp, sizeof(int) * rows);
    }
    if (picks) {
        a.picks = (const int32_t *)dsv4_cuda_in(b, picks, sizeof(int32_t) * (size_t)rows * topk);
        a.n_picks = (const int *)dsv4_cuda_in(b, n_picks, sizeof(int) * rows);
    }
    free(hl); /* staged above (pageable copies are taken when cudaMemcpyAsync returns) */
    free(hnl);
    a.sink = (const float *)dsv4_cuda_in(b, sink, sizeof(float) * n_heads);
    a.out = (float *)dsv4_cuda_out(b, out, sizeof(float) * nq);
    a.sc = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rh * max_n);
    a.pmax = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rh * nsplit);
    if (nsplit > 1) {
        a.pb = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rh * max_n);
        a.part = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rh * nsplit * head_dim);
    }
    a.flags = dsv4_cuda_devflags(b);
    if (!a.q || !a.win || !a.n_win || (comp_base && (!a.comp_base || !a.n_comp)) ||
        (picks && (!a.picks || !a.n_picks)) || !a.sink || !a.out || !a.sc || !a.pmax ||
        (nsplit > 1 && (!a.pb || !a.part)) || !a.flags)
        return;
    a.max_win = max_win;
    a.topk = topk;
    a.n_heads = n_heads;
    a.head_dim = head_dim;
    a.max_n = max_n;
    a.nsplit = nsplit;
    a.chunk = (max_n + nsplit - 1) / nsplit;
    a.prob_bf16 = prob_bf16;
    a.out_bf16 = out_bf16;
    a.scale = scale;
    dim3 grid((unsigned)rh, (unsigned)nsplit);
    k_attn_scores<<<grid, ATTN_THREADS, sizeof(float) * head_dim, c->stream>>>(a);
    if (CKL(b)) return;
    k_attn_pv<<<grid, ATTN_THREADS, 0, c->stream>>>(a);
    if (CKL(b)) return;
    if (nsplit > 1) {
        k_attn_combine<<<rh, 128, 0, c->stream>>>(a);
        if (CKL(b)) return;
    }
    dsv4_cuda_commit(b, out, a.out, sizeof(float) * nq);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_SPARSE_ATTN);
}

/* ----- indexer scores ----- */
__global__ void k_indexer(float *score, const float *q, const float *w, int n_heads, int head_dim,
                          const float *const *key_base, const int *n_keys, int max_keys, int score_bf16) {
    extern __shared__ float qs[];
    int r = blockIdx.y;
    int64_t nq = (int64_t)n_heads * head_dim;
    for (int64_t i = threadIdx.x; i < nq; i += blockDim.x) qs[i] = q[r * nq + i];
    __syncthreads();
    int lane = threadIdx.x & 31;
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= n_keys[r] || j >= max_keys) return;
    const float *k = key_base[r] + (int64_t)j * head_dim;
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
        float wh = w[(int64_t)r * n_heads + h];
        if (score_bf16) s = d_round_bf16(s + d_round_bf16(d_round_bf16(a) * wh));
        else s += a * wh;
    }
    if (lane == 0) score[(int64_t)r * max_keys + j] = s;
}

void cu_indexer_scores(dsv4_backend *b, float *score, const float *q, const float *w, int rows, int n_heads,
                       int head_dim, const float *const *key_base, const int *n_keys, int max_keys, int score_bf16) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0) return;
    cuda_impl *c = CI(b);
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
    const float *const *kd = (const float *const *)dsv4_cuda_stage(b, key_base, sizeof(float *) * rows);
    free(kb);
    float *qd = (float *)dsv4_cuda_in(b, q, sizeof(float) * rows * n_heads * head_dim);
    float *wd = (float *)dsv4_cuda_in(b, w, sizeof(float) * rows * n_heads);
    int *nd = (int *)dsv4_cuda_stage(b, n_keys, sizeof(int) * rows);
    int dev_out = dsv4_cuda_is_dev(b, score);
    /* device scores are written in place (only j < n_keys[r]); host ones go through scratch */
    float *sd = dev_out ? score : (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rows * (max_keys > 0 ? max_keys : 1));
    if (!kd || !qd || !wd || !nd || !sd) return;
    if (maxn > 0) {
        if (CK(b, cudaFuncSetAttribute(k_indexer, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem))) return;
        k_indexer<<<dim3((unsigned)((maxn + 7) / 8), rows), 256, smem, c->stream>>>(sd, qd, wd, n_heads, head_dim, kd,
                                                                                    nd, max_keys, score_bf16);
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

/* ----- top-k ----- */
__global__ void k_topk_rank(uint8_t *sel, const float *score, int stride, const int *n, int k) {
    __shared__ float tile[256];
    int r = blockIdx.y;
    int nr = n[r];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float *s = score + (int64_t)r * stride;
    float v = i < nr ? s[i] : 0.0f;
    int rank = 0;
    if (nr > k) {
        for (int t0 = 0; t0 < nr; t0 += 256) {
            __syncthreads();
            if (t0 + (int)threadIdx.x < nr) tile[threadIdx.x] = s[t0 + threadIdx.x];
            __syncthreads();
            int m = nr - t0 < 256 ? nr - t0 : 256;
            if (i < nr)
                for (int t = 0; t < m; t++) {
                    float u = tile[t];
                    rank += (u > v) || (u == v && t0 + t < i);
                }
        }
    }
    if (i < nr) sel[(int64_t)r * stride + i] = rank < k;
}

__global__ void k_topk_write(int32_t *idx, int *n_out, const uint8_t *sel, int stride, const int *n, int k) {
    __shared__ int wsum[32];
    __shared__ int base;
    int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int nr = n[r];
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    for (int t0 = 0; t0 < nr; t0 += blockDim.x) {
        int i = t0 + threadIdx.x;
        int f = i < nr ? sel[(int64_t)r * stride + i] : 0;
        int x = f; /* inclusive warp scan */
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) wsum[warp] = x;
        __syncthreads();
        int off = 0;
        for (int w = 0; w < warp; w++) off += wsum[w];
        int pos = base + off + x - f;
        if (f && pos < k) idx[(int64_t)r * k + pos] = i;
        __syncthreads();
        if (threadIdx.x == blockDim.x - 1) base += off + x;
        __syncthreads();
    }
    if (threadIdx.x == 0) n_out[r] = nr < k ? nr : k;
}

void cu_topk(dsv4_backend *b, int32_t *idx, int *n_out, const float *score, int rows, int stride, const int *n,
             int k) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || k <= 0) return;
    cuda_impl *c = CI(b);
    int maxn = 0;
    for (int r = 0; r < rows; r++) {
        if (n[r] > stride) { /* a host count: the caller's bug, not a device fault */
            dsv4_cuda_fail(b, "topk: a row's count exceeds its stride", __FILE__, __LINE__, cudaSuccess);
            return;
        }
        maxn = n[r] > maxn ? n[r] : maxn;
    }
    const float *sd = (const float *)dsv4_cuda_in(b, score, sizeof(float) * (size_t)rows * stride);
    int *nd = (int *)dsv4_cuda_stage(b, n, sizeof(int) * rows);
    uint8_t *sel = (uint8_t *)dsv4_cuda_scratch(b, (size_t)rows * stride);
    /* device outputs (the forward pass's) are written in place: nothing comes back to the host */
    int idx_dev = dsv4_cuda_is_dev(b, idx), n_dev = dsv4_cuda_is_dev(b, n_out);
    int32_t *id = idx_dev ? idx : (int32_t *)dsv4_cuda_scratch(b, sizeof(int32_t) * (size_t)rows * k);
    int *no = n_dev ? n_out : (int *)dsv4_cuda_scratch(b, sizeof(int) * rows);
    if (!sd || !nd || !sel || !id || !no) return;
    if (maxn > 0) {
        k_topk_rank<<<dim3((unsigned)((maxn + 255) / 256), rows), 256, 0, c->stream>>>(sel, sd, stride, nd, k);
        if (CKL(b)) return;
    }
    k_topk_write<<<rows, 1024, 0, c->stream>>>(id, no, sel, stride, nd, k);
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

void cu_pool(dsv4_backend *b, float *out, const float *const *kv, const float *const *gate, int n, int width) {
    dsv4_cuda_op_begin(b);
    if (n <= 0 || width <= 0) return;
    int all_dev = 1;
    for (int t = 0; t < n && all_dev; t++) all_dev = dsv4_cuda_is_dev(b, kv[t]) && dsv4_cuda_is_dev(b, gate[t]);
    if (all_dev) { /* device rows: only the pointer tables travel, no wait */
        const float **kd = (const float **)dsv4_cuda_stage(b, kv, sizeof(float *) * n);
        const float **gd = (const float **)dsv4_cuda_stage(b, gate, sizeof(float *) * n);
        float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * width);
        if (!kd || !gd || !od) return;
        k_pool_ptr<<<(width + 127) / 128, 128, 0, CI(b)->stream>>>(od, kd, gd, n, width);
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
    k_pool<<<(width + 127) / 128, 128, 0, CI(b)->stream>>>(od, d, d + (size_t)n * width, n, width);
    if (CKL(b)) return;
    dsv4_cuda_fetch(b, out, od, sizeof(float) * width);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_POOL);
}

/* ----- compressor position biases ----- */
__global__ void k_add_cyclic(float *x, const float *y, int width, int period, int first) {
    int i = blockIdx.y;
    const float *yr = y + (int64_t)((first + i) % period) * width;
    float *xr = x + (int64_t)i * width;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x) xr[c] += yr[c];
}

void cu_add_cyclic(dsv4_backend *b, float *x, const float *y, int rows, int width, int period, int first) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || width <= 0 || period <= 0) return;
    size_t xb = sizeof(float) * (size_t)rows * width;
    float *xd = (float *)dsv4_cuda_in(b, x, xb);
    const float *yd = (const float *)dsv4_cuda_in(b, y, sizeof(float) * (size_t)period * width);
    if (!xd || !yd) return;
    k_add_cyclic<<<dim3((unsigned)((width + 255) / 256), (unsigned)rows), 256, 0, CI(b)->stream>>>(xd, yd, width,
                                                                                                    period, first);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, x, xd, xb);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_ADD);
}
