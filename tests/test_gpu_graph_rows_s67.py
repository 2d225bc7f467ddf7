"""GPU-only (skipped without CUDA): a replayed graph answers the rows of the batch it was given, not of the padded
shape it replays. Session 66's GPU mutation check found no test watching this: a decode step returning its padding
sequences' logits too (G4) and a verify step returning its padding sequences' rows too (G5) passed every GPU test,
since the sampler's callers read only their own rows. The padding rows would be sampled with the rest, for nothing,
and any caller counting rows would count them."""
import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.speculative import SpeculativeConfig

pytestmark = pytest.mark.gpu


def test_graph_steps_answer_the_batch_s_rows_not_the_padded_shape_s():
    from scheduler.engine import Engine
    eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=1024, page_size=16,
                              cuda_graphs=True, max_running_requests=8,
                              speculative=SpeculativeConfig(5, 4, 1, draft_policy="always")))
    graphs = eng.runner.graphs
    tables = [[1], [2], [3]]  # three free pages, one a sequence

    shape = graphs.shape_for([1, 1, 1], tables)
    assert shape == (4, 1)  # three sequences replay the four-sequence decode graph
    logits = graphs.run(shape, [5, 6, 7], [0, 0, 0], [1, 1, 1], tables)
    assert logits.shape == (3, eng.model_config.vocab_size)

    shape = graphs.verify_shape_for([2, 2, 2], tables)
    assert shape is not None and shape[0] == 4
    rows = graphs.run(shape, [5, 6, 7, 8, 9, 10], [0, 0, 0], [2, 2, 2], tables, verify=True)
    assert rows.shape == (3 * shape[1], eng.model_config.vocab_size)  # sequence b's rows from b * R
    torch.cuda.synchronize()
    eng.check_integrity()
