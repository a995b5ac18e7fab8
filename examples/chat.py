"""Chat: conversations through the model's chat template, several at once, and a follow-up turn.

    python examples/chat.py                                # the default model, SmolLM2-135M-Instruct
    python examples/chat.py --model path/to/model --max-tokens 64
"""

import argparse

from jaxpaged import LLM, SamplingParams

parser = argparse.ArgumentParser(description="Chat with jaxpaged's LLM.chat")
parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct, installed with pip)")
parser.add_argument("--max-tokens", type=int, default=48, help="new tokens per answer")
args = parser.parse_args()

llm = LLM(model=args.model, max_num_seqs=8, max_model_len=512, precompile=False)  # compile shapes when first used
params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

# A conversation is a list of {"role", "content"} messages, as in OpenAI's API.
conversations = [
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "What is the tallest mountain on Earth?"}],
    [{"role": "user", "content": "Give me one tip for writing clear Python."}],
]

# chat() applies the tokenizer's chat template and answers every conversation in one batch.
answers = llm.chat(conversations, params)
for conversation, answer in zip(conversations, answers, strict=True):
    print(f"user: {conversation[-1]['content']}\nassistant: {answer.outputs[0].text.strip()}\n")

# A follow-up turn: append the answer and the next question, then ask again. The prompt now starts with the first
# turn's tokens, so the prefix cache reuses their KV blocks instead of computing them again.
first = conversations[0] + [{"role": "assistant", "content": answers[0].outputs[0].text},
                            {"role": "user", "content": "And how high is it?"}]
follow_up = llm.chat(first, params)[0]
print(f"user: And how high is it?\nassistant: {follow_up.outputs[0].text.strip()}")
print(f"prompt tokens served from the prefix cache: {follow_up.num_cached_tokens}")
