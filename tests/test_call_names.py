"""Messages name the model's arguments by their parameter names (`CallSpec.named`)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magis_nb


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, use_residual):
        h = self.lin(x)
        return h + x if use_residual else h


def test_a_changed_flag_and_a_wrong_shape_are_named_by_parameter():
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    res = magis_nb.optimize(Residual(), (x, True, y), loss_fn=F.mse_loss, time_budget=3,
                            max_states=2, device_profile="cpu")
    mod = res.module
    with pytest.raises(ValueError, match="argument use_residual was True when the step was planned"):
        mod(x, False, y)
    with pytest.raises(ValueError, match=r"\bx\b.*\(4, 8\)|x was planned"):
        mod(torch.randn(5, 8), True, torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"target"):
        mod(x, True, torch.randn(3, 8))
