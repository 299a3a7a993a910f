"""Pure-PyTorch twin of the LayerNorm/RMSNorm kernels (not written yet: the LayerNorm family, issue 4)."""

_MESSAGE = "reference.layernorm.{} is not implemented yet (the LayerNorm family, issue 4)"


def layer_norm(*args, **kwargs):
    raise NotImplementedError(_MESSAGE.format("layer_norm"))


def rms_norm(*args, **kwargs):
    raise NotImplementedError(_MESSAGE.format("rms_norm"))


def layer_norm_backward(*args, **kwargs):
    raise NotImplementedError(_MESSAGE.format("layer_norm_backward"))


def rms_norm_backward(*args, **kwargs):
    raise NotImplementedError(_MESSAGE.format("rms_norm_backward"))
