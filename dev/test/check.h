// check.h: the smallest test harness. A test program is a sequence of cases; each CHECK that fails
// prints one line and marks its case failed; the program ends with "N passed, N failed" (counting
// cases), which dev/test/run_tests.sh adds up across programs.
#ifndef CHECK_H
#define CHECK_H

#include <stdio.h>

static const char *check_case_name;
static int check_case_failed, check_cases_passed, check_cases_failed;

static void check_case_end(void) {
    if (!check_case_name) return;
    if (check_case_failed) check_cases_failed++;
    else check_cases_passed++;
    printf("%s %s\n", check_case_failed ? "FAIL" : "ok  ", check_case_name);
    fflush(stdout);
    check_case_name = NULL;
}

// Starts a new case (ending the one before).
static void check_case(const char *name) {
    check_case_end();
    check_case_name = name;
    check_case_failed = 0;
}

#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (!(cond)) {                                                                \
            check_case_failed = 1;                                                    \
            printf("  %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);         \
        }                                                                             \
    } while (0)

// Prints the summary line; the return value is the program's exit status.
static int check_summary(void) {
    check_case_end();
    printf("%d passed, %d failed\n", check_cases_passed, check_cases_failed);
    return check_cases_failed ? 1 : 0;
}

#endif  // CHECK_H
