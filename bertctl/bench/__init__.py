"""Benchmarks: a shared timing harness (``bertctl.bench.harness``) and the per-topic suites
(``bertctl.bench.ops`` for the fused ops; the model benchmark builds on the same harness)."""
