/* backend/cuda/mhc.cu: manifold-constrained hyper-connections (spec §2.3, §2.7).
 *
 * hc_pre / hc_head: the mix projection fn [nm, hc*dim] . X[r] runs through the
 *   dequantizing linear (k_linear; gemm_bf16 rounds both X and fn to bf16 as the CPU
 *   does), then one block per row: rsqrt(mean(X^2)+eps) by a block tree, thread 0
 *   forms pre/post/comb and the Sinkhorn iterations (hc <= 16, a few hundred flops),
 *   and all threads form y = sum_j pre_j X_j.
 * hc_post: one thread per output element: post[k] o[d] + sum_j comb[j][k] R[j][d].
 * Layout: X [rows][hc*dim] (stream j at j*dim), post [rows][hc], comb [rows][hc*hc].
 * Target: sm_90a.
 */
#include "backend/cuda/common.cuh"

__device__ __forceinline__ float d_sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

/* mix [rows][nm] (unscaled) -> y, post, comb; head = 1 computes only pre and y (hc_head) */
__global__ void k_hc_finish(float *y, float *post, float *comb, const float *mix, const float *X, int hc, int dim,
                            dweight base, dweight scale, int iters, float norm_eps, float hc_eps, int out_bf16,
                            int head) {
    __shared__ float sh[32];
    __shared__ float pre[16];
    int64_t r = blockIdx.x;
    int64_t width = (int64_t)hc * dim;
    const float *xr = X + r * width;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, sh);
    if (threadIdx.x == 0) {
        float s = 1.0f / sqrtf(ss / (float)width + norm_eps);
        int nm = head ? hc : (2 + hc) * hc;
        const float *mr = mix + r * nm;
        float sc0 = d_weight_at(scale, 0, 0);
        for (int j = 0; j < hc; j++) pre[j] = d_sigmoid((mr[j] * s) * sc0 + d_weight_at(base, 0, j)) + hc_eps;
        if (!head) {
            float sc1 = d_weight_at(scale, 0, 1), sc2 = d_weight_at(scale, 0, 2);
            for (int j = 0; j < hc; j++)
                post[r * hc + j] = 2.0f * d_sigmoid((mr[hc + j] * s) * sc1 + d_weight_at(base, 0, hc + j));
            float *C = comb + r * hc * hc;
            for (int j = 0; j < hc; j++) {
                float mx = -INFINITY;
                for (int k = 0; k < hc; k++) {
                    C[j * hc + k] = (mr[2 * hc + j * hc + k] * s) * sc2 + d_weight_at(base, 0, 2 * hc + j * hc + k);
                    mx = fmaxf(mx, C[j * hc + k]);
                }
                float sum = 0.0f;
                for (int k = 0; k < hc; k++) sum += (C[j * hc + k] = expf(C[j * hc + k] - mx));
                for (int k = 0; k < hc; k++) C[j * hc + k] = C[j * hc + k] / sum + hc_eps;
            }
            for (int it = 0; it < iters; it++) {
                if (it > 0)
                    for (int j = 0; j < hc; j++) {
                        float sum = 0.0f;
                        for (int k = 0; k < hc; k++) sum += C[j * hc + k];
                        for (int k = 0; k < hc; k++) C[j * hc + k] /= sum + hc_eps;
                    }
                for (int k = 0; k < hc; k++) {
                    float sum = 0.0f;
                    for (int j = 0; j < hc; j++) sum += C[j * hc + k];
                    for (int j = 0; j < hc; j++) C[j * hc + k] /= sum + hc_eps;
                }
            }
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float v = 0.0f;
        for (int j = 0; j < hc; j++) v += pre[j] * xr[(int64_t)j * dim + d];
        y[r * dim + d] = out_bf16 ? d_round_bf16(v) : v;
    }
}

static void hc_common(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc, int dim,
                      const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                      float norm_eps, float hc_eps, int gemm_bf16, int out_bf16, int head) {
    dweight wf, wb, ws;
    if (rows <= 0 || dsv4_cuda_weight(b, fn, &wf) || dsv4_cuda_weight(b, base, &wb) || dsv4_cuda_weight(b, scale, &ws))
        return;
    int nm = head ? hc : (2 + hc) * hc;
    size_t width = (size_t)hc * dim;
    float *xd = (float *)dsv4_cuda_in(b, X, sizeof(float) * rows * width);
    float *xb = gemm_bf16 ? (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * width) : xd;
    float *mix = (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * nm);
    float *yd = (float *)dsv4_cuda_out(b, y, sizeof(float) * rows * dim);
    float *pd = head ? (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * hc)
                     : (float *)dsv4_cuda_out(b, post, sizeof(float) * rows * hc);
    float *cd = head ? (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * hc * hc)
                     : (float *)dsv4_cuda_out(b, comb, sizeof(float) * rows * hc * hc);
    if (!xd || !xb || !mix || !yd || !pd || !cd) return;
    if (gemm_bf16) {
        if (CK(b, cudaMemcpyAsync(xb, xd, sizeof(float) * rows * width, cudaMemcpyDeviceToDevice, CI(b)->stream)))
            return;
        dsv4_cuda_round_bf16(b, xb, rows * width);
    }
    dsv4_cuda_linear(b, mix, nm, xb, width, rows, wf, 0, nm, gemm_bf16, 0);
    k_hc_finish<<<rows, 256, 0, CI(b)->stream>>>(yd, pd, cd, mix, xd, hc, dim, wb, ws, iters, norm_eps, hc_eps,
                                                 out_bf16, head);
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
