"""One client's session on the server: its state, and the worker thread that runs its messages.

The event loop only moves frames: it puts what a client sends into `Session.inbox`. The worker
thread feeds them to the session's `ServerStream` (rgpu_protocol.server_stream), which says what
each message needs, and runs new messages through the handler table (`handlers.HANDLERS`), so a
long kernel never stalls pings or other sessions. Replies go back through `Session.send`, which the
connection provides.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rgpu_protocol import (
    EXT_HOST,
    EXT_REF,
    EXT_VIEW,
    GeneratorRef,
    ProtocolError,
    Status,
    decode_host,
    decode_simple_ext,
    decode_view,
    unpack_ref,
)
from rgpu_protocol.codec import Device
from rgpu_protocol.server_stream import Action, ServerStream, UploadAborted

from . import generators, multidevice, numerics
from .handlers import HANDLERS, cancel_message, discard_chunks
from .poison import Poison, describe
from .state import SessionState

log = logging.getLogger("rgpu_server")
_RUN = Action.RUN


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __len__(self) -> int:
        return 0


STOP = _Marker("stop")  # inbox sentinel: end the session
DETACHED = _Marker("detached")  # inbox sentinel: the connection of this generation dropped
REOPEN = _Marker("reopen")  # inbox sentinel: a new client takes over a named session


class Session(SessionState):
    """A client's state, and the thread that executes its messages; it outlives connections."""

    def __init__(self, *args: Any, profile_dir: str | None = None, **kwargs: Any) -> None:
        """SessionState's arguments; `profile_dir`: a cProfile dump of the worker goes there."""
        super().__init__(*args, **kwargs)
        self._profile_dir = profile_dir
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.processed = 0  # bytes of frames taken from the inbox (the reader pauses on backlog)
        self.on_protocol_error: Callable[[str], None] | None = None
        # a session outlives its connection: a client that reconnects resumes it
        self.generation = 0
        self.detached_at: float | None = time.monotonic()
        self.ended = False
        self._busy = False
        self._sink_generation = 0  # the connection the chunks in progress come on
        # views built for the current message, by their wire bytes: one tensor for a view named
        # twice, and kept alive so that their id()s in `refs` stay valid
        self._views: dict[bytes, torch.Tensor] = {}
        self._worker = threading.Thread(
            target=self._run, name=f"rgpu-session-{self.hex}", daemon=True
        )
        self._worker.start()

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        self.inbox.put((self.generation, STOP))

    def attach(self, send: Callable[[list], None], on_protocol_error: Callable[[str], None]) -> int:
        """A connection takes over the session; frames of older connections are ignored from now."""
        self.generation += 1
        self.send = send
        self.on_protocol_error = on_protocol_error
        self.detached_at = None
        self.attached_at = time.monotonic()
        return self.generation

    def rename(self, sid: bytes) -> None:
        self.id = sid
        self.hex = sid.hex()[:8]

    def reopen(self) -> None:
        """A new client re-opens this named session: it starts a fresh stream and finds only
        what was kept (the old client's tensor ids mean nothing to it)."""
        self.generation += 1  # nothing more of the old connection runs
        self.inbox.put((self.generation, REOPEN))

    def detach(self, generation: int) -> None:
        """The connection of `generation` ended; the session waits for a resume."""
        if generation != self.generation:
            return  # a newer connection already took over
        self.send = None
        self.on_protocol_error = None
        self.detached_at = time.monotonic()
        self.inbox.put((generation, DETACHED))

    def put(self, generation: int, frame: bytes) -> None:
        self.inbox.put((generation, frame))

    def alive(self) -> bool:
        return self._worker.is_alive()

    def idle(self) -> bool:
        """Nothing received is still waiting to run, and no upload waits for its chunks."""
        return not self._busy and self.sink is None and self.inbox.empty()

    def join(self, timeout: float | None = None) -> None:
        self._worker.join(timeout)

    # -- the worker --------------------------------------------------------------------------

    def _run(self) -> None:
        if self.device.type == "cuda":  # the thread's CUDA device is its session's device 0
            torch.cuda.set_device(self.device)
        profile_dir = self._profile_dir
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
            try:
                self._serve()
            finally:
                profiler.disable()
                profiler.dump_stats(os.path.join(profile_dir, f"session-{self.hex}.prof"))
        else:
            self._serve()

    def _serve(self) -> None:
        try:
            while True:
                generation, frame = self.inbox.get()
                self.processed += len(frame)
                if frame is STOP:
                    return
                if frame is REOPEN:
                    self._fresh_stream()
                    continue
                if self.sink is not None and (
                    frame is DETACHED or generation != self._sink_generation
                ):
                    # the connection carrying an upload's chunks dropped: the client sends the
                    # upload again, whole, when it resumes
                    self.stream.abandon_chunks()
                    self.sink = None
                if frame is DETACHED or generation != self.generation:
                    continue  # from a connection that is gone or was superseded
                self._busy = True
                try:
                    if self.sink is not None:
                        self._take_chunk(frame)
                    else:
                        self._run_frame(frame, generation)
                except ProtocolError as e:
                    log.warning("session %s: protocol error: %s", self.hex, e)
                    self._protocol_failure(str(e))
                    return
                except Exception as e:  # a bug of ours: report it, keep the process alive
                    log.exception("session %s: internal error", self.hex)
                    self._protocol_failure(f"internal server error: {describe(e)}")
                    return
                finally:
                    self._busy = False
                ack = self.stream.ack_due(idle=self.inbox.empty())
                if ack is not None:
                    self.deliver([ack])
        finally:
            self.ended = True
            self.tensors.clear()
            self.user_generators.clear()
            self.kept.clear()
            self.groups.clear()
            self.stream.forget_replies()
            self.staged.clear()
            if self.lane is not None:
                self.lane.close()

    def _fresh_stream(self) -> None:
        self.tensors = {}
        multidevice.reset(self)
        self.settings = ()  # a new client sends its own
        self.user_generators = {}  # ...and makes its own generators
        self.stream = ServerStream(self.limits)
        self.first_error = None
        self.sequences = {}
        self.sequence_run = None
        self.sink = None
        self.bad = None
        self.refs = {}
        self._views = {}

    def _run_frame(self, frame: bytes, generation: int) -> None:
        numerics.enter(self)
        try:
            self._run_messages(frame, generation)
        finally:
            numerics.leave()

    def _run_messages(self, frame: bytes, generation: int) -> None:
        for seq, spec, msg, action, resend, _ in self.stream.messages(frame, self._ext_hook):
            if action is _RUN:
                self.current_seq = seq
                HANDLERS[spec.kind](self, seq, msg)
            elif action is Action.CANCEL:  # an interrupt on the client: skip the work
                cancel_message(self, seq, spec, msg)
            elif action is Action.DRAIN:  # a replayed chunked upload applied before
                self.sink = discard_chunks
            elif action is Action.RESEND:  # its reply was lost with the old connection
                self.deliver(resend)
            if self.sink is not None:
                if self.stream.chunks_wanted:
                    self._sink_generation = generation
                else:  # an upload of no bytes: no chunks follow
                    sink, self.sink = self.sink, None
                    sink.done()
            self.bad = None
            if self.refs:
                self.refs = {}
                self._views = {}

    def _take_chunk(self, frame: bytes) -> None:
        sink = self.sink
        try:
            offset, payload, last = self.stream.chunk(frame)
        except UploadAborted:
            self.sink = None
            sink.aborted()
            return
        sink.write(offset, payload)
        if last:
            self.sink = None
            sink.done()

    def _protocol_failure(self, message: str) -> None:
        """The stream is not understood: say so and end the session (its state is unknown)."""
        self.reply(0, Status.PROTOCOL, message)
        if self.on_protocol_error is not None:
            self.on_protocol_error(message)

    # -- decoding ----------------------------------------------------------------------------

    def _missing(self, found: Any) -> None:
        if self.bad is None:
            self.bad = found

    def _ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_REF:
            tid = unpack_ref(data)
            t = self.tensors.get(tid)
            if t is None or type(t) is Poison:
                self._missing(tid if t is None else t)
                return None
            self.refs[id(t)] = tid
            return t
        if code == EXT_VIEW:  # a view the client made locally: rebuild it over its base's storage
            v = self._views.get(data)
            if v is not None:  # named twice in one message: one tensor, as on the client
                return v  # (kernels test is_same: attention's self-attention path)
            view = decode_view(data)
            t = self.tensors.get(view.base)
            if t is None or type(t) is Poison:
                self._missing(view.base if t is None else t)
                return None
            try:
                v = t.as_strided(view.shape, view.stride, view.offset)
            except RuntimeError as e:
                if self.bad is None:
                    self.bad = Poison(
                        "view", f"invalid view of tensor {view.base}: {e}", self.stream.decoding
                    )
                    if self.first_error is None:
                        self.first_error = (self.bad.label, self.bad.message, self.bad.seq)
                return None
            self.refs[id(v)] = view.base  # writes through the view land in the base
            self._views[data] = v
            return v
        if code == EXT_HOST:
            dtype, shape, raw = decode_host(data)
            if len(raw) == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        value = decode_simple_ext(code, data)
        if type(value) is Device:
            return self._device(value.name)
        if type(value) is GeneratorRef:
            return generators.resolve(self, value)
        return value

    def _device(self, name: str) -> torch.device:
        if name == "rgpu" or name.startswith("rgpu:"):
            return self.device if len(self.devices) == 1 else multidevice.index_of(self, name)
        if name in ("cpu", "meta"):
            return torch.device(name)
        raise ProtocolError(f"unknown device {name!r}; the client may name rgpu, cpu or meta")
