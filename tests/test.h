/* tests/test.h: a tiny test harness.
 *
 * A test file defines `static void test_xxx(void)` functions and lists them in
 * TEST_MAIN(test_xxx, test_yyy, ...).  CHECK records a failure (file:line and the
 * expression) and continues; REQUIRE records and returns from the test.  Each
 * test prints "PASS name" or "FAIL name"; the binary's last line is
 * "# N passed, N failed" and it exits non-zero if anything failed.  tests/run.sh
 * adds these up for `make test`.  Tests may include a module's .c to reach statics.
 */
#ifndef DSV4_TEST_H
#define DSV4_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int test_failures_;  /* failures in the current test */
static int test_skipped_;   /* the current test did not run (SKIP_TEST) */
static const char *test_name_;

#define CHECK(cond)                                                                                         \
    do {                                                                                                    \
        if (!(cond)) {                                                                                      \
            fprintf(stderr, "  %s:%d: %s: check failed: %s\n", __FILE__, __LINE__, test_name_, #cond);      \
            test_failures_++;                                                                               \
        }                                                                                                   \
    } while (0)

#define CHECKF(cond, ...)                                                                                   \
    do {                                                                                                    \
        if (!(cond)) {                                                                                      \
            fprintf(stderr, "  %s:%d: %s: check failed: %s: ", __FILE__, __LINE__, test_name_, #cond);      \
            fprintf(stderr, __VA_ARGS__);                                                                   \
            fputc('\n', stderr);                                                                            \
            test_failures_++;                                                                               \
        }                                                                                                   \
    } while (0)

#define REQUIRE(cond)                                                                                       \
    do {                                                                                                    \
        if (!(cond)) {                                                                                      \
            fprintf(stderr, "  %s:%d: %s: requirement failed: %s\n", __FILE__, __LINE__, test_name_, #cond); \
            test_failures_++;                                                                               \
            return;                                                                                         \
        }                                                                                                   \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                                                  \
    do {                                                                                                    \
        long long a_ = (long long)(a), b_ = (long long)(b);                                                 \
        if (a_ != b_) {                                                                                     \
            fprintf(stderr, "  %s:%d: %s: %s == %s failed: %lld != %lld\n", __FILE__, __LINE__, test_name_,  \
                    #a, #b, a_, b_);                                                                        \
            test_failures_++;                                                                               \
        }                                                                                                   \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                                               \
    do {                                                                                                    \
        double a_ = (double)(a), b_ = (double)(b);                                                          \
        if (!(fabs(a_ - b_) <= (tol))) {                                                                    \
            fprintf(stderr, "  %s:%d: %s: |%s - %s| <= %g failed: %.9g vs %.9g\n", __FILE__, __LINE__,      \
                    test_name_, #a, #b, (double)(tol), a_, b_);                                             \
            test_failures_++;                                                                               \
        }                                                                                                   \
    } while (0)

#define CHECK_STR(a, b)                                                                                     \
    do {                                                                                                    \
        const char *a_ = (a), *b_ = (b);                                                                    \
        if (!a_ || !b_ || strcmp(a_, b_) != 0) {                                                            \
            fprintf(stderr, "  %s:%d: %s: %s == %s failed: \"%s\" != \"%s\"\n", __FILE__, __LINE__,          \
                    test_name_, #a, #b, a_ ? a_ : "(null)", b_ ? b_ : "(null)");                            \
            test_failures_++;                                                                               \
        }                                                                                                   \
    } while (0)

/* Ends the current test without running it: reported as "SKIP name: why" and
 * counted neither as passed nor as failed. */
#define SKIP_TEST(...)                                                                                      \
    do {                                                                                                    \
        printf("  skipped: ");                                                                              \
        printf(__VA_ARGS__);                                                                                \
        printf("\n");                                                                                       \
        test_skipped_ = 1;                                                                                  \
        return;                                                                                             \
    } while (0)

typedef void (*test_fn_)(void);

/* Runs the tests; with arguments, only those whose name contains one of them (each argument a
 * filter; several run the union, in the file's order), less those whose name contains an
 * argument given as -NAME (with only such arguments: every other test).  An argument that
 * matches no test fails the run: a mistyped name must not pass as "0 failed". */
static int test_run_all_(const char *names, test_fn_ *fns, int n, int argc, char **argv) {
    int passed = 0, failed = 0, skipped = 0;
    char buf[8192];
    int hit[64] = {0};
    snprintf(buf, sizeof buf, "%s", names);
    char *save = NULL;
    char *tok = strtok_r(buf, ", \t\n", &save);
    for (int i = 0; i < n && tok; i++, tok = strtok_r(NULL, ", \t\n", &save)) {
        int want = 1, drop = 0;
        for (int j = 1; j < argc; j++)
            if (argv[j][0] != '-') want = 0;
        for (int j = 1; j < argc; j++) {
            int neg = argv[j][0] == '-';
            if (strstr(tok, argv[j] + neg)) {
                hit[j < 64 ? j : 63] = 1;
                if (neg) drop = 1;
                else want = 1;
            }
        }
        if (!want || drop) continue;
        test_name_ = tok;
        test_failures_ = 0;
        test_skipped_ = 0;
        fns[i]();
        if (test_skipped_ && !test_failures_) {
            printf("SKIP %s\n", tok);
            skipped++;
        } else if (test_failures_) {
            printf("FAIL %s\n", tok);
            failed++;
        } else {
            printf("PASS %s\n", tok);
            passed++;
        }
        fflush(stdout);
    }
    for (int j = 1; j < argc && j < 63; j++)
        if (!hit[j]) {
            printf("FAIL no test matches '%s'\n", argv[j]);
            failed++;
        }
    printf("# %d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}

#define TEST_MAIN(...)                                                                                      \
    int main(int argc, char **argv) {                                                                       \
        test_fn_ fns[] = {__VA_ARGS__};                                                                     \
        return test_run_all_(#__VA_ARGS__, fns, (int)(sizeof fns / sizeof fns[0]), argc, argv);             \
    }

#endif
