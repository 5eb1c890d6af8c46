"""Benchmarks (each a script printing JSON figures) and the WAN lab they and the tests share (:mod:`bench.wanlab`)."""
