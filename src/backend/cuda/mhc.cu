/* backend/cuda/mhc.cu: manifold-constrained hyper-connections (spec §2.3, §2.7).
 *
 * hc_pre / hc_head run as two kernels, whatever the batch:
 *   k_hc_part  grid (splits, ceil(rows/8)), 256 threads.  Block (s, g) takes columns
 *              [s*kspan, (s+1)*kspan) of rows 8g..8g+7 of X [rows][hc*dim]: warp r stages
 *              row r's tile of 512 columns in shared memory (rounded to bf16 when
 *              gemm_bf16) and sums its unrounded squares; then warp w forms the dot
 *              products of mix outputs m = w, w+8, ... (4 per pass) with every staged row,
 *              each lane loading 16-byte vectors of fn (f32; other formats element-wise)
 *              for all of its outputs before the math.  Partials land in scratch
 *              part[row][m][split] (m = nm is the sum of squares).  kspan is a multiple
 *              of 128 chosen so that ~264 blocks run: at batch 1 (nm = 24, K = 16384)
 *              128 blocks each read 12 KB of fn.
 *   k_hc_fin   one block (256 threads) per row: warp w sums the partials of m = w, w+8, ...
 *              in split order (lane-strided, then a warp tree), rsqrt(mean + eps), then
 *              threads j < hc form pre (and post, and the softmaxed comb rows) in shared
 *              memory; warp 0 runs the Sinkhorn iterations (hc <= 5: lane i*hc + k keeps
 *              C[i][k] in a register and gathers its row's, then its column's, values by
 *              shuffles, summing them serially in the CPU's order; larger hc: thread j
 *              normalizes row j, thread k column k, in shared memory, same order), so the
 *              same arithmetic as the CPU op, while warps 1..7 form y = sum_j pre_j X_j;
 *              post and comb are written once at the end.
 *   No atomics; the split sums are in a fixed order, so results are deterministic.
 *   Differences from the CPU op: only the accumulation order of the mix dot products
 *   and the sum of squares (fp32; measured in tests/test_cuda_ops.c, tolerance 1e-5).
 * hc_post: one thread per output element: post[k] o[d] + sum_j comb[j][k] R[j][d].
 * Layout: X [rows][hc*dim] (stream j at j*dim), post [rows][hc], comb [rows][hc*hc].
 * Limits: hc <= 16.  Target: sm_90a.
 */
#include "backend/cuda/common.cuh"

__device__ __forceinline__ float d_sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

enum { HC_RB = 8, HC_TILE = 512, HC_THREADS = 256 };

/* partial mix dot products and sums of squares of one K-slice for up to 8 rows */
__global__ void __launch_bounds__(HC_THREADS) k_hc_part(float *part, const float *__restrict__ X, int rows,
                                                        int64_t K, dweight fn, int nm, int64_t kspan, int splits,
                                                        int gemm_bf16) {
    __shared__ __align__(16) float xs[HC_RB][HC_TILE];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int s = blockIdx.x;
    int r0 = blockIdx.y * HC_RB, nr = rows - r0 < HC_RB ? rows - r0 : HC_RB;
    int64_t kb = (int64_t)s * kspan, ke = kb + kspan < K ? kb + kspan : K;
    int vx = K % 4 == 0 && ((uintptr_t)X & 15) == 0;
    int vw = vx && fn.fmt == DSV4_WF_F32 && ((uintptr_t)fn.data & 15) == 0;
    float ss = 0.0f;
    for (int m0 = 0; m0 < nm; m0 += 32) { /* outputs m0 + warp + 8u, u < 4 */
        float acc[4][HC_RB];
#pragma unroll
        for (int u = 0; u < 4; u++)
#pragma unroll
            for (int r = 0; r < HC_RB; r++) acc[u][r] = 0.0f;
        for (int64_t t0 = kb; t0 < ke; t0 += HC_TILE) {
            int64_t tn = ke - t0 < HC_TILE ? ke - t0 : HC_TILE;
            __syncthreads(); /* the previous tile is consumed */
            if (warp < nr) { /* warp r stages row r (zero past the slice) */
                const float *xr = X + (int64_t)(r0 + warp) * K + t0;
                for (int c = lane * 4; c < HC_TILE; c += 128) {
                    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (vx && c < tn) v = __ldg((const float4 *)(xr + c));
                    else if (c < tn) {
                        v.x = xr[c];
                        v.y = c + 1 < tn ? xr[c + 1] : 0.0f;
                        v.z = c + 2 < tn ? xr[c + 2] : 0.0f;
                        v.w = c + 3 < tn ? xr[c + 3] : 0.0f;
                    }
                    if (m0 == 0) ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                    if (gemm_bf16) v.x = d_round_bf16(v.x), v.y = d_round_bf16(v.y), v.z = d_round_bf16(v.z),
                                   v.w = d_round_bf16(v.w);
                    *(float4 *)&xs[warp][c] = v;
                }
            }
            __syncthreads();
            for (int c = lane * 4; c < tn; c += 128) {
                float4 wv[4];
#pragma unroll
                for (int u = 0; u < 4; u++) { /* every weight load of this step before the math */
                    int m = m0 + warp + 8 * u;
                    wv[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (m >= nm) continue;
                    int64_t k = t0 + c;
                    if (vw) {
                        wv[u] = __ldg((const float4 *)((const float *)fn.data + (int64_t)m * K + k));
                    } else {
                        wv[u].x = d_weight_at(fn, m, k);
                        wv[u].y = c + 1 < tn ? d_weight_at(fn, m, k + 1) : 0.0f;
                        wv[u].z = c + 2 < tn ? d_weight_at(fn, m, k + 2) : 0.0f;
                        wv[u].w = c + 3 < tn ? d_weight_at(fn, m, k + 3) : 0.0f;
                    }
                    if (gemm_bf16) wv[u].x = d_round_bf16(wv[u].x), wv[u].y = d_round_bf16(wv[u].y),
                                   wv[u].z = d_round_bf16(wv[u].z), wv[u].w = d_round_bf16(wv[u].w);
                }
#pragma unroll
                for (int r = 0; r < HC_RB; r++) {
                    if (r >= nr) break;
                    float4 xv = *(const float4 *)&xs[r][c];
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        acc[u][r] += wv[u].x * xv.x + wv[u].y * xv.y + wv[u].z * xv.z + wv[u].w * xv.w;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int m = m0 + warp + 8 * u;
#pragma unroll
            for (int r = 0; r < HC_RB; r++) {
                if (r >= nr) break;
                float v = warp_sum(acc[u][r]);
                if (lane == 0 && m < nm) part[((int64_t)(r0 + r) * (nm + 1) + m) * splits + s] = v;
            }
        }
    }
    if (warp < nr) {
        ss = warp_sum(ss);
        if (lane == 0) part[((int64_t)(r0 + warp) * (nm + 1) + nm) * splits + s] = ss;
    }
}

/* partials -> mix, rms, pre/post/comb (Sinkhorn in shared memory), y; head = 1: pre and y only */
__global__ void __launch_bounds__(HC_THREADS) k_hc_fin(float *y, float *post, float *comb, const float *part,
                                                       int splits, const float *__restrict__ X, int hc, int dim,
                                                       dweight base, dweight scale, int iters, float norm_eps,
                                                       float hc_eps, int out_bf16, int head) {
    __shared__ float mix[(2 + 16) * 16 + 1];
    __shared__ float C[16 * 16];
    __shared__ float pre[16], pst[16];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int64_t r = blockIdx.x;
    int nm = head ? hc : (2 + hc) * hc;
    for (int m = warp; m <= nm; m += nw) {
        const float *p = part + (r * (nm + 1) + m) * splits;
        float v = 0.0f;
        for (int s = lane; s < splits; s += 32) v += p[s];
        v = warp_sum(v);
        if (lane == 0) mix[m] = v;
    }
    __syncthreads();
    int64_t width = (int64_t)hc * dim;
    float sn = 1.0f / sqrtf(mix[nm] / (float)width + norm_eps);
    int j = threadIdx.x;
    if (j < hc) {
        pre[j] = d_sigmoid((mix[j] * sn) * d_weight_at(scale, 0, 0) + d_weight_at(base, 0, j)) + hc_eps;
        if (!head) {
            pst[j] = 2.0f * d_sigmoid((mix[hc + j] * sn) * d_weight_at(scale, 0, 1) + d_weight_at(base, 0, hc + j));
            float sc2 = d_weight_at(scale, 0, 2), mx = -INFINITY, sum = 0.0f;
            float *cr = C + j * hc;
            for (int k = 0; k < hc; k++) { /* row softmax, + eps (the CPU's order) */
                cr[k] = (mix[2 * hc + j * hc + k] * sn) * sc2 + d_weight_at(base, 0, 2 * hc + j * hc + k);
                mx = fmaxf(mx, cr[k]);
            }
            for (int k = 0; k < hc; k++) sum += (cr[k] = expf(cr[k] - mx));
            for (int k = 0; k < hc; k++) cr[k] = cr[k] / sum + hc_eps;
        }
    }
    __syncthreads();
    if (warp == 0) {
        if (head) return; /* warp 0 has nothing else to do; y is formed by warps 1.. */
        if (hc * hc <= 32) { /* lane i*hc + k holds C[i][k] in a register; sums gathered by shuffles */
            int i = lane / hc, k = lane % hc;
            float cv = lane < hc * hc ? C[lane] : 0.0f;
            for (int it = 0; it < iters; it++) {
                if (it > 0) { /* row i: sum over k ascending, as the CPU */
                    float sum = 0.0f;
                    for (int t = 0; t < hc; t++) sum += __shfl_sync(0xffffffffu, cv, i * hc + t);
                    cv /= sum + hc_eps;
                }
                float sum = 0.0f; /* column k: sum over i ascending */
                for (int t = 0; t < hc; t++) sum += __shfl_sync(0xffffffffu, cv, t * hc + k);
                cv /= sum + hc_eps;
            }
            if (lane < hc * hc) comb[r * hc * hc + lane] = cv;
            if (lane < hc) post[r * hc + lane] = pst[lane];
            return;
        }
        for (int it = 0; it < iters; it++) {
            if (it > 0 && lane < hc) { /* row lane */
                float sum = 0.0f;
                for (int k = 0; k < hc; k++) sum += C[lane * hc + k];
                for (int k = 0; k < hc; k++) C[lane * hc + k] /= sum + hc_eps;
            }
            __syncwarp();
            if (lane < hc) { /* column lane */
                float sum = 0.0f;
                for (int i = 0; i < hc; i++) sum += C[i * hc + lane];
                for (int i = 0; i < hc; i++) C[i * hc + lane] /= sum + hc_eps;
            }
            __syncwarp();
        }
        for (int i = lane; i < hc * hc; i += 32) comb[r * hc * hc + i] = C[i];
        if (lane < hc) post[r * hc + lane] = pst[lane];
        return;
    }
    /* warps 1..: y = sum_j pre_j X_j (j ascending, as the CPU) */
    const float *xr = X + r * width;
    float *yr = y + r * dim;
    int t = threadIdx.x - 32, nt = blockDim.x - 32;
    if (dim % 4 == 0 && ((uintptr_t)xr & 15) == 0 && ((uintptr_t)yr & 15) == 0) {
        for (int d = t * 4; d < dim; d += nt * 4) {
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int jj = 0; jj < hc; jj++) {
                float4 xv = __ldg((const float4 *)(xr + (int64_t)jj * dim + d));
                float pj = pre[jj];
                v.x += pj * xv.x, v.y += pj * xv.y, v.z += pj * xv.z, v.w += pj * xv.w;
            }
            if (out_bf16) v.x = d_round_bf16(v.x), v.y = d_round_bf16(v.y), v.z = d_round_bf16(v.z),
                          v.w = d_round_bf16(v.w);
            *(float4 *)(yr + d) = v;
        }
    } else {
        for (int d = t; d < dim; d += nt) {
            float v = 0.0f;
            for (int jj = 0; jj < hc; jj++) v += pre[jj] * xr[(int64_t)jj * dim + d];
            yr[d] = out_bf16 ? d_round_bf16(v) : v;
        }
    }
}

static void hc_common(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc, int dim,
                      const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                      float norm_eps, float hc_eps, int gemm_bf16, int out_bf16, int head) {
    dweight wf, wb, ws;
    if (rows <= 0 || dsv4_cuda_weight(b, fn, &wf) || dsv4_cuda_weight(b, base, &wb) || dsv4_cuda_weight(b, scale, &ws))
        return;
    if (hc < 1 || hc > 16) {
        dsv4_cuda_fail(b, "hc_pre/hc_head: hc over 16", __FILE__, __LINE__, cudaSuccess);
        return;
    }
    int nm = head ? hc : (2 + hc) * hc;
    int64_t K = (int64_t)hc * dim;
    /* K-slices of a multiple of 128 columns (one warp sweep of 16-byte vectors), enough
     * of them that ~2 blocks per SM run; the partials are summed in split order */
    int groups = (rows + HC_RB - 1) / HC_RB;
    int64_t chunks = (K + 127) / 128, want = (264 + groups - 1) / groups;
    if (want > chunks) want = chunks;
    if (want < 1) want = 1;
    int64_t kspan = (chunks + want - 1) / want * 128;
    int splits = (int)((K + kspan - 1) / kspan);
    float *xd = (float *)dsv4_cuda_in(b, X, sizeof(float) * rows * K);
    float *part = (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * (nm + 1) * splits);
    float *yd = (float *)dsv4_cuda_out(b, y, sizeof(float) * rows * dim);
    float *pd = head ? (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * hc)
                     : (float *)dsv4_cuda_out(b, post, sizeof(float) * rows * hc);
    float *cd = head ? (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * hc * hc)
                     : (float *)dsv4_cuda_out(b, comb, sizeof(float) * rows * hc * hc);
    if (!xd || !part || !yd || !pd || !cd) return;
    k_hc_part<<<dim3((unsigned)splits, (unsigned)groups), HC_THREADS, 0, CI(b)->stream>>>(part, xd, rows, K, wf, nm,
                                                                                          kspan, splits, gemm_bf16);
    if (CKL(b)) return;
    k_hc_fin<<<rows, HC_THREADS, 0, CI(b)->stream>>>(yd, pd, cd, part, splits, xd, hc, dim, wb, ws, iters, norm_eps,
                                                     hc_eps, out_bf16, head);
    if (CKL(b)) return;
    if (!head) {
        dsv4_cuda_commit(b, post, pd, sizeof(float) * rows * hc);
        dsv4_cuda_commit(b, comb, cd, sizeof(float) * rows * hc * hc);
    }
    dsv4_cuda_commit(b, y, yd, sizeof(float) * rows * dim);
}

void cu_hc_pre(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc, int dim,
               const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters, float norm_eps,
               float hc_eps, int gemm_bf16, int out_bf16) {
    dsv4_cuda_op_begin(b);
    hc_common(b, y, post, comb, X, rows, hc, dim, fn, base, scale, iters, norm_eps, hc_eps, gemm_bf16, out_bf16, 0);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_HC_PRE);
}

void cu_hc_head(dsv4_backend *b, float *y, const float *X, int rows, int hc, int dim, const dsv4_weight *fn,
                const dsv4_weight *base, const dsv4_weight *scale, float norm_eps, float hc_eps, int gemm_bf16,
                int out_bf16) {
    dsv4_cuda_op_begin(b);
    hc_common(b, y, NULL, NULL, X, rows, hc, dim, fn, base, scale, 0, norm_eps, hc_eps, gemm_bf16, out_bf16, 1);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_HC_HEAD);
}

__global__ void k_hc_post(float *Xout, const float *o, const float *R, const float *post, const float *comb, int rows,
                          int hc, int dim, int state_bf16) {
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)rows * hc * dim) return;
    int d = (int)(t % dim);
    int k = (int)((t / dim) % hc);
    int64_t r = t / ((int64_t)hc * dim);
    const float *C = comb + r * hc * hc, *Rr = R + r * hc * dim;
    float v = post[r * hc + k] * o[r * dim + d];
    for (int j = 0; j < hc; j++) v += C[j * hc + k] * Rr[(int64_t)j * dim + d];
    Xout[t] = state_bf16 ? d_round_bf16(v) : v;
}

void cu_hc_post(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post, const float *comb,
                int rows, int hc, int dim, int state_bf16) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0) return;
    size_t n = (size_t)rows * hc * dim;
    float *od = (float *)dsv4_cuda_in(b, o, sizeof(float) * rows * dim);
    float *rd = (float *)dsv4_cuda_in(b, R, sizeof(float) * n);
    float *pd = (float *)dsv4_cuda_in(b, post, sizeof(float) * rows * hc);
    float *cd = (float *)dsv4_cuda_in(b, comb, sizeof(float) * rows * hc * hc);
    float *xd = (float *)dsv4_cuda_out(b, Xout, sizeof(float) * n);
    if (!od || !rd || !pd || !cd || !xd) return;
    k_hc_post<<<(unsigned)((n + 255) / 256), 256, 0, CI(b)->stream>>>(xd, od, rd, pd, cd, rows, hc, dim, state_bf16);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, Xout, xd, sizeof(float) * n);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_HC_POST);
}
