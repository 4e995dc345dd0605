"""The two-sample chi-square check the sampled-exactness tests share."""

from __future__ import annotations

import numpy as np
from scipy.stats import chi2_contingency


def assert_same_token_distribution(spec: list[tuple], plain: list[tuple], positions=(0, 1)):
    """Tokens at each position of `spec` and `plain` samples come from one distribution
    (p > 1e-3); tokens seen fewer than 10 times are pooled into one column."""
    for position in positions:
        a = np.array([p[position] for p in spec])
        b = np.array([p[position] for p in plain])
        tokens = sorted(set(a) | set(b))
        table = np.array([[np.sum(a == t) for t in tokens], [np.sum(b == t) for t in tokens]])
        keep = table.sum(axis=0) >= 10
        table = np.column_stack([table[:, keep], table[:, ~keep].sum(axis=1)])
        table = table[:, table.sum(axis=0) > 0]
        assert chi2_contingency(table).pvalue > 1e-3, (position, table)
