"""Screenshot of the watch page (GET /) mid-generation, for README: a real server.py on a real model (default: the
embedded SmolLM2-135M-Instruct), several chat clients streaming beside the page's own chat, headless Chromium.

    .venv/bin/python benchmarks/pool_page.py [--model PATH] [--out benchmarks/results/pool_page.png]

Needs Debian's chromium + chromium-driver and selenium (tests/server/test_pool_page.py installs Chromium when missing).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server.harness import Server  # noqa: E402
from tests.server.test_pool_page import KEY, QUESTIONS, SYSTEM, read_page  # noqa: E402

NAME = "SmolLM2-135M-Instruct"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--kv-cache-memory", default="48MiB", help="small, so that a few chats fill a visible share")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pool_page.png"))
    args = p.parse_args()
    from selenium import webdriver

    from jaxpaged.loader import default_model_path

    log = Path("/tmp/pool_page_server.log")
    # The flags after the model override the tiny-model defaults of tests' Server (pool size, context).
    srv = Server(Path(args.model or default_model_path()), log, "--api-key", KEY, "--max-model-len", "1024",
                 "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", "16",
                 "--served-model-name", NAME, startup_timeout=600)
    stop = threading.Event()
    client = srv.client(KEY)

    def chat(question: str, n: int, delay: float) -> None:
        time.sleep(delay)
        while not stop.is_set():
            stream = client.chat.completions.create(
                model=NAME, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                max_tokens=400, n=n, temperature=0.8, stream=True)
            for _ in stream:
                if stop.is_set():
                    stream.close()
                    break

    threads = [threading.Thread(target=chat, args=(q, 3 if i == 0 else 1, 1.0 * i), daemon=True)
               for i, q in enumerate(QUESTIONS)]
    options = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,860",
              "--force-device-scale-factor=1"):
        options.add_argument(a)
    driver = webdriver.Chrome(options=options)
    try:
        driver.get(srv.url + "/")
        time.sleep(1.0)
        driver.find_element("id", "api-key").send_keys(KEY)
        driver.find_element("id", "save-key").click()
        for t in threads:
            t.start()
        time.sleep(8)
        driver.find_element("id", "prompt").send_keys("Describe a lighthouse at night in three sentences.")
        driver.find_element("id", "send").click()
        deadline = time.time() + 300
        while time.time() < deadline:
            page = read_page(driver)
            answer = page["answer"] or {"text": "", "done": False}
            if answer["done"] or len(answer["text"]) > 220 and len(page["requests"]) >= 4:
                break
            time.sleep(0.2)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(args.out)
        print(f"saved {args.out}: {page['counts']}, {len(page['requests'])} requests holding blocks")
    finally:
        stop.set()
        driver.quit()
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
