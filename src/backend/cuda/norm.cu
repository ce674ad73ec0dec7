/* backend/cuda/norm.cu: row-wise elementwise ops: rmsnorm, rope, norm_rope, scale, sim.
 *
 * rmsnorm: one block per vector; sum of squares by a block tree (the CPU sums
 *   serially: accumulation order is the only difference; each float4's squares are formed
 *   and added with rounded intrinsics, d_sq4, the CPU's arithmetic, so no fma contraction
 *   can differ between kernels that must agree), then x * rsqrt(mean + eps) * w, rounded
 *   to bf16 if asked -- the same expression.  Dims that are multiples of 128 up to 4096
 *   (every Flash norm but the per-head 64) take k_rmsnorm_vec: dim/4 threads (one float4
 *   per thread, at most 1024), the row and its weights held in registers from one round of
 *   loads, bf16 / f32 weights as one 8- / 16-byte load per 4; others k_rmsnorm (256
 *   threads).  Measured on the H200 (ktrace, tests/test_cuda_mhc DSV4_MHC_BENCH=2, bf16
 *   weights evicted from L2, 1 row): dim 4096 4.57 us with 256 threads and element-wise
 *   weights, 3.20 with vector weights, 2.46 at 512 threads, 2.19 at 1024; dim 1024 1.97 ->
 *   1.61, dim 512 1.85 -> 1.51 (vector weights).  mhc.cu's hc_pre_norm repeats
 *   k_rmsnorm_vec's arithmetic inside hc_pre's kernel (same bits).
 * rope: one thread per (row, pair, head); angle = fp32 (float)pos * (float)freq like
 *   the CPU; cosf/sinf are CUDA's full-precision versions (<= 2 ulp from glibc's); the
 *   rotation rounds each product and sum (d_rope_rot, the CPU's arithmetic).  Up
 *   to 32 rows (decode) the positions and frequencies go in the kernel's parameters
 *   (k_rope_args), so the call is one launch with nothing staged; larger batches
 *   stage them (k_rope).
 * norm_rope: rmsnorm of each head then RoPE of its last rope_dim dims in one launch
 *   (k_norm_rope: k_rmsnorm_vec's code and shape, then d_rope_rot on the float4s in the rope
 *   part, in registers), bit for bit the two ops; shapes k_rmsnorm_vec does not take, and
 *   host buffers, run the two ops.  In profiles it counts as rmsnorm.  Measured (H200,
 *   ktrace, Flash decode): q (64 heads of 512) 2.37 us for rmsnorm 1.50 + rope 2.14; kv
 *   (one head) 2.27 for 1.82 + 2.1.
 * sim: one block (128 threads) per row; each warp takes whole quantization blocks
 *   (fp8: amax -> pow2 scale -> e4m3 RNE -> back; fp4 likewise onto e2m1); the
 *   Hadamard runs stage by stage in shared memory with the CPU's butterfly order,
 *   so every mode is bit-exact with the CPU's.
 * Layout: fp32 rows, row-major.  Target: sm_90a.
 */
#include "backend/cuda/norm.cuh"
#include "backend/cuda/rope.cuh"

__global__ void k_rmsnorm(float *out, const float *x, int dim, dweight w, int has_w, float eps, int out_bf16) {
    pdl_enter();
    __shared__ float sh[32];
    int64_t r = blockIdx.x;
    const float *xr = x + r * dim;
    float ss = 0.0f;
    const int steps = out_bf16 & DSV4_NORM_BF16_STEPS;
    if (steps) /* its own loop: the default one is the expression it always was (its fma contraction) */
        for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += d_round_bf16(__fmul_rn(xr[i], xr[i]));
    else
        for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, sh);
    float s = steps ? d_norm_steps(ss, dim, eps) : 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] * s;
        if (has_w) v *= d_weight_at(w, 0, i);
        out[r * dim + i] = out_bf16 ? d_round_bf16(v) : v;
    }
}

/* one block of dim/4 threads per row, one float4 each (in place is safe: a thread writes only
 * what it read) */
__global__ void k_rmsnorm_vec(float *out, const float *x, int dim, dweight w, int has_w, int vw, float eps,
                              int out_bf16) {
    pdl_enter();
    __shared__ float sh[32];
    int64_t r = blockIdx.x;
    float4 o = d_rmsnorm4((const float4 *)(x + r * dim), dim, w, has_w, vw, eps, out_bf16, sh, threadIdx.x, blockDim.x);
    ((float4 *)(out + r * dim))[threadIdx.x] = o;
}

/* the vector path's geometry for `rows` vectors of dim at xd -> od: 1 and its thread count in *th
 * (dim/4: one float4 per thread, at most 1024) when dim is a multiple of 128 up to 4096 and the rows
 * are 16-byte aligned; 0 = k_rmsnorm */
int rmsnorm_vec_threads(int dim, const void *xd, const void *od, int *th) {
    int nv4 = dim / 4;
    *th = nv4;
    return dim > 0 && dim % 128 == 0 && dim <= 4096 && (((uintptr_t)xd | (uintptr_t)od) & 15) == 0;
}

/* bf16 / f32 weights as one 8- / 16-byte load per 4 where aligned (d_weight4), else 0 */
int rmsnorm_vw(const dsv4_weight *w, const dweight &dw) {
    return !w ? 0
           : dw.fmt == DSV4_WF_F32 && ((uintptr_t)dw.data & 15) == 0 ? 1
           : dw.fmt == DSV4_WF_BF16 && ((uintptr_t)dw.data & 7) == 0 ? 2
                                                                      : 0;
}

int dsv4_cuda_rmsnorm_dev(dsv4_backend *b, float *od, const float *xd, int rows, int dim, const dsv4_weight *w,
                          const dweight &dw, float eps, int out_bf16) {
    int th = 0;
    if (!rmsnorm_vec_threads(dim, xd, od, &th))
        dsv4_launch(k_rmsnorm, rows, 256, 0, CI(b)->stream, od, xd, dim, dw, w != NULL, eps, out_bf16);
    else
        dsv4_launch(k_rmsnorm_vec, rows, th, 0, CI(b)->stream, od, xd, dim, dw, w != NULL, rmsnorm_vw(w, dw), eps,
                    out_bf16);
    return CKL(b);
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
    if (!xd || !od || dsv4_cuda_rmsnorm_dev(b, od, xd, rows, dim, w, dw, eps, out_bf16)) return;
    dsv4_cuda_commit(b, out, od, sizeof(float) * n);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_RMSNORM);
}

/* rope_args, d_rope_rot (the rotation, rounded as the CPU's) and rope_inputs: rope.cuh,
 * shared with attn.cu's fused ops */

__device__ __forceinline__ void rope_pair(float *x, int64_t r, int h, int i, int n_heads, int head_dim, int rope_dim,
                                          float a, int inverse, int out_bf16) {
    float *p = x + (r * n_heads + h) * head_dim + (head_dim - rope_dim) + 2 * i;
    float2 y = d_rope_rot(p[0], p[1], a, inverse, out_bf16);
    p[0] = y.x;
    p[1] = y.y;
}

/* one thread per (row, pair, head); angle = fp32 (float)pos * (float)freq as on the CPU */
__global__ void k_rope(float *x, int rows, int n_heads, int head_dim, int rope_dim, const int64_t *pos,
                       const float *freq, int inverse, int out_bf16) {
    pdl_enter();
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
    pdl_enter();
    int half = rope_dim / 2;
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)rows * half * n_heads) return;
    int h = (int)(t % n_heads);
    int i = (int)((t / n_heads) % half);
    int64_t r = t / ((int64_t)n_heads * half);
    rope_pair(x, r, h, i, n_heads, head_dim, rope_dim, (float)a.pos[r] * a.freq[i], inverse, out_bf16);
}

/* RoPE's positions and frequencies for a launch (rope.cuh) */
int rope_inputs(dsv4_backend *b, int rows, int half, const int64_t *pos, const double *freq, rope_args *a,
                       const int64_t **pd, const float **fd) {
    *pd = NULL;
    *fd = NULL;
    memset(a, 0, sizeof *a);
    if (rows <= ROPE_ARG_ROWS && half <= ROPE_ARG_HALF) {
        memcpy(a->pos, pos, sizeof(int64_t) * rows);
        for (int i = 0; i < half; i++) a->freq[i] = (float)freq[i];
        return 0;
    }
    float *ff = (float *)dsv4_cuda_hbuf(b, sizeof(float) * half);
    if (!ff) return 1;
    for (int i = 0; i < half; i++) ff[i] = (float)freq[i];
    *pd = (const int64_t *)dsv4_cuda_stage(b, pos, sizeof(int64_t) * rows);
    *fd = (const float *)dsv4_cuda_stage(b, ff, sizeof(float) * half);
    return !*pd || !*fd;
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
    rope_args a;
    const int64_t *pd;
    const float *fd;
    if (rope_inputs(b, rows, half, pos, freq, &a, &pd, &fd)) return;
    if (!pd)
        dsv4_launch(k_rope_args, blocks, 256, 0, CI(b)->stream, xd, rows, n_heads, head_dim, rope_dim, a, inverse,
                    out_bf16);
    else
        dsv4_launch(k_rope, blocks, 256, 0, CI(b)->stream, xd, rows, n_heads, head_dim, rope_dim, pd, fd, inverse,
                    out_bf16);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, x, xd, sizeof(float) * n);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_ROPE);
}

/* the two pairs of a float4 in the rope part rotated by angles a0 and a1 (k_norm_rope, k_op_list) */
__device__ __forceinline__ float4 d_rope4(float4 o, float a0, float a1, int out_bf16) {
    float2 y0 = d_rope_rot(o.x, o.y, a0, 0, out_bf16), y1 = d_rope_rot(o.z, o.w, a1, 0, out_bf16);
    return make_float4(y0.x, y0.y, y1.x, y1.y);
}

/* ----- norm_rope: rmsnorm of each head, then RoPE of its last rope_dim dims, one launch -----
 * One block per vector (row r, head h) of head_dim = 4 * blockDim.x floats, thread t holding
 * float4 t: k_rmsnorm_vec<1>'s code and launch shape (same sum order, same bits), then the
 * threads whose float4 lies in the rope part rotate its two pairs in registers (d_rope_rot,
 * as k_rope) and the block writes once.  pos / freq: by value (a) or device arrays (pd, fd). */
__global__ void k_norm_rope(float *x, int n_heads, int head_dim, dweight w, int has_w, int vw, float eps,
                            int rope_dim, rope_args a, const int64_t *pd, const float *fd, int out_bf16) {
    pdl_enter();
    __shared__ float sh[32];
    int64_t vi = blockIdx.x;
    float4 *xr = (float4 *)(x + vi * head_dim);
    int t = threadIdx.x;
    float4 o = d_rmsnorm4(xr, head_dim, w, has_w, vw, eps, out_bf16, sh, t, blockDim.x);
    int c0 = 4 * t - (head_dim - rope_dim); /* this float4's column in the rope part: pairs c0/2, c0/2 + 1 */
    if (c0 >= 0) {
        int64_t r = vi / n_heads;
        int i = c0 / 2;
        float p = pd ? (float)pd[r] : (float)a.pos[r];
        float f0 = pd ? fd[i] : a.freq[i], f1 = pd ? fd[i + 1] : a.freq[i + 1];
        o = d_rope4(o, p * f0, p * f1, out_bf16);
    }
    xr[t] = o;
}

void cu_norm_rope(dsv4_backend *b, float *x, int rows, int n_heads, int head_dim, const dsv4_weight *w, float eps,
                  int rope_dim, const int64_t *pos, const double *freq, int out_bf16) {
    int64_t nvec = (int64_t)rows * n_heads;
    int th = 0, half = rope_dim / 2;
    /* one launch for device rows of k_rmsnorm_vec's shapes; otherwise the two ops (host
     * buffers, only in tests, are committed at an op's end, so no op of two launches) */
    if (rows <= 0 || n_heads <= 0 || rope_dim <= 0 || rope_dim % 4 || rope_dim > head_dim || nvec > 0x7fffffff ||
        !dsv4_cuda_is_dev(b, x) || !rmsnorm_vec_threads(head_dim, x, x, &th)) {
        cu_rmsnorm(b, x, x, (int)nvec, head_dim, w, eps, out_bf16);
        cu_rope(b, x, rows, n_heads, head_dim, rope_dim, pos, freq, 0, out_bf16);
        return;
    }
    dsv4_cuda_op_begin(b);
    dweight dw;
    memset(&dw, 0, sizeof dw);
    if (w && dsv4_cuda_weight(b, w, &dw)) return;
    rope_args a;
    const int64_t *pd;
    const float *fd;
    if (rope_inputs(b, rows, half, pos, freq, &a, &pd, &fd)) return;
    dsv4_launch(k_norm_rope, (unsigned)nvec, th, 0, CI(b)->stream, x, n_heads, head_dim, dw, w != NULL,
                rmsnorm_vw(w, dw), eps, rope_dim, a, pd, fd, out_bf16);
    if (CKL(b)) return;
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_RMSNORM);
}

/* x * s, rounded to bf16 if asked (k_scale, k_op_list) */
__device__ __forceinline__ float d_scale1(float x, float s, int out_bf16) {
    return out_bf16 ? d_round_bf16(x * s) : x * s;
}

__global__ void k_scale(float *x, size_t n, float s, int out_bf16) {
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = d_scale1(x[i], s, out_bf16);
}

void cu_scale(dsv4_backend *b, float *x, size_t n, float s, int out_bf16) {
    dsv4_cuda_op_begin(b);
    if (!n) return;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * n);
    if (!xd) return;
    dsv4_launch(k_scale, (unsigned)((n + 255) / 256), 256, 0, CI(b)->stream, xd, n, s, out_bf16);
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
    pdl_enter();
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
        for (int i = threadIdx.x; i < width; i += blockDim.x) p[i] = d_round_bf16(row[i] * had_scale); /* bf16 out */
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
    dsv4_launch(k_sim, rows, 128, shm, CI(b)->stream, xd, stride, col0, width, mode, hs);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, x, xd, sizeof(float) * n);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_SIM);
}

/* ----- op lists (op_list): independent small ops in one launch -----
 * k_op_list runs the tasks of one table (oplist.cuh): block bi finds its task in the prefix
 * table (a binary search over the parameters), then does that task's share of the work with the
 * standalone kernels' device functions, so each task gets the bits of its own op:
 *   rmsnorm / norm_rope: k_rmsnorm_vec's / k_norm_rope's code (d_rmsnorm4, d_rope4) on sub-blocks
 *     of nt = dim/4 threads, blockDim/nt vectors a block (d_part_sum is block_sum over nt
 *     threads); a sub-block past the last vector norms the last one again without storing it, so
 *     every thread reaches the block's barriers;
 *   rope: rope_pair per (row, pair, head) at angle (float)pos * freq, as k_rope / k_rope_args;
 *   add_cyclic: one fp32 add per element, as k_add_cyclic; copy: 16-byte words or bytes;
 *   scale: d_scale1, as k_scale.
 * Elementwise tasks walk their elements in strides of their blocks.  The host (oplist.cu) gives
 * the list a norm task only where the standalone op runs the vector kernel, and picks blockDim as
 * a multiple of every norm task's nt. */
#include "backend/cuda/oplist.cuh"

__device__ __forceinline__ void op_list_run(const ol_params &p) {
    __shared__ float sh[32];
    int bi = blockIdx.x, lo = 0, hi = p.n - 1;
    while (lo < hi) { /* the last task whose first block is <= bi */
        int mid = (lo + hi + 1) >> 1;
        if (p.first[mid] <= bi) lo = mid;
        else hi = mid - 1;
    }
    const ol_task &t = p.t[lo];
    int tb = bi - p.first[lo], nb = p.first[lo + 1] - p.first[lo], T = blockDim.x, bf = t.flags & 1;
    int nbf = bf | ((t.flags & 16) ? DSV4_NORM_BF16_STEPS : 0); /* the norm's out_bf16 */
    if (t.kind == OL_RMSNORM || t.kind == OL_NORM_ROPE) {
        int dim = t.n2, nt = dim / 4, sub = threadIdx.x / nt, lt = threadIdx.x - sub * nt, vw = (t.flags >> 2) & 3;
        int64_t nvec = t.kind == OL_RMSNORM ? (int64_t)t.n0 : (int64_t)t.n0 * t.n1;
        int64_t v = (int64_t)tb * (T / nt) + sub;
        int live = v < nvec;
        if (!live) v = nvec - 1;
        dweight w = {};
        w.fmt = vw == 1 ? DSV4_WF_F32 : DSV4_WF_BF16;
        w.data = (const uint8_t *)t.w;
        float4 o = d_rmsnorm4((const float4 *)((const float *)t.y + v * dim), dim, w, t.w != NULL, vw, t.f, nbf,
                              sh + sub * (nt >> 5), lt, nt);
        if (t.kind == OL_NORM_ROPE) {
            int c0 = 4 * lt - (dim - t.n3); /* as k_norm_rope */
            if (c0 >= 0) {
                int i = c0 / 2;
                float pp = (float)p.pos[t.pos_at + v / t.n1];
                o = d_rope4(o, pp * p.freq[t.freq_at + i], pp * p.freq[t.freq_at + i + 1], bf);
            }
        }
        if (live) ((float4 *)((float *)t.x + v * dim))[lt] = o;
        return;
    }
    int64_t step = (int64_t)nb * T, e0 = (int64_t)tb * T + threadIdx.x;
    if (t.kind == OL_ROPE) {
        int heads = t.n1, half = t.n3 / 2, inv = (t.flags >> 1) & 1;
        int64_t total = (int64_t)t.n0 * half * heads;
        for (int64_t e = e0; e < total; e += step) {
            int h = (int)(e % heads), i = (int)((e / heads) % half);
            int64_t r = e / ((int64_t)heads * half);
            rope_pair((float *)t.x, r, h, i, heads, t.n2, t.n3, (float)p.pos[t.pos_at + r] * p.freq[t.freq_at + i],
                      inv, bf);
        }
    } else if (t.kind == OL_ADD_CYCLIC) {
        int width = t.n1;
        int64_t total = (int64_t)t.n0 * width;
        for (int64_t e = e0; e < total; e += step) {
            int i = (int)(e / width), c = (int)(e - (int64_t)i * width);
            const float *yr = (const float *)t.y + (int64_t)((t.n3 + i) % t.n2) * width;
            ((float *)t.x)[e] += yr[c];
        }
    } else if (t.kind == OL_COPY16) {
        for (int64_t e = e0; e < t.n0; e += step) ((uint4 *)t.x)[e] = ((const uint4 *)t.y)[e];
    } else if (t.kind == OL_COPY1) {
        for (int64_t e = e0; e < t.n0; e += step) ((uint8_t *)t.x)[e] = ((const uint8_t *)t.y)[e];
    } else if (t.kind == OL_SCALE) {
        for (int64_t e = e0; e < t.n0; e += step) ((float *)t.x)[e] = d_scale1(((float *)t.x)[e], t.f, bf);
    }
}

/* early (op_list_beside): the tasks run before the PDL wait, beside the kernel just before, whose
 * completion the wait at the end still carries to the next kernel (oplist.cu says when) */
__global__ void k_op_list(const __grid_constant__ ol_params p) {
    if (p.early) pdl_trigger();
    else pdl_enter();
    op_list_run(p);
    if (p.early) pdl_wait();
}

int dsv4_cuda_op_list_launch(dsv4_backend *b, const ol_params &p, unsigned blocks, int threads) {
    dsv4_launch(k_op_list, blocks, threads, 0, CI(b)->stream, p);
    return CKL(b);
}
