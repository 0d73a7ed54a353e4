import pytest
import torch

from opsnn_lab.bench import activation_bytes, chains_mlp, ops
from opsnn_lab.testing import assert_close_dtype


def test_rows_are_registered_in_the_ops_bench():
    assert set(chains_mlp.CHAINS) <= set(ops.CHAINS)
    chains, skipped = ops.build_chains(ops.QUICK, only=list(chains_mlp.CHAINS))
    assert [c.name for c in chains] == list(chains_mlp.CHAINS) and not skipped


def test_full_gated_rows_use_llama_like_widths():
    assert chains_mlp._gated_dims(ops.FULL) == (1024, 2816)
    assert chains_mlp._gated_dims(ops.QUICK) == (ops.QUICK["hidden"], ops.QUICK["inter"])


@pytest.mark.parametrize("name", ["gated_mlp_silu", "gated_mlp_silu[packed]", "gated_product_silu[lora]",
                                  "linear_gelu_tanh_linear[gpt2]", "linear_quick_gelu_linear"])
def test_fused_side_computes_the_eager_side(name):
    (chain,) = chains_mlp.build_chains(ops.QUICK, "cpu", torch.float32, [name])  # p = 0 rows: no masks to align
    x = chain.inputs[0]
    out, ref = chain.fused(x), chain.eager(x)
    assert_close_dtype(out, ref)
    g = torch.randn_like(out)
    assert_close_dtype(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0])


@pytest.mark.parametrize("name", ["gated_mlp_silu", "gated_mlp_gelu", "gated_mlp_silu[packed]"])
def test_gated_rows_meet_the_bytes_target(name):
    (chain,) = chains_mlp.build_chains(ops.QUICK, "cpu", torch.float32, [name])
    fused = activation_bytes(lambda: chain.fused(*chain.inputs))
    eager = activation_bytes(lambda: chain.eager(*chain.inputs))
    assert fused / eager <= chains_mlp.TARGETS["bytes_fused_vs_eager[gated_mlp_*]"]


def test_lora_row_shares_its_projections_and_drops_one_tensor():
    (chain,) = chains_mlp.build_chains(ops.QUICK, "cpu", torch.float32, ["gated_product_silu[lora]"])
    assert [p for p in chain.fused.parameters()] == [p for p in chain.eager.parameters()]
    assert chain.eager.product is None and chain.fused.product is not None
    h, i = chains_mlp._gated_dims(ops.QUICK)
    tokens = chain.inputs[0].numel() // h
    fused = activation_bytes(lambda: chain.fused(*chain.inputs))
    eager = activation_bytes(lambda: chain.eager(*chain.inputs))
    assert eager - fused == tokens * i * 4  # act(gate): (H + 3I) / (H + 4I) of eager, plus the rank-16 pieces


def test_lora_qkv_row_keeps_x_once_for_three_dropped_adapters():
    (chain,) = chains_mlp.build_chains(ops.QUICK, "cpu", torch.float32, ["dropout_linear[lora_qkv]"])
    assert [p for p in chain.fused.parameters()] == [p for p in chain.eager.parameters()]
    x = chain.inputs[0]
    h, rank = x.shape[-1], 16
    fused = activation_bytes(lambda: chain.fused(x))
    eager = activation_bytes(lambda: chain.eager(x))
    assert fused == x.numel() * 4 + 3 * x.numel() // h * rank * 4  # x once, and each lora_A output for lora_B
    assert eager >= 3 * x.numel() * (4 + 1)  # three dropped copies and three masks
    chain.eager.eval(), chain.fused.eval()
    assert_close_dtype(chain.fused(x), chain.eager(x))  # no dropout: the same projections


def test_conv1d_stand_in_is_the_hugging_face_layer():
    conv = chains_mlp.Conv1D(5, 3)
    x = torch.randn(2, 4, 3)
    assert_close_dtype(conv(x), x @ conv.weight + conv.bias)


def test_moe_row_fuses_the_product_of_the_grouped_gemm_halves_and_drops_one_tensor():
    (chain,) = chains_mlp.build_chains(ops.QUICK, "cpu", torch.float32, ["gated_product_silu[moe]"])
    x, offsets = chain.inputs
    assert [p for p in chain.fused.parameters()] == [p for p in chain.eager.parameters()]
    assert offsets.dtype == torch.int32 and int(offsets[-1]) == x.shape[0]  # every routed row, sorted by expert
    out, ref = chain.fused(x, offsets), chain.eager(x, offsets)
    assert_close_dtype(out, ref)
    g = torch.randn_like(out)
    inputs = (x, chain.eager.gate_up_proj, chain.eager.down_proj)
    for a, b in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g)):
        assert_close_dtype(a, b)
    inter = chain.eager.down_proj.shape[-1]
    fused = activation_bytes(lambda: chain.fused(*chain.inputs))
    eager = activation_bytes(lambda: chain.eager(*chain.inputs))
    assert eager - fused == x.shape[0] * inter * 4  # act(gate): (H + 3I) / (H + 4I) of eager
