"""transformers models with our attention and norms (``kernels.transformers``): tiny configurations, random
initialisation, no download. Each model family's logits and the gradients of every parameter equal the unpatched
model's (SDPA) in fp32, with and without padding (left and right); greedy generation gives the same tokens; the
cases the kernels cannot do fall back with a warning and still match."""

from __future__ import annotations

import copy
import importlib
import threading
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kernels.transformers as fused  # noqa: E402  (needs transformers)
from kernels._mode import DEVICE  # noqa: E402

SEQ, BATCH, VOCAB = 12, 3, 97


def _config(name: str):
    return _configs()["bert" if name == "bert-mlm" else name]


def _configs():
    small = {"vocab_size": VOCAB}
    decoder = {**small, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 64}
    return {
        "llama": transformers.LlamaConfig(**decoder),
        "mistral": transformers.MistralConfig(**decoder, sliding_window=5),
        "qwen2": transformers.Qwen2Config(**decoder),
        "gemma": transformers.GemmaConfig(**decoder, head_dim=16),
        "gpt2": transformers.GPT2Config(**small, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                        embd_pdrop=0.0, attn_pdrop=0.0),
        "bert": transformers.BertConfig(**small, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=96, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0),
    }


def _model(name: str):
    config = _config(name)
    torch.manual_seed(0)
    if name.startswith("bert"):
        model = (transformers.BertForMaskedLM if name == "bert-mlm" else transformers.BertModel)(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.set_attn_implementation("sdpa")
    return model.to(DEVICE).float()


def _batch(padding: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padding == "right":
        mask[1, 8:] = 0
        mask[2, 5:] = 0
    elif padding == "left":
        mask[1, :4] = 0
        mask[2, :7] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def _output(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _forward_backward(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = _output(model, ids, mask)
    valid = mask.bool()[..., None].to(out.dtype)  # padded positions' outputs are not defined by either
    (out * valid).square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return (out * valid).detach(), grads


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma", "gpt2", "bert", "bert-mlm"])
def test_a_patched_model_gives_the_unpatched_models_logits_and_gradients(name, padding):
    reference = _model(name)
    ours = copy.deepcopy(reference)
    report = fused.apply(ours)
    # the language models' forward is padding-free; BertModel's (a pooler: not per token) is not
    assert report[""] == "attention: fused_kernels" + ("" if name == "bert" else ", padding-free forward")
    assert ours.config._attn_implementation == "fused_kernels"
    norms = [n for n, what in report.items() if n and not what.startswith("left alone")]
    assert norms, report  # every family here has norms we replace
    ids, mask = _batch(padding)
    expected, expected_grads = _forward_backward(reference, ids, mask)
    got, grads = _forward_backward(ours, ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert grads.keys() == expected_grads.keys()
    for n in grads:
        scale = max(1.0, expected_grads[n].abs().max().item())
        torch.testing.assert_close(grads[n], expected_grads[n], rtol=1e-3, atol=1e-4 * scale, msg=n)


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert-mlm"])
def test_padding_free_forward_packs_the_tokens_and_keeps_the_loss(name, padding, monkeypatch):
    """With labels (-100 at the pads): one packed attention call per layer over the tokens alone, and the loss and
    every gradient of the padded model."""
    reference = _model(name)
    ours = copy.deepcopy(reference)
    fused.apply(ours)
    calls = []
    varlen = fused.flash_attention_varlen
    monkeypatch.setattr(fused, "flash_attention_varlen", lambda q, *a, **kw: calls.append(q.shape[0]) or varlen(
        q, *a, **kw))
    ids, mask = _batch(padding)
    labels = ids.masked_fill(mask == 0, -100)
    losses, grads = [], []
    for model in (reference, ours):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert calls == [int(mask.sum())] * 2, "one packed call per layer, of the tokens only"
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert grads[1].keys() == grads[0].keys()
    for n in grads[0]:
        scale = max(1.0, grads[0][n].abs().max().item())
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-3, atol=1e-4 * scale, msg=n)


def test_padding_free_forward_keeps_the_models_signature():
    """transformers' Trainer keeps the dataset columns model.forward names: the padding-free forward names the same."""
    import inspect

    reference = _model("llama")
    ours = copy.deepcopy(reference)
    fused.apply(ours)
    assert "forward" in vars(ours)
    assert inspect.signature(ours.forward) == inspect.signature(reference.forward)
    assert ours.forward.__doc__ == reference.forward.__doc__


def test_padding_free_forward_keeps_the_padded_forward_where_a_pad_counts():
    """A label at a pad position (counted by the padded loss), or a call asking for hidden states: the padded
    forward runs, as without the padding-free forward (pad positions' outputs are not defined: ours are zeros after
    attention, SDPA's attend to the row's tokens)."""
    padded = _model("llama")
    fused.apply(padded, padding_free=False)
    ours = copy.deepcopy(padded)
    fused.apply(ours)
    assert "forward" in vars(ours) and "forward" not in vars(padded)
    ids, mask = _batch("right")
    with torch.no_grad():
        for kwargs in ({"labels": ids}, {"output_hidden_states": True}):
            expected = padded(input_ids=ids, attention_mask=mask, **kwargs)
            got = ours(input_ids=ids, attention_mask=mask, **kwargs)
            torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=0)
            if "labels" in kwargs:
                torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=0)
            else:
                assert len(got.hidden_states) == len(expected.hidden_states)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma"])
def test_rotary_embedding_runs_our_kernel_in_patched_models_only(name, monkeypatch):
    """Attention modules that apply Llama's rotary code call kernels.attention.apply_rotary once per layer; the same
    family's unpatched model keeps transformers' own (bitwise its result before any patch)."""
    reference = _model(name)
    before = copy.deepcopy(reference)
    ours = copy.deepcopy(reference)
    ids, mask = _batch("none")
    with torch.no_grad():
        expected_before = _output(before, ids, mask)
    report = fused.apply(ours)
    rotary = [n for n, what in report.items() if what.startswith("rotary embedding")]
    assert rotary == [f"model.layers.{i}.self_attn" for i in range(2)]
    calls = []
    real = fused.apply_rotary
    monkeypatch.setattr(fused, "apply_rotary", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        got = _output(ours, ids, mask)
        assert len(calls) == 2
        assert torch.equal(_output(reference, ids, mask), expected_before) and len(calls) == 2
    torch.testing.assert_close(got, expected_before, rtol=1e-4, atol=1e-4)


def _count_calls(monkeypatch, owner, name: str) -> list:
    """Each call of ``owner.name`` from now on: its keyword arguments."""
    calls, original = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _gpt2(**dropouts):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                     **{"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **dropouts})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(DEVICE).float().train()


def test_gpt2_blocks_fuse_dropout_residual_and_the_next_layernorm(monkeypatch):
    """In training each GPT-2 block runs two add_dropout_norm calls (its ln_2, and the LayerNorm after it: the next
    block's ln_1 or ln_f, which take the rows handed to them): the first block's ln_1 is the one LayerNorm left; the
    logits and every gradient equal the unpatched model's."""
    import kernels.layernorm.modules as norm_modules

    reference = _gpt2()
    ours = copy.deepcopy(reference)
    report = fused.apply(ours)
    assert all("add_dropout_norm" in report[f"transformer.h.{i}"] for i in range(3))
    assert "normalised for it" in report["transformer.ln_f"]
    assert ours.state_dict().keys() == reference.state_dict().keys()
    assert dict(ours.named_modules()).keys() == dict(reference.named_modules()).keys()
    fused_calls = _count_calls(monkeypatch, fused, "add_dropout_norm")
    norm_calls = _count_calls(monkeypatch, norm_modules, "layer_norm")
    ids, mask = _batch("none")
    expected, expected_grads = _forward_backward(reference, ids, mask)
    got, grads = _forward_backward(ours, ids, mask)
    assert len(fused_calls) == 6 and len(norm_calls) == 1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert grads.keys() == expected_grads.keys()
    for n in grads:
        scale = max(1.0, expected_grads[n].abs().max().item())
        torch.testing.assert_close(grads[n], expected_grads[n], rtol=1e-3, atol=1e-4 * scale, msg=n)


def test_gpt2_blocks_give_their_dropout_to_the_fused_kernel_and_run_unfused_where_they_must(monkeypatch):
    """The residual dropouts' probability goes to add_dropout_norm (the dropout modules pass their input through
    meanwhile, and keep their p); evaluation, gradient checkpointing and a hook on a block's output that replaces it
    run without the fusion or its hand-off, and match the unpatched model."""
    model = _gpt2(resid_pdrop=0.25)
    fused.apply(model)
    calls = _count_calls(monkeypatch, fused, "add_dropout_norm")
    ids, mask = _batch("none")
    _output(model, ids, mask).sum().backward()
    assert [c["dropout_p"] for c in calls] == [0.25] * 6
    assert all(b.attn.resid_dropout.p == 0.25 and b.mlp.dropout.p == 0.25 for b in model.transformer.h)
    drop = model.transformer.h[0].mlp.dropout
    assert isinstance(drop, torch.nn.Dropout) and type(drop).__name__ == "Dropout"
    ones = torch.ones(4096)
    with fused._DropoutDeferred(drop):  # passed through in this thread only
        assert drop(ones) is ones
        other = []
        worker = threading.Thread(target=lambda: other.append(drop(ones)))
        worker.start()
        worker.join()
    assert (other[0] == 0).any() and not (drop(ones) == 1).all()
    assert all(p.grad is not None for p in model.parameters())

    reference = _gpt2()
    for case in ("eval", "checkpointing", "hook"):
        ours, expected_model = copy.deepcopy(reference), copy.deepcopy(reference)
        fused.apply(ours)
        calls.clear()
        if case == "eval":
            ours.eval()
            expected_model.eval()
        elif case == "checkpointing":
            for m in (ours, expected_model):
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            for m in (ours, expected_model):
                m.transformer.h[0].register_forward_hook(lambda module, args, output: output * 0.5)
        got, expected = _output(ours, ids, mask), _output(expected_model, ids, mask)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=case)
        assert len(calls) == {"eval": 0, "checkpointing": 0, "hook": 6}[case], case


def test_tanh_gelu_activations_compute_in_one_op_with_the_same_values(monkeypatch):
    """Every class of the table computes what torch's ``gelu(approximate="tanh")`` computes (so the swap keeps the
    function); apply swaps GPT-2's activations (reported, isinstance kept) and not with ``activations=False``."""
    import transformers.activations as acts

    x = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    for path, name in fused.GELU_TANH_CLASSES:
        cls = getattr(importlib.import_module(path), name)
        torch.testing.assert_close(cls()(x), torch.nn.functional.gelu(x, approximate="tanh"), rtol=1e-9, atol=1e-9,
                                   msg=name)
    reference = _gpt2()
    kept = copy.deepcopy(reference)
    assert not any("gelu" in what for what in fused.apply(kept, activations=False).values())
    assert type(kept.transformer.h[0].mlp.act) is acts.NewGELUActivation
    ours = copy.deepcopy(reference)
    report = fused.apply(ours)
    act = ours.transformer.h[0].mlp.act
    assert report["transformer.h.0.mlp.act"].startswith("NewGELUActivation -> torch.nn.functional.gelu")
    assert isinstance(act, acts.NewGELUActivation) and type(act).__name__ == "NewGELUActivation"
    calls = []
    gelu = torch.nn.functional.gelu
    monkeypatch.setattr(torch.nn.functional, "gelu", lambda *a, **k: calls.append(k) or gelu(*a, **k))
    ids, mask = _batch("none")
    expected, expected_grads = _forward_backward(reference, ids, mask)
    got, grads = _forward_backward(ours, ids, mask)
    assert calls == [{"approximate": "tanh"}] * 3
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for n in grads:
        scale = max(1.0, expected_grads[n].abs().max().item())
        torch.testing.assert_close(grads[n], expected_grads[n], rtol=1e-3, atol=1e-4 * scale, msg=n)


def test_apply_keeps_parameters_state_dict_and_isinstance():
    model = _model("llama")
    norm = model.model.norm
    cls, weight, state = type(norm), norm.weight, copy.deepcopy(model.state_dict())
    report = fused.apply(model)
    assert report["model.norm"] == "rms_norm (Llama)" and report["model.layers.0.input_layernorm"]
    assert model.model.norm is norm and norm.weight is weight and isinstance(norm, cls)
    assert type(norm).__name__ == cls.__name__ and repr(norm) == repr(norm)
    assert model.state_dict().keys() == state.keys()
    assert fused.apply(model) == report  # a second call changes nothing


class _EpsOutsideRMSNorm(torch.nn.Module):
    """An RMSNorm of the same structure as Llama's whose eps sits outside the root: another computation."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        return self.weight * hidden_states / (hidden_states.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)


def test_norms_of_other_families_with_the_same_code_compute_as_the_table_class():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm

    torch.manual_seed(0)
    model = torch.nn.Sequential(Phi3RMSNorm(64), Gemma3RMSNorm(64), _EpsOutsideRMSNorm(64)).to(DEVICE)
    for norm in model:
        torch.nn.init.normal_(norm.weight)
    reference = copy.deepcopy(model)
    report = fused.apply(model, attention=False)
    assert report["0"] == "rms_norm (Llama), the code of LlamaRMSNorm"
    assert report["1"] == "rms_norm (Gemma, 1 + weight), the code of GemmaRMSNorm"
    assert report["2"].startswith("left alone:") and type(model[2]) is _EpsOutsideRMSNorm
    assert type(model[0]).forward is fused._llama_forward and isinstance(model[0], Phi3RMSNorm)
    x = torch.randn(5, 64, device=DEVICE)
    for ours, theirs in zip(model, reference, strict=True):
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_registered_by_name_at_build_time():
    config = _configs()["llama"]
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="fused_kernels")
    assert model.config._attn_implementation == "fused_kernels"


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_greedy_generation_gives_the_same_tokens(name, padding):
    reference = _model(name).eval()
    ours = copy.deepcopy(reference)
    fused.apply(ours)
    ids, mask = _batch(padding)
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_soft_capping_falls_back_with_a_warning_and_matches():
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, sliding_window=5, attn_logit_softcapping=30.0)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(DEVICE)
    ours = copy.deepcopy(reference)
    fused.apply(ours)
    fused._WARNED.discard("soft-capped scores")
    ids, mask = _batch("left")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _output(ours, ids, mask)
    assert any("soft-capped scores" in str(w.message) for w in caught)
    expected = _output(reference, ids, mask)
    valid = mask.bool()[..., None]
    torch.testing.assert_close(got * valid, expected * valid, rtol=1e-4, atol=1e-4)


def test_compiled_patched_model_runs_and_matches():
    reference = _model("llama").eval()
    ours = copy.deepcopy(reference)
    fused.apply(ours)
    ids, mask = _batch("none")
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(ours, fullgraph=False)(input_ids=ids, attention_mask=mask).logits
        expected = reference(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
