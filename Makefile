# Makefile: builds the trainer and the tools, generates the bundled dataset, runs the tests.
#
#   make                      every binary and data/shapes.bin
#   make PRECISION=FP32       fp32 throughout (for matching PyTorch); BF16 is the default
#   make test                 CPU tests, plus GPU tests when a GPU is present
#   make test-gpu             GPU tests only
#   make tests                every test program (the GPU ones too, GPU or not), built and not run
#   make dev                  every kernel against its CPU reference on the GPU, one table
#   make bench                our training step and DDIM sampling against PyTorch (BENCH="seed:32 adm64:32"),
#                             then evaluate's FID against pytorch-fid's (make bench-fid alone)
#   make bench-conv           the 3x3 convolution kernels: checks, then each preset shape's timings against cuDNN
#   make fuzz                 the file readers under libFuzzer (clang), FUZZ_SECONDS each (default 60)
#   make clean
#
# Targets build in parallel, a job per core (`make -j1` on the command line builds one at a time),
# and nvcc compiles a file's GPU architectures in parallel (--threads 0).

VERSION := 0.1.0
NPROC := $(shell nproc 2>/dev/null || echo 1)
MAKEFLAGS += -j$(NPROC)
ifneq ($(filter clean,$(MAKECMDGOALS)),)
.NOTPARALLEL:  # `make clean all`: clean first, then the build
endif

PRECISION ?= BF16
ifeq ($(filter $(PRECISION),BF16 FP32),)
$(error PRECISION must be BF16 or FP32, not '$(PRECISION)')
endif

CC ?= cc
NVCC := $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc),nvcc)

# Build for the GPU in this machine when nvidia-smi finds one, else for A100, L40/RTX 40 and H100/H200.
# Either way the PTX of the newest architecture built is embedded too (code=compute_XX), so that on a
# GPU newer than any of these the driver compiles it at the first start instead of refusing to run.
# H100/H200 code is built as sm_90a, whose wgmma instructions the convolutions use (that PTX, the
# fallback for newer GPUs, is plain compute_90: sm_90a code runs on 9.0 GPUs only).
GPU_CC := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
ifneq ($(GPU_CC),)
GPU_SASS := $(if $(filter 90,$(GPU_CC)),90a,$(GPU_CC))
GPU_ARCH := -gencode arch=compute_$(GPU_SASS),code=sm_$(GPU_SASS) -gencode arch=compute_$(GPU_CC),code=compute_$(GPU_CC)
else
GPU_ARCH := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_89,code=sm_89 \
            -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90
endif

STB_CFLAGS := $(shell pkg-config --cflags stb 2>/dev/null || echo -I/usr/include/stb)
STB_LIBS := -lstb -lm

# NCCL, for training on many GPUs: the CUDA installation's, the system's (Debian's libnccl-dev), or
# else the one inside PyTorch's Python packages (nvidia/nccl), where a GPU machine may keep it only.
# Without any, the trainer is built for one GPU (UNET_NO_NCCL) and says so when asked for more.
CUDA_HOME := $(patsubst %/bin/nvcc,%,$(NVCC))
ifneq ($(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h),)
NCCL_CFLAGS :=
NCCL_LIBS := -lnccl
else
NCCL_PY := $(shell python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null)
ifneq ($(wildcard $(NCCL_PY)/include/nccl.h),)
NCCL_CFLAGS := -I$(NCCL_PY)/include
NCCL_LIBS := -L$(NCCL_PY)/lib -l:libnccl.so.2 -Xlinker -rpath=$(NCCL_PY)/lib
else
NCCL_CFLAGS := -DUNET_NO_NCCL
NCCL_LIBS :=
endif
endif

CFLAGS ?= -O2 -g
CFLAGS += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-function -I.
NVCCFLAGS ?= -O3 -g
NVCC_BASE := $(NVCCFLAGS) -std=c++17 --threads 0 -I. $(STB_CFLAGS) $(NCCL_CFLAGS) -Xcompiler -Wall,-Wno-unused-function
NVCC_COMMON := $(NVCC_BASE) $(GPU_ARCH)
NVCCFLAGS := $(NVCC_COMMON) -DPRECISION_$(PRECISION)
# The CPU test programs include train_unet.cu for its host code and never launch a kernel: their GPU
# code is one architecture's PTX, unoptimised (-Xcicc -O0: nvcc's device compiler at -O0), which
# compiles in a tenth of the time of the trainer's four optimised architectures.
NVCC_HOST_TESTS := $(NVCC_BASE) -gencode arch=compute_80,code=compute_80 -Xcicc -O0 -DPRECISION_$(PRECISION)

CUDA_LIBS := -lcublas -lcublasLt -lcusolver $(NCCL_LIBS) $(STB_LIBS)

BINARIES := train_unet prepare_data check_shapes generate evaluate
# The headers train_unet.cu includes: its own rules, and those of the programs that include it, rebuild when one changes.
TRAINER_HEADERS := gpu.cuh config.cuh team.cuh inception.cuh fid.cuh checkpoints.cuh unet_api.cuh \
                   checkpoint.h dataset.h fileio.h loss_plot.h png.h ptfile.h random.h sampler.h tensorfile.h unet_api.h
SHAPES_COUNT := 10000
SHAPES_SIZE := 64
SHAPES_SEED := 1

all: $(BINARIES) data/shapes.bin

# The precision the trainer was last built with: changing PRECISION rebuilds it.
build/precision: FORCE
	@mkdir -p build
	@[ "$$(cat $@ 2>/dev/null)" = "$(PRECISION)" ] || echo $(PRECISION) > $@

# What --version prints (cli.h): VERSION with `git describe` where there is a git checkout, and the
# GPU code built. Rewritten only when it changes, so a new commit relinks the programs and
# recompiles nothing else.
GIT_DESCRIBE := $(shell git describe --always --dirty 2>/dev/null)
BUILD_VERSION := $(VERSION)$(if $(GIT_DESCRIBE), (git $(GIT_DESCRIBE)))
comma := ,
empty :=
space := $(empty) $(empty)
BUILD_GPU_CODE := $(patsubst code=%,%,$(filter code=%,$(subst $(comma), ,$(GPU_ARCH))))
build/version.c: FORCE
	@mkdir -p build
	@printf '// Written by the Makefile: what --version prints (cli.h).\nconst char build_version[] = "%s";\nconst char build_gpu_code[] = "%s";\n' \
	    '$(BUILD_VERSION)' '$(BUILD_GPU_CODE)' > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi
build/version.o: build/version.c
	$(CC) $(CFLAGS) -c -o $@ $<

# The trainer, compiled once: train_unet is this object, and generate and evaluate link it for its
# C API (unet_api.h), each bringing its own main (train_unet.cu's is weak).
build/train_unet.o: train_unet.cu $(TRAINER_HEADERS) build/precision
	@mkdir -p build
	$(NVCC) $(NVCCFLAGS) -c -o $@ $<

train_unet: build/train_unet.o build/version.o
	$(NVCC) $(GPU_ARCH) -o $@ $^ $(CUDA_LIBS)

build/generate.o: generate.c cli.h dataset.h fileio.h sampler.h random.h png.h unet_api.h
	@mkdir -p build
	$(CC) $(CFLAGS) $(STB_CFLAGS) -c -o $@ $<

generate: build/generate.o build/train_unet.o build/version.o
	$(NVCC) $(GPU_ARCH) -o $@ $^ $(CUDA_LIBS)

build/evaluate.o: evaluate.c checkpoint.h cli.h dataset.h fileio.h metrics.h ptfile.h tensorfile.h unet_api.h sampler.h
	@mkdir -p build
	$(CC) $(CFLAGS) $(STB_CFLAGS) -c -o $@ $<

evaluate: build/evaluate.o build/train_unet.o build/version.o
	$(NVCC) $(GPU_ARCH) -o $@ $^ $(CUDA_LIBS)

prepare_data: prepare_data.c data/shapes.c build/version.o cli.h dataset.h fileio.h random.h data/shapes.h
	$(CC) $(CFLAGS) $(STB_CFLAGS) -pthread -o $@ prepare_data.c data/shapes.c build/version.o $(STB_LIBS)

check_shapes: data/check_shapes.c data/shapes.c build/version.o cli.h dataset.h fileio.h random.h data/shapes.h
	$(CC) $(CFLAGS) $(STB_CFLAGS) -o $@ data/check_shapes.c data/shapes.c build/version.o $(STB_LIBS)

# The bundled dataset: deterministic, so it is generated rather than committed.
data/shapes.bin: prepare_data
	./prepare_data --synthetic shapes --count $(SHAPES_COUNT) --size $(SHAPES_SIZE) --seed $(SHAPES_SEED) \
	    --output $@

# Tests: every program under dev/test is built into build/test and run by dev/test/run_tests.sh.
ASAN := -fsanitize=address,undefined -fno-omit-frame-pointer
NVCC_ASAN := -Xcompiler -fsanitize=address,-fsanitize=undefined,-fno-omit-frame-pointer -lasan -lubsan
TESTS_CPU := build/test/test_dataset build/test/test_safetensors build/test/test_shapes build/test/test_dataloader build/test/train_unet_asan \
             build/test/test_reference build/test/test_unet_fixtures build/test/test_checkpoint build/test/test_conv_plan \
             build/test/test_sampler build/test/test_sampler_fixture build/test/test_loss_plot build/test/test_model_inference \
             build/test/test_metrics build/test/test_inception build/test/test_rendezvous build/test/test_update_plan
TESTS_GPU := build/test/test_dataloader_gpu build/test/test_unet_gpu_fp32 build/test/test_unet_gpu_bf16 \
             build/test/test_unet_gpu_reference_fp32 build/test/test_unet_gpu_reference_bf16 \
             build/test/test_sampler_gpu_fp32 build/test/test_sampler_gpu_bf16 \
             build/test/test_inception_gpu_fp32 build/test/test_inception_gpu_bf16 build/test/generate_fp32

build/test/test_dataset: dev/test/test_dataset.c dataset.h fileio.h dev/test/check.h
	@mkdir -p build/test
	$(CC) $(CFLAGS) $(ASAN) -o $@ $<

# The checkpoint readers (checkpoint.h) on the corpus, with UBSan findings fatal.
build/test/test_safetensors: dev/test/test_safetensors.c checkpoint.h ptfile.h tensorfile.h fileio.h dev/test/check.h
	@mkdir -p build/test
	$(CC) $(CFLAGS) $(ASAN) -fno-sanitize-recover=undefined -o $@ $< -lm

# The loss chart (loss_plot.h, run/loss.svg); `build/test/test_loss_plot --chart LOG.csv OUT.svg` draws one.
build/test/test_loss_plot: dev/test/test_loss_plot.c loss_plot.h dev/test/check.h
	@mkdir -p build/test
	$(CC) $(CFLAGS) $(ASAN) -fno-sanitize-recover=undefined -o $@ $< -lm

build/test/test_shapes: dev/test/test_shapes.c data/shapes.c data/shapes.h random.h dev/test/check.h
	@mkdir -p build/test
	$(CC) $(CFLAGS) $(ASAN) $(STB_CFLAGS) -o $@ dev/test/test_shapes.c data/shapes.c $(STB_LIBS)

# The tests of the trainer's host code include train_unet.cu itself (library mode, no main): one
# source of truth, its internals in reach. The loader's under AddressSanitizer.
build/test/test_dataloader: dev/test/test_dataloader.cu train_unet.cu $(TRAINER_HEADERS) dev/test/check.h build/precision
	@mkdir -p build/test
	$(NVCC) $(NVCC_HOST_TESTS) $(NVCC_ASAN) -o $@ $< $(CUDA_LIBS)

# The sample-quality mathematics (metrics.h) against known answers and the NumPy port's fixture.
build/test/test_metrics: dev/test/test_metrics.c metrics.h checkpoint.h ptfile.h tensorfile.h fileio.h dev/test/check.h
	@mkdir -p build/test
	$(CC) $(CFLAGS) $(ASAN) -fno-sanitize-recover=undefined -o $@ $< -lm

build/test/test_sampler: dev/test/test_sampler.c sampler.h random.h png.h dev/test/check.h
	@mkdir -p build/test
	$(CC) $(CFLAGS) $(ASAN) $(STB_CFLAGS) -o $@ $< $(STB_LIBS)

build/test/test_checkpoint build/test/test_sampler_fixture build/test/test_conv_plan build/test/test_model_inference \
        build/test/test_inception build/test/test_rendezvous build/test/test_update_plan: build/test/%: dev/test/%.cu \
        train_unet.cu $(TRAINER_HEADERS) dev/test/check.h build/precision
	@mkdir -p build/test
	$(NVCC) $(NVCC_HOST_TESTS) -o $@ $< $(CUDA_LIBS)

# The trainer's host code under AddressSanitizer, for the command-line tests on damaged input.
build/test/train_unet_asan: train_unet.cu $(TRAINER_HEADERS) build/precision build/version.o
	@mkdir -p build/test
	$(NVCC) $(NVCC_HOST_TESTS) $(NVCC_ASAN) -o $@ $< build/version.o $(CUDA_LIBS)

# The CPU references (dev/*.cu, double precision): finite differences per layer, and the whole
# model against the PyTorch fixtures.
DEV_REFERENCES := dev/common.h dev/conv2d.cu dev/linear.cu dev/groupnorm.cu dev/attention.cu dev/resample.cu \
                  dev/embedding.cu dev/loss.cu dev/unet.cu
build/test/test_reference build/test/test_unet_fixtures: build/test/%: dev/test/%.cu $(DEV_REFERENCES) train_unet.cu $(TRAINER_HEADERS) \
        dev/test/check.h build/precision
	@mkdir -p build/test
	$(NVCC) $(NVCC_HOST_TESTS) -o $@ $< $(CUDA_LIBS)

# The GPU tests, for the GPU's own architecture when there is one. The loader's batches on the GPU:
build/test/test_dataloader_gpu: dev/test/test_dataloader_gpu.cu train_unet.cu $(TRAINER_HEADERS) dev/test/check.h build/precision
	@mkdir -p build/test
	$(NVCC) $(NVCCFLAGS) -o $@ $< $(CUDA_LIBS)

# The whole model against the PyTorch fixtures, in both precisions whatever PRECISION is.
# The same against the CPU reference on configurations the fixtures do not cover.
build/test/test_unet_gpu_fp32 build/test/test_unet_gpu_bf16: build/test/test_unet_gpu_%: dev/test/test_unet_gpu.cu train_unet.cu $(TRAINER_HEADERS) \
        dev/test/check.h
	@mkdir -p build/test
	$(NVCC) $(NVCC_COMMON) -DPRECISION_$(shell echo $* | tr a-z A-Z) -o $@ $< $(CUDA_LIBS)
# generate of the FP32 build whatever PRECISION is (test_guidance_gpu.sh: classifier guidance against PyTorch in float32).
build/test/train_unet_fp32.o: train_unet.cu $(TRAINER_HEADERS)
	@mkdir -p build/test
	$(NVCC) $(NVCC_COMMON) -DPRECISION_FP32 -c -o $@ $<
build/test/generate_fp32: build/generate.o build/test/train_unet_fp32.o build/version.o
	$(NVCC) $(GPU_ARCH) -o $@ $^ $(CUDA_LIBS)
build/test/test_unet_gpu_reference_%: dev/test/test_unet_gpu_reference.cu train_unet.cu $(TRAINER_HEADERS) $(DEV_REFERENCES) dev/test/check.h
	@mkdir -p build/test
	$(NVCC) $(NVCC_COMMON) -DPRECISION_$(shell echo $* | tr a-z A-Z) -o $@ $< $(CUDA_LIBS)
# The GPU sampling loop against sampler.h's host loop, in both precisions.
build/test/test_sampler_gpu_%: dev/test/test_sampler_gpu.cu train_unet.cu $(TRAINER_HEADERS) dev/test/check.h
	@mkdir -p build/test
	$(NVCC) $(NVCC_COMMON) -DPRECISION_$(shell echo $* | tr a-z A-Z) -o $@ $< $(CUDA_LIBS)

# evaluate's GPU paths (Inception's features, the metrics) in both precisions; run by dev/test/test_evaluate_gpu.sh.
build/test/test_inception_gpu_%: dev/test/test_inception_gpu.cu train_unet.cu $(TRAINER_HEADERS) metrics.h dev/test/check.h
	@mkdir -p build/test
	$(NVCC) $(NVCC_COMMON) -DPRECISION_$(shell echo $* | tr a-z A-Z) -o $@ $< $(CUDA_LIBS)

# Per-layer GPU checks: each dev/<layer>.cu has a main (the trainer's own kernels against the CPU
# reference on random shapes, and timings at the seed model's shapes). `make dev` builds them into
# build/dev and runs dev/run_dev.sh (one table, "N passed, N failed"); `make dev-memcheck` runs each
# under compute-sanitizer (DEV_QUICK=1: one timed run each). Neither needs stb or the dataset.
DEV_LAYERS := conv2d bench_conv linear groupnorm attention resample concat embedding loss adamw
DEV_BINARIES := $(addprefix build/dev/,$(DEV_LAYERS))

$(DEV_BINARIES): build/dev/%: dev/%.cu $(DEV_REFERENCES) train_unet.cu $(TRAINER_HEADERS) build/precision
	@mkdir -p build/dev
	$(NVCC) $(NVCCFLAGS) -o $@ $< $(CUDA_LIBS)

# The targets that run on a GPU. Without one (nvidia-smi finds none) they build nothing and say so.
ifneq ($(GPU_CC),)
dev: $(DEV_BINARIES)
	dev/run_dev.sh

dev-memcheck: $(DEV_BINARIES)
	@failed=""; for b in $(DEV_BINARIES); do \
	    echo "== compute-sanitizer --tool memcheck $$b"; \
	    DEV_QUICK=1 compute-sanitizer --tool memcheck --error-exitcode 1 $$b || failed="$$failed $$b"; \
	done; \
	if [ -n "$$failed" ]; then echo "memcheck: FAIL:$$failed"; exit 1; else echo "memcheck: all clean"; fi

test-gpu: all $(TESTS_GPU) build/test/test_inception  # (test_train_gpu.sh writes Inception weights with it)
	dev/test/run_tests.sh gpu
else
dev dev-memcheck test-gpu:
	@echo "no GPU: skipped (nvidia-smi finds none)"
endif

.PHONY: dev dev-memcheck

test: all $(TESTS_CPU) $(if $(GPU_CC),$(TESTS_GPU))
	dev/test/run_tests.sh all

# The binaries and test programs, built and not run.
tests: all $(TESTS_CPU) $(TESTS_GPU)

# Our training step against PyTorch's (eager, compile, compile + CUDA graphs), side by side, then
# DDIM-50 sampling of 256 images (generate --bench against scripts/sample_torch.py).
# BENCH="seed:32 seed:128 adm64:32" picks presets and batch sizes (adm64's compile takes minutes).
BENCH ?= seed:32 seed:128
bench: train_unet generate evaluate data/shapes.bin
	scripts/bench.sh $(BENCH)
	scripts/bench_fid.sh

# evaluate against pytorch-fid's way to FID, on two sets of 50,000 64x64 images (make bench runs it too).
bench-fid: evaluate prepare_data
	scripts/bench_fid.sh

# The implicit-GEMM 3x3 convolutions alone (dev/bench_conv.cu): checked against the CPU reference,
# then timed on every 3x3 convolution shape of the seed and adm64 presets at batch 32 and 128 (or,
# with BENCH_CONV_PRESETS="adm128:16 adm256:8", of those presets at those batches) and joined with
# cuDNN's times on the same shapes in the same run (scripts/bench_conv_torch.py: PyTorch,
# channels-last bf16). Our rows are kept in build/bench_conv.txt, cuDNN's in
# build/bench_conv_cudnn.txt. (`make dev` runs its checks too.)
BENCH_CONV_PRESETS ?=
bench-conv: build/dev/bench_conv
	build/dev/bench_conv
	build/dev/bench_conv --bench $(if $(strip $(BENCH_CONV_PRESETS)),--presets $(subst $(space),$(comma),$(strip $(BENCH_CONV_PRESETS)))) | tee build/bench_conv.txt
	python3 scripts/bench_conv_torch.py build/bench_conv.txt --save build/bench_conv_cudnn.txt

# Fuzzing with libFuzzer (clang): each dev/fuzz/fuzz_X.c is built with AddressSanitizer and UBSan
# into build/fuzz/fuzz_X and run for FUZZ_SECONDS from the committed seed corpus dev/test/corpus/X
# (read only: new inputs go to build/fuzz/corpus_X) by dev/fuzz/run_fuzz.sh, which prints each
# target's execution count and fails on any crash, leak or sanitizer report.
FUZZ_TARGETS := dataset safetensors state pt
FUZZ_SECONDS ?= 60
FUZZ_CC ?= clang

# Header dependencies come from the compiler (-MMD), so each target rebuilds when what it includes changes.
build/fuzz/fuzz_%: dev/fuzz/fuzz_%.c
	@mkdir -p build/fuzz
	$(FUZZ_CC) -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Wall -Wextra -I. -MMD -MP \
	    -MF $@.d -MT $@ -o $@ $<
-include $(FUZZ_TARGETS:%=build/fuzz/fuzz_%.d)

fuzz: $(FUZZ_TARGETS:%=build/fuzz/fuzz_%)
	dev/fuzz/run_fuzz.sh $(FUZZ_SECONDS) $(FUZZ_TARGETS)

.PHONY: fuzz

clean:
	rm -rf build $(BINARIES) data/shapes.bin

FORCE:
.PHONY: all test tests test-gpu bench bench-fid bench-conv clean FORCE
