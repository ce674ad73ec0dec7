/* tools/device/l2_probe.cu: can a decode step's idle DRAM time, while its latency-bound kernels run
 * (mHC, attention, the router: ~50 us a layer in which DRAM is nearly idle), be spent pulling the
 * next op's weights into the L2, so that the weight kernel after the chain reads them at L2 speed?
 * A persistent step kernel would do this through shared memory; a prefetch branch in the step's
 * graph is a much smaller change, if the L2 keeps what was prefetched.  This probe measures it on
 * buffers that are cold (each launch of a run reads the next of buffers spanning >= 1 GiB):
 *   read      the weight kernel alone: ldg U4, 4 blocks of 256 threads an SM (stream_probe's best);
 *   chain     K one-block kernels of ~1 us each (a clock spin), in sequence: the latency chain;
 *   chain+read          the chain, then the read: what a step does today;
 *   pf-bulk G + chain+read  a side branch forked at the chain's start: G blocks of 32 threads, each
 *             thread issuing cp.async.bulk.prefetch.L2 of 64 KB pieces of the buffer; the
 *             main branch runs the chain then the read; joined after the read;
 *   pf-ldg G + chain+read   the same with a side kernel of G blocks of 256 threads that loads the
 *             buffer (ldg U4, results folded and stored so the loads stay);
 *   pf-bulk G then read     the prefetch, then the read, in sequence: the read's L2-hit speed.
 * A run is 16 such units captured in one graph; printed: us a unit (the fastest of 5 launches).
 *   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/device/l2_probe.cu -o l2_probe
 *   ./l2_probe [K] [SIZE_MB ...]
 * First run (H200, 2026-12-04 05:03Z, K 16: the chain alone 29.8 us; docs/PERFORMANCE.md, stop 27): a
 * 33.5 MB read alone 11.26 us, chain+read 41.01, with a bulk prefetch of the same buffer from 8 or 32
 * blocks forked at the chain's start 40.33-40.37 (0.7 us less), with a load kernel of 32 blocks
 * 39.33 (1.7 less; of 8 or 16 blocks much slower: 135.8 / 70.6, the branch outlasting the chain);
 * 8.4 MB 35.60 against 35.30.  The prefetch then the read, in sequence, 29.94 us for 33.5 MB (the
 * read itself is not much faster from L2).  So the L2 does not make a read after a latency chain
 * faster: the same answer as the forward pass's prefetch op of 2026-12-02 (docs/CUDA.md, "Weights
 * into L2 ahead of their op"), now from a kernel with no math at all.
 * After this run the two load kernels became k_read<PF> and the loads moved to probe.cuh (no device
 * to rerun it). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "probe.cuh"

#define NT 256
#define UNITS 16

/* the 16-byte vectors of src, 4 a thread in flight: PF 0 the weight kernel (no L1 allocation, the
 * block's xor into out[0]), PF 1 the prefetch branch's loads (out[2] written only on an impossible
 * fold, which keeps the loads) */
template <int PF>
__global__ void __launch_bounds__(NT) k_read(const uint4 *src, size_t n16, uint32_t *out) {
    uint32_t x = 0;
    const size_t step = (size_t)gridDim.x * NT * 4;
    for (size_t base = (size_t)blockIdx.x * NT * 4 + threadIdx.x; base < n16; base += step) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            size_t i = base + (size_t)u * NT;
            v[u] = i >= n16 ? make_uint4(0, 0, 0, 0) : PF ? probe_ld_nc(src + i) : probe_ld_stream(src + i);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (PF) {
        if (x == 0x9e3779b9u) out[2] = x;
    } else {
        for (int o = 16; o; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
        if ((threadIdx.x & 31) == 0) atomicXor(out, x);
    }
}

/* one block spinning ~ns nanoseconds of clock: a latency kernel that reads nothing */
__global__ void k_spin(long long cycles, uint32_t *out) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
    if (threadIdx.x == 0) out[1] += 1;
}

__global__ void k_pf_bulk(const char *src, size_t bytes) {
    const size_t piece = 65536;
    size_t n = (bytes + piece - 1) / piece;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t off = i * piece;
        uint32_t len = (uint32_t)(bytes - off < piece ? bytes - off : piece);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src + off), "r"(len) : "memory");
    }
}

enum { V_READ, V_CHAIN, V_CHAIN_READ, V_PF_BULK, V_PF_LDG, V_PF_THEN_READ };

int main(int argc, char **argv) {
    int K = argc > 1 ? atoi(argv[1]) : 16;
    double sizes_def[] = {8.4, 16.8, 25.2, 33.5, 42.0};
    int nsz = argc > 2 ? argc - 2 : 5;
    double sizes[16];
    for (int i = 0; i < nsz && i < 16; i++) sizes[i] = argc > 2 ? atof(argv[2 + i]) : sizes_def[i];

    cudaDeviceProp prop;
    CKP(cudaGetDeviceProperties(&prop, 0));
    int nsm = prop.multiProcessorCount;
    printf("%s: %d SMs, L2 %d MB, persisting max %d MB; chain %d kernels\n", prop.name, nsm,
           prop.l2CacheSize >> 20, prop.persistingL2CacheMaxSize >> 20, K);
    const size_t pool = (size_t)1 << 30;
    char *buf;
    uint32_t *out;
    CKP(cudaMalloc(&buf, pool + (64 << 20)));
    CKP(cudaMemset(buf, 0x5a, pool + (64 << 20)));
    CKP(cudaMalloc(&out, 64));
    cudaStream_t st, side;
    CKP(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CKP(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaEvent_t fork[UNITS], join[UNITS];
    for (int i = 0; i < UNITS; i++) {
        CKP(cudaEventCreateWithFlags(&fork[i], cudaEventDisableTiming));
        CKP(cudaEventCreateWithFlags(&join[i], cudaEventDisableTiming));
    }
    int khz;
    CKP(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    long long spin = (long long)khz / 1000; /* ~1 us of cycles */

    struct { int v, g; const char *name; } cases[] = {
        {V_READ, 0, "read"},           {V_CHAIN, 0, "chain"},
        {V_CHAIN_READ, 0, "chain+read"}, {V_PF_BULK, 1, "pf-bulk 1 + chain+read"},
        {V_PF_BULK, 8, "pf-bulk 8 + chain+read"}, {V_PF_BULK, 32, "pf-bulk 32 + chain+read"},
        {V_PF_LDG, 8, "pf-ldg 8 + chain+read"}, {V_PF_LDG, 16, "pf-ldg 16 + chain+read"},
        {V_PF_LDG, 32, "pf-ldg 32 + chain+read"}, {V_PF_THEN_READ, 8, "pf-bulk 8 then read"},
    };
    int ncase = (int)(sizeof cases / sizeof cases[0]);
    for (int s = 0; s < nsz; s++) {
        size_t bytes = ((size_t)(sizes[s] * 1e6) + 4095) & ~(size_t)4095;
        size_t nbuf = pool / bytes;
        printf("\n%.1f MB (%zu buffers)\n", bytes / 1e6, nbuf);
        for (int c = 0; c < ncase; c++) {
            int v = cases[c].v, g = cases[c].g;
            static size_t next = 0;
            CKP(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            for (int u = 0; u < UNITS; u++) {
                const char *b = buf + (next++ % nbuf) * bytes;
                size_t n16 = bytes / 16;
                if (v == V_PF_BULK || v == V_PF_LDG) {
                    CKP(cudaEventRecord(fork[u], st));
                    CKP(cudaStreamWaitEvent(side, fork[u], 0));
                    if (v == V_PF_BULK) k_pf_bulk<<<g, 32, 0, side>>>(b, bytes);
                    else k_read<1><<<g, NT, 0, side>>>((const uint4 *)b, n16, out);
                    CKP(cudaEventRecord(join[u], side));
                }
                if (v == V_PF_THEN_READ) k_pf_bulk<<<g, 32, 0, st>>>(b, bytes);
                if (v != V_READ && v != V_PF_THEN_READ)
                    for (int k = 0; k < K; k++) k_spin<<<1, 32, 0, st>>>(spin, out);
                if (v != V_CHAIN) k_read<0><<<nsm * 4, NT, 0, st>>>((const uint4 *)b, n16, out);
                if (v == V_PF_BULK || v == V_PF_LDG) CKP(cudaStreamWaitEvent(st, join[u], 0));
            }
            cudaGraphExec_t ge = probe_graph_ready(st);
            float ms = probe_graph_ms(ge, st, 5);
            CKP(cudaGraphExecDestroy(ge));
            printf("  %-26s %8.2f us a unit\n", cases[c].name, ms * 1e3 / UNITS);
            fflush(stdout);
        }
    }
    CKP(cudaGetLastError());
    CKP(cudaDeviceSynchronize());
    return 0;
}
