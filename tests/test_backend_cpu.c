/* tests/test_backend_cpu: every CPU op against a straightforward scalar version
 * written here from the spec (double accumulation), on random inputs.  A CUDA
 * backend will be held to the same references and tolerances. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "model/quant.h"
#include "test.h"

static uint32_t rng = 1;
static float frand(void) {
    rng = rng * 1664525u + 1013904223u;
    return ((rng >> 8) / 16777216.0f) * 2.0f - 1.0f;
}
static void fill(float *x, size_t n, float s) {
    for (size_t i = 0; i < n; i++) x[i] = frand() * s;
}

static dsv4_backend be;
static int be_ok;
static dsv4_backend *B(void) {
    if (!be_ok) {
        dsv4_err err;
        if (dsv4_backend_cpu_init(&be, 2, &err) == 0) be_ok = 1;
    }
    return &be;
}

static dsv4_weight f32w(const float *d, int64_t rows, int64_t cols) {
    return (dsv4_weight){.fmt = DSV4_WF_F32, .rows = rows, .cols = cols, .data = d, .name = "test"};
}

static void test_matmul_f32_bf16_fp8(void) {
    enum { R = 3, O = 37, K = 300 };
    float *w = malloc(sizeof(float) * O * K), x[R * K], out[R * O];
    fill(w, O * K, 1);
    fill(x, R * K, 2);
    dsv4_weight W = f32w(w, O, K);
    B()->ops->matmul(B(), out, x, R, &W, 1 /* act_fp8 ignored for f32 weights */, 0);
    double worst = 0;
    for (int r = 0; r < R; r++)
        for (int o = 0; o < O; o++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += (double)w[o * K + k] * x[r * K + k];
            worst = fmax(worst, fabs(s - out[r * O + o]));
        }
    CHECKF(worst < 1e-4, "f32 matmul diff %g", worst);
    /* bf16 weights: the inline widening must equal the codec */
    uint16_t *wb = malloc(sizeof(uint16_t) * O * K);
    for (int i = 0; i < O * K; i++) wb[i] = dsv4_f32_to_bf16(w[i]);
    dsv4_weight Wb = {.fmt = DSV4_WF_BF16, .rows = O, .cols = K, .data = wb};
    B()->ops->matmul(B(), out, x, R, &Wb, 0, 1);
    worst = 0;
    for (int r = 0; r < R; r++)
        for (int o = 0; o < O; o++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += (double)dsv4_bf16_to_f32(wb[o * K + k]) * x[r * K + k];
            worst = fmax(worst, fabs(dsv4_round_bf16((float)s) - out[r * O + o]));
            CHECK(out[r * O + o] == dsv4_round_bf16(out[r * O + o])); /* out_bf16 */
        }
    CHECKF(worst < 0.02, "bf16 matmul diff %g", worst);
    /* fp8 weights with act quant: reference = quantize x per 1x128 block, dequantize w, dot */
    uint8_t *q = malloc(O * K), sc[1 * 3];
    for (int i = 0; i < 3; i++) sc[i] = 127 - 2 + i; /* scales 2^-2, 2^-1, 2^0 by column block */
    for (int i = 0; i < O * K; i++) q[i] = dsv4_f32_to_e4m3(w[i] * 8);
    dsv4_weight W8 = {.fmt = DSV4_WF_FP8, .rows = O, .cols = K, .data = q, .scale = sc, .block = 128};
    B()->ops->matmul(B(), out, x, R, &W8, 1, 0);
    float xq[K], wr[K];
    worst = 0;
    for (int r = 0; r < R; r++) {
        dsv4_fp8_quant_dequant(x + r * K, xq, K, 128, NULL);
        for (int o = 0; o < O; o++) {
            double s = 0;
            for (int k = 0; k < K; k++) {
                wr[k] = dsv4_e4m3_to_f32(q[o * K + k]) * ldexpf(1.0f, -2 + k / 128);
                s += (double)wr[k] * xq[k];
            }
            worst = fmax(worst, fabs(s - out[r * O + o]));
        }
    }
    CHECKF(worst < 1e-3, "fp8 act-quant matmul diff %g", worst);
    free(w);
    free(wb);
    free(q);
}

static void test_matmul_grouped(void) {
    enum { R = 2, G = 3, RK = 5, C = 40 };
    float w[G * RK * C], x[R * G * C], out[R * G * RK];
    fill(w, sizeof w / 4, 1);
    fill(x, sizeof x / 4, 1);
    dsv4_weight W = f32w(w, G * RK, C);
    B()->ops->matmul_grouped(B(), out, x, R, &W, G, 0, 0, 0);
    double worst = 0;
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++)
            for (int j = 0; j < RK; j++) {
                double s = 0;
                for (int k = 0; k < C; k++) s += (double)w[(g * RK + j) * C + k] * x[r * G * C + g * C + k];
                worst = fmax(worst, fabs(s - out[r * G * RK + g * RK + j]));
            }
    CHECKF(worst < 1e-5, "grouped diff %g", worst);
}

static void test_rmsnorm_rope(void) {
    enum { R = 3, D = 64 };
    float x[R * D], out[R * D], wv[D];
    fill(x, R * D, 3);
    fill(wv, D, 1);
    dsv4_weight W = f32w(wv, 1, D);
    B()->ops->rmsnorm(B(), out, x, R, D, &W, 1e-6f, 0);
    for (int r = 0; r < R; r++) {
        double ss = 0;
        for (int i = 0; i < D; i++) ss += (double)x[r * D + i] * x[r * D + i];
        double s = 1 / sqrt(ss / D + 1e-6);
        for (int i = 0; i < D; i++) CHECK_NEAR(out[r * D + i], x[r * D + i] * s * wv[i], 1e-5);
    }
    /* rope: 2 heads of 16, rope on the last 8 dims; rotate then inverse = identity */
    enum { H = 2, HD = 16, RD = 8 };
    float q[R * H * HD], q0[R * H * HD];
    fill(q, sizeof q / 4, 1);
    memcpy(q0, q, sizeof q);
    int64_t pos[R] = {0, 5, 1000};
    double freq[RD / 2] = {1.0, 0.1, 0.01, 0.001};
    B()->ops->rope(B(), q, R, H, HD, RD, pos, freq, 0, 0);
    for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) {
            const float *a = q0 + (r * H + h) * HD, *b = q + (r * H + h) * HD;
            for (int i = 0; i < HD - RD; i++) CHECK(a[i] == b[i]); /* nope dims untouched */
            for (int i = 0; i < RD / 2; i++) {
                double ang = (double)pos[r] * freq[i], c = cos(ang), s = sin(ang);
                double x0 = a[HD - RD + 2 * i], x1 = a[HD - RD + 2 * i + 1];
                CHECK_NEAR(b[HD - RD + 2 * i], x0 * c - x1 * s, 2e-4);
                CHECK_NEAR(b[HD - RD + 2 * i + 1], x1 * c + x0 * s, 2e-4);
            }
        }
    B()->ops->rope(B(), q, R, H, HD, RD, pos, freq, 1, 0);
    for (int i = 0; i < R * H * HD; i++) CHECK_NEAR(q[i], q0[i], 1e-5);
}

static void test_hc_pre_post_head(void) {
    enum { R = 2, HC = 4, D = 32, NM = (2 + HC) * HC };
    float X[R * HC * D], fn[NM * HC * D], base[NM], scale[3] = {0.7f, 1.3f, 0.9f};
    fill(X, sizeof X / 4, 2);
    fill(fn, sizeof fn / 4, 0.1f);
    fill(base, NM, 0.5f);
    dsv4_weight Fn = f32w(fn, NM, HC * D), Bs = f32w(base, 1, NM), Sc = f32w(scale, 1, 3);
    float y[R * D], post[R * HC], comb[R * HC * HC];
    B()->ops->hc_pre(B(), y, post, comb, X, R, HC, D, &Fn, &Bs, &Sc, 20, 1e-6f, 1e-6f, 0, 0);
    for (int r = 0; r < R; r++) {
        const float *xr = X + r * HC * D;
        double ss = 0, m[NM];
        for (int i = 0; i < HC * D; i++) ss += (double)xr[i] * xr[i];
        double rs = 1 / sqrt(ss / (HC * D) + 1e-6);
        for (int j = 0; j < NM; j++) {
            double s = 0;
            for (int i = 0; i < HC * D; i++) s += (double)fn[j * HC * D + i] * xr[i];
            m[j] = s * rs;
        }
        double pre[HC], C[HC][HC];
        for (int j = 0; j < HC; j++) {
            pre[j] = 1 / (1 + exp(-(m[j] * scale[0] + base[j]))) + 1e-6;
            CHECK_NEAR(post[r * HC + j], 2 / (1 + exp(-(m[HC + j] * scale[1] + base[HC + j]))), 1e-5);
        }
        for (int j = 0; j < HC; j++) {
            double mx = -1e30, s = 0;
            for (int k = 0; k < HC; k++) {
                C[j][k] = m[2 * HC + j * HC + k] * scale[2] + base[2 * HC + j * HC + k];
                mx = fmax(mx, C[j][k]);
            }
            for (int k = 0; k < HC; k++) s += (C[j][k] = exp(C[j][k] - mx));
            for (int k = 0; k < HC; k++) C[j][k] = C[j][k] / s + 1e-6;
        }
        for (int it = 0; it < 20; it++) {
            if (it)
                for (int j = 0; j < HC; j++) {
                    double s = 0;
                    for (int k = 0; k < HC; k++) s += C[j][k];
                    for (int k = 0; k < HC; k++) C[j][k] /= s + 1e-6;
                }
            for (int k = 0; k < HC; k++) {
                double s = 0;
                for (int j = 0; j < HC; j++) s += C[j][k];
                for (int j = 0; j < HC; j++) C[j][k] /= s + 1e-6;
            }
        }
        for (int j = 0; j < HC; j++)
            for (int k = 0; k < HC; k++) CHECK_NEAR(comb[r * HC * HC + j * HC + k], C[j][k], 1e-5);
        for (int d = 0; d < D; d++) {
            double s = 0;
            for (int j = 0; j < HC; j++) s += pre[j] * xr[j * D + d];
            CHECK_NEAR(y[r * D + d], s, 1e-4);
        }
    }
    /* post: X'[k] = post[k] o + sum_j comb[j][k] R[j] */
    float o[R * D], Xo[R * HC * D];
    fill(o, R * D, 1);
    B()->ops->hc_post(B(), Xo, o, X, post, comb, R, HC, D, 0);
    for (int r = 0; r < R; r++)
        for (int k = 0; k < HC; k++)
            for (int d = 0; d < D; d++) {
                double v = post[r * HC + k] * o[r * D + d];
                for (int j = 0; j < HC; j++) v += comb[r * HC * HC + j * HC + k] * X[r * HC * D + j * D + d];
                CHECK_NEAR(Xo[r * HC * D + k * D + d], v, 1e-5);
            }
    B()->ops->hc_post(B(), Xo, o, X, post, comb, R, HC, D, 1);
    for (int i = 0; i < R * HC * D; i++) CHECK(Xo[i] == dsv4_round_bf16(Xo[i]));
    /* hc_head: pre only */
    float hfn[HC * HC * D], hb[HC], hs[1] = {1.1f}, yh[R * D];
    fill(hfn, sizeof hfn / 4, 0.1f);
    fill(hb, HC, 0.3f);
    dsv4_weight HF = f32w(hfn, HC, HC * D), HB = f32w(hb, 1, HC), HS = f32w(hs, 1, 1);
    B()->ops->hc_head(B(), yh, X, R, HC, D, &HF, &HB, &HS, 1e-6f, 1e-6f, 0, 0);
    for (int r = 0; r < R; r++) {
        const float *xr = X + r * HC * D;
        double ss = 0;
        for (int i = 0; i < HC * D; i++) ss += (double)xr[i] * xr[i];
        double rs = 1 / sqrt(ss / (HC * D) + 1e-6), pre[HC];
        for (int j = 0; j < HC; j++) {
            double s = 0;
            for (int i = 0; i < HC * D; i++) s += (double)hfn[j * HC * D + i] * xr[i];
            pre[j] = 1 / (1 + exp(-(s * rs * hs[0] + hb[j]))) + 1e-6;
        }
        for (int d = 0; d < D; d++) {
            double s = 0;
            for (int j = 0; j < HC; j++) s += pre[j] * xr[j * D + d];
            CHECK_NEAR(yh[r * D + d], s, 1e-4);
        }
    }
}

/* One reference check of sparse_attn against the key list kv[r*N + j], j < n_kv[r]. */
static void check_attn(const float *out, const float *q, const float *const *kv, const int *n_kv, int R, int H,
                       int HD, int N, const float *sink) {
    for (int r = 0; r < R; r++)
        for (int h = 0; h < H; h++) {
            double s[64], mx = sink[h], den = 0;
            for (int j = 0; j < n_kv[r]; j++) {
                s[j] = 0;
                for (int d = 0; d < HD; d++) s[j] += (double)q[(r * H + h) * HD + d] * kv[r * N + j][d];
                s[j] *= 0.3;
                mx = fmax(mx, s[j]);
            }
            den = exp(sink[h] - mx);
            for (int j = 0; j < n_kv[r]; j++) den += exp(s[j] - mx);
            for (int d = 0; d < HD; d++) {
                double o = 0;
                for (int j = 0; j < n_kv[r]; j++) o += exp(s[j] - mx) / den * kv[r * N + j][d];
                CHECK_NEAR(out[(r * H + h) * HD + d], o, 1e-5);
            }
        }
}

/* Key order = window pointers, then compressed rows (by pick when picks are given, else
 * all n_comp in order), and the result is the same as attending to that explicit list. */
static void test_sparse_attn_sink(void) {
    enum { R = 3, H = 3, HD = 24, W = 4, NC = 9, TK = 3, N = W + NC };
    float q[R * H * HD], ring[W * HD], comp[NC * HD], out[R * H * HD], sink[H] = {0.5f, -1.0f, 2.0f};
    fill(q, sizeof q / 4, 1);
    fill(ring, sizeof ring / 4, 1);
    fill(comp, sizeof comp / 4, 1);
    const float *win[R * W], *base[R] = {comp, comp, NULL}, *kv[R * N];
    int n_win[R] = {W, 2, 3}, n_comp[R] = {NC, 5, 0}, n_kv[R];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) win[r * W + j] = ring + ((j * 3 + r) % W) * HD;
    /* all compressed rows in order */
    B()->ops->sparse_attn(B(), out, q, R, H, HD, win, n_win, W, base, n_comp, NULL, NULL, 0, sink, 0.3f, 0, 0);
    for (int r = 0; r < R; r++) {
        n_kv[r] = 0;
        for (int j = 0; j < n_win[r]; j++) kv[r * N + n_kv[r]++] = win[r * W + j];
        for (int t = 0; base[r] && t < n_comp[r]; t++) kv[r * N + n_kv[r]++] = comp + t * HD;
    }
    check_attn(out, q, kv, n_kv, R, H, HD, N, sink);
    /* picked rows (unsorted on purpose: the op keeps the given order) */
    int32_t picks[R * TK] = {7, 0, 4, 2, 3, -1, -1, -1, -1};
    int n_picks[R] = {3, 2, 0};
    B()->ops->sparse_attn(B(), out, q, R, H, HD, win, n_win, W, base, n_comp, picks, n_picks, TK, sink, 0.3f, 0, 0);
    for (int r = 0; r < R; r++) {
        n_kv[r] = 0;
        for (int j = 0; j < n_win[r]; j++) kv[r * N + n_kv[r]++] = win[r * W + j];
        for (int j = 0; base[r] && j < n_picks[r]; j++) kv[r * N + n_kv[r]++] = comp + picks[r * TK + j] * HD;
    }
    check_attn(out, q, kv, n_kv, R, H, HD, N, sink);
}

static void test_indexer_topk_pool(void) {
    enum { R = 2, H = 3, HD = 8, N = 10, K = 4 };
    float q[R * H * HD], w[R * H], keys[N * HD], score[R * N];
    fill(q, sizeof q / 4, 1);
    fill(w, sizeof w / 4, 1);
    fill(keys, sizeof keys / 4, 1);
    const float *kp[R] = {keys, keys}; /* each row's keys: one contiguous block */
    int nk[R] = {N, 3};
    B()->ops->indexer_scores(B(), score, q, w, R, H, HD, kp, nk, N, 0);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nk[r]; j++) {
            double s = 0;
            for (int h = 0; h < H; h++) {
                double d = 0;
                for (int i = 0; i < HD; i++) d += (double)q[(r * H + h) * HD + i] * keys[j * HD + i];
                s += w[r * H + h] * (d > 0 ? d : 0);
            }
            CHECK_NEAR(score[r * N + j], s, 1e-5);
        }
    /* bf16 scores (indexer.score=bf16), the reference's rounding points: each dot and each weighted
     * product rounded to bf16, the sum over heads in fp32 (head order) rounded once.  64 heads as
     * V4's indexer, so that a running sum rounded after every head (the form before stop 36) gives
     * other bits for many keys; the op's dots may differ from this loop's by an fp32 ulp, so nearly
     * all, not all, keys must match the one-rounding form, and more of them than the other */
    {
        enum { BH = 64, BD = 32, BN = 200 };
        static float bq[BH * BD], bw[BH], bk[BN * BD], bs[BN];
        fill(bq, BH * BD, 3);
        fill(bw, BH, 4);
        fill(bk, BN * BD, 5);
        for (int i = 0; i < BH; i++) bw[i] = fabsf(bw[i]) * 0.1f;
        const float *bkp[1] = {bk};
        int bnk[1] = {BN};
        B()->ops->indexer_scores(B(), bs, bq, bw, 1, BH, BD, bkp, bnk, BN, 1);
        int once = 0, every = 0;
        for (int j = 0; j < BN; j++) {
            float acc = 0, run = 0;
            for (int h = 0; h < BH; h++) {
                float d = 0;
                for (int i = 0; i < BD; i++) d += bq[h * BD + i] * bk[j * BD + i];
                if (d < 0) d = 0;
                float t = dsv4_round_bf16(dsv4_round_bf16(d) * bw[h]);
                acc += t;
                run = dsv4_round_bf16(run + t);
            }
            once += bs[j] == dsv4_round_bf16(acc);
            every += bs[j] == run;
            CHECK(bs[j] == dsv4_round_bf16(bs[j]));
        }
        printf("  bf16 scores, 64 heads: %d of %d keys equal one rounding of the fp32 head sum, %d the running "
               "bf16 sum\n", once, BN, every);
        CHECK(once >= BN * 95 / 100 && once > every);
    }
    int32_t idx[R * K];
    int nout[R];
    B()->ops->topk(B(), idx, nout, score, R, N, nk, K);
    CHECK_EQ_INT(nout[0], K);
    CHECK_EQ_INT(nout[1], 3); /* min(k, visible) */
    /* every picked score >= every unpicked one */
    for (int a = 0; a < nout[0]; a++) {
        if (a) CHECK(idx[a] > idx[a - 1]); /* ascending */
        for (int j = 0; j < N; j++) {
            int picked = 0;
            for (int b = 0; b < nout[0]; b++) picked |= idx[b] == j;
            if (!picked) CHECK(score[idx[a]] >= score[j]);
        }
    }
    /* pool: softmax over entries per channel; -inf entries weigh 0 */
    float kv[3][4], g[3][4], out[4];
    fill(&kv[0][0], 12, 1);
    fill(&g[0][0], 12, 2);
    g[0][2] = -INFINITY;
    const float *pk[3] = {kv[0], kv[1], kv[2]}, *pg[3] = {g[0], g[1], g[2]};
    B()->ops->pool(B(), out, pk, pg, 3, 4);
    for (int c = 0; c < 4; c++) {
        double mx = -1e30, den = 0, acc = 0;
        for (int t = 0; t < 3; t++) mx = fmax(mx, g[t][c]);
        for (int t = 0; t < 3; t++) {
            double e = exp(g[t][c] - mx);
            den += e;
            acc += e * kv[t][c];
        }
        CHECK_NEAR(out[c], acc / den, 1e-6);
    }
}

/* y += wt * w2 . SwiGLU(w1 . x, w3 . x) with both clamps, in double: the scalar reference of one
 * expert slot for test_route_and_moe (D = 16 inputs, I = 8 hidden) */
static void ref_ffn_add(double *y, const float *x, const float *w1, const float *w3, const float *w2, double wt,
                        float limit) {
    enum { D = 16, I = 8 };
    double h[I];
    for (int i = 0; i < I; i++) {
        double g = 0, u = 0;
        for (int d = 0; d < D; d++) {
            g += (double)w1[i * D + d] * x[d];
            u += (double)w3[i * D + d] * x[d];
        }
        g = fmin(g, limit);
        u = fmax(fmin(u, limit), -limit);
        h[i] = g / (1 + exp(-g)) * u;
    }
    for (int d = 0; d < D; d++) {
        double s = 0;
        for (int i = 0; i < I; i++) s += w2[d * I + i] * h[i];
        y[d] += wt * s;
    }
}

static void test_route_and_moe(void) {
    enum { R = 3, E = 6, K = 2, D = 16, I = 8 };
    float logits[R * E], bias[E], wts[R * K];
    int32_t ex[R * K];
    fill(logits, sizeof logits / 4, 3);
    fill(bias, E, 1);
    logits[0] = 30; /* beyond the softplus threshold */
    B()->ops->route(B(), ex, wts, logits, R, E, K, bias, NULL, 1.5f);
    for (int r = 0; r < R; r++) {
        double s[E], sum = 0;
        for (int e = 0; e < E; e++) {
            double z = logits[r * E + e];
            s[e] = sqrt(z > 20 ? z : log1p(exp(z)));
        }
        /* selected = the K best of s + bias */
        for (int a = 0; a < K; a++)
            for (int e = 0; e < E; e++) {
                int sel = 0;
                for (int b = 0; b < K; b++) sel |= ex[r * K + b] == e;
                if (!sel) CHECK(s[ex[r * K + a]] + bias[ex[r * K + a]] >= s[e] + bias[e]);
            }
        for (int a = 0; a < K; a++) sum += s[ex[r * K + a]];
        double tot = 0;
        for (int a = 0; a < K; a++) {
            CHECK_NEAR(wts[r * K + a], s[ex[r * K + a]] / sum * 1.5, 1e-5); /* unbiased scores, renormalised */
            tot += wts[r * K + a];
        }
        CHECK_NEAR(tot, 1.5, 1e-5);
    }
    int32_t hash[R * K] = {5, 0, 1, 1, 3, 2};
    B()->ops->route(B(), ex, wts, logits, R, E, K, NULL, hash, 1.0f);
    for (int i = 0; i < R * K; i++) CHECK_EQ_INT(ex[i], hash[i]);
    /* moe: clamped SwiGLU experts weighted after/before w2 + shared, vs scalar */
    static float w1[E + 1][I * D], w3[E + 1][I * D], w2[E + 1][D * I];
    dsv4_ffn_w f[E + 1];
    for (int e = 0; e <= E; e++) {
        fill(w1[e], I * D, 2);
        fill(w3[e], I * D, 2);
        fill(w2[e], D * I, 1);
        f[e].w1 = f32w(w1[e], I, D);
        f[e].w3 = f32w(w3[e], I, D);
        f[e].w2 = f32w(w2[e], D, I);
    }
    float x[R * D], out[R * D], out2[R * D];
    fill(x, R * D, 3);
    float limit = 1.0f; /* small so both clamps bite */
    B()->ops->moe(B(), out, x, R, f, E, ex, wts, K, &f[E], limit, 0, 0, 0, 1.0f);
    B()->ops->moe(B(), out2, x, R, f, E, ex, wts, K, &f[E], limit, 1, 0, 0, 1.0f);
    for (int r = 0; r < R; r++) {
        double y[D] = {0};
        for (int a = 0; a <= K; a++)
            ref_ffn_add(y, x + r * D, w1[a < K ? ex[r * K + a] : E], w3[a < K ? ex[r * K + a] : E],
                        w2[a < K ? ex[r * K + a] : E], a < K ? wts[r * K + a] : 1.0, limit);
        for (int d = 0; d < D; d++) {
            CHECK_NEAR(out[r * D + d], y[d], 1e-4);
            CHECK_NEAR(out2[r * D + d], y[d], 1e-4); /* before/after w2 agree in fp32 */
        }
    }
    /* one row naming one expert twice (more slots of an expert than rows: the gather buffers
     * hold `rows` rows) counts both slots, as the scalar sum over slots does */
    int32_t dup[K] = {4, 4};
    float dw[K] = {0.3f, 0.5f};
    for (int before = 0; before < 2; before++) {
        B()->ops->moe(B(), out, x, 1, f, E, dup, dw, K, &f[E], limit, before, 0, 0, 1.0f);
        double y[D] = {0};
        for (int a = 0; a <= K; a++)
            ref_ffn_add(y, x, w1[a < K ? dup[a] : E], w3[a < K ? dup[a] : E], w2[a < K ? dup[a] : E],
                        a < K ? dw[a] : 1.0, limit);
        for (int d = 0; d < D; d++) CHECK_NEAR(out[d], y[d], 1e-4);
    }
}

/* rmsnorm with DSV4_NORM_BF16_STEPS: torch's arithmetic on a bf16 tensor (each square rounded to
 * bf16 and summed in fp32, the mean, + eps and rsqrt each rounded, the product rounded), written
 * out here; unweighted heads of 512 as q's per-head RMS.  The one-rounding form (fp32 throughout)
 * gives other bits for a good part of the elements, so the check can see which ran. */
static void test_rmsnorm_bf16_steps(void) {
    enum { R = 16, D = 512 };
    static float x[R * D], y[R * D], z[R * D];
    fill(x, R * D, 9);
    for (int i = 0; i < R * D; i++) x[i] = dsv4_round_bf16(x[i] * (float)(1 + i % 7));
    B()->ops->rmsnorm(B(), y, x, R, D, NULL, 1e-6f, 1 | DSV4_NORM_BF16_STEPS);
    B()->ops->rmsnorm(B(), z, x, R, D, NULL, 1e-6f, 1);
    int same = 0, other = 0;
    for (int r = 0; r < R; r++) {
        float ss = 0;
        for (int i = 0; i < D; i++) ss += dsv4_round_bf16(x[r * D + i] * x[r * D + i]);
        float s = dsv4_round_bf16(1.0f / sqrtf(dsv4_round_bf16(dsv4_round_bf16(ss / (float)D) + 1e-6f)));
        for (int i = 0; i < D; i++) {
            same += y[r * D + i] == dsv4_round_bf16(x[r * D + i] * s);
            other += z[r * D + i] != y[r * D + i];
        }
    }
    printf("  rmsnorm bf16 steps: %d of %d elements as written out; %d differ from one rounding\n", same, R * D,
           other);
    CHECK(same == R * D);
    CHECK(other > R * D / 20);
}

static void test_sim_modes(void) {
    float x[2 * 64], y[2 * 64];
    fill(x, 128, 5);
    memcpy(y, x, sizeof x);
    B()->ops->sim(B(), y, 2, 64, 0, 64, DSV4_SIM_FP8_B64);
    float ref[64];
    for (int r = 0; r < 2; r++) {
        dsv4_fp8_quant_dequant(x + r * 64, ref, 64, 64, NULL);
        for (int i = 0; i < 64; i++) CHECK(y[r * 64 + i] == ref[i]);
    }
    memcpy(y, x, sizeof x);
    B()->ops->sim(B(), y, 2, 64, 0, 32, DSV4_SIM_HAD_FP4_B32);
    for (int r = 0; r < 2; r++) {
        memcpy(ref, x + r * 64, sizeof(float) * 32);
        dsv4_hadamard(ref, 32);
        dsv4_round_bf16_n(ref, 32); /* rotate_activation's bf16 output */
        dsv4_fp4_quant_dequant(ref, ref, 32, 32);
        for (int i = 0; i < 32; i++) CHECK(y[r * 64 + i] == ref[i]);
        for (int i = 32; i < 64; i++) CHECK(y[r * 64 + i] == x[r * 64 + i]); /* outside the width */
    }
}

/* add_cyclic_pos against add_cyclic row by row (each row its own phase; positions past the
 * period and repeated ones), copy_list against copy one by one */
static void test_cyclic_and_copy_list(void) {
    enum { R = 5, W = 24, P = 4 };
    const dsv4_backend_ops *op = B()->ops;
    REQUIRE(op->add_cyclic_pos && op->copy_list);
    float x[R * W], a[R * W], y[P * W];
    fill(x, R * W, 1);
    fill(y, P * W, 1);
    memcpy(a, x, sizeof x);
    const int64_t pos[R] = {7, 0, 130, 3, 7};
    op->add_cyclic_pos(B(), x, y, R, W, P, pos);
    for (int i = 0; i < R; i++) op->add_cyclic(B(), a + i * W, y, 1, W, P, (int)(pos[i] % P));
    CHECK(memcmp(x, a, sizeof x) == 0);
    float src[64], dst[64], ref[64];
    fill(src, 64, 1);
    memset(dst, 0, sizeof dst);
    memset(ref, 0, sizeof ref);
    void *d[3] = {dst, dst + 10, dst + 40};
    const void *s[3] = {src + 5, src, src + 60};
    size_t nb[3] = {sizeof(float) * 10, sizeof(float) * 7, sizeof(float) * 4};
    op->copy_list(B(), 3, d, s, nb);
    for (int i = 0; i < 3; i++) op->copy(B(), (char *)ref + ((char *)d[i] - (char *)dst), s[i], nb[i]);
    CHECK(memcmp(dst, ref, sizeof dst) == 0);
    CHECK(dst[0] == src[5] && dst[10] == src[0] && dst[43] == src[63] && dst[44] == 0.0f);
}


/* argmax (greedy decoding's pick): the first of equal largest values, NaN never winning, a row of
 * NaN or of -inf gives 0; gather_ids: int64 values as their low 32 bits, a token past the table
 * reads row 0 */
static void test_argmax_gather(void) {
    enum { N = 1000, R = 5, TR = 10, K = 3 };
    static float x[R * N];
    fill(x, (size_t)R * N, 3);
    x[17] = x[400] = 9.0f;
    for (int i = 0; i < N; i++) x[N + i] = NAN, x[2 * N + i] = -INFINITY, x[3 * N + i] = -INFINITY;
    x[2 * N] = NAN, x[2 * N + 555] = -1e30f;
    x[4 * N + N - 1] = 4.0f;
    int32_t out[R];
    static const int32_t want[R] = {17, 0, 555, 0, N - 1};
    B()->ops->argmax(B(), out, x, R, N);
    for (int r = 0; r < R; r++) {
        CHECKF(out[r] == want[r], "argmax row %d: %d, want %d", r, out[r], want[r]);
        CHECK(dsv4_argmax_row(x + (size_t)r * N, N) == want[r]);
    }
    int64_t t64[TR * K];
    for (int i = 0; i < TR * K; i++) t64[i] = i + 100;
    t64[4] = (int64_t)7 << 33 | 5;
    dsv4_weight w = {.fmt = DSV4_WF_I64, .rows = TR, .cols = K, .data = t64, .name = "t64"};
    int32_t tok[3] = {1, 9, 12}, ids[3 * K];
    B()->ops->gather_ids(B(), ids, tok, 3, &w, K);
    static const int32_t want_ids[3 * K] = {103, 5, 105, 127, 128, 129, 100, 101, 102};
    CHECK(memcmp(ids, want_ids, sizeof ids) == 0);
}

static void test_zz_free(void) {
    if (be_ok) {
        CHECK(dsv4_backend_cpu_spills(B()) >= 0);
        dsv4_backend_cpu_free(B());
    }
}

TEST_MAIN(test_matmul_f32_bf16_fp8, test_matmul_grouped, test_rmsnorm_rope, test_hc_pre_post_head,
          test_sparse_attn_sink, test_indexer_topk_pool, test_route_and_moe, test_rmsnorm_bf16_steps, test_sim_modes,
          test_cyclic_and_copy_list, test_argmax_gather, test_zz_free)
