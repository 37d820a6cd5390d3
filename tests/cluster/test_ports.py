"""Ports for the servers a run starts: chosen outside the kernel's ephemeral range, and a server whose chosen port
another process bound first is started again on a fresh one (counted).

The failure this guards against happened in CI: an engine's port came from bind(port 0), i.e. from the range every
outgoing connection takes its source port from, and before the CPU server bound it uvicorn said
"[Errno 98] ... address already in use".
"""

from __future__ import annotations

import socket

import pytest

from mgrpo import net
from mgrpo.net import LISTEN_PORTS, ephemeral_range, free_port
from mgrpo.rollout.sglang import server as server_mod
from mgrpo.rollout.sglang.server import PortInUseError, start_on_free_port


def _bound(port: int = 0) -> socket.socket:
    """A socket holding a port (bound, not listening: unit tests start no server)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    return s


# --- choosing -----------------------------------------------------------------------------------------------
def test_free_port_lies_below_the_ephemeral_range_and_binds():
    lo, hi = LISTEN_PORTS[0], min(LISTEN_PORTS[1], ephemeral_range()[0])
    ports = [free_port("127.0.0.1") for _ in range(200)]
    assert all(lo <= p < hi for p in ports), sorted(p for p in ports if not lo <= p < hi)
    assert len(set(ports)) > 150  # drawn at random, not a fixed sequence each caller would repeat
    with _bound(ports[0]):  # free: it binds
        pass


def test_free_port_skips_a_held_port_and_falls_back_to_the_kernel_when_none_binds(monkeypatch):
    with _bound() as held:
        port = held.getsockname()[1]
        monkeypatch.setattr(net, "LISTEN_PORTS", (port, port + 1))  # the only candidate is taken
        got = free_port("127.0.0.1", attempts=5)
    assert got != port and ephemeral_range()[0] <= got <= ephemeral_range()[1]


def test_ephemeral_range_reads_the_kernel_setting(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(str(f)) == (40000, 50000)
    f.write_text("garbage")
    assert ephemeral_range(str(f)) == (32768, 60999)  # Linux's default
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


# --- starting ------------------------------------------------------------------------------------------------
def test_a_taken_chosen_port_is_replaced_and_counted(monkeypatch):
    chosen = iter([21001, 21002, 21003])
    monkeypatch.setattr(server_mod, "free_port", lambda host: next(chosen))
    tried = []

    def start(port):
        tried.append(port)
        if port == 21001:
            raise PortInUseError("address already in use")
        return f"server on {port}"

    assert start_on_free_port(start, "127.0.0.1") == ("server on 21002", 21002, 1)
    assert tried == [21001, 21002]


def test_a_given_port_is_never_replaced_and_starts_are_bounded(monkeypatch):
    monkeypatch.setattr(server_mod, "free_port", lambda host: 21005)
    calls = []

    def taken(port):
        calls.append(port)
        raise PortInUseError(f"port {port} taken")

    with pytest.raises(PortInUseError, match="port 21010 taken"):
        start_on_free_port(taken, "127.0.0.1", port=21010)
    assert calls == [21010]
    calls.clear()
    with pytest.raises(PortInUseError):
        start_on_free_port(taken, "127.0.0.1", attempts=3)
    assert calls == [21005] * 3

    def broken(port):  # any other startup failure is not retried
        calls.append(port)
        raise RuntimeError("CUDA out of memory")

    calls.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        start_on_free_port(broken, "127.0.0.1")
    assert calls == [21005]


@pytest.mark.integration
def test_the_cpu_server_and_the_router_started_on_taken_ports_come_up_on_others(tmp_path, monkeypatch):
    """The real CPU server (uvicorn, as SGLang's) and sglang-router (its bind error comes from Rust): the first port
    free_port gives each is held by another socket (bound, as the source port of a connection is), so each fails to
    bind; each is started again on a fresh port and the retry is counted."""
    pytest.importorskip("sglang_router")
    from mgrpo.rollout.sglang.router import RoutedClient
    from mgrpo.rollout.types import GenerateRequest, SamplingParams
    from tests.helpers.sglang_cpu import launch, tiny_checkpoint

    ckpt = tiny_checkpoint(str(tmp_path / "tiny"))
    with _bound() as held:
        taken = held.getsockname()[1]

        def taken_first(host):  # the first port chosen after each reset is the held one
            return next(firsts, None) or net.free_port(host)

        firsts = iter([taken])
        monkeypatch.setattr(server_mod, "free_port", taken_first)
        eng = launch(ckpt, str(tmp_path / "logs"))
        try:
            assert not eng.url.endswith(f":{taken}")
            assert eng.stats["launch_port_retries"] == 1 and eng.retries == 1
            assert "address already in use" in (tmp_path / "logs" / f"sglang-127.0.0.1-{taken}.log").read_text()
            firsts = iter([taken])
            front = RoutedClient([eng.url], host="127.0.0.1", log_dir=str(tmp_path / "router"))
            try:
                assert front.router.port_retries == 1 and not front.router.url.endswith(f":{taken}")
                assert "Address already in use" in (tmp_path / "router" / f"router-{taken}.log").read_text()
                out = front.generate([GenerateRequest(0, [1, 2])], SamplingParams(max_new_tokens=2))
                assert len(out[0].token_ids) == 2 and front.retries == 1
            finally:
                front.shutdown()
        finally:
            eng.shutdown()
