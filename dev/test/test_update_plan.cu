// test_update_plan.cu: the plan of a step's parameter update beside the next step's forward
// (train_unet.cu's trainer_plan_update) on the CPU, for every preset and a noisy classifier: the
// chunks cover the storage in order, each from a 64-element boundary (AdamW's vectors), at most
// MAX_UPDATE_CHUNKS; the first holds every emb_layers tensor and the time and class embeddings,
// which the forward's start reads; and before each block's forward the main stream has waited
// (trainer_wait_update's rule) for every chunk that holds a parameter of that block or an earlier one.
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

// The chunks the main stream has waited for before block `block`'s forward: those whose first
// reader is `block` or earlier (trainer_wait_update).
static int chunks_waited(const Trainer *tr, int block) {
    int waited = 0;
    while (waited < tr->update_chunks && tr->update_block[waited] <= block) waited++;
    return waited;
}

// Every chunk overlapping [from, to) waited for: it ends no later than the waited chunks do.
static bool covered(const Trainer *tr, int waited, int64_t to) { return waited > 0 && to <= tr->update_to[waited - 1]; }

static void check_plan(const char *what, const ModelConfig *c, int batch) {
    Trainer tr;
    memset(&tr, 0, sizeof tr);
    unet_plan(&tr.m, c, batch, 1);
    trainer_plan_update(&tr);
    const UNet *m = &tr.m;
    const ParamList *params = &m->params;
    printf("  %s: %lld parameters' storage in %d chunks\n", what, (long long)m->storage, tr.update_chunks);
    CHECK(tr.update_chunks >= 1 && tr.update_chunks <= MAX_UPDATE_CHUNKS);
    CHECK(tr.update_block[0] == 0);
    CHECK(tr.update_to[tr.update_chunks - 1] == m->storage);
    for (int c = 0; c < tr.update_chunks; c++) {
        int64_t from = c ? tr.update_to[c - 1] : 0;
        CHECK(tr.update_to[c] > from);
        CHECK(from % 64 == 0);
        CHECK(c == 0 || tr.update_block[c] >= tr.update_block[c - 1]);
        CHECK(tr.update_block[c] <= m->num_blocks);
    }
    // The forward's start (before block 0): the embeddings' tensors and every emb_layers.
    int first_block_params = m->num_blocks ? m->blocks[0].param_count : 0;
    for (int k = 0; k < params->count; k++) {
        const ParamSpec *p = &params->specs[k];
        bool read_first = k < first_block_params || is_emb_layer(p->name, "weight") || is_emb_layer(p->name, "bias");
        if (read_first) CHECK(covered(&tr, chunks_waited(&tr, 0), p->offset + p->numel));
    }
    // Each block: every parameter walked up to it.
    int missing = 0;
    for (int i = 0; i < m->num_blocks; i++) {
        int waited = chunks_waited(&tr, i);
        for (int k = 0; k < m->blocks[i].param_count; k++)
            missing += !covered(&tr, waited, params->specs[k].offset + params->specs[k].numel);
    }
    CHECK(missing == 0);
    unet_destroy(&tr.m);
}

int main(void) {
    check_case("the update's chunks cover the storage in order, and every forward block waits for its parameters");
    const char *presets[] = {"seed", "adm64", "adm128", "adm256", "adm256u", "adm512", "adm64_256", "adm128_512"};
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        Options o;
        CHECK(preset_options(presets[i], &o) == 0);
        ModelConfig c = resolve_model(&o, o.num_classes ? o.num_classes + 1 : 0);  // (the null class's row: train_unet's)
        check_plan(presets[i], &c, 4);
    }
    check_case("a noisy classifier's update (no decoder: the pool head last)");
    Options o = preset_seed();
    classifier_model_flags(&o);
    ModelConfig c = resolve_model(&o, 0);
    char err[512];
    CHECK(classifier_config(&c, "attention", o.num_classes, err, sizeof err) == 0);
    check_plan("classifier (attention pool)", &c, 4);
    check_case_end();
    printf("%d passed, %d failed\n", check_cases_passed, check_cases_failed);
    return check_cases_failed != 0;
}
