"""Import-only stand-in for `sgl_kernel` (SGLang's compiled kernel library), for the tests' CPU
SGLang server.

Why: SGLang 0.5.23 imports `sgl_kernel` at start-up (layers, KV cache, sampling), but the CPU build
of `sglang-kernel` is not published as a wheel (it is built from source against one torch), and
the `sglang-kernel` wheel on PyPI is the CUDA build (383 MB), which cannot load on a CPU-only torch.
With `--device cpu --attention-backend torch_native` SGLang's Python layer never calls a kernel:
its one CPU fast path, Intel AMX (`cpu_has_amx_support()`), needs
`torch.ops.sgl_kernel.convert_weight_packed`, which this stand-in does not register, so that path
stays off on every CPU, with or without AMX tiles. Any call raises and is logged (`import_only`);
the tests check the server logs hold none.

What would make it go: a CPU `sglang-kernel` wheel for the torch the SGLang venv holds (then
install it in `make install-sglang` and delete this folder), at the price of taking SGLang's AMX
path on AMX CPUs and not on others.
"""

import sys

from eagle3_sglang_test_support.import_only import make_stand_in

make_stand_in(sys.modules[__name__])
