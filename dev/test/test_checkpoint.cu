// test_checkpoint.cu: the trainer's checkpoint writer on the CPU (train_unet.cu in library mode).
// A child process writes checkpoints of a small model in a loop and is killed with SIGKILL at a
// random moment, thirty times over: the latest complete checkpoint must always load, with the
// content of its step. Also: --keep, the safetensors files PyTorch reads (names, shapes, F32,
// metadata), and the messages for mismatched or damaged files.
#include <signal.h>
#include <sys/wait.h>

#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

static ModelConfig small_config(int num_channels) {
    Options o = preset_seed();
    o.image_size = 8, o.num_channels = num_channels, o.channel_mult = "1,2", o.num_res_blocks = 1;
    o.attention_resolutions = "4", o.num_head_channels = 32;
    return resolve_model(&o, 0);
}

// Parameter j of tensor i at step s: a value that says where it came from.
static float pattern(int64_t s, int i, int64_t j) { return (float)(s * 1000003 + i * 7919 + j) * 1e-3f; }

static void write_step(const char *run_dir, const ParamList *params, int64_t step, int keep) {
    float **model = (float **)malloc_or_die(params->count * sizeof(float *)), **ema = (float **)malloc_or_die(params->count * sizeof(float *));
    int64_t storage = 0;
    for (int i = 0; i < params->count; i++) {
        model[i] = (float *)malloc_or_die(params->specs[i].numel * sizeof(float));
        ema[i] = (float *)malloc_or_die(params->specs[i].numel * sizeof(float));
        for (int64_t j = 0; j < params->specs[i].numel; j++) model[i][j] = pattern(step, i, j), ema[i][j] = -pattern(step, i, j);
        storage += params->specs[i].numel;
    }
    Options o = preset_seed();
    o.channel_mult = "1,2", o.attention_resolutions = "4";
    ModelConfig c = small_config(32);
    Metadata meta = checkpoint_metadata(&o, &c, step);
    StateHeader h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, STATE_MAGIC, 8);
    h.version = STATE_VERSION, h.num_params = params->count, h.step = step, h.storage = storage;
    float *moments = (float *)calloc(2 * storage, sizeof(float));
    float rates[2] = {0.9999f, 0.999f};
    CheckpointData d = {step, params, model, 2, rates, {ema, ema}, &meta, &h, moments, 2 * storage * sizeof(float)};
    char saved[4096], err[512];
    if (write_checkpoint(run_dir, &d, keep, saved, sizeof saved, err, sizeof err) != 0) fatal("%s", err);
    for (int i = 0; i < params->count; i++) free(model[i]), free(ema[i]);
    free(model), free(ema), free(moments);
}

// Loads every file of a checkpoint folder and checks it holds step `step`'s values; 0 if so.
static int verify_checkpoint(const char *dir, const ParamList *params, int64_t step) {
    const char *files[3] = {"model.safetensors", "ema.safetensors", "ema_0.999.safetensors"};
    char path[4400], err[512];
    for (int k = 0; k < 3; k++) {
        SafeTensorsFile f;
        snprintf(path, sizeof path, "%s/%s", dir, files[k]);
        if (safetensors_open(path, &f, err, sizeof err) != 0) return printf("  %s\n", err), -1;
        if (match_parameters(params, &f, path, 1, err, sizeof err) != 0) return printf("  %s\n", err), safetensors_close(&f), -1;
        const char *meta_step = safetensors_metadata(&f, "step");
        int ok = meta_step && strtoll(meta_step, NULL, 10) == step;
        for (int i = 0; ok && i < params->count; i++) {
            const SafeTensor *t = safetensors_find(&f, params->specs[i].name);
            float *v = (float *)malloc_or_die(t->numel * sizeof(float));
            safetensors_get_float(t, v);
            for (int64_t j = 0; ok && j < t->numel; j++) ok = v[j] == (k ? -1.0f : 1.0f) * pattern(step, i, j);
            free(v);
        }
        safetensors_close(&f);
        if (!ok) return printf("  %s holds other values than step %lld's\n", path, (long long)step), -1;
    }
    snprintf(path, sizeof path, "%s/state.bin", dir);
    struct stat st;
    StateHeader h;
    FILE *f = fopen(path, "rb");
    int ok = f && fstat(fileno(f), &st) == 0 && fread(&h, sizeof h, 1, f) == 1 && h.step == step &&
             (size_t)st.st_size == sizeof h + 2 * h.storage * sizeof(float);
    if (f) fclose(f);
    return ok ? 0 : (printf("  %s is damaged\n", path), -1);
}

int main(void) {
    char run_dir[] = "/tmp/test_checkpoint_XXXXXX";
    if (!mkdtemp(run_dir)) fatal("mkdtemp failed");
    ModelConfig c = small_config(32);
    ParamList params = model_parameters(&c);
    srand((unsigned)time(NULL));

    check_case("checkpoint: the files hold guided-diffusion's names, shapes, F32 and the configuration");
    write_step(run_dir, &params, 7, 0);
    char dir[4096];
    CHECK(latest_checkpoint(run_dir, dir, sizeof dir) == 0 && strstr(dir, "step_000000007"));
    CHECK(verify_checkpoint(dir, &params, 7) == 0);
    SafeTensorsFile f;
    char path[4400], err[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK(safetensors_open(path, &f, err, sizeof err) == 0);
    const char *keys[] = {"image_size", "num_channels", "channel_mult", "attention_resolutions", "use_scale_shift_norm",
                          "num_head_channels", "class_cond", "conv_resample", "learn_sigma", "format_version"};
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) CHECK(safetensors_metadata(&f, keys[k]) != NULL);
    CHECK(strcmp(safetensors_metadata(&f, "attention_resolutions"), "4") == 0);
    CHECK(strcmp(safetensors_metadata(&f, "use_scale_shift_norm"), "False") == 0);
    ModelConfig back = model_config_from_metadata(&f);  // the metadata rebuilds the same model
    CHECK(memcmp(&back, &c, sizeof c) == 0);
    safetensors_close(&f);

    check_case("checkpoint: SIGKILL at any moment of a save leaves the latest checkpoint loadable");
    int64_t step = 7;
    int kills = 0, verified = 0;
    for (int round = 0; round < 30; round++) {
        pid_t child = fork();
        if (child == 0) {
            for (int64_t s = step + 1;; s++) write_step(run_dir, &params, s, 3);
        }
        usleep(1000 * (rand() % 40));
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        kills++;
        CHECK(latest_checkpoint(run_dir, dir, sizeof dir) == 0);
        int64_t latest = checkpoint_step(strrchr(dir, '/') + 1);
        CHECK(latest >= step);
        if (verify_checkpoint(dir, &params, latest) == 0) verified++;
        step = latest;
    }
    printf("  %d kills, the latest checkpoint verified after %d, last step %lld\n", kills, verified, (long long)step);
    CHECK(verified == kills);
    CHECK(step > 7);

    check_case("checkpoint: --keep keeps the newest, and a crashed save's temporary folder is removed");
    prune_checkpoints(run_dir, 2);
    snprintf(path, sizeof path, "%s/checkpoints", run_dir);
    DIR *d = opendir(path);
    int complete = 0, temporary = 0;
    struct dirent *e;
    while ((e = readdir(d))) complete += checkpoint_step(e->d_name) >= 0, temporary += strstr(e->d_name, ".tmp.") != NULL;
    closedir(d);
    CHECK(complete == 2 && temporary == 0);

    check_case("checkpoint: a file of another model is refused naming what differs");
    ModelConfig wide = small_config(64);
    ParamList wider = model_parameters(&wide);
    CHECK(latest_checkpoint(run_dir, dir, sizeof dir) == 0);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK(safetensors_open(path, &f, err, sizeof err) == 0);
    CHECK(match_parameters(&wider, &f, path, 1, err, sizeof err) != 0 && strstr(err, "time_embed.0.weight is F32 [128,32], expected F32 [256,64]") != NULL);
    printf("  %s\n", err);
    safetensors_close(&f);

    check_case("checkpoint: a truncated file is refused with one line");
    CHECK(truncate(path, 1000) == 0);
    CHECK(safetensors_open(path, &f, err, sizeof err) != 0 && strchr(err, '\n') == NULL);
    printf("  %s\n", err);

    free(params.specs), free(wider.specs);
    snprintf(path, sizeof path, "rm -rf %s", run_dir);
    CHECK(system(path) == 0);
    return check_summary();
}
