"""Test support that lets the real SGLang run on a CPU in the test suite (never product code).

The folder above this package (`tests/sglang_support/`) goes on the SGLang server's PYTHONPATH
(tests/sglang_helpers.py) and on no other python's; `eagle3/` never imports it. It holds:

- `sgl_kernel/`, `torchvision/`: import-only stand-ins for two packages SGLang imports at start-up
  but never calls on this path (`import_only.py`; each says why it exists and what makes it go);
- `mla_plugin.py`: the DeepSeek MLA prefill fix for the `torch_native` attention backend, loaded
  by SGLang's scheduler through the entry point that `eagle3_sglang_test_support-0.dist-info/`
  declares in SGLang's plugin group `sglang.srt.plugins`.
"""
