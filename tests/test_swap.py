"""``kernels.replace_modules``: torch's norm and dropout modules become the fused ones in place, and the
model is the same model afterwards: same module and parameter objects, hooks, parametrizations, ties,
frozen flags, optimizer, ``isinstance`` answers and ``state_dict``; only the speed may change."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.nn.utils import parametrize

import kernels
from examples.gpt import GPT, GPTConfig, batches, load_corpus
from kernels._mode import DEVICE, by_mode
from kernels.dropout import Dropout
from kernels.layernorm import LayerNorm, RMSNorm


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
    replaced = kernels.replace_modules(model)
    assert replaced == {"0.norm": torch.nn.LayerNorm, "0.mlp.1": torch.nn.Dropout, "0.mlp.2": torch.nn.RMSNorm,
                        "0.head_norm": torch.nn.LayerNorm, "1.norm": torch.nn.LayerNorm,
                        "1.mlp.1": torch.nn.Dropout, "1.mlp.2": torch.nn.RMSNorm, "1.head_norm": torch.nn.LayerNorm}
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
    assert kernels.replace_modules(model, dropout=False) == {"0": torch.nn.LayerNorm}
    assert type(model[0]) is LayerNorm and type(model[1]) is torch.nn.Dropout
    assert model[0].training
    bare = torch.nn.Dropout(0.3, inplace=True)
    assert kernels.replace_modules(bare) == {"": torch.nn.Dropout}
    assert type(bare) is Dropout and bare.p == 0.3 and bare.inplace


def test_the_swap_keeps_parameter_objects_and_an_optimizer_built_before_it_works():
    model = _randomized(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                            torch.nn.RMSNorm(16))).to(DEVICE)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kernels.replace_modules(model)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    before = [p.detach().clone() for p in params]
    model(torch.randn(4, 16, device=DEVICE)).square().sum().backward()
    optimizer.step()
    for p, old in zip(model.parameters(), before, strict=True):  # the optimizer moved the model's own tensors
        assert p.grad is not None and not torch.equal(p, old)


def test_frozen_weights_stay_frozen_and_a_shared_module_stays_one_module():
    shared = torch.nn.LayerNorm(8)
    shared.weight.requires_grad_(False)
    model = torch.nn.Sequential(shared, torch.nn.Linear(8, 8), shared).to(DEVICE)
    assert len(list(model.parameters())) == 4
    replaced = kernels.replace_modules(model)
    assert replaced == {"0": torch.nn.LayerNorm}  # listed once, under its first name
    assert model[0] is model[2] is shared and type(shared) is LayerNorm
    assert len(list(model.parameters())) == 4
    assert not shared.weight.requires_grad and shared.bias.requires_grad
    model(torch.randn(3, 8, device=DEVICE)).sum().backward()
    assert shared.weight.grad is None and shared.bias.grad is not None


def test_hooks_survive_the_swap():
    norm = torch.nn.LayerNorm(8).to(DEVICE)
    seen = []
    norm.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    norm.register_forward_hook(lambda m, args, out: out * 3)  # a hook that changes the output
    norm.register_full_backward_hook(lambda m, gin, gout: seen.append("backward"))
    x = torch.randn(2, 8, device=DEVICE, requires_grad=True)
    expected = torch.nn.functional.layer_norm(x, (8,)) * 3
    kernels.replace_modules(norm)
    assert type(norm) is LayerNorm
    y = norm(x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert seen == ["pre", "backward"]


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_parametrizations_survive_the_swap():
    norm = torch.nn.RMSNorm(8).to(DEVICE)
    parametrize.register_parametrization(norm, "weight", _Doubled())
    x = torch.randn(3, 8, device=DEVICE)
    expected = torch.nn.functional.rms_norm(x, (8,), 2 * torch.ones(8, device=DEVICE))
    assert kernels.replace_modules(norm) == {"": torch.nn.RMSNorm}
    assert isinstance(norm, RMSNorm) and parametrize.is_parametrized(norm, "weight")
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)
    parametrize.remove_parametrizations(norm, "weight")
    assert type(norm) is RMSNorm  # removing the parametrization leaves the fused class, not torch's
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)


def test_fused_modules_are_torch_modules_to_code_that_checks_types():
    pairs = [(LayerNorm(8), torch.nn.LayerNorm(8)),
             (LayerNorm((2, 4), bias=False), torch.nn.LayerNorm((2, 4), bias=False)),
             (RMSNorm(8), torch.nn.RMSNorm(8)),
             (RMSNorm(8, eps=1e-5, elementwise_affine=False), torch.nn.RMSNorm(8, eps=1e-5, elementwise_affine=False)),
             (Dropout(), torch.nn.Dropout()),
             (Dropout(0.1, inplace=True), torch.nn.Dropout(0.1, inplace=True))]
    for ours, theirs in pairs:
        assert isinstance(ours, type(theirs))
        assert repr(ours) == repr(theirs)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
    # the way model code finds norms (weight-decay groups, init functions, wrap policies)
    swapped = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Dropout())
    kernels.replace_modules(swapped)
    norms = [m for m in swapped.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
    assert norms == [swapped[1]]


def test_a_state_dict_saved_after_the_swap_loads_into_plain_torch_and_back():
    torch.manual_seed(0)
    model = _randomized(torch.nn.Sequential(_Block(), _Block())).to(DEVICE)
    kernels.replace_modules(model)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    plain = torch.nn.Sequential(_Block(), _Block()).to(DEVICE)
    plain.load_state_dict(torch.load(buffer), strict=True)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    fresh = torch.nn.Sequential(_Block(), _Block()).to(DEVICE)
    kernels.replace_modules(fresh)
    fresh.load_state_dict(plain.state_dict(), strict=True)
    x = torch.randn(3, 32, device=DEVICE)
    torch.testing.assert_close(fresh.eval()(x), plain.eval()(x), rtol=1e-4, atol=1e-4)


# The GPT example: an optimizer built before the swap, frozen norms and a tied norm; five fp32 steps with
# dropout 0 give torch's losses. The swap leaves attention on torch's SDPA, so the norms are the only change.
GPT_SIZE = by_mode(interpreter={"seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32},
                   cuda={"seq_len": 128, "n_layer": 2, "n_head": 4, "d_model": 256})
GPT_BATCH = by_mode(interpreter=2, cuda=8)


def _gpt_with_frozen_and_tied_norms():
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.0, backend="torch", **GPT_SIZE)).to(DEVICE).train()
    model.final_norm = model.blocks[0].norm2  # a tied norm: one module in two places
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    model.blocks[1].norm1.requires_grad_(False)  # frozen norms
    model.blocks[0].norm1.weight.requires_grad_(False)
    return model


def _train_steps(model, optimizer, steps):
    losses = []
    corpus = load_corpus(DEVICE)
    for tokens, targets in batches(corpus, GPT_BATCH, model.config.seq_len, steps, seed=1):
        _, loss = model(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_gpt_example_trains_the_same_after_the_swap():
    model = _gpt_with_frozen_and_tied_norms()
    untouched = copy.deepcopy(model)  # deepcopy keeps the tie
    frozen = model.blocks[1].norm1.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    untouched_optimizer = torch.optim.AdamW(untouched.parameters(), lr=1e-3)
    optimizer_params = optimizer.param_groups[0]["params"]

    replaced = kernels.replace_modules(model)
    assert set(replaced.values()) == {torch.nn.LayerNorm, torch.nn.Dropout}
    assert "final_norm" not in replaced and "blocks.0.norm2" in replaced  # the tied norm, once
    assert model.final_norm is model.blocks[0].norm2 and type(model.final_norm) is LayerNorm
    assert all(a is b for a, b in zip(model.parameters(), optimizer_params, strict=True))

    losses = _train_steps(model, optimizer, 5)
    expected = _train_steps(untouched, untouched_optimizer, 5)
    for step, (a, b) in enumerate(zip(losses, expected, strict=True), 1):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5), f"step {step}: swapped {a} vs torch {b}"
    assert torch.equal(model.blocks[1].norm1.weight, frozen)
    assert not model.blocks[0].norm1.weight.requires_grad and model.blocks[0].norm1.bias.requires_grad

    torch.manual_seed(1)
    plain = GPT(GPTConfig(dropout=0.0, backend="torch", **GPT_SIZE)).to(DEVICE)
    plain.load_state_dict(model.state_dict(), strict=True)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    model.load_state_dict(plain.state_dict(), strict=True)
