import socket

from common.ports import ephemeral_range, free_port


def test_free_ports_come_from_below_the_ephemeral_range_and_bind():
    low, high = ephemeral_range()
    assert 1024 <= low < high
    for _ in range(20):
        port = free_port()
        assert port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_to_avoid_is_never_handed_out(monkeypatch):
    """A launch picks its toggle's port after the gateway's, which nobody binds until the gateway starts: the same
    number twice made the gateway fail to bind (seen once in CI)."""
    import random

    picks = iter([12345, 12345, 12346])
    monkeypatch.setattr(random, "randrange", lambda *_: next(picks))
    assert free_port(avoid={12345}) == 12346
