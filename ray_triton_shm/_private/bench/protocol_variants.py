"""The front door's transports with a library's protocol state machine in place of the hand-written one.

Used by :mod:`~ray_triton_shm._private.bench.protocol_libs` to measure each
against the transport that ships:

* :func:`parse_head_h11`: the HTTP/1.1 listener with ``h11`` reading request
  heads (bodies still read by the listener straight into the handler's buffer);
* :class:`LibH2Server`: a gRPC server whose HTTP/2 (frames, flow control, HPACK)
  is a sans-I/O library's, ``h2`` (hyper-h2, pure Python) or ``ngh2`` (nghttp2,
  C): bytes read from the socket are fed to it, the request message's bytes it
  hands back are copied into a slot, and the answer is given to it as views of
  the slot.

The shipped HTTP/1.1 head reader (llhttp through ``httptools``) and the
hand-written one are both in :mod:`~ray_triton_shm._private.serve.http1.head`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import h11
import ngh2

from ray_triton_shm._private.serve.http1.head import (
    HttpParseError,
    RequestHead,
    assemble_head,
    read_request_line,
)

logger = logging.getLogger(__name__)

MAX_WINDOW = 2**31 - 1
MAX_FRAME = 2**24 - 1


def parse_head_h11(data: bytes | bytearray | memoryview) -> RequestHead:
    """A request head read by ``h11``, then checked as the shipped reader checks it.

    ``h11`` unfolds obsolete line folding and accepts a bare LF; the listener
    refuses a bare LF before any head is parsed, and folding is refused here.

    Raises:
        HttpParseError: A head ``h11`` or the checks refuse.
    """
    raw = bytes(data)
    if b"\r\n " in raw or b"\r\n\t" in raw:
        raise HttpParseError("obsolete line folding in the request head")
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(raw)
    try:
        event = connection.next_event()
    except h11.RemoteProtocolError as e:
        raise HttpParseError(f"malformed request head: {e}") from None
    if not isinstance(event, h11.Request):
        raise HttpParseError("incomplete request head")
    fields = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in event.headers.raw_items()]
    line = raw[: raw.index(b"\r\n")].decode("latin-1")
    return assemble_head(*read_request_line(line), fields)


CallHandler = Callable[[int, Any, memoryview], "list[memoryview]"]
"""Given a call's message length, its slot lease and the slot's view: the answer's parts (views of it)."""


class LibH2Server:
    """A gRPC server (unary calls) on an HTTP/2 library: a thread per connection; each call runs in it.

    Args:
        lease: Takes a slot (an object with ``view``, a writable ``memoryview``, and ``release()``).
        library: ``"h2"`` (hyper-h2) or ``"ngh2"`` (nghttp2).
        port: Port to bind on 127.0.0.1 (``0``: one the OS picks; see :attr:`port`).
    """

    def __init__(self, lease: Callable[[], Any], library: str = "h2", port: int = 0) -> None:
        self._lease = lease
        self._conn = _H2Conn if library == "h2" else _NgConn
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="h2-accept").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._conn(sock, self._lease).serve, daemon=True, name="h2-conn").start()

    def close(self) -> None:
        """Stop accepting connections."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()


class _Call:
    """A call's state while its message arrives: the slot and how much of the message is in it."""

    __slots__ = ("filled", "length", "prefix", "slot")

    def __init__(self) -> None:
        self.slot: Any = None
        self.prefix = bytearray()
        self.length = -1
        self.filled = 0


def _land(call: _Call, data: bytes, lease: Callable[[], Any]) -> None:
    """Copy a DATA payload of a call into its slot (after the message's 5-byte prefix)."""
    view = memoryview(data)
    if call.length < 0:
        need = 5 - len(call.prefix)
        call.prefix += view[:need]
        view = view[need:]
        if len(call.prefix) < 5:
            return
        call.length = struct.unpack(">I", call.prefix[1:5])[0]
        call.slot = lease()
    call.slot.view[call.filled : call.filled + len(view)] = view
    call.filled += len(view)


class _H2Conn:
    """One connection: ``h2`` reads and writes HTTP/2; message bytes go into a slot as they come."""

    def __init__(self, sock: socket.socket, lease: Callable[[], Any]) -> None:
        self._sock = sock
        self._lease = lease
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self._h2 = h2.connection.H2Connection(config=config)
        self._calls: dict[int, _Call] = {}
        self._buf = bytearray(256 * 1024)
        self._done = False

    def serve(self) -> None:
        conn = self._h2
        conn.initiate_connection()
        conn.update_settings(
            {
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: MAX_WINDOW,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME,
            }
        )
        conn.increment_flow_control_window(MAX_WINDOW - 65535)
        # A client may send frames as large as the settings allow before it acknowledges them
        # (RFC 9113 6.5.3): h2 takes the larger size only on the acknowledgement.
        conn.max_inbound_frame_size = MAX_FRAME
        conn.incoming_buffer.max_frame_size = MAX_FRAME
        try:
            self._flush()
            while not self._done:
                self._read()
        except OSError:
            pass
        except Exception:
            logger.exception("h2 connection failed")
        finally:
            for call in self._calls.values():
                if call.slot is not None:
                    call.slot.release()
            with contextlib.suppress(OSError):
                self._sock.close()

    def _flush(self) -> None:
        out = self._h2.data_to_send()
        if out:
            self._sock.sendall(out)

    def _read(self) -> None:
        n = self._sock.recv_into(self._buf)
        if not n:
            self._done = True
            return
        ended = []
        for event in self._h2.receive_data(bytes(memoryview(self._buf)[:n])):
            if isinstance(event, h2.events.RequestReceived):
                self._calls[event.stream_id] = _Call()
            elif isinstance(event, h2.events.DataReceived):
                self._data(event.stream_id, event.data)
                self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                ended.append(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                call = self._calls.pop(event.stream_id, None)
                if call is not None and call.slot is not None:
                    call.slot.release()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self._done = True
        self._flush()
        for stream_id in ended:
            self._answer(stream_id)

    def _data(self, stream_id: int, data: bytes) -> None:
        _land(self._calls[stream_id], data, self._lease)

    def _answer(self, stream_id: int) -> None:
        call = self._calls.pop(stream_id)
        conn = self._h2
        try:
            conn.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
            parts = [struct.pack(">BI", 0, call.filled), call.slot.view[: call.filled]]
            for part in parts:
                self._send(stream_id, memoryview(part))
            conn.send_headers(stream_id, [(b"grpc-status", b"0")], end_stream=True)
            self._flush()
        finally:
            call.slot.release()

    def _send(self, stream_id: int, view: memoryview) -> None:
        conn = self._h2
        while len(view):
            window = min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
            if window <= 0:
                self._flush()
                self._read()  # the client's WINDOW_UPDATE
                if self._done:
                    raise OSError("the client went away")
                continue
            step = min(window, len(view))
            conn.send_data(stream_id, view[:step])
            view = view[step:]


class _NgConn:
    """One connection on nghttp2 (``ngh2``): it frames, keeps the windows and encodes headers.

    The bytes read are handed to nghttp2 as a view of the read buffer; each DATA
    payload it gives back (``bytes``) is copied into the slot; the answer is given
    to it as views of the slot, which it frames as the client's windows allow.
    """

    def __init__(self, sock: socket.socket, lease: Callable[[], Any]) -> None:
        self._sock = sock
        self._lease = lease
        self._ng = ngh2.Connection(ngh2.Role.SERVER)
        self._calls: dict[int, _Call] = {}
        self._buf = bytearray(256 * 1024)
        self._done = False

    def serve(self) -> None:
        ng = self._ng
        ng.initiate_connection(
            {
                ngh2.Setting.INITIAL_WINDOW_SIZE: MAX_WINDOW,
                ngh2.Setting.MAX_FRAME_SIZE: MAX_FRAME,
                ngh2.Setting.MAX_CONCURRENT_STREAMS: 1024,
            }
        )
        ng.set_local_window_size(MAX_WINDOW)
        try:
            self._flush()
            while not self._done:
                self._read()
        except OSError:
            pass
        except Exception:
            logger.exception("ngh2 connection failed")
        finally:
            for call in self._calls.values():
                if call.slot is not None:
                    call.slot.release()
            with contextlib.suppress(OSError):
                self._sock.close()

    def _flush(self) -> None:
        out = self._ng.data_to_send()
        while out:
            self._sock.sendall(out)
            out = self._ng.data_to_send()

    def _read(self) -> None:
        n = self._sock.recv_into(self._buf)
        if not n:
            self._done = True
            return
        self._ng.receive_data(memoryview(self._buf)[:n])
        ended = []
        for event in self._ng.events():
            if isinstance(event, ngh2.RequestReceived):
                self._calls[event.stream_id] = _Call()
                if event.end_stream:
                    ended.append(event.stream_id)
            elif isinstance(event, ngh2.DataReceived):
                _land(self._calls[event.stream_id], event.data, self._lease)
                if event.end_stream:
                    ended.append(event.stream_id)
            elif isinstance(event, ngh2.StreamReset):
                call = self._calls.pop(event.stream_id, None)
                if call is not None and call.slot is not None:
                    call.slot.release()
            elif isinstance(event, ngh2.ConnectionClosed):
                self._done = True
        self._flush()
        for stream_id in ended:
            self._answer(stream_id)

    def _answer(self, stream_id: int) -> None:
        call = self._calls.pop(stream_id)
        ng = self._ng
        try:
            ng.send_response(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
            ng.send_data(stream_id, struct.pack(">BI", 0, call.filled))
            ng.send_data(stream_id, call.slot.view[: call.filled])
            ng.send_trailers(stream_id, [(b"grpc-status", b"0")])
            self._flush()
            while ng.queued_body_size(stream_id):
                self._read()  # the client's WINDOW_UPDATE
                if self._done:
                    raise OSError("the client went away")
        finally:
            call.slot.release()
