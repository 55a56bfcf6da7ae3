"""One trace's spans as a waterfall page (Jinja2), and its screenshot with Debian's Chromium:
docs/img/trace.png, written by tests/acceptance/test_tracing.py under
``OUTBOX_WRITE_DOCS_SCREENSHOT=1`` (no Jaeger offline: this page stands in for one)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, select_autoescape

from tests.otlp import Span

CHROMIUM = Path("/usr/bin/chromium")
#: The OTLP span kinds, by number.
KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
#: The attribute names shown under a span (in this order), when it has them.
SHOWN = (
    "outbox.operation.id",
    "outbox.tool",
    "outbox.target",
    "outbox.operation.state",
    "outbox.attempt",
    "outbox.intent.existing",
    "outbox.outcome",
    "outbox.result",
    "outbox.published",
    "outbox.decision",
    "outbox.decided_by",
    "messaging.operation.type",
    "http.request.method",
    "url.full",
    "http.response.status_code",
    "server.address",
    "mcp.method.name",
)

_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>
<style>
 body { font: 13px/1.35 system-ui, sans-serif; margin: 16px; color: #1d2430; width: 1180px; }
 h1 { font-size: 16px; margin: 0 0 2px; }
 .sub { color: #5b6573; margin-bottom: 10px; font-size: 12px; }
 .row { display: grid; grid-template-columns: 430px 1fr 74px; align-items: center;
        border-top: 1px solid #e7eaf0; padding: 3px 0; }
 .name { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
 .svc { display: inline-block; min-width: 92px; font-size: 11px; color: #fff;
        border-radius: 3px; padding: 0 4px; margin-right: 6px; text-align: center; }
 .kind { color: #7a8391; font-size: 11px; margin-left: 4px; }
 .lane { position: relative; height: 16px; background: #f6f7fa; }
 .bar { position: absolute; top: 2px; height: 12px; border-radius: 2px; min-width: 2px; }
 .bar.error { outline: 2px solid #c62828; }
 .ev { position: absolute; top: 0; width: 2px; height: 16px; background: #1d2430; }
 .dur { text-align: right; font-variant-numeric: tabular-nums; color: #39424e; }
 .attrs { grid-column: 1 / 4; font: 11px/1.3 ui-monospace, monospace; color: #5b6573;
          padding: 0 0 2px 0; white-space: normal; }
 .attrs b { color: #39424e; font-weight: 600; }
 .events { grid-column: 1 / 4; font: 11px/1.3 ui-monospace, monospace; color: #7a4a00; }
 .axis { display: grid; grid-template-columns: 430px 1fr 74px; color: #7a8391;
         font-size: 11px; }
 .scale { position: relative; display: flex; justify-content: space-between; height: 30px; }
 .cut { position: absolute; top: 0; text-align: center; font-size: 10px; color: #9a6b00;
        line-height: 1.2; }
 .gap { position: absolute; top: 0; height: 16px; background: repeating-linear-gradient(
        135deg, #fdf3dc 0 4px, #f6f7fa 4px 8px); }
</style></head><body>
<h1>{{ title }}</h1>
<div class="sub">trace {{ trace_id }} · {{ rows|length }} spans · {{ total }} ·
 {{ services|join(", ") }}</div>
<div class="axis"><div></div><div class="scale"><span>0</span>
 {% for b in breaks %}<span class="cut" style="left: {{ b.left }}%; width: {{ b.width }}%"
 >{{ b.label }} idle</span>{% endfor %}<span>{{ total }}</span></div><div></div></div>
{% for row in rows %}
<div class="row" title="{{ row.tooltip }}">
 <div class="name" style="padding-left: {{ row.depth * 16 }}px">
  <span class="svc" style="background: {{ row.colour }}">{{ row.service }}</span>
  {{- row.name }}<span class="kind">{{ row.kind }}</span></div>
 <div class="lane">
  {% for b in breaks %}<div class="gap" style="left: {{ b.left }}%; width: {{ b.width }}%"></div>
  {% endfor %}
  <div class="bar{% if row.error %} error{% endif %}"
       style="left: {{ row.left }}%; width: {{ row.width }}%; background: {{ row.colour }}"></div>
  {% for ev in row.events %}<div class="ev" style="left: {{ ev.left }}%"
       title="{{ ev.name }}"></div>{% endfor %}
 </div>
 <div class="dur">{{ row.duration }}</div>
 {% if row.attributes %}<div class="attrs" style="padding-left: {{ row.depth * 16 + 98 }}px">
  {% for key, value in row.attributes %}<b>{{ key }}</b>={{ value }}&nbsp;&nbsp;
  {% endfor %}</div>{% endif %}
 {% if row.events %}<div class="events" style="padding-left: {{ row.depth * 16 + 98 }}px">
  events: {% for ev in row.events %}{{ ev.name }} (+{{ ev.at }}){% if not loop.last %},
  {% endif %}{% endfor %}</div>{% endif %}
</div>
{% endfor %}
</body></html>
"""

_COLOURS = {
    "outbox-cli": "#6a4c93",
    "outbox-relay": "#1982c4",
    "outbox-worker": "#2a9d8f",
    "outbox-api": "#e76f51",
    "outbox-mcp": "#8a5a44",
}


@dataclass(frozen=True)
class _Event:
    name: str
    left: float
    at: str


@dataclass(frozen=True)
class _Row:
    name: str
    service: str
    colour: str
    kind: str
    depth: int
    left: float
    width: float
    duration: str
    error: bool
    attributes: list[tuple[str, str]]
    events: list[_Event]
    tooltip: str


def _ms(ns: int) -> str:
    ms = ns / 1e6
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.1f} ms"


def in_tree(spans: Sequence[Span], roots: Iterable[Span]) -> list[Span]:
    """``roots`` and every span below them (by parent) among ``spans``."""
    keep = {s.span_id for s in roots}
    grew = True
    while grew:
        grew = False
        for span in spans:
            if span.span_id not in keep and span.parent_span_id in keep:
                keep.add(span.span_id)
                grew = True
    return [s for s in spans if s.span_id in keep]


def render(spans: Sequence[Span], title: str) -> str:
    """The spans of one trace as a waterfall page: nested by parent, bars on one time axis,
    events as ticks and listed, the attributes that name the operation under each span (all
    of them on hover)."""
    assert spans, "no span to draw"
    t0 = min(s.start_ns for s in spans)
    total = max(max(s.end_ns for s in spans) - t0, 1)
    axis = _Axis(spans)
    ids = {s.span_id for s in spans}
    children: dict[int | None, list[Span]] = {}
    for span in spans:
        parent = span.parent_span_id if span.parent_span_id in ids else None
        children.setdefault(parent, []).append(span)
    rows: list[_Row] = []

    def walk(parent: int | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            rows.append(_row(span, depth, axis))
            walk(span.span_id, depth + 1)

    walk(None, 0)
    template = Environment(autoescape=select_autoescape(default=True)).from_string(_TEMPLATE)
    return template.render(
        title=title,
        trace_id=f"{spans[0].trace_id:032x}",
        rows=rows,
        total=_ms(total),
        breaks=axis.breaks,
        services=sorted({s.service for s in spans}),
    )


class _Axis:
    """Time to a percentage of the lane, an idle stretch (no span running, over a second and
    a twentieth of the trace: the relay not started yet, a wait for the in-flight horizon)
    shown as a break of fixed width with its length written on it."""

    BREAK = 4.0  # percent of the lane per break

    def __init__(self, spans: Sequence[Span]) -> None:
        self.t0 = min(s.start_ns for s in spans)
        end = max(s.end_ns for s in spans)
        covered: list[list[int]] = []
        for span in sorted(spans, key=lambda s: s.start_ns):
            if covered and span.start_ns <= covered[-1][1]:
                covered[-1][1] = max(covered[-1][1], span.end_ns)
            else:
                covered.append([span.start_ns, span.end_ns])
        least = max(1_000_000_000, (end - self.t0) // 20)
        self.gaps = [(a[1], b[0]) for a, b in itertools.pairwise(covered) if b[0] - a[1] > least]
        busy = (end - self.t0) - sum(b - a for a, b in self.gaps)
        self.scale = (100.0 - self.BREAK * len(self.gaps)) / max(busy, 1)
        self.breaks = [
            {"left": round(self.at(a), 3), "width": self.BREAK, "label": _ms(b - a)}
            for a, b in self.gaps
        ]

    def at(self, t: int) -> float:
        """``t``'s position on the lane, in percent."""
        position, last = 0.0, self.t0
        for a, b in self.gaps:
            if t <= a:
                break
            position += (a - last) * self.scale
            if t < b:
                return position + self.BREAK * (t - a) / (b - a)
            position += self.BREAK
            last = b
        return position + (t - last) * self.scale


def _row(span: Span, depth: int, axis: _Axis) -> _Row:
    shown = [(k, _text(span.attributes[k])) for k in SHOWN if k in span.attributes]
    return _Row(
        name=span.name,
        service=span.service,
        colour=_COLOURS.get(span.service, "#6c757d"),
        kind=KINDS.get(span.kind, str(span.kind)),
        depth=depth,
        left=round(axis.at(span.start_ns), 3),
        width=round(max(axis.at(span.end_ns) - axis.at(span.start_ns), 0.25), 3),
        duration=_ms(span.end_ns - span.start_ns),
        error=span.status == 2,
        attributes=shown,
        events=[
            _Event(name, round(axis.at(at), 3), _ms(at - span.start_ns))
            for (name, _attrs), at in zip(span.events, span.event_times, strict=True)
        ],
        tooltip="\n".join(f"{k}={_text(v)}" for k, v in sorted(span.attributes.items())),
    )


def _text(value: object) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= 90 else text[:87] + "..."


def screenshot(html: str, path: Path) -> None:
    """A full-page PNG of ``html`` at ``path``, by Debian's headless Chromium (Playwright
    driving ``/usr/bin/chromium``: never a downloaded browser)."""
    from playwright.sync_api import sync_playwright  # noqa: PLC0415 -- only when drawing

    path.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1212, "height": 600})
            page.set_content(html)
            page.screenshot(path=str(path), full_page=True)
        finally:
            browser.close()
