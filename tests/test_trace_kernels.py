"""scripts/trace_kernels.py on a synthetic chrome trace: forwards found by idle gaps, their span
split into kernel families and idle time, other streams' overlap counted."""
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import trace_kernels  # noqa: E402


def kernel(name, ts, dur, tid=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur}


def synthetic(path: Path) -> None:
    events, t = [], 0.0
    for _ in range(2):  # two forwards of 120 kernels: 10 us skinny + 1 us idle, 5 us norm + 1 us idle
        for i in range(60):
            events.append(kernel("_skinny_kernel", t, 10.0))
            t += 11.0
            events.append(kernel("_add_rms_norm_kernel", t, 5.0))
            t += 6.0
        t += 5000.0  # the host between requests
    events.append(kernel("h2d_layers_kernel", 100.0, 300.0, tid=9))  # a copy kernel beside the first
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 5})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_forwards_split_into_families_and_idle_time(tmp_path, capsys):
    path = tmp_path / "l2.json.gz"
    synthetic(path)
    kernels = trace_kernels.load(str(path))
    runs = trace_kernels.forwards(kernels, gap_us=200, min_kernels=100)
    assert [len(r) for r in runs] == [120, 120]
    main = {id(k) for r in runs for k in r}
    others = [k for k in kernels if id(k) not in main]
    first = trace_kernels.summarize(runs[0], others)
    assert first["span_us"] == 60 * 17 - 1  # the last norm ends 1 us before the next would start
    assert first["busy_us"] == 60 * 15
    assert first["idle_us"] == first["span_us"] - first["busy_us"]
    assert first["by_family_us"] == {"skinny": 600.0, "add_rms_norm": 300.0}
    assert first["other_streams_us"] == {"copy kernel": 300.0}
    assert trace_kernels.summarize(runs[1], others)["other_streams_us"] == {}
    assert trace_kernels.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 forwards" in out and "skinny" in out and "copy kernel" in out


def test_skinny_projections_split_by_their_place_in_a_layer(tmp_path):
    """--split-skinny: a layer's skinny kernels come as qkv, o_proj, gate_up, down, in that order."""
    path = tmp_path / "l2.json.gz"
    synthetic(path)
    runs = trace_kernels.forwards(trace_kernels.load(str(path)), gap_us=200, min_kernels=100)
    split = trace_kernels.summarize(runs[0], [], split_skinny=True)
    assert split["calls"] == {"skinny qkv": 15, "skinny o_proj": 15, "skinny gate_up": 15, "skinny down": 15,
                              "add_rms_norm": 60}
    assert sum(v for f, v in split["by_family_us"].items() if f.startswith("skinny")) == 600.0


def test_a_trace_without_kernels_is_an_error(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "pid": 0, "tid": 0,
                                                 "ts": 0, "dur": 1}]}))
    assert trace_kernels.main([str(path)]) == 1


def test_kernel_families():
    """cuDNN's flash attention is named like a GEMM kernel (sm90, wgmma): it is attention, not a
    projection (the first table in docs/benchmarks.md counted it with the GEMMs)."""
    family = trace_kernels.family
    assert family("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128") == "attention (SDPA)"
    assert family("nvjet_sm90_tst_384x16_64x4_2x1_v_bz_TNT") == "gemm (cuBLAS)"
    assert family("_skinny_kernel") == "skinny"
    assert family("_split_kernel") == "attention split"
    assert family("some_unknown_kernel_with_a_long_name_beyond_forty_chars") == "some_unknown_kernel_with_a_long_name_bey"
