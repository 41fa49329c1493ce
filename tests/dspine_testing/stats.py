"""Statistics helpers for distribution tests (no scipy needed)."""

import math


def chi2_sf(x, df):
    """Chi-square survival function, Q(df/2, x/2) (Numerical Recipes gammq)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_pre = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for P(a, x)
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_pre))
    tiny = 1e-300  # continued fraction for Q(a, x), modified Lentz
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_pre) * h


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit of ``counts`` to ``probs``; cells with a small
    expected count are pooled into one so the asymptotic distribution holds."""
    total = float(sum(counts))
    observed, expected = [], []
    pooled_o = pooled_e = 0.0
    for c, p in zip(counts, probs):
        e = p * total
        if e < min_expected:
            pooled_o += c
            pooled_e += e
        else:
            observed.append(float(c))
            expected.append(e)
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    if pooled_e == 0 and pooled_o > 0:
        return 0.0  # mass where the target has none
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    return chi2_sf(stat, max(1, len(observed) - 1))
