"""Reserved against used KV slots: the count all three parts report, as a table row and bars."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclass(frozen=True)
class SlotCount:
    """Reserved against used KV slots (tokens), and the unused share."""

    reserved: int
    used: int
    unused: int
    waste_fraction: float
    # Rounded to a whole percent, as the article reports it.
    waste_percent: int

    @classmethod
    def of(cls, reserved: int, used: int) -> SlotCount:
        unused = reserved - used
        fraction = unused / reserved if reserved else 0.0
        return cls(reserved, used, unused, fraction, round(100 * fraction))


def slot_row(name: str, slots: SlotCount, *extra: object) -> list[object]:
    """A table row: name, reserved, used, unused, wasted, then any extra cells."""
    cells = [f"{slots.reserved:,}", f"{slots.used:,}", f"{slots.unused:,}"]
    return [name, *cells, f"{100 * slots.waste_fraction:.1f}%", *extra]


def bar_panel(
    ax: Axes,
    title: str,
    contiguous: SlotCount,
    paged: SlotCount,
    in_flight: tuple[int, int] | None,
) -> None:
    """Reserved and used bars, contiguous beside paged, on one chart panel."""
    from matplotlib.ticker import StrMethodFormatter

    labels = [
        f"{name}\n{100 * slots.waste_fraction:.1f}% wasted"
        for name, slots in (("contiguous", contiguous), ("paged", paged))
    ]
    if in_flight is not None:
        labels = [f"{label}\n{n} in flight" for label, n in zip(labels, in_flight, strict=True)]
    xs = [0.0, 1.0]
    width = 0.38
    reserved = [contiguous.reserved, paged.reserved]
    used = [contiguous.used, paged.used]
    bars_r = ax.bar([x - width / 2 for x in xs], reserved, width, label="reserved", color="#d9822b")
    bars_u = ax.bar([x + width / 2 for x in xs], used, width, label="used", color="#2b7bd9")
    ax.bar_label(bars_r, labels=[f"{v:,}" for v in reserved], fontsize=8)
    ax.bar_label(bars_u, labels=[f"{v:,}" for v in used], fontsize=8)
    ax.set_xticks(xs, labels)
    # Plain thousands, not an offset like "1e6" that hides the scale in a corner.
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.set_title(title, fontsize=10)
    # Headroom above the tallest bar keeps the legend clear of the value labels.
    ax.set_ylim(0, max(reserved) * 1.3)
    ax.legend(fontsize=8, loc="upper center", ncols=2)
