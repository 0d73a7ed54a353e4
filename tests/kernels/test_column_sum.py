"""The shared second stage of the parameter-gradient reductions: tiled, fixed-order column sums."""

import pytest
import torch

from opsnn_lab.kernels import column_sum as C
from opsnn_lab.testing import seeded, triton_interpreter_ready


@pytest.fixture
def interpreter():
    if not triton_interpreter_ready():
        pytest.skip("needs triton with TRITON_INTERPRET=1")


# R: under one tile, one tile and a masked second, several tiles; N: one column, a partly masked block, 3 blocks
@pytest.mark.parametrize("r, n", [(1, 1), (33, 65), (100, 130), (7, 192), (0, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_fp64_sum(interpreter, r, n, dtype):
    part = seeded(r, n, seed=r + n)
    got = C.column_sum(part, torch.full((n,), float("nan"), dtype=dtype))  # every column written, zeros at R=0
    want = part.double().sum(0)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol * (1 + r ** 0.5), rtol=tol)
    torch.testing.assert_close(got, C.column_sum_reference(part, torch.empty(n, dtype=dtype)), atol=tol * (1 + r),
                               rtol=tol)


def test_same_bits_on_every_run_and_independent_of_the_output_dtype(interpreter):
    part = seeded(97, 70, seed=3) * 1e3
    first = C.column_sum(part, torch.empty(70))
    assert torch.equal(first, C.column_sum(part, torch.empty(70)))
    assert torch.equal(C.column_sum(part, torch.empty(70, dtype=torch.float64)).float(), first)


def test_bad_arguments_name_the_argument(interpreter):
    part = torch.zeros(4, 6)
    with pytest.raises(TypeError, match="partial"):
        C.column_sum(part.double(), torch.empty(6))
    with pytest.raises(ValueError, match="partial"):
        C.column_sum(torch.zeros(6), torch.empty(6))
    with pytest.raises(ValueError, match="partial must be contiguous"):
        C.column_sum(torch.zeros(6, 4).t(), torch.empty(6))
    with pytest.raises(ValueError, match="out must be a"):
        C.column_sum(part, torch.empty(5))
    with pytest.raises(TypeError, match="out"):
        C.column_sum(part, [0.0] * 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_many_partials_match_and_repeat():
    part = seeded(4096, 3000, seed=5).cuda()  # the partials of 64k rows: 128 tiles per program
    first = C.column_sum(part, torch.empty(3000, device="cuda"))
    assert torch.equal(first, C.column_sum(part, torch.empty(3000, device="cuda")))
    torch.testing.assert_close(first.double().cpu(), part.double().sum(0).cpu(), atol=1e-4, rtol=1e-6)
