/* backend/cuda/gemv_mma.cu: the FP8 GEMV of one row on f16 tensor cores (linear.dot=mma).
 *
 * Why: the fp32 FP8 GEMVs (k_gemv8, k_gemv8x) issue ~4.8 warp instructions per 32 weights (an
 * e4m3x2 -> f16x2 cvt per pair, an f16 -> f32 and an fp32 FMA per weight; ncu, docs/CUDA.md),
 * so at the copy rate they would need more issue slots than the SMs have while their loads
 * are in flight.  Here a weight costs 1/2 cvt and 1/256 of an MMA: ~57 warp instructions per
 * 2048 weights, a fifth of the fp32 kernels'.
 *
 * k_gemv_mma<SPW, D, CP>: out[o] = sum_k W[o][k] x[g(o) xg + k] for o < no (one row), W FP8
 * (e4m3) with e8m0 128 x 128 block scales, K = kw SPW 128 (kw = 1, 2, 4, 8), g(o) = o / gR.
 * Geometry: a warp takes a tile of 16 weight rows and SPW steps of 128 columns (one scale
 * block each); kw warps of a block share a tile and split its K (their sums added in warp
 * order in shared memory), so a block holds 8 / kw tiles.  Lane l = 4 g + t holds rows g and
 * g + 8 of the tile and, each step, loads 2 x 16 bytes of each: columns 16 t .. + 15 and 64 +
 * 16 t .. + 15, the lane's 32 "positions" (each load instruction reads whole 32-byte sectors:
 * 64 contiguous bytes a row; with columns 32 t .. 32 t + 31 each sector was read by two
 * instructions, half each, and the kernel ran no faster than the fp32 ones).  D steps of
 * loads are in flight, the first D issued before the PDL wait (weights only), the loop unrolled
 * so the ring's slots are constants: by default (CP = 1, below) a ring of D = 6 / 5 / 3 steps in
 * shared memory filled by cp.async at K <= 2048 / 4096 / 8192; DSV4_CUDA_GMA_CP=0 a ring of 3
 * in registers, as at K 512 (ncu, 2026-12-04: wo_a 12.1 against 13.5 us,
 * wo_b 13.0 against 13.9, wq_b 12.1 either way).
 * One m16n8k16 MMA takes k = 16 of the tile: for MMA j of a step, lane (g, t) gives its
 * positions 4 j .. + 3 of rows g and g + 8.  The MMA's sum does not depend on where each column
 * goes, so A's k slots (2 t, 2 t + 1, 2 t + 8, 2 t + 9) take those four columns in that
 * order and B's lane (g', t) holds the same four columns: a0 a1 / a4 a5 are the cvt of the
 * word's low / high byte pairs (row g; a2 a3 / a6 a7 row g + 8), b0 b1 / b2 b3 the x parts of
 * the same columns.
 * x as B: each 128-column block of x (a step) is scaled by 2^-E, E chosen so that its largest
 * |x| lands in [2^14, 2^15), and every value split into three f16 parts hi + mid + lo (each the
 * f16 rounding of what the parts before it left; the subtractions are exact in fp32).  Parts 0,
 * 1, 2 are B's columns 0, 1, 2 (lanes g' = 0, 1, 2); columns 3..7 are not read.  A block stages
 * every step's parts once in shared memory after its PDL wait (warp w splits steps w, w + 8,
 * ...; one barrier), each part in the lanes' position order, padded so that the B reads of a
 * step (lane (g', t): 4 x 16 bytes) hit 32 distinct banks per 8 lanes.  D's columns are then
 * the three parts' dots: lane t = 0 holds hi and mid of rows g and g + 8, lane t = 1 lo.
 * Numerics: an e4m3 weight (4 significant bits) times an f16 part (11) is exact in fp32, and
 * hi + mid + lo carries x to ~33 bits (exact for every x within 2^-18 of its block's largest;
 * smaller x lose bits below 2^-25 of that largest in the lo part).  What differs from the
 * fp32 fma chain is the tensor core's own summation of an MMA's 16 products and of the 8 MMAs
 * of a step (not IEEE step by step; the even and the odd MMAs of a step are two chains).  After
 * each step, fp32 FMAs add the two chains' three columns times the weight's e8m0 scale times 2^E
 * to a lane's sums; at the end hi + mid, then + lo, then
 * the kw warps in warp order; out_bf16 rounds.  A block of x holding an inf or a NaN makes its
 * step's factor a NaN: every output of the call is then NaN (the CPU's fp32 sum gives NaN, or
 * +-inf where x holds an inf and no NaN arises).
 * Not taken (the caller's fp32 kernels run instead): other formats, f32 scales, a block other
 * than 128, other K, rows > 1, w_bf16 where the bf16 rounding of a scaled weight is not exact
 * (dweight.e8_bf16), a grid of fewer blocks than SMs (the small weights).
 * Target: sm_90a (mma.sync m16n8k16 f16, cvt.rn.f16x2.e4m3x2). */
#include <cuda_fp16.h>
#include <stdlib.h>

#include "backend/cuda/common.cuh"

enum {
    GMA_STEP = 128,                 /* columns a step: one scale block */
    GMA_TB = 80,                    /* bytes of one lane-column t's 32 f16 and 16 bytes of padding */
    GMA_PB = 4 * GMA_TB,            /* bytes of one part of a step */
    GMA_SB = 3 * GMA_PB,            /* bytes of a step's three parts */
};

static long gma_calls; /* launches, for the tests (dsv4_cuda_gemv_mma_calls) */

/* a word of e4m3 codes (columns c .. c + 3) as two f16x2: (c, c + 1), (c + 2, c + 3); exact */
__device__ __forceinline__ void gma_cvt(uint32_t w, uint32_t &lo, uint32_t &hi) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}

__device__ __forceinline__ uint32_t gma_word(const uint4 &v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t gma_h2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *(uint32_t *)&h;
}

/* the three f16 parts of (a, b) (already scaled by 2^-E) as f16x2 words */
__device__ __forceinline__ void gma_split2(float a, float b, uint32_t &hi, uint32_t &mid, uint32_t &lo) {
    __half2 h = __floats2half2_rn(a, b);
    float2 hf = __half22float2(h);
    float ra = a - hf.x, rb = b - hf.y; /* exact: a minus its own f16 rounding */
    __half2 m = __floats2half2_rn(ra, rb);
    float2 mf = __half22float2(m);
    hi = *(uint32_t *)&h, mid = *(uint32_t *)&m;
    lo = gma_h2(ra - mf.x, rb - mf.y);
}

/* the 2 x 16 bytes of rows g and g + 8 a lane loads for step s (pa, pb: its row pointers at the
 * warp's first step, column 16 t): columns 16 t .. + 15 and 64 + 16 t .. + 15 */
__device__ __forceinline__ void gma_load(uint4 (&v)[4], const uint8_t *pa, const uint8_t *pb, int s) {
    v[0] = d_ld_stream16(pa + s * GMA_STEP);
    v[1] = d_ld_stream16(pa + s * GMA_STEP + 64);
    v[2] = d_ld_stream16(pb + s * GMA_STEP);
    v[3] = d_ld_stream16(pb + s * GMA_STEP + 64);
}

/* CP = 1: a lane's 4 x 16 bytes of a step go to shared memory by cp.async (16 bytes each, L1
 * bypassed), into the warp's ring of D stages of 2 KB (piece i of lane l at i 512 + 16 l: the
 * reads of a piece are 32 consecutive 16-byte words), one commit group a step.  No register holds
 * bytes in flight, so the ring can be deeper than the register ring's 3 steps (launcher: as deep
 * as 2 blocks an SM leave room for).  Each lane reads back only what it copied, so its own
 * cp.async.wait_group suffices (no barrier), and it refills a stage only after its reads of it
 * have been used. */
__device__ __forceinline__ void gma_cp_issue(uint8_t *st, const uint8_t *pa, const uint8_t *pb, int s, int lane) {
    uint8_t *d = st + 16 * lane;
    d_cp_async16(d, pa + s * GMA_STEP);
    d_cp_async16(d + 512, pa + s * GMA_STEP + 64);
    d_cp_async16(d + 1024, pb + s * GMA_STEP);
    d_cp_async16(d + 1536, pb + s * GMA_STEP + 64);
}

/* the bytes of shared memory before the cp.async stages: x's parts, the factors, red[8][16] */
__host__ __device__ constexpr size_t gma_xbytes(int ns) {
    return ((size_t)ns * (GMA_SB + sizeof(float)) + sizeof(float) * 8 * 16 + 127) / 128 * 128;
}

template <int SPW, int D, int CP>
__global__ void __launch_bounds__(256, 2)
    k_gemv_mma(float *out, const float *__restrict__ x, const uint8_t *__restrict__ wd,
               const uint8_t *__restrict__ ws, int K, int kw_log2, int64_t no, int64_t gR, int64_t xg, int x_bf16,
               int out_bf16) {
    extern __shared__ __align__(16) uint8_t gsm[]; /* ns steps' parts, ns factors 2^E, red[8][16] */
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int kw = 1 << kw_log2, tpb = 8 >> kw_log2, sub = wib & (kw - 1), ns = K / GMA_STEP;
    float *pe = (float *)(gsm + (size_t)ns * GMA_SB), *red = pe + ns;
    const int64_t tb = (int64_t)blockIdx.x * tpb; /* the block's first tile */
    const int64_t r0 = (tb + (wib >> kw_log2)) * 16;
    const int s0 = sub * SPW; /* the warp's first step */
    /* rows past the end re-read the last row (never written) */
    const int64_t ra = r0 + g < no ? r0 + g : no - 1, rb = r0 + g + 8 < no ? r0 + g + 8 : no - 1;
    const uint8_t *pa = wd + ra * (int64_t)K + s0 * GMA_STEP + 16 * t;
    const uint8_t *pb = wd + rb * (int64_t)K + s0 * GMA_STEP + 16 * t;
    uint4 v[CP ? 1 : D][4];
    uint8_t *wst = gsm + gma_xbytes(ns) + (size_t)wib * D * 2048; /* CP: the warp's stages */
#pragma unroll
    for (int d = 0; d < D; d++) {
        if constexpr (CP) {
            if (d < SPW) gma_cp_issue(wst + d * 2048, pa, pb, d, lane);
            d_cp_commit(); /* one group a step, empty past the end: the waits count steps */
        } else {
            if (d < SPW) gma_load(v[d], pa, pb, d);
        }
    }
    /* lane l < SPW: the e8m0 scale of step s0 + l (the tile's 16 rows lie in one 128-row block) */
    uint32_t sc = 0;
    const int64_t rs = r0 < no ? r0 : no - 1;
    if (lane < SPW) sc = __ldg(ws + (rs >> 7) * (int64_t)ns + s0 + lane);
    pdl_enter();

    /* stage x's parts: warp w splits steps w, w + 8, ... (ns <= 64: at most 8 a warp, loaded 4 at a
     * time); lane l takes columns 4 l .. 4 l + 3 */
    {
        const int64_t fr = tb * 16 < no ? tb * 16 : no - 1; /* the block's tiles lie in one group (launcher) */
        const float *xb = x + (xg ? (fr / gR) * xg : 0);
#pragma unroll
        for (int h = 0; h < 8; h += 4) { /* two rounds of 4 loads (8 at once spilled at 128 registers) */
        float4 f[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (wib + 8 * (h + i) < ns)
                f[i] = __ldg((const float4 *)(xb + (int64_t)(wib + 8 * (h + i)) * GMA_STEP + 4 * lane));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int st = wib + 8 * (h + i);
            if (st >= ns) break;
            float4 v4 = f[i];
            if (x_bf16)
                v4.x = d_round_bf16(v4.x), v4.y = d_round_bf16(v4.y), v4.z = d_round_bf16(v4.z),
                v4.w = d_round_bf16(v4.w);
            uint32_t m = max(max(__float_as_uint(v4.x) & 0x7fffffffu, __float_as_uint(v4.y) & 0x7fffffffu),
                             max(__float_as_uint(v4.z) & 0x7fffffffu, __float_as_uint(v4.w) & 0x7fffffffu));
            m = __reduce_max_sync(0xffffffffu, m); /* an inf or NaN compares above every finite value */
            int E = (int)(m >> 23) - 127 - 14;
            E = E < -126 ? -126 : E; /* tiny blocks: 2^-E stays a normal float */
            const float sd = __uint_as_float((uint32_t)(127 - E) << 23);
            uint32_t h0, m0, l0, h1, m1, l1;
            gma_split2(v4.x * sd, v4.y * sd, h0, m0, l0);
            gma_split2(v4.z * sd, v4.w * sd, h1, m1, l1);
            /* columns 4 l.. are lane-column t = (l & 15) / 4's positions 16 (l / 16) + 4 (l & 3).. */
            uint8_t *sp = gsm + (size_t)st * GMA_SB + ((lane & 15) >> 2) * GMA_TB + 32 * (lane >> 4) + 8 * (lane & 3);
            *(uint2 *)sp = make_uint2(h0, h1);
            *(uint2 *)(sp + GMA_PB) = make_uint2(m0, m1);
            *(uint2 *)(sp + 2 * GMA_PB) = make_uint2(l0, l1);
            if (lane == 0)
                pe[st] = m >= 0x7f800000u ? __uint_as_float(0x7fc00000u) : __uint_as_float((uint32_t)(127 + E) << 23);
        }
        }
    }
    __syncthreads();
    const float S = lane < SPW ? d_e8m0_to_f32((uint8_t)sc) * pe[s0 + lane] : 0.0f;

    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    /* B's columns 3..7 are never read from D, so lanes g >= 3 load parts 1, 0, 1, 0, 1 (any
     * finite bytes; these keep each 8-lane phase of the 16-byte reads on 32 distinct banks) */
    const uint8_t *bp = gsm + (size_t)s0 * GMA_SB + (g < 3 ? g : g & 1) * GMA_PB + t * GMA_TB;
#pragma unroll
    for (int s = 0; s < SPW; s++) {
        uint4 cs[4];
        if constexpr (CP) { /* step s's group is the oldest of D pending */
            d_cp_wait<D - 1>();
#pragma unroll
            for (int i = 0; i < 4; i++) cs[i] = *(const uint4 *)(wst + (s % D) * 2048 + i * 512 + 16 * lane);
        }
        uint4(&c)[4] = CP ? cs : v[s % D];
        uint4 bq[4];
#pragma unroll
        for (int q = 0; q < 4; q++) bq[q] = *(const uint4 *)(bp + (size_t)s * GMA_SB + 16 * q);
        float d[2][4]; /* even and odd MMAs: two chains of 4 */
#pragma unroll
        for (int j = 0; j < 8; j++) {
            uint32_t a0, a1, a2, a3;
            gma_cvt(gma_word(c[j >> 2], j & 3), a0, a2);      /* row g: cols 4j, 4j+1 | 4j+2, 4j+3 */
            gma_cvt(gma_word(c[2 + (j >> 2)], j & 3), a1, a3); /* row g + 8 */
            const uint4 &b = bq[j >> 1];
            const uint32_t b0 = (j & 1) ? b.z : b.x, b1 = (j & 1) ? b.w : b.y;
            if (j < 2) d_mma_f16(d[j], a0, a1, a2, a3, b0, b1, zero);
            else d_mma_f16(d[j & 1], a0, a1, a2, a3, b0, b1, d[j & 1]);
        }
        if constexpr (CP) {
            if (s + D < SPW) gma_cp_issue(wst + (s % D) * 2048, pa, pb, s + D, lane);
            d_cp_commit();
        } else {
            if (s + D < SPW) gma_load(v[s % D], pa, pb, s + D);
        }
        const float Ss = __shfl_sync(0xffffffffu, S, s);
#pragma unroll
        for (int e = 0; e < 4; e++) acc[e] = fmaf(d[1][e], Ss, fmaf(d[0][e], Ss, acc[e]));
    }
    /* lane t = 0: hi, mid of rows g (acc 0, 1) and g + 8 (acc 2, 3); lane t = 1: lo (acc 0, 2) */
    const float loa = __shfl_down_sync(0xffffffffu, acc[0], 1), lob = __shfl_down_sync(0xffffffffu, acc[2], 1);
    const float va = (acc[0] + acc[1]) + loa, vb = (acc[2] + acc[3]) + lob;
    if (kw == 1) {
        if (t == 0) {
            if (r0 + g < no) out[r0 + g] = out_bf16 ? d_round_bf16(va) : va;
            if (r0 + g + 8 < no) out[r0 + g + 8] = out_bf16 ? d_round_bf16(vb) : vb;
        }
        return;
    }
    if (t == 0) red[wib * 16 + g] = va, red[wib * 16 + g + 8] = vb;
    __syncthreads();
    if (sub == 0 && lane < 16) {
        float sum = red[wib * 16 + lane];
        for (int k = 1; k < kw; k++) sum += red[(wib + k) * 16 + lane];
        if (r0 + lane < no) out[r0 + lane] = out_bf16 ? d_round_bf16(sum) : sum;
    }
}

template <int SPW, int D, int CP>
static int gma_go(dsv4_backend *b, float *out, const float *x, const dweight &w, int64_t gR, int64_t xg, int kw_log2,
                  int x_bf16, int out_bf16, int64_t blocks, size_t smem) {
    static size_t set_smem; /* the attribute, raised once per instance as needed */
    if (smem > set_smem) {
        if (CK(b, cudaFuncSetAttribute(k_gemv_mma<SPW, D, CP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)))
            return 1;
        set_smem = smem;
    }
    dsv4_launch(k_gemv_mma<SPW, D, CP>, (unsigned)blocks, 256, smem, CI(b)->stream, out, x, w.data, w.scale,
                (int)w.cols, kw_log2, w.rows, gR, xg, x_bf16, out_bf16);
    if (!CKL(b)) gma_calls++;
    return 1;
}

int dsv4_cuda_gemv_mma(dsv4_backend *b, float *out_d, const float *x_d, const dweight &w, int64_t gR, int64_t xg,
                       int x_bf16, int w_bf16, int out_bf16) {
    cuda_impl *c = CI(b);
    const int64_t K = w.cols, no = w.rows;
    if (c->failed || w.fmt != DSV4_WF_FP8 || w.scale_f32 || w.block != GMA_STEP || K % GMA_STEP ||
        (w_bf16 && !w.e8_bf16))
        return 0;
    if (gR <= 0) gR = no;
    if (((uintptr_t)x_d & 15) || xg % 4 || no >= ((int64_t)1 << 31)) return 0;
    const int ns = (int)(K / GMA_STEP);
    int spw = 8;
    if (ns < 8) spw = ns == 4 ? 4 : 0;
    if (!spw || ns % spw) return 0;
    const int kw = ns / spw;
    if (kw > 8 || (kw & (kw - 1))) return 0;
    const int kw_log2 = kw == 8 ? 3 : kw == 4 ? 2 : kw == 2 ? 1 : 0, tpb = 8 / kw;
    if (xg && gR % (16 * tpb)) return 0; /* a block's tiles in one group */
    const int64_t blocks = ((no + 15) / 16 + tpb - 1) / tpb;
    if (blocks < c->nsm) return 0;
    static int cp = -1; /* DSV4_CUDA_GMA_CP=0 (read once; A/B): the register ring */
    if (cp < 0) {
        const char *f = getenv("DSV4_CUDA_GMA_CP");
        cp = !(f && f[0] == '0');
    }
    const size_t xs = gma_xbytes(ns);
    /* the cp.async ring at SPW 8: as many 2 KB steps a warp as two blocks an SM leave room for
     * (~113 KB a block): 6 at K <= 2048, 5 at 4096, 3 at 8192 */
    const int cd = spw == 8 && cp ? (int)((115000 - (xs < 115000 ? xs : 115000)) / (8 * 2048)) : 0;
#define GMA_GO(SPW, D, CP) \
    gma_go<SPW, D, CP>(b, out_d, x_d, w, gR, xg, kw_log2, x_bf16, out_bf16, blocks, xs + (CP ? 8 * D * 2048 : 0))
    if (cd >= 6) return GMA_GO(8, 6, 1);
    if (cd == 5) return GMA_GO(8, 5, 1);
    if (cd >= 3) return GMA_GO(8, 3, 1);
    if (spw == 8) return GMA_GO(8, 3, 0);
    return GMA_GO(4, 4, 0);
#undef GMA_GO
}

extern "C" long dsv4_cuda_gemv_mma_calls(void) { return gma_calls; }
