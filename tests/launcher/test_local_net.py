"""``free_port`` picks below the kernel's ephemeral range, so a port chosen now and bound later
cannot be handed out meanwhile by the kernel (vLLM opens ~20 kernel-chosen ports as it starts)."""

from __future__ import annotations

import socket

from omni_mesh.procutil import FREE_PORT_LOW, ephemeral_low, free_port


def test_ephemeral_low_matches_the_kernel() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert ephemeral_low() == int(f.read().split()[0])


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    ports = {free_port() for _ in range(20)}
    assert all(FREE_PORT_LOW <= p < ephemeral_low() for p in ports)
    assert len(ports) > 1  # random, not one fixed port
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_skips_a_taken_port() -> None:
    taken = [socket.socket() for _ in range(3)]
    try:
        held = set()
        for s in taken:
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.add(s.getsockname()[1])
        assert all(free_port() not in held for _ in range(50))
    finally:
        for s in taken:
            s.close()
