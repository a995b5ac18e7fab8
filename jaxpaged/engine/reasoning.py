"""A thinking model's reasoning apart from its answer, as vLLM's `reasoning_parser` names them: the chat response
gives the text inside <think> ... </think> as `reasoning_content` and the rest as `content`, and a request's
structured output (its grammar) constrains the answer only, from the token after </think> (`ThinkTokens`).

    deepseek_r1  the reasoning runs from the output's start (a leading <think> dropped: DeepSeek-R1's template puts
                 it in the prompt) to the first </think>; an output without </think> is all reasoning
    qwen3        the same when the model thinks: its output starts with <think>, or the prompt ends with it
                 (Qwen3-Thinking-2507's template); otherwise (enable_thinking false, whose template closes an empty
                 think block in the prompt) all of it is content

`split` is one function of the text so far, so a stream and a whole response split the same text the same way: while
the text could still turn into a tag (it ends in "</thi", or is only "<th"), those characters wait for the next
delta, and what each side shows only grows.

The engine follows the same rules on token ids (`ThinkTokens.start_mode`, where each tag is one token of the
vocabulary, as in DeepSeek-R1's and Qwen3's): a sequence reasons from its first output token (deepseek_r1, or a
prompt that ends inside a think block), or, for qwen3, when its first output token is <think>; its answer, which the
grammar constrains, starts after the first </think> it samples. A tokenizer without the tags as single tokens leaves
the grammar on the whole output (the engine says so at start-up).
"""

from __future__ import annotations

import dataclasses

START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    thinks_unless_told: bool  # deepseek_r1: reasoning first even without a leading <think>; qwen3: only with one

    def opens_in_prompt(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` (its last characters) leaves the model inside a think block."""
        return prompt_tail.rstrip().endswith(START)

    def split(self, text: str, opened_in_prompt: bool, done: bool) -> tuple[str, str]:
        """(reasoning, content) shown for `text`, a choice's output so far; done: it is the whole output."""
        stripped = text.lstrip()
        if stripped.startswith(START):
            body = stripped[len(START):]
        elif not done and START.startswith(stripped):  # empty, whitespace or "<thi": not decided yet
            return "", ""
        elif opened_in_prompt or self.thinks_unless_told:
            body = text
        else:
            return "", text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):]
        if done:
            return body, ""
        held = next((k for k in range(len(END) - 1, 0, -1) if body.endswith(END[:k])), 0)  # a tag's start, maybe
        return body[:len(body) - held], ""


# A sequence's phase, as the engine tracks it for a request with a grammar (`ThinkTokens`).
UNDECIDED = "undecided"  # qwen3, nothing sampled yet: a first token <think> starts reasoning, any other the answer
THINKING = "thinking"  # the grammar waits for </think>
ANSWER = "answer"  # the grammar applies


@dataclasses.dataclass(frozen=True)
class ThinkTokens:
    """A parser's tags as token ids of one tokenizer (`think_tokens`), for gating a grammar on token ids."""

    parser: ReasoningParser
    start: int  # <think>
    end: int  # </think>

    def start_mode(self, prompt_tail_text: str) -> str:
        """The phase a request's sequences start in, from its prompt's last characters (as the server splits it)."""
        if self.parser.opens_in_prompt(prompt_tail_text) or self.parser.thinks_unless_told:
            return THINKING
        return UNDECIDED


def think_tokens(parser: ReasoningParser, tokenizer) -> ThinkTokens | None:
    """The parser's tags as single token ids of `tokenizer`, or None where either is not one token."""
    if tokenizer is None or not hasattr(tokenizer, "encode"):
        return None
    ids = []
    for tag in (START, END):
        try:
            encoded = tokenizer.encode(tag, add_special_tokens=False)
        except Exception:  # a tokenizer that cannot encode the tag: no gate
            return None
        if len(encoded) != 1:
            return None
        ids.append(int(encoded[0]))
    return ThinkTokens(parser, *ids)


REASONING_PARSERS = {"deepseek_r1": ReasoningParser(thinks_unless_told=True),
                     "qwen3": ReasoningParser(thinks_unless_told=False)}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


__all__ = ["ANSWER", "REASONING_PARSERS", "THINKING", "UNDECIDED", "ReasoningParser", "ThinkTokens", "reasoning_parser",
           "think_tokens"]
