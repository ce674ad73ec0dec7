/* backend/cuda/moe.cuh: what moe.cu (routing, decode-shaped MoE kernels) and moe_gemm.cu
 * (the many-row MoE of prefill) share.  Included by .cu files only. */
#ifndef DSV4_BACKEND_CUDA_MOE_CUH
#define DSV4_BACKEND_CUDA_MOE_CUH

#include "backend/cuda/common.cuh"

/* one expert as the kernels see it; the table has n_routed + 1 entries (the last: the shared
 * expert, when there is one) */
struct dexpert {
    dweight w1, w3, w2;
    unsigned long long bytes; /* w1 + w2 + w3 as stored (weight-byte counter) */
    int q1;                   /* w1 is quantized: act_fp8 quantizes x for it */
};

/* SwiGLU of one feature as the CPU's moe forms it: gate and up (bf16-rounded under act_bf16),
 * clamped by limit when > 0, silu(gate) * up, times pre (the weight applied before w2),
 * bf16-rounded under act_bf16; the one-row, slot-group and GEMM kernels all call it */
__device__ __forceinline__ float moe_swiglu(float gv, float uv, float limit, int act_bf16, float pre) {
    if (act_bf16) gv = d_round_bf16(gv), uv = d_round_bf16(uv);
    if (limit > 0) { /* compares, as the CPU: a NaN stays NaN (fminf would return the limit) */
        gv = gv > limit ? limit : gv;
        uv = uv > limit ? limit : uv < -limit ? -limit : uv;
    }
    float v = gv / (1.0f + expf(-gv)) * uv;
    v *= pre;
    return act_bf16 ? d_round_bf16(v) : v;
}

/* Many-row MoE (moe_gemm.cu): out[rows][dim] for the routing e/wgt ([rows][k], device), x and
 * its act-quantized copy xq (device; xq == x when no quantization applies), the device
 * expert table tab.  Returns 1 when it ran, 0 when the shapes or formats need the slot-group
 * kernels of moe.cu (nothing was launched then).  wbytes/flags: the device weight-byte
 * counter and sticky flags of moe.cu (a bad expert id sets DSV4_DEVFLAG_EXPERT there). */
int dsv4_cuda_moe_gemm(dsv4_backend *b, float *out, const float *x, const float *xq, int rows,
                       const dsv4_ffn_w *experts, int n_routed, const dsv4_ffn_w *shared, const dexpert *tab,
                       const int32_t *e, const float *wgt, int k, float limit, int before_w2, int act_fp8,
                       int act_bf16, float out_scale, unsigned long long *wbytes, unsigned *flags,
                       unsigned bad_flag);

/* out[r] = (sum over i < k of cw[r*k+i] y[order[r*k+i]], order -1 skipped, in that order) x
 * out_scale + y[nrs + r] when has_shared; bf16-rounded when act_bf16.  unrolled: the kernel
 * that loads the first 8 pairs before the sum (same result); launched on the backend's stream */
void dsv4_cuda_moe_combine(dsv4_backend *b, float *out, const float *y, int64_t dim, int rows, int k,
                           const int32_t *order, const float *cw, int nrs, int has_shared, float out_scale,
                           int act_bf16, int unrolled);

/* 1 if the experts' formats and shapes suit dsv4_cuda_moe_gemm (host-side check) */
int dsv4_cuda_moe_gemm_takes(const dsv4_ffn_w *experts, int n_routed, const dsv4_ffn_w *shared);

/* rows from which cu_moe takes dsv4_cuda_moe_gemm (DSV4_CUDA_MOE_GEMM_MIN_ROWS overrides;
 * 0 there switches the path off) */
int dsv4_cuda_moe_gemm_min_rows(void);

#endif
