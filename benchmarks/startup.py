"""Start-up of the default model: how many step shapes the engine compiles and how long that takes, cold.

`LLM()` in a fresh process (no persistent compilation cache: the library turns it on only when asked), the engine's
own `startup_times` (setup, compile) and its shape count, beside the same in other checkouts (`--checkout DIR`,
each its own process with DIR's jaxpaged), one after another in this one run.

    .venv/bin/python benchmarks/startup.py
    .venv/bin/python benchmarks/startup.py --checkout /path/to/other/worktree   # before / after, same run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import RESULTS_DIR, cpu_name, print_table, write_json  # noqa: E402

MEASURE = """
import json, time
t0 = time.perf_counter()
from jaxpaged import LLM
llm = LLM(show_progress=False)
print(json.dumps({"shapes": len(llm.engine.runner.all_shapes()), "setup_s": llm.engine.startup_times["setup_s"],
                  "compile_s": llm.engine.startup_times["compile_s"], "llm_s": time.perf_counter() - t0}))
"""


def measure(checkout: str) -> dict:
    """The start-up of `checkout`'s jaxpaged, in a process of its own (cwd and PYTHONPATH the checkout)."""
    env = {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run([sys.executable, "-c", MEASURE], cwd=checkout, env=env, capture_output=True, text=True,
                         check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True,
                            text=True).stdout.strip()
    return {"checkout": checkout, "commit": commit, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", default=[], help="another checkout to measure in the same run")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "startup.json"))
    args = ap.parse_args()
    rows = []
    for checkout in [ROOT, *args.checkout]:
        t0 = time.perf_counter()
        rows.append(measure(os.path.abspath(checkout)))
        print(f"{checkout}: {rows[-1]} ({time.perf_counter() - t0:.0f} s with the process)", flush=True)
    print(f"\n{cpu_name()}; the default model, LLM() cold")
    print_table(rows, [("commit", "commit", ""), ("shapes", "step shapes", "d"), ("setup_s", "setup s", ".1f"),
                       ("compile_s", "compile s", ".1f"), ("llm_s", "LLM() s", ".1f")])
    write_json(args.out, {"cpu": cpu_name(), "rows": rows})


if __name__ == "__main__":
    main()
