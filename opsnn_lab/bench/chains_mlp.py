"""MLP-family rows of ``python -m opsnn_lab.bench ops``: gated MLPs (SwiGLU, GeGLU) and Linear -> act -> Linear.

Rows (names follow the fusion pattern names):

* ``gated_mlp_silu``: Llama's MLP, ``down(silu(gate(x)) * up(x))``, Llama-7B widths scaled to the CPU
  (hidden 1024, intermediate 2816; the 7B model has 4096 / 11008, the same 2.69 ratio), no bias.
* ``gated_mlp_gelu``: T5 v1.1's gated-gelu (``gelu_new`` = tanh GELU, dropout before ``wo``), same widths.
* ``gated_mlp_silu[packed]``: Phi-3's MLP, one ``gate_up_proj`` Linear split by ``chunk(2, -1)``
  (``FusedGatedMLP.from_packed``), the same widths.
* ``gated_product_silu[lora]``: Llama's MLP under LoRA fine-tuning: each projection a frozen Linear plus a
  rank-16 update, ``base(x) + B(A(x)) * scale``, as peft builds it; the projections are not Linears, so only
  ``act(gate) * up`` fuses (``FusedGatedProduct``). Eager saves x, the gate, act(gate), up and the product;
  fused drops act(gate): ``(H + 3I) / (H + 4I)`` = 0.77 at these widths, by construction.
* ``gated_product_silu[moe]``: a mixture-of-experts layer as transformers runs its experts by default
  (``grouped_mm``): tokens sorted by expert, one grouped GEMM for every expert's packed ``[gate | up]``,
  ``silu(gate) * up`` on the two halves of its output, one grouped GEMM down; Mixtral-8x7B's widths scaled by 1/4
  (hidden 1024, intermediate 3584, 8 experts, each token to 2). Only the product fuses, as in a fused Mixtral:
  ``(H + 3I) / (H + 4I)`` of eager's bytes by construction, read through the halves' row stride ``2I``.
* ``dropout_linear[lora_qkv]``: Llama's q, k and v projections under LoRA with ``lora_dropout=0.05`` (peft's
  usual setting), rank 16, hidden 1024: each adapter drops x with a dropout of its own, so eager keeps three
  dropped copies and three masks (a bool each on GPU, a float noise tensor on CPU); ``FusedDropoutLinear`` keeps
  x once and regenerates each mask: 1/6 of eager's bytes on CPU, 4/15 with bool masks.
* ``linear_gelu_tanh_linear[gpt2]``: GPT-2's MLP, Conv1D -> ``NewGELUActivation`` -> Conv1D, BERT-base widths.
* ``linear_quick_gelu_linear``: CLIP's MLP (QuickGELU written as in Hugging Face), BERT-base widths.
* ``linear_silu_dropout_linear``: nn.Linear -> SiLU -> Dropout -> nn.Linear, BERT-base widths.

The eager side is written as Hugging Face writes these modules (Conv1D and the activations are copied here
so that the benchmark does not import transformers); the fused side is built by ``from_modules`` on the
same modules, sharing their parameters.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

__all__ = ["CHAINS", "build_chains", "LLAMA_FULL"]

CHAINS = ("gated_mlp_silu", "gated_mlp_gelu", "gated_mlp_silu[packed]", "gated_product_silu[lora]",
          "gated_product_silu[moe]", "dropout_linear[lora_qkv]", "linear_gelu_tanh_linear[gpt2]",
          "linear_quick_gelu_linear", "linear_silu_dropout_linear")
LLAMA_FULL = dict(hidden=1024, inter=2816)  # Llama-7B's 4096 / 11008 scaled by 1/4
MIXTRAL_FULL = dict(hidden=1024, inter=3584, experts=8, top_k=2)  # Mixtral-8x7B's 4096 / 14336 scaled by 1/4
TARGETS = {"bytes_fused_vs_eager[gated_mlp_*]": 0.67, "bytes_fused_vs_compile[gated_mlp_*]": 1.0}


class Conv1D(nn.Module):
    """Hugging Face's ``transformers.pytorch_utils.Conv1D``: weight ``[in, out]``, ``y = x @ W + b``."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class NewGELUActivation(nn.Module):
    """GPT-2's ``gelu_new``, as Hugging Face writes it."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class QuickGELUActivation(nn.Module):
    """CLIP's activation, as Hugging Face writes it."""

    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class GatedMLP(nn.Module):
    """Llama's ``LlamaMLP`` / T5's ``T5DenseGatedActDense`` (dropout before the down projection)."""

    def __init__(self, hidden: int, inter: int, act: nn.Module, p: float = 0.0):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn, self.dropout = act, nn.Dropout(p)

    def forward(self, x):
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


class PackedGatedMLP(nn.Module):
    """Phi-3's ``Phi3MLP``: one ``gate_up_proj`` Linear computes ``[gate | up]``."""

    def __init__(self, hidden: int, inter: int, act: nn.Module):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.activation_fn = act

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class LowRankLinear(nn.Module):
    """peft's LoRA layer on a Linear: ``base(x) + lora_B(lora_A(lora_dropout(x))) * scaling``, the base frozen
    (``lora_dropout`` an ``nn.Identity`` at ``p = 0``, as peft builds it)."""

    def __init__(self, n_in: int, n_out: int, rank: int = 16, p: float = 0.0):
        super().__init__()
        self.base_layer = nn.Linear(n_in, n_out, bias=False).requires_grad_(False)
        self.lora_A, self.lora_B = nn.Linear(n_in, rank, bias=False), nn.Linear(rank, n_out, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)  # peft starts it at zero; a trained adapter is not
        self.lora_dropout = nn.Dropout(p) if p > 0 else nn.Identity()
        self.scaling, self.lora_in = 2.0, None  # lora_in: the fused twin's FusedDropoutLinear (see _sharing)

    def forward(self, x):
        a = self.lora_A(self.lora_dropout(x)) if self.lora_in is None else self.lora_in(x)
        return self.base_layer(x) + self.lora_B(a) * self.scaling


class AdapterQKV(nn.Module):
    """Llama's q, k and v projections under LoRA with ``lora_dropout=p``: three adapters reading one x."""

    def __init__(self, hidden: int, p: float, projections=None):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = projections or [LowRankLinear(hidden, hidden, p=p) for _ in range(3)]

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)


class AdapterGatedMLP(nn.Module):
    """``LlamaMLP`` with LoRA on its three projections; ``product`` (the fused op) in place of ``act(g) * u``."""

    def __init__(self, hidden: int, inter: int, act: nn.Module, product: nn.Module | None = None):
        super().__init__()
        self.gate_proj, self.up_proj = LowRankLinear(hidden, inter), LowRankLinear(hidden, inter)
        self.down_proj, self.act_fn, self.product = LowRankLinear(inter, hidden), act, product

    def forward(self, x):
        g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(g) * u if self.product is None else self.product(g, u))


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x`` (tokens sorted by expert) times each expert's ``weight[e].T`` over its rows (``offsets``: cumulative
    row counts): one ``torch._grouped_mm``, as transformers calls it, or a loop where torch has none or, as in
    transformers, where ``torch.compile`` has no other dtype than bf16 for it."""
    if hasattr(torch, "_grouped_mm") and not (torch.compiler.is_compiling() and x.dtype != torch.bfloat16):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    ends = offsets.tolist()
    return torch.cat([x[a:b] @ weight[e].T for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends))])


class GroupedExperts(nn.Module):
    """transformers' ``grouped_mm`` experts forward from its sorted tokens on: ``down(act(gate) * up)`` per expert,
    ``[gate | up]`` one grouped GEMM; ``product`` (the fused op) in place of ``act(gate) * up``."""

    def __init__(self, hidden: int, inter: int, experts: int, act: nn.Module, product: nn.Module | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * hidden ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) * inter ** -0.5)
        self.act_fn, self.product = act, product

    def forward(self, x, offsets):
        gate, up = _grouped(x, self.gate_up_proj, offsets).chunk(2, dim=-1)
        return _grouped(self.act_fn(gate) * up if self.product is None else self.product(gate, up), self.down_proj,
                        offsets)


def _moe(name, s, device, dtype, act):
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    hidden, inter = _gated_dims(s, MIXTRAL_FULL)
    experts, top_k = MIXTRAL_FULL["experts"], MIXTRAL_FULL["top_k"]
    eager = GroupedExperts(hidden, inter, experts, act).to(device, dtype)
    fused = _sharing(eager, product=ops.FusedGatedProduct.from_modules(act))
    rows = s["batch"] * s["tokens"] * top_k  # every token once per expert it is routed to
    g = torch.Generator().manual_seed(0)
    per_expert = torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts)
    offsets = per_expert.cumsum(0).to(device=device, dtype=torch.int32)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    return Chain(name, eager, fused, (x, offsets), note=f"hidden {hidden}, intermediate {inter}, {experts} experts, "
                 f"top {top_k}")


def _sharing(module: nn.Module, **replaced) -> nn.Module:
    """A shallow twin of ``module``: the same submodules and parameters (shared, not copied) in its own module
    dicts, with ``replaced`` set on it alone (the fused side of a row whose eager side is ``module``)."""
    twin = copy.copy(module)
    for d in ("_modules", "_parameters", "_buffers"):
        setattr(twin, d, dict(getattr(module, d)))
    for name, value in replaced.items():
        setattr(twin, name, value)
    return twin


def _gated_dims(s: dict, full: dict = LLAMA_FULL) -> tuple[int, int]:
    # full run: the model's widths scaled to the CPU (Llama-7B's by default); quick run: the CI-sized ones it was given
    return (full["hidden"], full["inter"]) if s["hidden"] >= 768 else (s["hidden"], s["inter"])


def _gated(name, s, device, dtype, act, p):
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    hidden, inter = _gated_dims(s)
    if name.endswith("[lora]"):
        eager = AdapterGatedMLP(hidden, inter, act).to(device, dtype)
        fused = _sharing(eager, product=ops.FusedGatedProduct.from_modules(act))
    elif name.endswith("[packed]"):
        eager = PackedGatedMLP(hidden, inter, act).to(device, dtype)
        fused = ops.FusedGatedMLP.from_packed(eager.gate_up_proj, eager.down_proj, act, register=False)
    else:
        eager = GatedMLP(hidden, inter, act, p).to(device, dtype)
        fused = ops.FusedGatedMLP.from_modules(eager.gate_proj, eager.up_proj, eager.down_proj, eager.act_fn,
                                               eager.dropout, register=False)
    x = torch.randn(s["batch"], s["tokens"], hidden, device=device, dtype=dtype, requires_grad=True)
    return Chain(name, eager, fused, (x,), note=f"hidden {hidden}, intermediate {inter}")


def _lora_qkv(name, s, device, dtype):
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    hidden = _gated_dims(s)[0]
    eager = AdapterQKV(hidden, 0.05).to(device, dtype)
    fused = AdapterQKV(hidden, 0.05, [
        _sharing(p, lora_in=ops.FusedDropoutLinear.from_modules(p.lora_dropout, p.lora_A, register=False))
        for p in (eager.q_proj, eager.k_proj, eager.v_proj)])
    x = torch.randn(s["batch"], s["tokens"], hidden, device=device, dtype=dtype, requires_grad=True)
    return Chain(name, eager, fused, (x,), note=f"hidden {hidden}, rank 16, lora_dropout 0.05")


def _two_layer(name, s, device, dtype, first, act, p, second):
    from opsnn_lab import ops
    from opsnn_lab.bench.ops import Chain

    drop = nn.Dropout(p)
    eager = nn.Sequential(first, act, drop, second).to(device, dtype)
    fused = ops.FusedLinearActDropoutLinear.from_modules(first, act, drop if p else None, second,
                                                         register_second=False)
    x = torch.randn(s["batch"], s["tokens"], s["hidden"], device=device, dtype=dtype, requires_grad=True)
    return Chain(name, eager, fused, (x,))


def build_chains(shapes: dict, device, dtype, wanted) -> list:
    """The rows of ``CHAINS`` named in ``wanted``, as ``bench.ops.Chain`` objects."""
    h, i, p = shapes["hidden"], shapes["inter"], shapes["p"]
    builders = {
        "gated_mlp_silu": lambda: _gated("gated_mlp_silu", shapes, device, dtype, nn.SiLU(), 0.0),
        "gated_mlp_gelu": lambda: _gated("gated_mlp_gelu", shapes, device, dtype, NewGELUActivation(), p),
        "gated_mlp_silu[packed]": lambda: _gated("gated_mlp_silu[packed]", shapes, device, dtype, nn.SiLU(), 0.0),
        "gated_product_silu[lora]": lambda: _gated("gated_product_silu[lora]", shapes, device, dtype, nn.SiLU(), 0.0),
        "gated_product_silu[moe]": lambda: _moe("gated_product_silu[moe]", shapes, device, dtype, nn.SiLU()),
        "dropout_linear[lora_qkv]": lambda: _lora_qkv("dropout_linear[lora_qkv]", shapes, device, dtype),
        "linear_gelu_tanh_linear[gpt2]": lambda: _two_layer(
            "linear_gelu_tanh_linear[gpt2]", shapes, device, dtype, Conv1D(i, h), NewGELUActivation(), 0.0,
            Conv1D(h, i)),
        "linear_quick_gelu_linear": lambda: _two_layer(
            "linear_quick_gelu_linear", shapes, device, dtype, nn.Linear(h, i), QuickGELUActivation(), 0.0,
            nn.Linear(i, h)),
        "linear_silu_dropout_linear": lambda: _two_layer(
            "linear_silu_dropout_linear", shapes, device, dtype, nn.Linear(h, i), nn.SiLU(), p, nn.Linear(i, h)),
    }
    return [build() for name, build in builders.items() if name in wanted]

