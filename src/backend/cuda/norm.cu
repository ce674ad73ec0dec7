/* backend/cuda/norm.cu: row-wise elementwise ops: rmsnorm, rope, scale, sim.
 *
 * rmsnorm: one block per vector; sum of squares by a block tree (the CPU sums
 *   serially: accumulation order is the only difference), then x * rsqrt(mean + eps) * w,
 *   rounded to bf16 if asked -- the same expression.  Dims that are multiples of 128 up to
 *   4096 (every Flash norm but the per-head 64) take k_rmsnorm_vec: dim/4 threads (at most
 *   1024: one float4 per thread at dim 4096), the row and its weights held in registers from
 *   one round of loads, bf16 / f32 weights as one 8- / 16-byte load per 4; others k_rmsnorm
 *   (256 threads).  Measured on the H200 (ktrace, tests/test_cuda_mhc DSV4_MHC_BENCH=2, bf16
 *   weights evicted from L2, 1 row): dim 4096 4.57 us with 256 threads and element-wise
 *   weights, 3.20 with vector weights, 2.46 at 512 threads, 2.19 at 1024; dim 1024 1.97 ->
 *   1.61, dim 512 1.85 -> 1.51 (vector weights).
 * rope: one thread per (row, pair, head); angle = fp32 (float)pos * (float)freq like
 *   the CPU; cosf/sinf are CUDA's full-precision versions (<= 2 ulp from glibc's).  Up
 *   to 32 rows (decode) the positions and frequencies go in the kernel's parameters
 *   (k_rope_args), so the call is one launch with nothing staged; larger batches
 *   stage them (k_rope).
 * sim: one block (128 threads) per row; each warp takes whole quantization blocks
 *   (fp8: amax -> pow2 scale -> e4m3 RNE -> back; fp4 likewise onto e2m1); the
 *   Hadamard runs stage by stage in shared memory with the CPU's butterfly order,
 *   so every mode is bit-exact with the CPU's.
 * Layout: fp32 rows, row-major.  Target: sm_90a.
 */
#include "backend/cuda/common.cuh"

__global__ void k_rmsnorm(float *out, const float *x, int dim, dweight w, int has_w, float eps, int out_bf16) {
    __shared__ float sh[32];
    int64_t r = blockIdx.x;
    const float *xr = x + r * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, sh);
    float s = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] * s;
        if (has_w) v *= d_weight_at(w, 0, i);
        out[r * dim + i] = out_bf16 ? d_round_bf16(v) : v;
    }
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

/* dim = 4 * NV * blockDim.x: thread t holds float4s t, t + blockDim.x, ... of the row in
 * registers, with their weights loaded in the same breath (one memory round trip before
 * the block sum instead of three), then writes x * s * w from registers (in place is safe:
 * a thread writes only what it read). */
template <int NV>
__global__ void k_rmsnorm_vec(float *out, const float *x, int dim, dweight w, int has_w, int vw, float eps,
                              int out_bf16) {
    __shared__ float sh[32];
    int64_t r = blockIdx.x;
    const float4 *xr = (const float4 *)(x + r * dim);
    float4 v[NV], wv[NV];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; j++) {
        int i = threadIdx.x + j * blockDim.x;
        v[j] = __ldg(xr + i);
        if (has_w) wv[j] = d_weight4(w, i, vw);
    }
#pragma unroll
    for (int j = 0; j < NV; j++) ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    ss = block_sum(ss, sh);
    float s = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int j = 0; j < NV; j++) {
        float4 o = make_float4(v[j].x * s, v[j].y * s, v[j].z * s, v[j].w * s);
        if (has_w) o.x *= wv[j].x, o.y *= wv[j].y, o.z *= wv[j].z, o.w *= wv[j].w;
        if (out_bf16) o.x = d_round_bf16(o.x), o.y = d_round_bf16(o.y), o.z = d_round_bf16(o.z), o.w = d_round_bf16(o.w);
        ((float4 *)(out + r * dim))[threadIdx.x + j * blockDim.x] = o;
    }
}

void cu_rmsnorm(dsv4_backend *b, float *out, const float *x, int rows, int dim, const dsv4_weight *w, float eps,
                int out_bf16) {
    dsv4_cuda_op_begin(b);
    dweight dw;
    memset(&dw, 0, sizeof dw);
    if (rows <= 0 || (w && dsv4_cuda_weight(b, w, &dw))) return;
    size_t n = (size_t)rows * dim;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * n);
    float *od = out == x ? xd : (float *)dsv4_cuda_out(b, out, sizeof(float) * n);
    if (!xd || !od) return;
    int vw = !w ? 0
             : dw.fmt == DSV4_WF_F32 && ((uintptr_t)dw.data & 15) == 0 ? 1
             : dw.fmt == DSV4_WF_BF16 && ((uintptr_t)dw.data & 7) == 0 ? 2
                                                                        : 0;
    /* vector path: dim a multiple of 128 up to 4096, 16-byte aligned rows; one float4 per
     * thread up to 1024 threads */
    int nv4 = dim / 4, th = nv4 < 1024 ? nv4 : 1024, nv = th ? nv4 / th : 0;
    int vec = dim % 128 == 0 && dim <= 4096 && nv4 % th == 0 && (nv == 1 || nv == 2 || nv == 4) &&
              ((uintptr_t)xd & 15) == 0 && ((uintptr_t)od & 15) == 0;
    if (!vec) k_rmsnorm<<<rows, 256, 0, CI(b)->stream>>>(od, xd, dim, dw, w != NULL, eps, out_bf16);
    else if (nv == 1) k_rmsnorm_vec<1><<<rows, th, 0, CI(b)->stream>>>(od, xd, dim, dw, w != NULL, vw, eps, out_bf16);
    else if (nv == 2) k_rmsnorm_vec<2><<<rows, th, 0, CI(b)->stream>>>(od, xd, dim, dw, w != NULL, vw, eps, out_bf16);
    else k_rmsnorm_vec<4><<<rows, th, 0, CI(b)->stream>>>(od, xd, dim, dw, w != NULL, vw, eps, out_bf16);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, out, od, sizeof(float) * n);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_RMSNORM);
}

/* RoPE angles' inputs passed by value (kernel parameters) for small batches, so a decode
 * call stages nothing: no host copy, no upload for the next op to wait on */
enum { ROPE_ARG_ROWS = 32, ROPE_ARG_HALF = 64 };
struct rope_args {
    int64_t pos[ROPE_ARG_ROWS];
    float freq[ROPE_ARG_HALF];
};

__device__ __forceinline__ void rope_pair(float *x, int64_t r, int h, int i, int n_heads, int head_dim, int rope_dim,
                                          float a, int inverse, int out_bf16) {
    float c = cosf(a), s = sinf(a);
    if (inverse) s = -s;
    float *p = x + (r * n_heads + h) * head_dim + (head_dim - rope_dim) + 2 * i;
    float x0 = p[0], x1 = p[1];
    float y0 = x0 * c - x1 * s, y1 = x1 * c + x0 * s;
    p[0] = out_bf16 ? d_round_bf16(y0) : y0;
    p[1] = out_bf16 ? d_round_bf16(y1) : y1;
}

/* one thread per (row, pair, head); angle = fp32 (float)pos * (float)freq as on the CPU */
__global__ void k_rope(float *x, int rows, int n_heads, int head_dim, int rope_dim, const int64_t *pos,
                       const float *freq, int inverse, int out_bf16) {
    int half = rope_dim / 2;
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)rows * half * n_heads) return;
    int h = (int)(t % n_heads);
    int i = (int)((t / n_heads) % half);
    int64_t r = t / ((int64_t)n_heads * half);
    rope_pair(x, r, h, i, n_heads, head_dim, rope_dim, (float)pos[r] * freq[i], inverse, out_bf16);
}

__global__ void k_rope_args(float *x, int rows, int n_heads, int head_dim, int rope_dim, rope_args a, int inverse,
                            int out_bf16) {
    int half = rope_dim / 2;
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)rows * half * n_heads) return;
    int h = (int)(t % n_heads);
    int i = (int)((t / n_heads) % half);
    int64_t r = t / ((int64_t)n_heads * half);
    rope_pair(x, r, h, i, n_heads, head_dim, rope_dim, (float)a.pos[r] * a.freq[i], inverse, out_bf16);
}

void cu_rope(dsv4_backend *b, float *x, int rows, int n_heads, int head_dim, int rope_dim, const int64_t *pos,
             const double *freq, int inverse, int out_bf16) {
    dsv4_cuda_op_begin(b);
    int half = rope_dim / 2;
    if (rows <= 0 || half <= 0) return;
    size_t n = (size_t)rows * n_heads * head_dim;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * n);
    if (!xd) return;
    int64_t threads = (int64_t)rows * half * n_heads;
    unsigned blocks = (unsigned)((threads + 255) / 256);
    if (rows <= ROPE_ARG_ROWS && half <= ROPE_ARG_HALF) {
        rope_args a;
        memset(&a, 0, sizeof a);
        memcpy(a.pos, pos, sizeof(int64_t) * rows);
        for (int i = 0; i < half; i++) a.freq[i] = (float)freq[i];
        k_rope_args<<<blocks, 256, 0, CI(b)->stream>>>(xd, rows, n_heads, head_dim, rope_dim, a, inverse, out_bf16);
    } else {
        float *ff = (float *)dsv4_cuda_hbuf(b, sizeof(float) * half);
        if (!ff) return;
        for (int i = 0; i < half; i++) ff[i] = (float)freq[i];
        int64_t *pd = (int64_t *)dsv4_cuda_stage(b, pos, sizeof(int64_t) * rows);
        float *fd = (float *)dsv4_cuda_stage(b, ff, sizeof(float) * half);
        if (!pd || !fd) return;
        k_rope<<<blocks, 256, 0, CI(b)->stream>>>(xd, rows, n_heads, head_dim, rope_dim, pd, fd, inverse, out_bf16);
    }
    if (CKL(b)) return;
    dsv4_cuda_commit(b, x, xd, sizeof(float) * n);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_ROPE);
}

__global__ void k_scale(float *x, size_t n, float s, int out_bf16) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = out_bf16 ? d_round_bf16(x[i] * s) : x[i] * s;
}

void cu_scale(dsv4_backend *b, float *x, size_t n, float s, int out_bf16) {
    dsv4_cuda_op_begin(b);
    if (!n) return;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * n);
    if (!xd) return;
    k_scale<<<(unsigned)((n + 255) / 256), 256, 0, CI(b)->stream>>>(xd, n, s, out_bf16);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, x, xd, sizeof(float) * n);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_SCALE);
}

/* ----- sim ----- */
/* Block amax over p[0..len) by one warp.  A NaN or inf in the block makes the
 * whole block NaN (as the CPU op does) and returns -1. */
__device__ float warp_block_amax(float *p, int len) {
    int lane = threadIdx.x & 31;
    float amax = 0.0f;
    int bad = 0;
    for (int i = lane; i < len; i += 32) {
        float a = fabsf(p[i]);
        bad |= !(a <= 3.40282347e38f);
        amax = fmaxf(amax, a);
    }
    amax = warp_max(amax);
    bad = __any_sync(0xffffffffu, bad);
    __syncwarp();
    if (bad) {
        for (int i = lane; i < len; i += 32) p[i] = __uint_as_float(0x7fc00000u);
        return -1.0f;
    }
    return amax;
}

/* one warp quantizes p[0..len) as one fp8 block (amax over the block) */
__device__ void warp_fp8_block(float *p, int len) {
    int lane = threadIdx.x & 31;
    float amax = warp_block_amax(p, len);
    if (amax < 0.0f) return;
    if (amax < 1e-4f) amax = 1e-4f;
    float s = d_pow2_ceil(amax * (1.0f / 448.0f)), inv = 1.0f / s;
    for (int i = lane; i < len; i += 32) p[i] = d_e4m3_to_f32(d_f32_to_e4m3(p[i] * inv)) * s;
}

__device__ void warp_fp4_block(float *p, int len) {
    int lane = threadIdx.x & 31;
    float amax = warp_block_amax(p, len);
    if (amax < 0.0f) return;
    if (amax < 6.0f * 0x1p-126f) amax = 6.0f * 0x1p-126f;
    float s = d_pow2_ceil(amax / 6.0f), inv = 1.0f / s;
    for (int i = lane; i < len; i += 32) {
        float y = p[i] * inv;
        float q = d_e2m1_round_abs(fabsf(y));
        p[i] = (y < 0.0f ? -q : q) * s;
    }
}

__global__ void k_sim(float *x, int stride, int col0, int width, int mode, float had_scale) {
    extern __shared__ float row[];
    float *p = x + (int64_t)blockIdx.x * stride + col0;
    int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (mode == DSV4_SIM_BF16) {
        for (int i = threadIdx.x; i < width; i += blockDim.x) p[i] = d_round_bf16(p[i]);
        return;
    }
    if (mode == DSV4_SIM_HAD_FP4_B32) {
        for (int i = threadIdx.x; i < width; i += blockDim.x) row[i] = p[i];
        __syncthreads();
        for (int h = 1; h < width; h <<= 1) {
            for (int t = threadIdx.x; t < width / 2; t += blockDim.x) {
                int j = (t / h) * 2 * h + t % h;
                float a = row[j], c = row[j + h];
                row[j] = a + c;
                row[j + h] = a - c;
            }
            __syncthreads();
        }
        for (int i = threadIdx.x; i < width; i += blockDim.x) p[i] = row[i] * had_scale;
        __syncthreads();
    }
    int block = mode == DSV4_SIM_FP8_B64 ? 64 : mode == DSV4_SIM_FP8_ROW ? width : 32;
    int nb = (width + block - 1) / block;
    for (int bi = warp; bi < nb; bi += nw) {
        int len = width - bi * block < block ? width - bi * block : block;
        if (mode == DSV4_SIM_FP8_B64 || mode == DSV4_SIM_FP8_ROW) warp_fp8_block(p + bi * block, len);
        else warp_fp4_block(p + bi * block, len);
    }
}

void cu_sim(dsv4_backend *b, float *x, int rows, int stride, int col0, int width, int mode) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || width <= 0 || mode < DSV4_SIM_BF16 || mode > DSV4_SIM_FP4_B32) return;
    if (mode == DSV4_SIM_HAD_FP4_B32 && width > 8192) {
        dsv4_cuda_fail(b, "sim: Hadamard width over 8192", __FILE__, __LINE__, cudaSuccess);
        return;
    }
    size_t n = (size_t)rows * stride;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * n);
    if (!xd) return;
    size_t shm = mode == DSV4_SIM_HAD_FP4_B32 ? sizeof(float) * width : 0;
    float hs = (float)(1.0 / sqrt((double)width));
    k_sim<<<rows, 128, shm, CI(b)->stream>>>(xd, stride, col0, width, mode, hs);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, x, xd, sizeof(float) * n);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_SIM);
}
