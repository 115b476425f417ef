"""Conditional disaggregation: which prompts the decode worker prefills itself."""
from __future__ import annotations

import pytest

from decode_worker.policy import ConditionalPolicy


def test_short_prompt_prefills_locally():
    assert ConditionalPolicy(max_local_tokens=64).place(64).local is True


def test_long_uncached_prompt_is_disaggregated():
    placement = ConditionalPolicy(max_local_tokens=64).place(500, 0)
    assert placement.local is False and "500 uncached" in placement.reason


def test_almost_fully_cached_long_prompt_prefills_locally():
    policy = ConditionalPolicy(max_local_tokens=64, min_cached_fraction=0.9, max_local_uncached_tokens=64)
    assert policy.place(640, 592).local is True          # 92.5% cached, 48 left
    assert policy.place(640, 560).local is False         # 87.5% cached
    assert policy.place(4000, 3800).local is False       # 95% cached but 200 tokens left


@pytest.mark.parametrize("field,value", [("max_local_tokens", -1), ("min_cached_fraction", 0.0),
                                         ("min_cached_fraction", 1.5), ("max_local_uncached_tokens", -3)])
def test_bad_policy_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ConditionalPolicy(**{field: value})
