"""Test doubles shared by the test suite and the benchmarks (never used by a stage)."""
