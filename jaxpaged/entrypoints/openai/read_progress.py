"""Whether a streaming client is reading: the server's `--write-timeout` counts the time a client has had output
waiting and consumed none of it, however large the socket buffers between them.

A write that blocks is a late sign: it blocks only once the kernel's send buffer (autotuned up to megabytes), the
client's receive buffer and the transport's buffer are all full, which for a token stream takes minutes. So:

- The stream's own buffers are kept small (`cap_buffers`: SO_SNDBUF and the transport's high-water mark), which
  also bounds the memory a client that does not read can pin in the kernel.
- The client's consumption is read from TCP itself (Linux TCP_INFO): the right edge of the window the client
  advertises, bytes acknowledged + receive window, moves only when the client's application reads (its kernel
  frees buffer space). While output flows to a client whose edge does not move, the clock runs, from the first
  unread byte. A client that reads slowly still moves its edge, and keeps its stream.
- Where TCP_INFO lacks the window (not Linux, or a kernel before 5.4), the transport's own buffer stands in: the
  clock runs while it holds data that does not drain.
"""

from __future__ import annotations

import socket
import struct

STREAM_SNDBUF_BYTES = 64 * 2**10  # the kernel doubles it: at most 128 KiB per stream sits in the send buffer
TRANSPORT_HIGH_WATER = 16 * 2**10  # aiohttp's writes wait (drain) beyond this much in the transport's buffer
# Offsets in Linux's struct tcp_info (include/uapi/linux/tcp.h): tcpi_bytes_acked (u64), tcpi_notsent_bytes (u32),
# tcpi_snd_wnd (u32, the peer's advertised receive window after scaling; Linux >= 5.4).
_BYTES_ACKED, _NOTSENT, _SND_WND = 120, 144, 228
_TCP_INFO_LEN = 232
# The window's right edge creeps even when nothing is read: a receiver grows its window toward its buffer as data
# arrives (measured on loopback, Linux 6.18, 8 MiB receive buffer: by 3 % to 40 % of the data received). Progress
# is an edge that moved by at least this share of what arrived since the last sample; a client whose buffer is full
# receives only what it reads, so a slow reader moves its edge by all of it.
_PROGRESS_SHARE = 1 / 2


def cap_buffers(transport) -> None:
    """Small buffers for a streaming response's connection (best effort: a transport without a socket keeps its)."""
    try:
        transport.set_write_buffer_limits(high=TRANSPORT_HIGH_WATER)
    except (AttributeError, NotImplementedError):
        pass
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF_BYTES)
        except OSError:
            pass


class ReadProgress:
    """Samples a streaming connection; `stalled_for(now)` is how long the client has had output waiting and read
    none of it. Call `sample(now)` every fraction of the timeout."""

    def __init__(self, transport, now: float):
        self.transport = transport
        self._sock = transport.get_extra_info("socket")
        self._ok_since = now
        self._acked = self._edge = None
        self._max_wnd = 0
        self._buffered = 0

    def _tcp_info(self) -> tuple[int, int, int] | None:
        """(bytes acknowledged, bytes not yet sent, the client's window) or None where TCP_INFO does not say."""
        if self._sock is None or not hasattr(socket, "TCP_INFO"):
            return None
        try:
            raw = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            return None
        if len(raw) < _TCP_INFO_LEN:
            return None
        return (struct.unpack_from("=Q", raw, _BYTES_ACKED)[0], struct.unpack_from("=I", raw, _NOTSENT)[0],
                struct.unpack_from("=I", raw, _SND_WND)[0])

    def sample(self, now: float) -> None:
        buffered = self.transport.get_write_buffer_size()
        info = self._tcp_info()
        if info is None:
            # Only the transport's buffer: output waits there while the client does not read; draining is progress.
            waiting, progress = buffered > 0, buffered < self._buffered
        else:
            acked, notsent, wnd = info
            edge = acked + wnd
            if self._acked is None:
                self._acked, self._edge = acked, edge
            acked_delta, edge_delta = acked - self._acked, edge - self._edge
            self._max_wnd = max(self._max_wnd, wnd)
            # Output is waiting for the client when it flowed since the last sample, is queued on our side, or
            # fills more than half the client's buffer (a client that has read it all would have said so: Linux
            # advertises a window that at least doubles at once).
            waiting = acked_delta > 0 or notsent > 0 or buffered > 0 or wnd < self._max_wnd / 2
            progress = edge_delta > 0 and edge_delta >= acked_delta * _PROGRESS_SHARE
            self._acked, self._edge = acked, max(edge, self._edge)
        self._buffered = buffered
        if progress or not waiting:
            self._ok_since = now

    def stalled_for(self, now: float) -> float:
        return now - self._ok_since
