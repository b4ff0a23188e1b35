# The two commands of the README: `make serve` brings the system up, `make test` runs the tests.
# Both create the virtual environment from this repo's own files on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: serve test format bench-engine bench-mesh bench-transfer bench-tracing bench-timeline bench-detokenize bench-sampling bench-structured bench-soak bench-prefix-cache bench-goodput bench-peer proto k8s-examples clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev,ucx]"
	touch $@

serve: $(VENV)/.installed
	$(VENV)/bin/epdmesh serve $(ARGS)

# lint and format check first (ruff, configured in pyproject.toml; `make format` fixes what it can), then the suite
test: $(VENV)/.installed
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/ruff format --check --quiet .
	$(PY) -m pytest -q $(ARGS)

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix --quiet .
	$(VENV)/bin/ruff format --quiet .

bench-engine: $(VENV)/.installed
	$(PY) -m bench.engine $(ARGS)

bench-mesh: $(VENV)/.installed
	$(PY) -m bench.mesh $(ARGS)

bench-transfer: $(VENV)/.installed
	$(PY) -m bench.transfer $(ARGS)

bench-tracing: $(VENV)/.installed
	$(PY) -m bench.tracing $(ARGS)

bench-timeline: $(VENV)/.installed
	$(PY) -m bench.timeline $(ARGS)

bench-detokenize: $(VENV)/.installed
	$(PY) -m bench.detokenize $(ARGS)

bench-sampling: $(VENV)/.installed
	$(PY) -m bench.sampling $(ARGS)

bench-structured: $(VENV)/.installed
	$(PY) -m bench.structured $(ARGS)

bench-soak: $(VENV)/.installed
	$(PY) -m bench.soak $(ARGS)

bench-prefix-cache: $(VENV)/.installed
	$(PY) -m bench.prefix_cache $(ARGS)

# e.g. make bench-goodput ARGS="--url http://127.0.0.1:8000 --workload textcaps --rates 1,2,4"
bench-goodput: $(VENV)/.installed
	$(PY) -m bench.goodput $(ARGS)

# epdmesh against vLLM's CPU build on one checkpoint (vLLM installed beside the repo: ../shared/peer/)
bench-peer: $(VENV)/.installed
	$(PY) -m bench.peer $(ARGS)

# regenerate epdmesh/v1/*_pb2*.py from proto/ (a test fails when they are stale)
proto: $(VENV)/.installed
	$(PY) -m epdmesh.protogen

# re-render deploy/k8s/*.yaml with the command in each one's first line (a test fails when they are stale)
k8s-examples: $(VENV)/.installed
	for f in deploy/k8s/*.yaml; do $(PY) -m epdmesh.cli $$(head -1 $$f | cut -c10-) --out $$f || exit 1; done

clean:
	rm -rf $(VENV) *.egg-info
