/* tools/switches: `dsv4 switches` -- the numerics switches and profiles, and
 * (--measure) each switch's distance from `exact` on a model. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "model/numerics.h"
#include "tools/commands.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: dsv4 switches [--measure [--model DIR] [--tokens N]]\n"
            "  Lists every numerics switch (name, values, meaning, spec section) and the values\n"
            "  each profile gives it.  --measure runs the model on N pseudo-random tokens\n"
            "  (default 300) in `exact`, then with each switch set to its `reference` value\n"
            "  (and every other non-exact value), printing max and mean |logit - exact|.\n");
}

static int run_logits(const char *model, const char **sets, int n_sets, const int32_t *ids, int T, float *out,
                      int *vocab) {
    dsv4_err err = {{0}};
    dsv4_engine *e = NULL;
    dsv4_seq *s = NULL;
    dsv4_engine_opts o = {.model_dir = model, .numerics = "exact", .sets = sets, .n_sets = n_sets};
    int rc = -1;
    if (dsv4_engine_open(&e, &o, &err) || dsv4_seq_new(e, &s, &err)) goto done;
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    *vocab = info.vocab_size;
    if (!out) {
        rc = 0;
        goto done;
    }
    if (dsv4_seq_append(s, ids, T, out, 1, &err)) goto done;
    rc = 0;
done:
    if (rc) fprintf(stderr, "dsv4 switches: %s\n", err.msg);
    dsv4_seq_free(s);
    dsv4_engine_close(e);
    return rc;
}

static int measure(const char *model, int T) {
    int vocab = 0;
    if (run_logits(model, NULL, 0, NULL, 0, NULL, &vocab)) return 1;
    int32_t *ids = malloc(sizeof *ids * (size_t)T);
    float *ex = malloc(sizeof(float) * (size_t)T * vocab), *sw = malloc(sizeof(float) * (size_t)T * vocab);
    if (!ids || !ex || !sw) {
        free(ids), free(ex), free(sw);
        fprintf(stderr, "dsv4 switches: out of memory\n");
        return 1;
    }
    uint32_t x = 12345;
    for (int i = 0; i < T; i++) {
        x = x * 1664525u + 1013904223u;
        ids[i] = (int32_t)((x >> 8) % (uint32_t)vocab);
    }
    int rc = 1;
    if (run_logits(model, NULL, 0, ids, T, ex, &vocab)) goto done;
    double scale = 0;
    for (size_t i = 0; i < (size_t)T * vocab; i++) scale = fmax(scale, fabs(ex[i]));
    printf("distance from exact over %d tokens (max |logit| in exact = %.4g):\n", T, scale);
    printf("  %-32s %12s %12s %9s\n", "setting", "max |diff|", "mean |diff|", "argmax=");
    for (int i = 0; i < dsv4_numerics_n_switches(); i++) {
        const dsv4_switch_info *si = dsv4_numerics_switch(i);
        char vals[128];
        snprintf(vals, sizeof vals, "%s", si->values);
        const char *exact_v = dsv4_numerics_value(&DSV4_NUMERICS_EXACT, i);
        for (char *v = strtok(vals, "|"); v; v = strtok(NULL, "|")) {
            if (!strcmp(v, exact_v)) continue;
            char set[160];
            snprintf(set, sizeof set, "%s=%s", si->name, v);
            const char *sets[1] = {set};
            if (run_logits(model, sets, 1, ids, T, sw, &vocab)) goto done;
            double mx = 0, sum = 0;
            int same = 0;
            for (int t = 0; t < T; t++) {
                const float *a = ex + (size_t)t * vocab, *b = sw + (size_t)t * vocab;
                int aa = 0, ab = 0;
                for (int j = 0; j < vocab; j++) {
                    double d = fabs((double)a[j] - b[j]);
                    mx = fmax(mx, d);
                    sum += d;
                    if (a[j] > a[aa]) aa = j;
                    if (b[j] > b[ab]) ab = j;
                }
                same += aa == ab;
            }
            printf("  %-32s %12.4g %12.4g %4d/%-4d\n", set, mx, sum / ((double)T * vocab), same, T);
        }
    }
    rc = 0;
done:
    free(ids);
    free(ex);
    free(sw);
    return rc;
}

int dsv4_cmd_switches(int argc, char **argv) {
    int do_measure = 0, T = 300;
    const char *model = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--measure")) {
            do_measure = 1;
        } else if (!strcmp(argv[i], "--model") && i + 1 < argc) {
            model = argv[++i];
        } else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 100000) {
                fprintf(stderr, "dsv4 switches: --tokens expects 1..100000, got '%s'\n", argv[i]);
                return 2;
            }
            T = (int)v;
        } else {
            fprintf(stderr, "dsv4 switches: unknown or incomplete option '%s' (see --help)\n", argv[i]);
            return 2;
        }
    }
    if (do_measure) return measure(model, T);
    printf("%-16s %-20s %-10s %-10s %s\n", "switch", "values", "exact", "reference", "meaning [spec]");
    for (int i = 0; i < dsv4_numerics_n_switches(); i++) {
        const dsv4_switch_info *si = dsv4_numerics_switch(i);
        printf("%-16s %-20s %-10s %-10s %s [%s]\n", si->name, si->values, dsv4_numerics_value(&DSV4_NUMERICS_EXACT, i),
               dsv4_numerics_value(&DSV4_NUMERICS_REFERENCE, i), si->meaning, si->spec);
    }
    printf("\nprofiles: exact (fp32 on exactly dequantized weights; equals transformers' DeepseekV4 in fp32),\n"
           "          reference (DeepSeek's inference numerics).  Edit with --set NAME=VALUE.\n");
    return 0;
}
