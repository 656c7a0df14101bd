"""The bench's verdict against AR's seed spread (``lantern.eval.report.yardstick`` / ``ARSpread``):
its false-alarm rate and power by simulation, "better" reported apart from "out", and the Student-t
quantiles it rests on.

The simulations draw normal metrics, AR at n = 5 seeds and m = 4 metrics (the bench's defaults),
20000 trials each with a fixed seed, through the same ``yardstick`` that ``ARSpread.judge`` calls.
A rate estimated from T = 20000 trials has binomial SD sqrt(r (1 - r) / T): 0.0015 at r = 0.05,
0.0034 at r = 0.6. Each test's comment states the rate it checks and its margin."""

from __future__ import annotations

import math

import pytest
import torch

from lantern.eval.report import (
    FALSE_ALARM_RATE,
    SPREAD_KEYS,
    ARSpread,
    BenchRow,
    format_table,
    prediction_bounds,
    t_cdf,
    t_quantile,
    yardstick,
)

TRIALS, SEEDS, METRICS = 20000, 5, 4


def binomial_sd(rate: float, trials: int = TRIALS) -> float:
    return math.sqrt(rate * (1 - rate) / trials)


def draw(seed: int, shift: tuple[float, ...] = (0.0,) * METRICS, rho: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """AR ``[TRIALS, METRICS, SEEDS]`` and a method ``[TRIALS, METRICS]``, all standard normal
    (higher is better) with correlation ``rho`` between metrics of one run; the method's metric i
    moved by ``shift[i]`` AR standard deviations (negative: worse)."""
    g = torch.Generator().manual_seed(seed)

    def runs(k: int) -> torch.Tensor:  # [TRIALS, k, METRICS]: one shared factor gives correlation rho
        common = torch.randn(TRIALS, k, 1, generator=g, dtype=torch.float64)
        own = torch.randn(TRIALS, k, METRICS, generator=g, dtype=torch.float64)
        return math.sqrt(rho) * common + math.sqrt(1 - rho) * own

    ar = runs(SEEDS).transpose(1, 2)
    method = runs(1)[:, 0] + torch.tensor(shift, dtype=torch.float64)
    return ar, method


def test_t_quantiles_match_published_values() -> None:
    # Reference values: scipy.stats.t.ppf (checked for (0.99375, 4) against a 30-digit quadrature of
    # the density with mpmath: 4.3146560489); scipy is not a dependency, so they are written here.
    known = {(0.975, 1): 12.706204736, (0.975, 4): 2.776445105, (0.9875, 4): 3.495405933,
             (0.99375, 4): 4.314656049, (0.995, 4): 4.604094871, (0.9995, 4): 8.610301581,
             (0.99375, 1): 50.923036636, (0.9875, 2): 6.205346817, (0.99375, 3): 5.391949071,
             (0.99, 10): 2.763769458, (0.975, 30): 2.042272456, (0.9, 2): 1.885618083, (0.975, 1000): 1.962339081}
    for (p, df), t in known.items():
        assert t_quantile(p, df) == pytest.approx(t, rel=1e-8), (p, df)
        assert t_cdf(t, df) == pytest.approx(p, abs=1e-9)  # the references are rounded to 1e-9
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-12)
    assert t_cdf(-2.0, 5) == pytest.approx(1 - t_cdf(2.0, 5), abs=1e-15)  # symmetric
    with pytest.raises(ValueError):
        t_quantile(1.0, 4)


def test_a_method_that_is_ar_is_called_out_at_most_the_stated_rate() -> None:
    """False alarm: alpha = 5 %, Bonferroni over 4 metrics, each one-sided at 1.25 %. A method
    drawn exactly like AR is out with probability 1 - (1 - 0.0125)^4 = 4.91 % when the metrics are
    independent (measured 0.0505 at this seed; per metric 0.0124 to 0.0131), so the bound is
    near-exact: the observed rate must lie within 3 binomial SDs (0.0046) of 4.91 % and not above
    5 % + 3 SD. With correlated metrics (rho 0.8) the union bound is conservative: at most 5 % + 3 SD
    (measured 0.0364). "Better" is the mirror image, under the same rate (measured 0.0481)."""
    alpha = FALSE_ALARM_RATE
    exact = 1 - (1 - alpha / METRICS) ** METRICS
    ar, method = draw(0)
    worse, better = yardstick(ar, method)
    out = worse.any(-1).double().mean().item()
    assert abs(out - exact) <= 3 * binomial_sd(exact) and out <= alpha + 3 * binomial_sd(alpha)
    per_metric = worse.double().mean(0)  # each metric alone: 1.25 %
    assert (per_metric - alpha / METRICS).abs().max().item() <= 4 * binomial_sd(alpha / METRICS)
    assert better.any(-1).double().mean().item() <= alpha + 3 * binomial_sd(alpha)

    worse_c, _ = yardstick(*draw(1, rho=0.8))
    assert worse_c.any(-1).double().mean().item() <= alpha + 3 * binomial_sd(alpha)


def test_a_method_worse_by_4_sd_on_fid_is_caught() -> None:
    """Power: a method 4 AR standard deviations worse on one metric (FID's, say), AR elsewhere, is
    out with probability 0.619: the noncentral t, P(t_4(nc = 4 / sqrt(1.2)) > t(0.9875, 4)) = 0.604
    on that metric (scipy.stats.nct), plus the three others' false alarms; measured 0.616 (0.602 on
    the metric itself). At 6 SD: 0.919 (0.916 on the metric), measured 0.918 (0.915). Each checked
    >= the stated value less 4 binomial SDs (0.014 at 4 SD, 0.008 at 6 SD)."""
    for shift, power, on_metric in ((4.0, 0.619, 0.604), (6.0, 0.919, 0.916)):
        worse, _ = yardstick(*draw(2, shift=(-shift, 0.0, 0.0, 0.0)))
        caught = worse.any(-1).double().mean().item()
        assert caught >= power - 4 * binomial_sd(power), (shift, caught)
        assert worse[:, 0].double().mean().item() >= on_metric - 4 * binomial_sd(on_metric), shift


def test_a_better_method_is_within_with_better_reported() -> None:
    """6 SD better on one metric: never out on its account. It is out only through the other three
    metrics' false alarms (1 - 0.9875^3 = 3.7 %, measured 0.0404, checked <= 5 % + 3 SD) and is
    reported better in 0.916 of trials (the 6 SD power; measured 0.914, checked >= 0.916 less 4 SD)."""
    worse, better = yardstick(*draw(3, shift=(6.0, 0.0, 0.0, 0.0)))
    assert not worse[:, 0].any()
    assert worse.any(-1).double().mean().item() <= FALSE_ALARM_RATE + 3 * binomial_sd(FALSE_ALARM_RATE)
    assert better[:, 0].double().mean().item() >= 0.916 - 4 * binomial_sd(0.916)


def _row(**quality: float) -> BenchRow:
    return BenchRow("m", "m", "-", None, 1.0, 64.0, 1.0, 1.0, 1.0, quality=dict(quality))


def _cell(row: BenchRow) -> str:
    """The row's "vs AR spread" cell in bench.md's table."""
    return format_table([row], markdown=True).splitlines()[-1].split(" | ")[-1].removesuffix(" |")


def test_ar_spread_judges_one_row_with_the_yardstick() -> None:
    """``ARSpread.judge``, the bench's verdict: FID lower is better, the rest higher; only worse is
    out, better is listed; the table cell says both."""
    values = {"fid": [0.70, 0.72, 0.74, 0.76, 0.78], "kid": [0.0] * 5, "precision": [0.50, 0.52, 0.54, 0.56, 0.58],
              "recall": [0.70, 0.72, 0.74, 0.76, 0.78], "class_accuracy": [0.90, 0.92, 0.94, 0.96, 0.98]}
    spread = ARSpread((0, 1, 2, 3, 4), values)
    assert spread.judged == list(SPREAD_KEYS) and spread.level == pytest.approx(1 - 0.05 / 4)
    half = 3.495405933 * math.sqrt(0.001) * math.sqrt(1.2)  # t(0.9875, 4) · s · sqrt(1 + 1/5), s^2 = 0.004 / 4
    assert spread.interval("fid") == pytest.approx((0.74 - half, 0.74 + half))

    cases = {  # quality -> (out on, better on, table cell)
        "ar-like": (dict(fid=0.80, precision=0.50, recall=0.74, class_accuracy=0.93), [], [], "within"),
        "better FID": (dict(fid=0.60, precision=0.54, recall=0.74, class_accuracy=0.94), [], ["fid"],
                       "within (better: FID)"),
        "worse acc, better prec": (dict(fid=0.74, precision=0.70, recall=0.74, class_accuracy=0.80),
                                   ["class_accuracy"], ["precision"], "out: acc (better: prec)"),
        "worse FID and recall": (dict(fid=0.95, precision=0.54, recall=0.55, class_accuracy=0.94),
                                 ["fid", "recall"], [], "out: FID, recall"),
    }
    for name, (quality, out, better, cell) in cases.items():
        row = _row(**quality, kid=9.0)  # KID is not judged
        spread.judge(row)
        assert (row.outside_ar_spread, row.better_than_ar, _cell(row)) == (out, better, cell), name

    # The same decisions as the vectorised yardstick the simulations test, with FID's sign flipped.
    sign = torch.tensor([-1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    ar = torch.tensor([values[k] for k in SPREAD_KEYS], dtype=torch.float64) * sign[:, None]
    for quality, out, better, _ in cases.values():
        w, b = yardstick(ar, torch.tensor([quality[k] for k in SPREAD_KEYS], dtype=torch.float64) * sign)
        assert [k for k, x in zip(SPREAD_KEYS, w.tolist(), strict=True) if x] == out
        assert [k for k, x in zip(SPREAD_KEYS, b.tolist(), strict=True) if x] == better

    # A metric the row lacks is skipped but still counts in the family (level stays 1 - alpha/4).
    partial = _row(fid=0.74 + 1.01 * half)
    spread.judge(partial)
    assert partial.outside_ar_spread == ["fid"] and partial.better_than_ar == []


def test_old_run_json_spread_is_readable() -> None:
    """run.json before this verdict had ``interval95`` and no ``false_alarm_rate``: it loads with
    the default rate, and the new form round-trips."""
    old = {"seeds": [0, 1, 2], "values": {"fid": [1.0, 1.1, 1.2]}, "interval95": {"fid": [0.5, 1.7]}}
    spread = ARSpread.from_dict(old)
    assert spread.alpha == FALSE_ALARM_RATE and spread.seeds == (0, 1, 2)
    again = ARSpread.from_dict(spread.to_dict())
    assert again == spread and again.to_dict()["interval"]["fid"] == pytest.approx(list(spread.interval("fid")))
    assert "at most 5%" in spread.summary()


def test_the_bounds_hold_every_ar_seed_so_widening_is_not_needed() -> None:
    """The earlier rule widened each interval to AR's observed range. By Samuelson's inequality no
    seed lies beyond s (n - 1) / sqrt(n) of the mean, inside t(1 - 0.05/m, n - 1) s sqrt(1 + 1/n)
    for n <= 9 seeds and m = 3 or 4 metrics: widening would never move a bound (checked on 2000
    draws per n, the tightest case being near-equal seeds with one outlier)."""
    g = torch.Generator().manual_seed(4)
    for m in (3, 4):
        for n in range(2, 10):
            ar = torch.randn(2000, n, generator=g, dtype=torch.float64)
            ar[:1000, 1:] = 0.0  # one outlier: Samuelson's bound is reached
            lo, hi = prediction_bounds(ar, 1 - 0.05 / m)
            assert bool((ar >= lo[:, None]).all() and (ar <= hi[:, None]).all()), (m, n)
