/* backend/cuda/mhc.cu: manifold-constrained hyper-connections (spec §2.3, §2.7).
 *
 * hc_pre / hc_head have two phases, in one launch at decode (rows <= HC_FUSED_ROWS) or two:
 *   part  grid (splits, ceil(rows/8)), 512 threads.  Block (s, g) takes columns
 *         [s*kspan, (s+1)*kspan) of rows 8g..8g+7 of X [rows][hc*dim], in tiles of 128
 *         columns: each lane first loads its 16-byte vectors of fn (f32; other formats
 *         element-wise) for outputs m = warp + 16u (u < 2) of the tile, then warp r stages
 *         row r's tile in shared memory (rounded to bf16 when gemm_bf16) and sums its
 *         unrounded squares, then every warp forms its dot products with every staged row.
 *         Partials land in scratch part[row][m][split] (m = nm is the sum of squares).
 *         kspan is a multiple of 128 chosen so that ~264 blocks run (at batch 1, nm = 24,
 *         K = 16384: 128 blocks, each reading 12 KB of fn).
 *   fin   rows r0..r0+nr-1 in one block: warp w sums the partials of (row, m) = w, w+16, ...
 *         (lane-strided in split order, then a warp tree), rsqrt(mean + eps), then one thread
 *         per (row, j) forms pre (and post, and the softmaxed comb rows) in shared memory;
 *         the first warps run the Sinkhorn iterations (hc <= 5: lane e of a group of hc*hc
 *         lanes keeps C[e / hc][e % hc] of one row in a register, gathers its row's, then
 *         its column's, hc values by shuffles issued together and adds them serially in the
 *         CPU's order, then divides: the same arithmetic as the CPU op; larger hc: one warp
 *         per row, thread j normalizes row j and thread k column k in shared memory, same
 *         order) while the other warps form y = sum_j pre_j X_j (j ascending).
 *   Decode at hc 4 with an f32 fn (V4-Flash) takes k_hc_dec (its banner below), the
 *   others this:
 *   Decode (one launch, k_hc_fused): every block runs part; the block that finishes last
 *   (a device counter of this backend's stream, incremented after a __threadfence and put
 *   back to 0 by that last block, so it is 0 between launches and CUDA-graph replays) runs
 *   fin for the group's rows, reading the partials through L2.  Larger batches launch
 *   k_hc_part then k_hc_fin (one block per row: y of many rows wants many SMs).
 *   No float atomics: the split sums have a fixed order, results are deterministic and the
 *   same for both launch shapes.  Differences from the CPU op: the accumulation order of
 *   the mix dot products and the sum of squares (fp32; measured in tests/test_cuda_mhc.c,
 *   tolerance 1e-5), expf, and nvcc's fma contraction, as before this version.
 * Measured on the H200 (tests/test_cuda_mhc DSV4_MHC_BENCH=2 under tools/device/ktrace.c,
 *   Flash shapes, fn evicted from L2 before each call, us per kernel): rows 1: k_hc_fused
 *   11.35, k_hc_dec 8.24 (with fn in L2: 9.45 / 7.18); rows 4: 15.85 / 11.46; hc_head
 *   6.82 / 5.39.  Of k_hc_dec's 8.2 us, 20 Sinkhorn iterations are 1.7 (iters 0: 6.56);
 *   the shortest kernel on the same run (k_scale of one float) took 0.74.
 *   k_hc_dec with POLL against the done counter (same run, 2026-12-01, medians of 30 cold
 *   calls, rows 1 unless said): hc_pre 7.55 / 8.94, iters 0 5.47 / 6.77; hc_pre_norm 7.78 /
 *   9.20, iters 0 7.06 / 8.29; rows 4 11.78 / 12.58; hc_head 4.82 / 6.24; fn in L2: hc_pre
 *   6.53 / 7.81; k_scale 0.77.  In the decode graphs (ktrace, 2-layer Flash synth, prompt
 *   256): 8.00 / 9.42 us per call.  With the norm, y + norm is nearly as long as Sinkhorn
 *   (iters 0 only 0.7 us shorter), so both paths now bound the finisher.
 * hc_pre_norm: hc_pre with y then rmsnormed in the same kernel (weights of dim, eps), the
 *   bits of hc_pre then norm.cu's rmsnorm (k_rmsnorm_vec: dim % 128 == 0, dim <= 4096; else
 *   hc_pre then rmsnorm as two ops): k_hc_dec keeps the last round of y in registers and
 *   sums squares per run of 32 float4s as it forms y, k_hc_fin / k_hc_fused re-read y after
 *   a named barrier among the y warps (hc_norm_rows).  The weights are loaded as raw
 *   bits (8 / 16 bytes) when the last block starts (block 0 prefetches them into L2): loading
 *   them through d_weight_at there made every k_hc_dec 3 us slower (the decode in the format
 *   branch waits for each load).  Measured (H200, ktrace, 2-layer Flash synth, decode at 2K):
 *   k_hc_dec 9.23 -> 9.35 us per call with the norm, for 1.86 us of k_rmsnorm_vec removed.
 * hc_post: one thread per (row, k, 4 adjacent d): post[k] o[d] + sum_j comb[j][k] R[j][d],
 *   j ascending (the scalar kernel's expression, element-wise when dim % 4 != 0).
 * Layout: X [rows][hc*dim] (stream j at j*dim), post [rows][hc], comb [rows][hc*hc].
 * Limits: hc <= 16.  Target: sm_90a.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/common.cuh"

void cu_rmsnorm(dsv4_backend *, float *, const float *, int, int, const dsv4_weight *, float, int); /* norm.cu */

__device__ __forceinline__ float d_sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

enum {
    HC_RB = 8,           /* rows per part block / fin group */
    HC_KT = 128,         /* columns per tile: one warp sweep of 16-byte vectors */
    HC_UO = 2,           /* mix outputs per warp per pass */
    HC_THREADS = 512,
    HC_NMX = 18 * 16,    /* largest nm: (2 + hc) * hc at hc = 16 */
    HC_FUSED_ROWS = 4,   /* up to this many rows, one launch (the last block forms y alone) */
    HC_SLOTS = 32,       /* streams (backends) that can hold a done counter */
};

struct hc_fin_smem {
    float mix[HC_RB][HC_NMX + 1];
    float C[HC_RB][16 * 16];
    float pre[HC_RB][16], pst[HC_RB][16];
    float bs[HC_NMX], sc[3]; /* base and scale, decoded */
    float nss[HC_RB][32];    /* y's norm: sums of squares of runs of 32 float4s */
};

/* thread t's share of base / scale (t < nm, t < 3), loaded at kernel start so that their
 * latency hides under the partial sums */
__device__ __forceinline__ float2 hc_bs_load(const dweight &base, const dweight &scale, int nm) {
    int t = threadIdx.x;
    return make_float2(t < nm ? d_weight_at(base, 0, t) : 0.0f, t < 3 ? d_weight_at(scale, 0, t) : 0.0f);
}

/* ----- part: partial mix dot products and sums of squares of one K-slice for up to 8 rows ----- */
__device__ __forceinline__ void hc_part_block(float *part, const float *__restrict__ X, int r0, int nr, int64_t K,
                                              const dweight &fn, int nm, int64_t kspan, int splits, int s,
                                              int gemm_bf16, float (*xs)[HC_KT]) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int64_t kb = (int64_t)s * kspan, ke = kb + kspan < K ? kb + kspan : K;
    int vx = K % 4 == 0 && ((uintptr_t)X & 15) == 0;
    int vw = vx && fn.fmt == DSV4_WF_F32 && ((uintptr_t)fn.data & 15) == 0;
    int c = lane * 4;
    float ss = 0.0f;
    for (int m0 = 0; m0 < nm; m0 += nw * HC_UO) { /* outputs m0 + warp + nw*u, u < HC_UO */
        float acc[HC_UO][HC_RB];
#pragma unroll
        for (int u = 0; u < HC_UO; u++)
#pragma unroll
            for (int r = 0; r < HC_RB; r++) acc[u][r] = 0.0f;
        for (int64_t t0 = kb; t0 < ke; t0 += HC_KT) {
            int tn = ke - t0 < HC_KT ? (int)(ke - t0) : HC_KT;
            float4 wv[HC_UO]; /* the weights do not depend on X: loaded before the staging */
#pragma unroll
            for (int u = 0; u < HC_UO; u++) {
                int m = m0 + warp + nw * u;
                wv[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (m >= nm || c >= tn) continue;
                int64_t k = t0 + c;
                if (vw) {
                    wv[u] = __ldg((const float4 *)((const float *)fn.data + (int64_t)m * K + k));
                } else {
                    wv[u].x = d_weight_at(fn, m, k);
                    wv[u].y = c + 1 < tn ? d_weight_at(fn, m, k + 1) : 0.0f;
                    wv[u].z = c + 2 < tn ? d_weight_at(fn, m, k + 2) : 0.0f;
                    wv[u].w = c + 3 < tn ? d_weight_at(fn, m, k + 3) : 0.0f;
                }
                if (gemm_bf16) wv[u].x = d_round_bf16(wv[u].x), wv[u].y = d_round_bf16(wv[u].y),
                               wv[u].z = d_round_bf16(wv[u].z), wv[u].w = d_round_bf16(wv[u].w);
            }
            __syncthreads(); /* the previous tile is consumed */
            if (warp < nr) { /* warp r stages row r (zero past the slice) */
                const float *xr = X + (int64_t)(r0 + warp) * K + t0;
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (vx && c < tn) v = __ldg((const float4 *)(xr + c));
                else if (c < tn) {
                    v.x = xr[c];
                    v.y = c + 1 < tn ? xr[c + 1] : 0.0f;
                    v.z = c + 2 < tn ? xr[c + 2] : 0.0f;
                    v.w = c + 3 < tn ? xr[c + 3] : 0.0f;
                }
                if (m0 == 0) ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                if (gemm_bf16) v.x = d_round_bf16(v.x), v.y = d_round_bf16(v.y), v.z = d_round_bf16(v.z),
                               v.w = d_round_bf16(v.w);
                *(float4 *)&xs[warp][c] = v;
            }
            __syncthreads();
            if (c < tn) {
#pragma unroll
                for (int r = 0; r < HC_RB; r++) {
                    if (r >= nr) break;
                    float4 xv = *(const float4 *)&xs[r][c];
#pragma unroll
                    for (int u = 0; u < HC_UO; u++)
                        acc[u][r] += wv[u].x * xv.x + wv[u].y * xv.y + wv[u].z * xv.z + wv[u].w * xv.w;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < HC_UO; u++) {
            int m = m0 + warp + nw * u;
#pragma unroll
            for (int r = 0; r < HC_RB; r++) {
                if (r >= nr) break;
                float v = warp_sum(acc[u][r]);
                if (lane == 0 && m < nm) part[((int64_t)(r0 + r) * (nm + 1) + m) * splits + s] = v;
            }
        }
    }
    if (warp < nr) {
        ss = warp_sum(ss);
        if (lane == 0) part[((int64_t)(r0 + warp) * (nm + 1) + nm) * splits + s] = ss;
    }
}

/* ----- fin ----- */
/* the sum of the HC lanes base + i0 + t*step (t ascending, the CPU's order) of cv: all the
 * shuffles issued before the serial adds */
template <int HC>
__device__ __forceinline__ float hc_lane_sum(float cv, int base, int i0, int step) {
    float v[HC];
#pragma unroll
    for (int t = 0; t < HC; t++) v[t] = __shfl_sync(0xffffffffu, cv, (base + i0 + t * step) & 31);
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < HC; t++) sum += v[t];
    return sum;
}

/* Sinkhorn for hc <= 5 (spec §2.3): sinkhorn warp wi takes rows wi*RPW .. of the group, one
 * group of HC*HC lanes per row; lanes past the groups compute on copies and write nothing */
template <int HC>
__device__ void hc_sinkhorn_lanes(float *comb, float *post, const hc_fin_smem *sm, int64_t r0, int nr, int wi,
                                  int iters, float hc_eps) {
    constexpr int E = HC * HC, RPW = 32 / E;
    int lane = threadIdx.x & 31, g = lane / E, e = lane % E, i = e / HC, k = e % HC;
    int rr = wi * RPW + g, base = g * E;
    bool act = g < RPW && rr < nr;
    float cv = act ? sm->C[rr][e] : 1.0f; /* idle lanes: a harmless normal value */
    for (int it = 0; it < iters; it++) {
        if (it > 0) cv /= hc_lane_sum<HC>(cv, base, i * HC, 1) + hc_eps; /* row i: over k ascending */
        cv /= hc_lane_sum<HC>(cv, base, k, HC) + hc_eps;                  /* column k: over i ascending */
    }
    if (!act) return;
    comb[(r0 + rr) * E + e] = cv;
    if (e < HC) post[(r0 + rr) * HC + e] = sm->pst[rr][e];
}

/* hc 6..16: warp wi normalizes row wi of the group in shared memory (serial sums, CPU order) */
__device__ void hc_sinkhorn_smem(float *comb, float *post, hc_fin_smem *sm, int64_t r0, int wi, int hc, int iters,
                                 float hc_eps) {
    int lane = threadIdx.x & 31;
    float *C = sm->C[wi];
    for (int it = 0; it < iters; it++) {
        if (it > 0 && lane < hc) { /* row lane */
            float sum = 0.0f;
            for (int k = 0; k < hc; k++) sum += C[lane * hc + k];
            for (int k = 0; k < hc; k++) C[lane * hc + k] /= sum + hc_eps;
        }
        __syncwarp();
        if (lane < hc) { /* column lane */
            float sum = 0.0f;
            for (int i = 0; i < hc; i++) sum += C[i * hc + lane];
            for (int i = 0; i < hc; i++) C[i * hc + lane] /= sum + hc_eps;
        }
        __syncwarp();
    }
    for (int i = lane; i < hc * hc; i += 32) comb[(r0 + wi) * hc * hc + i] = C[i];
    if (lane < hc) post[(r0 + wi) * hc + lane] = sm->pst[wi][lane];
}

/* ----- y's rmsnorm (hc_pre_norm) -----
 * The norm that would follow (norm.cu's rmsnorm of dim <= 4096, dim % 128 == 0: k_rmsnorm_vec,
 * dim/4 threads of one float4 each) applied to y inside the kernel that forms y, with the same
 * arithmetic, so the same bits: hc_sq4 is norm.cu's d_sq4; a row's sum of squares is the warp
 * sum (xor tree) of hc_sq4 over each run of 32 float4s (k_rmsnorm_vec's warps), then the warp
 * sum of those dim/128 partials in lanes, zeros past them (block_sum's second stage); then
 * x * (1 / sqrtf(ss / dim + eps)) * w, rounded to bf16 if asked.  Weights are decoded element
 * by element (the same values as the vector loads of k_rmsnorm_vec). */
struct hc_ynorm {
    dweight w;
    int on, has_w, vw; /* on: norm y; has_w: weighted; vw: f32 (1) / bf16 (2) weights aligned for vector loads */
    float eps;
};

__device__ __forceinline__ float hc_sq4(float4 v) {
    return __fadd_rn(__fadd_rn(__fadd_rn(__fmul_rn(v.x, v.x), __fmul_rn(v.y, v.y)), __fmul_rn(v.z, v.z)),
                     __fmul_rn(v.w, v.w));
}

/* a row's scale from its dim/128 partials, partial lane in lane (0 past them; by a whole warp, every
 * lane gets it) */
__device__ __forceinline__ float hc_norm_scale_lane(float part, int dim, float eps) {
    float ss = warp_sum(part);
    return 1.0f / sqrtf(ss / (float)dim + eps);
}
__device__ __forceinline__ float hc_norm_scale(const float *nss, int dim, float eps) {
    int lane = threadIdx.x & 31;
    return hc_norm_scale_lane(lane < dim / 128 ? nss[lane] : 0.0f, dim, eps);
}

/* weights 4c .. 4c+3 (ones when unweighted) */
__device__ __forceinline__ float4 hc_norm_w4(const hc_ynorm &yn, int64_t c) {
    if (!yn.has_w) return make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    return make_float4(d_weight_at(yn.w, 0, 4 * c), d_weight_at(yn.w, 0, 4 * c + 1), d_weight_at(yn.w, 0, 4 * c + 2),
                       d_weight_at(yn.w, 0, 4 * c + 3));
}

/* weights 4c .. 4c+3 as raw bits, not decoded yet: a decode inside the format branch would
 * make the thread wait for the load right there (k_hc_dec issues these before its partial
 * sums and uses them at the end); f32: one 16-byte load, bf16: one 8-byte load */
__device__ __forceinline__ uint4 hc_norm_wraw(const hc_ynorm &yn, int64_t c) {
    uint4 r = make_uint4(0u, 0u, 0u, 0u);
    if (yn.vw == 1) {
        r = __ldg((const uint4 *)yn.w.data + c);
    } else if (yn.vw == 2) {
        uint2 u = __ldg((const uint2 *)yn.w.data + c);
        r.x = u.x, r.y = u.y;
    }
    return r;
}

/* the values of hc_norm_w4 from hc_norm_wraw's bits (other formats: element by element) */
__device__ __forceinline__ float4 hc_norm_wdec(const hc_ynorm &yn, uint4 r, int64_t c) {
    if (yn.vw == 1)
        return make_float4(__uint_as_float(r.x), __uint_as_float(r.y), __uint_as_float(r.z), __uint_as_float(r.w));
    if (yn.vw == 2)
        return make_float4(__uint_as_float(r.x << 16), __uint_as_float(r.x & 0xffff0000u), __uint_as_float(r.y << 16),
                           __uint_as_float(r.y & 0xffff0000u));
    return hc_norm_w4(yn, c);
}

__device__ __forceinline__ float4 hc_norm4(float4 v, float s, float4 w, int has_w, int out_bf16) {
    float4 o = make_float4(v.x * s, v.y * s, v.z * s, v.w * s);
    if (has_w) o.x *= w.x, o.y *= w.y, o.z *= w.z, o.w *= w.w;
    if (out_bf16) o.x = d_round_bf16(o.x), o.y = d_round_bf16(o.y), o.z = d_round_bf16(o.z), o.w = d_round_bf16(o.w);
    return o;
}

/* rows r0 .. r0+nr-1 of y, already written by the y threads (t of nt, whole warps, which
 * all call this), normed in place: named barrier 1 among them, a pass for the partials
 * (warp per run of 32 float4s), a barrier, a pass that scales.  Runs of 32 float4s never
 * straddle rows (dim % 128 == 0), so each warp's row is uniform. */
__device__ void hc_norm_rows(float *y, int64_t r0, int nr, int dim, const hc_ynorm &yn, int out_bf16, int t, int nt,
                             float (*nss)[32]) {
    int lane = t & 31, nwv = dim / 128, dq = dim / 4;
    asm volatile("bar.sync 1, %0;" ::"r"(nt) : "memory"); /* y is written */
    for (int q = t >> 5; q < nr * nwv; q += nt >> 5) {
        int rr = q / nwv, v = q - rr * nwv;
        float ss = warp_sum(hc_sq4(__ldcg((const float4 *)(y + (r0 + rr) * dim) + v * 32 + lane)));
        if (lane == 0) nss[rr][v] = ss;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(nt) : "memory");
    int rs = -1;
    float s = 0.0f;
    for (int q = t; q < nr * dq; q += nt) {
        int rr = q / dq, c = q - rr * dq;
        if (rr != rs) s = hc_norm_scale(nss[rr], dim, yn.eps), rs = rr;
        float4 *p = (float4 *)(y + (r0 + rr) * dim) + c;
        *p = hc_norm4(__ldcg(p), s, hc_norm_wdec(yn, hc_norm_wraw(yn, c), c), yn.has_w, out_bf16);
    }
}

/* y[r] = sum_j pre_j X[r][j] (j ascending, as the CPU) for the group's rows, by threads t of nt */
__device__ __forceinline__ void hc_y_store(float *yp, float4 v, int out_bf16) {
    if (out_bf16) v.x = d_round_bf16(v.x), v.y = d_round_bf16(v.y), v.z = d_round_bf16(v.z), v.w = d_round_bf16(v.w);
    *(float4 *)yp = v;
}

/* hc known at compile time: two positions per pass, their 2*HC loads issued before the math */
template <int HC>
__device__ void hc_y_rows_fixed(float *y, const float *__restrict__ X, const hc_fin_smem *sm, int64_t r0, int nr,
                                int dim, int out_bf16, int t, int nt) {
    int64_t width = (int64_t)HC * dim;
    int dq = dim / 4, n = nr * dq;
    for (int q = t; q < n; q += 2 * nt) {
        int np = q + nt < n ? 2 : 1;
        float4 xv[2][HC];
#pragma unroll
        for (int p = 0; p < 2; p++) {
            if (p >= np) break;
            int qq = q + p * nt, rr = qq / dq, d = (qq - rr * dq) * 4;
            const float *xr = X + (r0 + rr) * width + d;
#pragma unroll
            for (int jj = 0; jj < HC; jj++) xv[p][jj] = __ldg((const float4 *)(xr + (int64_t)jj * dim));
        }
#pragma unroll
        for (int p = 0; p < 2; p++) {
            if (p >= np) break;
            int qq = q + p * nt, rr = qq / dq, d = (qq - rr * dq) * 4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int jj = 0; jj < HC; jj++) {
                float pj = sm->pre[rr][jj];
                v.x += pj * xv[p][jj].x, v.y += pj * xv[p][jj].y, v.z += pj * xv[p][jj].z, v.w += pj * xv[p][jj].w;
            }
            hc_y_store(y + (r0 + rr) * dim + d, v, out_bf16);
        }
    }
}

__device__ void hc_y_rows(float *y, const float *__restrict__ X, const hc_fin_smem *sm, int64_t r0, int nr, int hc,
                          int dim, int out_bf16, int t, int nt) {
    int64_t width = (int64_t)hc * dim;
    if (dim % 4 == 0 && ((uintptr_t)X & 15) == 0 && ((uintptr_t)y & 15) == 0) {
        if (hc == 4) {
            hc_y_rows_fixed<4>(y, X, sm, r0, nr, dim, out_bf16, t, nt);
            return;
        }
        int dq = dim / 4;
        for (int q = t; q < nr * dq; q += nt) {
            int rr = q / dq, d = (q - rr * dq) * 4;
            const float *xr = X + (r0 + rr) * width + d;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
            for (int jj = 0; jj < hc; jj++) {
                float4 xv = __ldg((const float4 *)(xr + (int64_t)jj * dim));
                float pj = sm->pre[rr][jj];
                v.x += pj * xv.x, v.y += pj * xv.y, v.z += pj * xv.z, v.w += pj * xv.w;
            }
            hc_y_store(y + (r0 + rr) * dim + d, v, out_bf16);
        }
        return;
    }
    for (int q = t; q < nr * dim; q += nt) {
        int rr = q / dim, d = q - rr * dim;
        const float *xr = X + (r0 + rr) * width + d;
        float v = 0.0f;
        for (int jj = 0; jj < hc; jj++) v += sm->pre[rr][jj] * xr[(int64_t)jj * dim];
        y[(r0 + rr) * dim + d] = out_bf16 ? d_round_bf16(v) : v;
    }
}

/* partials of rows r0..r0+nr-1 -> mix, rms, pre/post/comb, Sinkhorn, y; head = 1: pre and y only.
 * Partials are read through L2 (__ldcg): in the fused kernel other blocks wrote them. */
__device__ void hc_fin_rows(float *y, float *post, float *comb, const float *part, int splits,
                            const float *__restrict__ X, int64_t r0, int nr, int hc, int dim, float2 bsv, int iters,
                            float norm_eps, float hc_eps, int out_bf16, int head, const hc_ynorm &yn,
                            hc_fin_smem *sm) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int nm = head ? hc : (2 + hc) * hc;
    const int comb_lg = iters & DSV4_HC_COMB_LOGITS; /* comb gets the logits (backend.h) */
    iters &= DSV4_HC_ITERS;
    for (int q = warp; q < nr * (nm + 1); q += nw) {
        int rr = q / (nm + 1), m = q - rr * (nm + 1);
        const float *p = part + ((r0 + rr) * (nm + 1) + m) * splits;
        float v = 0.0f;
        for (int s = lane; s < splits; s += 32) v += __ldcg(p + s);
        v = warp_sum(v);
        if (lane == 0) sm->mix[rr][m] = v;
    }
    if ((int)threadIdx.x < nm) sm->bs[threadIdx.x] = bsv.x;
    if (threadIdx.x < 3) sm->sc[threadIdx.x] = bsv.y;
    __syncthreads();
    int64_t width = (int64_t)hc * dim;
    if ((int)threadIdx.x < nr * hc) {
        int rr = threadIdx.x / hc, j = threadIdx.x - rr * hc;
        const float *mix = sm->mix[rr];
        float sn = 1.0f / sqrtf(mix[nm] / (float)width + norm_eps);
        sm->pre[rr][j] = d_sigmoid((mix[j] * sn) * sm->sc[0] + sm->bs[j]) + hc_eps;
        if (!head) {
            /* rounded step by step, as the CPU does and as the kernel before this version compiled
             * it (its base load sat in another basic block, so nothing was fused): same bits */
            sm->pst[rr][j] =
                2.0f * d_sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(mix[hc + j], sn), sm->sc[1]), sm->bs[hc + j]));
            float sc2 = sm->sc[2], mx = -INFINITY, sum = 0.0f;
            float *cr = sm->C[rr] + j * hc;
            for (int k = 0; k < hc; k++) { /* row softmax, + eps (the CPU's order) */
                cr[k] = (mix[2 * hc + j * hc + k] * sn) * sc2 + sm->bs[2 * hc + j * hc + k];
                mx = fmaxf(mx, cr[k]);
            }
            if (comb_lg) { /* the logits and post, no Sinkhorn warps */
                for (int k = 0; k < hc; k++) comb[(r0 + rr) * hc * hc + j * hc + k] = cr[k];
                post[(r0 + rr) * hc + j] = sm->pst[rr][j];
            } else {
                for (int k = 0; k < hc; k++) sum += (cr[k] = expf(cr[k] - mx));
                for (int k = 0; k < hc; k++) cr[k] = cr[k] / sum + hc_eps;
            }
        }
    }
    __syncthreads();
    int nsw = 0; /* warps running Sinkhorn */
    if (!head && !comb_lg) nsw = hc * hc <= 32 ? (nr + 32 / (hc * hc) - 1) / (32 / (hc * hc)) : nr;
    if (warp < nsw) {
        switch (hc) {
        case 1: hc_sinkhorn_lanes<1>(comb, post, sm, r0, nr, warp, iters, hc_eps); break;
        case 2: hc_sinkhorn_lanes<2>(comb, post, sm, r0, nr, warp, iters, hc_eps); break;
        case 3: hc_sinkhorn_lanes<3>(comb, post, sm, r0, nr, warp, iters, hc_eps); break;
        case 4: hc_sinkhorn_lanes<4>(comb, post, sm, r0, nr, warp, iters, hc_eps); break;
        case 5: hc_sinkhorn_lanes<5>(comb, post, sm, r0, nr, warp, iters, hc_eps); break;
        default: hc_sinkhorn_smem(comb, post, sm, r0, warp, hc, iters, hc_eps); break;
        }
        return;
    }
    int t = threadIdx.x - nsw * 32, nt = blockDim.x - nsw * 32;
    hc_y_rows(y, X, sm, r0, nr, hc, dim, out_bf16, t, nt);
    if (yn.on) hc_norm_rows(y, r0, nr, dim, yn, out_bf16, t, nt, sm->nss);
}

/* ----- kernels ----- */
__global__ void __launch_bounds__(HC_THREADS) k_hc_part(float *part, const float *__restrict__ X, int rows, int64_t K,
                                                        dweight fn, int nm, int64_t kspan, int splits, int gemm_bf16) {
    pdl_enter();
    __shared__ __align__(16) float xs[HC_RB][HC_KT];
    int r0 = blockIdx.y * HC_RB, nr = rows - r0 < HC_RB ? rows - r0 : HC_RB;
    hc_part_block(part, X, r0, nr, K, fn, nm, kspan, splits, blockIdx.x, gemm_bf16, xs);
}

__global__ void __launch_bounds__(HC_THREADS) k_hc_fin(float *y, float *post, float *comb, const float *part,
                                                       int splits, const float *__restrict__ X, int hc, int dim,
                                                       dweight base, dweight scale, int iters, float norm_eps,
                                                       float hc_eps, int out_bf16, int head, hc_ynorm yn) {
    pdl_enter();
    __shared__ hc_fin_smem sm;
    float2 bsv = hc_bs_load(base, scale, head ? hc : (2 + hc) * hc);
    hc_fin_rows(y, post, comb, part, splits, X, blockIdx.x, 1, hc, dim, bsv, iters, norm_eps, hc_eps, out_bf16, head,
                yn, &sm);
}

/* part, then the last block of each row group (done[g] counts finished blocks) runs fin */
__global__ void __launch_bounds__(HC_THREADS) k_hc_fused(float *y, float *post, float *comb, float *part,
                                                         unsigned *done, const float *__restrict__ X, int rows,
                                                         int hc, int dim, dweight fn, int nm, int64_t kspan,
                                                         int splits, dweight base, dweight scale, int iters,
                                                         float norm_eps, float hc_eps, int gemm_bf16, int out_bf16,
                                                         int head, hc_ynorm yn) {
    pdl_enter();
    __shared__ __align__(16) float xs[HC_RB][HC_KT];
    __shared__ hc_fin_smem sm;
    __shared__ int last;
    int r0 = blockIdx.y * HC_RB, nr = rows - r0 < HC_RB ? rows - r0 : HC_RB;
    float2 bsv = hc_bs_load(base, scale, nm); /* for fin, if this block is the last */
    hc_part_block(part, X, r0, nr, (int64_t)hc * dim, fn, nm, kspan, splits, blockIdx.x, gemm_bf16, xs);
    __threadfence(); /* this block's partials are visible device-wide before it counts itself done */
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned prev = atomicAdd(&done[blockIdx.y], 1u);
        last = prev == gridDim.x - 1;
        if (last) atomicExch(&done[blockIdx.y], 0u); /* every block of this launch has counted */
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    hc_fin_rows(y, post, comb, part, splits, X, r0, nr, hc, dim, bsv, iters, norm_eps, hc_eps, out_bf16, head, yn,
                &sm);
}

/* ----- hc_post's arithmetic -----
 * 4 adjacent outputs of stream k: post_k o, then + comb[j][k] R_j for j ascending, then the
 * state's bf16 rounding if asked.  The multiply and the fmas are spelled out (they are what
 * nvcc made of k_hc_post4's plain expression before: mul.f32, then fma.rn.f32 per j), so
 * k_hc_post4 and the hc_post inside k_hc_dec (hc_post_pre_norm) form the same bits. */
__device__ __forceinline__ float4 hc_post_begin(float pk, float4 o) {
    return make_float4(__fmul_rn(pk, o.x), __fmul_rn(pk, o.y), __fmul_rn(pk, o.z), __fmul_rn(pk, o.w));
}

__device__ __forceinline__ float4 hc_post_step(float4 v, float cj, float4 r) {
    return make_float4(__fmaf_rn(cj, r.x, v.x), __fmaf_rn(cj, r.y, v.y), __fmaf_rn(cj, r.z, v.z),
                       __fmaf_rn(cj, r.w, v.w));
}

__device__ __forceinline__ float4 hc_post_round(float4 v, int state_bf16) {
    if (state_bf16) v.x = d_round_bf16(v.x), v.y = d_round_bf16(v.y), v.z = d_round_bf16(v.z), v.w = d_round_bf16(v.w);
    return v;
}

/* hc_post's inputs when k_hc_dec forms its X itself (hc_post_pre_norm): Xout = hc_post(o, R,
 * post, comb), device memory; Xout aliases none of o, R (as for hc_post), and k_hc_dec's
 * outputs y, post, comb alias none of o, R, post, comb (backend.h) */
struct hc_postin {
    float *Xout;
    const float *o, *R, *post, *comb;
    int state_bf16;
    int comb_lg; /* comb holds an earlier hc_pre's logits (DSV4_HC_COMBIN_LOGITS): every block forms the
                  * matrix, before its PDL wait (2) or after it (1: comb's writer may be the kernel before) */
    moe_comb mc; /* POST 2 (DSV4_CUDA_HC_COMB, moe.cu): o is the MoE's combine of mc, formed here (moe_comb4)
                  * wherever o is read, and written to mc.out (= o) by the warps of stream 0's columns */
    int l2pf;    /* R, post_in and comb_in asked into L2 before the PDL wait (dsv4_cuda_l2pf) */
};

/* ----- decode fast path (k_hc_dec): rows <= 4, hc = 4, f32 fn, K a multiple of 128 * T -----
 * One launch of K / (128 T) blocks of 384 threads (12 warps).  Block b owns columns
 * [128 T b, 128 T (b + 1)): lane l of every warp loads its 16-byte vectors of X (the
 * group's rows) and of fn (outputs m = warp + 12 u, u < 2) for the T tiles at once -- no
 * shared staging, no barrier before the math -- and writes one partial per (row, m) and the
 * row's sum of squares (warp 0).  The finisher -- block 0, polling tagged partials (POLL,
 * below; splits <= HD_PSPLITS and one of the first HC_PSLOTS streams), else the last block
 * by the done counter as k_hc_fused (DSV4_CUDA_HC_DEC_OLD=1 forces that) -- then loads
 * its first round of X for y while it sums the partials (lane-strided in split order, then
 * a warp tree: the same sums either way, so the same bits), and splits: the first
 * ceil(rows / 2) warps run softmax + Sinkhorn in lanes (16 lanes per row: the arithmetic of
 * hc_sinkhorn_lanes<4>, the row softmax in the same lanes) and write post / comb, the other
 * warps form pre (a named barrier among them) and y.  Same expressions as hc_fin_rows; only
 * the split of the dot products differs.  POLL also skips the warp sums of absent rows and
 * sums Sinkhorn's terms from the first (hc_lane_sum1): the same bits.
 * POST (hc_post_pre_norm: the hc_post before this hc_pre in the same launch): X is not read;
 * warp w < rows T of each block forms its slice's row w / T, tile w % T of hc_post (lane l
 * its 4 columns, from o, R, post_in, comb_in: k_hc_post4's arithmetic, hc_post_step), stores
 * it to Xout and in shared memory, and after one barrier every warp takes its X vectors from
 * there.  The finisher does not read Xout (other blocks write it, with no ordering towards
 * block 0): it forms each X vector y needs from o and R again, with the same arithmetic, so
 * the same bits, and its first round of o and R is in flight while it sums the partials as
 * X was.  post_in / comb_in are read by every block before it stores its partials and are
 * staged in the finisher's shared memory; the outputs must not alias them anyway (forward.c
 * keeps two pairs).
 * DIST (DSV4_CUDA_HC_DIST=1, POLL, not hc_head, not POST 2, dim % 128 == 0, dim <= 4096): y and its norm
 * are formed by the blocks instead of block 0 alone.  y's float4 positions fall into runs of 32 (128
 * columns of one row, the warps of the finisher's norm); run i belongs to warp 2 + i / g of block i % g
 * (g blocks), whose lane l takes its position 32 (i mod dim / 128) + l.  Every block with a run stays
 * after its partials, polls them all as block 0 does, forms pre (warp 2) and its runs' y with the
 * finisher's expressions, stores each run's sum of squares (the same warp sum) as a tagged word of a
 * second area, polls its row's dim / 128 words in lanes and takes the finisher's scale from them (the
 * same warp sum again): the same bits as the finisher.  Block 0 still runs Sinkhorn (post, comb) and
 * stores the epoch.  Each thread's finisher code is one position instead of HD_YP, and the norm's
 * second pass needs no barrier, at the cost of up to 64 blocks polling instead of one. */
enum { HD_THREADS = 384, HD_WARPS = 12, HD_MU = 2, HD_ROWS = 4, HD_HC = 4, HD_NM = (2 + HD_HC) * HD_HC,
       HD_T = 2, /* tiles per lane: at K = 16384, 64 blocks (T = 1: 128 blocks, same time; T = 4: +0.3 us) */
       HD_PQ = 3 /* pairs per warp per round of the partial sums */, HD_YP = 3 /* y positions per thread */,
       HD_PIN = HD_HC + HD_HC * HD_HC /* post_in and comb_in of one row */,
       HD_PSPLITS = 64 /* POLL: at most this many blocks */,
       HD_TG_NORM = HD_ROWS * (HD_NM + 1) * HD_PSPLITS /* DIST: the norm's tagged partials, [row][32], from here */,
       HD_TGW = HD_TG_NORM + HD_ROWS * 32 /* tagged words of one stream */ };

/* o at row rr, columns d..d+3, in the finisher: o itself (POST 1), or (POST 2) the combine's out
 * as the hc_post warps of every block wrote it, read once every partial is in (see k_hc_dec) */
template <int POST>
__device__ __forceinline__ float4 hd_o4(const hc_postin &pin, int rr, int64_t d, int dim) {
    return __ldcg((const float4 *)((POST == 2 ? pin.mc.out : pin.o) + (int64_t)rr * dim + d));
}

/* y's inputs at position d of row rr: X's hc vectors there, or (POST) R's and o's (in [HD_HC]; with
 * no_o, POST 2's first round before the partials are in, o is left for later) */
template <int POST>
__device__ __forceinline__ void hd_y_load(float4 (&xy)[HD_HC + 1], const float *X, const hc_postin &pin, int rr,
                                          int64_t d, int64_t K, int dim, bool no_o = false) {
    const float *xr = (POST ? pin.R : X) + rr * K + d;
#pragma unroll
    for (int j = 0; j < HD_HC; j++) xy[j] = __ldcg((const float4 *)(xr + (int64_t)j * dim));
    if (POST && !no_o) xy[HD_HC] = hd_o4<POST>(pin, rr, d, dim);
}

/* X's vector of stream j from hd_y_load's (POST: hc_post of o and R with the row's staged
 * post_in / comb_in, pc) */
template <int POST>
__device__ __forceinline__ float4 hd_y_x(const float4 (&xy)[HD_HC + 1], const float *pc, int j, int state_bf16) {
    if (!POST) return xy[j];
    float4 v = hc_post_begin(pc[j], xy[HD_HC]);
#pragma unroll
    for (int i = 0; i < HD_HC; i++) v = hc_post_step(v, pc[HD_HC + i * HD_HC + j], xy[i]);
    return hc_post_round(v, state_bf16);
}

/* pre_j of the row whose mixes are mr (the sum of squares at mr[nm]) */
__device__ __forceinline__ float hd_pre(const float *mr, int j, int nm, float width, float norm_eps, float sc0,
                                        float bj, float hc_eps) {
    float sn = 1.0f / sqrtf(mr[nm] / width + norm_eps);
    return d_sigmoid((mr[j] * sn) * sc0 + bj) + hc_eps;
}

/* y at one position from hd_y_load's values: sum_j pre_j X_j (j ascending) */
template <int POST>
__device__ __forceinline__ float4 hd_y_val(const float4 (&xy)[HD_HC + 1], const float *pc, const float *pr,
                                           int state_bf16) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int j = 0; j < HD_HC; j++) {
        float pj = pr[j];
        float4 xj = hd_y_x<POST>(xy, pc, j, state_bf16);
        v.x += pj * xj.x, v.y += pj * xj.y, v.z += pj * xj.z, v.w += pj * xj.w;
    }
    return v;
}

/* POLL (k_hc_dec's default): every block stores its partials tagged with the launch's tag
 * (64-bit words: tag << 32 | the float's bits, relaxed at gpu scope, so a word is seen whole
 * or not at all) and block 0, the finisher, polls until it has read every word of this
 * launch's tag: no fence, no done counter, no second trip through L2.  The tag is the
 * stream's epoch + 1, read by every block at its start; block 0 stores it as the new epoch
 * after it has read every partial, hence after every block has read the epoch (a block reads
 * it before it stores a partial), and the next launch on the stream starts after this one
 * ends.  A stale word holds an older launch's tag (or 0: never written), which differs
 * from this launch's until the 32-bit epoch wraps.  Block 0 spins while the other blocks
 * run: it needs no more than the other 63 blocks to be scheduled eventually. */
__device__ __forceinline__ unsigned hc_ld_relaxed(const unsigned *p) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void hc_st_relaxed(unsigned *p, unsigned v) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long hc_ld_tagged(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void hc_st_tagged(unsigned long long *p, float v, unsigned tag) {
    unsigned long long w = (unsigned long long)tag << 32 | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

/* v[i][s] = split lane + 32 s of pair q0 + 12 i (0 past splits or nq), once every word of
 * this launch is there: all loads issued at once, the missing ones re-issued until the
 * whole warp has them (k_hc_dec's old gather read the same values, in the same places) */
__device__ __forceinline__ void hc_poll_partials(float (&v)[HD_PQ][4], const unsigned long long *tg, int q0, int nq,
                                                 int splits, unsigned tag) {
    int lane = threadIdx.x & 31;
    unsigned long long w[HD_PQ][4];
#pragma unroll
    for (int i = 0; i < HD_PQ; i++)
#pragma unroll
        for (int s = 0; s < 4; s++) {
            int q = q0 + i * HD_WARPS;
            w[i][s] = q < nq && lane + 32 * s < splits ? hc_ld_tagged(tg + (int64_t)q * splits + lane + 32 * s)
                                                       : (unsigned long long)tag << 32;
        }
    for (;;) {
        bool miss = false;
#pragma unroll
        for (int i = 0; i < HD_PQ; i++)
#pragma unroll
            for (int s = 0; s < 4; s++) miss |= (unsigned)(w[i][s] >> 32) != tag;
        if (!__any_sync(0xffffffffu, miss)) break;
#pragma unroll
        for (int i = 0; i < HD_PQ; i++)
#pragma unroll
            for (int s = 0; s < 4; s++)
                if ((unsigned)(w[i][s] >> 32) != tag)
                    w[i][s] = hc_ld_tagged(tg + (int64_t)(q0 + i * HD_WARPS) * splits + lane + 32 * s);
    }
#pragma unroll
    for (int i = 0; i < HD_PQ; i++)
#pragma unroll
        for (int s = 0; s < 4; s++) v[i][s] = __uint_as_float((unsigned)w[i][s]); /* 0.0f where nothing was read */
}

/* hc_lane_sum from the first term on: v0 + v1 + ... instead of 0 + v0 + ..., the same bits
 * unless v0 is -0, and every value Sinkhorn sums is +0 or more (softmax + eps, quotients) */
template <int HC>
__device__ __forceinline__ float hc_lane_sum1(float cv, int base, int i0, int step) {
    float v[HC];
#pragma unroll
    for (int t = 0; t < HC; t++) v[t] = __shfl_sync(0xffffffffu, cv, (base + i0 + t * step) & 31);
    float sum = v[0];
#pragma unroll
    for (int t = 1; t < HC; t++) sum += v[t];
    return sum;
}

/* comb from lane e = i * 4 + k's logit cv (group base16 of 16 lanes, row i, column k): the row
 * softmax in lanes, + hc_eps, then Sinkhorn's iterations, the sums from the first term on
 * (hc_lane_sum1) and the first iteration peeled; every lane of the warp calls it (shuffles) */
__device__ __forceinline__ float hd_row_exp(float cv, int base16, int i) { /* exp(cv - the max of row i) */
    float mx = -INFINITY, rv[HD_HC];
#pragma unroll
    for (int t = 0; t < HD_HC; t++) rv[t] = __shfl_sync(0xffffffffu, cv, base16 + i * HD_HC + t);
#pragma unroll
    for (int t = 0; t < HD_HC; t++) mx = fmaxf(mx, rv[t]);
    return expf(cv - mx);
}

__device__ __forceinline__ float hd_comb_form(float cv, int base16, int i, int k, int iters, float hc_eps) {
    cv = hd_row_exp(cv, base16, i);
    cv = cv / hc_lane_sum1<HD_HC>(cv, base16, i * HD_HC, 1) + hc_eps;
    if (iters > 0) cv /= hc_lane_sum1<HD_HC>(cv, base16, k, HD_HC) + hc_eps;
    for (int it = 1; it < iters; it++) {
        cv /= hc_lane_sum1<HD_HC>(cv, base16, i * HD_HC, 1) + hc_eps; /* row i: k ascending */
        cv /= hc_lane_sum1<HD_HC>(cv, base16, k, HD_HC) + hc_eps;     /* column k: i ascending */
    }
    return cv;
}

/* comb_in's logits (rows < nr, [row][16]) into the matrix cmb: warp w < ceil(nr / 2) takes rows 2w,
 * 2w + 1, 16 lanes each (hd_comb_form: the bits the producer would have written) */
__device__ __forceinline__ void hd_comb_in(float (*cmb)[HD_HC * HD_HC], const float *comb, int nr, int warp, int lane,
                                           int iters, float hc_eps) {
    constexpr int E = HD_HC * HD_HC;
    if (warp >= (nr + 1) / 2) return;
    int g = lane / E, e = lane % E, rr = warp * 2 + g;
    bool act = rr < nr;
    float cv = hd_comb_form(__ldcg(comb + (act ? rr : 0) * E + e), g * E, e / HD_HC, e % HD_HC, iters, hc_eps);
    if (act) cmb[rr][e] = cv;
}

/* DSV4_CUDA_HC_STAMP=1 (a probe, read at the first hc call): k_hc_dec (POLL) records %globaltimer at its
 * phases in slot tag % HS_CALLS: 0 block 0's start, 1 its wait passed, 2 the last block's partials
 * stored, 3 the finisher's sums done, 4 pre formed, 5 y formed, 6 y normed, 7 Sinkhorn done, 8 POST + 16
 * rows, 9 the last block past its wait, 10 the last y thread's first value formed, 11 the last y thread's y
 * done, 12 the last thread's end; dsv4_backend_cuda_free prints them (hc_stamp_dump).  DIST records 0 to 3,
 * 7 to 9 only */
enum { HS_N = 13, HS_CALLS = 1024 };
__device__ unsigned long long d_hc_stamp[HS_CALLS][HS_N];
__device__ int d_hc_stamp_on;
__device__ __forceinline__ unsigned long long hs_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
template <int T, int POLL, int POST, int DIST = 0>
__global__ void __launch_bounds__(HD_THREADS) k_hc_dec(float *y, float *post, float *comb, float *part,
                                                       unsigned *done, unsigned long long *tg, unsigned *epoch,
                                                       const float *__restrict__ X, int nr, int dim,
                                                       const float *__restrict__ fn, int nm, int splits, dweight base,
                                                       dweight scale, int iters, float norm_eps, float hc_eps,
                                                       int gemm_bf16, int out_bf16, int head, hc_ynorm yn,
                                                       hc_postin pin) {
    __shared__ float mix[HD_ROWS][HD_NM + 1], pre[HD_ROWS][HD_HC], bs[HD_NM], sc[3], nss[HD_ROWS][32];
    __shared__ float4 xs[POST ? HD_ROWS : 1][POST ? T : 1][32]; /* POST: this block's slice of Xout */
    __shared__ float spin[POST ? HD_ROWS : 1][HD_PIN];          /* POST: post_in, comb_in (the finisher) */
    __shared__ float cmb[POST ? HD_ROWS : 1][HD_HC * HD_HC];    /* POST, pin.comb_lg: comb_in's matrix */
    __shared__ int last;
    static_assert(!DIST || (POLL && POST != 2), "k_hc_dec: DIST takes POLL, POST 0 or 1");
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    /* DIST: runs of 32 float4s of y (rpr a row), the blocks that own one (nyb) */
    const int rpr = dim >> 7, nrun = nr * rpr, nyb = DIST ? min((int)gridDim.x, nrun) : 1;
    const int comb_lg = iters & DSV4_HC_COMB_LOGITS; /* write comb's logits (backend.h) */
    iters &= DSV4_HC_ITERS;
    const int hs = POLL && d_hc_stamp_on;
    unsigned long long hs0 = hs ? hs_now() : 0ull;
    int64_t K = (int64_t)HD_HC * dim, k0 = (int64_t)blockIdx.x * (HC_KT * T) + lane * 4;
    /* weights only before pdl_enter (common.cuh): base / scale, the norm's weights into L2 now
     * (block 0, a 128-byte line per thread, so the finisher's loads of them do not wait for
     * DRAM) and this block's fn vectors, all in flight while the previous kernel finishes */
    unsigned tag;
    float2 bsv = !POLL || blockIdx.x == 0 || (DIST && (int)blockIdx.x < nyb) ? hc_bs_load(base, scale, nm)
                                                                             : make_float2(0.0f, 0.0f);
    if (yn.vw && blockIdx.x == 0 && (int64_t)threadIdx.x * 128 < (int64_t)dim * (yn.vw == 1 ? 4 : 2))
        d_prefetch_l2((const char *)yn.w.data + threadIdx.x * 128);
    {
        float4 wv[HD_MU][T], xv[HD_ROWS][T];
#pragma unroll
        for (int u = 0; u < HD_MU; u++) {
            int m = warp + HD_WARPS * u;
#pragma unroll
            for (int t = 0; t < T; t++)
                wv[u][t] = m < nm ? d_ld_stream_f4(fn + m * K + k0 + t * HC_KT) : make_float4(0, 0, 0, 0);
        }
        /* comb_in's logits into the matrix in every block (the producer's arithmetic: hd_comb_form),
         * 16 lanes a row; before the wait where the host saw another op between comb_in's writer
         * and this one (comb_lg 2: that writer has completed when this kernel starts, common.cuh) */
        if (POST && pin.comb_lg == 2) hd_comb_in(cmb, pin.comb, nr, warp, lane, iters, hc_eps);
        /* POST 2: the row's combine order and weights, also before the wait (the plan that wrote them
         * ran before the MoE's gate/up, two kernels back: common.cuh's pre-wait rule) */
        moe_comb_row mrow = {};
        if (POST == 2 && warp < nr * T) mrow = moe_comb_row_load(pin.mc, warp / T);
        /* the residual R was written a half layer ago, and ~50-100 MB of weights have streamed through
         * L2 since: ask for this block's slice now, before the wait, where the next kernel's early
         * weight loads would queue ahead of it after (the lanes that start a 128-byte line) */
        if (POST && pin.l2pf) {
            if (warp < nr * T && (lane & 7) == 0) {
                int r = warp / T, t = warp - r * T, k = (int)((k0 + t * HC_KT) / dim);
                int64_t d = k0 + t * HC_KT - (int64_t)k * dim;
#pragma unroll
                for (int j = 0; j < HD_HC; j++) d_prefetch_l2(pin.R + r * K + (int64_t)j * dim + d);
            }
            if (warp == HD_WARPS - 1 && lane < nr) d_prefetch_l2(pin.post + lane * HD_HC);
            if (warp == HD_WARPS - 1 && lane >= 8 && lane < 8 + nr)
                d_prefetch_l2(pin.comb + (lane - 8) * HD_HC * HD_HC);
        }
        pdl_enter();
        if (POST && pin.comb_lg == 1) hd_comb_in(cmb, pin.comb, nr, warp, lane, iters, hc_eps);
        if (POST && pin.comb_lg) __syncthreads();
        /* POLL: this launch's tag; block 0 stores it as the next epoch once it has read every
         * partial, i.e. after every block has read the epoch */
        tag = POLL ? hc_ld_relaxed(epoch) + 1u : 0u;
        if (hs && threadIdx.x == 0) {
            unsigned long long *st = d_hc_stamp[tag % HS_CALLS], t = hs_now();
            atomicMax(st + 9, t);
            if (blockIdx.x == 0) st[0] = hs0, st[1] = t, st[8] = POST + 16 * nr;
        }
        if (POST) { /* hc_post of this block's slice (banner), then X from shared memory */
            if ((!POLL || blockIdx.x == 0 || (DIST && (int)blockIdx.x < nyb)) && (int)threadIdx.x < nr * HD_PIN) {
                int r = threadIdx.x / HD_PIN, i = threadIdx.x - r * HD_PIN;
                spin[r][i] = i < HD_HC                ? __ldg(pin.post + r * HD_HC + i)
                             : pin.comb_lg ? cmb[POST ? r : 0][i - HD_HC]
                                           : __ldg(pin.comb + r * HD_HC * HD_HC + i - HD_HC);
            }
            if (warp < nr * T) {
                int r = warp / T, t = warp - r * T, k = (int)((k0 + t * HC_KT) / dim);
                int64_t d = k0 + t * HC_KT - (int64_t)k * dim;
                float4 rv[HD_HC];
#pragma unroll
                for (int j = 0; j < HD_HC; j++) rv[j] = __ldg((const float4 *)(pin.R + r * K + (int64_t)j * dim + d));
                float4 ov = POST == 2 ? moe_comb4(pin.mc, mrow, dim, r, d)
                                      : __ldg((const float4 *)(pin.o + (int64_t)r * dim + d));
                if (POST == 2 && k == 0) { /* the combine's out, visible device-wide before this block's partials */
                    *(float4 *)(pin.mc.out + (int64_t)r * dim + d) = ov;
                    __threadfence();
                }
                float4 v = hc_post_begin(__ldg(pin.post + r * HD_HC + k), ov);
#pragma unroll
                for (int j = 0; j < HD_HC; j++)
                    v = hc_post_step(v, pin.comb_lg ? cmb[POST ? r : 0][j * HD_HC + k]
                                                    : __ldg(pin.comb + r * HD_HC * HD_HC + j * HD_HC + k),
                                     rv[j]);
                v = hc_post_round(v, pin.state_bf16);
                *(float4 *)(pin.Xout + r * K + k0 + t * HC_KT) = v;
                xs[POST ? r : 0][POST ? t : 0][lane] = v;
            }
            __syncthreads();
#pragma unroll
            for (int r = 0; r < HD_ROWS; r++)
#pragma unroll
                for (int t = 0; t < T; t++)
                    xv[r][t] = r < nr ? xs[POST ? r : 0][POST ? t : 0][lane] : make_float4(0, 0, 0, 0);
        } else {
#pragma unroll
            for (int r = 0; r < HD_ROWS; r++)
#pragma unroll
                for (int t = 0; t < T; t++)
                    xv[r][t] = r < nr ? __ldg((const float4 *)(X + r * K + k0 + t * HC_KT)) : make_float4(0, 0, 0, 0);
        }
        float ss[HD_ROWS], acc[HD_MU][HD_ROWS];
#pragma unroll
        for (int r = 0; r < HD_ROWS; r++) {
            ss[r] = 0.0f;
#pragma unroll
            for (int t = 0; t < T; t++) {
                float4 v = xv[r][t];
                ss[r] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                if (gemm_bf16) xv[r][t] = make_float4(d_round_bf16(v.x), d_round_bf16(v.y), d_round_bf16(v.z),
                                                      d_round_bf16(v.w));
            }
        }
#pragma unroll
        for (int u = 0; u < HD_MU; u++)
#pragma unroll
            for (int r = 0; r < HD_ROWS; r++) {
                acc[u][r] = 0.0f;
#pragma unroll
                for (int t = 0; t < T; t++) {
                    float4 w = wv[u][t], x = xv[r][t];
                    if (gemm_bf16) w = make_float4(d_round_bf16(w.x), d_round_bf16(w.y), d_round_bf16(w.z),
                                                   d_round_bf16(w.w));
                    acc[u][r] += w.x * x.x + w.y * x.y + w.z * x.z + w.w * x.w;
                }
            }
#pragma unroll
        for (int u = 0; u < HD_MU; u++)
#pragma unroll
            for (int r = 0; r < HD_ROWS; r++)
                if (!POLL || r < nr) acc[u][r] = warp_sum(acc[u][r]); /* warp-uniform */
#pragma unroll
        for (int r = 0; r < HD_ROWS; r++)
            if (!POLL || r < nr) ss[r] = warp_sum(ss[r]);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < HD_ROWS; r++) {
                if (r >= nr) break;
#pragma unroll
                for (int u = 0; u < HD_MU; u++) {
                    int m = warp + HD_WARPS * u;
                    int64_t i = ((int64_t)r * (nm + 1) + m) * splits + blockIdx.x;
                    if (m >= nm) continue;
                    if (POLL) hc_st_tagged(tg + i, acc[u][r], tag);
                    else part[i] = acc[u][r];
                }
                if (warp == 0) {
                    int64_t i = ((int64_t)r * (nm + 1) + nm) * splits + blockIdx.x;
                    if (POLL) hc_st_tagged(tg + i, ss[r], tag);
                    else part[i] = ss[r];
                }
            }
            if (!POLL) __threadfence(); /* this warp's partials are visible device-wide before the block counts */
            if (hs) atomicMax(d_hc_stamp[tag % HS_CALLS] + 2, hs_now());
        }
    }
    if (POLL) {
        if (DIST ? (int)blockIdx.x >= nyb : blockIdx.x != 0) return; /* block 0 (DIST: those with runs) finishes */
    } else {
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned prev = atomicAdd(done, 1u);
            last = prev == gridDim.x - 1;
            if (last) atomicExch(done, 0u); /* every block of this launch has counted */
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
    }
    int nsw = head ? 0 : (nr + 1) / 2; /* Sinkhorn warps: two 4x4 matrices per warp */
    int dq = dim / 4, n = nr * dq, tt = (int)threadIdx.x - nsw * 32, nt = HD_THREADS - nsw * 32;
    float4 xy[HD_YP][HD_HC + 1]; /* y's first round of X (POST: of R and o), in flight while the partials are summed */
    uint4 wy[HD_YP];             /* and the norm's weights for those positions (raw bits) */
    /* DIST: this warp's run (drun), its row dr and float4 position dc in the row */
    const int drun_i = (int)blockIdx.x + (warp - 2) * (int)gridDim.x;
    const bool drun = DIST && warp >= 2 && drun_i < nrun;
    const int dr = drun ? drun_i / rpr : 0, dc = drun ? (drun_i - dr * rpr) * 32 + lane : 0;
    if (DIST) {
        if (drun) {
            hd_y_load<POST>(xy[0], X, pin, dr, (int64_t)dc * 4, K, dim);
            if (yn.on) wy[0] = hc_norm_wraw(yn, dc);
        }
    } else if (tt >= 0) {
#pragma unroll
        for (int p = 0; p < HD_YP; p++) {
            int q = tt + p * nt;
            if (q >= n) break;
            int rr = q / dq;
            hd_y_load<POST>(xy[p], X, pin, rr, (int64_t)(q - rr * dq) * 4, K, dim, POST == 2);
            if (yn.on) wy[p] = hc_norm_wraw(yn, q - rr * dq);
        }
    }
    int nq = nr * (nm + 1);
    for (int q0 = warp; q0 < nq; q0 += HD_WARPS * HD_PQ) { /* pairs (row, m): splits <= 128 */
        float v[HD_PQ][4];
        if (POLL) {
            hc_poll_partials(v, tg, q0, nq, splits, tag);
        } else {
#pragma unroll
            for (int i = 0; i < HD_PQ; i++) {
                int q = q0 + i * HD_WARPS;
                const float *p = part + (int64_t)(q < nq ? q : 0) * splits;
#pragma unroll
                for (int s = 0; s < 4; s++) v[i][s] = lane + 32 * s < splits ? __ldcg(p + lane + 32 * s) : 0.0f;
            }
        }
#pragma unroll
        for (int i = 0; i < HD_PQ; i++) {
            float a = ((v[i][0] + v[i][1]) + v[i][2]) + v[i][3];
            v[i][0] = warp_sum(a);
        }
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < HD_PQ; i++) {
                int q = q0 + i * HD_WARPS;
                if (q < nq) mix[q / (nm + 1)][q % (nm + 1)] = v[i][0];
            }
    }
    if ((int)threadIdx.x < nm) bs[threadIdx.x] = bsv.x;
    if (threadIdx.x < 3) sc[threadIdx.x] = bsv.y;
    __syncthreads();
    if (POLL && threadIdx.x == 0 && (!DIST || blockIdx.x == 0))
        hc_st_relaxed(epoch, tag); /* every partial of this launch is read (by block 0) */
    unsigned long long *hst = d_hc_stamp[tag % HS_CALLS];
    if (hs && threadIdx.x == 0 && (!DIST || blockIdx.x == 0)) {
        hst[3] = hs_now();
        unsigned long long *nx = d_hc_stamp[(tag + 1) % HS_CALLS]; /* the next launch's maxima start at 0 */
        nx[2] = 0ull, nx[9] = 0ull, nx[10] = 0ull, nx[11] = 0ull, nx[12] = 0ull;
    }
    if (POST == 2 && tt >= 0) { /* every block's partials are in, so its out stores are visible (their fence) */
        __threadfence();
#pragma unroll
        for (int p = 0; p < HD_YP; p++) {
            int q = tt + p * nt;
            if (q >= n) break;
            int rr = q / dq;
            xy[p][HD_HC] = hd_o4<POST>(pin, rr, (int64_t)(q - rr * dq) * 4, dim);
        }
    }
    float width = (float)K;
    /* softmax + Sinkhorn: lane e = i*4 + k of group g holds C[i][k] of row 2 warp + g */
    if (warp < nsw && (!DIST || blockIdx.x == 0)) {
        constexpr int E = HD_HC * HD_HC;
        int g = lane / E, e = lane % E, i = e / HD_HC, k = e % HD_HC, rr = warp * 2 + g, base16 = g * E;
        bool act = rr < nr;
        const float *mr = mix[act ? rr : 0]; /* idle lanes repeat row 0 (same path, nothing written) */
        float sn = 1.0f / sqrtf(mr[nm] / width + norm_eps);
        if (act && e < HD_HC)
            post[rr * HD_HC + e] =
                2.0f * d_sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(mr[HD_HC + e], sn), sc[1]), bs[HD_HC + e]));
        float cv = (mr[2 * HD_HC + e] * sn) * sc[2] + bs[2 * HD_HC + e];
        if (comb_lg) { /* the logits: the op that reads comb forms the matrix (backend.h) */
            if (act) comb[rr * E + e] = cv;
            return;
        }
        if (POLL) { /* the same sums from the first term on (hc_lane_sum1), the first iteration peeled */
            cv = hd_comb_form(cv, base16, i, k, iters, hc_eps);
        } else {
            cv = hd_row_exp(cv, base16, i);
            cv = cv / hc_lane_sum<HD_HC>(cv, base16, i * HD_HC, 1) + hc_eps;
            for (int it = 0; it < iters; it++) {
                if (it > 0) cv /= hc_lane_sum<HD_HC>(cv, base16, i * HD_HC, 1) + hc_eps; /* row i: k ascending */
                cv /= hc_lane_sum<HD_HC>(cv, base16, k, HD_HC) + hc_eps;                  /* column k: i ascending */
            }
        }
        if (act) comb[rr * E + e] = cv;
        if (hs && threadIdx.x == 0) hst[7] = hs_now();
        return;
    }
    if (DIST) { /* y and its norm, a run of 32 positions a warp (banner) */
        if (warp < 2) return;
        int t2 = (int)threadIdx.x - 64;
        if (t2 < nr * HD_HC) {
            int rr = t2 / HD_HC, j = t2 - rr * HD_HC;
            pre[rr][j] = hd_pre(mix[rr], j, nm, width, norm_eps, sc[0], bs[j], hc_eps);
        }
        asm volatile("bar.sync 1, %0;" ::"r"((HD_WARPS - 2) * 32) : "memory"); /* warps 2.. only */
        if (!drun) return;
        float4 v = hd_y_val<POST>(xy[0], spin[POST ? dr : 0], pre[dr], pin.state_bf16);
        float4 *yp = (float4 *)(y + (int64_t)dr * dim) + dc;
        if (!yn.on) {
            hc_y_store((float *)yp, v, out_bf16);
            return;
        }
        if (out_bf16) v.x = d_round_bf16(v.x), v.y = d_round_bf16(v.y), v.z = d_round_bf16(v.z),
                      v.w = d_round_bf16(v.w);
        /* this run's sum of squares (the finisher's nss entry), then the row's rpr entries in lanes */
        float ss = warp_sum(hc_sq4(v));
        unsigned long long *ntg = tg + HD_TG_NORM + dr * 32;
        if (lane == 0) hc_st_tagged(ntg + (dc >> 5), ss, tag);
        unsigned long long w = lane < rpr ? hc_ld_tagged(ntg + lane) : (unsigned long long)tag << 32;
        while (__any_sync(0xffffffffu, (unsigned)(w >> 32) != tag))
            if ((unsigned)(w >> 32) != tag) w = hc_ld_tagged(ntg + lane);
        float s = hc_norm_scale_lane(lane < rpr ? __uint_as_float((unsigned)w) : 0.0f, dim, yn.eps);
        *yp = hc_norm4(v, s, hc_norm_wdec(yn, wy[0], dc), yn.has_w, out_bf16);
        return;
    }
    if (tt < nr * HD_HC) {
        int rr = tt / HD_HC, j = tt - rr * HD_HC;
        pre[rr][j] = hd_pre(mix[rr], j, nm, width, norm_eps, sc[0], bs[j], hc_eps);
    }
    asm volatile("bar.sync 1, %0;" ::"r"(nt) : "memory"); /* the y warps only */
    if (hs && tt == 0) hst[4] = hs_now();
    /* with the norm (dim % 128 == 0: whole warps per run of 32 float4s of one row), the last
     * round's y stays in registers (yv), earlier rounds go through y; each warp's run adds its
     * partial sum of squares to nss */
    float4 yv[HD_YP];
    for (int q0 = tt; q0 < n; q0 += HD_YP * nt) {
        if (q0 != tt) {
#pragma unroll
            for (int p = 0; p < HD_YP; p++) {
                int q = q0 + p * nt;
                if (q >= n) break;
                int rr = q / dq;
                hd_y_load<POST>(xy[p], X, pin, rr, (int64_t)(q - rr * dq) * 4, K, dim);
            }
        }
#pragma unroll
        for (int p = 0; p < HD_YP; p++) {
            int q = q0 + p * nt;
            if (q >= n) break;
            int rr = q / dq;
            float4 v = hd_y_val<POST>(xy[p], spin[POST ? rr : 0], pre[rr], pin.state_bf16);
            if (!yn.on) {
                hc_y_store(y + (int64_t)rr * dim + (int64_t)(q - rr * dq) * 4, v, out_bf16);
                continue;
            }
            if (out_bf16) v.x = d_round_bf16(v.x), v.y = d_round_bf16(v.y), v.z = d_round_bf16(v.z),
                          v.w = d_round_bf16(v.w);
            /* (the compare on v makes the stamp wait for v's inputs) */
            if (hs && p == 0 && q0 == tt && __float_as_uint(v.x) != 0x7fc00001u) atomicMax(hst + 10, hs_now());
            yv[p] = v;
            if (q0 + HD_YP * nt < n) *(float4 *)(y + (int64_t)rr * dim + (int64_t)(q - rr * dq) * 4) = v;
            float ss = warp_sum(hc_sq4(v));
            if (lane == 0) nss[rr][(q - rr * dq) >> 5] = ss;
        }
    }
    if (hs && tt == 0) hst[5] = hs_now();
    if (hs) atomicMax(hst + 11, hs_now());
    if (!yn.on) return;
    asm volatile("bar.sync 1, %0;" ::"r"(nt) : "memory"); /* nss and the earlier rounds' y are written */
    int rs = -1;
    float s = 0.0f;
    for (int q0 = tt; q0 < n; q0 += HD_YP * nt) {
        bool last_round = q0 + HD_YP * nt >= n;
#pragma unroll
        for (int p = 0; p < HD_YP; p++) {
            int q = q0 + p * nt;
            if (q >= n) break;
            int rr = q / dq, c = q - rr * dq;
            if (rr != rs) s = hc_norm_scale(nss[rr], dim, yn.eps), rs = rr; /* warp-uniform */
            float4 *yp = (float4 *)(y + (int64_t)rr * dim) + c;
            float4 v = last_round ? yv[p] : __ldcg(yp);
            *yp = hc_norm4(v, s, hc_norm_wdec(yn, q0 == tt ? wy[p] : hc_norm_wraw(yn, c), c), yn.has_w, out_bf16);
        }
    }
    if (hs && tt == 0) hst[6] = hs_now();
    if (hs) atomicMax(hst + 12, hs_now());
}

/* ----- done counters -----
 * The fused kernel's counters must be 0 when it starts and survive between launches (and
 * graph replays), so they cannot live in the per-op scratch.  One slot of HC_SLOTS device
 * words per CUDA stream: launches on one stream run in order, so a slot is never shared
 * by two launches in flight.  The table only maps a backend's stream to its slot; a stream
 * that finds no free slot takes the two-launch path (same results).
 * k_hc_dec's tagged partials and epoch (POLL) live beside them, for the first HC_PSLOTS
 * streams (zero at load: tag 0 is never a launch's); the later ones take the counter. */
enum { HC_PSLOTS = 8 };
__device__ unsigned d_hc_done[HC_SLOTS][HC_FUSED_ROWS / HC_RB + 1];
__device__ unsigned long long d_hc_tagged[HC_PSLOTS][HD_TGW];
__device__ unsigned d_hc_epoch[HC_PSLOTS][32]; /* a 128-byte line each */
static pthread_mutex_t hc_slot_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    cudaStream_t stream;
    unsigned *dev, *epoch;     /* epoch: NULL past HC_PSLOTS */
    unsigned long long *tagged;
} hc_slot[HC_SLOTS];
static int hc_slot_n;

/* this stream's done counters; *epoch / *tagged: its POLL words, or NULL */
static unsigned *hc_done_counters(dsv4_backend *b, unsigned **epoch, unsigned long long **tagged) {
    cudaStream_t s = CI(b)->stream;
    unsigned *dev = NULL;
    *epoch = NULL, *tagged = NULL;
    pthread_mutex_lock(&hc_slot_lock);
    for (int i = 0; i < hc_slot_n && !dev; i++)
        if (hc_slot[i].stream == s) dev = hc_slot[i].dev, *epoch = hc_slot[i].epoch, *tagged = hc_slot[i].tagged;
    if (!dev && hc_slot_n < HC_SLOTS) {
        void *p = NULL, *pe = NULL, *pt = NULL; /* the symbols of this device (the backend's device is current) */
        dsv4_cuda_seg_end(b); /* first use: no capture in progress while the module is asked */
        if (cudaGetSymbolAddress(&p, d_hc_done) == cudaSuccess) {
            int i = hc_slot_n;
            dev = (unsigned *)p + (size_t)i * (HC_FUSED_ROWS / HC_RB + 1);
            if (i < HC_PSLOTS && cudaGetSymbolAddress(&pe, d_hc_epoch) == cudaSuccess &&
                cudaGetSymbolAddress(&pt, d_hc_tagged) == cudaSuccess) {
                *epoch = (unsigned *)pe + (size_t)i * 32;
                *tagged = (unsigned long long *)pt + (size_t)i * HD_TGW;
            } else {
                cudaGetLastError(); /* not fatal: the done counter */
                *epoch = NULL, *tagged = NULL;
            }
            if (dsv4_cuda_hc_stamp) {
                int one = 1;
                if (cudaMemcpyToSymbol(d_hc_stamp_on, &one, sizeof one) != cudaSuccess) cudaGetLastError();
            }
            hc_slot[i].stream = s;
            hc_slot[i].dev = dev;
            hc_slot[i].epoch = *epoch;
            hc_slot[i].tagged = *tagged;
            hc_slot_n++;
        } else {
            cudaGetLastError(); /* not fatal: the two-launch path */
        }
    }
    pthread_mutex_unlock(&hc_slot_lock);
    return dev;
}

/* DSV4_CUDA_HC_DEC_OLD=1 (A/B, read once): k_hc_dec with the done counter and fences (the
 * kernel before POLL) */
static int hc_dec_old(void) {
    static int v = -1;
    if (v < 0) {
        const char *o = getenv("DSV4_CUDA_HC_DEC_OLD");
        v = o && o[0] == '1';
    }
    return v;
}

/* ----- entry points ----- */

/* k_hc_dec takes the call: hc 4, rows 1..4, an f32 fn, K a multiple of 128 T in at most 128
 * blocks, fn and the buffers it streams (al: their addresses or'ed) 16-byte aligned, and a
 * done counter for this stream (done) */
static int hc_dec_takes(int rows, int hc, int dim, const dweight &wf, uintptr_t al, const unsigned *done) {
    int64_t K = (int64_t)hc * dim;
    return done && hc == HD_HC && rows >= 1 && rows <= HD_ROWS && wf.fmt == DSV4_WF_F32 && dim % 4 == 0 &&
           K % (HC_KT * HD_T) == 0 && K / (HC_KT * HD_T) <= 128 && (((uintptr_t)wf.data | al) & 15) == 0;
}

/* ynorm: also rmsnorm y in place (weights ynw, NULL = unweighted; eps yeps) when the shapes
 * allow it (dim % 128 == 0, dim <= 4096: norm.cu's k_rmsnorm_vec, whose bits it gives; y
 * 16-byte aligned).  Returns 1 when y was normed, 0 when the caller must run rmsnorm.
 * pin (hc_post_pre_norm, NULL otherwise): X is pin->Xout, formed in k_hc_dec from pin's
 * inputs (the caller has checked that k_hc_dec takes the call: hc_post_fits). */
static int hc_common(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc, int dim,
                     const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                     float norm_eps, float hc_eps, int gemm_bf16, int out_bf16, int head, int ynorm,
                     const dsv4_weight *ynw, float yeps, const hc_postin *pin) {
    dweight wf, wb, ws;
    hc_ynorm yn;
    memset(&yn, 0, sizeof yn);
    if (rows <= 0 || dim <= 0 || dsv4_cuda_weight(b, fn, &wf) || dsv4_cuda_weight(b, base, &wb) || dsv4_cuda_weight(b, scale, &ws))
        return 1;
    if (hc < 1 || hc > 16) {
        dsv4_cuda_fail(b, "hc_pre/hc_head: hc over 16", __FILE__, __LINE__, cudaSuccess);
        return 1;
    }
    int nm = head ? hc : (2 + hc) * hc;
    int64_t K = (int64_t)hc * dim;
    /* K-slices of a multiple of 128 columns (one warp sweep of 16-byte vectors), enough
     * of them that ~2 blocks per SM run; the partials are summed in split order */
    int groups = (rows + HC_RB - 1) / HC_RB;
    int64_t chunks = (K + HC_KT - 1) / HC_KT, want = (264 + groups - 1) / groups;
    if (want > chunks) want = chunks;
    if (want < 1) want = 1;
    int64_t kspan = (chunks + want - 1) / want * HC_KT;
    int splits = (int)((K + kspan - 1) / kspan);
    unsigned *epoch = NULL;
    unsigned long long *tagged = NULL;
    unsigned *done = rows <= HC_FUSED_ROWS ? hc_done_counters(b, &epoch, &tagged) : NULL;
    float *xd = pin ? pin->Xout : (float *)dsv4_cuda_in(b, X, sizeof(float) * rows * K);
    /* room for either split: k_hc_dec has up to 128 */
    float *part = (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * (nm + 1) * (splits > 128 ? splits : 128));
    float *yd = (float *)dsv4_cuda_out(b, y, sizeof(float) * rows * dim);
    float *pd = head ? NULL : (float *)dsv4_cuda_out(b, post, sizeof(float) * rows * hc);
    float *cd = head ? NULL : (float *)dsv4_cuda_out(b, comb, sizeof(float) * rows * hc * hc);
    if (!xd || !part || !yd || (!head && (!pd || !cd))) return 1;
    yn.on = ynorm && dim % 128 == 0 && dim <= 4096 && ((uintptr_t)yd & 15) == 0;
    yn.has_w = ynw != NULL;
    yn.eps = yeps;
    if (yn.on && ynw && dsv4_cuda_weight(b, ynw, &yn.w)) return 1;
    if (yn.on && ynw)
        yn.vw = yn.w.fmt == DSV4_WF_F32 && ((uintptr_t)yn.w.data & 15) == 0    ? 1
                : yn.w.fmt == DSV4_WF_BF16 && ((uintptr_t)yn.w.data & 7) == 0 ? 2
                                                                                : 0;
    uintptr_t al = (uintptr_t)xd | (uintptr_t)yd;
    if (pin) al |= (uintptr_t)pin->o | (uintptr_t)pin->R | (uintptr_t)pin->mc.y;
    int fast = hc_dec_takes(rows, hc, dim, wf, al, done);
    if (pin && !fast) {
        dsv4_cuda_fail(b, "hc_post_pre_norm: k_hc_dec does not take this call (internal)", __FILE__, __LINE__,
                       cudaSuccess);
        return 1;
    }
    if (fast) {
        int g = (int)(K / (HC_KT * HD_T));
        hc_postin pi;
        memset(&pi, 0, sizeof pi);
        if (pin) pi = *pin, xd = NULL; /* k_hc_dec<.., 1> reads no X: it forms it */
        const float *wd = (const float *)wf.data;
        int post = !pin ? 0 : pin->mc.y ? 2 : 1; /* 2: the MoE's combine taken (cu_hc_post_pre_norm) */
        /* DSV4_CUDA_HC_COMB=2: that launch without PDL, so its blocks do not sit resident beside the MoE's
         * down half (they then start when it has ended) */
        int pdl = !(post == 2 && CI(b)->hc_comb == 2);
        /* DSV4_CUDA_HC_DIST=1: y and its norm over the blocks (k_hc_dec's banner); each block has at most
         * HD_WARPS - 2 runs of 128 columns */
        int dist = CI(b)->hc_dist && !head && post != 2 && dim % 128 == 0 && dim <= 4096 &&
                   (rows * (dim / 128) + g - 1) / g <= HD_WARPS - 2;
        if (epoch && g <= HD_PSPLITS && !hc_dec_old() && dist) {
            dsv4_launch_pdl(pdl, post ? k_hc_dec<HD_T, 1, 1, 1> : k_hc_dec<HD_T, 1, 0, 1>, g, HD_THREADS, 0,
                            CI(b)->stream, yd, pd, cd, part, done, tagged, epoch, xd, rows, dim, wd, nm, g, wb, ws,
                            iters, norm_eps, hc_eps, gemm_bf16, out_bf16, head, yn, pi);
            CI(b)->hc_dist_n++;
        } else if (epoch && g <= HD_PSPLITS && !hc_dec_old())
            dsv4_launch_pdl(pdl, post == 2 ? k_hc_dec<HD_T, 1, 2> : post ? k_hc_dec<HD_T, 1, 1> : k_hc_dec<HD_T, 1, 0>, g,
                        HD_THREADS, 0, CI(b)->stream, yd, pd, cd, part, done, tagged, epoch, xd, rows, dim, wd, nm, g,
                        wb, ws, iters, norm_eps, hc_eps, gemm_bf16, out_bf16, head, yn, pi);
        else
            dsv4_launch_pdl(pdl, post == 2 ? k_hc_dec<HD_T, 0, 2> : post ? k_hc_dec<HD_T, 0, 1> : k_hc_dec<HD_T, 0, 0>, g,
                        HD_THREADS, 0, CI(b)->stream, yd, pd, cd, part, done, nullptr, nullptr, xd, rows, dim, wd, nm,
                        g, wb, ws, iters, norm_eps, hc_eps, gemm_bf16, out_bf16, head, yn, pi);
        if (CKL(b)) return 1;
    } else if (done) {
        dsv4_launch(k_hc_fused, dim3((unsigned)splits, (unsigned)groups), HC_THREADS, 0, CI(b)->stream, yd, pd, cd,
                    part, done, xd, rows, hc, dim, wf, nm, kspan, splits, wb, ws, iters, norm_eps, hc_eps, gemm_bf16,
                    out_bf16, head, yn);
        if (CKL(b)) return 1;
    } else {
        dsv4_launch(k_hc_part, dim3((unsigned)splits, (unsigned)groups), HC_THREADS, 0, CI(b)->stream, part, xd, rows,
                    K, wf, nm, kspan, splits, gemm_bf16);
        if (CKL(b)) return 1;
        dsv4_launch(k_hc_fin, rows, HC_THREADS, 0, CI(b)->stream, yd, pd, cd, part, splits, xd, hc, dim, wb, ws, iters,
                    norm_eps, hc_eps, out_bf16, head, yn);
        if (CKL(b)) return 1;
    }
    if (!head) {
        dsv4_cuda_commit(b, post, pd, sizeof(float) * rows * hc);
        dsv4_cuda_commit(b, comb, cd, sizeof(float) * rows * hc * hc);
        if (iters & DSV4_HC_COMB_LOGITS) { /* comb's reader forms the matrix (cu_hc_post_pre_norm) */
            CI(b)->hc_lg_ptr = comb;
            CI(b)->hc_lg_op = CI(b)->op_seq;
        }
    }
    dsv4_cuda_commit(b, y, yd, sizeof(float) * rows * dim);
    return yn.on || !ynorm;
}

void cu_hc_pre(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc, int dim,
               const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters, float norm_eps,
               float hc_eps, int gemm_bf16, int out_bf16) {
    dsv4_cuda_op_begin(b);
    hc_common(b, y, post, comb, X, rows, hc, dim, fn, base, scale, iters, norm_eps, hc_eps, gemm_bf16, out_bf16, 0, 0,
              NULL, 0.0f, NULL);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_HC_PRE);
}

/* hc_pre, then y rmsnormed in the same kernel (bit for bit cu_rmsnorm's result), or by
 * cu_rmsnorm itself where the shapes do not allow it; counted as hc_pre in profiles */
void cu_hc_pre_norm(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc, int dim,
                    const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                    float norm_eps, float hc_eps, int gemm_bf16, int out_bf16, const dsv4_weight *y_norm,
                    float y_eps) {
    dsv4_cuda_op_begin(b);
    int normed = hc_common(b, y, post, comb, X, rows, hc, dim, fn, base, scale, iters, norm_eps, hc_eps, gemm_bf16,
                           out_bf16, 0, 1, y_norm, y_eps, NULL);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_HC_PRE);
    if (!normed) cu_rmsnorm(b, y, y, rows, dim, y_norm, y_eps, out_bf16);
}

void cu_hc_head(dsv4_backend *b, float *y, const float *X, int rows, int hc, int dim, const dsv4_weight *fn,
                const dsv4_weight *base, const dsv4_weight *scale, float norm_eps, float hc_eps, int gemm_bf16,
                int out_bf16) {
    dsv4_cuda_op_begin(b);
    hc_common(b, y, NULL, NULL, X, rows, hc, dim, fn, base, scale, 0, norm_eps, hc_eps, gemm_bf16, out_bf16, 1, 0, NULL,
              0.0f, NULL);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_HC_HEAD);
}

/* ----- hc_post ----- */
/* thread (r, k, q): outputs d = 4q .. 4q+3 of stream k of row r (dq = dim / 4) */
__global__ void k_hc_post4(float *Xout, const float *__restrict__ o, const float *__restrict__ R,
                           const float *__restrict__ post, const float *__restrict__ comb, int rows, int hc, int dq,
                           int state_bf16) {
    pdl_enter();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)rows * hc * dq) return;
    int q = (int)(t % dq), k = (int)((t / dq) % hc);
    int64_t r = t / ((int64_t)hc * dq), dim = (int64_t)dq * 4;
    const float *C = comb + r * hc * hc, *Rr = R + r * hc * dim + (int64_t)q * 4;
    float4 ov = __ldg((const float4 *)(o + r * dim) + q);
    float4 v = hc_post_begin(__ldg(post + r * hc + k), ov);
#pragma unroll 4
    for (int j = 0; j < hc; j++) v = hc_post_step(v, __ldg(C + j * hc + k), __ldg((const float4 *)(Rr + (int64_t)j * dim)));
    *(float4 *)(Xout + (r * hc + k) * dim + (int64_t)q * 4) = hc_post_round(v, state_bf16);
}

/* any dim: one thread per output element */
__global__ void k_hc_post(float *Xout, const float *o, const float *R, const float *post, const float *comb, int rows,
                          int hc, int dim, int state_bf16) {
    pdl_enter();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)rows * hc * dim) return;
    int d = (int)(t % dim);
    int k = (int)((t / dim) % hc);
    int64_t r = t / ((int64_t)hc * dim);
    const float *C = comb + r * hc * hc, *Rr = R + r * hc * dim;
    float v = post[r * hc + k] * o[r * dim + d];
    for (int j = 0; j < hc; j++) v += C[j * hc + k] * Rr[(int64_t)j * dim + d];
    Xout[t] = state_bf16 ? d_round_bf16(v) : v;
}

/* comb_dev: comb is this op's device scratch (hc_comb_scratch), not a caller's buffer */
static void hc_post_launch(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post,
                           const float *comb, int comb_dev, int rows, int hc, int dim, int state_bf16) {
    size_t n = (size_t)rows * hc * dim;
    float *od = (float *)dsv4_cuda_in(b, o, sizeof(float) * rows * dim);
    float *rd = (float *)dsv4_cuda_in(b, R, sizeof(float) * n);
    float *pd = (float *)dsv4_cuda_in(b, post, sizeof(float) * rows * hc);
    float *cd = comb_dev ? (float *)comb : (float *)dsv4_cuda_in(b, comb, sizeof(float) * rows * hc * hc);
    float *xd = (float *)dsv4_cuda_out(b, Xout, sizeof(float) * n);
    if (!od || !rd || !pd || !cd || !xd) return;
    if (dim % 4 == 0 && (((uintptr_t)od | (uintptr_t)rd | (uintptr_t)xd) & 15) == 0) {
        size_t nq = n / 4;
        dsv4_launch(k_hc_post4, (unsigned)((nq + 127) / 128), 128, 0, CI(b)->stream, xd, od, rd, pd, cd, rows, hc,
                    dim / 4, state_bf16);
    } else {
        dsv4_launch(k_hc_post, (unsigned)((n + 255) / 256), 256, 0, CI(b)->stream, xd, od, rd, pd, cd, rows, hc, dim,
                    state_bf16);
    }
    if (CKL(b)) return;
    dsv4_cuda_commit(b, Xout, xd, sizeof(float) * n);
}

void cu_hc_post(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post, const float *comb,
                int rows, int hc, int dim, int state_bf16) {
    dsv4_cuda_op_begin(b);
    if (rows > 0 && hc > 0 && dim > 0) hc_post_launch(b, Xout, o, R, post, comb, 0, rows, hc, dim, state_bf16);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_HC_POST);
}

/* ----- hc_post then the next hc_pre_norm (backend.h hc_post_pre_norm) -----
 * k_hc_dec with POST where it takes the call (below), one launch instead of k_hc_post4 +
 * k_hc_dec; otherwise the two ops.  Counted as hc_pre in profiles (as hc_pre_norm). */

/* k_hc_dec<.., 1> takes the call: its shapes, and hc_post's buffers device memory (it reads
 * and writes them in place: no staging), o, R and Xout 16-byte aligned (y: device memory
 * aligned, or host, staged in aligned scratch) */
static int hc_post_fits(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post_in,
                        const float *comb_in, float *y, int rows, int hc, int dim, const dsv4_weight *fn) {
    dweight wf;
    unsigned *epoch = NULL;
    unsigned long long *tagged = NULL;
    if (rows < 1 || rows > HD_ROWS || hc != HD_HC || CI(b)->failed) return 0;
    if (!dsv4_cuda_is_dev(b, Xout) || !dsv4_cuda_is_dev(b, o) || !dsv4_cuda_is_dev(b, R) ||
        !dsv4_cuda_is_dev(b, post_in) || !dsv4_cuda_is_dev(b, comb_in))
        return 0;
    uintptr_t al = (uintptr_t)Xout | (uintptr_t)o | (uintptr_t)R | (dsv4_cuda_is_dev(b, y) ? (uintptr_t)y : 0);
    if (dsv4_cuda_weight(b, fn, &wf)) return 0;
    return hc_dec_takes(rows, hc, dim, wf, al, hc_done_counters(b, &epoch, &tagged));
}

/* comb_in's Sinkhorn inputs (hc_pre's logits, DSV4_HC_COMB_LOGITS) -> the matrix, one thread a
 * row in the CPU's order (hc_pre's arithmetic: the same bits as hd_comb_form's lanes, whose sums
 * add the same terms in the same order) */
__global__ void k_hc_comb_form(float *out, const float *in, int rows, int hc, int iters, float hc_eps) {
    pdl_enter();
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float *C = out + (int64_t)r * hc * hc;
    for (int e = 0; e < hc * hc; e++) C[e] = in[(int64_t)r * hc * hc + e];
    for (int j = 0; j < hc; j++) { /* row softmax, + eps */
        float mx = -INFINITY, s = 0.0f;
        for (int k = 0; k < hc; k++) mx = fmaxf(mx, C[j * hc + k]);
        for (int k = 0; k < hc; k++) s += (C[j * hc + k] = expf(C[j * hc + k] - mx));
        for (int k = 0; k < hc; k++) C[j * hc + k] = C[j * hc + k] / s + hc_eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0)
            for (int j = 0; j < hc; j++) { /* rows: k ascending */
                float s = 0.0f;
                for (int k = 0; k < hc; k++) s += C[j * hc + k];
                for (int k = 0; k < hc; k++) C[j * hc + k] /= s + hc_eps;
            }
        for (int k = 0; k < hc; k++) { /* columns: j ascending */
            float s = 0.0f;
            for (int j = 0; j < hc; j++) s += C[j * hc + k];
            for (int j = 0; j < hc; j++) C[j * hc + k] /= s + hc_eps;
        }
    }
}

/* the matrix of comb_in's logits in this op's scratch (NULL on failure) */
static const float *hc_comb_scratch(dsv4_backend *b, const float *comb_in, int rows, int hc, int iters, float hc_eps) {
    size_t n = (size_t)rows * hc * hc;
    const float *in = (const float *)dsv4_cuda_in(b, comb_in, sizeof(float) * n);
    float *out = (float *)dsv4_cuda_scratch(b, sizeof(float) * n);
    if (!in || !out) return NULL;
    dsv4_launch(k_hc_comb_form, (unsigned)((rows + 127) / 128), 128, 0, CI(b)->stream, out, in, rows, hc, iters,
                hc_eps);
    return CKL(b) ? NULL : out;
}

long dsv4_cuda_hc_dist_count(dsv4_backend *b) {
    return CI(b)->hc_dist_n;
}

void dsv4_cuda_hc_lg_counts(dsv4_backend *b, long *early, long *late) {
    *early = CI(b)->hc_lg_early;
    *late = CI(b)->hc_lg_late;
}

void cu_hc_post_pre_norm(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post_in,
                         const float *comb_in, int state_bf16, float *y, float *post, float *comb, int rows, int hc,
                         int dim, const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                         float norm_eps, float hc_eps, int gemm_bf16, int out_bf16, const dsv4_weight *y_norm,
                         float y_eps) {
    int lg_in = (iters & DSV4_HC_COMBIN_LOGITS) != 0;
    iters &= ~DSV4_HC_COMBIN_LOGITS;
    if (!hc_post_fits(b, Xout, o, R, post_in, comb_in, y, rows, hc, dim, fn)) {
        /* the two ops; comb_in's logits formed into scratch first (k_hc_comb_form) */
        dsv4_cuda_op_begin(b);
        const float *cm = comb_in;
        if (lg_in && rows > 0 && hc > 0) cm = hc_comb_scratch(b, comb_in, rows, hc, iters & DSV4_HC_ITERS, hc_eps);
        if (cm && rows > 0 && hc > 0 && dim > 0)
            hc_post_launch(b, Xout, o, R, post_in, cm, cm != comb_in, rows, hc, dim, state_bf16);
        dsv4_cuda_op_end(b, DSV4_CUDA_OP_HC_POST);
        cu_hc_pre_norm(b, y, post, comb, Xout, rows, hc, dim, fn, base, scale, iters, norm_eps, hc_eps, gemm_bf16,
                       out_bf16, y_norm, y_eps);
        return;
    }
    /* the moe op's combine of o, if it left it pending (moe.cu "the combine into hc"): taken before
     * op_begin, which would launch it */
    moe_comb mc;
    if (!dsv4_cuda_comb_take(b, o, rows, dim, &mc)) memset(&mc, 0, sizeof mc);
    dsv4_cuda_op_begin(b);
    cuda_impl *c = CI(b);
    /* comb_in's logits: formed in k_hc_dec, before its PDL wait unless their writer was the op
     * just before this one (it may then still be running: common.cuh's pre-wait rule) */
    int lg = !lg_in ? 0 : comb_in == c->hc_lg_ptr && c->op_seq - c->hc_lg_op <= 1 ? 1 : 2;
    c->hc_lg_early += lg == 2, c->hc_lg_late += lg == 1;
    hc_postin pin = {Xout, o, R, post_in, comb_in, state_bf16, lg, mc, dsv4_cuda_l2pf};
    int normed = hc_common(b, y, post, comb, Xout, rows, hc, dim, fn, base, scale, iters, norm_eps, hc_eps, gemm_bf16,
                           out_bf16, 0, 1, y_norm, y_eps, &pin);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_HC_PRE);
    if (!normed) cu_rmsnorm(b, y, y, rows, dim, y_norm, y_eps, out_bf16);
}

/* DSV4_CUDA_HC_STAMP=1: k_hc_dec's phase stamps (us after block 0 passed its wait), the calls in time order */
static double hs_us(unsigned long long t, double w) { /* us after w; -1 for a stamp never written */
    return t ? ((double)t - w) / 1e3 : -1.0;
}
static int hs_cmp(const void *a, const void *b) {
    unsigned long long x = ((const unsigned long long *)a)[1], y = ((const unsigned long long *)b)[1];
    return x < y ? -1 : x > y;
}
void dsv4_cuda_hc_stamp_dump(void) {
    if (!dsv4_cuda_hc_stamp) return;
    static unsigned long long h[HS_CALLS][HS_N];
    if (cudaMemcpyFromSymbol(h, d_hc_stamp, sizeof h) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    int n = 0;
    for (int i = 0; i < HS_CALLS; i++)
        if (h[i][1]) memmove(h[n++], h[i], sizeof h[i]);
    qsort(h, (size_t)n, sizeof h[0], hs_cmp);
    fprintf(stderr, "hc_stamp: %d calls; us after block 0's wait: start, last block's wait, last partials, sums, "
                    "pre, y, norm, sinkhorn | post rows | us since the previous call's norm\n", n);
    for (int i = 0; i < n; i++) {
        double w = (double)h[i][1];
        fprintf(stderr, "hc_stamp %4d: %7.2f %6.2f %6.2f %6.2f %6.2f %6.2f %6.2f %6.2f | %d %d | %8.2f\n", i,
                ((double)h[i][0] - w) / 1e3, hs_us(h[i][9], w), hs_us(h[i][2], w), ((double)h[i][3] - w) / 1e3,
                hs_us(h[i][4], w), hs_us(h[i][5], w), hs_us(h[i][6], w), hs_us(h[i][7], w), (int)(h[i][8] & 15),
                (int)(h[i][8] >> 4), i ? (w - (double)h[i - 1][6]) / 1e3 : 0.0);
        fprintf(stderr, "hc_stamp %4d+ last y thread's first value %6.2f, its y %6.2f, last thread's end %6.2f\n", i,
                hs_us(h[i][10], w), hs_us(h[i][11], w), hs_us(h[i][12], w));
    }
}
