import platform
import sys

import pytest

from opsnn_lab.bench import allocator


def test_page_faults_count_fresh_memory():
    if sys.platform == "win32":
        assert allocator.page_faults() == 0
        return
    import mmap

    size = 32 << 20
    buf = mmap.mmap(-1, size)  # fresh pages, whatever the heap holds
    before = allocator.page_faults()
    for offset in range(0, size, 4096):
        buf[offset] = 1
    assert allocator.page_faults() - before >= size // 4096 // 2


_FRESH = """
import importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
assert allocator.steady() == "steady (glibc: every block from the heap, never trimmed)"
if sys.argv[2] == "prefault":
    assert allocator.prefault(128 << 20) == 128 << 20
elif sys.argv[2] == "reuse":
    buf = bytearray(96 << 20)
    del buf
elif sys.argv[2] == "fragmented":  # 128 MB free in 32 MB holes between live blocks: none holds 96 MB
    blocks = [bytearray(32 << 20) for _ in range(8)]
    del blocks[::2]
    assert allocator.prefault(128 << 20) == 128 << 20
f0 = faults()
buf = bytearray(96 << 20)  # zero-filled: every page is written
print(faults() - f0)
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_steady_heap_keeps_large_blocks_and_prefault_makes_headroom_resident():
    # in a fresh process each: steady() changes malloc for the rest of the process it runs in
    import subprocess

    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _FRESH, allocator.__file__, mode], capture_output=True,
                             text=True, check=True)
        return int(out.stdout)

    pages = (96 << 20) // 4096
    assert faults("fresh") > pages // 2  # a fresh process faults the buffer in
    assert faults("prefault") < pages // 20  # the headroom was resident already
    assert faults("reuse") < pages // 20  # a 96 MB block freed is kept (an mmap block would be unmapped)
    # prefault grows the top by one block: pieces would have gone into the holes and left the top as it was
    assert faults("fragmented") < pages // 20


def test_prefault_rejects_a_bad_size():
    with pytest.raises(ValueError, match="nbytes"):
        allocator.prefault(-1)
    with pytest.raises(TypeError, match="nbytes"):
        allocator.prefault(1.5)
    assert allocator.prefault(0) == 0
