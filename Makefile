# make demo: the whole pipeline on the embedded tiny target (CPU, a few minutes).
# make test: the test suite.
PY ?= python3

.PHONY: install demo test
install: .installed
.installed: requirements.txt
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -r requirements.txt
	touch .installed

demo: install
	bash demo.sh runs/demo

test: install
	$(PY) -m pytest -q tests
