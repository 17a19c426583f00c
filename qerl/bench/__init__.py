"""Benchmarks: scripts that write CSV under results/, never timed tests."""
