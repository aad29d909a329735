"""Server-drawn SVG charts: coordinates for a template to draw, so a page charts without a script.

A line chart plots values over time (one polyline per series); a stacked bar chart plots one bar
per day, each series a segment of it. Both keep to the look of the job page's loss chart: a
600-wide view box, the value axis from zero on the left, the first and last moment under the
plot. Each series gets a colour class (`series-1` .. `series-8` in portal.css) that its legend
entry shares, so the legend needs no colour of its own.
"""

from __future__ import annotations

from datetime import date, datetime

WIDTH = 600
LEFT, RIGHT, TOP, BOTTOM = 56, 10, 10, 22  # margins round the plot: the value ticks left, the dates below
MAX_POINTS = 300  # per polyline; a longer series is thinned evenly, its last point kept
DOTTED = 30  # a series of at most this many points is drawn with a dot on each
COLOURS = 8


def _colour(index: int) -> str:
    return f"series-{index % COLOURS + 1}"


def _frame(height: int) -> dict:
    return {"width": WIDTH, "height": height, "left": LEFT, "right": WIDTH - RIGHT, "top": TOP,
            "bottom": height - BOTTOM, "tick_y": height - 5}


def _thinned(points: list) -> list:
    stride = max(1, len(points) // MAX_POINTS)
    sampled = points[::stride]
    if sampled and sampled[-1] is not points[-1]:
        sampled.append(points[-1])
    return sampled


def line_chart(series: list[tuple[str, list[tuple[datetime, float]]]], *, title: str, unit: str,
               height: int = 180, high: float | None = None,
               span: tuple[datetime, datetime] | None = None) -> dict | None:
    """Polylines of (moment, value) series; None when there is nothing to draw.

    `high` fixes the top of the value axis (100 for a percentage), else the highest value sets it;
    `span` fixes the time axis (a page's date range), else the first and last points do. The
    chart's `label` says in words what it shows, for a screen reader (the SVG is one image).
    """
    drawn = [(label, sorted(points)) for label, points in series if points]
    if not drawn:
        return None
    moments = [at for _, points in drawn for at, _ in points]
    first, last = span if span else (min(moments), max(moments))
    seconds = (last - first).total_seconds()
    top = high if high is not None else max(value for _, points in drawn for _, value in points)
    top = top or 1.0
    frame = _frame(height)

    def x(at: datetime) -> float:
        share = (at - first).total_seconds() / seconds if seconds > 0 else 1.0
        return frame["left"] + (frame["right"] - frame["left"]) * min(1.0, max(0.0, share))

    def y(value: float) -> float:
        return frame["bottom"] - (frame["bottom"] - frame["top"]) * min(1.0, max(0.0, value / top))

    lines = []
    for index, (label, points) in enumerate(drawn):
        shown = _thinned(points)
        lines.append({
            "label": label, "colour": _colour(index), "count": len(points), "latest": points[-1][1],
            "points": " ".join(f"{x(at):.1f},{y(value):.1f}" for at, value in shown),
            # A few points are dotted too, so a short series (a lone point draws no line) stays visible.
            "dots": [{"x": f"{x(at):.1f}", "y": f"{y(value):.1f}"} for at, value in shown] if len(shown) <= DOTTED else [],
        })
    figures = "; ".join(
        f"{line['label']}: peak {max(value for _, value in points):.1f}{unit}, latest {line['latest']:.1f}{unit}"
        for line, (_, points) in zip(lines, drawn)
    )
    label = f"{title} from {first:%Y-%m-%d %H:%M} to {last:%Y-%m-%d %H:%M} UTC; {figures}"
    return {**frame, "high": top, "first": first, "last": last, "lines": lines, "unit": unit, "label": label,
            "count": sum(line["count"] for line in lines)}


def stacked_bars(days: list[date], series: list[tuple[str, dict[date, float]]], *, title: str, unit: str,
                 height: int = 180) -> dict | None:
    """One bar per day, each series a segment stacked from the bottom; None when every value is zero.

    The legend lists the series with anything in the range, each with its total.
    """
    totals = {day: sum(values.get(day, 0.0) for _, values in series) for day in days}
    top = max(totals.values(), default=0.0)
    if top <= 0:
        return None
    frame = _frame(height)
    plot_height = frame["bottom"] - frame["top"]
    step = (frame["right"] - frame["left"]) / len(days)
    gap = min(2.0, step * 0.2)
    bars, drawn = [], 0
    for position, day in enumerate(days):
        base, segments = frame["bottom"], []
        for index, (label, values) in enumerate(series):
            value = values.get(day, 0.0)
            if value <= 0:
                continue
            size = plot_height * value / top
            base -= size
            segments.append({"label": label, "value": value, "colour": _colour(index), "y": f"{base:.1f}",
                             "height": f"{size:.1f}"})
        drawn += len(segments)
        bars.append({"day": day, "total": totals[day], "x": f"{frame['left'] + position * step + gap / 2:.1f}",
                     "width": f"{max(0.5, step - gap):.1f}", "segments": segments})
    legend = [{"label": label, "colour": _colour(index), "total": sum(values.get(day, 0.0) for day in days)}
              for index, (label, values) in enumerate(series)]
    legend = [entry for entry in legend if entry["total"] > 0]
    figures = "; ".join(f"{entry['label']} {entry['total']:.2f} {unit}" for entry in legend)
    label = f"{title} per day from {days[0]:%Y-%m-%d} to {days[-1]:%Y-%m-%d}, stacked by series: {figures}"
    return {**frame, "high": top, "first": days[0], "last": days[-1], "bars": bars, "legend": legend, "unit": unit,
            "label": label, "count": drawn}


def replica_charts(utilization: dict, labels: dict[tuple[int, int, int], str],
                   span: tuple[datetime, datetime]) -> dict:
    """The utilization and memory charts of a job's or an endpoint's replicas (runners.usage.pages.replica_utilization).

    `labels` names each replica by (job, attempt, rank); one line per replica in each chart.
    """
    named = [(labels[(r["job"], r["attempt"], r["rank"])], r) for r in utilization["replicas"]]
    return {
        "utilization": line_chart([(label, r["utilization"]) for label, r in named], title="GPU utilization",
                                  unit="%", high=100, span=span),
        "memory": line_chart([(label, r["memory_gib"]) for label, r in named], title="GPU memory used",
                             unit=" GiB", span=span),
        "simulated": utilization["simulated"], "measured": utilization["measured"],
    }
