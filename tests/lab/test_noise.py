"""fp8lab.lab.noise.late_gap_pct: the one noise rule of compare and debug."""

import math

from fp8lab.lab.noise import late_gap_pct


def test_largest_gap_over_the_second_half_in_percent_of_the_reference():
    a = {0: 5.0, 10: 4.0, 20: 3.0, 30: 2.2, 40: 2.0}
    b = {0: 1.0, 10: 1.0, 20: 2.97, 30: 2.0, 40: 2.01}
    ref = {0: 1.0, 10: 1.0, 20: 3.0, 30: 2.0, 40: 2.0}
    # steps 0 and 10 (huge gaps) are in the first half of last = 40; 20 (2 t >= 40) counts
    assert late_gap_pct(a, b, ref) == abs(100.0 * (2.2 - 2.0) / 2.0)


def test_curves_as_pairs_and_only_common_steps():
    a = [(0, 3.0), (50, 2.0), (100, 1.5)]
    b = [(0, 3.0), (50, 2.1), (100, 1.5), (200, 9.0)]  # 200: not in a, ignored
    assert late_gap_pct(a, b, b) == abs(100.0 * (2.0 - 2.1) / 2.1)


def test_the_final_common_point_always_counts():
    assert late_gap_pct({7: 2.0}, {7: 2.02}, {7: 2.0}) == abs(100.0 * (2.0 - 2.02) / 2.0)


def test_unknown_when_a_late_value_is_missing_zero_or_not_finite():
    assert late_gap_pct({}, {}, {}) is None
    assert late_gap_pct({0: None, 10: 2.0}, {0: 1.0, 10: 2.0}, {0: 1.0, 10: 2.0}) is not None
    assert late_gap_pct({10: None}, {10: 2.0}, {10: 2.0}) is None
    assert late_gap_pct({10: 2.0}, {10: 2.0}, {10: 0.0}) is None
    assert late_gap_pct({10: math.nan}, {10: 2.0}, {10: 2.0}) is None
    assert late_gap_pct({10: math.inf}, {10: 2.0}, {10: 2.0}) is None
