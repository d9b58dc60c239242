"""Tensor bytes between this process and the server: uploads, downloads, non-blocking readbacks.

Small uploads ride inside the op stream; large ones go as CHUNK frames after their UPLOAD
message, or, on a fast link, as raw bytes on the bulk lane (staged and confirmed before their
UPLOAD is posted). An upload whose bytes the server already holds becomes a server-side copy
(content addressing, rgpu.dedup). Downloads come back inline, as DATA frames, or on the lane.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rgpu_protocol import (
    ABORT_OFFSET,
    Frame,
    Kind,
    Status,
    byte_view,
    chunk_frame,
    dense_strides,
    lane_reply_bytes,
)
from rgpu_protocol.lane import INTERRUPTED_TICKET

from . import dedup
from .errors import ProtocolViolation
from .keys import NESTED, nested_refused
from .lane import Lane, LaneError
from .progress import TransferProgress
from .waits import Waiter

_RUN = int(Kind.RUN)
INLINE_UPLOAD = 256 * 1024  # uploads up to this size ride inside the op stream
UPLOAD_CHUNK = 1 << 20  # small enough that an interrupted upload stops within one chunk


@dataclass
class ChunkedUpload:
    """The source of a chunked UPLOAD, kept by reference (not copied) until the server confirms
    it: a resume sends its chunks again, or cancels it if the source changed in place since."""

    src: torch.Tensor
    version: int
    nbytes: int
    writer: Any = None  # the FrameWriter that last queued its chunks...
    ticket: int = 0  # ...and the ticket of its last chunk
    done: threading.Event = field(default_factory=threading.Event)  # confirmed by the server

    def unchanged(self) -> bool:
        return self.src._version == self.version


class TransferMixin:
    """The transfer half of `rgpu.session.Session` (a mixin: it uses the session's queue, lock,
    writer, link and counters)."""

    _tickets = itertools.count(1)  # lane tickets, unique in this process

    # -- uploads ----------------------------------------------------------------------------------

    def upload(self, dst: Any, src: torch.Tensor) -> None:
        """Copy a CPU tensor's bytes into `dst` on the server; the bytes are taken now."""
        src = src.detach().resolve_conj().resolve_neg().contiguous()
        nbytes = src.numel() * src.element_size()
        index = self.uploads
        index.settle()
        sha = None
        if index.enabled and nbytes >= index.min_bytes:
            if index.worth_hashing(src) or nbytes <= INLINE_UPLOAD:
                sha = dedup.digest(byte_view(src))
                holder = index.find(src, sha)
                if holder is not None and holder is not dst:
                    # the server already has these bytes in `holder`: copy there, send nothing
                    self.post((_RUN, "copy_.default", [dst, holder], None, [None]))
                    index.hits += 1
                    index.bytes_saved += nbytes
                    index.remember(dst, src, sha)
                    return
        if nbytes <= INLINE_UPLOAD:
            self.post((Kind.UPLOAD, dst, src), data_bytes=nbytes)
            if sha is not None:
                index.remember(dst, src, sha)
            return
        lane = self._lane(nbytes)
        if lane is not None:
            hash_too = index.enabled and not sha and self.link.hash_lane_uploads()
            sent, digest = self._upload_by_lane(lane, dst, src, nbytes, hash_too)
            if sent:
                if index.enabled and (sha or digest):  # unhashed lane uploads are not remembered
                    index.remember(dst, src, sha or digest)
                return
        hasher = hashlib.sha256() if index.enabled and sha is None else None
        digest = self._upload_chunked(dst, src, nbytes, hasher)
        if index.enabled:
            index.remember(dst, src, sha if sha is not None else digest)

    def _upload_chunked(self, dst: Any, src: torch.Tensor, nbytes: int, hasher: Any) -> bytes:
        tag = object()  # marks this upload's chunks in the writer's queue
        upload = ChunkedUpload(src, src._version, nbytes)
        progress = TransferProgress(nbytes, "rgpu upload")
        start = self.writer.bytes_written
        seq = 0
        try:
            with self.lock:
                try:
                    seq = self.post_chunked((Kind.UPLOAD, dst, [src.dtype, list(src.shape), nbytes]),
                                         nbytes, upload)  # fmt: skip
                    self.send_chunks(seq, upload, tag, hasher)
                except BaseException:
                    if seq:
                        self._cancel_upload(seq, tag)
                    raise
            # the call returns once every byte is written (or the server has it): the caller may
            # change `src` after that
            try:
                while not upload.done.is_set():
                    writer = upload.writer
                    if (
                        writer is not None
                        and upload.ticket
                        and writer.wait_written(upload.ticket, 0.1)
                    ):
                        break
                    if writer is None or not upload.ticket:
                        upload.done.wait(0.1)
                    self.check_usable()
                    progress.update_to(self.writer.bytes_written - start)
            except BaseException:
                with self.lock:
                    self._cancel_upload(seq, tag)
                raise
        finally:
            progress.close()
        return hasher.digest() if hasher is not None else b""

    def send_chunks(
        self, seq: int, upload: ChunkedUpload, tag: object = None, hasher: Any = None
    ) -> None:
        """Queue an upload's chunks (session lock held); `hasher`, if given, hashes each chunk
        while the writer thread sends the ones before it (hashlib releases the GIL)."""
        if not upload.unchanged():  # its source changed since: cancel rather than send other bytes
            self.send(chunk_frame(Frame.CHUNK, seq, ABORT_OFFSET, b""))
            return
        data = byte_view(upload.src)
        chunk = self.max_chunk
        for off in range(0, upload.nbytes, chunk):
            piece = data[off : off + chunk]
            upload.ticket = self.send(chunk_frame(Frame.CHUNK, seq, off, piece), tag)
            if hasher is not None:
                hasher.update(piece)
        upload.writer = self.writer

    def _cancel_upload(self, seq: int, tag: object) -> None:
        """Withdraw an upload's unwritten chunks and tell the server to drop it (dst is poisoned)."""
        self.writer.withdraw(tag)
        if self.broken is not None or self.closed:
            return
        self.flush_locked()  # the UPLOAD message itself, if the interrupt beat its flush
        self.send(chunk_frame(Frame.CHUNK, seq, ABORT_OFFSET, b""))

    def _upload_by_lane(
        self, lane: Lane, dst: Any, src: torch.Tensor, nbytes: int, hash_too: bool
    ) -> tuple[bool, bytes]:
        """Stage the bytes on the server over the lane, then post the UPLOAD that claims them.
        (False, _) with nothing posted when the lane failed: the caller sends them over the
        websocket. With `hash_too`, a thread hashes the bytes for dedup while they go out (both
        release the GIL); the digest comes back second."""
        ticket = next(self._tickets)
        progress = TransferProgress(nbytes, "rgpu upload")
        digest: list[bytes] = [b""]
        hasher = None
        if hash_too:
            hasher = threading.Thread(
                target=lambda: digest.__setitem__(0, dedup.digest(byte_view(src))),
                name="rgpu-hash",
                daemon=True,
            )
            hasher.start()
        t0 = time.perf_counter()
        header = [src.dtype, list(src.shape), nbytes]
        try:
            lane.put(ticket, byte_view(src), progress.update_to)
            self.link.lane_bps = nbytes / max(time.perf_counter() - t0, 1e-6)
            if hasher is not None:
                hasher.join()
        except LaneError as e:
            self.link.lane_failed(lane, e)
            return False, b""
        except BaseException:  # Ctrl-C: the destination must say it holds no data
            self.post((Kind.UPLOAD, dst, [*header, INTERRUPTED_TICKET]))
            raise
        finally:
            progress.close()
        self.post((Kind.UPLOAD, dst, [*header, ticket]))
        self.bytes_out += nbytes
        self.link.lane_transfers += 1
        return True, digest[0]

    def _lane(self, nbytes: int) -> Lane | None:
        return self.link.lane_for(nbytes, self.url, self.token, self.session_bytes, self.welcome.lane,
                               self.open_timeout)  # fmt: skip

    # -- downloads --------------------------------------------------------------------------------

    def download(self, w: Any) -> torch.Tensor:
        """The values of `w` as a new CPU tensor with the same shape (one wait)."""
        if w._r.key[5] & NESTED:
            raise nested_refused()
        dtype = w.dtype
        shape = tuple(w.shape)
        numel = w.numel()
        flat = torch.empty(numel, dtype=dtype, device="cpu")
        nbytes = numel * flat.element_size()
        view = byte_view(flat)
        timing = [0.0, 0.0, 0]  # first DATA frame's arrival, the last one's, the first's size

        def sink(offset: int, payload: memoryview) -> None:
            if timing[2]:
                timing[1] = time.perf_counter()
            else:
                timing[0], timing[2] = time.perf_counter(), len(payload)
            view[offset : offset + len(payload)] = payload

        lane = self._lane(nbytes)
        if lane is None or not self._download_by_lane(lane, w, view, sink):
            progress = TransferProgress(nbytes, "rgpu download")
            value = self.request((Kind.DOWNLOAD, w), sink, progress=progress)
            _fill(view, nbytes, value)
        self.link.measured_download(nbytes, timing[0], timing[1], timing[2])
        out = flat.view(shape)
        stride = w.stride()
        if out.stride() != stride and dense_strides(shape, stride):
            out = torch.empty_strided(shape, stride, dtype=dtype, device="cpu").copy_(out)
        return out

    def _download_by_lane(self, lane: Lane, w: Any, view: memoryview, sink: Callable) -> bool:
        """Ask for the bytes on the lane (one wait). False when they must be asked for again
        over the websocket: the lane closed before they were all in."""
        nbytes = len(view)
        ticket = next(self._tickets)
        try:
            receipt = lane.expect(ticket, view)
        except LaneError:
            return False
        try:
            value = self.request((Kind.DOWNLOAD, w, ticket), sink)
        except BaseException:
            lane.forget(ticket)
            raise
        on_lane = lane_reply_bytes(value)
        if on_lane is None:
            lane.forget(ticket)  # the server sent them inline or over the websocket
            _fill(view, nbytes, value)
            return True
        if on_lane != nbytes:
            lane.forget(ticket)
            raise ProtocolViolation(f"download of {nbytes} bytes returned {on_lane}")
        progress = TransferProgress(nbytes, "rgpu download")
        t0 = time.perf_counter()
        try:
            ok = lane.wait(receipt, ticket, progress.update_to)
        finally:
            progress.close()
            self.wait_seconds += time.perf_counter() - t0
        if not ok:
            self.link.lane_failed(lane, LaneError("it closed during a download"))
            return False
        self.bytes_in += nbytes
        self.link.lane_transfers += 1
        return True

    def download_async(self, w: Any, into: torch.Tensor | None = None) -> torch.Tensor:
        """Non-blocking readback: a CPU tensor returned now and filled when the reply arrives.

        Read it after `torch.rgpu.synchronize()` or once an `rgpu.Event` recorded after this
        call reports done; a failure is raised at the next wait. No wait is spent here."""
        return self.download_later(w, into)[0]

    def download_later(
        self, w: Any, into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Waiter]:
        """`download_async`, with the waiter that says when the tensor is filled (`wait_for`
        it, or look at its event): for loops that read results a few steps behind."""
        if w._r.key[5] & NESTED:
            raise nested_refused()
        numel = w.numel()
        shape = tuple(w.shape)  # the closures below must not keep `w` alive: freed on the reader
        # thread, its FREE would join the stream at a moment that depends on timing
        target = into if into is not None else torch.empty(shape, dtype=w.dtype, device="cpu")
        direct = target.is_contiguous() and target.dtype == w.dtype and target.numel() == numel
        flat = target.reshape(-1) if direct else torch.empty(numel, dtype=w.dtype, device="cpu")
        nbytes = numel * flat.element_size()
        view = byte_view(flat)

        def sink(offset: int, payload: memoryview) -> None:
            view[offset : offset + len(payload)] = payload

        def done(waiter: Waiter) -> None:  # the reader thread, as the reply lands
            try:
                if waiter.status is Status.OK:
                    _fill(view, nbytes, waiter.value)
                    if not direct:
                        target.copy_(flat.view(shape))
                elif waiter.status is Status.ERROR:
                    self.note_async_error(waiter)
            except Exception as e:
                self.async_error = e

        self.check_async_error()
        waiter = self.request_async((Kind.DOWNLOAD, w), sink, on_done=done, detached=True)
        self.async_readbacks += 1
        return target, waiter

    def record_event(self, device: int | None = None) -> Waiter:
        """A marker in the op stream: its waiter finishes once the server has run everything
        before it; the reply carries the server's clock then (for `Event.elapsed_time`)."""

        def done(waiter: Waiter) -> None:
            if waiter.status is Status.ERROR:
                self.note_async_error(waiter)

        self.check_async_error()
        return self.request_async((Kind.SYNC,), on_done=done, detached=True, device=device)


def _fill(view: memoryview, nbytes: int, value: Any) -> None:
    """Finish a download: an inline reply carries the bytes, a chunked one their count."""
    if type(value) is bytes:
        if len(value) != nbytes:
            raise ProtocolViolation(f"download of {nbytes} bytes returned {len(value)}")
        if nbytes:
            view[:] = value
    elif value != nbytes:
        raise ProtocolViolation(f"download of {nbytes} bytes returned {value}")
