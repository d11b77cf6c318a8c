// loss_plot.h: the training loss curve as a standalone SVG chart (run/loss.svg), drawn without
// Python. Plain C11 that also compiles as C++17 (train_unet.cu includes it); libc and libm only,
// plus POSIX rename/getpid (the build defines _GNU_SOURCE; g++ does by default).
//
//   LossLog curve = {NULL, 0, 0};
//   loss_log_read_csv(&curve, "run/log.csv", err, sizeof err);        // on resume: the rows kept
//   loss_log_add(&curve, step, loss, lr);                              // at each log interval
//   loss_plot_write("run/loss.svg", "run", curve.points, curve.count, err, sizeof err);
//   loss_log_free(&curve);
//
// loss_plot_write_quantity draws another quantity logged at some steps the same way (the trainer's
// run/fid.svg: "FID", the learning rate NaN), its name in the heading, axis and legend.
//
// The chart (800x560): the loss on a log axis with 1-2-5 ticks, each logged value as a thin light
// line and a smoothed line on top; the learning rate beneath on a linear axis; one step axis with
// round ticks. The smoothed line is a trailing exponential moving average of log(loss) over steps
// (a geometric mean, as the log axis shows it), debiased (divided by the weight it has accumulated,
// as Adam does, so the first points are not pulled towards zero); its time constant is a tenth of
// the steps so far, at most 1/40 of the steps shown, so it follows the fast fall at the start and
// smooths the slow part after it without a visible lag. Rows whose loss is not finite or not positive are left out of the
// loss lines; rows with a non-finite learning rate out of the learning-rate line. With more points
// than two per pixel column, each line is drawn through the lowest and highest point of each
// column (in their order), so spikes stay visible and the file stays under ~60 KB however long the
// run. The file is written to PATH.tmp.PID beside PATH and renamed over PATH: a reader sees the old
// chart or the new one, never half of one; on an error nothing is left behind. It is not synced:
// the chart is drawn again at every interval from what log.csv holds, and a sync (milliseconds on
// a slow disk) would cost more than the drawing.
#ifndef LOSS_PLOT_H
#define LOSS_PLOT_H

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    int64_t step;
    double loss;  // mean training loss over the log interval ending at step
    double lr;    // learning rate at step
} LossPoint;

// The points of one run, in step order; grows as the run logs.
typedef struct {
    LossPoint *points;
    int count, capacity;
} LossLog;

#define LOSS_LOG_MAX_POINTS 50000000  // 1.2 GB of points: a log longer than this is refused

// Appends one point. 0, or -1 when out of memory (the log is unchanged).
static int loss_log_add(LossLog *log, int64_t step, double loss, double lr) {
    if (log->count == log->capacity) {
        if (log->capacity >= LOSS_LOG_MAX_POINTS) return -1;
        int capacity = log->capacity ? 2 * log->capacity : 1024;
        if (capacity > LOSS_LOG_MAX_POINTS) capacity = LOSS_LOG_MAX_POINTS;
        LossPoint *grown = (LossPoint *)realloc(log->points, (size_t)capacity * sizeof(LossPoint));
        if (!grown) return -1;
        log->points = grown, log->capacity = capacity;
    }
    LossPoint *p = &log->points[log->count++];
    p->step = step, p->loss = loss, p->lr = lr;
    return 0;
}

static void loss_log_free(LossLog *log) {
    free(log->points);
    log->points = NULL, log->count = log->capacity = 0;
}

// Appends the rows of a log.csv as train_unet writes it (header
// step,loss,lr,grad_norm,img_per_s,ms_per_step,gpu_mem_gib,mse,vb, then one row per log interval; only
// the first three columns are read). Lines
// that do not start with a step number, a step and two numbers (the header, a line cut short by a
// crash) are skipped; "nan" and "inf" are read as such and left out when drawn. 0, or -1 with one
// line in err (cannot open or read the file, out of memory).
static int loss_log_read_csv(LossLog *log, const char *path, char *err, size_t err_len) {
    FILE *f = fopen(path, "r");
    if (!f) return snprintf(err, err_len, "cannot read %s: %s", path, strerror(errno)), -1;
    char line[512];
    int at_line_start = 1;
    while (fgets(line, sizeof line, f)) {
        size_t len = strlen(line);
        int starts = at_line_start;
        at_line_start = len > 0 && line[len - 1] == '\n';
        if (!starts || line[0] < '0' || line[0] > '9') continue;  // the rest of a long line, the header
        char *end;
        errno = 0;
        long long step = strtoll(line, &end, 10);
        if (errno || *end != ',') continue;
        double loss = strtod(end + 1, &end);
        if (*end != ',') continue;
        double lr = strtod(end + 1, &end);
        if (*end != ',' && *end != '\n' && *end != '\r' && *end != '\0') continue;
        if (loss_log_add(log, (int64_t)step, loss, lr) != 0) {
            fclose(f);
            return snprintf(err, err_len, "cannot read %s: out of memory (%d rows)", path, log->count), -1;
        }
    }
    int failed = ferror(f);
    fclose(f);
    if (failed) return snprintf(err, err_len, "cannot read %s: read error", path), -1;
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Drawing. Everything below is internal to loss_plot_write.

enum { LP_W = 800, LP_H = 560, LP_LEFT = 72, LP_RIGHT = 784, LP_LOSS_TOP = 60, LP_LOSS_BOTTOM = 380,
       LP_LR_TOP = 404, LP_LR_BOTTOM = 500 };

// A round step for about `target` intervals over `range` (1, 2 or 5 times a power of ten).
static double lp_nice_step(double range, int target) {
    double raw = range / target, mag = pow(10, floor(log10(raw))), f = raw / mag;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
}

// Removes trailing zeros after a decimal point ("1.50" -> "1.5", "2.0" -> "2").
static void lp_trim_zeros(char *s) {
    if (!strchr(s, '.')) return;
    size_t n = strlen(s);
    while (n > 0 && s[n - 1] == '0') s[--n] = '\0';
    if (n > 0 && s[n - 1] == '.') s[--n] = '\0';
}

// A tick label for v on an axis whose ticks are `step` apart: fixed point with the decimals the
// step needs, or m.me-N when that would be long (1e-4, 2.5e-5).
static void lp_format(char *out, size_t len, double v, double step) {
    if (fabs(v) < step * 1e-6) v = 0;
    int k = (int)floor(log10(step) + 1e-9);
    if (v == 0) {
        snprintf(out, len, "0");
    } else if (k >= -4 && fabs(v) < 1e6) {
        snprintf(out, len, "%.*f", k < 0 ? -k : 0, v);
        lp_trim_zeros(out);
    } else {
        int e = (int)floor(log10(fabs(v)) + 1e-9);
        double mant = v / pow(10, e);
        char m[40];
        snprintf(m, sizeof m, "%.*f", e - k > 0 ? (e - k < 6 ? e - k : 6) : 0, mant);
        lp_trim_zeros(m);
        snprintf(out, len, "%se%d", m, e);
    }
}

// A step count: 1500, 25k, 1.5M.
static void lp_format_step(char *out, size_t len, double v) {
    long long s = llround(v);
    if (s != 0 && s % 1000000 == 0) snprintf(out, len, "%lldM", s / 1000000);
    else if (s != 0 && s % 1000 == 0) snprintf(out, len, "%lldk", s / 1000);
    else snprintf(out, len, "%lld", s);
}

// A value for the summary line: 4 significant digits.
static void lp_format_value(char *out, size_t len, double v) { snprintf(out, len, "%.4g", v); }

// Writes s with XML's special characters escaped, control characters and bytes that are not
// UTF-8 replaced by '?', so that any run folder name gives a valid document.
static void lp_write_text(FILE *f, const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned c = *p;
        int extra = c < 0x80 ? 0 : (c & 0xe0) == 0xc0 && c >= 0xc2 ? 1 : (c & 0xf0) == 0xe0 ? 2 : (c & 0xf8) == 0xf0 && c <= 0xf4 ? 3 : -1;
        int ok = extra >= 0;
        for (int i = 1; ok && i <= extra; i++) ok = (p[i] & 0xc0) == 0x80;
        if (ok && extra == 2) ok = !(c == 0xe0 && p[1] < 0xa0) && !(c == 0xed && p[1] >= 0xa0);  // overlong, surrogates
        if (ok && extra == 3) ok = !(c == 0xf0 && p[1] < 0x90) && !(c == 0xf4 && p[1] >= 0x90);
        if (!ok) { fputc('?', f), p++; continue; }
        if (extra) { fwrite(p, 1, (size_t)extra + 1, f), p += extra + 1; continue; }
        if (c == '&') fputs("&amp;", f);
        else if (c == '<') fputs("&lt;", f);
        else if (c == '>') fputs("&gt;", f);
        else if (c == '"') fputs("&quot;", f);
        else if (c < 0x20 || c == 0x7f) fputc('?', f);
        else fputc((int)c, f);
        p++;
    }
}

// A polyline through n points in pixel coordinates. With more than two points per pixel column,
// only each column's lowest and highest point is kept, in their order along the line.
static void lp_polyline(FILE *f, const char *id, const char *style, const double *x, const double *y, int n) {
    fprintf(f, "<polyline id=\"%s\" %s points=\"", id, style);
    int thin = n > 2 * (LP_RIGHT - LP_LEFT);
    for (int i = 0; i < n;) {
        int j = i + 1;
        if (thin) {
            double column = floor(x[i]);
            while (j < n && floor(x[j]) == column) j++;
        }
        if (j - i <= 2) {
            for (int k = i; k < j; k++) fprintf(f, "%.1f,%.1f ", x[k], y[k]);
        } else {
            int lo = i, hi = i;
            for (int k = i + 1; k < j; k++) lo = y[k] < y[lo] ? k : lo, hi = y[k] > y[hi] ? k : hi;
            int a = lo < hi ? lo : hi, b = lo < hi ? hi : lo;
            fprintf(f, "%.1f,%.1f ", x[a], y[a]);
            if (b != a) fprintf(f, "%.1f,%.1f ", x[b], y[b]);
        }
        i = j;
    }
    if (n == 1) fprintf(f, "%.1f,%.1f", x[0], y[0]);  // a second copy: a zero-length line with round caps is a dot
    fprintf(f, "\"/>\n");
}

static double lp_clamp(double v, double lo, double hi) { return v < lo ? lo : v > hi ? hi : v == v ? v : lo; }

// The values drawn: a loss in (1e-300, 1e300), a learning rate within +-1e300 (beyond, axes overflow).
static int lp_loss_ok(double loss) { return isfinite(loss) && loss > 1e-300 && loss < 1e300; }
static int lp_lr_ok(double lr) { return isfinite(lr) && fabs(lr) < 1e300; }

// The whole document into f, `quantity` naming the curve ("loss": the training loss; another, as
// "FID", a metric logged at some steps, the learning-rate panel then empty). Returns 0, or -1 when
// out of memory.
static int lp_draw(FILE *f, const char *title, const char *quantity, const LossPoint *points, int count) {
    int is_loss = strcmp(quantity, "loss") == 0;
    const char *heading = is_loss ? "training loss" : quantity;
    // The points each line keeps.
    int n_loss = 0, n_lr = 0;
    int64_t step_min = 0, step_max = 0;
    double loss_min = 0, loss_max = 0, lr_min = 0, lr_max = 0;
    for (int i = 0; i < count; i++) {
        const LossPoint *p = &points[i];
        int loss_ok = lp_loss_ok(p->loss), lr_ok = lp_lr_ok(p->lr);
        if (!loss_ok && !lr_ok) continue;
        if (n_loss + n_lr == 0 || p->step < step_min) step_min = p->step;
        if (n_loss + n_lr == 0 || p->step > step_max) step_max = p->step;
        if (loss_ok) {
            if (n_loss == 0 || p->loss < loss_min) loss_min = p->loss;
            if (n_loss == 0 || p->loss > loss_max) loss_max = p->loss;
            n_loss++;
        }
        if (lr_ok) {
            if (n_lr == 0 || p->lr < lr_min) lr_min = p->lr;
            if (n_lr == 0 || p->lr > lr_max) lr_max = p->lr;
            n_lr++;
        }
    }
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
               "font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\" fill=\"#333\">\n", LP_W, LP_H, LP_W, LP_H);
    fprintf(f, "<title>%s%s", heading, title && title[0] ? ": " : "");
    if (title) lp_write_text(f, title);
    fprintf(f, "</title>\n<rect width=\"%d\" height=\"%d\" fill=\"#fff\"/>\n", LP_W, LP_H);
    fprintf(f, "<text x=\"%d\" y=\"24\" font-size=\"16\" font-weight=\"bold\">%s%s", LP_LEFT, heading, title && title[0] ? ": " : "");
    if (title) lp_write_text(f, title);
    fprintf(f, "</text>\n");
    if (n_loss == 0 && n_lr == 0) {
        fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"20\" text-anchor=\"middle\" fill=\"#888\">no data yet</text>\n</svg>\n",
                LP_W / 2, LP_H / 2);
        return 0;
    }

    // The step axis: from 0 when the log starts in its first half (as a run's does), else from the
    // first step; a single step gets a range of 2 around it.
    double x0 = (double)step_min, x1 = (double)step_max;
    if (x0 >= 0 && x0 < x1 - x0) x0 = 0;
    if (x1 - x0 < 2) x0 = (x0 + x1) / 2 - 1, x1 = x0 + 2;
    double x_range = x1 - x0 > 0 ? x1 - x0 : 2;  // 0 only when steps near 2^63 swallow the padding
    double xs = (LP_RIGHT - LP_LEFT) / x_range;
    double x_step = lp_nice_step(x_range, 8);
    if (x_step < 1) x_step = 1;
    double x_first = ceil(x0 / x_step - 1e-9);  // ticks at (x_first + i) * x_step; counted, not summed,
    int x_ticks = (int)fmin(floor(x1 / x_step + 1e-9) - x_first + 1, 40);  // so huge steps cannot loop

    // The loss axis, in decades: 1-2-5 ticks over 1 to 6 decades, 1..9 over less than one, powers of
    // ten (every k-th) over more; the ends snap outward to ticks, so both ends are labelled.
    double lo = n_loss ? log10(loss_min) : -1, hi = n_loss ? log10(loss_max) : 0;
    if (hi - lo < 1e-6) lo -= 0.05, hi += 0.05;
    double span = hi - lo;
    static const int m125[] = {1, 2, 5}, m19[] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, m1[] = {1};
    const int *mants = span > 6 ? m1 : span >= 1 ? m125 : m19;
    int n_mants = span > 6 ? 1 : span >= 1 ? 3 : 9;
    int decade_step = span > 6 ? (int)ceil(span / 8) : 1;
    int d_lo = (int)floor(lo + 1e-9), d_hi = (int)ceil(hi - 1e-9);
    if (decade_step > 1) d_lo = (int)floor((double)d_lo / decade_step) * decade_step;
    double y_lo = d_lo, y_hi = d_hi;  // snapped ends (log10)
    for (int d = d_lo; d <= d_hi; d += decade_step)
        for (int k = 0; k < n_mants; k++) {
            double t = d + log10((double)mants[k]);
            if (t <= lo + 1e-9 && t > y_lo) y_lo = t;
        }
    for (int d = d_hi; d >= d_lo - 1; d -= decade_step)
        for (int k = 0; k < n_mants; k++) {
            double t = d + log10((double)mants[k]);
            if (t >= hi - 1e-9 && t < y_hi) y_hi = t;
        }
    if (decade_step > 1) y_hi = ceil(hi / decade_step - 1e-9) * decade_step, y_lo = floor(lo / decade_step + 1e-9) * decade_step;
    if (y_hi <= y_lo) y_hi = y_lo + 1;
    double ys = (LP_LOSS_BOTTOM - LP_LOSS_TOP) / (y_hi - y_lo);

    // The learning-rate axis: from 0 (or the lowest rate, when negative) up to a round value.
    double r0 = lr_min < 0 ? lr_min : 0, r1 = lr_max > r0 ? lr_max : (r0 == 0 ? 1 : r0 + fabs(r0));
    if (n_lr == 0) r0 = 0, r1 = 1;
    double r_step = lp_nice_step(r1 - r0, 3);
    r1 = ceil(r1 / r_step - 1e-9) * r_step, r0 = floor(r0 / r_step + 1e-9) * r_step;
    double rs = (LP_LR_BOTTOM - LP_LR_TOP) / (r1 - r0);

    // Summary line: the last point's values.
    char buf[64], buf2[64];
    const LossPoint *last = &points[count - 1];
    fprintf(f, "<text x=\"%d\" y=\"44\" fill=\"#666\">step %lld", LP_LEFT, (long long)last->step);

    // The lines, in pixel coordinates.
    double *lx = (double *)malloc(((size_t)n_loss * 3 + (size_t)n_lr * 2 + 1) * sizeof(double));
    if (!lx) return -1;
    double *ly = lx + n_loss, *sy = ly + n_loss, *rx = sy + n_loss, *ry = rx + n_lr;
    double tau_max = x_range / 40, avg = 0, weight = 0, smoothed_last = 0;
    int64_t prev_step = 0;
    int il = 0, ir = 0;
    for (int i = 0; i < count; i++) {
        const LossPoint *p = &points[i];
        double x = lp_clamp(LP_LEFT + ((double)p->step - x0) * xs, LP_LEFT, LP_RIGHT);
        if (lp_loss_ok(p->loss)) {
            double v = log10(p->loss);
            double tau = fmin(tau_max, ((double)p->step - x0) / 10);
            double keep = il == 0 || !(tau > 0) ? 0 : exp(-fabs((double)p->step - (double)prev_step) / tau);
            avg = keep * avg + (1 - keep) * v, weight = keep * weight + (1 - keep);
            smoothed_last = avg / weight;
            prev_step = p->step;
            lx[il] = x, ly[il] = lp_clamp(LP_LOSS_BOTTOM - (v - y_lo) * ys, LP_LOSS_TOP, LP_LOSS_BOTTOM);
            sy[il] = lp_clamp(LP_LOSS_BOTTOM - (smoothed_last - y_lo) * ys, LP_LOSS_TOP, LP_LOSS_BOTTOM);
            il++;
        }
        if (lp_lr_ok(p->lr)) rx[ir] = x, ry[ir] = lp_clamp(LP_LR_BOTTOM - (p->lr - r0) * rs, LP_LR_TOP, LP_LR_BOTTOM), ir++;
    }
    if (isfinite(last->loss)) {
        lp_format_value(buf, sizeof buf, last->loss);
        fprintf(f, " \xc2\xb7 %s %s", quantity, buf);
    }
    if (n_loss) {
        lp_format_value(buf2, sizeof buf2, pow(10, smoothed_last));
        fprintf(f, " \xc2\xb7 smoothed %s", buf2);
    }
    if (isfinite(last->lr)) {
        lp_format_value(buf, sizeof buf, last->lr);
        fprintf(f, " \xc2\xb7 lr %s", buf);
    }
    fprintf(f, "</text>\n");

    // Loss panel: grid, ticks, lines, legend.
    fprintf(f, "<g id=\"loss-panel\">\n<g stroke=\"#e6e6e6\" stroke-width=\"1\">\n");
    for (int i = 0; i < x_ticks; i++) {
        double t = (x_first + i) * x_step, x = lp_clamp(LP_LEFT + (t - x0) * xs, LP_LEFT, LP_RIGHT);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\"/>\n", x, LP_LOSS_TOP, x, LP_LOSS_BOTTOM);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\"/>\n", x, LP_LR_TOP, x, LP_LR_BOTTOM);
    }
    fprintf(f, "</g>\n<g font-size=\"11\" text-anchor=\"end\">\n");
    for (int d = d_lo - decade_step; d <= d_hi + decade_step; d += decade_step)
        for (int k = 0; k < n_mants; k++) {
            double t = d + log10((double)mants[k]);
            if (t < y_lo - 1e-9 || t > y_hi + 1e-9) continue;
            double y = LP_LOSS_BOTTOM - (t - y_lo) * ys;
            char label[64];
            if (d >= -4 && d <= 5) snprintf(label, sizeof label, "%.*f", d < 0 ? -d : 0, mants[k] * pow(10, d));
            else snprintf(label, sizeof label, "%de%d", mants[k], d);
            fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"%s\"/>\n", LP_LEFT, y, LP_RIGHT, y,
                    mants[k] == 1 ? "#d0d0d0" : "#e6e6e6");
            fprintf(f, "<text x=\"%d\" y=\"%.1f\">%s</text>\n", LP_LEFT - 6, y + 4, label);
        }
    fprintf(f, "</g>\n<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#999\"/>\n", LP_LEFT, LP_LOSS_TOP,
            LP_RIGHT - LP_LEFT, LP_LOSS_BOTTOM - LP_LOSS_TOP);
    fprintf(f, "<text transform=\"translate(18 %d) rotate(-90)\" text-anchor=\"middle\">%s (log scale)</text>\n",
            (LP_LOSS_TOP + LP_LOSS_BOTTOM) / 2, quantity);
    if (n_loss) {
        lp_polyline(f, "loss", "fill=\"none\" stroke=\"#9ecae1\" stroke-width=\"1\" stroke-linejoin=\"round\" stroke-linecap=\"round\"",
                    lx, ly, n_loss);
        lp_polyline(f, "loss-smoothed", "fill=\"none\" stroke=\"#08519c\" stroke-width=\"2\" stroke-linejoin=\"round\" stroke-linecap=\"round\"",
                    lx, sy, n_loss);
        if (n_loss == 1) fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"#08519c\"/>\n", lx[0], sy[0]);
    } else {
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#888\">no finite %s yet</text>\n",
                (LP_LEFT + LP_RIGHT) / 2, (LP_LOSS_TOP + LP_LOSS_BOTTOM) / 2, quantity);
    }
    fprintf(f, "<g font-size=\"11\">\n<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#9ecae1\" stroke-width=\"2\"/>\n"
               "<text x=\"%d\" y=\"%d\">%s (%s)</text>\n", LP_RIGHT - 230, LP_LOSS_TOP + 14, LP_RIGHT - 210,
            LP_LOSS_TOP + 14, LP_RIGHT - 204, LP_LOSS_TOP + 18, quantity, is_loss ? "mean per log interval" : "each evaluation");
    fprintf(f, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#08519c\" stroke-width=\"2\"/>\n"
               "<text x=\"%d\" y=\"%d\">smoothed (EMA of log %s)</text>\n</g>\n</g>\n", LP_RIGHT - 230, LP_LOSS_TOP + 30,
            LP_RIGHT - 210, LP_LOSS_TOP + 30, LP_RIGHT - 204, LP_LOSS_TOP + 34, quantity);

    // Learning-rate panel and the step axis beneath it.
    fprintf(f, "<g id=\"lr-panel\">\n<g font-size=\"11\" text-anchor=\"end\">\n");
    int r_ticks = (int)fmin(round((r1 - r0) / r_step) + 1, 20);
    for (int i = 0; i < r_ticks; i++) {
        double t = r0 + i * r_step, y = LP_LR_BOTTOM - (t - r0) * rs;
        lp_format(buf, sizeof buf, t, r_step);
        fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#e6e6e6\"/>\n", LP_LEFT, y, LP_RIGHT, y);
        fprintf(f, "<text x=\"%d\" y=\"%.1f\">%s</text>\n", LP_LEFT - 6, y + 4, buf);
    }
    fprintf(f, "</g>\n<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#999\"/>\n", LP_LEFT, LP_LR_TOP,
            LP_RIGHT - LP_LEFT, LP_LR_BOTTOM - LP_LR_TOP);
    fprintf(f, "<text transform=\"translate(18 %d) rotate(-90)\" text-anchor=\"middle\">learning rate</text>\n",
            (LP_LR_TOP + LP_LR_BOTTOM) / 2);
    if (n_lr == 1) fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"#d95f02\"/>\n", rx[0], ry[0]);
    if (n_lr) lp_polyline(f, "lr", "fill=\"none\" stroke=\"#d95f02\" stroke-width=\"1.5\" stroke-linejoin=\"round\" stroke-linecap=\"round\"", rx, ry, n_lr);
    fprintf(f, "<g font-size=\"11\" text-anchor=\"middle\">\n");
    for (int i = 0; i < x_ticks; i++) {
        double t = (x_first + i) * x_step;
        lp_format_step(buf, sizeof buf, t);
        fprintf(f, "<text x=\"%.1f\" y=\"%d\">%s</text>\n", lp_clamp(LP_LEFT + (t - x0) * xs, LP_LEFT, LP_RIGHT), LP_LR_BOTTOM + 16, buf);
    }
    fprintf(f, "</g>\n<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">step</text>\n</g>\n</svg>\n", (LP_LEFT + LP_RIGHT) / 2,
            LP_LR_BOTTOM + 40);
    free(lx);
    return 0;
}

// Writes the chart of `count` points (in step order) of `quantity` (lp_draw) to path, atomically
// (see the top of the file); title (the run folder, say) may be NULL. 0 or 0 points give a chart
// that says "no data yet". Returns 0, or -1 with one line in err ("cannot write PATH: reason"),
// leaving no file behind.
static int loss_plot_write_quantity(const char *path, const char *title, const char *quantity, const LossPoint *points, int count,
                                    char *err, size_t err_len) {
    char tmp[4400];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof tmp)
        return snprintf(err, err_len, "cannot write %s: path too long", path), -1;
    int e = 0;
    for (int attempt = 0; attempt < 3; attempt++) {  // a signal during a write: again
        FILE *f = fopen(tmp, "w");
        if (!f) {
            e = errno;
            if (e == EINTR) continue;
            break;
        }
        errno = 0;
        int failed = lp_draw(f, title, quantity, points, count < 0 ? 0 : count) != 0;
        if (failed) e = ENOMEM;
        if (!failed && (ferror(f) || fflush(f) != 0)) failed = 1, e = errno ? errno : EIO;
        if (fclose(f) != 0 && !failed) failed = 1, e = errno;
        if (!failed && rename(tmp, path) != 0) failed = 1, e = errno;
        if (!failed) return 0;
        unlink(tmp);
        if (e != EINTR) break;
    }
    snprintf(err, err_len, "cannot write %s: %s", path, strerror(e));
    return -1;
}

// The training loss's chart (run/loss.svg).
static int loss_plot_write(const char *path, const char *title, const LossPoint *points, int count, char *err, size_t err_len) {
    return loss_plot_write_quantity(path, title, "loss", points, count, err, err_len);
}

#endif  // LOSS_PLOT_H
