import platform
import sys

import pytest

from opsnn_lab.bench import allocator


def test_page_faults_count_fresh_memory():
    if sys.platform == "win32":
        assert allocator.page_faults() == 0
        return
    before = allocator.page_faults()
    buf = bytearray(32 << 20)  # zero-filled: every page is touched
    assert allocator.page_faults() - before >= (32 << 20) // 4096 // 2, len(buf)


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_steady_allocator_on_glibc():
    assert allocator.steady().startswith("steady (glibc")
