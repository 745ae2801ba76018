"""A minimal RPC so a WeightSender in one process can drive an engine in another without HTTP.

RpcServer exposes a few of an object's methods on a localhost socket (multiprocessing.connection,
authenticated); RpcClient calls them, and EngineProxy is the client a WeightSender takes as a
target (where a server and RemoteEngine are more than a job needs: a sibling process, a
benchmark). Each call opens its own connection, so calls from several threads never interleave
on one socket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Client,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)
from typing import Any

EXPOSED = ("init_weights_update_group", "update_weights_from_distributed",
           "destroy_weights_update_group", "get_weight_version")


class RpcServer:
    """Serves `target`'s EXPOSED methods, one thread per connection."""

    def __init__(self, target: Any, authkey: bytes | None = None,
                 exposed: tuple[str, ...] = EXPOSED) -> None:
        self.target = target
        self.exposed = exposed
        self.authkey = authkey or os.urandom(16)
        # Authenticated per connection in its own thread (_serve), after TCP_NODELAY is set.
        self._listener = Listener(("127.0.0.1", 0))
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.address

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # accept() does not return when the socket is closed under it; a last client wakes it.
        with contextlib.suppress(OSError):
            Client(self.address).close()
        self._thread.join(timeout=5)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:  # the listener closed
                continue
            if self._closed:
                conn.close()
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            try:
                _no_delay(conn)
                deliver_challenge(conn, self.authkey)
                answer_challenge(conn, self.authkey)
                method, kwargs = conn.recv()
            except (EOFError, OSError, AuthenticationError):
                return
            try:
                if method not in self.exposed:
                    raise ValueError(f"method {method!r} is not exposed")
                reply = ("ok", getattr(self.target, method)(**kwargs))
            except Exception as exc:  # noqa: BLE001 - sent back to the caller
                reply = ("err", type(exc).__name__, str(exc))
            with contextlib.suppress(OSError):  # the caller may have died while we worked
                conn.send(reply)


class RpcClient:
    """Calls the methods an RpcServer exposes; a remote ValueError is raised as ValueError."""

    def __init__(self, address: tuple[str, int], authkey: bytes, timeout_s: float = 120.0
                 ) -> None:
        self.address = tuple(address)
        self.authkey = authkey
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address[0]}:{self.address[1]})"

    def call(self, method: str, **kwargs: Any) -> Any:
        with Client(self.address) as conn:
            _no_delay(conn)
            answer_challenge(conn, self.authkey)
            deliver_challenge(conn, self.authkey)
            conn.send((method, kwargs))
            if not conn.poll(self.timeout_s):
                raise TimeoutError(f"{method}: no answer within {self.timeout_s}s")
            status, *payload = conn.recv()
        if status == "ok":
            return payload[0]
        kind, message = payload
        raise (ValueError if kind == "ValueError" else RuntimeError)(f"{kind}: {message}")


def _no_delay(conn: Connection) -> None:
    """Send small messages at once: with Nagle's algorithm on, the handshake's short writes wait
    for a delayed ACK and every call took ~44 ms on localhost."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()


class EngineProxy(RpcClient):
    """The engine's weight-update methods, called in the process that runs RpcServer."""

    def init_weights_update_group(self, **kwargs: Any) -> dict:
        return self.call("init_weights_update_group", **kwargs)

    def update_weights_from_distributed(self, **kwargs: Any) -> dict:
        return self.call("update_weights_from_distributed", **kwargs)

    def destroy_weights_update_group(self, **kwargs: Any) -> dict:
        return self.call("destroy_weights_update_group", **kwargs)

    def get_weight_version(self) -> str:
        return self.call("get_weight_version")
