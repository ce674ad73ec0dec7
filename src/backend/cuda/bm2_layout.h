/* backend/cuda/bm2_layout.h: where bm2_run (moe.cu, moe.dot=mma's second kernel form) puts a warp's
 * slice of weight vectors in shared memory and where its ldmatrix.x4 reads them.  Plain functions of
 * the lane, shared by the kernel and tests/test_kernel_layout.c, which checks on the CPU that every
 * lane receives bm_run's words and that no ldmatrix phase has a bank conflict.
 * A slice: 16 weight rows x 4 vectors of 16 bytes (one 32-wide scale block each); row i at byte 64 i,
 * vector j in slot j ^ ((i >> 1) & 3) of the row. */
#ifndef DSV4_BACKEND_CUDA_BM2_LAYOUT_H
#define DSV4_BACKEND_CUDA_BM2_LAYOUT_H

#ifdef __CUDACC__
#define BM2_FN __host__ __device__ __forceinline__
#else
#define BM2_FN static inline
#endif

/* byte offset of vector j of row i in a slice */
BM2_FN int bm2_slot_off(int i, int j) { return i * 64 + ((j ^ ((i >> 1) & 3)) << 4); }

/* lane's two 16-byte copies (k = 0, 1) of a slice: row lane / 2, vectors 2 (lane & 1) + k (32
 * contiguous bytes of the row in global memory) */
BM2_FN int bm2_copy_row(int lane) { return lane >> 1; }
BM2_FN int bm2_copy_vec(int lane, int k) { return 2 * (lane & 1) + k; }

/* ldmatrix.x4 of pair p (vectors 2 p, 2 p + 1): lane 8 m + r gives the address of row r of matrix
 * m, which is row r + 8 (m & 1) of vector 2 p + (m >> 1); lane 4 g + t then holds word t of row g of
 * each matrix: rows g, g + 8 of vector 2 p, then of vector 2 p + 1 (bm_run's wa, wb of two blocks) */
BM2_FN int bm2_ldm_row(int lane) { return (lane & 7) + 8 * ((lane >> 3) & 1); }
BM2_FN int bm2_ldm_vec(int lane, int p) { return 2 * p + (lane >> 4); }

#undef BM2_FN
#endif
