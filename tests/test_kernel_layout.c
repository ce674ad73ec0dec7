/* tests/test_kernel_layout.c: GPU kernel data layouts checked on the CPU (no device needed).
 *
 * bm2_run (backend/cuda/moe.cu, moe.dot=mma's second form) stages a warp's 16 weight rows x 4
 * vectors with two cp.async a lane and reads them back with ldmatrix.x4, whose fragments must be
 * the words bm_run loads one by one: lane 4 g + t, word t of the 16-byte vector of rows g and
 * g + 8 for each 32-wide block.  The kernel takes its offsets from backend/cuda/bm2_layout.h;
 * this test plays the copies and the ldmatrix of those offsets on a model of shared memory. */
#include "test.h"

#include "backend/cuda/bm2_layout.h"

enum { ROWS = 16, VECS = 4, SLICE = ROWS * VECS * 16 };

/* which (row, vector) each 16-byte chunk of the slice holds after the warp's copies; -1 = none */
static int place(int (*held)[2]) {
    for (int c = 0; c < SLICE / 16; c++) held[c][0] = held[c][1] = -1;
    int bad = 0;
    for (int lane = 0; lane < 32; lane++)
        for (int k = 0; k < 2; k++) {
            int r = bm2_copy_row(lane), v = bm2_copy_vec(lane, k), off = bm2_slot_off(r, v);
            if (off < 0 || off + 16 > SLICE || off % 16) {
                bad++;
                continue;
            }
            if (held[off / 16][0] >= 0) bad++; /* two copies into one chunk */
            held[off / 16][0] = r, held[off / 16][1] = v;
        }
    return bad;
}

/* every (row, vector) of the slice lands in its own chunk, 16-byte aligned, and the two copies
 * of a lane read 32 contiguous bytes of its row (vectors 2 (lane & 1), + 1) */
static void test_bm2_copies_cover_the_slice(void) {
    int held[SLICE / 16][2];
    CHECK(place(held) == 0);
    int seen[ROWS][VECS] = {{0}};
    for (int c = 0; c < SLICE / 16; c++)
        if (held[c][0] >= 0) seen[held[c][0]][held[c][1]]++;
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < VECS; v++) CHECKF(seen[r][v] == 1, "row %d vector %d copied %d times", r, v, seen[r][v]);
    for (int lane = 0; lane < 32; lane++) {
        CHECK(bm2_copy_row(lane) == lane / 2);
        CHECK(bm2_copy_vec(lane, 1) == bm2_copy_vec(lane, 0) + 1 && bm2_copy_vec(lane, 0) % 2 == 0);
    }
}

/* ldmatrix.x4 as the PTX ISA defines it (lanes 8 m .. 8 m + 7 give the row addresses of matrix m;
 * lane 4 g + t receives bytes 4 t .. 4 t + 3 of row g of each matrix): what each lane gets must
 * be word t of rows g, g + 8 of vector 2 p, then of vector 2 p + 1 */
static void test_bm2_ldmatrix_fragments(void) {
    int held[SLICE / 16][2];
    REQUIRE(place(held) == 0);
    for (int p = 0; p < 2; p++)
        for (int lane = 0; lane < 32; lane++) {
            int g = lane >> 2, t = lane & 3;
            for (int m = 0; m < 4; m++) {
                int src = 8 * m + g; /* the lane that gave row g of matrix m */
                int off = bm2_slot_off(bm2_ldm_row(src), bm2_ldm_vec(src, p));
                REQUIRE(off >= 0 && off + 16 <= SLICE && off % 16 == 0);
                int row = held[off / 16][0], vec = held[off / 16][1];
                int want_row = g + 8 * (m & 1), want_vec = 2 * p + (m >> 1);
                CHECKF(row == want_row && vec == want_vec,
                       "pair %d lane %d matrix %d: row %d vector %d, expected row %d vector %d (word %d)", p, lane,
                       m, row, vec, want_row, want_vec, t);
            }
        }
}

/* each 8-address phase of the ldmatrix (one matrix) covers the 32 banks once: its 16-byte chunks
 * fall on 8 distinct 16-byte bank groups; the copies' 16-byte stores likewise per 8 lanes */
static void test_bm2_no_bank_conflicts(void) {
    for (int p = 0; p < 2; p++)
        for (int m = 0; m < 4; m++) {
            int used = 0;
            for (int r = 0; r < 8; r++) {
                int lane = 8 * m + r, grp = (bm2_slot_off(bm2_ldm_row(lane), bm2_ldm_vec(lane, p)) / 16) % 8;
                CHECKF(!(used & (1 << grp)), "pair %d matrix %d: bank group %d twice", p, m, grp);
                used |= 1 << grp;
            }
        }
    for (int k = 0; k < 2; k++)
        for (int q = 0; q < 4; q++) { /* a 16-byte store per lane: 8 lanes a shared-memory wavefront */
            int used = 0;
            for (int r = 0; r < 8; r++) {
                int lane = 8 * q + r, grp = (bm2_slot_off(bm2_copy_row(lane), bm2_copy_vec(lane, k)) / 16) % 8;
                CHECKF(!(used & (1 << grp)), "copy %d lanes %d..%d: bank group %d twice", k, 8 * q, 8 * q + 7, grp);
                used |= 1 << grp;
            }
        }
}

TEST_MAIN(test_bm2_copies_cover_the_slice, test_bm2_ldmatrix_fragments, test_bm2_no_bank_conflicts)
