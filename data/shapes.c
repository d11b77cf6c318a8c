// shapes.c: the bundled synthetic dataset "shapes" (the renderer) and the checker that decides
// whether an RGB image, a dataset image or a trained model's sample, is a valid shape image.
//
// An image is one filled shape on a plain background. Shapes are a circle, an axis-aligned square
// or a right isosceles triangle (right angle in one of the 4 corners of its bounding box), all with
// a square bounding box of side 25%..70% of the image, kept at least 5% of the side away from the
// image edge. Edges are antialiased (exact coverage, one pixel wide), like the soft edges a
// diffusion model draws. Colours come from two small palettes, every shape colour at least 120
// away (Euclidean RGB) from every background colour and from every other shape colour.
#include "data/shapes.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "random.h"  // mix64

const char *const shapes_class_names[SHAPES_NUM_CLASSES] = {"circle", "square", "triangle"};

enum { CIRCLE, SQUARE, TRIANGLE };

static const uint8_t background_palette[][3] = {{255, 255, 255}, {0, 0, 0}, {128, 128, 128}};
static const uint8_t shape_palette[][3] = {
    {230, 40, 40},   // red
    {240, 210, 30},  // yellow
    {40, 180, 60},   // green
    {30, 190, 220},  // cyan
    {40, 70, 220},   // blue
    {210, 50, 200},  // magenta
};
#define NUM_BACKGROUNDS (int)(sizeof background_palette / sizeof background_palette[0])
#define NUM_SHAPE_COLOURS (int)(sizeof shape_palette / sizeof shape_palette[0])

// Rendering.
#define MIN_SIDE 0.25   // smallest shape side, as a fraction of the image side
#define MAX_SIDE 0.70   // largest shape side
#define MARGIN 0.05     // empty space kept between the shape and the image edge
#define SUPERSAMPLE 4   // antialiasing: SUPERSAMPLE^2 coverage samples per pixel

// Checking: distances are Euclidean in RGB (0..255 per channel), fractions are of pixel counts.
#define MIN_IMAGE_SIDE 8          // smaller images cannot hold a shape with a background margin
#define MAX_IMAGE_PIXELS (1 << 28) // int pixel indices; the work buffers take 8 bytes a pixel
#define BG_PALETTE_TOL 48.0       // the background may drift this far from its palette colour
#define BORDER_CLEAN_TOL 48.0     // clean border pixel: within 3 sigma of noise of sigma 16 per channel
#define BORDER_MIN_CLEAN 0.90     // rendered shapes never touch the border: it is almost all background
#define FG_MIN_DIST 60.0          // half the smallest background-to-shape colour distance (123)
#define FG_TOP_FRAC 0.25          // the shape's colour is measured on the farthest quarter of those
#define FG_PALETTE_TOL 48.0       // the shape may drift this far from its palette colour (< 120/2)
#define OFF_LINE_TOL 56.0         // off-colour: this far from every background/shape mixture; above
                                  // sigma-16 noise, below 92 (any other palette colour is that far)
#define SECOND_BLOB_FRAC 0.10     // another blob of 10% of the shape's area is a second shape
#define MAX_NOISE_FRAC 0.01       // at most 1% of the pixels may be off-colour or stray specks
#define MIN_AREA_FRAC 0.012       // the smallest rendered shape (a triangle) covers 3.1% of the image
#define MIN_IOU 0.88              // overlap with the fitted ideal shape; equal-area circle and square
                                  // overlap 0.83, so a blob between the classes fails

// ---------------------------------------------------------------------------------------------
// Random numbers: splitmix64 (random.h's mix64) over a counter. The stream of image `index` starts
// from a hash of (seed, index), so every image is independent of the others.

// Next 64 random bits: advance the counter by the golden-ratio increment and mix it.
static uint64_t rng_next(uint64_t *state) { return mix64(*state += 0x9E3779B97F4A7C15ull); }

// Uniform double in [0, 1) from the top 53 bits.
static double rng_uniform(uint64_t *state) { return (double)(rng_next(state) >> 11) * 0x1.0p-53; }

// Uniform integer in [0, n); the modulo bias is below 2^-60 for the tiny n used here.
static int rng_int(uint64_t *state, int n) { return (int)(rng_next(state) % (uint64_t)n); }

// ---------------------------------------------------------------------------------------------
// Shapes in continuous pixel coordinates: pixel (x, y) covers [x, x+1) x [y, y+1).

typedef struct {
    int cls;
    double x0, y0, side;  // bounding box [x0, x0+side) x [y0, y0+side)
    int corner;           // triangle: right angle at bit0 ? right : left, bit1 ? bottom : top
} Shape;

// Is the point (x, y) inside the shape? Circle: (x-cx)^2 + (y-cy)^2 < r^2 with r = side/2.
// Triangle: with u, v the distances from the right-angle corner along the legs, over side,
// u >= 0, v >= 0, u + v < 1.
static int shape_contains(const Shape *s, double x, double y) {
    double u = (x - s->x0) / s->side, v = (y - s->y0) / s->side;  // bounding box -> [0, 1)^2
    switch (s->cls) {
    case CIRCLE: return (u - 0.5) * (u - 0.5) + (v - 0.5) * (v - 0.5) < 0.25;
    case SQUARE: return u >= 0 && u < 1 && v >= 0 && v < 1;
    default:
        if (s->corner & 1) u = 1 - u;
        if (s->corner & 2) v = 1 - v;
        return u >= 0 && v >= 0 && u + v < 1;
    }
}

// Fraction of pixel (x, y) the shape covers, from a SUPERSAMPLE x SUPERSAMPLE grid of samples.
static double shape_coverage(const Shape *s, int x, int y) {
    int inside = 0;
    for (int i = 0; i < SUPERSAMPLE; i++)
        for (int j = 0; j < SUPERSAMPLE; j++)
            inside += shape_contains(s, x + (j + 0.5) / SUPERSAMPLE, y + (i + 0.5) / SUPERSAMPLE);
    return (double)inside / (SUPERSAMPLE * SUPERSAMPLE);
}

// Draws image `index`: class, side, position, corner, shape colour and background colour, all
// uniform. Each pixel is background + coverage * (shape - background), rounded.
int shapes_render(uint64_t seed, uint64_t index, int size, uint8_t *rgb) {
    uint64_t state = mix64(mix64(seed) ^ index);
    Shape s;
    s.cls = rng_int(&state, SHAPES_NUM_CLASSES);
    s.side = size * (MIN_SIDE + (MAX_SIDE - MIN_SIDE) * rng_uniform(&state));
    double margin = size * MARGIN, room = size - 2 * margin - s.side;
    s.x0 = margin + room * rng_uniform(&state);
    s.y0 = margin + room * rng_uniform(&state);
    s.corner = rng_int(&state, 4);
    const uint8_t *fg = shape_palette[rng_int(&state, NUM_SHAPE_COLOURS)];
    const uint8_t *bg = background_palette[rng_int(&state, NUM_BACKGROUNDS)];
    int x_lo = (int)s.x0, x_hi = (int)(s.x0 + s.side), y_lo = (int)s.y0, y_hi = (int)(s.y0 + s.side);
    for (int y = 0; y < size; y++)
        for (int x = 0; x < size; x++) {
            double a = (x >= x_lo && x <= x_hi && y >= y_lo && y <= y_hi) ? shape_coverage(&s, x, y) : 0.0;
            uint8_t *p = rgb + ((size_t)y * size + x) * 3;
            for (int c = 0; c < 3; c++) p[c] = (uint8_t)lround(bg[c] + a * (fg[c] - bg[c]));
        }
    return s.cls;
}

// ---------------------------------------------------------------------------------------------
// The checker.

#define MAX_DIST 442  // the largest distance between two RGB colours, sqrt(3) * 255, rounded down

// Euclidean distance between two RGB colours.
static double colour_dist(const uint8_t *p, const double *q) {
    double d0 = p[0] - q[0], d1 = p[1] - q[1], d2 = p[2] - q[2];
    return sqrt(d0 * d0 + d1 * d1 + d2 * d2);
}

// Distance from colour c to the nearest of n palette colours.
static double palette_dist(const double *c, const uint8_t (*palette)[3], int n) {
    double best = INFINITY;
    for (int i = 0; i < n; i++) {
        double d = colour_dist(palette[i], c);
        if (d < best) best = d;
    }
    return best;
}

// Per-channel histograms of a set of pixels, for a robust (median) colour of the set.
typedef struct {
    uint32_t count[3][256];
    uint32_t n;
} ColourHistogram;

static void histogram_add(ColourHistogram *h, const uint8_t *p) {
    for (int c = 0; c < 3; c++) h->count[c][p[c]]++;
    h->n++;
}

// The per-channel median: the smallest value with at least half the pixels at or below it.
static void histogram_median(const ColourHistogram *h, double *out) {
    for (int c = 0; c < 3; c++) {
        uint32_t below = 0;
        int v = 0;
        while (v < 255 && 2 * (below + h->count[c][v]) < h->n) below += h->count[c][v++];
        out[c] = v;
    }
}

// Writes the reason an image failed; returns -1 for the caller to pass on.
static int reject(char *why, size_t why_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int reject(char *why, size_t why_len, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    if (why && why_len) vsnprintf(why, why_len, fmt, args);
    va_end(args);
    return -1;
}

// Labels the 4-connected components of the foreground (labels[i] == 0: unlabelled foreground,
// -1: not foreground) with 1, 2, ... by flood fill. Returns the label of the largest component and
// writes its area, the area of the second largest and the total foreground area.
static int label_components(int32_t *labels, int32_t *stack, int w, int h, long *largest, long *second,
                            long *total) {
    int best = 0, next = 0;
    *largest = *second = *total = 0;
    for (int start = 0; start < w * h; start++) {
        if (labels[start] != 0) continue;
        long area = 0;
        int top = 0;
        labels[start] = ++next;
        stack[top++] = start;
        while (top > 0) {
            int i = stack[--top], x = i % w, y = i / w;
            area++;
            int neighbours[4] = {x > 0 ? i - 1 : -1, x < w - 1 ? i + 1 : -1, y > 0 ? i - w : -1,
                                 y < h - 1 ? i + w : -1};
            for (int k = 0; k < 4; k++)
                if (neighbours[k] >= 0 && labels[neighbours[k]] == 0) {
                    labels[neighbours[k]] = next;
                    stack[top++] = neighbours[k];
                }
        }
        *total += area;
        if (area > *largest) {
            *second = *largest;
            *largest = area;
            best = next;
        } else if (area > *second) {
            *second = area;
        }
    }
    return best;
}

// Intersection over union of the blob (pixels labelled `blob`) and the ideal shape s, where a pixel
// is in the shape when its centre is. Only the union of both bounding boxes can contribute.
static double blob_iou(const int32_t *labels, int blob, const int *bbox, const Shape *s, int w, int h) {
    int x_lo = (int)fmax(0, fmin(bbox[0], floor(s->x0)));
    int y_lo = (int)fmax(0, fmin(bbox[1], floor(s->y0)));
    int x_hi = (int)fmin(w - 1, fmax(bbox[2], ceil(s->x0 + s->side)));
    int y_hi = (int)fmin(h - 1, fmax(bbox[3], ceil(s->y0 + s->side)));
    long inter = 0, uni = 0;
    for (int y = y_lo; y <= y_hi; y++)
        for (int x = x_lo; x <= x_hi; x++) {
            int a = labels[y * w + x] == blob, b = shape_contains(s, x + 0.5, y + 0.5);
            inter += a && b;
            uni += a || b;
        }
    return uni ? (double)inter / uni : 0.0;
}

// The ideal shapes of each class with the blob's area and centroid (mx, my); the best overlap
// decides the class. Square of side sqrt(A); circle of diameter 2 sqrt(A/pi); triangle of legs
// sqrt(2A) in each of the 4 corners, its centroid a third of the legs from the right angle.
static int classify_blob(const int32_t *labels, int blob, const int *bbox, long area, double mx, double my,
                         int w, int h, double *best_iou) {
    int best_cls = -1;
    *best_iou = -1;
    for (int t = 0; t < 6; t++) {
        Shape s = {.cls = t < 2 ? t : TRIANGLE, .corner = t < 2 ? 0 : t - 2};
        if (s.cls == CIRCLE) s.side = 2 * sqrt(area / M_PI);
        else if (s.cls == SQUARE) s.side = sqrt((double)area);
        else s.side = sqrt(2.0 * area);
        // The centroid's place in the bounding box, as a fraction of the side.
        double fx = s.cls != TRIANGLE ? 0.5 : (s.corner & 1) ? 2.0 / 3 : 1.0 / 3;
        double fy = s.cls != TRIANGLE ? 0.5 : (s.corner & 2) ? 2.0 / 3 : 1.0 / 3;
        s.x0 = mx - fx * s.side;
        s.y0 = my - fy * s.side;
        double iou = blob_iou(labels, blob, bbox, &s, w, h);
        if (iou > *best_iou) {
            *best_iou = iou;
            best_cls = s.cls;
        }
    }
    return best_cls;
}

// Is pixel i of a w x h image on its 1-pixel border?
static int on_border(long i, int w, int h) {
    int x = (int)(i % w), y = (int)(i / w);
    return x == 0 || y == 0 || x == w - 1 || y == h - 1;
}

// Decides whether rgb shows one palette-coloured shape on a plain palette background:
//  (a) background: the median colour of the 1-pixel border, near a background palette colour,
//      with the border almost all within BORDER_CLEAN_TOL of it;
//  (b) shape colour: the median of the pixels farthest from the background (the shape's inside,
//      not its soft edge), near a shape palette colour;
//  (c) every pixel is projected on the segment background -> shape colour: t is its mixing weight,
//      and it is off-colour when farther than OFF_LINE_TOL from the segment (antialiased and blurred
//      edges lie on it). Foreground is t >= 0.5; its 4-connected components must be one blob plus
//      specks, and off-colour pixels and specks together stay under MAX_NOISE_FRAC;
//  (d) the blob covers at least MIN_AREA_FRAC; (e) it is compared with ideal shapes of its area and
//      centroid: the best overlap (IoU) must reach MIN_IOU and names the class.
int shapes_check(const uint8_t *rgb, int w, int h, char *why, size_t why_len) {
    if (w < MIN_IMAGE_SIDE || h < MIN_IMAGE_SIDE)
        return reject(why, why_len, "image %dx%d is smaller than %dx%d", w, h, MIN_IMAGE_SIDE, MIN_IMAGE_SIDE);
    long n = (long)w * h;
    if (n > MAX_IMAGE_PIXELS) return reject(why, why_len, "image %dx%d is too large to check", w, h);
    ColourHistogram *hist = malloc(sizeof *hist);
    int32_t *labels = malloc(2 * n * sizeof *labels);  // component labels, then the flood-fill stack
    if (!hist || !labels) {
        free(hist);
        free(labels);
        return reject(why, why_len, "out of memory");
    }
    int result = -1;

    // (a) The background.
    double bg[3];
    memset(hist, 0, sizeof *hist);
    for (long i = 0; i < n; i++)
        if (on_border(i, w, h)) histogram_add(hist, rgb + i * 3);
    histogram_median(hist, bg);
    long clean = 0;
    for (long i = 0; i < n; i++) clean += on_border(i, w, h) && colour_dist(rgb + i * 3, bg) <= BORDER_CLEAN_TOL;
    double bg_err = palette_dist(bg, background_palette, NUM_BACKGROUNDS);
    if (bg_err > BG_PALETTE_TOL) {
        reject(why, why_len, "background (%.0f,%.0f,%.0f) is %.0f from every background colour", bg[0], bg[1], bg[2],
               bg_err);
        goto done;
    }
    if (clean < BORDER_MIN_CLEAN * hist->n) {
        reject(why, why_len, "border is not plain background (%.1f%% clean)", 100.0 * clean / hist->n);
        goto done;
    }

    // (b) The shape's colour: the median of the FG_TOP_FRAC of the far pixels farthest from the
    // background, so the shape's inside and not its soft edge. dist_count: far pixels by distance.
    double fg[3];
    long dist_count[MAX_DIST + 1] = {0}, far = 0;
    for (long i = 0; i < n; i++) {
        double dist = colour_dist(rgb + i * 3, bg);
        if (dist > FG_MIN_DIST) dist_count[(int)dist]++, far++;
    }
    if (far == 0) {
        reject(why, why_len, "no shape: nothing stands out from the background");
        goto done;
    }
    int cut = MAX_DIST;
    for (long above = dist_count[cut]; above < FG_TOP_FRAC * far;) above += dist_count[--cut];
    memset(hist, 0, sizeof *hist);
    for (long i = 0; i < n; i++) {
        double dist = colour_dist(rgb + i * 3, bg);
        if (dist > FG_MIN_DIST && (int)dist >= cut) histogram_add(hist, rgb + i * 3);
    }
    histogram_median(hist, fg);
    double fg_err = palette_dist(fg, shape_palette, NUM_SHAPE_COLOURS);
    if (fg_err > FG_PALETTE_TOL) {
        reject(why, why_len, "shape colour (%.0f,%.0f,%.0f) is %.0f from every shape colour", fg[0], fg[1], fg[2],
               fg_err);
        goto done;
    }

    // (c) Foreground, off-colour pixels and blobs.
    double d[3] = {fg[0] - bg[0], fg[1] - bg[1], fg[2] - bg[2]};
    double dd = d[0] * d[0] + d[1] * d[1] + d[2] * d[2];
    long off = 0;
    for (long i = 0; i < n; i++) {
        const uint8_t *p = rgb + i * 3;
        double t = ((p[0] - bg[0]) * d[0] + (p[1] - bg[1]) * d[1] + (p[2] - bg[2]) * d[2]) / dd;
        double tc = t < 0 ? 0 : t > 1 ? 1 : t;
        double mixture[3] = {bg[0] + tc * d[0], bg[1] + tc * d[1], bg[2] + tc * d[2]};
        int is_off = colour_dist(p, mixture) > OFF_LINE_TOL;
        off += is_off;
        labels[i] = !is_off && t >= 0.5 ? 0 : -1;
    }
    long largest, second, total;
    int blob = label_components(labels, labels + n, w, h, &largest, &second, &total);
    if (largest == 0) {
        reject(why, why_len, "no shape: no pixel is nearer the shape colour than the background");
        goto done;
    }
    if (second >= SECOND_BLOB_FRAC * largest) {
        reject(why, why_len, "more than one shape (blobs of %ld and %ld pixels)", largest, second);
        goto done;
    }
    if (off + total - largest > MAX_NOISE_FRAC * n) {
        reject(why, why_len, "noisy: %.1f%% of pixels are off-colour or stray specks",
               100.0 * (off + total - largest) / n);
        goto done;
    }

    // (d) Size.
    if (largest < MIN_AREA_FRAC * n) {
        reject(why, why_len, "shape too small (%.1f%% of the image)", 100.0 * largest / n);
        goto done;
    }

    // (e) Shape: the blob's centroid (of pixel centres) and bounding box, then the best ideal shape.
    double mx = 0, my = 0;
    int bbox[4] = {w, h, -1, -1};  // x_lo, y_lo, x_hi, y_hi
    for (long i = 0; i < n; i++)
        if (labels[i] == blob) {
            int x = (int)(i % w), y = (int)(i / w);
            mx += x + 0.5;
            my += y + 0.5;
            if (x < bbox[0]) bbox[0] = x;
            if (y < bbox[1]) bbox[1] = y;
            if (x > bbox[2]) bbox[2] = x;
            if (y > bbox[3]) bbox[3] = y;
        }
    double iou;
    int cls = classify_blob(labels, blob, bbox, largest, mx / largest, my / largest, w, h, &iou);
    if (iou < MIN_IOU)
        reject(why, why_len, "blob is no clean shape (best match %s, overlap %.2f < %.2f)", shapes_class_names[cls],
               iou, MIN_IOU);
    else
        result = cls;

done:
    free(hist);
    free(labels);
    return result;
}
