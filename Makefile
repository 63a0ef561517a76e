# ragspec: two commands on a fresh machine.
#   make run   - create .venv, install torch 2.13.0 (CPU) and ragspec, fetch the default model,
#                summarize one Spec-Bench RAG prompt with stats and the plain-decoding comparison
#   make test  - the same setup (with the ray extra, for the Ray Serve tests), then the whole
#                test suite (CI runs exactly this)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DATA   ?= ../shared/data/specbench-dev.jsonl
STAMP  := $(VENV)/.ragspec-installed

.PHONY: setup data run lint test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is a CPU build on this machine's disk; an unpinned torch pulls CUDA
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,plot,ray]'
	touch $(STAMP)

setup: $(STAMP)

data:
	@test -f $(DATA) || { echo "Spec-Bench dev data not found at $(DATA): run make in a checkout beside shared/, or give its path: make run DATA=path/to/specbench-dev.jsonl" >&2; exit 2; }

run: data setup
	$(BIN)/ragspec model fetch
	$(BIN)/ragspec summarize --specbench $(DATA) --category rag --index 0 --compare

# ruff (lint + format check) and mypy, pinned in the test extra
LINT := ragspec tests examples $(wildcard scripts/*.py)
lint: setup
	$(BIN)/ruff check $(LINT)
	$(BIN)/ruff format --check $(LINT)
	$(BIN)/mypy
	$(BIN)/python scripts/check_doc_links.py

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

bench: setup
	$(BIN)/ragspec bench --data $(DATA) --limit 10 --json bench.json

clean:
	rm -rf $(VENV) build *.egg-info
