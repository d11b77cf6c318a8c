// test_loss_plot.c: the loss chart of loss_plot.h (run/loss.svg). Charts of typical and edge-case
// logs are written into a temporary folder and each is checked to be a well-formed standalone SVG
// (an XML declaration, <svg xmlns=...>, every element closed in order, </svg> at the end), with the
// lines it should have, every coordinate inside the picture and no "nan" or "inf" anywhere; a
// failed write returns one error line and leaves no file behind; 100,000 points stay small and
// keep a spike. log.csv rows are read back as train_unet writes them. Built with AddressSanitizer
// and UBSan.
//
//   build/test/test_loss_plot                          the tests (KEEP=1: the charts stay in /tmp)
//   build/test/test_loss_plot --chart LOG.csv OUT.svg [TITLE]
//                                                      one chart from a log (dev/loss_example.svg)
#include <dirent.h>
#include <float.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>

#include "loss_plot.h"
#include "check.h"

static char tmp_dir[] = "/tmp/test_loss_plot_XXXXXX";

static const char *tmp_path(const char *name) {
    static char path[4][512];
    static int next;
    char *p = path[next++ % 4];
    snprintf(p, 512, "%s/%s", tmp_dir, name);
    return p;
}

// The whole file as a string (NULL when it cannot be read); its size in *size.
static char *read_all(const char *path, long *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = (char *)malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) free(s), s = NULL;
    if (s) s[n] = '\0';
    fclose(f);
    if (size) *size = n;
    return s;
}

// Files in the temporary folder whose name contains ".tmp.".
static int leftover_temporaries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strstr(e->d_name, ".tmp.")) n++;
    if (d) closedir(d);
    return n;
}

// Checks the points="x,y x,y ..." of every polyline: numbers, inside the 800x560 picture. Returns
// the number of bad coordinates; *top gets the smallest y of the polyline with the given id.
static int check_points(const char *svg, const char *id, double *top) {
    int bad = 0;
    char want[64];
    snprintf(want, sizeof want, "<polyline id=\"%s\"", id);
    *top = 1e9;
    for (const char *p = strstr(svg, "<polyline"); p; p = strstr(p + 1, "<polyline")) {
        int is_id = strncmp(p, want, strlen(want)) == 0;
        const char *q = strstr(p, "points=\"");
        if (!q) return bad + 1;
        q += 8;
        while (*q && *q != '"') {
            char *end;
            double x = strtod(q, &end);
            if (end == q || *end != ',') return bad + 1;
            double y = strtod(end + 1, &end);
            if (!isfinite(x) || !isfinite(y) || x < 0 || x > 800 || y < 0 || y > 560) bad++;
            if (is_id && y < *top) *top = y;
            q = end;
            while (*q == ' ') q++;
        }
    }
    return bad;
}

// Well-formed enough: the XML declaration, <svg with the SVG namespace, every element closed in
// order (a small tag-stack parser; text holds no '<' as it is escaped), nothing after </svg>, no
// "nan" or "inf" in any case, and only valid UTF-8. Prints what is wrong.
static int well_formed(const char *svg) {
    if (strncmp(svg, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\"", 78) != 0)
        return printf("  does not start with the XML declaration and <svg xmlns=...>\n"), 0;
    size_t n = strlen(svg);
    if (n < 7 || strcmp(svg + n - 7, "</svg>\n") != 0) return printf("  does not end with </svg>\n"), 0;
    for (const char *p = svg; *p; p++)
        if (strncasecmp(p, "nan", 3) == 0 || strncasecmp(p, "inf", 3) == 0) return printf("  holds '%.3s'\n", p), 0;
    char stack[64][32];
    int depth = 0, roots = 0;
    const char *p = strstr(svg, "?>") + 2;
    while ((p = strchr(p, '<'))) {
        const char *end = strchr(p, '>');
        if (!end) return printf("  unclosed tag\n"), 0;
        if (p[1] == '/') {
            size_t len = (size_t)(end - p - 2);
            if (depth == 0 || strlen(stack[depth - 1]) != len || strncmp(stack[depth - 1], p + 2, len) != 0)
                return printf("  </%.*s> does not close the open element\n", (int)len, p + 2), 0;
            depth--;
        } else if (end[-1] != '/') {
            size_t len = strcspn(p + 1, " >");
            if (depth == 64 || len >= 32) return printf("  too deep\n"), 0;
            if (depth == 0) roots++;
            snprintf(stack[depth++], 32, "%.*s", (int)len, p + 1);
        }
        p = end + 1;
    }
    if (depth != 0 || roots != 1) return printf("  %d elements left open, %d roots\n", depth, roots), 0;
    for (const unsigned char *u = (const unsigned char *)svg; *u; u++) {
        if (*u < 0x80) continue;
        int extra = (*u & 0xe0) == 0xc0 ? 1 : (*u & 0xf0) == 0xe0 ? 2 : (*u & 0xf8) == 0xf0 ? 3 : -1;
        if (extra < 0) return printf("  not UTF-8\n"), 0;
        for (int i = 1; i <= extra; i++)
            if ((u[i] & 0xc0) != 0x80) return printf("  not UTF-8\n"), 0;
        u += extra;
    }
    return 1;
}

// Writes a chart and checks it: well-formed, coordinates inside, the lines it should have. Returns
// the file's text (to free) or NULL.
static char *chart(const char *name, const char *title, const LossPoint *p, int count, int want_loss, int want_lr) {
    char err[512] = "";
    const char *path = tmp_path(name);
    int r = loss_plot_write(path, title, p, count, err, sizeof err);
    if (r != 0) printf("  %s: %s\n", name, err);
    CHECK(r == 0);
    long size = 0;
    char *svg = read_all(path, &size);
    CHECK(svg != NULL);
    if (!svg) return NULL;
    double top;
    int good = well_formed(svg), inside = check_points(svg, "loss", &top) == 0;
    if (!good || !inside) printf("  in %s\n", name);
    CHECK(good && inside);
    CHECK((strstr(svg, "<polyline id=\"loss\"") != NULL) == want_loss);
    CHECK((strstr(svg, "<polyline id=\"loss-smoothed\"") != NULL) == want_loss);
    CHECK((strstr(svg, "<polyline id=\"lr\"") != NULL) == want_lr);
    CHECK(size > 200 && size < 400000);
    return svg;
}

// A synthetic run: the loss falls from ~1 to ~0.03 with noise, warm-up then cosine decay of the lr.
static void synthetic(LossPoint *p, int n, int64_t interval, unsigned seed) {
    for (int i = 0; i < n; i++) {
        int64_t step = (i + 1) * interval;
        double t = (double)i / n;
        seed = seed * 1664525u + 1013904223u;
        double noise = ((seed >> 8) / 16777216.0 - 0.5) * 0.4;
        p[i].step = step;
        p[i].loss = (0.03 + 0.97 * exp(-t * 40)) * exp(noise);
        p[i].lr = i < n / 50 ? 2e-4 * (i + 1) / (n / 50) : 1e-5 + 0.5 * (2e-4 - 1e-5) * (1 + cos(M_PI * t));
    }
}

static int write_chart(const char *log, const char *out, const char *title) {
    LossLog curve = {NULL, 0, 0};
    char err[1024];
    if (loss_log_read_csv(&curve, log, err, sizeof err) != 0 || loss_plot_write(out, title, curve.points, curve.count, err, sizeof err) != 0) {
        fprintf(stderr, "test_loss_plot: %s\n", err);
        loss_log_free(&curve);
        return 1;
    }
    printf("%s: %d points from %s\n", out, curve.count, log);
    loss_log_free(&curve);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && strcmp(argv[1], "--chart") == 0) return write_chart(argv[2], argv[3], argc > 4 ? argv[4] : NULL);
    if (argc > 1) return fprintf(stderr, "usage: test_loss_plot [--chart LOG.csv OUT.svg [TITLE]]\n"), 2;
    if (!mkdtemp(tmp_dir)) return printf("mkdtemp failed\n"), 1;
    char err[512], cmd[1024];
    static LossPoint p[100000];
    char *svg;

    check_case("typical run: well-formed SVG with the raw, smoothed and lr lines, 1-2-5 loss ticks, round steps");
    synthetic(p, 2000, 10, 1);
    svg = chart("typical.svg", "run", p, 2000, 1, 1);
    CHECK(svg && strstr(svg, ">0.1</text>") && strstr(svg, ">0.2</text>") && strstr(svg, ">0.05</text>"));
    CHECK(svg && strstr(svg, ">10k</text>") && strstr(svg, ">20k</text>") && strstr(svg, ">0</text>"));
    CHECK(svg && strstr(svg, ">2e-4</text>") && strstr(svg, "training loss: run</text>") && strstr(svg, "step 20000"));
    free(svg);

    check_case("log.csv: rows read back as train_unet writes them; header, cut lines and bad rows skipped");
    FILE *f = fopen(tmp_path("log.csv"), "w");
    fprintf(f, "step,loss,lr,grad_norm,img_per_s,ms_per_step,gpu_mem_gib\n");
    fprintf(f, "10,0.960189,0.0001,2.422963,644.0,49.691,3.319\n20,0.869057,0.0001,2.165092,1450.4,22.063,3.319\n");
    fprintf(f, "30,nan,0.0001,nan,1450.4,22.063,3.319\n40,0.5,1e-05,1,1,1,1\nx,1,2\n50,abc,1\n60,0.4");
    fclose(f);
    LossLog curve = {NULL, 0, 0};
    CHECK(loss_log_read_csv(&curve, tmp_path("log.csv"), err, sizeof err) == 0);
    CHECK(curve.count == 4 && curve.points[0].step == 10 && curve.points[0].loss == 0.960189 && curve.points[1].lr == 0.0001);
    CHECK(curve.count == 4 && isnan(curve.points[2].loss) && curve.points[3].step == 40 && curve.points[3].lr == 1e-5);
    svg = chart("from_csv.svg", NULL, curve.points, curve.count, 1, 1);
    free(svg);
    loss_log_free(&curve);
    CHECK(loss_log_read_csv(&curve, tmp_path("missing.csv"), err, sizeof err) == -1 && strstr(err, "cannot read") && !strchr(err, '\n'));
    CHECK(loss_log_read_csv(&curve, "dev/runs/shapes_26k/log.csv", err, sizeof err) == 0 && curve.count == 264);
    svg = chart("shapes_26k.svg", "shapes_26k", curve.points, curve.count, 1, 1);
    free(svg);
    loss_log_free(&curve);

    check_case("no points, or none usable: a chart that says so");
    svg = chart("empty.svg", "run", p, 0, 0, 0);
    CHECK(svg && strstr(svg, "no data yet"));
    free(svg);
    LossPoint bad[4] = {{10, NAN, NAN}, {20, INFINITY, -INFINITY}, {30, 0, NAN}, {40, -1, NAN}};
    svg = chart("all_bad.svg", "run", bad, 4, 0, 0);
    CHECK(svg && strstr(svg, "no data yet"));
    free(svg);

    check_case("one point; losses not finite or not positive left out; all-equal values; lr constant 0");
    LossPoint one = {100, 0.5, 1e-4};
    svg = chart("one.svg", "run", &one, 1, 1, 1);
    free(svg);
    LossPoint mixed[6] = {{10, 1.0, 1e-4}, {20, NAN, 1e-4}, {30, -0.5, 1e-4}, {40, 0, 1e-4}, {50, INFINITY, NAN}, {60, 0.25, 1e-4}};
    svg = chart("mixed.svg", "run", mixed, 6, 1, 1);
    free(svg);
    LossPoint flat[50];
    for (int i = 0; i < 50; i++) flat[i].step = i * 10, flat[i].loss = 0.125, flat[i].lr = 0;
    svg = chart("flat.svg", "run", flat, 50, 1, 1);
    CHECK(svg && strstr(svg, ">0</text>"));
    free(svg);
    LossPoint lr_only[3] = {{10, NAN, 1e-4}, {20, NAN, 2e-4}, {30, -1, 3e-4}};
    svg = chart("lr_only.svg", "run", lr_only, 3, 0, 1);
    CHECK(svg && strstr(svg, "no finite loss yet"));
    free(svg);

    check_case("extreme ranges: many decades, a narrow band, tiny and huge values, negative steps and lr");
    for (int i = 0; i < 200; i++) p[i].step = i, p[i].loss = pow(10, 20 - 0.2 * i), p[i].lr = 1e9;
    svg = chart("decades.svg", "run", p, 200, 1, 1);
    free(svg);
    for (int i = 0; i < 200; i++) p[i].step = 1000000 + i, p[i].loss = 0.0210 + 1e-5 * (i % 7), p[i].lr = -1e-3 + 1e-5 * i;
    svg = chart("narrow.svg", "run", p, 200, 1, 1);
    CHECK(svg && strstr(svg, ">0.02</text>"));
    free(svg);
    for (int i = 0; i < 200; i++) p[i].step = -100 + i, p[i].loss = 1e-300 * (1 + i), p[i].lr = 1e-300;
    svg = chart("tiny.svg", "run", p, 200, 1, 1);
    free(svg);
    for (int i = 0; i < 200; i++) p[i].step = INT64_MAX / 2 + i, p[i].loss = 9e299 / (1 + i), p[i].lr = i < 100 ? 9e299 : DBL_MAX;
    svg = chart("huge.svg", "run", p, 200, 1, 1);
    free(svg);

    check_case("title: XML characters escaped, invalid UTF-8 and control characters replaced");
    synthetic(p, 100, 10, 2);
    svg = chart("title.svg", "a<b>&\"c\" caf\xc3\xa9 \xff\xfe\x01 \xe2\x82", p, 100, 1, 1);
    CHECK(svg && strstr(svg, "a&lt;b&gt;&amp;&quot;c&quot; caf\xc3\xa9 ?" "?? ?" "?</text>"));
    free(svg);

    check_case("100,000 points: a bounded file, drawn in ~2 points per pixel column, a single spike kept");
    synthetic(p, 100000, 10, 3);
    p[50000].loss = 3.0;  // one step whose loss is 100x its neighbours'
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    svg = chart("long.svg", "run", p, 100000, 1, 1);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    long size = 0;
    free(read_all(tmp_path("long.svg"), &size));
    double top;
    CHECK(svg && check_points(svg, "loss", &top) == 0 && top < 100);  // the spike (y 89.5); without it the top is the start (~146)
    CHECK(size < 120000);
    printf("  %ld bytes, written in %.1f ms\n", size, 1e3 * (t1.tv_sec - t0.tv_sec) + 1e-6 * (t1.tv_nsec - t0.tv_nsec));
    free(svg);

    check_case("rewriting replaces the chart and leaves no temporary file");
    synthetic(p, 10, 10, 4);
    CHECK(loss_plot_write(tmp_path("again.svg"), "run", p, 5, err, sizeof err) == 0);
    CHECK(loss_plot_write(tmp_path("again.svg"), "run", p, 10, err, sizeof err) == 0);
    svg = read_all(tmp_path("again.svg"), NULL);
    CHECK(svg && strstr(svg, "step 100"));
    free(svg);
    CHECK(leftover_temporaries(tmp_dir) == 0);

    check_case("another quantity (the trainer's fid.svg): its name in the heading, axis, legend and summary; no lr line");
    for (int i = 0; i < 6; i++) p[i].step = 1000 * (i + 1), p[i].loss = 80.0 / (i + 1), p[i].lr = NAN;
    CHECK(loss_plot_write_quantity(tmp_path("fid.svg"), "run", "FID", p, 6, err, sizeof err) == 0);
    svg = read_all(tmp_path("fid.svg"), NULL);
    CHECK(svg && well_formed(svg) && strstr(svg, ">FID: run</text>") && strstr(svg, "FID (log scale)") &&
          strstr(svg, "FID (each evaluation)") && strstr(svg, "\xc2\xb7 FID 13.33") && !strstr(svg, "training loss") &&
          !strstr(svg, "<polyline id=\"lr\""));
    free(svg);

    check_case("a failed write: one error line, -1, no file and no temporary left behind");
    err[0] = '\0';
    CHECK(loss_plot_write(tmp_path("no such folder/loss.svg"), "run", p, 10, err, sizeof err) == -1);
    CHECK(strstr(err, "cannot write") && strstr(err, "No such file") && !strchr(err, '\n'));
    CHECK(mkdir(tmp_path("a folder.svg"), 0700) == 0);  // renaming a file over a folder fails after the write
    err[0] = '\0';
    CHECK(loss_plot_write(tmp_path("a folder.svg"), "run", p, 10, err, sizeof err) == -1 && strstr(err, "cannot write"));
    CHECK(leftover_temporaries(tmp_dir) == 0);
    CHECK(mkdir(tmp_path("read-only"), 0500) == 0);
    if (geteuid() != 0) {  // root writes anyway
        err[0] = '\0';
        CHECK(loss_plot_write(tmp_path("read-only/loss.svg"), "run", p, 10, err, sizeof err) == -1);
        CHECK(strstr(err, "cannot write") && strstr(err, "Permission denied"));
        CHECK(access(tmp_path("read-only/loss.svg"), F_OK) != 0);
    }
    CHECK(leftover_temporaries(tmp_path("read-only")) == 0);
    chmod(tmp_path("read-only"), 0700);

    if (getenv("KEEP")) return check_summary();
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp_dir);
    CHECK(system(cmd) == 0);
    return check_summary();
}
