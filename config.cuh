// config.cuh: the configuration: the option table (every flag under guided-diffusion's name, once),
// the presets, and the model configuration (ModelConfig) resolved and validated from the command
// line's values or a checkpoint's metadata. Needs only gpu.cuh; train_unet.cu includes it at its
// top (one translation unit).

// ----------------------------------------------------------------------------------------------
// The configuration: guided-diffusion's UNetModel arguments (ModelConfig), a run's options, and
// both resolved and validated from the command line's values or a checkpoint's metadata.

#define MAX_LEVELS 8
#define MAX_RES_BLOCKS 8
// The encoder's outputs kept for the decoder's skip connections: the input convolution's, one per
// residual block, one per downsampling.
#define MAX_SKIPS (1 + MAX_LEVELS * (MAX_RES_BLOCKS + 1))

typedef struct {
    int image_size;
    int in_channels, out_channels;
    int model_channels;
    int num_levels;                       // len(channel_mult)
    int level_channels[MAX_LEVELS];       // int(channel_mult[level] * model_channels)
    int level_attention[MAX_LEVELS];      // attention blocks at this level (downsample rate 2^level)
    int num_res_blocks;
    int num_heads, num_heads_upsample;    // used when num_head_channels == -1
    int num_head_channels;                // -1: fixed head count instead
    int use_scale_shift_norm, resblock_updown, conv_resample, use_new_attention_order;
    float dropout;
    int num_classes;                      // rows of label_emb (dataset classes + the null class), 0: unconditional
    int pool;                             // POOL_NONE: the diffusion UNet; else the noisy classifier with this head
    int low_res;                          // SuperResModel (the upsampler): the low-resolution image's side, 0: none
    int learn_sigma;                      // the output's second half is the learned variance (out_channels 2 in_channels)
} ModelConfig;

// The model's input channels: the image's, and for SuperResModel the low-resolution image's after
// them (bilinearly upsampled to the image's size: upsample_bilinear).
static int model_input_channels(const ModelConfig *c) { return c->low_res ? 2 * c->in_channels : c->in_channels; }

// The noisy classifier (guided-diffusion's EncoderUNetModel): the UNet's time embedding, input
// blocks and middle block, then a head (its `pool`) that turns the last feature map into one logit
// a class (out_channels of them); no label embedding, no decoder. The spatial heads' hidden layer
// has SPATIAL_HIDDEN units (guided-diffusion's).
#define SPATIAL_HIDDEN 2048
typedef enum { POOL_NONE, POOL_ADAPTIVE, POOL_ATTENTION, POOL_SPATIAL, POOL_SPATIAL_V2, NUM_POOLS } ClassifierPool;
static const char *const pool_names[NUM_POOLS] = {"", "adaptive", "attention", "spatial", "spatial_v2"};

// A run's options under guided-diffusion's flag names (the command line's, a checkpoint's metadata):
// the table of them, the presets, and each value read and checked. A preset sets a group of them
// first, and every flag given explicitly overrides it whatever its position.

typedef struct {
    // guided-diffusion's model flags
    int image_size, num_channels, num_res_blocks;
    const char *channel_mult, *attention_resolutions;
    int num_heads, num_head_channels, num_heads_upsample;
    int use_new_attention_order, use_scale_shift_norm, resblock_updown, conv_resample;
    float dropout;
    int class_cond, num_classes, learn_sigma;
    int super_res;  // SuperResModel's low-resolution side (guided-diffusion's small_size; the image size is its large_size)
    // what is trained, and the noisy classifier's flags (guided-diffusion's classifier_train.py)
    const char *model;
    int classifier_width, classifier_depth;
    const char *classifier_attention_resolutions, *classifier_pool;
    int classifier_use_scale_shift_norm, classifier_resblock_updown, noised;
    const char *val_data;
    int eval_interval;
    int eval_num;           // a diffusion model's FID during training: the images sampled (0: none)
    const char *inception;  // FID's Inception weights ("": where pytorch-fid keeps them)
    // diffusion
    int diffusion_steps;
    const char *noise_schedule, *predict, *schedule_sampler;
    int use_kl, rescale_learned_sigmas, sigma_small;
    const char *precond;                  // "ddpm" (guided-diffusion's discrete time) or "edm"
    float sigma_data, p_mean, p_std;      // EDM's
    // training
    float lr, weight_decay, beta1, beta2, adam_eps, min_lr, grad_clip, cfg_dropout;
    const char *lr_decay;
    int warmup_steps;
    int batch_size, microbatch, use_checkpoint;
    int gpus;
    const char *rdzv;      // host:port of rank 0's TCP rendezvous ("": MASTER_ADDR and MASTER_PORT, else the run folder's file)
    int rdzv_timeout;      // seconds
    const char *ema_rate;
    int log_interval, save_interval, keep, max_bad_steps, sample_interval, sample_count, sample_steps;
    const char *resume_checkpoint, *run_dir, *init_from;
    // data and run
    const char *data, *preset;
    int random_flip;
    long long steps, stop_step;
    long long seed;
    int dry_run, bench, bench_loader, overwrite;
} Options;

typedef enum { OPT_INT, OPT_LONG, OPT_FLOAT, OPT_BOOL, OPT_STRING, OPT_SWITCH } OptionType;

// What an option is besides a value of the run (OptionSpec.group, a set of these). A checkpoint's
// metadata holds every MODEL, KEPT and TUNABLE option (checkpoint_metadata walks the table):
//   MODEL           the model's: read back to build it (model_config_from_metadata); fixed on resume
//   DIFFUSION       the diffusion's: read back with the model (diffusion_from_metadata)
//   KEPT            fixed on resume: the data, noise and EMA streams depend on it
//   TUNABLE         resume may change it (and says so)
//   DIFFUSION_ONLY  a diffusion model's flag, which --model classifier refuses
enum { MODEL = 1, DIFFUSION = 2, KEPT = 4, TUNABLE = 8, DIFFUSION_ONLY = 16 };
#define IN_METADATA (MODEL | KEPT | TUNABLE)

typedef struct {
    const char *name;
    OptionType type;
    size_t offset;     // of the value in Options
    int group;         // MODEL, DIFFUSION, KEPT, TUNABLE, DIFFUSION_ONLY or none (0)
    const char *key;   // its key in the metadata when that is not its name (guided-diffusion's), else NULL
    const char *help;
} OptionSpec;

#define OPT(name, type, group, help) {#name, type, offsetof(Options, name), group, NULL, help}
#define OPT_KEY(name, type, group, key, help) {#name, type, offsetof(Options, name), group, key, help}
static const OptionSpec option_specs[] = {
    OPT(data, OPT_STRING, 0, "dataset .bin written by prepare_data (required to train), or its parts trained as one: a.bin,b.bin or "
                             "@LIST, a file of one path a line"),
    OPT(preset, OPT_STRING, 0, "seed | adm64 | adm128 | adm256 | adm256u | adm512 | adm64_256 | adm128_512: a model and training "
                               "configuration to start from"),
    OPT(image_size, OPT_INT, MODEL, "image side in pixels; when not given, the dataset's (without --data the preset's)"),
    OPT(num_channels, OPT_INT, MODEL, "model channels (multiple of 32)"),
    OPT(channel_mult, OPT_STRING, MODEL, "channel multiplier per level, e.g. 1,2,3,4; \"\", or not given with an image size from the "
                                         "dataset: guided-diffusion's default for that size"),
    OPT(num_res_blocks, OPT_INT, MODEL, "residual blocks per level"),
    OPT(attention_resolutions, OPT_STRING, MODEL, "resolutions with attention, e.g. 16,8 (\"\": none besides the middle block)"),
    OPT(num_heads, OPT_INT, MODEL, "attention heads (when num_head_channels is -1)"),
    OPT(num_head_channels, OPT_INT, MODEL, "channels per attention head, -1 to use num_heads"),
    OPT(num_heads_upsample, OPT_INT, MODEL, "heads in the decoder's attention, -1: num_heads"),
    OPT(use_new_attention_order, OPT_BOOL, MODEL, "split qkv before heads (QKVAttention) instead of the legacy order"),
    OPT(use_scale_shift_norm, OPT_BOOL, MODEL, "timestep embedding as scale and shift of the norm (FiLM)"),
    OPT(resblock_updown, OPT_BOOL, MODEL, "resample with residual blocks"),
    OPT(conv_resample, OPT_BOOL, MODEL, "convolution in up/downsampling (guided-diffusion always uses it)"),
    OPT(dropout, OPT_FLOAT, MODEL, "dropout in residual blocks"),
    OPT(class_cond, OPT_BOOL, MODEL | DIFFUSION_ONLY, "condition on the dataset's labels"),
    OPT(num_classes, OPT_INT, MODEL, "classes, when there is no --data to read them from"),
    OPT(learn_sigma, OPT_BOOL, MODEL | DIFFUSION_ONLY, "6 output channels: the prediction and guided-diffusion's learned variance, "
                                                       "trained with the hybrid loss (MSE + the variational bound's term)"),
    OPT_KEY(super_res, OPT_INT, MODEL | DIFFUSION_ONLY, "small_size", "the upsampler: guided-diffusion's SuperResModel, conditioned on "
                                                                      "the image downsampled to this side (its small_size; --image_size "
                                                                      "is its large_size), 0: none"),
    OPT(model, OPT_STRING, 0, "diffusion | classifier: the UNet, or guided-diffusion's noisy classifier (EncoderUNetModel) trained on "
                              "the dataset's labels with the classifier_ flags below instead of the model flags above"),
    OPT(classifier_width, OPT_INT, 0, "classifier: model channels"),
    OPT(classifier_depth, OPT_INT, 0, "classifier: residual blocks per level"),
    OPT(classifier_attention_resolutions, OPT_STRING, 0, "classifier: resolutions with attention (64-channel heads)"),
    OPT(classifier_use_scale_shift_norm, OPT_BOOL, 0, "classifier: timestep embedding as scale and shift of the norm"),
    OPT(classifier_resblock_updown, OPT_BOOL, 0, "classifier: downsample with residual blocks"),
    OPT(classifier_pool, OPT_STRING, MODEL, "classifier: its head, attention | adaptive | spatial | spatial_v2"),
    OPT(noised, OPT_BOOL, 0, "classifier: train on images noised at t drawn uniformly (False: the clean images at t = 0)"),
    OPT(val_data, OPT_STRING, 0, "classifier: a dataset .bin to evaluate on (its loss and accuracy in log.csv's val_ columns)"),
    OPT(eval_interval, OPT_INT, 0, "steps between evaluations: a classifier's on --val_data (a batch each); a diffusion model's FID "
                                   "(--eval_num; then a multiple of --log_interval, and when not given --sample_interval's)"),
    OPT(eval_num, OPT_INT, 0, "diffusion models: FID every --eval_interval steps and at the end, of this many images sampled from the "
                              "first EMA (DDIM, --sample_steps) against the first 50000 training images; more than 2048 (0: none)"),
    OPT(inception, OPT_STRING, 0, "FID's Inception-v3 weights, pytorch-fid's pt_inception-2015-12-05-6726825d.pth; unset: where "
                                  "pytorch-fid keeps it, $TORCH_HOME/hub/checkpoints/ or ~/.cache/torch/hub/checkpoints/"),
    OPT(diffusion_steps, OPT_INT, DIFFUSION | KEPT, "diffusion timesteps"),
    OPT(noise_schedule, OPT_STRING, DIFFUSION | KEPT, "linear | cosine"),
    OPT(predict, OPT_STRING, DIFFUSION | KEPT | DIFFUSION_ONLY, "eps | v | x0: what the model is trained to predict (x0: "
                                                                "guided-diffusion's predict_xstart)"),
    OPT(precond, OPT_STRING, DIFFUSION | KEPT | DIFFUSION_ONLY, "ddpm | edm: guided-diffusion's discrete timesteps, or EDM's "
                                                                 "preconditioning (Karras et al. 2022) of the model at continuous "
                                                                 "noise levels, sampled on Karras levels"),
    OPT(sigma_data, OPT_FLOAT, DIFFUSION | KEPT | DIFFUSION_ONLY, "edm: the images' standard deviation in the preconditioning"),
    OPT(p_mean, OPT_FLOAT, DIFFUSION | KEPT | DIFFUSION_ONLY, "edm: the mean of ln(sigma) drawn in training"),
    OPT(p_std, OPT_FLOAT, DIFFUSION | KEPT | DIFFUSION_ONLY, "edm: the standard deviation of ln(sigma) drawn in training"),
    OPT(use_kl, OPT_BOOL, DIFFUSION | TUNABLE | DIFFUSION_ONLY, "with learn_sigma: the loss is the variational bound alone "
                                                                "(guided-diffusion's KL loss), through both halves"),
    OPT(rescale_learned_sigmas, OPT_BOOL, DIFFUSION | TUNABLE, "scale the bound's term by diffusion_steps/1000 in the hybrid loss, by "
                                                               "diffusion_steps with use_kl"),
    OPT(sigma_small, OPT_BOOL, DIFFUSION | TUNABLE | DIFFUSION_ONLY, "without learn_sigma: sample and measure the likelihood with the "
                                                                     "posterior's variance beta_tilde_t instead of beta_t "
                                                                     "(guided-diffusion's default, the large)"),
    OPT(schedule_sampler, OPT_STRING, DIFFUSION | TUNABLE, "uniform | loss-second-moment: how the training timesteps are drawn "
                                                           "(guided-diffusion's importance sampling of t by the losses' second moment, "
                                                           "the loss reweighted to stay unbiased)"),
    OPT(lr, OPT_FLOAT, TUNABLE, "AdamW learning rate"),
    OPT(beta1, OPT_FLOAT, TUNABLE, "AdamW beta1"),
    OPT(beta2, OPT_FLOAT, TUNABLE, "AdamW beta2"),
    OPT(adam_eps, OPT_FLOAT, TUNABLE, "AdamW epsilon"),
    OPT(weight_decay, OPT_FLOAT, TUNABLE, "AdamW decoupled weight decay"),
    OPT(warmup_steps, OPT_INT, TUNABLE, "linear learning-rate warm-up steps"),
    OPT(lr_decay, OPT_STRING, TUNABLE, "none | cosine: after warm-up, constant or a half cosine down to min_lr at the last step"),
    OPT(min_lr, OPT_FLOAT, TUNABLE, "the learning rate at the end of a cosine decay"),
    OPT(grad_clip, OPT_FLOAT, TUNABLE, "clip the global gradient norm to this (0: off); the norm is logged either way"),
    OPT(cfg_dropout, OPT_FLOAT, TUNABLE | DIFFUSION_ONLY, "probability of replacing a label by the null class (classifier-free guidance)"),
    OPT(batch_size, OPT_INT, KEPT, "images per step and GPU"),
    OPT(microbatch, OPT_INT, 0, "run each step's batch through the model in pieces of this many images (dividing --batch_size), their "
                                "gradients summed into one step: the same step in less memory (-1: the whole batch at once)"),
    OPT(use_checkpoint, OPT_BOOL, 0, "recompute each block's inner activations in its backward instead of keeping them: the same "
                                     "gradients in less memory, for a slower step"),
    OPT(gpus, OPT_INT, 0, "GPUs of this machine to train on: a process each, data parallel over NCCL"),
    OPT(rdzv, OPT_STRING, 0, "under a launcher, host:port where rank 0 meets the others over TCP (as torchrun's MASTER_ADDR and "
                             "MASTER_PORT, which it overrides; without either, through a file of the run folder)"),
    OPT(rdzv_timeout, OPT_INT, 0, "seconds the rendezvous waits for every rank"),
    OPT_KEY(ema_rate, OPT_STRING, KEPT, "ema_rates", "EMA decay rates, comma-separated"),
    OPT(log_interval, OPT_INT, 0, "steps between progress lines"),
    OPT(save_interval, OPT_INT, 0, "steps between checkpoints"),
    OPT(keep, OPT_INT, 0, "checkpoints to keep, the newest (0: all)"),
    OPT(sample_interval, OPT_INT, 0, "steps between sample grids from the EMA weights (0: only at the end)"),
    OPT(sample_count, OPT_INT, 0, "images in a sample grid, e.g. 64 (0: no grids); an upsampler's: the first images of the validation or "
                                  "training data, each as low-res | sample | original"),
    OPT(sample_steps, OPT_INT, 0, "DDIM steps of a sample grid"),
    OPT(max_bad_steps, OPT_INT, 0, "stop after this many steps in a row with a non-finite loss or gradient"),
    OPT(run_dir, OPT_STRING, 0, "run folder: config.txt, log.csv, checkpoints/"),
    OPT(resume_checkpoint, OPT_STRING, 0, "checkpoint folder to resume from, or latest (the newest in run_dir)"),
    OPT(init_from, OPT_STRING, 0, "start a new run from these weights (fine-tuning): a checkpoint folder (its EMA), a .safetensors or a "
                                  "PyTorch .pt file of the same model; the EMAs start from them, the optimiser and the step fresh"),
    OPT(overwrite, OPT_SWITCH, 0, "start a new run in a run folder that holds one, removing its checkpoints, samples, log and config"),
    OPT(random_flip, OPT_BOOL, TUNABLE, "random horizontal flips of the training images"),
    OPT(steps, OPT_LONG, TUNABLE, "training steps (the length of the learning-rate schedule)"),
    OPT(stop_step, OPT_LONG, 0, "save and stop after this step, to continue later with --resume_checkpoint (0: at --steps)"),
    OPT(seed, OPT_LONG, KEPT, "random seed (initialisation, data order, noise)"),
    OPT(dry_run, OPT_SWITCH, 0, "check the configuration, dataset, run folder and resume checkpoint, print them, the parameter count and "
                                "the memory plan, exit"),
    OPT(bench, OPT_INT, 0, "time N training steps on random data (after warm-up) and exit; needs no --data"),
    OPT(bench_loader, OPT_INT, 0, "time N batches of --data's loader alone, from a cold page cache, with and without its read-ahead, "
                                  "and exit (no GPU): the disk speed a run needs"),
};
#define NUM_OPTIONS ((int)(sizeof option_specs / sizeof option_specs[0]))

// The defaults: the seed project's model (clu0/unet.cu) with guided-diffusion's training defaults.
static Options preset_seed(void) {
    Options o;
    memset(&o, 0, sizeof o);
    o.image_size = 64, o.num_channels = 64, o.num_res_blocks = 2;
    o.channel_mult = "1,2,3,4", o.attention_resolutions = "16,8";
    o.num_heads = 4, o.num_head_channels = 32, o.num_heads_upsample = -1;
    o.use_new_attention_order = 0, o.use_scale_shift_norm = 0, o.resblock_updown = 0, o.conv_resample = 0;
    o.dropout = 0.0f, o.class_cond = 0, o.num_classes = 0, o.learn_sigma = 0;
    o.model = "diffusion", o.classifier_width = 128, o.classifier_depth = 2, o.classifier_attention_resolutions = "32,16,8";
    o.classifier_use_scale_shift_norm = 1, o.classifier_resblock_updown = 1, o.classifier_pool = "attention", o.noised = 1;
    o.val_data = "", o.eval_interval = 5, o.eval_num = 0, o.inception = "";
    o.diffusion_steps = 1000, o.noise_schedule = "linear", o.predict = "eps", o.use_kl = 0, o.rescale_learned_sigmas = 1;
    o.sigma_small = 0;
    o.schedule_sampler = "uniform";
    o.precond = "ddpm", o.sigma_data = 0.5f, o.p_mean = -1.2f, o.p_std = 1.2f;
    o.lr = 1e-4f, o.weight_decay = 0.0f, o.beta1 = 0.9f, o.beta2 = 0.999f, o.adam_eps = 1e-8f;
    o.warmup_steps = 0, o.lr_decay = "none", o.min_lr = 0.0f, o.grad_clip = 0.0f, o.cfg_dropout = 0.0f;
    o.batch_size = 32, o.microbatch = -1, o.use_checkpoint = 0, o.gpus = 1, o.rdzv = "", o.rdzv_timeout = 600, o.ema_rate = "0.9999";
    o.log_interval = 10, o.save_interval = 10000, o.keep = 0, o.max_bad_steps = 10;
    o.sample_interval = 5000, o.sample_count = 64, o.sample_steps = 50;
    o.resume_checkpoint = "", o.run_dir = "run", o.init_from = "";
    o.data = "", o.preset = "seed", o.random_flip = 1, o.steps = 100000, o.stop_step = 0, o.seed = 0, o.dry_run = 0;
    return o;
}

// ADM ImageNet-64 (guided-diffusion's README), without learned sigma; add --class_cond True.
static Options preset_adm64(void) {
    Options o = preset_seed();
    o.num_channels = 192, o.num_res_blocks = 3, o.attention_resolutions = "32,16,8";
    o.num_head_channels = 64, o.use_new_attention_order = 1, o.use_scale_shift_norm = 1;
    o.resblock_updown = 1, o.conv_resample = 1, o.dropout = 0.1f, o.noise_schedule = "cosine";
    o.preset = "adm64";
    return o;
}

// guided-diffusion's released ImageNet models at 128, 256 and 512 (its README's flags): learned
// variance, linear schedule, scale-shift norm, resblock up/down, attention at 32,16,8, the default
// channel multipliers of the size; class-conditional (the dataset's classes, else 1000) but adm256u.
static Options preset_adm_large(int size, const char *name) {
    Options o = preset_seed();
    o.image_size = size, o.num_channels = 256, o.num_res_blocks = 2, o.channel_mult = "", o.attention_resolutions = "32,16,8";
    o.num_heads = 4, o.num_head_channels = size == 128 ? -1 : 64, o.use_scale_shift_norm = 1, o.resblock_updown = 1, o.conv_resample = 1;
    o.learn_sigma = 1, o.class_cond = strcmp(name, "adm256u") != 0, o.num_classes = 1000, o.noise_schedule = "linear";
    o.preset = name;
    return o;
}

// guided-diffusion's released upsamplers (its README's flags; their files 64_256_upsampler.pt and
// 128_512_upsampler.pt): 192 channels, 2 blocks, learned variance, linear schedule, scale-shift
// norm, resblock up/down, class-conditional; the upsampler's channel multipliers of the size; 64 to
// 256 with attention at 32,16,8 and 4 heads, 128 to 512 at 32,16 with 64-channel heads.
static Options preset_adm_upsampler(int small_size, int large_size, const char *name) {
    Options o = preset_adm_large(large_size, name);
    o.super_res = small_size, o.num_channels = 192;
    if (large_size == 512) o.attention_resolutions = "32,16";
    return o;
}

// The options of a preset by its name. Returns 0, or -1 for a name that is none.
static int preset_options(const char *name, Options *o) {
    if (strcmp(name, "seed") == 0) *o = preset_seed();
    else if (strcmp(name, "adm64") == 0) *o = preset_adm64();
    else if (strcmp(name, "adm128") == 0 || strcmp(name, "adm256") == 0 || strcmp(name, "adm256u") == 0 || strcmp(name, "adm512") == 0)
        *o = preset_adm_large(atoi(name + 3), name);
    else if (strcmp(name, "adm64_256") == 0) *o = preset_adm_upsampler(64, 256, name);
    else if (strcmp(name, "adm128_512") == 0) *o = preset_adm_upsampler(128, 512, name);
    else return -1;
    return 0;
}

// Parses a boolean as guided-diffusion's str2bool does (yes/true/t/y/1, no/false/f/n/0).
static int parse_bool(const char *s, int *out) {
    static const char *const yes[] = {"yes", "true", "t", "y", "1"}, *const no[] = {"no", "false", "f", "n", "0"};
    for (int i = 0; i < 5; i++) {
        if (strcasecmp(s, yes[i]) == 0) return *out = 1, 0;
        if (strcasecmp(s, no[i]) == 0) return *out = 0, 0;
    }
    return -1;
}

// Stores one option's value, checking that a number is a whole number (or a real) and nothing else.
// Returns 0, or -1 with a message.
static int option_from_string(Options *o, const OptionSpec *s, const char *value, char *err, size_t err_len) {
    char *p = (char *)o + s->offset, *end = NULL;
    errno = 0;
    switch (s->type) {
    case OPT_INT: {
        long v = strtol(value, &end, 10);
        if (end == value || *end || errno || v < INT32_MIN || v > INT32_MAX)
            return error_line(err, err_len, "--%s needs a whole number, not '%s'", s->name, value);
        *(int *)p = (int)v;
        break;
    }
    case OPT_LONG: {
        long long v = strtoll(value, &end, 10);
        if (end == value || *end || errno) return error_line(err, err_len, "--%s needs a whole number, not '%s'", s->name, value);
        *(long long *)p = v;
        break;
    }
    case OPT_FLOAT: {
        double v = strtod(value, &end);
        if (end == value || *end || errno || !isfinite(v)) return error_line(err, err_len, "--%s needs a number, not '%s'", s->name, value);
        *(float *)p = (float)v;
        break;
    }
    case OPT_BOOL:
        if (parse_bool(value, (int *)p) != 0) return error_line(err, err_len, "--%s needs True or False, not '%s'", s->name, value);
        break;
    case OPT_STRING: *(const char **)p = value; break;
    case OPT_SWITCH: *(int *)p = 1; break;
    }
    return 0;
}

// The option of a name (len characters; a hyphen in it stands for an underscore, cli.h), or NULL.
static const OptionSpec *find_option(const char *name, size_t len) {
    for (int i = 0; i < NUM_OPTIONS; i++)
        if (cli_name_is(name, len, option_specs[i].name)) return &option_specs[i];
    return NULL;
}

// Parses a comma-separated list of positive numbers; returns the count, or -1 on a bad entry.
static int parse_number_list(const char *s, double *out, int max) {
    int n = 0;
    while (*s) {
        char *end;
        errno = 0;
        double v = strtod(s, &end);
        if (end == s || errno || !isfinite(v) || v <= 0 || n == max) return -1;
        out[n++] = v;
        s = end;
        if (*s == ',') s++;
        else if (*s) return -1;
    }
    return n;
}

// guided-diffusion's channel_mult when none is given (script_util.create_model), and for 32x32
// improved-diffusion's.
static const char *default_channel_mult(int image_size) {
    switch (image_size) {
    case 512: return "0.5,1,1,2,2,4,4";
    case 256: return "1,1,2,2,4,4";
    case 128: return "1,1,2,3,4";
    case 64: return "1,2,3,4";
    case 32: return "1,2,2,2";  // improved-diffusion's (CIFAR-10); guided-diffusion has none
    default: return NULL;
    }
}

// An upsampler's channel_mult when none is given (guided-diffusion's sr_create_model), by its large size.
static const char *super_res_channel_mult(int image_size) {
    return image_size == 512 || image_size == 256 ? "1,1,2,2,4,4" : image_size == 64 ? "1,2,3,4" : NULL;
}

// Checks every value and resolves the model configuration into c. label_rows: rows of the class
// embedding (0: unconditional). Returns 0, or -1 with the first bad value (the command line's
// or a checkpoint's metadata's: the caller says which).
static int model_config_from_options(Options *o, int label_rows, ModelConfig *out, char *err, size_t err_len) {
    ModelConfig c;
    memset(&c, 0, sizeof c);
    if (o->image_size < 8 || o->image_size > 4096) return error_line(err, err_len, "--image_size %d is out of range (8..4096)", o->image_size);
    if (o->num_channels < 32 || o->num_channels > 8192 || o->num_channels % 32)
        return error_line(err, err_len, "--num_channels %d must be a multiple of 32 (GroupNorm uses 32 groups) from 32 to 8192", o->num_channels);
    if (o->num_res_blocks < 0 || o->num_res_blocks > MAX_RES_BLOCKS)
        return error_line(err, err_len, "--num_res_blocks %d is out of range (0..%d)", o->num_res_blocks, MAX_RES_BLOCKS);
    if (!o->channel_mult[0]) {
        o->channel_mult = o->super_res ? super_res_channel_mult(o->image_size) : default_channel_mult(o->image_size);
        if (!o->channel_mult) return error_line(err, err_len, "no default --channel_mult for image size %d; give one", o->image_size);
    }
    double mult[MAX_LEVELS];
    int levels = parse_number_list(o->channel_mult, mult, MAX_LEVELS);
    if (levels < 1) return error_line(err, err_len, "--channel_mult '%s' must be 1 to %d positive numbers separated by commas", o->channel_mult, MAX_LEVELS);
    if (o->image_size % (1 << (levels - 1)))
        return error_line(err, err_len, "--image_size %d must be divisible by 2^%d = %d for %d levels", o->image_size, levels - 1,
                    1 << (levels - 1), levels);
    c.image_size = o->image_size;
    c.in_channels = 3;
    if (o->super_res && (o->super_res < 1 || o->super_res >= o->image_size || o->image_size % o->super_res))
        return error_line(err, err_len, "--super_res %d must be a side from 1 below the image size %d that divides it", o->super_res,
                          o->image_size);
    c.low_res = o->super_res;
    c.learn_sigma = o->learn_sigma;
    c.out_channels = o->learn_sigma ? 6 : 3;
    c.model_channels = o->num_channels;
    c.num_levels = levels;
    for (int l = 0; l < levels; l++) {
        double channels = mult[l] * o->num_channels;
        c.level_channels[l] = channels <= 32768 ? (int)channels : 0;
        if (c.level_channels[l] < 32 || c.level_channels[l] % 32)
            return error_line(err, err_len, "channel_mult %g x num_channels %d = %g channels at level %d; must be a multiple of 32 from 32 to 32768",
                        mult[l], o->num_channels, channels, l);
    }
    double res[MAX_LEVELS];
    int num_res = o->attention_resolutions[0] ? parse_number_list(o->attention_resolutions, res, MAX_LEVELS) : 0;
    if (num_res < 0) return error_line(err, err_len, "--attention_resolutions '%s' must be resolutions separated by commas", o->attention_resolutions);
    for (int i = 0; i < num_res; i++) {
        int level = -1;
        for (int l = 0; l < levels; l++)
            if (res[i] == (double)(o->image_size >> l)) level = l;
        if (level < 0)
            return error_line(err, err_len, "attention resolution %g is none of the model's resolutions (%d down to %d)", res[i],
                        o->image_size, o->image_size >> (levels - 1));
        c.level_attention[level] = 1;
    }
    if (o->num_head_channels != -1 && o->num_head_channels < 1)
        return error_line(err, err_len, "--num_head_channels %d must be positive or -1", o->num_head_channels);
    if (o->num_heads < 1) return error_line(err, err_len, "--num_heads %d must be positive", o->num_heads);
    if (o->num_heads_upsample == -1) o->num_heads_upsample = o->num_heads;
    if (o->num_heads_upsample < 1) return error_line(err, err_len, "--num_heads_upsample %d must be positive or -1", o->num_heads_upsample);
    for (int l = 0; l < levels; l++) {  // every attention block's channels split evenly into heads
        int middle = l == levels - 1, ch = c.level_channels[l];
        if (!c.level_attention[l] && !middle) continue;
        if (o->num_head_channels != -1 && ch % o->num_head_channels)
            return error_line(err, err_len, "--num_head_channels %d does not divide the %d channels of the attention at resolution %d",
                        o->num_head_channels, ch, o->image_size >> l);
        if (o->num_head_channels == -1 && (ch % o->num_heads || ch % o->num_heads_upsample))
            return error_line(err, err_len, "--num_heads %d (or --num_heads_upsample %d) does not divide the %d channels at resolution %d",
                        o->num_heads, o->num_heads_upsample, ch, o->image_size >> l);
    }
    if (!(o->dropout >= 0 && o->dropout < 1)) return error_line(err, err_len, "--dropout %g must be in [0, 1)", o->dropout);
    c.num_res_blocks = o->num_res_blocks;
    c.num_heads = o->num_heads;
    c.num_heads_upsample = o->num_heads_upsample;
    c.num_head_channels = o->num_head_channels;
    c.use_scale_shift_norm = o->use_scale_shift_norm;
    c.resblock_updown = o->resblock_updown;
    c.conv_resample = o->conv_resample;
    c.use_new_attention_order = o->use_new_attention_order;
    c.dropout = o->dropout;
    if (o->class_cond && label_rows < 1)
        return error_line(err, err_len, "--class_cond needs a dataset with labels (--data) or --num_classes");
    c.num_classes = o->class_cond ? label_rows : 0;
    *out = c;
    return 0;
}

// Turns a model configuration into the classifier of that body with head `pool` (a name of
// pool_names) and `classes` logits. Returns 0, or -1 with a message.
static int classifier_config(ModelConfig *c, const char *pool, int classes, char *err, size_t err_len) {
    c->pool = POOL_NONE;
    for (int p = 1; p < NUM_POOLS; p++)
        if (strcmp(pool, pool_names[p]) == 0) c->pool = p;
    if (c->pool == POOL_NONE) return error_line(err, err_len, "classifier_pool '%s' is none of adaptive, attention, spatial and spatial_v2", pool);
    if (classes < 1) return error_line(err, err_len, "a classifier needs num_classes of at least 1, not %d", classes);
    int ch = c->level_channels[c->num_levels - 1];
    if (c->pool == POOL_ATTENTION && (c->num_head_channels < 1 || ch % c->num_head_channels))
        return error_line(err, err_len, "the attention pool needs num_head_channels dividing its %d channels, not %d", ch,
                          c->num_head_channels);
    c->out_channels = classes, c->num_classes = 0, c->learn_sigma = 0;
    return 0;
}

// --model classifier: the model flags from the classifier's (guided-diffusion's create_classifier:
// the size's default channel_mult, 64-channel heads in the legacy order, convolution resampling,
// no dropout, no label embedding), so that everything after (the configuration printed, the
// checkpoint's metadata) names the model trained. Its classes: the dataset's, or --num_classes, or
// guided-diffusion's 1000.
// The classifier flags that have a model flag of their own, onto it.
static void classifier_flags_onto_model(Options *o) {
    o->num_channels = o->classifier_width, o->num_res_blocks = o->classifier_depth;
    o->attention_resolutions = o->classifier_attention_resolutions;
    o->use_scale_shift_norm = o->classifier_use_scale_shift_norm, o->resblock_updown = o->classifier_resblock_updown;
}

static void classifier_model_flags(Options *o) {
    classifier_flags_onto_model(o);
    o->channel_mult = "", o->num_head_channels = 64, o->use_new_attention_order = 0;
    o->conv_resample = 1, o->dropout = 0.0f, o->class_cond = 0, o->learn_sigma = 0;
    if (o->num_classes < 1) o->num_classes = 1000;
}

// The model configuration of options that name it whole (a checkpoint's metadata, a .pt's inferred
// flags): a classifier's when classifier_pool names a head (num_classes: its logits), else the
// UNet's (num_classes: label_emb's rows). Returns 0, or -1 with a message.
static int named_model_config(const Options *named, ModelConfig *c, char *err, size_t err_len) {
    Options o = *named;
    const char *pool = o.classifier_pool;
    if (!pool[0]) return model_config_from_options(&o, o.num_classes, c, err, err_len);
    if (o.class_cond) return error_line(err, err_len, "a classifier (classifier_pool %s) has no class_cond", pool);
    if (o.super_res) return error_line(err, err_len, "a classifier (classifier_pool %s) has no super_res", pool);
    if (model_config_from_options(&o, 0, c, err, err_len) != 0) return -1;
    return classifier_config(c, pool, o.num_classes, err, err_len);
}

// guided-diffusion's own defaults (script_util.model_and_diffusion_defaults), for reading a
// checkpoint whose metadata leaves a flag out; conv_resample is always on there.
static Options guided_diffusion_defaults(void) {
    Options o = preset_seed();
    o.num_channels = 128, o.channel_mult = "", o.num_head_channels = -1, o.use_scale_shift_norm = 1;
    o.conv_resample = 1, o.num_classes = 1000, o.classifier_pool = "";
    return o;
}

// An option's key in a checkpoint's metadata: guided-diffusion's name for it.
static const char *metadata_key(const OptionSpec *s) { return s->key ? s->key : s->name; }

// Reads into o every option of `group` that a checkpoint's metadata holds. Returns 0, or -1 with
// the first bad value.
static int options_from_metadata(const SafeTensorsFile *f, int group, Options *o, char *err, size_t err_len) {
    for (int i = 0; i < NUM_OPTIONS; i++) {
        const OptionSpec *s = &option_specs[i];
        const char *value = s->group & group ? safetensors_metadata(f, metadata_key(s)) : NULL;
        if (value && option_from_string(o, s, value, err, err_len) != 0) return -1;
    }
    return 0;
}

// The model configuration a checkpoint's metadata gives under guided-diffusion's flag names (its
// MODEL options; guided-diffusion's defaults for those it leaves out). There num_classes is the
// label embedding's row count, null class included. Returns 0, or -1 with a message naming the file.
static int model_config_from_metadata(const SafeTensorsFile *f, const char *path, ModelConfig *c, char *err, size_t err_len) {
    Options o = guided_diffusion_defaults();
    char why[512];
    int r = options_from_metadata(f, MODEL, &o, why, sizeof why);
    if (r == 0) r = named_model_config(&o, c, why, sizeof why);
    return r == 0 ? 0 : error_line(err, err_len, "%s: its metadata gives no valid model: %s", path, why);
}

// ----------------------------------------------------------------------------------------------
// The diffusion and the training, resolved once from options already checked (the command line's
// by validate_training, a checkpoint's by diffusion_from_metadata) into what the trainer, the
// samplers and the likelihood read: no flag's text is parsed after this.

// A model's diffusion (guided-diffusion's create_gaussian_diffusion): a learned variance for a model
// with learn_sigma and its hybrid loss (or with use_kl the bound alone), else a fixed one, the
// large (guided-diffusion's default) or with sigma_small the small, and the MSE; with precond edm,
// EDM's (predict PREDICT_EDM: the MSE of its F, see sampler.h).
static DiffusionConfig diffusion_config(const Options *o, const ModelConfig *c) {
    DiffusionConfig d;
    memset(&d, 0, sizeof d);
    d.steps = o->diffusion_steps;
    d.schedule = strcmp(o->noise_schedule, "cosine") == 0 ? "cosine" : "linear";
    d.predict = strcmp(o->precond, "edm") == 0 ? PREDICT_EDM : (Prediction)prediction_from_name(o->predict);
    d.sigma_data = o->sigma_data, d.p_mean = o->p_mean, d.p_std = o->p_std;
    d.variance = c->learn_sigma ? VARIANCE_LEARNED_RANGE : o->sigma_small ? VARIANCE_FIXED_SMALL : VARIANCE_FIXED_LARGE;
    d.loss = !c->learn_sigma ? LOSS_MSE : o->use_kl ? LOSS_KL : LOSS_HYBRID;
    d.bound_scale = o->rescale_learned_sigmas ? (o->use_kl ? (float)d.steps : (float)d.steps / 1000.0f) : 1.0f;
    d.timesteps = strcmp(o->schedule_sampler, "loss-second-moment") == 0 ? TIMESTEPS_LOSS_SECOND_MOMENT : TIMESTEPS_UNIFORM;
    return d;
}

// EDM's values a run or a checkpoint may hold: sigma_data and p_std positive, p_mean finite, each
// below 1000 in size.
static int edm_values_valid(float sigma_data, float p_mean, float p_std) {
    return sigma_data > 0 && sigma_data < 1e3f && p_std > 0 && p_std < 1e3f && fabsf(p_mean) < 1e3f;
}

// The diffusion a checkpoint's metadata gives for model c (its DIFFUSION options; guided-diffusion's
// defaults where it says nothing), each value checked. Returns 0, or -1 with a message naming the file.
static int diffusion_from_metadata(const SafeTensorsFile *f, const char *path, const ModelConfig *c, DiffusionConfig *d, char *err,
                                   size_t err_len) {
    Options o = guided_diffusion_defaults();
    char why[512];
    if (options_from_metadata(f, DIFFUSION, &o, why, sizeof why) != 0)
        return error_line(err, err_len, "%s: its metadata gives no valid diffusion: %s", path, why);
    if (o.diffusion_steps < 1 || o.diffusion_steps > 100000)
        return error_line(err, err_len, "%s: metadata diffusion_steps %d is not a whole number from 1 to 100000", path, o.diffusion_steps);
    if (strcmp(o.noise_schedule, "linear") != 0 && strcmp(o.noise_schedule, "cosine") != 0)
        return error_line(err, err_len, "%s: metadata noise_schedule '%s' is neither linear nor cosine", path, o.noise_schedule);
    if (prediction_from_name(o.predict) < 0)
        return error_line(err, err_len, "%s: metadata predict '%s' is none of eps, v and x0", path, o.predict);
    if (strcmp(o.precond, "ddpm") != 0 && strcmp(o.precond, "edm") != 0)
        return error_line(err, err_len, "%s: metadata precond '%s' is neither ddpm nor edm", path, o.precond);
    if (!edm_values_valid(o.sigma_data, o.p_mean, o.p_std))
        return error_line(err, err_len, "%s: metadata sigma_data %g, p_mean %g, p_std %g are not EDM's kind of values", path,
                          o.sigma_data, o.p_mean, o.p_std);
    if (strcmp(o.schedule_sampler, "uniform") != 0 && strcmp(o.schedule_sampler, "loss-second-moment") != 0)
        return error_line(err, err_len, "%s: metadata schedule_sampler '%s' is neither uniform nor loss-second-moment", path,
                          o.schedule_sampler);
    *d = diffusion_config(&o, c);
    return 0;
}

#define MAX_EMA_RATES 8
typedef enum { LR_CONSTANT, LR_COSINE } LrDecay;  // after warm-up (--lr_decay none, cosine)

// A run's training: what the trainer reads of it.
typedef struct {
    int batch_size;     // images a step on this GPU
    int piece;          // images a pass of the model (--microbatch; batch_size: the whole batch at once)
    int recompute;      // --use_checkpoint
    float lr, min_lr, weight_decay, beta1, beta2, adam_eps, grad_clip, cfg_dropout;
    int warmup_steps;
    LrDecay lr_decay;
    int64_t steps;      // the learning-rate schedule's length
    int num_ema;
    float ema_rates[MAX_EMA_RATES];
    uint64_t seed;
    int noised;         // a classifier learns on noised images (else on the clean ones at t = 0)
} TrainConfig;

static TrainConfig train_config(const Options *o) {
    TrainConfig t;
    memset(&t, 0, sizeof t);
    t.batch_size = o->batch_size, t.piece = o->microbatch > 0 ? o->microbatch : o->batch_size, t.recompute = o->use_checkpoint;
    t.lr = o->lr, t.min_lr = o->min_lr, t.weight_decay = o->weight_decay, t.beta1 = o->beta1, t.beta2 = o->beta2;
    t.adam_eps = o->adam_eps, t.grad_clip = o->grad_clip, t.cfg_dropout = o->cfg_dropout;
    t.warmup_steps = o->warmup_steps, t.lr_decay = strcmp(o->lr_decay, "cosine") == 0 ? LR_COSINE : LR_CONSTANT, t.steps = o->steps;
    double rates[MAX_EMA_RATES];
    int n = parse_number_list(o->ema_rate, rates, MAX_EMA_RATES);
    for (int i = 0; i < n; i++) t.ema_rates[t.num_ema++] = (float)rates[i];
    t.seed = (uint64_t)o->seed, t.noised = o->noised;
    return t;
}
