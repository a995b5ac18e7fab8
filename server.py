"""The OpenAI-compatible server, run from a checkout: `python server.py --model path/to/model --port 8000`.

The server itself is jaxpaged/entrypoints/openai/api_server.py, part of the installed package: `jaxpaged serve
[model] [flags]` and `python -m jaxpaged.entrypoints.openai.api_server [flags]` run the same code with the same flags.
"""

from jaxpaged.entrypoints.openai.api_server import exit_now, main

if __name__ == "__main__":
    exit_now(main())
