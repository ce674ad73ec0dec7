/* The golden test: dsv4's exact profile against transformers' DeepseekV4ForCausalLM.
 *
 * tests/golden/NAME.{tokens,json,cols.f32} were produced on the device machine by
 * tools/golden/golden.py (transformers 5.17, fp32, whole sequence, no cache) on a
 * checkpoint written by `dsv4 synth` with the arguments recorded in NAME.json.
 * Here the same checkpoint is synthesized again (synth is deterministic per seed,
 * independent of thread count), the tokens are run through the engine in the
 * `exact` profile, and we require, at every position:
 *   - |ours - golden| <= 1e-4 x scale on the 2048 sampled columns,
 *   - the same argmax as transformers' full row, with its logit within 1e-4 x scale,
 * where scale = max |logit| over the whole golden output.
 * Sequences cross the window (16 for tiny), every compression boundary (4, 8) and
 * index_topk < visible compressed rows (topk 4); flash2 has V4-Flash's full shapes.
 * Prefill in one call and in uneven chunks must both pass.
 */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "engine/engine.h"
#include "test.h"

#define TOL 1e-4

static char *read_text(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) buf[n] = 0;
    if (len) *len = (size_t)n;
    return buf;
}

static int parse_tokens(const char *text, int32_t *out, int max) {
    int n = 0;
    const char *p = text;
    while (*p && n < max) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p) {
            p++;
            continue;
        }
        out[n++] = (int32_t)v;
        p = end;
    }
    return n;
}

/* Synthesizes the checkpoint named in the golden json into dir; returns 0 on success. */
static int synth_for(const char *synth_cmd, const char *dir) {
    const char *bin = getenv("DSV4_BIN");
    if (!bin) bin = "build/dsv4";
    const char *args = strstr(synth_cmd, "synth ");
    if (!args) return -1;
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && '%s' %s --out '%s' >/dev/null", dir, bin, args, dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* Runs one golden case; chunk = 0 prefills everything in one call, else in pieces of `chunk`. */
static void golden_case(const char *name, int chunk) {
    char path[512];
    snprintf(path, sizeof path, "tests/golden/%s.json", name);
    size_t jlen;
    char *jtext = read_text(path, &jlen);
    REQUIRE(jtext != NULL);
    json_error_t jerr;
    json_t *meta = json_loadb(jtext, jlen, 0, &jerr);
    free(jtext);
    REQUIRE(meta != NULL);
    int T = (int)json_integer_value(json_object_get(meta, "T"));
    int V = (int)json_integer_value(json_object_get(meta, "vocab"));
    double scale = json_number_value(json_object_get(meta, "scale"));
    json_t *cols = json_object_get(meta, "columns"), *am = json_object_get(meta, "argmax");
    json_t *aml = json_object_get(meta, "argmax_logit");
    const char *synth = json_string_value(json_object_get(meta, "synth"));
    int C = (int)json_array_size(cols);
    REQUIRE(T > 0 && V > 0 && C > 0 && synth && (int)json_array_size(am) == T);

    snprintf(path, sizeof path, "tests/golden/%s.tokens", name);
    char *ttext = read_text(path, NULL);
    REQUIRE(ttext != NULL);
    int32_t *tokens = malloc(sizeof(int32_t) * (size_t)T);
    int nt = parse_tokens(ttext, tokens, T);
    free(ttext);
    CHECK_EQ_INT(nt, T);

    snprintf(path, sizeof path, "tests/golden/%s.cols.f32", name);
    size_t glen;
    float *gold = (float *)read_text(path, &glen);
    REQUIRE(gold != NULL);
    REQUIRE(glen == sizeof(float) * (size_t)T * (size_t)C);

    char dir[256];
    snprintf(dir, sizeof dir, "%s/dsv4-golden-%s-%d", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", name, (int)getpid());
    REQUIRE(synth_for(synth, dir) == 0);

    dsv4_engine_opts o = {0};
    o.model_dir = dir;
    o.numerics = "exact";
    dsv4_engine *e = NULL;
    dsv4_err err = {{0}};
    int rc = dsv4_engine_open(&e, &o, &err);
    CHECKF(rc == 0, "%s", err.msg);
    float *logits = malloc(sizeof(float) * (size_t)T * (size_t)V);
    if (rc == 0 && logits) {
        dsv4_seq *s = NULL;
        REQUIRE(dsv4_seq_new(e, &s, &err) == 0);
        int step = chunk > 0 ? chunk : T;
        for (int t = 0; t < T && rc == 0; t += step) {
            int n = T - t < step ? T - t : step;
            rc = dsv4_seq_append(s, tokens + t, n, logits + (size_t)t * V, 1, &err);
            CHECKF(rc == 0, "%s", err.msg);
        }
        double worst = 0, worst_am = 0;
        int worst_t = -1, argmax_bad = 0;
        for (int t = 0; t < T && rc == 0; t++) {
            const float *row = logits + (size_t)t * V;
            for (int c = 0; c < C; c++) {
                int id = (int)json_integer_value(json_array_get(cols, (size_t)c));
                double d = fabs((double)row[id] - gold[(size_t)t * C + c]);
                if (d > worst) worst = d, worst_t = t;
            }
            int best = 0;
            for (int v = 1; v < V; v++)
                if (row[v] > row[best]) best = v;
            int want = (int)json_integer_value(json_array_get(am, (size_t)t));
            if (best != want) {
                if (argmax_bad++ < 5)
                    fprintf(stderr, "  %s: position %d: argmax %d (%.6f), transformers %d (%.6f)\n", name, t, best,
                            row[best], want, row[want]);
            }
            double d = fabs((double)row[want] - json_number_value(json_array_get(aml, (size_t)t)));
            if (d > worst_am) worst_am = d;
        }
        printf("  %s (chunk %d): T=%d max|diff|/scale=%.3e (position %d), argmax-logit err/scale=%.3e, argmax "
               "mismatches %d\n",
               name, chunk, T, worst / scale, worst_t, worst_am / scale, argmax_bad);
        CHECKF(worst <= TOL * scale, "max |diff| %.3g > %.3g", worst, TOL * scale);
        CHECKF(worst_am <= TOL * scale, "argmax logit diff %.3g > %.3g", worst_am, TOL * scale);
        CHECK_EQ_INT(argmax_bad, 0);
        dsv4_seq_free(s);
    }
    if (e) dsv4_engine_close(e);
    free(logits);
    free(gold);
    free(tokens);
    json_decref(meta);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "  could not remove %s\n", dir);
}

static void test_golden_tiny(void) { golden_case("tiny_s1", 0); }
static void test_golden_tiny_chunked(void) { golden_case("tiny_s1", 37); }
static void test_golden_tiny_nvfp4(void) { golden_case("tiny_nvfp4_s2", 0); }

/* V4-Flash's full shapes, 2 layers, no MTP: ~9.3 GB of synthesized weights.
 * Under the sanitizer build (DSV4_SANITIZE=1) this runs only in the optimized
 * pass; with under 12 GB free on the temp filesystem it cannot run at all,
 * which is reported loudly rather than passed. */
static void test_golden_flash2(void) {
    if (getenv("DSV4_SANITIZE")) {
        SKIP_TEST("flash2 golden runs in the optimized test pass only (9 GB under ASan is too slow)");
    }
    struct statvfs fs;
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    if (statvfs(tmp, &fs) == 0 && (double)fs.f_bavail * fs.f_frsize < 12e9) {
        fprintf(stderr, "  %s has %.1f GB free; the flash2 golden test needs 12 GB\n", tmp,
                (double)fs.f_bavail * fs.f_frsize / 1e9);
        CHECK(!"not enough disk for the flash2 golden checkpoint");
        return;
    }
    golden_case("flash2_s1", 0);
}

TEST_MAIN(test_golden_tiny, test_golden_tiny_chunked, test_golden_tiny_nvfp4, test_golden_flash2)
