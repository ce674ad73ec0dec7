/* backend/cuda/rope.cuh: RoPE's arithmetic as norm.cu's rope and norm_rope kernels form it,
 * shared with the attention kernels that apply RoPE in their epilogue or as they load q
 * (attn.cu: sparse_attn_rope, indexer_scores_rs), so a fused op gives the separate ops' bits.
 * Included by .cu files only.
 *
 * The angle of pair i at position p is the fp32 product (float)p * (float)freq[i] (as the
 * CPU); positions and frequencies travel by value (rope_args) up to ROPE_ARG_ROWS rows, else
 * staged to the device (rope_inputs, norm.cu). */
#ifndef DSV4_BACKEND_CUDA_ROPE_CUH
#define DSV4_BACKEND_CUDA_ROPE_CUH

#include "backend/cuda/common.cuh"

/* RoPE angles' inputs passed by value (kernel parameters) for small batches, so a decode
 * call stages nothing: no host copy, no upload for the next op to wait on */
enum { ROPE_ARG_ROWS = 32, ROPE_ARG_HALF = 64 };
struct rope_args {
    int64_t pos[ROPE_ARG_ROWS];
    float freq[ROPE_ARG_HALF];
};

/* (x0, x1) rotated by the angle whose cosine and sine (the sine negated when inverse) are c
 * and s, rounded to bf16 if asked: every product and sum rounded as the CPU's (no fma;
 * intrinsics, so every kernel that calls it gives the same bits whatever its contraction) */
__device__ __forceinline__ float2 d_rope_rot_cs(float x0, float x1, float c, float s, int out_bf16) {
    float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)), y1 = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
    return out_bf16 ? make_float2(d_round_bf16(y0), d_round_bf16(y1)) : make_float2(y0, y1);
}

/* (x0, x1) rotated by angle a (its conjugate when inverse); cosf/sinf are CUDA's
 * full-precision versions (<= 2 ulp from glibc's), the same values in every kernel */
__device__ __forceinline__ float2 d_rope_rot(float x0, float x1, float a, int inverse, int out_bf16) {
    float c = cosf(a), s = sinf(a);
    if (inverse) s = -s;
    return d_rope_rot_cs(x0, x1, c, s, out_bf16);
}

/* RoPE's positions and frequencies for a launch: by value up to ROPE_ARG_ROWS rows and
 * ROPE_ARG_HALF pairs (*pd, *fd NULL), else staged to the device (*pd, *fd); 1 on error
 * (sticky error set).  Call inside an op (after dsv4_cuda_op_begin: staging uses the op's
 * arenas). */
int rope_inputs(dsv4_backend *b, int rows, int half, const int64_t *pos, const double *freq, rope_args *a,
                const int64_t **pd, const float **fd);

#endif
