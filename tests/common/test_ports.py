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
