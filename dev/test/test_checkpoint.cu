// test_checkpoint.cu: the trainer's checkpoint writer and resume checks on the CPU (train_unet.cu in
// library mode). A child process writes checkpoints of a small model in a loop and is killed with
// SIGKILL at chosen points inside a save: before and after each file, around the rename, and while
// an older checkpoint is pruned. The child stops at each such point until the parent lets it go on,
// so every point is reached on any disk, however slow. After every kill each checkpoint under a
// valid name must load with the content of its step. Also: a save onto an existing step, --keep,
// the safetensors files PyTorch reads (names, shapes, F32, metadata), resume's checks of the
// configuration, weights and training state, and the messages for mismatched or damaged files.
// Run folders: the lock, resumes from elsewhere, symlinks that pruning and --overwrite must not
// follow, the set-aside branch of an older resume, and a checkpoint read once by generate's API.
#include <signal.h>
#include <stdarg.h>
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

// check_resume with the run's training configuration resolved from its options, as main does.
static int resume_check(const Options *o, const ModelConfig *c, const ParamList *params, ResumePoint *rp, char *err, size_t err_len) {
    TrainConfig train = train_config(o);
    return check_resume(o, c, &train, params, rp, err, err_len);
}

// Parameter j of tensor i at step s: a value that says where it came from (plus an offset that
// tells two saves of one step apart).
static float pattern_offset = 0.0f;
static float pattern(int64_t s, int i, int64_t j) { return (float)(s * 1000003 + i * 7919 + j) * 1e-3f + pattern_offset; }

// Called on each checkpoint's metadata before it is written, when set (an older or newer format).
static void (*edit_metadata)(Metadata *m);

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
    if (edit_metadata) edit_metadata(&meta);
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

// Removes a key from a checkpoint's metadata, as an older format that did not record it.
static void meta_remove(Metadata *m, const char *key) {
    for (int i = 0; i < m->count; i++)
        if (strcmp(m->entries[i].key, key) == 0) {
            free((char *)m->entries[i].value);
            memmove(&m->entries[i], &m->entries[i + 1], (m->count - i - 1) * sizeof m->entries[0]);
            m->count--;
            return;
        }
}
static void without_attention_and_dropout(Metadata *m) {
    meta_remove(m, "num_heads"), meta_remove(m, "num_heads_upsample"), meta_remove(m, "dropout");
}
static void without_format_version(Metadata *m) { meta_remove(m, "format_version"); }
static void newer_format(Metadata *m) {
    meta_remove(m, "format_version");
    meta_add(m, "format_version", "%d", CHECKPOINT_FORMAT_VERSION + 1);
}

static void probe_lock(const void *run_dir) { lock_run_folder((const char *)run_dir, 0); }
static void take_lock(const void *run_dir) { lock_run_folder((const char *)run_dir, 1); }
static void check_folder(const void *o) { check_run_folder((const Options *)o); }

static int exists(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

// Runs a shell command built like printf; 0 if it exited 0.
static int shell(const char *fmt, ...) {
    char command[8192];
    va_list args;
    va_start(args, fmt);
    vsnprintf(command, sizeof command, fmt, args);
    va_end(args);
    return system(command);
}

// The child's side of the handshake: at each stage of a save, tell the parent and wait for it.
static int to_parent = -1, from_parent = -1;
static void stop_at_stage(const char *stage) {
    char c = stage[0];
    if (write(to_parent, &c, 1) != 1 || read(from_parent, &c, 1) != 1) _exit(3);
}

// The run-folder cases, in folders under `top`.
static void run_folder_cases(const char *top, const ParamList *params) {
    char a[4096], b[4096], victim[4096], path[4400], err[2048], out[4096];
    Options o = small_options(32);
    ModelConfig c = small_config(&o);

    check_case("run folder: one trainer at a time; the lock names its holder and dies with it");
    snprintf(a, sizeof a, "%s/locked", top);
    CHECK(mkdir(a, 0777) == 0);
    int ready[2], hold[2];
    CHECK(pipe(ready) == 0 && pipe(hold) == 0);
    pid_t holder = fork();
    if (holder == 0) {
        lock_run_folder(a, 1);
        char c = 1;
        if (write(ready[1], &c, 1) != 1 || read(hold[0], &c, 1) < 0) _exit(3);
        _exit(0);
    }
    char byte;
    CHECK(read(ready[0], &byte, 1) == 1);  // the holder has the lock
    char holder_text[64];
    snprintf(holder_text, sizeof holder_text, "(process %d holds train.lock)", (int)holder);
    CHECK(check_in_child(probe_lock, a, out, sizeof out) == 1 && strstr(out, "is in use by another trainer") && strstr(out, holder_text) &&
          check_lines(out) == 1);
    printf("  %s", out);
    CHECK(check_in_child(take_lock, a, out, sizeof out) == 1 && strstr(out, holder_text));
    Options dry = o;
    dry.run_dir = a, dry.dry_run = 1;
    CHECK(check_in_child(check_folder, &dry, out, sizeof out) == 1 && strstr(out, holder_text));  // --dry_run says so too
    kill(holder, SIGKILL);
    waitpid(holder, NULL, 0);
    CHECK(check_in_child(take_lock, a, out, sizeof out) == 0);  // the kernel released it: nothing stale to clean
    CHECK(check_in_child(probe_lock, a, out, sizeof out) == 0);

    check_case("run folder: a checkpoint from elsewhere starts a new run, in an empty or new folder only");
    snprintf(a, sizeof a, "%s/run_a", top);
    snprintf(b, sizeof b, "%s/run_b", top);
    CHECK(mkdir(a, 0777) == 0 && mkdir(b, 0777) == 0);
    write_step(a, params, 10, 0);
    write_step(b, params, 20, 0);
    snprintf(path, sizeof path, "%s/checkpoints/step_000000010", a);
    Options resume = o;
    resume.run_dir = b, resume.resume_checkpoint = path;
    CHECK(resume_from_elsewhere(&resume) == 1);
    CHECK(check_in_child(check_folder, &resume, out, sizeof out) == 1 && strstr(out, "is not a checkpoint of run folder") &&
          strstr(out, "holds another run") && check_lines(out) == 1);
    printf("  %s", out);
    char own[4400];
    snprintf(own, sizeof own, "%s/checkpoints/step_000000020/", b);  // a step of its own, trailing slash and all
    resume.resume_checkpoint = own;
    CHECK(resume_from_elsewhere(&resume) == 0 && check_in_child(check_folder, &resume, out, sizeof out) == 0);
    resume.resume_checkpoint = "latest";
    CHECK(resume_from_elsewhere(&resume) == 0);
    snprintf(own, sizeof own, "%s/checkpoints/step_000000005", b);  // a link under a step's name: elsewhere
    CHECK(symlink(path, own) == 0);
    resume.resume_checkpoint = own;
    CHECK(resume_from_elsewhere(&resume) == 1 && check_in_child(check_folder, &resume, out, sizeof out) == 1);
    unlink(own);
    char fresh[4096];
    snprintf(fresh, sizeof fresh, "%s/run_new", top);
    resume.run_dir = fresh, resume.resume_checkpoint = path;
    CHECK(resume_from_elsewhere(&resume) == 1 && check_in_child(check_folder, &resume, out, sizeof out) == 0);
    CHECK(mkdir(fresh, 0777) == 0 && check_in_child(check_folder, &resume, out, sizeof out) == 0);  // empty: fine too

    check_case("run folder: pruning and --overwrite remove symlinks as links, never what they point at");
    snprintf(victim, sizeof victim, "%s/victim", top);
    CHECK(mkdir(victim, 0777) == 0);
    write_step(victim, params, 5, 0);
    snprintf(path, sizeof path, "%s/checkpoints/step_000000005", victim);
    char run[4096];
    snprintf(run, sizeof run, "%s/linked", top);
    CHECK(mkdir(run, 0777) == 0);
    write_step(run, params, 7, 0);
    write_step(run, params, 8, 0);
    snprintf(own, sizeof own, "%s/checkpoints/step_000000001", run);  // the oldest name: --keep would prune it first
    CHECK(symlink(path, own) == 0);
    snprintf(own, sizeof own, "%s/checkpoints/step_000000002.tmp.1", run);  // a leftover's name
    CHECK(symlink(path, own) == 0);
    prune_checkpoints(run, 1);
    CHECK(verify_checkpoint(path, params, 5) == 0);
    CHECK(!exists(own));  // the leftover link was removed, as a link
    snprintf(own, sizeof own, "%s/checkpoints/step_000000001", run);
    CHECK(latest_checkpoint(run, out, sizeof out) == 0 && strstr(out, "step_000000008"));
    snprintf(own, sizeof own, "%s/samples", run);
    char target[4400];
    snprintf(target, sizeof target, "%s/checkpoints", victim);
    CHECK(symlink(target, own) == 0);  // samples/ as a link to another run's folder
    clear_run_folder(run);
    CHECK(verify_checkpoint(path, params, 5) == 0 && latest_checkpoint(victim, out, sizeof out) == 0);
    CHECK(!exists(own));
    snprintf(own, sizeof own, "%s/checkpoints", run);
    CHECK(shell("rm -rf %s && ln -s %s/checkpoints %s", own, victim, own) == 0);  // checkpoints/ itself a link
    prune_checkpoints(run, 1);
    CHECK(latest_checkpoint(run, out, sizeof out) != 0);  // not followed: no checkpoint there
    Options linked = o;
    linked.run_dir = run, linked.resume_checkpoint = "latest";
    CHECK(check_in_child(check_folder, &linked, out, sizeof out) == 1 && strstr(out, "symbolic link"));
    printf("  %s", out);
    float **model = (float **)malloc_or_die(params->count * sizeof(float *));
    for (int i = 0; i < params->count; i++) model[i] = (float *)calloc(params->specs[i].numel, sizeof(float));
    Metadata meta = checkpoint_metadata(&o, &c, 9);
    StateHeader h;
    memset(&h, 0, sizeof h);
    CheckpointData d = {9, params, model, 0, NULL, {0}, &meta, &h, NULL, 0};
    char saved[4400];
    CHECK(write_checkpoint(run, &d, 0, saved, sizeof saved, err, sizeof err) != 0 && strstr(err, "symbolic link") && !strchr(err, '\n'));
    printf("  %s\n", err);
    for (int i = 0; i < params->count; i++) free(model[i]);
    free(model);
    metadata_free(&meta);
    clear_run_folder(run);
    CHECK(!exists(own) && verify_checkpoint(path, params, 5) == 0);
    snprintf(own, sizeof own, "%s/link_to_run", top);
    CHECK(symlink(victim, own) == 0);
    linked.run_dir = own;
    CHECK(check_in_child(check_folder, &linked, out, sizeof out) == 1 && strstr(out, "is a symbolic link"));

    check_case("run folder: --overwrite removes the earlier run's log, config, loss.svg, fid.svg, grids and checkpoints, nothing else");
    snprintf(run, sizeof run, "%s/cleared", top);
    CHECK(mkdir(run, 0777) == 0);
    write_step(run, params, 10, 0);
    CHECK(shell("cd %s && mkdir samples && touch log.csv config.txt loss.svg fid.svg notes.txt samples/step_000000010.png "
                "samples/mine.png", run) == 0);
    clear_run_folder(run);
    const char *gone[] = {"log.csv", "config.txt", "loss.svg", "fid.svg", "samples/step_000000010.png", "checkpoints/step_000000010"};
    for (size_t i = 0; i < sizeof gone / sizeof gone[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", run, gone[i]);
        if (exists(path)) printf("  %s is left\n", path), check_case_failed = 1;
    }
    snprintf(path, sizeof path, "%s/notes.txt", run);
    CHECK(exists(path));
    snprintf(path, sizeof path, "%s/samples/mine.png", run);
    CHECK(exists(path));

    check_case("run folder: what lies in it, for --overwrite with --init_from: by name or by what a link leads to");
    snprintf(a, sizeof a, "%s/inside", top);
    snprintf(b, sizeof b, "%s/inside_not", top);  // a name that starts with the run folder's
    CHECK(shell("mkdir -p %s/checkpoints/step_000000010 %s && touch %s/w.pt %s/w.pt && ln -s %s/w.pt %s/out.pt && ln -s %s/w.pt %s/in.pt",
                a, b, a, b, a, b, b, a) == 0);
    snprintf(path, sizeof path, "%s/checkpoints/step_000000010/", a);
    CHECK(lies_in_folder(path, a) == 1 && lies_in_folder(a, a) == 1);
    snprintf(path, sizeof path, "%s/w.pt", b);
    CHECK(lies_in_folder(path, a) == 0);
    snprintf(path, sizeof path, "%s/out.pt", b);  // a link elsewhere to a file in it
    CHECK(lies_in_folder(path, a) == 1);
    snprintf(path, sizeof path, "%s/in.pt", a);  // a link in it to a file elsewhere: clearing could remove the link
    CHECK(lies_in_folder(path, a) == 1);
    snprintf(path, sizeof path, "%s/..", a);
    CHECK(lies_in_folder(path, a) == 0);
    snprintf(path, sizeof path, "%s/missing", top);
    CHECK(lies_in_folder(b, path) == 0);

    check_case("run folder: resuming an older step sets the later ones aside; latest is then the resumed step");
    snprintf(run, sizeof run, "%s/branch", top);
    CHECK(mkdir(run, 0777) == 0);
    for (int64_t s = 10; s <= 30; s += 10) write_step(run, params, s, 0);
    CHECK(set_aside_later_checkpoints(run, 10) == 2);
    CHECK(latest_checkpoint(run, out, sizeof out) == 0 && strstr(out, "step_000000010"));
    snprintf(path, sizeof path, "%s/checkpoints/step_000000030.abandoned", run);
    CHECK(verify_checkpoint(path, params, 30) == 0);
    write_step(run, params, 20, 1);  // the new branch goes on; --keep 1 prunes step 10, not the set-aside ones
    CHECK(set_aside_later_checkpoints(run, 10) == 1);  // back to 10 again (gone: nothing at or below it)
    snprintf(path, sizeof path, "%s/checkpoints/step_000000020.abandoned.2", run);
    CHECK(verify_checkpoint(path, params, 20) == 0);
    snprintf(path, sizeof path, "%s/checkpoints/step_000000020.abandoned", run);
    CHECK(verify_checkpoint(path, params, 20) == 0);
    CHECK(checkpoint_step("step_000000020.abandoned") == -1 && checkpoint_step("step_20") == -1 && checkpoint_step("step_000000020") == 20);

    check_case("resume: a key an older format did not record means its default; an unknown or newer format is refused");
    snprintf(run, sizeof run, "%s/older", top);
    CHECK(mkdir(run, 0777) == 0);
    edit_metadata = without_attention_and_dropout;
    write_step(run, params, 3, 0);
    ResumePoint rp;
    memset(&rp, 0, sizeof rp);
    CHECK(latest_checkpoint(run, rp.dir, sizeof rp.dir) == 0);
    CHECK(resume_check(&o, &c, params, &rp, err, sizeof err) == 0);  // the defaults: as the older format meant
    Options changed = o;
    changed.dropout = 0.1f, changed.num_heads = 8;
    ModelConfig changed_config = small_config(&changed);
    CHECK(resume_check(&changed, &changed_config, params, &rp, err, sizeof err) != 0 &&
          strstr(err, "--dropout 0.1 (checkpoint: not recorded, which means 0)") && strstr(err, "--num_heads 8 (checkpoint: not recorded, which means 4)"));
    printf("  %s\n", err);
    edit_metadata = newer_format;
    write_step(run, params, 3, 0);
    CHECK(resume_check(&o, &c, params, &rp, err, sizeof err) != 0 && strstr(err, "format_version '3'") && !strchr(err, '\n'));
    printf("  %s\n", err);
    edit_metadata = without_format_version;
    write_step(run, params, 3, 0);
    CHECK(resume_check(&o, &c, params, &rp, err, sizeof err) != 0 && strstr(err, "records no format_version"));
    edit_metadata = NULL;

    check_case("generate's checkpoint: mapped once, it keeps the step it opened when a trainer replaces or prunes it");
    snprintf(run, sizeof run, "%s/sampled", top);
    CHECK(mkdir(run, 0777) == 0);
    write_step(run, params, 4, 0);
    snprintf(path, sizeof path, "%s/checkpoints/step_000000004", run);
    UnetInfo info;
    UnetCheckpoint *ck = unet_checkpoint_open(path, "model", NULL, 0, &info, err, sizeof err);
    CHECK(ck && info.image_size == 8 && strstr(info.file, "step_000000004/model.safetensors"));
    pattern_offset = 0.5f;
    write_step(run, params, 4, 0);  // the same step saved again: replaced
    pattern_offset = 0.0f;
    write_step(run, params, 5, 1);  // and then pruned by --keep 1
    CHECK(!exists(path));
    int same = ck != NULL;
    for (int i = 0; same && i < params->count; i++) {
        const SafeTensor *t = safetensors_find(&ck->f, params->specs[i].name);
        float *v = (float *)malloc_or_die(t->numel * sizeof(float));
        same = safetensors_get_float(t, v) == 0;
        for (int64_t j = 0; same && j < t->numel; j++) same = v[j] == pattern(4, i, j);
        free(v);
    }
    CHECK(same);
    unet_checkpoint_close(ck);
    CHECK(!unet_checkpoint_open(path, "ema", NULL, 0, &info, err, sizeof err) && strstr(err, "cannot open checkpoint") && !strchr(err, '\n'));
    printf("  %s\n", err);
}

static void init_gpu_0(const void *) { gpu_init(0); }

// Every program that starts the GPU (the trainer, generate, the tests', dev/'s) does it through
// gpu_init: without a GPU or driver that is one error line in the program's own name. On a machine
// with a GPU there is nothing to see.
static void no_gpu_case(void) {
    char err[512], out[1024];
    if (gpu_available(err, sizeof err) == 0) return;
    check_case("without a GPU: starting it is one error line, in the program's own name, that says why");
    CHECK(check_in_child(init_gpu_0, NULL, out, sizeof out) == 1 && check_lines(out) == 1 &&
          strncmp(out, "test_checkpoint: error: no NVIDIA GPU or driver found", 53) == 0);
    printf("  %s", out);
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
    CHECK(resume_check(&o, &c, &params, &rp, err, sizeof err) == 0 && rp.step == step && rp.changes[0] == '\0');

    check_case("resume: a changed optimiser is allowed and said; a changed model or batch is refused, each difference named");
    Options changed = small_options(32);
    changed.lr = 2e-4f, changed.steps = 5000;
    ModelConfig changed_config = small_config(&changed);
    CHECK(resume_check(&changed, &changed_config, &params, &rp, err, sizeof err) == 0);
    CHECK(strstr(rp.changes, "--lr 0.0002 (checkpoint: 0.0001)") && strstr(rp.changes, "--steps 5000 (checkpoint: 100000)"));
    printf("  %s\n", rp.changes);
    changed = small_options(32);
    changed.num_heads = 8, changed.dropout = 0.25f, changed.batch_size = 16;
    changed_config = small_config(&changed);
    CHECK(resume_check(&changed, &changed_config, &params, &rp, err, sizeof err) != 0);
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
    CHECK(resume_check(&o, &c, &params, &rp, err, sizeof err) != 0 && strstr(err, "NaN or infinite") && !strchr(err, '\n'));
    printf("  %s\n", err);
    snprintf(path, sizeof path, "%s/checkpoints/step_%09lld/state.bin", run_dir, (long long)(step - 1));
    memset(&rp, 0, sizeof rp);
    snprintf(rp.dir, sizeof rp.dir, "%s/checkpoints/step_%09lld", run_dir, (long long)(step - 1));
    CHECK(resume_check(&o, &c, &params, &rp, err, sizeof err) == 0);
    CHECK(truncate(path, 200) == 0);
    CHECK(resume_check(&o, &c, &params, &rp, err, sizeof err) != 0 && strstr(err, "truncated") && !strchr(err, '\n'));
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
        if (system(copy) == 0 && resume_check(&o, &c, &params, &rp, err, sizeof err) != 0 && strstr(err, "state.bin") && !strchr(err, '\n'))
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

    run_folder_cases(run_dir, &params);
    no_gpu_case();
    free(params.specs), free(wider.specs);
    snprintf(path, sizeof path, "rm -rf %s", run_dir);
    CHECK(system(path) == 0);
    return check_summary();
}
