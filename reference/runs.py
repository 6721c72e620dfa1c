"""The drafts a reference run trains beside main's, by work folder (read by reference/steps.py,
which trains them, and reference/phase3.py, which evaluates them)."""

# Storage layouts trained beside main's bf16 (issue 17): work folder -> (02b --dtype,
# 04 --topk-teacher, the folder whose 02b files it trains from instead of extracting its own).
LAYOUT_RUNS = {"fp8": ("fp8", None, None), "fp8_all": ("fp8-all", None, None),
               "topk": ("fp8-topk", "renorm", None), "topk_tail": ("fp8-topk", "tail", "topk")}
# Drafts trained on main's own bf16 states, merged data and vocabulary, so that only the draft
# or 04's way of training it differs (issue 16, the FP8 GEMM option, the per-step TTT unroll
# beside main's shared one): work folder -> what its 04 adds to main's flags ("profile" = the
# profile's fp8gemm_train in place of its train_precision).
SAME_STATE_RUNS = {"mla": ("--draft-arch", "mla"), "fp8gemm": "profile",
                   "perstep": ("--ttt-unroll", "per-step")}
