"""Exceptions raised by dsv4. Every message says what to change.

A refused call changes nothing: the manager checks before it mutates, so after
any of these the cache is exactly as it was before the call.
"""

from __future__ import annotations


class DSV4Error(Exception):
    """Base class of every error dsv4 raises on purpose."""


class ConfigError(DSV4Error, ValueError):
    """A configuration field has a value dsv4 cannot use."""


class FormatError(DSV4Error, ValueError):
    """An unknown storage format name, or a shape the format cannot store."""


class OutOfBlocksError(DSV4Error):
    """Not enough free cache blocks for an admission or a growth."""

    def __init__(self, needed: int, free: int, what: str = ""):
        self.needed, self.free = needed, free
        where = f" for {what}" if what else ""
        super().__init__(
            f"need {needed} free cache blocks{where} but only {free} are free; "
            "free finished requests, lower the context, or give the manager more "
            "memory (num_blocks= or memory_bytes=)"
        )


class OutOfSlotsError(DSV4Error):
    """Every request slot of the state cache is taken."""


class RequestError(DSV4Error, KeyError):
    """An unknown or duplicate request id."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class InputError(DSV4Error, ValueError):
    """A call's arguments are out of range (token counts, positions, shapes)."""


class DeviceError(DSV4Error, ValueError):
    """A tensor is on the wrong device or has the wrong dtype."""


class CheckpointError(DSV4Error):
    """A checkpoint directory is missing, corrupt, or not a DeepSeek-V4 model."""
