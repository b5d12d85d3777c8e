"""adapter_config.json fields that change the math and that no worker implements: refused
unless at a value that means "not used" (the worker when it loads an adapter, the control
plane in its preflight). ``layers_to_transform`` / ``layers_pattern`` need nothing: the
adapter then has no weights for the other layers, and modules an adapter lacks add nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# field -> the values that mean "not used"; the last is the one to name in a message
REFUSED_PEFT_FIELDS: dict[str, tuple[object, ...]] = {
    "use_dora": (None, False),
    "modules_to_save": (None, []),
    "fan_in_fan_out": (None, False),
    "bias": (None, "none"),
    "lora_bias": (None, False),
    "layer_replication": (None, []),
    "trainable_token_indices": (None, [], {}),
    "alora_invocation_tokens": (None, []),
    "use_qalora": (None, False),
    "use_bdlora": (None, False, {}),
}


def refused_peft_field(config: Mapping[str, Any]) -> tuple[str, object, object] | None:
    """The first refused field ``config`` uses: (field, its value, the value to use instead)."""
    for field_name, unused in REFUSED_PEFT_FIELDS.items():
        value = config.get(field_name)
        if value not in unused:
            return field_name, value, unused[-1]
    return None
