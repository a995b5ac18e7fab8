#!/usr/bin/env bash
# Every check that needs a GPU, in one call of a lent H100 / H200 (a session has 15 minutes of device time, one
# command at most 10): the GPU kernels' tests, the quantized matmul kernel against bf16 and dequantize-then-dot,
# then issue #29's and #30's throughput rows. Each part has its own time limit so one that hangs leaves the others
# their time (150 + 75 + 325 s, plus ~20 s to start); the whole script ends within ~9.5 minutes. Output:
# $OUT (or benchmarks/results/device/ without $OUT) holds each part's log and the JSON.
#
# The card's image has JAX, flax, transformers and torch but not pydantic, gguf or llguidance: carry them as wheels.
# Here, once, in the repository's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 gguf==0.19.0 \
#     llguidance==1.9.1
# then call the device tool with carry [".whl"] and the command `bash benchmarks/device_checks.sh`.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-benchmarks/results/device}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import jax; print(jax.__version__, jax.devices())"; } \
  > "$OUT_DIR/device.txt" 2>&1

part() {  # part NAME SECONDS COMMAND...: runs COMMAND with a time limit, its output in $OUT_DIR/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  echo "   exit $? after ${SECONDS} s in all"
  tail -n 25 "$OUT_DIR/$name.log"
}

# 1. correctness on the card: the Pallas GPU kernels (bf16, fp8 pools) and the quantized matmuls' fusion
part kernels 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernel_gpu.py \
  tests/kernels/test_fp8_kernels.py tests/kernels/test_quant_fusion.py
# 2. issue #30: the GGUF block formats' Pallas kernel (pallas_kernels/gpu_qmatmul.py) compiled on the card, checked
#    against dequantize-then-dot at ragged shapes, then timed at Llama-3-8B's MLP shapes (decode rows first; new
#    cases stop after 55 s). Its unit tests on the card take a second call:
#    `python3 -m pytest -q tests/kernels/test_gpu_qmatmul.py`
part qmatmul 75 python3 benchmarks/gpu_qmatmul.py --budget-s 55 --out "$OUT_DIR/gpu_qmatmul.json"
# 3. issue #29 (decode step against its device time, output tok/s) and #30 (fp8 KV + int8 weights >= 1.3x bf16),
#    Llama-3.2-1B and Llama-3-8B shapes, workload D, no HF peers (their rows: a second call, `--workloads D P`)
#    Llama-3-8B first (both issues' rows), then 1B; no new row after 230 s, and the JSON is written after each row,
#    so a row cut off by the part's limit loses only itself.
part throughput 325 python3 benchmarks/gpu_throughput.py --models 8b 1b --workloads D --formats bf16 fp8kv+int8 \
  --no-hf --budget-s 230 --out "$OUT_DIR/gpu_throughput.json"
echo "done in ${SECONDS} s"
