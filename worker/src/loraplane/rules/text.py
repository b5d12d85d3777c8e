"""Text a request may carry: Unicode strings only.

JSON can spell a lone surrogate (``"\\ud800"``), which Python decodes into a ``str`` that no
UTF-8 encoder, tokenizer, database driver or file system accepts. Both servers refuse such a
string by its field, before it goes anywhere.
"""

from __future__ import annotations

from typing import Any


def not_text(value: str) -> str | None:
    """Why ``value`` is not Unicode text, or None when it is."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"holds a lone surrogate (U+{ord(value[exc.start]):04X}) at character {exc.start}, "
            "which is not Unicode text; send UTF-8 text"
        )
    return None


def check_text(value: Any) -> Any:
    """``value`` as given (a pydantic ``after`` validator of any field): a string, or a list's
    string, that is not Unicode text raises ValueError with the reason."""
    for text in value if isinstance(value, list) else (value,):
        if isinstance(text, str) and (reason := not_text(text)) is not None:
            raise ValueError(reason)
    return value
