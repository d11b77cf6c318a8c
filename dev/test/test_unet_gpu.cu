// test_unet_gpu.cu: the trainer's whole model on the GPU against the PyTorch fixtures
// (scripts/make_fixtures.py): output, loss, every parameter's gradient and the input's gradient.
//   test_unet_gpu [FIXTURE.safetensors ...]     (default: dev/fixtures/*.safetensors)
// Tolerance, relative (|a - b| / |b| per tensor): FP32 build 1e-5. BF16 build: 2e-2 for the output
// and loss, 8e-2 for gradients: on these small random-weight fixtures PyTorch's own bf16 autocast
// lands 1.0-1.6e-2 from the output and up to 6.8e-2 from a gradient (scripts/bf16_error.py, H200),
// and this build lands no further (dev/NOTES.md). A gradient that is zero in exact
// arithmetic (the fixtures hold rounding noise there: at 32 channels the timestep embedding has no
// effect without scale-shift) is measured against 1e-2 of the largest gradient norm of the fixture
// instead of its own norm. A classifier's fixture (metadata classifier_pool: EncoderUNetModel) is
// checked the same way, its output and target the logits [N, classes]; an upsampler's (metadata
// small_size: SuperResModel) takes its low_res too, and its input gradient is x's channels'.
#include <glob.h>

#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

static const double TOLERANCE = sizeof(floatX) == 4 ? 1e-5 : 2e-2, TOLERANCE_GRAD = sizeof(floatX) == 4 ? 1e-5 : 8e-2;

static double norm2(const float *a, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * a[i];
    return sqrt(s);
}

static double diff2(const float *a, const float *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        s += d * d;
    }
    return isfinite(s) ? sqrt(s) : INFINITY;
}

static float *tensor_floats(const SafeTensorsFile *f, const char *name, int64_t expect) {
    const SafeTensor *t = safetensors_find(f, name);
    if (!t) fatal("fixture has no tensor %s", name);
    if (expect >= 0 && t->numel != expect) fatal("fixture tensor %s has %lld values, expected %lld", name, (long long)t->numel, (long long)expect);
    float *out = (float *)malloc_or_die(t->numel * sizeof(float));
    if (safetensors_get_float(t, out) != 0) fatal("fixture tensor %s is not floating point", name);
    return out;
}

// NCHW (PyTorch) <-> NHWC (ours), as floats.
static void nchw_to_nhwc(float *dst, const float *src, int N, int C, int H, int W) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            for (int p = 0; p < H * W; p++) dst[((int64_t)n * H * W + p) * C + c] = src[((int64_t)n * C + c) * H * W + p];
}

static void nhwc_to_nchw(float *dst, const float *src, int N, int C, int H, int W) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            for (int p = 0; p < H * W; p++) dst[((int64_t)n * C + c) * H * W + p] = src[((int64_t)n * H * W + p) * C + c];
}

static void upload_act(floatX *dst, const float *nchw, int N, int C, int H, int W) {
    int64_t n = (int64_t)N * C * H * W;
    float *nhwc = (float *)malloc_or_die(n * sizeof(float));
    floatX *x = (floatX *)malloc_or_die(n * sizeof(floatX));
    nchw_to_nhwc(nhwc, nchw, N, C, H, W);
    for (int64_t i = 0; i < n; i++) x[i] = (floatX)nhwc[i];
    cuda_check(cudaMemcpy(dst, x, n * sizeof(floatX), cudaMemcpyHostToDevice));
    free(nhwc);
    free(x);
}

static float *download_act(const floatX *src, int N, int C, int H, int W) {
    int64_t n = (int64_t)N * C * H * W;
    floatX *x = (floatX *)malloc_or_die(n * sizeof(floatX));
    float *nhwc = (float *)malloc_or_die(n * sizeof(float)), *nchw = (float *)malloc_or_die(n * sizeof(float));
    cuda_check(cudaMemcpy(x, src, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; i++) nhwc[i] = (float)x[i];
    nhwc_to_nchw(nchw, nhwc, N, C, H, W);
    free(x);
    free(nhwc);
    return nchw;
}

static void test_fixture(const char *path) {
    SafeTensorsFile f;
    char err[512];
    if (safetensors_open(path, &f, err, sizeof err) != 0) fatal("%s", err);
    ModelConfig c;
    if (model_config_from_metadata(&f, path, &c, err, sizeof err) != 0) fatal("%s", err);
    const SafeTensor *xt = safetensors_find(&f, "x");
    if (!xt) fatal("%s: no input x", path);
    int N = (int)xt->shape[0], S = c.image_size, So = c.pool ? 1 : S;  // So: the output's side (a classifier's: 1)
    if (c.pool == POOL_SPATIAL_V2 && !group_norm_fits(SPATIAL_HIDDEN)) {  // (this build's GroupNorm takes fewer channels)
        printf("skip %s: its GroupNorm over %d channels is beyond the %s build's kernels\n", path, SPATIAL_HIDDEN, PRECISION_NAME);
        safetensors_close(&f);
        return;
    }
    UNet m;
    unet_create(&m, &c, N, 1);

    char name[256];
    snprintf(name, sizeof name, "%s: parameter names and shapes equal guided-diffusion's", path);
    check_case(strdup(name));
    float **values = (float **)malloc_or_die(m.params.count * sizeof(float *));
    int fixture_params = 0;
    for (int i = 0; i < f.count; i++) fixture_params += strcmp(f.tensors[i].name, "x") && strcmp(f.tensors[i].name, "t") &&
        strcmp(f.tensors[i].name, "y") && strcmp(f.tensors[i].name, "target") && strcmp(f.tensors[i].name, "out") &&
        strcmp(f.tensors[i].name, "low_res") &&
        strcmp(f.tensors[i].name, "loss") && strncmp(f.tensors[i].name, "grad.", 5);
    CHECK(fixture_params == m.params.count);
    for (int i = 0; i < m.params.count; i++) {
        const ParamSpec *p = &m.params.specs[i];
        const SafeTensor *t = safetensors_find(&f, p->name);
        int same = t && t->ndim == p->ndim;
        for (int d = 0; same && d < p->ndim; d++) same = t->shape[d] == p->shape[d];
        if (!same) printf("  %s: missing or of another shape\n", p->name);
        CHECK(same);
        values[i] = tensor_floats(&f, p->name, p->numel);
    }
    unet_set_parameters(&m, values);

    // An upsampler's input has x's channels, then the low-resolution image's (upsampled by
    // unet_forward): x goes into the first, zeros into the others (NCHW: per sample, C then C planes).
    int C = c.in_channels, Ci = model_input_channels(&c);
    int64_t plane = (int64_t)S * S, n_x = (int64_t)N * C * plane;
    float *x = tensor_floats(&f, "x", n_x), *x_in = (float *)calloc((size_t)N * Ci * plane, sizeof(float));
    float *target = tensor_floats(&f, "target", (int64_t)N * c.out_channels * So * So);
    for (int64_t i = 0; i < n_x; i++) x_in[i / (C * plane) * Ci * plane + i % (C * plane)] = x[i];
    upload_act(m.input.x, x_in, N, Ci, S, S);
    if (c.low_res) {
        float *low = tensor_floats(&f, "low_res", (int64_t)N * C * c.low_res * c.low_res);
        upload_act(m.low_res.x, low, N, C, c.low_res, c.low_res);
        free(low);
    }
    upload_act(m.target.x, target, N, c.out_channels, So, So);
    int64_t t[64], y[64];
    int labels[64];
    if (N > 64) fatal("fixture batch %d is larger than this test's 64", N);
    if (safetensors_get_int64(safetensors_find(&f, "t"), t) != 0) fatal("%s: bad t", path);
    cuda_check(cudaMemcpy(m.timesteps, t, N * sizeof(int64_t), cudaMemcpyHostToDevice));
    if (c.num_classes) {
        if (safetensors_get_int64(safetensors_find(&f, "y"), y) != 0) fatal("%s: bad y", path);
        for (int n = 0; n < N; n++) labels[n] = (int)y[n];
        cuda_check(cudaMemcpy(m.labels, labels, N * sizeof(int), cudaMemcpyHostToDevice));
    }

    unet_forward(&m, 1);
    int64_t count = act_numel(m.output);
    // the MSE over every output channel (the fixture's loss), every sample weighted 1
    LossOutputs loss_out = loss_outputs_create(N, So * So);
    LossInputs no_inputs = {NULL, NULL, NULL, NULL, 0, NULL};
    LossKind mse_only = {0, 1, 0, PREDICT_EPS, 1.0f};
    training_loss(&loss_out, m.output->dx, m.output->x, m.target.x, &no_inputs, N, So * So, c.out_channels, mse_only);
    unet_backward(&m, 1, NULL, NULL);
    cuda_check(cudaDeviceSynchronize());

    snprintf(name, sizeof name, "%s: output and loss", path);
    check_case(strdup(name));
    float *out = download_act(m.output->x, N, c.out_channels, So, So), *ref = tensor_floats(&f, "out", count), loss, ref_loss;
    double out_err = diff2(out, ref, count) / norm2(ref, count);
    cuda_check(cudaMemcpy(&loss, loss_out.terms, sizeof loss, cudaMemcpyDeviceToHost));
    float *ref_loss_p = tensor_floats(&f, "loss", 1);
    ref_loss = *ref_loss_p;
    double loss_err = fabs((double)loss - ref_loss) / fabs(ref_loss);
    printf("  output %.2e, loss %.2e (%g vs %g)\n", out_err, loss_err, loss, ref_loss);
    CHECK(out_err <= TOLERANCE);
    CHECK(loss_err <= TOLERANCE);

    snprintf(name, sizeof name, "%s: every parameter gradient and the input gradient", path);
    check_case(strdup(name));
    double largest = 0, worst = 0;
    const char *worst_name = "";
    float **ref_grads = (float **)malloc_or_die(m.params.count * sizeof(float *));
    for (int i = 0; i < m.params.count; i++) {
        snprintf(name, sizeof name, "grad.%s", m.params.specs[i].name);
        ref_grads[i] = tensor_floats(&f, name, m.params.specs[i].numel);
        largest = fmax(largest, norm2(ref_grads[i], m.params.specs[i].numel));
    }
    for (int i = 0; i < m.params.count; i++) {
        const ParamSpec *p = &m.params.specs[i];
        float *g = (float *)malloc_or_die(p->numel * sizeof(float));
        unet_get_parameter(&m, i, 1, g);
        double e = diff2(g, ref_grads[i], p->numel) / fmax(norm2(ref_grads[i], p->numel), 1e-2 * largest);
        if (!(e <= worst)) worst = e, worst_name = p->name;
        if (!(e <= TOLERANCE_GRAD)) printf("  grad.%s: relative error %.2e\n", p->name, e);
        free(g);
        free(ref_grads[i]);
    }
    float *dx_in = download_act(m.input.dx, N, Ci, S, S), *dx = (float *)malloc_or_die(n_x * sizeof(float));
    float *ref_dx = tensor_floats(&f, "grad.x", n_x);
    for (int64_t i = 0; i < n_x; i++) dx[i] = dx_in[i / (C * plane) * Ci * plane + i % (C * plane)];  // x's channels
    double dx_err = diff2(dx, ref_dx, n_x) / norm2(ref_dx, n_x);
    printf("  worst parameter gradient %.2e (%s), input gradient %.2e\n", worst, worst_name, dx_err);
    CHECK(worst <= TOLERANCE_GRAD);
    CHECK(dx_err <= TOLERANCE_GRAD);
    for (int i = 0; i < m.params.count; i++) free(values[i]);
    free(values), free(ref_grads), free(x), free(x_in), free(target), free(out), free(ref), free(ref_loss_p), free(dx), free(dx_in),
        free(ref_dx);
    safetensors_close(&f);
}

int main(int argc, char **argv) {
    gpu_init(0);
    printf("precision %s, tolerance %g (output), %g (gradients)\n", PRECISION_NAME, TOLERANCE, TOLERANCE_GRAD);
    if (argc > 1) {
        for (int i = 1; i < argc; i++) test_fixture(argv[i]);
    } else {
        glob_t g;
        if (glob("dev/fixtures/*.safetensors", 0, NULL, &g) != 0) fatal("no fixtures in dev/fixtures (run from the repository root)");
        for (size_t i = 0; i < g.gl_pathc; i++) test_fixture(g.gl_pathv[i]);
        globfree(&g);
    }
    return check_summary();
}
