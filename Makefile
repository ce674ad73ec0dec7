# dsv4 build.  `make` = CPU-only build (never touches CUDA); `make CUDA=1` adds the
# CUDA backend.  `make test` builds and runs every tests/test_*.c; `make SAN=1`
# builds with ASan/UBSan; `make fuzz` builds the libFuzzer harnesses (clang).
# Use BUILD=dir to keep separate trees (e.g. BUILD=build-san SAN=1).
#
# Dependencies (Debian packages; .ci/run installs the same list):
#   libjansson-dev libpcre2-dev libmicrohttpd-dev, gcc with OpenMP, clang for fuzz.

BUILD ?= build
CC ?= cc
CFLAGS_BASE := -std=c11 -Wall -Wextra -Werror -Wno-unused-parameter -D_GNU_SOURCE -Isrc -fopenmp -g
OPT ?= -O2 -march=x86-64-v3 -mtune=native
LIBS := -ljansson -lpcre2-8 -lutf8proc -lmicrohttpd -lcurl -lm -lpthread -fopenmp

ifeq ($(SAN),1)
  OPT := -O1 -fno-omit-frame-pointer
  CFLAGS_BASE += -fsanitize=address,undefined -fno-sanitize-recover=undefined
  LIBS += -fsanitize=address,undefined
endif

CFLAGS := $(CFLAGS_BASE) $(OPT) $(EXTRA_CFLAGS)

# Every .c under src/ except main.c and the CUDA tree belongs to the library.
SRC := $(filter-out src/main.c,$(shell find src -name '*.c' -not -path 'src/backend/cuda/*' | sort))
CUDA_SRC :=
NVCC ?= /usr/local/cuda/bin/nvcc
ifeq ($(CUDA),1)
  CUDA_C_SRC := $(shell find src/backend/cuda -name '*.c' | sort)
  CUDA_SRC := $(shell find src/backend/cuda -name '*.cu' | sort)
  SRC := $(filter-out src/backend/nocuda.c,$(SRC)) $(CUDA_C_SRC)
  LIBS += -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcudart -lcublasLt -lcublas -lstdc++
  NVCCFLAGS := -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc -Xcompiler -Wall,-Wextra,-Werror --expt-relaxed-constexpr -lineinfo
  # CUDA_EVF: the decode kernels' weight streams evict_first in L2 (docs/CUDA.md, "Weights evict_first"):
  # 2 (the default since stop 48) with a constant policy (common.cuh d_pol_stream), 1 by createpolicy at each
  # use, 0 without the hint.  With CUDA_EVF_CP=1 every GPU test passed and the step was faster than with 0 in
  # every round (H100, stop 48: greedy 3.19-3.20 against 3.25-3.26 ms at 2K, 3.38-3.40 against 3.44-3.48 at
  # 32K).  A change rebuilds the CUDA objects
  CUDA_EVF ?= 2
  NVCCFLAGS += -DDSV4_CUDA_EVF=$(CUDA_EVF)
  # CUDA_EVF_CP (with CUDA_EVF): the MoE's cp.async stage copies carry the hint too (moe.cu b1_cp16): 1 (the
  # default since stop 48) the one-row kernels' (batch-1 decode), 2 also k_moe_bnr's, whose copies stopped on
  # an illegal instruction with it (stop 46), the symptom of a known ptxas fault with hinted cp.async (moe.cu);
  # 0 none (with CUDA_EVF=2 level with no hint at all, stop 47)
  CUDA_EVF_CP ?= 1
  NVCCFLAGS += -DDSV4_CUDA_EVF_CP=$(CUDA_EVF_CP)
endif

OBJ := $(SRC:%.c=$(BUILD)/%.o) $(CUDA_SRC:%.cu=$(BUILD)/%.cu.o)
LIB := $(BUILD)/libdsv4.a
BIN := $(BUILD)/dsv4

TEST_SRC := $(sort $(wildcard tests/test_*.c))
# GPU tests (tests/test_cuda_*.c) are built and run by `make test-cuda` on a machine with a device.
TEST_BIN := $(filter-out $(BUILD)/tests/test_cuda%,$(TEST_SRC:tests/%.c=$(BUILD)/tests/%))

.PHONY: all test tests clean fuzz fuzz-replay default-model test-cuda format
all: $(BIN)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

# The CUDA objects depend on the flags they were built with (CUDA_EVF and the like): the stamp is rewritten
# while the Makefile is read, and so made newer than the objects, only when NVCCFLAGS differ from the last
# build's in this BUILD dir (make -n and -q stay true)
NVCC_STAMP := $(BUILD)/.nvccflags
ifeq ($(CUDA),1)
  $(shell mkdir -p $(BUILD) && (echo '$(NVCCFLAGS)' | cmp -s - $(NVCC_STAMP) || echo '$(NVCCFLAGS)' >$(NVCC_STAMP)))
endif

$(BUILD)/%.cu.o: %.cu $(NVCC_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(LIB): $(OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BIN): $(BUILD)/src/main.o $(LIB)
	$(CC) $(CFLAGS) $^ -o $@ $(LIBS)

$(BUILD)/tests/%: tests/%.c tests/test.h $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -MMD -MP $< $(LIB) -o $@ $(LIBS)

tests: $(BIN) $(TEST_BIN)

# Runs every unit test binary, then the CLI tests; the last line is "N passed, N failed".
test: tests default-model
	@BUILD=$(BUILD) bash tests/run.sh

# The embedded default model: generated deterministically at build time by synth
# (not a committed blob) with the real DeepSeek-V4 tokenizer.  See docs/DEFAULT_MODEL.md.
DEFAULT_MODEL := $(BUILD)/default-model
default-model: $(DEFAULT_MODEL)/config.json
$(DEFAULT_MODEL)/config.json: $(BIN) data/tokenizer/tokenizer.json
	@rm -rf $(DEFAULT_MODEL)
	$(BIN) synth --config tiny --seed 1 --out $(DEFAULT_MODEL) --tokenizer data/tokenizer

# ----- fuzzing (clang + libFuzzer); corpora under fuzz/corpus/<name>/ -----
FUZZ_SRC := $(sort $(wildcard fuzz/fuzz_*.c))
FUZZ_BIN := $(FUZZ_SRC:fuzz/%.c=$(BUILD)/fuzz/%)
# The library is compiled once for all harnesses (sanitizer-coverage objects in
# $(BUILD)/fuzzobj), then each harness links against it.
FUZZ_CFLAGS := -std=c11 -D_GNU_SOURCE -Isrc -g -O1 -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fopenmp=libgomp
FUZZ_OBJ := $(patsubst %.c,$(BUILD)/fuzzobj/%.o,$(filter-out $(CUDA_C_SRC),$(SRC)))
$(BUILD)/fuzzobj/%.o: %.c
	@mkdir -p $(dir $@)
	clang $(FUZZ_CFLAGS) -c $< -o $@
$(BUILD)/fuzz/%: fuzz/%.c $(FUZZ_OBJ)
	@mkdir -p $(dir $@)
	clang $(FUZZ_CFLAGS) -fsanitize=fuzzer $< $(FUZZ_OBJ) -o $@ $(filter-out -fopenmp,$(LIBS)) -lgomp
fuzz: $(FUZZ_BIN)
# Replays every committed corpus (no new inputs): what CI runs.
fuzz-replay: $(FUZZ_BIN)
	@set -e; for f in $(FUZZ_BIN); do n=$$(basename $$f); \
	  echo "replay $$n"; $$f -runs=0 fuzz/corpus/$${n#fuzz_}/ 2>&1 | tail -1; done

# The CUDA op tests and end-to-end comparisons against the CPU backend (needs a GPU:
# run it on the device machine; DSV4_CUDA_FLASH2=DIR adds the 2-layer full-size model,
# see docs/CUDA.md).  Each binary reports SKIP when no device answers.
CUDA_TESTS := $(patsubst tests/%.c,build-cuda/tests/%,$(filter tests/test_cuda%,$(TEST_SRC)))
test-cuda:
	$(MAKE) CUDA=1 BUILD=build-cuda all $(CUDA_TESTS)
	@set -e; for t in $(CUDA_TESTS); do echo "== $$t"; DSV4_BIN=$$PWD/build-cuda/dsv4 $$t; done

format:
	clang-format -i $$(find src tests fuzz -name '*.[ch]' -o -name '*.cu')

clean:
	rm -rf build build-*

-include $(OBJ:.o=.d) $(BUILD)/src/main.d $(TEST_BIN:=.d)
