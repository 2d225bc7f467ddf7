"""GPU-only (skipped without CUDA): beam search (scheduler/beam_search.py) over the prefix cache and CUDA graphs."""
import pytest

from scheduler.config import EngineConfig
from test_gpu import prompts

pytestmark = pytest.mark.gpu


def test_beam_search_on_cuda_over_the_prefix_cache_equals_a_search_without_it():
    """Beam search (scheduler/beam_search.py) on CUDA with graphs: its steps re-send each beam, whose prefix the
    cache serves (a tail prefill of the last page), and give the beams of a search whose every step recomputes
    every sequence whole (no prefix cache, eager), float32; every step after the first read from the cache."""
    import asyncio

    from scheduler.beam_search import BeamSearchParams, beam_search
    from scheduler.engine import Engine

    prompt = prompts(1, base=70)[0]
    # (8 beams: each step after the first a prefill of 8 tails over cached prefixes, the (8, TAIL_ROWS) graph)
    params = BeamSearchParams(beam_width=8, max_tokens=6, ignore_eos=True, length_penalty=0.5)

    def search(**kw):
        eng = Engine(EngineConfig(model="tiny", device="cuda", dtype="float32", num_pages=512, page_size=16, **kw))

        async def go():
            try:
                return await beam_search(eng, prompt, params)
            finally:
                await eng.stop_loop()
        result = asyncio.run(go())
        eng.check_integrity()
        assert not eng.requests
        return result

    cached = search(cuda_graphs=True)
    whole = search(cuda_graphs=False, enable_prefix_cache=False)
    assert [b.output_ids for b in cached.beams] == [b.output_ids for b in whole.beams]
    for a, b in zip(cached.beams, whole.beams):
        assert abs(a.cum_logprob - b.cum_logprob) < 1e-3
    assert len(cached.beams) == 8 and all(n > 0 for n in cached.cached_tokens_per_step[1:])
    assert not any(whole.cached_tokens_per_step)
