"""Request bodies of the OpenAI-compatible routes, validated with pydantic.

A field this server does not act on is refused by name, unless it is a label or sent at the value
that asks for nothing (control/api/fields.py); so are ``best_of`` > 1 and ``echo``. ``n`` is served
up to ``MAX_CHOICES`` (control/api/choices.py), ``logprobs`` (chat: ``logprobs`` + ``top_logprobs``;
completions: an int) up to ``MAX_LOGPROBS`` alternatives. ``presence_penalty``,
``frequency_penalty``, ``logit_bias`` and ``repetition_penalty`` (an extension, as vLLM's) are
applied by the worker's sampler (dataplane/model/penalties.py); a logit_bias id beyond the model's
vocabulary is refused once the worker has told its size (control/scheduler/admission.py).
Residency's own field is ``session_id`` (the OpenAI client sends it through ``extra_body``); the
``X-Session-Id`` header names a session too. ``ignore_eos`` (as in vLLM) keeps generating past the
model's end-of-turn token, up to ``max_tokens`` (benchmarks).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator

from residency.control.api.errors import ApiError
from residency.control.api.fields import CHAT_NEUTRAL, COMPLETION_NEUTRAL, Neutral, check_fields
from residency.events.commands import MAX_LOGPROBS
from residency.events.serving import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_PENALTY

MAX_CHOICES = 8                        # choices (``n``) one request may ask for

MAX_STOP_SEQUENCES = 4
MAX_TOKENS_LIMIT = 1 << 31            # beyond any context window; the backend checks the real one
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
# Token ids beyond any vocabulary a model could have; the worker checks the model's own. Ids past
# this would not fit the int the worker's tensors hold.
MAX_TOKEN_ID = (1 << 31) - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None
    include_obfuscation: Literal[False] | None = None     # chunks are never padded: only "no" is honoured


class _Body(BaseModel):
    # fields.check_fields has refused what the server does not act on; labels are dropped here
    model_config = ConfigDict(extra="ignore", str_strip_whitespace=False)
    NEUTRAL: ClassVar[Neutral] = {}

    model: str = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = None
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    session_id: str | None = None
    ignore_eos: StrictBool = False       # an extension (as vLLM's): run to max_tokens past end-of-turn
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)   # an extension (vLLM's)
    logit_bias: dict[int, float] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v):
        """Token id (an int, or the decimal string JSON keys must be) -> a bias in [-100, 100]; the
        vocabulary's own bound is checked once the model is known (the worker tells it)."""
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
        if len(v) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias names {len(v)} tokens, at most {MAX_LOGIT_BIAS_TOKENS} are allowed")
        out: dict[int, float] = {}
        for k, b in v.items():
            if isinstance(k, str) and re.fullmatch(r"[0-9]{1,10}", k):
                t = int(k)
            elif type(k) is int:
                t = k
            else:
                raise ValueError(f"key {k!r} is not a token id (an integer from 0 to {MAX_TOKEN_ID})")
            if not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"token id {t} is outside [0, {MAX_TOKEN_ID}]")
            if type(b) not in (int, float) or not math.isfinite(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {t} must be a number in [{-MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {b!r}")
            if t in out:
                raise ValueError(f"token id {t} is named twice")
            out[t] = float(b)
        return out

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return stops

    @field_validator("session_id")
    @classmethod
    def _session(cls, v):
        if v is not None and not SESSION_ID_RE.match(v):
            raise ValueError("session_id must be 1-128 characters of [A-Za-z0-9._:@-]")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    # a key the chat template would drop (tool calls, audio...) is refused, as a body's field is
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None              # labels the speaker; the model's template has no place for it
    tool_call_id: str | None = None      # labels a tool's answer, whose content is read
    tool_calls: list[Any] | None = None  # only empty: the calls themselves would be dropped

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v):
        if v:
            raise ValueError("tool calls are not supported; an assistant message may carry none")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"content part {i} is of type {kind!r}; this model reads only 'text' parts")
        elif v is not None and not isinstance(v, str):
            raise ValueError(f"content must be a string or a list of text parts, not {type(v).__name__}")
        return v

    @model_validator(mode="after")
    def _content_present(self):
        # OpenAI's API: only an assistant's message (one that carried tool calls) may omit it
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionBody(_Body):
    NEUTRAL: ClassVar[Neutral] = CHAT_NEUTRAL
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(_Body):
    NEUTRAL: ClassVar[Neutral] = COMPLETION_NEUTRAL
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)
    echo: StrictBool | None = None
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if len(v) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)):
                if len(v) != 1:
                    raise ValueError("exactly one prompt per request is supported")
                v = v[0]
        if isinstance(v, str) and v == "":
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and (not v or any(t < 0 or t > MAX_TOKEN_ID for t in v)):
            raise ValueError(f"prompt token ids must be a non-empty list of ints from 0 to {MAX_TOKEN_ID}")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs


class ParkBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tier: Literal["host", "disk"] = "host"


def parse_json(raw: bytes) -> Any:
    if not raw.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError:
        raise ApiError(400, "the request body nests arrays or objects too deeply to parse", code="invalid_json") from None


def lone_surrogate_at(obj: Any, path: str = "") -> str | None:
    """Where in a parsed body a string holds a lone UTF-16 surrogate (JSON's ``"\\ud800"`` escape
    decodes to one), or None. Such a string is not Unicode text: it cannot be encoded to be sent
    to a worker or written to the ledger, so it is refused here, by its place in the body."""
    if isinstance(obj, str):
        if obj.isascii():               # CPython knows this without a scan: most prompts end here
            return None
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        where = lone_surrogate_at(k, path) if isinstance(k, str) else None
        where = where or lone_surrogate_at(v, f"{path}.{k}" if path else str(k))
        if where is not None:
            return where
    return None


def validate(model: type[BaseModel], obj: Any):
    if not isinstance(obj, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(obj).__name__}", code="invalid_json")
    if issubclass(model, _Body):
        check_fields(obj, model.model_fields.keys(), model.NEUTRAL)
    where = lone_surrogate_at(obj)
    if where is not None:
        raise ApiError(400, f"{where}: the text holds a lone UTF-16 surrogate (U+D800..U+DFFF), which is not "
                            "Unicode text", param=where.split(".")[0], code="invalid_value")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        if err.get("type") == "missing":
            msg = f"missing required field {loc!r}"
            code = "missing_required_parameter"
        else:
            msg = f"{loc or 'body'}: {err.get('msg', 'invalid value')}"
            code = "invalid_value"
        raise ApiError(400, msg, param=loc.split(".")[0] or None, code=code) from None
