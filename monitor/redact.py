"""Redaction of secrets in configs before they are written anywhere: config.toml, the run store's meta, W&B.

A value is secret when its key ends with one of SECRET_KEYS (case-insensitive), so `monitor.webhook_url`,
`WANDB_API_KEY` and `hf_token` are all caught. Erring this way also hides the odd harmless value (a
tokenizer's `eos_token`); a leaked Slack webhook or API key is worse.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

SECRET_KEYS: tuple[str, ...] = ("webhook_url", "api_key", "token", "password", "secret")
REDACTED = "<redacted>"


def is_secret_key(key: object) -> bool:
    return str(key).lower().endswith(SECRET_KEYS)


def redact(config: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `config` with every non-empty secret value replaced by "<redacted>"."""
    return {key: _redact_value(key, value) for key, value in config.items()}


def _redact_value(key: object, value: Any) -> Any:
    if isinstance(value, Mapping):
        return redact(value)
    if isinstance(value, (list, tuple)):
        # A list under a secret key (several tokens) is secret item by item.
        return [_redact_value(key, item) for item in value]
    if is_secret_key(key) and value not in (None, ""):
        return REDACTED
    return copy.deepcopy(value)


def redact_argv(argv: list[str]) -> list[str]:
    """Command-line arguments with the values of secret `key=value` overrides hidden
    (`--monitor.webhook_url=<redacted>`), for tools that record the command line (W&B does)."""
    hidden = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        hidden.append(f"{key}={REDACTED}" if sep and value and is_secret_key(key) else arg)
    return hidden
