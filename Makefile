# Two commands on a fresh machine: `make train` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install train test clean

$(PY):
	python3 -m venv $(VENV)

# Reinstall when the pinned dependencies change.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The default SimpleFSDP rehearsal: 2 CPU ranks, the Llama debug recipe,
# bundled c4_test data and tokenizer.
train: install
	./run_train.sh --training.steps 10 --dataloader.dataset c4_test \
		--hf_assets_path=./tests/assets/tokenizer

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf outputs .pytest_cache
