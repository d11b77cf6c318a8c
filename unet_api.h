// unet_api.h: the small C API of train_unet.cu's library build (make builds it into
// build/unet_api.o): load a checkpoint, run the model forward, free. generate.c uses it.
#ifndef UNET_API_H
#define UNET_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct UnetModel UnetModel;

// What a checkpoint's metadata says about its model and diffusion.
typedef struct {
    int image_size, in_channels, out_channels;
    int num_classes;      // label_emb rows, 0: unconditional
    int null_class;       // the last row is the null class of classifier-free guidance (train_unet's
                          // checkpoints); guided-diffusion's own have none: every row is a class
    int diffusion_steps;
    char noise_schedule[16], predict[8];
    int64_t parameters;
} UnetInfo;

// Error messages start with this name ("train_unet" unless set).
void unet_set_program_name(const char *name);

// Reads the configuration of a checkpoint without a GPU. path: a checkpoint folder (its
// ema.safetensors, or model.safetensors with weights "model") or a .safetensors file. Returns 0,
// or -1 with a message; on success *file holds the safetensors path used (file_len bytes).
int unet_inspect(const char *path, const char *weights, UnetInfo *info, char *file, size_t file_len, char *err, size_t err_len);

// Loads the weights of a safetensors file (from unet_inspect) onto the GPU for batches of `batch`
// images; NULL with a message on error (a missing GPU, a mismatched file).
UnetModel *unet_load(const char *file, int batch, char *err, size_t err_len);

// The model's output for x [batch][H][W][in_channels] (NHWC, float), timesteps t [batch] and labels
// y [batch] (ignored when unconditional): out [batch][H][W][out_channels].
void unet_forward_nhwc(UnetModel *model, const float *x, const int64_t *t, const int *y, float *out);

void unet_free(UnetModel *model);

// --eval: runs the model of a safetensors file (from unet_inspect) on the inputs of in_path
// (x [N][C][H][W] float in PyTorch's NCHW layout, t [N] and, for a class-conditional model, y [N],
// integers) and writes its raw output to out_path (out [N][C_out][H][W] F32, NCHW). Every input is
// checked before the GPU is used. Returns 0, or -1 with a message.
int unet_eval(const char *file, const char *in_path, const char *out_path, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif  // UNET_API_H
