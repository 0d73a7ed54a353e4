"""Embedded reference models and deterministic synthetic tasks.

Two small models every notebook and benchmark uses by default:

* ``Encoder``: a BERT-style encoder for masked-token prediction. Attention is
  written out by hand (separate ``query``/``key``/``value`` Linear layers,
  ``softmax(q @ k^T * scale + mask) -> dropout -> @ v``) and the MLP is
  ``Linear -> GELU -> Dropout -> Linear``, so the fusion analysis has the
  patterns real checkpoints have. ``EncoderConfig.bert_base()`` gives BERT-base shapes.
* ``ResNet``: a ResNet-style CNN whose stem is ``Conv2d -> BatchNorm2d -> ReLU -> MaxPool2d``
  followed by basic blocks.

The tasks are synthetic but learnable, so a falling loss means the model learned
something: a batch depends only on ``(seed, step)``, never on global RNG state.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab._checks import check_positive, check_range, check_tensor

__all__ = [
    "EncoderConfig",
    "Encoder",
    "EncoderLayer",
    "SelfAttention",
    "MLP",
    "ResNetConfig",
    "ResNet",
    "BasicBlock",
    "MaskedTokenTask",
    "ImageTask",
]


# --------------------------------------------------------------------------- encoder
@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 512
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    intermediate: int = 512
    max_len: int = 128
    dropout: float = 0.1
    attn_dropout: float = 0.1
    layer_norm_eps: float = 1e-12

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "layers", "heads", "intermediate", "max_len"):
            check_positive(name, getattr(self, name), integer=True)
        check_range("dropout", self.dropout, 0.0, 1.0)
        check_range("attn_dropout", self.attn_dropout, 0.0, 1.0)
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    @classmethod
    def bert_base(cls, **overrides) -> EncoderConfig:
        """BERT-base shapes: 12 layers, 768 hidden, 12 heads, 3072 intermediate."""
        base = cls(vocab_size=30522, hidden=768, layers=12, heads=12, intermediate=3072, max_len=512)
        return replace(base, **overrides)

    @classmethod
    def tiny(cls, **overrides) -> EncoderConfig:
        """A size that trains in seconds on a laptop CPU (the CI default)."""
        base = cls(vocab_size=128, hidden=64, layers=2, heads=4, intermediate=256, max_len=64)
        return replace(base, **overrides)


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections, core written by hand."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_dropout = nn.Dropout(cfg.attn_dropout)
        self.output = nn.Linear(cfg.hidden, cfg.hidden)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self._split(self.query(x))
        k = self._split(self.key(x))
        v = self._split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        if mask is not None:
            scores = scores + mask
        probs = self.attn_dropout(torch.softmax(scores, dim=-1))
        ctx = torch.matmul(probs, v).transpose(1, 2).flatten(2)
        return self.output(ctx)


class MLP(nn.Module):
    """Linear -> GELU -> Dropout -> Linear, as in BERT's intermediate/output blocks."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.intermediate)
        self.act = nn.GELU()
        self.dropout = nn.Dropout(cfg.dropout)
        self.fc2 = nn.Linear(cfg.intermediate, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(self.act(self.fc1(x))))


class EncoderLayer(nn.Module):
    """Post-LayerNorm transformer layer (BERT layout)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.attention = SelfAttention(cfg)
        self.attn_out_dropout = nn.Dropout(cfg.dropout)
        self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)
        self.mlp_out_dropout = nn.Dropout(cfg.dropout)
        self.mlp_norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attn_norm(x + self.attn_out_dropout(self.attention(x, mask)))
        return self.mlp_norm(x + self.mlp_out_dropout(self.mlp(x)))


class Encoder(nn.Module):
    """BERT-style encoder with a masked-token head: ``input_ids (B, T) -> logits (B, T, vocab)``."""

    def __init__(self, cfg: EncoderConfig | None = None, **overrides):
        super().__init__()
        cfg = replace(cfg or EncoderConfig(), **overrides)
        self.config = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position_embedding = nn.Embedding(cfg.max_len, cfg.hidden)
        self.embedding_norm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.embedding_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # BERT's initialiser: N(0, 0.02) weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                target_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)``; with ``target_mask`` (bool ``(B, T)``) only the selected positions'
        logits ``(N, vocab)``, in row-major order: BERT's pretraining gathers the masked positions before
        the vocabulary head, so the ``B x T x vocab`` logits are neither computed nor saved."""
        check_tensor("input_ids", input_ids, dtypes=(torch.int64, torch.int32), dim=2)
        if target_mask is not None:
            check_tensor("target_mask", target_mask, dtypes=(torch.bool,), dim=2)
            if target_mask.shape != input_ids.shape:
                raise ValueError(f"target_mask has shape {tuple(target_mask.shape)}, input_ids "
                                 f"{tuple(input_ids.shape)}; they must match")
        b, t = input_ids.shape
        if t > self.config.max_len:
            raise ValueError(f"input_ids has sequence length {t}, more than max_len={self.config.max_len}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(pos)
        x = self.embedding_dropout(self.embedding_norm(x))
        mask = None
        if attention_mask is not None:
            # (B, T) of 1 = keep, 0 = pad  ->  additive (B, 1, 1, T) mask
            mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, mask)
        if target_mask is not None:
            x = x[target_mask]
        return self.head(x)


# --------------------------------------------------------------------------- CNN
@dataclass(frozen=True)
class ResNetConfig:
    in_channels: int = 3
    width: int = 16
    blocks: tuple[int, ...] = (1, 1)
    num_classes: int = 10

    @classmethod
    def resnet18_stem(cls, **overrides) -> ResNetConfig:
        """ResNet-18 widths (64 stem channels, four stages of two blocks)."""
        return replace(cls(width=64, blocks=(2, 2, 2, 2), num_classes=1000), **overrides)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """ResNet-style CNN: Conv-BN-ReLU-MaxPool stem, basic blocks, global pool, classifier."""

    def __init__(self, cfg: ResNetConfig | None = None, **overrides):
        super().__init__()
        cfg = replace(cfg or ResNetConfig(), **overrides)
        self.config = cfg
        w = cfg.width
        self.conv1 = nn.Conv2d(cfg.in_channels, w, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, cin = [], w
        for i, n in enumerate(cfg.blocks):
            cout = w * 2**i
            stages.append(nn.Sequential(*(BasicBlock(cin if j == 0 else cout, cout, 2 if (i and j == 0) else 1)
                                          for j in range(n))))
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, min_dim=4)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.fc(self.pool(self.stages(x)).flatten(1))


# --------------------------------------------------------------------------- tasks
def _generator(seed: int, step: int) -> torch.Generator:
    # One generator per (seed, step): a batch never depends on what ran before it.
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step) % (2**63 - 1))
    return g


def _is_fsdp_unit(module: nn.Module) -> bool:
    return "FullyShard" in type(module).__name__ or type(module).__name__.startswith("FSDP")


def _fusable_head(model: nn.Module) -> nn.Linear | None:
    """The Encoder's ``head`` Linear when the fused head + loss can run it, else None (plain path).

    Under FSDP2 the head qualifies when it belongs to the root's parameter group (no sharded unit of its
    own below the root): the root keeps its parameters unsharded from its forward to its backward, so
    the loss can read ``head.weight`` after the forward and its gradient is reduce-scattered with the
    root's. DDP and FSDP then compute the same loss, bit for bit (strict world-size identity needs it).
    """
    inner = getattr(model, "module", model)  # DistributedDataParallel keeps the model at .module
    head = getattr(inner, "head", None)
    if not isinstance(head, nn.Linear):
        return None
    if _is_fsdp_unit(head):  # a child of the root: only a unit of its own would reshard it after the forward
        return None
    return head


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"  # torch.distributed.tensor, without importing it here


@contextmanager
def _head_input(head: nn.Linear) -> Iterator[list[torch.Tensor]]:
    """Capture the head's input and hand the head 0 rows of it, so the forward computes no logits."""
    box: list[torch.Tensor] = []

    def keep_input(_module, args):
        box.append(args[0])
        return (args[0][:0], *args[1:])

    handle = head.register_forward_pre_hook(keep_input)
    try:
        yield box
    finally:
        handle.remove()


@dataclass
class MaskedTokenTask:
    """Masked-token prediction on arithmetic token sequences.

    Each sequence is ``t_i = (start + stride * i) mod vocab`` with a random start and a
    stride from ``strides``; 15% of positions are replaced by the mask token and must be
    recovered from their neighbours. Chance-level loss is ``log(vocab)``; a model that
    learned the rule reaches near zero.

    ``fused_head`` (default True): ``loss`` runs the vocabulary head and the cross-entropy as one
    ``ops.linear_cross_entropy`` (the masked rows' logits are never held); False, or a model whose
    ``head`` is not an ``nn.Linear`` (or is sharded by an FSDP unit below the root), takes the plain
    ``head -> F.cross_entropy`` path.
    Both give the same loss and gradients within fp32 tolerance.
    """

    vocab_size: int = 128
    seq_len: int = 32
    batch_size: int = 8
    seed: int = 0
    mask_prob: float = 0.15
    strides: tuple[int, ...] = (1, 2, 3, 5)
    fused_head: bool = True

    def __post_init__(self):
        if not isinstance(self.fused_head, bool):
            raise TypeError(f"fused_head must be bool, got {type(self.fused_head).__name__}")
        check_positive("vocab_size", self.vocab_size, integer=True)
        check_positive("seq_len", self.seq_len, integer=True)
        check_positive("batch_size", self.batch_size, allow_zero=True, integer=True)
        check_range("mask_prob", self.mask_prob, 0.0, 1.0, low_inclusive=False)
        if self.vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3 (one id is reserved for the mask), got {self.vocab_size}")

    @property
    def mask_id(self) -> int:
        return self.vocab_size - 1

    def batch(self, step: int, batch_size: int | None = None) -> dict[str, torch.Tensor]:
        """The batch for ``step``: ``{"input_ids", "labels"}``, labels -100 where not masked."""
        n = self.batch_size if batch_size is None else batch_size
        g = _generator(self.seed, step)
        vocab = self.vocab_size - 1  # ids 0..vocab-2 are tokens
        start = torch.randint(0, vocab, (n, 1), generator=g)
        strides = torch.tensor(self.strides)[torch.randint(0, len(self.strides), (n, 1), generator=g)]
        tokens = (start + strides * torch.arange(self.seq_len)) % vocab
        masked = torch.rand(n, self.seq_len, generator=g) < self.mask_prob
        masked[:, 0] |= ~masked.any(dim=1)  # at least one target per row keeps the loss defined
        input_ids = torch.where(masked, torch.full_like(tokens, self.mask_id), tokens)
        labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
        return {"input_ids": input_ids, "labels": labels}

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The model's positional inputs for ``batch`` (what fusion analysis runs the model on)."""
        return (batch["input_ids"],)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy over the masked positions only (the head runs on those rows alone)."""
        labels = batch["labels"]
        targets = labels != -100
        head = _fusable_head(model) if self.fused_head else None
        if head is None:
            logits = model(batch["input_ids"], target_mask=targets)
            return F.cross_entropy(logits.float(), labels[targets])
        from opsnn_lab.ops.fused_linear_cross_entropy import linear_cross_entropy

        with _head_input(head) as hidden:
            model(batch["input_ids"], target_mask=targets)
        if _is_dtensor(head.weight):  # a root that resharded after its forward: no weight to read, run plainly
            logits = model(batch["input_ids"], target_mask=targets)
            return F.cross_entropy(logits.float(), labels[targets])
        return linear_cross_entropy(hidden[0], head.weight, labels[targets], head.bias)

    def model(self, cfg: EncoderConfig | None = None, **overrides) -> Encoder:
        """An ``Encoder`` sized for this task (vocabulary and length filled in)."""
        cfg = replace(cfg or EncoderConfig.tiny(), vocab_size=self.vocab_size,
                      max_len=max(self.seq_len, (cfg or EncoderConfig.tiny()).max_len))
        return Encoder(cfg, **overrides)


@dataclass
class ImageTask:
    """Classify which of ``num_classes`` oriented gratings is hidden under noise."""

    num_classes: int = 10
    image_size: int = 32
    channels: int = 3
    batch_size: int = 16
    seed: int = 0
    noise: float = 0.5

    def __post_init__(self):
        check_positive("num_classes", self.num_classes, integer=True)
        check_positive("image_size", self.image_size, integer=True)
        check_positive("channels", self.channels, integer=True)
        check_positive("batch_size", self.batch_size, allow_zero=True, integer=True)
        check_positive("noise", self.noise, allow_zero=True)

    def batch(self, step: int, batch_size: int | None = None) -> dict[str, torch.Tensor]:
        n = self.batch_size if batch_size is None else batch_size
        g = _generator(self.seed, step)
        labels = torch.randint(0, self.num_classes, (n,), generator=g)
        coords = torch.linspace(-math.pi, math.pi, self.image_size)
        yy, xx = torch.meshgrid(coords, coords, indexing="ij")
        angle = labels.float()[:, None, None] * (math.pi / self.num_classes)
        freq = 2.0 + (labels % 3).float()[:, None, None]
        grating = torch.sin(freq * (xx * torch.cos(angle) + yy * torch.sin(angle)))
        images = grating[:, None].expand(n, self.channels, -1, -1)
        images = images + self.noise * torch.randn(n, self.channels, self.image_size, self.image_size, generator=g)
        return {"images": images.contiguous(), "labels": labels}

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (batch["images"],)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch["images"]).float(), batch["labels"])

    def model(self, cfg: ResNetConfig | None = None, **overrides) -> ResNet:
        cfg = replace(cfg or ResNetConfig(), in_channels=self.channels, num_classes=self.num_classes)
        return ResNet(cfg, **overrides)
