// test_sampler_gpu.cu: the GPU sampling loop (train_unet.cu's GpuSampler: one step captured as a
// CUDA graph and replayed, the step index on the GPU, guidance at twice the batch) against
// sampler.h's host loop driving the same model one forward pass at a time, with the same draws.
// Every sampler (DDPM on a 100-step schedule, DDIM with eta 0 and 1, DPM-Solver++), eps and v
// prediction, with and without classifier-free guidance, on a small class-conditional model with
// random weights everywhere (zero-initialised layers too); and DDPM with a learned variance
// (learn_sigma: the output's second half), respaced. Classifier guidance (a noisy classifier's
// input gradient by its backward pass without parameter gradients, inside the step's graph) against
// the host loop's score from the classifier's training model (parameter gradients and all) and a
// host softmax, on a class-conditional and an unconditional model, with DDPM, DDIM and
// DPM-Solver++, with and without classifier-free guidance; an EDM model's (its input scaled, its
// continuous time) with Heun and DPM-Solver++; an upsampler's plans (its low-resolution
// images in every step's input); and one classifier-guided step against
// guided-diffusion's cond_fn with p_sample and with ddim_sample in float64 PyTorch
// (scripts/make_guidance_fixture.py, on the committed fixtures' models: FP32 1e-5). The likelihood's GPU loop (generate --nll)
// against the same host model and train_unet.cu's bound_term, value by value. Tolerance on the final x: FP32 1e-4
// relative (the host's cosf against the GPU's cospif, and other product shapes); BF16 2e-2.
// Sampling the same batch again gives the same pixels, bit for bit, and a batch's forward pass
// equals each image's own.
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

// Unguided; a guided output (1 - w) eps_u + w eps_c carries the rounding of both halves, weighted
// |1 - w| + |w|, so the tolerance grows by that factor (5 at guidance 3).
static const double TOLERANCE = sizeof(floatX) == 4 ? 1e-4 : 2e-2;
enum { IMAGES = 3, CLASSES = 3, FIRST = 5 };  // the batch samples images FIRST .. FIRST + IMAGES - 1

// The host loop's model: forward passes of m (batch IMAGES), guided like the GPU's.
typedef struct {
    UNet *m;
    UNet *classifier;  // classifier guidance (NULL: none): a training model of the classifier
    float classifier_scale;
    int guided;
    float guidance;
    int labels[IMAGES], null_labels[IMAGES];
    int64_t t[IMAGES];
    int64_t offset;
    uint64_t seed;
    float *raw;  // the model's output, [IMAGES][H][W][out channels]
    float *wide; // an upsampler's input [IMAGES][H][W][2C]: x, then room for the low-resolution image (its forward pass's)
    int learned; // the plan samples with the learned variance: out holds it too
    float *scaled; // an EDM model's input, x times the step's input_scale (NULL: not an EDM model)
} Host;

// Classifier guidance's score g = s d log p(y | x) / dx of the classifier c (a training model: it
// computes the parameters' gradients too) on x at timesteps t: its forward pass, the logits'
// gradient s (onehot(y) - softmax(z)) computed here in double, and its backward pass.
static void host_score(UNet *c, const float *x, const int64_t *t, const int *y, float s, float *g) {
    int K = c->output->C;
    int64_t n = act_numel(&c->input);
    float *logits = (float *)malloc_or_die(IMAGES * K * sizeof(float));
    forward_nhwc(c, x, t, y, logits);
    floatX *staged = (floatX *)malloc_or_die((n > IMAGES * K ? n : IMAGES * K) * sizeof(floatX));
    for (int b = 0; b < IMAGES; b++) {
        double top = -INFINITY, sum = 0;
        for (int k = 0; k < K; k++) top = fmax(top, logits[b * K + k]);
        for (int k = 0; k < K; k++) sum += exp(logits[b * K + k] - top);
        for (int k = 0; k < K; k++) staged[b * K + k] = (floatX)(s * ((k == y[b]) - exp(logits[b * K + k] - top) / sum));
    }
    cuda_check(cudaMemcpy(c->output->dx, staged, IMAGES * K * sizeof(floatX), cudaMemcpyHostToDevice));
    unet_backward(c, 0, NULL, NULL);
    cuda_check(cudaMemcpy(staged, c->input.dx, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; i++) g[i] = (float)staged[i];
    free(logits), free(staged);
}

// sample_loop's model: the prediction (guided), and with a learned variance the conditional
// output's variance half after it, and with a classifier its score after them. An EDM model sees
// x times the step's input_scale at the step's continuous time.
static void host_model(void *ctx, const float *x, const SampleStep *st, float *out) {
    Host *h = (Host *)ctx;
    int t = st->timestep;
    int64_t n = image_values(h->m);
    int C = h->m->config.in_channels, Co = h->m->output->C;
    for (int b = 0; b < IMAGES; b++) h->t[b] = t;
    if (h->scaled) {
        float time[IMAGES];
        for (int b = 0; b < IMAGES; b++) time[b] = st->time;
        cuda_check(cudaMemcpy(h->m->time, time, sizeof time, cudaMemcpyHostToDevice));
        for (int64_t i = 0; i < n; i++) h->scaled[i] = x[i] * st->input_scale;
        x = h->scaled;
    }
    if (h->wide) {
        for (int64_t i = 0; i < n; i++) h->wide[i / C * 2 * C + i % C] = x[i];
        x = h->wide;
    }
    forward_nhwc(h->m, x, h->t, h->labels, h->raw);
    for (int64_t i = 0; i < n; i++) {
        out[i] = h->raw[i / C * Co + i % C];
        if (h->learned) out[n + i] = h->raw[i / C * Co + C + i % C];
    }
    if (h->guided) {
        forward_nhwc(h->m, x, h->t, h->null_labels, h->raw);
        for (int64_t i = 0; i < n; i++) out[i] = guided_output(out[i], h->raw[i / C * Co + i % C], h->guidance);
    }
    if (h->classifier) host_score(h->classifier, x, h->t, h->labels, h->classifier_scale, out + (h->learned ? 2 : 1) * n);
}

static float host_noise(void *ctx, int j, size_t i) {
    Host *h = (Host *)ctx;
    return normal_sample(h->seed, rng_stream(RNG_SAMPLE_NOISE, (uint64_t)j), h->offset + i);
}

// Random parameters of roughly PyTorch's scale, the zero-initialised layers too.
static void random_parameters(UNet *m, uint64_t seed) {
    float *host = (float *)calloc(m->storage, sizeof(float));
    for (int i = 0; i < m->params.count; i++) {
        const ParamSpec *p = &m->params.specs[i];
        int norm_weight = p->ndim == 1 && (strstr(p->name, "layers.0.") || strstr(p->name, ".norm.") || strncmp(p->name, "out.0.", 6) == 0) &&
                          ends_with(p->name, "weight");
        double bound = p->ndim >= 2 ? 1.5 / sqrt((double)(p->numel / p->shape[0])) : 0.1;
        if (strncmp(p->name, "label_emb.", 10) == 0) bound = 1.0;
        float *values = (float *)malloc_or_die(p->numel * sizeof(float));
        for (int64_t j = 0; j < p->numel; j++) values[j] = (float)((2 * uniform01(seed, i, j) - 1) * bound + norm_weight);
        param_layout(p, values, host + p->offset, 1);
        free(values);
    }
    cuda_check(cudaMemcpy(m->master, host, m->storage * sizeof(float), cudaMemcpyHostToDevice));
    unet_sync_compute(m);
    free(host);
}

// A progress callback's record: the steps it heard of, in order.
typedef struct {
    int calls, last, in_order, steps;
} ProgressLog;

static void log_progress(void *ctx, int step, int steps) {
    ProgressLog *p = (ProgressLog *)ctx;
    p->in_order = p->in_order && step == p->last + 1 && steps == p->steps;
    p->calls++, p->last = step;
}

// The GPU loop against the host loop on one plan. classifier (NULL: none): classifier guidance with
// scale classifier_scale by that classifier's training model (its weights are copied to the sampler's).
// karras: the steps on the schedule's own Karras levels (sample_plan_karras), from scaled noise;
// 2: with Heun's churn (EDM's ImageNet S_churn 40 on every level); 3: the model as an EDM model
// (precond edm, sigma_data 0.5) on EDM's levels.
static void test_plan(const char *name, const ModelConfig *c, UNet *weights, SamplerKind kind, int steps, float eta,
                      int predict_v, float guidance, UNet *classifier = NULL, float classifier_scale = 0.0f, int karras = 0) {
    check_case(name);
    NoiseSchedule d;
    SamplePlan plan;
    CHECK(noise_schedule_make(&d, 100, "linear") == 0);
    VarianceType variance = c->learn_sigma ? VARIANCE_LEARNED_RANGE : VARIANCE_FIXED_LARGE;
    KarrasLevels levels = {0, 0, 7, karras == 2 ? 40.0 : 0.0, 0, INFINITY, 1.003, karras == 3 ? 0.5 : 0.0};
    CHECK(karras ? sample_plan_karras(&plan, &d, kind, steps, levels, eta, karras == 3 ? PREDICT_EDM : predict_v ? PREDICT_V : PREDICT_EPS,
                                      1) == 0
                 : sample_plan_make(&plan, &d, kind, steps, NULL, eta, predict_v ? PREDICT_V : PREDICT_EPS, 1, variance) == 0);
    uint64_t seed = 1234;
    int S = c->image_size;
    int64_t per_image = (int64_t)S * S * c->in_channels, n = IMAGES * per_image;
    int labels[IMAGES] = {2, 0, 1};

    GpuSampler s;
    gpu_sampler_create(&s, c, IMAGES, &plan, guidance, classifier ? &classifier->config : NULL, classifier_scale, seed);
    cuda_check(cudaMemcpy(s.m.master, weights->master, weights->storage * sizeof(float), cudaMemcpyDeviceToDevice));
    unet_sync_compute(&s.m);
    if (classifier) {
        cuda_check(cudaMemcpy(s.classifier.master, classifier->master, classifier->storage * sizeof(float), cudaMemcpyDeviceToDevice));
        unet_sync_compute(&s.classifier);
        CHECK(!s.classifier.grad && !s.classifier.adam_m);  // the sampler's classifier keeps no parameter gradients
    }
    uint8_t *pixels = (uint8_t *)malloc_or_die(n), *again = (uint8_t *)malloc_or_die(n);
    // An upsampler's low-resolution images: random pixels, the same on the GPU and in the host's model.
    uint8_t *low = NULL;
    int s_low = c->low_res;
    if (s_low) {
        size_t n_low = (size_t)IMAGES * s_low * s_low * c->in_channels;
        low = (uint8_t *)malloc_or_die(n_low);
        floatX *staged = (floatX *)malloc_or_die(n_low * sizeof(floatX));
        for (size_t i = 0; i < n_low; i++) low[i] = (uint8_t)(random_u64(31, 0, i) >> 56), staged[i] = (floatX)pixel_value(low[i]);
        cuda_check(cudaMemcpy(weights->low_res.x, staged, n_low * sizeof(floatX), cudaMemcpyHostToDevice));
        free(staged);
    }
    float ms = gpu_sampler_run(&s, FIRST, IMAGES, labels, low, pixels, NULL, NULL);
    float *gpu_x = (float *)malloc_or_die(n * sizeof(float));
    cuda_check(cudaMemcpy(gpu_x, s.x, n * sizeof(float), cudaMemcpyDeviceToHost));
    ProgressLog log = {0, 0, 1, plan.count};  // the same images, with every step reported once, in order
    gpu_sampler_run(&s, FIRST, IMAGES, labels, low, again, log_progress, &log);
    CHECK(memcmp(pixels, again, n) == 0);
    CHECK(log.in_order && log.calls == plan.count);

    Host h;
    memset(&h, 0, sizeof h);
    h.m = weights, h.guided = guidance != 1.0f, h.guidance = guidance, h.offset = FIRST * per_image, h.seed = seed;
    h.classifier = classifier, h.classifier_scale = classifier_scale;
    for (int b = 0; b < IMAGES; b++) h.labels[b] = labels[b], h.null_labels[b] = CLASSES;
    h.raw = (float *)malloc_or_die(act_numel(weights->output) * sizeof(float));
    h.learned = plan.learned;
    h.wide = s_low ? (float *)calloc((size_t)2 * n, sizeof(float)) : NULL;
    h.scaled = karras == 3 ? (float *)malloc_or_die(n * sizeof(float)) : NULL;
    weights->continuous_time = karras == 3;
    float *x = (float *)malloc_or_die(n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = normal_sample(seed, rng_stream(RNG_SAMPLE_START, 0), h.offset + i);
    CHECK(sample_loop(&plan, host_model, classifier != NULL, host_noise, &h, x, n) == 0);

    double diff = 0, norm = 0;
    int pixel_gap = 0;
    for (int64_t i = 0; i < n; i++) {
        diff += (double)(gpu_x[i] - x[i]) * (gpu_x[i] - x[i]), norm += (double)x[i] * x[i];
        int want = pixel_from_value(gpu_x[i]);
        pixel_gap = abs(want - pixels[i]) > pixel_gap ? abs(want - pixels[i]) : pixel_gap;
    }
    double err = sqrt(diff / norm);
    printf("  %d steps, GPU against the host loop %.2e, x's RMS %.3f, %.2f ms\n", plan.count, err, sqrt(norm / n), ms);
    if (classifier) {  // the score moves the samples far more than the two loops differ: the check sees it
        float *plain = (float *)malloc_or_die(n * sizeof(float));
        for (int64_t i = 0; i < n; i++) plain[i] = normal_sample(seed, rng_stream(RNG_SAMPLE_START, 0), h.offset + i);
        h.classifier = NULL;
        CHECK(sample_loop(&plan, host_model, 0, host_noise, &h, plain, n) == 0);
        double moved = 0;
        for (int64_t i = 0; i < n; i++) moved += (double)(plain[i] - x[i]) * (plain[i] - x[i]);
        moved = sqrt(moved / norm);
        printf("  classifier guidance moves the samples by %.2e of their norm\n", moved);
        CHECK(moved > (sizeof(floatX) == 4 ? 10 : 3) * err && moved > 1e-2);  // (BF16's own rounding is near 1e-2)
        free(plain);
    }
    CHECK(err <= TOLERANCE * (fabs(1.0 - guidance) + fabs(guidance)));
    CHECK(pixel_gap <= 1);  // the pixels are the samples, rounded (the host's lrintf may round a tie otherwise)
    CHECK(sqrt(norm / n) > 0.05);  // the samples are not all zero
    gpu_sampler_destroy(&s);
    weights->continuous_time = 0;
    free(pixels), free(again), free(gpu_x), free(x), free(h.raw), free(h.wide), free(h.scaled), free(low);
    sample_plan_free(&plan);
    noise_schedule_free(&d);
}

// A forward pass over the batch equals the forward pass of each image alone: no image's output
// depends on another's (the convolutions' tiles span images; the norms' sums must not).
static void test_batch_independence(const ModelConfig *c, UNet *batch_model) {
    check_case("a forward pass over the batch equals each image's own");
    UNet one;
    unet_create(&one, c, 1, 0);
    cuda_check(cudaMemcpy(one.master, batch_model->master, batch_model->storage * sizeof(float), cudaMemcpyDeviceToDevice));
    unet_sync_compute(&one);
    int64_t per_in = act_numel(&one.input), per_out = act_numel(one.output);
    float *x = (float *)malloc_or_die(IMAGES * per_in * sizeof(float)), *out = (float *)malloc_or_die(IMAGES * per_out * sizeof(float));
    float *alone = (float *)malloc_or_die(per_out * sizeof(float));
    int64_t t[IMAGES] = {999, 500, 3};
    int y[IMAGES] = {1, 3, 0};
    for (int64_t i = 0; i < IMAGES * per_in; i++) x[i] = normal_sample(5, 1, i);
    forward_nhwc(batch_model, x, t, y, out);
    double worst = 0;
    for (int b = 0; b < IMAGES; b++) {
        forward_nhwc(&one, x + b * per_in, t + b, y + b, alone);
        double diff = 0, norm = 0;
        for (int64_t i = 0; i < per_out; i++) diff += pow(out[b * per_out + i] - alone[i], 2), norm += pow(alone[i], 2);
        worst = fmax(worst, sqrt(diff / norm));
    }
    printf("  worst relative difference %.2e\n", worst);
    CHECK(worst <= (sizeof(floatX) == 4 ? 1e-5 : 1e-2));
    unet_destroy(&one);
    free(x), free(out), free(alone);
}

// The likelihood of IMAGES random images on the steps `spec` keeps: the GPU loop (likelihood_run)
// against the host's, which noises each image as the GPU does, runs the model one forward pass a
// step and sums bound_term over the values in double.
static void test_likelihood(const char *name, const ModelConfig *c, UNet *weights, const char *spec, int predict) {
    check_case(name);
    NoiseSchedule d;
    SampleSchedule kept = {0, NULL, NULL};
    CHECK(noise_schedule_make(&d, 100, "cosine") == 0 && sample_schedule_respaced(&d, spec, &kept) == 0);
    Likelihood l;
    DiffusionConfig diffusion = {100, "cosine", (Prediction)predict, c->learn_sigma ? VARIANCE_LEARNED_RANGE : VARIANCE_FIXED_LARGE,
                                 LOSS_MSE, 1.0f, TIMESTEPS_UNIFORM};
    likelihood_create(&l, c, &diffusion, IMAGES, &kept);
    cuda_check(cudaMemcpy(l.m.master, weights->master, weights->storage * sizeof(float), cudaMemcpyDeviceToDevice));
    unet_sync_compute(&l.m);
    int64_t n = act_numel(&l.m.input), per_image = n / IMAGES, n_out = act_numel(weights->output);
    int C = c->in_channels, Co = c->out_channels, labels[IMAGES] = {2, 0, 1};
    uint8_t *pixels = (uint8_t *)malloc_or_die(n), *d_pixels = (uint8_t *)gpu_malloc(n);
    for (int64_t i = 0; i < n; i++) pixels[i] = (uint8_t)(random_u64(77, 0, i) >> 56);
    cuda_check(cudaMemcpy(d_pixels, pixels, n, cudaMemcpyHostToDevice));
    cuda_check(cudaMemcpy(l.m.labels, labels, sizeof labels, cudaMemcpyHostToDevice));
    double gpu_bits[IMAGES], host_bits[IMAGES] = {0, 0, 0};
    likelihood_run(&l, d_pixels, FIRST, 4321, gpu_bits);

    float *x_t = (float *)malloc_or_die(n * sizeof(float)), *out = (float *)malloc_or_die(n_out * sizeof(float));
    int64_t t[IMAGES];
    for (int k = 0; k < l.steps; k++) {
        const TimestepTerms *tt = &l.terms[k];
        for (int64_t i = 0; i < n; i++)
            x_t[i] = tt->sqrt_abar * pixel_value(pixels[i]) +
                     tt->sqrt_one_minus_abar * normal_sample(4321, rng_stream(RNG_NLL, (uint64_t)k), FIRST * per_image + i);
        for (int b = 0; b < IMAGES; b++) t[b] = l.timesteps[k];
        forward_nhwc(weights, x_t, t, labels, out);
        for (int64_t i = 0; i < n; i++) {
            int64_t o = i / C * Co + i % C;
            float v = Co == 2 * C ? out[o + C] : k == 0 ? -1.0f : 1.0f;
            host_bits[i / per_image] += bound_term(pixel_value(pixels[i]), x_t[i], out[o], v, tt, k == 0, predict, 1).value / (per_image * M_LN2);
        }
    }
    double worst = 0;
    for (int b = 0; b < IMAGES; b++) worst = fmax(worst, fabs(gpu_bits[b] - host_bits[b]) / host_bits[b]);
    printf("  %d steps: bits/dim (prior aside) %.4f %.4f %.4f, GPU against the host loop %.2e\n", l.steps, gpu_bits[0], gpu_bits[1],
           gpu_bits[2], worst);
    CHECK(worst <= (sizeof(floatX) == 4 ? 1e-4 : 1e-2) && host_bits[0] > 0);
    CHECK(likelihood_prior(pixels, per_image, l.abar_last) >= 0);
    likelihood_destroy(&l);
    cudaFree(d_pixels);
    free(pixels), free(x_t), free(out);
    sample_schedule_free(&kept);
    noise_schedule_free(&d);
}

// A fixture tensor as doubles (F32, F64 or I64).
static double *fixture_values(const SafeTensorsFile *f, const char *name, int64_t *numel) {
    const SafeTensor *t = safetensors_find(f, name);
    if (!t) fatal("guided step fixture: no tensor %s", name);
    double *v = (double *)malloc_or_die(t->numel * sizeof(double));
    for (int64_t i = 0; i < t->numel; i++)
        v[i] = strcmp(t->dtype, "F32") == 0 ? ((const float *)t->data)[i]
               : strcmp(t->dtype, "F64") == 0 ? ((const double *)t->data)[i] : (double)((const int64_t *)t->data)[i];
    if (numel) *numel = t->numel;
    return v;
}

// One step of the GPU sampler's graph (the plan's step at the case's timestep: DDPM on all 1000
// steps, or DDIM with eta 0 on ddimN's) from the case's x_t with the classifier's score, against
// PyTorch's guided mean plus its noise scale times this step's own draws.
static void test_guided_step(const SafeTensorsFile *fx, const char *name, const char *model_file, SamplerKind kind, int steps) {
    char what[160], err[512], key[64];
    snprintf(what, sizeof what, "classifier guidance, %s: one step equals guided-diffusion's cond_fn with %s (PyTorch, float64)", name,
             kind == SAMPLER_DDPM ? "p_sample" : "ddim_sample");
    check_case(what);
    UnetInfo info, classifier_info;
    UnetCheckpoint *ck = unet_checkpoint_open(model_file, "ema", NULL, 0, &info, err, sizeof err);
    UnetCheckpoint *cl = ck ? unet_classifier_open("dev/fixtures/unet_classifier_attention.safetensors", NULL, 0, info.image_size,
                                                   &classifier_info, err, sizeof err) : NULL;
    if (!ck || !cl) fatal("%s", err);
    int64_t n = 0, count = 0;
    snprintf(key, sizeof key, "%s.x", name);
    double *x = fixture_values(fx, key, &n);
    snprintf(key, sizeof key, "%s.y", name);
    double *y = fixture_values(fx, key, &count);
    snprintf(key, sizeof key, "%s.t", name);
    double *t = fixture_values(fx, key, NULL);
    snprintf(key, sizeof key, "%s.scale", name);
    double *scale = fixture_values(fx, key, NULL);
    snprintf(key, sizeof key, "%s.mean", name);
    double *mean = fixture_values(fx, key, NULL);
    snprintf(key, sizeof key, "%s.noise_scale", name);
    double *noise_scale = fixture_values(fx, key, NULL);
    snprintf(key, sizeof key, "%s.unguided", name);
    double *unguided = fixture_values(fx, key, NULL);
    int N = (int)count, S = info.image_size, C = info.in_channels, labels[8];
    for (int b = 0; b < N; b++) labels[b] = (int)y[b];

    NoiseSchedule d;
    SamplePlan plan;
    CHECK(noise_schedule_make(&d, 1000, "linear") == 0);
    VarianceType variance = info.diffusion.variance == VARIANCE_LEARNED_RANGE ? VARIANCE_LEARNED_RANGE : VARIANCE_FIXED_SMALL;  // the fixture's
    CHECK(sample_plan_make(&plan, &d, kind, steps, NULL, 0.0f, PREDICT_EPS, 1, variance) == 0);
    SamplePlan one = plan;
    one.count = 1, one.steps = NULL;
    for (int j = 0; j < plan.count; j++)
        if (plan.steps[j].timestep == (int)t[0]) one.steps = &plan.steps[j];
    if (!one.steps) fatal("guided step fixture: t = %d is no step of the plan", (int)t[0]);
    GpuSampler s;
    gpu_sampler_create(&s, &ck->config, N, &one, 1.0f, &cl->config, (float)scale[0], 77);
    if (upload_tensors(&s.m, &ck->f, ck->file, s.m.master, 0, err, sizeof err) != 0 ||
        upload_tensors(&s.classifier, &cl->f, cl->file, s.classifier.master, 0, err, sizeof err) != 0)
        fatal("%s", err);
    unet_sync_compute(&s.m);
    unet_sync_compute(&s.classifier);
    gpu_sampler_begin(&s, 0, N, labels, NULL);
    float *x_nhwc = (float *)malloc_or_die(n * sizeof(float)), *got = (float *)malloc_or_die(n * sizeof(float));
    for (int64_t i = 0; i < n; i++)  // NCHW -> NHWC: value i is (b, h, w, c)
        x_nhwc[i] = (float)x[((i / (S * S * C) * C + i % C) * S + i / C % (S * S) / S) * S + i / C % S];
    cuda_check(cudaMemcpy(s.x, x_nhwc, n * sizeof(float), cudaMemcpyHostToDevice));
    gpu_sampler_steps(&s, NULL, NULL);
    cuda_check(cudaMemcpy(got, s.x, n * sizeof(float), cudaMemcpyDeviceToHost));
    double diff = 0, norm = 0, moved = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t at = ((i / (S * S * C) * C + i % C) * S + i / C % (S * S) / S) * S + i / C % S;
        double z = one.steps[0].noisy ? normal_sample(77, rng_stream(RNG_SAMPLE_NOISE, 0), i) : 0.0;
        double want = mean[at] + noise_scale[at] * z;
        diff += (got[i] - want) * (got[i] - want), norm += want * want, moved += pow(mean[at] - unguided[at], 2);
    }
    double e = sqrt(diff / norm);
    printf("  t = %d, scale %g: relative error %.2e; the guidance moves the step by %.2e of its norm\n", (int)t[0], scale[0], e,
           sqrt(moved / norm));
    CHECK(e <= (sizeof(floatX) == 4 ? 1e-5 : 2e-2));
    CHECK(sqrt(moved / norm) > 1e-3);  // the case sees guidance: 100 times the FP32 tolerance
    gpu_sampler_destroy(&s);
    unet_checkpoint_close(ck), unet_checkpoint_close(cl);
    free(x), free(y), free(t), free(scale), free(mean), free(noise_scale), free(unguided), free(x_nhwc), free(got);
    sample_plan_free(&plan);
    noise_schedule_free(&d);
}

int main(void) {
    gpu_init(0);
    Options o = preset_seed();
    o.image_size = 16, o.num_channels = 32, o.channel_mult = "1,2", o.num_res_blocks = 1, o.attention_resolutions = "8";
    o.use_scale_shift_norm = 1, o.class_cond = 1;
    ModelConfig c = resolve_model(&o, CLASSES + 1);  // 3 classes and the null class
    UNet m;
    unet_create(&m, &c, IMAGES, 0);
    random_parameters(&m, 99);
    test_batch_independence(&c, &m);

    test_plan("DDIM, 10 steps, eta 0", &c, &m, SAMPLER_DDIM, 10, 0.0f, 0, 1.0f);
    test_plan("DDIM, 10 steps, eta 1 (noise every step but the last)", &c, &m, SAMPLER_DDIM, 10, 1.0f, 0, 1.0f);
    test_plan("DDPM, all 100 steps", &c, &m, SAMPLER_DDPM, 0, 0.0f, 0, 1.0f);
    test_plan("DPM-Solver++(2M), 8 steps, v prediction", &c, &m, SAMPLER_DPM_SOLVER_PP, 8, 0.0f, 1, 1.0f);
    test_plan("DDIM, 10 steps, classifier-free guidance 3", &c, &m, SAMPLER_DDIM, 10, 0.0f, 0, 3.0f);
    test_plan("DPM-Solver++(2M), 8 steps, guidance 2, eta ignored", &c, &m, SAMPLER_DPM_SOLVER_PP, 8, 0.5f, 0, 2.0f);
    test_plan("Euler ancestral on 10 Karras levels (noise every step but the last)", &c, &m, SAMPLER_EULER_ANCESTRAL, 10, 1.0f, 0, 1.0f,
              NULL, 0.0f, 1);
    test_plan("DPM-Solver++(2M) on 8 Karras levels, v prediction, guidance 2", &c, &m, SAMPLER_DPM_SOLVER_PP, 8, 0.0f, 1, 2.0f, NULL,
              0.0f, 1);
    test_plan("Heun on 6 Karras levels (11 calls)", &c, &m, SAMPLER_HEUN, 6, 0.0f, 0, 1.0f, NULL, 0.0f, 1);
    test_plan("Heun on 6 Karras levels with churn 40, v prediction, guidance 2", &c, &m, SAMPLER_HEUN, 6, 0.0f, 1, 2.0f, NULL, 0.0f, 2);
    test_plan("an EDM model (precond edm): Heun on 6 of EDM's Karras levels", &c, &m, SAMPLER_HEUN, 6, 0.0f, 0, 1.0f, NULL, 0.0f, 3);
    test_plan("an EDM model: DPM-Solver++(2M) on 8 of EDM's levels, guidance 2", &c, &m, SAMPLER_DPM_SOLVER_PP, 8, 0.0f, 0, 2.0f, NULL,
              0.0f, 3);

    // The noisy classifier of the same images: 3 classes, the attention pool over the 8x8 tokens.
    Options co = o;
    co.class_cond = 0, co.num_head_channels = 32;
    ModelConfig cc;
    char err[512];
    if (model_config_from_options(&co, 0, &cc, err, sizeof err) != 0 || classifier_config(&cc, "attention", CLASSES, err, sizeof err) != 0)
        fatal("%s", err);
    UNet classifier;
    unet_create(&classifier, &cc, IMAGES, 1);
    random_parameters(&classifier, 96);
    test_plan("DDPM, all 100 steps, classifier guidance 20", &c, &m, SAMPLER_DDPM, 0, 0.0f, 0, 1.0f, &classifier, 20.0f);
    test_plan("DDIM, 10 steps, classifier-free guidance 3 and classifier guidance 6", &c, &m, SAMPLER_DDIM, 10, 0.0f, 0, 3.0f,
              &classifier, 6.0f);
    test_plan("Euler ancestral on 10 Karras levels, classifier guidance 6", &c, &m, SAMPLER_EULER_ANCESTRAL, 10, 1.0f, 0, 1.0f,
              &classifier, 6.0f, 1);
    test_plan("Heun on 6 Karras levels, classifier guidance 6", &c, &m, SAMPLER_HEUN, 6, 0.0f, 0, 1.0f, &classifier, 6.0f, 1);
    unet_destroy(&m);
    co = o, co.class_cond = 0;
    ModelConfig unconditional = resolve_model(&co, 0);
    unet_create(&m, &unconditional, IMAGES, 0);
    random_parameters(&m, 95);
    test_plan("DPM-Solver++(2M), 8 steps, an unconditional model, classifier guidance 6", &unconditional, &m, SAMPLER_DPM_SOLVER_PP, 8,
              0.0f, 0, 1.0f, &classifier, 6.0f);
    unet_destroy(&m);

    o.learn_sigma = 1;
    ModelConfig learned = resolve_model(&o, CLASSES + 1);
    unet_create(&m, &learned, IMAGES, 0);
    random_parameters(&m, 98);
    test_plan("DDPM with a learned variance, 25 of 100 steps (respaced)", &learned, &m, SAMPLER_DDPM, 25, 0.0f, 0, 1.0f);
    test_plan("DDPM with a learned variance, all 100 steps, v prediction, guidance 2", &learned, &m, SAMPLER_DDPM, 0, 0.0f, 1, 2.0f);
    test_plan("DDIM, 10 steps, of a model with a learned variance (its mean)", &learned, &m, SAMPLER_DDIM, 10, 0.0f, 0, 1.0f);
    test_plan("DDPM with a learned variance, 25 of 100 steps, classifier guidance 20 (times the learned variance)", &learned, &m,
              SAMPLER_DDPM, 25, 0.0f, 0, 1.0f, &classifier, 20.0f);
    test_likelihood("likelihood of a learned variance, 12 of 100 steps (ddim12's), eps", &learned, &m, "ddim12", PREDICT_EPS);
    test_likelihood("likelihood of a learned variance, section counts 5,3, x0", &learned, &m, "5,3", PREDICT_X0);
    unet_destroy(&m);
    o.learn_sigma = 0;
    unet_create(&m, &c, IMAGES, 0);
    random_parameters(&m, 97);
    test_likelihood("likelihood of a fixed (large) variance, 10 of 100 steps, v", &c, &m, "10", PREDICT_V);
    unet_destroy(&m);
    unet_destroy(&classifier);

    // The upsampler (SuperResModel, 16x16 from 8x8): the low-resolution images reach every step's
    // forward pass, in both halves when guided.
    o.learn_sigma = 1, o.super_res = 8;
    ModelConfig up = resolve_model(&o, CLASSES + 1);
    unet_create(&m, &up, IMAGES, 0);
    random_parameters(&m, 94);
    test_plan("an upsampler from 8x8, DDIM, 10 steps", &up, &m, SAMPLER_DDIM, 10, 0.0f, 0, 1.0f);
    test_plan("an upsampler from 8x8 with a learned variance, DDPM, 25 of 100 steps, guidance 2", &up, &m, SAMPLER_DDPM, 25, 0.0f, 0,
              2.0f);
    unet_destroy(&m);

    SafeTensorsFile fixture;
    if (safetensors_open("dev/fixtures/samplers/guided_step.safetensors", &fixture, err, sizeof err) != 0) fatal("%s", err);
    test_guided_step(&fixture, "ddpm_fixed", "dev/fixtures/unet_seed.safetensors", SAMPLER_DDPM, 0);
    test_guided_step(&fixture, "ddpm_learned", "dev/fixtures/unet_adm.safetensors", SAMPLER_DDPM, 0);
    test_guided_step(&fixture, "ddim", "dev/fixtures/unet_seed.safetensors", SAMPLER_DDIM, 10);
    safetensors_close(&fixture);
    return check_summary();
}
