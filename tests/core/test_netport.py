"""The tests' port picker (tests/netport.py): ports below the kernel's
ephemeral range, distinct, free (a server binds them), and never one a
listening server holds."""

from __future__ import annotations

import socket

import pytest

import tests.netport as netport


def test_ports_lie_below_the_ephemeral_range_distinct_and_bindable() -> None:
    top = netport._ephemeral_start()
    ports = netport.free_ports(16)
    assert len(set(ports)) == 16
    assert all(10000 <= p < top for p in ports), (ports, top)
    socks = []
    try:
        for p in ports:  # each one free: a server can bind it
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", p))
    finally:
        for s in socks:
            s.close()


def test_a_port_a_server_holds_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", netport.free_port()))
        server.listen()
        held = server.getsockname()[1]
        other = netport.free_port()
        picks = iter([held, held, other])
        monkeypatch.setattr(netport._RANDOM, "randrange", lambda lo, hi: next(picks))
        assert netport.free_port() == other
