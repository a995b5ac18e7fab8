"""Bad input gets a clear error naming the problem, and the engine keeps serving afterwards with no leak."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import parse_bytes
from tests.tiny import random_params, tiny_config

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def llm():
    return LLM.from_params(CONFIG, random_params(CONFIG), None, dtype="float32", max_num_seqs=4,
                           max_num_batched_tokens=64, max_model_len=64, block_size=8, num_blocks=40, precompile=False,
                           show_progress=False)


def still_serves(llm):
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1
    s = llm.stats()
    assert s["num_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
    assert not llm.engine.requests


def tokenizer_llm(chat_template: str | None = None, tok=None) -> tuple[LLM, object]:
    """An LLM of random weights with the tiny HF tokenizer (or `tok`), given this chat template; and the tokenizer."""
    from tests.tiny_hf import TINY_VOCAB, make_tiny_tokenizer

    tok = tok or make_tiny_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    config = tiny_config(vocab_size=TINY_VOCAB)
    return LLM.from_params(config, random_params(config), tok, max_model_len=64, block_size=8, num_blocks=40,
                           precompile=False, show_progress=False), tok


def test_prompt_longer_than_the_context(llm):
    with pytest.raises(ValueError, match="longer than the context.*max_model_len=64"):
        llm.generate([{"prompt_token_ids": [3] * 64}], use_tqdm=False)
    still_serves(llm)


def test_bad_prompt_in_a_batch_rejects_the_batch_and_leaks_nothing(llm):
    with pytest.raises(ValueError, match="longer than the context"):
        llm.generate([{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [3] * 100}], use_tqdm=False)
    still_serves(llm)


def test_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        llm.generate([{"prompt_token_ids": [3, 96]}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)
    still_serves(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p"),
    ({"n": 0}, "n"), ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"), ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, error, field", [
    # wrong types: refused, never converted
    ({"n": 2.5}, TypeError, "n"), ({"seed": 1.5}, TypeError, "seed"), ({"logprobs": 2.5}, TypeError, "logprobs"),
    ({"max_tokens": 3.5}, TypeError, "max_tokens"), ({"max_tokens": True}, TypeError, "max_tokens"),
    ({"top_k": 2.0}, TypeError, "top_k"), ({"temperature": "0.5"}, TypeError, "temperature"),
    ({"stop": [b"x"]}, TypeError, "stop"), ({"stop": 5}, TypeError, "stop"),
    ({"stop_token_ids": ["a"], "min_tokens": 1}, TypeError, "stop_token_ids"),
    ({"stop_token_ids": [True]}, TypeError, "stop_token_ids"), ({"ignore_eos": "yes"}, TypeError, "ignore_eos"),
    # integers past what the device batch holds, and floats that are not finite
    ({"top_k": 2**31}, ValueError, "top_k"), ({"top_k": 2**40}, ValueError, "top_k"),
    ({"top_k": 2**70}, ValueError, "top_k"), ({"stop_token_ids": [1099511627776]}, ValueError, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, ValueError, "stop_token_ids"), ({"max_tokens": 2**31}, ValueError, "max_tokens"),
    ({"seed": 2**63}, ValueError, "seed"), ({"seed": -1}, ValueError, "seed"), ({"n": 10**6}, ValueError, "n"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"temperature": float("inf")}, ValueError, "temperature"), ({"top_p": float("nan")}, ValueError, "top_p"),
    ({"min_p": float("inf")}, ValueError, "min_p"), ({"stop": ["s"] * 17}, ValueError, "stop"),
    ({"output_kind": 3}, ValueError, "output_kind"), ({"output_kind": "delta"}, TypeError, "output_kind"),
])
def test_sampling_params_refuse_wrong_types_and_unbounded_values(kwargs, error, field):
    with pytest.raises(error, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_keep_good_values():
    p = SamplingParams(n=3, temperature=1, top_k=2**31 - 1, stop="x", stop_token_ids=(4, 5), seed=2**63 - 1)
    assert p.temperature == 1.0 and isinstance(p.temperature, float) and p.stop == ["x"]
    assert p.stop_token_ids == [4, 5] and p.top_k == 2**31 - 1
    assert SamplingParams(temperature=1e-300).greedy  # would overflow logits / temperature


def test_token_ids_beyond_the_vocabulary_are_refused_before_queueing(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 96\)"):
        llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(stop_token_ids=[96], min_tokens=1),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(stop_token_ids=[500]), use_tqdm=False)
    still_serves(llm)


@pytest.mark.parametrize("prompt, field", [
    ({"prompt_token_ids": None}, "prompt_token_ids"), ({"prompt_token_ids": "123"}, "prompt_token_ids"),
    ({"prompt_token_ids": [3.0, 4]}, "prompt_token_ids"), ({"prompt_token_ids": [True, 4]}, "prompt_token_ids"),
    ([3, 4.7], "prompt"), ({"prompt": 5}, "prompt"), (3, "prompt"),
])
def test_bad_prompt_types_reject_the_whole_batch(llm, prompt, field):
    """The good prompt before the bad one is not left queued holding blocks."""
    with pytest.raises(TypeError, match=field):
        llm.generate([{"prompt_token_ids": [3, 4, 5]}, prompt], use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.scheduler.waiting
    still_serves(llm)


def test_sampling_params_of_the_wrong_kind_are_named(llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams.*'greedy'"):
        llm.generate([{"prompt_token_ids": [3, 4]}], "greedy", use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate([{"prompt_token_ids": [3, 4]}], [{"temperature": 0}], use_tqdm=False)
    still_serves(llm)


def test_a_request_that_fails_in_a_step_fails_alone_and_the_llm_goes_on(llm, monkeypatch):
    """A row the host cannot lay out fails its own request; the LLM raises, leaves nothing queued, serves on."""
    real_prepare = llm.engine.runner.prepare

    def prepare(out, *args):
        if any(s.prompt_token_ids[0] == 9 for s in out.seqs):
            raise OverflowError("injected")
        return real_prepare(out, *args)

    monkeypatch.setattr(llm.engine.runner, "prepare", prepare)
    from jaxpaged.entrypoints.llm import RequestFailedError

    with pytest.raises(RequestFailedError, match="injected"):
        llm.generate([{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [9, 4]}], use_tqdm=False)
    assert llm.stats()["failed_requests"] >= 1
    still_serves(llm)


def test_chat_messages_are_checked():
    from jaxpaged.chat import apply_chat_template

    class Templated:
        chat_template = "{{ messages }}"

    with pytest.raises(ValueError, match=r"messages\[0\].role='wizard'"):
        apply_chat_template(Templated(), [{"role": "wizard", "content": "hi"}])
    with pytest.raises(TypeError, match=r"messages\[1\].content must be a string.*NoneType"):
        apply_chat_template(Templated(), [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])


def test_unknown_model_path():
    with pytest.raises((FileNotFoundError, ValueError), match="no/such/model"):
        LLM("/no/such/model", precompile=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 12}, "block_size=12 is not supported.*8, 16, 32"),
    ({"dtype": "int8"}, "dtype='int8'"),
    ({"attention_backend": "cuda"}, "attention_backend"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory='lots'"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"bogus_option": 1}, "unknown engine option.*bogus_option"),
])
def test_bad_engine_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM.from_params(CONFIG, random_params(CONFIG), None, precompile=False, **kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_num_seqs": 0}, ValueError, "max_num_seqs=0"), ({"max_num_seqs": "4"}, TypeError, "max_num_seqs='4'"),
    ({"block_size": 16.0}, TypeError, "block_size"), ({"enable_prefix_caching": 1}, TypeError, "enable_prefix"),
    ({"max_num_batched_tokens": 8}, ValueError, "max_num_batched_tokens=8"), ({"seed": -3}, ValueError, "seed"),
])
def test_engine_options_are_checked_before_the_model_loads(monkeypatch, kwargs, error, message):
    import jaxpaged.loader

    def load_model(*args, **kw):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(jaxpaged.loader, "load_model", load_model)
    with pytest.raises(error, match=message):
        LLM(**kwargs)


def test_every_engine_option_is_a_flag():
    """The CLI is generated from EngineConfig: every field has a flag, and flags reach the config unchanged."""
    import argparse
    import dataclasses

    from jaxpaged.engine.setup import EngineConfig
    from jaxpaged.entrypoints.cli import add_engine_args, engine_options

    p = argparse.ArgumentParser()
    add_engine_args(p)
    flags = {a.dest for a in p._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= flags
    args = p.parse_args(["--num-blocks", "40", "--no-enable-prefix-caching", "--kv-cache-memory", "2GiB",
                         "--max-num-seqs", "3", "--seed", "7", "--no-precompile"])
    config = EngineConfig(**engine_options(args))
    assert (config.num_blocks, config.enable_prefix_caching, config.max_num_seqs, config.seed) == (40, False, 3, 7)
    assert config.kv_cache_memory == "2GiB" and not config.precompile
    assert EngineConfig(**engine_options(p.parse_args([]))) == EngineConfig()
    # an option whose choices hold None (its help lists it) takes it as "none" or "None"
    for text, want in (("none", None), ("None", None), ("int8", "int8")):
        assert p.parse_args(["--quantization", text]).quantization == want


def test_the_server_bounds_prefill_while_decoding_by_default_and_the_flag_overrides_it():
    """server.py's own default (EngineConfig's is the whole token budget): 128 prompt tokens per step while streams
    decode, never above max_num_batched_tokens (which would be refused); an explicit value is kept."""
    from jaxpaged.engine.setup import EngineConfig
    from jaxpaged.entrypoints.cli import engine_options
    from jaxpaged.entrypoints.openai import api_server as server

    assert EngineConfig().max_prefill_tokens_while_decoding is None
    assert server.parse_args([]).max_prefill_tokens_while_decoding == server.SERVER_PREFILL_TOKENS_WHILE_DECODING
    assert server.parse_args(["--max-num-batched-tokens", "64"]).max_prefill_tokens_while_decoding == 64
    args = server.parse_args(["--max-prefill-tokens-while-decoding", "2048"])
    assert EngineConfig(**engine_options(args)).max_prefill_tokens_while_decoding == 2048
    # The pacer: on by default in the server (off in EngineConfig), a value kept, 0 turns it off
    assert EngineConfig().max_decode_slowdown is None
    assert server.parse_args([]).max_decode_slowdown == server.SERVER_MAX_DECODE_SLOWDOWN
    args = server.parse_args(["--max-decode-slowdown", "1.5"])
    assert EngineConfig(**engine_options(args)).max_decode_slowdown == 1.5
    assert server.parse_args(["--max-decode-slowdown", "0"]).max_decode_slowdown is None


@pytest.mark.parametrize("value, error", [(1.0, ValueError), (0.5, ValueError), (-2, ValueError), ("2", TypeError)])
def test_max_decode_slowdown_must_be_a_number_above_one(value, error):
    from jaxpaged.engine.setup import EngineConfig

    with pytest.raises(error, match="max_decode_slowdown"):
        EngineConfig(max_decode_slowdown=value).scheduler_config(64)


def test_pool_too_small_for_one_max_length_sequence_says_the_numbers():
    with pytest.raises(ValueError, match=r"holds 3 blocks .*needs 8 blocks"):
        LLM.from_params(CONFIG, random_params(CONFIG), None, max_model_len=64, block_size=8, num_blocks=4,
                        precompile=False)


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes(1000) == 1000
    with pytest.raises(ValueError):
        parse_bytes("-1GiB")


@pytest.mark.parametrize("kwargs, message", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width=0"), ({"beam_width": 11, "max_tokens": 4}, "beam_width=11"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens=0"),
])
def test_bad_beam_search_params(kwargs, message):
    from jaxpaged import BeamSearchParams

    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_requests_too_big_for_the_engine_are_refused_and_leak_nothing(llm):
    from jaxpaged import BeamSearchParams

    with pytest.raises(ValueError, match="n=5 exceeds max_num_seqs=4"):
        llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(n=5), use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width=5 exceeds max_num_seqs=4"):
        llm.beam_search([{"prompt_token_ids": [3, 4]}], BeamSearchParams(beam_width=5, max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        llm.beam_search([{"prompt_token_ids": [3] * 40}], BeamSearchParams(beam_width=2, max_tokens=30),
                        use_tqdm=False)
    still_serves(llm)


def test_llm_chat_renders_tools_through_the_template():
    """LLM.chat(tools=...) hands OpenAI function definitions to the chat template, as vLLM's LLM.chat does."""
    llm, tok = tokenizer_llm("{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
                             "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}")
    conversation = [{"role": "user", "content": "what is the weather"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = llm.apply_chat_template(conversation, tools=tools)
    assert with_tools == tok("tools: get_weather user: what is the weather ")["input_ids"]
    assert llm.apply_chat_template(conversation) == tok("user: what is the weather ")["input_ids"]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False,
                   tools=tools)[0]
    assert out.prompt_token_ids == with_tools and len(out.outputs[0].token_ids) == 3


def test_the_input_processor_refuses_a_request_on_its_own():
    """What the engine refuses before queueing is the input processor's alone: it needs no engine, no model."""
    from jaxpaged.engine.beam_search import BeamSearchParams
    from jaxpaged.engine.input_processor import InputProcessor
    from jaxpaged.engine.structured_output import GrammarCache

    inputs = InputProcessor(None, 50, {0}, max_model_len=8, max_num_seqs=2, grammars=GrammarCache(None, 50, [0]),
                            num_blocks=4, block_size=4, seed=0)
    req = inputs.request("a", [3, 4, 5], SamplingParams(max_tokens=2))
    assert req.seqs[0].token_ids == [3, 4, 5] and req.seqs[0].stop_ids == frozenset({0})
    for prompt, params, message in [
        ([3] * 8, None, "max_model_len=8"),
        ([50], None, r"\[0, 50\)"),
        ("text", None, "no tokenizer"),
        ([3], SamplingParams(n=3), "max_num_seqs=2"),
        ([3], SamplingParams(bad_words=["x"]), "bad_words needs a tokenizer"),
        ([3], {"max_tokens": 2}, "sampling_params must be a SamplingParams"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            inputs.request("b", prompt, params)
    with pytest.raises(ValueError, match="need 4 KV blocks; the pool has 3"):  # 2 beams of 7 tokens, blocks of 4
        inputs.beam_request("c", [3, 4], BeamSearchParams(beam_width=2, max_tokens=5))


def test_chat_template_options_continue_the_last_message_and_reach_the_template():
    """vLLM's continue_final_message (the assistant's last message left open), chat_template_kwargs (variables for
    the template) and chat_template (a template of the call's own), in LLM.chat and apply_chat_template; options
    that cannot apply are ValueErrors naming the field, before anything is rendered or queued."""
    llm, tok = tokenizer_llm("{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}"
                             "{% if add_generation_prompt %}assistant: {% endif %}{% if shout %}loud {% endif %}")
    ask = [{"role": "user", "content": "tell a story"}]
    begun = ask + [{"role": "assistant", "content": "once upon"}]
    assert llm.apply_chat_template(ask, chat_template_kwargs={"shout": True}) == \
        tok("user: tell a story assistant: loud ")["input_ids"]
    continued = llm.apply_chat_template(begun, add_generation_prompt=False, continue_final_message=True)
    assert continued == tok("user: tell a story assistant: once upon")["input_ids"]
    out = llm.chat(begun, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == continued
    own = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"  # vLLM's chat_template= (a call's own)
    out = llm.chat(ask, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False,
                   chat_template=own)[0]
    assert out.prompt_token_ids == llm.apply_chat_template(ask, chat_template=own) == tok("<user>tell a story")[
        "input_ids"]
    for kwargs, message in [
        ({"continue_final_message": True}, "cannot both be true"),
        ({"continue_final_message": True, "add_generation_prompt": False, "messages": ask}, "the assistant's"),
        ({"chat_template_kwargs": {"tools": []}}, "cannot set 'tools'"),
        ({"chat_template_kwargs": {"a b": 1}}, "not a name"),
        ({"chat_template_kwargs": [("shout", True)]}, "must be a dict"),
    ]:
        messages = kwargs.pop("messages", begun)
        with pytest.raises(ValueError, match=message):
            llm.chat(messages, use_tqdm=False, **kwargs)
    still_serves(llm)


def test_truncate_prompt_tokens_keeps_the_prompts_end_and_a_leading_bos():
    """vLLM's truncate_prompt_tokens: the last k tokens of a prompt (text or ids); a BOS the tokenizer put first stays
    first; -1 is max_model_len; 0, < -1 or > max_model_len are refused naming the field."""
    from tokenizers.processors import TemplateProcessing

    from jaxpaged.engine.input_processor import truncate_prompt
    from tests.tiny_hf import make_tiny_tokenizer

    assert truncate_prompt([1, 5, 6, 7, 8], 3, bos_token_id=1) == [1, 7, 8]
    assert truncate_prompt([1, 5, 6, 7, 8], 3) == [6, 7, 8]
    assert truncate_prompt([5, 6, 7, 8], 3, bos_token_id=1) == [6, 7, 8]
    assert truncate_prompt([5, 6], 3, bos_token_id=1) == [5, 6]
    tok = make_tiny_tokenizer()  # made to put its BOS first, as Llama's and Gemma's tokenizers do
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A",
                                                              special_tokens=[(tok.bos_token, tok.bos_token_id)])
    llm, _ = tokenizer_llm(tok=tok)
    text = "the block cache holds the tokens of every request " * 4
    full = list(tok(text)["input_ids"])
    assert len(full) > 8 and full[0] == tok.bos_token_id
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, truncate_prompt_tokens=8)
    out = llm.generate([text, {"prompt_token_ids": full}], params, use_tqdm=False)
    assert out[0].prompt_token_ids == full[:1] + full[-7:] and out[1].prompt_token_ids == full[-8:]
    long_ids = {"prompt_token_ids": [5] * 100}  # longer than max_model_len=64: truncated first, so it fits
    assert len(llm.generate([long_ids], SamplingParams(max_tokens=1, truncate_prompt_tokens=60),
                            use_tqdm=False)[0].prompt_token_ids) == 60
    with pytest.raises(ValueError, match="truncate_prompt_tokens=65 is greater than max_model_len=64"):
        llm.generate([long_ids], SamplingParams(truncate_prompt_tokens=65), use_tqdm=False)
    with pytest.raises(ValueError, match="longer than the context"):  # -1 keeps 64 tokens: no room to generate
        llm.generate([long_ids], SamplingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    for bad in (0, -2, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    still_serves(llm)


def test_detokenize_false_gives_the_same_tokens_without_text():
    """vLLM's detokenize=False: token ids (and log-probs) as with text, the text empty, in every output kind; stop
    strings need the text, so they are refused with it."""
    from jaxpaged.engine.output_processor import RequestState
    from jaxpaged.sampling_params import RequestOutputKind

    llm, tok = tokenizer_llm()
    assert llm.get_tokenizer() is tok is llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompt = "the block cache holds"
    with_text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert with_text.text
    for kind in RequestOutputKind:
        bare = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1, detokenize=False,
                              output_kind=kind)
        req = llm.engine.make_request(f"detok-{kind.name}", prompt, bare)
        state = RequestState(tok, req.request_id, req.prompt, req.seqs[0].prompt_token_ids, bare, 0.0)
        llm.engine.enqueue(req)
        outs = []
        while llm.engine.has_unfinished_requests():
            outs += [got.outputs[0] for out in llm.engine.step() if (got := state.update(out)) is not None]
        parts = outs if kind == RequestOutputKind.DELTA else outs[-1:]  # deltas add up; the others are cumulative
        assert [t for o in parts for t in o.token_ids] == with_text.token_ids
        assert {o.text for o in outs} == {""}
        assert [{t: (e.logprob, e.rank, e.decoded_token) for t, e in lp.items()} for o in parts for lp in o.logprobs] \
            == [{t: (e.logprob, e.rank, None) for t, e in lp.items()} for lp in with_text.logprobs]
        assert all(e.decoded_token is not None for lp in with_text.logprobs for e in lp.values())
    with pytest.raises(ValueError, match="^detokenize=False cannot look for stop strings"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(TypeError, match="^detokenize"):
        SamplingParams(detokenize="no")
