/* backend/cuda/oplist.cuh: the task table of one k_op_list launch (included by .cu files only).
 *
 * cu_op_list (oplist.cu) fills it from an op_list call; k_op_list (norm.cu, beside the standalone
 * kernels whose device functions it shares) runs it.  A launch: at most OL_MAX tasks, a 1-D grid
 * of blockDim `threads`, task t owning blocks first[t] .. first[t+1]-1; the rope tasks' positions
 * and frequencies in pos[] and freq[] (from pos_at / freq_at).  The table travels as the kernel's
 * parameter (~4.3 KB): nothing is staged, so a launch adds no copy to a graph (copies would also
 * break the chain of programmatic launches).
 *
 * Shapes by kind (n0..n3):
 *   OL_RMSNORM    n0 vectors of n2 floats, y -> x (may be the same), w: weights (vw 1 f32, 2 bf16)
 *   OL_NORM_ROPE  n0 rows x n1 heads of n2 floats in place (x), rope on the last n3, w as above
 *   OL_ROPE       n0 rows x n1 heads of n2 floats in place (x), rope on the last n3
 *   OL_ADD_CYCLIC n0 rows of n1 floats in place (x), += y row ((n3 + row) mod n2)
 *   OL_COPY16     n0 16-byte words y -> x;  OL_COPY1: n0 bytes
 *   OL_SCALE      n0 floats in place (x) times f
 * flags: bit 0 out_bf16, bit 1 inverse (rope), bits 2-3 vw, bit 4 the norm's DSV4_NORM_BF16_STEPS. */
#ifndef DSV4_BACKEND_CUDA_OPLIST_CUH
#define DSV4_BACKEND_CUDA_OPLIST_CUH

#include "backend/cuda/common.cuh"
#include "backend/cuda/norm.cuh" /* rmsnorm_vec_threads, rmsnorm_vw */

enum { OL_MAX = 48, OL_POS = 64, OL_FREQ = 128 };
enum { OL_RMSNORM = 1, OL_NORM_ROPE, OL_ROPE, OL_ADD_CYCLIC, OL_COPY16, OL_COPY1, OL_SCALE };

struct ol_task {
    void *x;          /* written */
    const void *y;    /* read (rmsnorm's input, add_cyclic's rows, copy's source) */
    const void *w;    /* norm weights, NULL = unweighted */
    int kind, flags;
    int n0, n1, n2, n3;
    float f;          /* eps (norms), s (scale) */
    int pos_at, freq_at;
};

struct ol_params {
    int n;                  /* tasks */
    int early;              /* op_list_beside: the tasks before the PDL wait, the wait at the end (oplist.cu) */
    int first[OL_MAX + 1];  /* block prefix */
    ol_task t[OL_MAX];
    int64_t pos[OL_POS];
    float freq[OL_FREQ];
};

/* launches k_op_list (norm.cu) over `blocks` blocks of `threads`; 1 on error (sticky) */
int dsv4_cuda_op_list_launch(dsv4_backend *b, const ol_params &p, unsigned blocks, int threads);

#endif
