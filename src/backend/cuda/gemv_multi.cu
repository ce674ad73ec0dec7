/* backend/cuda/gemv_multi.cu: matmul_multi, the decode projections of one input in one launch.
 *
 * A layer's attention half multiplies the same normalized hidden state y by up to seven weights
 * (spec §2.4-2.5): wq_a and wkv (FP8), the compressor's wkv and wgate, the indexer compressor's
 * wkv and wgate and the indexer's weights_proj (bf16).  At one row each is a GEMV of 0.5-8 MB
 * whose time is mostly its launch and ramp (k_gemv / k_gemv8: 2.6-4.7 us a call in the decode
 * graphs against ~1-2 us of bytes).  matmul_multi takes them in one call; here the entries of
 * one format and one input (x, or its act_quant copy for FP8 weights that ask for it) share one
 * launch of k_gemv_multi, the rest go through matmul one by one.
 *
 * k_gemv_multi<FMT, VPL, RPW>: the weights' rows are laid end to end (a virtual row space, up
 * to GM_MAXE entries); a warp takes RPW adjacent rows of one entry (every entry's row count is
 * a multiple of RPW: the launcher checks), lane l reads 16-byte vectors l, l + 32, ... of each
 * row (VPL vectors per lane: K = 32 VPL x values per vector), all RPW x VPL loads issued at
 * once, before the block waits for its predecessor (PDL: weights only); x is then staged in
 * shared memory once per block and read as float4.  One block per 8 warps, one task per warp
 * (no persistent loop: the tasks are a wave or two).
 * Numerics (exact, as matmul's up to summation order): every product is the fp32 product of
 * the exactly decoded weight (bf16 -> f32 by a shift; e4m3 through the e4m3x2 -> f16x2
 * instruction, exact) and x; FP8 takes only e8m0 (power-of-two) block scales, applied to the
 * 16-product partial of a vector (its 16 columns lie in one block of >= 16): multiplying by
 * 2^k is exact barring overflow and subnormals, as in k_gemv8.  A lane sums its partials in
 * vector order, the warp by a shuffle tree; out_bf16 rounds the sum.
 * A layer's bf16 table and its FP8 table on x go as one launch of k_gemv_multi2 where an instance
 * takes their K (4096, 2048): each block does one table's work as in its own launch, the bf16
 * blocks first (one kernel boundary less a layer; DSV4_CUDA_GM_MERGE=0 keeps two launches).
 * Under linear.act=fp8 (the reference profile) the FP8 table's blocks quantize x as they stage it
 * (d_stage_x, k_act_quant's bits), so that table merges with the bf16 one too: one launch where
 * there were three (act_quant, FP8, bf16); bit 2 of DSV4_CUDA_AQ_FUSE, docs/CUDA.md.
 * Target: sm_90a.  DSV4_CUDA_GEMV_MULTI=0 (read once) sends every entry through matmul (A/B).
 */
#include <stdlib.h>

#include "backend/cuda/common.cuh"

extern "C" {
#include "model/weights.h"
}

#define GM_MAXE 8

struct gm_entry {
    const uint8_t *w, *s; /* weight rows, FP8 e8m0 block scales (one byte per block) */
    float *out;
    int row0;           /* first virtual row */
    int srow, blk_log2; /* FP8: scale bytes per block row, log2 of the block */
    int out_bf16;
};
struct gm_table {
    gm_entry e[GM_MAXE];
    int n, total; /* entries, virtual rows */
    int aq;       /* x staged as act_quant(x) (common.cuh d_stage_x): the FP8 entries with act_fp8 */
    int early;    /* DSV4_CUDA_GM_EARLY (dsv4_cuda_gm_early): the blocks whose index is a multiple of early ask
                   * for their weights before the PDL wait, the others (all, at 0) after it */
};

enum { GM_BF16 = 0, GM_FP8 = 1 };

/* 8 bf16 weights (one vector) times x[0..7] */
__device__ __forceinline__ float gm_dot_bf16(const uint4 &q, const float4 &a, const float4 &b) {
    float s = __uint_as_float(q.x << 16) * a.x;
    s = fmaf(__uint_as_float(q.x & 0xffff0000u), a.y, s);
    s = fmaf(__uint_as_float(q.y << 16), a.z, s);
    s = fmaf(__uint_as_float(q.y & 0xffff0000u), a.w, s);
    s = fmaf(__uint_as_float(q.z << 16), b.x, s);
    s = fmaf(__uint_as_float(q.z & 0xffff0000u), b.y, s);
    s = fmaf(__uint_as_float(q.w << 16), b.z, s);
    s = fmaf(__uint_as_float(q.w & 0xffff0000u), b.w, s);
    return s;
}

/* 16 e4m3 codes (one vector) times x[0..15], unscaled */
__device__ __forceinline__ float gm_dot_fp8(const uint4 &q, const float *xv) {
    const uint32_t *qw = (const uint32_t *)&q;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 lo = d_e4m3x2_to_f32x2((uint16_t)(qw[i] & 0xffffu)),
               hi = d_e4m3x2_to_f32x2((uint16_t)(qw[i] >> 16));
        s0 = fmaf(lo.x, xv[4 * i], s0);
        s1 = fmaf(lo.y, xv[4 * i + 1], s1);
        s0 = fmaf(hi.x, xv[4 * i + 2], s0);
        s1 = fmaf(hi.y, xv[4 * i + 3], s1);
    }
    return s0 + s1;
}

/* one block's work of k_gemv_multi (task: this warp's task; xs: K floats of shared memory) */
template <int FMT, int VPL, int RPW>
__device__ __forceinline__ void gm_body(const gm_table &t, const float *__restrict__ x, int task, float *xs) {
    constexpr int VN = FMT == GM_FP8 ? 16 : 8, K = 32 * VPL * VN;
    const int lane = threadIdx.x & 31;
    const int r0 = task * RPW; /* first virtual row of this warp */
    int ei = 0;
#pragma unroll 1
    for (int i = 1; i < t.n; i++)
        if (r0 >= t.e[i].row0) ei = i;
    const gm_entry &E = t.e[ei];
    const bool live = r0 < t.total;
    const int64_t lr = r0 - E.row0; /* the entry's row */
    const int64_t rowb = (int64_t)K * (FMT == GM_FP8 ? 1 : 2);
    uint4 q[RPW][VPL];
    const bool late = t.early == 0 || blockIdx.x % (unsigned)t.early != 0; /* block-uniform */
    if (late) pdl_enter();
    if (live) {
#pragma unroll
        for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int j = 0; j < VPL; j++)
                q[r][j] = d_ld_stream16(E.w + (lr + r) * rowb + (int64_t)(j * 32 + lane) * 16);
    }
    float sc[RPW][VPL];
    if (FMT == GM_FP8 && live) {
#pragma unroll
        for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int j = 0; j < VPL; j++)
                sc[r][j] = d_e8m0_to_f32(
                    __ldg(E.s + ((lr + r) >> E.blk_log2) * E.srow + (((j * 32 + lane) * 16) >> E.blk_log2)));
    }
    if (!late) pdl_enter(); /* x is the previous kernel's output */
    d_stage_x(xs, x, K, t.aq); /* act_quant's values where the table asks for them (K % 512 == 0) */
    __syncthreads();
    if (!live) return;
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++)
        acc[r] = 0.0f;
#pragma unroll
    for (int j = 0; j < VPL; j++) {
        const float *xv = xs + (j * 32 + lane) * VN;
        if (FMT == GM_FP8) {
            float xr[16];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float4 v = ((const float4 *)xv)[i];
                xr[4 * i] = v.x, xr[4 * i + 1] = v.y, xr[4 * i + 2] = v.z, xr[4 * i + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < RPW; r++)
                acc[r] += gm_dot_fp8(q[r][j], xr) * sc[r][j];
        } else {
            float4 a = ((const float4 *)xv)[0], b = ((const float4 *)xv)[1];
#pragma unroll
            for (int r = 0; r < RPW; r++)
                acc[r] += gm_dot_bf16(q[r][j], a, b);
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0) E.out[lr + r] = E.out_bf16 ? d_round_bf16(s) : s;
    }
}

template <int FMT, int VPL, int RPW>
__global__ void __launch_bounds__(256) k_gemv_multi(const gm_table t, const float *__restrict__ x) {
    extern __shared__ __align__(16) float xs[]; /* K floats */
    gm_body<FMT, VPL, RPW>(t, x, blockIdx.x * 8 + (threadIdx.x >> 5), xs);
}

/* The bf16 table tb in blocks [0, nb) and the FP8 table tf (same x, same K) in the blocks after
 * them: the two launches of a layer's projections as one (each block does what it did in its own
 * launch, so the same bits).  Instances for K 4096 (bf16 16 vectors a lane, FP8 8 at one or two
 * rows a warp) and K 2048 (8 and 4).  DSV4_CUDA_GM_MERGE=0 keeps two launches (A/B). */
template <int VB, int RB, int VF, int RF>
__global__ void __launch_bounds__(256, 2) k_gemv_multi2(const gm_table tb, const gm_table tf, const float *__restrict__ x,
                                                    int nb) {
    static_assert(32 * VB * 8 == 32 * VF * 16, "k_gemv_multi2: one K for both tables");
    extern __shared__ __align__(16) float xs[]; /* K floats */
    if ((int)blockIdx.x < nb)
        gm_body<GM_BF16, VB, RB>(tb, x, blockIdx.x * 8 + (threadIdx.x >> 5), xs);
    else
        gm_body<GM_FP8, VF, RF>(tf, x, (blockIdx.x - nb) * 8 + (threadIdx.x >> 5), xs);
}

static int gm_off = -1; /* DSV4_CUDA_GEMV_MULTI=0 */

/* VPL for K in format fmt (vectors per lane), 0 if k_gemv_multi has no instance for it */
static int gm_vpl(int fmt, int64_t K) {
    int64_t vn = fmt == GM_FP8 ? 16 : 8;
    if (K % (32 * vn)) return 0;
    int64_t v = K / (32 * vn);
    return v == 4 || v == 8 || v == 16 ? (int)v : 0;
}

template <int FMT, int VPL, int RPW> static void gm_go(const gm_table &t, const float *x, cudaStream_t st) {
    int64_t tasks = (t.total + RPW - 1) / RPW;
    size_t smem = sizeof(float) * 32 * VPL * (FMT == GM_FP8 ? 16 : 8);
    dsv4_launch(k_gemv_multi<FMT, VPL, RPW>, (unsigned)((tasks + 7) / 8), 256, smem, st, t, x);
}

/* FP8 at 8 vectors a lane keeps two rows a warp (the default since 2026-12-02) even where that
 * leaves fewer than two blocks per SM (wq_a + wkv of Flash, 1536 rows: 96 blocks at two rows, 192
 * at one; commit 23083cc had taken one row a warp there).  A/B on the H200, 20 Flash layers, 2K,
 * batch 1, same lease, alternating (2026-12-02 ~03:33Z): 3.25 / 3.25 ms per step with two rows
 * against 3.35 / 3.31 with one.  DSV4_CUDA_GM_ROWS=1 (read once) takes one row a warp there again;
 * both give the same bits. */
static int gm_one_row(void) {
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("DSV4_CUDA_GM_ROWS");
        v = e && !strcmp(e, "1");
    }
    return v;
}

/* one launch over t (format fmt, VPL vpl; RPW from the vectors per lane: up to 16 loads in
 * flight per lane; gm_one_row above) */
static void gm_launch(const gm_table &t, int fmt, int vpl, const float *x, cudaStream_t st, int nsm) {
    if (fmt == GM_BF16) {
        if (vpl == 16)
            gm_go<GM_BF16, 16, 1>(t, x, st);
        else if (vpl == 8)
            gm_go<GM_BF16, 8, 2>(t, x, st);
        else
            gm_go<GM_BF16, 4, 4>(t, x, st);
    } else {
        if (vpl == 16)
            gm_go<GM_FP8, 16, 1>(t, x, st);
        else if (vpl == 8 && gm_one_row() && (t.total / 2 + 7) / 8 < 2 * nsm)
            gm_go<GM_FP8, 8, 1>(t, x, st);
        else if (vpl == 8)
            gm_go<GM_FP8, 8, 2>(t, x, st);
        else
            gm_go<GM_FP8, 4, 4>(t, x, st);
    }
}

static int gm_rpw(int vpl) {
    return 16 / vpl;
}

static int gm_merge_on(void) {
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("DSV4_CUDA_GM_MERGE");
        v = !(e && !strcmp(e, "0"));
    }
    return v;
}

/* the bf16 table tb and the FP8 table tf (K in both) in one k_gemv_multi2 launch, where an
 * instance takes them: 1 if launched */
static int gm_launch2(const gm_table &tb, const gm_table &tf, int64_t K, const float *x, cudaStream_t st, int nsm) {
    if (!gm_merge_on()) return 0;
    int vb = gm_vpl(GM_BF16, K), vf = gm_vpl(GM_FP8, K);
    size_t smem = sizeof(float) * (size_t)K;
    if (vb == 16 && vf == 8) {
        int one = gm_one_row() && (tf.total / 2 + 7) / 8 < 2 * nsm; /* gm_launch's choice for tf alone */
        int rf = one ? 1 : 2;
        unsigned nb = (unsigned)((tb.total + 7) / 8), nf = (unsigned)(((tf.total + rf - 1) / rf + 7) / 8);
        if (one)
            dsv4_launch(k_gemv_multi2<16, 1, 8, 1>, nb + nf, 256, smem, st, tb, tf, x, (int)nb);
        else
            dsv4_launch(k_gemv_multi2<16, 1, 8, 2>, nb + nf, 256, smem, st, tb, tf, x, (int)nb);
        return 1;
    }
    if (vb == 8 && vf == 4) {
        unsigned nb = (unsigned)(((tb.total + 1) / 2 + 7) / 8), nf = (unsigned)(((tf.total + 3) / 4 + 7) / 8);
        dsv4_launch(k_gemv_multi2<8, 2, 4, 4>, nb + nf, 256, smem, st, tb, tf, x, (int)nb);
        return 1;
    }
    return 0;
}

void cu_matmul_any(dsv4_backend *, float *, const float *, int, const dsv4_weight *, int, int); /* gemm.cu */

long dsv4_cuda_gemv_multi_launches(dsv4_backend *b) {
    return CI(b)->gm_launches;
}

void cu_matmul_multi(dsv4_backend *b, int n, float *const *outs, const float *x, int rows,
                     const dsv4_weight *const *ws, const int *flags, const int *out_bf16) {
    cuda_impl *c = CI(b);
    if (gm_off < 0) {
        const char *e = getenv("DSV4_CUDA_GEMV_MULTI");
        gm_off = e && e[0] == '0';
    }
    if (c->failed || n <= 0) return;
    /* entries k_gemv_multi takes: one row, device output, bf16 or FP8 with e8m0 blocks of
     * >= 16 columns, K with an instance, rows a multiple of RPW */
    int take[GM_MAXE * 4] = {0}, fmtv[GM_MAXE * 4] = {0};
    int any = 0;
    for (int i = 0; i < n && i < GM_MAXE * 4; i++) {
        const dsv4_weight *w = ws[i];
        int fmt = w->fmt == DSV4_WF_BF16 ? GM_BF16 : w->fmt == DSV4_WF_FP8 ? GM_FP8 : -1;
        int vpl = fmt < 0 ? 0 : gm_vpl(fmt, w->cols);
        int ok = !gm_off && rows == 1 && vpl && w->cols == ws[0]->cols && dsv4_cuda_is_dev(b, outs[i]) &&
                 w->rows % gm_rpw(vpl) == 0 && w->rows < (1 << 24);
        if (ok && fmt == GM_FP8)
            ok = !w->scale_f32 && w->block >= 16 && (w->block & (w->block - 1)) == 0 &&
                 w->cols % w->block == 0;
        take[i] = ok, fmtv[i] = fmt, any |= ok;
    }
    if (dsv4_cuda_is_dev(b, x) && ((uintptr_t)x & 15)) any = 0; /* x is read by float4 */
    if (!any || n > GM_MAXE * 4) {
        for (int i = 0; i < n; i++)
            cu_matmul_any(b, outs[i], x, rows, ws[i], flags[i], out_bf16[i]);
        return;
    }
    for (int i = 0; i < n; i++)
        if (!take[i]) cu_matmul_any(b, outs[i], x, rows, ws[i], flags[i], out_bf16[i]);
    dsv4_cuda_op_begin(b);
    int64_t K = ws[0]->cols;
    int nsm = c->nsm;
    const float *xd = (const float *)dsv4_cuda_in(b, x, sizeof(float) * K);
    if (!xd) return;
    const float *xq = NULL;
    /* launch groups: (format, input): bf16, FP8 on x, FP8 on act_quant(x).  The third group's
     * blocks quantize x themselves as they stage it (aq, d_stage_x: act_quant's bits) unless
     * DSV4_CUDA_AQ_FUSE lacks bit 2 (act_quant into scratch first, as before).  The last table of
     * each group waits for the end, where one launch may take the bf16 table with an FP8 table
     * (gm_launch2) */
    const int fuse = (dsv4_cuda_aq_fuse() & DSV4_CUDA_AQ_MULTI) != 0;
    gm_table keep[3];
    for (int g = 0; g < 3; g++) {
        int fmt = g == 0 ? GM_BF16 : GM_FP8, quant = g == 2;
        gm_table t;
        t.n = 0, t.total = 0, t.aq = quant && fuse;
        t.early = dsv4_cuda_gm_early;
        for (int i = 0; i < n; i++) {
            if (!take[i] || fmtv[i] != fmt || (fmt == GM_FP8 && ((flags[i] & DSV4_LIN_ACT_FP8) != 0) != quant))
                continue;
            if (quant && !fuse && !xq) {
                float *q = (float *)dsv4_cuda_scratch(b, sizeof(float) * K);
                if (!q) return;
                dsv4_cuda_act_quant(b, q, xd, 1, K, 128);
                xq = q;
            }
            if (t.n == GM_MAXE) { /* a full table goes now */
                gm_launch(t, fmt, gm_vpl(fmt, K), quant && !fuse ? xq : xd, c->stream, nsm);
                if (CKL(b)) return;
                c->gm_launches++;
                t.n = 0, t.total = 0;
            }
            dweight dw;
            if (dsv4_cuda_weight(b, ws[i], &dw)) return;
            gm_entry &E = t.e[t.n++];
            E.w = dw.data, E.s = dw.scale, E.out = outs[i];
            E.row0 = t.total, t.total += (int)dw.rows;
            E.srow = fmt == GM_FP8 ? (int)(K / dw.block) : 0;
            E.blk_log2 = 0;
            while (fmt == GM_FP8 && (1 << E.blk_log2) < dw.block)
                E.blk_log2++;
            E.out_bf16 = out_bf16[i] != 0;
            c->weight_bytes_read +=
                (size_t)dw.rows * (size_t)K * (fmt == GM_FP8 ? 1 : 2) +
                (fmt == GM_FP8 ? (size_t)((dw.rows + dw.block - 1) / dw.block) * E.srow : 0);
        }
        keep[g] = t;
    }
    /* the bf16 table and an FP8 table that reads x (the second group, or the third where its
     * blocks quantize x themselves) in one launch where an instance takes their K */
    int merged = 0;
    for (int g = 1; g < 3 && keep[0].n && !merged; g++)
        if (keep[g].n && (g == 1 || fuse) && gm_launch2(keep[0], keep[g], K, xd, c->stream, nsm)) {
            if (CKL(b)) return;
            c->gm_launches++;
            merged = g;
        }
    for (int g = 0; g < 3; g++) {
        if (!keep[g].n || (merged && (g == merged || g == 0))) continue; /* merged: 0 none, else the FP8 group */
        gm_launch(keep[g], g == 0 ? GM_BF16 : GM_FP8, gm_vpl(g == 0 ? GM_BF16 : GM_FP8, K), g == 2 && !fuse ? xq : xd,
                  c->stream, nsm);
        if (CKL(b)) return;
        c->gm_launches++;
    }
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_MATMUL_MULTI);
}
