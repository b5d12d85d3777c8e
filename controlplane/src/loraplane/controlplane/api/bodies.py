"""What every request body of the control plane's API shares."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from loraplane.rules.text import check_text


class Body(BaseModel):
    """A request body: a field it does not have is refused by name, nothing is coerced
    (``"5"`` is no number), numbers are finite, and every string is Unicode text (a lone
    surrogate would reach the database driver and fail there, a 500)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        return check_text(value)


class NoFields(Body):
    """The body of a call that takes none: absent or ``{}``; any field is refused by name
    rather than ignored (an unload sent ``{"placement": ...}`` would otherwise unload all)."""
