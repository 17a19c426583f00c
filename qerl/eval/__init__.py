"""Evaluation on math benchmarks with the rollout engine and the training rewards."""
