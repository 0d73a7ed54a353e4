import math

import pytest
import torch

from opsnn_lab.kernels import rng, triton_available
from opsnn_lab.testing import reloaded

# (seed, offset, numel): odd offsets, a high-word carry inside the draw, the int32 wrap of the low word.
DRAWS = [
    (0, 0, 10),
    (1, 1, 11),
    (2**64 - 1, 7, 64),
    (123, 2**33 - 6, 21),  # word index crosses 2**32: the key changes mid-draw
    (5, 2**32 - 9, 40),  # low word crosses 2**31 (int32 wrap on the CPU path)
    (9, 2**40 + 3, 1001),
    (11, 2**62, 3),
]


@pytest.fixture(scope="module")
def interpreted():
    """rng reloaded under TRITON_INTERPRET=1 (kernels are built at import), restored afterwards."""
    if not triton_available():
        pytest.skip("triton not installed")
    with reloaded(rng, TRITON_INTERPRET="1") as module:
        yield module


@pytest.mark.parametrize("seed, offset, numel", DRAWS)
def test_cpu_path_matches_int64_specification(seed, offset, numel):
    spec = rng._words_reference(seed, offset, numel)
    assert torch.equal(rng.random_bits16(seed, offset, numel).long(), spec)


@pytest.mark.parametrize("seed, offset, numel", DRAWS)
def test_triton_interpreter_gives_the_same_bits(interpreted, seed, offset, numel):
    spec = interpreted._words_reference(seed, offset, numel)
    assert torch.equal(interpreted.random_bits16_triton(seed, offset, numel).long(), spec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed, offset, numel", DRAWS + [(3, 5, 3_000_001)])
def test_gpu_kernel_and_gpu_torch_path_give_the_same_bits(seed, offset, numel):
    spec = rng._words_reference(seed, offset, numel)
    assert torch.equal(rng.random_bits16_triton(seed, offset, numel, "cuda").long().cpu(), spec)
    assert torch.equal(rng.random_bits16(seed, offset, numel, "cuda").long().cpu(), spec)
    for dtype in (torch.bool, torch.float32, torch.bfloat16):
        mask = rng.dropout_mask(seed, offset, numel, 0.1, "cuda", dtype=dtype)  # the Triton mask kernel
        assert torch.equal(mask.cpu(), rng.dropout_mask(seed, offset, numel, 0.1, dtype=dtype))
        if dtype != torch.bool:
            x = torch.randn(numel, dtype=dtype)
            assert torch.equal(rng.dropout_mul(x.cuda(), seed, offset, 0.1, 1 / 0.9).cpu(),
                               rng.dropout_mul(x, seed, offset, 0.1, 1 / 0.9))  # randn: no NaN


@pytest.mark.parametrize("seed, offset, numel", DRAWS)
@pytest.mark.parametrize("p, dtype", [(0.1, torch.bool), (0.5, torch.float32), (0.9, torch.bfloat16),
                                      (0.3, torch.float16)])
def test_triton_mask_kernel_gives_the_torch_paths_mask(interpreted, monkeypatch, seed, offset, numel, p, dtype):
    """On a GPU ``dropout_mask`` writes the mask in one Triton pass; CPU and GPU masks stay the same bits."""
    monkeypatch.setenv("OPSNN_BACKEND", "torch")
    want = interpreted.dropout_mask(seed, offset, (numel,), p, dtype=dtype)
    monkeypatch.setenv("OPSNN_BACKEND", "triton")
    got = interpreted.dropout_mask(seed, offset, (numel,), p, dtype=dtype)
    assert got.dtype == dtype and got.shape == (numel,)
    assert torch.equal(got, want)
    bits = interpreted._words_reference(seed, offset, numel)
    assert torch.equal(got.bool(), bits >= interpreted.keep_threshold(p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1 / 0.9])
def test_dropout_mul_kernel_gives_the_mask_paths_bits(interpreted, monkeypatch, dtype, scale):
    """x * keep * scale in one pass (the GPU path) = multiplying by the float mask, then by scale, bit for bit:
    signed zeros, NaN and inf included; in place too."""
    x = torch.randn(3, 5, 67).to(dtype)
    x.view(-1)[:4] = torch.tensor([-0.0, float("nan"), float("inf"), -1e-30])

    def bits(t):
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32)

    monkeypatch.setenv("OPSNN_BACKEND", "torch")
    want = interpreted.dropout_mul(x, 7, 2**33 - 11, 0.3, scale)
    assert torch.equal(bits(want), bits(x * interpreted.dropout_mask(7, 2**33 - 11, x.shape, 0.3, dtype=dtype) * scale))
    monkeypatch.setenv("OPSNN_BACKEND", "triton")
    got = interpreted.dropout_mul(x, 7, 2**33 - 11, 0.3, scale)
    if dtype == torch.bfloat16 and scale != 1.0:  # the interpreter rounds fp32 -> bf16 toward zero (GPU: to nearest,
        diff = (bits(got).int() - bits(want).int()).abs()  # checked bit for bit in the GPU test below)
        assert int(diff.max()) <= 1 and torch.equal(got.isnan(), want.isnan())
    else:
        assert torch.equal(bits(got), bits(want))  # bit for bit: -0.0, NaN
    inplace = x.clone()
    assert interpreted.dropout_mul(inplace, 7, 2**33 - 11, 0.3, scale, out=inplace) is inplace
    assert torch.equal(bits(inplace), bits(got))
    strided = x.transpose(0, 2)  # not contiguous: the mask path, the same counters over the row-major order
    assert torch.equal(interpreted.dropout_mul(strided, 7, 5, 0.3, scale).nan_to_num(),
                       (strided * interpreted.dropout_mask(7, 5, strided.shape, 0.3, dtype=dtype) * scale).nan_to_num())


def test_dropout_mul_bad_arguments():
    x = torch.ones(4, 4)
    with pytest.raises(TypeError, match="x must be"):
        rng.dropout_mul([1.0], 0, 0, 0.5)
    with pytest.raises(ValueError, match="out must match"):
        rng.dropout_mul(x, 0, 0, 0.5, out=torch.empty(4, 5))
    with pytest.raises(ValueError, match="p"):
        rng.dropout_mul(x, 0, 0, 1.5)
    assert torch.equal(rng.dropout_mul(x, 0, 0, 0.0, 2.0), x * 2) and rng.dropout_mul(x[:0], 0, 0, 0.5).numel() == 0


def test_mask_depends_only_on_seed_and_offset():
    a = rng.dropout_mask(4, 100, (6, 7), 0.5)
    flat = rng.dropout_mask(4, 100, 42, 0.5)
    assert torch.equal(a.flatten(), flat)
    # Element e of a draw at offset o is element e - k of the draw at offset o + k.
    shifted = rng.dropout_mask(4, 105, 37, 0.5)
    assert torch.equal(flat[5:], shifted)
    assert not torch.equal(rng.dropout_mask(5, 100, 42, 0.5), flat)


def test_mask_is_threshold_of_bits_in_every_dtype():
    bits = rng.random_bits16(8, 3, 5000)
    for p in (0.1, 0.5, 0.9):
        keep = rng.dropout_mask(8, 3, 5000, p)
        assert torch.equal(keep, bits >= rng.keep_threshold(p))
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            assert torch.equal(rng.dropout_mask(8, 3, 5000, p, dtype=dtype), keep.to(dtype))
    assert rng.dropout_mask(8, 3, (2, 3), 0.0, dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_within_four_std(p):
    n = 200_000
    kept = rng.dropout_mask(17, 2**35 + 1, n, p).double().mean().item()
    std = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 4 * std, (kept, 1 - p, std)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return (a @ b / (a.norm() * b.norm())).item()


def test_no_correlation_between_neighbouring_offsets_and_seeds():
    n = 100_000
    limit = 4 / math.sqrt(n)  # 4 std of a correlation estimate between independent streams
    u = rng.uniform(3, 0, n + 2)
    assert abs(_corr(u[:-1], u[1:])) < limit  # lag 1: the two halves of a word
    assert abs(_corr(u[:-2], u[2:])) < limit  # lag 2: neighbouring words
    for seed_b in (4, 3 + 2**32):  # neighbouring seed, and a seed differing only in its high word
        assert abs(_corr(rng.uniform(3, 0, n), rng.uniform(seed_b, 0, n))) < limit
    step = rng.MAX_NUMEL  # the per-call stride modules use: neighbouring steps
    assert abs(_corr(rng.uniform(3, 0, n), rng.uniform(3, step, n))) < limit
    # keep masks (not only uniforms) of neighbouring elements are independent too
    keep = rng.dropout_mask(3, 0, n + 1, 0.5).double()
    assert abs(_corr(keep[:-1], keep[1:])) < limit


def test_uniform_range_and_mean():
    u = rng.uniform(1, 0, 100_000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / 100_000)


def test_edge_probabilities_and_empty():
    assert rng.dropout_mask(0, 0, (3, 4), 0.0).all()
    assert not rng.dropout_mask(0, 0, (3, 4), 1.0).any()
    assert rng.dropout_mask(0, 0, (0, 4), 0.5).shape == (0, 4)
    assert rng.random_bits16(0, 0, 0).numel() == 0
    assert rng.keep_threshold(0.1) == 6554


def test_mask_regeneration_is_cheap_next_to_the_gemm_it_serves():
    # Count passes, not seconds (CI machines are shared): the CPU mask is 7 passes over numel / 2
    # int32 words plus one compare, i.e. well under the 2 * M * K * N flops of the GEMM beside it.
    from torch.profiler import profile

    with profile() as prof:
        rng.dropout_mask(0, 0, (64, 96), 0.1)
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::") and e.key not in
           ("aten::view", "aten::select", "aten::slice", "aten::as_strided", "aten::empty", "aten::lift_fresh",
            "aten::alias", "aten::detach_", "aten::to", "aten::_to_copy", "aten::copy_", "aten::empty_strided")]
    assert sum(e.count for e in ops) <= 12, [(e.key, e.count) for e in ops]


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(seed=-1, offset=0, numel=3), ValueError, "seed"),
    (dict(seed=1.5, offset=0, numel=3), TypeError, "seed"),
    (dict(seed=0, offset=-2, numel=3), ValueError, "offset"),
    (dict(seed=0, offset=0, numel=-1), ValueError, "numel"),
    (dict(seed=0, offset=2**63, numel=3), ValueError, "offset"),
])
def test_bad_arguments_name_the_argument(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        rng.random_bits16(**kwargs)


def test_bad_probability():
    with pytest.raises(ValueError, match="p"):
        rng.dropout_mask(0, 0, 4, 1.5)
    with pytest.raises(TypeError, match="p"):
        rng.dropout_mask(0, 0, 4, "0.1")


def test_serial_hash_restores_the_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rng.dropout_mask(0, 0, 1000, 0.5, dtype=torch.float32)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
