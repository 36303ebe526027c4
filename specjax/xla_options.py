"""XLA compiler options the library sets for its own executables (never a user's global flags)."""

from __future__ import annotations

from typing import Any


def compiler_options() -> dict[str, Any] | None:
    """Options passed to ``Lowered.compile`` for every engine executable; None = XLA's defaults."""
    return None
