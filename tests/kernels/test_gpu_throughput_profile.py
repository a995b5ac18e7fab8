"""benchmarks/gpu_throughput.py's reading of a profiler trace: the decode step's device time is the busiest device
line's, and its costliest operations are named from that line only (host lines and other streams left out). The
benchmark runs on a lent GPU, where a mistake here would cost a run's profile: these check it on a made-up trace."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_benchmark(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # as when run: its own folder first (common.py)
    spec = importlib.util.spec_from_file_location("gpu_throughput", os.path.join(ROOT, "benchmarks",
                                                                                 "gpu_throughput.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_throughput", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def trace() -> list[dict]:
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    compute = [{"ph": "X", "pid": 1, "tid": 7, "name": name, "dur": dur}
               for name, dur in [("fusion.3", 300), ("gemm_fusion.1", 900), ("fusion.3", 300), ("gemm_fusion.1", 900)]]
    copies = [{"ph": "X", "pid": 1, "tid": 8, "name": "memcpy", "dur": 500}]
    host = [{"ph": "X", "pid": 2, "tid": 1, "name": "gemm_fusion.1", "dur": 10_000}]
    return meta + compute + copies + host


HLO = """
  %fusion.3 = f32[256,128256]{1,0} fusion(%a), kind=kLoop, metadata={op_name="jit(step)/log_softmax"}
  %gemm_fusion.1 = bf16[256,8192]{1,0} fusion(%b, %c), kind=kCustom, metadata={op_name="jit(step)/mlp/dot"}
"""


def test_the_busiest_device_line_is_the_compute_stream(monkeypatch):
    bench = load_benchmark(monkeypatch)
    line = bench.busiest_device_line(trace())
    assert {(e["pid"], e["tid"]) for e in line} == {(1, 7)}
    assert sum(e["dur"] for e in line) == 2400


def test_a_trace_without_a_device_line_gives_nothing(monkeypatch):
    bench = load_benchmark(monkeypatch)
    assert bench.busiest_device_line([e for e in trace() if e["pid"] == 2]) == []


def test_the_costliest_operations_are_named_per_step_from_the_hlo(monkeypatch):
    bench = load_benchmark(monkeypatch)
    rows = bench.top_xla_ops(bench.busiest_device_line(trace()), HLO, calls=2, top=5)
    assert [r["op"] for r in rows] == ["gemm_fusion.1", "fusion.3"]
    assert rows[0]["ms_per_step"] == 0.9 and rows[0]["calls_per_step"] == 1
    assert rows[0]["shape"] == "bf16[256,8192]{1,0}" and rows[0]["op_name"] == "jit(step)/mlp/dot"


def test_decode_floors_follow_the_formats_bytes_and_the_larger_of_reading_and_multiplying(monkeypatch):
    """`decode_floor`: the matmuls take the longer of reading their weights and their FLOPs at the tensor cores'
    peak, the K/V read adds to it; int8 weights halve the weight read only (they multiply in bf16), an fp8 pool the
    K/V read only."""
    bench = load_benchmark(monkeypatch)
    config = bench.SHAPES["8b"]
    floors = {fmt: bench.decode_floor(config, fmt, "H200", 256, 416.0) for fmt in bench.FORMATS}
    bf16 = floors["bf16"]
    assert floors["int8"]["weights_ms"] == bf16["weights_ms"] / 2 and floors["int8"]["kv_ms"] == bf16["kv_ms"]
    assert floors["int8"]["matmul_flops_ms"] == bf16["matmul_flops_ms"]  # multiplied in bf16
    assert floors["fp8kv"]["kv_ms"] == bf16["kv_ms"] / 2 and floors["fp8kv"]["weights_ms"] == bf16["weights_ms"]
    assert floors["fp8kv"]["matmul_flops_ms"] == bf16["matmul_flops_ms"]
    for f in floors.values():
        assert f["floor_ms"] == max(f["weights_ms"], f["matmul_flops_ms"]) + f["kv_ms"]
    one = bench.decode_floor(config, "bf16", "H200", 1, 416.0)
    assert one["weights_ms"] > one["matmul_flops_ms"]  # one sequence: reading the weights bounds it
    assert bf16["matmul_flops_ms"] > bf16["weights_ms"]  # 256 on an H200: the products do
