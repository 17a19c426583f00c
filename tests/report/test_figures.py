"""The training curves read as what they show: whole steps on the x-axis, and every
method's line visible where lines coincide."""

from __future__ import annotations

import pandas as pd

from qerl.report import figures


def test_curves_tick_whole_steps_and_keep_coinciding_lines_visible(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(figures, "_save", lambda plt, fig, path: drawn.append(fig) or path)
    runs = pd.DataFrame([{"model": "tiny", "recipe": "smoke", "method": method, "step": step,
                          "reward": 0.0, "entropy": 7.9}
                         for method in ("full", "lora", "qerl") for step in (1, 2)])
    assert figures.curves({"train": runs}, None, tmp_path) == [
        tmp_path / "curves_tiny_smoke.png"]
    for ax in drawn[0].axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        lines = ax.get_lines()
        assert len(lines) == 3 and all(list(line.get_ydata()) == list(lines[0].get_ydata())
                                       for line in lines)
        # The same points: each line drawn smaller than the one under it, in a style of
        # its own, so that every one shows.
        sizes = [line.get_markersize() for line in lines]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3
        assert len({(line.get_marker(), line.get_linestyle()) for line in lines}) == 3
