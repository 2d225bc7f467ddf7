"""The timeline's tables and PNG show request ids and reasons as the log has them (bug hunt, session 80).

A request id is the client's: the HTTP server takes vLLM's `request_id` field or an X-Request-Id header, any
printable ASCII (scheduler/request_ids.py), into its engine rids, and the Python API takes any string. Brackets
and dollar signs are printable ASCII; neither may be read as markup by the tools that draw the timeline."""
from __future__ import annotations

import html
import io
import re

import pytest

from scheduler.timeline import build_timeline
from scheduler.timeline_views import print_tables, render_png
from test_timeline import PREFILL_HITS, req

# engine rids as the server makes them from a client's id: "chatcmpl-{id}-{8 hex digits}"
MARKUP_RIDS = ["chatcmpl-[/x]-1a2b3c4d", "chatcmpl-[bold]-1a2b3c4d", "chatcmpl-:smile:-1a2b3c4d"]
MATH_RIDS = ["chatcmpl-$a^$-1a2b3c4d", "cmpl-$5-$10-1a2b3c4d"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _one_request_each(rids: list[str], reason: str = "abort") -> list[dict]:
    events = []
    for i, rid in enumerate(rids):
        events += [req(10 * i, rid, "queued"), req(10 * i + 1, rid, "prefill_start", **PREFILL_HITS),
                   req(10 * i + 2, rid, "aborted", output_tokens=0, reason=reason, error="[/INST] seen")]
    return events


def test_the_terminals_tables_show_request_ids_and_reasons_as_logged(monkeypatch):
    """Regression: on a terminal (rich's tables) each cell was read as rich markup: a request id with "[/x]" in it
    raised MarkupError out of scripts/timeline.py, one with "[bold]" lost that part and ":smile:" became an emoji."""
    monkeypatch.setenv("COLUMNS", "300")  # (no cell folded over two lines)
    tl = build_timeline(_one_request_each(MARKUP_RIDS))
    out = _Terminal()
    print_tables(tl, out)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # (its colours)
    for rid in MARKUP_RIDS:
        assert rid in text, rid
    assert "abort: [/INST] seen" in text


@pytest.mark.parametrize("rid", MATH_RIDS)
def test_the_png_labels_request_ids_as_logged(tmp_path, rid):
    """Regression: a request's row is labelled with its id, which matplotlib read as mathtext between two dollar
    signs: "$a^$" raised ValueError out of render_png (no PNG written), "$5-$" was drawn as math, its dollars
    gone. (An SVG with its text kept as text shows what the labels say.)"""
    import matplotlib

    tl = build_timeline(_one_request_each([rid]))
    render_png(tl, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        render_png(tl, tmp_path / "t.svg")
    drawn = re.sub(r"<!--.*?-->", "", (tmp_path / "t.svg").read_text(), flags=re.S)  # (its comments quote the text)
    assert f"req {rid}" in html.unescape(drawn)
