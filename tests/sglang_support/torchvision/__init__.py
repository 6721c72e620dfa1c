"""Import-only stand-in for `torchvision`, for the tests' CPU SGLang server.

Why: SGLang 0.5.23 imports `torchvision.transforms` at start-up through a multimodal config
(`sglang.srt.configs` -> `nano_nemotron_vl` -> `multimodal.internvl_utils`) even to serve a text
model. No torchvision wheel this machine can reach matches the CPU build of torch 2.13.0: PyPI's
0.28.0 is built against CUDA torch and fails at import ("operator torchvision::nms does not
exist"), and download.pytorch.org's CPU index is not reachable. A text-only DeepSeek never
calls it; any call raises and is logged (`import_only`).

What would make it go: a CPU torchvision build for torch 2.13.0 in `make install-sglang`, or an
SGLang release that imports its multimodal configs lazily.
"""

import sys

from eagle3_sglang_test_support.import_only import make_stand_in

make_stand_in(sys.modules[__name__])
