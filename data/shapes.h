// shapes.h: the bundled synthetic dataset "shapes" and its checker.
// Each image holds one filled circle, square or triangle of random size, position and palette
// colour on a plain background; the label is the shape. The checker decides whether any RGB image
// (a dataset image or a generated sample) is a valid shape image and which class it shows.
#ifndef SHAPES_H
#define SHAPES_H

#include <stddef.h>
#include <stdint.h>

#define SHAPES_NUM_CLASSES 3
extern const char *const shapes_class_names[SHAPES_NUM_CLASSES];  // "circle", "square", "triangle"

// Renders image `index` of the dataset drawn with `seed` into rgb (size*size*3 bytes, row-major,
// RGB) and returns its class. Deterministic: the same (seed, index, size) gives the same image, and
// image `index` does not depend on any other. The same (seed, index) at another size is the same
// picture scaled. Sizes of 32 and up are what the checker is tuned for (99%+ of renders pass).
int shapes_render(uint64_t seed, uint64_t index, int size, uint8_t *rgb);

// Checks an RGB image (width*height*3 bytes). Returns its class (0..SHAPES_NUM_CLASSES-1) if it is
// a valid shape image, or -1 with a one-line reason written to why (why may be NULL). Accepts
// soft edges, mild noise and blur, as a diffusion model's samples have; see data/shapes.c.
int shapes_check(const uint8_t *rgb, int width, int height, char *why, size_t why_len);

#endif  // SHAPES_H
