/* tools/device/gridbar_probe.cu: what a phase boundary costs inside one persistent kernel, against
 * a kernel boundary in a PDL chain, on this GPU.  A dsv4 decode layer is ~18 dependent launches at
 * batch 1; a persistent kernel per layer would turn each boundary into a grid-wide barrier.  The
 * probe runs the same chain of N dependent phases both ways, at the grid sizes a layer's kernels
 * use (one block per SM, and 4), and prints microseconds per boundary:
 *   chain:   N kernels captured into one CUDA graph with the PDL attribute (each waits with
 *            griddepcontrol.wait, then lets the next launch with griddepcontrol.launch_dependents);
 *   barrier: one kernel of N phases separated by a grid barrier: (fences) arrive on a device
 *            counter, the last block to arrive resets it and bumps a generation word the others
 *            poll, __threadfence around it; (release / acquire) one monotonic counter, every block
 *            adds 1 with red.release and polls with ld.acquire until the phase's target.
 * Each phase makes every block read a word the previous phase wrote in another block, so a
 * barrier that fails to order memory gives a wrong sum (checked against the host's).
 *   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a tools/device/gridbar_probe.cu -o gridbar_probe */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "probe.cuh"

__global__ void k_chain_step(unsigned *dst, const unsigned *src, int nb) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    probe_phase(dst, src, nb);
}

/* grid barrier: the block's writes are released before it arrives; the last arrival resets the
 * counter and bumps the generation; the others wait for the bump, then acquire */
__device__ __forceinline__ void grid_barrier(unsigned *count, unsigned *gen, unsigned nb) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned g = *(volatile unsigned *)gen;
        __threadfence();
        if (atomicAdd(count, 1u) == nb - 1) {
            *(volatile unsigned *)count = 0u;
            __threadfence();
            atomicAdd(gen, 1u);
        } else {
            while (*(volatile unsigned *)gen == g) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

/* RA 0: grid_barrier; RA 1: probe_barrier_ra (count's value at the start in base) */
template <int RA>
__global__ void k_phases(unsigned *a, unsigned *b, int nb, int n, unsigned *count, unsigned *gen, unsigned base) {
    for (int i = 0; i < n; i++) {
        unsigned *dst = i & 1 ? a : b, *src = i & 1 ? b : a;
        probe_phase(dst, src, nb);
        if (RA) probe_barrier_ra(count, base + (unsigned)(i + 1) * (unsigned)nb);
        else grid_barrier(count, gen, (unsigned)nb);
    }
}

/* us per boundary: mode 0 chain, 1 barrier, 2 release / acquire barrier; the final words checked (every word = n after n phases
 * from zeros) */
static double run(int mode, int nb, int n, unsigned *a, unsigned *b, unsigned *count, unsigned *gen) {
    cudaStream_t st;
    CKP(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t g;
    cudaGraphExec_t x;
    CKP(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    if (mode == 0) {
        for (int i = 0; i < n; i++) {
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[0].val.programmaticStreamSerializationAllowed = 1;
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(nb);
            cfg.blockDim = dim3(256);
            cfg.stream = st;
            cfg.attrs = at;
            cfg.numAttrs = 1;
            unsigned *dst = i & 1 ? a : b, *src = i & 1 ? b : a;
            CKP(cudaLaunchKernelEx(&cfg, k_chain_step, dst, (const unsigned *)src, nb));
        }
    } else if (mode == 1) {
        k_phases<0><<<nb, 256, 0, st>>>(a, b, nb, n, count, gen, 0u);
    } else {
        /* the monotonic counter starts from 0 at each launch (a memset node ahead of the kernel) */
        CKP(cudaMemsetAsync(gen + 1, 0, sizeof(unsigned), st));
        k_phases<1><<<nb, 256, 0, st>>>(a, b, nb, n, gen + 1, gen, 0u);
    }
    CKP(cudaStreamEndCapture(st, &g));
    CKP(cudaGraphInstantiate(&x, g, 0));
    float best = 1e30f;
    for (int rep = 0; rep < 5; rep++) {
        CKP(cudaMemsetAsync(a, 0, sizeof(unsigned) * nb, st));
        CKP(cudaMemsetAsync(b, 0, sizeof(unsigned) * nb, st));
        float ms = probe_graph_once_ms(x, st);
        if (ms < best) best = ms;
        unsigned *h = (unsigned *)malloc(sizeof(unsigned) * nb);
        CKP(cudaMemcpy(h, n & 1 ? b : a, sizeof(unsigned) * nb, cudaMemcpyDeviceToHost));
        for (int i = 0; i < nb; i++)
            if (h[i] != (unsigned)n) {
                fprintf(stderr, "%s nb %d: word %d = %u, expected %d (the phases were not ordered)\n",
                        mode == 2 ? "barrier (release / acquire)" : mode ? "barrier" : "chain", nb, i, h[i], n);
                exit(1);
            }
        free(h);
    }
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);
    cudaStreamDestroy(st);
    return 1e3 * best / n;
}

int main(void) {
    int sms = 0;
    CKP(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    int per = 0;
    CKP(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, k_phases<0>, 256, 0));
    unsigned *a, *b, *cg;
    int nmax = 8 * sms;
    CKP(cudaMalloc(&a, sizeof(unsigned) * nmax));
    CKP(cudaMalloc(&b, sizeof(unsigned) * nmax));
    CKP(cudaMalloc(&cg, 3 * sizeof(unsigned))); /* count, generation, the monotonic counter */
    CKP(cudaMemset(cg, 0, 3 * sizeof(unsigned)));
    printf("gridbar_probe: %d SMs, up to %d resident blocks of 256 threads an SM; us per boundary (best of 5)\n",
           sms, per);
    const int n = 1000;
    for (int k = 1; k <= 4; k *= 2) {
        int nb = k * sms;
        if (k > per) break; /* the barrier needs every block resident */
        double c = run(0, nb, n, a, b, cg, cg + 1), r = run(1, nb, n, a, b, cg, cg + 1),
               q = run(2, nb, n, a, b, cg, cg + 1);
        printf("  blocks %4d (%d an SM): PDL kernel chain %.2f us, grid barrier %.2f us (fences), %.2f us (release / "
               "acquire)\n",
               nb, k, c, r, q);
    }
    cudaFree(a);
    cudaFree(b);
    cudaFree(cg);
    return 0;
}
