"""The ranks of one node sharing one telemetry sender.

[Note: one sender per node] A thousand ranks each posting once a second would keep a
dashboard's server busy with requests rather than events. So the ranks of one node (those
torchrun starts together: LOCAL_RANK, LOCAL_WORLD_SIZE) share one sender: local rank 0's
HttpSink listens on a Unix socket of the abstract namespace (nothing on disk), the node's other
ranks hand it their batches, and it posts whatever arrived together as one request, gzipped
when large. A batch counts as delivered only once the dashboard acknowledged the request that
carried it (the relay answers each rank after the POST), so the count means the same as with a
direct POST. A rank that cannot reach the relay (not started yet, or gone) posts directly.
Everything here runs on emitter threads, never on the training thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
import sys
import threading
import time
from typing import Any

_ACK, _NACK = b"\x01", b"\x00"
_LENGTH = struct.Struct("!I")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def node_sharing_wanted() -> bool:
    if os.environ.get("SHARDWISE_TELEMETRY_SHARE_NODE", "1") == "0":
        return False
    if not sys.platform.startswith("linux"):  # the abstract socket namespace is Linux's
        return False
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ
    except ValueError:
        return False


def relay_address(endpoint: str) -> str:
    # The ranks of one job on one node, sending to one dashboard, meet at the same address.
    job = os.environ.get("TORCHELASTIC_RUN_ID") or "{}:{}".format(
        os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    )
    digest = hashlib.sha256(f"{endpoint}|{job}|{os.getuid()}".encode()).hexdigest()[:24]
    return f"\0shardwise-telemetry-{digest}"


def _same_user(connection: socket.socket) -> bool:
    # An abstract socket is reachable by every user of the machine: only this user's processes
    # may hand batches to a sender that holds the dashboard token, or receive them.
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    _pid, uid, _gid = _CREDENTIALS.unpack(credentials)
    return bool(uid == os.getuid())


def _read_exact(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = connection.recv(size - len(data))
        if not part:
            raise ConnectionError("the other end closed the connection")
        data += part
    return data


class RelayPeer:
    """A rank's side of the node's shared sender: hands a batch over, waits for the answer."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._connection: socket.socket | None = None

    def send(self, events: list[dict[str, Any]]) -> bool:
        """True: the dashboard acknowledged the batch. False: not sent through the relay
        (none there, or it went away before sending it): post it directly."""
        payload = json.dumps(events, allow_nan=False).encode()
        for _ in range(2):  # a relay that restarted since the last batch: one reconnect
            if self._connection is None and not self._connect():
                return False
            assert self._connection is not None
            try:
                self._connection.sendall(_LENGTH.pack(len(payload)) + payload)
            except OSError:
                self.close()  # not handed over whole: the relay drops a partial frame
                continue
            try:
                answer = _read_exact(self._connection, 1)
            except TimeoutError:
                # Handed over, outcome unknown: counted as dropped rather than risk sending
                # it twice.
                self.close()
                raise
            except OSError:
                self.close()  # the relay closed before taking it: try again, or post directly
                continue
            if answer == _NACK:
                raise ConnectionError("the node's telemetry sender could not deliver the batch")
            return True
        return False

    def _connect(self) -> bool:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(self.timeout_s)
        try:
            connection.connect(self.address)
            trusted = _same_user(connection)
        except OSError:
            connection.close()
            return False
        if not trusted:
            connection.close()
            return False
        self._connection = connection
        return True

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(OSError):
                self._connection.close()
            self._connection = None


class NodeRelay:
    """Local rank 0's side: collects the batches of the node's ranks that arrive together
    (within `linger_s` of the first) and posts them as one request, then answers each rank.

    Args:
        address: where the node's ranks find it.
        post: sends a list of events to the dashboard; raises on failure.
        linger_s: how long the first batch waits for the others of the same flush.
    """

    def __init__(self, address: str, post: Any, linger_s: float = 0.05) -> None:
        self.post = post
        self.linger_s = linger_s
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(address)
        except OSError:
            self._listener.close()
            raise
        self._listener.listen(256)
        self._pending: list[tuple[list[dict[str, Any]], Any]] = []
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._accept, name="shardwise-telemetry-relay", daemon=True),
            threading.Thread(target=self._send, name="shardwise-telemetry-send", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, events: list[dict[str, Any]]) -> None:
        """This rank's own batch: sent with the others; raises when the POST failed."""
        done = threading.Event()
        outcome: list[bool] = []

        def answer(ok: bool) -> None:
            outcome.append(ok)
            done.set()

        self._enqueue(events, answer)
        done.wait()
        if not outcome[0]:
            raise ConnectionError("the dashboard did not acknowledge the batch")

    def _enqueue(self, events: list[dict[str, Any]], answer: Any) -> None:
        with self._ready:
            if self._closed:
                answer(False)
                return
            self._pending.append((events, answer))
            self._ready.notify()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
                trusted = _same_user(connection)
            except OSError:
                return  # closed
            if not trusted:
                connection.close()
                continue
            threading.Thread(
                target=self._serve, args=(connection,), name="shardwise-telemetry-peer", daemon=True
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            while True:
                try:
                    (size,) = _LENGTH.unpack(_read_exact(connection, _LENGTH.size))
                    events = json.loads(_read_exact(connection, size))
                except (OSError, ValueError):
                    return
                if self._closed:
                    return  # closing without an answer: the rank posts it directly
                done = threading.Event()
                outcome: list[bool] = []

                def answer(ok: bool, outcome: list[bool] = outcome, done: Any = done) -> None:
                    outcome.append(ok)
                    done.set()

                self._enqueue(events, answer)
                done.wait()
                try:
                    connection.sendall(_ACK if outcome[0] else _NACK)
                except OSError:
                    return

    def _send(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._closed:
                    self._ready.wait()
                if not self._pending:
                    return  # closed and drained
            time.sleep(self.linger_s)  # let the rest of this flush arrive
            with self._ready:
                group, self._pending = self._pending, []
            try:
                self.post([event for events, _ in group for event in events])
                ok = True
            except Exception:
                ok = False
            for _, answer in group:
                answer(ok)

    def close(self) -> None:
        """Stop taking batches (ranks still sending post directly), send what is pending."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        # As the emitter's own close: a dashboard that does not answer delays exit a little,
        # never for long.
        self._threads[1].join(5.0)
