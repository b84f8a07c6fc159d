import pytest

from qkv.training.schedule import noam, peak_lr


def test_literal_values():
    # d_model = 512, warmup = 4000: d_model^-0.5 = 0.04419417, warmup^-1.5 = 3.9528471e-06
    assert noam(1, 512, 4000) == pytest.approx(0.04419417 * 3.9528471e-06, rel=1e-6)  # 1.7469e-07
    assert noam(1, 512, 4000) == pytest.approx(1.7469e-07, rel=1e-4)
    assert noam(4000, 512, 4000) == pytest.approx(6.9877e-04, rel=1e-4)  # 0.04419417 / sqrt(4000)
    assert noam(16000, 512, 4000) == pytest.approx(3.4939e-04, rel=1e-4)  # half the peak: sqrt(16000/4000) = 2
    assert noam(100, 16, 4, scale=2.0) == pytest.approx(2.0 * 0.25 * 0.1)  # 16^-0.5 = 0.25, 100^-0.5 = 0.1


def test_step_zero_is_step_one():
    assert noam(0, 512, 4000) == noam(1, 512, 4000)
    with pytest.raises(ValueError):
        noam(-1, 512, 4000)


def test_peak_at_warmup():
    assert peak_lr(512, 4000) == pytest.approx(noam(4000, 512, 4000))
    assert peak_lr(512, 4000, scale=2.0) == pytest.approx(2 * 6.9877e-04, rel=1e-4)
    values = [noam(s, 512, 4000) for s in range(1, 20001, 7)]
    assert max(values) <= peak_lr(512, 4000) * (1 + 1e-12)
    assert noam(3999, 512, 4000) < noam(4000, 512, 4000) > noam(4001, 512, 4000)


def test_linear_before_inverse_sqrt_after():
    # Linear warmup: lr(2s) = 2 lr(s).
    assert noam(2000, 512, 4000) == pytest.approx(2 * noam(1000, 512, 4000))
    assert noam(3000, 512, 4000) == pytest.approx(3 * noam(1000, 512, 4000))
    # Inverse square root decay: lr(4s) = lr(s) / 2.
    assert noam(40000, 512, 4000) == pytest.approx(noam(10000, 512, 4000) / 2)
    assert noam(90000, 512, 4000) == pytest.approx(noam(10000, 512, 4000) / 3)
