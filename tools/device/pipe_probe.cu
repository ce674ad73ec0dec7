/* tools/device/pipe_probe.cu: how many of each instruction of the one-row MoE's decode an SM issues a
 * clock.  k_moe_b1r's gate/up runs ~14 weights a clock an SM (ncu: issue slots ~50 % busy, the ALU the
 * busiest pipe at 37 %), and its DEC 2 decode spends per 8 e2m1 codes 7 integer operations, 4
 * cvt.rn.f16x2.e4m3x2, 8 cvt.f32.f16 and 8 fma.  If a conversion runs on a narrow pipe, the kernel is
 * bound by that pipe and not by issue, and the remedy is another decode mix, not fewer instructions.
 * Each kernel runs 132 x BPS blocks of 256 threads (all resident), every thread a loop of independent
 * chains; a block times its loop with clock64 and the slowest block gives the rate:
 *   ops a clock an SM = iterations x ops an iteration x 256 x BPS / cycles.
 * Kernels (OP):
 *   0 fma            8 independent fma chains
 *   1 f16x2.e4m3x2   8 cvt a iteration (inputs from the counter), results folded by xor
 *   2 f32.f16        8 cvt a iteration, results summed by fadd
 *   3 dec2 word      k_moe_b1r's DEC 2 of one 32-bit word of codes (b1f_fp4's body) and its 8 fma
 *   4 f32 placement  the same word decoded by placing the bits in f32 (moe.cu's removed variant)
 *   5 mma word       bm_run's A of one word (7 integer operations, 4 cvt) and one m16n8k16 a 2 words
 *   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/device/pipe_probe.cu -o pipe_probe && ./pipe_probe */
#include <cuda_fp16.h>
#include <stdint.h>

#include "probe.cuh"

enum { THREADS = 256, ITERS = 4096 };

__device__ __forceinline__ uint32_t f16x2_e4m3x2(uint32_t w) {
    uint32_t d;
    asm volatile("{\n\t.reg .b16 l, u;\n\tmov.b32 {l, u}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\t}" : "=r"(d) : "r"(w));
    return d;
}
__device__ __forceinline__ float f32_f16(uint32_t h) {
    float f;
    asm volatile("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}
/* the DEC 2 e4m3 bytes of a word's low and high nibbles */
__device__ __forceinline__ void dec2(uint32_t w, uint32_t &lo, uint32_t &hi) {
    lo = ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4);
    hi = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}
__device__ __forceinline__ float word_dec2(uint32_t w, float x, float acc) {
    uint32_t lo, hi;
    dec2(w, lo, hi);
    uint32_t h[4] = {f16x2_e4m3x2(lo), f16x2_e4m3x2(lo >> 16), f16x2_e4m3x2(hi), f16x2_e4m3x2(hi >> 16)};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        acc = fmaf(f32_f16(h[k] & 0xffffu), x, acc);
        acc = fmaf(f32_f16(h[k] >> 16), x + 1.0f, acc);
    }
    return acc;
}
/* code j of the word: magnitude bits at f32 bits 22..24, sign at 31 (the value times 2^-126) */
__device__ __forceinline__ float word_place(uint32_t w, float x, float acc) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        uint32_t m = j <= 5 ? (w << (22 - 4 * j)) : (w >> (4 * j - 22));
        uint32_t s = 4 * j + 3 <= 31 ? (w << (31 - (4 * j + 3))) : 0u;
        acc = fmaf(__uint_as_float((m & 0x01C00000u) | (s & 0x80000000u)), x, acc);
    }
    return acc;
}
template <int OP>
__global__ void __launch_bounds__(THREADS) k_pipe(float *out, long long *cyc, uint32_t seed) {
    uint32_t s = seed ^ (threadIdx.x * 0x9E3779B9u) ^ blockIdx.x;
    float a[8];
#pragma unroll
    for (int k = 0; k < 8; k++) a[k] = (float)(threadIdx.x + k);
    uint32_t u[8];
#pragma unroll
    for (int k = 0; k < 8; k++) u[k] = s + k * 0x01010101u;
    __syncthreads();
    long long t0 = clock64();
    for (int i = 0; i < ITERS; i++) {
        if (OP == 0) {
#pragma unroll
            for (int k = 0; k < 8; k++) a[k] = fmaf(a[k], 0.999f, 1.0f);
        } else if (OP == 1) {
#pragma unroll
            for (int k = 0; k < 8; k++) u[k] = f16x2_e4m3x2(u[k] ^ i);
        } else if (OP == 2) {
#pragma unroll
            for (int k = 0; k < 8; k++) a[k] += f32_f16(u[k] + i);
        } else if (OP == 3) {
#pragma unroll
            for (int k = 0; k < 4; k++) a[k] = word_dec2(u[k] + i, 0.5f, a[k]);
        } else if (OP == 4) {
#pragma unroll
            for (int k = 0; k < 4; k++) a[k] = word_place(u[k] + i, 0.5f, a[k]);
        } else {
            uint32_t A[4][4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                uint32_t lo, hi;
                dec2(u[k] + i, lo, hi);
                A[k][0] = f16x2_e4m3x2(lo), A[k][1] = f16x2_e4m3x2(lo >> 16), A[k][2] = f16x2_e4m3x2(hi),
                A[k][3] = f16x2_e4m3x2(hi >> 16);
            }
#pragma unroll
            for (int k = 0; k < 4; k += 2) { /* one m16n8k16 a 2 words (a 16 x 32 tile's share of a lane) */
                float d[4];
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                             "{%8, %9}, {%10, %11, %12, %13};"
                             : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                             : "r"(A[k][0]), "r"(A[k + 1][0]), "r"(A[k][1] ^ A[k][2]), "r"(A[k + 1][1] ^ A[k + 1][3]),
                               "r"(u[4]), "r"(u[5]), "f"(a[k]), "f"(a[k + 1]), "f"(a[k + 2]), "f"(a[k + 3]));
                a[k] = d[0] + d[1], a[k + 1] = d[2] + d[3];
            }

        }
    }
    long long t1 = clock64();
    float r = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) r += a[k] + (float)(u[k] & 1u);
    out[blockIdx.x * THREADS + threadIdx.x] = r;
    if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}

/* lane-operations of the measured kind per iteration of a thread, and what they are */
static const struct {
    double ops;
    const char *what;
} kinds[] = {
    {8, "fma a clock an SM"},
    {8, "cvt.rn.f16x2.e4m3x2 a clock an SM"},
    {8, "cvt.f32.f16 a clock an SM"},
    {32, "weights a clock an SM, DEC 2 decode + fma (4 words)"},
    {32, "weights a clock an SM, f32 bit placement + fma"},
    {32, "weights a clock an SM, DEC 2 A + m16n8k16 (1 per 2 words)"},
};

template <int OP> static void run(int sms, float *out, long long *cyc, int bps) {
    int nb = sms * bps;
    for (int rep = 0; rep < 2; rep++) {
        k_pipe<OP><<<nb, THREADS>>>(out, cyc, 12345u + rep);
        CKP(cudaGetLastError());
        CKP(cudaDeviceSynchronize());
    }
    long long *h = (long long *)malloc(sizeof(long long) * nb), mx = 0;
    CKP(cudaMemcpy(h, cyc, sizeof(long long) * nb, cudaMemcpyDeviceToHost));
    for (int i = 0; i < nb; i++) mx = h[i] > mx ? h[i] : mx;
    free(h);
    double rate = (double)ITERS * kinds[OP].ops * THREADS * bps / (double)mx;
    printf("  OP %d, %d blocks an SM: %7.1f %s (%lld cycles)\n", OP, bps, rate, kinds[OP].what, mx);
}

int main(void) {
    cudaDeviceProp p;
    CKP(cudaGetDeviceProperties(&p, 0));
    printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
    int sms = p.multiProcessorCount;
    float *out;
    long long *cyc;
    CKP(cudaMalloc(&out, sizeof(float) * sms * 8 * THREADS));
    CKP(cudaMalloc(&cyc, sizeof(long long) * sms * 8));
    for (int bps = 2; bps <= 4; bps += 2) {
        run<0>(sms, out, cyc, bps);
        run<1>(sms, out, cyc, bps);
        run<2>(sms, out, cyc, bps);
        run<3>(sms, out, cyc, bps);
        run<4>(sms, out, cyc, bps);
        run<5>(sms, out, cyc, bps);
    }
    return 0;
}
