"""Moving KV bytes between instances through a real transfer engine (docs/design.md §4.20,
``../shared/DESIGN.md`` §V): ``register`` memory, ``write`` batches of (source, destination,
length) into a peer's registered memory, ``poll`` a write until it is done.

Two engines, both TCP on CPU (RDMA or NVLink on GPU hosts): Mooncake's transfer engine
(``mooncake-transfer-engine-non-cuda``; peer-to-peer handshake, no metadata server; chosen:
measured 0.45-0.55 GB/s between two processes on this machine's loopback against NIXL's
0.26-0.36, a 46 MB wheel without a torch dependency against 68 MB with one, and a dead peer is
an error code at once) and NIXL (``nixl-cu12`` over UCX with ``UCX_TLS=tcp``; a dead peer raises
``nixlRemoteDisconnectError`` at once), kept pluggable behind the same three calls.
"""

from __future__ import annotations

import os
import time
import uuid
from abc import ABC, abstractmethod


class TransferError(RuntimeError):
    """A write that failed or did not finish in time (the peer is gone or unreachable)."""


class Transport(ABC):
    """One instance's endpoint. ``session``: what a peer passes to ``write`` to reach it."""

    session: str

    @abstractmethod
    def register(self, addr: int, nbytes: int) -> None:
        """Make [addr, addr + nbytes) of this process's memory readable and writable by peers."""

    @abstractmethod
    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> object:
        """Start copying each src[i] (local, registered) to dst[i] (the peer's, registered) of
        lengths[i] bytes, as one batch; returns a handle for ``poll``."""

    @abstractmethod
    def poll(self, handle: object) -> bool:
        """Whether the write is done; TransferError if it failed."""

    def wait(self, peer: str, handle: object, deadline: float) -> None:
        """Poll a write to ``peer`` until it is done; TransferError past ``deadline`` (monotonic)."""
        while not self.poll(handle):
            if time.monotonic() > deadline:
                raise TransferError(f"a KV write to {peer} did not finish in time")
            time.sleep(0.0005)

    def write_all(self, peer: str, src: list[int], dst: list[int], lengths: list[int], timeout: float) -> None:
        """``write`` and wait for it, at most ``timeout`` seconds (TransferError past it)."""
        self.wait(peer, self.write(peer, src, dst, lengths), time.monotonic() + timeout)


class MooncakeTransport(Transport):
    """Mooncake's transfer engine, ``protocol`` tcp (rdma on hosts with RDMA NICs)."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise TransferError(f"Mooncake's transfer engine did not start on {host} ({protocol})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, addr: int, nbytes: int) -> None:
        if self.engine.register_memory(addr, nbytes) != 0:
            raise TransferError(f"Mooncake could not register {nbytes} bytes at {addr:#x}")

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> object:
        batch = self.engine.batch_transfer_async_write(peer, src, dst, lengths)
        if batch == 0:
            raise TransferError(f"Mooncake could not start a write to {peer}")
        return batch

    def poll(self, handle: object) -> bool:
        status = self.engine.get_batch_transfer_status([handle])
        if status < 0:
            raise TransferError(f"a KV write failed (Mooncake status {status}; the peer is gone?)")
        return status == 0


class NixlTransport(Transport):
    """NIXL over UCX (TCP unless ``UCX_TLS`` says otherwise). A peer's ``session`` is its agent
    metadata, hex-encoded."""

    def __init__(self, name: str | None = None) -> None:
        os.environ.setdefault("UCX_TLS", "tcp")
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(
            name or f"fastdeploy-{os.getpid()}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"])
        )
        self.peers: dict[str, str] = {}
        self.session = ""

    def register(self, addr: int, nbytes: int) -> None:
        self.agent.register_memory(self.agent.get_reg_descs([(addr, nbytes, 0, "")], "DRAM"))
        self.session = self.agent.get_agent_metadata().hex()  # registrations are part of it

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> object:
        if peer not in self.peers:
            self.peers[peer] = self.agent.add_remote_agent(bytes.fromhex(peer))
        s = self.agent.get_xfer_descs([(a, n, 0) for a, n in zip(src, lengths, strict=True)], "DRAM")
        d = self.agent.get_xfer_descs([(a, n, 0) for a, n in zip(dst, lengths, strict=True)], "DRAM")
        for _ in range(200):  # the first connection to a peer takes a moment
            try:
                handle = self.agent.initialize_xfer("WRITE", s, d, self.peers[peer], b"kv")
                break
            except Exception:  # noqa: BLE001 - not connected yet
                time.sleep(0.01)
        else:
            raise TransferError("NIXL could not reach its peer")
        try:
            self.agent.transfer(handle)
        except Exception as e:  # noqa: BLE001 - NIXL's errors, remote disconnects included
            raise TransferError(f"a KV write failed ({type(e).__name__})") from None
        return handle

    def poll(self, handle: object) -> bool:
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001 - NIXL's errors, remote disconnects included
            raise TransferError(f"a KV write failed ({type(e).__name__})") from None
        if state == "ERR":
            raise TransferError("a KV write failed (NIXL state ERR)")
        return state == "DONE"


CONNECTORS = {"MooncakeConnector": MooncakeTransport, "NixlConnector": NixlTransport}


def make_transport(connector: str, host: str = "127.0.0.1") -> Transport:
    """The transport ``--kv-transfer-config``'s ``kv_connector`` names."""
    if connector == "NixlConnector":
        return NixlTransport()
    return MooncakeTransport(host)
