"""Small byte-level language models: a transformer, as a GPT (causal LM) or a BERT-style
masked LM, a causal convolutional LM (``cnn``) and a recurrent one (``rnn``, an LSTM): other
architectures to check convergence on.

Written after nanoGPT: pre-LayerNorm blocks, fused attention, GELU MLP, token embedding tied to
the output head, and biases in the linear layers and LayerNorms unless ``bias=False`` (as
nanoGPT; the key bias then gets no gradient at all, since softmax ignores it). Bytes are
tokens (vocabulary 256, plus a ``[MASK]`` token for BERT), so any text trains without a
tokenizer. There is no dropout: a run is a deterministic function of its seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MASK_TOKEN = 256
"""The BERT model's ``[MASK]`` token, one past the last byte."""


@dataclass
class ModelConfig:
    """Shape of the model. ``kind`` is ``"gpt"`` (causal), ``"bert"`` (bidirectional, masked),
    ``"cnn"`` (causal, convolutional) or ``"rnn"`` (an LSTM); the last two do not use
    ``n_head``."""

    kind: str = "gpt"
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = True

    @property
    def vocab_size(self) -> int:
        return 257 if self.kind == "bert" else 256


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.causal = config.kind == "gpt"
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final LayerNorm and a tied head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits for every position, and the mean cross-entropy over targets that are not -100.

        For a GPT the targets are the inputs shifted by one; for a BERT they are the original
        bytes at masked positions and -100 elsewhere.
        """
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return logits, loss

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices only, not on biases, LayerNorms or position embeddings."""
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and n != "wpe.weight"]
        rest = [p for n, p in self.named_parameters() if p.dim() < 2 or n == "wpe.weight"]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ]


class ConvBlock(nn.Module):
    """A pre-LayerNorm residual block: a causal convolution of kernel 3 and dilation
    ``dilation`` widening to ``2·n_embd`` channels, GELU, and a pointwise one back."""

    def __init__(self, config: ModelConfig, dilation: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.pad = 2 * dilation
        self.conv = nn.Conv1d(
            config.n_embd, 2 * config.n_embd, 3, dilation=dilation, bias=config.bias
        )
        self.proj = nn.Conv1d(2 * config.n_embd, config.n_embd, 1, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        h = F.pad(self.ln(x).transpose(1, 2), (self.pad, 0))
        return x + self.proj(F.gelu(self.conv(h))).transpose(1, 2)


class ConvNet(nn.Module):
    """A causal byte-level convolutional LM, after WaveNet: an embedding, ``n_layer`` blocks
    with dilations 1, 2, 4, ... (a receptive field of ``2^(n_layer+1) - 1`` bytes), a final
    LayerNorm and an untied head. No attention and no position embedding: its parameters are
    3-D convolution kernels and matrices of other shapes than the transformer's."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(ConvBlock(config, 2**i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        nn.init.normal_(self.wte.weight, std=0.02)
        for block in self.blocks:
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits for every position, and the mean cross-entropy of the next byte."""
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices and kernels only, not on biases or LayerNorms."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ]


class RecurrentNet(nn.Module):
    """A byte-level LSTM LM: an embedding, an ``n_layer``-layer LSTM of width ``n_embd``, a final
    LayerNorm and an untied head. Its recurrent matrices (the four gates of each layer stacked,
    ``4·n_embd x n_embd``) and its pairs of gate biases are shapes neither other model has, and
    its gradients flow through time rather than through depth."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.lstm = nn.LSTM(
            config.n_embd, config.n_embd, config.n_layer, bias=config.bias, batch_first=True
        )
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits for every position, and the mean cross-entropy of the next byte."""
        x, _ = self.lstm(self.wte(idx))
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices only, not on biases or LayerNorms."""
        return ConvNet.param_groups(self, weight_decay)


MODELS = ("gpt", "bert", "cnn", "rnn")
"""The models ``onebit train --model`` builds."""


def build_model(config: ModelConfig) -> nn.Module:
    """The model ``config.kind`` names: a :class:`Transformer`, a :class:`ConvNet` or a
    :class:`RecurrentNet`."""
    if config.kind == "cnn":
        return ConvNet(config)
    return RecurrentNet(config) if config.kind == "rnn" else Transformer(config)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
