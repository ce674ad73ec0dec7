/* tools/device/phase_probe.cu: the premise of a persistent decode layer, measured before any rewrite
 * (docs/CUDA.md "Not done", stop 55).  A decode layer alternates latency-bound phases (hc, attention, the
 * router: dependent round trips on a few blocks) with weight streams (33.5 MB FP8 GEMVs).  Today each is
 * a kernel in a PDL chain, and a GEMV asks for only a few loads a thread before its wait.  In one
 * persistent kernel the GEMV's blocks could stage their first weights in shared memory while the latency
 * phase runs, and compute once a flag says the phase's output is there.  Timed per iteration:
 *   L      the latency phase alone: one block, D dependent L2 round trips (a pointer chase), then x;
 *   G      the GEMV alone: y = W x, W [R x K] e4m3 (8192 x 4096: 33.5 MB), a warp's rows in order (ROWS2
 *          below: one or two rows' loads in flight a warp);
 *   L+G    both as two PDL launches (G's first rows in registers before its wait);
 *   fused  one cooperative kernel: block 0 runs L and then releases a flag; the other blocks stage up to
 *          STAGE_KB of their rows in shared memory (cp.async), and the next (two with ROWS2) in registers,
 *          before they wait for it, then compute;
 *   L+Gs   the PDL pair with G's blocks staging as the fused kernel's do before their wait: the same gain
 *          within today's launch chain, if G's blocks become resident while L runs.
 * The fused iterations run in stream order (a cooperative launch takes no PDL attribute here), so each pays
 * the launch that the pair's PDL hides: the comparison leans against the fused form.
 * W rotates over NW copies (134 MB), so no iteration finds its weights in the 50 MB L2.  Every form's y
 * is checked against the host's sums first.  The rewrite pays only if "fused" takes most of L's time
 * off "L+G".  Measured on an H100 (stop 58, docs/PERFORMANCE.md): it does not; neither "fused" nor "L+Gs"
 * hid more than the pair's 1.5-2.1 us in any of the eight settings run.
 *   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a [-DROWS2=1] tools/device/phase_probe.cu -o phase_probe
 *   ./phase_probe [D round trips, default 48] [STAGE_KB, default 80] */
#include <math.h>

#include "probe.cuh"

enum { R = 8192, K = 4096, NW = 4, THREADS = 256, WARPS = THREADS / 32, VPL = K / 16 / 32, CHASE = 4096 };
/* x in shared memory is kept transposed by 16-value vector: x[16 m + c] at xs[c * XS + m].  A lane's 16
 * weight bytes meet x[16 m ..], and the warp's lanes take consecutive m: read in x's own order, every
 * lane's address would fall in one of two banks (a 16-way conflict, which held the first G to 1.25 TB/s
 * on the H100).  XS = K / 16 + 1 (XS = 1 mod 32) also keeps the transposing writes at most 2-way. */
enum { XS = K / 16 + 1, XS_FLOATS = 16 * XS };

/* 16 e4m3 bytes of v (vector m of a row) times x's 16 values there, one fma chain */
__device__ __forceinline__ float dot16(uint4 v, const float *xs, int m) {
    const uint32_t *w = (const uint32_t *)&v;
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 l = probe_e4m3x2_f32<0>(w[i]), h = probe_e4m3x2_f32<1>(w[i]);
        a = fmaf(l.x, xs[(4 * i) * XS + m], a);
        a = fmaf(l.y, xs[(4 * i + 1) * XS + m], a);
        a = fmaf(h.x, xs[(4 * i + 2) * XS + m], a);
        a = fmaf(h.y, xs[(4 * i + 3) * XS + m], a);
    }
    return a;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* one row from vectors in registers (lane l holds vectors l, l + 32, ...) */
__device__ __forceinline__ void row_out(const uint4 (&v)[VPL], const float *xs, float *y, int r) {
    float a = 0.0f;
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < VPL; j++) a += dot16(v[j], xs, lane + 32 * j);
    a = warp_sum(a);
    if (lane == 0) y[r] = a;
}

__device__ __forceinline__ void row_load(uint4 (&v)[VPL], const uint8_t *W, int r) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < VPL; j++) v[j] = probe_ld_stream(W + (size_t)r * K + 16 * (lane + 32 * j));
}

/* the latency phase: D dependent L2 round trips from thread 0, then x = xsrc (+ 0 from the chain's
 * end, which the compiler cannot know) by the block's threads */
__device__ __forceinline__ void chase_then_x(float *x, const float *xsrc, const unsigned *next, int d) {
    __shared__ unsigned endv;
    if (threadIdx.x == 0) {
        unsigned j = 0;
        for (int i = 0; i < d; i++) j = __ldcg(next + j);
        endv = j;
    }
    __syncthreads();
    float z = (float)(endv >> 31);
    for (int k = threadIdx.x; k < K; k += blockDim.x) x[k] = xsrc[k] + z;
}

__global__ void k_lat(float *x, const float *xsrc, const unsigned *next, int d) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    chase_then_x(x, xsrc, next, d);
}

/* a warp's rows r, r + nw, ... < R.  ROWS2 (-DROWS2=1) keeps two rows' vectors in flight a warp (v holds
 * row r and u row r + nw when rows_run starts; rows_first asks for them); that needs ~214 registers, so
 * a block an SM.  Without it, one row in flight and two blocks an SM: the same bytes in flight an SM. */
#ifndef ROWS2
#define ROWS2 0
#endif
enum { BPS = ROWS2 ? 1 : 2 };

__device__ __forceinline__ void rows_first(uint4 (&v)[VPL], uint4 (&u)[VPL], const uint8_t *W, int r, int nw) {
    if (r < R) row_load(v, W, r);
    if (ROWS2 && r + nw < R) row_load(u, W, r + nw);
}

__device__ __forceinline__ void rows_run(uint4 (&v)[VPL], uint4 (&u)[VPL], const uint8_t *W, const float *xs,
                                         float *y, int r, int nw) {
#if ROWS2
    while (r < R) {
        row_out(v, xs, y, r);
        if (r + 2 * nw < R) row_load(v, W, r + 2 * nw);
        r += nw;
        if (r >= R) break;
        row_out(u, xs, y, r);
        if (r + 2 * nw < R) row_load(u, W, r + 2 * nw);
        r += nw;
    }
#else
    (void)u;
    for (; r < R; r += nw) {
        row_out(v, xs, y, r);
        if (r + nw < R) row_load(v, W, r + nw);
    }
#endif
}

/* G: warp gw takes rows gw, gw + nw, ...; its first rows' vectors are asked for before the wait */
__global__ void __launch_bounds__(THREADS, BPS) k_gemv(float *y, const uint8_t *W, const float *x) {
    __shared__ float xs[XS_FLOATS];
    int nw = gridDim.x * WARPS, gw = blockIdx.x * WARPS + (threadIdx.x >> 5);
    uint4 v[VPL], u[VPL];
    rows_first(v, u, W, gw, nw);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    for (int k = threadIdx.x; k < K; k += THREADS) xs[(k & 15) * XS + (k >> 4)] = x[k];
    __syncthreads();
    rows_run(v, u, W, xs, y, gw, nw);
}

__device__ __forceinline__ void cp16(void *dst, const void *src) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

/* a GEMV warp's part once its first ns rows (ns a warp, st its staging area) are asked for by cp.async
 * and the next (two with ROWS2) in registers: WAIT 0 waits for flag = it (the fused kernel), WAIT 1 for
 * the PDL primary (griddepcontrol.wait); then x into shared memory and the rows */
template <int WAIT>
__device__ __forceinline__ void gemv_staged(float *y, const uint8_t *W, const float *x, float *xs, uint8_t *st,
                                            int gw, int nw, int ns, const unsigned *flag, unsigned it) {
    int lane = threadIdx.x & 31;
    for (int i = 0; i < ns; i++) {
        int r = gw + i * nw;
        if (r < R)
#pragma unroll
            for (int j = 0; j < VPL; j++)
                cp16(st + (size_t)i * K + 16 * (lane + 32 * j), W + (size_t)r * K + 16 * (lane + 32 * j));
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    int r1 = gw + ns * nw; /* the first row not staged: it (and with ROWS2 the next) in registers before the wait */
    uint4 v[VPL], u[VPL];
    rows_first(v, u, W, r1, nw);
    if (WAIT == 1) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    } else {
        if (threadIdx.x == 0) {
            unsigned f;
            do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(f) : "l"(flag) : "memory");
            while (f != it);
        }
        __syncthreads();
    }
    for (int k = threadIdx.x; k < K; k += THREADS) xs[(k & 15) * XS + (k >> 4)] = __ldcg(x + k);
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    for (int i = 0, r = gw; i < ns && r < R; i++, r += nw) {
        uint4 w[VPL];
#pragma unroll
        for (int j = 0; j < VPL; j++) w[j] = *(const uint4 *)(st + (size_t)i * K + 16 * (lane + 32 * j));
        row_out(w, xs, y, r);
    }
    rows_run(v, u, W, xs, y, r1, nw);
}

/* fused: block 0 runs the latency phase and releases flag = it; block b > 0 is GEMV block b - 1 of
 * gridDim.x - 1: each warp stages its first ns rows (ns a warp, from the dynamic shared memory's size)
 * before it waits, the rest after */
__global__ void __launch_bounds__(THREADS, BPS) k_fused(float *y, const uint8_t *W, float *x, const float *xsrc,
                                                      const unsigned *next, int d, unsigned *flag, unsigned it,
                                                      int ns) {
    extern __shared__ __align__(16) uint8_t sm[];
    if (blockIdx.x == 0) {
        chase_then_x(x, xsrc, next, d);
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(it) : "memory");
        }
        return;
    }
    int warp = threadIdx.x >> 5;
    uint8_t *st = sm + XS_FLOATS * sizeof(float) + (size_t)warp * ns * K; /* XS_FLOATS * 4: a 16-byte multiple */
    int nw = (gridDim.x - 1) * WARPS, gw = (blockIdx.x - 1) * WARPS + warp;
    gemv_staged<0>(y, W, x, (float *)sm, st, gw, nw, ns, flag, it);
}

/* the same staging in today's form, a PDL pair: G's blocks become resident beside L's one block once it
 * lets its dependents launch, stage their first rows, then wait for L's grid (no cooperative launch) */
__global__ void __launch_bounds__(THREADS, BPS) k_gemv_st(float *y, const uint8_t *W, const float *x, int ns) {
    extern __shared__ __align__(16) uint8_t sm[];
    int warp = threadIdx.x >> 5;
    uint8_t *st = sm + XS_FLOATS * sizeof(float) + (size_t)warp * ns * K;
    int nw = gridDim.x * WARPS, gw = blockIdx.x * WARPS + warp;
    gemv_staged<1>(y, W, x, (float *)sm, st, gw, nw, ns, NULL, 0);
}

static float e4m3_host(uint8_t b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
    return s ? -v : v;
}

static void launch(const void *fn, int grid, size_t smem, cudaStream_t st, int pdl, int coop, void **args) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = at;
    cfg.numAttrs = 0;
    if (pdl) {
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.numAttrs = 1;
    } else if (coop) {
        at[0].id = cudaLaunchAttributeCooperative;
        at[0].val.cooperative = 1;
        cfg.numAttrs = 1;
    }
    CKP(cudaLaunchKernelExC(&cfg, fn, args));
}

int main(int argc, char **argv) {
    int d = argc > 1 ? atoi(argv[1]) : 48, stage_kb = argc > 2 ? atoi(argv[2]) : 80;
    cudaDeviceProp p;
    CKP(cudaGetDeviceProperties(&p, 0));
    int sms = p.multiProcessorCount, ns = stage_kb * 1024 / WARPS / K;
    size_t fsm = XS_FLOATS * sizeof(float) + (size_t)WARPS * ns * K;
    printf("%s, %d SMs; D %d round trips; fused: %d staged rows a warp (%zu KB shared a block)\n", p.name, sms, d, ns,
           fsm / 1024);
    /* host data: NW weight copies (bytes that are not NaN), x, the chase table (a random cycle) */
    size_t wb = (size_t)R * K;
    uint8_t *hw = (uint8_t *)malloc(wb * NW);
    float *hx = (float *)malloc(K * sizeof(float)), *hy = (float *)malloc(R * sizeof(float));
    unsigned *hn = (unsigned *)malloc(CHASE * sizeof(unsigned)), *perm = (unsigned *)malloc(CHASE * sizeof(unsigned));
    unsigned s = 12345u;
    for (size_t i = 0; i < wb * NW; i++) {
        s = s * 1664525u + 1013904223u;
        uint8_t b = (uint8_t)(s >> 24);
        hw[i] = (b & 0x7f) == 0x7f ? 0x38 : b;
    }
    for (int k = 0; k < K; k++) s = s * 1664525u + 1013904223u, hx[k] = (float)(s >> 8) / 16777216.0f - 0.5f;
    for (int i = 0; i < CHASE; i++) perm[i] = i;
    for (int i = CHASE - 1; i > 0; i--) {
        s = s * 1664525u + 1013904223u;
        int j = (int)(s % (unsigned)(i + 1));
        unsigned t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int i = 0; i < CHASE; i++) hn[perm[i]] = perm[(i + 1) % CHASE];
    uint8_t *W;
    float *x, *xsrc, *y;
    unsigned *next, *flag;
    CKP(cudaMalloc(&W, wb * NW));
    CKP(cudaMalloc(&x, K * sizeof(float)));
    CKP(cudaMalloc(&xsrc, K * sizeof(float)));
    CKP(cudaMalloc(&y, R * sizeof(float)));
    CKP(cudaMalloc(&next, CHASE * sizeof(unsigned)));
    CKP(cudaMalloc(&flag, sizeof(unsigned)));
    CKP(cudaMemcpy(W, hw, wb * NW, cudaMemcpyHostToDevice));
    CKP(cudaMemcpy(xsrc, hx, K * sizeof(float), cudaMemcpyHostToDevice));
    CKP(cudaMemcpy(next, hn, CHASE * sizeof(unsigned), cudaMemcpyHostToDevice));
    CKP(cudaMemset(flag, 0, sizeof(unsigned)));
    CKP(cudaFuncSetAttribute((const void *)k_fused, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fsm));
    int per = 0;
    CKP(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, k_fused, THREADS, fsm));
    int fgrid = per * sms; /* every block resident (a cooperative launch requires it) */
    printf("fused: %d blocks an SM, grid %d (1 latency block + %d GEMV blocks)\n", per, fgrid, fgrid - 1);
    if (fgrid < 2) return fprintf(stderr, "fused: no room for its blocks\n"), 1;
    CKP(cudaFuncSetAttribute((const void *)k_gemv_st, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fsm));
    int sper = 0;
    CKP(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&sper, k_gemv_st, THREADS, fsm));
    int sgrid = sper * sms;
    printf("L+G staged (PDL): %d blocks an SM, grid %d\n", sper, sgrid);
    if (sgrid < 1) return fprintf(stderr, "staged pair: no room for its blocks\n"), 1;
    cudaStream_t st;
    CKP(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    unsigned epoch = 0;
    /* one iteration of a form on weight copy c: 0 L, 1 G, 2 L+G, 3 fused, 4 L+G with G's rows staged */
    auto run = [&](int form, int c) {
        const uint8_t *wc = W + (size_t)c * wb;
        void *al[] = {&x, &xsrc, &next, &d};
        void *ag[] = {&y, &wc, &x};
        if (form == 0 || form == 2) launch((const void *)k_lat, 1, 0, st, form == 2, 0, al);
        if (form == 1 || form == 2) launch((const void *)k_gemv, BPS * sms, 0, st, form == 2, 0, ag);
        if (form == 4) {
            void *as[] = {&y, &wc, &x, &ns};
            launch((const void *)k_lat, 1, 0, st, 1, 0, al);
            launch((const void *)k_gemv_st, sgrid, fsm, st, 1, 0, as);
        }
        if (form == 3) {
            epoch++;
            void *af[] = {&y, &wc, &x, &xsrc, &next, &d, &flag, &epoch, &ns};
            launch((const void *)k_fused, fgrid, fsm, st, 0, 1, af);
        }
    };
    /* the check: every GEMV form on copy 0 against the host's sums (x = xsrc) */
    /* scale: a row's sum of |w x| (random e4m3 bytes reach 448, so the sums cancel and |y| says little of
     * fp32's rounding); a lost 16-byte vector moves y by ~1e-3 of it (16 of 4096 terms, random signs),
     * fp32's order moved it by 2.3e-8 on the H100 (stop 56) */
    double *hs = (double *)malloc(R * sizeof(double));
    for (int r = 0; r < R; r++) {
        double a = 0.0, m = 0.0;
        for (int k = 0; k < K; k++) {
            double t = (double)e4m3_host(hw[(size_t)r * K + k]) * hx[k];
            a += t, m += fabs(t);
        }
        hy[r] = (float)a, hs[r] = m;
    }
    const char *names[5] = {"L", "G", "L+G (PDL)", "fused", "L+Gs (PDL)"};
    int bad = 0;
    for (int form = 1; form < 5; form++) {
        CKP(cudaMemset(y, 0, R * sizeof(float)));
        CKP(cudaMemcpy(x, hx, K * sizeof(float), cudaMemcpyHostToDevice));
        run(form, 0);
        CKP(cudaStreamSynchronize(st));
        float *gy = (float *)malloc(R * sizeof(float));
        CKP(cudaMemcpy(gy, y, R * sizeof(float), cudaMemcpyDeviceToHost));
        double worst = 0.0;
        for (int r = 0; r < R; r++) {
            double e = fabs((double)gy[r] - hy[r]) / (hs[r] + 1.0);
            if (!(e <= worst)) worst = e;
        }
        printf("check %-11s worst |y - host| / (sum |w x| + 1) = %.3g%s\n", names[form], worst,
               worst < 1e-5 ? "" : " BAD");
        bad |= !(worst < 1e-5);
        free(gy);
    }
    if (bad) return fprintf(stderr, "a form's y differs from the host's: no timing\n"), 1;
    const int N = 200;
    for (int form = 0; form < 5; form++) {
        float best = 1e30f;
        for (int rep = 0; rep < 5; rep++) {
            cudaEvent_t e0, e1;
            CKP(cudaEventCreate(&e0));
            CKP(cudaEventCreate(&e1));
            run(form, 0); /* warm-up, outside the timing */
            CKP(cudaEventRecord(e0, st));
            for (int i = 0; i < N; i++) run(form, i % NW);
            CKP(cudaEventRecord(e1, st));
            CKP(cudaEventSynchronize(e1));
            float ms;
            CKP(cudaEventElapsedTime(&ms, e0, e1));
            if (ms < best) best = ms;
            CKP(cudaEventDestroy(e0));
            CKP(cudaEventDestroy(e1));
        }
        double us = best * 1000.0 / N;
        printf("%-11s %8.2f us an iteration", names[form], us);
        if (form == 1) printf("  (%.0f GB/s)", (double)wb / (us * 1e3));
        printf("\n");
    }
    CKP(cudaGetLastError());
    return 0;
}
