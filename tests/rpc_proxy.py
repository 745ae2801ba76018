"""A minimal RPC so a WeightSender in one process can drive an engine in another.

RpcServer exposes a few of an object's methods on a localhost socket (multiprocessing.connection,
authenticated); EngineProxy is the client that WeightSender takes as a target. It stands in for
RemoteEngine in the multi-process weight-update tests and in bench/weight_sync.py. Each call opens
its own connection, so calls from several threads never interleave on one socket.
"""

from __future__ import annotations

import contextlib
import os
import threading
from multiprocessing.connection import Client, Connection, Listener
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
        self._listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
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
            Client(self.address, authkey=self.authkey).close()
        self._thread.join(timeout=5)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:  # a client that failed authentication, or the listener closed
                continue
            if self._closed:
                conn.close()
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            try:
                method, kwargs = conn.recv()
            except (EOFError, OSError):
                return
            try:
                if method not in self.exposed:
                    raise ValueError(f"method {method!r} is not exposed")
                reply = ("ok", getattr(self.target, method)(**kwargs))
            except Exception as exc:  # noqa: BLE001 - sent back to the caller
                reply = ("err", type(exc).__name__, str(exc))
            with contextlib.suppress(OSError):  # the caller may have died while we worked
                conn.send(reply)


class EngineProxy:
    """The engine's weight-update methods, called in the process that runs RpcServer."""

    def __init__(self, address: tuple[str, int], authkey: bytes, timeout_s: float = 120.0
                 ) -> None:
        self.address = tuple(address)
        self.authkey = authkey
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"EngineProxy({self.address[0]}:{self.address[1]})"

    def call(self, method: str, **kwargs: Any) -> Any:
        with Client(self.address, authkey=self.authkey) as conn:
            conn.send((method, kwargs))
            if not conn.poll(self.timeout_s):
                raise TimeoutError(f"{method}: no answer within {self.timeout_s}s")
            status, *payload = conn.recv()
        if status == "ok":
            return payload[0]
        kind, message = payload
        raise (ValueError if kind == "ValueError" else RuntimeError)(f"{kind}: {message}")

    def init_weights_update_group(self, **kwargs: Any) -> dict:
        return self.call("init_weights_update_group", **kwargs)

    def update_weights_from_distributed(self, **kwargs: Any) -> dict:
        return self.call("update_weights_from_distributed", **kwargs)

    def destroy_weights_update_group(self, **kwargs: Any) -> dict:
        return self.call("destroy_weights_update_group", **kwargs)

    def get_weight_version(self) -> str:
        return self.call("get_weight_version")
