"""How both servers word a request body's validation errors (pydantic's, from FastAPI).

Each error names the field as the client wrote it, never pydantic's union branch tags
(``stop``, not ``stop.str``); a field the endpoint does not have is called that, with the
field meant where it is another endpoint's spelling; and a body that is no JSON object is
refused as the body, saying why (``body_refusal``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SEND_JSON = "send the body as UTF-8 JSON with Content-Type: application/json"
# starlette's answer to a body that json.loads raised on (bad UTF-8, nesting too deep), and
# what both servers say instead
UNPARSED = "There was an error parsing the body"
UNPARSED_MESSAGE = f"body: could not be read as JSON; {SEND_JSON}"


def field_path(loc: Sequence[Any], *, keep_body: bool) -> tuple[str, ...]:
    """An error's field path without the union branch tags pydantic puts in (``str``, ``int``,
    ``list[...]``, a class name: fields are snake_case); without the leading ``body`` unless
    ``keep_body`` (the control plane names ``body.placement``, the worker ``max_tokens``)."""
    parts = [str(part) for part in loc]
    if parts[:1] == ["body"] and not keep_body:
        parts = parts[1:]
    return tuple(
        part
        for part in parts
        if not ("[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper())
    )


def described(
    errors: Sequence[Mapping[str, Any]],
    *,
    keep_body: bool,
    meant: Mapping[tuple[str, ...], str] | None = None,
) -> list[tuple[str, str]]:
    """(field, message) per bad field, in order. Of a union's branches, those refused only for
    their type give way to a branch that got further (a list of text parts with a bad part is
    told about that part, not that it is no string); types alone are merged into one message
    (``stop: Input should be a valid string or a valid list``). ``meant``: the field a client
    may mean, by the path it wrote (``("sampling_params", "max_tokens")``)."""
    located = [(field_path(e.get("loc", ()), keep_body=keep_body), e) for e in errors]

    def further(path: tuple[str, ...], error: Mapping[str, Any]) -> bool:
        return any(
            other is not error
            and other_path[: len(path)] == path
            and (len(other_path) > len(path) or not str(other.get("type", "")).endswith("_type"))
            for other_path, other in located
        )

    by_field: dict[str, list[str]] = {}
    for path, error in located:
        kind = str(error.get("type", ""))
        if kind.endswith("_type") and further(path, error):
            continue
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        if kind == "extra_forbidden":
            hint = (meant or {}).get(path[1:] if keep_body else path)
            message = "not a field of this endpoint" + (f" (did you mean {hint}?)" if hint else "")
        messages = by_field.setdefault(".".join(path) or "body", [])
        if messages and message.startswith("Input should be ") and message not in messages:
            message = message.removeprefix("Input should be ")
        if message not in messages:
            messages.append(message)
    return [(field, " or ".join(messages)) for field, messages in by_field.items()]


def body_refusal(errors: Sequence[Mapping[str, Any]], content_type: str) -> str | None:
    """The message for a body that is no JSON object at all, or None: not valid JSON (naming
    the character where parsing stopped), or not sent as JSON."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        at, why = list(first.get("loc", ("body", "?")))[-1], (first.get("ctx") or {}).get("error")
        return (
            f"body: not valid JSON at character {at}"
            + (f" ({why})" if why else "")
            + (f"; {SEND_JSON}")
        )
    media = content_type.split(";")[0].strip().lower()
    json_media = media == "application/json" or media.endswith("+json")
    if not json_media and field_path(first.get("loc", ()), keep_body=False) == ():
        return f"body: Content-Type is {media or 'not set'}; {SEND_JSON}"
    return None


def summary(
    errors: Sequence[Mapping[str, Any]],
    *,
    keep_body: bool,
    shown: int,
    meant: Mapping[tuple[str, ...], str] | None = None,
) -> tuple[str | None, str]:
    """The first bad field and one message over all of them (``described``): the first
    ``shown`` fields, the rest counted, so a body of many bad items gets a bounded answer."""
    found = described(errors, keep_body=keep_body, meant=meant)
    parts = [f"{field}: {message}" for field, message in found]
    message = "; ".join(parts[:shown])
    if len(parts) > shown:
        message += f"; and {len(parts) - shown} more"
    return (found[0][0] if found else None), message
