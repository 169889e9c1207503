"""The merge table (``stats.summary.FIELD_RULES``): the pairwise merge, the grouped merge
and the empty summary follow it, field by field (issue 31: one owner of the merge rules)."""

import numpy as np
import pytest

from tandv.stats import merge, summarize
from tandv.stats.summary import CORE_FIELDS, FIELD_INDEX, FIELD_RULES, merge_groups

#: Plain Python arithmetic for each value-by-value rule: the expectation.
EXPECTED = {"sum": lambda a, b: a + b, "min": min, "max": max}


def _two_summaries():
    a, layout = summarize(
        np.array([1.0, -3.0, 0.0, np.nan], np.float32),
        extras={"s": (1.0, "sum"), "lo": (5.0, "min"), "hi": (5.0, "max"), "avg": (1.0, "mean")},
    )
    b, _ = summarize(
        np.array([0.25, 8.0, np.inf], np.float32),
        extras={"s": (2.0, "sum"), "lo": (2.0, "min"), "hi": (2.0, "max"), "avg": (5.0, "mean")},
    )
    return a, b, layout


def test_every_core_field_has_one_rule():
    assert tuple(FIELD_RULES) == CORE_FIELDS
    assert set(FIELD_RULES.values()) == {"sum", "min", "max", "moment", "power"}


@pytest.mark.parametrize("how", ["merge", "merge_groups"])
def test_value_by_value_fields_follow_the_table(how):
    a, b, layout = _two_summaries()
    if how == "merge":
        out = merge(a, b, layout)
    else:
        out = merge_groups(np.stack([a, b]), np.array([0, 0]), layout)[0]
    checked = 0
    for name, rule in FIELD_RULES.items():
        if rule in EXPECTED:
            i = FIELD_INDEX[name]
            assert out[i] == EXPECTED[rule](a[i], b[i]), name
            checked += 1
    assert checked == 8  # four counts, four extrema
    counts = layout.exponent_counts
    np.testing.assert_array_equal(out[counts], a[counts] + b[counts])
    s, lo, hi, avg = out[layout.extra_values]
    assert (s, lo, hi) == (3.0, 2.0, 5.0)
    assert avg == pytest.approx((4 * 1.0 + 3 * 5.0) / 7)  # weighted by numel (4 and 3)


def test_the_empty_summary_is_neutral_for_every_rule():
    a, _, layout = _two_summaries()
    np.testing.assert_array_equal(merge(layout.empty(), a, layout), a)
    grouped = merge_groups(a[None, :], np.array([1]), layout, num_groups=2)
    np.testing.assert_array_equal(grouped[0], layout.empty())
    np.testing.assert_array_equal(grouped[1], a)
