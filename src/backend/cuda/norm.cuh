/* backend/cuda/norm.cuh: the rmsnorm arithmetic of norm.cu's vector kernels (d_rmsnorm4 and the
 * pieces it is made of), shared with the kernels that norm their input themselves (linear.cu's
 * k_gemv8n: matmul_rn), so a fused op gives the separate ops' bits.  Included by .cu files only. */
#ifndef DSV4_BACKEND_CUDA_NORM_CUH
#define DSV4_BACKEND_CUDA_NORM_CUH

#include "backend/cuda/common.cuh"

/* the norm's factor from the sum of bf16-rounded squares, each step rounded to bf16 as torch on a
 * bf16 tensor: mean, + eps, rsqrt (DSV4_NORM_BF16_STEPS; the CPU's expression) */
__device__ __forceinline__ float d_norm_steps(float ss, int dim, float eps) {
    return d_round_bf16(1.0f / sqrtf(d_round_bf16(__fadd_rn(d_round_bf16(ss / (float)dim), eps))));
}

/* weights 4c..4c+3 as one 16-byte (f32, vw = 1) or 8-byte (bf16, vw = 2) load where the
 * host found the data aligned, else element by element (same values either way) */
__device__ __forceinline__ float4 d_weight4(const dweight &w, int64_t c, int vw) {
    if (vw == 1) return __ldg((const float4 *)w.data + c);
    if (vw == 2) {
        uint2 u = __ldg((const uint2 *)w.data + c);
        return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                           __uint_as_float(u.y & 0xffff0000u));
    }
    return make_float4(d_weight_at(w, 0, 4 * c), d_weight_at(w, 0, 4 * c + 1), d_weight_at(w, 0, 4 * c + 2),
                       d_weight_at(w, 0, 4 * c + 3));
}

/* a float4's sum of squares ((x x + y y) + z z) + w w, every product and sum rounded (no
 * fma: the CPU's arithmetic, only the order of the row sum differs).  Written with
 * intrinsics so that no kernel's fma contraction can differ: k_norm_rope and the norm
 * inside hc_pre (mhc.cu, hc_sq4: the same expression) give these kernels' bits. */
__device__ __forceinline__ float d_sq4(float4 v) {
    return __fadd_rn(__fadd_rn(__fadd_rn(__fmul_rn(v.x, v.x), __fmul_rn(v.y, v.y)), __fmul_rn(v.z, v.z)),
                     __fmul_rn(v.w, v.w));
}

/* d_sq4 with each square rounded to bf16 first (DSV4_NORM_BF16_STEPS) */
__device__ __forceinline__ float d_sq4_bf16(float4 v) {
    return __fadd_rn(__fadd_rn(__fadd_rn(d_round_bf16(__fmul_rn(v.x, v.x)), d_round_bf16(__fmul_rn(v.y, v.y))),
                               d_round_bf16(__fmul_rn(v.z, v.z))),
                     d_round_bf16(__fmul_rn(v.w, v.w)));
}

/* float4 lt of the vector at xr (dim = 4 * nt: nt threads, lt this one among them, sh their
 * nt/32 slots), normed: its weights loaded with it (one memory round trip before the block sum
 * instead of three), then x * s * w rounded to bf16 if asked.  k_rmsnorm_vec, k_norm_rope and
 * k_op_list all call it: the same bits. */
__device__ __forceinline__ float4 d_rmsnorm4(const float4 *xr, int dim, const dweight &w, int has_w, int vw,
                                             float eps, int out_bf16, float *sh, int lt, int nt) {
    int t = lt;
    float4 v = __ldg(xr + t), wv = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    if (has_w) wv = d_weight4(w, t, vw);
    const int steps = out_bf16 & DSV4_NORM_BF16_STEPS;
    float ss = d_part_sum(steps ? d_sq4_bf16(v) : d_sq4(v), sh, lt, nt);
    float s = steps ? d_norm_steps(ss, dim, eps) : 1.0f / sqrtf(ss / (float)dim + eps);
    float4 o = make_float4(v.x * s, v.y * s, v.z * s, v.w * s);
    if (has_w) o.x *= wv.x, o.y *= wv.y, o.z *= wv.z, o.w *= wv.w;
    if (out_bf16) o.x = d_round_bf16(o.x), o.y = d_round_bf16(o.y), o.z = d_round_bf16(o.z), o.w = d_round_bf16(o.w);
    return o;
}

/* norm.cu's choice of kernel for rmsnorm and norm_rope: 1 (and dim/4 threads in *th) when the vector
 * kernels take dim at xd -> od; the weights' vector width for them (0: element loads) */
int rmsnorm_vec_threads(int dim, const void *xd, const void *od, int *th);
int rmsnorm_vw(const dsv4_weight *w, const dweight &dw);

/* rmsnorm's launch (cu_rmsnorm without the op around it) on device rows xd -> od, dw the device form
 * of w (NULL: unweighted); 1 on error (sticky) */
int dsv4_cuda_rmsnorm_dev(dsv4_backend *b, float *od, const float *xd, int rows, int dim, const dsv4_weight *w,
                          const dweight &dw, float eps, int out_bf16);

#endif
