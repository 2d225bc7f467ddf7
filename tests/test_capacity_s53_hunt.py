"""Regressions from session 53's capacity hunt: a page larger than the L1 pool it divides is refused whether the
page size was given (--page-size) or is the device's default (3 tokens were one default page of 4, and refused as
--page-size 4); a pool of whole pages, or rounded up to them, is taken either way."""
from __future__ import annotations

import pytest

from scheduler.config import EngineConfig


@pytest.mark.parametrize("page_size,named", [(0, "the device's default page size 4"), (4, "page_size (--page-size) 4")])
def test_a_page_past_the_pool_is_refused_given_or_default(page_size, named):
    with pytest.raises(ValueError) as err:
        EngineConfig(model="tiny", device="cpu", max_total_tokens=3, page_size=page_size)
    assert str(err.value).startswith(named) and "--max-total-tokens 3" in str(err.value)


@pytest.mark.parametrize("page_size", [0, 4])
@pytest.mark.parametrize("tokens,pages", [(4, 1), (5, 2)])
def test_pools_of_a_page_or_more_are_rounded_up_to_whole_pages(page_size, tokens, pages):
    config = EngineConfig(model="tiny", device="cpu", max_total_tokens=tokens, page_size=page_size)
    assert config.l1_pages(config.page_size_on("cpu")) == pages
