"""scripts/trace_copies.py on a synthetic chrome trace: copies of one direction grouped into
transfers by idle gaps, each transfer's span, idle time, and the rate of its DMAs alone against
the rate beside kernels that are not waiting on a flag."""
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import trace_copies  # noqa: E402


def copy(ts, dur, nbytes, name="Memcpy HtoD (Pinned -> Device)"):
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur,
            "args": {"bytes": nbytes, "stream": 21}}


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {}}


def synthetic(path: Path) -> None:
    events = []
    for i in range(10):  # one transfer: 10 DMAs of 2 MB, 40 us each, 5 us apart
        events.append(copy(i * 45.0, 40.0, 2_000_000))
    events.append(copy(2000.0, 40.0, 2_000_000))  # another transfer, far after
    events.append(copy(3000.0, 40.0, 2_000_000, name="Memcpy DtoH (Device -> Pinned)"))  # other direction
    events.append(copy(3100.0, 1.0, 8_000))  # a page index: too small to count
    events.append(kernel("_split_kernel", 0.0, 450.0))  # a waiting attention kernel: not a load
    events.append(kernel("_skinny_kernel", 90.0, 220.0))  # beside DMAs 2..6
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_transfers_split_by_gaps_with_rates_alone_and_beside_kernels(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    synthetic(path)
    assert trace_copies.main([str(path), "--json", "--kernels", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["dmas"] for r in rows] == [10, 1]
    first = rows[0]
    assert first["bytes"] == 20_000_000 and first["span_us"] == 445.0 and first["idle_us"] == 45.0
    assert first["dmas_beside_kernels"] == 5 and first["dmas_alone"] == 5  # the split kernel is not a load
    assert first["gb_s_alone"] == first["gb_s_beside_kernels"] == 50.0
    assert [name for name, _ in first["beside"]] == ["_split_kernel", "_skinny_kernel"]
    assert trace_copies.main([str(path), "--direction", "DtoH", "--json"]) == 0
    assert [r["dmas"] for r in json.loads(capsys.readouterr().out)] == [1]
