/* tools/device/probe.cuh: what the stand-alone device probes (pdl_probe.cu, gridbar_probe.cu,
 * stream_probe.cu, l2_probe.cu, moe_probe.cu, smem_probe.cu, phase_probe.cu) share: a CUDA call checked,
 * the process ending with the call and its error on failure; 16-byte stream loads; the e4m3 decode; a
 * captured graph made ready and timed. */
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CKP(x)                                                                               \
    do {                                                                                     \
        cudaError_t e_ = (x);                                                                \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

/* a 16-byte load through the non-coherent path without allocating in L1 (a weight stream) */
__device__ __forceinline__ uint4 probe_ld_stream(const void *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/* the same load, allocating in L1 as a plain read-only load does */
__device__ __forceinline__ uint4 probe_ld_nc(const void *p) { return __ldg((const uint4 *)p); }

/* f32 pair of the e4m3 bytes 0, 1 (H 0) or 2, 3 (H 1) of w (exact: cuda_fp8.h's e4m3x2 -> f16x2) */
template <int H>
__device__ __forceinline__ float2 probe_e4m3x2_f32(uint32_t w) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> (16 * H)), __NV_E4M3);
    return __half22float2(__half2(r));
}

/* ends the capture on st, instantiates its graph (the graph itself is no longer needed) and
 * launches it once as a warm-up, waited for */
static inline cudaGraphExec_t probe_graph_ready(cudaStream_t st) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CKP(cudaStreamEndCapture(st, &g));
    CKP(cudaGraphInstantiate(&ge, g, 0));
    CKP(cudaGraphDestroy(g));
    CKP(cudaGraphLaunch(ge, st));
    CKP(cudaStreamSynchronize(st));
    return ge;
}

/* the device time of one launch of ge on st in ms (events around it, waited for; what the caller
 * queued on st before, a reset say, stays outside) */
static inline float probe_graph_once_ms(cudaGraphExec_t ge, cudaStream_t st) {
    cudaEvent_t e0, e1;
    float ms;
    CKP(cudaEventCreate(&e0));
    CKP(cudaEventCreate(&e1));
    CKP(cudaEventRecord(e0, st));
    CKP(cudaGraphLaunch(ge, st));
    CKP(cudaEventRecord(e1, st));
    CKP(cudaEventSynchronize(e1));
    CKP(cudaEventElapsedTime(&ms, e0, e1));
    CKP(cudaEventDestroy(e0));
    CKP(cudaEventDestroy(e1));
    return ms;
}

/* the device time of one launch of ge on st in ms, the fastest of reps */
static inline float probe_graph_ms(cudaGraphExec_t ge, cudaStream_t st, int reps) {
    float best = 1e30f;
    for (int r = 0; r < reps; r++) {
        float ms = probe_graph_once_ms(ge, st);
        if (ms < best) best = ms;
    }
    return best;
}

/* a phase of the chains of gridbar_probe.cu and smem_probe.cu: block b's word of phase p + 1 is
 * word (b + 1) % nb of phase p, plus one (so each phase's result depends on another block's write
 * in the phase before) */
__device__ __forceinline__ void probe_phase(unsigned *dst, const unsigned *src, int nb) {
    if (threadIdx.x == 0) {
        unsigned v = *(volatile const unsigned *)(src + (blockIdx.x + 1) % nb);
        dst[blockIdx.x] = v + 1u;
    }
}

/* a grid barrier on one monotonic counter with PTX release / acquire (gridbar_probe.cu's fastest):
 * every block adds 1 (release) and polls (acquire) until the count reaches the phase's target; no
 * reset */
__device__ __forceinline__ void probe_barrier_ra(unsigned *count, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
        } while ((int)(v - target) < 0);
    }
    __syncthreads();
}
