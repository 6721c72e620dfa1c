#!/usr/bin/env bash
# Builds the SGLang 0.5.17 bundle that benchmarks/gpu_sglang.sh carries to the lent GPU: SGLang
# and the wheels it imports that the GPU machine (python 3.12, torch 2.11 + CUDA 13, triton,
# transformers 5.17) lacks, unpacked into one folder and xz-compressed.
#
#   bash benchmarks/sglang_gpu_bundle.sh /tmp/gpusite.tar.xz     # ~10 min on 2 cores, 49 MB
#
# - The list is what SGLang 0.5.17's server imports (found by importing its http server,
#   scheduler, model runner, DeepSeek-V2 / Llama / EAGLE-3 models, triton attention and the
#   EAGLE worker on a machine holding only the GPU image's packages), pinned; transformers
#   5.12.1 and tokenizers 0.22.2 because 0.5.17 does not import with 5.17 ("'qwen3_asr' is
#   already used by a Transformers config"): the server gets the bundle as its own PYTHONPATH.
# - sglang-kernel 0.4.5 is 383 MB as published: a 1.12 GB FlashAttention-3 library
#   (flash_ops), the InfLLM library and the sm100 build, none of which an H100/H200 server on
#   the triton backend loads; they are removed (sgl_kernel/load_utils.py loads sm90/ on
#   compute capability 9.0).
# - xgrammar's static library (lib/libxgrammar.a: headers for building against it) goes, and
#   the CPU-only shared libraries are stripped of debug symbols (xgrammar's bindings: 51 MB ->
#   2 MB); CUDA libraries (sgl_kernel, flashinfer, torchao, tvm_ffi) are left as they are.
# - Every wheel is checked against benchmarks/sglang_gpu_bundle.sha256 before it is unpacked.
set -euo pipefail
out=${1:?usage: $0 OUT.tar.xz}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
# Each wheel is fetched for exactly the platform tags its pinned file name carries: with a list of
# platforms, pip 23 takes the first wheel any of them matches (apache-tvm-ffi 0.1.11's
# manylinux2014 build instead of the pinned manylinux_2_24/_2_28 one).
while read -r _ wheel; do
    IFS=- read -r name version _py _abi plat <<< "${wheel%.whl}"
    tags=()
    for t in ${plat//./ }; do tags+=(--platform "$t"); done
    python3 -m pip download -q --python-version 3.12 --implementation cp --only-binary=:all: \
        --no-deps "${tags[@]}" -d "$work/wheels" "${name}==${version}"
done < "$here/sglang_gpu_bundle.sha256"
(cd "$work/wheels" && sha256sum -c --quiet "$here/sglang_gpu_bundle.sha256")
mkdir -p "$work/site"
for w in "$work"/wheels/*.whl; do unzip -q -o "$w" -d "$work/site"; done
cd "$work/site"
rm -f sgl_kernel/flash_ops.abi3.so sgl_kernel/infllm_ops*.so xgrammar/lib/libxgrammar.a
rm -rf sgl_kernel/sm100
find . -name __pycache__ -prune -exec rm -rf {} +
find . -name "*.so*" -type f | grep -v -E "^./(sgl_kernel|flashinfer|torchao|tvm_ffi|torch_memory_saver)" \
    | while read -r f; do strip --strip-unneeded "$f" 2>/dev/null || true; done
tar cf - . | xz -T2 -9 > "$out"
rm -rf "$work"
ls -la "$out"
