#!/usr/bin/env bash
# The checks only a CUDA machine can make, in one call: the tests marked `gpu` (compiled Triton kernels and
# the ops on CUDA, not the interpreter), then `bench ops` on the GPU unless GPU_BENCH=0. Uses the machine's
# own python3 and torch (nothing installed: the package runs from the checkout). Logs go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
timeout "${GPU_TEST_S:-330}" python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short --durations=8 tests/kernels tests/ops tests/consistency tests/test_memory.py \
    > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -40
if [ "${GPU_BENCH:-1}" != 0 ]; then
    timeout "${GPU_BENCH_S:-180}" python3 -m opsnn_lab.bench ops --device cuda --no-compile --out "$OUT" \
        > "$OUT/bench.log" 2>&1
    grep -v "it/s\]" "$OUT/bench.log" | tail -45
fi
