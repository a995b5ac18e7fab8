"""Chat messages -> prompt token ids through the tokenizer's chat template (shared by LLM.chat and the server)."""

from __future__ import annotations

import os

ROLES = ("system", "user", "assistant", "tool")


# apply_chat_template's own arguments: chat_template_kwargs may not set them (they have their own fields, or would
# change what the call returns)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
MAX_TEMPLATE_KWARGS = 32


class TemplateOptionError(ValueError):
    """A chat template option that cannot apply; `param` names the field (for the server's 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_template_options(last_role: str | None, add_generation_prompt: bool, continue_final_message: bool,
                           chat_template_kwargs: dict | None) -> None:
    """The options' own checks (the conversation's are apply_chat_template's); TemplateOptionError naming the field.
    last_role: the conversation's last message's role."""
    if continue_final_message and add_generation_prompt:
        raise TemplateOptionError("continue_final_message and add_generation_prompt cannot both be true: continuing "
                                  "the last message adds no new assistant turn", "continue_final_message")
    if continue_final_message and last_role != "assistant":
        raise TemplateOptionError(f"continue_final_message needs the last message to be the assistant's, not "
                                  f"{last_role!r}'s", "continue_final_message")
    if chat_template_kwargs is None:
        return
    if not isinstance(chat_template_kwargs, dict):
        raise TemplateOptionError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}",
                                  "chat_template_kwargs")
    if len(chat_template_kwargs) > MAX_TEMPLATE_KWARGS:
        raise TemplateOptionError(f"chat_template_kwargs has {len(chat_template_kwargs)} keys; at most "
                                  f"{MAX_TEMPLATE_KWARGS}", "chat_template_kwargs")
    for key in chat_template_kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise TemplateOptionError(f"chat_template_kwargs key {key!r} is not a name a template can read",
                                      "chat_template_kwargs")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise TemplateOptionError(f"chat_template_kwargs cannot set {key!r}: it is an argument of its own",
                                      "chat_template_kwargs")


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: a Jinja template file's path, or the template itself (ValueError if it is neither)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value[:200]!r} is neither a file nor a Jinja template")


def check_chat_template(template: str, tokenizer) -> None:
    """Tries `template` on a one-message conversation, so a broken one fails at start-up (ValueError) and not on
    every request."""
    try:
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}], chat_template=template)
    except Exception as e:  # jinja's syntax and undefined-name errors, a template's own raise_exception
        raise ValueError(f"the chat template fails on a one-message conversation: {e}") from e


def apply_chat_template(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, *, continue_final_message: bool = False,
                        chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[int]:
    """Prompt token ids of `conversation`; `tools` (OpenAI function definitions) are rendered by the template.
    continue_final_message: the last (assistant) message is left open for the model to continue, as vLLM and
    transformers do; chat_template_kwargs: more variables for the template (e.g. Qwen3's `enable_thinking`);
    chat_template: a Jinja template used instead of the tokenizer's."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead (or give one: "
                         "chat_template=, --chat-template)")
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise TypeError("a conversation must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role={m['role']!r} is not one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise TypeError(f"messages[{i}].content must be a string, got {type(m['content']).__name__}")
    check_template_options(conversation[-1]["role"], add_generation_prompt, continue_final_message,
                           chat_template_kwargs)
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        tools=tools, continue_final_message=continue_final_message,
                                        **({"chat_template": chat_template} if chat_template else {}),
                                        **(chat_template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
