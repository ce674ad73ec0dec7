/* backend/cuda/moe_gemm.cu: the MoE of many rows (prefill chunks) as gathered GEMMs.
 *
 * The slot-group kernels of moe.cu take up to 8 slots of an expert per pass and decode every
 * weight again for each pass: at prefill shapes (a 1024-row chunk routes ~24 rows to each of
 * 256 experts) they are compute-bound on the decoding (H200, 20 Flash layers, 2048-token
 * prefill: 3.0 s of the 4.3 s of kernel time were k_moe_up<8>/k_moe_down<8>).  Here the slots
 * are sorted by expert and each expert runs as a GEMM over its slots, every weight tile
 * decoded once per tile of 64 slots (32 when the experts average fewer than 40 slots: a
 * 512-row prefill sub-batch gives a V4-Flash expert ~12, and empty tile rows cost as much as
 * full ones):
 *
 *   k_mg_plan    one block: counts per expert, positions in (expert, slot) order (stable:
 *                slot order within an expert), the tiles (expert, first position, <= 64 or
 *                32 slots), each row's slots in expert-id order for the combine, the weight
 *                bytes; a bad id is skipped and sets the moe device flag (ops->check).
 *   k_mg_up      tile x 64 features: g = x W1^T and u = x W3^T for the tile's slots at once (the
 *                W1 and W3 rows of the same 64 features make one 128-row weight tile), then
 *                h = SwiGLU(g, u) (clamped, x the routing weight before w2 if asked, bf16
 *                where the profile rounds) into H [position][inter].
 *   (act_fp8)    h quantized per row by dsv4_cuda_act_quant, as moe.cu does.
 *   k_mg_down    tile x 128 output features: Y = H W2^T (bf16 where the profile rounds).
 *   combine      moe.cu's (dsv4_cuda_moe_combine): out[r] = (sum of w_j Y[position of slot j]
 *                over row r's experts in id order) x out_scale + Y[shared row r]; bf16 where
 *                the profile rounds.
 *
 * The shared expert is one more expert whose tiles take every row (launched separately: the
 * kernels are templated on the weight format, and the shared expert's may differ from the
 * routed ones').  The GEMM core is k_sgemm's (gemm.cu): K in steps of 16, x and W tiles
 * dequantized in registers with the exact codecs (d_load_w8 in common.cuh: the same fp32 values the CPU
 * makes), stored k-major into double-buffered shared tiles, 4 (or 2) x 8 outputs per thread, one
 * fp32 fma chain per output.  So results equal the CPU op's up to accumulation order, as for
 * every other linear of the backend.
 * Needs: dim and inter multiples of 16 (FP8: block multiple of 8; FP4: K multiple of 32), every
 * routed expert of one format and shape, 16-byte aligned x; otherwise cu_moe keeps the
 * slot-group kernels.  Used from dsv4_cuda_moe_gemm_min_rows() rows (default 128: below that
 * an expert gets too few slots for a 64-slot tile to pay).
 * Target: sm_90a.
 */
#include <stdlib.h>

#include "backend/cuda/moe.cuh"

#define MG_BK 16      /* K step */
#define MG_LDW (128 + 4)

int dsv4_cuda_moe_gemm_min_rows(void) {
    static int v = -1;
    if (v < 0) {
        const char *s = getenv("DSV4_CUDA_MOE_GEMM_MIN_ROWS");
        v = s && *s ? atoi(s) : 128;
        if (v < 0) v = 0;
    }
    return v;
}

/* calls per backend, for the tests (keyed by the backend's impl pointer; a handful of backends) */
static struct {
    const void *impl;
    long n;
} mg_calls[16];

static void count_call(dsv4_backend *b) {
    const void *k = CI(b);
    for (int i = 0; i < 16; i++)
        if (mg_calls[i].impl == k || !mg_calls[i].impl) {
            mg_calls[i].impl = k;
            mg_calls[i].n++;
            return;
        }
}

long dsv4_cuda_moe_gemm_calls(dsv4_backend *b) {
    const void *k = CI(b);
    for (int i = 0; i < 16; i++)
        if (mg_calls[i].impl == k) return mg_calls[i].n;
    return 0;
}

struct mg_tile {
    int ex;   /* expert (n_routed: the shared expert) */
    int pos0; /* first position in H / Y */
    int n;    /* slots, <= the tile size (64 or 32) */
};

/* The GEMM core shared by up and down, for tiles of TM slots (64 or 32):
 * acc[i][j] = sum_k X[slot ty*SI+i][k] W[row(j)][k] (SI = TM / 16 slots per thread) for the
 * tile's slots and the 128 weight rows of the block (row j of this thread: tx*4+j for j < 4,
 * 64+tx*4+j-4 otherwise).  xp: the K floats of this thread's x-loader slot (NULL past the
 * tile).  Same loop as k_sgemm: loads of step t overlap the multiply of step t - 1. */
template <int TM> struct mg_geo {
    enum { SI = TM / 16, XV = TM / 16, XT = 16 / (TM / 16), LDX = TM + 4 };
    /* x loader: XV consecutive k of slot xr */
    static __device__ __forceinline__ int xr() { return threadIdx.x / XT; }
    static __device__ __forceinline__ int xk() { return (threadIdx.x % XT) * XV; }
};

template <int FMT, int TM>
__device__ __forceinline__ void mg_core(float (&acc)[TM / 16][8], const float *xp, const dweight *wl, int64_t wo,
                                        int w_in, int64_t K, float (*xs)[MG_BK][TM + 4], float (*ws)[MG_BK][MG_LDW]) {
    typedef mg_geo<TM> G;
    constexpr int SI = G::SI, XV = G::XV;
    const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
    const int xr = G::xr(), xk = G::xk();
    const int lr = tid >> 1, lk = (tid & 1) * 8; /* W loader: weight row lr, k offset lk (8 values) */
#pragma unroll
    for (int i = 0; i < SI; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;
    float xv[XV];
#pragma unroll
    for (int i = 0; i < XV; i++) xv[i] = 0.0f;
    float wv[8];
    const int nk = (int)(K / MG_BK);
    for (int t = 0; t <= nk; t++) {
        if (t < nk) {
            int64_t k0 = (int64_t)t * MG_BK;
            if (xp) {
                if constexpr (XV == 4) {
                    float4 v = __ldg((const float4 *)(xp + k0 + xk));
                    xv[0] = v.x, xv[1] = v.y, xv[2] = v.z, xv[3] = v.w;
                } else {
                    float2 v = __ldg((const float2 *)(xp + k0 + xk));
                    xv[0] = v.x, xv[1] = v.y;
                }
            }
            if (w_in) d_load_w8<FMT>(*wl, wo, k0 + lk, wv);
            else {
#pragma unroll
                for (int i = 0; i < 8; i++) wv[i] = 0.0f;
            }
        }
        if (t > 0) {
            const int s = (t - 1) & 1;
#pragma unroll
            for (int kk = 0; kk < MG_BK; kk++) {
                float av[SI];
                if constexpr (SI == 4) {
                    float4 a = *(const float4 *)&xs[s][kk][ty * 4];
                    av[0] = a.x, av[1] = a.y, av[2] = a.z, av[3] = a.w;
                } else {
                    float2 a = *(const float2 *)&xs[s][kk][ty * 2];
                    av[0] = a.x, av[1] = a.y;
                }
                float4 b0 = *(const float4 *)&ws[s][kk][tx * 4], b1 = *(const float4 *)&ws[s][kk][64 + tx * 4];
                float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                for (int i = 0; i < SI; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
            }
        }
        if (t < nk) {
            const int s = t & 1;
#pragma unroll
            for (int i = 0; i < XV; i++) xs[s][xk + i][xr] = xv[i];
#pragma unroll
            for (int i = 0; i < 8; i++) ws[s][lk + i][lr] = wv[i];
        }
        __syncthreads();
    }
}

/* grid: (tiles, inter / 64).  Tile t0 + blockIdx.x (past *n_tiles: exit). */
template <int FMT, int TM>
__global__ void __launch_bounds__(256, 2) k_mg_up(float *H, int64_t ldh, const float *x, const float *xq, int64_t dim,
                                               const mg_tile *tiles, const int *n_tiles, int t0, const dexpert *tab,
                                               const int32_t *rowof, const float *pre, int act_fp8, float limit,
                                               int act_bf16) {
    pdl_wait(); /* no early launch_dependents: a multi-wave GEMM keeps its SM slots (common.cuh) */
    constexpr int SI = TM / 16;
    __shared__ __align__(16) float xs[2][MG_BK][TM + 4];
    __shared__ __align__(16) float ws[2][MG_BK][MG_LDW];
    int ti = t0 + (int)blockIdx.x;
    if (n_tiles && ti >= *n_tiles) return;
    const mg_tile T = tiles[ti];
    const dexpert &E = tab[T.ex];
    const int64_t inter = E.w1.rows, f0 = (int64_t)blockIdx.y * 64;
    if (f0 >= inter) return;
    const int tid = threadIdx.x, xr = mg_geo<TM>::xr(), lr = tid >> 1;
    const float *xb = act_fp8 && E.q1 ? xq : x;
    const float *xp = xr < T.n ? xb + (int64_t)rowof[T.pos0 + xr] * dim : NULL;
    /* weight rows 0..63: W1 features f0.., 64..127: W3 of the same features */
    const dweight *wl = lr < 64 ? &E.w1 : &E.w3;
    int64_t wo = f0 + (lr & 63);
    int w_in = wo < inter;
    float acc[SI][8];
    mg_core<FMT, TM>(acc, xp, wl, wo, w_in, dim, xs, ws);
    const int ty = tid >> 4, tx = tid & 15;
#pragma unroll
    for (int i = 0; i < SI; i++) {
        int s = ty * SI + i;
        if (s >= T.n) break;
        int p = T.pos0 + s;
        float pw = pre ? pre[p] : 1.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int64_t f = f0 + tx * 4 + j;
            if (f >= inter) break;
            H[(int64_t)p * ldh + f] = moe_swiglu(acc[i][j], acc[i][4 + j], limit, act_bf16, pw);
        }
    }
}

/* grid: (tiles, dim / 128) */
template <int FMT, int TM>
__global__ void __launch_bounds__(256, 2) k_mg_down(float *Y, int64_t dim, const float *H, int64_t ldh,
                                                 const mg_tile *tiles, const int *n_tiles, int t0, const dexpert *tab,
                                                 int act_bf16) {
    pdl_wait(); /* no early launch_dependents: a multi-wave GEMM keeps its SM slots (common.cuh) */
    constexpr int SI = TM / 16;
    __shared__ __align__(16) float xs[2][MG_BK][TM + 4];
    __shared__ __align__(16) float ws[2][MG_BK][MG_LDW];
    int ti = t0 + (int)blockIdx.x;
    if (n_tiles && ti >= *n_tiles) return;
    const mg_tile T = tiles[ti];
    const dexpert &E = tab[T.ex];
    const int64_t d0 = (int64_t)blockIdx.y * 128, nd = E.w2.rows < dim ? E.w2.rows : dim;
    if (d0 >= nd) return;
    const int tid = threadIdx.x, xr = mg_geo<TM>::xr(), lr = tid >> 1;
    const float *xp = xr < T.n ? H + (int64_t)(T.pos0 + xr) * ldh : NULL;
    int64_t wo = d0 + lr;
    float acc[SI][8];
    mg_core<FMT, TM>(acc, xp, &E.w2, wo, wo < nd, E.w2.cols, xs, ws);
    const int ty = tid >> 4, tx = tid & 15;
#pragma unroll
    for (int i = 0; i < SI; i++) {
        int s = ty * SI + i;
        if (s >= T.n) break;
        float *yr = Y + (int64_t)(T.pos0 + s) * dim;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int64_t d = d0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
            if (d < nd) yr[d] = act_bf16 ? d_round_bf16(acc[i][j]) : acc[i][j];
        }
    }
}

/* The plan, one block.  Shared memory: cnt[n_routed], off[n_routed], toff[n_routed].
 * Writes: posof[slot] (-1: bad id, skipped), rowof/pre [position], tiles[0 .. *n_tiles) of
 * the routed experts, the shared tiles at [max_rt, max_rt + ceil(rows / 64)), and
 * ord[r*k + i] / cw[r*k + i]: row r's i-th slot in expert-id order (ties in slot order). */
__global__ void __launch_bounds__(1024) k_mg_plan(mg_tile *tiles, int *n_tiles, int max_rt, int tm, int32_t *posof,
                                                  int32_t *rowof, float *pre, int32_t *ord, float *cw,
                                                  const int32_t *e, const float *wgt, int rows, int k, int n_routed,
                                                  int has_shared, int before_w2, const dexpert *tab,
                                                  unsigned long long *wbytes, unsigned *flags, unsigned bad_flag) {
    pdl_enter();
    extern __shared__ int sh[];
    int *cnt = sh, *off = sh + n_routed, *toff = sh + 2 * n_routed;
    const int nrs = rows * k, tid = threadIdx.x, nt = blockDim.x;
    for (int x = tid; x < n_routed; x += nt) cnt[x] = 0;
    __syncthreads();
    for (int s = tid; s < nrs; s += nt) {
        int x = e[s];
        if ((unsigned)x < (unsigned)n_routed) atomicAdd(&cnt[x], 1);
        else {
            posof[s] = -1;
            atomicOr(flags, bad_flag);
        }
    }
    __syncthreads();
    if (tid == 0) { /* prefix sums over experts (n_routed is a few hundred) */
        int o = 0, to = 0;
        for (int x = 0; x < n_routed; x++) {
            off[x] = o;
            toff[x] = to;
            o += cnt[x];
            to += (cnt[x] + tm - 1) / tm;
        }
        *n_tiles = to;
    }
    __syncthreads();
    /* one thread per expert walks the slots in order: stable positions, then its tiles */
    for (int x = tid; x < n_routed; x += nt) {
        int c = cnt[x];
        if (!c) continue;
        int p = off[x];
        for (int s = 0; s < nrs; s++)
            if (__ldg(e + s) == x) {
                posof[s] = p;
                rowof[p] = s / k;
                pre[p] = before_w2 ? wgt[s] : 1.0f;
                p++;
            }
        int nt_x = (c + tm - 1) / tm;
        for (int i = 0; i < nt_x; i++) {
            mg_tile T;
            T.ex = x;
            T.pos0 = off[x] + i * tm;
            T.n = min(tm, c - i * tm);
            tiles[toff[x] + i] = T;
        }
        atomicAdd(wbytes, tab[x].bytes * (unsigned long long)nt_x);
    }
    if (has_shared) {
        for (int r = tid; r < rows; r += nt) {
            rowof[nrs + r] = r;
            pre[nrs + r] = 1.0f;
        }
        int nsh = (rows + tm - 1) / tm;
        for (int i = tid; i < nsh; i += nt) {
            mg_tile T;
            T.ex = n_routed;
            T.pos0 = nrs + i * tm;
            T.n = min(tm, rows - i * tm);
            tiles[max_rt + i] = T;
        }
        if (tid == 0) atomicAdd(wbytes, tab[n_routed].bytes * (unsigned long long)nsh);
    }
    __syncthreads(); /* posof complete */
    /* each row's slots in expert-id order (ties: slot order), as the CPU accumulates */
    for (int r = tid; r < rows; r += nt) {
        const int32_t *er = e + (int64_t)r * k;
        int prev_e = -1, prev_j = -1;
        for (int i = 0; i < k; i++) {
            int be = 0x7fffffff, bj = -1;
            for (int j = 0; j < k; j++) {
                int x = er[j];
                if ((unsigned)x >= (unsigned)n_routed) continue;
                int after = x > prev_e || (x == prev_e && j > prev_j);
                if (after && (x < be || (x == be && j < bj))) be = x, bj = j;
            }
            if (bj < 0) {
                ord[r * k + i] = -1;
                cw[r * k + i] = 0.0f;
                continue;
            }
            ord[r * k + i] = posof[r * k + bj];
            cw[r * k + i] = before_w2 ? 1.0f : wgt[r * k + bj];
            prev_e = be, prev_j = bj;
        }
    }
}

static int mg_quantized(int fmt) { return fmt == DSV4_WF_FP8 || fmt == DSV4_WF_MXFP4 || fmt == DSV4_WF_NVFP4; }

/* a weight the GEMM core takes: K a multiple of 16 and of the format's scale group */
static int mg_ok(const dsv4_weight *w) {
    if (w->cols % MG_BK) return 0;
    switch (w->fmt) {
    case DSV4_WF_F32:
    case DSV4_WF_BF16: return 1;
    case DSV4_WF_FP8: return w->block > 0 && w->block % 8 == 0;
    case DSV4_WF_MXFP4: return w->cols % 32 == 0;
    case DSV4_WF_NVFP4: return 1;
    default: return 0;
    }
}

static int same_shape(const dsv4_weight *a, const dsv4_weight *b) {
    return a->fmt == b->fmt && a->rows == b->rows && a->cols == b->cols && a->block == b->block &&
           a->scale_f32 == b->scale_f32;
}

/* an FFN of one format for all three weights, shapes [I][D], [D][I] */
static int ffn_ok(const dsv4_ffn_w *f, int64_t dim) {
    return mg_ok(&f->w1) && mg_ok(&f->w3) && mg_ok(&f->w2) && same_shape(&f->w1, &f->w3) &&
           f->w1.fmt == f->w2.fmt && f->w1.cols == dim && f->w2.rows == dim && f->w2.cols == f->w1.rows &&
           f->w1.rows % 4 == 0;
}

/* one launch of the up (up = 1) or down kernel; the arguments every launch shares */
struct mg_args {
    float *H, *Y;
    int64_t ldh, dim;
    const float *x, *xq;
    const mg_tile *tiles;
    const dexpert *tab;
    const int32_t *rowof;
    const float *pre;
    int act_fp8, act_bf16;
    float limit;
};

template <int FMT, int TM>
static void mg_launch(cudaStream_t st, int up, dim3 grid, const mg_args &a, const int *n_tiles, int t0) {
    if (up)
        dsv4_launch(k_mg_up<FMT, TM>, grid, 256, 0, st, a.H, a.ldh, a.x, a.xq, a.dim, a.tiles, n_tiles, t0, a.tab,
                    a.rowof, a.pre, a.act_fp8, a.limit, a.act_bf16);
    else
        dsv4_launch(k_mg_down<FMT, TM>, grid, 256, 0, st, a.Y, a.dim, a.H, a.ldh, a.tiles, n_tiles, t0, a.tab,
                    a.act_bf16);
}

template <int TM>
static void mg_run_tm(cudaStream_t st, int fmt, int up, dim3 grid, const mg_args &a, const int *n_tiles, int t0) {
    switch (fmt) {
    case DSV4_WF_F32: mg_launch<DSV4_WF_F32, TM>(st, up, grid, a, n_tiles, t0); break;
    case DSV4_WF_BF16: mg_launch<DSV4_WF_BF16, TM>(st, up, grid, a, n_tiles, t0); break;
    case DSV4_WF_FP8: mg_launch<DSV4_WF_FP8, TM>(st, up, grid, a, n_tiles, t0); break;
    case DSV4_WF_MXFP4: mg_launch<DSV4_WF_MXFP4, TM>(st, up, grid, a, n_tiles, t0); break;
    default: mg_launch<DSV4_WF_NVFP4, TM>(st, up, grid, a, n_tiles, t0); break;
    }
}

static void mg_run(dsv4_backend *b, int tm, int fmt, int up, dim3 grid, const mg_args &a, const int *n_tiles,
                   int t0) {
    if (tm == 64) mg_run_tm<64>(CI(b)->stream, fmt, up, grid, a, n_tiles, t0);
    else mg_run_tm<32>(CI(b)->stream, fmt, up, grid, a, n_tiles, t0);
}

/* slots per tile: 64 when the experts average >= 40 slots, else 32 (prefill sub-batches of 512
 * rows give ~12 per expert at V4-Flash); DSV4_CUDA_MOE_GEMM_TM=32|64 forces one (A/B runs) */
static int mg_tile_slots(int nrs, int n_routed) {
    static int forced = -1;
    if (forced < 0) {
        const char *s = getenv("DSV4_CUDA_MOE_GEMM_TM");
        forced = s && (atoi(s) == 32 || atoi(s) == 64) ? atoi(s) : 0;
    }
    if (forced) return forced;
    return nrs >= 40 * n_routed ? 64 : 32;
}

int dsv4_cuda_moe_gemm_takes(const dsv4_ffn_w *experts, int n_routed, const dsv4_ffn_w *shared) {
    if (n_routed <= 0) return 0;
    const dsv4_ffn_w *f0 = &experts[0];
    int64_t dim = f0->w1.cols;
    if (!ffn_ok(f0, dim) || (shared && !ffn_ok(shared, dim))) return 0;
    for (int i = 1; i < n_routed; i++)
        if (!same_shape(&experts[i].w1, &f0->w1) || !same_shape(&experts[i].w3, &f0->w3) ||
            !same_shape(&experts[i].w2, &f0->w2))
            return 0;
    return 1;
}

int dsv4_cuda_moe_gemm(dsv4_backend *b, float *out, const float *x, const float *xq, int rows,
                       const dsv4_ffn_w *experts, int n_routed, const dsv4_ffn_w *shared, const dexpert *tab,
                       const int32_t *e, const float *wgt, int k, float limit, int before_w2, int act_fp8,
                       int act_bf16, float out_scale, unsigned long long *wbytes, unsigned *flags,
                       unsigned bad_flag) {
    if (rows <= 0 || k <= 0 || n_routed <= 0) return 0;
    const dsv4_ffn_w *f0 = &experts[0];
    int64_t dim = f0->w1.cols, inter = f0->w1.rows;
    if (!dsv4_cuda_moe_gemm_takes(experts, n_routed, shared) || ((uintptr_t)x | (uintptr_t)xq) & 15) return 0;
    cuda_impl *c = CI(b);
    int nrs = rows * k, S = nrs + (shared ? rows : 0);
    int64_t si = shared ? shared->w1.rows : 0, ldh = inter > si ? inter : si;
    int tm = mg_tile_slots(nrs, n_routed);
    int max_rt = nrs / tm + (n_routed < nrs ? n_routed : nrs) + 1; /* routed tiles, an upper bound */
    int nsh = shared ? (rows + tm - 1) / tm : 0;
    size_t plan_smem = sizeof(int) * 3 * (size_t)n_routed;
    if (plan_smem > 48 * 1024 &&
        CK(b, cudaFuncSetAttribute(k_mg_plan, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)plan_smem)))
        return 1; /* the sticky error is set: the op is over */
    mg_tile *tiles = (mg_tile *)dsv4_cuda_scratch(b, sizeof(mg_tile) * (size_t)(max_rt + nsh));
    int *nt = (int *)dsv4_cuda_scratch(b, sizeof(int));
    int32_t *posof = (int32_t *)dsv4_cuda_scratch(b, sizeof(int32_t) * (size_t)nrs);
    int32_t *rowof = (int32_t *)dsv4_cuda_scratch(b, sizeof(int32_t) * (size_t)S);
    float *pre = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)S);
    int32_t *ord = (int32_t *)dsv4_cuda_scratch(b, sizeof(int32_t) * (size_t)nrs);
    float *cw = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)nrs);
    float *H = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)S * (size_t)ldh);
    float *Y = (float *)dsv4_cuda_scratch(b, sizeof(float) * (size_t)S * (size_t)dim);
    if (!tiles || !nt || !posof || !rowof || !pre || !ord || !cw || !H || !Y) return 1;
    count_call(b);
    dsv4_launch(k_mg_plan, 1, 1024, plan_smem, c->stream, tiles, nt, max_rt, tm, posof, rowof, pre, ord, cw, e, wgt,
                rows, k, n_routed, shared != NULL, before_w2, tab, wbytes, flags, bad_flag);
    if (CKL(b)) return 1;
    /* up: routed tiles (count on the device, grid an upper bound), then the shared ones */
    mg_args A = {H, Y, ldh, dim, x, xq, tiles, tab, rowof, pre, act_fp8, act_bf16, limit};
    mg_run(b, tm, f0->w1.fmt, 1, dim3((unsigned)max_rt, (unsigned)((inter + 63) / 64)), A, nt, 0);
    if (CKL(b)) return 1;
    if (shared) {
        mg_run(b, tm, shared->w1.fmt, 1, dim3((unsigned)nsh, (unsigned)((si + 63) / 64)), A, NULL, max_rt);
        if (CKL(b)) return 1;
    }
    if (act_fp8) { /* h of each position quantized over its own width, as moe.cu does */
        if (mg_quantized(f0->w2.fmt)) {
            if (inter == ldh) /* contiguous rows: one launch */
                dsv4_cuda_act_quant(b, H, H, nrs, inter, 128);
            else
                for (int p = 0; p < nrs; p++)
                    dsv4_cuda_act_quant(b, H + (int64_t)p * ldh, H + (int64_t)p * ldh, 1, inter, 128);
        }
        if (shared && mg_quantized(shared->w2.fmt)) {
            if (si == ldh)
                dsv4_cuda_act_quant(b, H + (int64_t)nrs * ldh, H + (int64_t)nrs * ldh, rows, si, 128);
            else
                for (int r = 0; r < rows; r++)
                    dsv4_cuda_act_quant(b, H + (int64_t)(nrs + r) * ldh, H + (int64_t)(nrs + r) * ldh, 1, si, 128);
        }
    }
    mg_run(b, tm, f0->w2.fmt, 0, dim3((unsigned)max_rt, (unsigned)((dim + 127) / 128)), A, nt, 0);
    if (CKL(b)) return 1;
    if (shared) {
        mg_run(b, tm, shared->w2.fmt, 0, dim3((unsigned)nsh, (unsigned)((dim + 127) / 128)), A, NULL, max_rt);
        if (CKL(b)) return 1;
    }
    dsv4_cuda_moe_combine(b, out, Y, dim, rows, k, ord, cw, nrs, shared != NULL, out_scale, act_bf16, 1);
    CKL(b);
    return 1;
}
