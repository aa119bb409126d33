"""The gate's exactness comparison (difuse.count_mismatches): bit patterns, not values."""
import pytest

torch = pytest.importorskip("torch")
import difuse  # noqa: E402


def test_bits_not_values():
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    b = a.clone()
    assert difuse.count_mismatches(a, b) == 0  # NaN with the same payload matches
    b[0] = -0.0
    assert difuse.count_mismatches(a, b) == 1  # +0 != -0
    assert difuse.count_mismatches(a, a.float()) == 4  # dtype differs: every element counts
    assert difuse.count_mismatches(a, a[:3]) == 4


def test_tuples_and_none():
    # SD3's last joint block returns (None, hidden_states): None matches only None.
    t = torch.ones(2, 3, dtype=torch.bfloat16)
    assert difuse.count_mismatches((None, t), (None, t.clone())) == 0
    assert difuse.count_mismatches(None, None) == 0
    assert difuse.count_mismatches((None, t), (t, t)) == 6
    assert difuse.count_mismatches((t, None), (t, t)) == 6
    assert difuse.count_mismatches((t, t), (t,)) == 12
    assert difuse.count_mismatches(t, None) == 6
    u = t.clone()
    u[1, 2] = 2.0
    assert difuse.count_mismatches((None, t), (None, u)) == 1
