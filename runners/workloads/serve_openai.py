"""The inference server's OpenAI routes: what a request may hold, and the shapes of answers, chunks and errors.

`POST /v1/completions` and `POST /v1/chat/completions` take OpenAI's request bodies (the fields below;
any other is a 400 naming it) and answer OpenAI's shapes, so the `openai` Python client works against a
replica, or the edge in front of it. Pure functions: the front (runners.workloads.serve) calls them.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

COMPLETION_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "stop", "temperature", "stream", "stream_options", "seed", "deadline_ms",
    "n", "top_p", "user",
})
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt"}) | {"messages", "max_completion_tokens"}
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; a chat may run to the server's --max-tokens
MAX_STOPS = 4


class Invalid(ValueError):
    """A 400 in OpenAI's error shape, `param` naming the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


@dataclass
class Completion:
    chat: bool
    model: str
    prompt: str | None  # the completion's prompt, or the chat's messages rendered for the CharModel
    messages: list[dict] | None
    max_tokens: int
    stop: tuple[str, ...]
    temperature: float
    seed: int | None
    deadline_ms: float | None
    stream: bool
    include_usage: bool


def _number(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer of 400 digits
        return False


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    raise Invalid(f"messages[{index}].content", "a string, or a list of {\"type\": \"text\", \"text\": ...} parts")


def check(body, *, chat: bool, max_tokens_limit: int, served_model: str) -> Completion:
    """The request, checked; Invalid(param, why) at the first problem."""
    if not isinstance(body, dict):
        raise Invalid("body", "the body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise Invalid(unknown[0], f"not supported; the fields are {', '.join(sorted(allowed))}")
    model = body.get("model", served_model)
    if not isinstance(model, str):
        raise Invalid("model", "a string")
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Invalid("messages", "required, a non-empty list of {\"role\", \"content\"}")
        checked = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise Invalid(f"messages[{i}].role", f"each message is an object whose role is one of {', '.join(sorted(ROLES))}")
            checked.append({"role": message["role"], "content": _content(message, i)})
        messages = checked
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise Invalid("prompt", "required, a string")
        if not prompt:
            raise Invalid("prompt", "must not be empty")
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is None:
        max_tokens = max_tokens_limit if chat else min(DEFAULT_COMPLETION_TOKENS, max_tokens_limit)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise Invalid(name, "an integer")
    if not 1 <= max_tokens <= max_tokens_limit:
        raise Invalid(name, f"must be between 1 and {max_tokens_limit}")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise Invalid("stop", f"a string or a list of at most {MAX_STOPS} strings")
    if any(not s for s in stop):
        raise Invalid("stop", "a stop string must not be empty")
    temperature = body.get("temperature", 0)
    if temperature is None:
        temperature = 0
    if not _number(temperature) or not 0 <= temperature <= 2:
        raise Invalid("temperature", "a number between 0 and 2")
    for name, default in (("n", 1), ("top_p", 1)):
        value = body.get(name, default)
        if value is not None and value != default:
            raise Invalid(name, f"only {default} is supported")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise Invalid("seed", "an integer between 0 and 2**63 - 1")
    deadline_ms = body.get("deadline_ms")
    if deadline_ms is not None:
        if not _number(deadline_ms):
            raise Invalid("deadline_ms", "a number of milliseconds")
        if deadline_ms <= 0:
            raise Invalid("deadline_ms", "must be positive: the deadline is that long after the request arrives")
        deadline_ms = float(deadline_ms)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise Invalid("stream", "true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise Invalid("stream_options", "only with \"stream\": true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise Invalid("stream_options", "an object with at most the field include_usage")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise Invalid("stream_options.include_usage", "true or false")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise Invalid("user", "a string")
    return Completion(chat, model, prompt, messages, max_tokens, stop, float(temperature), seed, deadline_ms,
                      stream, include_usage)


# --- answers -------------------------------------------------------------------------------------


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable",
               504: "timeout"}


def plain_chat(messages: list[dict]) -> str:
    """The chat prompt of a model without a chat template: one `role: content` line a message, then `assistant:`."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def error(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def answer(req: Completion, ident: str, result: dict) -> dict:
    """The whole answer of a request that was not streamed; `result` is the engine's."""
    choice = {"index": 0, "logprobs": None, "finish_reason": result["finish_reason"]}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": result["text"]}
    else:
        choice["text"] = result["text"]
    return {
        "id": ident, "object": "chat.completion" if req.chat else "text_completion", "created": int(time.time()),
        "model": req.model, "choices": [choice], "usage": usage(result["prompt_tokens"], result["tokens"]),
    }


def chunk(req: Completion, ident: str, created: int, *, text: str | None = None, first: bool = False,
          finish_reason: str | None = None) -> dict:
    """One streamed chunk: new text, or (with finish_reason) the last of the choice."""
    choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if req.chat:
        delta: dict = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    out = {"id": ident, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": created,
           "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: Completion, ident: str, created: int, result: dict) -> dict:
    """With stream_options.include_usage: after the last choice chunk, one with no choices and the usage."""
    return {"id": ident, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": created,
            "model": req.model, "choices": [], "usage": usage(result["prompt_tokens"], result["tokens"])}
