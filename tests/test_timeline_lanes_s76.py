"""The lanes of the timeline's views (scheduler/timeline_views.py, session 76's hunt): `_pack_lanes` puts each span
in the lowest lane free at its start (Chrome trace batches, the PNG's request and transfer rows), and render_png
builds each lane's row. Regression: both were O(lanes x spans), each span scanning every lane and each lane's row
every span: a burst of 1k / 2k / 4k / 8k requests open at once took 0.09 / 0.34 / 1.7 / 6.3 s to pack alone."""
from __future__ import annotations

import random

import pytest

from scheduler import timeline_views
from scheduler.timeline import build_timeline
from scheduler.timeline_views import _pack_lanes
from test_timeline import PREFILL_HITS, op, req


def _scanning_pack(spans: list[tuple[float, float]]) -> list[int]:
    """The packing as it was: each span scans the lanes for the first free one (the reference)."""
    lane_ends: list[float] = []
    lanes = []
    for a, b in spans:
        lane = next((i for i, end in enumerate(lane_ends) if end <= a), None)
        if lane is None:
            lane = len(lane_ends)
            lane_ends.append(b)
        lane_ends[lane] = b
        lanes.append(lane)
    return lanes


def test_the_lanes_are_those_of_the_scan_on_random_spans():
    """Same lane for every span as the scan: random starts in order, ties, instant and back-to-back spans, an end
    before its start (a clock that stepped), ints (ns) and floats (ms)."""
    rng = random.Random(76)
    for trial in range(300):
        n = rng.randrange(0, 60)
        starts = sorted(rng.choice([rng.randrange(0, 50), rng.uniform(0, 50)]) for _ in range(n))
        spans = []
        for a in starts:
            roll = rng.random()
            b = a if roll < 0.1 else a - rng.randrange(1, 5) if roll < 0.15 else a + rng.choice([1, 2, 5, 20, 3.5])
            spans.append((a, b))
        assert _pack_lanes(spans) == _scanning_pack(spans), (trial, spans)


class CountedFloat(float):
    """A time whose comparisons are counted."""
    compared = 0

    def _count(self, op_name, other):
        CountedFloat.compared += 1
        return getattr(float, op_name)(self, other)

    def __lt__(self, other): return self._count("__lt__", other)  # noqa: E704
    def __le__(self, other): return self._count("__le__", other)  # noqa: E704
    def __gt__(self, other): return self._count("__gt__", other)  # noqa: E704
    def __ge__(self, other): return self._count("__ge__", other)  # noqa: E704
    def __eq__(self, other): return self._count("__eq__", other)  # noqa: E704
    __hash__ = float.__hash__


@pytest.mark.parametrize("open_at_once", [True, False])
def test_packing_compares_times_n_log_n_times_not_lanes_times_spans(open_at_once):
    """A burst open at once (a lane each) and a steady stream (a few lanes, reused): comparisons per span grow with
    log N at most (was N / 2 per span for the burst: 4 x the spans, 16 x the comparisons)."""
    per_span = {}
    for n in (500, 2000):
        if open_at_once:
            spans = [(CountedFloat(i), CountedFloat(10.0 * n)) for i in range(n)]
        else:
            spans = [(CountedFloat(i), CountedFloat(i + 3.5)) for i in range(n)]
        CountedFloat.compared = 0
        lanes = _pack_lanes(spans)
        assert max(lanes) + 1 == (n if open_at_once else 4)
        per_span[n] = CountedFloat.compared / n
    assert per_span[2000] <= per_span[500] + 8, per_span  # (log2 of 4 x: +2 a comparison, a few for the tuples)
    assert per_span[2000] <= 40, per_span


class CountedLanes(list):
    """`_pack_lanes`' answer, counting the lanes read when iterated (each pass over it reads them all)."""
    read = 0

    def __iter__(self):
        for lane in super().__iter__():
            CountedLanes.read += 1
            yield lane


def _burst(n: int) -> list[dict]:
    """`n` requests and `n` backups open at once, the requests in prefill, then ending in turn."""
    events = []
    for i in range(n):
        events += [req(i * 0.01, f"q{i}", "queued"), req(i * 0.01 + 0.5, f"q{i}", "prefill_start", **PREFILL_HITS),
                   op(i * 0.01, i, "backup", "L1_PRIVATE", "D2H_PENDING")]
    for i in range(n):
        events += [req(100 + i * 0.01, f"q{i}", "finished", output_tokens=1),
                   op(100 + i * 0.01, i, "backup", "D2H_PENDING", "L1_L2")]
    return events


def test_the_pngs_lane_rows_read_the_lanes_once_and_hold_their_spans(tmp_path, monkeypatch):
    """Each lane's row (requests, transfers) is built in one pass over the lanes (was a pass per lane: lanes x spans
    reads), and holds exactly the spans of its lane's requests or ops, drawn on its row."""
    import matplotlib.axes
    import matplotlib.collections

    pack = timeline_views._pack_lanes
    monkeypatch.setattr(timeline_views, "_pack_lanes", lambda spans: CountedLanes(pack(spans)))
    drawn = {}

    def polys(boxes, **kw):  # the PNG's boxes: (y of the row, x0) of each
        drawn["boxes"] = sorted((round(b[0][1] + 0.4), round(b[0][0], 6)) for b in boxes)
        return real_polys(boxes, **kw)
    real_polys = matplotlib.collections.PolyCollection
    monkeypatch.setattr(matplotlib.collections, "PolyCollection", polys)
    real_ticks = matplotlib.axes.Axes.set_yticks
    monkeypatch.setattr(matplotlib.axes.Axes, "set_yticks",
                        lambda ax, ticks, labels=None, **kw: (drawn.setdefault("labels", labels),
                                                               real_ticks(ax, ticks, labels, **kw))[1])
    reads = {}
    for n in (60, 120):
        tl = build_timeline(_burst(n))
        CountedLanes.read = 0
        drawn.clear()
        timeline_views.render_png(tl, tmp_path / f"burst{n}.png", max_request_rows=40)
        reads[n] = CountedLanes.read
        labels = drawn["labels"]
        assert [lb for lb in labels if lb.startswith("requests")] == [f"requests {k}" for k in range(n)]
        assert [lb for lb in labels if lb.startswith("transfers")] == [f"transfers {k}" for k in range(n)]
        ms = timeline_views.png_ms(tl)
        want = []  # each request's phases on its lane's row (arrival i: lane i), each op's states on its own
        for i, r in enumerate(tl.requests.values()):
            row = labels.index(f"requests {i}")
            want += [(row, round(ms(a, r.run), 6)) for _, a, _ in r.phase_spans(tl.open_end_ns(r.run))]
        for i, o in enumerate(tl.ops.values()):
            row = labels.index(f"transfers {i}")
            want += [(row, round(ms(a, o.run), 6)) for _, a, _ in o.state_spans(tl.open_end_ns(o.run))]
        assert drawn["boxes"] == sorted(want)
    assert reads[120] <= 2 * reads[60] + 8, reads  # (was 4 x: a pass over n lanes for each of n lanes)
    assert reads[120] <= 8 * 2 * 120, reads
