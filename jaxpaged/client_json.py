"""JSON text that a client sent (a schema given as a string, a tool call's arguments in a chat history): every parse
of it goes through `loads`, which turns any failure, a RecursionError on deep nesting included, into a ValueError
that names the field, and bounds the nesting depth of what it returns so that later code (templates, json.dumps,
the grammar compiler) never recurses deeper than that."""

from __future__ import annotations

import json

MAX_DEPTH = 64


class TooDeepError(ValueError):
    """JSON nested deeper than the limit (a ValueError naming the field)."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads(text: str | bytes, field: str, max_depth: int = MAX_DEPTH):
    """The value of JSON `text`; ValueError naming `field` if it is not JSON or nests deeper than `max_depth`."""
    try:
        value = json.loads(text, parse_constant=_no_constant)  # NaN and Infinity are Python's, not JSON
    except RecursionError:
        raise TooDeepError(f"{field} is nested more than {max_depth} levels deep") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{field} is not valid JSON: {str(e)[:200]}") from None
    if depth(value, max_depth) > max_depth:
        raise TooDeepError(f"{field} is nested more than {max_depth} levels deep")
    return value


def depth(value, limit: int) -> int:
    """The nesting depth of a JSON value (a scalar is 0, [] is 1), counted without recursion; stops counting once it
    passes `limit`."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        elif not isinstance(node, (list, tuple)):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((v, d + 1) for v in node)
    return deepest
