"""Pure-PyTorch twin of the attention kernels (not written yet: the attention family, issue 5)."""

_MESSAGE = "reference.attention.{} is not implemented yet (the attention family, issue 5)"


def attention(*args, **kwargs):
    raise NotImplementedError(_MESSAGE.format("attention"))


def flash_attention_forward(*args, **kwargs):
    raise NotImplementedError(_MESSAGE.format("flash_attention_forward"))


def flash_attention_backward(*args, **kwargs):
    raise NotImplementedError(_MESSAGE.format("flash_attention_backward"))
