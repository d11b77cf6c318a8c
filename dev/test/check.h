// check.h: the smallest test harness. A test program is a sequence of cases; each CHECK that fails
// prints one line and marks its case failed; the program ends with "N passed, N failed" (counting
// cases), which dev/test/run_tests.sh adds up across programs.
#ifndef CHECK_H
#define CHECK_H

#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

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

// Runs fn(arg) in a child process with its stderr captured into out (len bytes, NUL-terminated)
// and its stdout discarded: the child's exit status, or 128 + the signal that ended it. For code
// that ends the process (one error line and exit, a handler of a fatal signal).
static int check_in_child(void (*fn)(const void *), const void *arg, char *out, size_t len) {
    int err_pipe[2];
    if (pipe(err_pipe) != 0) return -1;
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        dup2(err_pipe[1], STDERR_FILENO);
        close(err_pipe[0]);
        if (!freopen("/dev/null", "w", stdout)) _exit(99);
        fn(arg);
        _exit(0);
    }
    close(err_pipe[1]);
    size_t got = 0;
    ssize_t n;
    while (got + 1 < len && (n = read(err_pipe[0], out + got, len - 1 - got)) > 0) got += (size_t)n;
    out[got] = '\0';
    close(err_pipe[0]);
    int status;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The number of lines in s.
static int check_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

// Prints the summary line; the return value is the program's exit status.
static int check_summary(void) {
    check_case_end();
    printf("%d passed, %d failed\n", check_cases_passed, check_cases_failed);
    return check_cases_failed ? 1 : 0;
}

#endif  // CHECK_H
