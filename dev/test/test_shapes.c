// test_shapes.c: the synthetic "shapes" dataset and its checker. The renderer is deterministic and
// class balanced; the checker accepts rendered images (also slightly noisy or blurred ones, as a
// diffusion model draws them) and names their class, and rejects noise and other garbage.
#include "data/shapes.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dev/test/check.h"
#include "random.h"

#define SEED 1234
#define MAX_SIDE 128

static uint8_t image[MAX_SIDE * MAX_SIDE * 3], other[MAX_SIDE * MAX_SIDE * 3];
static uint64_t rng_state;  // the tests' own noise, fresh each run

// splitmix64 (random.h's mix64 over a counter): next 64 random bits.
static uint64_t rng_next(void) { return mix64(rng_state += 0x9E3779B97F4A7C15ull); }

// Uniform double in (0, 1).
static double rng_uniform(void) { return ((rng_next() >> 11) + 0.5) * 0x1.0p-53; }

// Standard normal sample (Box-Muller).
static double rng_normal(void) { return sqrt(-2 * log(rng_uniform())) * cos(2 * M_PI * rng_uniform()); }

static uint8_t clamp_u8(double v) { return v < 0 ? 0 : v > 255 ? 255 : (uint8_t)lround(v); }

// Fills a w x h image with one colour.
static void fill(uint8_t *rgb, int w, int h, const uint8_t *c) {
    for (int i = 0; i < w * h; i++) memcpy(rgb + i * 3, c, 3);
}

// Paints the pixels whose centre lies in the ellipse with centre (cx, cy) and radii (rx, ry), or
// (when box) in the rectangle [cx-rx, cx+rx) x [cy-ry, cy+ry). No antialiasing.
static void paint(uint8_t *rgb, int w, int h, int box, double cx, double cy, double rx, double ry, const uint8_t *c) {
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) {
            double u = (x + 0.5 - cx) / rx, v = (y + 0.5 - cy) / ry;
            int inside = box ? fabs(u) < 1 && fabs(v) < 1 : u * u + v * v < 1;
            if (inside) memcpy(rgb + (y * w + x) * 3, c, 3);
        }
}

// Adds Gaussian noise of standard deviation sigma to every channel.
static void add_noise(uint8_t *rgb, int n, double sigma) {
    for (int i = 0; i < n * 3; i++) rgb[i] = clamp_u8(rgb[i] + sigma * rng_normal());
}

// 3x3 box blur (the mean of the pixel and its neighbours inside the image).
static void box_blur(const uint8_t *in, uint8_t *out, int w, int h) {
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int c = 0; c < 3; c++) {
                int sum = 0, count = 0;
                for (int dy = -1; dy <= 1; dy++)
                    for (int dx = -1; dx <= 1; dx++)
                        if (x + dx >= 0 && x + dx < w && y + dy >= 0 && y + dy < h) {
                            sum += in[((y + dy) * w + x + dx) * 3 + c];
                            count++;
                        }
                out[(y * w + x) * 3 + c] = (uint8_t)((sum + count / 2) / count);
            }
}

// Renders `count` images of side `size`, blurs them (when blur) and adds noise of sigma per channel,
// then checks them. Writes the fraction that pass and the fraction checked as the rendered class.
static void measure(int size, int count, int blur, double sigma, double *pass, double *agree) {
    int passed = 0, agreed = 0;
    for (int i = 0; i < count; i++) {
        int cls = shapes_render(SEED, i, size, image);
        if (blur) {
            box_blur(image, other, size, size);
            memcpy(image, other, (size_t)size * size * 3);
        }
        if (sigma > 0) add_noise(image, size * size, sigma);
        int got = shapes_check(image, size, size, NULL, 0);
        passed += got >= 0;
        agreed += got == cls;
    }
    *pass = (double)passed / count;
    *agree = (double)agreed / count;
    printf("  %dx%d%s%s: %.2f%% pass, %.2f%% as the rendered class\n", size, size, blur ? ", 3x3 blur" : "",
           sigma == 8 ? ", noise sigma 8" : sigma == 16 ? ", noise sigma 16" : "", 100 * *pass, 100 * *agree);
}

// Checks an image that must fail, printing the reason the checker gives.
static int rejected(const char *what, int w, int h) {
    char why[256] = "";
    int got = shapes_check(image, w, h, why, sizeof why);
    printf("  %-24s -> %s\n", what, got < 0 ? why : shapes_class_names[got]);
    return got < 0;
}

int main(void) {
    const uint8_t white[3] = {255, 255, 255}, black[3] = {0, 0, 0}, grey[3] = {128, 128, 128};
    const uint8_t red[3] = {230, 40, 40}, blue[3] = {40, 70, 220}, brown[3] = {140, 90, 40};
    rng_state = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
    printf("noise seed %llu\n", (unsigned long long)rng_state);

    check_case("render is deterministic and independent per image");
    int cls = shapes_render(SEED, 7, 64, image);
    shapes_render(SEED, 8, 64, other);  // rendering others in between changes nothing
    CHECK(memcmp(image, other, 64 * 64 * 3) != 0);
    CHECK(shapes_render(SEED, 7, 64, other) == cls);
    CHECK(memcmp(image, other, 64 * 64 * 3) == 0);
    shapes_render(SEED + 1, 7, 64, other);
    CHECK(memcmp(image, other, 64 * 64 * 3) != 0);

    check_case("classes are balanced");
    int counts[SHAPES_NUM_CLASSES] = {0};
    for (int i = 0; i < 3000; i++) {
        int c = shapes_render(SEED, i, 32, image);
        CHECK(c >= 0 && c < SHAPES_NUM_CLASSES);
        if (c >= 0 && c < SHAPES_NUM_CLASSES) counts[c]++;
    }
    for (int c = 0; c < SHAPES_NUM_CLASSES; c++) CHECK(counts[c] > 900 && counts[c] < 1100);

    check_case(">= 99% of 10,000 64x64 renders pass with their class");
    double pass, agree;
    measure(64, 10000, 0, 0, &pass, &agree);
    CHECK(pass >= 0.99 && agree >= 0.99);

    check_case(">= 99% of 32x32 and 128x128 renders pass with their class");
    measure(32, 2000, 0, 0, &pass, &agree);
    CHECK(pass >= 0.99 && agree >= 0.99);
    measure(128, 1000, 0, 0, &pass, &agree);
    CHECK(pass >= 0.99 && agree >= 0.99);

    check_case(">= 90% of noisy (sigma 8 and 16) and blurred (3x3 box) renders pass with their class");
    measure(64, 2000, 0, 8, &pass, &agree);
    CHECK(pass >= 0.9 && agree >= 0.9);
    measure(64, 2000, 0, 16, &pass, &agree);
    CHECK(pass >= 0.9 && agree >= 0.9);
    measure(64, 2000, 1, 0, &pass, &agree);
    CHECK(pass >= 0.9 && agree >= 0.9);
    measure(64, 2000, 1, 8, &pass, &agree);
    CHECK(pass >= 0.9 && agree >= 0.9);

    check_case("hand-drawn shapes pass, also on non-square images");
    fill(image, 96, 64, white);
    paint(image, 96, 64, 1, 40, 30, 12, 12, red);
    CHECK(shapes_check(image, 96, 64, NULL, 0) == 1);
    fill(image, 64, 96, black);
    paint(image, 64, 96, 0, 30, 60, 15, 15, blue);
    CHECK(shapes_check(image, 64, 96, NULL, 0) == 0);

    check_case("0 of 1000 uniform noise images pass");
    int noise_passed = 0;
    for (int i = 0; i < 1000; i++) {
        for (int j = 0; j < 64 * 64 * 3; j++) image[j] = (uint8_t)rng_next();
        noise_passed += shapes_check(image, 64, 64, NULL, 0) >= 0;
    }
    printf("  uniform noise: %d of 1000 pass\n", noise_passed);
    CHECK(noise_passed == 0);

    check_case("garbage is rejected");
    fill(image, 64, 64, grey);
    CHECK(rejected("plain background", 64, 64));
    fill(image, 64, 64, white);
    paint(image, 64, 64, 1, 16, 16, 8, 8, red);
    paint(image, 64, 64, 1, 46, 46, 8, 8, red);
    CHECK(rejected("two squares", 64, 64));
    fill(image, 64, 64, white);
    paint(image, 64, 64, 1, 20, 20, 10, 10, red);
    paint(image, 64, 64, 0, 44, 44, 10, 10, blue);
    CHECK(rejected("square and circle", 64, 64));
    fill(image, 64, 64, white);
    paint(image, 64, 64, 1, 32, 32, 12, 12, brown);
    CHECK(rejected("non-palette colour", 64, 64));
    fill(image, 64, 64, (const uint8_t[]){70, 100, 40});
    paint(image, 64, 64, 1, 32, 32, 12, 12, red);
    CHECK(rejected("non-palette background", 64, 64));
    fill(image, 64, 64, black);
    paint(image, 64, 64, 1, 32, 32, 20, 8, red);
    CHECK(rejected("2:1 rectangle", 64, 64));
    fill(image, 64, 64, black);
    paint(image, 64, 64, 0, 32, 32, 20, 11, red);
    CHECK(rejected("2:1 ellipse", 64, 64));
    fill(image, 64, 64, black);
    paint(image, 64, 64, 0, 32, 32, 18, 18, red);
    paint(image, 64, 64, 0, 32, 32, 10, 10, black);
    CHECK(rejected("ring", 64, 64));
    fill(image, 64, 64, black);
    paint(image, 64, 64, 1, 32, 32, 18, 6, red);
    paint(image, 64, 64, 1, 32, 32, 6, 18, red);
    CHECK(rejected("cross", 64, 64));
    fill(image, 64, 64, white);
    paint(image, 64, 64, 1, 32, 32, 2, 2, red);
    CHECK(rejected("speck", 64, 64));
    fill(image, 64, 64, white);
    paint(image, 64, 64, 1, 10, 32, 16, 16, red);
    CHECK(rejected("square cut by the edge", 64, 64));
    shapes_render(SEED, 3, 64, image);
    for (int i = 0; i < 64 * 64; i++)
        if (rng_uniform() < 0.05)
            for (int c = 0; c < 3; c++) image[i * 3 + c] = (uint8_t)rng_next();
    CHECK(rejected("5% pixels sprinkled", 64, 64));
    for (int y = 0; y < 64; y++)
        for (int x = 0; x < 64; x++) memset(image + (y * 64 + x) * 3, x * 4, 3);
    CHECK(rejected("horizontal grey ramp", 64, 64));
    for (int y = 0; y < 64; y++)
        for (int x = 0; x < 64; x++) {
            uint8_t *p = image + (y * 64 + x) * 3;
            p[0] = (uint8_t)(x * 4), p[1] = (uint8_t)(y * 4), p[2] = 128;
        }
    CHECK(rejected("colour gradient", 64, 64));
    for (int y = 0; y < 64; y++)
        for (int x = 0; x < 64; x++) memset(image + (y * 64 + x) * 3, 255 - (x + y), 3);
    CHECK(rejected("diagonal ramp", 64, 64));
    fill(image, 4, 4, white);
    CHECK(rejected("4x4 image", 4, 4));

    return check_summary();
}
