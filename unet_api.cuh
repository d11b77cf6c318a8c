// unet_api.cuh: the C API that unet_api.h declares, for generate.c and evaluate.c: a checkpoint's
// configuration, its model's forward, the GPU sampler and the likelihood. Built on the whole trainer,
// so train_unet.cu includes it just before main (one translation unit; generate and evaluate link
// train_unet.o).

// ----------------------------------------------------------------------------------------------
// The C API (unet_api.h) for generate.c: a checkpoint's configuration, and its model forward.

// A checkpoint's weights file, mapped once: every later read (the configuration, the GPU's copy of
// the weights) sees the same bytes, whatever happens to the file meanwhile (a trainer's --keep
// deleting it, a new save replacing it).
struct UnetCheckpoint {
    SafeTensorsFile f;
    char file[4096];  // its path, for messages
    ModelConfig config;
    DiffusionConfig diffusion;
};

struct UnetSampler {
    GpuSampler s;
};

#ifndef TRAIN_UNET_LIBRARY  // the programs' --version (build/version.o), which tests and dev/ checks do not link
extern "C" void unet_print_version(void) {
    char built_with[256];
    snprintf(built_with, sizeof built_with, "%s, GPU code %s, CUDA %d.%d", PRECISION_NAME, build_gpu_code,
             CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
    cli_print_version(program_name, built_with);
}
#endif

extern "C" void unet_die(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    exit_with_error(1, "", fmt, args);
}

extern "C" void unet_usage_error(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    exit_with_error(2, " (see --help)", fmt, args);
}

// Maps a checkpoint's weights file: path itself, or in a checkpoint folder its model or EMA file,
// opened through a handle of the folder. A folder that loses the file or its name meanwhile (a
// trainer pruning it) is said to have gone away. Returns 0, or -1 with a message.
static int map_checkpoint_file(const char *path, const char *weights, UnetCheckpoint *ck, char *err, size_t err_len) {
    int dir = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0 && errno != ENOTDIR) return error_line(err, err_len, "cannot open checkpoint %s: %s", path, strerror(errno));
    if (dir < 0) {
        snprintf(ck->file, sizeof ck->file, "%s", path);
        return safetensors_open(path, &ck->f, err, err_len);
    }
    const char *name = strcmp(weights, "model") == 0 ? "model.safetensors" : "ema.safetensors";
    snprintf(ck->file, sizeof ck->file, "%.4000s/%s", path, name);
    int r = safetensors_open_at(dir, name, ck->file, &ck->f, err, err_len);
    struct stat held, now;
    if (r != 0 && errno == ENOENT && fstat(dir, &held) == 0 && (stat(path, &now) != 0 || now.st_ino != held.st_ino || now.st_dev != held.st_dev))
        r = error_line(err, err_len, "checkpoint %s went away while it was opened (a trainer's --keep removed it?): choose "
                         "another step", path);
    close(dir);
    return r;
}

// guided-diffusion's --sigma_small VALUE on a diffusion: the small fixed variance or the large. Returns
// 0, or -1 for a bad value or a model that learns its variance (to which neither applies).
static int sigma_small_onto(DiffusionConfig *d, const char *value, const char *path, char *err, size_t err_len) {
    Options o = guided_diffusion_defaults();
    char why[256];
    if (option_from_string(&o, find_option("sigma_small", 11), value, why, sizeof why) != 0)
        return error_line(err, err_len, "--sigma_small %s: %s", value, why);
    if (d->variance == VARIANCE_LEARNED_RANGE)
        return error_line(err, err_len, "--sigma_small chooses a fixed variance: %s learns its own (learn_sigma)", path);
    d->variance = o.sigma_small ? VARIANCE_FIXED_SMALL : VARIANCE_FIXED_LARGE;
    return 0;
}

// unet_checkpoint_open (classifier_size 0: either model), and with classifier_size > 0
// unet_classifier_open: a noisy classifier of images of that size.
static UnetCheckpoint *checkpoint_open(const char *path, const char *weights, const char *const *flags, int num_flags,
                                       int classifier_size, UnetInfo *info, char *err, size_t err_len) {
    UnetCheckpoint *ck = (UnetCheckpoint *)calloc(1, sizeof *ck);
    if (!ck) fatal("out of host memory");
    if (map_checkpoint_file(path, weights, ck, err, err_len) != 0) return free(ck), (UnetCheckpoint *)NULL;
    memset(info, 0, sizeof *info);
    int r, described = ck->f.meta_count == 0;  // no metadata (a .pt): the model from its tensors and the flags
    const char *with_size[65];  // a classifier's: its image size is the diffusion model's
    char size_flag[32];
    snprintf(size_flag, sizeof size_flag, "image_size=%d", classifier_size);
    if (described && classifier_size && num_flags < 64) {
        with_size[0] = size_flag;
        for (int i = 0; i < num_flags; i++) with_size[i + 1] = flags[i];
        flags = with_size, num_flags++;
    }
    const char *model_flag = NULL, *sigma_small = NULL;  // sigma_small, a sampling choice, is taken over any metadata's
    for (int i = 0; i < num_flags; i++)
        if (strncmp(flags[i], "sigma_small=", 12) == 0) sigma_small = flags[i] + 12;
        else if (!model_flag) model_flag = flags[i];
    if (described)
        r = model_from_tensors_and_flags(&ck->f, ck->file, flags, num_flags, &ck->config, &ck->diffusion, info->model,
                                         sizeof info->model, err, err_len);
    else if (model_flag)
        r = error_line(err, err_len, "%s holds its model's configuration: --%.*s and the other model flags are for files without it (.pt)",
                       ck->file, (int)(strchr(model_flag, '=') ? strchr(model_flag, '=') - model_flag : 0), model_flag);
    else r = model_config_from_metadata(&ck->f, ck->file, &ck->config, err, err_len);
    if (r == 0 && !ck->config.pool && classifier_size)
        r = error_line(err, err_len, "%s is a diffusion model, not a noisy classifier (train one with train_unet --model classifier)",
                       ck->file);
    if (r == 0 && classifier_size && ck->config.image_size != classifier_size)
        r = error_line(err, err_len, "%s classifies %dx%d images; the diffusion model makes %dx%d", ck->file, ck->config.image_size,
                       ck->config.image_size, classifier_size, classifier_size);
    if (r == 0 && !described) r = diffusion_from_metadata(&ck->f, ck->file, &ck->config, &ck->diffusion, err, err_len);
    if (r == 0 && sigma_small) r = sigma_small_onto(&ck->diffusion, sigma_small, ck->file, err, err_len);
    if (r == 0) {
        ParamList params = model_parameters(&ck->config);
        r = read_tensors(&params, &ck->f, ck->file, 0, NULL, err, err_len);  // names, shapes, finite values
        info->parameters = params.numel;
        free(params.specs);
    }
    if (r != 0) {
        unet_checkpoint_close(ck);
        return NULL;
    }
    const ModelConfig *c = &ck->config;
    info->image_size = c->image_size, info->in_channels = c->in_channels, info->out_channels = c->out_channels;
    info->num_classes = c->pool ? c->out_channels : c->num_classes;
    info->small_size = c->low_res;
    snprintf(info->classifier_pool, sizeof info->classifier_pool, "%s", c->pool ? pool_names[c->pool] : "");
    const char *null_class = safetensors_metadata(&ck->f, "null_class");
    info->null_class = c->num_classes > 0 && null_class && strcmp(null_class, "True") == 0;
    info->diffusion = ck->diffusion;
    snprintf(info->file, sizeof info->file, "%s", ck->file);
    return ck;
}

extern "C" UnetCheckpoint *unet_checkpoint_open(const char *path, const char *weights, const char *const *flags, int num_flags,
                                                UnetInfo *info, char *err, size_t err_len) {
    return checkpoint_open(path, weights, flags, num_flags, 0, info, err, err_len);
}

extern "C" UnetCheckpoint *unet_classifier_open(const char *path, const char *const *flags, int num_flags, int image_size, UnetInfo *info,
                                                char *err, size_t err_len) {
    return checkpoint_open(path, "model", flags, num_flags, image_size, info, err, err_len);
}

extern "C" void unet_checkpoint_close(UnetCheckpoint *ck) {
    if (!ck) return;
    safetensors_close(&ck->f);
    free(ck);
}

// The model's output for x [batch][H][W][model_input_channels] (NHWC, float), timesteps t [batch] and labels
// y [batch] (ignored when unconditional): out [batch][H][W][out_channels].
static void forward_nhwc(UNet *m, const float *x, const int64_t *t, const int *y, float *out) {
    int64_t n_in = act_numel(&m->input), n_out = act_numel(m->output);
    floatX *staged = (floatX *)malloc_or_die((n_in > n_out ? n_in : n_out) * sizeof(floatX));
    for (int64_t i = 0; i < n_in; i++) staged[i] = (floatX)x[i];
    cuda_check(cudaMemcpy(m->input.x, staged, n_in * sizeof(floatX), cudaMemcpyHostToDevice));
    cuda_check(cudaMemcpy(m->timesteps, t, m->batch * sizeof(int64_t), cudaMemcpyHostToDevice));
    if (m->config.num_classes) cuda_check(cudaMemcpy(m->labels, y, m->batch * sizeof(int), cudaMemcpyHostToDevice));
    unet_forward(m, 0);
    cuda_check(cudaMemcpy(staged, m->output->x, n_out * sizeof(floatX), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n_out; i++) out[i] = (float)staged[i];
    free(staged);
}

extern "C" UnetSampler *unet_sampler_create(const UnetCheckpoint *ck, int batch, const SamplePlan *plan, const UnetGuidance *guidance,
                                            uint64_t seed, char *err, size_t err_len) {
    if (api_gpu_ready(err, err_len) != 0) return NULL;
    UnetSampler *u = (UnetSampler *)malloc_or_die(sizeof(UnetSampler));
    const UnetCheckpoint *classifier = guidance->classifier;
    gpu_sampler_create(&u->s, &ck->config, batch, plan, guidance->scale, classifier ? &classifier->config : NULL,
                       guidance->classifier_scale, seed);
    if (upload_tensors(&u->s.m, &ck->f, ck->file, u->s.m.master, 0, err, err_len) != 0 ||
        (classifier && upload_tensors(&u->s.classifier, &classifier->f, classifier->file, u->s.classifier.master, 0, err, err_len) != 0)) {
        unet_sampler_free(u);
        return NULL;
    }
    unet_sync_compute(&u->s.m);
    if (classifier) unet_sync_compute(&u->s.classifier);
    return u;
}

extern "C" float unet_sample(UnetSampler *u, int64_t first, int count, const int *labels, const uint8_t *low_res, uint8_t *pixels,
                             UnetProgress progress, void *ctx) {
    return gpu_sampler_run(&u->s, first, count, labels, low_res, pixels, progress, ctx);
}

extern "C" int unet_sampler_max_batch(const UnetCheckpoint *ck, const SamplePlan *plan, const UnetGuidance *guidance, int limit,
                                      char *err, size_t err_len) {
    if (api_gpu_ready(err, err_len) != 0) return 0;
    const ModelConfig *c = &ck->config, *classifier = guidance->classifier ? &guidance->classifier->config : NULL;
    size_t free_bytes, total_bytes;
    cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes));
    int guided = guidance->scale != 1.0f, pixels = c->image_size * c->image_size * (guided ? 2 : 1);
    int64_t budget = (int64_t)(free_bytes * 0.9);
    if (limit > INT32_MAX / pixels) limit = INT32_MAX / pixels;  // unet_plan counts pixels in 32 bits
    if (gpu_sampler_bytes(c, 1, plan->count, guided, classifier) > budget) {
        error_line(err, err_len, "%s: even one image needs %.2f GiB of GPU memory; %.2f GiB are free", ck->file,
                     gpu_sampler_bytes(c, 1, plan->count, guided, classifier) / 1073741824.0, free_bytes / 1073741824.0);
        return 0;
    }
    int lo = 1, hi = limit;  // lo fits; find the largest that does
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        if (gpu_sampler_bytes(c, mid, plan->count, guided, classifier) <= budget) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

extern "C" void unet_sampler_free(UnetSampler *u) {
    if (!u) return;
    gpu_sampler_destroy(&u->s);
    free(u);
}

extern "C" int unet_nll(const UnetCheckpoint *ck, const uint8_t *pixels, const int *labels, int count, int batch, const char *respacing,
                        uint64_t seed, double *bpd, double *prior, char *err, size_t err_len) {
    const ModelConfig *c = &ck->config;
    if (c->num_classes && !labels) return error_line(err, err_len, "%s is class-conditional: the images need labels", ck->file);
    NoiseSchedule d;
    SampleSchedule kept = {0, NULL, NULL};
    if (noise_schedule_make(&d, ck->diffusion.steps, ck->diffusion.schedule) != 0) fatal("unknown noise schedule '%s'", ck->diffusion.schedule);
    int made = respacing && respacing[0] ? sample_schedule_respaced(&d, respacing, &kept) : sample_schedule_make(&d, d.steps, &kept);
    noise_schedule_free(&d);
    if (made != 0) {
        sample_schedule_free(&kept);
        return error_line(err, err_len, "--respacing '%s' keeps no steps of the %d diffusion steps", respacing, ck->diffusion.steps);
    }
    if (api_gpu_ready(err, err_len) != 0) return sample_schedule_free(&kept), -1;
    Likelihood l;
    likelihood_create(&l, c, &ck->diffusion, batch, &kept);
    sample_schedule_free(&kept);
    if (upload_tensors(&l.m, &ck->f, ck->file, l.m.master, 0, err, err_len) != 0) return likelihood_destroy(&l), -1;
    unet_sync_compute(&l.m);
    int64_t per_image = act_numel(&l.m.input) / batch;
    uint8_t *d_pixels = (uint8_t *)gpu_malloc(batch * per_image);
    int *batch_labels = (int *)malloc_or_die(batch * sizeof(int));
    double *bits = (double *)malloc_or_die(batch * sizeof(double));
    for (int first = 0; first < count; first += batch) {
        int n = count - first < batch ? count - first : batch;  // the batch's other slots repeat its first image
        for (int b = 0; b < batch; b++) {
            int i = first + (b < n ? b : 0);
            cuda_check(cudaMemcpy(d_pixels + b * per_image, pixels + i * per_image, per_image, cudaMemcpyHostToDevice));
            batch_labels[b] = labels ? labels[i] : 0;
        }
        if (c->num_classes) cuda_check(cudaMemcpy(l.m.labels, batch_labels, batch * sizeof(int), cudaMemcpyHostToDevice));
        likelihood_run(&l, d_pixels, first, seed, bits);
        for (int b = 0; b < n; b++) {
            prior[first + b] = likelihood_prior(pixels + (first + b) * per_image, per_image, l.abar_last);
            bpd[first + b] = bits[b] + prior[first + b];
        }
    }
    cudaFree(d_pixels);
    free(batch_labels), free(bits);
    likelihood_destroy(&l);
    return 0;
}

extern "C" int unet_eval(const UnetCheckpoint *ck, const char *in_path, const char *out_path, char *err, size_t err_len) {
    const ModelConfig *c = &ck->config;
    SafeTensorsFile in;
    if (safetensors_open(in_path, &in, err, err_len) != 0) return -1;
    const SafeTensor *x = safetensors_find(&in, "x"), *t = safetensors_find(&in, "t"), *y = safetensors_find(&in, "y");
    const SafeTensor *low = safetensors_find(&in, "low_res");
    int S = c->image_size, s = c->low_res, N = x && x->ndim == 4 && x->shape[0] <= 65536 ? (int)x->shape[0] : 0, r = -1;
    if (!x || x->ndim != 4 || N < 1 || x->shape[1] != c->in_channels || x->shape[2] != S || x->shape[3] != S)
        error_line(err, err_len, "%s: x must be [N, %d, %d, %d] (NCHW) with N from 1 to 65536", in_path, c->in_channels, S, S);
    else if (!t || t->numel != N)
        error_line(err, err_len, "%s: t must hold N = %d timesteps", in_path, N);
    else if (c->num_classes && (!y || y->numel != N))
        error_line(err, err_len, "%s: the model is class-conditional: y must hold N = %d labels", in_path, N);
    else if (s && (!low || low->ndim != 4 || low->shape[0] != N || low->shape[1] != c->in_channels || low->shape[2] != s || low->shape[3] != s))
        error_line(err, err_len, "%s: the model is an upsampler: low_res must be [%d, %d, %d, %d] (NCHW)", in_path, N, c->in_channels, s, s);
    else r = 0;
    // Sizes only from here on, once the shapes are known to be sane.
    int64_t *steps = (int64_t *)malloc_or_die(N * sizeof(int64_t)), *labels64 = (int64_t *)malloc_or_die(N * sizeof(int64_t));
    if (r == 0 && (safetensors_get_int64(t, steps) != 0 || (c->num_classes && safetensors_get_int64(y, labels64) != 0)))
        r = error_line(err, err_len, "%s: t and y must be integers (I64 or I32)", in_path);
    for (int n = 0; r == 0 && n < N; n++) {
        if (steps[n] < 0 || steps[n] >= ck->diffusion.steps)
            r = error_line(err, err_len, "%s: t[%d] = %lld is outside 0..%d", in_path, n, (long long)steps[n], ck->diffusion.steps - 1);
        else if (c->num_classes && (labels64[n] < 0 || labels64[n] >= c->num_classes))
            r = error_line(err, err_len, "%s: y[%d] = %lld is outside 0..%d", in_path, n, (long long)labels64[n], c->num_classes - 1);
    }
    float *x_nchw = r == 0 ? (float *)malloc_or_die(x->numel * sizeof(float)) : NULL;
    float *low_nchw = r == 0 && s ? (float *)malloc_or_die(low->numel * sizeof(float)) : NULL;
    int got = r == 0 ? safetensors_get_float(x, x_nchw) : 0;
    if (got) r = error_line(err, err_len, got == -2 ? "%s: x holds NaN or infinite values" : "%s: x must be floating point", in_path);
    got = r == 0 && s ? safetensors_get_float(low, low_nchw) : 0;
    if (got) r = error_line(err, err_len, got == -2 ? "%s: low_res holds NaN or infinite values" : "%s: low_res must be floating point", in_path);
    UNet m;
    if (r == 0 && api_gpu_ready(err, err_len) != 0) r = -1;
    if (r == 0) {
        unet_create(&m, c, N, 0);
        r = upload_tensors(&m, &ck->f, ck->file, m.master, 0, err, err_len);
        if (r != 0) unet_destroy(&m);
        else unet_sync_compute(&m);
    }
    if (r == 0) {
        // a classifier's out: [N, classes]; an upsampler's input: x, then the upsampled low_res (unet_forward's)
        int C = c->in_channels, Ci = model_input_channels(c), Co = c->out_channels, HW = S * S, HWo = c->pool ? 1 : HW;
        float *x_nhwc = (float *)calloc((size_t)N * Ci * HW, sizeof(float)), *out = (float *)malloc_or_die((size_t)N * Co * HWo * sizeof(float));
        float *out_nchw = (float *)malloc_or_die((size_t)N * Co * HWo * sizeof(float));
        int *labels = (int *)calloc(N, sizeof(int));
        if (!x_nhwc || !labels) fatal("out of host memory");
        for (int n = 0; n < N; n++) labels[n] = (int)labels64[n];
        for (size_t i = 0; i < (size_t)N * C * HW; i++)  // i walks NCHW
            x_nhwc[(i / (C * HW) * HW + i % HW) * Ci + i / HW % C] = x_nchw[i];
        if (s) {
            size_t n_low = (size_t)N * C * s * s;
            floatX *low_nhwc = (floatX *)malloc_or_die(n_low * sizeof(floatX));
            for (size_t i = 0; i < n_low; i++) low_nhwc[(i / (C * s * s) * s * s + i % (s * s)) * C + i / (s * s) % C] = (floatX)low_nchw[i];
            cuda_check(cudaMemcpy(m.low_res.x, low_nhwc, n_low * sizeof(floatX), cudaMemcpyHostToDevice));
            free(low_nhwc);
        }
        forward_nhwc(&m, x_nhwc, steps, labels, out);
        for (size_t i = 0; i < (size_t)N * Co * HWo; i++)
            out_nchw[i] = out[(i / (Co * HWo) * HWo + i % HWo) * Co + i / HWo % Co];
        int shape[4] = {N, Co, S, S};
        SafeTensorOut tensor = {"out", c->pool ? 2 : 4, shape, (int64_t)N * Co * HWo, out_nchw};
        Metadata meta;
        memset(&meta, 0, sizeof meta);
        meta_add(&meta, "checkpoint", "%s", ck->file);
        char tmp[4200];  // written whole under a temporary name, then renamed: never a partial file
        snprintf(tmp, sizeof tmp, "%.4000s.tmp.%d", out_path, (int)getpid());
        if (safetensors_write(tmp, &tensor, 1, meta.entries, meta.count) != 0 || rename(tmp, out_path) != 0) {
            r = error_line(err, err_len, "cannot write %s: %s", out_path, strerror(errno));
            unlink(tmp);
        }
        metadata_free(&meta);
        free(x_nhwc), free(out), free(out_nchw), free(labels);
        unet_destroy(&m);
    }
    free(steps), free(labels64), free(x_nchw), free(low_nchw);
    safetensors_close(&in);
    return r;
}
