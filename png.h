// png.h: writing images as PNG files (stb_image_write): one image, or a grid of them, written
// under a temporary name and renamed, so a reader never sees half a file. generate.c writes its
// samples with it, train_unet.cu its sample grids.
#ifndef PNG_H
#define PNG_H

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <stb_image_write.h>

// Returns 0, or -1 with errno set.
static inline int write_png(const char *path, int w, int h, const uint8_t *rgb) {
    char tmp[4608];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof tmp) return errno = ENAMETOOLONG, -1;
    int ok = stbi_write_png(tmp, w, h, 3, rgb, w * 3) != 0 && rename(tmp, path) == 0;
    if (!ok) unlink(tmp);
    return ok ? 0 : -1;
}

// Writes images ([count][size][size][3]) as one PNG grid, cols to a row (0: ceil(sqrt(count))), with
// a 2-pixel white border; written to a temporary name and renamed. Returns 0, or -1 with errno.
static inline int write_grid_png(const char *path, const uint8_t *images, int count, int size, int cols) {
    if (cols <= 0) cols = (int)ceil(sqrt((double)count));
    int rows = (count + cols - 1) / cols, pad = 2;
    int W = cols * (size + pad) + pad, H = rows * (size + pad) + pad;
    uint8_t *grid = (uint8_t *)malloc((size_t)W * H * 3);
    if (!grid) return -1;
    memset(grid, 255, (size_t)W * H * 3);
    for (int i = 0; i < count; i++)
        for (int y = 0; y < size; y++)
            memcpy(grid + ((size_t)(pad + (i / cols) * (size + pad) + y) * W + pad + (i % cols) * (size + pad)) * 3,
                   images + ((size_t)i * size + y) * size * 3, (size_t)size * 3);
    int r = write_png(path, W, H, grid);
    free(grid);
    return r;
}

#endif  // PNG_H
