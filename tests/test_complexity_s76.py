"""Session 76's complexity hunt: costs that grew faster than the work, each pinned by counting operations (never by
timing): a radix tree's eviction of many sibling prefixes, a completion's text over a run of special tokens, a
chained decode step's rows."""
from __future__ import annotations

from hicache.allocator import PageAllocator
from hicache.radix import RadixTree, Tier
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import Request, SamplingParams
from scheduler.stop_strings import CompletionText
from scheduler.tokenizer import HFTokenizer

PS = 4


class _CountingChildren(dict):
    """A node's children dict that counts the entries its `values()` walks hand out."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.visits = 0

    def values(self):
        for child in super().values():
            self.visits += 1
            yield child


def _shared_prefix_tree(num_branches: int) -> tuple[RadixTree, object]:
    """One prefix page (a system prompt), and `num_branches` one-page continuations of it, each in L1 and in L2
    (write-through's backups): the prefix node's children."""
    allocs = {tier: PageAllocator(num_branches + 1, tier.label) for tier in (Tier.L1, Tier.L2)}
    tree = RadixTree(PS, allocs)
    prefix = [1] * PS
    for i in range(-1, num_branches):
        tokens = prefix if i < 0 else prefix + [i + 10] * PS
        for tier in (Tier.L1, Tier.L2):
            claim = allocs[tier].new_claim("test")
            tree.insert(tokens, tier, allocs[tier].alloc(1, claim), claim,
                        start_tokens=0 if i < 0 else PS)
            allocs[tier].close_claim(claim)
    return tree, tree.match(prefix, touch=False).path[0]


def test_evicting_l1_branches_that_l2_keeps_walks_no_sibling_per_eviction():
    """Regression: whether a node became a leaf of a tier after one of its children left that tier was found by
    walking its children for one still resident, so evicting from L1 the continuations of one prefix that L2 still
    held (they stay in the tree, ahead of the resident ones) walked all those evicted before it: quadratic, 3.3 s
    to evict 8,000 branches of one system prompt (0.07 s for 1,000). A node counts its resident children per tier."""
    branches = 400
    tree, shared = _shared_prefix_tree(branches)
    shared.children = _CountingChildren(shared.children)
    assert tree.evict(Tier.L1, branches) == branches  # the branches only: the prefix is a leaf of L1 after them
    assert shared.children.visits <= 2 * branches, shared.children.visits
    assert tree.evict(Tier.L1, 1) == 1  # then the prefix itself, found as L1's leaf
    assert tree.match([1] * PS + [10] * PS).lengths[Tier.L2] == 2 * PS
    tree.check_integrity()


# -- a completion's text: special tokens a response leaves out ---------------------------------------------------------
def _tokenizer_with_eos(path) -> HFTokenizer:
    """A word-level tokenizer.json with a special token "<eos>" (a decode with skip_special_tokens leaves it out)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 5, "there": 6}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text("{}")
    return HFTokenizer(str(path))


def test_a_run_of_skipped_special_tokens_is_not_decoded_again_at_each_token(tmp_path):
    """Regression: the incremental decoder re-decodes its window of ids after the last text it sent, and a special
    token that skip_special_tokens leaves out adds no text, so a run of them (a model repeating its EOS under
    ignore_eos, the benchmarks' setting) grew the window by one id a token and decoded it whole each time:
    quadratic, 3.8 s of the event loop for 8,000 tokens (0.07 s for 1,000). Such a token is left out of the window,
    as vLLM's detokenizer leaves it out of its tokens; the text is the same."""
    tok = _tokenizer_with_eos(tmp_path)
    eos, hi, there = tok.tok.token_to_id("<eos>"), 5, 6
    decoded_ids = []
    decode = tok.decode
    tok.decode = lambda ids, skip_special_tokens=True: decoded_ids.append(len(ids)) or decode(ids, skip_special_tokens)
    run = 300
    ids = [hi] + [eos] * run + [there, eos]
    text = CompletionText(tok, [])
    streamed = "".join(text.feed(t) for t in ids) + text.flush()
    assert sum(decoded_ids) <= 8 * len(ids), sum(decoded_ids)
    assert streamed == tok.decode(ids) == "hi there"
    kept = CompletionText(tok, [], skip_special_tokens=False)  # (kept, the special tokens are text)
    assert "".join(kept.feed(t) for t in ids[:3]) + kept.flush() == tok.decode(ids[:3], skip_special_tokens=False)


# -- a chained decode step's rows --------------------------------------------------------------------------------------
def test_a_chained_decode_step_finds_its_rows_without_searching_the_batch(monkeypatch):
    """Regression: a chained decode step found each of its requests' rows in the step before by a search of that
    step's list (`list.index`), B * B / 2 comparisons a step: 0.5 ms of host time a step at 256 running requests,
    1.8 ms at 512, 8 ms at 1,024 (more than a small model's decode step). Counted here as the requests compared
    (Request compares by identity: an __eq__ that counts stands in)."""
    compared = [0]

    def counting_eq(self, other):
        compared[0] += 1
        return self is other
    monkeypatch.setattr(Request, "__eq__", counting_eq)
    batch, steps = 16, 24
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=256))
    results = eng.generate([[i + 1] * 5 for i in range(batch)], SamplingParams(max_tokens=steps, ignore_eos=True))
    assert eng.stats["chained_steps"] >= steps // 2
    assert all(len(r.output_ids) == steps for r in results)
    assert compared[0] <= batch * batch, compared[0]  # (not a search per row per step: ~2,500 here)
    eng.check_integrity()
