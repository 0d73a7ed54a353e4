
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opsnn_lab.bench import activation_bytes
from opsnn_lab.kernels import gated_mlp as gm_kernels
from opsnn_lab.kernels import gelu_dropout, rng, triton_available
from opsnn_lab.ops import FusedGatedMLP
from opsnn_lab.ops import gated_mlp as gm_ops
from opsnn_lab.testing import (
    assert_close_dtype,
    assert_within_eager_error,
    non_contiguous,
    reloaded,
    run_fwd_bwd,
    seeded,
)

_ACT_MODULES = {"silu": nn.SiLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh")}


def _modules(h=16, inter=24, out=None, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    gate, up = nn.Linear(h, inter, bias=bias).to(dtype), nn.Linear(h, inter, bias=bias).to(dtype)
    return gate, up, nn.Linear(inter, out or h, bias=bias).to(dtype)


def _eager(mods, act, p=0.0, step=0, seed=11):
    """The unfused Llama/T5 computation, nn.Dropout's mask replaced by the counter-based one."""
    gate, up, down = mods
    act_fn = _ACT_MODULES[act]()

    def fn(x):
        prod = act_fn(gate(x)) * up(x)
        if p > 0:
            keep = rng.dropout_mask(seed, step * rng.MAX_NUMEL, prod.shape, p, prod.device)
            prod = prod * keep * (0.0 if p == 1 else 1.0 / (1 - p))
        return down(prod)
    return fn


def _fused(mods, act, p=0.0, **kw):
    drop = nn.Dropout(p) if p else None
    return FusedGatedMLP.from_modules(*mods, _ACT_MODULES[act](), drop, seed=11, **kw)


def _params(mods):
    return [t for m in mods for t in (m.weight, m.bias) if t is not None]


def _compare(fused, eager, x, mods, dtype=None):
    out, grads = run_fwd_bwd(fused, [x], _params(mods))
    ref, ref_grads = run_fwd_bwd(eager, [x], _params(mods))
    assert_close_dtype(out, ref, dtype)
    assert len(grads) == len(ref_grads) == 1 + len(_params(mods))
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_close_dtype(g, r, dtype, msg=f"grad {i}")


@pytest.mark.parametrize("act", list(_ACT_MODULES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_every_gradient_match_eager(act, bias, p, recompute, dtype):
    mods = _modules(bias=bias, dtype=dtype)
    fused = _fused(mods, act, p, recompute=recompute)
    fused.set_rng(11, 2)
    x = seeded(3, 5, 16, seed=1, dtype=dtype, requires_grad=True)
    _compare(fused, _eager(mods, act, p, step=2), x, mods)
    assert fused.rng_step == 3


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_twice_eager_error(act, dtype):
    mods64, mods = _modules(h=32, inter=48, dtype=torch.float64), _modules(h=32, inter=48, dtype=dtype)
    x64 = seeded(4, 9, 32, seed=2, dtype=torch.float64, requires_grad=True)
    x = x64.detach().to(dtype).requires_grad_(True)
    ref, ref_grads = run_fwd_bwd(_eager(mods64, act, 0.2), [x64], _params(mods64))
    eager, eager_grads = run_fwd_bwd(_eager(mods, act, 0.2), [x], _params(mods))
    out, grads = run_fwd_bwd(_fused(mods, act, 0.2), [x], _params(mods))
    assert_within_eager_error(out, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


def test_odd_shape_and_non_contiguous_input():
    mods = _modules(h=781, inter=37, out=29, bias=True)
    x = non_contiguous(seeded(1823, 781, seed=3, scale=0.5)).requires_grad_(True)
    _compare(_fused(mods, "silu", 0.1), _eager(mods, "silu", 0.1), x, mods)


def test_mixed_biases_and_unpacked_weights():
    gate, up, down = _modules()
    up.bias = None
    fused = _fused((gate, up, down), "gelu", pack=False)
    assert not fused.packed  # falls back to one concatenation per call
    x = seeded(6, 16, seed=4, requires_grad=True)
    _compare(fused, _eager((gate, up, down), "gelu"), x, (gate, up, down))


def test_empty_batch():
    mods = _modules()
    x = torch.zeros(0, 16, requires_grad=True)
    out, grads = run_fwd_bwd(_fused(mods, "silu", 0.2), [x], _params(mods))
    assert out.shape == (0, 16) and all(g is None or not g.any() for g in grads)


def test_eval_mode_matches_eager_and_does_not_draw():
    mods = _modules()
    fused = _fused(mods, "silu", 0.5).eval()
    x = seeded(4, 16, seed=5)
    assert_close_dtype(fused(x), _eager(mods, "silu")(x))
    assert fused.rng_step == 0


def test_masks_advance_per_call_and_replay_with_set_rng():
    fused = _fused(_modules(), "silu", 0.5)
    x = seeded(8, 16, seed=6)
    a, b = fused(x), fused(x)
    assert not torch.equal(a, b)
    fused.set_rng(11, 0)
    assert torch.equal(fused(x), a)


def test_parameters_keep_identity_keys_and_see_optimizer_steps():
    gate, up, down = mods = _modules()
    before = {k: v.clone() for k, v in nn.ModuleDict(dict(g=gate, u=up, d=down)).state_dict().items()}
    params = [gate.weight, up.weight, gate.bias, up.bias]
    fused = _fused(mods, "silu")
    assert fused.packed and [gate.weight, up.weight, gate.bias, up.bias] == params
    assert gate.weight.data_ptr() + gate.weight.nbytes == up.weight.data_ptr()
    assert list(fused.state_dict()) == [f"{n}.{t}" for n in ("gate_proj", "up_proj", "down_proj")
                                        for t in ("weight", "bias")]
    assert all(torch.equal(v, before[k]) for k, v in nn.ModuleDict(dict(g=gate, u=up, d=down)).state_dict().items())
    t5 = _fused(mods, "gelu_tanh", names=("wi_0", "wi_1", "wo"))
    assert list(t5.state_dict())[0] == "wi_0.weight"
    refs = _fused(mods, "silu", register=False)
    assert list(refs.state_dict()) == [] and refs.linears == mods
    with torch.no_grad():
        up.weight.add_(1.0)
    x = seeded(3, 16, seed=7)
    assert_close_dtype(refs.eval()(x), _eager(mods, "silu")(x))


def test_saves_only_x_and_packed_preactivations():
    mods = _modules(h=32, inter=64)
    x = seeded(8, 32, seed=8, requires_grad=True)
    packed = 8 * 2 * 64 * 4
    assert activation_bytes(lambda: _fused(mods, "silu", 0.1)(x)) == x.nbytes + packed
    assert activation_bytes(lambda: _fused(mods, "silu", recompute=True)(x)) == x.nbytes
    eager_bytes = activation_bytes(lambda: _eager(mods, "silu")(x))
    assert eager_bytes == x.nbytes + 2 * packed  # gate, act(gate), up, product
    assert (x.nbytes + packed) / eager_bytes <= 0.67


def test_supports_and_bad_arguments_name_the_argument():
    gate, up, down = _modules()
    assert FusedGatedMLP.supports(gate, up, down, nn.SiLU()) == (True, "")
    cases = [((gate, up, down, nn.Tanh()), TypeError, "act"),
             ((gate, up, down, nn.PReLU()), TypeError, "parameters"),
             ((gate, nn.Conv1d(16, 24, 1), down, nn.SiLU()), TypeError, "up"),
             ((gate, nn.Linear(16, 25), down, nn.SiLU()), ValueError, "up"),
             ((gate, up, nn.Linear(23, 16), nn.SiLU()), ValueError, "down"),
             ((gate, up, down.double(), nn.SiLU()), TypeError, "down")]
    for args, exc, word in cases:
        ok, why = FusedGatedMLP.supports(*args)
        assert not ok and word in why
        with pytest.raises(exc, match=word):
            FusedGatedMLP.from_modules(*args)
    gate, up, down = _modules()
    assert not FusedGatedMLP.supports(gate, up, down, nn.SiLU(), nn.ReLU())[0]
    with pytest.raises(TypeError, match="dropout"):
        FusedGatedMLP.from_modules(gate, up, down, nn.SiLU(), nn.ReLU())
    with pytest.raises(ValueError, match="names"):
        FusedGatedMLP(gate, up, down, names=("a", "a", "b"))
    with pytest.raises(ValueError, match="act"):
        FusedGatedMLP(gate, up, down, act="swish")
    fused = FusedGatedMLP(gate, up, down)
    with pytest.raises(ValueError, match="x"):
        fused(torch.zeros(2, 15))
    with pytest.raises(TypeError, match="x"):
        fused(torch.zeros(2, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="x"):
        fused([0.0] * 16)


# --------------------------------------------------------------------------- Hugging Face modules
@pytest.mark.slow  # importing transformers takes ~10 s on the CI machine
def test_llama_and_t5_mlps_fuse_and_match():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, T5Config
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.t5.modeling_t5 import T5DenseGatedActDense

    torch.manual_seed(0)
    llama = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu"))
    fused = FusedGatedMLP.from_modules(llama.gate_proj, llama.up_proj, llama.down_proj, llama.act_fn)
    assert fused.act == "silu"
    x = seeded(2, 5, 32, seed=9, requires_grad=True)
    _compare(fused, llama, x, (llama.gate_proj, llama.up_proj, llama.down_proj))
    t5 = T5DenseGatedActDense(T5Config(d_model=32, d_ff=48, dense_act_fn="gelu_new", dropout_rate=0.0))
    fused = FusedGatedMLP.from_modules(t5.wi_0, t5.wi_1, t5.wo, t5.act, t5.dropout, names=("wi_0", "wi_1", "wo"))
    assert fused.act == "gelu_tanh" and list(fused.state_dict()) == list(t5.state_dict())
    _compare(fused, t5, x, (t5.wi_0, t5.wi_1, t5.wo))


# --------------------------------------------------------------------------- Triton under the interpreter
@pytest.fixture
def interpreted():
    if not triton_available():
        pytest.skip("triton not installed")
    with reloaded(rng, gelu_dropout, gm_kernels, gm_ops, TRITON_INTERPRET="1", OPSNN_BACKEND="triton") as ops:
        yield ops


@pytest.mark.parametrize("act, p, recompute", [("silu", 0.3, False), ("gelu_tanh", 0.0, True)])
def test_triton_interpreter_matches_eager(interpreted, act, p, recompute):
    mods = _modules(h=8, inter=20, out=6)
    fused = interpreted.FusedGatedMLP.from_modules(*mods, _ACT_MODULES[act](), nn.Dropout(p), seed=11,
                                                   recompute=recompute)
    x = seeded(2, 3, 8, seed=10, requires_grad=True)
    _compare(fused, _eager(mods, act, p), x, mods)


def test_eager_oracle_is_the_plain_computation():
    mods = _modules()
    x = seeded(3, 16, seed=11)
    gate, up, down = mods
    assert_close_dtype(_eager(mods, "silu")(x), down(F.silu(gate(x)) * up(x)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_matches_eager_error_bound(act, dtype):
    mods = [m.cuda() for m in _modules(h=1024, inter=2816, bias=False, dtype=dtype)]
    mods64 = [m.cuda() for m in _modules(h=1024, inter=2816, bias=False, dtype=torch.float64)]
    x64 = seeded(1151, 1024, seed=12, dtype=torch.float64, device="cuda", scale=0.5, requires_grad=True)
    x = x64.detach().to(dtype).requires_grad_(True)
    out, grads = run_fwd_bwd(_fused(mods, act, 0.1), [x], _params(mods))
    eager, eager_grads = run_fwd_bwd(_eager(mods, act, 0.1), [x], _params(mods))
    ref, ref_grads = run_fwd_bwd(_eager(mods64, act, 0.1), [x64], _params(mods64))
    assert_within_eager_error(out, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


# --------------------------------------------------------------------------- one Linear computing [gate | up]
class _PackedMLP(nn.Module):
    """Phi-3's MLP: ``gate, up = gate_up_proj(x).chunk(2, -1); down_proj(up * act(gate))``; with
    ``gate_first=False`` diffusers' GEGLU: ``hidden, gate = proj(x).chunk(2, -1); hidden * gelu(gate)``."""

    def __init__(self, h=16, inter=24, bias=False, act="silu", dtype=torch.float32, gate_first=True):
        super().__init__()
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=bias).to(dtype)
        self.down_proj = nn.Linear(inter, h, bias=bias).to(dtype)
        self.act = _ACT_MODULES[act]()
        self.gate_first = gate_first

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if not self.gate_first:
            up, gate = gate, up
        return self.down_proj(up * self.act(gate))


def _packed(mlp, **kw):
    return FusedGatedMLP.from_packed(mlp.gate_up_proj, mlp.down_proj, mlp.act, gate_first=mlp.gate_first, **kw)


@pytest.mark.parametrize("act", list(_ACT_MODULES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recompute, gate_first", [(False, True), (True, True), (False, False), (True, False)])
def test_packed_gate_up_matches_eager(act, bias, recompute, gate_first):
    torch.manual_seed(0)
    mlp = _PackedMLP(h=19, inter=13, bias=bias, act=act, dtype=torch.float64, gate_first=gate_first)
    fused = _packed(mlp, recompute=recompute)
    assert fused.packed and isinstance(fused, gm_ops.FusedPackedGatedMLP)
    params = [p for p in mlp.parameters()]
    x = non_contiguous(seeded(3, 5, 19, seed=1, dtype=torch.float64)).requires_grad_(True)
    out, grads = run_fwd_bwd(fused, [x], params)
    ref, ref_grads = run_fwd_bwd(mlp, [x], params)
    assert_close_dtype(out, ref)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.shape == r.shape
        assert_close_dtype(g, r, msg=f"grad {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gate_first", [True, False])
def test_packed_low_precision_within_twice_eager_error(dtype, gate_first):
    torch.manual_seed(0)
    mlp64 = _PackedMLP(h=32, inter=48, bias=True, act="gelu_tanh", dtype=torch.float64, gate_first=gate_first)
    mlp = _PackedMLP(h=32, inter=48, bias=True, act="gelu_tanh", gate_first=gate_first).to(dtype)
    mlp.load_state_dict({k: v.to(dtype) for k, v in mlp64.state_dict().items()})
    x64 = seeded(4, 9, 32, seed=2, dtype=torch.float64, requires_grad=True)
    x = x64.detach().to(dtype).requires_grad_(True)
    ref, ref_grads = run_fwd_bwd(mlp64, [x64], list(mlp64.parameters()))
    eager, eager_grads = run_fwd_bwd(mlp, [x], list(mlp.parameters()))
    out, grads = run_fwd_bwd(_packed(mlp), [x], list(mlp.parameters()))
    assert_within_eager_error(out, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        assert_within_eager_error(g, e, r, name=f"grad {i}")


def test_packed_dropout_draws_the_two_linear_forms_mask():
    torch.manual_seed(0)
    mlp = _PackedMLP(bias=True)
    inter = mlp.down_proj.in_features
    gate = nn.Linear(16, inter)
    up = nn.Linear(16, inter)
    with torch.no_grad():
        gate.weight.copy_(mlp.gate_up_proj.weight[:inter]), up.weight.copy_(mlp.gate_up_proj.weight[inter:])
        gate.bias.copy_(mlp.gate_up_proj.bias[:inter]), up.bias.copy_(mlp.gate_up_proj.bias[inter:])
    two = FusedGatedMLP.from_modules(gate, up, mlp.down_proj, nn.SiLU(), nn.Dropout(0.3), seed=5, pack=False)
    packed = FusedGatedMLP.from_packed(mlp.gate_up_proj, mlp.down_proj, nn.SiLU(), nn.Dropout(0.3), seed=5)
    x = seeded(7, 16, seed=3)
    torch.testing.assert_close(packed(x), two(x))
    assert packed.rng_step == two.rng_step == 1


def test_packed_keeps_the_state_dict_and_rejects_bad_modules():
    mlp = _PackedMLP()
    fused = _packed(mlp)
    assert list(fused.state_dict()) == ["gate_up_proj.weight", "down_proj.weight"]
    assert "packed=[gate | up]" in repr(fused)
    assert "packed=[up | gate]" in repr(FusedGatedMLP.from_packed(mlp.gate_up_proj, mlp.down_proj, nn.SiLU(),
                                                                  gate_first=False))
    with pytest.raises(TypeError, match="gate_first"):
        FusedGatedMLP.from_packed(mlp.gate_up_proj, mlp.down_proj, nn.SiLU(), gate_first="second")
    odd = nn.Linear(16, 47)
    assert FusedGatedMLP.supports_packed(odd, mlp.down_proj, nn.SiLU()) == (
        False, "gate_up must have twice down's in_features (24) as out_features, got 47")
    with pytest.raises(TypeError, match="gate_up"):
        FusedGatedMLP.from_packed(nn.Conv1d(16, 48, 1), mlp.down_proj, nn.SiLU())
    with pytest.raises(TypeError, match="down has dtype"):
        FusedGatedMLP.from_packed(mlp.gate_up_proj, nn.Linear(24, 16).double(), nn.SiLU())
    with pytest.raises(ValueError, match="names"):
        FusedGatedMLP.from_packed(mlp.gate_up_proj, mlp.down_proj, nn.SiLU(), names=("a", "a"))
    with pytest.raises(ValueError, match="16 features"):
        fused(torch.zeros(2, 15))
    assert fused(torch.zeros(0, 16)).shape == (0, 16)
