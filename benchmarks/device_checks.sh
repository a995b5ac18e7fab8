#!/usr/bin/env bash
# Every check that needs a GPU, in two calls of a lent H100 / H200 (a session has 15 minutes of device time, one
# command at most 10, ~30 s to start a machine):
#   bash benchmarks/device_checks.sh 1    # timeout_s 600: at most ~9 minutes (its parts' limits)
#   bash benchmarks/device_checks.sh 2    # with what is left (~5 minutes): its parts in order of value, so a
#                                         # limit cuts the least useful
# Stage 1, what the latest changes need first: the GPU kernels no card has run yet (their numbers on the card: a
# throughput row over random weights cannot tell a wrong product from a right one), then issue #29's and #30's
# decode rows, then the A/Bs that say what each change gave (the sampler split from the step; the layer matmul
# kernel). Stage 2: the prefill-heavy row, a sampled row (the split sampler's path), a grammar A/B (late bitmasks),
# the layer matmul's tiles, a CUDA-graph experiment and the other kernel tests. Each part has its own time limit, so one that hangs leaves the
# others their time. Output: each part's log and JSON in $OUT (or benchmarks/results/device/ without $OUT). The GGUF
# Pallas matmul's timing (benchmarks/gpu_qmatmul.py) ran on an H200 on 2026-11-27
# (benchmarks/results/device_h200_20261127/) and is left out.
#
# The card's image has JAX, flax, transformers and torch but not pydantic, gguf or llguidance: carry them as wheels.
# Here, once, in the repository's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 gguf==0.19.0 llguidance==1.9.1
# then call the device tool with carry [".whl"] and the command `bash benchmarks/device_checks.sh 1` (then 2).
set -u
cd "$(dirname "$0")/.."
STAGE=${1:-1}
# The device tool brings back at most 8 files from $OUT: there the logs gather in a folder of their own and $OUT
# gets one archive of it, rewritten after each part (so a run cut off by its limit still returns what it did).
OUT_DIR=${OUT:+/tmp/device_checks}
OUT_DIR=${OUT_DIR:-benchmarks/results/device}
mkdir -p "$OUT_DIR"
pack() {
  if [ -n "${OUT:-}" ]; then
    tar czf /tmp/stage.tar.gz -C "$OUT_DIR" . && mv /tmp/stage.tar.gz "$OUT/stage$STAGE.tar.gz"
  fi
}
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
  pack
}

GPU_TPUT="python3 benchmarks/gpu_throughput.py --lazy-compile --log-compiles"
NO_PREALLOC="XLA_PYTHON_CLIENT_PREALLOCATE=false"  # pytest workers share the card (the throughput rows do not)
if [ "$STAGE" = 1 ]; then
  # 1a. the kernels that no card has run: the layer matmul reading a stacked weight in place (bf16, and int8 per
  #     channel), the W8A8 kernel (int8 tensor cores), on the card against XLA's dot and the float64 references; -v
  #     logs each result as it comes, so a cut-off run says what passed
  part new_kernels 75 env $NO_PREALLOC python3 -m pytest -o addopts= -v -n 4 -p no:cacheprovider \
    tests/kernels/test_gpu_w8a8.py tests/kernels/test_gpu_matmul.py tests/kernels/test_gpu_qmatmul.py
  # 1b. issues #29 (decode step against its device time and by host part, output tok/s, the costliest device ops)
  #     and #30 (fp8 KV + int8 weights against bf16 on Llama-3-8B, workload D). Shapes compile when first used
  #     (~12 per row, 2-10 s each on an H200), each compile's time logged; no new row after 170 s; the JSON is
  #     written after each row, so a row cut off by the limit loses only itself. No HF peers (a call of their own:
  #     `--models 8b --workloads P`).
  part throughput 280 $GPU_TPUT --rows 1b:D:bf16 8b:D:bf16 8b:D:fp8kv+int8 --budget-s 170 \
    --out "$OUT_DIR/gpu_throughput.json"
  # 1c. the A/Bs: the 1B decode row with the sampler inside the step (its conditionals made the host wait for the
  #     device every step), the 8B one with XLA's GEMM of the sliced layer (benchmarks/gpu_step_hlo.py shows it
  #     copying each layer's weights first)
  part fused_sampler 75 $GPU_TPUT --rows 1b:D:bf16 --fused-sampler --out "$OUT_DIR/gpu_throughput_fused_sampler.json"
  part xla_layer_matmul 75 $GPU_TPUT --rows 8b:D:bf16 --xla-layer-matmul \
    --out "$OUT_DIR/gpu_throughput_xla_layer_matmul.json"
else
  # 2a. the prefill-heavy workload (#29: >= 50% of the card's bf16 peak), then the 1B decode row sampled as a chat
  #     client samples (every step runs the split sampler: queued after the next step is laid out)
  part prefill 110 $GPU_TPUT --rows 8b:P:bf16 --out "$OUT_DIR/gpu_throughput_prefill.json"
  part sampled 70 $GPU_TPUT --rows 1b:D:bf16 --sampling top_p --out "$OUT_DIR/gpu_throughput_sampled.json"
  # 2b. a grammar on every request (a regex's bitmask each step): late bitmasks (computed while the step's model
  #     runs) against the synchronous loop they replace
  part grammar 70 $GPU_TPUT --rows 1b:D:bf16 --sampling regex --out "$OUT_DIR/gpu_throughput_grammar.json"
  part grammar_sync 70 $GPU_TPUT --rows 1b:D:bf16 --sampling regex --sync-masks \
    --out "$OUT_DIR/gpu_throughput_grammar_sync.json"
  # 2c. the layer matmul kernel's tiles (reasoned, never tuned) against XLA's GEMM at Llama-3-8B's decode shapes
  part layer_matmul 70 python3 benchmarks/gpu_layer_matmul.py --rows 256 --shapes "8b gate/up" "8b down" "8b q/o" \
    "8b k/v" --tiles 128,128,64,8 64,256,64,8 128,64,64,4 --int8 --budget-s 50 --out "$OUT_DIR/gpu_layer_matmul.json"
  # 2d. the 1B decode row with the layer loop recorded as a CUDA graph (XLA's command buffers with WHILE, off by
  #     default): is the 1B step launch-bound?
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" \
    part command_buffers 70 $GPU_TPUT --rows 1b:D:bf16 --out "$OUT_DIR/gpu_throughput_command_buffers.json"
  # 2e. correctness on the card (passed on an H200 on 2026-11-27, so last): the paged attention kernel (bf16 and fp8
  #     pools), the quantized matmuls' fusion, the engine's step shapes
  part kernels 90 env $NO_PREALLOC python3 -m pytest -o addopts= -v -n 8 -p no:cacheprovider \
    tests/kernels/test_kernel_gpu.py tests/kernels/test_fp8_kernels.py tests/kernels/test_quant_fusion.py \
    tests/engine/test_step_shapes.py
  grep -cE " PASSED " "$OUT_DIR/kernels.log" | sed 's/^/   passed: /'
  grep -E " (FAILED|ERROR) " "$OUT_DIR/kernels.log" | head -n 20
fi
grep -hE " (FAILED|ERROR) " "$OUT_DIR"/new_kernels.log 2>/dev/null | head -n 20
pack
echo "done in ${SECONDS} s"
