"""What the config sections of every component share: one-line checks of a field, and the monitor's
enum-like field types (keel.trainer.config's parser checks a value against a Literal's choices).

A section's validate() raises ValueError with one line that names the field, its value and the fix;
keel.trainer.config reports it as a ConfigError before any worker starts. Light on purpose (no pandas,
no wandb): `keel train` imports it to check a config.
"""

from __future__ import annotations

from typing import Literal

# monitor.wandb_mode: auto logs online with an API key and offline without (see keel.monitor.wandb_sink).
WandbMode = Literal["auto", "online", "offline", "disabled"]


def at_least(name: str, value: float, low: float, fix: str = "") -> None:
    """`not value >= low` rather than `value < low`, so that NaN fails too."""
    if not value >= low:
        raise ValueError(f"{name}={value}: must be at least {low}{'; ' + fix if fix else ''}")
