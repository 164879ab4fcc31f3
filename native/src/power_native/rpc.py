"""llama.cpp's RPC backend: a target's layers on remote ``rpc-server`` processes (config
``rpc_servers``, ``power run --rpc HOST:PORT[,...]``; power-native built with ``POWER_NATIVE_RPC=1``).

ggml-rpc aborts the whole process when it cannot connect or the handshake fails, so every endpoint
is probed here first, in Python, with a bounded timeout: a TCP connect and the protocol's HELLO
(command 14, 24 capability bytes; the reply carries the server's protocol version). A refused,
unreachable, silent (e.g. serving another client) or foreign endpoint becomes a typed
:class:`~power_core.errors.RuntimeFault` naming the address, before llama.cpp sees it.

ggml-rpc is **unauthenticated and unencrypted**: anyone who can reach an ``rpc-server`` can run
graphs on it and read what it holds. Bind servers to loopback or a private network only.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import weakref
from collections.abc import Iterable

from power_core.config import parse_endpoint
from power_core.errors import RuntimeFault

__all__ = ["RpcUnreachable", "parse_endpoint", "probe", "connected", "hold", "PROTOCOL_MAJOR", "PROBE_TIMEOUT_S"]

#: the pinned ggml-rpc protocol (ggml/include/ggml-rpc.h RPC_PROTO_MAJOR/MINOR_VERSION): the client
#: aborts on another major or a newer minor
PROTOCOL_MAJOR = 7
PROTOCOL_MINOR = 0
_HELLO = 14  # RPC_CMD_HELLO, fixed by the protocol
_CAPS = 24  # RPC_CONN_CAPS_SIZE
#: seconds a probe may take per endpoint (``POWER_RPC_TIMEOUT`` overrides)
PROBE_TIMEOUT_S = 5.0


class RpcUnreachable(RuntimeFault):
    """An ``rpc-server`` endpoint refused, timed out or did not speak ggml-rpc."""

    code = "rpc_unreachable"


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        out += chunk
    return out


def probe(endpoint: str, timeout: float | None = None) -> tuple[int, int, int]:
    """Connect to ``endpoint`` and exchange ggml-rpc's HELLO within ``timeout`` seconds; return the
    server's protocol version or raise :class:`RpcUnreachable` (the address and why)."""
    host, port = parse_endpoint(endpoint)
    timeout = float(os.environ.get("POWER_RPC_TIMEOUT", PROBE_TIMEOUT_S)) if timeout is None else timeout
    try:
        # IPv4, as ggml-rpc's client resolves (gethostbyname): an IPv6-only name must fail here
        addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]  # (ip, port)
        with socket.create_connection((str(addr[0]), int(addr[1])), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack("<BQ", _HELLO, _CAPS) + bytes(_CAPS))
            (size,) = struct.unpack("<Q", _recv(sock, 8))
            if size != 4 + _CAPS:
                raise ConnectionError(f"unexpected HELLO reply of {size} bytes")
            major, minor, patch = _recv(sock, size)[:3]
    except TimeoutError:
        raise RpcUnreachable(f"rpc server {endpoint}: no answer within {timeout:g} s (down, firewalled, or busy "
                             "with another client); check that rpc-server runs there") from None
    except socket.gaierror as exc:
        raise RpcUnreachable(f"rpc server {endpoint}: cannot resolve {host!r} to an IPv4 address ({exc.strerror})") from None
    except OSError as exc:  # refused, unreachable, reset, closed (ConnectionError is an OSError)
        raise RpcUnreachable(f"rpc server {endpoint}: {exc.strerror or exc}; check the address and that "
                             "rpc-server runs there") from None
    if major != PROTOCOL_MAJOR or minor > PROTOCOL_MINOR:
        raise RpcUnreachable(f"rpc server {endpoint} speaks ggml-rpc {major}.{minor}.{patch}; this power-native "
                             f"needs {PROTOCOL_MAJOR}.{PROTOCOL_MINOR} or an older minor (build rpc-server from the same "
                             "pinned llama.cpp)")
    return major, minor, patch


# ggml-rpc keeps one connection per endpoint for as long as buffers live there, and rpc-server serves
# one client at a time: while a model of this process is on a server, a probe would wait in its queue
_held: dict[str, weakref.WeakSet] = {}
_held_lock = threading.Lock()


def hold(endpoints: Iterable[str], model: object) -> None:
    """Record that ``model`` (loaded onto ``endpoints``) keeps their connections open."""
    with _held_lock:
        for endpoint in endpoints:
            _held.setdefault(endpoint, weakref.WeakSet()).add(model)


def connected(endpoint: str) -> bool:
    """True while a model of this process lives on ``endpoint`` (llama.cpp reuses that connection)."""
    with _held_lock:
        return bool(_held.get(endpoint))
