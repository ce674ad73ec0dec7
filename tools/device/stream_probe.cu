/* tools/device/stream_probe.cu: how fast one kernel can stream a decode op's weights from DRAM on
 * this GPU, by the access patterns a GEMV can use, with next to no math.  A batch-1 decode step is a
 * chain of kernels that each read 2-70 MB once; dsv4's GEMVs reach 55-62 % of the copy rate and its
 * MoE ~50 % (docs/CUDA.md), and an earlier diagnostic of the MoE's own loads with trivial math
 * stopped at ~70 %.  This probe asks what the streaming alone allows, before any kernel is built on
 * a pattern:
 *   ldg U B:  each thread keeps U 16-byte loads in flight (ld.global.nc.L1::no_allocate.v4, a warp's
 *             32 loads one contiguous 512-byte run), B blocks of 256 threads per SM, grid-stride;
 *   chunk U B: as ldg, but block b reads its own contiguous share [n b / G, n (b + 1) / G) (the MoE's and
 *             k_gemv8x's grids: a block owns its rows), so the grid's loads are spread over G runs (stop 63);
 *   share U K B: the MoE's grid (k_moe_b1r): one block a K-byte share aligned to K (64 or 128 KB), as many blocks
 *             as shares (not persistent: the blocks run in waves), B blocks per SM (held by dynamic shared memory);
 *   rows U K B: the same grid and occupancy, but block b reads the 4 KB rows b, b + G, b + 2 G, ... (G blocks):
 *             DSV4_CUDA_MOE_B1G=6's interleaved features, where a group's blocks read neighbouring rows;
 *   cpa S V K, cpa-rows S V K: share's and rows' grids and bytes, loaded as k_moe_b1r loads them (b1f_run): each
 *             thread's 16-byte cp.async.cg copies into its own slots of an S-stage shared-memory ring, V copies a
 *             stage, S - 1 stages in flight (cp.async.wait_group), then read back from shared memory;
 *   bulk S T B: one thread per block feeds a ring of S shared-memory stages of T bytes by
 *             cp.async.bulk (the copy engine: no registers hold bytes in flight), the 8 warps read
 *             each stage from shared memory and release it (a block barrier), B blocks per SM.
 * Every variant folds what it read into one xor per block (checked against the ldg U 1 result on
 * the same buffer, so a variant that skips bytes fails).  Sizes: 4, 8, 16.8, 33.5 and 70 MB (a
 * 2 MB GEMV, the shared expert, wq_b / wo_b, a layer's routed gate/up); each launch of a run
 * reads the next of buffers spanning >= 512 MB, so none of it is in the 50-60 MB L2.  A run is 32
 * launches captured in one CUDA graph, without PDL: the per-kernel time includes the gap between
 * kernels, as in a decode step.  Printed: us per kernel, GB/s, % of the D2D copy rate
 * (cudaMemcpyAsync of 1 GiB, read + write counted, as `dsv4 bench` does).
 *   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/device/stream_probe.cu -o stream_probe
 *   ./stream_probe [SIZE_MB ...]
 * First run on the H200 on 2026-12-04 (docs/PERFORMANCE.md, stop 26): ldg U4-U8 at 4 blocks per SM is the
 * best pattern at every size (70 MB 17.2 us = 95 % of the copy rate, 33.5 MB 9.0 us = 87 %, 16.8 MB 5.3 us
 * = 74 %, 4 MB 2.5 us = 37 %); the bulk-copy rings are slower at every size. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "probe.cuh"

#define NT 256       /* threads a block */
#define RUN_LAUNCHES 32

__device__ __forceinline__ uint32_t fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

/* the block's xor into out[blockIdx.x] (a warp xor, then the warps' in shared memory) */
__device__ __forceinline__ void block_xor(uint32_t x, uint32_t *out) {
    __shared__ uint32_t w[NT / 32];
    for (int o = 16; o; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
    if ((threadIdx.x & 31) == 0) w[threadIdx.x >> 5] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t a = 0;
        for (int i = 0; i < NT / 32; i++) a ^= w[i];
        out[blockIdx.x] = a;
    }
}

/* the xor of the 16-byte vectors base, base + NT, .., base + (U - 1) NT, then the same from base + step, ..., below
 * end: U loads in flight a thread, issued before any is folded */
template <int U>
__device__ __forceinline__ uint32_t fold_run(const uint4 *src, size_t base, size_t end, size_t step) {
    uint32_t x = 0;
    for (; base < end; base += step) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            size_t i = base + (size_t)u * NT;
            v[u] = i < end ? probe_ld_stream(src + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) x ^= fold(v[u]);
    }
    return x;
}

/* ldg U: n16 16-byte vectors; a step of the grid covers gridDim.x * NT * U vectors, thread t's U
 * loads of a step at t, t + NT, ... within its block's run of NT * U */
template <int U>
__global__ void __launch_bounds__(NT) k_ldg(const uint4 *src, size_t n16, uint32_t *out) {
    block_xor(fold_run<U>(src, (size_t)blockIdx.x * NT * U + threadIdx.x, n16, (size_t)gridDim.x * NT * U), out);
}

/* chunk U: the pattern of dsv4's GEMV and MoE grids, where a block owns a contiguous share of the weight (its rows):
 * block b reads vectors [n16 b / G, n16 (b + 1) / G) in steps of NT * U (thread t's U loads at t, t + NT, ... of
 * the step), so at any moment the grid's loads are spread over G separate runs instead of one span (ldg) */
template <int U>
__global__ void __launch_bounds__(NT) k_chunk(const uint4 *src, size_t n16, uint32_t *out) {
    const size_t v0 = n16 * blockIdx.x / gridDim.x, v1 = n16 * (blockIdx.x + 1) / gridDim.x;
    block_xor(fold_run<U>(src, v0 + threadIdx.x, v1, (size_t)NT * U), out);
}

/* share U: block b reads vectors [b K16, min((b + 1) K16, n16)) (K16: a share's 16-byte vectors), one share a block,
 * as k_moe_b1r's blocks each read their group's 64 KB (down) or 2 x 64 KB (gate/up) of rows; the dynamic shared
 * memory the host passes only caps the blocks per SM */
template <int U>
__global__ void __launch_bounds__(NT) k_share(const uint4 *src, size_t n16, size_t k16, uint32_t *out) {
    const size_t v0 = (size_t)blockIdx.x * k16, v1 = v0 + k16 < n16 ? v0 + k16 : n16;
    block_xor(fold_run<U>(src, v0 + threadIdx.x, v1, (size_t)NT * U), out);
}

/* rows U: rows of NT vectors (4 KB); block b of G reads rows b, b + G, ... (U rows in flight, thread t vector t of
 * each), so at any moment the grid's loads fall in one span of about G rows, as with DSV4_CUDA_MOE_B1G=6 */
template <int U>
__global__ void __launch_bounds__(NT) k_rows(const uint4 *src, size_t n16, uint32_t *out) {
    const size_t g = gridDim.x, nrows = n16 / NT;
    uint32_t x = 0;
    for (size_t r = blockIdx.x; r < nrows; r += g * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            size_t ru = r + (size_t)u * g;
            v[u] = ru < nrows ? probe_ld_stream(src + ru * NT + threadIdx.x) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) x ^= fold(v[u]);
    }
    block_xor(x, out);
}

__device__ __forceinline__ uint32_t sm_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* cpa S V (ROWS 0: share's layout, block b's vectors [b K16, (b + 1) K16) in stages of V NT; ROWS 1: rows', V rows
 * of NT vectors a stage from b, b + G, ...): copy j of stage `it` of thread t is vector at(it, j) (n16 where there
 * is none), into slot ((it mod S) V + j) NT + t of the ring; each thread reads back only its own slots, so the
 * cp.async wait of its own groups is the only synchronisation, as in b1f_run */
template <int S, int V, int ROWS>
__global__ void __launch_bounds__(NT) k_cpa(const uint4 *src, size_t n16, size_t k16, uint32_t *out) {
    extern __shared__ __align__(128) uint4 cring[]; /* S V NT vectors (the rest of the allocation caps occupancy) */
    const size_t g = gridDim.x, b = blockIdx.x, t = threadIdx.x, nrows = n16 / NT;
    const size_t v0 = b * k16, v1 = v0 + k16 < n16 ? v0 + k16 : n16;
    auto at = [&](size_t it, int j) -> size_t {
        if (ROWS) {
            const size_t r = b + g * (it * V + (size_t)j);
            return r < nrows ? r * NT + t : n16;
        }
        const size_t v = v0 + (it * V + (size_t)j) * NT + t;
        return v < v1 ? v : n16;
    };
    const size_t nb = ROWS ? (nrows > b ? (nrows - b + g - 1) / g : 0) : 0; /* rows: the block's row count */
    const size_t nit = ROWS ? (nb + V - 1) / V : (v1 > v0 ? (v1 - v0 + (size_t)NT * V - 1) / ((size_t)NT * V) : 0);
    auto issue = [&](size_t it) {
#pragma unroll
        for (int j = 0; j < V; j++) {
            const size_t v = at(it, j);
            if (v < n16)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                                 sm_addr(cring + ((it % S) * V + (size_t)j) * NT + t)),
                             "l"(src + v)
                             : "memory");
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
#pragma unroll
    for (int st = 0; st < S - 1; st++) issue((size_t)st); /* copies past the end issue nothing, an empty group */
    uint32_t x = 0;
    for (size_t it = 0; it < nit; it++) {
        issue(it + S - 1);
        asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory");
#pragma unroll
        for (int j = 0; j < V; j++)
            if (at(it, j) < n16) x ^= fold(cring[((it % S) * V + (size_t)j) * NT + t]);
    }
    block_xor(x, out);
}

/* bulk S: the block's contiguous share of the buffer in units of T bytes (T % 16 == 0), a ring of S
 * stages; thread 0 arms stage s's mbarrier with its byte count and issues the copy, every thread
 * waits on it (parity = use count & 1), reads its 16-byte vectors of the stage, and the block's
 * barrier after the reads lets thread 0 refill the stage */
__global__ void __launch_bounds__(NT) k_bulk(const uint8_t *src, size_t bytes, int S, int T, uint32_t *out) {
    extern __shared__ __align__(128) uint8_t ring[]; /* S * T bytes, then S mbarriers */
    uint64_t *bar = (uint64_t *)(ring + (size_t)S * T);
    const size_t units = bytes / (size_t)T;
    const size_t u0 = units * blockIdx.x / gridDim.x, u1 = units * (blockIdx.x + 1) / gridDim.x;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sm_addr(bar + s)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](size_t u) {
        int s = (int)((u - u0) % (size_t)S);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sm_addr(bar + s)), "r"(T)
                     : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         sm_addr(ring + (size_t)s * T)),
                     "l"(src + u * (size_t)T), "r"(T), "r"(sm_addr(bar + s))
                     : "memory");
    };
    if (threadIdx.x == 0)
        for (size_t u = u0; u < u1 && u < u0 + (size_t)S; u++) issue(u);
    uint32_t x = 0;
    for (size_t u = u0; u < u1; u++) {
        const int s = (int)((u - u0) % (size_t)S);
        const uint32_t parity = (uint32_t)(((u - u0) / (size_t)S) & 1u);
        uint32_t done = 0;
        while (!done)
            asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                         "selp.u32 %0, 1, 0, p;\n\t}"
                         : "=r"(done)
                         : "r"(sm_addr(bar + s)), "r"(parity)
                         : "memory");
        const uint4 *st = (const uint4 *)(ring + (size_t)s * T);
        for (int i = threadIdx.x; i < T / 16; i += NT) x ^= fold(st[i]);
        __syncthreads(); /* every read of stage s is done */
        if (threadIdx.x == 0 && u + S < u1) issue(u + S);
    }
    block_xor(x, out);
}

/* buffer contents: a hash of the word index, so every xor depends on every byte read */
__global__ void k_fill(uint32_t *p, size_t n, uint32_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        p[i] = h;
    }
}

static uint32_t host_xor(const uint32_t *part, int n) {
    uint32_t a = 0;
    for (int i = 0; i < n; i++) a ^= part[i];
    return a;
}

struct run_cfg {
    const char *name;
    int kind; /* 0 ldg, 1 bulk, 2 chunk, 3 share, 4 rows, 5 cpa, 6 cpa-rows */
    int u, s, t, bps; /* share, rows, cpa: t the share's bytes; cpa: s stages of u copies */
};

/* one configuration on nbuf buffers of `bytes` each: 32 launches in a graph, rotating through the
 * buffers; returns us per kernel, the xor of buffer 0 in *x0 */
static double run(const run_cfg &c, uint8_t *const *buf, int nbuf, size_t bytes, int nsm, size_t sm_per_sm,
                  size_t sm_reserved, uint32_t *part_d, uint32_t *x0, cudaStream_t st) {
    int grid = nsm * c.bps;
    size_t smem = c.kind == 1 ? (size_t)c.s * c.t + 8 * (size_t)c.s : 0;
    if (c.kind == 1) CKP(cudaFuncSetAttribute(k_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (c.kind >= 3) {
        /* one block a share; the shared memory (cpa's ring, else unused) lets at most bps blocks share an SM */
        grid = (int)((bytes + (size_t)c.t - 1) / (size_t)c.t);
        smem = sm_per_sm / (size_t)c.bps - sm_reserved - 256;
        if (c.kind >= 5 && smem < (size_t)c.s * c.u * NT * 16) {
            fprintf(stderr, "stream_probe: %s S%d V%d does not fit %d blocks an SM\n", c.name, c.s, c.u, c.bps);
            exit(1);
        }
        const void *fn = c.kind == 6 ? (c.u == 2 ? (const void *)k_cpa<4, 2, 1> : (const void *)k_cpa<4, 4, 1>)
                         : c.kind == 5 ? (c.u == 2 ? (const void *)k_cpa<4, 2, 0> : (const void *)k_cpa<4, 4, 0>)
                         : c.kind == 4 ? (c.u == 2 ? (const void *)k_rows<2> : (const void *)k_rows<4>)
                                       : (c.u == 4 ? (const void *)k_share<4> : (const void *)k_share<8>);
        CKP(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    }
    auto launch = [&](int b) {
        const uint4 *src = (const uint4 *)buf[b];
        const size_t n16 = bytes / 16, k16 = (size_t)c.t / 16;
        if (c.kind == 5 && c.u == 2)
            k_cpa<4, 2, 0><<<grid, NT, smem, st>>>(src, n16, k16, part_d);
        else if (c.kind == 5)
            k_cpa<4, 4, 0><<<grid, NT, smem, st>>>(src, n16, k16, part_d);
        else if (c.kind == 6 && c.u == 2)
            k_cpa<4, 2, 1><<<grid, NT, smem, st>>>(src, n16, k16, part_d);
        else if (c.kind == 6)
            k_cpa<4, 4, 1><<<grid, NT, smem, st>>>(src, n16, k16, part_d);
        else if (c.kind == 3 && c.u == 4)
            k_share<4><<<grid, NT, smem, st>>>((const uint4 *)buf[b], bytes / 16, (size_t)c.t / 16, part_d);
        else if (c.kind == 3)
            k_share<8><<<grid, NT, smem, st>>>((const uint4 *)buf[b], bytes / 16, (size_t)c.t / 16, part_d);
        else if (c.kind == 4 && c.u == 2)
            k_rows<2><<<grid, NT, smem, st>>>((const uint4 *)buf[b], bytes / 16, part_d);
        else if (c.kind == 4)
            k_rows<4><<<grid, NT, smem, st>>>((const uint4 *)buf[b], bytes / 16, part_d);
        else if (c.kind == 1)
            k_bulk<<<grid, NT, smem, st>>>(buf[b], bytes, c.s, c.t, part_d);
        else if (c.kind == 2 && c.u == 4)
            k_chunk<4><<<grid, NT, 0, st>>>((const uint4 *)buf[b], bytes / 16, part_d);
        else if (c.kind == 2)
            k_chunk<8><<<grid, NT, 0, st>>>((const uint4 *)buf[b], bytes / 16, part_d);
        else if (c.u == 1)
            k_ldg<1><<<grid, NT, 0, st>>>((const uint4 *)buf[b], bytes / 16, part_d);
        else if (c.u == 2)
            k_ldg<2><<<grid, NT, 0, st>>>((const uint4 *)buf[b], bytes / 16, part_d);
        else if (c.u == 4)
            k_ldg<4><<<grid, NT, 0, st>>>((const uint4 *)buf[b], bytes / 16, part_d);
        else if (c.u == 8)
            k_ldg<8><<<grid, NT, 0, st>>>((const uint4 *)buf[b], bytes / 16, part_d);
        else
            k_ldg<16><<<grid, NT, 0, st>>>((const uint4 *)buf[b], bytes / 16, part_d);
    };
    /* the check: buffer 0 alone */
    launch(0);
    CKP(cudaGetLastError());
    CKP(cudaStreamSynchronize(st));
    uint32_t *part = (uint32_t *)malloc(sizeof(uint32_t) * grid);
    CKP(cudaMemcpy(part, part_d, sizeof(uint32_t) * grid, cudaMemcpyDeviceToHost));
    *x0 = host_xor(part, grid);
    free(part);
    CKP(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < RUN_LAUNCHES; i++) launch((i + 1) % nbuf);
    cudaGraphExec_t ge = probe_graph_ready(st);
    const float best = probe_graph_ms(ge, st, 3);
    CKP(cudaGraphExecDestroy(ge));
    return 1000.0 * best / RUN_LAUNCHES;
}

int main(int argc, char **argv) {
    double sizes_mb[16] = {4, 8, 16.8, 33.5, 70};
    int nsz = 5;
    if (argc > 1) {
        nsz = 0;
        for (int i = 1; i < argc && nsz < 16; i++) {
            double v = atof(argv[i]);
            if (v <= 0) {
                fprintf(stderr, "stream_probe: '%s' is not a size in MB\n", argv[i]);
                return 2;
            }
            sizes_mb[nsz++] = v;
        }
    }
    int dev = 0, nsm = 0;
    CKP(cudaGetDevice(&dev));
    CKP(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CKP(cudaGetDeviceProperties(&prop, dev));
    printf("device %s, %d SMs, L2 %d MB\n", prop.name, nsm, prop.l2CacheSize >> 20);
    cudaStream_t st;
    CKP(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    /* the copy rate, as dsv4 bench measures it */
    const size_t cb = (size_t)1 << 30;
    void *ca, *cbuf;
    CKP(cudaMalloc(&ca, cb));
    CKP(cudaMalloc(&cbuf, cb));
    CKP(cudaMemcpyAsync(cbuf, ca, cb, cudaMemcpyDeviceToDevice, st));
    cudaEvent_t e0, e1;
    CKP(cudaEventCreate(&e0));
    CKP(cudaEventCreate(&e1));
    CKP(cudaEventRecord(e0, st));
    CKP(cudaMemcpyAsync(cbuf, ca, cb, cudaMemcpyDeviceToDevice, st));
    CKP(cudaEventRecord(e1, st));
    CKP(cudaEventSynchronize(e1));
    float cms;
    CKP(cudaEventElapsedTime(&cms, e0, e1));
    const double copy_gbs = 2.0 * (double)cb / (cms * 1e-3) / 1e9;
    printf("copy rate %.0f GB/s (D2D 1 GiB, read + write)\n", copy_gbs);
    CKP(cudaFree(ca));
    CKP(cudaFree(cbuf));
    static const run_cfg cfgs[] = {
        {"ldg", 0, 1, 0, 0, 4},       {"ldg", 0, 2, 0, 0, 4},       {"ldg", 0, 4, 0, 0, 4},
        {"ldg", 0, 8, 0, 0, 2},       {"ldg", 0, 8, 0, 0, 4},       {"ldg", 0, 16, 0, 0, 2},
        {"bulk", 1, 0, 4, 8192, 2},   {"bulk", 1, 0, 8, 8192, 2},   {"bulk", 1, 0, 4, 16384, 2},
        {"bulk", 1, 0, 6, 16384, 1},  {"bulk", 1, 0, 12, 16384, 1}, {"bulk", 1, 0, 4, 32768, 1},
        {"chunk", 2, 4, 0, 0, 4},     {"chunk", 2, 8, 0, 0, 4},     {"chunk", 2, 4, 0, 0, 2},
        {"chunk", 2, 8, 0, 0, 2},     {"share", 3, 4, 0, 65536, 4}, {"share", 3, 8, 0, 65536, 4},
        {"share", 3, 4, 0, 131072, 4}, {"rows", 4, 2, 0, 65536, 4}, {"rows", 4, 4, 0, 65536, 4},
        {"rows", 4, 4, 0, 131072, 4}, {"cpa", 5, 2, 4, 65536, 4},  {"cpa", 5, 4, 4, 65536, 3},
        {"cpa-rows", 6, 2, 4, 65536, 4}, {"cpa-rows", 6, 4, 4, 65536, 3},
    };
    const int ncfg = (int)(sizeof cfgs / sizeof cfgs[0]);
    /* a share kernel's grid: one block per 64 KB of the largest size */
    double max_mb = 0;
    for (int z = 0; z < nsz; z++) max_mb = sizes_mb[z] > max_mb ? sizes_mb[z] : max_mb;
    const size_t nparts = (size_t)nsm * 16 + (size_t)(max_mb * 1e6) / 65536 + 1;
    uint32_t *part_d;
    CKP(cudaMalloc(&part_d, sizeof(uint32_t) * nparts));
    int bad = 0;
    for (int z = 0; z < nsz; z++) {
        /* a multiple of 32 KB (the largest stage), so every variant reads the same bytes */
        size_t bytes = (size_t)(sizes_mb[z] * 1e6) / 32768 * 32768;
        if (bytes < 32768) bytes = 32768;
        int nbuf = (int)(((size_t)512 << 20) / bytes) + 1;
        if (nbuf > RUN_LAUNCHES + 1) nbuf = RUN_LAUNCHES + 1;
        if (nbuf < 2) nbuf = 2;
        uint8_t **buf = (uint8_t **)malloc(sizeof(uint8_t *) * nbuf);
        for (int b = 0; b < nbuf; b++) {
            CKP(cudaMalloc((void **)&buf[b], bytes));
            k_fill<<<nsm * 4, 256, 0, st>>>((uint32_t *)buf[b], bytes / 4, 0x9e3779b9u * (uint32_t)(b + 1));
            CKP(cudaGetLastError());
        }
        CKP(cudaStreamSynchronize(st));
        printf("\n%.1f MB (%zu bytes), %d buffers (%.0f MB) rotating, %d launches a graph\n", bytes / 1e6, bytes, nbuf,
               nbuf * bytes / 1e6, RUN_LAUNCHES);
        printf("  %-32s %10s %9s %8s  %s\n", "pattern", "us/kernel", "GB/s", "% copy", "check");
        uint32_t ref = 0;
        for (int i = 0; i < ncfg; i++) {
            const run_cfg &c = cfgs[i];
            if (c.kind == 1 && (size_t)c.s * c.t + 8 * (size_t)c.s > (size_t)prop.sharedMemPerBlockOptin / c.bps) continue;
            uint32_t x0 = 0;
            double us = run(c, buf, nbuf, bytes, nsm, prop.sharedMemPerMultiprocessor, prop.reservedSharedMemPerBlock,
                            part_d, &x0, st);
            if (i == 0) ref = x0;
            char label[64];
            if (c.kind == 0) snprintf(label, sizeof label, "ldg U%d, %d blocks/SM", c.u, c.bps);
            else if (c.kind == 2) snprintf(label, sizeof label, "chunk U%d, %d blocks/SM", c.u, c.bps);
            else if (c.kind >= 5)
                snprintf(label, sizeof label, "%s S%d V%d %dK, %d blocks/SM", c.name, c.s, c.u, c.t / 1024, c.bps);
            else if (c.kind >= 3)
                snprintf(label, sizeof label, "%s U%d %dK, %d blocks/SM", c.name, c.u, c.t / 1024, c.bps);
            else snprintf(label, sizeof label, "bulk %dx%dK, %d blocks/SM", c.s, c.t / 1024, c.bps);
            double gbs = bytes / (us * 1e-6) / 1e9;
            int ok = x0 == ref;
            bad += !ok;
            printf("  %-32s %10.2f %9.0f %7.1f%%  %s\n", label, us, gbs, 100.0 * gbs / copy_gbs,
                   ok ? "xor ok" : "XOR DIFFERS");
        }
        for (int b = 0; b < nbuf; b++) CKP(cudaFree(buf[b]));
        free(buf);
    }
    CKP(cudaFree(part_d));
    printf("\n%s\n", bad ? "FAILED: a pattern read other bytes than ldg U1" : "all patterns read the same bytes");
    return bad ? 1 : 0;
}
