"""The official `openai` client against jaxpaged's OpenAI-compatible server: a streamed chat, then structured output.

Start a server first (it prints "serving ... on http://127.0.0.1:8000" when ready), then run this in another shell:

    jaxpaged serve                     # the default model; or: jaxpaged serve path/to/model --port 8000
    python examples/openai_client.py   # or: --base-url http://host:port/v1

Needs `pip install openai`. With `jaxpaged serve --api-key KEY`, set OPENAI_API_KEY=KEY here.
"""

import argparse
import json
import os

from openai import OpenAI

parser = argparse.ArgumentParser(description="jaxpaged's server through the openai client")
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
parser.add_argument("--max-tokens", type=int, default=64, help="new tokens of the streamed answer")
args = parser.parse_args()

client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
model = client.models.list().data[0].id  # the name the server was started with (--served-model-name)

# 1. Streaming: the answer arrives as server-sent events, a few characters per chunk, as the model produces them.
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Tell me about the city of Lyon in two sentences."}],
    max_tokens=args.max_tokens, temperature=0.0, stream=True)
print("streamed: ", end="", flush=True)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()

# 2. Structured output: a JSON schema constrains every sampled token, so the reply always parses and fits the schema.
schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Describe Lyon as JSON: city, country, population."}],
    max_tokens=200, temperature=0.0,
    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
city = json.loads(reply.choices[0].message.content)
print("structured:", json.dumps(city))
