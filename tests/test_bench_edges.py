"""bench --compare's rule applied honestly: a slowdown far beyond what noise can do is a regression even when one
run was noisy, and the saved run is only called noisy when it was."""

from dataclasses import replace

from test_saved import NOISY, QUIET, report_with, saved_run

from tblock_cli.benchmark.saved import CLEAR_FACTOR, compare


def test_a_slowdown_of_orders_is_a_regression_even_when_this_run_was_noisy():
    slow = tuple(1000 * s for s in NOISY)  # every sample 1000x the saved ones: no load does that
    saved = saved_run(QUIET)
    saved["results"][0]["latency_ms"]["noisy"] = False  # what that run judged of itself
    report = report_with(slow)
    (c,) = compare(report, saved)
    assert c.noisy == ("this run",) and c.slower and not c.inconclusive
    report = replace(report, comparisons=(c,))
    assert not report.ok and [f.kind for f in report.failing] == ["bench.regression"]


def test_within_the_clear_factor_a_noisy_point_stays_inconclusive():
    near = tuple(s * CLEAR_FACTOR / 3 for s in NOISY)
    (c,) = compare(report_with(near), saved_run(QUIET))
    assert c.inconclusive and not c.slower


def test_a_saved_run_judged_quiet_is_not_blamed():
    saved = saved_run((1.0, 1.6, 1.3, 2.0, 1.1))  # samples that look noisy now, judged quiet when saved
    saved["results"][0]["latency_ms"]["noisy"] = False
    (c,) = compare(report_with(tuple(1.2 * s for s in NOISY)), saved)
    assert c.noisy == ("this run",)
