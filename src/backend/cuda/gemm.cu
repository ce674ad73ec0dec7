/* backend/cuda/gemm.cu: prefill matmuls (many rows) on the GPU.
 *
 * The `matmul` entry of the CUDA op table: out[r][o] = sum_k W[o][k] x[r][k], x [rows][K]
 * fp32, out [rows][N] fp32, W [N][K] in its stored format on the device.  Calls with fewer
 * than GEMM_MIN_ROWS rows (decode, small batches) and shapes the tiled kernels do not take
 * go to the dequantizing GEMV of linear.cu (cu_matmul), which streams W once per 8 rows.
 * Calls with many rows (prefill sub-batches of up to 1024 rows) run one of two GEMMs that
 * read each weight tile once per 128 rows:
 *
 * (a) exact path, k_sgemm<FMT> (act_fp8 = 0, or W not FP8 with 128x128 block scales):
 *     128 x 128 output tile per block (rows x features), K in steps of 16, 256 threads,
 *     8 x 8 outputs per thread (rows ty*4+i and 64+ty*4+i, features tx*4+j and 64+tx*4+j).
 *     Each step loads x[128][16] and W[128][16] into registers (every thread: 8 k of one
 *     row of each), dequantizes W there with the exact codecs of common.cuh (the same fp32
 *     values the CPU's dsv4_weight_row makes), stores both transposed (k-major) into the
 *     other half of a double-buffered shared tile, and multiplies from the current half:
 *     one barrier per step.  fp32 FMA on CUDA cores, no TF32: results equal the CPU's up to
 *     accumulation order (here one sequential fma chain over K per output; the CPU sums 8
 *     interleaved partials).  act_fp8 with a quantized W: x goes through act_quant first
 *     (dsv4_cuda_act_quant, bit-exact with the CPU), as in cu_matmul.
 *     Needs K % 16 == 0 (FP8: block % 8 == 0; MXFP4: K % 32 == 0) and 16-byte aligned x.
 *     Measured against the CPU: rel 5e-7 .. 1.2e-6 (K 1024 .. 4096); 36-40 TFLOP/s at the
 *     large prefill shapes on the H200 (fp32 peak ~67), 7-18 where N <= 1024 leaves SMs idle.
 *
 * (b) FP8 tensor-core path, k_gemm_fp8 (act_fp8 = 1 and W FP8 with 128 x 128 block
 *     scales, K % 128 == 0: the `reference` numerics profile).  k_quant_bytes writes x as
 *     e4m3 bytes plus one power-of-two scale per (row, 128 columns): exactly the bytes and
 *     scale behind k_act_quant's dequantized values (same code), so CPU and GPU multiply
 *     the same numbers.  128 x 128 output tile per block, 8 warps as 2 (rows) x 4
 *     (features), 64 x 32 outputs per warp = 4 x 4 mma.sync.m16n8k32 e4m3 x e4m3 -> f32.
 *     K goes in 128-wide blocks (one weight scale block); x and W bytes of a block come
 *     into shared memory by cp.async (rows padded to 160 bytes so the 8-byte fragment
 *     loads hit distinct banks), two stages.  Each K block is summed by the tensor cores
 *     into a fresh accumulator, then promoted on CUDA cores:
 *     out_acc += partial * (w_scale * x_scale[row]) in fp32 (DeepSeek's kernels promote
 *     every 128 K too: Hopper's FP8 MMA adds its products with reduced internal precision).
 *     The e4m3 x e4m3 products are exact; what differs from the CPU is the order of the sums
 *     and that internal precision: tests/test_cuda_gemm.c measures it (rel 1.1e-7 .. 3.0e-7
 *     on the H200, K up to 8192) and tests with rel <= 2e-6.
 *     Fragment loads: the k order inside one m16n8k32 is free as long as A and B use the
 *     same one, so each lane reads 8 consecutive bytes (k = 8t .. 8t+7 of the 32) for its
 *     A register pair (a0, a2) / (a1, a3) and its B pair (b0, b1).
 *
 * Both write out_bf16-rounded outputs when asked (d_round_bf16) and count W's bytes once
 * per call in weight_bytes_read.  Grids put the row tiles on x (fastest), so the blocks
 * that share a weight tile run together and W streams from DRAM about once.
 * Target: sm_90a (mma.sync e4m3 needs sm_89+).  Not done: wgmma + TMA for the FP8 path
 * (mma.sync reaches 80-180 TFLOP/s here, a fraction of Hopper's FP8 rate), split-K or
 * smaller tiles for few output features, a bf16/TF32 tensor-core path for the head.
 */
#include <stdlib.h>

#include "backend/cuda/common.cuh"

void cu_matmul(dsv4_backend *, float *, const float *, int, const dsv4_weight *, int, int);

/* below this many rows the GEMV (8 rows per pass) is used.  FP8 tensor-core path from 32
 * rows; the fp32 SGEMM path (~35 TFLOP/s) only from 128 rows: below that the GEMV, which
 * reads W once per 8 rows near the bandwidth bound, was faster (H200, 2026-11-29: 20 Flash
 * layers at batch 32, matmul 98 ms/step through the SGEMM).  DSV4_CUDA_SGEMM_MIN_ROWS
 * overrides the SGEMM threshold (tests use 32 to cover its tails). */
#define GEMM_MIN_ROWS 32
static int sgemm_min_rows(void) {
    static int v = 0;
    if (!v) {
        const char *e = getenv("DSV4_CUDA_SGEMM_MIN_ROWS");
        v = e && atoi(e) > 0 ? atoi(e) : 128;
    }
    return v;
}

static int quantized_fmt(int fmt) { return fmt == DSV4_WF_FP8 || fmt == DSV4_WF_MXFP4 || fmt == DSV4_WF_NVFP4; }

/* bytes of W (data + scales) one pass over it reads */
static size_t weight_bytes(const dsv4_weight *w) {
    size_t n = (size_t)w->rows, k = (size_t)w->cols;
    switch (w->fmt) {
    case DSV4_WF_F32: return n * k * 4;
    case DSV4_WF_BF16: return n * k * 2;
    case DSV4_WF_FP8: {
        size_t B = (size_t)w->block;
        return n * k + ((n + B - 1) / B) * ((k + B - 1) / B) * (w->scale_f32 ? 4 : 1);
    }
    case DSV4_WF_MXFP4: return n * k / 2 + n * k / 32;
    case DSV4_WF_NVFP4: return n * k / 2 + n * k / 16;
    default: return 0;
    }
}

/* ===================================================================================== */
/* ----- (a) exact path: fp32 SGEMM on dequantized weight tiles ----- */

#define SG_BM 128 /* rows of x per block */
#define SG_BN 128 /* weight rows (output features) per block */
#define SG_BK 16
#define SG_LD (SG_BM + 4) /* shared row length in floats: multiple of 4 for float4 reads */

/* Grouped form (wo_a; grid.z = group g): features g*gN .. g*gN + gN - 1 read x columns
 * g*gx .. g*gx + K - 1 and write out columns g*gN ..; a plain matmul is one group with
 * gN = N, gx = 0.  ldx / ldo: row strides of x and out.  w_bf16 rounds each dequantized
 * weight to bf16 (the grouped op's in_bf16, as the CPU's mm does). */
template <int FMT>
__global__ void __launch_bounds__(256, 2) k_sgemm(float *__restrict__ out, const float *__restrict__ x, int rows,
                                               dweight w, int out_bf16, int vec_out, int64_t ldx, int64_t ldo,
                                               int64_t gN, int64_t gx, int w_bf16) {
    pdl_wait(); /* no early launch_dependents: a multi-wave GEMM keeps its SM slots (common.cuh) */
    __shared__ __align__(16) float xs[2][SG_BK][SG_LD];
    __shared__ __align__(16) float ws[2][SG_BK][SG_LD];
    const int tid = threadIdx.x;
    const int64_t K = w.cols, N = gN, gw = (int64_t)blockIdx.z * gN;
    const int m0 = blockIdx.x * SG_BM;
    const int64_t n0 = (int64_t)blockIdx.y * SG_BN;
    x += (int64_t)blockIdx.z * gx;
    out += gw;

    /* loader: thread -> (tile row lr, k offset lk) of both x and W */
    const int lr = tid >> 1, lk = (tid & 1) * 8;
    const int x_in = m0 + lr < rows, w_in = n0 + lr < N;
    const float *xp = x + (int64_t)(x_in ? m0 + lr : 0) * ldx + lk;
    float xv[8], wv[8];

    /* compute: thread -> rows ty*4 + {0..3}, 64 + ty*4 + {0..3}; features likewise with tx */
    const int ty = tid >> 4, tx = tid & 15;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;

    const int nk = (int)(K / SG_BK);
    for (int t = 0; t <= nk; t++) {
        /* global -> registers for step t (overlaps the multiply of step t - 1) */
        if (t < nk) {
            int64_t k0 = (int64_t)t * SG_BK;
            if (x_in) {
                float4 a = __ldg((const float4 *)(xp + k0)), b = __ldg((const float4 *)(xp + k0 + 4));
                xv[0] = a.x, xv[1] = a.y, xv[2] = a.z, xv[3] = a.w, xv[4] = b.x, xv[5] = b.y, xv[6] = b.z, xv[7] = b.w;
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) xv[i] = 0.0f;
            }
            if (w_in) {
                d_load_w8<FMT>(w, gw + n0 + lr, k0 + lk, wv);
                if (w_bf16) {
#pragma unroll
                    for (int i = 0; i < 8; i++) wv[i] = d_round_bf16(wv[i]);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) wv[i] = 0.0f;
            }
        }
        if (t > 0) { /* multiply step t - 1 from buffer (t - 1) & 1 */
            const int s = (t - 1) & 1;
#pragma unroll
            for (int kk = 0; kk < SG_BK; kk++) {
                float4 a0 = *(const float4 *)&xs[s][kk][ty * 4], a1 = *(const float4 *)&xs[s][kk][64 + ty * 4];
                float4 b0 = *(const float4 *)&ws[s][kk][tx * 4], b1 = *(const float4 *)&ws[s][kk][64 + tx * 4];
                float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                float bb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                for (int i = 0; i < 8; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[i][j] = fmaf(a[i], bb[j], acc[i][j]);
            }
        }
        if (t < nk) { /* registers -> buffer t & 1, last read by the multiply of step t - 2 */
            const int s = t & 1;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                xs[s][lk + i][lr] = xv[i];
                ws[s][lk + i][lr] = wv[i];
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 8; i++) {
        int m = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
        if (m >= rows) continue;
        float *orow = out + (int64_t)m * ldo;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int64_t n = n0 + h * 64 + tx * 4;
            float v[4];
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = out_bf16 ? d_round_bf16(acc[i][h * 4 + j]) : acc[i][h * 4 + j];
            if (vec_out && n + 3 < N) {
                *(float4 *)(orow + n) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (n + j < N) orow[n + j] = v[j];
            }
        }
    }
}

/* 1 if the exact path takes this weight (x alignment is checked by the caller) */
static int sgemm_ok(const dsv4_weight *w) {
    if (w->rows <= 0 || w->cols <= 0 || w->cols % SG_BK) return 0;
    switch (w->fmt) {
    case DSV4_WF_F32:
    case DSV4_WF_BF16:
    case DSV4_WF_NVFP4: return 1;
    case DSV4_WF_FP8: return w->block > 0 && w->block % 8 == 0;
    case DSV4_WF_MXFP4: return w->cols % 32 == 0;
    default: return 0;
    }
}

/* groups G of gN features each (G = 1, gN = w.rows: a plain matmul); x rows of ldx floats,
 * group g reading columns g * gx .. */
static void launch_sgemm(dsv4_backend *b, float *od, const float *xd, int rows, const dweight &w, int out_bf16,
                         int G, int64_t gN, int64_t ldx, int64_t gx, int w_bf16) {
    cuda_impl *c = CI(b);
    int64_t ldo = (int64_t)G * gN;
    int vec_out = gN % 4 == 0 && ((uintptr_t)od & 15) == 0;
    dim3 grid((unsigned)((rows + SG_BM - 1) / SG_BM), (unsigned)((gN + SG_BN - 1) / SG_BN), (unsigned)G);
#define SG_ARGS od, xd, rows, w, out_bf16, vec_out, ldx, ldo, gN, gx, w_bf16
    switch (w.fmt) {
    case DSV4_WF_F32: dsv4_launch(k_sgemm<DSV4_WF_F32>, grid, 256, 0, c->stream, SG_ARGS); break;
    case DSV4_WF_BF16: dsv4_launch(k_sgemm<DSV4_WF_BF16>, grid, 256, 0, c->stream, SG_ARGS); break;
    case DSV4_WF_FP8: dsv4_launch(k_sgemm<DSV4_WF_FP8>, grid, 256, 0, c->stream, SG_ARGS); break;
    case DSV4_WF_MXFP4: dsv4_launch(k_sgemm<DSV4_WF_MXFP4>, grid, 256, 0, c->stream, SG_ARGS); break;
    default: dsv4_launch(k_sgemm<DSV4_WF_NVFP4>, grid, 256, 0, c->stream, SG_ARGS); break;
    }
#undef SG_ARGS
    CKL(b);
}

/* The grouped matmul (wo_a) of many rows on the SGEMM: out[r][g*R + j] = sum_k W[g*R + j][k]
 * x[r][g*C + k] (x already rounded to bf16 by the caller when in_bf16; the weights are
 * rounded here then).  Returns 1 when it ran, 0 when the GEMV path must take the call
 * (few rows, a shape or alignment the tiles do not take). */
static long grouped_calls; /* process-wide, for the tests */
long dsv4_cuda_sgemm_grouped_calls(void) { return grouped_calls; }

int dsv4_cuda_gemm_grouped(dsv4_backend *b, float *od, const float *xd, int rows, const dsv4_weight *w, int groups,
                           int in_bf16, int out_bf16) {
    int64_t R = w->rows / groups, C = w->cols;
    if (rows < sgemm_min_rows() || !sgemm_ok(w) || R % 4 || C % 4 || ((uintptr_t)xd & 15)) return 0;
    dweight dw;
    if (dsv4_cuda_weight(b, w, &dw)) return 1;
    launch_sgemm(b, od, xd, rows, dw, out_bf16, groups, R, (int64_t)groups * C, C, in_bf16);
    grouped_calls++;
    if (!CI(b)->failed) CI(b)->weight_bytes_read += weight_bytes(w);
    return 1;
}

/* ===================================================================================== */
/* ----- (b) FP8 path: e4m3 x e4m3 on tensor cores, promoted every 128 K ----- */

#define F8_BM 128
#define F8_BN 128
#define F8_BK 128                              /* = the weight's scale block */
#define F8_LD 160                              /* shared row stride in bytes (128 + 32 pad) */
#define F8_STAGE ((F8_BM + F8_BN) * F8_LD)     /* bytes of one stage (x tile, then W tile) */
#define F8_SMEM (2 * F8_STAGE)                 /* 80 KiB: dynamic shared memory */

/* x [rows][K] -> e4m3 bytes q [rows][K] and scales sc [rows][K/128]; one warp per
 * (row, 128-block), 4 values per lane.  The same arithmetic as k_act_quant (linear.cu), so
 * d_e4m3_to_f32(q) * sc is bit-for-bit its output; a block with NaN/Inf gets scale NaN
 * (k_act_quant writes NaN for the whole block), which makes the row's outputs NaN as on
 * the CPU. */
__global__ void k_quant_bytes(uint8_t *__restrict__ q, float *__restrict__ sc, const float *__restrict__ x, int rows,
                              int64_t K) {
    pdl_enter();
    int64_t nb = K / 128;
    int64_t wid = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (wid >= rows * nb) return;
    int64_t r = wid / nb, blk = wid % nb, off = r * K + blk * 128 + lane * 4;
    float v[4];
    float amax = 0.0f;
    int bad = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[i] = x[off + i];
        float a = fabsf(v[i]);
        bad |= !(a <= 3.40282347e38f);
        amax = fmaxf(amax, a);
    }
    amax = warp_max(amax);
    bad = __any_sync(0xffffffffu, bad);
    if (bad) {
        *(uint32_t *)(q + off) = 0u;
        if (lane == 0) sc[r * nb + blk] = __uint_as_float(0x7fc00000u);
        return;
    }
    if (amax < 1e-4f) amax = 1e-4f;
    float s = d_pow2_ceil(amax * (1.0f / 448.0f));
    float inv = 1.0f / s;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) packed |= (uint32_t)d_f32_to_e4m3(v[i] * inv) << (8 * i);
    *(uint32_t *)(q + off) = packed;
    if (lane == 0) sc[r * nb + blk] = s;
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, int bytes) {
    uint32_t d = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* x rows [m0, m0+128) and W rows [n0, n0+128) of K block kb into one stage; rows past the
 * end are zero-filled (cp.async with 0 source bytes reads nothing) */
__device__ __forceinline__ void f8_issue(uint8_t *stage, const uint8_t *xq, int rows, const dweight &w, int m0,
                                         int64_t n0, int64_t kb) {
    const int64_t K = w.cols;
    for (int c = threadIdx.x; c < 2 * 128 * 8; c += 256) {
        int tile = c >> 10, r = (c >> 3) & 127, col = (c & 7) * 16;
        const uint8_t *src;
        int ok;
        if (tile == 0) {
            ok = m0 + r < rows;
            src = xq + (ok ? (int64_t)(m0 + r) * K + kb * F8_BK + col : 0);
        } else {
            ok = n0 + r < w.rows;
            src = w.data + (ok ? (n0 + r) * K + kb * F8_BK + col : 0);
        }
        cp_async16(stage + tile * (F8_BM * F8_LD) + r * F8_LD + col, src, ok ? 16 : 0);
    }
    cp_async_commit();
}

__global__ void __launch_bounds__(256) k_gemm_fp8(float *__restrict__ out, const uint8_t *__restrict__ xq,
                                                  const float *__restrict__ xsc, int rows, dweight w, int out_bf16,
                                                  int vec_out) {
    pdl_wait(); /* no early launch_dependents: a multi-wave GEMM keeps its SM slots (common.cuh) */
    extern __shared__ __align__(16) uint8_t f8_smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp >> 2, wn = warp & 3; /* warp tile: rows wm*64 .. +64, features wn*32 .. +32 */
    const int64_t K = w.cols, N = w.rows, nkb = K / F8_BK;
    const int m0 = blockIdx.x * F8_BM;
    const int64_t n0 = (int64_t)blockIdx.y * F8_BN;
    const int64_t wsrow = (n0 / F8_BK) * nkb; /* the weight's scale row for this feature tile */

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    f8_issue(f8_smem, xq, rows, w, m0, n0, 0);
    for (int64_t kb = 0; kb < nkb; kb++) {
        uint8_t *stage = f8_smem + (kb & 1) * F8_STAGE;
        if (kb + 1 < nkb) { /* the other stage was last read before the barrier that ended step kb - 1 */
            f8_issue(f8_smem + ((kb + 1) & 1) * F8_STAGE, xq, rows, w, m0, n0, kb + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        /* scales of this K block: the weight's (one per 128x128 block) times each row's */
        float wsc = w.scale_f32 ? __ldg((const float *)w.scale + wsrow + kb) : d_e8m0_to_f32(__ldg(w.scale + wsrow + kb));
        float rs[4][2];
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int m = m0 + wm * 64 + mi * 16 + g + h * 8;
                rs[mi][h] = m < rows ? __ldg(xsc + (int64_t)m * nkb + kb) * wsc : 0.0f;
            }

        float p[4][4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) p[i][j][e] = 0.0f;

        const uint8_t *A = stage + (wm * 64) * F8_LD, *B = stage + F8_BM * F8_LD + (wn * 32) * F8_LD;
#pragma unroll
        for (int ks = 0; ks < F8_BK / 32; ks++) {
            uint32_t af[4][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                const uint8_t *ra = A + (mi * 16 + g) * F8_LD + ks * 32 + t * 8;
                uint2 lo = *(const uint2 *)ra, hi = *(const uint2 *)(ra + 8 * F8_LD);
                af[mi][0] = lo.x, af[mi][1] = hi.x, af[mi][2] = lo.y, af[mi][3] = hi.y;
            }
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                uint2 v = *(const uint2 *)(B + (ni * 8 + g) * F8_LD + ks * 32 + t * 8);
                bf[ni][0] = v.x, bf[ni][1] = v.y;
            }
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_e4m3(p[mi][ni], af[mi], bf[ni]);
        }
        /* promotion: fp32 on CUDA cores, once per 128 K */
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mi][ni][e] = fmaf(p[mi][ni][e], rs[mi][e >> 1], acc[mi][ni][e]);
        __syncthreads(); /* every warp is done with this stage before it is refilled */
    }

    /* accumulator e of tile (mi, ni): row g + 8 * (e >> 1), feature 2t + (e & 1) */
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int m = m0 + wm * 64 + mi * 16 + g + h * 8;
            if (m >= rows) continue;
            float *orow = out + (int64_t)m * N;
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                int64_t n = n0 + wn * 32 + ni * 8 + 2 * t;
                float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                if (out_bf16) v0 = d_round_bf16(v0), v1 = d_round_bf16(v1);
                if (vec_out && n + 1 < N) {
                    *(float2 *)(orow + n) = make_float2(v0, v1);
                } else {
                    if (n < N) orow[n] = v0;
                    if (n + 1 < N) orow[n + 1] = v1;
                }
            }
        }
}

/* 1 if the FP8 tensor-core path takes this call: only when asked for (linear.gemm=e4m3), as its
 * sums are not the CPU's (the MMA's reduced internal precision within each 128-wide block) */
static int fp8_ok(const dsv4_weight *w, int flags) {
    return (flags & DSV4_LIN_ACT_FP8) && (flags & DSV4_LIN_GEMM_E4M3) && w->fmt == DSV4_WF_FP8 && w->block == F8_BK &&
           w->cols > 0 && w->cols % F8_BK == 0 && w->rows > 0;
}

static long gemm_e4m3_calls;
extern "C" long dsv4_cuda_gemm_e4m3_calls(void) { return gemm_e4m3_calls; }

static void launch_fp8(dsv4_backend *b, float *od, const float *xd, int rows, const dweight &w, int out_bf16) {
    cuda_impl *c = CI(b);
    gemm_e4m3_calls++;
    int64_t K = w.cols, nkb = K / F8_BK;
    uint8_t *q = (uint8_t *)dsv4_cuda_scratch(b, (size_t)rows * (size_t)K);
    float *sc = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)rows * (size_t)nkb);
    if (!q || !sc) return;
    int64_t warps = (int64_t)rows * nkb;
    dsv4_launch(k_quant_bytes, (unsigned)((warps * 32 + 255) / 256), 256, 0, c->stream, q, sc, xd, rows, K);
    if (CKL(b)) return;
    if (CK(b, cudaFuncSetAttribute(k_gemm_fp8, cudaFuncAttributeMaxDynamicSharedMemorySize, F8_SMEM))) return;
    int vec_out = w.rows % 2 == 0 && ((uintptr_t)od & 7) == 0;
    dim3 grid((unsigned)((rows + F8_BM - 1) / F8_BM), (unsigned)((w.rows + F8_BN - 1) / F8_BN));
    dsv4_launch(k_gemm_fp8, grid, 256, F8_SMEM, c->stream, od, q, sc, rows, w, out_bf16, vec_out);
    CKL(b);
}

/* ===================================================================================== */
/* ----- the op ----- */

void cu_matmul_any(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int flags,
                   int out_bf16) {
    const int act_fp8 = flags & DSV4_LIN_ACT_FP8;
    int fp8 = rows >= GEMM_MIN_ROWS && fp8_ok(w, flags);
    /* the exact path reads x by float4: a device x must be 16-byte aligned (staged copies
     * and act_quant scratch are) */
    int x_al = !dsv4_cuda_is_dev(b, x) || ((uintptr_t)x & 15) == 0 || (act_fp8 && quantized_fmt(w->fmt));
    int exact = !fp8 && rows >= sgemm_min_rows() && sgemm_ok(w) && x_al;
    if (!fp8 && !exact) {
        cu_matmul(b, out, x, rows, w, flags, out_bf16);
        return;
    }
    dsv4_cuda_op_begin(b);
    dweight dw;
    if (dsv4_cuda_weight(b, w, &dw)) return;
    size_t xin = (size_t)rows * (size_t)w->cols, xout = (size_t)rows * (size_t)w->rows;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * xin);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * xout);
    if (!xd || !od) return;
    if (fp8) {
        launch_fp8(b, od, xd, rows, dw, out_bf16);
    } else {
        if (act_fp8 && quantized_fmt(w->fmt)) { /* into scratch: the caller's input stays as it is */
            float *xq = (float *)dsv4_cuda_scratch(b, sizeof(float) * xin);
            if (!xq) return;
            dsv4_cuda_act_quant(b, xq, xd, rows, w->cols, 128);
            xd = xq;
        }
        launch_sgemm(b, od, xd, rows, dw, out_bf16, 1, dw.rows, dw.cols, 0, 0);
    }
    if (CI(b)->failed) return;
    CI(b)->weight_bytes_read += weight_bytes(w);
    dsv4_cuda_commit(b, out, od, sizeof(float) * xout);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_MATMUL);
}
