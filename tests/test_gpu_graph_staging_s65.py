"""GPU-only (skipped without CUDA): what a captured graph's step stages, checked with the device kept busy so that
the host runs ahead of it, as it does under load. Session 65's GPU mutation check of scheduler/cuda_graphs.py:
mutants that dropped the waits guarding the pinned staging buffers, or a restore step's staged epoch, passed every
other GPU test, whose devices were never behind their hosts."""
import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.cuda_graphs import TAIL_ROWS
from scheduler.request import SamplingParams

pytestmark = pytest.mark.gpu

BUSY_CYCLES = 300_000_000  # one spinning kernel of ~0.2 s: the host gets well ahead of the device


def graph_engine(**kw):
    """A tiny engine on CUDA, started once (its graphs captured), and an L1 page of the test's own."""
    from scheduler.engine import Engine

    cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=64, page_size=16, cuda_graphs=True)
    if kw.pop("l2", False):
        cfg = cfg.with_hicache(enable=True, policy="always", host_ratio=2.0)
    eng = Engine(EngineConfig(**{**cfg.__dict__, **kw}))
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert eng.runner.graphs is not None
    return eng, eng.runner.graphs, eng.hold_l1_page("test")


def alone_then_queued(step, inputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each input's `step` result run alone (the device idle before each), then all of them queued behind a busy
    device (the host staging every step well before the device reads what it staged)."""
    alone = []
    for x in inputs:
        alone.append(step(x))
        torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    queued = [step(x) for x in inputs]
    torch.cuda.synchronize()
    return alone, queued


def test_graph_steps_queued_behind_a_busy_device_each_read_their_own_inputs():
    """Two pinned staging buffers alternate; a step refills one only once the device has copied what the step
    two before staged in it. Without that wait, a third step's inputs overwrote the first's before the device read
    them, and the first step computed the third's token."""
    eng, graphs, page = graph_engine()

    def step(token: int) -> torch.Tensor:  # one token at position 0 of `page`: its logits depend on its id alone
        return graphs.run((1, 1), [token], [0], [1], [[page]]).clone()  # [1, V]

    alone, queued = alone_then_queued(step, [11, 222, 333, 444])
    assert not torch.equal(alone[0], alone[2])  # (the tokens give different logits)
    assert all(torch.equal(a, q) for a, q in zip(alone, queued))


def test_prefill_graphs_queued_behind_a_busy_device_each_read_their_own_inputs():
    """A fresh prefill's graph has one staging buffer: the next prefill refills it only once the device copied it."""
    eng, graphs, page = graph_engine(enable_prefix_cache=False)
    length = graphs.prefill_buckets[0]
    prompts = [[(7 * i + j) % 500 + 1 for j in range(12)] for i in range(3)]  # (12 tokens: within `page`)

    def prefill(prompt: list[int]) -> torch.Tensor:
        return graphs.run_prefill(length, prompt, [page]).clone()  # [1, V]

    alone, queued = alone_then_queued(prefill, prompts)
    assert not torch.equal(alone[0], alone[1])
    assert all(torch.equal(a, q) for a, q in zip(alone, queued))


def test_a_restore_graph_waits_for_the_epoch_its_step_staged():
    """A tail forward beside a layer-ordered restore replays the graph whose attention first waits, per layer, for
    the restore's epoch (staged with the step's inputs). An epoch every layer's flag has reached passes; one no copy
    will ever signal makes each wait give up (~1.3 s) and say so, as a restore's lost copy would (the forward is then
    discarded and recomputed). Without the staged epoch, or replaying the plain graph, nothing waited."""
    eng, graphs, page = graph_engine(l2=True)
    flags = eng.runner.layer_flags
    # (a one-token forward and a tail of up to TAIL_ROWS tokens beside a restore replay a graph, not eagerly)
    assert flags is not None and graphs.has_restore_graph((1, 1)) and graphs.has_restore_graph((1, TAIL_ROWS))
    reached, never = int(flags.flags.min()), int(flags.flags.max()) + 1
    assert not flags.timed_out()
    graphs.run((1, 1), [5], [0], [1], [[page]], wait_restore=True, restore_epoch=reached)
    assert not flags.timed_out()
    graphs.run((1, 1), [5], [0], [1], [[page]], wait_restore=True, restore_epoch=never)
    assert flags.timed_out()
