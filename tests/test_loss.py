import math

import pytest
import torch
import torch.nn.functional as F

from qkv.config import PAD
from qkv.losses import label_smoothed_nll_loss


def test_hand_computed_example():
    # V = 3, logits [0, ln 2, ln 5] -> p = [1/8, 2/8, 5/8]; target 2; eps = 0.3.
    logits = torch.tensor([[0.0, math.log(2.0), math.log(5.0)]])
    target = torch.tensor([2])
    loss, nll = label_smoothed_nll_loss(logits, target, epsilon=0.3)
    # q = (1 - 0.3) * onehot + 0.3 / 3 = [0.1, 0.1, 0.8]
    expected = -(0.1 * math.log(1 / 8) + 0.1 * math.log(2 / 8) + 0.8 * math.log(5 / 8))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert loss.item() == pytest.approx(0.722576, abs=1e-6)
    assert nll.item() == pytest.approx(-math.log(5 / 8), rel=1e-6)


def test_equals_torch_cross_entropy_with_label_smoothing():
    torch.manual_seed(0)
    logits = torch.randn(4, 7, 11)
    target = torch.randint(1, 11, (4, 7))
    target[0, 5:] = PAD
    target[2, 3:] = PAD
    for eps in (0.0, 0.1, 0.5):
        loss, nll = label_smoothed_nll_loss(logits, target, eps)
        ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), reduction="sum",
                              label_smoothing=eps, ignore_index=PAD)
        ref_nll = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), reduction="sum", ignore_index=PAD)
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(nll, ref_nll)


def test_eps_zero_is_nll():
    torch.manual_seed(1)
    logits = torch.randn(5, 6)
    target = torch.tensor([1, 2, 3, 4, 5])
    loss, nll = label_smoothed_nll_loss(logits, target, 0.0)
    expected = -torch.log_softmax(logits, -1)[torch.arange(5), target].sum()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, expected)


def test_pads_contribute_nothing():
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 9)
    target = torch.tensor([[5, 6, PAD, PAD], [7, 8, 1, PAD]])
    loss, nll = label_smoothed_nll_loss(logits, target, 0.1)
    # Changing the logits at padded positions must not change the loss.
    noisy = logits.clone()
    noisy[target == PAD] = 100 * torch.randn(3, 9)
    loss2, nll2 = label_smoothed_nll_loss(noisy, target, 0.1)
    torch.testing.assert_close(loss, loss2)
    torch.testing.assert_close(nll, nll2)
    # And equals the sum over the 5 real tokens taken one by one.
    keep = target != PAD
    per_token = [label_smoothed_nll_loss(logits[keep][i : i + 1], target[keep][i : i + 1], 0.1)[0] for i in range(5)]
    torch.testing.assert_close(loss, torch.stack(per_token).sum())
    all_pad = torch.full((2, 4), PAD)
    assert label_smoothed_nll_loss(logits, all_pad, 0.1)[0].item() == 0.0


def test_other_ignore_index_out_of_range():
    logits = torch.randn(3, 4)
    target = torch.tensor([0, -100, 2])
    loss, _ = label_smoothed_nll_loss(logits, target, 0.1, ignore_index=-100)
    ref = F.cross_entropy(logits, target, reduction="sum", label_smoothing=0.1, ignore_index=-100)
    torch.testing.assert_close(loss, ref)


def test_bf16_logits_computed_in_float32():
    torch.manual_seed(3)
    logits = torch.randn(6, 50).bfloat16()
    target = torch.randint(1, 50, (6,))
    loss, nll = label_smoothed_nll_loss(logits, target, 0.1)
    assert loss.dtype == torch.float32 and nll.dtype == torch.float32
    ref = F.cross_entropy(logits.float(), target, reduction="sum", label_smoothing=0.1)
    torch.testing.assert_close(loss, ref)


def test_gradient_flows_and_shape_errors():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    loss, _ = label_smoothed_nll_loss(logits, torch.tensor([[1, 2, 0], [3, 4, 1]]), 0.1)
    loss.backward()
    assert logits.grad is not None and logits.grad[0, 2].abs().sum() == 0  # the PAD position
    with pytest.raises(ValueError, match="do not match"):
        label_smoothed_nll_loss(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), 0.1)
    with pytest.raises(ValueError, match="epsilon"):
        label_smoothed_nll_loss(torch.randn(2, 5), torch.ones(2, dtype=torch.long), 1.0)


# --- the fused output projection + loss --------------------------------------------------------------

from qkv.losses import linear_label_smoothed_nll_loss  # noqa: E402


def _fused_and_reference(eps: float, chunk: int | None, dtype=torch.float64):
    torch.manual_seed(1)
    hidden = torch.randn(3, 7, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, dtype=dtype, requires_grad=True)
    target = torch.randint(1, 50, (3, 7))
    target[0, 5:] = PAD
    target[2, 2:] = PAD
    n = int((target != PAD).sum())
    ref_loss, ref_nll = label_smoothed_nll_loss(F.linear(hidden, weight), target, eps)
    (ref_loss / n).backward()
    ref = (ref_loss.detach(), ref_nll, hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    loss, nll = linear_label_smoothed_nll_loss(hidden, weight, target, eps, chunk=chunk)
    (loss / n).backward()
    return (loss.detach(), nll, hidden.grad, weight.grad), ref, target


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("chunk", [1, 4, None])  # a row at a time, chunks that straddle sentences, one chunk
def test_fused_projection_loss_equals_logits_then_loss(eps, chunk):
    """Same loss, same un-smoothed NLL, same gradients for the states and the projection (incl. at
    the padded positions, whose state gradient must be exactly 0) as making the logits first."""
    fused, ref, target = _fused_and_reference(eps, chunk)
    for got, want, name in zip(fused, ref, ("loss", "nll", "d hidden", "d weight")):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6, msg=name)
    assert torch.all(fused[2][target == PAD] == 0)


def test_fused_projection_loss_without_grad_and_all_padding():
    torch.manual_seed(2)
    hidden, weight = torch.randn(2, 5, 8), torch.randn(30, 8)
    target = torch.randint(1, 30, (2, 5))
    with torch.no_grad():
        loss, nll = linear_label_smoothed_nll_loss(hidden, weight, target, 0.1)
    ref_loss, ref_nll = label_smoothed_nll_loss(F.linear(hidden, weight), target, 0.1)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)
    assert not loss.requires_grad
    h = hidden.clone().requires_grad_()
    loss, nll = linear_label_smoothed_nll_loss(h, weight, torch.full_like(target, PAD), 0.1)
    assert loss.item() == nll.item() == 0.0
    loss.backward()
    assert torch.all(h.grad == 0)


def test_fused_projection_loss_checks_shapes():
    with pytest.raises(ValueError, match="does not match target"):
        linear_label_smoothed_nll_loss(torch.randn(2, 5, 8), torch.randn(30, 8), torch.zeros(2, 4, dtype=torch.long), 0.1)
    with pytest.raises(ValueError, match="does not match the projection"):
        linear_label_smoothed_nll_loss(torch.randn(2, 5, 8), torch.randn(30, 9), torch.zeros(2, 5, dtype=torch.long), 0.1)
