"""Session-wide test setup.

Triton decides between its interpreter and its compiler when it is first imported, so the
interpreter switch must be set before any test module imports it: without a GPU every Triton
kernel is tested under ``TRITON_INTERPRET=1`` against its torch reference. torch.compile's cache is set the
same way, before torch is imported.
"""

import atexit
import os
import shutil
import tempfile

# torch.compile's kernels go to a cache of this run's own: a cache shared with other processes (or left by a
# run under another ATEN_CPU_CAPABILITY) is not what a fresh clone tests. The run removes it when it ends.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="opsnn-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _restore_threads():
    """Every test starts with the session's intra-op thread count: a benchmark's ``main()`` run in-process
    sets its own (``--threads``, or 1 for tiny tensors), and a later test's numerics depend on it."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def interpreted():
    """The GELU-dropout and RNG kernels forced onto the Triton interpreter for one test."""
    from opsnn_lab.kernels import gelu_dropout, rng, triton_available
    from opsnn_lab.testing import reloaded

    if not triton_available():
        pytest.skip("triton not installed")
    # the ops call into gelu_dropout's globals, so they see the reloaded kernels
    with reloaded(rng, gelu_dropout, TRITON_INTERPRET="1", OPSNN_BACKEND="triton"):
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
