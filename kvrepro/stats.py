"""Paired non-inferiority of a KV mode against bf16 on the same prompts (McNemar, exact).

Each prompt is answered by both modes; only the *discordant* pairs carry information about the difference:
``b`` = right with bf16 and wrong with the mode (a loss), ``c`` = wrong with bf16 and right with the mode (a
gain), ``N`` = all pairs. The loss in accuracy is ``delta = p_b - p_c``, estimated by ``(b - c) / N``.

The bound. ``delta = (2 pi - 1) d`` with ``d = p_b + p_c`` the rate of discordant pairs and ``pi = p_b / d`` the
share of losses among them. McNemar's conditional view (McNemar 1947, "Note on the sampling error of the
difference between correlated proportions or percentages", Psychometrika 12:153-157): given ``n = b + c``,
``b ~ Binomial(n, pi)``. Both factors are bounded exactly, each by a one-sided Clopper-Pearson bound at level
``alpha / 2`` (Clopper & Pearson 1934, "The use of confidence or fiducial limits illustrated in the case of the
binomial", Biometrika 26:404-413: ``pi_U`` is the ``p`` with ``P(X <= b; n, p) = alpha / 2``):

    bound = (2 pi_U - 1) x d_U     if 2 pi_U - 1 >= 0   (d_U: upper bound on d from n of N)
            (2 pi_U - 1) x d_L     otherwise            (d_L: lower bound on d; the mode gains significantly)

By the union bound, ``bound >= delta`` with probability >= ``1 - alpha`` whatever ``p_b, p_c``: the bound is exact
in the Clopper-Pearson sense (conservative, never below its level; ``tests/test_accuracy.py`` checks the coverage
by enumerating every outcome of small trinomials). With no discordant pair, ``pi`` is unconstrained
(``pi_U = 1``) and the bound is ``d_U = 1 - (alpha / 2) ** (1 / N)`` (~3.7 / N): few pairs never look better than
they are, and ``min_pairs`` (368 for 1.0 pp at alpha 0.05) is the smallest ``N`` that can show
non-inferiority at all.

Why not ``(2 pi_U - 1) x n / N`` (the observed discordant rate plugged in): when a mode only loses (``c = 0``,
the usual pattern of a compressed cache), ``pi_U = 1`` and that bound is the observed loss itself; simulated
with ``p_b = 1%``, ``p_c = 0``, ``N = 1000`` it covers the true loss in 55% of runs, not 95%. The bound here
costs about 0.4 pp of width at ``N = 1000`` against that plug-in in balanced cases (e.g. b = c = 10: 1.40 pp vs
0.79 pp; Tango's asymptotic score bound, Stat. Med. 17:891-908, 1998, gives 0.78 pp).

Non-inferior: the bound <= ``margin_pp`` percentage points. Pure Python (``math``): no SciPy needed.
"""
from __future__ import annotations

import math

ALPHA = 0.05       # one-sided: a 95% upper bound
MARGIN_PP = 1.0    # non-inferiority margin on the accuracy loss, in percentage points


def _check_counts(x: int, n: int) -> None:
    for name, v in (("x", x), ("n", n)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if x > n:
        raise ValueError(f"x={x} exceeds n={n}")


def _check_alpha(alpha: float) -> None:
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be a number in (0, 1), got {alpha!r}")


def binom_cdf(x: int, n: int, p: float) -> float:
    """``P(X <= x)`` for ``X ~ Binomial(n, p)``: the terms summed in log space (``math.lgamma``), float64."""
    _check_counts(x, n)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    if x == n or p == 0.0:
        return 1.0
    if p == 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    lc = math.lgamma(n + 1)
    logs = [lc - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq for k in range(x + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * math.fsum(math.exp(v - top) for v in logs))


def clopper_pearson_upper(x: int, n: int, alpha: float = ALPHA) -> float:
    """One-sided ``1 - alpha`` Clopper-Pearson upper bound on a binomial proportion after ``x`` successes in
    ``n`` trials: the ``p`` with ``P(X <= x; n, p) = alpha`` (1 for ``x = n``, including ``n = 0``;
    ``1 - alpha ** (1 / n)`` for ``x = 0``). Bisection on :func:`binom_cdf` to 1e-13; equals
    ``scipy.stats.beta.ppf(1 - alpha, x + 1, n - x)``.

    Raises:
        ValueError: ``x`` outside [0, n], ``alpha`` outside (0, 1).
    """
    _check_counts(x, n)
    _check_alpha(alpha)
    if x == n:
        return 1.0
    if x == 0:
        return -math.expm1(math.log(alpha) / n)
    return _bisect(lambda p: binom_cdf(x, n, p) > alpha, x / n)


def clopper_pearson_lower(x: int, n: int, alpha: float = ALPHA) -> float:
    """One-sided ``1 - alpha`` Clopper-Pearson lower bound: the ``p`` with ``P(X >= x; n, p) = alpha`` (0 for
    ``x = 0``; ``alpha ** (1 / n)`` for ``x = n``). Equals ``scipy.stats.beta.ppf(alpha, x, n - x + 1)``.

    Raises:
        ValueError: ``x`` outside [0, n], ``alpha`` outside (0, 1).
    """
    _check_counts(x, n)
    _check_alpha(alpha)
    if x == 0:
        return 0.0
    if x == n:
        return math.exp(math.log(alpha) / n)
    return _bisect(lambda p: 1.0 - binom_cdf(x - 1, n, p) <= alpha, 0.0, x / n)


def _bisect(below, lo: float, hi: float = 1.0) -> float:
    """The boundary in [lo, hi] of a predicate true below it and false above it (``below(lo)`` must hold);
    returns the first point where it is false, to 1e-13."""
    if not below(lo):
        lo = 0.0
    while hi - lo > 1e-13:
        mid = 0.5 * (lo + hi)
        if below(mid):
            lo = mid
        else:
            hi = mid
    return hi


def min_pairs(margin_pp: float = MARGIN_PP, alpha: float = ALPHA) -> int:
    """Smallest number of pairs ``N`` whose bound with zero discordant pairs, ``1 - (alpha / 2) ** (1 / N)``, is
    within the margin: fewer pairs cannot show non-inferiority whatever they hold (368 for 1.0 pp, alpha 0.05)."""
    _check_alpha(alpha)
    if not isinstance(margin_pp, (int, float)) or isinstance(margin_pp, bool) or not 0 < margin_pp < 100:
        raise ValueError(f"margin_pp must be in (0, 100), got {margin_pp!r}")
    m = margin_pp / 100.0
    n = max(1, math.ceil(math.log(alpha / 2) / math.log1p(-m)) - 2)
    while -math.expm1(math.log(alpha / 2) / n) > m + 1e-15:
        n += 1
    return n


def noninferiority_bound(b: int, c: int, pairs: int, alpha: float = ALPHA) -> float:
    """The one-sided ``1 - alpha`` upper bound on the loss ``p_b - p_c`` (a fraction; module docstring)."""
    n = b + c
    k = 2.0 * clopper_pearson_upper(b, n, alpha / 2) - 1.0
    if k >= 0:
        return k * clopper_pearson_upper(n, pairs, alpha / 2)
    return k * clopper_pearson_lower(n, pairs, alpha / 2)


def mcnemar_noninferiority(b: int, c: int, pairs: int, margin_pp: float = MARGIN_PP, alpha: float = ALPHA) -> dict:
    """Paired non-inferiority of a mode against the baseline.

    Args:
        b: pairs right with the baseline, wrong with the mode (losses).
        c: pairs wrong with the baseline, right with the mode (gains).
        pairs: all pairs ``N`` (>= b + c, >= 1).
        margin_pp: non-inferiority margin on the loss, percentage points.
        alpha: one-sided level (0.05: a 95% bound).

    Returns:
        ``{"pairs", "lost", "gained", "discordant", "loss_pp", "bound_pp", "p_worse", "non_inferior"}``:
        ``loss_pp`` = 100 (b - c) / N; ``bound_pp`` = the one-sided ``1 - alpha`` upper bound on the loss
        (``noninferiority_bound``); ``p_worse`` = the exact one-sided McNemar p-value of "the mode loses more
        than it gains" (``P(X >= b)``, ``X ~ Binomial(n, 1/2)``; 1.0 without losses); ``non_inferior`` =
        ``bound_pp <= margin_pp``.

    Raises:
        ValueError: negative counts, ``b + c > pairs``, ``pairs < 1``, bad ``alpha`` or ``margin_pp``.
    """
    for name, v in (("b", b), ("c", c), ("pairs", pairs)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if pairs < 1 or b + c > pairs:
        raise ValueError(f"pairs must be >= 1 and >= b + c, got b={b}, c={c}, pairs={pairs}")
    _check_alpha(alpha)
    if not isinstance(margin_pp, (int, float)) or isinstance(margin_pp, bool) or not 0 < margin_pp < 100:
        raise ValueError(f"margin_pp must be in (0, 100), got {margin_pp!r}")
    n = b + c
    bound = noninferiority_bound(b, c, pairs, alpha)
    p_worse = 1.0 - binom_cdf(b - 1, n, 0.5) if b > 0 else 1.0
    return {"pairs": pairs, "lost": b, "gained": c, "discordant": n, "loss_pp": 100.0 * (b - c) / pairs,
            "bound_pp": 100.0 * bound, "p_worse": p_worse, "non_inferior": 100.0 * bound <= margin_pp + 1e-12}
