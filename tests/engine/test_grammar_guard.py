"""Structured-output specs checked out of harm's way (issue #28): input limits before anything compiles, llguidance
in a worker process that may crash, time out or run out of memory without taking this process along, and the
engine's own matchers (offline `LLM`) built only from specs that passed. Every case here once killed the process
(SIGSEGV) or stalled it, or reached the engine's first step before failing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpaged import LLM, SamplingParams, client_json
from jaxpaged.engine import grammar_guard
from jaxpaged.engine.grammar_guard import (
    MAX_GRAMMAR_RULES,
    MAX_SPEC_CHARS,
    MAX_SPEC_DEPTH,
    MAX_SPEC_REFS,
    GrammarWorkers,
)
from jaxpaged.engine.structured_output import GrammarCache
from jaxpaged.sampling_params import StructuredOutputsParams
from tests.tiny_hf import EOS_ID, TINY_VOCAB, make_tiny_hf_model, make_tiny_tokenizer

EMPTY = "[^\\x00-\\U0010FFFF]"  # a regex with an empty language: llguidance compiles it; no token can start it


def defs_chain(n: int, link=lambda nxt: {"$ref": nxt}) -> dict:
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def object_link(nxt: str) -> dict:
    return {"type": "object", "properties": {"a": {"$ref": nxt}}, "required": ["a"]}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "a"\n'


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# ---- gate 1: input limits ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,message", [
    ({"json": defs_chain(3000)}, "$refs"),
    ({"json": json.dumps(defs_chain(3000))}, "$refs"),
    ({"json": {"$defs": {f"d{i}": {"type": "string"} for i in range(600)}}}, "definitions"),
    ({"json": nested(10_000)}, "nested"),  # a dict 20,000 levels deep: refused without recursing into it
    ({"json": "[" * 100_000 + "]" * 100_000}, "characters"),
    ({"json": "[" * 5000 + "]" * 5000}, "nested"),
    ({"json": '{"type": NaN}'}, "not valid JSON"),
    ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, "characters"),
    ({"grammar": lark_chain(3000)}, "rules"),
    ({"grammar": "start: r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(MAX_GRAMMAR_RULES))}, "rules"),
    ({"choice": ["x" * 1000] * 200}, "characters"),
])
def test_specs_beyond_the_limits_are_refused_before_anything_compiles(spec, message):
    workers = grammar_guard.workers()
    compiles = workers.compiles
    field = f"structured_outputs.{next(iter(spec))}"
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        StructuredOutputsParams(**spec)
    assert str(e.value).startswith(field)
    assert workers.compiles == compiles  # never reached llguidance


def test_specs_at_the_limits_compile():
    StructuredOutputsParams(json=defs_chain(MAX_SPEC_REFS - 1))
    StructuredOutputsParams(json=nested(MAX_SPEC_DEPTH // 2 - 1))
    StructuredOutputsParams(grammar=lark_chain(100))


def test_client_json_turns_every_failure_into_a_value_error_naming_the_field():
    for text in ("[" * 5000 + "]" * 5000, "[" * 100 + "]" * 100, "{", "NaN", "\"\\ud800", b"\xff"):
        with pytest.raises(ValueError, match=r"^messages\.0\.x "):
            client_json.loads(text, "messages.0.x")
    assert client_json.loads('{"a": [1, {"b": null}]}', "f") == {"a": [1, {"b": None}]}
    assert client_json.depth([[[]]], 64) == 3 and client_json.depth(7, 64) == 0


# ---- gate 2: the worker process ----------------------------------------------------------------------------------

def test_a_spec_that_crashes_the_compiler_is_refused_and_this_process_lives():
    """A chain of object references within every limit still overflows the worker's small stack: the worker dies
    (SIGSEGV), the spec gets a ValueError naming its field, the next spec is served by a fresh worker."""
    workers = grammar_guard.workers()
    restarts = workers.restarts
    with pytest.raises(ValueError, match=r"^structured_outputs\.json .*too complex"):
        StructuredOutputsParams(json=defs_chain(250, object_link))
    assert workers.restarts == restarts + 1
    with pytest.raises(ValueError, match="too complex"):  # the same spec again: answered from the cache
        StructuredOutputsParams(json=defs_chain(250, object_link))
    assert workers.restarts == restarts + 1
    StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})


def test_the_same_chain_compiled_in_process_would_have_killed_it():
    """What the worker takes for us: llguidance run directly on this spec kills its process."""
    code = ("import json, sys; from llguidance import LLMatcher; "
            "g = LLMatcher.grammar_from_json_schema(json.loads(sys.stdin.read())); "
            "LLMatcher.validate_grammar_with_warnings(g)")
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(defs_chain(4000)), text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == -11  # SIGSEGV


def test_a_spec_that_outlasts_the_timeout_is_refused_and_the_worker_replaced():
    workers = GrammarWorkers(num_workers=1, timeout_s=30)
    try:
        assert workers.grammar("f", "grammar", 'start: "yes" | "no"')  # a warm worker: the timeout is the compile's
        workers.timeout_s = 0.05
        slow = "start: " + " | ".join(f'"{i}"' for i in range(15_000))  # about 0.4 s to compile here
        with pytest.raises(ValueError, match=r"^structured_outputs\.grammar .*more than 0.05 s"):
            workers.grammar("structured_outputs.grammar", "grammar", slow)
        assert workers.restarts == 1
        workers.timeout_s = 30
        assert workers.grammar("f", "grammar", 'start: "maybe"')
        assert workers.restarts == 1
    finally:
        workers.close()


def test_workers_run_with_an_address_space_limit_and_a_small_stack():
    workers = GrammarWorkers(num_workers=1, memory_bytes=512 * 2**20)
    try:
        workers.grammar("f", "regex", "[a-z]+")
        (worker,) = workers._idle
        limits = Path(f"/proc/{worker.proc.pid}/limits").read_text()
        assert re.search(r"Max address space\s+536870912\s+536870912", limits), limits
        cmd = Path(f"/proc/{worker.proc.pid}/cmdline").read_text().split("\0")
        assert int(cmd[3]) == grammar_guard.worker_stack_bytes() <= 2 * 2**20
    finally:
        workers.close()
    assert worker.proc.poll() is not None  # closed: no process left behind


def test_a_grammar_with_no_first_token_is_refused_against_the_tokenizer():
    """It compiles and validates on its own; the engine's first step would have failed on it."""
    StructuredOutputsParams(regex=EMPTY)
    cache = GrammarCache(make_tiny_tokenizer(), TINY_VOCAB, [EOS_ID])
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex .*no first token") as e:
        cache.matcher("regex", EMPTY)
    assert "<state>" not in str(e.value) and len(str(e.value)) < 300
    with pytest.raises(ValueError, match="Token range end too large"):
        cache.matcher("grammar", "start: <[100000]>")
    assert cache.matcher("regex", "[ab]+") is not None


# ---- the engine (offline LLM) ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    return LLM(path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128, block_size=16,
               num_blocks=64, precompile=False, show_progress=False)


def test_the_engine_refuses_a_crashing_spec_before_queueing_and_serves_the_next(llm):
    """The engine builds matchers from (kind, spec) itself: through the same checked path."""
    engine = llm.engine
    with pytest.raises(ValueError, match="too complex"):
        engine.grammars.matcher("json", json.dumps(defs_chain(250, object_link)))
    with pytest.raises(ValueError, match="no first token"):
        engine.add_request("r0", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            regex=EMPTY)))
    assert not engine.has_unfinished_requests()
    out = llm.generate(["hello"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"])), use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")


def test_a_grammar_that_fails_while_generating_fails_its_own_request_with_a_short_error(llm):
    midway = f'start: "abcdefghij" x\nx: /{EMPTY}/'
    failing = SamplingParams(max_tokens=30, temperature=0,
                             structured_outputs=StructuredOutputsParams(grammar=midway))
    fine = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine = llm.engine
    engine.add_request("bad", [5, 6, 7], failing)
    engine.add_request("good", [5, 6, 8], fine)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    bad = outs["bad"][-1]
    assert bad.error is not None and bad.error.startswith("GrammarError: ") and "<state>" not in bad.error
    assert len(bad.error) < 300, bad.error
    assert all(o.error is None for o in outs["good"]) and outs["good"][-1].finished
    assert sum(len(d.token_ids) for o in outs["good"] for d in o.deltas) == 30
    assert engine.stats()["num_used"] == 0  # the failed request's blocks are back too
    # and its grammar's template left the cache (the lexer states its matchers built, up to ~75 MiB, with it)
    compiles = engine.grammars.compiles
    engine.grammars.matcher("grammar", midway)
    assert engine.grammars.compiles == compiles + 1


def test_a_token_mask_over_the_cpu_limit_fails_its_own_request_and_the_rest_go_on(llm, monkeypatch):
    """The engine computes a step's masks on its own thread: one that takes more than MAX_MASK_CPU_S would stall
    every request (an ambiguous grammar's masks grow with its output), so it fails its request. The limit is set
    below any mask's time here; the plain request beside it keeps its tokens."""
    from jaxpaged.engine import grammar_worker

    engine = llm.engine
    fine = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate([[5, 6, 8]], fine, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(grammar_worker, "MAX_MASK_CPU_S", -1.0)
    engine.add_request("slow", [5, 6, 7], SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(
        regex="[ab]+")))
    engine.add_request("good", [5, 6, 8], fine)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    error = outs["slow"][-1].error
    assert error is not None and error.startswith("GrammarError: structured output: a token mask took"), error
    assert "over the limit of -1000 ms" in error
    assert [t for o in outs["good"] for d in o.deltas for t in d.token_ids] == alone
    assert engine.stats()["num_used"] == 0


def test_a_first_token_mask_over_the_cpu_limit_is_refused(monkeypatch):
    """The worker computes a grammar's first mask before the request is queued: over the limit, a ValueError (the
    server's 400) instead of a stalled step."""
    from llguidance import LLTokenizer

    from jaxpaged.engine import grammar_worker
    from jaxpaged.engine.structured_output import grammar, tokenizer_json

    tokenizer = LLTokenizer(tokenizer_json(make_tiny_tokenizer()), n_vocab=TINY_VOCAB, eos_token=[EOS_ID])
    g = grammar("regex", "[ab]+")
    grammar_worker.check_matcher(tokenizer, g)
    monkeypatch.setattr(grammar_worker, "MAX_MASK_CPU_S", -1.0)
    with pytest.raises(ValueError, match="^its first token mask took .* ms of CPU time, over the limit of -1000 ms"):
        grammar_worker.check_matcher(tokenizer, g)
