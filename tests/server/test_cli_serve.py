"""`jaxpaged serve`: the server ships in the package (issue #32). Its flags are server.py's (every EngineConfig field
among them), and a wheel installed into a fresh virtual environment serves /health and a chat completion with no
checkout on the path."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from jaxpaged.engine.setup import EngineConfig
from jaxpaged.entrypoints import cli
from jaxpaged.entrypoints.openai import api_server
from tests import ROOT
from tests.server.harness import free_port, get, post
from tests.tiny_hf import make_tiny_hf_model

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")


def _help(run, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        run()
    assert e.value.code == 0
    return capsys.readouterr().out


def test_serve_help_lists_every_engine_flag_and_the_flags_of_server_py(capsys):
    serve_help = _help(lambda: cli.main(["serve", "--help"]), capsys)
    server_help = _help(lambda: api_server.parse_args(["--help"]), capsys)
    engine_flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig)}
    serve_flags = set(FLAG.findall(serve_help))
    assert engine_flags <= serve_flags, f"missing engine flags: {sorted(engine_flags - serve_flags)}"
    assert {"--port", "--host", "--api-key", "--served-model-name", "--shutdown-grace"} <= serve_flags
    assert serve_flags == set(FLAG.findall(server_help))  # the same flags as server.py
    assert "usage: jaxpaged serve" in serve_help and "[model]" in serve_help


def test_serve_takes_the_model_as_an_argument_or_a_flag_but_not_two_models(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda args: seen.append(args) or 0)
    assert cli.main(["serve", "some/model", "--port", "9", "--max-num-seqs", "3"]) == 0
    assert cli.main(["serve", "--model", "other/model"]) == 0
    assert cli.main(["serve", "same", "--model", "same"]) == 0
    assert [a.model for a in seen] == ["some/model", "other/model", "same"]
    assert (seen[0].port, seen[0].max_num_seqs) == (9, 3)
    # the server's own defaults apply, as with server.py
    assert seen[1].max_decode_slowdown == api_server.SERVER_MAX_DECODE_SLOWDOWN
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "one", "--model", "two"])
    assert e.value.code == 2 and "two models: 'one' and --model 'two'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--write-timeout", "0"])
    assert e.value.code == 2 and "--write-timeout must be > 0" in capsys.readouterr().err


def test_the_entry_points_turn_the_compilation_cache_on_and_keep_an_explicit_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXPAGED_COMPILATION_CACHE", str(tmp_path / "env"))
    args = api_server.parse_args([])
    cli.use_compilation_cache(args)
    assert args.compilation_cache_dir == str(tmp_path / "env")
    args = api_server.parse_args(["--compilation-cache-dir", str(tmp_path / "mine")])
    cli.use_compilation_cache(args)
    assert args.compilation_cache_dir == str(tmp_path / "mine")


def _copy_source(dest: Path) -> Path:
    """The files a wheel is built from, without the checkout's build/ or egg-info leftovers."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build", "*.egg-info")
    for name in ("jaxpaged", "pallas_kernels"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    return dest


def test_a_wheel_installed_in_a_fresh_venv_serves_health_and_a_chat_completion(tmp_path):
    """`pip install` of the package into a new venv, then `jaxpaged serve <model dir>` run from outside any checkout:
    the server, its page and py.typed come from the installed wheel. The venv reaches the dependencies (jax, ...)
    through a path entry to this interpreter's site-packages, so nothing is downloaded; the wheel is built here with
    this interpreter's setuptools, as `pip install .` would build it."""
    src = _copy_source(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, cwd=tmp_path, timeout=300)
    wheel, = (tmp_path / "dist").glob("jaxpaged-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([venv / "bin" / "python", "-c", purelib], check=True, capture_output=True,
                               text=True).stdout.strip())
    # A plain path line, after the venv's own site-packages: this environment's .pth files (an editable jaxpaged)
    # are not processed through it, so `import jaxpaged` can only find the installed wheel.
    (site / "_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([venv / "bin" / "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   cwd=tmp_path, timeout=300)
    found = subprocess.run([venv / "bin" / "python", "-c", "import jaxpaged, pathlib; p = pathlib.Path("
                            "jaxpaged.__file__).parent; print(p); print((p / 'py.typed').is_file(), "
                            "(p / 'entrypoints/openai/static/index.html').is_file())"],
                           cwd=tmp_path, check=True, capture_output=True, text=True).stdout.split()
    assert found[0].startswith(str(site)) and found[1:] == ["True", "True"], found

    model = make_tiny_hf_model(tmp_path / "tiny", "llama")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed below)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([venv / "bin" / "jaxpaged", "serve", model, "--port", str(port), "--dtype", "float32",
                             "--no-precompile", "--max-model-len", "128", "--kv-cache-memory", "4MiB",
                             "--compilation-cache-dir", str(tmp_path / "xla")],
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if get(f"{url}/health") == (200, {"status": "ok"}):
                    break
            except OSError:
                time.sleep(0.5)
        status, body = post(f"{url}/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "ignore_eos": True,
                                                           "messages": [{"role": "user", "content": "Hello"}]})
        assert status == 200, body
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] == 4
        with urllib.request.urlopen(f"{url}/") as page:  # the page is package data
            assert page.status == 200 and b"<html" in page.read().lower()
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        assert json.loads(urllib.request.urlopen(f"{url}/version").read())["version"] == version  # its metadata
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert any((tmp_path / "xla").iterdir()), "the entry point's compilation cache was not written"
