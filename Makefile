# make demo: the whole pipeline on the embedded tiny target (CPU, a few minutes).
# make test: the test suite (installs the test-only extras first).
PY ?= python3

.PHONY: install install-test demo test
install: .installed
.installed: requirements.txt pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -e .   # eagle3/ and reference/ importable from every folder
	touch .installed

# speculators (vLLM export test) pins torch and datasets pins fsspec: install them without deps.
install-test: .installed-test
.installed-test: .installed requirements-test.txt
	$(PY) -m pip install -r requirements-test.txt
	$(PY) -m pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0
	touch .installed-test

demo: install
	bash demo.sh runs/demo

test: install-test
	$(PY) -m pytest -q tests
