// test_dataloader_gpu.cu: the loader's GPU side (train_unet.cu in library mode): pinned batches
// copied to the device and converted to model input, against the same conversion on the CPU.
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

int main(void) {
    // A random dataset: 300 images of 33x33 (odd, so no vector path hides a tail), 5 classes.
    char path[] = "/tmp/test_dataloader_gpu_XXXXXX";
    close(mkstemp(path));
    DatasetHeader h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, DATASET_MAGIC, 8);
    h.version = DATASET_VERSION, h.channels = 3, h.count = 300, h.height = 33, h.width = 33;
    h.num_classes = 5, h.names_bytes = 10;
    DatasetLayout layout;
    char err[256];
    if (dataset_layout(&h, &layout, err, sizeof err) != 0) fatal("%s", err);
    uint8_t *file = (uint8_t *)calloc(layout.file_bytes, 1);
    memcpy(file, &h, sizeof h);
    memcpy(file + layout.names_offset, "a\0b\0c\0d\0e\0", 10);
    srand((unsigned)time(NULL));
    for (uint64_t i = 0; i < h.count; i++) ((int32_t *)(file + layout.labels_offset))[i] = rand() % 5;
    for (uint64_t j = 0; j < h.count * layout.image_bytes; j++) file[layout.pixels_offset + j] = (uint8_t)rand();
    FILE *f = fopen(path, "wb");
    fwrite(file, 1, layout.file_bytes, f);
    fclose(f);
    free(file);

    check_case("gpu loader: pinned batches convert to [-1, 1] exactly as on the CPU");
    DataLoader loader;
    const int batch = 64;
    CHECK(loader_open(&loader, path, NULL, batch, 0, 1, 1, 42, 1, err, sizeof err) == 0);
    size_t n = (size_t)batch * layout.image_bytes;
    uint8_t *d_pixels;
    floatX *d_input, *input = (floatX *)malloc(n * sizeof(floatX));
    cuda_check(cudaMalloc((void **)&d_pixels, n));
    cuda_check(cudaMalloc((void **)&d_input, n * sizeof(floatX)));
    size_t mismatches = 0;
    for (int step = 0; step < 7; step++) {  // crosses an epoch end
        loader_next_batch(&loader);
        cuda_check(cudaMemset(d_input, 0xff, n * sizeof(floatX)));  // poison: NaN in fp32 and bf16
        cuda_check(cudaMemcpy(d_pixels, loader.batch_pixels, n, cudaMemcpyHostToDevice));
        images_to_model_input(d_input, d_pixels, n, 0);
        cuda_check(cudaMemcpy(input, d_input, n * sizeof(floatX), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++) {
            float expect = loader.batch_pixels[i] / 127.5 - 1.0, got = (float)input[i];
            float tolerance = sizeof(floatX) == 2 ? 4e-3f : 1e-7f;  // bf16 rounds to 8 bits of mantissa
            if (!(fabsf(got - expect) <= tolerance) || (float)pixel_to_model_input(loader.batch_pixels[i]) != got)
                mismatches++;
        }
    }
    CHECK(mismatches == 0);
    loader_close(&loader);
    cudaFree(d_pixels);
    cudaFree(d_input);
    free(input);
    unlink(path);
    return check_summary();
}
