"""CPU side of session 65's GPU mutation check of scheduler/cuda_graphs.py (its GPU side:
tests/test_gpu_graph_staging_s65.py): which captured verify graph a speculative verify step replays."""
from __future__ import annotations

from scheduler.cuda_graphs import DecodeGraphs
from test_mutation_kernels_s56 import _graphs


def test_a_verify_step_takes_the_smallest_verify_graph_that_holds_it():
    """G21 / G22: a verify step of up to verify_rows tokens a sequence replays the smallest captured verify graph
    that holds its sequences (a graph a size up computes padding sequences for nothing); a row more than the graph
    has, a page table longer than its, or more sequences than the largest holds runs eagerly."""
    g = _graphs(max_batch=8, max_pages=10)
    g.verify_rows = 8
    g.verify_graphs = {(b, 8): object() for b, rows in g.shapes if rows > 1}  # 1, 2, 4, 8 sequences of 8 rows
    short = [list(range(3))]
    assert DecodeGraphs.verify_shape_for(g, [8], short) == (1, 8)
    assert DecodeGraphs.verify_shape_for(g, [9], short) is None
    assert DecodeGraphs.verify_shape_for(g, [3, 8], short * 2) == (2, 8)
    assert DecodeGraphs.verify_shape_for(g, [4] * 3, short * 3) == (4, 8)
    assert DecodeGraphs.verify_shape_for(g, [4] * 8, short * 8) == (8, 8)
    assert DecodeGraphs.verify_shape_for(g, [4] * 9, short * 9) is None
    assert DecodeGraphs.verify_shape_for(g, [4], [list(range(10))]) == (1, 8)
    assert DecodeGraphs.verify_shape_for(g, [4], [list(range(11))]) is None
    assert DecodeGraphs.verify_max_seqs.fget(g) == 8
