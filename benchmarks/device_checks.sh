#!/usr/bin/env bash
# Every check that needs a GPU, in one call of a lent H100 / H200 (a session has 15 minutes of device time, one
# command at most 10): issue #29's and #30's throughput rows first, the layer matmul kernel's A/B, a CUDA-graph
# experiment, then the GPU kernels' tests (the paged attention kernel with bf16 and fp8 pools, the layer matmuls, the
# quantized matmuls' fusion, the GGUF block formats' Pallas matmul). Each part has its own time limit so one that
# hangs leaves the others their time (315 + 90 + 70 + 90 s, plus ~20 s to install and start); the whole script ends
# within ~9.8 minutes: call it with timeout_s 600. Output: each part's log and JSON in $OUT (or
# benchmarks/results/device/ without $OUT). The GGUF Pallas matmul's timing (benchmarks/gpu_qmatmul.py) ran on an
# H200 on 2026-11-27 (benchmarks/results/device_h200_20261127/) and is left out.
#
# The card's image has JAX, flax, transformers and torch but not pydantic, gguf or llguidance: carry them as wheels.
# Here, once, in the repository's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 gguf==0.19.0 llguidance==1.9.1
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

# 1. issues #29 (decode step against its device time, output tok/s, prefill-heavy share of peak, and the decode
#    step's costliest device operations) and #30 (fp8 KV and int8 weights against bf16 on Llama-3-8B, workload D,
#    each alone), in order of what each goal needs most. Shapes compile when first used (--lazy-compile; ~12 per row,
#    3.5-10 s each on an H200), each compile's time logged. No new row after 270 s; the JSON is written after each
#    row, so a row cut off by the part's limit loses only itself. No HF peers (their rows: a call of their own,
#    `--models 8b --workloads P`).
part throughput 315 python3 benchmarks/gpu_throughput.py --rows 1b:D:bf16 8b:D:bf16 8b:P:bf16 8b:D:int8 8b:D:fp8kv \
  1b:D:fp8kv+int8 --lazy-compile --log-compiles --budget-s 205 --out "$OUT_DIR/gpu_throughput.json"
# 1b. the layer matmul's A/B: the 8B decode row again with XLA's GEMM of the sliced layer (the engine before
#     pallas_kernels/gpu_matmul.py; benchmarks/gpu_step_hlo.py shows it copying each layer's weights first)
part xla_layer_matmul 90 python3 benchmarks/gpu_throughput.py --rows 8b:D:bf16 --xla-layer-matmul --lazy-compile \
  --out "$OUT_DIR/gpu_throughput_xla_layer_matmul.json"
# 1c. the 1B decode step is launch-bound (its step 1.30x its kernels' time on 2026-11-27): the model's layer loop is
#     an XLA while loop whose body the runtime launches kernel by kernel; XLA can record it as a CUDA graph
#     (command buffers with WHILE, off by default). The 1B row again with that on.
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" \
  part command_buffers 70 python3 benchmarks/gpu_throughput.py --rows 1b:D:bf16 --lazy-compile \
  --out "$OUT_DIR/gpu_throughput_command_buffers.json"
# 2. correctness on the card, several pytest workers sharing the GPU (the Triton compiles are CPU work; no worker
#    takes the GPU's memory up front), each result logged as it comes (-v) so a cut-off run still says what passed
export XLA_PYTHON_CLIENT_PREALLOCATE=false
part kernels 90 python3 -m pytest -o addopts= -v -n 8 -p no:cacheprovider \
  tests/kernels/test_kernel_gpu.py tests/kernels/test_fp8_kernels.py tests/kernels/test_quant_fusion.py \
  tests/kernels/test_gpu_qmatmul.py tests/kernels/test_gpu_matmul.py tests/engine/test_step_shapes.py
grep -cE " PASSED " "$OUT_DIR/kernels.log" | sed 's/^/   passed: /'
grep -E " (FAILED|ERROR) " "$OUT_DIR/kernels.log" | head -n 20
echo "done in ${SECONDS} s"
