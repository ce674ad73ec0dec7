/* backend/cuda/linear.cu: dequantizing linears (matmul, matmul_rn, grouped wo_a, embed, act_quant).
 *
 * k_linear<NR, OPW, FMT>: out[r][o] = sum_k W[o0+o][k] x[r][g(o)*xg + k] for o < no,
 * r < rows (<= NR <= 8 per launch; the launcher walks larger batches in chunks of 8 rows).
 * g(o) = o / gR is the group of a grouped projection (wo_a: one launch over all groups;
 * plain matmul: gR = no, xg = 0).
 * Layout: W in its stored format (device), x [rows][ldx] fp32, out [rows][ldo] fp32.
 * Geometry: one warp per OPW adjacent output features (4 for 1-2 rows, 2 for 3-8), 8 warps
 *   per block; with few features kw = 2/4/8 warps of a block split one group's K (sums
 *   added in shared memory in warp order); split-K over grid.y only for tall thin weights,
 *   partials summed by k_splitk_sum in split order (deterministic, no atomics).  A lane
 *   issues the 16-byte weight loads of two steps for its OPW features (FP8: 16 values per
 *   vector, MXFP4/NVFP4: 32, bf16: 8, f32: 4; ld.global.nc.L1::no_allocate) and their block
 *   scales before any math, then takes x 4 columns at a time (one float4 per row, used for
 *   all OPW features) and dequantizes in registers (FP8 by the e4m3x2 -> f16x2 instruction).
 *   Odd shapes (K not a multiple of 32, partial scale blocks, unaligned x) take the
 *   element-wise path (one feature per warp).
 * k_gemv (below) takes batches of 1-2 rows whose weight rows are 32..1024 16-byte vectors
 *   (every Flash decode projection): a thread always reads the same columns of RPP rows a
 *   pass, sums leave by a warp reduce-scatter; 18-25 % faster than k_linear there.
 * k_gemv8 (below) takes FP8 at one row instead: the e8m0 block scale applied once per
 *   16-product partial, the scale mode a template parameter (12.6 us against 18.1 on wq_b);
 *   k_gemv8x (below) at K 4096..8192 (wo_a, wo_b): x in registers, persistent grid, next
 *   pass's loads in flight (wo_b 14.2 us against 16.8).
 * k_gemv8n (below): k_gemv8 at wq_b's geometry with x's rmsnorm formed by each block (matmul_rn:
 *   qa's norm inside wq_b, the bits of the two ops).
 * k_gemvn (below) takes 2..8 rows a launch of FP8 and bf16 weights with K % 128 == 0 (larger
 *   batches in chunks of 8): a weight decoded once for all rows, x loads contiguous across a
 *   warp, a persistent grid (DSV4_CUDA_BGEMV=0: the paths above, for the A/B).
 * Accumulation order differs from the CPU's (lane-strided partial sums of 4 products,
 * then a warp tree): that is the only difference; the flags (w_bf16, out_bf16) round
 * exactly where the CPU does (each dequantized weight; each output).
 * Target: sm_90a.  Decode at batch 1 is memory-bound; prefill reuses nothing across
 * chunks of 8 rows (tensor-core prefill is future work, docs/CUDA.md).
 */
#include "backend/cuda/common.cuh"
#include "backend/cuda/norm.cuh"

enum { LF_F32 = 0, LF_BF16 = 1, LF_FP8 = 2, LF_FP4 = 3 }; /* vector paths (FP4: MXFP4 and NVFP4) */

/* values per 16-byte vector of each vector path */
template <int FMT> struct lvec { enum { N = FMT == LF_F32 ? 4 : FMT == LF_BF16 ? 8 : FMT == LF_FP8 ? 16 : 32 }; };

/* weights i*4 .. i*4+3 of a 16-byte vector v, times its scale(s) (FP4: s0 for the first 16, s1 after) */
template <int FMT>
__device__ __forceinline__ float4 dequant4(const uint4 &v, int i, float s0, float s1) {
    const uint8_t *by = (const uint8_t *)&v;
    float4 f;
    if (FMT == LF_F32) {
        f = make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
    } else if (FMT == LF_BF16) {
        const uint16_t *h = (const uint16_t *)&v;
        f = make_float4(d_bf16_to_f32(h[4 * i]), d_bf16_to_f32(h[4 * i + 1]), d_bf16_to_f32(h[4 * i + 2]),
                        d_bf16_to_f32(h[4 * i + 3]));
    } else if (FMT == LF_FP8) { /* hardware e4m3x2 -> f16x2 (exact, as is f16 -> f32) */
        const uint16_t *h = (const uint16_t *)&v;
        float2 a = d_e4m3x2_to_f32x2(h[2 * i]), b = d_e4m3x2_to_f32x2(h[2 * i + 1]);
        f = make_float4(a.x * s0, a.y * s0, b.x * s0, b.y * s0);
    } else { /* two bytes = four e2m1 values, low nibble first */
        float s = i < 4 ? s0 : s1;
        uint32_t b0 = by[2 * i], b1 = by[2 * i + 1];
        f = make_float4(d_e2m1_to_f32(b0 & 15u) * s, d_e2m1_to_f32(b0 >> 4) * s, d_e2m1_to_f32(b1 & 15u) * s,
                        d_e2m1_to_f32(b1 >> 4) * s);
    }
    return f;
}

/* block scale(s) of the 16-byte vector at column k0 of weight row o (FP8: s0; FP4: s0, s1) */
template <int FMT>
__device__ __forceinline__ void vec_scales(const dweight &w, int64_t o, int64_t k0, int64_t K, int64_t scols,
                                           float &s0, float &s1) {
    s0 = s1 = 1.0f;
    if (FMT == LF_FP8) {
        int64_t si = (o / w.block) * scols + k0 / w.block;
        s0 = w.scale_f32 ? __ldg((const float *)w.scale + si) : d_e8m0_to_f32(__ldg(w.scale + si));
    } else if (FMT == LF_FP4) {
        if (w.fmt == DSV4_WF_MXFP4) {
            s0 = s1 = d_e8m0_to_f32(__ldg(w.scale + o * (K / 32) + k0 / 32));
        } else {
            const uint8_t *sp = w.scale + o * (K / 16) + k0 / 16;
            s0 = d_e4m3_to_f32(__ldg(sp)) * w.scale2;
            s1 = d_e4m3_to_f32(__ldg(sp + 1)) * w.scale2;
        }
    }
}

/* acc[u][r] += the products of one 16-byte vector per feature with x columns k0.. */
template <int NR, int OPW, int FMT>
__device__ __forceinline__ void vec_fma(float (&acc)[OPW][NR], const uint4 (&v)[OPW], const float (&s0)[OPW],
                                        const float (&s1)[OPW], const float *__restrict__ xw, int64_t ldx, int rows,
                                        int64_t k0, int w_bf16) {
    constexpr int VN = lvec<FMT>::N;
#pragma unroll
    for (int i = 0; i < VN / 4; i++) {
        float4 wf[OPW];
#pragma unroll
        for (int u = 0; u < OPW; u++) {
            wf[u] = dequant4<FMT>(v[u], i, s0[u], s1[u]);
            if (w_bf16) wf[u].x = d_round_bf16(wf[u].x), wf[u].y = d_round_bf16(wf[u].y),
                        wf[u].z = d_round_bf16(wf[u].z), wf[u].w = d_round_bf16(wf[u].w);
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r >= rows) break;
            float4 xv = __ldg((const float4 *)(xw + (int64_t)r * ldx + k0 + 4 * i));
#pragma unroll
            for (int u = 0; u < OPW; u++)
                acc[u][r] += wf[u].x * xv.x + wf[u].y * xv.y + wf[u].z * xv.z + wf[u].w * xv.w;
        }
    }
}

/* kw warps of a block share one group of OPW features and split its K span step by step
 * (warp j takes steps j, j + kw, ...); their sums meet in shared memory and are added in
 * warp order (deterministic).  Each warp loads two steps ahead (2 x OPW 16-byte vectors per
 * lane) before any math. */
template <int NR, int OPW, int FMT>
__global__ void __launch_bounds__(256) k_linear(float *out, int64_t ldo, const float *__restrict__ x, int64_t ldx,
                                                int rows, dweight w, int64_t o0, int64_t no, int64_t gR, int64_t xg,
                                                int w_bf16, int out_bf16, int64_t kspan, float *part, int kw) {
    pdl_enter();
    constexpr int VN = lvec<FMT>::N;
    __shared__ float red[8][OPW * NR];
    int wib = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int grp = wib / kw, sub = wib % kw;
    int64_t ob = ((int64_t)blockIdx.x * (8 / kw) + grp) * OPW; /* first feature (all OPW in one group) */
    int active = ob < no;
    int64_t K = w.cols;
    int64_t kb = (int64_t)blockIdx.y * kspan, ke = kb + kspan < K ? kb + kspan : K; /* split-K slice */
    const float *xw = x + (active ? ob / gR : 0) * xg;
    float acc[OPW][NR];
#pragma unroll
    for (int u = 0; u < OPW; u++)
#pragma unroll
        for (int r = 0; r < NR; r++) acc[u][r] = 0.0f;
    int64_t rbytes = FMT == LF_F32 ? K * 4 : FMT == LF_BF16 ? K * 2 : FMT == LF_FP8 ? K : K / 2;
    int64_t scols = FMT == LF_FP8 ? (K + w.block - 1) / w.block : 0;
    int64_t stride = (int64_t)kw * 32 * VN;
    const uint8_t *rowp[OPW];
    int64_t orow[OPW];
#pragma unroll
    for (int u = 0; u < OPW; u++) {
        orow[u] = o0 + (ob + u < no ? ob + u : ob);
        rowp[u] = w.data + orow[u] * rbytes;
    }
#define VB(k) (FMT == LF_F32 ? (k) * 4 : FMT == LF_BF16 ? (k) * 2 : FMT == LF_FP8 ? (k) : (k) / 2)
    for (int64_t k0 = kb + ((int64_t)sub * 32 + lane) * VN; active && k0 < ke; k0 += 2 * stride) {
        int64_t k1 = k0 + stride;
        int has1 = k1 < ke;
        uint4 v0[OPW], v1[OPW];
        float a0[OPW], b0[OPW], a1[OPW], b1[OPW];
#pragma unroll
        for (int u = 0; u < OPW; u++) { /* every load of both steps first */
            v0[u] = d_ld_stream16(rowp[u] + VB(k0));
            if (has1) v1[u] = d_ld_stream16(rowp[u] + VB(k1));
        }
#pragma unroll
        for (int u = 0; u < OPW; u++) {
            vec_scales<FMT>(w, orow[u], k0, K, scols, a0[u], b0[u]);
            if (has1) vec_scales<FMT>(w, orow[u], k1, K, scols, a1[u], b1[u]);
        }
        vec_fma<NR, OPW, FMT>(acc, v0, a0, b0, xw, ldx, rows, k0, w_bf16);
        if (has1) vec_fma<NR, OPW, FMT>(acc, v1, a1, b1, xw, ldx, rows, k1, w_bf16);
    }
#undef VB
#pragma unroll
    for (int u = 0; u < OPW; u++)
#pragma unroll
        for (int r = 0; r < NR; r++) {
            float v = warp_sum(acc[u][r]);
            if (kw > 1 && lane == 0) red[wib][u * NR + r] = v;
            acc[u][r] = v;
        }
    if (kw > 1) {
        __syncthreads();
        if (sub != 0) return;
    }
    if (!active || lane >= OPW * NR) return;
    int u = lane / NR, r = lane % NR;
    if (r >= rows || ob + u >= no) return;
    float v;
    if (kw > 1) { /* the group's warps in order */
        v = red[wib][lane];
        for (int j = 1; j < kw; j++) v += red[wib + j][lane];
    } else {
        v = 0.0f;
#pragma unroll
        for (int uu = 0; uu < OPW; uu++)
#pragma unroll
            for (int rr = 0; rr < NR; rr++)
                if (uu * NR + rr == lane) v = acc[uu][rr];
    }
    int64_t o = ob + u;
    if (gridDim.y > 1) part[((int64_t)blockIdx.y * rows + r) * no + o] = v;
    else out[(int64_t)r * ldo + o] = out_bf16 ? d_round_bf16(v) : v;
}

/* element-wise path for odd shapes: one warp per feature, d_weight_at per element */
template <int NR>
__global__ void __launch_bounds__(256) k_linear_any(float *out, int64_t ldo, const float *__restrict__ x,
                                                    int64_t ldx, int rows, dweight w, int64_t o0, int64_t no,
                                                    int64_t gR, int64_t xg, int w_bf16, int out_bf16) {
    pdl_enter();
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= no) return;
    const float *xw = x + (warp / gR) * xg;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    for (int64_t k = lane; k < w.cols; k += 32) {
        float wk = d_weight_at(w, o0 + warp, k);
        if (w_bf16) wk = d_round_bf16(wk);
#pragma unroll
        for (int r = 0; r < NR; r++)
            if (r < rows) acc[r] += wk * xw[(int64_t)r * ldx + k];
    }
#pragma unroll
    for (int r = 0; r < NR; r++) {
        if (r >= rows) break;
        float v = warp_sum(acc[r]);
        if (lane == 0) out[(int64_t)r * ldo + warp] = out_bf16 ? d_round_bf16(v) : v;
    }
}

/* ----- k_gemv: the streaming GEMV of decode batches of 1-2 rows ----- */

constexpr int ilog2(int n) { return n <= 1 ? 0 : 1 + ilog2(n / 2); }

/* Warp reduce-scatter of N sums (N a power of two <= 32): afterwards lane l holds the warp
 * sum of v[l / (32 / N)].  log2(N) halving stages (lanes exchange the half they give away)
 * then plain butterfly steps: N - 1 + 5 - log2(N) shuffles instead of 5 N. */
template <int N>
__device__ __forceinline__ float warp_reduce_scatter(float (&v)[N], int lane) {
    constexpr int L = ilog2(N);
#pragma unroll
    for (int st = 0; st < L; st++) {
        const int h = N >> (st + 1), s = 16 >> st, up = lane & s;
#pragma unroll
        for (int i = 0; i < h; i++) {
            float send = up ? v[i] : v[i + h], keep = up ? v[i + h] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, s);
        }
    }
    float r = v[0];
#pragma unroll
    for (int s = 16 >> L; s >= 1; s >>= 1) r += __shfl_xor_sync(0xffffffffu, r, s);
    return r;
}

/* The end of a pass of k_gemv / k_gemv8: the RPP x NR sums of each row slot leave the warp by
 * one reduce-scatter and, when a slot spans nw > 1 warps, meet in shared memory (red, two
 * buffers alternating by pass), added in warp order (deterministic).  Returns 1 on the
 * threads that hold a finished sum: `sum`, of slot `sl`, value `id` (row id / NR, input row
 * id % NR).  nw is block-uniform (it holds a barrier). */
template <int N>
__device__ __forceinline__ int gemv_slot_sum(float (&acc)[N], float (&red)[2][8][N], int &buf, int nw, int slots,
                                             int slot, float &sum, int &sl, int &id) {
    const int t = threadIdx.x, lane = t & 31, wib = t >> 5, per = 32 / N;
    sum = warp_reduce_scatter<N>(acc, lane);
    sl = slot, id = lane / per;
    int wr = lane % per == 0;
    if (nw > 1) { /* the slot's warps meet in shared memory, added in warp order */
        if (wr) red[buf][wib][id] = sum;
        __syncthreads();
        wr = t < slots * N;
        if (wr) {
            sl = t / N, id = t % N;
            sum = red[buf][sl * nw][id];
            for (int k = 1; k < nw; k++) sum += red[buf][sl * nw + k][id];
        }
        buf ^= 1;
    }
    return wr;
}

/* The weight vectors (and their block scales) of one pass: RPP rows from rb on, the thread's
 * CPT columns; rows past the end re-read the last row (never written out). */
template <int FMT, int CPT, int RPP>
__device__ __forceinline__ void gemv_load(uint4 (&v)[RPP][CPT], float (&s0)[RPP][CPT], float (&s1)[RPP][CPT],
                                          const dweight &w, int64_t o0, int64_t no, int64_t rb, int64_t rbytes,
                                          const int64_t (&kcol)[CPT], const int (&scol)[CPT], int64_t scols) {
#pragma unroll
    for (int j = 0; j < RPP; j++) {
        int64_t o = o0 + (rb + j < no ? rb + j : no - 1);
        const uint8_t *rp = w.data + o * rbytes;
#pragma unroll
        for (int i = 0; i < CPT; i++)
            v[j][i] = d_ld_stream16(rp + (FMT == LF_F32 ? kcol[i] * 4 : FMT == LF_BF16 ? kcol[i] * 2
                                          : FMT == LF_FP8 ? kcol[i] : kcol[i] / 2));
    }
#pragma unroll
    for (int j = 0; j < RPP; j++) {
        int64_t o = o0 + (rb + j < no ? rb + j : no - 1);
#pragma unroll
        for (int i = 0; i < CPT; i++) {
            s0[j][i] = s1[j][i] = 1.0f;
            if (FMT == LF_FP8) {
                int64_t si = (int64_t)((uint64_t)o / (unsigned)w.block) * scols + scol[i];
                s0[j][i] = w.scale_f32 ? __ldg((const float *)w.scale + si) : d_e8m0_to_f32(__ldg(w.scale + si));
            } else if (FMT == LF_FP4) {
                const uint8_t *sp = w.scale + o * scols + scol[i];
                if (w.fmt == DSV4_WF_MXFP4) {
                    s0[j][i] = s1[j][i] = d_e8m0_to_f32(__ldg(sp));
                } else {
                    s0[j][i] = d_e4m3_to_f32(__ldg(sp)) * w.scale2;
                    s1[j][i] = d_e4m3_to_f32(__ldg(sp + 1)) * w.scale2;
                }
            }
        }
    }
}

/* k_gemv<NR, FMT, CPT, RPP>: out[r][o] = sum_k W[o0+o][k] x[r][g(o)*xg + k] for rows <= NR
 * (1 or 2), the same contract as k_linear (gR % RPP == 0: a pass's rows share one group).
 * Geometry: a row of W is CV = K / VN 16-byte vectors; tpr = CV / CPT threads (32..256, a
 * power of two) cover one row, thread c always the columns c, c + tpr, ..., so 256 / tpr row
 * slots run side by side in a 256-thread block.  A pass gives each slot RPP consecutive rows:
 * every thread issues its RPP x CPT weight loads (and block scales) before any math, reads
 * each x float4 once for the RPP rows, then the RPP x NR sums leave the warp by one
 * reduce-scatter and (tpr > 32) meet in shared memory, added in warp order (one barrier a
 * pass, two buffers).  One pass per block (grid = passes; the loop is grid-stride).
 * Measured on the H200 (ktrace, cold weights, batch 1, against k_linear): FP8 wq_b
 * [32768 x 1024] 18.2 us (23.7), grouped wo_a 19.2 (23.0), wo_b [4096 x 8192] 20.4 (22.4),
 * wq_a 5.0 (5.5), wkv 4.2 (4.6), bf16 [1024 x 4096] 5.3 (5.8); a plain 16-byte read of the
 * 33.6 MB took 12.1 us.  Variants that were slower: RPP 8 and 16 (registers: 118-254 at NR
 * 1-2, fewer blocks per SM), the next pass's loads issued before this pass's math (1-2
 * blocks per SM left), a persistent grid.  Also slower (H200, ktrace, cold, 2026-12-01): the
 * same passes on a persistent grid with per-thread cp.async stages in shared memory (each
 * thread copies its own vectors and scale words, S - 1 passes in flight, cp.async.wait_group,
 * no barrier per stage; same bits): wq_b rows 1 27.8 / 27.9 / 24.6 us at S = 4 / 3 / 2 stages
 * (2 / 3 / 4 blocks per SM) against 18.3 here, wo_a 29.2 / 29.6 / 25.9 (19.4), wo_b 29.6 /
 * 29.9 / 28.9 (21.7).  Fewer resident warps (16-32 per SM against 40 here: 48 registers, 5
 * blocks) lost more than the overlapped loads gained; not analysed further. */
template <int NR, int FMT, int CPT, int RPP>
__global__ void __launch_bounds__(256) k_gemv(float *out, int64_t ldo, const float *__restrict__ x, int64_t ldx,
                                              int rows, dweight w, int64_t o0, int64_t no, int64_t gR, int64_t xg,
                                              int w_bf16, int out_bf16, int tpr_log2, int npass, int early) {
    constexpr int VN = lvec<FMT>::N, N = RPP * NR;
    __shared__ float red[2][8][N];
    const int tpr = 1 << tpr_log2, nw = tpr >> 5, slots = 256 >> tpr_log2;
    const int t = threadIdx.x, slot = t >> tpr_log2, c = t & (tpr - 1);
    const int64_t K = w.cols;
    const int64_t rbytes = FMT == LF_F32 ? K * 4 : FMT == LF_BF16 ? K * 2 : FMT == LF_FP8 ? K : K / 2;
    const int64_t scols = FMT == LF_FP8 ? K / w.block : FMT == LF_FP4 ? K / (w.fmt == DSV4_WF_MXFP4 ? 32 : 16) : 0;
    int64_t kcol[CPT];
    int scol[CPT];
#pragma unroll
    for (int i = 0; i < CPT; i++) {
        kcol[i] = (int64_t)(c + i * tpr) * VN;
        scol[i] = FMT == LF_FP8 ? (int)(kcol[i] / w.block)
                  : FMT == LF_FP4 ? (int)(kcol[i] / (w.fmt == DSV4_WF_MXFP4 ? 32 : 16)) : 0;
    }
    int buf = 0, entered = 0; /* pdl_enter (common.cuh) once the first pass's weights are asked for, as k_gemv8 */
    if (!early) pdl_enter(), entered = 1; /* DSV4_CUDA_GEMV_EARLY=0: the wait first, as before stop 39 */
    for (int p = blockIdx.x; p < npass; p += gridDim.x) {
        const int64_t rb = ((int64_t)p * slots + slot) * RPP; /* this slot's first row */
        uint4 v[RPP][CPT];
        float s0[RPP][CPT], s1[RPP][CPT];
        gemv_load<FMT, CPT, RPP>(v, s0, s1, w, o0, no, rb, rbytes, kcol, scol, scols);
        if (!entered) pdl_enter(), entered = 1; /* weights only before it: in flight while the previous kernel ends */
        const float *xw = x + (rb < no ? rb / gR : 0) * xg;
        float acc[N];
#pragma unroll
        for (int n = 0; n < N; n++) acc[n] = 0.0f;
#pragma unroll
        for (int i = 0; i < CPT; i++)
#pragma unroll
            for (int q = 0; q < VN / 4; q++) {
                float4 xv[NR];
#pragma unroll
                for (int r = 0; r < NR; r++)
                    xv[r] = r < rows ? __ldg((const float4 *)(xw + (int64_t)r * ldx + kcol[i] + 4 * q))
                                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int j = 0; j < RPP; j++) {
                    float4 wf = dequant4<FMT>(v[j][i], q, s0[j][i], s1[j][i]);
                    if (w_bf16) wf.x = d_round_bf16(wf.x), wf.y = d_round_bf16(wf.y), wf.z = d_round_bf16(wf.z),
                                wf.w = d_round_bf16(wf.w);
#pragma unroll
                    for (int r = 0; r < NR; r++)
                        acc[j * NR + r] += wf.x * xv[r].x + wf.y * xv[r].y + wf.z * xv[r].z + wf.w * xv[r].w;
                }
            }
        float sum;
        int sl, id;
        const int wr = gemv_slot_sum<N>(acc, red, buf, nw, slots, slot, sum, sl, id);
        int64_t o = ((int64_t)p * slots + sl) * RPP + id / NR;
        int r = id % NR;
        if (wr && o < no && r < rows) out[(int64_t)r * ldo + o] = out_bf16 ? d_round_bf16(sum) : sum;
    }
    if (!entered) pdl_enter();
}

static size_t wbytes_rows(const dweight &w, int64_t no) {
    switch (w.fmt) {
    case DSV4_WF_F32: return (size_t)(no * w.cols * 4);
    case DSV4_WF_BF16: return (size_t)(no * w.cols * 2);
    case DSV4_WF_FP8: return (size_t)(no * w.cols + (no * w.cols) / (w.block * w.block) * (w.scale_f32 ? 4 : 1));
    case DSV4_WF_MXFP4: return (size_t)(no * w.cols / 2 + no * w.cols / 32);
    case DSV4_WF_NVFP4: return (size_t)(no * w.cols / 2 + no * w.cols / 16);
    default: return 0;
    }
}

/* sums the split-K partials in split order (deterministic) */
__global__ void k_splitk_sum(float *out, int64_t ldo, const float *part, int rows, int64_t no, int splits,
                             int out_bf16) {
    pdl_enter();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows * no) return;
    int64_t r = t / no, o = t % no;
    float v = 0.0f;
    for (int s = 0; s < splits; s++) v += part[((int64_t)s * rows + r) * no + o];
    out[r * ldo + o] = out_bf16 ? d_round_bf16(v) : v;
}

struct lin_args {
    float *out;
    int64_t ldo;
    const float *x;
    int64_t ldx;
    int rows;
    dweight w;
    int64_t o0, no, gR, xg;
    int w_bf16, out_bf16;
    int64_t kspan;
    float *part;
    int kw;
    int x_bf16; /* k_gemv8x only (gemv_bf16in): x rounded to bf16 as it is loaded */
};

template <int NR, int OPW>
static void launch_vec(const lin_args &a, dim3 grid, cudaStream_t st) {
    switch (a.w.fmt) {
    case DSV4_WF_F32:
        dsv4_launch(k_linear<NR, OPW, LF_F32>, grid, 256, 0, st, a.out, a.ldo, a.x, a.ldx, a.rows, a.w, a.o0, a.no,
                    a.gR, a.xg, a.w_bf16, a.out_bf16, a.kspan, a.part, a.kw);
        break;
    case DSV4_WF_BF16:
        dsv4_launch(k_linear<NR, OPW, LF_BF16>, grid, 256, 0, st, a.out, a.ldo, a.x, a.ldx, a.rows, a.w, a.o0, a.no,
                    a.gR, a.xg, a.w_bf16, a.out_bf16, a.kspan, a.part, a.kw);
        break;
    case DSV4_WF_FP8:
        dsv4_launch(k_linear<NR, OPW, LF_FP8>, grid, 256, 0, st, a.out, a.ldo, a.x, a.ldx, a.rows, a.w, a.o0, a.no,
                    a.gR, a.xg, a.w_bf16, a.out_bf16, a.kspan, a.part, a.kw);
        break;
    default:
        dsv4_launch(k_linear<NR, OPW, LF_FP4>, grid, 256, 0, st, a.out, a.ldo, a.x, a.ldx, a.rows, a.w, a.o0, a.no,
                    a.gR, a.xg, a.w_bf16, a.out_bf16, a.kspan, a.part, a.kw);
        break;
    }
}

/* ----- k_gemv launch ----- */
template <int NR, int FMT, int CPT>
static void gemv_rpp(const lin_args &a, int rpp, int tpr_log2, int npass, cudaStream_t st) {
    switch (rpp) {
    case 1:
        dsv4_launch(k_gemv<NR, FMT, CPT, 1>, npass, 256, 0, st, a.out, a.ldo, a.x, a.ldx, a.rows, a.w, a.o0, a.no, a.gR,
                    a.xg, a.w_bf16, a.out_bf16, tpr_log2, npass, dsv4_cuda_gemv_early);
        break;
    case 2:
        dsv4_launch(k_gemv<NR, FMT, CPT, 2>, npass, 256, 0, st, a.out, a.ldo, a.x, a.ldx, a.rows, a.w, a.o0, a.no, a.gR,
                    a.xg, a.w_bf16, a.out_bf16, tpr_log2, npass, dsv4_cuda_gemv_early);
        break;
    default:
        dsv4_launch(k_gemv<NR, FMT, CPT, 4>, npass, 256, 0, st, a.out, a.ldo, a.x, a.ldx, a.rows, a.w, a.o0, a.no, a.gR,
                    a.xg, a.w_bf16, a.out_bf16, tpr_log2, npass, dsv4_cuda_gemv_early);
        break;
    }
}

template <int NR, int FMT>
static void gemv_fmt(const lin_args &a, int cpt, int rpp, int tpr_log2, int npass, cudaStream_t st) {
    if (cpt == 1) gemv_rpp<NR, FMT, 1>(a, rpp, tpr_log2, npass, st);
    else if (cpt == 2) gemv_rpp<NR, FMT, 2>(a, rpp, tpr_log2, npass, st);
    else gemv_rpp<NR, FMT, 4>(a, rpp, tpr_log2, npass, st);
}

/* k_gemv takes rows <= 2 when a weight row is 32..1024 vectors, a power of two (0: not
 * taken).  RPP: 4 / CPT rows a pass (>= 1), halved while that leaves fewer than two passes
 * per SM (wq_a [1024 x 4096]: 2; wkv [512 x 4096]: 1) or does not divide the group size. */
static int gemv_launch(const lin_args &a, int nsm, cudaStream_t st) {
    if (a.rows > 2 || nsm <= 0) return 0;
    int64_t K = a.w.cols,
            vn = a.w.fmt == DSV4_WF_F32 ? 4 : a.w.fmt == DSV4_WF_BF16 ? 8 : a.w.fmt == DSV4_WF_FP8 ? 16 : 32;
    int64_t cv = K / vn;
    if (cv < 32 || cv > 1024 || (cv & (cv - 1))) return 0;
    int cpt = cv > 256 ? (int)(cv / 256) : 1, tpr = (int)(cv / cpt), tl = ilog2(tpr), slots = 256 / tpr;
    int rpp = 4 / cpt > 1 ? 4 / cpt : 1;
    while (rpp > 1 &&
           (a.gR % rpp || (a.no + (int64_t)slots * rpp - 1) / ((int64_t)slots * rpp) < 2 * (int64_t)nsm))
        rpp /= 2;
    int64_t np = (a.no + (int64_t)slots * rpp - 1) / ((int64_t)slots * rpp);
    if (np > (1 << 30)) return 0;
    int npass = (int)np;
    switch (a.w.fmt) {
    case DSV4_WF_F32:
        if (a.rows == 1) gemv_fmt<1, LF_F32>(a, cpt, rpp, tl, npass, st);
        else gemv_fmt<2, LF_F32>(a, cpt, rpp, tl, npass, st);
        break;
    case DSV4_WF_BF16:
        if (a.rows == 1) gemv_fmt<1, LF_BF16>(a, cpt, rpp, tl, npass, st);
        else gemv_fmt<2, LF_BF16>(a, cpt, rpp, tl, npass, st);
        break;
    case DSV4_WF_FP8:
        if (a.rows == 1) gemv_fmt<1, LF_FP8>(a, cpt, rpp, tl, npass, st);
        else gemv_fmt<2, LF_FP8>(a, cpt, rpp, tl, npass, st);
        break;
    default:
        if (a.rows == 1) gemv_fmt<1, LF_FP4>(a, cpt, rpp, tl, npass, st);
        else gemv_fmt<2, LF_FP4>(a, cpt, rpp, tl, npass, st);
        break;
    }
    return 1;
}

/* ----- k_gemv8: the FP8 decode GEMV of one row ----- */

/* the 16 e4m3 weights of vector v as f32 (k_gemv8, k_gemv8x): SCL 0 the codes' values (the
 * caller applies the power-of-two scale to the partial), else as the CPU forms the weight:
 * value * scale s, bf16-rounded at SCL 2 */
template <int SCL>
__device__ __forceinline__ void g8_dec16(const uint4 &v, float s, float (&wf)[16]) {
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 8; e++) {
        float2 d = d_e4m3x2_to_f32x2((uint16_t)(u[e >> 1] >> (16 * (e & 1))));
        wf[2 * e] = d.x, wf[2 * e + 1] = d.y;
    }
    if (SCL != 0)
#pragma unroll
        for (int e = 0; e < 16; e++) wf[e] = SCL == 2 ? d_round_bf16(wf[e] * s) : wf[e] * s;
}

/* k_gemv8<NR, SCL, CPT, RPP>: out[r][o] = sum_k W[o0+o][k] x[r][g(o)*xg + k] for FP8 (e4m3)
 * weights with power-of-two block scales of >= 16 columns, rows == NR (the launcher: 1; 2
 * compiles and passed the tests, see below); the same contract as k_linear.  Geometry as
 * k_gemv: a row of W is CV = K / 16 16-byte vectors, tpr = CV / CPT threads (32..256) cover
 * one row, thread c always the columns c, c + tpr, ...; 256 / tpr row slots per block, RPP
 * consecutive rows per slot and pass.  The launcher
 * prefers tpr = 32 (a warp per row: no shared memory, no barrier) with CPT <= 4, and
 * RPP * CPT = 8 vectors (128 bytes) of loads in flight per thread.
 * Compiled for 3 blocks per SM (<= 80 registers): no spills at these CPT x RPP (ptxas -v,
 * CUDA 13); CPT 8 spilled (the compiler hoists every x load of the pass).
 * What k_gemv spent per weight (11 warp instructions; 62 % issue-busy, 39 % DRAM on wq_b) and
 * what this kernel does instead:
 *   - the block scale multiplied into every weight: with SCL 0 (e8m0 scales, no w_bf16) each
 *     thread sums a vector's 16 products x * w first (an fma chain) and multiplies the partial
 *     by the block scale once.  e8m0 is a power of two, so (w * s) * x = (w * x) * s and the
 *     partial sum's roundings scale with it: the same values as scaling every weight, barring
 *     under/overflow of the scaled terms.  f32 scales (SCL 1) keep the per-weight multiply
 *     (not a power of two: factoring would round differently), as does w_bf16 (SCL 2: the
 *     scaled weight rounded to bf16, as the CPU does);
 *   - w_bf16 / scale_f32 runtime branches per 4 weights: SCL is a template parameter;
 *   - 64-bit divisions for the scale row and the group: shifts (block a power of two) and
 *     one 32-bit division per pass (grouped only);
 *   - one scale load per (row, vector): rows of one pass share their scale row (o0 % RPP ==
 *     0 and RPP <= 16 <= block), so a pass loads CPT scales.
 * Inner loop per weight: 1/2 cvt e4m3x2 -> f16x2, 1 f16 -> f32, 1 fma (SCL 0).
 * Sums: warp reduce-scatter, then (tpr > 32) shared memory in warp order, as k_gemv.
 * Measured (H200, ncu --clock-control none, decode graphs of the 2-layer Flash synth, batch 1,
 * 2026-12-01 18:00Z; k_gemv in the same run): wq_b [32768 x 1024] 12.74 / 12.54 us (18.05 /
 * 18.05), 4.71 M warp instructions = 4.5 per weight (11.64 M), DRAM 56 % (39 %); wo_b
 * [4096 x 8192] 16.90 / 16.70 (21.92 / 21.12); grouped wo_a 17.15 / 17.41 (18.98 / 18.66);
 * wkv 4.74 / 4.64 (4.86 / 5.12); wq_a [1024 x 4096] 5.82 / 5.95 (5.66 / 5.63: slower).
 * Still latency-bound (31 % occupancy at 80 registers, half the stalls on L1TEX), and at
 * CPT 4 and RPP <= 2 a thread reads more bytes of x (from L1) than of weights.  Two rows
 * stay on k_gemv: NR 2 passed the tests in that run but timed slower in test_cuda_linear's
 * cold timing (wo_a 45.9 us against 25.2, wo_b 43.8 / 33.0, wq_b 27.2 / 24.3), so the
 * launcher takes one row only and NR 2 is not instantiated.  DSV4_CUDA_GEMV_OLD=1 (read
 * once) takes k_gemv for one row too (A/B). */
/* a k_gemv8 / k_gemv8n thread's place in its block: tpr threads a row (nw warps), slots rows a pass, its
 * slot, its column c; its CPT vectors' first columns (tpr vectors of 16 apart) and their scale columns */
template <int CPT> struct g8_place {
    int tpr, nw, slots, slot, c, scols;
    int kcol[CPT], scol[CPT];
};
template <int CPT> __device__ __forceinline__ g8_place<CPT> g8_place_of(int tpr_log2, int K, int blk_log2) {
    g8_place<CPT> g;
    g.tpr = 1 << tpr_log2, g.nw = g.tpr >> 5, g.slots = 256 >> tpr_log2;
    g.slot = (int)threadIdx.x >> tpr_log2, g.c = (int)threadIdx.x & (g.tpr - 1);
    g.scols = K >> blk_log2;
#pragma unroll
    for (int i = 0; i < CPT; i++) g.kcol[i] = (g.c + i * g.tpr) * 16, g.scol[i] = g.kcol[i] >> blk_log2;
    return g;
}

template <int NR, int SCL, int CPT, int RPP>
__global__ void __launch_bounds__(256, 3) k_gemv8(float *out, int64_t ldo, const float *__restrict__ x, int64_t ldx,
                                               const uint8_t *__restrict__ wd, const uint8_t *__restrict__ ws,
                                               int K, int sf32, int blk_log2, int64_t o0, int64_t no, int64_t gR,
                                               int64_t xg, int out_bf16, int tpr_log2, int npass) {
    constexpr int N = RPP * NR;
    __shared__ float red[2][8][N];
    const g8_place<CPT> g = g8_place_of<CPT>(tpr_log2, K, blk_log2);
    const int nw = g.nw, slots = g.slots, slot = g.slot, scols = g.scols;
    const int(&kcol)[CPT] = g.kcol, (&scol)[CPT] = g.scol;
    int buf = 0, entered = 0; /* pdl_enter (common.cuh) once this block's first weights are asked for */
    for (int p = blockIdx.x; p < npass; p += gridDim.x) {
        const int64_t rb = ((int64_t)p * slots + slot) * RPP; /* this slot's first row */
        uint4 v[RPP][CPT];
#pragma unroll
        for (int j = 0; j < RPP; j++) { /* rows past the end re-read the last row (never written) */
            const uint8_t *rp = wd + (o0 + (rb + j < no ? rb + j : no - 1)) * (int64_t)K;
#pragma unroll
            for (int i = 0; i < CPT; i++) v[j][i] = d_ld_stream16(rp + kcol[i]);
        }
        float s[CPT]; /* the pass's rows share one scale row */
        const int64_t srow = ((o0 + (rb < no ? rb : no - 1)) >> blk_log2) * scols;
#pragma unroll
        for (int i = 0; i < CPT; i++)
            s[i] = SCL != 0 && sf32 ? __ldg((const float *)ws + srow + scol[i])
                                    : d_e8m0_to_f32(__ldg(ws + srow + scol[i]));
        if (!entered) pdl_enter(), entered = 1; /* the first pass's weights are in flight meanwhile */
        const float *xw = x + (xg && rb < no ? (int64_t)((uint32_t)rb / (uint32_t)gR) * xg : 0);
        float acc[N];
#pragma unroll
        for (int n = 0; n < N; n++) acc[n] = 0.0f;
#pragma unroll
        for (int i = 0; i < CPT; i++) {
            float xv[NR][16];
#pragma unroll
            for (int r = 0; r < NR; r++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    float4 f = __ldg((const float4 *)(xw + (int64_t)r * ldx + kcol[i] + 4 * q));
                    xv[r][4 * q] = f.x, xv[r][4 * q + 1] = f.y, xv[r][4 * q + 2] = f.z, xv[r][4 * q + 3] = f.w;
                }
#pragma unroll
            for (int j = 0; j < RPP; j++) {
                float wf[16];
                g8_dec16<SCL>(v[j][i], s[i], wf);
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    float part = wf[0] * xv[r][0];
#pragma unroll
                    for (int e = 1; e < 16; e++) part = fmaf(wf[e], xv[r][e], part);
                    /* SCL 0: part * 2^k is exact (header), one rounding in the add */
                    acc[j * NR + r] = SCL == 0 ? fmaf(part, s[i], acc[j * NR + r]) : acc[j * NR + r] + part;
                }
            }
        }
        float sum;
        int sl, id;
        const int wr = gemv_slot_sum<N>(acc, red, buf, nw, slots, slot, sum, sl, id);
        const int64_t o = ((int64_t)p * slots + sl) * RPP + id / NR;
        const int r = id % NR;
        if (wr && o < no) out[(int64_t)r * ldo + o] = out_bf16 ? d_round_bf16(sum) : sum;
    }
    if (!entered) pdl_enter();
}

/* ----- k_gemv8n: matmul_rn at one row, k_gemv8 with its input normed by each block ----- */

/* the rmsnorm of x (k_gemv8n): rmsnorm's weights as dweight, has_w, their vector width (d_weight4),
 * eps, and the norm's out_bf16 (with DSV4_NORM_BF16_STEPS) */
struct g8_rn {
    dweight w;
    int has_w, vw, bf;
    float eps;
};

/* x's float4 g (columns 4g..4g+3) in k_gemv8n's shared copy: within each run of 4 (a thread's 16
 * columns) the slot is xored with bits 1-2 of the run, so the 8 lanes of a quarter warp, reading
 * the same q of 8 consecutive runs, hit 8 distinct 16-byte bank groups */
__device__ __forceinline__ int g8n_slot(int g) { return (g & ~3) | ((g & 3) ^ ((g >> 3) & 3)); }

/* k_gemv8n<CPT, RPP>: k_gemv8<1, 0, CPT, RPP> (e8m0 scales, one row) whose x is the rmsnorm of
 * the given row, K = 1024 (one float4 a thread of the 256).  After the first pass's weights are
 * asked for and the PDL wait, each block norms x with d_rmsnorm4 (the code, shape and so the bits
 * of rmsnorm's vector kernel and of op_list's norm task at dim 1024) into shared memory, and the
 * math reads it there instead of through L1; the products and sums are k_gemv8's, so the output
 * has the bits of rmsnorm then matmul.  With qa's norm in here the op list before wq_b reads
 * nothing wq_b writes and the reverse, which DSV4_WQB_FIRST's order builds on (forward.c). */
template <int CPT, int RPP>
__global__ void __launch_bounds__(256, 3) k_gemv8n(float *out, const float *__restrict__ x,
                                                const uint8_t *__restrict__ wd, const uint8_t *__restrict__ ws,
                                                int blk_log2, int64_t no, int out_bf16, int tpr_log2, int npass,
                                                g8_rn rn) {
    constexpr int K = 1024;
    __shared__ float red[2][8][RPP];
    __shared__ float4 xs[K / 4];
    __shared__ float sh[32];
    const g8_place<CPT> g = g8_place_of<CPT>(tpr_log2, K, blk_log2);
    const int nw = g.nw, slots = g.slots, slot = g.slot, scols = g.scols, t = threadIdx.x;
    const int(&kcol)[CPT] = g.kcol, (&scol)[CPT] = g.scol;
    int buf = 0, normed = 0;
    for (int p = blockIdx.x; p < npass; p += gridDim.x) {
        const int64_t rb = ((int64_t)p * slots + slot) * RPP;
        uint4 v[RPP][CPT];
#pragma unroll
        for (int j = 0; j < RPP; j++) {
            const uint8_t *rp = wd + (rb + j < no ? rb + j : no - 1) * (int64_t)K;
#pragma unroll
            for (int i = 0; i < CPT; i++) v[j][i] = d_ld_stream16(rp + kcol[i]);
        }
        float s[CPT];
        const int64_t srow = ((rb < no ? rb : no - 1) >> blk_log2) * scols;
#pragma unroll
        for (int i = 0; i < CPT; i++) s[i] = d_e8m0_to_f32(__ldg(ws + srow + scol[i]));
        if (!normed) {
            pdl_enter();
            xs[g8n_slot(t)] = d_rmsnorm4((const float4 *)x, K, rn.w, rn.has_w, rn.vw, rn.eps, rn.bf, sh, t, 256);
            __syncthreads();
            normed = 1;
        }
        float acc[RPP];
#pragma unroll
        for (int j = 0; j < RPP; j++) acc[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < CPT; i++) {
            float xv[16];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                float4 f = xs[g8n_slot((kcol[i] >> 2) + q)];
                xv[4 * q] = f.x, xv[4 * q + 1] = f.y, xv[4 * q + 2] = f.z, xv[4 * q + 3] = f.w;
            }
#pragma unroll
            for (int j = 0; j < RPP; j++) {
                float wf[16];
                g8_dec16<0>(v[j][i], s[i], wf);
                float part = wf[0] * xv[0];
#pragma unroll
                for (int e = 1; e < 16; e++) part = fmaf(wf[e], xv[e], part);
                acc[j] = fmaf(part, s[i], acc[j]); /* k_gemv8's SCL 0 */
            }
        }
        float sum;
        int sl, id;
        const int wr = gemv_slot_sum<RPP>(acc, red, buf, nw, slots, slot, sum, sl, id);
        const int64_t o = ((int64_t)p * slots + sl) * RPP + id;
        if (wr && o < no) out[o] = out_bf16 ? d_round_bf16(sum) : sum;
    }
    if (!normed) pdl_enter();
}

/* ----- k_gemv8x: k_gemv8 for the large weights, x held in registers ----- */

/* k_gemv8x<SCL, CPT, RPP>: the contract and numerics of k_gemv8 at one row (SCL as there),
 * for K / 16 = 2 tpr vectors (tpr = 32..256 threads a row, CPT = 2: K 1024..8192; the
 * launcher takes K 4096..8192).  What k_gemv8 spent and this kernel does not:
 *   - x read again every pass (64 bytes of x from L1 per 16 weight bytes; half the stall
 *     cycles on L1TEX): a thread's columns are the same in every pass, so its 32 floats of x
 *     stay in registers and are read again only when a pass starts a new group (grouped wo_a);
 *   - one pass per block, the loads of a pass waiting on nothing else: a persistent grid
 *     (the SMs times the resident blocks), each block a contiguous run of passes (a group
 *     changes at most a few times in a block), the next pass's weight vectors and scale words
 *     issued before this pass's math (two register buffers, the loop unrolled by two so
 *     neither is copied).
 * Sums as k_gemv8 (a vector's 16-product fma chain, times the e8m0 scale at SCL 0: exact, a
 * power of two; warp reduce-scatter; the slot's warps in warp order in shared memory, one
 * barrier a pass, two buffers).  128 registers at RPP 4 (no spills, ptxas -v, CUDA 13): 2
 * blocks, 16 warps per SM.
 * Measured (H200, ncu --clock-control none, decode graphs of the 2-layer Flash synth, batch 1,
 * 2026-12-01, both layers; k_gemv8 from its own run): grouped wo_a 15.2 / 14.3 us (17.3), wo_b
 * [4096 x 8192] 14.2 / 14.2 (16.8), DRAM 47-50 % (41-42 %); wq_b [32768 x 1024] 13.4 / 13.3
 * (12.6: slower, left to k_gemv8).  Not memory-bound yet: 25 % occupancy, 36 % issue-busy,
 * 45 % of stall cycles on L1TEX (now the weight loads: one pass ahead is not enough at 16
 * warps per SM), SM active only 78-82 % of the elapsed cycles (start-up and tail of the
 * 2-blocks-per-SM grid), 4.7 warp instructions per weight (as k_gemv8: the x loads were not
 * what the instruction count was made of). */
/* k_gemv8x: G8X_BPS resident blocks per SM (the launch bound; the persistent grid is the
 * SMs times that), G8X_RPP rows per slot and pass at most */
enum { G8X_BPS = 2, G8X_RPP = 4 };

template <int CPT, int RPP> struct g8x_buf {
    uint4 v[RPP][CPT];
    uint32_t s[CPT]; /* scale words as loaded (e8m0 byte or f32 bits), decoded at the math */
};

/* the weight vectors and scale words of the pass whose slot starts at row rb (rows past the
 * end re-read the last row, never written; the pass's rows share one scale row) */
template <int SCL, int CPT, int RPP>
__device__ __forceinline__ void g8x_load(g8x_buf<CPT, RPP> &b, const uint8_t *__restrict__ wd,
                                         const uint8_t *__restrict__ ws, int K, int sf32, int blk_log2, int scols,
                                         int64_t o0, int64_t no, int64_t rb, const int (&kcol)[CPT],
                                         const int (&scol)[CPT]) {
#pragma unroll
    for (int j = 0; j < RPP; j++) {
        const uint8_t *rp = wd + (o0 + (rb + j < no ? rb + j : no - 1)) * (int64_t)K;
#pragma unroll
        for (int i = 0; i < CPT; i++) b.v[j][i] = d_ld_stream16(rp + kcol[i]);
    }
    const int64_t srow = ((o0 + (rb < no ? rb : no - 1)) >> blk_log2) * scols;
#pragma unroll
    for (int i = 0; i < CPT; i++)
        b.s[i] = SCL != 0 && sf32 ? __ldg((const unsigned int *)ws + srow + scol[i]) : __ldg(ws + srow + scol[i]);
}

/* one pass: x for its group (loaded when the group changes), the RPP sums, their reduction
 * and the outputs */
template <int SCL, int CPT, int RPP, int XBF>
__device__ __forceinline__ void g8x_pass(const g8x_buf<CPT, RPP> &b, float (&xv)[CPT][16], int64_t &xgrp,
                                         int &buf, float (&red)[2][8][RPP], float *out, const float *__restrict__ x,
                                         int sf32, int64_t no, int64_t gR, int64_t xg, int out_bf16, int tpr_log2,
                                         int64_t p, const int (&kcol)[CPT]) {
    const int nw = 1 << (tpr_log2 - 5), slots = 256 >> tpr_log2;
    const int slot = (int)threadIdx.x >> tpr_log2;
    const int64_t rb = (p * slots + slot) * RPP;
    const int64_t g = xg && rb < no ? (int64_t)((uint32_t)rb / (uint32_t)gR) : 0;
    if (g != xgrp) { /* warp-uniform: a warp lies in one slot */
        xgrp = g;
        const float *xw = x + g * xg;
#pragma unroll
        for (int i = 0; i < CPT; i++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                float4 f = __ldg((const float4 *)(xw + kcol[i] + 4 * q));
                if (XBF) /* grouped wo_a's bf16 input, rounded here instead of in a copy (gemv_bf16in) */
                    f = make_float4(d_round_bf16(f.x), d_round_bf16(f.y), d_round_bf16(f.z), d_round_bf16(f.w));
                xv[i][4 * q] = f.x, xv[i][4 * q + 1] = f.y, xv[i][4 * q + 2] = f.z, xv[i][4 * q + 3] = f.w;
            }
    }
    float acc[RPP];
#pragma unroll
    for (int j = 0; j < RPP; j++) acc[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < CPT; i++) {
        const float s = SCL != 0 && sf32 ? __uint_as_float(b.s[i]) : d_e8m0_to_f32((uint8_t)b.s[i]);
#pragma unroll
        for (int j = 0; j < RPP; j++) {
            float wf[16];
            g8_dec16<SCL>(b.v[j][i], s, wf);
            float part = wf[0] * xv[i][0];
#pragma unroll
            for (int e = 1; e < 16; e++) part = fmaf(wf[e], xv[i][e], part);
            /* SCL 0: part * 2^k is exact (k_gemv8's header), one rounding in the add */
            acc[j] = SCL == 0 ? fmaf(part, s, acc[j]) : acc[j] + part;
        }
    }
    float sum;
    int sl, id;
    const int wr = gemv_slot_sum<RPP>(acc, red, buf, nw, slots, slot, sum, sl, id);
    const int64_t o = (p * slots + sl) * RPP + id;
    if (wr && o < no) out[o] = out_bf16 ? d_round_bf16(sum) : sum;
}

template <int SCL, int CPT, int RPP, int XBF, int SPLIT = 0>
__global__ void __launch_bounds__(256, G8X_BPS) k_gemv8x(float *out, const float *__restrict__ x,
                                                 const uint8_t *__restrict__ wd, const uint8_t *__restrict__ ws,
                                                 int K, int sf32, int blk_log2, int64_t o0, int64_t no, int64_t gR,
                                                 int64_t xg, int out_bf16, int tpr_log2, int npass) {
    __shared__ float red[2][8][RPP];
    const int tpr = 1 << tpr_log2, c = threadIdx.x & (tpr - 1);
    const int scols = K >> blk_log2;
    int kcol[CPT], scol[CPT];
#pragma unroll
    for (int i = 0; i < CPT; i++) kcol[i] = (c + i * tpr) * 16, scol[i] = kcol[i] >> blk_log2;
    const int slots = 256 >> tpr_log2, slot = threadIdx.x >> tpr_log2;
    float xv[CPT][16];
    int64_t xgrp = -1;
    int buf = 0;
    g8x_buf<CPT, RPP> ba, bb;
#define G8X_LOAD(B, P) g8x_load<SCL, CPT, RPP>(B, wd, ws, K, sf32, blk_log2, scols, o0, no, \
                                               ((int64_t)(P) * slots + slot) * RPP, kcol, scol)
#define G8X_PASS(B, P) g8x_pass<SCL, CPT, RPP, XBF>(B, xv, xgrp, buf, red, out, x, sf32, no, gR, xg, out_bf16, \
                                                    tpr_log2, P, kcol)
    /* this block's passes pb .. pe - 1, contiguous.  The default (since stop 64): whole runs of R = ceil(npass /
     * gridDim.x) passes, block b's run [b R, b R + R) (the last shorter, blocks past npass idle), so no block takes
     * more passes than under the split; on Flash's wo_a / wo_b (1024 passes, 264 blocks) that is one run of 4 a
     * block, measured 5.6 % faster per kernel than the split on an H100 (as runs of 4 interleaved, the same
     * assignment there; stop 64).  SPLIT (DSV4_CUDA_G8X_SPLIT=1, the default before): npass split in proportion,
     * every block within one pass of the others */
    const int64_t R = ((int64_t)npass + gridDim.x - 1) / gridDim.x;
    const int64_t pb = SPLIT ? (int64_t)npass * blockIdx.x / gridDim.x : R * blockIdx.x,
                  pe = SPLIT ? (int64_t)npass * (blockIdx.x + 1) / gridDim.x
                             : (pb + R < npass ? pb + R : (int64_t)npass);
    if (pb < pe) G8X_LOAD(ba, pb);
    pdl_enter(); /* the first pass's weights and scales are in flight while the previous kernel ends */
    for (int64_t p = pb; p < pe; p += 2) { /* loads of the next pass in flight during pass p */
        if (p + 1 < pe) G8X_LOAD(bb, p + 1);
        G8X_PASS(ba, p);
        if (p + 1 >= pe) break;
        if (p + 2 < pe) G8X_LOAD(ba, p + 2);
        G8X_PASS(bb, p + 1);
    }
#undef G8X_LOAD
#undef G8X_PASS
}

/* DSV4_CUDA_GEMV_OLD (A/B, read once): 1 = k_gemv instead of k_gemv8 / k_gemv8x, 2 = k_gemv8
 * instead of k_gemv8x */
static int gemv8_old(void) {
    static int v = -1;
    if (v < 0) {
        const char *o = getenv("DSV4_CUDA_GEMV_OLD");
        v = o && (o[0] == '1' || o[0] == '2') ? o[0] - '0' : 0;
    }
    return v;
}

struct gemv8_geom {
    int tpr_log2, npass, blk_log2, sf32;
};

template <int NR, int SCL, int CPT, int RPP>
static void gemv8_go(const lin_args &a, const gemv8_geom &g, cudaStream_t st) {
    dsv4_launch(k_gemv8<NR, SCL, CPT, RPP>, g.npass, 256, 0, st, a.out, a.ldo, a.x, a.ldx, a.w.data, a.w.scale,
                (int)a.w.cols, g.sf32, g.blk_log2, a.o0, a.no, a.gR, a.xg, a.out_bf16, g.tpr_log2, g.npass);
}

template <int SCL>
static void gemv8_cr(const lin_args &a, int cpt, int rpp, const gemv8_geom &g, cudaStream_t st) {
    switch (cpt * 8 + rpp) { /* CPT * RPP <= 8 */
    case 8 + 1: gemv8_go<1, SCL, 1, 1>(a, g, st); break;
    case 8 + 2: gemv8_go<1, SCL, 1, 2>(a, g, st); break;
    case 8 + 4: gemv8_go<1, SCL, 1, 4>(a, g, st); break;
    case 16 + 1: gemv8_go<1, SCL, 2, 1>(a, g, st); break;
    case 16 + 2: gemv8_go<1, SCL, 2, 2>(a, g, st); break;
    case 16 + 4: gemv8_go<1, SCL, 2, 4>(a, g, st); break;
    case 32 + 1: gemv8_go<1, SCL, 4, 1>(a, g, st); break;
    default: gemv8_go<1, SCL, 4, 2>(a, g, st); break;
    }
}

/* DSV4_CUDA_G8X_SPLIT=1 (A/B, read once): k_gemv8x's passes split in proportion over the blocks, the default before
 * stop 64's whole runs */
static int gemv8x_split(void) {
    static int v = -1;
    if (v < 0) {
        const char *o = getenv("DSV4_CUDA_G8X_SPLIT");
        v = o && !strcmp(o, "1");
    }
    return v;
}

template <int SCL, int RPP, int XBF>
static void gemv8x_go(const lin_args &a, int tpr_log2, int npass, int grid, cudaStream_t st) {
    dsv4_launch(gemv8x_split() ? k_gemv8x<SCL, 2, RPP, XBF, 1> : k_gemv8x<SCL, 2, RPP, XBF>, grid, 256, 0, st, a.out,
                a.x, a.w.data, a.w.scale, (int)a.w.cols, a.w.scale_f32, ilog2(a.w.block), a.o0, a.no, a.gR, a.xg,
                a.out_bf16, tpr_log2, npass);
}

template <int SCL, int XBF>
static void gemv8x_rpp(const lin_args &a, int rpp, int tpr_log2, int npass, int grid, cudaStream_t st) {
    if (rpp == 4) gemv8x_go<SCL, 4, XBF>(a, tpr_log2, npass, grid, st);
    else if (rpp == 2) gemv8x_go<SCL, 2, XBF>(a, tpr_log2, npass, grid, st);
    else gemv8x_go<SCL, 1, XBF>(a, tpr_log2, npass, grid, st);
}

/* w_bf16 (the weight rounded to bf16 after its scale, grouped wo_a in the reference profile)
 * changes no weight where every e8m0 code lies in [3, 246] (dweight.e8_bf16, found at the
 * upload: an e4m3 value times 2^(c - 127) is then exact in bf16), so the kernels take SCL 0 there,
 * the scale factored out of a vector's partial as at w_bf16 0 (the same bits as SCL 2's per-weight
 * scale and rounding, barring partials that under- or overflow, as for SCL 0 itself), instead of
 * SCL 2's multiply and rounding of every weight (grouped wo_a took 40 us a call in the H200's
 * reference-profile trace of 2026-12-03 against ~15 for the same bytes at SCL 0).
 * DSV4_CUDA_AQ_FUSE without bit 4 keeps SCL 2 (A/B). */
static int w_bf16_exact(const dweight &w) {
    return w.e8_bf16 && !w.scale_f32 && (dsv4_cuda_aq_fuse() & DSV4_CUDA_AQ_WOA);
}

/* k_gemv8x takes what gemv8_launch admits when K / 16 is 256..512 (K 4096..8192; 2 columns a
 * thread, tpr = K / 32) and there are at least two passes per block of the persistent grid
 * (wo_a, wo_b of Flash; the small weights keep k_gemv8's one pass per block).  The kernel
 * also runs K 1024..2048 (tests passed there, 2026-12-01), but on wq_b [32768 x 1024] it took
 * 13.4 us against k_gemv8's 12.6: there k_gemv8 reads only as many x bytes as weight bytes.
 * RPP = G8X_RPP, cut to divide the group size and o0.  0: not taken. */
static int gemv8x_launch(const lin_args &a, int nsm, cudaStream_t st) {
    int64_t cv = a.w.cols / 16;
    if (cv < 256 || cv > 512) return 0;
    int tpr = (int)(cv / 2), rpp = G8X_RPP;
    while (rpp > 1 && (a.gR % rpp || a.o0 % rpp)) rpp /= 2;
    int64_t per = (int64_t)(256 / tpr) * rpp, np = (a.no + per - 1) / per, grid = (int64_t)nsm * G8X_BPS;
    if (np < 2 * grid || np > (1 << 30) || (a.x_bf16 && !a.w_bf16)) return 0;
    if (a.x_bf16 && w_bf16_exact(a.w)) gemv8x_rpp<0, 1>(a, rpp, ilog2(tpr), (int)np, (int)grid, st);
    else if (a.x_bf16) gemv8x_rpp<2, 1>(a, rpp, ilog2(tpr), (int)np, (int)grid, st);
    else if (a.w_bf16 && w_bf16_exact(a.w)) gemv8x_rpp<0, 0>(a, rpp, ilog2(tpr), (int)np, (int)grid, st);
    else if (a.w_bf16) gemv8x_rpp<2, 0>(a, rpp, ilog2(tpr), (int)np, (int)grid, st);
    else if (a.w.scale_f32) gemv8x_rpp<1, 0>(a, rpp, ilog2(tpr), (int)np, (int)grid, st);
    else gemv8x_rpp<0, 0>(a, rpp, ilog2(tpr), (int)np, (int)grid, st);
    return 1;
}

/* k_gemv8 takes FP8 at one row when K / 16 is a power of two in 32..1024 and the block a
 * power of two >= 16 (0: not taken); k_gemv8x first, where it takes the weight.  tpr: 32,
 * doubled while CPT > 4; RPP = 8 / CPT (<= 4), cut to divide the group size and o0; then,
 * while that leaves fewer than two passes per SM (small weights: wq_a, wkv, indexer wq_b),
 * tpr is doubled and then RPP halved (more blocks, less serial math per thread; wq_a
 * [1024 x 4096] gets k_gemv's geometry, 256 threads a row and 2 rows a pass, where halving
 * RPP first left it slower than k_gemv). */
/* (gemv8_geometry: that choice of tpr, CPT and RPP, 0 where k_gemv8 / k_gemv8x cannot take the
 * weight; matmul_rn's fused kernel takes exactly the geometry it picks) */
static int gemv8_geometry(const lin_args &a, int nsm, int *tpr_out, int *cpt_out, int *rpp_out) {
    const dweight &w = a.w;
    if (w.fmt != DSV4_WF_FP8 || a.rows != 1 || nsm <= 0 || gemv8_old() == 1) return 0;
    int64_t K = w.cols, cv = K / 16;
    if (K % 16 || cv < 32 || cv > 1024 || (cv & (cv - 1))) return 0;
    if (w.block < 16 || (w.block & (w.block - 1)) || K % w.block || a.no >= ((int64_t)1 << 31) ||
        a.gR >= ((int64_t)1 << 31))
        return 0;
    int tpr = 32;
    while (cv / tpr > 4) tpr *= 2;
    if (tpr > 256) return 0;
    int cpt = (int)(cv / tpr), rpp = 8 / cpt > 4 ? 4 : 8 / cpt;
    while (rpp > 1 && (a.gR % rpp || a.o0 % rpp)) rpp /= 2;
    for (;;) {
        int64_t per = (int64_t)(256 / tpr) * rpp;
        if ((a.no + per - 1) / per >= 2 * (int64_t)nsm) break;
        if (tpr < 256 && cpt > 1) tpr *= 2, cpt /= 2;
        else if (rpp > 1) rpp /= 2;
        else break;
    }
    *tpr_out = tpr, *cpt_out = cpt, *rpp_out = rpp;
    return 1;
}

static int gemv8_launch(const lin_args &a, int nsm, cudaStream_t st) {
    const dweight &w = a.w;
    int tpr, cpt, rpp;
    if (!gemv8_geometry(a, nsm, &tpr, &cpt, &rpp)) return 0;
    if (gemv8_old() != 2 && gemv8x_launch(a, nsm, st)) return 1;
    int64_t per = (int64_t)(256 / tpr) * rpp, np = (a.no + per - 1) / per;
    if (np > (1 << 30) || a.x_bf16) return 0; /* x_bf16: k_gemv8x only */
    gemv8_geom g = {ilog2(tpr), (int)np, ilog2(w.block), w.scale_f32};
    if (a.w_bf16 && w_bf16_exact(w)) gemv8_cr<0>(a, cpt, rpp, g, st);
    else if (a.w_bf16) gemv8_cr<2>(a, cpt, rpp, g, st);
    else if (w.scale_f32) gemv8_cr<1>(a, cpt, rpp, g, st);
    else gemv8_cr<0>(a, cpt, rpp, g, st);
    return 1;
}

/* ----- k_gemvn: the decode GEMV of 2..8 rows a launch (batched decode) ----- */

/* k_gemvn<NR, FMT, RPP>: out[r][o] = sum_k W[o0+o][k] x[r][g(o)*xg + k] for rows <= NR (2, 4
 * or 8; the launcher walks larger batches in chunks of 8 rows), FP8 (e8m0 or f32 block
 * scales) or bf16 weights, K a multiple of 128; the contract of k_linear.
 * Why: at 8 rows exact fp32 FMA is ~8 FMAs per FP8 byte, near the H200's FMA/byte balance
 * (~33 TFMA/s against ~4.3 TB/s), so a weight is decoded once and used for all NR rows, and
 * a lane's x loads are contiguous across the warp (k_gemv / k_gemv8 read 16 columns a lane,
 * so a warp's float4 loads of x touch 16 lines each: at 8 rows that L1 traffic, not the
 * FMAs, would bound the kernel).
 * Geometry: a warp takes RPP (4 by default, or 8) consecutive output rows (a "group" of rows;
 * RPP divides the group size gR and the scale block, so the rows share one x group and one
 * scale row) and
 * walks K in steps of 128 columns, lane l the 4 columns 4l..4l+3 of each step: one 4-byte
 * (FP8) or 8-byte (bf16) weight load per row and step (128 / 256 contiguous bytes a warp),
 * one float4 of x per input row and step (512 contiguous bytes a warp), used for RPP rows.
 * kw = 1..8 warps of a block split one group's steps (warp sub takes steps sub, sub + kw, ...;
 * their sums meet in shared memory, added in warp order), so a block holds 8 / kw groups
 * ("a block group").  Persistent grid (the SMs times the resident blocks): block b takes
 * block groups b, b + grid, ...; each warp runs one flat sequence of (group, step) tasks with
 * a ring of D tasks' weight words and scale words in flight (loads of task t + D issued
 * after task t's math; they cross group boundaries, so a block never drains between groups;
 * the ring moves down a slot per task, so the loop body is one task).
 * Numerics: each weight is decoded exactly and multiplied by its block scale (the CPU's
 * dequantized weight, also for f32 scales; w_bf16 rounds it, as the CPU does), then one fp32
 * FMA per product; a lane sums its steps in order, a warp reduce-scatter (fixed tree) and the
 * kw warps in warp order finish the sum: only the summation order differs from the CPU.
 * The first D tasks' weights are loaded before pdl_enter (weights only). */
enum { GN_STEP = 128 }; /* columns a warp covers per step (4 a lane) */

/* a lane's 4 weights of one row and step: FP8 one word, bf16 two (never reused: no L1) */
template <int FMT>
__device__ __forceinline__ uint2 gn_load(const uint8_t *p) {
    uint2 u;
    if constexpr (FMT == LF_FP8) {
        asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(u.x) : "l"(p));
        u.y = 0;
    } else {
        asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(u.x), "=r"(u.y) : "l"(p));
    }
    return u;
}

/* the 4 weights as the CPU dequantizes them: FP8 code value * block scale s (bf16-rounded
 * with w_bf16), bf16 by placement */
template <int FMT>
__device__ __forceinline__ float4 gn_dec(uint2 u, float s, int w_bf16) {
    float4 f;
    if constexpr (FMT == LF_FP8) {
        float2 a = d_e4m3x2_to_f32x2((uint16_t)u.x), b = d_e4m3x2_to_f32x2((uint16_t)(u.x >> 16));
        f = make_float4(a.x * s, a.y * s, b.x * s, b.y * s);
        if (w_bf16) f.x = d_round_bf16(f.x), f.y = d_round_bf16(f.y), f.z = d_round_bf16(f.z), f.w = d_round_bf16(f.w);
    } else { /* a bf16 value rounds to itself: w_bf16 changes nothing */
        f = make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                        __uint_as_float(u.y & 0xffff0000u));
    }
    return f;
}

/* warp_reduce_scatter's stages with the half count a template constant (at 16 and 32 sums the
 * loop form left the sums in local memory: a stack frame in ptxas -v); the same adds in the
 * same order */
template <int N, int ST>
__device__ __forceinline__ void gn_rs_stages(float (&v)[N], int lane) {
    if constexpr (ST < ilog2(N)) {
        constexpr int h = N >> (ST + 1), s = 16 >> ST;
        const int up = lane & s;
#pragma unroll
        for (int i = 0; i < h; i++) {
            float send = up ? v[i] : v[i + h], keep = up ? v[i + h] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, s);
        }
        gn_rs_stages<N, ST + 1>(v, lane);
    }
}
template <int N>
__device__ __forceinline__ float gn_reduce_scatter(float (&v)[N], int lane) {
    gn_rs_stages<N, 0>(v, lane);
    float r = v[0];
#pragma unroll
    for (int s = 16 >> ilog2(N); s >= 1; s >>= 1) r += __shfl_xor_sync(0xffffffffu, r, s);
    return r;
}

/* a warp's position in its (group, step) task sequence */
struct gn_cur {
    int64_t bg; /* block group */
    int s;      /* step index within the warp's steps (0 .. spw - 1) */
};

template <int NR, int FMT, int RPP>
__global__ void __launch_bounds__(256, RPP * NR >= 64 ? 1 : 2)
    k_gemvn(float *out, int64_t ldo, const float *__restrict__ x, int64_t ldx, int rows,
            const uint8_t *__restrict__ wd, const uint8_t *__restrict__ ws, int K, int sf32, int blk_log2, int64_t o0,
            int64_t no, int64_t gR, int64_t xg, int w_bf16, int out_bf16, int kw_log2, int64_t nbg) {
    constexpr int N = RPP * NR, WB = FMT == LF_FP8 ? 1 : 2, D = FMT == LF_FP8 ? 4 : 2;
    constexpr int M = N > 32 ? 32 : N, H = N / M, PER = 32 / M; /* reduce-scatter pieces */
    __shared__ float red[2][8][N];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, kw = 1 << kw_log2;
    const int grp = wib >> kw_log2, sub = wib & (kw - 1), gpb = 8 >> kw_log2;
    const int spw = (K / GN_STEP) >> kw_log2; /* steps per warp and group (the launcher: kw divides) */
    const int64_t rowb = (int64_t)K * WB;
    const int scols = FMT == LF_FP8 ? K >> blk_log2 : 0;
    const int64_t tasks = (nbg - blockIdx.x + gridDim.x - 1) / gridDim.x * spw; /* block-uniform */
    uint2 buf[D][RPP];
    uint32_t sbuf[D];
    gn_cur ld = {blockIdx.x, 0}, cu = ld;
    /* the weights and scale word of the task at cursor c (nothing when its rows are past the end) */
    auto load = [&](uint2(&b)[RPP], uint32_t &sw, const gn_cur &c) {
        const int64_t rb = (c.bg * gpb + grp) * RPP;
        if (rb >= no) return;
        const int k = ((c.s << kw_log2) + sub) * GN_STEP + 4 * lane;
        const uint8_t *p = wd + (o0 + rb) * rowb + (int64_t)k * WB;
#pragma unroll
        for (int j = 0; j < RPP; j++) /* rows past the end re-read the last row (never written) */
            b[j] = gn_load<FMT>(p + (rb + j < no ? j : no - 1 - rb) * rowb);
        if constexpr (FMT == LF_FP8) {
            const int64_t si = ((o0 + rb) >> blk_log2) * scols + (k >> blk_log2);
            sw = sf32 ? __ldg((const unsigned int *)ws + si) : (uint32_t)__ldg(ws + si);
        }
    };
    auto next = [&](gn_cur &c) {
        if (++c.s == spw) c.s = 0, c.bg += gridDim.x;
    };
#pragma unroll
    for (int d = 0; d < D; d++) {
        sbuf[d] = 0;
        if (d < tasks) load(buf[d], sbuf[d], ld), next(ld);
    }
    pdl_enter(); /* the first tasks' weights are in flight while the previous kernel ends */
    float acc[N];
    const float *xw = x;
    int rbuf = 0;
    for (int64_t t = 0; t < tasks; t++) { /* slot 0 of the ring holds task t's weights */
        const int64_t rb = (cu.bg * gpb + grp) * RPP;
        if (cu.s == 0) { /* a new group: its x rows, fresh sums */
#pragma unroll
            for (int n = 0; n < N; n++) acc[n] = 0.0f;
            xw = x + (xg && rb < no ? (int64_t)((uint64_t)rb / (uint64_t)gR) * xg : 0) + 4 * lane;
        }
        if (rb < no) {
            const int k = ((cu.s << kw_log2) + sub) * GN_STEP;
            /* rows past `rows` (3 of 4, 5..7 of 8) repeat the last row: no branch between the
             * FMAs (a guard per row and weight row split the FMA chains into basic blocks
             * that ran one after another: 4.95 cycles per issued instruction, ncu), their
             * sums are never written */
            float4 xv[NR];
#pragma unroll
            for (int r = 0; r < NR; r++)
                xv[r] = __ldg((const float4 *)(xw + (int64_t)(r < rows ? r : rows - 1) * ldx + k));
            float sc = 1.0f;
            if constexpr (FMT == LF_FP8) sc = sf32 ? __uint_as_float(sbuf[0]) : d_e8m0_to_f32((uint8_t)sbuf[0]);
#pragma unroll
            for (int j = 0; j < RPP; j++) {
                const float4 wf = gn_dec<FMT>(buf[0][j], sc, w_bf16);
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    float a = acc[j * NR + r];
                    a = fmaf(wf.x, xv[r].x, a);
                    a = fmaf(wf.y, xv[r].y, a);
                    a = fmaf(wf.z, xv[r].z, a);
                    acc[j * NR + r] = fmaf(wf.w, xv[r].w, a);
                }
            }
        }
        /* the ring moves down one slot (register moves: one copy of this body instead of D
         * unrolled ones, whose size stalled the warps on instruction fetch, ncu), task t + D
         * into the last slot */
#pragma unroll
        for (int d = 0; d + 1 < D; d++) {
#pragma unroll
            for (int j = 0; j < RPP; j++) buf[d][j] = buf[d + 1][j];
            sbuf[d] = sbuf[d + 1];
        }
        if (t + D < tasks) load(buf[D - 1], sbuf[D - 1], ld), next(ld);
        if (cu.s == spw - 1) { /* the group's last step: sums out */
            float sum[H];
#pragma unroll
            for (int h = 0; h < H; h++) {
                float v[M];
#pragma unroll
                for (int i = 0; i < M; i++) v[i] = acc[h * M + i];
                sum[h] = gn_reduce_scatter<M>(v, lane);
            }
            if (kw == 1) {
                if (lane % PER == 0)
#pragma unroll
                    for (int h = 0; h < H; h++) {
                        const int id = h * M + lane / PER, r = id % NR;
                        const int64_t o = rb + id / NR;
                        if (o < no && r < rows) out[(int64_t)r * ldo + o] = out_bf16 ? d_round_bf16(sum[h]) : sum[h];
                    }
            } else { /* the group's kw warps meet in shared memory, added in warp order */
                if (lane % PER == 0)
#pragma unroll
                    for (int h = 0; h < H; h++) red[rbuf][wib][h * M + lane / PER] = sum[h];
                __syncthreads();
                const int tt = threadIdx.x;
                if (tt < gpb * N) {
                    const int g = tt / N, id = tt % N, r = id % NR;
                    float v = red[rbuf][g * kw][id];
                    for (int q = 1; q < kw; q++) v += red[rbuf][g * kw + q][id];
                    const int64_t o = (cu.bg * gpb + g) * RPP + id / NR;
                    if (o < no && r < rows) out[(int64_t)r * ldo + o] = out_bf16 ? d_round_bf16(v) : v;
                }
                rbuf ^= 1;
            }
        }
        next(cu);
    }
}

/* DSV4_CUDA_BGEMV (A/B, read once): 0 = 2..32 rows on the paths before k_gemvn (k_gemv at 2
 * rows, k_linear from 3); 4 or 8 = k_gemvn with that many rows a warp; else (default) k_gemvn
 * with RPP 4 (H200, 2-layer Flash synth, batch 8 and 32: RPP 4 faster than 8, docs/CUDA.md) */
static int bgemv_mode(void) {
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("DSV4_CUDA_BGEMV");
        v = e && (e[0] == '0' || e[0] == '4' || e[0] == '8') && !e[1] ? e[0] - '0' : 4;
    }
    return v;
}

template <int NR, int FMT, int RPP>
static void gemvn_go(const lin_args &a, int kw_log2, int64_t nbg, int grid, cudaStream_t st) {
    dsv4_launch(k_gemvn<NR, FMT, RPP>, grid, 256, 0, st, a.out, a.ldo, a.x, a.ldx, a.rows, a.w.data, a.w.scale,
                (int)a.w.cols, a.w.scale_f32, FMT == LF_FP8 ? ilog2(a.w.block) : 0, a.o0, a.no, a.gR, a.xg, a.w_bf16,
                a.out_bf16, kw_log2, nbg);
}

template <int FMT, int RPP>
static void gemvn_nr(const lin_args &a, int kw_log2, int64_t nbg, int grid, cudaStream_t st) {
    if (a.rows <= 2) gemvn_go<2, FMT, RPP>(a, kw_log2, nbg, grid, st);
    else if (a.rows <= 4) gemvn_go<4, FMT, RPP>(a, kw_log2, nbg, grid, st);
    else gemvn_go<8, FMT, RPP>(a, kw_log2, nbg, grid, st);
}

/* k_gemvn takes 2..8 rows of FP8 (power-of-two block >= RPP, K a multiple of it) or bf16
 * weights when K is a multiple of 128 (0: not taken).  RPP: DSV4_CUDA_BGEMV (4 by default),
 * cut to divide the group size and o0.  Blocks per SM: 1 when a lane holds 64 sums (RPP x
 * rows), else 2 (the launch bounds); the grid is the SMs times that.  kw (warps per group) is
 * doubled from 1 while the block groups are fewer than two per block of the grid and each
 * warp keeps at least two steps (wo_b [4096 x 8192] at 8 rows, RPP 8: kw 8). */
static int gemvn_launch(const lin_args &a, int nsm, cudaStream_t st) {
    const dweight &w = a.w;
    int mode = bgemv_mode();
    if (mode == 0 || a.rows < 2 || a.rows > 8 || nsm <= 0) return 0;
    if (w.fmt != DSV4_WF_FP8 && w.fmt != DSV4_WF_BF16) return 0;
    int64_t K = w.cols;
    if (K % GN_STEP || K > ((int64_t)1 << 24) || a.no >= ((int64_t)1 << 31) || a.o0 + a.no >= ((int64_t)1 << 31))
        return 0;
    int rpp = mode;
    while (rpp > 1 && ((a.xg && a.gR % rpp) || a.o0 % rpp)) rpp /= 2;
    if (rpp < 4) return 0;
    if (w.fmt == DSV4_WF_FP8 && (w.block < rpp || w.block < 4 || (w.block & (w.block - 1)) || K % w.block))
        return 0;
    int nr = a.rows <= 2 ? 2 : a.rows <= 4 ? 4 : 8, bps = rpp * nr >= 64 ? 1 : 2;
    int64_t grid = (int64_t)nsm * bps, groups = (a.no + rpp - 1) / rpp, nsteps = K / GN_STEP;
    int kwl = 0;
    while (kwl < 3 && (groups + (8 >> kwl) - 1) / (8 >> kwl) < 2 * grid && nsteps % (2 << kwl) == 0 &&
           nsteps / (2 << kwl) >= 2)
        kwl++;
    int64_t nbg = (groups + (8 >> kwl) - 1) / (8 >> kwl);
    if (grid > nbg) grid = nbg;
    if (w.fmt == DSV4_WF_FP8) {
        if (rpp == 8) gemvn_nr<LF_FP8, 8>(a, kwl, nbg, (int)grid, st);
        else gemvn_nr<LF_FP8, 4>(a, kwl, nbg, (int)grid, st);
    } else {
        if (rpp == 8) gemvn_nr<LF_BF16, 8>(a, kwl, nbg, (int)grid, st);
        else gemvn_nr<LF_BF16, 4>(a, kwl, nbg, (int)grid, st);
    }
    return 1;
}

void dsv4_cuda_linear_grouped(dsv4_backend *b, float *out_d, int64_t ldo, const float *x_d, int64_t ldx, int rows,
                              const dweight &w, int64_t o0, int64_t no, int64_t gR, int64_t xg, int w_bf16,
                              int out_bf16) {
    cuda_impl *c = CI(b);
    if (c->failed || rows <= 0 || no <= 0) return;
    if (gR <= 0) gR = no;
    int64_t K = w.cols;
    int vec = K % 32 == 0 && ldx % 4 == 0 && xg % 4 == 0 && ((uintptr_t)x_d & 15) == 0 &&
              (w.fmt == DSV4_WF_F32 || w.fmt == DSV4_WF_BF16 || w.fmt == DSV4_WF_FP8 || w.fmt == DSV4_WF_MXFP4 ||
               w.fmt == DSV4_WF_NVFP4);
    if (w.fmt == DSV4_WF_FP8 && (w.block % 16 || K % w.block)) vec = 0;
    /* a warp's OPW (<= 4) features must lie in one group: other group sizes go element-wise */
    if (gR != no && gR % 4) vec = 0;
    /* Enough warps for the SMs (132 x up to 64): features are taken OPW at a time by a warp;
     * when that gives fewer than ~4K warps, kw = 2, 4 or 8 warps of a block split one group's
     * K span (summed in shared memory, in warp order) while each still has a whole step
     * (32 16-byte vectors) to load.  Only when that is still short of ~1K warps and K is long
     * (tall thin weights) does K also split over grid.y, summed by k_splitk_sum in split
     * order. */
    int opw0 = rows <= 2 ? 4 : 2;
    int64_t vn = w.fmt == DSV4_WF_F32 ? 4 : w.fmt == DSV4_WF_BF16 ? 8 : w.fmt == DSV4_WF_FP8 ? 16 : 32;
    int64_t steps = (K + 32 * vn - 1) / (32 * vn), fgroups = (no + opw0 - 1) / opw0;
    int kw = 1;
    while (vec && kw < 8 && fgroups * kw < 4096 && steps >= 2 * kw) kw *= 2;
    int splits = 1;
    int64_t kspan = K;
    int64_t warps = fgroups * kw;
    if (vec && warps < 1024 && K / kw >= 4096) {
        int64_t want = (1024 + warps - 1) / warps, most = K / (1024 * kw);
        splits = (int)(want < most ? want : most);
        if (splits < 1) splits = 1;
        kspan = ((K + splits - 1) / splits + 1023) / 1024 * 1024;
        splits = (int)((K + kspan - 1) / kspan);
    }
    int nsm = vec ? c->nsm : 0; /* the GEMVs' pass counts and persistent grids are cut to the SMs */
    float *part = NULL;
    if (splits > 1 && !(part = (float *)dsv4_cuda_scratch(b, sizeof(float) * splits * (rows < 8 ? rows : 8) * no)))
        return;
    for (int r0 = 0; r0 < rows; r0 += 8) {
        int nr = rows - r0 < 8 ? rows - r0 : 8;
        lin_args a = {out_d + (int64_t)r0 * ldo, ldo, x_d + (int64_t)r0 * ldx, ldx, nr, w, o0, no, gR, xg, w_bf16,
                      out_bf16, kspan, part, kw, 0};
        if (!vec) {
            dim3 grid((unsigned)((no * 32 + 255) / 256));
            if (nr == 1)
                dsv4_launch(k_linear_any<1>, grid, 256, 0, c->stream, a.out, ldo, a.x, ldx, nr, w, o0, no, gR, xg,
                            w_bf16, out_bf16);
            else
                dsv4_launch(k_linear_any<8>, grid, 256, 0, c->stream, a.out, ldo, a.x, ldx, nr, w, o0, no, gR, xg,
                            w_bf16, out_bf16);
        } else if (gemvn_launch(a, nsm, c->stream) ||
                   (nr <= 2 && (gemv8_launch(a, nsm, c->stream) || gemv_launch(a, nsm, c->stream)))) {
            if (CKL(b)) return;
            c->weight_bytes_read += wbytes_rows(w, no);
            continue;
        } else {
            int opw = nr <= 2 ? 4 : 2, per_block = 8 / kw;
            int64_t fg = (no + opw - 1) / opw;
            dim3 grid((unsigned)((fg + per_block - 1) / per_block), (unsigned)splits);
            if (nr == 1) launch_vec<1, 4>(a, grid, c->stream);
            else if (nr == 2) launch_vec<2, 4>(a, grid, c->stream);
            else if (nr <= 4) launch_vec<4, 2>(a, grid, c->stream);
            else launch_vec<8, 2>(a, grid, c->stream);
        }
        if (CKL(b)) return;
        if (vec && splits > 1) {
            dsv4_launch(k_splitk_sum, (unsigned)((nr * no + 255) / 256), 256, 0, c->stream, a.out, ldo, part, nr, no,
                        splits, out_bf16);
            if (CKL(b)) return;
        }
        c->weight_bytes_read += wbytes_rows(w, no);
    }
}

void dsv4_cuda_linear(dsv4_backend *b, float *out_d, int64_t ldo, const float *x_d, int64_t ldx, int rows,
                      const dweight &w, int64_t o0, int64_t no, int w_bf16, int out_bf16) {
    dsv4_cuda_linear_grouped(b, out_d, ldo, x_d, ldx, rows, w, o0, no, no, 0, w_bf16, out_bf16);
}

/* ----- the reference profile's inputs fused into their consumers (cuda.h dsv4_cuda_aq_fuse) -----
 * Grouped wo_a in the reference profile copied x and ran k_round_bf16 on the copy, a node of its
 * own in the decode graphs; at one row k_gemv8x now rounds its register copy of x as it loads it
 * (gemv_bf16in), and w_bf16_exact (above) spares its per-weight rounding.  matmul_multi quantizes
 * inside k_gemv_multi's staging (gemv_multi.cu), the MoE quantizes h in one launch (moe.cu).
 * Measured (H200, 2026-12-03 ~11:00Z, 20 Flash layers of synth, `--numerics reference`, decode
 * batch 1 at 2K, `ab` medians of 2 rounds, DSV4_CUDA_AQ_FUSE masks): 0 (the separate kernels)
 * 4.335 ms/step, 4 (wo_a only) 3.820, 14 (all three) 3.835; wo_a's factored weights are the
 * gain, the other two measured within the spread.  act_quant inside k_gemv8 / k_gemv8x as well
 * (each block quantizing all of x into shared memory after its PDL wait; commit 9ad3cbe, mask
 * 15 then) was correct and slower, 3.950, and is gone. */
static int aq_fuse_v = -1;
static long aq_fused_n;

extern "C" int dsv4_cuda_aq_fuse(void) {
    if (aq_fuse_v < 0) {
        const char *e = getenv("DSV4_CUDA_AQ_FUSE");
        aq_fuse_v = e && *e ? atoi(e) & DSV4_CUDA_AQ_ALL : DSV4_CUDA_AQ_ALL;
    }
    return aq_fuse_v;
}
extern "C" void dsv4_cuda_set_aq_fuse(int mask) { aq_fuse_v = mask & DSV4_CUDA_AQ_ALL; }
extern "C" long dsv4_cuda_aq_fused_calls(void) { return aq_fused_n; }

/* grouped out = W x for one row with x rounded to bf16 inside k_gemv8x (w_bf16, as grouped wo_a
 * in the reference profile): 1 if launched, 0 if k_gemv8x does not take it (bit 4 off, the
 * format, the shapes: the caller then rounds a copy of x itself) */
static int gemv_bf16in(dsv4_backend *b, float *out_d, const float *x_d, int64_t ldx, const dweight &w, int64_t gR,
                       int64_t xg, int out_bf16) {
    cuda_impl *c = CI(b);
    if (c->failed || w.fmt != DSV4_WF_FP8 || !(dsv4_cuda_aq_fuse() & DSV4_CUDA_AQ_WOA)) return 0;
    int64_t K = w.cols, no = w.rows;
    if (gR <= 0) gR = no;
    if (K % 32 || ldx % 4 || xg % 4 || ((uintptr_t)x_d & 15) || w.block % 16 || K % w.block || (gR != no && gR % 4))
        return 0;
    lin_args a = {out_d, no, x_d, ldx, 1, w, 0, no, gR, xg, 1, out_bf16, K, NULL, 1, 1};
    if (!gemv8_launch(a, c->nsm, c->stream)) return 0;
    if (!CKL(b)) c->weight_bytes_read += wbytes_rows(w, no), aq_fused_n++;
    return 1;
}

/* ----- act_quant / fp8_sim (spec §2.0): one warp per (row, block) ----- */
__global__ void k_act_quant(float *out, const float *x, int rows, int64_t K, int block) {
    pdl_enter();
    int64_t nb = (K + block - 1) / block;
    int64_t wid = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (wid >= rows * nb) return;
    int64_t r = wid / nb, b0 = (wid % nb) * block;
    int64_t len = K - b0 < block ? K - b0 : block;
    const float *xp = x + r * K + b0;
    float *op = out + r * K + b0;
    float amax = 0.0f;
    int bad = 0;
    for (int64_t i = lane; i < len; i += 32) {
        float a = fabsf(xp[i]);
        bad |= !(a <= 3.40282347e38f);
        amax = fmaxf(amax, a);
    }
    amax = warp_max(amax);
    bad = __any_sync(0xffffffffu, bad);
    if (bad) {
        for (int64_t i = lane; i < len; i += 32) op[i] = __uint_as_float(0x7fc00000u);
        return;
    }
    if (amax < 1e-4f) amax = 1e-4f;
    float s = d_pow2_ceil(amax * (1.0f / 448.0f));
    float inv = 1.0f / s;
    for (int64_t i = lane; i < len; i += 32) op[i] = d_e4m3_to_f32(d_f32_to_e4m3(xp[i] * inv)) * s;
}

void dsv4_cuda_act_quant(dsv4_backend *b, float *out_d, const float *x_d, int rows, int64_t K, int block) {
    if (CI(b)->failed || rows <= 0) return;
    int64_t warps = rows * ((K + block - 1) / block);
    dsv4_launch(k_act_quant, (unsigned)((warps * 32 + 255) / 256), 256, 0, CI(b)->stream, out_d, x_d, rows, K, block);
    CKL(b);
}

__global__ void k_round_bf16(float *x, size_t n) {
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = d_round_bf16(x[i]);
}

void dsv4_cuda_round_bf16(dsv4_backend *b, float *x_d, size_t n) {
    if (CI(b)->failed || !n) return;
    dsv4_launch(k_round_bf16, (unsigned)((n + 255) / 256), 256, 0, CI(b)->stream, x_d, n);
    CKL(b);
}

static int quantized(int fmt) { return fmt == DSV4_WF_FP8 || fmt == DSV4_WF_MXFP4 || fmt == DSV4_WF_NVFP4; }

/* ----- ops ----- */
/* cu_matmul's launches on device rows xd -> od (xd is not written: act_quant goes to scratch) */
static void matmul_dev(dsv4_backend *b, float *od, float *xd, int rows, const dsv4_weight *w, const dweight &dw,
                       int flags, int out_bf16) {
    size_t xin = (size_t)rows * w->cols;
    if ((flags & DSV4_LIN_ACT_FP8) && quantized(w->fmt)) { /* into scratch: the caller's input stays as it is */
        float *xq = (float *)dsv4_cuda_scratch(b, sizeof(float) * xin);
        if (!xq) return;
        dsv4_cuda_act_quant(b, xq, xd, rows, w->cols, 128);
        xd = xq;
    }
    /* linear.dot=mma: one row on the tensor cores where k_gemv_mma takes the weight (gemv_mma.cu) */
    if (rows == 1 && (flags & DSV4_LIN_DOT_MMA) && dsv4_cuda_gemv_mma(b, od, xd, dw, 0, 0, 0, 0, out_bf16)) {
        if (!CI(b)->failed) CI(b)->weight_bytes_read += wbytes_rows(dw, dw.rows);
    } else {
        dsv4_cuda_linear(b, od, w->rows, xd, w->cols, rows, dw, 0, w->rows, 0, out_bf16);
    }
}

void cu_matmul(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int flags,
               int out_bf16) {
    dsv4_cuda_op_begin(b);
    dweight dw;
    if (dsv4_cuda_weight(b, w, &dw)) return;
    size_t xin = (size_t)rows * w->cols, xout = (size_t)rows * w->rows;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * xin);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * xout);
    if (!xd || !od) return;
    matmul_dev(b, od, xd, rows, w, dw, flags, out_bf16);
    dsv4_cuda_commit(b, out, od, sizeof(float) * xout);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_MATMUL);
}

/* ----- matmul_rn (backend.h): qa's norm inside wq_b (docs/CUDA.md) -----
 * One row of an FP8 weight of 1024 columns with e8m0 scales, no flags, where k_gemv8 would take
 * it with a warp a row, CPT 2 and RPP 4 (Flash's wq_b): k_gemv8n.  Else rmsnorm into scratch,
 * then matmul: the same bits by either path (DSV4_CUDA_QA_FUSE=0 takes the op out, backend.cu). */
/* 1 where k_gemv8n takes the weight (one row, x aligned): the geometry k_gemv8 would pick is its own */
static int gemv8_rn_ok(int nsm, const dweight &w) {
    if (w.fmt != DSV4_WF_FP8 || w.cols != 1024 || w.scale_f32 || gemv8_old()) return 0;
    lin_args a = {NULL, w.rows, NULL, w.cols, 1, w, 0, w.rows, w.rows, 0, 0, 0, w.cols, NULL, 1, 0};
    int tpr, cpt, rpp;
    return gemv8_geometry(a, nsm, &tpr, &cpt, &rpp) && tpr == 32 && cpt == 2 && rpp == 4 &&
           (w.rows + 31) / 32 <= (1 << 30);
}

static int gemv8_rn(dsv4_backend *b, float *od, const float *xd, const dweight &w, int out_bf16, const g8_rn &rn) {
    cuda_impl *c = CI(b);
    if (((uintptr_t)xd & 15) || !gemv8_rn_ok(c->nsm, w)) return 0;
    int64_t np = (w.rows + 31) / 32; /* 8 slots of RPP 4 rows a pass */
    dsv4_launch(k_gemv8n<2, 4>, (unsigned)np, 256, 0, c->stream, od, xd, w.data, w.scale, ilog2(w.block), w.rows,
                out_bf16, 5, (int)np, rn);
    if (!CKL(b)) c->weight_bytes_read += wbytes_rows(w, w.rows);
    return 1;
}

int cu_matmul_rn_takes(dsv4_backend *b, const dsv4_weight *w, int rows, int flags) {
    if (rows != 1 || flags || CI(b)->failed) return 0;
    dweight dw; /* the shape only (no upload here: the op maps the weight) */
    memset(&dw, 0, sizeof dw);
    dw.fmt = w->fmt, dw.rows = w->rows, dw.cols = w->cols, dw.scale_f32 = w->scale_f32;
    dw.block = w->block > 0 ? w->block : 128;
    return gemv8_rn_ok(CI(b)->nsm, dw);
}

void dsv4_cuda_rn_counts(dsv4_backend *b, long *fused, long *alone) {
    *fused = CI(b)->rn_fused, *alone = CI(b)->rn_alone;
}

void cu_matmul_rn(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int flags,
                  int out_bf16, const dsv4_weight *norm_w, float eps, int norm_bf16) {
    cuda_impl *c = CI(b);
    dsv4_cuda_op_begin(b);
    dweight dw, nd;
    memset(&nd, 0, sizeof nd);
    if (rows <= 0 || dsv4_cuda_weight(b, w, &dw) || (norm_w && dsv4_cuda_weight(b, norm_w, &nd))) return;
    size_t xin = (size_t)rows * w->cols, xout = (size_t)rows * w->rows;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * xin);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * xout);
    if (!xd || !od) return;
    g8_rn rn = {nd, norm_w != NULL, norm_w ? rmsnorm_vw(norm_w, nd) : 0, norm_bf16, eps};
    if (rows == 1 && !flags && gemv8_rn(b, od, xd, dw, out_bf16, rn)) {
        c->rn_fused++;
    } else {
        float *t = (float *)dsv4_cuda_scratch(b, sizeof(float) * xin);
        if (!t || dsv4_cuda_rmsnorm_dev(b, t, xd, rows, (int)w->cols, norm_w, nd, eps, norm_bf16)) return;
        matmul_dev(b, od, t, rows, w, dw, flags, out_bf16);
        c->rn_alone++;
    }
    if (!c->failed && c->side_state == 0) /* its kernels wait before they let the next launch (common.cuh) */
        c->rn_op = c->op_seq, c->rn_x = xd, c->rn_x_n = sizeof(float) * xin, c->rn_out = od,
        c->rn_out_n = sizeof(float) * xout;
    dsv4_cuda_commit(b, out, od, sizeof(float) * xout);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_MATMUL);
}

void cu_matmul_grouped(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int groups,
                       int in_bf16, int out_bf16, int flags) {
    dsv4_cuda_op_begin(b);
    dweight dw;
    if (dsv4_cuda_weight(b, w, &dw)) return;
    int64_t R = w->rows / groups, C = w->cols;
    size_t xin = (size_t)rows * groups * C, xout = (size_t)rows * w->rows;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * xin);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * xout);
    if (!xd || !od) return;
    /* linear.dot=mma: one row on the tensor cores (x's bf16 rounding inside, w_bf16 only where exact) */
    if (rows == 1 && (flags & DSV4_LIN_DOT_MMA) &&
        dsv4_cuda_gemv_mma(b, od, xd, dw, R, C, in_bf16, in_bf16, out_bf16)) {
        if (!CI(b)->failed) CI(b)->weight_bytes_read += wbytes_rows(dw, dw.rows);
        dsv4_cuda_commit(b, out, od, sizeof(float) * xout);
        dsv4_cuda_op_end(b, DSV4_CUDA_OP_MATMUL_GROUPED);
        return;
    }
    /* one row: the rounding inside k_gemv8x (gemv_bf16in), where it takes the weight */
    if (in_bf16 && rows == 1 && gemv_bf16in(b, od, xd, groups * C, dw, R, C, out_bf16)) {
        dsv4_cuda_commit(b, out, od, sizeof(float) * xout);
        dsv4_cuda_op_end(b, DSV4_CUDA_OP_MATMUL_GROUPED);
        return;
    }
    if (in_bf16) { /* rounded copy in scratch */
        float *xb = (float *)dsv4_cuda_scratch(b, sizeof(float) * xin);
        dsv4_cuda_seg_note(b, DSV4_SEG_COPY);
        if (!xb || CK(b, cudaMemcpyAsync(xb, xd, sizeof(float) * xin, cudaMemcpyDeviceToDevice, CI(b)->stream)))
            return;
        dsv4_cuda_round_bf16(b, xb, xin);
        xd = xb;
    }
    /* many rows (prefill): the SGEMM, group by group (gemm.cu); else one GEMV launch over every
     * group: feature g*R + j reads x columns g*C .. g*C + C - 1 */
    if (dsv4_cuda_gemm_grouped(b, od, xd, rows, w, groups, in_bf16, out_bf16)) {
        dsv4_cuda_commit(b, out, od, sizeof(float) * xout);
        dsv4_cuda_op_end(b, DSV4_CUDA_OP_MATMUL_GROUPED);
        return;
    }
    dsv4_cuda_linear_grouped(b, od, w->rows, xd, groups * C, rows, dw, 0, w->rows, R, C, in_bf16, out_bf16);
    dsv4_cuda_commit(b, out, od, sizeof(float) * xout);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_MATMUL_GROUPED);
}

__global__ void k_embed(float *out, const int32_t *tok, int rows, dweight w) {
    pdl_enter();
    int r = blockIdx.y;
    int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows && c < w.cols) out[(int64_t)r * w.cols + c] = d_weight_at(w, tok[r], c);
}

/* tokens in host memory are staged; in device memory (dsv4_forward_greedy: the previous step's
 * argmax) read in place */
void cu_embed(dsv4_backend *b, float *out, const int32_t *tokens, int rows, const dsv4_weight *w) {
    dsv4_cuda_op_begin(b);
    dweight dw;
    if (rows <= 0 || dsv4_cuda_weight(b, w, &dw)) return;
    int32_t *td = (int32_t *)dsv4_cuda_in(b, tokens, sizeof(int32_t) * rows);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * rows * w->cols);
    if (!td || !od) return;
    dsv4_launch(k_embed, dim3((unsigned)((w->cols + 255) / 256), rows), 256, 0, CI(b)->stream, od, td, rows, dw);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, out, od, sizeof(float) * rows * w->cols);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_EMBED);
}

/* ----- argmax and gather_ids (backend.h): greedy decoding with the token in device memory -----
 * k_argmax: one block of 1024 threads a row; thread t scans t, t + 1024, ... keeping the first
 * of its largest non-NaN values, then a tree over the threads keeps the larger value, the lower
 * index between equal ones: the host rule (dsv4_argmax_row), so the same index. */
enum { AM_THREADS = 1024 };

__device__ __forceinline__ void am_take(float &bv, int &bi, float v, int i) {
    /* (v, i) replaces (bv, bi): none yet, a larger value, or an equal one at a lower index */
    if (i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi))) bv = v, bi = i;
}

__global__ void __launch_bounds__(AM_THREADS) k_argmax(int32_t *out, const float *x, int n) {
    pdl_enter();
    __shared__ float sv[AM_THREADS / 32];
    __shared__ int si[AM_THREADS / 32];
    const float *row = x + (int64_t)blockIdx.x * n;
    float bv = 0.0f;
    int bi = -1;
    for (int i = threadIdx.x; i < n; i += AM_THREADS) {
        float v = row[i];
        if (v == v && (bi < 0 || v > bv)) bv = v, bi = i;
    }
    for (int o = 16; o; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, bv, o);
        int i = __shfl_xor_sync(0xffffffffu, bi, o);
        am_take(bv, bi, v, i);
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) sv[warp] = bv, si[warp] = bi;
    __syncthreads();
    if (warp == 0) {
        bv = sv[lane], bi = si[lane];
        for (int o = 16; o; o >>= 1) {
            float v = __shfl_xor_sync(0xffffffffu, bv, o);
            int i = __shfl_xor_sync(0xffffffffu, bi, o);
            am_take(bv, bi, v, i);
        }
        if (lane == 0) out[blockIdx.x] = bi < 0 ? 0 : bi;
    }
}

void cu_argmax(dsv4_backend *b, int32_t *out, const float *x, int rows, int n) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || n <= 0) return;
    const float *xd = (const float *)dsv4_cuda_in(b, x, sizeof(float) * (size_t)rows * n);
    int32_t *od = (int32_t *)dsv4_cuda_out(b, out, sizeof(int32_t) * rows);
    if (!xd || !od) return;
    dsv4_launch(k_argmax, dim3((unsigned)rows), AM_THREADS, 0, CI(b)->stream, od, xd, n);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, out, od, sizeof(int32_t) * rows);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_ARGMAX);
}

/* dst[r][j] = table[tok[r]][j]: int64 tables (I64) as their low 32 bits, as the host's cast; a
 * token outside [0, trows) (outside the op's contract) reads row 0, never memory past the table */
template <int I64>
__global__ void k_gather_ids(int32_t *dst, const int32_t *tok, int rows, const void *table, int64_t trows, int k) {
    pdl_enter();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * k) return;
    int64_t t = tok[i / k];
    int64_t at = (t >= 0 && t < trows ? t : 0) * k + i % k;
    dst[i] = I64 ? (int32_t)((const int64_t *)table)[at] : ((const int32_t *)table)[at];
}

void cu_gather_ids(dsv4_backend *b, int32_t *dst, const int32_t *tokens, int rows, const dsv4_weight *w, int k) {
    dsv4_cuda_op_begin(b);
    dweight dw;
    if (rows <= 0 || k <= 0 || dsv4_cuda_weight(b, w, &dw)) return;
    if (w->fmt != DSV4_WF_I64 && w->fmt != DSV4_WF_I32) {
        dsv4_cuda_fail(b, "gather_ids: the table is neither int32 nor int64", __FILE__, __LINE__, cudaErrorInvalidValue);
        return;
    }
    const int32_t *td = (const int32_t *)dsv4_cuda_in(b, tokens, sizeof(int32_t) * rows);
    int32_t *od = (int32_t *)dsv4_cuda_out(b, dst, sizeof(int32_t) * rows * k);
    if (!td || !od) return;
    unsigned blocks = (unsigned)((rows * k + 255) / 256);
    if (w->fmt == DSV4_WF_I64)
        dsv4_launch(k_gather_ids<1>, blocks, 256, 0, CI(b)->stream, od, td, rows, (const void *)dw.data, w->rows, k);
    else
        dsv4_launch(k_gather_ids<0>, blocks, 256, 0, CI(b)->stream, od, td, rows, (const void *)dw.data, w->rows, k);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, dst, od, sizeof(int32_t) * rows * k);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_GATHER_IDS);
}
