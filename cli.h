// cli.h: the command-line conventions the five programs share.
//
// - Options are guided-diffusion's underscore names; a hyphen anywhere in a given name stands for
//   an underscore (--batch-size is --batch_size), as in most command-line tools.
// - An unknown option gets the nearest known name as a hint ("did you mean --batch_size?").
// - --version prints the program's version (the Makefile's VERSION and `git describe`, from
//   build/version.c, which the Makefile writes) and what it was built with.
// - Help text is at most 80 columns wide (cli_print_wrapped).
#ifndef CLI_H
#define CLI_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif
extern const char build_version[];   // "0.1.0 (git 10bcdeb)"
extern const char build_gpu_code[];  // the GPU code of the CUDA programs, e.g. "sm_80 sm_89 sm_90a compute_90"
#ifdef __cplusplus
}
#endif

// A whole number in lo..hi, the whole of s, into *v: 0, or -1 (the caller says what was expected).
static int cli_read_int(const char *s, long long lo, long long hi, long long *v) {
    char *end;
    errno = 0;
    *v = strtoll(s, &end, 10);
    return end == s || *end || errno || *v < lo || *v > hi ? -1 : 0;
}

// Whether the given name (len characters, without the leading "--") is `name`, '-' matching '_'.
static int cli_name_is(const char *given, size_t len, const char *name) {
    if (strlen(name) != len) return 0;
    for (size_t i = 0; i < len; i++)
        if ((given[i] == '-' ? '_' : given[i]) != name[i]) return 0;
    return 1;
}

// The edit distance (insertions, deletions, substitutions) between a given name and a known one,
// '-' matching '_'; names longer than 63 characters count as far from everything.
static int cli_edit_distance(const char *given, size_t len, const char *name) {
    size_t n = strlen(name);
    if (len > 63 || n > 63) return 1000;
    int row[64];
    for (size_t j = 0; j <= n; j++) row[j] = (int)j;
    for (size_t i = 1; i <= len; i++) {
        int diagonal = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= n; j++) {
            int same = (given[i - 1] == '-' ? '_' : given[i - 1]) == name[j - 1];
            int best = diagonal + !same;
            if (row[j] + 1 < best) best = row[j] + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            diagonal = row[j];
            row[j] = best;
        }
    }
    return row[n];
}

// Whether the given name is the beginning of `name`, '-' matching '_'.
static int cli_begins(const char *given, size_t len, const char *name) {
    if (strlen(name) < len) return 0;
    for (size_t i = 0; i < len; i++)
        if ((given[i] == '-' ? '_' : given[i]) != name[i]) return 0;
    return 1;
}

// The known name nearest to an unknown given one, or NULL when none is near: the closest within an
// edit distance of a third of the given name's length (at least 2), else the first name that the
// given one begins (3 characters or more).
static const char *cli_nearest_name(const char *given, size_t len, const char *const *names, int count) {
    const char *nearest = NULL;
    int best = (int)len / 3 > 2 ? (int)len / 3 : 2;
    for (int i = 0; i < count; i++) {
        int d = cli_edit_distance(given, len, names[i]);
        if (d < best || (d == best && !nearest)) nearest = names[i], best = d;
    }
    for (int i = 0; !nearest && len >= 3 && i < count; i++)
        if (cli_begins(given, len, names[i])) nearest = names[i];
    return nearest;
}

// Writes the hint for an unknown option into buf: "; did you mean --NAME?", or "" when no known name
// is near. Returns buf.
static const char *cli_hint(const char *given, size_t len, const char *const *names, int count, char *buf, size_t buf_len) {
    const char *nearest = cli_nearest_name(given, len, names, count);
    if (nearest) snprintf(buf, buf_len, "; did you mean --%s?", nearest);
    else if (buf_len) buf[0] = '\0';
    return buf;
}

// --version: "PROGRAM VERSION", then what the build chose (the precision, the GPU code) when given.
static void cli_print_version(const char *program, const char *built_with) {
    printf("%s %s\n", program, build_version);
    if (built_with) printf("built with %s\n", built_with);
}

// Ends a line already begun to `column` with text, wrapped between words at 80 columns: the text
// starts at column `indent` (on the next line when the line is already past it), and each further
// line is indented as much.
static void cli_print_wrapped(FILE *f, const char *text, int column, int indent) {
    for (int first = 1;; first = 0) {
        while (*text == ' ') text++;
        size_t word = strcspn(text, " ");
        if (word == 0) break;
        if (first && column < indent) {
            fprintf(f, "%*s", indent - column, "");
            column = indent;
        } else if (column + 1 + (int)word > 80) {
            fprintf(f, "\n%*s", indent, "");
            column = indent;
        } else {
            fputc(' ', f);
            column++;
        }
        fprintf(f, "%.*s", (int)word, text);
        column += (int)word;
        text += word;
    }
    fputc('\n', f);
}

#endif
