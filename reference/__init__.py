"""The GPU reference benchmark: a small real target trained here, then the whole pipeline.

See `reference/run_reference.py` for the phases and BENCHMARKS.md ("GPU reference: ...").
"""
