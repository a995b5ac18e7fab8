"""Chat messages -> prompt token ids through the tokenizer's chat template (shared by LLM.chat and the server)."""

from __future__ import annotations

ROLES = ("system", "user", "assistant", "tool")


def apply_chat_template(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None) -> list[int]:
    """Prompt token ids of `conversation`; `tools` (OpenAI function definitions) are rendered by the template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise TypeError("a conversation must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role={m['role']!r} is not one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise TypeError(f"messages[{i}].content must be a string, got {type(m['content']).__name__}")
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        tools=tools)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
