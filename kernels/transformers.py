"""Hugging Face transformers: our attention and norms inside a transformers model.

    import kernels.transformers                 # registers attn_implementation="fused_kernels"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fused_kernels")
    kernels.transformers.apply(model)          # or on a built model: attention and every norm it knows

Importing this module (transformers is an optional dependency: ``pip install fused-kernels[transformers]``;
``import kernels`` never imports it) registers the attention implementation ``"fused_kernels"`` with
``transformers.AttentionInterface`` and its mask function with ``AttentionMaskInterface``: the mask a model builds
for it is None (no padding) or the 2-D padding mask, never a dense one.

The attention function (:func:`attention_forward`) takes what transformers passes:
- no padding: :func:`kernels.attention.flash_attention` on the (B, H, S, D) tensors as they are (GQA/MQA without
  expanding K/V; causal or bidirectional by the module's ``is_causal``; queries aligned bottom-right to the keys,
  which is where a cache puts them; ``sliding_window`` as the window; ``scaling``; ``dropout`` in training);
- a 2-D padding mask (left or right padding, prefill or decoding): the tokens are gathered once per forward (the
  indices, computed for the mask object a forward passes to all its layers, are kept while it lives) and attended
  packed by :func:`kernels.attention.flash_attention_varlen`, then scattered back (padded query rows get zeros);
- a StaticCache's keys past the mask's length are not attended (the mask's length is what has been written);
- packed sequences (batch 1, no mask, ``cu_seq_lens_q``/``max_length_q`` among the kwargs, as transformers'
  padding-free calls give them): one :func:`kernels.attention.flash_attention_varlen` call;
- a few queries against many keys (a decoding step): :func:`kernels.attention.flash_attention` runs its split-KV
  kernel.
The outputs at pad positions are not defined by the padded model (SDPA lets a pad query attend to its row's tokens);
ours are zeros after attention, as with transformers' FlashAttention, so a loss that counts pad positions differs.
What the kernels cannot do falls back, for that call, to an implementation of transformers' own, with a one-time
warning, never a wrong answer: score soft-capping and attention sinks to the model's eager attention (its
``eager_attention_forward``), a mask that is not a 2-D padding mask, a position bias or attention weights asked
for to SDPA.

Padding-free forward (:func:`apply`): a causal-LM or masked-LM model given a batch with padding (a 2-D
``attention_mask``) runs its tokens packed into one row, every layer computing only them, and returns the padded
forward's loss and its logits scattered back, zeros at the pads (:class:`_PaddingFreeForward`; a cache, hidden states
or attention weights asked for, or a label at a pad position, keep the padded forward).

Rotary embedding (:func:`apply`): an attention module whose forward calls its python module's
``apply_rotary_pos_emb`` when that function is Llama's code computes it with :func:`kernels.attention.apply_rotary`:
the module's class becomes a same-named subclass whose forward marks the thread, and the module's function is
wrapped to take our kernel while a marked forward runs (transformers' own everywhere else, and under torch.compile).

GPT-2 blocks (:func:`apply`, with norms): in a training step each ``GPT2Block`` computes its residual steps with
:func:`kernels.layernorm.add_dropout_norm`: ``ln_2(dropout(attention) + residual)`` in one kernel, and
``dropout(mlp) + residual`` with the LayerNorm after the block (the next block's ``ln_1``, or ``ln_f``) in another,
whose rows that norm takes (:func:`_gpt2_block_forward`); evaluation, gradient checkpointing, cross-attention,
torch.compile and modules with hooks keep the class's forward.

Activations (:func:`apply`): a module of a class in :data:`GELU_TANH_CLASSES` (GPT-2's ``gelu_new``: the tanh
approximation of GELU as eight eager ops) computes the same function with ``torch.nn.functional.gelu(approximate=
"tanh")``, one kernel each way; this is torch's kernel, not ours, and it is most of what ``apply`` gains on an eager
GPT-2 (the benchmark's ``sdpa+gelu-tanh`` provider takes the swap alone).

Norms (:func:`apply`): each module of a class in :data:`NORM_CLASSES` computes with
:func:`kernels.layernorm.rms_norm` with that class's exact semantics; ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm``
become :mod:`kernels.layernorm`'s drop-ins (``kernels.replace_modules``). The module keeps its identity, parameters,
hooks and ``state_dict``; only its class changes, to a subclass of its own class (``isinstance`` holds) with the
same name. A class not in the table whose forward is the same code as a table class's (transformers copies its norm
classes from model to model) computes as that class, when the module has that class's structure (a leaf whose only
parameter is a 1-D ``weight``); any other module with "norm" in its class name is left alone and reported.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import textwrap
import threading
import warnings
import weakref

import torch

try:
    import transformers  # noqa: F401
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
except ImportError as error:  # pragma: no cover - the optional dependency is missing
    raise ImportError("kernels.transformers needs transformers: pip install 'fused-kernels[transformers]'") from error

from kernels.attention import apply_rotary, flash_attention, flash_attention_varlen
from kernels.dropout import dropout
from kernels.layernorm import add_dropout_norm, rms_norm
from kernels.swap import replace_modules

#: the attention implementation name this module registers
NAME = "fused_kernels"

_WARNED: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"fused_kernels attention: {reason}; this call runs transformers' own attention", stacklevel=3)


# --- attention -----------------------------------------------------------------------------------------------

class _UnpadPlan:
    """Where a 2-D padding mask's tokens are: flat indices of the query rows and key rows that are tokens, their
    cumulative lengths per sequence and the longest sequences (one host read of the lengths per plan)."""

    __slots__ = ("cu_k", "cu_q", "index_k", "index_q", "max_k", "max_q", "no_padding")

    def __init__(self, mask: torch.Tensor, q_length: int):
        keys = mask.bool()
        queries = keys[:, -q_length:]
        lengths_k, lengths_q = keys.sum(-1, dtype=torch.int32), queries.sum(-1, dtype=torch.int32)
        self.index_k = keys.flatten().nonzero().flatten()
        self.index_q = queries.flatten().nonzero().flatten()
        zero = torch.zeros(1, dtype=torch.int32, device=mask.device)
        self.cu_k = torch.cat([zero, lengths_k.cumsum(0, dtype=torch.int32)])
        self.cu_q = torch.cat([zero, lengths_q.cumsum(0, dtype=torch.int32)])
        self.max_k, self.max_q = (int(t.max()) if t.numel() else 0 for t in (lengths_k, lengths_q))
        # every position a token (a StaticCache's mask without padding): the dense call, nothing gathered
        self.no_padding = self.index_k.numel() == keys.numel()


#: plans by padding mask: the mask object a forward passes to every layer, held weakly (a later mask at the same
#: address is another object, so a plan is never taken for another mask's tokens)
_PLANS: list[tuple[weakref.ref, int, int, _UnpadPlan]] = []
_PLANS_LIMIT = 8


def _unpad_plan(mask: torch.Tensor, q_length: int) -> _UnpadPlan:
    for ref, version, length, plan in _PLANS:
        if ref() is mask and version == mask._version and length == q_length:
            return plan
    plan = _UnpadPlan(mask, q_length)
    _PLANS[:] = [entry for entry in _PLANS if entry[0]() is not None][-(_PLANS_LIMIT - 1):]
    _PLANS.append((weakref.ref(mask), mask._version, q_length, plan))
    return plan


def _tokens(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows ``index`` of (B, H, S, D) ``t`` as packed (tokens, H, D)."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h, d).index_select(0, index)


def _window(sliding_window, causal: bool) -> tuple[int, int]:
    """transformers' sliding window (``sliding_window`` keys: the query's own and ``sliding_window - 1`` before it)
    as :func:`flash_attention`'s ``window_size``."""
    if sliding_window is None or sliding_window <= 0:
        return -1, -1
    return sliding_window - 1, -1 if causal else sliding_window - 1


def _fallback_reason(module, attention_mask, kwargs) -> str | None:
    if kwargs.get("softcap") is not None:
        return "soft-capped scores"
    if kwargs.get("s_aux") is not None:
        return "attention sinks"
    if kwargs.get("position_bias") is not None:
        return "a position bias"
    if kwargs.get("output_attentions"):
        return "attention weights asked for"
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.dtype.is_floating_point):
        return f"a {attention_mask.dim()}-D {attention_mask.dtype} mask"
    return None


def _packed_sequences(query: torch.Tensor, attention_mask, kwargs) -> tuple[torch.Tensor, int] | None:
    """``(cumulative lengths int32, longest sequence)`` when the call attends packed sequences (batch 1, no mask,
    ``cu_seq_lens_q`` among the kwargs, as transformers' padding-free calls and :func:`apply`'s padding-free forward
    give them: one self-attention per sequence), else None."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or attention_mask is not None or query.shape[0] != 1:
        return None
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise ValueError("fused_kernels attention: packed sequences need cu_seq_lens_k equal to cu_seq_lens_q "
                         "(self-attention)")
    max_length = kwargs.get("max_length_q")
    max_length = int(cu.diff().max()) if max_length is None else int(max_length)
    return cu.to(torch.int32), max_length


def _dense_mask(mask2d, q_length: int, kv_length: int, causal: bool, left: int, right: int, device) -> torch.Tensor:
    """The boolean (B or 1, 1, Sq, Sk) mask of what each query sees: the band (bottom-right aligned) and the
    padding."""
    i = torch.arange(q_length, device=device)[:, None] + (kv_length - q_length)
    j = torch.arange(kv_length, device=device)[None, :]
    keep = torch.ones(q_length, kv_length, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    keep = keep[None, None]
    if mask2d is not None and mask2d.dim() == 2:
        keep = keep & mask2d[:, None, None, -kv_length:].bool()
    return keep


def _fallback(module, query, key, value, attention_mask, dropout, scaling, causal, left, right, reason, kwargs):
    _warn_once(reason)
    mask = attention_mask
    if mask is None or mask.dim() == 2:
        mask = _dense_mask(mask, query.shape[2], key.shape[2], causal, left, right, query.device)
    packed = _packed_sequences(query, attention_mask, kwargs)
    if packed is not None:  # one sequence attends only to itself
        sequence = torch.bucketize(torch.arange(query.shape[2], device=query.device), packed[0][1:], right=True)
        mask = mask & (sequence[:, None] == sequence[None, :])
    kwargs = {k: v for k, v in kwargs.items() if k not in _PACKED_KWARGS}
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            if mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    ~mask, torch.finfo(query.dtype).min)
            return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                  is_causal=False, **kwargs)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None, **kwargs):
    """transformers' attention function for ``attn_implementation="fused_kernels"``: query (B, Hq, Sq, D), key and
    value (B, Hkv, Sk, D) -> ``(output (B, Sq, Hq, D), None)``. See the module docstring for what it takes."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal)
    left, right = _window(sliding_window, causal)
    reason = _fallback_reason(module, attention_mask, kwargs)
    if reason is not None:
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, causal, left, right, reason,
                         kwargs)
    packed = _packed_sequences(query, attention_mask, kwargs)
    if packed is not None:
        cu, max_length = packed
        out = flash_attention_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu,
                                     cu, max_length, max_length, causal=causal, softmax_scale=scaling,
                                     dropout_p=dropout, window_size=(left, right))
        return out[None], None
    if attention_mask is not None and attention_mask.shape[1] < key.shape[2]:
        # a StaticCache: the mask covers what has been written, from position 0
        key, value = key[:, :, :attention_mask.shape[1]], value[:, :, :attention_mask.shape[1]]
    window = (left, right)
    b, hq, sq, d = query.shape
    plan = None if attention_mask is None else _unpad_plan(attention_mask, sq)
    if plan is None or plan.no_padding:
        out = flash_attention(query, key, value, causal=causal, softmax_scale=scaling, dropout_p=dropout,
                              window_size=window)
        return out.transpose(1, 2), None
    packed = flash_attention_varlen(_tokens(query, plan.index_q), _tokens(key, plan.index_k),
                                    _tokens(value, plan.index_k), plan.cu_q, plan.cu_k, plan.max_q, plan.max_k,
                                    causal=causal, softmax_scale=scaling, dropout_p=dropout, window_size=window)
    out = packed.new_zeros(b * sq, hq, d).index_copy(0, plan.index_q, packed)
    return out.view(b, sq, hq, d), None


#: the kwargs of transformers' padding-free calls (packed sequences)
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _register() -> None:
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


_register()


# --- padding-free forward ---------------------------------------------------------------------------------

#: the arguments a padding-free forward packs (every other tensor argument keeps the padded forward)
_PER_TOKEN_ARGUMENTS = ("input_ids", "inputs_embeds", "token_type_ids", "position_ids", "labels")
#: arguments that ask for what a packed forward does not give: attention weights, every layer's states, a cache
_PADDED_ONLY = {"output_attentions": True, "output_hidden_states": True, "use_cache": True, "return_dict": False}


def _padding_free_kind(model: torch.nn.Module) -> str | None:
    """"causal" or "masked" when ``model`` is transformers' causal-LM or masked-LM class of its model type (its
    outputs are per token: logits and a loss), else None."""
    from transformers.models.auto import modeling_auto

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = type(model).__name__
    if modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) == name:
        return "causal"
    if modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.get(model_type) == name:
        return "masked"
    return None


class _PaddingFreeForward:
    """A model's ``forward`` that runs a padded batch without its pad tokens: given a 2-D ``attention_mask`` with
    padding, it packs the tokens into one row (``input_ids``, ``inputs_embeds``, ``token_type_ids``,
    ``position_ids``, ``labels``: the positions the padded forward gives them, ``arange(S)`` by default), passes
    the sequences' cumulative lengths to the attention (``cu_seq_lens_q``: one self-attention per sequence) and no
    mask, and scatters the logits back to (B, S, ...) with zeros at the pads. Every layer then computes only the
    tokens. The loss is the padded forward's: a causal LM gets the packed ``shift_labels`` (each token's next label
    in its row), so no pair crosses a sequence; a batch whose labels count a pad position (a label at a pad, or
    after a left pad for a causal LM) keeps the padded forward, as do calls that ask for a cache, attention weights
    or hidden states, and calls with other tensor arguments. One host read per call (the lengths)."""

    def __init__(self, forward, kind: str):
        self.forward = forward
        self.kind = kind
        self.signature = inspect.signature(forward)
        # what introspects model.forward (transformers' Trainer keeps the dataset columns it names) sees the model's
        functools.update_wrapper(self, forward)
        self.__signature__ = self.signature
        self.var_keyword = next((p.name for p in self.signature.parameters.values()
                                 if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def __call__(self, *args, **kwargs):
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return self.forward(*args, **kwargs)  # its own error
        arguments = dict(bound.arguments)
        extra = dict(arguments.pop(self.var_keyword, {}) if self.var_keyword else {})
        packed = self._pack(arguments, extra)
        if packed is None:
            return self.forward(*args, **kwargs)
        arguments, index, shape = packed
        output = self.forward(**arguments, **extra)
        logits = output.logits[0]
        output.logits = logits.new_zeros(shape[0] * shape[1], *logits.shape[1:]).index_copy(0, index, logits).view(
            *shape, *logits.shape[1:])
        return output

    def _pack(self, arguments: dict, extra: dict):
        mask = arguments.get("attention_mask")
        tokens = arguments.get("input_ids")
        tokens = arguments.get("inputs_embeds") if tokens is None else tokens
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.dtype.is_floating_point or tokens is None \
                or tokens.shape[:2] != mask.shape or "position_ids" not in self.signature.parameters \
                or "shift_labels" in extra or any(k in extra for k in _PACKED_KWARGS):
            return None
        for name, value in (*arguments.items(), *extra.items()):
            if name in _PADDED_ONLY and value is _PADDED_ONLY[name]:
                return None
            if name == "logits_to_keep" and not (isinstance(value, int) and value == 0):
                return None
            if isinstance(value, torch.Tensor) and name not in (*_PER_TOKEN_ARGUMENTS, "attention_mask"):
                return None
            if name == "past_key_values" and value is not None:
                return None
        batch, length = mask.shape
        keep = mask.bool()
        lengths = keep.sum(-1, dtype=torch.int32)
        labels = arguments.get("labels")
        counted = torch.zeros((), dtype=torch.bool, device=mask.device)
        if labels is not None:
            if self.kind == "causal":
                labels = torch.cat([labels[:, 1:], labels.new_full((batch, 1), -100)], 1)  # each token's next label
            counted = ((labels != -100) & ~keep).any()
        tokens_total, longest, padded, pad_labels = torch.stack(
            [lengths.sum(), lengths.max(), (~keep).any(), counted]).tolist()
        if not padded or pad_labels or tokens_total == 0:
            return None
        index = torch.nonzero_static(keep.flatten(), size=tokens_total).flatten()

        def pack(t: torch.Tensor) -> torch.Tensor:
            return t.expand(batch, length, *t.shape[2:]).flatten(0, 1).index_select(0, index)[None]

        packed = {name: value for name, value in arguments.items()}
        for name in _PER_TOKEN_ARGUMENTS:
            if packed.get(name) is not None:
                packed[name] = pack(packed[name])
        if arguments.get("position_ids") is None:
            packed["position_ids"] = (index % length)[None]
        if labels is not None and self.kind == "causal":
            packed["shift_labels"] = pack(labels)
        packed["attention_mask"] = None
        if "use_cache" in self.signature.parameters:
            packed["use_cache"] = False
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
        packed.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return packed, index, (batch, length)


def _padding_free(model: torch.nn.Module) -> bool:
    """Give ``model`` the padding-free forward if it is a causal-LM or masked-LM model (once)."""
    if isinstance(model.__dict__.get("forward"), _PaddingFreeForward):
        return True
    kind = _padding_free_kind(model)
    if kind is None:
        return False
    model.forward = _PaddingFreeForward(model.forward, kind)
    return True


# --- rotary position embedding ----------------------------------------------------------------------------

_ROTARY_NAME = "apply_rotary_pos_emb"
#: set while a patched attention module's forward runs on this thread: the rotary functions of the modules
#: :func:`apply` patched then compute with :func:`kernels.attention.apply_rotary`, other callers get transformers' own
_ROTARY_ACTIVE = threading.local()


def _llama_rotary_code():
    from transformers.models.llama import modeling_llama

    function = vars(modeling_llama)[_ROTARY_NAME]
    return _function_code(getattr(function, "_fused_kernels_original", function))


def _rotary_of(cls: type):
    """The python module of attention class ``cls`` when its forward calls that module's ``apply_rotary_pos_emb`` and
    that function is Llama's code (transformers copies it from family to family), else None."""
    module = sys.modules.get(cls.__module__)
    function = getattr(module, _ROTARY_NAME, None)
    forward = getattr(cls, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    if function is None or code is None or _ROTARY_NAME not in code.co_names:
        return None
    original = getattr(function, "_fused_kernels_original", function)
    return module if _function_code(original) == _llama_rotary_code() else None


def _rotary_dispatch(original):
    """``apply_rotary_pos_emb`` for a module whose attention :func:`apply` patched: ours inside a patched forward,
    transformers' own elsewhere (and under torch.compile, whose inductor fuses it, and for anything but the (B, S, D)
    tables it gives a (B, H, S, D) layout)."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (getattr(_ROTARY_ACTIVE, "on", False) and unsqueeze_dim == 1 and not torch.compiler.is_compiling()
                and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
                and cos.shape[0] in (1, q.shape[0]) and cos.shape[1:] == (q.shape[2], q.shape[3])
                and k.shape[2:] == q.shape[2:] and q.shape[3] % 2 == 0 and q.dtype == k.dtype):
            return apply_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._fused_kernels_original = original
    return apply_rotary_pos_emb


def _rotary_attention_forward(self, *args, **kwargs):
    base = type(self)._fused_kernels_base
    if torch.compiler.is_compiling():
        return base.forward(self, *args, **kwargs)
    outer = getattr(_ROTARY_ACTIVE, "on", False)
    _ROTARY_ACTIVE.on = True
    try:
        return base.forward(self, *args, **kwargs)
    finally:
        _ROTARY_ACTIVE.on = outer


def _patch_rotary(model: torch.nn.Module, report: dict[str, str]) -> None:
    """Attention modules whose forward applies Llama's rotary embedding compute it with our kernel."""
    for name, module in model.named_modules():
        cls = type(module)
        base = getattr(cls, "_fused_kernels_base", cls)
        if base is not cls and cls.forward is not _rotary_attention_forward:
            continue  # patched for something else
        python_module = _rotary_of(base)
        if python_module is None:
            continue
        function = vars(python_module)[_ROTARY_NAME]
        if not hasattr(function, "_fused_kernels_original"):
            setattr(python_module, _ROTARY_NAME, _rotary_dispatch(function))
        module.__class__ = _patched(base, _rotary_attention_forward)
        report[name] = "rotary embedding: kernels.attention.apply_rotary"


# --- GPT-2 blocks: dropout, residual add and LayerNorm as one kernel ----------------------------------------

_GPT2_BLOCK = ("transformers.models.gpt2.modeling_gpt2", "GPT2Block")
_GPT2_MODEL = ("transformers.models.gpt2.modeling_gpt2", "GPT2Model")

#: each fused GPT-2 block -> a weak reference to the LayerNorm that follows it (the next block's ``ln_1``, or the
#: model's ``ln_f``), kept outside the module so that neither its submodules nor its state_dict change
_NEXT_NORM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: the normalised rows a block computed for the next LayerNorm, per thread: (the block's output, its version, the
#: norm module, the rows)
_HANDOFF = threading.local()


def _class_of(path_and_name: tuple[str, str]) -> type | None:
    """The class a table names by ``(module path, class name)``, or None where this transformers has none or another
    library has put a class of its own in its place."""
    path, name = path_and_name
    try:
        cls = getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError):
        return None
    return cls if cls.__module__ == path and cls.__name__ == name else None


def _plain(module: torch.nn.Module) -> bool:
    """Whether a module runs as its class says when called: no hooks, its own or global, that a fused call would
    skip."""
    hooks = torch.nn.modules.module
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def _fusable_norm(norm) -> bool:
    return (isinstance(norm, torch.nn.LayerNorm) and norm.weight is not None and norm.bias is not None
            and len(norm.normalized_shape) == 1 and _plain(norm))


def _handed_off(hidden_states: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor | None:
    """The rows the previous block normalised for ``norm`` from exactly ``hidden_states`` (the same tensor, not
    changed in place since), taken once; None otherwise."""
    handoff = getattr(_HANDOFF, "value", None)
    if handoff is None:
        return None
    _HANDOFF.value = None
    output, version, target, rows = handoff
    if output is hidden_states and target is norm and hidden_states._version == version:
        return rows
    return None


#: per thread, the dropout module whose call passes its input through (its probability applied in a fused kernel)
_DEFERRED_DROPOUT = threading.local()


def _deferred_dropout_forward(self, input: torch.Tensor) -> torch.Tensor:
    """A GPT-2 block's residual dropout: its input unchanged while this thread's fused block applies it, else
    ``nn.Dropout``'s own forward (the module's ``p`` is never changed, so other threads see it as it is)."""
    if getattr(_DEFERRED_DROPOUT, "module", None) is self:
        return input
    return torch.nn.Dropout.forward(self, input)


class _DropoutDeferred:
    """Within the ``with``: ``module`` (a residual dropout of a fused block) passes its input through in this
    thread; its probability (0 when it is not training) is given to the caller, who applies it in a fused kernel."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __enter__(self) -> float:
        _DEFERRED_DROPOUT.module = self.module
        return float(self.module.p) if self.module.training else 0.0

    def __exit__(self, *exc) -> None:
        _DEFERRED_DROPOUT.module = None


def _gpt2_block_fusable(block, hidden_states, encoder_hidden_states) -> bool:
    """A training step's block whose residual steps can be fused: grad on, training, no cross-attention, no
    gradient checkpointing (a recomputed forward must draw the same masks as torch's dropout), LayerNorms and
    dropouts of the plain classes without hooks, not under torch.compile (which fuses for itself)."""
    return (block.training and torch.is_grad_enabled() and encoder_hidden_states is None
            and not torch.compiler.is_compiling() and isinstance(hidden_states, torch.Tensor)
            and hidden_states.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and not getattr(block, "gradient_checkpointing", False)
            and _fusable_norm(block.ln_1) and _fusable_norm(block.ln_2)
            and all(type(d).forward is _deferred_dropout_forward and _plain(d)
                    for d in (block.attn.resid_dropout, block.mlp.dropout)))


def _gpt2_block_forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                        encoder_attention_mask=None, use_cache=False, **kwargs):
    """GPT2Block's forward with its residual steps fused: ``ln_2(dropout(attention) + residual)`` as one
    :func:`kernels.layernorm.add_dropout_norm`, and ``dropout(mlp) + residual`` with the LayerNorm that follows the
    block (the next block's ``ln_1``, the model's ``ln_f``) as another, whose normalised rows the next one takes
    (:func:`_handed_off`). Every other call runs the class's own forward."""
    base = type(self)._fused_kernels_base
    if not _gpt2_block_fusable(self, hidden_states, encoder_hidden_states):
        return base.forward(self, hidden_states, past_key_values, attention_mask, encoder_hidden_states,
                            encoder_attention_mask, use_cache, **kwargs)
    residual = hidden_states
    x = _handed_off(hidden_states, self.ln_1)
    if x is None:
        x = self.ln_1(hidden_states)
    with _DropoutDeferred(self.attn.resid_dropout) as p:
        attn_output, _ = self.attn(x, past_key_values=past_key_values, attention_mask=attention_mask,
                                   use_cache=use_cache, **kwargs)
    x, hidden_states = add_dropout_norm(attn_output, residual, self.ln_2.weight, self.ln_2.bias, eps=self.ln_2.eps,
                                        dropout_p=p)
    with _DropoutDeferred(self.mlp.dropout) as p:
        feed_forward = self.mlp(x)
    following = _NEXT_NORM.get(self)
    following = following() if following is not None else None
    if following is None or not _fusable_norm(following):
        return hidden_states + (dropout(feed_forward, p) if p else feed_forward)
    rows, hidden_states = add_dropout_norm(feed_forward, hidden_states, following.weight, following.bias,
                                           eps=following.eps, dropout_p=p)
    _HANDOFF.value = (hidden_states, hidden_states._version, following, rows)
    return hidden_states


def _final_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A GPT-2 model's ``ln_f`` after a fused block: the rows the block normalised for it, else its own forward."""
    rows = _handed_off(x, self)
    return rows if rows is not None else type(self)._fused_kernels_base.forward(self, x)


def _fuse_gpt2_blocks(model: torch.nn.Module, report: dict[str, str]) -> None:
    """Every GPT2Model in ``model`` whose norms are ours: its blocks take :func:`_gpt2_block_forward`, its ``ln_f``
    :func:`_final_norm_forward`; each block is told which LayerNorm follows it."""
    block_cls, model_cls = _class_of(_GPT2_BLOCK), _class_of(_GPT2_MODEL)
    if block_cls is None or model_cls is None:
        return
    names = {module: name for name, module in model.named_modules()}
    for gpt2 in [m for m in model.modules() if isinstance(m, model_cls)]:
        blocks = [b for b in gpt2.h if getattr(type(b), "_fused_kernels_base", type(b)) is block_cls]
        if len(blocks) != len(gpt2.h) or not isinstance(gpt2.ln_f, torch.nn.LayerNorm):
            continue
        for block, following in zip(blocks, [*(b.ln_1 for b in blocks[1:]), gpt2.ln_f], strict=True):
            dropouts = (block.attn.resid_dropout, block.mlp.dropout)
            if not all(type(d) is torch.nn.Dropout or type(d).forward is _deferred_dropout_forward for d in dropouts):
                continue  # a dropout of another class: the block keeps its forward
            for d in dropouts:
                d.__class__ = _patched(torch.nn.Dropout, _deferred_dropout_forward)
            block.__class__ = _patched(block_cls, _gpt2_block_forward)
            _NEXT_NORM[block] = weakref.ref(following)
            report[names[block]] = "dropout + residual + LayerNorm fused: kernels.layernorm.add_dropout_norm"
        base = getattr(type(gpt2.ln_f), "_fused_kernels_base", type(gpt2.ln_f))
        gpt2.ln_f.__class__ = _patched(base, _final_norm_forward)
        name = names[gpt2.ln_f]
        report[name] = report.get(name, "LayerNorm") + ", the rows the last block normalised for it"


# --- norms ------------------------------------------------------------------------------------------------

def _llama_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``weight * normalise_fp32(x).to(x.dtype)``: with a weight of x's dtype the product is fused (one rounding
    instead of two); with another (an fp32 weight under autocast) it is taken as the class takes it."""
    n = hidden_states.shape[-1]
    eps = self.variance_epsilon
    if self.weight.dtype == hidden_states.dtype:
        y = rms_norm(hidden_states, (n,), self.weight, eps)
        return y if y.dtype == hidden_states.dtype else y.to(hidden_states.dtype)  # (CUDA autocast gives fp32)
    normalised = rms_norm(hidden_states, (n,), None, eps)
    return self.weight * normalised.to(hidden_states.dtype)


def _gemma_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``(normalise_fp32(x) * (1 + weight_fp32)).to(x.dtype)``: one rounding, as the class."""
    y = rms_norm(x, (x.shape[-1],), 1.0 + self.weight.float(), self.eps)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _t5_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """T5's: the normalised rows in fp32, cast to a half-precision weight's dtype, times the weight."""
    n = hidden_states.shape[-1]
    if self.weight.dtype in (torch.float16, torch.bfloat16):
        y = rms_norm(hidden_states.to(self.weight.dtype), (n,), self.weight, self.variance_epsilon)
        return y if y.dtype == self.weight.dtype else y.to(self.weight.dtype)
    return rms_norm(hidden_states.float(), (n,), self.weight.float(), self.variance_epsilon)


#: the norm classes :func:`apply` knows, ``(module path, class name) -> (forward, what it becomes)``; each forward
#: states the class's semantics with our ``rms_norm``
NORM_CLASSES = {
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"): (_llama_forward, "rms_norm (Llama)"),
    ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"): (_llama_forward, "rms_norm (Llama)"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"): (_llama_forward, "rms_norm (Llama)"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"): (_llama_forward, "rms_norm (Llama)"),
    ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm"): (_gemma_forward, "rms_norm (Gemma, 1 + weight)"),
    ("transformers.models.t5.modeling_t5", "T5LayerNorm"): (_t5_forward, "rms_norm (T5)"),
}

_PATCHED: dict[type, type] = {}

#: the methods whose code decides what a norm class computes
_NORM_METHODS = ("forward", "_norm")


@functools.cache
def _function_code(function) -> str | None:
    """What ``function`` computes, as its syntax tree (docstring, comments, decorators and layout left out), or None
    when its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(tree, ast.FunctionDef):
        return None
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=[*body], type_ignores=[]), annotate_fields=False) + str(
        [a.arg for a in tree.args.args])


def _code(cls: type) -> tuple | None:
    """What ``cls`` computes, as the syntax trees of its :data:`_NORM_METHODS` (docstrings, comments and layout left
    out), or None when a method's source cannot be read."""
    trees = []
    for method in _NORM_METHODS:
        function = getattr(cls, method, None)
        if function is None:
            trees.append(None)
            continue
        tree = _function_code(function)
        if tree is None:
            return None
        trees.append(tree)
    return tuple(trees)


_SAME_CODE: dict[type, tuple | None] = {}


def _same_code_as_known(module: torch.nn.Module, known: dict[type, tuple]) -> tuple | None:
    """The structural rule: ``(forward, what, known class)`` when ``module`` is a leaf whose only parameter is a 1-D
    ``weight``, with no buffers, and its class's forward (and ``_norm``) is the same code as a class of the table's
    (transformers copies its norms from model to model: 131 classes of transformers 5.17 compute Llama's forward
    line for line); else None."""
    cls = type(module)
    if cls not in _SAME_CODE:
        code = _code(cls)
        _SAME_CODE[cls] = None
        if code is not None:
            for known_cls, (forward, what) in known.items():
                if _code(known_cls) == code:
                    _SAME_CODE[cls] = (forward, what, known_cls)
                    break
    match = _SAME_CODE[cls]
    if match is None or next(module.children(), None) is not None or next(module.buffers(recurse=False), None) \
            is not None:
        return None
    parameters = dict(module.named_parameters(recurse=False))
    if list(parameters) != ["weight"] or parameters["weight"].dim() != 1:
        return None
    return match


def _norm_classes() -> dict[type, tuple]:
    """The classes of :data:`NORM_CLASSES` this transformers has, by class."""
    return {cls: entry for key, entry in NORM_CLASSES.items() if (cls := _class_of(key)) is not None}


def _patched(cls: type, forward) -> type:
    """A subclass of ``cls`` with the same name whose ``forward`` is ``forward``."""
    if cls not in _PATCHED:
        _PATCHED[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                    "__qualname__": cls.__qualname__, "_fused_kernels_base": cls})
    return _PATCHED[cls]


# --- activations --------------------------------------------------------------------------------------------

def _gelu_tanh_forward(self, input: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, in one kernel forward
    and one backward (computed in fp32 inside, rounded once)."""
    return torch.nn.functional.gelu(input, approximate="tanh")


#: the activation classes :func:`apply` computes in one kernel, ``(module path, class name)``: each states the tanh
#: approximation of GELU as a chain of eager ops (GPT-2's ``gelu_new`` is eight kernels forward, each a pass over the
#: MLP's widest tensor, and keeps their intermediates for the backward)
GELU_TANH_CLASSES = (
    ("transformers.activations", "NewGELUActivation"),
    ("transformers.activations", "FastGELUActivation"),
    ("transformers.activations", "AccurateGELUActivation"),
)


def _swap_activations(model: torch.nn.Module, report: dict[str, str]) -> None:
    classes = {cls for key in GELU_TANH_CLASSES if (cls := _class_of(key)) is not None}
    for name, module in model.named_modules():
        base = getattr(type(module), "_fused_kernels_base", type(module))
        if base in classes:
            module.__class__ = _patched(base, _gelu_tanh_forward)
            report[name] = f"{base.__name__} -> torch.nn.functional.gelu(approximate='tanh'), one kernel"


def apply(model: torch.nn.Module, *, attention: bool = True, norms: bool = True,
          padding_free: bool = True, activations: bool = True) -> dict[str, str]:
    """Make a built transformers ``model`` compute with fused-kernels, in place: its attention implementation
    becomes ``"fused_kernels"`` (``model.set_attn_implementation``) and every norm module of a known class computes
    with our kernels, GPT-2 blocks fusing their residual steps with the norms (see the module docstring). With
    ``attention`` and ``padding_free``, a causal-LM or masked-LM model's forward runs a padded batch without its pad
    tokens (:class:`_PaddingFreeForward`). With ``activations``, a tanh-approximated GELU written as a chain of
    eager ops (:data:`GELU_TANH_CLASSES`, GPT-2's ``gelu_new``) computes with torch's one-kernel
    ``gelu(approximate="tanh")``, the same function. Returns ``{module name: what it became}``; norm-like modules of
    classes it does not know (an RMSNorm of a model family not in :data:`NORM_CLASSES`) are listed as ``"left alone:
    <class>"``. Calling it again changes nothing."""
    report: dict[str, str] = {}
    if activations:
        _swap_activations(model, report)
    if attention:
        model.set_attn_implementation(NAME)
        report[""] = f"attention: {NAME}"
        if padding_free and _padding_free(model):
            report[""] += ", padding-free forward"
        _patch_rotary(model, report)
    if not norms:
        return report
    known = _norm_classes()
    for name, module in model.named_modules():
        cls = type(module)
        base = getattr(cls, "_fused_kernels_base", cls)
        if base in known:
            forward, what = known[base]
            module.__class__ = _patched(base, forward)
            report[name] = what
        elif (match := _same_code_as_known(module, known)) is not None:
            forward, what, like = match
            module.__class__ = _patched(base, forward)
            report[name] = f"{what}, the code of {like.__name__}"
        elif "norm" in cls.__name__.lower() and not isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            report[name] = f"left alone: {cls.__module__}.{cls.__name__}"
    for name, cls in replace_modules(model, dropout=False).items():
        report[name] = f"{cls.__name__} -> kernels.layernorm.{cls.__name__}"
    _fuse_gpt2_blocks(model, report)
    return report
