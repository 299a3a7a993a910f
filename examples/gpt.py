"""A small GPT-style decoder, trained on this repository's own text, with fused-kernels or torch's ops.

The model is plain torch (token and position embeddings, pre-norm blocks of causal self-attention and an
MLP, a tied output head). ``backend`` picks the ops:

- ``"torch"``: ``nn.LayerNorm``, ``nn.Dropout`` and ``F.scaled_dot_product_attention``;
- ``"fused"``: the same model after ``kernels.replace_modules`` (our LayerNorm and Dropout, weights kept),
  with attention through ``kernels.attention.flash_attention`` (attention dropout included), and each
  residual step (dropout of a branch's output, the add, the next norm) through
  ``kernels.layernorm.add_dropout_norm``, one kernel forward and one backward, whose output comes in the
  autocast dtype that the next matmul takes (torch's norm gives fp32 and the matmul casts it: same values).

Both backends build the same parameters in the same order, so one ``torch.manual_seed`` gives one init.

    python examples/gpt.py                       # both backends, 200 steps each, then their step times
    python examples/gpt.py --backend fused --steps 500 --compile
    python examples/gpt.py --help

On several GPUs, under ``torchrun``: ``--parallel ddp`` (DistributedDataParallel) or ``--parallel fsdp`` (FSDP2,
``fully_shard`` per block, then the whole model) split each batch's rows over the ranks; ``--context-parallel``
splits each sequence over them instead (zigzag shards, attention by
``kernels.attention.context_parallel_attention``, the gradients averaged over the ranks by DDP, FSDP or, with
neither, one all-reduce per parameter). Every rank starts from the same weights and draws the same batches, so the
losses are the one-GPU run's (reported as the mean over the ranks):

    torchrun --nproc-per-node 2 examples/gpt.py --backend fused --parallel fsdp
    torchrun --nproc-per-node 2 examples/gpt.py --backend fused --context-parallel --seq 16384 --batch 1 --dropout 0

Without a GPU it runs on the CPU (our kernels through the Triton interpreter when ``TRITON_INTERPRET=1``;
small ``--layers/--d-model/--seq`` then).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the repository's packages import
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from kernels.attention import context_parallel_attention, flash_attention, shard_sequence  # noqa: E402
from kernels.layernorm import add_dropout_norm  # noqa: E402

BACKENDS = ("torch", "fused")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 8
    d_model: int = 512
    dropout: float = 0.1
    backend: str = "fused"
    #: attention over a sequence sharded across the ranks of the default process group (ring attention)
    context_parallel: bool = False


def fused_attention(q, k, v, p: float) -> torch.Tensor:
    """Causal self-attention on (B, H, S, D) with attention dropout ``p``: ours."""
    return flash_attention(q, k, v, causal=True, dropout_p=p)


def torch_attention(q, k, v, p: float) -> torch.Tensor:
    """The same through torch's SDPA."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)


def context_parallel_causal_attention(q, k, v, p: float) -> torch.Tensor:
    """Causal self-attention on this rank's zigzag shard of the sequence: ours, by ring attention (no attention
    dropout: the model refuses a context-parallel config with dropout)."""
    return context_parallel_attention(q, k, v, causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.attention_dropout = config.dropout
        self.residual_dropout = nn.Dropout(config.dropout)
        self.attend = fused_attention if config.backend == "fused" else torch_attention
        if config.context_parallel:
            self.attend = context_parallel_causal_attention

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """The attention branch before its residual dropout."""
        batch, seq, width = x.shape
        # (B, S, 3, H, Dh) -> three (B, H, S, Dh) views: both backends take the strided views as they are
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        y = self.attend(q, k, v, self.attention_dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual_dropout(self.branch(x))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attention = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * config.d_model, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP branch before its residual dropout (the last module of ``mlp``). Not ``self.mlp[:-1](x)``: a
        sliced ``nn.Sequential`` is a new module built on every call (~14 us of host time on a CPU)."""
        for layer in itertools.islice(self.mlp, len(self.mlp) - 1):
            x = layer(x)
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {config.backend!r}")
        if config.context_parallel and (config.backend != "fused" or config.dropout):
            raise ValueError("context parallelism runs our ring attention, which has no attention dropout: it needs "
                             f"backend 'fused' and dropout 0, got {config.backend!r} and {config.dropout}")
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))
        if config.backend == "fused":
            kernels.replace_modules(self)
        #: each residual step and the next norm in one kernel (fused backend); False runs the blocks' own forward
        #: (our modules still), as FSDP needs: it gathers a block's parameters when that block's forward runs
        self.fuse_residual_stream = config.backend == "fused"

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """Logits (B, S, vocab); with ``targets``, ``(logits, mean cross-entropy)``. ``positions``: the tokens'
        positions in their sequence (default ``0 .. S - 1``; a context-parallel shard's are its chunks')."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        embedded = self.token_embedding(tokens) + self.position_embedding(positions)
        if self.fuse_residual_stream:
            normed = self._fused_residual_stream(embedded)
        else:
            x = self.embedding_dropout(embedded)
            for block in self.blocks:
                x = block(x)
            normed = self.final_norm(x)
        logits = normed @ self.token_embedding.weight.t()  # tied head
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


    def _fused_residual_stream(self, embedded: torch.Tensor) -> torch.Tensor:
        """The blocks of ``forward`` with every residual step fused: ``x = x + dropout(branch)`` and the norm
        that reads ``x`` next are one ``add_dropout_norm`` call, with the same modules' parameters, ``p`` and
        training flag. Returns the final norm's output."""
        norms = [block.norm1 for block in self.blocks] + [self.final_norm]
        # Every norm output feeds a matmul (the next projection, or the tied head), which autocast runs in its low
        # precision: the norm writes that dtype itself, the values torch's fp32 norm output takes when the matmul
        # casts it, without the fp32 tensor and the cast kernel (and its gradient comes back in that dtype).
        device_type = embedded.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        normed, x = _residual_step(embedded, None, norms[0], self.embedding_dropout, out_dtype)
        for i, block in enumerate(self.blocks):
            normed, x = _residual_step(block.attention.branch(normed), x, block.norm2, block.attention.residual_dropout,
                                       out_dtype)
            normed, x = _residual_step(block.mlp_branch(normed), x, norms[i + 1], block.mlp[-1], out_dtype)
        return normed


def _residual_step(branch: torch.Tensor, residual: torch.Tensor | None, norm: nn.LayerNorm, dropout: nn.Dropout,
                   out_dtype: torch.dtype | None):
    """``(norm(x), x)`` for ``x = dropout(branch) + residual``, one fused kernel each way, the norm's output in
    ``out_dtype``."""
    return add_dropout_norm(branch, residual, norm.weight, norm.bias, eps=norm.eps, dropout_p=dropout.p,
                            training=dropout.training, out_dtype=out_dtype)


def load_corpus(device) -> torch.Tensor:
    """This repository's Markdown and Python files as one byte tensor (sorted, so every run reads the same)."""
    return torch.frombuffer(bytearray(_corpus_bytes()), dtype=torch.uint8).to(device=device, dtype=torch.long)


@functools.cache
def _corpus_bytes() -> bytes:
    # read once per process: runs compared side by side (the two backends of a test or a benchmark) then train on
    # the same data even when a file of the repository is edited between them
    paths = sorted(p for pattern in ("*.md", "*.py") for p in ROOT.glob(f"**/{pattern}")
                   if not any(part.startswith(".") or part == "results" for part in p.relative_to(ROOT).parts))
    return b"\n".join(p.read_bytes() for p in paths)


def batches(corpus: torch.Tensor, batch: int, seq_len: int, steps: int, seed: int = 0):
    """``steps`` (tokens, targets) pairs of random windows of the corpus, the same for a given ``seed``."""
    g = torch.Generator().manual_seed(seed)
    # drawn on the host and copied to the device in one go: a copy from pageable host memory waits for the GPU, so
    # one per step would stop the host from running ahead of the GPU
    starts = torch.stack([torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=g)
                          for _ in range(steps)]).to(corpus.device)
    offsets = torch.arange(seq_len + 1, device=corpus.device)
    for step_starts in starts:
        chunk = corpus[step_starts[:, None] + offsets]
        yield chunk[:, :-1], chunk[:, 1:]


@dataclasses.dataclass
class TrainResult:
    losses: list[float]
    step_seconds: list[float]

    def median_step_ms(self, warmup: int) -> float:
        """Median step time, leaving out the first ``warmup`` steps (compilation, autotuning, caches)."""
        timed = self.step_seconds[warmup:] or self.step_seconds
        return 1e3 * statistics.median(timed)


def _progress(label: str, step: int, steps: int, loss: float, seconds: float, width: int = 30) -> None:
    done = width * step // steps
    bar = "#" * done + "." * (width - done)
    end = "\n" if step == steps else ""
    print(f"\r{label:>6} [{bar}] {step:>5}/{steps} loss {loss:7.4f} {1e3 * seconds:8.2f} ms/step", end=end,
          file=sys.stderr, flush=True)


def train(config: GPTConfig, *, steps: int, batch: int, device, init_seed: int = 0, data_seed: int = 0,
          lr: float = 1e-3, autocast_dtype: torch.dtype | None = torch.bfloat16, compile_model: bool = False,
          progress: bool = False, pipelined: bool = False, parallel: str | None = None) -> TrainResult:
    """Train a fresh model for ``steps`` AdamW steps; return each step's loss and time.

    ``init_seed`` fixes the initial weights and the dropout masks' generator, ``data_seed`` the batches, so
    two backends given the same seeds start from the same weights and see the same data. A step's time
    covers forward, backward and the optimiser step.

    By default each step starts and ends with an idle GPU (synchronised on both sides, timed on the host) and its
    loss is read at once: the step's latency. ``pipelined=True`` runs the loop as a trainer that reads its losses
    later does: nothing waits for the GPU until the last step, so the host queues the next step's kernels while the
    GPU runs this one's, and a step's time is the GPU-side interval between CUDA events recorded at the start of
    successive steps (the GPU's pace when the host keeps ahead, the host's when it does not). On a CPU both time
    the host.

    Over the ranks of an initialised default process group (``device`` being this rank's): ``parallel`` "ddp" or
    "fsdp" wraps the model so (see the module docstring); without ``config.context_parallel`` each rank trains on
    its rows of every batch (``batch`` is the global batch, a multiple of the ranks), with it on its shard of every
    sequence. The losses returned are the means over the ranks: the global batch's.
    """
    device = torch.device(device)
    distributed = parallel is not None or config.context_parallel
    world = torch.distributed.get_world_size() if distributed else 1
    rank = torch.distributed.get_rank() if distributed else 0
    if parallel not in (None, *PARALLEL_MODES):
        raise ValueError(f"parallel must be one of {PARALLEL_MODES} or None, got {parallel!r}")
    if not config.context_parallel and batch % world:
        raise ValueError(f"a batch of {batch} rows does not split over {world} ranks")
    if config.context_parallel and compile_model:
        raise ValueError("context parallelism runs eager: ring attention's point-to-point transfers do not compile")
    torch.manual_seed(init_seed)
    model = GPT(config).to(device).train()
    step_fn = _parallel_model(model, parallel, device) if parallel else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    step_fn = torch.compile(step_fn, fullgraph=parallel is None) if compile_model else step_fn
    average_gradients = config.context_parallel and parallel is None
    corpus = load_corpus(device)
    pipelined = pipelined and device.type == "cuda"
    losses, times, step_marks = [], [], []
    use_autocast = autocast_dtype is not None
    positions = None
    if config.context_parallel:
        positions = shard_sequence(torch.arange(config.seq_len, device=device), 0)
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    for step, (tokens, targets) in enumerate(batches(corpus, batch, config.seq_len, steps, data_seed), 1):
        if config.context_parallel:  # every rank takes every row, and its shard of each sequence
            tokens, targets = shard_sequence(tokens, 1), shard_sequence(targets, 1)
        elif distributed:
            tokens, targets = tokens[rows], targets[rows]
        if pipelined:
            step_marks.append(_record_event())
        else:
            _synchronize(device)
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=use_autocast):
            _, loss = step_fn(tokens, targets, positions)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if average_gradients:
            _average_gradients(model, world)
        optimizer.step()
        if distributed:  # the global batch's loss: the mean of the ranks' (equal shares of every batch)
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
            loss /= world
        if pipelined:
            losses.append(loss.detach())
            continue
        _synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if progress and rank == 0:
            _progress(config.backend, step, steps, losses[-1], times[-1])
    if pipelined and losses:
        step_marks.append(_record_event())
        _synchronize(device)
        times = [1e-3 * begin.elapsed_time(end) for begin, end in itertools.pairwise(step_marks)]
        losses = torch.stack(losses).float().tolist()
        if progress and rank == 0:
            for step, (loss_value, seconds) in enumerate(zip(losses, times, strict=True), 1):
                _progress(config.backend, step, steps, loss_value, seconds)
    return TrainResult(losses, times)


#: ``--parallel``: how the ranks hold the parameters and reduce the gradients
PARALLEL_MODES = ("ddp", "fsdp")


def _parallel_model(model: GPT, parallel: str, device: torch.device) -> nn.Module:
    """``model`` under DDP, or sharded by FSDP2 (each block, then the whole model: the embeddings, the final norm
    and the tied head), over the default process group."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    model.fuse_residual_stream = False  # a block's parameters are gathered for its forward only
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _average_gradients(model: nn.Module, world: int) -> None:
    """Every parameter's gradient, averaged over the ranks (context parallelism without DDP or FSDP: each rank's
    gradient is of its shard's mean loss, and the shards are equal)."""
    for p in model.parameters():
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)
            p.grad /= world


def _record_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model-size and batch flags (shared with ``scripts/profile_gpt.py``)."""
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.1)


def config_from_arguments(args: argparse.Namespace, backend: str) -> GPTConfig:
    return GPTConfig(seq_len=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                     dropout=args.dropout, backend=backend)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=(*BACKENDS, "both"), default="both")
    parser.add_argument("--steps", type=int, default=200)
    add_model_arguments(parser)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                        help="autocast dtype (fp32: no autocast)")
    parser.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median step time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipelined", action="store_true",
                        help="let the host queue the next step while the GPU runs this one (losses read at the end); "
                             "steps timed by CUDA events")
    parser.add_argument("--parallel", choices=PARALLEL_MODES, default=None,
                        help="under torchrun: DDP, or FSDP2 per block (the batch's rows split over the ranks)")
    parser.add_argument("--context-parallel", action="store_true",
                        help="under torchrun: each sequence split over the ranks, ring attention (fused backend, "
                             "--dropout 0)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    distributed = args.parallel is not None or args.context_parallel
    if distributed:
        device = _init_distributed(device)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.dtype]
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lead = not distributed or torch.distributed.get_rank() == 0
    ranks = f" x {torch.distributed.get_world_size()} ranks ({_parallel_label(args)})" if distributed else ""
    if lead:
        print(f"GPT {args.layers} layers x d_model {args.d_model} x {args.heads} heads, seq {args.seq}, "
              f"batch {args.batch}, dropout {args.dropout}, {args.dtype}{' compiled' if args.compile else ''}, "
              f"{args.steps} steps on {name}{ranks}", file=sys.stderr)
    results = {}
    for backend in backends:
        config = dataclasses.replace(config_from_arguments(args, backend), context_parallel=args.context_parallel)
        results[backend] = train(config, steps=args.steps, batch=args.batch,
                                 device=device, init_seed=args.seed,
                                 data_seed=args.seed, lr=args.lr, autocast_dtype=autocast_dtype,
                                 compile_model=args.compile, progress=True, pipelined=args.pipelined,
                                 parallel=args.parallel)
    if distributed:
        torch.distributed.destroy_process_group()
    if not lead:
        return
    print(f"{'backend':>8} {'median ms/step':>15} {'tokens/s':>12} {'first loss':>11} {'last loss':>10}")
    for backend, result in results.items():
        ms = result.median_step_ms(args.warmup)
        tokens_per_s = args.batch * args.seq / (ms / 1e3)
        print(f"{backend:>8} {ms:15.2f} {tokens_per_s:12.0f} {result.losses[0]:11.4f} {result.losses[-1]:10.4f}")
    if len(results) == 2:
        ratio = results["torch"].median_step_ms(args.warmup) / results["fused"].median_step_ms(args.warmup)
        print(f"fused step time is {ratio:.3f}x faster than torch's")


def _parallel_label(args: argparse.Namespace) -> str:
    return " + ".join(label for label, on in ((args.parallel, args.parallel), ("context parallel",
                                                                              args.context_parallel)) if on)


def _init_distributed(device: str) -> torch.device:
    """The default process group from torchrun's environment (NCCL with a GPU per rank, else gloo); this rank's
    device."""
    import os

    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("--parallel and --context-parallel run under torchrun: torchrun --nproc-per-node N "
                         "examples/gpt.py ...")
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    torch.distributed.init_process_group("gloo")
    return torch.device("cpu")


if __name__ == "__main__":
    main()
