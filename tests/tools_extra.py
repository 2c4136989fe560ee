"""An extra tool loaded through CHAT["EXTRA_TOOLS"] in tests."""

from __future__ import annotations

from typing import Literal

from chatcore.engine.tools import ToolContext, tool


@tool
def convert_temperature(ctx: ToolContext, value: float, unit: Literal["C", "F"] = "C") -> str:
    """Convert a temperature between Celsius and Fahrenheit.

    Args:
        value: the temperature to convert
        unit: the unit of `value`
    """
    if unit == "C":
        return f"{value * 9 / 5 + 32:.1f} F"
    return f"{(value - 32) * 5 / 9:.1f} C"
