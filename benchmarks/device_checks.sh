#!/usr/bin/env bash
# Every check that needs a GPU, in two calls of a lent H100 / H200 (a session has 15 minutes of device time, one
# command at most 10, ~30 s to start a machine):
#   bash benchmarks/device_checks.sh 1    # timeout_s 600: at most ~9 minutes (its parts' limits)
#   bash benchmarks/device_checks.sh 2    # with what is left (~5 minutes): its parts in order of value, so a
#                                         # limit cuts the least useful
# Stage 1, what the latest changes need first: the GPU matmul kernels' tests, then issue #29's decode rows and their
# A/B with the layer loop unrolled (the lever the H200 run of 2026-11-27 22:30 pointed at). Stage 2: issue #30's
# row, a grammar A/B (late bitmasks), the prefill-heavy row, the top-p threshold's sort against its bisection and the
# other kernel tests. Measured before and left out:
# the split sampler against the fused one, the layer kernel against XLA's sliced GEMM, CUDA-graph command buffers,
# the layer matmul's tiles (benchmarks/results/device_h200_20261127_2230/), the GGUF Pallas matmul
# (benchmarks/results/device_h200_20261127/). Each part has its own time limit, so one that hangs leaves the others
# their time. Output: each part's log and JSON, under $OUT as one archive per stage (or in benchmarks/results/device/
# without $OUT).
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
  # 1a. the GPU matmul kernels' tests (the W8A8 kernel's product and activations checked apart since its failures on
  #     the H200 of 2026-11-27 22:30; the per-channel kernel's float32 comparison at full precision); -v logs each
  #     result as it comes, so a cut-off run says what passed
  part new_kernels 60 env $NO_PREALLOC python3 -m pytest -o addopts= -v -n 4 -p no:cacheprovider \
    tests/kernels/test_gpu_w8a8.py tests/kernels/test_gpu_matmul.py tests/kernels/test_gpu_qmatmul.py
  # 1b. issue #29's decode rows, the baseline of 1c on the same card. Shapes compile when first used, each
  #     compile's time logged; no new row after --budget-s; the JSON is written after each row.
  part throughput 140 $GPU_TPUT --rows 8b:D:bf16 1b:D:bf16 --budget-s 80 --out "$OUT_DIR/gpu_throughput.json"
  # 1c. the A/B that may close #29's throughput goals: decode-sized steps with the layer loop unrolled, XLA's own
  #     GEMMs reading static slices of the stacked weights in place (XLA's GEMM of a weight of its own ran 1.5-3x
  #     faster than the layer kernel at Llama-3-8B's decode products on the H200). Its compile grows with depth
  #     (deviceless here: 8x the rolled step's at 8B), so its compile times in the log matter as much as tok/s.
  part unrolled 330 $GPU_TPUT --rows 8b:D:bf16 1b:D:bf16 --unrolled-layers --budget-s 220 \
    --out "$OUT_DIR/gpu_throughput_unrolled.json"
else
  # 2a. issue #30's row: fp8 KV + int8 weights (now gpu_qmatmul.py's weight-only kernel), against stage 1's 8b bf16
  part fp8kv_int8 140 $GPU_TPUT --rows 8b:D:fp8kv+int8 --out "$OUT_DIR/gpu_throughput_fp8kv_int8.json"
  # 2b. what XLA's own GEMMs make of int8 weights stored signed (bf16 activations; int8 per-row activations on the
  #     int8 tensor cores) against bf16's and the kernels', at Llama-3-8B's MLP products: the way to #30's 1.3x?
  part int8_matmul 70 python3 benchmarks/gpu_layer_matmul.py --rows 256 --shapes "8b gate/up" "8b down" --int8 \
    --budget-s 45 --out "$OUT_DIR/gpu_layer_matmul_int8.json"
  # 2c. a grammar on every request (a regex's bitmask each step): late bitmasks (computed while the step's model
  #     runs) against the synchronous loop they replace
  part grammar 70 $GPU_TPUT --rows 1b:D:bf16 --sampling regex --out "$OUT_DIR/gpu_throughput_grammar.json"
  part grammar_sync 70 $GPU_TPUT --rows 1b:D:bf16 --sampling regex --sync-masks \
    --out "$OUT_DIR/gpu_throughput_grammar_sync.json"
  # 2d. the prefill-heavy workload (#29: >= 50% of the card's bf16 peak; 44% of the data sheet's on 2026-11-27)
  part prefill 110 $GPU_TPUT --rows 8b:P:bf16 --out "$OUT_DIR/gpu_throughput_prefill.json"
  # 2e. the sampler's top-p threshold on the card: the sort GPUs run against the bisection CPUs ran (~2 ms of the
  #     H200's 6.6 ms sampled 1B step was the sort), 256 rows of Llama 3's vocabulary
  part top_p 45 python3 benchmarks/top_p.py --rows 256 --vocab 128256 --samples 3 --out "$OUT_DIR/top_p.json"
  # 2f. correctness on the card (passed on an H200 twice on 2026-11-27, so last): the paged attention kernel (bf16
  #     and fp8 pools), the quantized matmuls' fusion, the engine's step shapes
  part kernels 90 env $NO_PREALLOC python3 -m pytest -o addopts= -v -n 8 -p no:cacheprovider \
    tests/kernels/test_kernel_gpu.py tests/kernels/test_fp8_kernels.py tests/kernels/test_quant_fusion.py \
    tests/engine/test_step_shapes.py
  grep -cE " PASSED " "$OUT_DIR/kernels.log" | sed 's/^/   passed: /'
  grep -E " (FAILED|ERROR) " "$OUT_DIR/kernels.log" | head -n 20
fi
grep -hE " (FAILED|ERROR) " "$OUT_DIR"/new_kernels.log 2>/dev/null | head -n 20
pack
echo "done in ${SECONDS} s"
