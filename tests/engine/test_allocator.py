"""The entry points' allocator (jaxpaged/allocator.py): a program that calls use_tcmalloc() runs on, same pid and
same arguments, with tcmalloc loaded where it is installed; JAXPAGED_MALLOC=system keeps glibc's; a bad value is an
error naming the variable. The server started by tests/server/test_server.py is checked there too."""

import json
import os
import subprocess
import sys

import pytest

from jaxpaged.runtime.tcmalloc import tcmalloc_path

PROGRAM = """
import json, os, sys
from jaxpaged.runtime.tcmalloc import tcmalloc_loaded, use_tcmalloc
use_tcmalloc()
print(json.dumps({"pid": os.getpid(), "argv": sys.argv, "loaded": tcmalloc_loaded(), "optimize": sys.flags.optimize}))
"""


def run(env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "JAXPAGED_MALLOC")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-O", "-c", PROGRAM, *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(tcmalloc_path() is None, reason="tcmalloc is not installed here (libtcmalloc-minimal4)")
def test_a_program_is_re_executed_once_with_tcmalloc_and_its_arguments():
    proc = run({}, "a b", "--flag")
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()  # the program ran to its end once
    out = json.loads(line)
    assert out["loaded"] is True
    assert out["argv"] == ["-c", "a b", "--flag"] and out["optimize"] == 1  # interpreter options kept
    assert "large alloc" not in proc.stderr


def test_system_keeps_glibc_malloc_and_a_bad_value_names_the_variable():
    proc = run({"JAXPAGED_MALLOC": "system"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["loaded"] is False
    proc = run({"JAXPAGED_MALLOC": "jemalloc"})
    assert proc.returncode != 0 and "JAXPAGED_MALLOC" in proc.stderr and "jemalloc" in proc.stderr
