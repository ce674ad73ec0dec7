/* tools/device/pdl_probe.cu: does programmatic dependent launch (PDL) shorten a chain of
 * small dependent kernels inside a CUDA graph on this GPU?  A decode step of dsv4 is ~40
 * kernels per layer, most of them a few microseconds long, so the time between one kernel's
 * end and the next one's start matters.  The probe captures the same chain of dependent
 * kernels (each reads what the previous wrote) with plain launches and with the PDL launch
 * attribute (kernels wait with griddepcontrol.wait before reading, and let the next launch
 * early with griddepcontrol.launch_dependents), replays each graph and prints us per kernel.
 * The chain result is checked so the faster variant cannot be the wrong one.
 *   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a tools/device/pdl_probe.cu -o pdl_probe */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "probe.cuh"

/* out[i] = in[i] * 0.5 + 1 over n floats; `work` extra dependent FMAs per element to vary length */
__global__ void k_step(float *out, const float *in, int n, int work) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = in[i];
        for (int w = 0; w < work; w++) v = v * 0.999f + 0.001f;
        out[i] = v * 0.5f + 1.0f;
    }
}

static float run(int pdl, int blocks, int threads, int n, int work, int chain, float *a, float *b, float *check) {
    cudaStream_t st;
    CKP(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CKP(cudaMemset(a, 0, sizeof(float) * n));
    CKP(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    for (int i = 0; i < chain; i++) {
        float *o = i & 1 ? a : b, *in = i & 1 ? b : a;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(threads);
        cfg.stream = st;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = pdl ? 1 : 0;
        CKP(cudaLaunchKernelEx(&cfg, k_step, o, (const float *)in, n, work));
    }
    cudaGraphExec_t ge = probe_graph_ready(st);
    CKP(cudaMemset(a, 0, sizeof(float) * n));
    const float ms = probe_graph_ms(ge, st, 1);
    CKP(cudaMemcpy(check, chain & 1 ? b : a, sizeof(float) * n, cudaMemcpyDeviceToHost));
    cudaGraphExecDestroy(ge);
    cudaStreamDestroy(st);
    return ms * 1000.0f / chain;
}

int main(void) {
    const int n = 1 << 20, chain = 400;
    float *a, *b;
    CKP(cudaMalloc(&a, sizeof(float) * n));
    CKP(cudaMalloc(&b, sizeof(float) * n));
    float *c0 = (float *)malloc(sizeof(float) * n), *c1 = (float *)malloc(sizeof(float) * n);
    struct { int blocks, threads, n, work; } cases[] = {
        {1, 256, 4096, 0}, {16, 256, 4096, 0}, {132, 256, 1 << 16, 0}, {264, 256, 1 << 18, 0},
        {1024, 256, 1 << 20, 0}, {132, 256, 1 << 16, 200}, {1, 1024, 4096, 100},
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        float t0 = run(0, cases[i].blocks, cases[i].threads, cases[i].n, cases[i].work, chain, a, b, c0);
        float t1 = run(1, cases[i].blocks, cases[i].threads, cases[i].n, cases[i].work, chain, a, b, c1);
        int same = 1;
        for (int j = 0; j < cases[i].n; j++) same &= c0[j] == c1[j];
        bad += !same;
        printf("pdl_probe: grid %5d x %4d, %7d floats, work %3d: plain %.2f us/kernel, PDL %.2f us/kernel (%s)\n",
               cases[i].blocks, cases[i].threads, cases[i].n, cases[i].work, t0, t1, same ? "same result" : "RESULTS DIFFER");
    }
    return bad ? 1 : 0;
}
