"""What the server holds for one client: tensors, errors, generator, quota, graphs, lane, and the
helpers every message handler uses to fail, answer and count.

`Session` (session.py) adds the worker thread and the inbox; handlers (handlers.py) see this
state only.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import torch

from rgpu_protocol import DEFAULT_SEED, Limits, Status
from rgpu_protocol.server_stream import ServerStream

from . import graphs, numerics
from .devices import live_facts
from .lane import DEFAULT_STAGE_LIMIT, ServerLane, StagedUploads
from .poison import Poison
from .quota import Quota


class SessionState:
    def __init__(
        self,
        sid: bytes,
        device: torch.device,
        limits: Limits,
        client: str = "?",
        quota: int | None = None,
        owner: str = "",
        name: str | None = None,
    ) -> None:
        self.id = sid
        self.owner = owner  # a hash of the token that made the session: only it may reach it
        self.name = name  # a named session outlives its client (registry.py)
        self.hex = sid.hex()[:8]
        self.device = device
        self.limits = limits
        self.client = client
        self.tensors: dict[int, torch.Tensor | Poison] = {}
        # label, message, failing seq (and, inside a REPLAY, the failing op's index)
        self.first_error: tuple | None = None
        self.current_seq = 0  # the message running now
        self.replay_index: int | None = None  # the op of a REPLAY running now (replay.py)
        self.sequences: dict[int, Any] = {}  # DEFINE'd sequences by slot (replay.py)
        self.sequence_run: Any = None  # the run REPLAY messages continue (replay.py)
        self.stream = ServerStream(limits)
        self.ops_run = 0
        self.meta_mismatches = 0  # ops failed because an output differed from `expect`
        self.started = time.time()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(DEFAULT_SEED)
        # several devices (multidevice.py): messages run on devices[device_index], with its
        # generator; `device` and `generator` are always the current device's
        self.devices: tuple[torch.device, ...] = (device,)
        self.device_index = 0
        self.generators: list[torch.Generator] = [self.generator]
        self.user_generators: dict[int, torch.Generator] = {}  # the client's (generators.py)
        self.groups: dict[str, Any] = {}  # collective groups this session joined (collectives.py)
        self.settings: tuple = ()  # torch's numeric settings, as the client set them (numerics.py)
        self.send: Callable[[list], None] | None = None  # set by the connection
        self.server_info: Callable[[], dict] | None = None  # facts about the whole server, for INFO
        self.pinned: torch.Tensor | None = None  # staging for chunks on their way to a GPU
        self.graphs: dict[str, graphs.Graph | Poison] = {}  # compiled graphs, by the client's key
        self.graph_layouts: dict[str, tuple] = {}  # their outputs' layouts in the client's trace
        self.quota = Quota(quota) if quota is not None else None
        self.bad: Any = None  # first missing id or Poison met while decoding the current message
        self.refs: dict[int, int] = {}  # id() of each tensor the current message names -> its id
        self.sink: Any = None  # where the chunks of the upload in progress go (transfers.py)
        # the bulk lane: its key (sent in WELCOME), uploads staged on it, the open lane if any
        self.lane_key = secrets.token_bytes(16)
        self.staged = StagedUploads(quota if quota is not None else DEFAULT_STAGE_LIMIT)
        self.max_lane_bytes = quota if quota is not None else DEFAULT_STAGE_LIMIT
        self.lane: ServerLane | None = None
        self.lane_transfers = 0
        self.data: Any = None  # the server's DataRoots (files.py), when it has --data-dir roots
        self.written = 0  # bytes of files this session wrote (counted against its quota)
        self.kept: dict[str, Any] = {}  # rgpu.keep: name -> Kept (keeping.py)
        self.registry: Any = None  # the server's SessionRegistry, for SESSIONS and DROP_SESSION
        self.store: Any = None  # the server's DurableStore (--state-dir), if any
        self.attached_at: float | None = None

    @property
    def last_seq(self) -> int:
        return self.stream.last_seq

    # -- failures ----------------------------------------------------------------------------

    def fail(self, label: str, message: str, outs: Any) -> None:
        """Poison these ids with the op's error; the first error is reported at the next wait."""
        poison = Poison(label, message, self.current_seq, self.replay_index)
        for i in outs:
            if i is not None:
                if self.quota is not None:
                    self.quota.uncharge(i)
                self.tensors[i] = poison
        if self.first_error is None:
            self.first_error = tuple(poison.reply())

    def missing_message(self) -> str:
        return f"KeyError: no tensor with id {self.bad} in this session (freed, or never created)"

    def pass_on_bad(self, label: str, outs: Any) -> None:
        """An argument was missing or poisoned: its outputs get the same poison (no new error)
        or, for a missing id, a new one."""
        bad = self.bad
        if type(bad) is Poison:
            for i in outs:
                if i is not None:
                    self.tensors[i] = bad
        else:
            self.fail(label, self.missing_message(), outs)

    def bad_reply(self, label: str) -> list:
        """The [label, message] a waited message answers when an argument was missing or
        poisoned."""
        bad = self.bad
        if type(bad) is Poison:
            return bad.reply()
        return [label, f"KeyError: no tensor with id {bad} in this session", self.current_seq]

    def written_ids(self, resolved: Any, args: list, kwargs: dict | None) -> list[int]:
        """Ids of the tensors an in-place or out= op writes: they must not silently keep old data."""
        if not resolved.writes:
            return []
        targets: set[int] = set()
        for pos, name in resolved.writes:
            v = args[pos] if 0 <= pos < len(args) else (kwargs or {}).get(name)
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor):
                    targets.add(id(t))
        return [tid for obj_id, tid in self.refs.items() if obj_id in targets]

    def error_pending(self, seq: int) -> bool:
        """Waited messages report a pending streamed failure instead of running."""
        if self.first_error is None:
            return False
        error, self.first_error = self.first_error, None
        self.reply(seq, Status.ERROR, list(error))
        return True

    def charge(self, label: str, ids: Any, report: bool = True) -> bool:
        """Count new outputs against the quota; over it, drop them like an out-of-memory error."""
        if self.quota.charge(self.tensors, ids):
            return True
        message = self.quota.message()
        for i in ids:
            if i is not None:
                self.quota.uncharge(i)
                self.tensors[i] = Poison(label, message, self.current_seq, self.replay_index)
        if report and self.first_error is None:
            self.first_error = tuple(
                Poison(label, message, self.current_seq, self.replay_index).reply()
            )
        return False

    # -- replies and facts -------------------------------------------------------------------

    def deliver(self, frames: list) -> None:
        if self.send is not None:
            with numerics.released():  # a slow client holds up no other session
                self.send(frames)

    def reply(self, seq: int, status: Status, value: Any, data: list | None = None) -> None:
        self.deliver(self.stream.reply(seq, status, value, data))

    def memory(self) -> tuple[int, int]:
        """(live tensor ids, bytes of the distinct storages they and kept objects hold)."""
        seen: dict[int, int] = {}
        count = 0
        for t in list(self.tensors.values()):
            if isinstance(t, torch.Tensor):
                count += 1
                st = t.untyped_storage()
                seen[st.data_ptr() or id(st)] = st.nbytes()
        for kept in list(self.kept.values()):
            for t in kept.tensors:
                if t.device.type == self.device.type:  # kept on any of its devices
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
            "quota": self.quota.limit if self.quota is not None else None,
            "graphs": len(self.graphs),
            "lane_transfers": self.lane_transfers,
            "lane_staged_bytes": self.staged.nbytes,
            "compile": graphs.CACHE.counters(),
            "device": str(self.device),
            "server": self.server_info() if self.server_info is not None else {},
            **live_facts(self.device),  # memory used / total, utilisation: read now
        }

    def peek(self) -> dict:
        """What a PEEK frame asks for: the live device facts and what this session holds (not
        its stream position: the peek is answered out of band, from the event loop's side)."""
        count, nbytes = self.memory()
        return {"tensors": count, "bytes": nbytes, **live_facts(self.device)}
