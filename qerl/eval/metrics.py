"""avg@k and pass@k of k sampled answers per problem."""

from __future__ import annotations

from math import comb


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples with ``correct`` right ones (Chen et
    al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= correct <= n and 1 <= k <= n, got n={n}, "
                         f"correct={correct}, k={k}")
    return 1.0 - comb(n - correct, k) / comb(n, k)


def summarize(scores: dict[str, list[float]], k: int) -> dict[str, float]:
    """Per problem id, its samples' scores (1.0 right, 0.0 wrong) -> avg@k (mean score over
    all samples), pass@1 and pass@k (means over problems)."""
    if not scores:
        raise ValueError("no scored problems")
    n = {len(s) for s in scores.values()}
    if len(n) != 1:
        raise ValueError(f"every problem needs the same number of samples, got {sorted(n)}")
    n = n.pop()
    right = [sum(s) for s in scores.values()]
    return {
        "problems": len(scores),
        "samples": n,
        f"avg@{n}": sum(right) / (len(right) * n),
        "pass@1": sum(pass_at_k(n, int(c), 1) for c in right) / len(right),
        f"pass@{k}": sum(pass_at_k(n, int(c), k) for c in right) / len(right),
    }
