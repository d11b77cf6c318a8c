// checkpoints.cuh: the trainer's checkpoints: folders of safetensors with the configuration in their
// metadata, saving and exact resuming, and the architecture of a .pt without metadata inferred from
// its tensors. checkpoint.h reads the files as untrusted input; this is built on the model, so
// train_unet.cu includes it after the model, the trainer and the sampler (one translation unit).

// ----------------------------------------------------------------------------------------------
// Checkpoint files. A checkpoint is a folder holding model.safetensors (the fp32 weights under
// guided-diffusion's state_dict names and shapes, the configuration in __metadata__ under its flag
// names), ema.safetensors (the first EMA rate; ema_<rate>.safetensors for the others) and
// state.bin (everything else an exact resume needs); checkpoint.h writes and reads safetensors,
// and reads state.bin. The folder is written under a temporary
// name, every file and the folder synced, then renamed: a crash leaves the previous checkpoint
// the latest complete one.

// A parameter array as the tensors of a safetensors file (values: host, PyTorch layouts).
static int write_parameters(const char *path, const ParamList *params, float *const *values, const MetaPair *meta,
                            int meta_count) {
    SafeTensorOut *tensors = (SafeTensorOut *)malloc_or_die(params->count * sizeof(SafeTensorOut));
    for (int i = 0; i < params->count; i++) {
        const ParamSpec *p = &params->specs[i];
        SafeTensorOut t = {p->name, p->ndim, p->shape, p->numel, values[i]};
        tensors[i] = t;
    }
    int r = safetensors_write(path, tensors, params->count, meta, meta_count);
    free(tensors);
    return r;
}

// The configuration under guided-diffusion's flag names, spelled as on its command line, each
// value a heap string of any length (metadata_free releases them).
#define MAX_METADATA 64

typedef struct {
    MetaPair entries[MAX_METADATA];
    int count;
} Metadata;

static void meta_add(Metadata *m, const char *key, const char *fmt, ...) {
    if (m->count == MAX_METADATA) fatal("internal error: more than %d metadata entries", MAX_METADATA);
    va_list args;
    va_start(args, fmt);
    char *value;
    if (vasprintf(&value, fmt, args) < 0) fatal("out of host memory");
    va_end(args);
    m->entries[m->count].key = key;
    m->entries[m->count].value = value;
    m->count++;
}

static void metadata_free(Metadata *m) {
    for (int i = 0; i < m->count; i++) free((char *)m->entries[i].value);
    m->count = 0;
}

// A float as the shortest %g text that reads back as the same float (1e-4 stays "0.0001").
static const char *float_text(float v, char *buf, size_t len) {
    for (int digits = 6; digits <= 9; digits++) {
        snprintf(buf, len, "%.*g", digits, v);
        if (strtof(buf, NULL) == v) break;
    }
    return buf;
}

// Format 2 adds the training configuration (the keys after "predict") for resume to compare.
// A whole number written as decimal digits and nothing else (a step, a format version); -1 for
// anything else.
static int64_t whole_number(const char *p) {
    int64_t n = 0;
    if (!*p) return -1;
    for (; *p; p++) {
        if (*p < '0' || *p > '9' || n > (INT64_MAX - 9) / 10) return -1;
        n = 10 * n + (*p - '0');
    }
    return n;
}

#define CHECKPOINT_FORMAT_VERSION 2

// An option's value in the metadata: as the command line spells it, a float in the fewest digits
// that read back as the same float.
static void meta_add_option(Metadata *m, const Options *o, const OptionSpec *s) {
    const char *value = (const char *)o + s->offset, *key = metadata_key(s);
    char buf[32];
    switch (s->type) {
    case OPT_INT: meta_add(m, key, "%d", *(const int *)value); break;
    case OPT_LONG: meta_add(m, key, "%lld", *(const long long *)value); break;
    case OPT_FLOAT: meta_add(m, key, "%s", float_text(*(const float *)value, buf, sizeof buf)); break;
    case OPT_BOOL:
    case OPT_SWITCH: meta_add(m, key, "%s", *(const int *)value ? "True" : "False"); break;
    case OPT_STRING: meta_add(m, key, "%s", *(const char *const *)value); break;
    }
}

// The configuration a checkpoint records: every MODEL, KEPT and TUNABLE option of the option table,
// in its order, under guided-diffusion's names, as model c resolved them (num_classes: its label
// rows, or a classifier's logits; classifier_pool: its head, "" for the UNet; batch_size: the images
// a step on all the GPUs); an upsampler's sizes as guided-diffusion's large_size and small_size
// (other models have neither); and null_class (the last label row is classifier-free guidance's
// null class).
static Metadata checkpoint_metadata(const Options *o, const ModelConfig *c, int64_t step) {
    Metadata m;
    memset(&m, 0, sizeof m);
    meta_add(&m, "format", "unet.cu checkpoint");
    meta_add(&m, "format_version", "%d", CHECKPOINT_FORMAT_VERSION);
    meta_add(&m, "step", "%lld", (long long)step);
    Options v = *o;
    v.image_size = c->image_size, v.num_channels = c->model_channels, v.num_res_blocks = c->num_res_blocks;
    v.num_heads = c->num_heads, v.num_head_channels = c->num_head_channels, v.num_heads_upsample = c->num_heads_upsample;
    v.use_scale_shift_norm = c->use_scale_shift_norm, v.resblock_updown = c->resblock_updown;
    v.use_new_attention_order = c->use_new_attention_order, v.conv_resample = c->conv_resample, v.dropout = c->dropout;
    v.class_cond = c->num_classes > 0, v.num_classes = c->pool ? c->out_channels : c->num_classes, v.learn_sigma = c->learn_sigma;
    v.classifier_pool = pool_names[c->pool], v.super_res = c->low_res, v.batch_size = o->batch_size * o->gpus;
    for (int i = 0; i < NUM_OPTIONS; i++) {
        const OptionSpec *s = &option_specs[i];
        int super_res = s->offset == offsetof(Options, super_res);
        if (!(s->group & IN_METADATA) || (super_res && !c->low_res)) continue;
        if (super_res) meta_add(&m, "large_size", "%d", c->image_size);
        meta_add_option(&m, &v, s);
        if (s->offset == offsetof(Options, num_classes)) meta_add(&m, "null_class", "%s", c->num_classes > 0 ? "True" : "False");
    }
    return m;
}

// A key's value in metadata m, or NULL.
static const char *metadata_value(const Metadata *m, const char *key) {
    for (int i = 0; i < m->count; i++)
        if (strcmp(m->entries[i].key, key) == 0) return m->entries[i].value;
    return NULL;
}

// What resume allows to differ between the checkpoint's configuration and this run's: nothing of
// the model (MODEL: its weights would not fit, or would mean another function; an upsampler's sizes
// and the null class with them), nothing that fixes the data, noise or EMA streams (KEPT: batch,
// seed, diffusion, EMA rates), and anything of the optimiser and its schedule (TUNABLE, said when
// it differs).
static int resume_may_change(const char *key) {
    if (strcmp(key, "null_class") == 0 || strcmp(key, "large_size") == 0) return 0;
    for (int i = 0; i < NUM_OPTIONS; i++)
        if (strcmp(key, metadata_key(&option_specs[i])) == 0) return !(option_specs[i].group & (MODEL | KEPT));
    return 1;
}

// Appends "--key A (checkpoint B)" to a list of at most len bytes, "..." when it is full. With more
// than one GPU, batch_size (the images a step on all of them) is named as such.
static void append_difference(char *list, size_t len, const char *key, const char *now, const char *then, int gpus) {
    size_t at = strlen(list);
    if (at + 4 >= len) return;
    const char *label = gpus > 1 && strcmp(key, "batch_size") == 0 ? "images a step (--batch_size times --gpus)" : key;
    int n = snprintf(list + at, len - at, "%s%s%s %s (checkpoint: %s)", at ? ", " : "", label == key ? "--" : "", label, now, then);
    if (n < 0 || (size_t)n >= len - at) snprintf(list + (len > 4 ? len - 4 : 0), len > 4 ? 4 : len, "...");
}

// Compares this run's configuration (its metadata `now`) with the one a checkpoint was trained
// with. A key the checkpoint does not hold was not recorded by the older format that wrote it: it
// stands for the value that format meant, this trainer's default (so a checkpoint without its
// dropout or attention keys resumes only with the default values). Differences that resume may not
// make refuse, each named; the others are listed in changes. Returns 0, or -1.
static int compare_with_checkpoint(const SafeTensorsFile *f, const char *path, const Metadata *now, int gpus, char *changes,
                                   size_t changes_len, char *err, size_t err_len) {
    Options default_options = preset_seed();
    ModelConfig default_config;
    char refused[768] = "", why[256], unrecorded[160];
    if (model_config_from_options(&default_options, 0, &default_config, why, sizeof why) != 0) fatal("the default model: %s", why);
    Metadata defaults = checkpoint_metadata(&default_options, &default_config, 0);
    changes[0] = '\0';
    for (int i = 0; i < now->count; i++) {
        const char *key = now->entries[i].key, *then = safetensors_metadata(f, key), *meant = metadata_value(&defaults, key);
        if (strcmp(key, "step") == 0 || strncmp(key, "format", 6) == 0) continue;
        if (!then) {
            snprintf(unrecorded, sizeof unrecorded, "not recorded, which means %s", meant ? meant : "none");
            if (meant && strcmp(now->entries[i].value, meant) == 0) continue;
            then = unrecorded;
        }
        if (strcmp(then, now->entries[i].value) == 0) continue;
        if (resume_may_change(key)) append_difference(changes, changes_len, key, now->entries[i].value, then, gpus);
        else append_difference(refused, sizeof refused, key, now->entries[i].value, then, gpus);
    }
    metadata_free(&defaults);
    if (refused[0])
        return error_line(err, err_len, "%s was trained with another configuration: %s; resume with the checkpoint's values", path, refused);
    return 0;
}

// The checkpoint format versions this trainer reads: 1 (no optimiser keys, no null_class) to
// CHECKPOINT_FORMAT_VERSION. A file without format_version, or of a newer or unknown version, is
// refused: its keys may mean what this trainer does not know. Returns 0, or -1 with a message.
static int check_format_version(const SafeTensorsFile *f, const char *path, char *err, size_t err_len) {
    const char *version = safetensors_metadata(f, "format_version");
    int64_t v = version ? whole_number(version) : -1;
    if (!version) return error_line(err, err_len, "%s records no format_version: not a checkpoint this trainer can resume", path);
    if (v < 1 || v > CHECKPOINT_FORMAT_VERSION)
        return error_line(err, err_len, "%s is of checkpoint format_version '%s'; this trainer reads versions 1 to %d (a newer "
                            "trainer wrote it?)", path, version, CHECKPOINT_FORMAT_VERSION);
    return 0;
}

// ----------------------------------------------------------------------------------------------
// Checkpoints: DIR/checkpoints/step_NNNNNNNNN/{model.safetensors, ema.safetensors,
// ema_<rate>.safetensors..., state.bin}; checkpoint.h defines state.bin and reads both formats.

// A parameter array in the GPU layout ([storage] fp32 on the GPU) as host tensors in PyTorch
// layouts, one malloc'd array per parameter (freed by free_tensors).
static float **download_tensors(const UNet *m, const float *array) {
    float **values = (float **)malloc_or_die(m->params.count * sizeof(float *));
    float *staged = (float *)malloc_or_die(m->storage * sizeof(float));
    cuda_check(cudaMemcpy(staged, array, m->storage * sizeof(float), cudaMemcpyDeviceToHost));
    for (int i = 0; i < m->params.count; i++) {
        const ParamSpec *p = &m->params.specs[i];
        values[i] = (float *)malloc_or_die(p->numel * sizeof(float));
        param_layout(p, staged + p->offset, values[i], 0);
    }
    free(staged);
    return values;
}

static void free_tensors(const UNet *m, float **values) {
    for (int i = 0; i < m->params.count; i++) free(values[i]);
    free(values);
}

// ema.safetensors holds the first EMA rate, ema_<rate>.safetensors each other.
static void ema_file_name(char *out, size_t len, const char *dir, const float *rates, int i) {
    if (i == 0) snprintf(out, len, "%s/ema.safetensors", dir);
    else snprintf(out, len, "%s/ema_%g.safetensors", dir, rates[i]);
}

// A save stops here between its steps when a test asks it to (dev/test/test_checkpoint.cu kills the
// writer at each of these points); NULL in every program.
static void (*checkpoint_stage_hook)(const char *stage);
static void checkpoint_stage(const char *stage) {
    if (checkpoint_stage_hook) checkpoint_stage_hook(stage);
}

// Run folders are changed only through handles that no symlink can redirect: the run folder and
// its checkpoints/ are opened with O_NOFOLLOW | O_DIRECTORY, and what is in them is renamed or
// deleted relative to those handles (renameat, unlinkat), never by a path. A symlink found there is
// removed as a link or left alone, never followed into another run's files.

// Opens folder `name` of `parent` (a handle, or AT_FDCWD) without following a symlink at its last
// component. Returns the handle, or -1 with errno set (ELOOP or ENOTDIR when `name` is a link).
static int open_folder(int parent, const char *name) {
    return openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

// A listing of an open folder, through a handle of its own (closedir leaves `folder` open).
static DIR *list_folder(int folder) {
    int fd = openat(folder, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d && fd >= 0) close(fd);
    return d;
}

// RUN/checkpoints, opened as open_folder does both parts: the handle, or -1 with errno set.
static int open_checkpoints(const char *run_dir) {
    int run = open_folder(AT_FDCWD, run_dir);
    if (run < 0) return -1;
    int fd = open_folder(run, "checkpoints"), e = errno;
    close(run);
    errno = e;
    return fd;
}

// Deletes folder `name` of `parent` and the files in it. A symlink, in it or as `name` itself, is
// removed as a link.
static void delete_folder(int parent, const char *name) {
    int fd = open_folder(parent, name);
    if (fd < 0) {
        if (errno == ELOOP || errno == ENOTDIR) unlinkat(parent, name, 0);
        return;
    }
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        unlinkat(fd, e->d_name, 0);
        checkpoint_stage("deleting");
    }
    closedir(d);
    unlinkat(parent, name, AT_REMOVEDIR);
}

// Removes complete checkpoint `name` of the checkpoints folder: first renamed to NAME.del.PID
// (synced), so that a crash while its files are deleted never leaves a half checkpoint under a
// valid name.
static void remove_checkpoint(int checkpoints, const char *name) {
    char doomed[300];
    snprintf(doomed, sizeof doomed, "%.255s.del.%d", name, (int)getpid());
    if (renameat(checkpoints, name, checkpoints, doomed) != 0) return;
    fsync(checkpoints);
    checkpoint_stage("renamed for deletion");
    delete_folder(checkpoints, doomed);
}

// The step of a complete checkpoint's folder name, exactly as the trainer writes it
// ("step_000000100", at least 9 digits, no other leading zeros), or -1 for anything else: a save
// in progress is step_N.tmp.PID, a removal step_N.del.PID, an abandoned branch step_N.abandoned.
static int64_t checkpoint_step(const char *name) {
    int64_t step = strncmp(name, "step_", 5) == 0 ? whole_number(name + 5) : -1;
    char canonical[32];
    snprintf(canonical, sizeof canonical, "step_%09lld", (long long)step);
    return step >= 0 && strcmp(name, canonical) == 0 ? step : -1;
}

// The steps of the complete checkpoints in an open checkpoints folder (folders under a valid name;
// a symlink is none), in increasing order, into *out (malloc'd); returns their count.
static int list_checkpoints(int checkpoints, int64_t **out) {
    int64_t *steps = NULL;
    int count = 0, capacity = 0;
    DIR *d = list_folder(checkpoints);
    struct dirent *e;
    struct stat st;
    while (d && (e = readdir(d))) {
        int64_t step = checkpoint_step(e->d_name);
        if (step < 0 || fstatat(checkpoints, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode)) continue;
        if (count == capacity && !(steps = (int64_t *)realloc(steps, (capacity = 2 * capacity + 64) * sizeof *steps)))
            fatal("out of host memory");
        steps[count++] = step;
    }
    if (d) closedir(d);
    if (count) qsort(steps, count, sizeof *steps, compare_int64);
    *out = steps;
    return count;
}

// The latest complete checkpoint under run_dir/checkpoints into out; 0 if found.
static int latest_checkpoint(const char *run_dir, char *out, size_t len) {
    int checkpoints = open_checkpoints(run_dir);
    if (checkpoints < 0) return -1;
    int64_t *steps;
    int count = list_checkpoints(checkpoints, &steps);
    if (count) snprintf(out, len, "%.3500s/checkpoints/step_%09lld", run_dir, (long long)steps[count - 1]);
    free(steps);
    close(checkpoints);
    return count ? 0 : -1;
}

// Keeps the newest `keep` complete checkpoints (0: all) and deletes what crashed saves and
// removals left behind (step_N.tmp.PID, step_N.del.PID).
static void prune_checkpoints(const char *run_dir, int keep) {
    int checkpoints = open_checkpoints(run_dir);
    if (checkpoints < 0) return;
    DIR *d = list_folder(checkpoints);
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strncmp(e->d_name, "step_", 5) == 0 && (strstr(e->d_name, ".tmp.") || strstr(e->d_name, ".del.")))
            delete_folder(checkpoints, e->d_name);
    if (d) closedir(d);
    int64_t *steps;
    int count = list_checkpoints(checkpoints, &steps);
    char name[64];
    for (int i = 0; keep > 0 && i < count - keep; i++) {
        snprintf(name, sizeof name, "step_%09lld", (long long)steps[i]);
        remove_checkpoint(checkpoints, name);
    }
    free(steps);
    close(checkpoints);
}

// Resuming step `step` of a run abandons the checkpoints it saved after that step: each is renamed
// step_N.abandoned (.abandoned.2, .3, ... when the name is taken) and said on stdout, so that
// `latest` and --keep see only the run being continued. Returns how many were set aside.
static int set_aside_later_checkpoints(const char *run_dir, int64_t step) {
    int checkpoints = open_checkpoints(run_dir);
    if (checkpoints < 0) return 0;
    int64_t *steps;
    int count = list_checkpoints(checkpoints, &steps), moved = 0;
    for (int i = 0; i < count; i++) {
        if (steps[i] <= step) continue;
        char name[64], aside[96];
        snprintf(name, sizeof name, "step_%09lld", (long long)steps[i]);
        for (int k = 1; k < 1000; k++) {
            snprintf(aside, sizeof aside, k == 1 ? "%s.abandoned" : "%s.abandoned.%d", name, k);
            if (renameat2(checkpoints, name, checkpoints, aside, RENAME_NOREPLACE) == 0) break;
            if (errno != EEXIST) fatal("cannot rename %s/checkpoints/%s: %s", run_dir, name, strerror(errno));
        }
        printf("resume: set aside %s/checkpoints/%s as %s (a later step of the branch the resume abandons)\n", run_dir, name, aside);
        moved++;
    }
    if (moved) fsync(checkpoints);
    free(steps);
    close(checkpoints);
    return moved;
}

// Everything a checkpoint holds, on the host: the weights and each EMA in PyTorch layouts, the
// metadata, the training state.
typedef struct {
    int64_t step;
    const ParamList *params;
    float **model;
    int num_ema;
    const float *ema_rates;
    float **ema[8];
    const Metadata *meta;
    const StateHeader *header;
    const float *moments;  // AdamW m then v, [2][storage]
    size_t moments_bytes;
    const LossHistory *history;  // the schedule sampler's, when header->history_steps (else NULL)
} CheckpointData;

// Puts complete folder `tmp` of the checkpoints folder in place as `name`, replacing a checkpoint
// of the same step atomically (renameat2's RENAME_EXCHANGE swaps the two; the old one, now under
// the temporary name, is then deleted). On a file system without the exchange, the old one is
// renamed away first: a crash between the two renames leaves the step missing, and the previous
// checkpoint the latest.
static int put_in_place(int checkpoints, const char *tmp, const char *name) {
    if (renameat(checkpoints, tmp, checkpoints, name) == 0) return 0;
    if (errno != ENOTEMPTY && errno != EEXIST && errno != ENOTDIR) return -1;
    if (renameat2(checkpoints, tmp, checkpoints, name, RENAME_EXCHANGE) == 0) {
        checkpoint_stage("exchanged");
        delete_folder(checkpoints, tmp);
        return 0;
    }
    char old[300];
    snprintf(old, sizeof old, "%.255s.del.%d", name, (int)getpid());
    if (renameat(checkpoints, name, checkpoints, old) != 0 || renameat(checkpoints, tmp, checkpoints, name) != 0) return -1;
    delete_folder(checkpoints, old);
    return 0;
}

// Writes run_dir/checkpoints/step_NNNNNNNNN under a temporary name, syncs every file and the folder,
// puts it in place (replacing one of the same step) and syncs its parent; then keeps the newest
// `keep`. Returns 0, or -1 with a message (and nothing left behind but the previous checkpoints).
static int write_checkpoint(const char *run_dir, const CheckpointData *d, int keep, char *saved, size_t saved_len, char *err,
                            size_t err_len) {
    char folder[4096], name[64], tmp_name[96], tmp[4300], path[4400];
    snprintf(folder, sizeof folder, "%s/checkpoints", run_dir);
    if (make_dir_synced(folder) != 0) return error_line(err, err_len, "cannot create %s: %s", folder, strerror(errno));
    int checkpoints = open_checkpoints(run_dir);
    if (checkpoints < 0)
        return error_line(err, err_len, "cannot open %s: %s", folder,
                            errno == ELOOP || errno == ENOTDIR ? "it (or the run folder) is a symbolic link, which could lead into another run"
                                                               : strerror(errno));
    snprintf(name, sizeof name, "step_%09lld", (long long)d->step);
    snprintf(tmp_name, sizeof tmp_name, "%s.tmp.%d", name, (int)getpid());
    snprintf(tmp, sizeof tmp, "%s/%s", folder, tmp_name);
    delete_folder(checkpoints, tmp_name);  // a save of this step by this process that failed before
    if (mkdirat(checkpoints, tmp_name, 0777) != 0) {
        int e = errno;
        close(checkpoints);
        return error_line(err, err_len, "cannot create %s: %s", tmp, strerror(e));
    }
    checkpoint_stage("folder created");
    snprintf(path, sizeof path, "%s/model.safetensors", tmp);
    int failed = write_parameters(path, d->params, d->model, d->meta->entries, d->meta->count);
    for (int i = 0; i < d->num_ema && !failed; i++) {
        checkpoint_stage("file written");
        Metadata em = *d->meta;  // the same entries, and this file's own rate (freed below)
        meta_add(&em, "ema_rate", "%g", d->ema_rates[i]);
        ema_file_name(path, sizeof path, tmp, d->ema_rates, i);
        failed = write_parameters(path, d->params, d->ema[i], em.entries, em.count);
        free((char *)em.entries[em.count - 1].value);
    }
    if (!failed) {
        checkpoint_stage("file written");
        snprintf(path, sizeof path, "%s/state.bin", tmp);
        FILE *f = fopen(path, "wb");
        failed = !f || write_all(f, d->header, sizeof *d->header) || write_all(f, d->moments, d->moments_bytes);
        if (!failed && d->header->history_steps)
            failed = write_all(f, d->history->counts, d->header->history_steps * sizeof(int32_t)) ||
                     write_all(f, d->history->losses, (size_t)d->header->history_steps * d->header->history_length * sizeof(float));
        failed = failed || fflush(f) != 0 || fsync(fileno(f)) != 0;
        if (f && fclose(f) != 0) failed = 1;
    }
    if (!failed) checkpoint_stage("files written");
    if (failed || fsync_path(tmp) != 0 || (checkpoint_stage("folder synced"), put_in_place(checkpoints, tmp_name, name)) != 0) {
        int e = errno;
        delete_folder(checkpoints, tmp_name);
        close(checkpoints);
        return error_line(err, err_len, "cannot write checkpoint %s/%s: %s", folder, name, strerror(e));
    }
    checkpoint_stage("in place");
    fsync(checkpoints);
    close(checkpoints);
    checkpoint_stage("synced");
    snprintf(saved, saved_len, "%s/%s", folder, name);
    prune_checkpoints(run_dir, keep);
    return 0;
}

// A checkpoint of the trainer's current step.
// The run's options `o` are its metadata.
static int save_checkpoint(Trainer *tr, const Options *o, const char *run_dir, const LoaderPosition *position, char *saved,
                           size_t saved_len, char *err, size_t err_len) {
    UNet *m = &tr->m;
    trainer_settle(tr);
    Metadata meta = checkpoint_metadata(o, &tr->config, tr->step);
    StateHeader h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, STATE_MAGIC, 8);
    h.version = STATE_VERSION, h.num_params = (uint32_t)m->params.count;
    h.step = tr->step, h.storage = m->storage, h.seed = o->seed;
    h.loader_epoch = position->epoch, h.loader_next = position->next;
    h.batch_size = o->batch_size * o->gpus, h.diffusion_steps = o->diffusion_steps;
    snprintf(h.noise_schedule, sizeof h.noise_schedule, "%s", o->noise_schedule);
    snprintf(h.predict, sizeof h.predict, "%s", o->predict);
    if (tr->weighted_draws) h.history_steps = tr->history.steps, h.history_length = LOSS_HISTORY;
    CheckpointData d = {tr->step, &m->params, download_tensors(m, m->master), tr->train.num_ema, tr->train.ema_rates, {0}, &meta, &h,
                        NULL, 2 * (size_t)m->storage * sizeof(float), tr->weighted_draws ? &tr->history : NULL};
    for (int i = 0; i < tr->train.num_ema; i++) d.ema[i] = download_tensors(m, tr->ema[i]);
    float *moments = (float *)malloc_or_die(d.moments_bytes);
    cuda_check(cudaMemcpy(moments, m->adam_m, m->storage * sizeof(float), cudaMemcpyDeviceToHost));
    cuda_check(cudaMemcpy(moments + m->storage, m->adam_v, m->storage * sizeof(float), cudaMemcpyDeviceToHost));
    d.moments = moments;
    int r = write_checkpoint(run_dir, &d, o->keep, saved, saved_len, err, err_len);
    free(moments);
    free_tensors(m, d.model);
    for (int i = 0; i < tr->train.num_ema; i++) free_tensors(m, d.ema[i]);
    metadata_free(&meta);
    return r;
}

// Checks that a safetensors file holds these parameters, each of its shape: strictly (a checkpoint
// to resume: F32 and nothing else) or not (weights to evaluate: any float dtype, other tensors
// ignored). Returns 0, or -1 with what does not match (the first few problems, and their count).
static int dtype_is_float(const char *dtype) {
    return strcmp(dtype, "F32") == 0 || strcmp(dtype, "F64") == 0 || strcmp(dtype, "BF16") == 0 || strcmp(dtype, "F16") == 0;
}

static int match_parameters(const ParamList *params, const SafeTensorsFile *f, const char *path, int strict, char *err,
                            size_t err_len) {
    char problems[1024] = "";
    int count = 0;
    for (int i = 0; i < params->count; i++) {
        const ParamSpec *p = &params->specs[i];
        const SafeTensor *t = safetensors_find(f, p->name);
        int same = t && t->ndim == p->ndim && (strict ? strcmp(t->dtype, "F32") == 0 : dtype_is_float(t->dtype));
        for (int d = 0; same && d < p->ndim; d++) same = t->shape[d] == p->shape[d];
        if (same || count++ >= 3) continue;
        size_t at = strlen(problems);
        char want[64] = "", have[64] = "";
        for (int d = 0; d < p->ndim; d++) snprintf(want + strlen(want), sizeof want - strlen(want), d ? ",%d" : "%d", p->shape[d]);
        for (int d = 0; t && d < t->ndim; d++)
            snprintf(have + strlen(have), sizeof have - strlen(have), d ? ",%lld" : "%lld", (long long)t->shape[d]);
        if (!t) snprintf(problems + at, sizeof problems - at, "%s%s is missing", at ? "; " : "", p->name);
        else snprintf(problems + at, sizeof problems - at, "%s%s is %s [%s], expected F32 [%s]", at ? "; " : "", p->name, t->dtype,
                      have, want);
    }
    if (!count && strict && f->count != params->count)
        count = 1, snprintf(problems, sizeof problems, "it holds %d tensors, the model has %d", f->count, params->count);
    if (count) return error_line(err, err_len, "%s does not match the model (%d problems): %s", path, count, problems);
    return 0;
}

// Reads this model's parameters from an open safetensors file (matched as match_parameters does,
// every value finite) into staged ([storage] floats in the GPU layout), or only checks them when
// staged is NULL. path names the file in messages. Returns 0, or -1 with a message.
static int read_tensors(const ParamList *params, const SafeTensorsFile *f, const char *path, int strict, float *staged, char *err,
                        size_t err_len) {
    int r = match_parameters(params, f, path, strict, err, err_len);
    for (int i = 0; r == 0 && i < params->count; i++) {
        const ParamSpec *p = &params->specs[i];
        float *torch = (float *)malloc_or_die(p->numel * sizeof(float));
        if (safetensors_get_float(safetensors_find(f, p->name), torch) != 0)
            r = error_line(err, err_len, "%s: tensor %s holds NaN or infinite values", path, p->name);
        else if (staged)
            param_layout(p, torch, staged + p->offset, 1);
        free(torch);
    }
    return r;
}

// read_tensors of the safetensors file at path.
static int read_parameters(const ParamList *params, const char *path, int strict, float *staged, char *err, size_t err_len) {
    SafeTensorsFile f;
    if (safetensors_open(path, &f, err, err_len) != 0) return -1;
    int r = read_tensors(params, &f, path, strict, staged, err, err_len);
    safetensors_close(&f);
    return r;
}

// Reads this model's parameters from an open safetensors file into a GPU array (GPU layout).
static int upload_tensors(const UNet *m, const SafeTensorsFile *f, const char *path, float *array, int strict, char *err,
                          size_t err_len) {
    float *staged = (float *)calloc(m->storage, sizeof(float));
    if (!staged) fatal("out of host memory");
    int r = read_tensors(&m->params, f, path, strict, staged, err, err_len);
    if (r == 0) cuda_check(cudaMemcpy(array, staged, m->storage * sizeof(float), cudaMemcpyHostToDevice));
    free(staged);
    return r;
}

// upload_tensors of the safetensors file at path.
static int load_parameters(const UNet *m, const char *path, float *array, int strict, char *err, size_t err_len) {
    SafeTensorsFile f;
    if (safetensors_open(path, &f, err, err_len) != 0) return -1;
    int r = upload_tensors(m, &f, path, array, strict, err, err_len);
    safetensors_close(&f);
    return r;
}

// A checkpoint to resume from, checked on the host before any GPU work (so that --dry_run checks
// all of it): its folder, step and data position, and what changed since (said, not refused).
typedef struct {
    char dir[4096];
    int64_t step;
    LoaderPosition position;
    char changes[1024];
    int elsewhere;  // from outside the run folder (resume_from_elsewhere): a new run starts from it
} ResumePoint;

// Checks everything a resume reads: model.safetensors and each EMA file (header, names, shapes,
// F32, finite values), the configuration they were trained with against this run's (see
// compare_with_checkpoint), and state.bin (state_check, then against this model and step).
static int check_resume(const Options *o, const ModelConfig *c, const TrainConfig *train, const ParamList *params, ResumePoint *rp,
                        char *err, size_t err_len) {
    char path[4400];
    SafeTensorsFile f;
    snprintf(path, sizeof path, "%s/model.safetensors", rp->dir);
    if (safetensors_open(path, &f, err, err_len) != 0) return -1;
    const char *format = safetensors_metadata(&f, "format"), *step = safetensors_metadata(&f, "step");
    Metadata now = checkpoint_metadata(o, c, 0);
    int r = 0;
    if (!format || strcmp(format, "unet.cu checkpoint") != 0 || !step || (rp->step = whole_number(step)) < 0)
        r = error_line(err, err_len, "%s is not a checkpoint of this trainer (its metadata lacks format or step): it can be "
                         "evaluated or sampled, not resumed", path);
    if (r == 0) r = check_format_version(&f, path, err, err_len);
    if (r == 0) r = compare_with_checkpoint(&f, rp->dir, &now, o->gpus, rp->changes, sizeof rp->changes, err, err_len);
    metadata_free(&now);
    safetensors_close(&f);
    if (r == 0) r = read_parameters(params, path, 1, NULL, err, err_len);
    for (int i = 0; r == 0 && i < train->num_ema; i++) {
        ema_file_name(path, sizeof path, rp->dir, train->ema_rates, i);
        r = read_parameters(params, path, 1, NULL, err, err_len);
    }
    if (r != 0) return -1;
    snprintf(path, sizeof path, "%s/state.bin", rp->dir);
    MappedFile state;
    StateHeader h;
    char why[512];
    if (map_regular_file(path, "training state", &state, err, err_len) != 0) return -1;
    ParamList layout = model_parameters(c);  // the GPU layout's length, as unet_create makes it
    int64_t emb_bias_offset, storage = param_offsets(&layout, &emb_bias_offset);
    free(layout.specs);
    if (state_check(state.bytes, state.size, &h, why, sizeof why) != 0)
        r = error_line(err, err_len, "%s: %s", path, why);
    else if (h.storage != storage || (int)h.num_params != params->count)
        r = error_line(err, err_len, "%s holds the state of a model of %lld values in %u tensors, not this one's %lld in %d", path,
                         (long long)h.storage, h.num_params, (long long)storage, params->count);
    else if (h.history_length && h.history_length != LOSS_HISTORY)
        r = error_line(err, err_len, "%s holds a schedule sampler's history of %d losses a timestep; this trainer keeps %d", path,
                       h.history_length, LOSS_HISTORY);
    else if (h.step != rp->step)
        r = error_line(err, err_len, "%s is of step %lld but the weights beside it are of step %lld", path, (long long)h.step,
                         (long long)rp->step);
    else if (h.batch_size != o->batch_size * o->gpus || h.diffusion_steps != o->diffusion_steps || h.seed != o->seed ||
             strcmp(h.noise_schedule, o->noise_schedule) != 0 || strcmp(h.predict, o->predict) != 0)
        r = error_line(err, err_len, "%s was trained with %d images a step (--batch_size times the GPUs) --diffusion_steps %d "
                         "--noise_schedule %s --predict %s --seed %lld; resume with the same values", rp->dir, h.batch_size,
                         h.diffusion_steps, h.noise_schedule, h.predict, (long long)h.seed);
    rp->position.epoch = h.loader_epoch, rp->position.next = h.loader_next;
    unmap_file(&state);
    return r;
}

// Restores a checked resume point onto the GPU: weights, EMAs, AdamW's moments, the step.
static int load_checkpoint(Trainer *tr, const ResumePoint *rp, char *err, size_t err_len) {
    UNet *m = &tr->m;
    char path[4400];
    snprintf(path, sizeof path, "%s/model.safetensors", rp->dir);
    if (load_parameters(m, path, m->master, 1, err, err_len) != 0) return -1;
    for (int i = 0; i < tr->train.num_ema; i++) {
        ema_file_name(path, sizeof path, rp->dir, tr->train.ema_rates, i);
        if (load_parameters(m, path, tr->ema[i], 1, err, err_len) != 0) return -1;
    }
    snprintf(path, sizeof path, "%s/state.bin", rp->dir);
    MappedFile state;
    StateHeader h;
    char why[512];
    if (map_regular_file(path, "training state", &state, err, err_len) != 0) return -1;
    if (state_check(state.bytes, state.size, &h, why, sizeof why) != 0 || h.storage != m->storage ||
        (h.history_steps && (h.history_steps != tr->diffusion.schedule.steps || h.history_length != LOSS_HISTORY))) {
        unmap_file(&state);
        return error_line(err, err_len, "%s changed since it was checked", path);
    }
    const float *moments = (const float *)state_moments(state.bytes, &h);  // m, then v
    cuda_check(cudaMemcpy(m->adam_m, moments, m->storage * sizeof(float), cudaMemcpyHostToDevice));
    cuda_check(cudaMemcpy(m->adam_v, moments + m->storage, m->storage * sizeof(float), cudaMemcpyHostToDevice));
    if (tr->weighted_draws && h.history_steps) {  // (a run that changes the sampler starts with an empty history, or drops it)
        const uint8_t *history = state_history(state.bytes, &h);
        memcpy(tr->history.counts, history, h.history_steps * sizeof(int32_t));
        memcpy(tr->history.losses, history + h.history_steps * sizeof(int32_t), (size_t)h.history_steps * LOSS_HISTORY * sizeof(float));
    }
    unmap_file(&state);
    unet_sync_compute(m);
    tr->step = rp->step;
    return 0;
}

// ----------------------------------------------------------------------------------------------
// The model configuration of a state_dict that carries no metadata (a .pt), from its tensors' names
// and shapes: the channels, the levels' multipliers, the blocks a level, the levels with attention,
// scale-shift, ResBlock or convolution up/downsampling, the classes and a learned variance. What
// shapes cannot say comes from `given` (guided-diffusion's flags): image_size (which turns levels
// into attention resolutions), the heads (heads_given: whether the command line set them), the
// attention order and dropout. Every candidate configuration is built and its whole parameter list
// compared with the file's (each model tensor there, and no other); the first that matches is taken
// (a model without parameters in its resampling, where conv_resample changes nothing, as
// guided-diffusion's default). Returns 0, or -1 with a message.
static int is_model_tensor(const char *name) {
    static const char *const prefixes[] = {"time_embed.", "label_emb.", "input_blocks.", "middle_block.", "output_blocks.", "out."};
    for (int i = 0; i < 6; i++)
        if (strncmp(name, prefixes[i], strlen(prefixes[i])) == 0) return 1;
    return 0;
}

static int parameters_match(const ParamList *params, const SafeTensorsFile *f) {
    int model_tensors = 0;
    for (int i = 0; i < f->count; i++) model_tensors += is_model_tensor(f->tensors[i].name);
    if (model_tensors != params->count) return 0;
    for (int i = 0; i < params->count; i++) {
        const ParamSpec *p = &params->specs[i];
        const SafeTensor *t = safetensors_find(f, p->name);
        if (!t || t->ndim != p->ndim) return 0;
        for (int d = 0; d < p->ndim; d++)
            if (t->shape[d] != p->shape[d]) return 0;
    }
    return 1;
}

// The first dimension of tensor `name` (printf-formatted), or 0 when there is none.
static int64_t tensor_rows(const SafeTensorsFile *f, const char *fmt, int index) {
    char name[128];
    snprintf(name, sizeof name, fmt, index);
    const SafeTensor *t = safetensors_find(f, name);
    return t && t->ndim >= 1 ? t->shape[0] : 0;
}

typedef struct {
    ModelConfig config;
    Options options;  // given, with the inferred flags (channel_mult and attention_resolutions: the texts below)
    char channel_mult[128], attention_resolutions[128];
} InferredModel;

// Whether a candidate's parameters are the file's; then it is the inferred model (with its flags'
// texts).
static int take_if_match(const SafeTensorsFile *f, const Options *o, const ModelConfig *candidate, InferredModel *inferred) {
    ParamList params = model_parameters(candidate);
    int match = parameters_match(&params, f);
    free(params.specs);
    if (!match) return 0;
    inferred->config = *candidate, inferred->options = *o;
    snprintf(inferred->channel_mult, sizeof inferred->channel_mult, "%s", o->channel_mult);
    snprintf(inferred->attention_resolutions, sizeof inferred->attention_resolutions, "%s", o->attention_resolutions);
    inferred->options.channel_mult = inferred->channel_mult;
    inferred->options.attention_resolutions = inferred->attention_resolutions;
    return 1;
}

// The head of a classifier's state_dict by its tensors (a pool's name, its classes in *classes), or
// NULL: no classifier's head (a UNet's out.0 is a GroupNorm and its out.2 a 3x3 convolution).
static const char *classifier_head(const SafeTensorsFile *f, int64_t *classes) {
    const SafeTensor *out0 = safetensors_find(f, "out.0.weight"), *out1 = safetensors_find(f, "out.1.weight");
    const SafeTensor *out2 = safetensors_find(f, "out.2.weight"), *out3 = safetensors_find(f, "out.3.weight");
    if (safetensors_find(f, "out.2.positional_embedding")) return *classes = tensor_rows(f, "out.2.c_proj.weight", 0), "attention";
    if (out0 && out0->ndim == 1 && out3 && out3->ndim == 4) return *classes = out3->shape[0], "adaptive";
    if (out0 && out0->ndim == 2 && out2 && out2->ndim == 2) return *classes = out2->shape[0], "spatial";
    if (out0 && out0->ndim == 2 && out1 && out1->ndim == 1 && out3 && out3->ndim == 2) return *classes = out3->shape[0], "spatial_v2";
    return NULL;
}

// The noisy classifier's (EncoderUNetModel: input blocks, middle block, a head; infer_model_config
// sends a state_dict with a classifier's head and no output blocks here): its head and classes from
// the head's tensors (classifier_head), the levels from the input blocks (the first conv, per level
// num_res_blocks ResBlocks and a downsampling but on the last), each level's channels from its first
// ResBlock, attention where a level's blocks have it; the heads are 64 channels (guided-diffusion's
// create_classifier) unless given.
static int infer_classifier_config(const SafeTensorsFile *f, const Options *given, int heads_given, InferredModel *inferred, char *err,
                                   size_t err_len) {
    const SafeTensor *time = safetensors_find(f, "time_embed.0.weight");
    int64_t classes = 0, ch = time->shape[1], inputs = 0;
    const char *pool = classifier_head(f, &classes);
    for (int i = 0; i < f->count; i++) {
        int j;
        if (sscanf(f->tensors[i].name, "input_blocks.%d.", &j) == 1 && j + 1 > inputs) inputs = j + 1;
    }
    int64_t scale_shift_rows = tensor_rows(f, "input_blocks.%d.0.emb_layers.1.weight", 1);
    for (int blocks = 1; blocks <= MAX_RES_BLOCKS; blocks++) {
        int levels = (int)(inputs / (blocks + 1));  // 1 + levels blocks + (levels - 1) input blocks
        if (inputs % (blocks + 1) || levels < 1 || levels > MAX_LEVELS) continue;
        char mult[128] = "", resolutions[128] = "";
        int ok = 1;
        for (int level = 0; level < levels && ok; level++) {
            int first = 1 + level * (blocks + 1), with_attention = 0;
            int64_t level_ch = tensor_rows(f, "input_blocks.%d.0.out_layers.3.weight", first);
            for (int k = first; k < first + blocks; k++) with_attention |= tensor_rows(f, "input_blocks.%d.1.qkv.weight", k) != 0;
            ok = level_ch > 0 && level_ch * 2 % ch == 0;
            snprintf(mult + strlen(mult), sizeof mult - strlen(mult), "%s%g", level ? "," : "", (double)level_ch / (double)ch);
            if (with_attention)
                snprintf(resolutions + strlen(resolutions), sizeof resolutions - strlen(resolutions), "%s%d", resolutions[0] ? "," : "",
                         given->image_size >> level);
        }
        for (int updown = 0; ok && updown < 2; updown++) {  // (conv_resample: always, as create_classifier leaves it)
            Options o = *given;
            o.num_channels = (int)ch, o.num_res_blocks = blocks, o.channel_mult = mult, o.attention_resolutions = resolutions;
            o.use_scale_shift_norm = scale_shift_rows == 2 * tensor_rows(f, "input_blocks.%d.0.out_layers.3.weight", 1);
            o.resblock_updown = updown, o.conv_resample = 1, o.class_cond = 0, o.learn_sigma = 0, o.num_classes = (int)classes;
            o.classifier_pool = pool, o.classifier_width = o.num_channels, o.classifier_depth = blocks;
            o.classifier_use_scale_shift_norm = o.use_scale_shift_norm, o.classifier_resblock_updown = updown;
            if (!heads_given) o.num_head_channels = 64;
            ModelConfig candidate;
            char why[256];
            if (named_model_config(&o, &candidate, why, sizeof why) == 0 && take_if_match(f, &o, &candidate, inferred)) {
                inferred->options.classifier_attention_resolutions = inferred->attention_resolutions;
                return 0;
            }
        }
    }
    return error_line(err, err_len, "its tensors fit no guided-diffusion classifier this trainer builds (with --image_size %d%s)",
                      given->image_size, heads_given ? " and the heads given" : "");
}

static int infer_model_config(const SafeTensorsFile *f, const Options *given, int heads_given, InferredModel *inferred, char *err,
                              size_t err_len) {
    const SafeTensor *time_embed = safetensors_find(f, "time_embed.0.weight");
    int64_t classes;
    if (time_embed && time_embed->ndim == 2 && classifier_head(f, &classes) && tensor_rows(f, "output_blocks.%d.0.in_layers.2.weight", 0) == 0) {
        if (given->image_size <= 0)
            return error_line(err, err_len, "--image_size: a state_dict does not say the images' size; give guided-diffusion's flag");
        return infer_classifier_config(f, given, heads_given, inferred, err, err_len);
    }
    const SafeTensor *first = safetensors_find(f, "input_blocks.0.0.weight"), *last = safetensors_find(f, "out.2.weight");
    const SafeTensor *time = safetensors_find(f, "time_embed.0.weight");  // [4 model_channels][model_channels]
    if (!first || !last || !time || first->ndim != 4 || last->ndim != 4 || time->ndim != 2)
        return error_line(err, err_len, "not a guided-diffusion UNet's state_dict (no input_blocks.0.0.weight, time_embed.0.weight or "
                          "out.2.weight)");
    if (given->image_size <= 0)
        return error_line(err, err_len, "--image_size: a state_dict does not say the images' size; give guided-diffusion's flag");
    int64_t ch = time->shape[1], in = first->shape[1], out = last->shape[0], label_rows = tensor_rows(f, "label_emb.weight", 0);
    int outputs = 0, attention = 0;
    for (int i = 0; i < f->count; i++) {
        int j;
        if (sscanf(f->tensors[i].name, "output_blocks.%d.", &j) == 1 && j + 1 > outputs) outputs = j + 1;
        attention |= strstr(f->tensors[i].name, ".qkv.weight") != NULL;
    }
    if (attention && !heads_given)
        return error_line(err, err_len, "--num_head_channels or --num_heads: a state_dict does not say how its attention splits into "
                          "heads; give guided-diffusion's flag for this model");
    if (in == 6 && !given->super_res)
        return error_line(err, err_len, "--large_size and --small_size: a UNet of 6 input channels is an upsampler (SuperResModel); give "
                          "guided-diffusion's flags for its sizes");
    int64_t image_in = given->super_res ? in / 2 : in;  // an upsampler's input: the image's channels, then the low-resolution image's
    if (image_in != 3 || in != (given->super_res ? 6 : 3) || (out != image_in && out != 2 * image_in) || outputs < 1)
        return error_line(err, err_len, "a UNet of %lld input and %lld output channels: this trainer builds 3 in (6 for an upsampler), 3 "
                          "or 6 out", (long long)in, (long long)out);
    int64_t block_out = tensor_rows(f, "output_blocks.%d.0.in_layers.2.weight", 0);
    int scale_shift = tensor_rows(f, "output_blocks.%d.0.emb_layers.1.weight", 0) == 2 * block_out;
    for (int blocks = 0; blocks <= MAX_RES_BLOCKS; blocks++) {
        int levels = outputs / (blocks + 1);
        if (outputs % (blocks + 1) || levels > MAX_LEVELS) continue;
        char mult[128] = "", resolutions[128] = "";
        int ok = 1;
        for (int level = 0; level < levels && ok; level++) {  // output block j belongs to level levels - 1 - j / (blocks + 1)
            int j = (levels - 1 - level) * (blocks + 1), with_attention = 0;
            int64_t level_ch = tensor_rows(f, "output_blocks.%d.0.in_layers.2.weight", j);
            for (int k = j; k < j + blocks + 1; k++) with_attention |= tensor_rows(f, "output_blocks.%d.1.qkv.weight", k) != 0;
            ok = level_ch > 0 && level_ch * 2 % ch == 0;  // multipliers of 0.5 and up
            snprintf(mult + strlen(mult), sizeof mult - strlen(mult), "%s%g", level ? "," : "", (double)level_ch / (double)ch);
            if (with_attention)
                snprintf(resolutions + strlen(resolutions), sizeof resolutions - strlen(resolutions), "%s%d", resolutions[0] ? "," : "",
                         given->image_size >> level);
        }
        for (int k = 0; ok && k < 4; k++) {  // resblock_updown, conv_resample: 0 1, 0 0, 1 1, 1 0
            Options o = *given;
            o.num_channels = (int)ch, o.num_res_blocks = blocks, o.channel_mult = mult, o.attention_resolutions = resolutions;
            o.use_scale_shift_norm = scale_shift, o.resblock_updown = k / 2, o.conv_resample = k % 2 == 0;
            o.class_cond = label_rows > 0, o.num_classes = (int)label_rows, o.learn_sigma = out == 2 * image_in;
            ModelConfig candidate;
            char why[256];
            if (model_config_from_options(&o, o.num_classes, &candidate, why, sizeof why) == 0 && take_if_match(f, &o, &candidate, inferred))
                return 0;
        }
    }
    return error_line(err, err_len, "its tensors fit no guided-diffusion UNet this trainer builds (with --image_size %d and the heads given)",
                      given->image_size);
}

// The model and diffusion of a weights file without metadata (a .pt), from its tensors and
// guided-diffusion's flags as its README gives them for each released model ("name=value" each;
// use_fp16 and classifier_use_fp16, which say how it ran there, are accepted and left alone; a
// classifier's flags are its classifier_ ones). The flags the tensors decide
// must agree with them; the rest (image_size, the heads, the attention order, dropout, the
// diffusion) come from the flags, diffusion_steps 1000, linear and eps where they say nothing.
// *described gets one line of what was inferred and what was given. Returns 0, or -1 with a
// message naming the file.
static int model_from_tensors_and_flags(const SafeTensorsFile *f, const char *path, const char *const *flags, int num_flags,
                                        ModelConfig *c, DiffusionConfig *d, char *described, size_t described_len, char *err,
                                        size_t err_len) {
    Options given = guided_diffusion_defaults();
    given.image_size = 0;  // none: inference asks for it
    int heads_given = 0, used = 0;
    const OptionSpec *specs[64];
    const char *values[64];
    char why[512], given_text[512] = "";
    for (int i = 0; i < num_flags && used < 64; i++) {
        const char *eq = strchr(flags[i], '=');
        size_t len = eq ? (size_t)(eq - flags[i]) : 0;
        if (!eq || (len == 8 && strncmp(flags[i], "use_fp16", 8) == 0) || (len == 19 && strncmp(flags[i], "classifier_use_fp16", 19) == 0))
            continue;
        // guided-diffusion's upsampler flags: large_size is the image size, small_size our super_res
        const OptionSpec *spec = len == 10 && strncmp(flags[i], "large_size", 10) == 0   ? find_option("image_size", 10)
                                 : len == 10 && strncmp(flags[i], "small_size", 10) == 0 ? find_option("super_res", 9)
                                                                                       : find_option(flags[i], len);
        if (!spec || option_from_string(&given, spec, eq + 1, why, sizeof why) != 0)
            return error_line(err, err_len, "--%.*s %s: %s", (int)len, flags[i], eq + 1, spec ? why : "not a model or diffusion flag");
        heads_given |= strcmp(spec->name, "num_heads") == 0 || strcmp(spec->name, "num_head_channels") == 0;
        snprintf(given_text + strlen(given_text), sizeof given_text - strlen(given_text), " %s %s", spec->name, eq + 1);
        specs[used] = spec, values[used++] = eq + 1;
    }
    InferredModel inferred;
    if (infer_model_config(f, &given, heads_given, &inferred, why, sizeof why) != 0) return error_line(err, err_len, "%s: %s", path, why);
    for (int i = 0; i < used; i++) {  // each flag given, put on the inferred model, must leave it as it is
        Options o = inferred.options;
        ModelConfig with_flag;
        int r = option_from_string(&o, specs[i], values[i], why, sizeof why);
        if (inferred.config.pool && strncmp(specs[i]->name, "classifier_", 11) == 0) classifier_flags_onto_model(&o);
        if (r != 0 || named_model_config(&o, &with_flag, why, sizeof why) != 0 ||
            memcmp(&with_flag, &inferred.config, sizeof with_flag) != 0)
            return error_line(err, err_len, "%s: --%s %s does not fit its tensors (they are of --num_channels %d --channel_mult %s "
                              "--num_res_blocks %d --attention_resolutions %s)", path, specs[i]->name, values[i], inferred.options.num_channels,
                              inferred.channel_mult, inferred.options.num_res_blocks, inferred.attention_resolutions);
    }
    if (strcmp(given.noise_schedule, "linear") != 0 && strcmp(given.noise_schedule, "cosine") != 0)
        return error_line(err, err_len, "--noise_schedule %s: linear or cosine", given.noise_schedule);
    if (prediction_from_name(given.predict) < 0) return error_line(err, err_len, "--predict %s: eps, v or x0", given.predict);
    if (given.diffusion_steps < 1 || given.diffusion_steps > 100000) return error_line(err, err_len, "--diffusion_steps out of range");
    const Options *o = &inferred.options;
    const char *truth[2] = {"False", "True"};
    char kind[96] = "";
    if (inferred.config.pool) snprintf(kind, sizeof kind, "a classifier (classifier_pool %s, %d classes): ", o->classifier_pool, o->num_classes);
    if (inferred.config.low_res)
        snprintf(kind, sizeof kind, "an upsampler (SuperResModel, %dx%d to %dx%d): ", o->super_res, o->super_res, o->image_size, o->image_size);
    snprintf(described, described_len, "inferred from the tensors: %snum_channels %d channel_mult %s num_res_blocks %d attention_resolutions "
             "%s use_scale_shift_norm %s resblock_updown %s class_cond %s learn_sigma %s; given:%s", kind, o->num_channels,
             inferred.channel_mult, o->num_res_blocks, inferred.attention_resolutions, truth[o->use_scale_shift_norm],
             truth[o->resblock_updown], truth[o->class_cond], truth[o->learn_sigma], given_text[0] ? given_text : " none");
    *c = inferred.config, *d = diffusion_config(&given, c);
    return 0;
}
