/* tools/device/moe_probe.cu: can the batch-1 MoE gate/up stream its MXFP4 experts near the copy
 * rate with exact fp32 math, if it streams the way stream_probe's best pattern does (plain 16-byte
 * loads from registers, many in flight, a persistent grid) instead of k_moe_b1r's per-thread
 * cp.async stages through shared memory?  k_moe_b1r takes ~31.5 us for a Flash layer's gate/up
 * (6 routed MXFP4 experts + the FP8 shared one, ~70 MB; ncu: 16.9 M warp instructions, issue
 * 51 % busy), its trivial-math diagnostic ~22 us, and stream_probe streams 70 MB in 17.2 us.
 * This probe runs the routed part alone (6 experts x w1, w3 [2048 x 4096] e2m1 codes + e8m0
 * scales of 32: 50.3 + 3.1 MB), with the same exact arithmetic as k_moe_b1r's DEC 2 decode
 * (e2m1 -> e4m3 bytes by 5 integer operations a word of 8 codes, cvt e4m3x2 -> f16x2, f16 -> f32,
 * fp32 fma chain over a 32-code block, times the block's power-of-two scale):
 *   k_gu<NB, BPS, MATH>: a warp takes one feature at a time (w1 row and w3 row: 2 x 2 KB), lane l
 *   the 16-byte vectors l, l + 32, l + 64, l + 96 of both rows (8 loads, 8 scale bytes); NB = 2
 *   issues the next feature's loads before this one's math (register double buffer); x in shared
 *   memory, 32-column blocks padded to 36 floats (float4 reads without bank conflicts); warp shuffles sum the
 *   lanes.  BPS blocks of 256 threads per SM, a persistent grid.  MATH 0 only folds the bytes.
 *   k_gh<BPS>: the same in half features, the next half's loads in flight during this half's math.
 * Results are checked against a one-thread-a-row reference kernel (rel 1e-5).  Each of a run's 16
 * launches reads 6 other experts of 96 (805 MB), so nothing comes from L2.  Printed: us a launch
 * (one graph of 16 launches, the fastest of 5), GB/s of codes + scales, % of the D2D copy rate.
 *   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/device/moe_probe.cu -o moe_probe
 *   ./moe_probe
 * Runs on the H200 (2026-12-04, docs/PERFORMANCE.md, stop 27; every checked variant within 1.21e-7 of
 * the reference): no math 14.3-15.7 us (81-89 % of copy); k_gu NB 1 at 2 / 3 / 4 blocks per SM
 * 22.0-22.5 / 20.1-21.2 / 22.2-22.4 us; NB 2 spilled (44-62 us at 2 blocks, 19.8 at 1 with 231
 * registers); k_gh 18.9 / 19.2 / 20.1 us at 2 / 3 / 4 blocks (67 / 66 / 63 % of copy).  Moved into
 * k_moe_b1r (gate/up's MXFP4 chunks at 2 blocks per SM, branch moe-s1), it was slower than b1f_run in the
 * 20-layer trace (gate/up 648 against 611 us a step exposed): a chunk of 32 features a block on a grid of
 * the real blocks is not the probe's persistent grid, and the FP8 shared expert's blocks in the same
 * launch ran at 2 blocks per SM too.
 * (The first run, 05:15Z, loaded each lane's 4 scale bytes of a row one by one; the second, 05:21Z, and
 * this file load the row's 128 bytes as one word a lane.)
 * After these runs the file was refactored without a device (its loads from probe.cuh, the e4m3 pairs
 * by cuda_fp8.h's conversion, a kernel argument struct, shared row and x helpers): not rerun since. */
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>

#include "probe.cuh"

enum { DIM = 4096, INTER = 2048, NSEL = 6, NEXP = 96, RUN = 16 };
#define ROWB (DIM / 2)        /* code bytes a row */
#define SROW (DIM / 32)       /* scale bytes a row */
#define EXPB ((size_t)2 * INTER * ROWB)
#define EXPS ((size_t)2 * INTER * SROW)
#define XPAD 36               /* floats a 32-column block of x takes in shared memory */

/* the 8 codes of word w against x columns c0..c0+7 (x8: those floats), added to a chain: values
 * times 2^-6 (the e4m3 bytes' exponent offset), the caller scales the block's sum */
__device__ __forceinline__ float word_dot(uint32_t w, const float4 &xa, const float4 &xb, float acc) {
    uint32_t lo = ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4); /* codes 0, 2, 4, 6 */
    uint32_t hi = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);        /* codes 1, 3, 5, 7 */
    float2 l0 = probe_e4m3x2_f32<0>(lo), l1 = probe_e4m3x2_f32<1>(lo);
    float2 h0 = probe_e4m3x2_f32<0>(hi), h1 = probe_e4m3x2_f32<1>(hi);
    acc = fmaf(l0.x, xa.x, acc); /* code 0 */
    acc = fmaf(h0.x, xa.y, acc); /* code 1 */
    acc = fmaf(l0.y, xa.z, acc); /* code 2 */
    acc = fmaf(h0.y, xa.w, acc);
    acc = fmaf(l1.x, xb.x, acc);
    acc = fmaf(h1.x, xb.y, acc);
    acc = fmaf(l1.y, xb.z, acc);
    acc = fmaf(h1.y, xb.w, acc);
    return acc;
}

/* part[r] + the 32 codes of vector vec of row r (v0, v1) against x columns 32 vec.. (x rows of 32
 * padded to XPAD floats: the lanes' float4 reads on other banks) */
__device__ __forceinline__ void vec_part(const uint4 &v0, const uint4 &v1, const float *xs, int vec, float (&part)[2]) {
    const uint32_t w[2][4] = {{v0.x, v0.y, v0.z, v0.w}, {v1.x, v1.y, v1.z, v1.w}};
#pragma unroll
    for (int t = 0; t < 4; t++) {
        const float4 xa = *(const float4 *)(xs + vec * XPAD + 8 * t);
        const float4 xb = *(const float4 *)(xs + vec * XPAD + 8 * t + 4);
#pragma unroll
        for (int r = 0; r < 2; r++) part[r] = word_dot(w[r][t], xa, xb, part[r]);
    }
}

/* x into the block's shared rows of XPAD floats a 32-column block, then a barrier */
__device__ __forceinline__ void stage_x(float *xs, const float *x) {
    for (int i = threadIdx.x; i < DIM / 4; i += blockDim.x) *(float4 *)(xs + (i / 8) * XPAD + (i % 8) * 4) = ((const float4 *)x)[i];
    __syncthreads();
}

struct feat_buf {
    uint4 v[2][4];
    uint32_t s[2]; /* scale bytes 4 lane .. 4 lane + 3 of each row (shuffled out at the math) */
};

/* the e8m0 code of vector lane + 32 q of a row whose 128 scale bytes lie 4 a lane in w */
__device__ __forceinline__ uint32_t scale_code(uint32_t w, int lane, int q) {
    return (__shfl_sync(0xffffffffu, w, (lane >> 2) + 8 * q) >> (8 * (lane & 3))) & 255u;
}

/* row r (0: w1, 1: w3) of feature f's codes and scales */
__device__ __forceinline__ void feat_rows(const uint8_t *codes, const uint8_t *scales, const int *eids, int f, int r,
                                          const uint8_t *&row, const uint8_t *&srow) {
    const size_t e = (size_t)eids[f / INTER], i = (size_t)(f % INTER);
    row = codes + e * EXPB + ((size_t)r * INTER + i) * ROWB;
    srow = scales + e * EXPS + ((size_t)r * INTER + i) * SROW;
}

__device__ __forceinline__ void feat_load(feat_buf &b, const uint8_t *codes, const uint8_t *scales,
                                          const int *eids, int f, int lane) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const uint8_t *row, *srow;
        feat_rows(codes, scales, eids, f, r, row, srow);
#pragma unroll
        for (int q = 0; q < 4; q++) b.v[r][q] = probe_ld_stream(row + (size_t)(lane + 32 * q) * 16);
        b.s[r] = __ldg((const unsigned int *)srow + lane);
    }
}

template <int MATH>
__device__ __forceinline__ void feat_math(const feat_buf &b, const float *xs, float *out, uint32_t *fold, int f,
                                          int lane) {
    float acc[2] = {0.0f, 0.0f};
    uint32_t x_ = 0;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int vec = lane + 32 * q; /* columns 32 vec .. */
        float part[2] = {0.0f, 0.0f};
        if (MATH) {
            vec_part(b.v[0][q], b.v[1][q], xs, vec, part);
#pragma unroll
            for (int r = 0; r < 2; r++) { /* e8m0 code c: 2^(c - 127), times 2^6 for the bytes' offset */
                const uint32_t c = scale_code(b.s[r], lane, q);
                acc[r] = fmaf(part[r], __uint_as_float((c + 6u) << 23), acc[r]);
            }
            /* keeps the compiler from hoisting the next blocks' x reads (registers: NB 2 spilled) */
            asm volatile("" ::: "memory");
        } else {
#pragma unroll
            for (int r = 0; r < 2; r++) x_ ^= b.v[r][q].x ^ b.v[r][q].y ^ b.v[r][q].z ^ b.v[r][q].w ^ b.s[r];
        }
    }
    if (MATH) {
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);
            acc[1] += __shfl_xor_sync(0xffffffffu, acc[1], o);
        }
        if (lane == 0) out[2 * f] = acc[0], out[2 * f + 1] = acc[1];
    } else {
        for (int o = 16; o; o >>= 1) x_ ^= __shfl_xor_sync(0xffffffffu, x_, o);
        if (lane == 0 && x_ == 0x12345678u) fold[0] = x_;
    }
}

/* a launch's work: the codes and scales of all experts, this launch's expert ids (NSEL from launch's), x,
 * the outputs [feature][gate, up], the fold word of MATH 0 */
struct gu_args {
    const uint8_t *codes, *scales;
    const int *eids;
    const float *x;
    float *out;
    uint32_t *fold;
};

/* where a warp starts: lane, global warp gw of nw, features nf */
struct wpos {
    int lane, gw, nw, nf;
};
__device__ __forceinline__ wpos wpos_here() {
    return wpos{(int)(threadIdx.x & 31), (int)(blockIdx.x * 8 + (threadIdx.x >> 5)), (int)(gridDim.x * 8), NSEL * INTER};
}

template <int NB, int BPS, int MATH>
__global__ void __launch_bounds__(256, BPS) k_gu(gu_args ga) {
    __shared__ __align__(16) float xs[DIM / 32 * XPAD];
    const uint8_t *codes = ga.codes, *scales = ga.scales;
    const int *eids = ga.eids;
    const float *x = ga.x;
    float *out = ga.out;
    uint32_t *fold = ga.fold;
    const wpos w = wpos_here();
    const int lane = w.lane, gw = w.gw, nw = w.nw, nf = w.nf;
    feat_buf a, bb;
    int f = gw;
    if (f < nf) feat_load(a, codes, scales, eids, f, lane);
    stage_x(xs, x);
    if (NB == 1) {
        for (; f < nf; f += nw) {
            if (f != gw) feat_load(a, codes, scales, eids, f, lane);
            feat_math<MATH>(a, xs, out, fold, f, lane);
        }
    } else {
        for (; f < nf; f += 2 * nw) {
            if (f + nw < nf) feat_load(bb, codes, scales, eids, f + nw, lane);
            feat_math<MATH>(a, xs, out, fold, f, lane);
            if (f + nw >= nf) break;
            if (f + 2 * nw < nf) feat_load(a, codes, scales, eids, f + 2 * nw, lane);
            feat_math<MATH>(bb, xs, out, fold, f + nw, lane);
        }
    }
}

/* k_gh<BPS>: the same work in half features (a row pair's vectors q = 2h, 2h + 1 of each lane), the
 * next half's 4 vectors and scale words in flight while this half's math runs (two buffers of 16 + 2
 * registers instead of two of 34) */
struct half_buf {
    uint4 v[2][2];
    uint32_t s[2];
};

__device__ __forceinline__ void half_load(half_buf &b, const uint8_t *codes, const uint8_t *scales, const int *eids,
                                          int f, int h, int lane) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const uint8_t *row, *srow;
        feat_rows(codes, scales, eids, f, r, row, srow);
#pragma unroll
        for (int q = 0; q < 2; q++) b.v[r][q] = probe_ld_stream(row + (size_t)(lane + 32 * (2 * h + q)) * 16);
        b.s[r] = h == 0 ? __ldg((const unsigned int *)srow + lane) : b.s[r];
    }
}

__device__ __forceinline__ void half_math(const half_buf &b, const uint32_t (&sw)[2], const float *xs, float (&acc)[2],
                                          int h, int lane) {
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int qq = 2 * h + q, vec = lane + 32 * qq;
        float part[2] = {0.0f, 0.0f};
        vec_part(b.v[0][q], b.v[1][q], xs, vec, part);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const uint32_t c = scale_code(sw[r], lane, qq);
            acc[r] = fmaf(part[r], __uint_as_float((c + 6u) << 23), acc[r]);
        }
    }
}

template <int BPS>
__global__ void __launch_bounds__(256, BPS) k_gh(gu_args ga) {
    __shared__ __align__(16) float xs[DIM / 32 * XPAD];
    const wpos w = wpos_here();
    const int lane = w.lane, gw = w.gw, nw = w.nw, nf = w.nf;
    const uint8_t *codes = ga.codes, *scales = ga.scales;
    const int *eids = ga.eids;
    const float *x = ga.x;
    float *out = ga.out;
    half_buf a, bb;
    uint32_t sw[2];
    if (gw < nf) half_load(a, codes, scales, eids, gw, 0, lane);
    stage_x(xs, x);
    for (int f = gw; f < nf; f += nw) {
        float acc[2] = {0.0f, 0.0f};
        sw[0] = a.s[0], sw[1] = a.s[1];
        bb.s[0] = a.s[0], bb.s[1] = a.s[1];
        half_load(bb, codes, scales, eids, f, 1, lane);
        half_math(a, sw, xs, acc, 0, lane);
        if (f + nw < nf) half_load(a, codes, scales, eids, f + nw, 0, lane);
        half_math(bb, sw, xs, acc, 1, lane);
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);
            acc[1] += __shfl_xor_sync(0xffffffffu, acc[1], o);
        }
        if (lane == 0) out[2 * f] = acc[0], out[2 * f + 1] = acc[1];
    }
}

__device__ float e2m1_val(uint32_t c) {
    const float m[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    return (c & 8) ? -m[c & 7] : m[c & 7];
}

/* one thread a (feature, half): the plain sum, in double, for the check */
__global__ void k_ref(const uint8_t *codes, const uint8_t *scales, const int *eids, const float *x, float *out) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= NSEL * INTER * 2) return;
    int f = t / 2, r = t % 2, j = f / INTER, i = f % INTER;
    size_t e = (size_t)eids[j];
    const uint8_t *row = codes + e * EXPB + ((size_t)r * INTER + i) * ROWB;
    const uint8_t *srow = scales + e * EXPS + ((size_t)r * INTER + i) * SROW;
    double acc = 0.0;
    for (int k = 0; k < DIM; k++) {
        uint32_t by = row[k / 2], c = k & 1 ? by >> 4 : by & 15;
        acc += (double)e2m1_val(c) * ldexp(1.0, (int)srow[k / 32] - 127) * x[k];
    }
    out[t] = (float)acc;
}

__global__ void k_fill(uint8_t *p, size_t n, uint32_t seed, int scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        p[i] = scale ? (uint8_t)(118 + h % 8) : (uint8_t)h; /* scales 2^-9 .. 2^-2 */
    }
}

typedef void (*kfn)(gu_args);

int main() {
    cudaDeviceProp prop;
    CKP(cudaGetDeviceProperties(&prop, 0));
    const int nsm = prop.multiProcessorCount;
    uint8_t *codes, *scales, *cp_a, *cp_b;
    float *x, *out, *ref;
    int *eids;
    uint32_t *fold;
    CKP(cudaMalloc(&codes, EXPB * NEXP));
    CKP(cudaMalloc(&scales, EXPS * NEXP));
    CKP(cudaMalloc(&x, DIM * 4));
    CKP(cudaMalloc(&out, NSEL * INTER * 2 * 4));
    CKP(cudaMalloc(&ref, NSEL * INTER * 2 * 4));
    CKP(cudaMalloc(&eids, RUN * NSEL * 4));
    CKP(cudaMalloc(&fold, 64));
    k_fill<<<1024, 256>>>(codes, EXPB * NEXP, 0x1234u, 0);
    k_fill<<<1024, 256>>>(scales, EXPS * NEXP, 0x9876u, 1);
    float hx[DIM];
    for (int k = 0; k < DIM; k++) hx[k] = sinf(0.37f * k) * (1.0f + (k % 7));
    CKP(cudaMemcpy(x, hx, sizeof hx, cudaMemcpyHostToDevice));
    int he[RUN * NSEL];
    for (int i = 0; i < RUN * NSEL; i++) he[i] = (i * 37) % NEXP; /* 96 distinct over a run */
    CKP(cudaMemcpy(eids, he, sizeof he, cudaMemcpyHostToDevice));
    /* copy rate, as dsv4 bench: D2D of 1 GiB, read + write */
    size_t cb = (size_t)1 << 30;
    CKP(cudaMalloc(&cp_a, cb));
    CKP(cudaMalloc(&cp_b, cb));
    cudaStream_t st;
    CKP(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CKP(cudaEventCreate(&e0));
    CKP(cudaEventCreate(&e1));
    float best = 1e30f;
    for (int r = 0; r < 5; r++) {
        float ms;
        CKP(cudaEventRecord(e0, st));
        CKP(cudaMemcpyAsync(cp_b, cp_a, cb, cudaMemcpyDeviceToDevice, st));
        CKP(cudaEventRecord(e1, st));
        CKP(cudaEventSynchronize(e1));
        CKP(cudaEventElapsedTime(&ms, e0, e1));
        if (ms < best) best = ms;
    }
    double copy_gbs = 2.0 * cb / (best * 1e-3) / 1e9;
    CKP(cudaFree(cp_a));
    CKP(cudaFree(cp_b));
    double bytes = (double)NSEL * (EXPB + EXPS);
    printf("%s, %d SMs; copy %.0f GB/s; gate/up of %d MXFP4 experts: %.1f MB a launch\n", prop.name, nsm, copy_gbs, NSEL,
           bytes / 1e6);
    k_ref<<<(NSEL * INTER * 2 + 255) / 256, 256>>>(codes, scales, eids, x, ref);
    CKP(cudaDeviceSynchronize());
    struct { kfn f; int bps, math; const char *name; } ks[] = {
        {k_gu<1, 4, 0>, 4, 0, "NB1 BPS4 no math"}, {k_gu<2, 2, 0>, 2, 0, "NB2 BPS2 no math"},
        {k_gu<1, 2, 1>, 2, 1, "NB1 BPS2"},         {k_gu<1, 3, 1>, 3, 1, "NB1 BPS3"},
        {k_gu<1, 4, 1>, 4, 1, "NB1 BPS4"},         {k_gu<2, 2, 1>, 2, 1, "NB2 BPS2"},
        {k_gu<2, 1, 1>, 1, 1, "NB2 BPS1"},         {k_gh<2>, 2, 1, "half BPS2"},
        {k_gh<3>, 3, 1, "half BPS3"},              {k_gh<4>, 4, 1, "half BPS4"},
    };
    float *hr = (float *)malloc(NSEL * INTER * 2 * 4), *ho = (float *)malloc(NSEL * INTER * 2 * 4);
    CKP(cudaMemcpy(hr, ref, NSEL * INTER * 2 * 4, cudaMemcpyDeviceToHost));
    for (size_t c = 0; c < sizeof ks / sizeof ks[0]; c++) {
        int grid = nsm * ks[c].bps;
        if (ks[c].math) { /* check launch 0 */
            CKP(cudaMemset(out, 0, NSEL * INTER * 2 * 4));
            ks[c].f<<<grid, 256, 0, st>>>(gu_args{codes, scales, eids, x, out, fold});
            CKP(cudaStreamSynchronize(st));
            CKP(cudaMemcpy(ho, out, NSEL * INTER * 2 * 4, cudaMemcpyDeviceToHost));
            double worst = 0, mx = 0;
            for (int i = 0; i < NSEL * INTER * 2; i++) mx = fmax(mx, fabs(hr[i]));
            for (int i = 0; i < NSEL * INTER * 2; i++) worst = fmax(worst, fabs(ho[i] - hr[i]) / mx);
            printf("  %-20s check: worst |err| / max|ref| %.2e %s\n", ks[c].name, worst, worst < 1e-5 ? "ok" : "FAIL");
        }
        CKP(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        for (int u = 0; u < RUN; u++) ks[c].f<<<grid, 256, 0, st>>>(gu_args{codes, scales, eids + u * NSEL, x, out, fold});
        cudaGraphExec_t ge = probe_graph_ready(st);
        float ms = probe_graph_ms(ge, st, 5);
        CKP(cudaGraphExecDestroy(ge));
        double us = ms * 1e3 / RUN;
        printf("  %-20s %7.2f us a launch, %6.0f GB/s = %5.1f %% of copy\n", ks[c].name, us, bytes / (us * 1e-6) / 1e9,
               100.0 * bytes / (us * 1e-6) / 1e9 / copy_gbs);
        fflush(stdout);
    }
    CKP(cudaGetLastError());
    return 0;
}
