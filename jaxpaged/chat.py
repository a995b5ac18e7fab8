"""Chat messages -> prompt token ids through the tokenizer's chat template (shared by LLM.chat and the server)."""

from __future__ import annotations


def apply_chat_template(tokenizer, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    for m in conversation:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError("each chat message must be a dict with 'role' and 'content'")
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
