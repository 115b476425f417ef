"""Lease range arithmetic and the in-process lease book (tcp owner side)."""
from __future__ import annotations

import time

import pytest

from kvstore.transfer import LeaseExpired, OutOfBounds
from kvstore.transfer.lease import LeaseBook, check_lease, covers, normalize_ranges


def test_normalize_ranges_sorts_and_merges_adjacent_and_overlapping():
    assert normalize_ranges([(100, 50), (0, 10), (10, 10), (140, 20), (300, 1)], 1000) == ([0, 100, 300],
                                                                                            [20, 160, 301])


@pytest.mark.parametrize("ranges", [[(-1, 4)], [(0, 0)], [(990, 11)], []])
def test_normalize_ranges_rejects_ranges_outside_the_region(ranges):
    with pytest.raises(ValueError):
        normalize_ranges(ranges, 1000)


@pytest.mark.parametrize("offset,length,expected", [(0, 20, True), (5, 10, True), (15, 6, False), (100, 60, True),
                                                    (99, 2, False), (159, 1, True), (160, 1, False)])
def test_covers_needs_one_merged_span_to_hold_the_whole_range(offset, length, expected):
    starts, ends = [0, 100], [20, 160]
    assert covers(starts, ends, offset, length) is expected


def test_lease_book_grant_check_release():
    book = LeaseBook()
    lease = book.grant("pool", 1000, [(0, 100)], ttl_s=30.0)
    check_lease(book.get(lease), lease, "pool", 10, 90, 0)
    with pytest.raises(OutOfBounds):
        check_lease(book.get(lease), lease, "pool", 50, 51, 0)
    with pytest.raises(OutOfBounds):
        check_lease(book.get(lease), lease, "other", 0, 1, 0)
    assert book.release(lease) is True and book.release(lease) is False
    with pytest.raises(LeaseExpired):
        check_lease(book.get(lease), lease, "pool", 0, 1, 0)


def test_lease_book_expires_by_ttl_and_sweeps_expired_leases():
    book = LeaseBook()
    lease = book.grant("pool", 1000, [(0, 100)], ttl_s=0.05)
    assert book.live(lease)
    time.sleep(0.06)
    assert not book.live(lease)
    with pytest.raises(LeaseExpired):
        check_lease(book.get(lease), lease, "pool", 0, 1, 0)
    book.grant("pool", 1000, [(0, 1)], ttl_s=30.0)  # granting sweeps the expired one
    assert len(book) == 1


def test_lease_book_drop_region_ends_its_leases():
    book = LeaseBook()
    a, b = book.grant("a", 10, [(0, 1)], 30.0), book.grant("b", 10, [(0, 1)], 30.0)
    book.drop_region("a")
    assert not book.live(a) and book.live(b)


def test_ttl_must_be_positive():
    with pytest.raises(ValueError):
        LeaseBook().grant("pool", 10, [(0, 1)], ttl_s=0)
