"""Pipeline timelines as text and as a picture: ranks as rows, one coloured block per
compute action (F, B, I, W, F&B), idle time white. ``molds-schedule`` draws the simulated
timelines of several schedules one above the other, the figure people compare schedules by."""

from __future__ import annotations

from .schedule import Timeline

COLOURS = {  # (chunk 0, chunk 1)
    "F": ((118, 167, 250), (40, 98, 200)),
    "B": ((120, 200, 120), (40, 140, 60)),
    "I": ((250, 190, 110), (215, 130, 40)),
    "W": ((190, 150, 220), (120, 80, 170)),
}


def _colour(kind: str, chunk: int):
    return COLOURS[kind][min(chunk, 1)]


def describe(lists, comm: bool = False) -> list[str]:
    """One line per rank: its actions in order (compute only unless ``comm``)."""
    return [f"rank {r}: " + " ".join(str(a) for a in acts if comm or a.is_compute) for r, acts in enumerate(lists)]


def draw(panels: list[tuple[str, Timeline]], path: str, px_per_unit: float | None = None) -> None:
    """One panel per (title, timeline), on a common time scale, saved as PNG."""
    from PIL import Image, ImageDraw, ImageFont  # here: molds-schedule --help loads no Pillow

    span = max(t.makespan for _, t in panels) or 1.0
    width = 1400
    scale = px_per_unit or (width - 120) / span
    row, gap, head = 26, 14, 24
    height = sum(head + row * t.ranks + gap for _, t in panels) + 40
    img = Image.new("RGB", (int(120 + span * scale + 20), height), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    y = 10
    for title, t in panels:
        d.text((10, y), title, fill="black", font=font)
        y += head
        for r in range(t.ranks):
            d.text((10, y + 7), f"rank {r}", fill="black", font=font)
            d.rectangle([120, y, 120 + span * scale, y + row - 4], outline=(200, 200, 200))
            for start, end, a in t.spans[r]:
                if a is None:
                    continue
                x0, x1 = 120 + start * scale, 120 + end * scale
                if a.kind == "FB":  # upper half the forward, lower half the backward
                    mid = y + (row - 4) / 2
                    d.rectangle([x0, y, x1, mid], fill=_colour("F", a.chunk), outline="white")
                    d.rectangle([x0, mid, x1, y + row - 4], fill=_colour("B", a.b_chunk), outline="white")
                    label = f"{a.mb}/{a.b_mb}"
                else:
                    d.rectangle([x0, y, x1, y + row - 4], fill=_colour(a.kind, a.chunk), outline="white")
                    label = str(a.mb)
                if x1 - x0 > 6 * len(label) + 2:
                    d.text((x0 + 2, y + 6), label, fill="black", font=font)
            y += row
        y += gap
    legend = [("F", "forward"), ("B", "full backward"), ("I", "input-only backward"), ("W", "weight backward")]
    x = 120
    for kind, text in legend:
        d.rectangle([x, y, x + 14, y + 12], fill=_colour(kind, 0))
        d.rectangle([x + 14, y, x + 28, y + 12], fill=_colour(kind, 1))
        d.text((x + 32, y), text, fill="black", font=font)
        x += 60 + 7 * len(text)
    d.text((x, y), "F&B: forward above, backward below (f/b: their micro-batches); light / dark: chunk 0 / chunk 1", fill="black",
           font=font)
    img.save(path)
