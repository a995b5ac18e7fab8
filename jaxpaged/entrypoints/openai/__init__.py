"""The OpenAI-compatible HTTP API: `api_server` (aiohttp transport: routes, auth, limits, SSE, shutdown), `protocol`
(request and response shapes), `serving` (requests to the engine and back), `tokenization` (prompts off the event
loop), `tool_parsers` (tool calls out of chat text), `read_progress` (whether a stream's client still reads) and
`static/` (the page served at /)."""
