#!/usr/bin/env bash
# The whole pipeline on the embedded tiny target, on CPU, in a few minutes.
# Every stage is the same script and code path as the real run; only the flags differ.
# Usage: bash demo.sh [--stream] [WORKDIR]   (default runs/demo; re-running resumes / skips
# finished stages; --stream runs 02b and 04 at the same time through a bounded spool)
# EAGLE3_TINY_ARCH=llama bash demo.sh runs/llama: the same on the tiny Llama target (vLLM-servable).
set -euo pipefail
cd "$(dirname "$0")"
STREAM=0
if [ "${1:-}" = "--stream" ]; then STREAM=1; shift; fi
SPOOL_GB=0.01
W=${1:-runs/demo}
T=$W/target
export PYTHONUNBUFFERED=1

# The target has random weights: its greedy output loops, and a draft accepted on loops has
# learned nothing. 04 and 05 print the loop share and the loop-free acceptance beside every
# acceptance figure; read those. (`--pretrain` trains the target on the demo text first,
# eagle3/tiny/pretrain.py; its effect on the demo's figures is not measured yet.)
python -m eagle3.tiny.target --out "$T" --arch "${EAGLE3_TINY_ARCH:-deepseek_v3}"
python 01_prepare_datasets.py --recipe datasets/demo.json --workdir "$W" --target "$T"
python 01b_generate_synthetic.py --workdir "$W" --target "$T" --backend hf --max-new-tokens 48
python datasets/merge_and_shuffle.py --workdir "$W" --eval-fraction 0.1
extract() { python 02b_extract_hidden_states_sglang.py --workdir "$W" --target "$T" --backend hf "$@"; }
vocab() { python 03_build_vocab_mapping.py --workdir "$W" --target "$T" --draft-vocab 256; }
# 04: one intra-op thread: the tiny draft's ops are too small to gain from more, and
# oversubscribed threads on a busy machine slow them down tenfold.
train() {
    OMP_NUM_THREADS=1 python 04_train.py --workdir "$W" --target "$T" --epochs 6 --lr 1e-3 \
        --max-seq-len 512 --num-workers 1 --eval-every 100 --log-every 50 "$@"
}
source tools/extract_and_train.sh
python 05_benchmark.py --workdir "$W" --target "$T" --backend hf --steps 3 7 \
    --max-new-tokens 32 --num-prompts 8
python -m eagle3.core.run_summary "$W"
