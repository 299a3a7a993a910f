"""``kernels.replace_modules``: torch's norm and dropout modules swapped in place, weights kept."""

from __future__ import annotations

import torch

import kernels
from kernels.dropout import Dropout
from kernels.layernorm import LayerNorm, RMSNorm
from tests._mode import DEVICE


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.2), torch.nn.RMSNorm(32))
        self.head_norm = torch.nn.LayerNorm(32, bias=False, eps=1e-6)

    def forward(self, x):
        return self.head_norm(self.mlp(self.norm(x)))


class _CustomNorm(torch.nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 2


def _randomized(model):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def test_replace_modules_swaps_in_place_and_keeps_weights():
    torch.manual_seed(0)
    model = _randomized(torch.nn.Sequential(_Block(), _Block(), _CustomNorm(32))).to(DEVICE).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 32, device=DEVICE)
    expected = model(x)
    assert kernels.replace_modules(model) is model
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(LayerNorm) == 4 and kinds.count(RMSNorm) == 2 and kinds.count(Dropout) == 2
    assert torch.nn.LayerNorm not in kinds and torch.nn.RMSNorm not in kinds and torch.nn.Dropout not in kinds
    assert _CustomNorm in kinds  # subclasses may override forward: left alone
    assert set(model.state_dict()) == set(before)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not any(m.training for m in model.modules())
    torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-4)


def test_replace_modules_options_and_a_bare_module():
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Dropout(0.5)).train()
    kernels.replace_modules(model, dropout=False)
    assert isinstance(model[0], LayerNorm) and type(model[1]) is torch.nn.Dropout
    assert model[0].training
    swapped = kernels.replace_modules(torch.nn.Dropout(0.3, inplace=True))
    assert isinstance(swapped, Dropout) and swapped.p == 0.3 and swapped.inplace
