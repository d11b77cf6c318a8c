// test_checkpoint.cu: the trainer's checkpoint writer and resume checks on the CPU (train_unet.cu in
// library mode). A child process writes checkpoints of a small model in a loop and is killed with
// SIGKILL at chosen points inside a save: before and after each file, around the rename, and while
// an older checkpoint is pruned. The child stops at each such point until the parent lets it go on,
// so every point is reached on any disk, however slow. After every kill each checkpoint under a
// valid name must load with the content of its step. Also: a save onto an existing step, --keep,
// the safetensors files PyTorch reads (names, shapes, F32, metadata), resume's checks of the
// configuration, weights and training state, and the messages for mismatched or damaged files.
#include <signal.h>
#include <sys/wait.h>

#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

// The options of the small model every checkpoint here is of.
static Options small_options(int num_channels) {
    Options o = preset_seed();
    o.image_size = 8, o.num_channels = num_channels, o.channel_mult = "1,2", o.num_res_blocks = 1;
    o.attention_resolutions = "4", o.num_head_channels = 32, o.ema_rate = "0.9999,0.999";
    return o;
}

static ModelConfig small_config(Options *o) { return resolve_model(o, 0); }

// Parameter j of tensor i at step s: a value that says where it came from (plus an offset that
// tells two saves of one step apart).
static float pattern_offset = 0.0f;
static float pattern(int64_t s, int i, int64_t j) { return (float)(s * 1000003 + i * 7919 + j) * 1e-3f + pattern_offset; }

static void write_step(const char *run_dir, const ParamList *params, int64_t step, int keep) {
    Options o = small_options(32);
    ModelConfig c = small_config(&o);
    float **model = (float **)malloc_or_die(params->count * sizeof(float *)), **ema = (float **)malloc_or_die(params->count * sizeof(float *));
    for (int i = 0; i < params->count; i++) {
        model[i] = (float *)malloc_or_die(params->specs[i].numel * sizeof(float));
        ema[i] = (float *)malloc_or_die(params->specs[i].numel * sizeof(float));
        for (int64_t j = 0; j < params->specs[i].numel; j++) model[i][j] = pattern(step, i, j), ema[i][j] = -pattern(step, i, j);
    }
    ParamList layout = model_parameters(&c);  // the GPU layout's length, as the trainer saves it
    int64_t emb_bias_offset, storage = param_offsets(&layout, &emb_bias_offset);
    free(layout.specs);
    Metadata meta = checkpoint_metadata(&o, &c, step);
    StateHeader h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, STATE_MAGIC, 8);
    h.version = STATE_VERSION, h.num_params = params->count, h.step = step, h.storage = storage;
    h.seed = o.seed, h.batch_size = o.batch_size, h.diffusion_steps = o.diffusion_steps;
    snprintf(h.noise_schedule, sizeof h.noise_schedule, "%s", o.noise_schedule);
    snprintf(h.predict, sizeof h.predict, "%s", o.predict);
    float *moments = (float *)calloc(2 * storage, sizeof(float));
    float rates[2] = {0.9999f, 0.999f};
    CheckpointData d = {step, params, model, 2, rates, {ema, ema}, &meta, &h, moments, 2 * storage * sizeof(float)};
    char saved[4400], err[512];
    if (write_checkpoint(run_dir, &d, keep, saved, sizeof saved, err, sizeof err) != 0) fatal("%s", err);
    for (int i = 0; i < params->count; i++) free(model[i]), free(ema[i]);
    free(model), free(ema), free(moments);
    metadata_free(&meta);
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
    MappedFile m;
    StateHeader h;
    memset(&h, 0, sizeof h);
    int ok = map_regular_file(path, "training state", &m, err, sizeof err) == 0 && state_check(m.bytes, m.size, &h, err, sizeof err) == 0 &&
             h.step == step;
    unmap_file(&m);
    return ok ? 0 : (printf("  %s is damaged\n", path), -1);
}

// Every folder under a valid checkpoint name verified; the count of them, or -1 if one fails.
static int verify_all_checkpoints(const char *run_dir, const ParamList *params) {
    char dir[4096], path[4400];
    snprintf(dir, sizeof dir, "%s/checkpoints", run_dir);
    DIR *d = opendir(dir);
    int count = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        int64_t step = checkpoint_step(e->d_name);
        if (step < 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (verify_checkpoint(path, params, step) != 0) count = -1;
        else if (count >= 0) count++;
    }
    if (d) closedir(d);
    return count;
}

// The child's side of the handshake: at each stage of a save, tell the parent and wait for it.
static int to_parent = -1, from_parent = -1;
static void stop_at_stage(const char *stage) {
    char c = stage[0];
    if (write(to_parent, &c, 1) != 1 || read(from_parent, &c, 1) != 1) _exit(3);
}

int main(void) {
    char run_dir[] = "/tmp/test_checkpoint_XXXXXX";
    if (!mkdtemp(run_dir)) fatal("mkdtemp failed");
    Options o = small_options(32);
    ModelConfig c = small_config(&o);
    ParamList params = model_parameters(&c);

    check_case("checkpoint: the files hold guided-diffusion's names, shapes, F32 and the configuration");
    write_step(run_dir, &params, 7, 0);
    char dir[4096];
    CHECK(latest_checkpoint(run_dir, dir, sizeof dir) == 0 && strstr(dir, "step_000000007"));
    CHECK(verify_checkpoint(dir, &params, 7) == 0);
    SafeTensorsFile f;
    char path[4400], err[2048];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK(safetensors_open(path, &f, err, sizeof err) == 0);
    const char *keys[] = {"image_size", "num_channels", "channel_mult", "attention_resolutions", "use_scale_shift_norm",
                          "num_head_channels", "class_cond", "conv_resample", "learn_sigma", "format_version", "lr", "ema_rates"};
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) CHECK(safetensors_metadata(&f, keys[k]) != NULL);
    CHECK(strcmp(safetensors_metadata(&f, "attention_resolutions"), "4") == 0);
    CHECK(strcmp(safetensors_metadata(&f, "use_scale_shift_norm"), "False") == 0);
    CHECK(strcmp(safetensors_metadata(&f, "lr"), "0.0001") == 0);
    ModelConfig back;  // the metadata rebuilds the same model
    CHECK(model_config_from_metadata(&f, path, &back, err, sizeof err) == 0 && memcmp(&back, &c, sizeof c) == 0);
    safetensors_close(&f);

    check_case("checkpoint: a save onto an existing step replaces it whole");
    pattern_offset = 0.5f;
    write_step(run_dir, &params, 7, 0);
    CHECK(verify_checkpoint(dir, &params, 7) == 0);
    pattern_offset = 0.0f;
    write_step(run_dir, &params, 7, 0);
    CHECK(verify_checkpoint(dir, &params, 7) == 0);
    CHECK(verify_all_checkpoints(run_dir, &params) == 1);

    check_case("checkpoint: SIGKILL at every stage of a save or a pruning leaves every checkpoint loadable");
    // Round r lets the child pass r % 40 stages, then kills it at the next: the first rounds stop
    // inside the first save (which replaces the latest step), later ones inside the second or third
    // save, and inside the removal of the oldest checkpoint that --keep 3 prunes.
    int64_t step = 7;
    int kills = 0, verified = 0, stages_seen = 0;
    for (int round = 0; round < 80; round++) {
        int up[2], down[2];
        if (pipe(up) != 0 || pipe(down) != 0) fatal("pipe failed");
        pid_t child = fork();
        if (child == 0) {
            close(up[0]), close(down[1]);
            to_parent = up[1], from_parent = down[0];
            checkpoint_stage_hook = stop_at_stage;
            for (int64_t s = step;; s++) write_step(run_dir, &params, s, 3);
        }
        close(up[1]), close(down[0]);
        char stage, go = 1;
        int passed = 0, alive = 1;
        for (; alive && passed <= round % 40; passed++) {
            alive = read(up[0], &stage, 1) == 1;
            if (alive && passed < round % 40) alive = write(down[1], &go, 1) == 1;
        }
        CHECK(alive);  // the child reached the stage to be killed at
        stages_seen += passed;
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        close(up[0]), close(down[1]);
        kills++;
        CHECK(latest_checkpoint(run_dir, dir, sizeof dir) == 0);
        int64_t latest = checkpoint_step(strrchr(dir, '/') + 1);
        CHECK(latest >= step);
        if (verify_all_checkpoints(run_dir, &params) > 0) verified++;
        step = latest;
    }
    printf("  %d kills after %d stages in all, every checkpoint verified after %d, last step %lld\n", kills, stages_seen, verified,
           (long long)step);
    CHECK(verified == kills);
    CHECK(step > 9);

    check_case("checkpoint: --keep keeps the newest, and what crashed saves and removals left is deleted");
    prune_checkpoints(run_dir, 2);
    snprintf(path, sizeof path, "%s/checkpoints", run_dir);
    DIR *d = opendir(path);
    int complete = 0, leftovers = 0;
    struct dirent *e;
    while ((e = readdir(d))) complete += checkpoint_step(e->d_name) >= 0, leftovers += strstr(e->d_name, ".tmp.") || strstr(e->d_name, ".del.");
    closedir(d);
    CHECK(complete == 2 && leftovers == 0);

    check_case("checkpoint: metadata values are stored whole, however long");
    Options long_values = small_options(32);
    long_values.channel_mult = "1.0000000000000000000000000000000000000000000000000000000000000000000000,2";
    ModelConfig long_config = small_config(&long_values);
    Metadata meta = checkpoint_metadata(&long_values, &long_config, 1);
    int found = 0;
    for (int i = 0; i < meta.count; i++)
        found += strcmp(meta.entries[i].key, "channel_mult") == 0 && strcmp(meta.entries[i].value, long_values.channel_mult) == 0;
    CHECK(found == 1);
    metadata_free(&meta);

    check_case("resume: the latest checkpoint of the same configuration passes every check");
    ResumePoint rp;
    memset(&rp, 0, sizeof rp);
    CHECK(latest_checkpoint(run_dir, rp.dir, sizeof rp.dir) == 0);
    CHECK(check_resume(&o, &c, &params, &rp, err, sizeof err) == 0 && rp.step == step && rp.changes[0] == '\0');

    check_case("resume: a changed optimiser is allowed and said; a changed model or batch is refused, each difference named");
    Options changed = small_options(32);
    changed.lr = 2e-4f, changed.steps = 5000;
    ModelConfig changed_config = small_config(&changed);
    CHECK(check_resume(&changed, &changed_config, &params, &rp, err, sizeof err) == 0);
    CHECK(strstr(rp.changes, "--lr 0.0002 (checkpoint: 0.0001)") && strstr(rp.changes, "--steps 5000 (checkpoint: 100000)"));
    printf("  %s\n", rp.changes);
    changed = small_options(32);
    changed.num_heads = 8, changed.dropout = 0.25f, changed.batch_size = 16;
    changed_config = small_config(&changed);
    CHECK(check_resume(&changed, &changed_config, &params, &rp, err, sizeof err) != 0);
    CHECK(strstr(err, "--num_heads 8 (checkpoint: 4)") && strstr(err, "--dropout 0.25 (checkpoint: 0)") &&
          strstr(err, "--batch_size 16 (checkpoint: 32)") && !strchr(err, '\n'));
    printf("  %s\n", err);

    check_case("resume: damaged weights or training state are refused with one line");
    snprintf(path, sizeof path, "%s/ema.safetensors", rp.dir);
    FILE *file = fopen(path, "r+b");  // the first value of the first tensor becomes NaN
    SafeTensorsFile ema;
    CHECK(file && safetensors_open(path, &ema, err, sizeof err) == 0);
    long first_value = (long)(ema.tensors[0].data - ema.file.bytes);
    for (int i = 1; i < ema.count; i++)
        if (ema.tensors[i].data - ema.file.bytes < first_value) first_value = (long)(ema.tensors[i].data - ema.file.bytes);
    safetensors_close(&ema);
    float nan_value = NAN;
    CHECK(fseek(file, first_value, SEEK_SET) == 0 && fwrite(&nan_value, 4, 1, file) == 1 && fclose(file) == 0);
    CHECK(check_resume(&o, &c, &params, &rp, err, sizeof err) != 0 && strstr(err, "NaN or infinite") && !strchr(err, '\n'));
    printf("  %s\n", err);
    snprintf(path, sizeof path, "%s/checkpoints/step_%09lld/state.bin", run_dir, (long long)(step - 1));
    memset(&rp, 0, sizeof rp);
    snprintf(rp.dir, sizeof rp.dir, "%s/checkpoints/step_%09lld", run_dir, (long long)(step - 1));
    CHECK(check_resume(&o, &c, &params, &rp, err, sizeof err) == 0);
    CHECK(truncate(path, 200) == 0);
    CHECK(check_resume(&o, &c, &params, &rp, err, sizeof err) != 0 && strstr(err, "truncated") && !strchr(err, '\n'));
    printf("  %s\n", err);

    check_case("resume: every bad training state of the corpus, put in a checkpoint, is refused with one line");
    snprintf(path, sizeof path, "%s/checkpoints/step_%09lld/state.bin", run_dir, (long long)(step - 1));
    snprintf(rp.dir, sizeof rp.dir, "%s/checkpoints/step_%09lld", run_dir, (long long)(step - 1));
    d = opendir("dev/test/corpus/state");
    int refused = 0, files = 0;
    while (d && (e = readdir(d))) {
        if (strncmp(e->d_name, "bad_", 4) != 0) continue;
        char copy[4096 + 600];
        snprintf(copy, sizeof copy, "cp dev/test/corpus/state/%s %s", e->d_name, path);
        files++;
        if (system(copy) == 0 && check_resume(&o, &c, &params, &rp, err, sizeof err) != 0 && strstr(err, "state.bin") && !strchr(err, '\n'))
            refused++;
        else
            printf("  %s was not refused with one line naming state.bin\n", e->d_name);
    }
    if (d) closedir(d);
    CHECK(files > 10 && refused == files);

    check_case("checkpoint: a file of another model is refused naming what differs");
    Options wide_options = small_options(64);
    ModelConfig wide = small_config(&wide_options);
    ParamList wider = model_parameters(&wide);
    snprintf(path, sizeof path, "%s/model.safetensors", rp.dir);
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
