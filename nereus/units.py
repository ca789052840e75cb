"""Formatting of quantities shared by every layer (no dependencies)."""

from __future__ import annotations


def format_bytes(nbytes: float) -> str:
    """1536 -> "1.5 KiB"; binary units, three significant figures."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"
