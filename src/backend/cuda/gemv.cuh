/* backend/cuda/gemv.cuh: the streaming GEMV of decode batches of 1-2 rows (k_gemv) and its helpers, shared by
 * linear.cu (the matmul op) and moe.cu (the router gate with the route and plan in its last block,
 * gate_route_moe).  Templates only: each file instantiates what it launches. */
#pragma once
#include "backend/cuda/common.cuh"

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

/* k_gemv's end: gemv_no_epi (the matmul op) nothing; moe.cu's gate_epi routes and plans in the grid's last
 * block.  EPI::on is a constant, so the matmul op's instances hold no trace of it. */
struct gemv_no_epi {
    static constexpr bool on = false;
    __device__ void operator()() const {}
};

/* k_gemv<NR, FMT, CPT, RPP, EPI>: out[r][o] = sum_k W[o0+o][k] x[r][g(o)*xg + k] for rows <= NR
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
template <int NR, int FMT, int CPT, int RPP, class EPI = gemv_no_epi>
__global__ void __launch_bounds__(256) k_gemv(float *out, int64_t ldo, const float *__restrict__ x, int64_t ldx,
                                              int rows, dweight w, int64_t o0, int64_t no, int64_t gR, int64_t xg,
                                              int w_bf16, int out_bf16, int tpr_log2, int npass, int early, EPI epi) {
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
    if (EPI::on) epi(); /* every block, every thread: EPI's own barriers */
}

/* the k_gemv instance and grid matmul(out, x, one row, w, no flags) launches where it takes k_gemv with an F32 or
 * bf16 weight (dsv4_cuda_gemv_plan, linear.cu: 0 where it does not): FMT, CPT, RPP, log2 of the threads a
 * weight row, passes (= blocks), and the weight's bytes */
struct gemv_plan {
    int fmt, cpt, rpp, tpr_log2, npass;
    size_t bytes;
};
int dsv4_cuda_gemv_plan(dsv4_backend *b, const dweight &w, const float *x_d, gemv_plan *p);
