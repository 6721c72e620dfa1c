#!/usr/bin/env bash
# The real SGLang (0.5.17) on the lent GPU: benchmarks/bench_sglang_gpu.py's phases.
#   dump      the dump patch against HF in bf16 (tiny DeepSeek-V3 at Kimi's latent width)
#   serve     SmolLM2-135M-Instruct plain and with the committed chat draft (EAGLE3)
#   kimi      the dump's cost at Kimi-K2.5's width (random weights), an MLA draft served
#   pipeline  the whole pipeline on a real target through the patched SGLang, then its draft
#             served beside plain (benchmarks/gpu_pipeline.py: Qwen2.5-Coder-1.5B-Instruct)
#   pipeline-train, pipeline-serve  the same in two sessions (below): up to 04, its draft back;
#             then that draft served beside plain and the offline 05
#
# What travels: SGLang 0.5.17 and the wheels it imports that the GPU machine lacks, unpacked into
# one folder and xz-compressed (benchmarks/sglang_gpu_bundle.sh builds it: ~51 MB), then the
# target's GGUF (SmolLM2 98 MB, Qwen2.5-Coder 1,117 MB), then (session B) the draft's tar, as one
# stream cut in parts that fit a device call beside the tree that travels with it (64 MiB a call
# in all; `split` computes the part size from what would travel now, PART=BYTES overrides it).
# Made here once (.git/info/exclude ignores /.gpu/):
#   bash benchmarks/sglang_gpu_bundle.sh /tmp/gpusite.tar.xz
#   bash benchmarks/gpu_sglang.sh split /tmp/gpusite.tar.xz GGUF TARGET   # -> .gpu/p1 ... .gpu/pK
# TARGET is a packaged target's name (smollm2-135m, qwen2.5-coder-1.5b); `split` prints K and
# which part completes the bundle (B). Keep what travels small: the Qwen GGUF needs ~18 calls at
# ~62 MB, so ignore the folders the GPU run does not read for those calls (tests/fixtures, the
# raw results) and carry only the part. Then device calls on one warm machine, each within ~30 s
# of the one before (carry .gpu/pN in call N):
#   calls 1..B-1: bash benchmarks/gpu_sglang.sh part N
#   call B:       bash benchmarks/gpu_sglang.sh part B && bash benchmarks/gpu_sglang.sh site kimi
#                 (unpacks SGLang, patches it, starts the given phases detached)
#   calls ..K-1:  bash benchmarks/gpu_sglang.sh part N      (the site phases run meanwhile)
#   call K:       bash benchmarks/gpu_sglang.sh part K && bash benchmarks/gpu_sglang.sh start pipeline
#                 (converts the target, stops the site phases if still running, starts these)
#   then:         bash benchmarks/gpu_sglang.sh follow 560   (or `fetch 60`: brings the draft
#                 parts back as soon as 04 wrote them, a few a call)
# The SmolLM2 phases: `site dump`, then `start serve kimi`. Every call leaves under $OUT what has
# finished: <phase>.json, results.tgz (logs, manifests), and draft parts once 04 has written one.
#
# The pipeline in two sessions: a session's 30 minutes hold the data stages and a real 04, or a
# draft's serving, not both (the step times: benchmarks/gpu_pipeline.py). Qwen2.5-Coder, B = 1:
#   session A (train), here:
#     bash benchmarks/gpu_sglang.sh split /tmp/gpusite.tar.xz GGUF qwen2.5-coder-1.5b
#   device calls, as above but for call K:
#     call 1:   bash benchmarks/gpu_sglang.sh part 1 && bash benchmarks/gpu_sglang.sh site kimi
#     call N:   bash benchmarks/gpu_sglang.sh part N                          (N = 2 .. K-1)
#     call K:   bash benchmarks/gpu_sglang.sh part K && bash benchmarks/gpu_sglang.sh start pipeline-train
#               (04 gets the deadline less the draft's return share; the serving steps and the
#               offline 05 are recorded as skipped, "serve in the next session")
#     then:     bash benchmarks/gpu_sglang.sh follow 560   until the driver has ended (its last
#               lines: pipeline.json's steps; 04 exported), which brings the first draft parts
#     then:     bash benchmarks/gpu_sglang.sh fetch 0      until every draft.tar.partNN that
#               draft.sha256 names came back (~15 parts of 15 MB, 4 a call)
#   here: every call's files folder (files_at) that holds draft parts, joined and checked:
#     bash benchmarks/gpu_sglang.sh join-draft /tmp/draft.tar FILES_AT_1 FILES_AT_2 ...
#   session B (serve), here (the draft ends the stream: ~4 parts more):
#     bash benchmarks/gpu_sglang.sh split /tmp/gpusite.tar.xz GGUF qwen2.5-coder-1.5b /tmp/draft.tar
#   device calls:
#     call 1:   bash benchmarks/gpu_sglang.sh part 1 && bash benchmarks/gpu_sglang.sh site kimi
#     call N:   bash benchmarks/gpu_sglang.sh part N                          (N = 2 .. K-1)
#     call K:   bash benchmarks/gpu_sglang.sh part K && bash benchmarks/gpu_sglang.sh start pipeline-serve
#               (unpacks the draft into /tmp/gs/draft_in/final, converts the target; no data
#               server, no data step, 03 or 04: the servers, 05 natural and fixed, offline 05)
#     then:     bash benchmarks/gpu_sglang.sh follow 560   until the driver has ended
# Both sessions write $OUT/pipeline.json (its "route": train, serve; all for `pipeline`).
set -uo pipefail
cd "$(dirname "$0")/.."
G=${GS_DIR:-/tmp/gs}  # the machine's working folder (GS_DIR: the tests' temp folder)
SITE=/tmp/sglsite
HELD_S=${HELD_S:-1620}  # seconds from the first call to the run's end (a machine is held 30 min)
export PYTHONUNBUFFERED=1

mf() { awk -v k="$1" '$1 == k {print $2}' $G/parts/manifest; }
# bytes FROM (0-based) to FROM+N of the stream the parts hold (split: bundle, GGUF, draft)
stream() { cat $(ls $G/parts/part* | sort) | tail -c +$(( $1 + 1 )) | head -c "$2"; }
has() { echo "$1  $2" | sha256sum -c --status - 2>/dev/null; }  # has SHA256 FILE

unpack() {  # the GGUF and the draft (when the stream holds one) out of the parts, checked
    local bb gb db
    bb=$(mf bundle_bytes); gb=$(mf gguf_bytes); db=$(mf draft_bytes)
    if ! has "$(mf gguf_sha256)" $G/target.gguf; then
        stream "$bb" "$gb" > $G/target.gguf
        echo "$(mf gguf_sha256)  $G/target.gguf" | sha256sum -c - || return 1
    fi
    if [ -n "$db" ]; then  # session A's draft: $G/draft_in/final
        if ! has "$(mf draft_sha256)" $G/draft.tar; then
            stream $(( bb + gb )) "$db" > $G/draft.tar
            echo "$(mf draft_sha256)  $G/draft.tar" | sha256sum -c - || return 1
        fi
        rm -rf $G/draft_in && mkdir -p $G/draft_in && tar xf $G/draft.tar -C $G/draft_in \
            || return 1
        ls -la $G/draft_in/final
    fi
    rm -f $G/parts/part*  # 1.1 GB of disk back; the manifest stays
}

drive() {  # bench_sglang_gpu.py's given phases, detached, with the pipeline's target and deadline
    local draft=()
    [ -f $G/draft_in/final/config.json ] && draft=(--pipeline-draft $G/draft_in/final)
    mkdir -p $G/out
    # the deadline: no step starts past ~2.5 min before the machine goes
    setsid nohup python3 benchmarks/bench_sglang_gpu.py --phases "$@" --out $G/out \
        --sglang-site $SITE --smollm2 $G/target --pipeline-target $G/target "${draft[@]}" \
        --deadline-at $(( $(cat $G/t0) + HELD_S - 150 )) > $G/run_start.log 2>&1 &
    echo $! > $G/start.pid
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$G/out"
    tar czf "$OUT/results.tgz" -C "$G" out $(cd $G && ls -d run_*.log work/pipeline/logs \
        work/pipeline/run/*/manifest.json work/pipeline/run/01c_merged/stats.json \
        work/pipeline/run/01_prepared/*/heldout.jsonl work/pipeline/run/04_train/metrics.jsonl \
        work/pipeline/{serve_*,offline}/05_benchmark/{report.md,results.json,manifest.json} \
        work/logs/*.log 2>/dev/null) 2>/dev/null
    cp "$G"/out/*.json "$OUT/" 2>/dev/null
    # the draft, in 15 MB parts, as many as fit this call (64 MiB and 8 files in all)
    local d=$G/work/pipeline/run/04_train/final
    if [ -f "$d/model.safetensors" ] && [ -f "$d/config.json" ] && [ ! -f $G/draft/done ]; then
        mkdir -p $G/draft && tar cf - -C "$d/.." final | split -b 15000000 -d -a 2 - $G/draft/draft.tar.part
        (cd $G/draft && sha256sum draft.tar.part* > draft.sha256) && touch $G/draft/done
    fi
    if [ -f $G/draft/done ]; then
        cp $G/draft/draft.sha256 "$OUT/"
        for f in $G/draft/draft.tar.part*; do
            [ -f "$f.sent" ] && continue
            [ $(( $(du -sb "$OUT" | cut -f1) + $(stat -c %s "$f") )) -lt 64000000 ] || break
            [ "$(ls "$OUT" | wc -l)" -lt 8 ] || break
            cp "$f" "$OUT/" && touch "$f.sent"
        done
    fi
    ls -la "$OUT"
}

case "${1:-}" in
split)  # here: the bundle, the GGUF (and a draft) as parts, with a manifest of sizes and sha256
    use="usage: $0 split BUNDLE.tar.xz GGUF TARGET [DRAFT.tar]"
    bundle=${2:?$use}; gguf=${3:?$use}; target=${4:?$use}; draft=${5:-}
    [ -z "$draft" ] || tar tf "$draft" | grep -x 'final/model.safetensors' > /dev/null \
        || { echo "$draft holds no final/model.safetensors: join-draft makes the tar" >&2; exit 1; }
    rm -rf .gpu && mkdir -p .gpu
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
           | awk '{s += $1} END {print s}')
    if [ -n "${PART:-}" ]; then part=$PART  # bytes a part, as given
    else
        part=$(( 67108864 - tree - 1048576 ))  # 1 MiB of room for the manifest, files
        [ "$part" -gt 8000000 ] || { echo "the tree that travels is $tree B: no room for parts" >&2; exit 1; }
    fi
    cat "$bundle" "$gguf" ${draft:+"$draft"} | split -b "$part" -d -a 2 - .gpu/part
    k=0
    for f in .gpu/part*; do k=$((k + 1)); mkdir -p .gpu/p$k; mv "$f" .gpu/p$k/; done
    bb=$(stat -c %s "$bundle")
    { echo "target $target"; echo "parts $k"; echo "part_bytes $part"; echo "bundle_bytes $bb"
      echo "bundle_sha256 $(sha256sum "$bundle" | cut -d' ' -f1)"
      echo "gguf_bytes $(stat -c %s "$gguf")"; echo "gguf_sha256 $(sha256sum "$gguf" | cut -d' ' -f1)"
      if [ -n "$draft" ]; then
          echo "draft_bytes $(stat -c %s "$draft")"
          echo "draft_sha256 $(sha256sum "$draft" | cut -d' ' -f1)"
      fi
    } > .gpu/manifest
    for i in $(seq 1 $k); do cp .gpu/manifest .gpu/p$i/; done
    echo "tree $tree B travels; $k parts of $part B; the bundle is complete with part" \
         "$(( (bb + part - 1) / part ))${draft:+; the draft ends the stream}"
    ;;
join-draft)  # here: session A's draft parts (from any of the calls' folders), checked, one tar
    use="usage: $0 join-draft OUT.tar DIR..."
    out=${2:?$use}; shift 2; [ $# -gt 0 ] || { echo "$use" >&2; exit 2; }
    sums=
    for d in "$@"; do
        [ -f "$d/draft.sha256" ] || continue
        [ -z "$sums" ] && sums=$d/draft.sha256
        cmp -s "$sums" "$d/draft.sha256" \
            || { echo "$d/draft.sha256 differs from $sums: two drafts" >&2; exit 1; }
    done
    [ -n "$sums" ] \
        || { echo "no draft.sha256 in $*: collect sends it with the first draft part" >&2; exit 1; }
    files=(); bad=0
    while read -r sum name; do
        got=missing
        for d in "$@"; do  # a part fetched twice: the first copy that checks
            [ -f "$d/$name" ] || continue
            if has "$sum" "$d/$name"; then got=$d/$name; break; fi
            got=damaged
        done
        case $got in
            missing) echo "$name: in none of $* (fetch again: a call brings a few)" >&2; bad=1 ;;
            damaged) echo "$name: damaged, not draft.sha256's sha256 (fetch again)" >&2; bad=1 ;;
            *) files+=("$got") ;;
        esac
    done < "$sums"
    [ "$bad" = 0 ] || exit 1
    cat "${files[@]}" > "$out.tmp" && mv "$out.tmp" "$out" || exit 1
    tar tf "$out" | grep -x 'final/model.safetensors' > /dev/null \
        || { echo "$out holds no final/model.safetensors" >&2; exit 1; }
    echo "$out: ${#files[@]} parts, $(stat -c %s "$out") B (session B: split ... TARGET $out)"
    ;;
part)
    n=${2:?usage: $0 part N}
    mkdir -p $G/parts && cp .gpu/p$n/* $G/parts/ || exit 1
    [ -f $G/t0 ] || date +%s > $G/t0
    echo "part $n: $(ls $G/parts/part* | wc -l) of $(mf parts) here, $(( $(date +%s) - $(cat $G/t0) )) s since the first"
    if [ -f $G/site.pid ]; then tail -2 $G/run_site.log; fi
    ;;
site)  # the bundle: unpack, check, patch every hooked model file, start the given phases
    shift
    stream 0 "$(mf bundle_bytes)" > $G/sglsite.tar.xz
    echo "$(mf bundle_sha256)  $G/sglsite.tar.xz" | sha256sum -c - || exit 1
    rm -rf $SITE && mkdir -p $SITE && tar xJf $G/sglsite.tar.xz -C $SITE || exit 1
    nvidia-smi -L; df -h /tmp /dev/shm | tail -2
    PYTHONPATH=$SITE python3 -c "
import sglang, transformers, sgl_kernel, torch
print('sglang', sglang.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)
import sglang.srt.entrypoints.http_server, sglang.srt.models.deepseek_v2, sglang.srt.models.qwen2"
    python3 -m eagle3.extract.patching --sglang-dir $SITE || exit 1
    python3 -m eagle3.extract.patching --sglang-dir $SITE --check
    mkdir -p $G/out
    setsid nohup python3 benchmarks/bench_sglang_gpu.py --phases "${@:-dump}" --out $G/out \
        --sglang-site $SITE > $G/run_site.log 2>&1 &
    echo $! > $G/site.pid
    sleep 20; tail -5 $G/run_site.log; collect
    ;;
start)  # the GGUF (and draft): join, check, convert; stop the site phases; start these phases
    shift
    if [[ " $* " == *" pipeline-serve "* ]] && [ -z "$(mf draft_bytes)" ]; then
        echo "pipeline-serve serves session A's draft: none in the parts (split ... DRAFT.tar)" >&2
        exit 1
    fi
    unpack || exit 1
    # the converter runs on the machine's transformers; only gguf comes from the bundle
    mkdir -p /tmp/ggufsite && ln -sfn $SITE/gguf /tmp/ggufsite/gguf
    ln -sfn $SITE/gguf-*.dist-info /tmp/ggufsite/
    t=$(date +%s)
    PYTHONPATH=/tmp/ggufsite python3 -m eagle3.targets.gguf --target "$(mf target)" \
        --gguf $G/target.gguf --out $G/target || exit 1
    echo "converted in $(( $(date +%s) - t )) s"
    if [ -f $G/site.pid ] && kill -0 "$(cat $G/site.pid)" 2>/dev/null; then
        echo "the site phases still run: stopped (their finished results are kept)"
        pkill -f "[b]ench_sglang_gpu.py"; pkill -f "[s]glang.launch_server"; sleep 5
        pkill -9 -f "[s]glang.launch_server"; pkill -9 -f "[s]glang::"; sleep 2
    fi
    rm -rf $G/work/kimi/x02b* $G/work/kimi/dumps* /dev/shm/eagle3-kimi*  # the kimi phase's states
    drive "${@:-pipeline}"
    sleep "${WAIT_S:-30}"; tail -5 $G/run_start.log; collect
    ;;
restart)  # stop every server and driver, then run the given phases detached
    shift
    pkill -f "[b]ench_sglang_gpu.py"; pkill -f "[s]glang.launch_server"; sleep 5
    pkill -9 -f "[s]glang.launch_server"; pkill -9 -f "[s]glang::"; sleep 2
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    for ph in "$@"; do rm -rf "$G/out/${ph}_error.txt"; done
    drive "$@"
    ;;
unpack)  # the GGUF and the draft out of the parts (start does it first)
    unpack || exit 1
    ;;
follow|fetch)  # wait for the drivers (follow) or not past WAIT_S (fetch), then collect
    end=$((SECONDS + ${2:-560}))
    while [ $SECONDS -lt $end ] && pgrep -f bench_sglang_gpu.py > /dev/null; do
        sleep 5
        [ "$1" = fetch ] && [ -f $G/work/pipeline/run/04_train/final/config.json ] \
            && [ ! -f $G/draft/done ] && break
    done
    tail -3 $G/run_site.log $G/run_start.log 2>/dev/null
    python3 -c "
import json; d = json.load(open('$G/out/pipeline.json'))
print({k: (v.get('wall_s'), v.get('rc')) for k, v in d['steps'].items()}, 'skipped:', d['skipped'])" 2>/dev/null
    collect
    ;;
*)
    echo "usage: $0 split BUNDLE GGUF TARGET [DRAFT.tar] | join-draft OUT.tar DIR... | part N | unpack | site PHASE... | start PHASE... | restart PHASE... | follow|fetch [WAIT_S]" >&2
    exit 2
    ;;
esac
