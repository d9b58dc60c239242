"""One client's state on the server, and the worker thread that runs its messages in order.

The event loop only moves frames: it puts what a client sends into `Session.inbox`, and the
session's worker thread decodes and executes them, so a long kernel never stalls pings or other
sessions. Replies go back through `Session.send`, which the connection provides.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rgpu.protocol import (
    EXT_HOST,
    EXT_REF,
    EXT_VIEW,
    WAITED,
    BatchReader,
    Encoder,
    Frame,
    Kind,
    Limits,
    ProtocolError,
    Status,
    TensorMeta,
    ack_frame,
    byte_view,
    chunk_frame,
    decode_host,
    decode_simple_ext,
    decode_view,
    decompress_batch,
    parse_chunk,
    reply_frame,
    unpack_ref,
)
from rgpu.protocol.codec import Device
from rgpu.protocol.lane import INTERRUPTED_TICKET

from . import graphs
from .lane import DEFAULT_STAGE_LIMIT, ServerLane, StagedUploads
from .ops import OpRefused, resolve
from .ops import _cache as _resolved

log = logging.getLogger("rgpu_server")

DEFAULT_SEED = (
    67280421310721  # torch's own default seed, so a fresh session acts like a fresh process
)
INLINE_DOWNLOAD = 1 << 20  # downloads up to this size ride inside the REPLY
DOWNLOAD_CHUNK = 1 << 20
MAX_DYNAMIC_OUTPUTS = 4096  # the client reserves this many ids for one RUN_DYN
REPLY_CACHE = 32  # replies kept for resending after a dropped connection...
REPLY_CACHE_BYTES = 512 << 20  # ...and their bytes (the newest is always kept)
ACK_EVERY_MESSAGES = 2048
ACK_EVERY_BYTES = 4 << 20
ACK_IDLE_BYTES = 16 << 10
_rng_swap_lock = threading.Lock()  # guards the process-wide default generator during a swap


class Poison:
    """Stands in for the outputs of a failed op; every later use fails with the same error."""

    __slots__ = ("label", "message")

    def __init__(self, label: str, message: str) -> None:
        self.label = label
        self.message = message


class ConnectionGone(Exception):
    """The connection dropped while the worker needed more frames from it."""


class UploadAborted(Exception):
    """The client cancelled an upload midway (Ctrl-C); its destination is poisoned."""


ABORT_OFFSET = (1 << 64) - 1  # a CHUNK at this offset cancels the upload it belongs to


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __len__(self) -> int:
        return 0


STOP = _Marker("stop")  # inbox sentinel: end the session
DETACHED = _Marker("detached")  # inbox sentinel: the connection of this generation dropped


def default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    if device.type == "mps":
        return torch.mps._get_default_mps_generator()
    return torch.default_generator


def _layout(meta: tuple) -> str:
    """`float32 [4, 2] strides [1, 4] offset 0` (and conj/neg bits when set)."""
    dtype, shape, stride, offset, conj, neg = meta
    bits = (" conj" if conj else "") + (" neg" if neg else "")
    return f"{dtype} {shape} strides {stride} offset {offset}{bits}"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _flatten(result: Any) -> list:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        flat: list = []
        for r in result:
            if isinstance(r, (tuple, list)):
                flat.extend(r)
            else:
                flat.append(r)
        return flat
    return [result]


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor as contiguous CPU memory (conj/neg resolved)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return byte_view(t.contiguous())


class Session:
    """Tensors, errors and RNG of one client, and the thread that executes its messages."""

    def __init__(
        self,
        sid: bytes,
        device: torch.device,
        limits: Limits,
        client: str = "?",
        quota: int | None = None,
    ) -> None:
        self.id = sid
        self.hex = sid.hex()[:8]
        self.device = device
        self.limits = limits
        self.client = client
        self.tensors: dict[int, torch.Tensor | Poison] = {}
        self.first_error: tuple[str, str] | None = None
        self.last_seq = 0
        self.ops_run = 0
        self.meta_mismatches = 0  # ops failed because an output differed from `expect`
        self.started = time.time()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(DEFAULT_SEED)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.processed = 0  # bytes of frames taken from the inbox (the reader pauses on backlog)
        self.send: Callable[[list], None] | None = None  # set by the connection
        self.on_protocol_error: Callable[[str], None] | None = None
        self.server_info: Callable[[], dict] | None = None  # facts about the whole server, for INFO
        # a session outlives its connection: a client that reconnects resumes it
        self.generation = 0
        self.detached_at: float | None = time.monotonic()
        self.ended = False
        self._busy = False
        self._pinned: torch.Tensor | None = None  # staging for chunks on their way to a GPU
        self.graphs: dict[str, graphs.Graph | Poison] = {}  # compiled graphs, by the client's key
        self._lookahead: tuple[int, Any] | None = (
            None  # a frame _receive_chunks took but did not own
        )
        # replies to waited messages, kept so a reply lost with a connection can be sent again
        self._replies: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._reply_bytes = 0
        self._acked = 0  # last sequence number announced in an ACK frame
        self._acked_bytes = 0
        # optional memory quota (bytes of distinct storages this session holds)
        self.quota = quota
        self.held = 0
        self._storage_of: dict[int, int] = {}  # tensor id -> storage key
        self._storages: dict[int, list[int]] = {}  # storage key -> [nbytes, refcount]
        self._encoder = Encoder()
        self._bad: Any = None  # first missing id or Poison met while decoding the current message
        self._refs: dict[int, int] = {}  # id() of each tensor the current message names -> its id
        self._keep: list = []  # views built for the current message (their id()s stay valid)
        # the bulk lane: its key (sent in WELCOME), uploads staged on it, the open lane if any
        self.lane_key = secrets.token_bytes(16)
        self.staged = StagedUploads(quota if quota is not None else DEFAULT_STAGE_LIMIT)
        self.max_lane_bytes = quota if quota is not None else DEFAULT_STAGE_LIMIT
        self.lane: ServerLane | None = None
        self.lane_transfers = 0
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
        return self.generation

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
        """Nothing received is still waiting to run."""
        return not self._busy and self._lookahead is None and self.inbox.empty()

    def join(self, timeout: float | None = None) -> None:
        self._worker.join(timeout)

    def _run(self) -> None:
        profile_dir = os.environ.get("RGPU_SERVER_PROFILE")  # developer aid: cProfile per session
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

    def _next_frame(self) -> tuple[int, Any]:
        """The next inbox item; a frame put back by `_receive_chunks` comes first."""
        if self._lookahead is not None:
            item, self._lookahead = self._lookahead, None
            return item
        return self.inbox.get()

    def _serve(self) -> None:
        try:
            while True:
                generation, frame = self._next_frame()
                self.processed += len(frame)
                if frame is STOP:
                    return
                if frame is DETACHED or generation != self.generation:
                    continue  # from a connection that is gone or was superseded
                self._busy = True
                try:
                    self._handle_frame(frame)
                except ConnectionGone:
                    continue  # the rest comes again when the client replays
                except ProtocolError as e:
                    log.warning("session %s: protocol error: %s", self.hex, e)
                    self._protocol_failure(str(e))
                    return
                except Exception as e:  # a bug of ours: report it, keep the process alive
                    log.exception("session %s: internal error", self.hex)
                    self._protocol_failure(f"internal server error: {_describe(e)}")
                    return
                finally:
                    self._busy = False
                self._maybe_ack()
        finally:
            self.ended = True
            self.tensors.clear()
            self._replies.clear()
            self.staged.clear()
            if self.lane is not None:
                self.lane.close()

    def _protocol_failure(self, message: str) -> None:
        """The stream is not understood: say so and end the session (its state is unknown)."""
        self._reply(0, Status.PROTOCOL, message)
        if self.on_protocol_error is not None:
            self.on_protocol_error(message)

    def _maybe_ack(self) -> None:
        """Tell the client what was applied, now and then, so its replay buffer stays small."""
        if self.last_seq > self._acked and (
            # caught up: a client holding back for flow control may be waiting for this
            (self.processed - self._acked_bytes >= ACK_IDLE_BYTES and self.inbox.empty())
            or self.last_seq - self._acked >= ACK_EVERY_MESSAGES
            or self.processed - self._acked_bytes >= ACK_EVERY_BYTES
        ):
            self._acked = self.last_seq
            self._acked_bytes = self.processed
            self._send([ack_frame(self.last_seq)])

    def _handle_frame(self, frame: bytes) -> None:
        if not frame:
            raise ProtocolError("empty frame")
        kind = frame[0]
        if kind == Frame.BATCH:
            self._run_batch(frame)
        elif kind == Frame.BATCH_Z:
            self._run_batch(decompress_batch(frame, self.limits))
        elif kind == Frame.CHUNK:
            seq, offset, _ = parse_chunk(frame, self.limits)
            if offset == ABORT_OFFSET and seq <= self.last_seq:
                return  # the cancelled upload had already arrived whole; nothing to undo
            raise ProtocolError("a CHUNK frame arrived that no UPLOAD announced")
        else:
            raise ProtocolError(f"a client may not send frame kind {kind}")

    # -- decoding ----------------------------------------------------------------------------

    def _ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_REF:
            tid = unpack_ref(data)
            t = self.tensors.get(tid)
            if t is None:
                if self._bad is None:
                    self._bad = tid
                return None
            if type(t) is Poison:
                if self._bad is None:
                    self._bad = t
                return None
            self._refs[id(t)] = tid
            return t
        if code == EXT_VIEW:  # a view the client made locally: rebuild it over its base's storage
            view = decode_view(data)
            t = self.tensors.get(view.base)
            if t is None:
                if self._bad is None:
                    self._bad = view.base
                return None
            if type(t) is Poison:
                if self._bad is None:
                    self._bad = t
                return None
            try:
                v = t.as_strided(view.shape, view.stride, view.offset)
            except RuntimeError as e:
                if self._bad is None:
                    self._bad = Poison("view", f"invalid view of tensor {view.base}: {e}")
                    if self.first_error is None:
                        self.first_error = (self._bad.label, self._bad.message)
                return None
            self._refs[id(v)] = view.base  # writes through the view land in the base
            self._keep.append(v)
            return v
        if code == EXT_HOST:
            dtype, shape, raw = decode_host(data)
            if len(raw) == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        value = decode_simple_ext(code, data)
        if type(value) is Device:
            return self._device(value.name)
        return value

    def _device(self, name: str) -> torch.device:
        if name == "rgpu" or name.startswith("rgpu:"):
            return self.device
        if name in ("cpu", "meta"):
            return torch.device(name)
        raise ProtocolError(f"unknown device {name!r}; the client may name rgpu, cpu or meta")

    # -- the batch loop ----------------------------------------------------------------------

    def _run_batch(self, frame: bytes) -> None:
        self._bad = None
        self._refs = {}
        self._keep = []
        reader = BatchReader(frame, self.limits, self._ext_hook)
        seq = reader.first_seq
        if seq > self.last_seq + 1:
            raise ProtocolError(f"sequence gap: expected {self.last_seq + 1}, got {seq}")
        for msg in reader:
            if seq > self.last_seq:
                self._execute(seq, msg)
                self.last_seq = seq
            elif (
                msg[0] == Kind.UPLOAD
                and len(msg) == 3
                and type(msg[2]) is list
                and len(msg[2]) == 3
            ):  # a replayed chunked upload: drain its chunks (a lane upload has none)
                _, _, nbytes = self._chunk_header(msg[2])
                try:
                    self._receive_chunks(seq, nbytes, lambda offset, payload: None)
                except UploadAborted:
                    pass  # its source changed since; it was applied whole the first time
            elif msg[0] in WAITED:
                self._resend_reply(seq)  # its reply was lost with the old connection
            seq += 1
            self._bad = None
            if self._refs:
                self._refs = {}
                self._keep = []

    def _execute(self, seq: int, msg: list) -> None:
        kind = msg[0]
        if kind == Kind.RUN:
            self._run_op(msg)
        elif kind == Kind.FREE:
            self._free(msg)
        elif kind == Kind.UPLOAD:
            self._upload(seq, msg)
        elif kind == Kind.DOWNLOAD:
            self._download(seq, msg)
        elif kind == Kind.RUN_DYN:
            self._run_dyn(seq, msg)
        elif kind == Kind.SYNC:
            if self._error_pending(seq):
                return
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elif self.device.type == "mps":
                torch.mps.synchronize()
            # the server's clock once the device is idle: the client's Event.elapsed_time
            self._reply(seq, Status.OK, time.perf_counter())
        elif kind == Kind.SEED:
            if len(msg) != 2 or type(msg[1]) is not int:
                raise ProtocolError("SEED takes one integer")
            self.generator.manual_seed(msg[1] & 0xFFFF_FFFF_FFFF_FFFF)
        elif kind == Kind.INFO:
            if not self._error_pending(seq):
                self._reply(seq, Status.OK, self.info())
        elif kind == Kind.RNG_GET:
            if not self._error_pending(seq):
                self._reply(seq, Status.OK, bytes(byte_view(self.generator.get_state())))
        elif kind == Kind.RNG_SET:
            if len(msg) != 2 or type(msg[1]) is not bytes:
                raise ProtocolError("RNG_SET takes one bytes value")
            try:
                self.generator.set_state(torch.frombuffer(bytearray(msg[1]), dtype=torch.uint8))
            except RuntimeError as e:
                self._fail("set_rng_state", _describe(e), ())
        elif kind == Kind.COMPILE:
            self._compile(msg)
        elif kind == Kind.CALL:
            self._call_graph(msg)
        elif kind == Kind.ACK:
            if not self._error_pending(seq):
                self._reply(seq, Status.OK, self.last_seq)
        else:
            raise ProtocolError(f"unknown message kind {kind}")

    # -- failures ----------------------------------------------------------------------------

    def _fail(self, label: str, message: str, outs) -> None:
        poison = Poison(label, message)
        for i in outs:
            if i is not None:
                if self.quota is not None:
                    self._uncharge(i)
                self.tensors[i] = poison
        if self.first_error is None:
            self.first_error = (label, message)

    def _written_ids(self, resolved, args: list, kwargs: dict | None) -> list[int]:
        """Ids of the tensors an in-place or out= op writes: they must not silently keep old data."""
        if not resolved.writes:
            return []
        targets: set[int] = set()
        for pos, name in resolved.writes:
            v = args[pos] if 0 <= pos < len(args) else (kwargs or {}).get(name)
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor):
                    targets.add(id(t))
        return [tid for obj_id, tid in self._refs.items() if obj_id in targets]

    def _poison_from_bad(self, label: str, outs) -> None:
        bad = self._bad
        if (
            type(bad) is Poison
        ):  # consuming a poisoned tensor: pass the same poison on, no new error
            for i in outs:
                if i is not None:
                    self.tensors[i] = bad
        else:
            self._fail(
                label,
                f"KeyError: no tensor with id {bad} in this session (freed, or never created)",
                outs,
            )

    def _error_pending(self, seq: int) -> bool:
        """Waited messages report a pending streamed failure instead of running."""
        if self.first_error is None:
            return False
        label, message = self.first_error
        self.first_error = None
        self._reply(seq, Status.ERROR, [label, message])
        return True

    # -- ops ---------------------------------------------------------------------------------

    def _call(self, resolved, args: list, kwargs: dict | None) -> Any:
        kwargs = kwargs or {}
        if resolved.takes_generator and kwargs.get("generator") is None:
            kwargs["generator"] = self.generator
            return resolved.op(*args, **kwargs)
        if resolved.seeded:
            default = default_generator(self.device)
            with _rng_swap_lock:
                saved = default.get_state()
                default.set_state(self.generator.get_state())
                try:
                    return resolved.op(*args, **kwargs)
                finally:
                    self.generator.set_state(default.get_state())
                    default.set_state(saved)
        return resolved.call(*args, **kwargs)

    def _run_op(self, msg: list) -> None:
        if len(msg) == 5:  # the hot path: no expected metadata
            _, name, args, kwargs, outs = msg
            if (
                type(args) is list
                and type(outs) is list
                and len(outs) == 1
                and self._bad is None
                and self.quota is None
            ):
                resolved = _resolved.get(name) if type(name) is str else None
                if resolved is not None and resolved.plain:
                    try:
                        result = resolved.call(*args, **kwargs) if kwargs else resolved.call(*args)
                    except Exception as e:
                        self._fail(
                            resolved.label,
                            _describe(e),
                            [*outs, *self._written_ids(resolved, args, kwargs)],
                        )
                        return
                    self.ops_run += 1
                    i = outs[0]
                    if type(result) is torch.Tensor and type(i) is int:
                        self.tensors[i] = result
                        return
                    self._store(resolved, msg, outs, result)
                    return
        if len(msg) < 5:
            raise ProtocolError("RUN takes op, args, kwargs, out_ids")
        name, args, kwargs, outs = msg[1], msg[2], msg[3], msg[4]
        if (
            type(args) is not list
            or (kwargs is not None and type(kwargs) is not dict)
            or type(outs) is not list
        ):
            raise ProtocolError("RUN fields have the wrong types")
        try:
            resolved = resolve(name)
        except OpRefused as e:
            self._fail(f"aten::{name}", f"OpRefused: {e}", outs)
            return
        if self._bad is not None:
            self._poison_from_bad(
                resolved.label, [*outs, *self._written_ids(resolved, args, kwargs)]
            )
            return
        if self.quota is not None and resolved.factory:
            need = self._factory_bytes(resolved, args, kwargs)
            if self.held + need > self.quota:
                self._fail(resolved.label, self._oom_message(need), outs)
                return
        try:
            result = self._call(resolved, args, kwargs)
        except Exception as e:
            self._fail(
                resolved.label, _describe(e), [*outs, *self._written_ids(resolved, args, kwargs)]
            )
            return
        self.ops_run += 1
        self._store(resolved, msg, outs, result)

    def _store(self, resolved, msg: list, outs: list, result: Any) -> None:
        """Keep an op's outputs under the client's ids."""
        if not outs:
            return
        if len(outs) == 1 and type(result) is torch.Tensor:
            flat = [result]
        else:
            flat = _flatten(result)
            if len(flat) != len(outs):
                self._fail(
                    resolved.label,
                    f"op returned {len(flat)} values, client expected {len(outs)}",
                    outs,
                )
                return
        if len(msg) > 5 and msg[5] is not None:
            flat = self._check_expected(resolved.label, flat, msg[5], outs)
            if flat is None:
                return
        tensors = self.tensors
        for i, v in zip(outs, flat):
            if i is not None:
                if type(i) is not int:
                    raise ProtocolError("output ids must be integers or null")
                if isinstance(v, torch.Tensor):
                    tensors[i] = v
                elif v is not None:  # None: an undefined optional output (e.g. a masked-out grad)
                    self._fail(
                        resolved.label, f"expected a tensor output, got {type(v).__name__}", outs
                    )
                    return
        if self.quota is not None:
            self._charge(resolved.label, outs)

    def _check_expected(self, label: str, flat: list, expect, outs) -> list | None:
        """Check outputs against the client's predicted metadata; fail the op on any difference.

        The client makes views of an output from its prediction alone, so an output laid out
        otherwise would be read wrongly later: it is reported, never re-laid-out or replaced.
        Strides are compared where they address memory (dims of size > 1 of a non-empty
        tensor), as torch._prims_common.check_significant_strides does."""
        if type(expect) is not list or len(expect) != len(flat):
            raise ProtocolError("expected-metadata list does not match the outputs")
        for k, (v, e) in enumerate(zip(flat, expect)):
            if e is None or not isinstance(v, torch.Tensor):
                continue
            if type(e) is not TensorMeta:
                raise ProtocolError("expected metadata must be tensor metadata")
            shape, stride = list(v.shape), list(v.stride())
            got = (v.dtype, shape, stride, v.storage_offset(), v.is_conj(), v.is_neg())
            want = (e.dtype, list(e.shape), list(e.stride), e.offset, bool(e.conj), bool(e.neg))
            same = got[:2] == want[:2] and got[3:] == want[3:] and len(want[2]) == len(stride)
            if same and v.numel() > 0:
                same = all(n == 1 or a == b for n, a, b in zip(shape, stride, want[2]))
            if not same:
                self.meta_mismatches += 1
                self._fail(
                    label,
                    f"rgpu predicted output {k} as {_layout(want)} but the server produced "
                    f"{_layout(got)}; please report this as an rgpu bug",
                    outs,
                )
                return None
        return flat

    def _run_dyn(self, seq: int, msg: list) -> None:
        """An op whose output shapes only the data can tell: run now, answer with metadata."""
        if (
            len(msg) != 5
            or type(msg[2]) is not list
            or (msg[3] is not None and type(msg[3]) is not dict)
        ):
            raise ProtocolError("RUN_DYN takes op, args, kwargs, first_id")
        name, args, kwargs, first_id = msg[1], msg[2], msg[3], msg[4]
        if type(first_id) is not int or first_id < 1:
            raise ProtocolError("RUN_DYN first_id must be a positive integer")
        if self._error_pending(seq):
            return
        try:
            resolved = resolve(name)
        except OpRefused as e:
            self._reply(seq, Status.ERROR, [f"aten::{name}", f"OpRefused: {e}"])
            return
        if self._bad is not None:
            bad = self._bad
            if type(bad) is Poison:
                self._reply(seq, Status.ERROR, [bad.label, bad.message])
            else:
                self._reply(
                    seq,
                    Status.ERROR,
                    [resolved.label, f"KeyError: no tensor with id {bad} in this session"],
                )
            return
        try:
            result = self._call(resolved, args, kwargs)
        except Exception as e:
            poison = Poison(resolved.label, _describe(e))
            for i in self._written_ids(resolved, args, kwargs):
                self.tensors[i] = poison
            self._reply(seq, Status.ERROR, [resolved.label, _describe(e)])
            return
        self.ops_run += 1
        values = []
        next_id = first_id
        flat = _flatten(result)
        if len(flat) > MAX_DYNAMIC_OUTPUTS:
            self._reply(
                seq,
                Status.ERROR,
                [
                    resolved.label,
                    f"returned {len(flat)} values; at most {MAX_DYNAMIC_OUTPUTS} are supported",
                ],
            )
            return
        for v in flat:
            if isinstance(v, torch.Tensor) and v.layout != torch.strided:
                self._reply(
                    seq,
                    Status.ERROR,
                    [
                        resolved.label,
                        f"produced a {v.layout} tensor; rgpu supports dense (strided) tensors only",
                    ],
                )
                return
        stored = []
        for v in flat:
            if isinstance(v, torch.Tensor):
                self.tensors[next_id] = v
                stored.append(next_id)
                next_id += 1
                values.append(
                    TensorMeta(
                        v.dtype,
                        tuple(v.shape),
                        v.stride(),
                        v.storage_offset(),
                        v.is_conj(),
                        v.is_neg(),
                    )
                )
            elif v is None or type(v) in (bool, int, float, complex, str, torch.dtype):
                values.append(v)
            else:
                values.append(str(v))
        if self.quota is not None and not self._charge(resolved.label, stored, report=False):
            self.first_error = None
            self._reply(seq, Status.ERROR, [resolved.label, self._oom_message(0)])
            return
        self._reply(seq, Status.OK, values)

    def _free(self, msg: list) -> None:
        if len(msg) != 2 or type(msg[1]) is not list:
            raise ProtocolError("FREE takes a list of ids")
        pop = self.tensors.pop
        if self.quota is not None:
            for i in msg[1]:
                if type(i) is int:
                    self._uncharge(i)
        for i in msg[1]:
            if type(i) is int:
                pop(i, None)

    # -- compiled graphs ---------------------------------------------------------------------

    def _compile(self, msg: list) -> None:
        if (
            len(msg) != 5
            or type(msg[1]) is not str
            or msg[3] not in graphs.COMPILERS
            or not (msg[4] is None or type(msg[4]) is str)
        ):
            raise ProtocolError(
                "COMPILE takes a key, nodes, a compiler (inductor or eager) and a mode"
            )
        key, nodes, compiler, mode = msg[1], msg[2], msg[3], msg[4]
        if key in self.graphs:
            return
        try:
            self.graphs[key] = graphs.CACHE.get_or_build(nodes, compiler, mode, self.device)
        except graphs.GraphRefused as e:
            self._fail_graph(key, f"OpRefused: {e}")
        except ProtocolError:
            raise
        except Exception as e:
            self._fail_graph(key, _describe(e))

    def _fail_graph(self, key: str, message: str) -> None:
        poison = Poison(f"compiled graph {key[:12]}", message)
        self.graphs[key] = poison
        if self.first_error is None:
            self.first_error = (poison.label, message)

    def _call_graph(self, msg: list) -> None:
        if len(msg) != 4 or type(msg[2]) is not list or type(msg[3]) is not list:
            raise ProtocolError("CALL takes a graph key, inputs and output ids")
        key, inputs, outs = msg[1], msg[2], msg[3]
        graph = self.graphs.get(key) if type(key) is str else None
        if graph is None:
            self._fail(
                f"graph {str(key)[:12]}",
                "RuntimeError: this graph was never compiled in this session",
                outs,
            )
            return
        if type(graph) is Poison:
            for i in outs:
                if i is not None:
                    self.tensors[i] = graph
            return
        if self._bad is not None:
            self._poison_from_bad(f"compiled graph {key[:12]}", outs)
            return
        try:
            result = graphs.timed_first_call(graph, lambda: self._run_graph(graph, inputs))
        except Exception as e:
            self._fail(f"compiled graph {key[:12]}", _describe(e), outs)
            return
        self.ops_run += 1
        result = list(result) if isinstance(result, (list, tuple)) else [result]
        if len(result) != len(outs):
            self._fail(
                f"compiled graph {key[:12]}",
                f"graph returned {len(result)} values, client expected {len(outs)}",
                outs,
            )
            return
        for i, v in zip(outs, result):
            if i is not None:
                if type(i) is not int:
                    raise ProtocolError("output ids must be integers or null")
                if isinstance(v, torch.Tensor):
                    self.tensors[i] = v
        if self.quota is not None:
            self._charge(f"compiled graph {key[:12]}", outs)

    def _run_graph(self, graph: graphs.Graph, inputs: list) -> Any:
        with torch.no_grad():
            if not graph.seeded:
                return graph.fn(*inputs)
            default = default_generator(self.device)
            with _rng_swap_lock:
                saved = default.get_state()
                default.set_state(self.generator.get_state())
                try:
                    return graph.fn(*inputs)
                finally:
                    self.generator.set_state(default.get_state())
                    default.set_state(saved)

    # -- memory quota ------------------------------------------------------------------------

    def _charge(self, label: str, ids, report: bool = True) -> bool:
        """Count new outputs against the quota; over it, drop them like an out-of-memory error."""
        for i in ids:
            if i is None:
                continue
            t = self.tensors.get(i)
            if not isinstance(t, torch.Tensor) or i in self._storage_of:
                continue
            st = t.untyped_storage()
            key = st.data_ptr() or -id(st)
            entry = self._storages.get(key)
            if entry is None:
                self._storages[key] = [st.nbytes(), 1]
                self.held += st.nbytes()
            else:
                entry[1] += 1
            self._storage_of[i] = key
        if self.held <= self.quota:
            return True
        message = self._oom_message(0)
        for i in ids:
            if i is not None:
                self._uncharge(i)
                self.tensors[i] = Poison(label, message)
        if report and self.first_error is None:
            self.first_error = (label, message)
        return False

    def _uncharge(self, tid: int) -> None:
        key = self._storage_of.pop(tid, None)
        if key is None:
            return
        entry = self._storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self.held -= entry[0]

    def _oom_message(self, need: int) -> str:
        return (
            f"OutOfMemoryError: this session holds {self.held} bytes"
            + (f" and asked for {need} more" if need else "")
            + f"; its quota on this server is {self.quota} bytes. Free tensors you no longer need "
            "(del them) and try again."
        )

    def _factory_bytes(self, resolved, args: list, kwargs: dict | None) -> int:
        """Bytes a factory would allocate, from its meta kernel: refused before it allocates."""
        meta_kwargs = dict(kwargs or {})
        meta_kwargs["device"] = torch.device("meta")
        try:
            out = resolved.op(*args, **meta_kwargs)
        except Exception:
            return 0  # the real call will fail with the real error
        return sum(
            t.numel() * t.element_size() for t in _flatten(out) if isinstance(t, torch.Tensor)
        )

    # -- transfers ---------------------------------------------------------------------------

    def _upload(self, seq: int, msg: list) -> None:
        if len(msg) != 3:
            raise ProtocolError("UPLOAD takes a destination and data")
        dst, data = msg[1], msg[2]
        staged = None  # a lane buffer, given back once its bytes are copied out
        if type(data) is list and len(data) == 4:  # on the lane: [dtype, shape, nbytes, ticket]
            if data[3] == INTERRUPTED_TICKET:
                self._poison_interrupted(dst)
                return
            staged = self._staged_upload(data)
            if staged is None:
                return
            host = staged[1]
        elif type(data) is list:  # chunked: [dtype, shape, nbytes], CHUNK frames follow
            dtype, shape, nbytes = self._chunk_header(data)
            write = self._direct_writer(dst, dtype, shape)
            staging = None
            if write is None and (not isinstance(dst, torch.Tensor) or nbytes > dst.numel() * 16):
                # no destination (poisoned or unknown id), or more bytes than any copy_ into it
                # could use: take the chunks without keeping them
                write = lambda offset, payload: None  # noqa: E731
                dst = None
            elif write is None:  # a cast, a broadcast or a strided destination: stage, then copy_
                staging = bytearray(nbytes)
                view = memoryview(staging)

                def write(offset: int, payload: memoryview) -> None:
                    view[offset : offset + len(payload)] = payload

            try:
                self._receive_chunks(seq, nbytes, write)
            except UploadAborted:
                self._poison_interrupted(dst)
                return
            if dst is None:
                if self._bad is None:
                    self._fail(
                        "upload", f"the upload of {nbytes} bytes does not fit its destination", ()
                    )
                elif type(self._bad) is not Poison:
                    self._fail(
                        "upload", f"KeyError: no tensor with id {self._bad} in this session", ()
                    )
                return
            if staging is None:
                return  # the chunks went straight into dst (or nowhere, for a poisoned dst)
            host = (
                torch.frombuffer(staging, dtype=dtype).reshape(shape)
                if nbytes
                else torch.empty(shape, dtype=dtype)
            )
        elif isinstance(data, torch.Tensor):
            host = data
        else:
            raise ProtocolError("UPLOAD data must be a host tensor or a chunk header")
        if self._bad is not None:
            if type(self._bad) is not Poison:
                self._fail("upload", f"KeyError: no tensor with id {self._bad} in this session", ())
            return
        if not isinstance(dst, torch.Tensor):
            raise ProtocolError("UPLOAD destination must be a tensor reference")
        try:
            with torch.no_grad():
                dst.copy_(host)
            if staged is not None and self.device.type in ("cpu", "cuda"):
                # copy_ from pageable memory has read it all when it returns on these devices
                self.staged.recycle(staged[0])
        except Exception as e:
            self._fail("upload", _describe(e), ())

    def _poison_interrupted(self, dst: Any) -> None:
        poison = Poison(
            "upload", "the upload was interrupted on the client; this tensor holds no data"
        )
        if isinstance(dst, torch.Tensor) and id(dst) in self._refs:
            self.tensors[self._refs[id(dst)]] = poison

    def _staged_upload(self, header: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(buffer, host tensor) of an upload staged on the lane; None (the upload failed) if it
        is not there."""
        ticket = header[3]
        dtype, shape, nbytes = self._chunk_header(header[:3])
        if type(ticket) is not int:
            raise ProtocolError("a lane UPLOAD's ticket must be an integer")
        staged = self.staged.take(ticket)
        if staged is None or staged.numel() != nbytes:
            self._fail(
                "upload", f"no {nbytes} bytes were staged on the lane as upload {ticket}", ()
            )
            return None
        self.lane_transfers += 1
        host = staged.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        return staged, host

    def _direct_writer(self, dst: Any, dtype: torch.dtype, shape: list):
        """Write chunks straight into dst when its bytes are exactly the upload's bytes (saves a
        staging buffer the size of the upload and a full copy)."""
        if (
            self._bad is not None
            or not isinstance(dst, torch.Tensor)
            or dst.dtype != dtype
            or list(dst.shape) != shape
            or not dst.is_contiguous()
            or dst.is_conj()
            or dst.is_neg()
            or dst.numel() == 0
        ):
            return None
        if dst.device.type == "cpu":
            view = byte_view(dst)

            def write(offset: int, payload: memoryview) -> None:
                view[offset : offset + len(payload)] = payload

            return write
        flat = dst.reshape(-1).view(torch.uint8)
        if self._pinned is None or self._pinned.numel() < self.limits.max_chunk:
            pin = self.device.type == "cuda"
            self._pinned = torch.empty(self.limits.max_chunk, dtype=torch.uint8, pin_memory=pin)
        pinned = self._pinned
        pinned_view = byte_view(pinned)

        def write_device(offset: int, payload: memoryview) -> None:
            n = len(payload)
            pinned_view[:n] = payload
            flat[offset : offset + n].copy_(pinned[:n])

        return write_device

    def _chunk_header(self, header: list) -> tuple[torch.dtype, list, int]:
        if len(header) != 3:
            raise ProtocolError("chunked UPLOAD header is [dtype, shape, nbytes]")
        dtype, shape, nbytes = header
        if type(dtype) is not torch.dtype or type(shape) is not list or type(nbytes) is not int:
            raise ProtocolError("chunked UPLOAD header has the wrong types")
        numel = 1
        for s in shape:
            if type(s) is not int or s < 0:
                raise ProtocolError("chunked UPLOAD shape must be non-negative integers")
            numel *= s
        if nbytes != numel * dtype.itemsize:
            raise ProtocolError(
                f"chunked UPLOAD announces {nbytes} bytes for shape {shape} of {dtype}"
            )
        return dtype, shape, nbytes

    def _receive_chunks(self, seq: int, nbytes: int, write) -> None:
        """Take the CHUNK frames of UPLOAD `seq` from the inbox, in order, into `write`."""
        got = 0
        upload_generation = self.generation
        while got < nbytes:
            generation, frame = self._next_frame()
            if frame is STOP or (generation != upload_generation and frame is not DETACHED):
                # the session ends, or a newer connection's replay arrived before we noticed the
                # old one drop: leave that frame for the main loop; the upload comes again
                self._lookahead = (generation, frame)
                raise ConnectionGone()
            self.processed += len(frame)
            if frame is DETACHED:
                raise ConnectionGone()  # the upload comes again, whole, when the client replays
            if not frame or frame[0] != Frame.CHUNK:
                raise ProtocolError("UPLOAD expected a CHUNK frame next")
            cseq, offset, payload = parse_chunk(frame, self.limits)
            if offset == ABORT_OFFSET and cseq == seq:
                raise UploadAborted()
            if cseq != seq or offset != got or got + len(payload) > nbytes or not payload:
                raise ProtocolError(
                    f"CHUNK for seq {cseq} at offset {offset} does not continue UPLOAD {seq}"
                )
            write(got, payload)
            got += len(payload)

    def _download(self, seq: int, msg: list) -> None:
        if len(msg) not in (2, 3):
            raise ProtocolError("DOWNLOAD takes one tensor reference (and a lane ticket)")
        ticket = msg[2] if len(msg) == 3 else None
        if ticket is not None and type(ticket) is not int:
            raise ProtocolError("a DOWNLOAD's lane ticket must be an integer")
        if self._error_pending(seq):
            return
        t = msg[1]
        if self._bad is not None:
            bad = self._bad
            if type(bad) is Poison:
                self._reply(seq, Status.ERROR, [bad.label, bad.message])
            else:
                self._reply(
                    seq,
                    Status.ERROR,
                    [
                        f"download of tensor {bad}",
                        f"KeyError: no tensor with id {bad} in this session",
                    ],
                )
            return
        if not isinstance(t, torch.Tensor):
            raise ProtocolError("DOWNLOAD takes a tensor reference")
        try:
            data = _host_bytes(t)
        except Exception as e:
            self._reply(seq, Status.ERROR, ["download", _describe(e)])
            return
        n = len(data)
        if n <= INLINE_DOWNLOAD:
            self._reply(seq, Status.OK, bytes(data))
            return
        lane = self.lane
        if ticket is not None and lane is not None and lane.send(ticket, data):
            self.lane_transfers += 1
            self._reply(seq, Status.OK, ["lane", n])  # a lost lane: the client asks again
            return
        frames = [
            chunk_frame(Frame.DATA, seq, off, data[off : off + DOWNLOAD_CHUNK])
            for off in range(0, n, DOWNLOAD_CHUNK)
        ]
        self._reply(seq, Status.OK, n, frames)

    # -- replies and facts -------------------------------------------------------------------

    def _send(self, frames: list) -> None:
        if self.send is not None:
            self.send(frames)

    def _reply(self, seq: int, status: Status, value: Any, data: list | None = None) -> None:
        frames = [*(data or ()), reply_frame(self._encoder.encode, seq, status, value)]
        if seq:
            self._remember(seq, frames)
        self._send(frames)

    def _remember(self, seq: int, frames: list) -> None:
        size = sum(len(f) if not isinstance(f, list) else sum(len(x) for x in f) for f in frames)
        self._replies[seq] = frames
        self._reply_bytes += size
        while len(self._replies) > 1 and (
            len(self._replies) > REPLY_CACHE or self._reply_bytes > REPLY_CACHE_BYTES
        ):
            _, old = self._replies.popitem(last=False)
            self._reply_bytes -= sum(
                len(f) if not isinstance(f, list) else sum(len(x) for x in f) for f in old
            )

    def _resend_reply(self, seq: int) -> None:
        frames = self._replies.get(seq)
        if frames is None:
            frames = [reply_frame(self._encoder.encode, seq, Status.ERROR, [
                "resume", "the reply to this request was lost with the connection and is no longer "
                "kept; run the request again"])]  # fmt: skip
        self._send(frames)

    def memory(self) -> tuple[int, int]:
        """(live tensor ids, bytes of the distinct storages they hold)."""
        seen: dict[int, int] = {}
        count = 0
        for t in list(self.tensors.values()):
            if isinstance(t, torch.Tensor):
                count += 1
                st = t.untyped_storage()
                seen[st.data_ptr() or id(st)] = st.nbytes()
        return count, sum(seen.values())

    def info(self) -> dict:
        count, nbytes = self.memory()
        return {
            "session": self.id.hex(),
            "tensors": count,
            "bytes": nbytes,
            "last_seq": self.last_seq,
            "ops_run": self.ops_run,
            "meta_mismatches": self.meta_mismatches,
            "quota": self.quota,
            "graphs": len(self.graphs),
            "lane_transfers": self.lane_transfers,
            "lane_staged_bytes": self.staged.nbytes,
            "compile": graphs.CACHE.counters(),
            "device": str(self.device),
            "server": self.server_info() if self.server_info is not None else {},
        }
