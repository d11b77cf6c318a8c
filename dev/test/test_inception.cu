// test_inception.cu: reading Inception-v3's weights for evaluate (train_unet.cu's
// unet_inception_open), without a GPU: the tensors the architecture's walk expects are
// pytorch-fid's (their count and size, those of scripts/fid_inception.py's module), a file of them
// opens, and a misshapen, missing or non-finite tensor or a negative variance is refused with one
// line naming it. `test_inception --list` prints the expected tensors, one "name [shape]" a line
// (scripts/fid_inception.py's state_dict lists the same, less fc.bias and num_batches_tracked);
// `test_inception --write FILE` writes random weights of them (safetensors), for the command-line tests.
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

// The expected tensors written to path with random values (variances positive), except that the
// tensor named `victim` is written as `damage` says: "shape" one row short, "missing" left out,
// "nan" with a NaN, "variance" negative. Returns 0, or -1.
static int write_weights(const char *path, const char *victim, const char *damage) {
    InceptionTensor *expected;
    int count = inception_expected_tensors(&expected), written = 0;
    SafeTensorOut *tensors = (SafeTensorOut *)calloc(count, sizeof(SafeTensorOut));
    int (*shapes)[4] = (int (*)[4])calloc(count, sizeof *shapes);
    float **values = (float **)calloc(count, sizeof(float *));
    uint64_t state = 12345;
    for (int i = 0; i < count; i++) {
        const InceptionTensor *t = &expected[i];
        int is_victim = victim && strcmp(t->name, victim) == 0;
        if (is_victim && strcmp(damage, "missing") == 0) continue;
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) shapes[written][d] = (int)t->shape[d], numel *= t->shape[d];
        if (is_victim && strcmp(damage, "shape") == 0) numel /= shapes[written][0], shapes[written][0] -= 1, numel *= shapes[written][0];
        values[written] = (float *)malloc(numel * sizeof(float));
        // values that keep the activations in range through the 94 layers: He-uniform convolutions,
        // BatchNorms near the identity, a small classifier
        int conv = strstr(t->name, "conv.weight") != NULL, variance = strstr(t->name, "running_var") != NULL;
        int scale = strstr(t->name, "bn.weight") != NULL;
        double conv_bound = t->ndim == 4 ? sqrt(6.0 / (t->shape[1] * t->shape[2] * t->shape[3])) : 0.0;
        for (int64_t k = 0; k < numel; k++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            float u = (float)((state >> 40) * (1.0 / 16777216.0));
            values[written][k] = conv ? (float)((2 * u - 1) * conv_bound) : variance ? 0.5f + u : scale ? 0.8f + 0.4f * u : 0.2f * (u - 0.5f);
        }
        if (is_victim && strcmp(damage, "nan") == 0) values[written][0] = NAN;
        if (is_victim && strcmp(damage, "variance") == 0) values[written][0] = -1.0f;
        tensors[written] = {t->name, t->ndim, shapes[written], numel, values[written], NULL};
        written++;
    }
    int r = safetensors_write(path, tensors, written, NULL, 0);
    for (int i = 0; i < written; i++) free(values[i]);
    free(values), free(shapes), free(tensors), free(expected);
    return r;
}

// Opens the weights written with the damage given; the error line, or "" when they opened.
static void open_damaged(const char *path, const char *victim, const char *damage, char *err, size_t err_len) {
    err[0] = '\0';
    CHECK(write_weights(path, victim, damage) == 0);
    UnetInception *net = unet_inception_open(path, err, err_len);
    if (net) err[0] = '\0';
    unet_inception_close(net);
}

int main(int argc, char **argv) {
    InceptionTensor *expected;
    int count = inception_expected_tensors(&expected);
    if (argc > 2 && strcmp(argv[1], "--write") == 0) return write_weights(argv[2], NULL, "") == 0 ? 0 : 1;  // random weights, for the CLI tests
    if (argc > 1 && strcmp(argv[1], "--list") == 0) {
        for (int i = 0; i < count; i++) {
            printf("%s [", expected[i].name);
            for (int d = 0; d < expected[i].ndim; d++) printf(d ? ", %lld" : "%lld", (long long)expected[i].shape[d]);
            printf("]\n");
        }
        return 0;
    }

    check_case("the walk expects pytorch-fid's 471 tensors, 23,884,384 values (94 layers)");
    // 94 BasicConv2d (a weight and the BatchNorm's four) and fc.weight: torchvision's inception_v3
    // without its auxiliary head at 1008 classes has 23,850,960 parameters; here the running
    // statistics are counted and fc.bias, which the evaluator does not use, is not.
    int64_t values = 0;
    for (int i = 0; i < count; i++) {
        int64_t n = 1;
        for (int d = 0; d < expected[i].ndim; d++) n *= expected[i].shape[d];
        values += n;
    }
    CHECK(count == 471);
    CHECK(values == 23884384);
    free(expected);

    char path[] = "/tmp/test_inception_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    char err[1024];

    check_case("weights of the expected tensors open");
    open_damaged(path, NULL, "", err, sizeof err);
    CHECK(err[0] == '\0');
    if (err[0]) printf("  %s\n", err);

    check_case("a misshapen tensor is refused, named with both shapes");
    open_damaged(path, "Mixed_6c.branch7x7_2.conv.weight", "shape", err, sizeof err);
    CHECK(strstr(err, "Mixed_6c.branch7x7_2.conv.weight is [159, 160, 1, 7]; pytorch-fid's Inception has [160, 160, 1, 7]") != NULL);
    CHECK(strchr(err, '\n') == NULL);

    check_case("a missing tensor is refused, naming the file pytorch-fid's weights come in");
    open_damaged(path, "fc.weight", "missing", err, sizeof err);
    CHECK(strstr(err, "has no tensor fc.weight") != NULL);
    CHECK(strstr(err, "pt_inception-2015-12-05-6726825d.pth") != NULL);

    check_case("a NaN and a negative variance are refused");
    open_damaged(path, "Conv2d_1a_3x3.bn.bias", "nan", err, sizeof err);
    CHECK(strstr(err, "Conv2d_1a_3x3.bn.bias holds NaN or infinite values") != NULL);
    open_damaged(path, "Mixed_7c.branch_pool.bn.running_var", "variance", err, sizeof err);
    CHECK(strstr(err, "Mixed_7c.branch_pool.bn.running_var has a negative variance") != NULL);

    check_case("a file that is not there is named, with where the weights come from");
    unlink(path);
    CHECK(unet_inception_open(path, err, sizeof err) == NULL);
    CHECK(strstr(err, "cannot open the Inception weights") != NULL && strstr(err, "README") != NULL);

    check_case_end();
    printf("%d passed, %d failed\n", check_cases_passed, check_cases_failed);
    return check_cases_failed ? 1 : 0;
}
