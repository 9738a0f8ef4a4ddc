# Two commands on a fresh machine: `make train` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install train test test-fast test-slow check-errors bench bench-cache bench-plan \
	bench-documents bench-hf bench-ceiling bench-parallel bench-pipeline clean

$(PY):
	python3 -m venv $(VENV)

# Reinstall when the pinned dependencies change.
# pip byte-compiles one file at a time; compileall on every core is faster.
# Like pip, it skips files that are not valid for this Python (torch ships a
# Python 3.12-only test helper), so its exit status is not checked.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --no-compile -e '.[test]'
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	touch $(STAMP)

install: $(STAMP)

# The default SimpleFSDP rehearsal: 2 CPU ranks, the Llama debug recipe,
# bundled c4_test data and tokenizer.
train: install
	./run_train.sh --training.steps 10 --dataloader.dataset c4_test \
		--hf_assets_path=./tests/assets/tokenizer

# The test tiers (pytest markers, registered in pyproject.toml):
#   test       every unit test and the core end-to-end runs: the two-rank
#              rehearsal, parity, resume and the error matrix (~6 min here:
#              342 s on the 2-core Xeon, 2026-12-07)
#   test-slow  the remaining multi-process proofs, make train's first run
#              among them (CI runs both). Two test files at a time
#              (pytest-xdist): a launch leaves a core idle while it starts,
#              waits on a collective or plans in one process.
#   test-fast  no multi-process launch, for the edit loop (~2 min)
test: install
	$(PY) -m pytest -q -m "not slow" tests

test-slow: install
	$(PY) -m pytest -q -m slow -n 2 --dist loadfile tests

test-fast: install
	$(PY) -m pytest -q -m "not e2e and not slow" tests

# Every launch mistake the tutorial's users make, run as they would run it:
# one line per case with the message seen and the time to exit (~5 minutes).
check-errors: install
	$(PY) scripts/check_errors.py

# SimpleFSDP jit against torchtitan's eager FSDP2, upstream's aot_fx_trace and
# 1 rank, and scaling to 4 ranks, on the tiny, medium and DeepSeek models;
# Every peer under full and under selective AC, 3 launches per cell (hours on 2 cores:
# narrow it). Writes docs/bench.md and docs/bench.png.
# Not part of `make test`. Narrow it: make bench BENCH_ARGS="--models tiny".
bench: install
	$(PY) scripts/bench.py $(BENCH_ARGS)

# What the machine lets the bench's MFU reach: the matmul peak with one and
# with both cores busy, each bench model's own matmuls, its parameter update,
# and one step's collectives on gloo (1-3 minutes).
bench-ceiling: install
	$(PY) scripts/bench_ceiling.py $(BENCH_ARGS)

# First step with a cold and a warm compile cache (about 3 minutes).
bench-cache: install
	$(PY) scripts/bench_compile_cache.py

# Planned vs measured peak tensor memory on CPU ranks (about 22 minutes);
# writes docs/plan_accuracy.md. Not part of `make test`.
bench-plan: install
	$(PY) scripts/bench_plan.py

# Step time and peak memory of block_causal against causal attention on the
# tiny Llama and DeepSeek recipes (about 4 minutes).
bench-documents: install
	$(PY) scripts/bench_documents.py

# Expert against tensor parallelism (DeepSeek debug, 4 ranks) and context
# parallelism's memory (Llama debug, seq 2048, 2 ranks), at equal work
# (about 10 minutes). Figures in docs/parallelisms.md.
bench-parallel: install
	$(PY) scripts/bench_parallelisms.py

# The pipeline's measured bubble against 1F1B's theoretical one: PP2 on 2
# ranks against 1 rank, 2, 4 and 8 microbatches (about 10 minutes).
bench-pipeline: install
	$(PY) scripts/bench_pipeline.py

# The Hugging Face hand-off figures of docs/hf.md: import, round trip and
# export of each family's debug flavor against transformers (about 8 minutes).
bench-hf: install
	$(PY) -m pytest -q -s -m slow tests/test_hf.py | grep "hf-figure"

clean:
	rm -rf outputs .pytest_cache
