import pytest
import torch

from opsnn_lab.bench import activation_bytes, chains_norm, ops


def _outputs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("name", chains_norm.NORM_CHAINS)
def test_every_row_computes_what_eager_computes(name):
    chain = ops.build_chains(ops.QUICK, only=[name])[0][0]
    leaves = [t for t in chain.inputs if t.is_floating_point()]
    params = list(getattr(chain.eager, "parameters", lambda: [])())
    results = []
    for fn in (chain.eager, chain.fused):
        outs = _outputs(fn(*chain.inputs))
        grads = torch.autograd.grad(outs, leaves + params, [torch.ones_like(o) for o in outs], allow_unused=True)
        results.append([o.detach() for o in outs] + list(grads))
    tol = 5e-2 if chain.inputs[0].dtype == torch.bfloat16 else 2e-4
    for got, want in zip(*reversed(results)):
        if want is not None:
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_saved_bytes_ratios_at_ci_shapes():
    chains = {c.name: c for c in ops.build_chains(ops.QUICK, only=list(chains_norm.NORM_CHAINS))[0]}

    def ratio(name):
        c = chains[name]
        return activation_bytes(lambda: c.fused(*c.inputs)) / activation_bytes(lambda: c.eager(*c.inputs))

    h = ops.QUICK["hidden"]
    # alone, built as the output nothing keeps: nn.LayerNorm's input + mean + rstd
    assert ratio("layer_norm") == ratio("add_layer_norm") == 1.0
    # alone, saving the output anyway: y + rstd against the same, nothing shared
    assert ratio("layer_norm[save_output]") == pytest.approx((h + 1) / (h + 2))
    # with the Linear that reads y: y is stored once, eager stores the norm's input and the Linear's copy of y
    assert ratio("layer_norm+linear") == ratio("add_layer_norm+linear") == pytest.approx(0.5)
    assert ratio("rms_norm+linear") == ratio("add_rms_norm+linear") == pytest.approx((h + 1) / (3 * h + 1))
    assert ratio("add_rms_norm+linear[bf16]") <= 0.5
    assert ratio("rms_norm") == pytest.approx((h + 1) / (2 * h + 1))  # x + rstd vs x, x * rstd, rstd
    # bf16: eager also keeps an fp32 copy of the input: (2H + 4) / (4H + 2H + 4) bytes per row
    assert ratio("add_rms_norm[bf16]") == pytest.approx((2 * h + 4) / (6 * h + 4))
    assert ratio("linear_cross_entropy[bf16]") < 0.3
