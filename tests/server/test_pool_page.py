"""The watch page at / in a real browser: headless Chromium (Debian's `chromium` + `chromium-driver`, installed here
with apt-get when missing) drives it against a real `server.py` process with an API key, while other clients
stream beside it. It asks for the key, streams a chat answer that grows on screen, shows its request's blocks in
use while it runs, and shows them free or cached once every request has ended.

POOL_PAGE_SCREENSHOT=benchmarks/results/pool_page.png also saves the mid-generation screenshot there (README's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.server.harness import MODEL, Server
from tests.tiny_hf import make_tiny_hf_model

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

KEY = "page-key"
SYSTEM = "You are the keeper of a lighthouse on a rocky coast. Answer in the voice of an old sailor, briefly."
QUESTIONS = ["Which ships passed last night?", "How do you trim the lamp wick?", "What does the fog horn sound like?",
             "Tell me about the storm of '98."]


def _ensure_chromium() -> tuple[str, str]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("headless Chromium is missing and cannot be installed here: "
                    "apt-get install chromium chromium-driver (Debian) needs apt-get and root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.skip(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-500:]}")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("apt-get installed chromium but chromium / chromedriver are not on PATH")
    return chromium, driver


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium (the 'test' extra)")
    chromium, driver_path = _ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1440,900", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("tiny_model"), "llama")
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log", "--api-key", KEY, "--max-model-len",
                 "512", "--kv-cache-memory", "3MiB", "--max-num-seqs", "24")
    yield srv
    srv.stop()


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# What the page shows, read in one go (it redraws 4 times a second; elements found one by one would go stale).
_READ_PAGE = """
const num = (id) => Number(document.getElementById(id).textContent || 0);
const answers = document.querySelectorAll('.msg.assistant');
const last = answers[answers.length - 1];
return {
  counts: Object.fromEntries(['count-free', 'count-used', 'count-shared', 'count-cached', 'num-running']
                             .map((id) => [id, num(id)])),
  requests: Array.from(document.querySelectorAll('#requests li'))
                 .map((li) => ({mine: li.classList.contains('mine'), blocks: Number(li.dataset.blocks)})),
  answer: last ? {text: last.querySelector('.text').textContent, done: !!last.dataset.done,
                  error: last.classList.contains('error'), meta: (last.querySelector('.meta') || {}).textContent}
               : null,
};
"""


def read_page(driver) -> dict:
    return driver.execute_script(_READ_PAGE)


def counts(driver) -> dict[str, int]:
    return read_page(driver)["counts"]


def background_streams(server, stop: threading.Event) -> list[threading.Thread]:
    """Other users: chats sharing a system prompt (so a cached prefix), one with n=3 samples (shared blocks)."""
    client = server.client(KEY)

    def chat(question: str, n: int, delay: float):
        time.sleep(delay)
        while not stop.is_set():
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                max_tokens=240, n=n, temperature=1.0, stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                if stop.is_set():
                    stream.close()
                    break

    threads = [threading.Thread(target=chat, args=(q, 3 if i == 0 else 1, 0.3 * i), daemon=True)
               for i, q in enumerate(QUESTIONS)]
    for t in threads:
        t.start()
    return threads


def test_page_streams_a_chat_and_shows_its_blocks_used_then_released(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(server.url + "/")
    # The server has a key: the page says so and asks for it.
    key_box = wait_for(lambda: driver.find_element(By.ID, "key-box").is_displayed() and
                       driver.find_element(By.ID, "key-box"), 15, "the API-key field")
    key_box.find_element(By.ID, "api-key").send_keys(KEY)
    driver.find_element(By.ID, "save-key").click()
    wait_for(lambda: "max_model_len 512" in driver.find_element(By.ID, "model").text, 15, "the model's name")
    total = wait_for(lambda: sum(v for k, v in counts(driver).items() if k.startswith("count-")), 15, "the pool")
    assert counts(driver)["count-used"] == 0

    stop = threading.Event()
    others = background_streams(server, stop)
    try:
        wait_for(lambda: counts(driver)["num-running"] >= 3, 60, "the other clients' requests in the pool view")
        prompt = driver.find_element(By.ID, "prompt")
        max_tokens = driver.find_element(By.ID, "max-tokens")
        max_tokens.clear()
        max_tokens.send_keys("300")
        driver.find_element(By.ID, "ignore-eos").click()
        prompt.send_keys("Describe the lighthouse at night, lamp by lamp.")
        driver.find_element(By.ID, "send").click()

        wait_for(lambda: read_page(driver)["answer"], 10, "an answer bubble")
        lengths, mine_blocks, shot = [], [], None
        deadline = time.time() + 120
        while time.time() < deadline and not (page := read_page(driver))["answer"]["done"]:
            lengths.append(len(page["answer"]["text"]))
            mine = [r["blocks"] for r in page["requests"] if r["mine"]]
            if mine:
                mine_blocks.append(mine[0])
                if shot is None and lengths[-1] > 40 and len(page["requests"]) >= 4:
                    shot = tmp_path / "pool_page.png"
                    driver.save_screenshot(str(shot))
            time.sleep(0.05)
        answer = read_page(driver)["answer"]
        assert answer["done"], "the answer never finished"
    finally:
        stop.set()
        for t in others:
            t.join(60)
    text = answer["text"]
    assert not answer["error"], answer
    assert "length" in answer["meta"]  # all 300 tokens (ignore EOS)
    # the text grew on screen over time, not all at once (the page was read at several partial lengths; how many
    # depends on how fast the machine decodes beside the page's own polling)
    growing = sorted(set(n for n in lengths if 0 < n < len(text)))
    assert len(growing) >= 3, growing[:10]
    # while it ran, the pool view showed this page's request holding blocks
    assert mine_blocks and max(mine_blocks) >= 2, mine_blocks
    assert shot is not None, "never saw the page mid-generation beside the other requests"
    # once everything ended, no block is in use: each is free or a cached prefix
    final = wait_for(lambda: (p := read_page(driver))["counts"]["count-used"] == p["counts"]["count-shared"] == 0
                     and not p["requests"] and p["counts"], 30, "the pool to drain")
    assert final["count-free"] + final["count-cached"] == total and final["count-cached"] > 0
    target = os.environ.get("POOL_PAGE_SCREENSHOT")
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)
