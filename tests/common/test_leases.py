"""Leases on handed-off pages: granted, read, acked once, expired by the clock."""

import pytest

from common.paged_cache import PageLayout
from common.transfer import LeaseTable, PageHandle

LAYOUT = PageLayout("kv", "float32", 16, (2, 2, 16, 2, 8))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_grant_take_once_and_expire():
    clock = Clock()
    table = LeaseTable("p-1", "127.0.0.1:9", ttl_s=5, clock=clock)
    a = table.grant("r1@prefill", [7, 3], 20, LAYOUT)
    b = table.grant("r2@prefill", [4], 16, LAYOUT)
    assert (a.worker_id, a.address, a.block_ids, a.num_tokens, a.lease_expiry) == (
        "p-1",
        "127.0.0.1:9",
        (7, 3),
        20,
        1005.0,
    )
    assert a.num_bytes == 2 * LAYOUT.bytes_per_block
    with pytest.raises(ValueError, match="already leased"):
        table.grant("r1@prefill", [1, 2], 20, LAYOUT)
    assert table.take(a.lease_id).engine_request_id == "r1@prefill"
    assert table.take(a.lease_id) is None
    clock.now = 1005.5
    assert table.get(b.lease_id) is None  # expired: no longer readable
    assert [lease.lease_id for lease in table.expired()] == ["r2@prefill"]
    assert table.expired() == [] and len(table) == 0


def test_the_lease_count_is_reported_as_it_changes():
    clock, counts = Clock(), []
    table = LeaseTable("p-1", "127.0.0.1:9", ttl_s=5, clock=clock, on_change=counts.append)
    a = table.grant("r1@prefill", [7], 16, LAYOUT)
    table.grant("r2@prefill", [4], 16, LAYOUT)
    table.take(a.lease_id)
    table.take(a.lease_id)  # unknown now: no change
    clock.now = 1006
    table.expired()
    table.expired()
    assert counts == [0, 1, 2, 1, 0]


def test_handle_checks_its_block_count():
    with pytest.raises(ValueError, match="block ids"):
        PageHandle("w", "a", "l", (1,), 17, LAYOUT, 0.0)
    with pytest.raises(ValueError, match="cache kind"):
        PageHandle("w", "a", "l", (1,), 3, PageLayout("disk", "float32", 16, (1,)), 0.0)
