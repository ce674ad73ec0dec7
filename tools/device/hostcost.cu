/* tools/device/hostcost.cu: what the host pays per CUDA call on the device machine.
 * Times (host wall clock, average over N calls, stream drained before and after):
 * an empty kernel launch, a launch while capturing a graph, a 1 KB pinned H2D
 * cudaMemcpyAsync (eager and captured), cudaGraphExecUpdate and cudaGraphLaunch of a
 * 55-node graph, cudaGetLastError, cudaStreamBeginCapture + EndCapture.
 * Build: nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o hostcost tools/device/hostcost.cu */
#include <cuda_runtime.h>
#include <stdio.h>
#include <time.h>

__global__ void k_empty(int *p, int v) {
    if (p && threadIdx.x == 1024) *p = v;
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

#define N 2000
int main(void) {
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    int *d;
    cudaMalloc(&d, 1 << 20);
    char *h;
    cudaMallocHost(&h, 1 << 20);
    for (int i = 0; i < 100; i++) k_empty<<<1, 32, 0, s>>>(d, i);
    cudaStreamSynchronize(s);
    double t0 = now_us();
    for (int i = 0; i < N; i++) k_empty<<<132, 256, 0, s>>>(d, i);
    double t1 = now_us();
    cudaStreamSynchronize(s);
    double t2 = now_us();
    printf("launch (eager)          %7.2f us/call host; drained after %7.2f us/kernel on the device\n", (t1 - t0) / N,
           (t2 - t0) / N);
    t0 = now_us();
    for (int i = 0; i < N; i++) cudaMemcpyAsync(d + (i % 64) * 256, h + (i % 64) * 1024, 1024, cudaMemcpyHostToDevice, s);
    t1 = now_us();
    cudaStreamSynchronize(s);
    printf("memcpy H2D 1KB pinned   %7.2f us/call host\n", (t1 - t0) / N);
    t0 = now_us();
    for (int i = 0; i < N; i++) (void)cudaGetLastError();
    printf("cudaGetLastError        %7.3f us/call\n", (now_us() - t0) / N);
    /* capture cost */
    cudaGraph_t g;
    cudaGraphExec_t ex = NULL;
    double cap = 0, cpy = 0, endc = 0, upd = 0, lau = 0;
    int reps = 50;
    for (int r = 0; r < reps; r++) {
        double a = now_us();
        cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);
        double b = now_us();
        for (int i = 0; i < 50; i++) k_empty<<<132, 256, 0, s>>>(d, i + r);
        double c = now_us();
        for (int i = 0; i < 5; i++) cudaMemcpyAsync(d + i * 256, h + i * 1024 + r, 1024, cudaMemcpyHostToDevice, s);
        double e = now_us();
        cudaStreamEndCapture(s, &g);
        double f = now_us();
        if (!ex) {
            cudaGraphInstantiate(&ex, g, 0);
        } else {
            cudaGraphExecUpdateResultInfo info;
            if (cudaGraphExecUpdate(ex, g, &info) != cudaSuccess) printf("update refused\n");
        }
        double u = now_us();
        cudaGraphLaunch(ex, s);
        double l = now_us();
        cudaGraphDestroy(g);
        cudaStreamSynchronize(s);
        if (r > 0) {
            cap += (c - b) / 50;
            cpy += (e - c) / 5;
            endc += (b - a) + (f - e);
            upd += u - f;
            lau += l - u;
        }
    }
    reps--;
    printf("launch (capturing)      %7.2f us/call host\n", cap / reps);
    printf("memcpy H2D (capturing)  %7.2f us/call host\n", cpy / reps);
    printf("Begin+EndCapture        %7.2f us per graph\n", endc / reps);
    printf("cudaGraphExecUpdate     %7.2f us per 55-node graph\n", upd / reps);
    printf("cudaGraphLaunch         %7.2f us per graph\n", lau / reps);
    printf("errors: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 0;
}
