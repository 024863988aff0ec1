"""The multi-seed protocol's report: mean +- SE at equal steps and equal training time, paired differences."""

from __future__ import annotations

import json
import math

import pytest

from resispec.analysis.compare import mean_se, plot_curves, step_seconds, summarize


def _curve(taus, sec, name):
    return {"loss": name, "steps": [0, 100, 200], "tau": {"1.0": taus, "0.6": [t - 0.5 for t in taus]},
            "sec_per_step": sec}  # fmt: skip


def test_mean_se():
    assert mean_se([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1.0 / math.sqrt(3)))
    assert mean_se([4.0]) == (4.0, 0.0)


def test_summary_equal_steps_equal_time_and_paired_difference(tmp_path):
    curves = {
        "fkl": {s: _curve([2.0, 3.0, 3.5 + 0.1 * s], 0.1, "fkl") for s in range(3)},
        # twice as slow per step: at the fast loss's time for 200 steps it has done 100
        "slow": {s: _curve([2.0, 3.2, 3.8 + 0.1 * s], 0.2, "slow") for s in range(3)},
    }
    table = summarize(curves)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "3.600 ± 0.058" in rows["fkl"]  # @200: 3.5, 3.6, 3.7
    assert "3.900 ± 0.058" in rows["slow"]
    assert "+0.300 ± 0.000 (+8.3%)" in rows["slow"]  # paired by seed
    assert "@20s" in table and "slow 100" in table  # equal wall-clock: 20 s buys slow 100 steps
    assert rows["slow"].count("3.200 ± 0.000") == 2  # tau @100 steps (equal steps) and @20 s (equal time)
    plot_curves(curves, tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_step_seconds_is_the_median_step(tmp_path):
    rows = [{"step": 0, "before/fkl": 1.0}]
    rows += [{"step": i, "train/tokens": 100 * i, "train/tokens_per_s": 1000.0} for i in range(1, 6)]
    rows[3]["train/tokens_per_s"] = 10.0  # one step that also wrote a checkpoint
    (tmp_path / "history.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert step_seconds(tmp_path) == pytest.approx(0.1)


def test_tau_between_evaluated_steps_is_linear():
    from resispec.analysis.compare import _at_step

    c = _curve([2.0, 3.0, 4.0], 0.1, "x")
    assert _at_step(c, "1.0", 150) == pytest.approx(3.5) and _at_step(c, "1.0", 200) == 4.0
    assert _at_step(c, "1.0", 250) == 4.0  # past the last evaluation: the last value
