/* tools/device/smem_probe.cu: the premise of a persistent decode kernel, measured alone.  Can a
 * GEMV's weights move into shared memory while a latency-bound chain runs, so that the GEMV after
 * the chain reads them on chip, and how much does that streaming slow the chain?  (The L2 version
 * of the question, l2_probe.cu, gave ~1 us on a 33.5 MB read: bytes in L2 do not make these reads
 * faster.  Six overlaps inside the forward pass slowed the latency-bound kernels they ran beside.)
 *
 * The GEMV is wq_b's shape: out[r] = sum_k W[r][k] x[k] * 2^-8, W [32768 x 1024] e4m3 (32 MB), x
 * 1024 floats; a row's 1024 bytes are one warp's, 32 per lane (two 16-byte runs 512 apart), four
 * rows a warp in flight, decoded e4m3x2 -> f16x2 -> f32 and summed by one fma chain a lane and a
 * warp tree, the same order in every mode: their outputs must agree bit for bit, and 64 rows of
 * the GEMV alone are checked against the host's fp64 dot (rel 1e-5).  The chain is NPH grid
 * barriers (probe_barrier_ra) in which every block's thread 0 also reads a word another block
 * wrote in the phase before (probe_phase): ~1.1-1.2 us a phase, a stand-in for hc, attention and
 * the router.  One block of 512 threads per SM, the rows split evenly over the blocks.
 * The kernel's MODE and the rows printed (us per launch, the fastest of 5 graphs of REPS launches):
 *   1 gemv:         the GEMV alone, weights from global memory
 *   0 chain:        the chain alone
 *   2 chain+gemv:   one kernel, the chain then the GEMV from global memory
 *   3 staged:       one kernel; every thread first issues cp.async copies of the block's first S KB
 *                   of rows into shared memory (S = 200, 128, 64: three rows), the chain runs while
 *                   they land, then the GEMV reads those rows from shared memory, the rest from global
 *   4 bulk-staged:  the same with S = 200, 64 copied by thread 0's cp.async.bulk (TMA) in 32 KB pieces
 *                   on one mbarrier (no per-thread issue before the chain)
 * and, for every MODE but 1, the chain's own duration inside the kernel (block 0's clock64 from the
 * kernel's start to the chain's end, in us at the SM clock).
 * The MMA modes (k_probe_mma, added at stop 35) ask the same question with the GEMV's arithmetic on
 * f16 tensor cores, as linear.dot=mma's k_gemv_mma forms it: ~0.02 warp instructions a weight
 * instead of ~0.15, so a GEMV whose weights sit in shared memory is no longer held by its decode
 * and sums (mode 3's 8.8 us).  A warp takes a tile of 16 rows over all 8 steps of 128 columns (one
 * tile a warp: a block's ~248 rows are 16 tiles), 8 m16n8k16 MMAs a step, weights through a
 * register ring of 4 steps; x is scaled by 2^14 and split into three f16 parts (B's columns 0..2)
 * once per block, so every product is exact and the outputs differ from the fp32 modes only by
 * the tensor core's summation (checked against the host's fp64 dot; the MMA modes must agree with
 * each other bit for bit):
 *   mma gemv:       the MMA GEMV alone, weights from global memory
 *   mma chain+gemv: the chain then the MMA GEMV, weights from global memory
 *   mma staged:     S KB of the block's rows (S = 200, 128, 64) by cp.async during the chain, then
 *                   the MMA GEMV reading those rows from shared memory
 * COPIES (second argument, default 1): the weights held that many times, launch i of a graph reading
 * copy i % COPIES, so that at 4 (134 MB against the 50 MB L2) each launch reads its weights from
 * memory; with one copy, the 20 launches of a graph reread the same 33.6 MB, which L2 partly serves.
 *   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/device/smem_probe.cu -o smem_probe && ./smem_probe [NPH [COPIES]] */
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "probe.cuh"

enum { R = 32768, K = 1024, THREADS = 512, REPS = 20, SMEM_MAX = 200 * 1024 };

/* one phase of the chain: thread 0 reads the word block (b + 1) % nb wrote in the phase before and
 * writes its own (probe_phase), then every block arrives and waits (probe_barrier_ra) */
__device__ __forceinline__ void chain_phase(unsigned *w, unsigned *count, unsigned target, int i, int nb) {
    probe_phase(w + (i & 1) * nb, w + ((i + 1) & 1) * nb, nb);
    probe_barrier_ra(count, target);
}

/* 16 e4m3 bytes times x's 16 floats, one fma chain (k ascending) */
__device__ __forceinline__ float dot16(uint4 q, const float *xv) {
    const uint32_t wd[4] = {q.x, q.y, q.z, q.w};
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(wd[j] >> (16 * h)), __NV_E4M3);
            float2 f = __half22float2(*(__half2 *)&hr);
            acc = fmaf(f.x, xv[4 * j + 2 * h], acc);
            acc = fmaf(f.y, xv[4 * j + 2 * h + 1], acc);
        }
    }
    return acc;
}

/* the bulk (TMA) form: thread 0 arms an mbarrier with the byte count and issues the copies in
 * pieces of up to 32 KB; the others wait on the barrier's phase 0 */
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bulk_stage(uint8_t *dst, const uint8_t *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
    for (uint32_t o = 0; o < bytes; o += 32768) {
        uint32_t n = bytes - o < 32768 ? bytes - o : 32768;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         smem_u32(dst + o)),
                     "l"(src + o), "r"(n), "r"(smem_u32(bar))
                     : "memory");
    }
}
__device__ __forceinline__ void bulk_wait(uint64_t *bar) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(smem_u32(bar))
                     : "memory");
}

__device__ __forceinline__ void cp_async16(void *smem, const void *g) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
}

template <int MODE>
__device__ __forceinline__ void probe_gemv(float *out, const uint8_t *__restrict__ W, const float *x, float *xs,
                                           const uint8_t *ws, int r0, int r1, int ns);

/* MODE 0 chain, 1 gemv, 2 chain then gemv, 3 staged (stage_rows of the block's rows copied to
 * shared memory before the chain by every thread's cp.async), 4 the same by thread 0's bulk copies */
template <int MODE>
__global__ void __launch_bounds__(THREADS, 1) k_probe(float *out, const uint8_t *__restrict__ W, const float *x,
                                                      unsigned *words, unsigned *count, unsigned base, int nph,
                                                      int stage_rows, long long *chain_cycles) {
    extern __shared__ __align__(128) uint8_t ws[];
    __shared__ __align__(16) float xs[K];
    __shared__ __align__(8) uint64_t bar;
    const int nb = gridDim.x, b = blockIdx.x, t = threadIdx.x;
    const int r0 = (int)((long long)R * b / nb), r1 = (int)((long long)R * (b + 1) / nb);
    long long c0 = clock64();
    int ns = 0;
    if (MODE == 3) { /* the first ns rows of the block, 16 bytes a copy, every thread */
        ns = min(stage_rows, r1 - r0);
        const uint8_t *g = W + (size_t)r0 * K;
        for (int i = t; i < ns * (K / 16); i += THREADS) cp_async16(ws + 16 * i, g + 16 * (size_t)i);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    if (MODE == 4) {
        ns = min(stage_rows, r1 - r0);
        if (t == 0 && ns > 0) bulk_stage(ws, W + (size_t)r0 * K, (uint32_t)ns * K, &bar);
    }
    if (MODE != 1)
        for (int i = 0; i < nph; i++) chain_phase(words, count, base + (unsigned)(i + 1) * (unsigned)nb, i, nb);
    if (b == 0 && t == 0 && MODE != 1) chain_cycles[0] += clock64() - c0;
    if (MODE == 4 && ns > 0) bulk_wait(&bar); /* chain_phase's barriers ordered the init before any wait */
    if constexpr (MODE != 0) probe_gemv<MODE>(out, W, x, xs, ws, r0, r1, ns);
}

/* the block's rows r0..r1 (the first ns from shared memory, staged by MODE 3) */
template <int MODE>
__device__ __forceinline__ void probe_gemv(float *out, const uint8_t *__restrict__ W, const float *x, float *xs,
                                           const uint8_t *ws, int r0, int r1, int ns) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    for (int i = t; i < K; i += THREADS) xs[i] = x[i];
    if (MODE == 3) asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    float xv[32]; /* lane l holds bytes 16 l .. 16 l + 15 and 512 + 16 l .. of a row: no bank conflicts */
#pragma unroll
    for (int j = 0; j < 16; j++) xv[j] = xs[16 * lane + j], xv[16 + j] = xs[512 + 16 * lane + j];
    constexpr int NW = THREADS / 32, U = 4; /* a warp's U rows a round, their loads first */
    for (int rb = r0 + warp; rb < r1; rb += NW * U) {
        uint4 q[U][2];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int r = rb + u * NW;
            if (r >= r1) break;
            if (r - r0 < ns) {
                q[u][0] = *(const uint4 *)(ws + (size_t)(r - r0) * K + 16 * lane);
                q[u][1] = *(const uint4 *)(ws + (size_t)(r - r0) * K + 512 + 16 * lane);
            } else {
                q[u][0] = probe_ld_stream(W + (size_t)r * K + 16 * lane);
                q[u][1] = probe_ld_stream(W + (size_t)r * K + 512 + 16 * lane);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int r = rb + u * NW;
            if (r >= r1) break;
            float acc = dot16(q[u][0], xv) + dot16(q[u][1], xv + 16);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) out[r] = acc * 0.00390625f;
        }
    }
}

/* ----- the MMA modes ----- */
enum { PM_STEPS = K / 128, PM_TB = 80, PM_PB = 4 * PM_TB, PM_SB = 3 * PM_PB, PM_D = 4 };

/* a word of e4m3 codes as two f16x2 (bytes 0, 1 -> lo; 2, 3 -> hi), exact */
__device__ __forceinline__ void pm_cvt(uint32_t w, uint32_t &lo, uint32_t &hi) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}

__device__ __forceinline__ void pm_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pm_word(const uint4 &v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* a lane's 16 bytes of row r at byte offset o: from shared memory when the row is among the block's
 * first ns (staged), else a stream load */
__device__ __forceinline__ uint4 pm_ld(const uint8_t *__restrict__ W, const uint8_t *ws, int r, int r0, int ns, int o) {
    if (r - r0 < ns) return *(const uint4 *)(ws + (size_t)(r - r0) * K + o);
    return probe_ld_stream(W + (size_t)r * K + o);
}

/* step s's 4 x 16 bytes of lane (g, t): rows ra (g) and rb (g + 8), columns 128 s + 16 t .. + 15 and
 * 128 s + 64 + 16 t .. + 15 */
__device__ __forceinline__ void pm_load(uint4 (&v)[4], const uint8_t *__restrict__ W, const uint8_t *ws, int ra,
                                        int rb, int r0, int ns, int s, int t) {
    v[0] = pm_ld(W, ws, ra, r0, ns, 128 * s + 16 * t);
    v[1] = pm_ld(W, ws, ra, r0, ns, 128 * s + 64 + 16 * t);
    v[2] = pm_ld(W, ws, rb, r0, ns, 128 * s + 16 * t);
    v[3] = pm_ld(W, ws, rb, r0, ns, 128 * s + 64 + 16 * t);
}

/* the block's rows r0..r1 by MMA: x's parts staged in xp (step s, part p, lane-column t: 32 f16 at
 * s PM_SB + p PM_PB + t PM_TB; position q < 16 is column 16 t + q, q >= 16 column 64 + 16 t + q - 16) */
__device__ __forceinline__ void probe_gemv_mma(float *out, const uint8_t *__restrict__ W, const float *x,
                                               uint8_t *xp, const uint8_t *ws, int r0, int r1, int ns, int staged) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    for (int c = tid; c < K; c += THREADS) {
        const int s = c >> 7, cc = c & 63, tc = cc >> 4, q = (cc & 15) + ((c & 64) ? 16 : 0);
        const float v = x[c] * 16384.0f; /* |x| < 1: the parts below carry every bit (x is k 2^-22) */
        const __half h = __float2half_rn(v);
        const float r1v = v - __half2float(h);
        const __half m = __float2half_rn(r1v);
        const __half l = __float2half_rn(r1v - __half2float(m));
        __half *base = (__half *)(xp + s * PM_SB + tc * PM_TB) + q;
        base[0] = h;
        base[PM_PB / 2] = m;
        base[PM_PB] = l;
    }
    if (staged) asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    constexpr int NW = THREADS / 32;
    const uint8_t *bp = xp + (g < 3 ? g : g & 1) * PM_PB + t * PM_TB; /* lanes g >= 3: any finite part */
    for (int tr = r0 + 16 * warp; tr < r1; tr += 16 * NW) {
        const int ra = tr + g < r1 ? tr + g : r1 - 1, rb = tr + g + 8 < r1 ? tr + g + 8 : r1 - 1;
        uint4 v[PM_D][4];
#pragma unroll
        for (int s = 0; s < PM_D; s++) pm_load(v[s], W, ws, ra, rb, r0, ns, s, t);
        float d[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int s = 0; s < PM_STEPS; s++) {
            uint4(&c)[4] = v[s % PM_D];
            uint4 bq[4];
#pragma unroll
            for (int q = 0; q < 4; q++) bq[q] = *(const uint4 *)(bp + s * PM_SB + 16 * q);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                uint32_t a0, a1, a2, a3;
                pm_cvt(pm_word(c[j >> 2], j & 3), a0, a2);
                pm_cvt(pm_word(c[2 + (j >> 2)], j & 3), a1, a3);
                const uint4 &b = bq[j >> 1];
                pm_mma(d[j & 1], a0, a1, a2, a3, (j & 1) ? b.z : b.x, (j & 1) ? b.w : b.y);
            }
            if (s + PM_D < PM_STEPS) pm_load(v[s % PM_D], W, ws, ra, rb, r0, ns, s + PM_D, t);
        }
        /* lane t = 0: hi, mid of rows g, g + 8 (d[.][0, 1] / [2, 3]); lane t = 1: lo (d[.][0] / [2]) */
        const float e0 = d[0][0] + d[1][0], e1 = d[0][1] + d[1][1], e2 = d[0][2] + d[1][2], e3 = d[0][3] + d[1][3];
        const float loa = __shfl_down_sync(0xffffffffu, e0, 1), lob = __shfl_down_sync(0xffffffffu, e2, 1);
        if (t == 0) {
            const float f = 1.0f / (16384.0f * 256.0f);
            if (tr + g < r1) out[tr + g] = ((e0 + e1) + loa) * f;
            if (tr + g + 8 < r1) out[tr + g + 8] = ((e2 + e3) + lob) * f;
        }
    }
}

/* MODE 0 the MMA GEMV alone (global), 1 the chain then it, 2 stage_rows staged by cp.async during the
 * chain, then it */
template <int MODE>
__global__ void __launch_bounds__(THREADS, 1) k_probe_mma(float *out, const uint8_t *__restrict__ W, const float *x,
                                                          unsigned *words, unsigned *count, unsigned base, int nph,
                                                          int stage_rows, long long *chain_cycles) {
    extern __shared__ __align__(128) uint8_t ws[];
    __shared__ __align__(16) uint8_t xp[PM_STEPS * PM_SB];
    const int nb = gridDim.x, b = blockIdx.x, t = threadIdx.x;
    const int r0 = (int)((long long)R * b / nb), r1 = (int)((long long)R * (b + 1) / nb);
    long long c0 = clock64();
    int ns = 0;
    if (MODE == 2) {
        ns = min(stage_rows, r1 - r0);
        const uint8_t *gsrc = W + (size_t)r0 * K;
        for (int i = t; i < ns * (K / 16); i += THREADS) cp_async16(ws + 16 * i, gsrc + 16 * (size_t)i);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    if (MODE != 0)
        for (int i = 0; i < nph; i++) chain_phase(words, count, base + (unsigned)(i + 1) * (unsigned)nb, i, nb);
    if (b == 0 && t == 0 && MODE != 0) chain_cycles[0] += clock64() - c0;
    probe_gemv_mma(out, W, x, xp, ws, r0, r1, ns, MODE == 2);
}

struct probe_bufs {
    float *out, *x;
    uint8_t *W;
    unsigned *words, *count;
    long long *cyc;
};

/* us per launch of mode m (stage rows sr), the fastest of 5 graphs of REPS launches; *chain_us:
 * block 0's chain per launch at the SM clock (MHz clk) */
static double run_mode(int m, int sr, int nph, int nb, const probe_bufs &p0, float *h_out, double clk_mhz,
                       double *chain_us, int copies) {
    cudaStream_t st;
    CKP(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    size_t smem = m == 3 || m == 4 || m == 12 ? (size_t)sr * K : 0; /* 10, 11, 12: the MMA modes 0, 1, 2 */
    CKP(cudaMemset(p0.count, 0, sizeof(unsigned))); /* for the warm-up launch in probe_graph_ready */
    CKP(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    for (int i = 0; i < REPS; i++) {
        unsigned base = (unsigned)i * (unsigned)nph * (unsigned)nb;
        probe_bufs p = p0; /* launch i reads copy i % copies of the weights (all copies hold the same bytes) */
        p.W = p0.W + (size_t)(i % copies) * R * K;
        if (m == 0) k_probe<0><<<nb, THREADS, 0, st>>>(p.out, p.W, p.x, p.words, p.count, base, nph, 0, p.cyc);
        else if (m == 1) k_probe<1><<<nb, THREADS, 0, st>>>(p.out, p.W, p.x, p.words, p.count, base, nph, 0, p.cyc);
        else if (m == 2) k_probe<2><<<nb, THREADS, 0, st>>>(p.out, p.W, p.x, p.words, p.count, base, nph, 0, p.cyc);
        else if (m == 3) k_probe<3><<<nb, THREADS, smem, st>>>(p.out, p.W, p.x, p.words, p.count, base, nph, sr, p.cyc);
        else if (m == 4) k_probe<4><<<nb, THREADS, smem, st>>>(p.out, p.W, p.x, p.words, p.count, base, nph, sr, p.cyc);
        else if (m == 10)
            k_probe_mma<0><<<nb, THREADS, 0, st>>>(p.out, p.W, p.x, p.words, p.count, base, nph, 0, p.cyc);
        else if (m == 11)
            k_probe_mma<1><<<nb, THREADS, 0, st>>>(p.out, p.W, p.x, p.words, p.count, base, nph, 0, p.cyc);
        else k_probe_mma<2><<<nb, THREADS, smem, st>>>(p.out, p.W, p.x, p.words, p.count, base, nph, sr, p.cyc);
    }
    cudaGraphExec_t ge = probe_graph_ready(st); /* its warm-up launch too */
    float best = 1e30f;
    long long cyc_best = 0;
    for (int rep = 0; rep < 5; rep++) {
        CKP(cudaMemsetAsync(p0.count, 0, sizeof(unsigned), st)); /* the barrier's counter from 0 each graph */
        CKP(cudaMemsetAsync(p0.cyc, 0, sizeof(long long), st));
        CKP(cudaMemsetAsync(p0.out, 0, sizeof(float) * R, st));
        float ms = probe_graph_once_ms(ge, st);
        long long cyc;
        CKP(cudaMemcpy(&cyc, p0.cyc, sizeof cyc, cudaMemcpyDeviceToHost));
        if (ms < best) best = ms, cyc_best = cyc;
    }
    if (m != 0) CKP(cudaMemcpy(h_out, p0.out, sizeof(float) * R, cudaMemcpyDeviceToHost));
    *chain_us = m == 1 || m == 10 ? 0.0 : (double)cyc_best / REPS / clk_mhz;
    CKP(cudaGraphExecDestroy(ge));
    CKP(cudaStreamDestroy(st));
    return 1000.0 * best / REPS;
}

/* e4m3 code c as a double (no NaN codes here) */
static double e4m3_value(uint8_t c) {
    int e = (c >> 3) & 15, m = c & 7;
    double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return c & 0x80 ? -v : v;
}

/* 64 rows spread over W against the host's fp64 dot, rel 1e-5 of each row's sum of |w x|; 1 on a
 * mismatch */
static int host_check(const float *got, const uint8_t *hw, const float *hx) {
    for (int i = 0; i < 64; i++) {
        int r = (int)((long long)i * (R - 1) / 63);
        double d = 0.0, a = 0.0;
        for (int k = 0; k < K; k++) {
            double t = e4m3_value(hw[(size_t)r * K + k]) * hx[k];
            d += t, a += fabs(t);
        }
        d *= 0.00390625, a *= 0.00390625;
        if (!(fabs(got[r] - d) <= 1e-5 * a)) {
            printf("  row %d: gpu %.9g, host %.9g\n", r, got[r], d);
            return 1;
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    int nph = argc > 1 ? atoi(argv[1]) : 16, copies = argc > 2 ? atoi(argv[2]) : 1;
    if (nph < 1 || nph > 1000 || copies < 1 || copies > 8) {
        fprintf(stderr, "usage: smem_probe [phases 1..1000] [weight copies 1..8]\n");
        return 2;
    }
    cudaDeviceProp pr;
    CKP(cudaGetDeviceProperties(&pr, 0));
    int nb = pr.multiProcessorCount, clk_khz = 0;
    CKP(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0));
    double clk_mhz = clk_khz / 1000.0;
    probe_bufs p;
    CKP(cudaMalloc(&p.out, sizeof(float) * R));
    CKP(cudaMalloc(&p.x, sizeof(float) * K));
    CKP(cudaMalloc(&p.W, (size_t)R * K * copies));
    CKP(cudaMalloc(&p.words, sizeof(unsigned) * 2 * nb));
    CKP(cudaMalloc(&p.count, sizeof(unsigned)));
    CKP(cudaMalloc(&p.cyc, sizeof(long long)));
    CKP(cudaMemset(p.words, 0, sizeof(unsigned) * 2 * nb));
    uint8_t *hw = (uint8_t *)malloc((size_t)R * K);
    float hx[K], *ref = (float *)malloc(sizeof(float) * R), *got = (float *)malloc(sizeof(float) * R);
    if (!hw || !ref || !got) return 1;
    uint32_t s = 12345u;
    for (size_t i = 0; i < (size_t)R * K; i++) {
        s = s * 1664525u + 1013904223u;
        uint8_t c = (uint8_t)(s >> 24);
        hw[i] = (c & 0x7f) == 0x7f ? (uint8_t)(c & 0xfe) : c; /* no NaN codes */
    }
    for (int i = 0; i < K; i++) {
        s = s * 1664525u + 1013904223u;
        hx[i] = (float)((int)(s >> 9) - (1 << 22)) / (float)(1 << 22);
    }
    for (int c = 0; c < copies; c++) CKP(cudaMemcpy(p.W + (size_t)c * R * K, hw, (size_t)R * K, cudaMemcpyHostToDevice));
    CKP(cudaMemcpy(p.x, hx, sizeof hx, cudaMemcpyHostToDevice));
    CKP(cudaFuncSetAttribute(k_probe<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_MAX));
    CKP(cudaFuncSetAttribute(k_probe<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_MAX));
    CKP(cudaFuncSetAttribute(k_probe_mma<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_MAX));
    printf("smem_probe: %s, %d SMs at %.0f MHz, %d blocks x %d threads; GEMV [%d x %d] e4m3 = %.1f MB; chain of %d "
           "grid barriers; %d cop%s of the weights in turn\n",
           pr.name, nb, clk_mhz, nb, THREADS, R, K, (double)R * K / 1e6, nph, copies, copies == 1 ? "y" : "ies");
    const struct {
        int mode, stage_kb;
        const char *what;
    } modes[] = {{1, 0, "gemv alone (global)"},
                 {0, 0, "chain alone"},
                 {2, 0, "chain, then gemv (global)"},
                 {3, 200, "staged 200 KB a block during the chain"},
                 {3, 128, "staged 128 KB a block during the chain"},
                 {3, 64, "staged 64 KB a block during the chain"},
                 {4, 200, "bulk-staged 200 KB a block during the chain"},
                 {4, 64, "bulk-staged 64 KB a block during the chain"},
                 {10, 0, "mma gemv alone (global)"},
                 {11, 0, "mma: chain, then gemv (global)"},
                 {12, 200, "mma: staged 200 KB a block during the chain"},
                 {12, 128, "mma: staged 128 KB a block during the chain"},
                 {12, 64, "mma: staged 64 KB a block during the chain"}};
    float *mref = (float *)malloc(sizeof(float) * R);
    if (!mref) return 1;
    int bad = 0;
    for (size_t i = 0; i < sizeof modes / sizeof *modes; i++) {
        double cus;
        int sr = modes[i].stage_kb * 1024 / K;
        double us = run_mode(modes[i].mode, sr, nph, nb, p, got, clk_mhz, &cus, copies);
        const int mm = modes[i].mode;
        if (mm == 1 || mm == 10) { /* the first of each family: against the host, then the reference */
            memcpy(mm == 1 ? ref : mref, got, sizeof(float) * R);
            bad += host_check(got, hw, hx);
        } else if (mm != 0 && memcmp(mm >= 10 ? mref : ref, got, sizeof(float) * R)) bad++, printf("  outputs DIFFER\n");
        printf("  %-42s %8.2f us a launch", modes[i].what, us);
        if (mm != 1 && mm != 10) printf(" (block 0's chain %.2f us)", cus);
        if (mm == 1 || mm == 10) printf(" = %.0f GB/s", (double)R * K / (us * 1e3));
        printf("\n");
    }
    printf(bad ? "smem_probe: outputs wrong or differing between modes\n"
               : "smem_probe: both GEMVs' rows match the host's, every mode's outputs equal its family's first\n");
    return bad ? 1 : 0;
}
