/* backend/cuda/attn.cu: sparse sink attention, indexer scores, top-k, compressor pooling.
 *
 * Key rows reach these ops as host pointers (forward.c's lists into the window
 * ring, the fresh kv rows and the compressed rows).  The glue dedupes them into
 * unique rows [U][width] plus an index table [rows][max] and uploads both, so a key
 * shared by every row of a prefill chunk crosses the bus once; the kernels address
 * keys by (buffer, index), the form a device-resident state will hand them directly.
 *
 * sparse_attn: one block (256 threads) per (row, head): q in shared memory, one warp
 *   per key for the scores (scratch [rows*heads][max_kv]), block max/sum with the sink
 *   in the denominator, then each thread owns output dims and sums p_j K_j in key
 *   order 0..n-1 exactly like the CPU; only the denominator's summation order differs.
 * indexer_scores: one warp per (row, key), q of the row in shared memory; per head a
 *   warp dot, relu, weighted sum in head order (score_bf16 rounds like the CPU).
 * topk: rank of each entry = #entries greater, ties to the lower index (the CPU's
 *   order); entries of rank < k are kept; a block scan writes them in ascending
 *   index order.  O(n^2 / threads) per row: fine to a few 10^4 keys.
 * pool: one thread per channel, softmax over the window in entry order.
 * Target: sm_90a.
 */
#include <stdlib.h>

#include "backend/cuda/common.cuh"

/* ----- pointer lists -> unique rows + indices ----- */
typedef struct {
    const float *key;
    int32_t id;
} pslot;

static size_t phash(const void *p, size_t cap) {
    uint64_t v = (uint64_t)(uintptr_t)p;
    v ^= v >> 31;
    v *= 0x9e3779b97f4a7c15ull;
    return (size_t)(v >> 20) & (cap - 1);
}

__global__ void k_gather(float *dst, const float *const *src, const int32_t *id, int width) {
    const float *s = src[blockIdx.x];
    float *d = dst + (int64_t)id[blockIdx.x] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
}

/* Uploads the rows named by ptrs[r*max + j] (j < n[r]) as unique rows; *rows_d gets
 * [U][width] floats and *idx_d [rows][max] indices.  Rows in host memory (sequence
 * state) are copied through the pinned buffer; rows in device memory (this step's
 * fresh kv rows) are gathered by a kernel.  0 or -1 (sticky error set). */
static int gather_rows(dsv4_backend *b, const float *const *ptrs, const int *n, int rows, int max, int width,
                       float **rows_d, int32_t **idx_d) {
    size_t total = 0;
    for (int r = 0; r < rows; r++) total += (size_t)(n[r] > 0 ? n[r] : 0);
    size_t cap = 64;
    while (cap < 2 * total + 2) cap *= 2;
    pslot *tab = (pslot *)calloc(cap, sizeof *tab);
    int32_t *idx = (int32_t *)calloc((size_t)rows * (max > 0 ? max : 1), sizeof *idx);
    if (!tab || !idx) {
        free(tab);
        free(idx);
        dsv4_cuda_fail(b, "attention lists: out of host memory", __FILE__, __LINE__, cudaSuccess);
        return -1;
    }
    int32_t U = 0;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < n[r]; j++) {
            const float *p = ptrs[(size_t)r * max + j];
            size_t h = phash(p, cap);
            while (tab[h].key && tab[h].key != p) h = (h + 1) & (cap - 1);
            if (!tab[h].key) tab[h] = pslot{p, U++};
            idx[(size_t)r * max + j] = tab[h].id;
        }
    size_t rb = sizeof(float) * (size_t)(U > 0 ? U : 1) * width;
    float *h = (float *)dsv4_cuda_hbuf(b, rb);
    if (!h) {
        free(tab);
        free(idx);
        return -1;
    }
    int n_dev = 0;
    for (size_t s = 0; s < cap; s++)
        if (tab[s].key) {
            if (dsv4_cuda_is_dev(b, tab[s].key)) tab[n_dev++] = tab[s]; /* compacted in place: n_dev <= s */
            else memcpy(h + (size_t)tab[s].id * width, tab[s].key, sizeof(float) * width);
        }
    *rows_d = (float *)dsv4_cuda_stage(b, h, rb);
    *idx_d = (int32_t *)dsv4_cuda_stage(b, idx, sizeof(int32_t) * (size_t)rows * (max > 0 ? max : 1));
    if (n_dev > 0 && *rows_d) {
        const float **src = (const float **)malloc(sizeof(float *) * n_dev);
        int32_t *dst = (int32_t *)malloc(sizeof(int32_t) * n_dev);
        if (!src || !dst) {
            free(src), free(dst), free(tab), free(idx);
            dsv4_cuda_fail(b, "attention lists: out of host memory", __FILE__, __LINE__, cudaSuccess);
            return -1;
        }
        for (int i = 0; i < n_dev; i++) src[i] = tab[i].key, dst[i] = tab[i].id;
        const float **srcd = (const float **)dsv4_cuda_stage(b, src, sizeof(float *) * n_dev);
        int32_t *dstd = (int32_t *)dsv4_cuda_stage(b, dst, sizeof(int32_t) * n_dev);
        free(src);
        free(dst);
        if (!srcd || !dstd) {
            free(tab), free(idx);
            return -1;
        }
        k_gather<<<n_dev, 128, 0, CI(b)->stream>>>(*rows_d, srcd, dstd, width);
        if (CKL(b)) {
            free(tab), free(idx);
            return -1;
        }
    }
    /* the copies from pageable idx are complete when cudaMemcpyAsync returns; the pinned
     * h stays untouched until this op's fetch synchronizes */
    free(tab);
    free(idx);
    return (*rows_d && *idx_d) ? 0 : -1;
}

/* ----- sparse attention ----- */
__global__ void k_sparse_attn(float *out, const float *q, int n_heads, int head_dim, const float *K, const int32_t *idx,
                              const int *n_kv, int max_kv, const float *sink, float scale, int prob_bf16,
                              int out_bf16, float *sc) {
    extern __shared__ float qs[];
    __shared__ float red[32];
    int r = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float *qh = q + ((int64_t)r * n_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qh[d];
    __syncthreads();
    int n = n_kv[r];
    const int32_t *ir = idx + (int64_t)r * max_kv;
    float *s = sc + (int64_t)blockIdx.x * max_kv;
    float mx = sink[h];
    for (int j = warp; j < n; j += nw) {
        const float *k = K + (int64_t)ir[j] * head_dim;
        float a = 0.0f;
        for (int d = lane; d < head_dim; d += 32) a += qs[d] * k[d];
        a = warp_sum(a) * scale;
        if (lane == 0) s[j] = a;
        mx = fmaxf(mx, a);
    }
    mx = block_max(mx, red);
    __syncthreads();
    float den = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float e = expf(s[j] - mx);
        s[j] = e;
        den += e;
    }
    den = block_sum(den, red) + expf(sink[h] - mx);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float p = s[j] / den;
        s[j] = prob_bf16 ? d_round_bf16(p) : p;
    }
    __syncthreads();
    float *oh = out + ((int64_t)r * n_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int j = 0; j < n; j++) a += s[j] * K[(int64_t)ir[j] * head_dim + d];
        oh[d] = out_bf16 ? d_round_bf16(a) : a;
    }
}

void cu_sparse_attn(dsv4_backend *b, float *out, const float *q, int rows, int n_heads, int head_dim,
                    const float *const *kv, const int *n_kv, int max_kv, const float *sink, float scale, int prob_bf16,
                    int out_bf16) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0) return;
    size_t nq = (size_t)rows * n_heads * head_dim;
    float *Kd;
    int32_t *id;
    if (gather_rows(b, kv, n_kv, rows, max_kv, head_dim, &Kd, &id)) return;
    float *qd = (float *)dsv4_cuda_in(b, q, sizeof(float) * nq);
    int *nd = (int *)dsv4_cuda_stage(b, n_kv, sizeof(int) * rows);
    float *sd = (float *)dsv4_cuda_in(b, sink, sizeof(float) * n_heads);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * nq);
    float *sc = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rows * n_heads * (max_kv > 0 ? max_kv : 1));
    if (!qd || !nd || !sd || !od || !sc) return;
    k_sparse_attn<<<rows * n_heads, 256, sizeof(float) * head_dim, CI(b)->stream>>>(
        od, qd, n_heads, head_dim, Kd, id, nd, max_kv, sd, scale, prob_bf16, out_bf16, sc);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, out, od, sizeof(float) * nq);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_SPARSE_ATTN);
}

/* ----- indexer scores ----- */
__global__ void k_indexer(float *score, const float *q, const float *w, int n_heads, int head_dim, const float *keys,
                          const int32_t *idx, const int *n_keys, int max_keys, int score_bf16) {
    extern __shared__ float qs[];
    int r = blockIdx.y;
    int64_t nq = (int64_t)n_heads * head_dim;
    for (int64_t i = threadIdx.x; i < nq; i += blockDim.x) qs[i] = q[r * nq + i];
    __syncthreads();
    int lane = threadIdx.x & 31;
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= n_keys[r]) return;
    const float *k = keys + (int64_t)idx[(int64_t)r * max_keys + j] * head_dim;
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
                       int head_dim, const float *const *keys, const int *n_keys, int max_keys, int score_bf16) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0) return;
    size_t smem = sizeof(float) * (size_t)n_heads * head_dim;
    if (smem > 200 * 1024) {
        dsv4_cuda_fail(b, "indexer: q of one row exceeds 200 KB of shared memory", __FILE__, __LINE__, cudaSuccess);
        return;
    }
    float *Kd;
    int32_t *id;
    if (gather_rows(b, keys, n_keys, rows, max_keys, head_dim, &Kd, &id)) return;
    float *qd = (float *)dsv4_cuda_in(b, q, sizeof(float) * rows * n_heads * head_dim);
    float *wd = (float *)dsv4_cuda_in(b, w, sizeof(float) * rows * n_heads);
    int *nd = (int *)dsv4_cuda_stage(b, n_keys, sizeof(int) * rows);
    float *sd = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rows * (max_keys > 0 ? max_keys : 1));
    if (!qd || !wd || !nd || !sd) return;
    int maxn = 0;
    for (int r = 0; r < rows; r++) maxn = n_keys[r] > maxn ? n_keys[r] : maxn;
    if (maxn > 0) {
        if (CK(b, cudaFuncSetAttribute(k_indexer, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem))) return;
        k_indexer<<<dim3((unsigned)((maxn + 7) / 8), rows), 256, smem, CI(b)->stream>>>(
            sd, qd, wd, n_heads, head_dim, Kd, id, nd, max_keys, score_bf16);
        if (CKL(b)) return;
    }
    /* only the first n_keys[r] entries of each row are written (the rest is the caller's) */
    if (dsv4_cuda_is_dev(b, score)) { /* device scores: stream-ordered copies, no wait */
        for (int r = 0; r < rows && !CI(b)->failed; r++)
            if (n_keys[r] > 0)
                CK(b, cudaMemcpyAsync(score + (size_t)r * max_keys, sd + (size_t)r * max_keys,
                                      sizeof(float) * n_keys[r], cudaMemcpyDeviceToDevice, CI(b)->stream));
    } else if (rows <= 24) { /* one queued copy per row */
        for (int r = 0; r < rows; r++)
            if (n_keys[r] > 0)
                dsv4_cuda_fetch(b, score + (size_t)r * max_keys, sd + (size_t)r * max_keys, sizeof(float) * n_keys[r]);
    } else {
        for (int r = 0; r < rows && !CI(b)->failed; r++)
            if (n_keys[r] > 0)
                CK(b, cudaMemcpyAsync(score + (size_t)r * max_keys, sd + (size_t)r * max_keys,
                                      sizeof(float) * n_keys[r], cudaMemcpyDeviceToHost, CI(b)->stream));
        CK(b, cudaStreamSynchronize(CI(b)->stream));
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
    float *sd = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rows * stride);
    int *nd = (int *)dsv4_cuda_stage(b, n, sizeof(int) * rows);
    uint8_t *sel = (uint8_t *)dsv4_cuda_scratch(b, (size_t)rows * stride);
    int32_t *id = (int32_t *)dsv4_cuda_scratch(b, sizeof(int32_t) * (size_t)rows * k);
    int *no = (int *)dsv4_cuda_scratch(b, sizeof(int) * rows);
    if (!sd || !nd || !sel || !id || !no) return;
    int maxn = 0;
    for (int r = 0; r < rows; r++) {
        maxn = n[r] > maxn ? n[r] : maxn;
        if (n[r] > 0 && CK(b, cudaMemcpyAsync(sd + (size_t)r * stride, score + (size_t)r * stride,
                                             sizeof(float) * n[r], cudaMemcpyDefault, CI(b)->stream)))
            return;
    }
    if (maxn > 0) {
        k_topk_rank<<<dim3((unsigned)((maxn + 255) / 256), rows), 256, 0, CI(b)->stream>>>(sel, sd, stride, nd, k);
        if (CKL(b)) return;
    }
    k_topk_write<<<rows, 1024, 0, CI(b)->stream>>>(id, no, sel, stride, nd, k);
    if (CKL(b)) return;
    for (int r = 0; r < rows && !CI(b)->failed; r++) { /* min(k, n[r]) entries, as the kernel writes */
        int take = n[r] < k ? (n[r] > 0 ? n[r] : 0) : k;
        if (take > 0) dsv4_cuda_fetch(b, idx + (size_t)r * k, id + (size_t)r * k, sizeof(int32_t) * take);
    }
    dsv4_cuda_fetch(b, n_out, no, sizeof(int) * rows);
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
