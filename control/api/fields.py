"""Which request fields this server honours, and the refusal of every other one by name.

A field the server does not act on must not pass silently: a client that asks for tools, a JSON
answer or an insertion suffix would get an ordinary completion and believe it got what it asked.
So a request field is one of:

- read: a field of the body's pydantic model (schemas.py), acted on;
- a label: names the caller or the request and changes no token of the answer (``user``...),
  accepted and not used;
- neutral-only: an OpenAI option this server does not implement, accepted only at the value that
  asks for nothing (``tools: []``, ``tool_choice: "none"``, ``response_format: {"type": "text"}``),
  because common clients send those defaults explicitly; any other value is a 400 naming it;
- anything else: a 400 naming every unknown field.
"""
from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

from residency.control.api.errors import ApiError

# Fields that identify the caller or tag the request; no token of the answer depends on them.
LABELS = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _absent(v: Any) -> bool:
    return v is None


def _none_choice(v: Any) -> bool:
    return v is None or v == "none"


def _false(v: Any) -> bool:
    return v is None or v is False


def _any_bool(v: Any) -> bool:
    return v is None or isinstance(v, bool)


def _text_format(v: Any) -> bool:
    return v is None or v == {"type": "text"}


def _text_only(v: Any) -> bool:
    return v is None or v == ["text"]


def _no_suffix(v: Any) -> bool:
    return v is None or v == ""


# name -> (is the value neutral?, what to tell a client that asks for more)
Neutral = dict[str, tuple[Callable[[Any], bool], str]]

CHAT_NEUTRAL: Neutral = {
    "tools": (_empty, "tool calling is not supported; send [] or leave it out"),
    "tool_choice": (_none_choice, "tool calling is not supported; tool_choice may only be 'none'"),
    # parallel_tool_calls only shapes tool calls, which never happen here
    "parallel_tool_calls": (_any_bool, "parallel_tool_calls must be a boolean"),
    "functions": (_empty, "function calling is not supported; send [] or leave it out"),
    "function_call": (_none_choice, "function calling is not supported; function_call may only be 'none'"),
    "response_format": (_text_format, "only plain text answers are produced; response_format may only be "
                                      "{\"type\": \"text\"}"),
    "modalities": (_text_only, "only text is produced; modalities may only be [\"text\"]"),
    "audio": (_absent, "audio output is not supported"),
    "prediction": (_absent, "predicted outputs are not supported"),
    "reasoning_effort": (_absent, "this model has no reasoning effort to set"),
    "verbosity": (_absent, "verbosity is not supported"),
    "web_search_options": (_absent, "web search is not supported"),
    "store": (_false, "completions are not stored; store may only be false"),
}

COMPLETION_NEUTRAL: Neutral = {
    "suffix": (_no_suffix, "suffix (insertion) is not supported; send \"\" or leave it out"),
}


def check_fields(obj: dict, read: Container[str], neutral: Neutral) -> None:
    """Raise a 400 ``ApiError`` naming the first field of ``obj`` asked at a value this server does
    not honour, or every field it does not know at all. Returns None when all are honoured."""
    unknown = [k for k in obj if k not in read and k not in LABELS and k not in neutral]
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise ApiError(400, f"unrecognized request field{'s' if len(unknown) > 1 else ''} {names}; this server does "
                            "not act on it, so it refuses it rather than ignore it", param=unknown[0],
                       code="unsupported_parameter")
    for k, v in obj.items():
        rule = neutral.get(k)
        if rule is not None and not rule[0](v):
            raise ApiError(400, f"{k}: {rule[1]}", param=k, code="unsupported_parameter")
