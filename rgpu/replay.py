"""Replayed steps: a repeated op sequence goes to the server once, then one REPLAY message runs
each repetition (protocol.md, DEFINE and REPLAY).

The stream of RUN messages is cut into *segments* at every other message (a wait, an upload, a
seed, a compiled-graph call, ...) and at `Session.flush()`. Each segment is recorded in relative
form (rgpu.sequences); when a segment repeats one recorded before, the two become a template.
When a later segment starts with a template's first op, its RUNs are *held* instead of queued,
each checked against the template (byte for byte, varying floats aside, and its output ids); held
ops are queued as one REPLAY every `flush_ops` ops, before a FREE, and when the segment ends (the
queue goes out as `cut` says). The
first op that differs ends the replay: the held ops before it go out as a REPLAY of what matched,
it and the rest of the segment as RUNs. So the server always runs exactly the ops the program
issued, in order; a held op's output ids are the ids the client already minted.

Every decision depends on the program only, never on timing: the quiet-flush thread does not
send held ops (it would make message counts depend on when it wakes), so a client that stops
mid-segment leaves at most `flush_ops - 1` ops unsent until its next wait, upload or flush.

Held RUNs are not kept (their tensors may die meanwhile, as with RUNs already queued): a FREE
first sends the held ops, which may name the ids it frees.

Interrupts: state that a REPLAY is built from changes in an order that can lose an op an
interrupt lands in (as an interrupted RUN is lost) but never sends one twice or wrong: each held
op is committed by one list append, inputs are numbered only after they are listed, and inputs
and params are re-checked against the template before a REPLAY goes out.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import msgpack

from rgpu_protocol import MAX_SEQUENCE_OPS, Kind, SlotKind, slot_ext, slot_view_ext

from .errors import RgpuError
from .sequences import MIN_OPS, Library, OpRec, Template
from .tensor import RemoteTensor

_RUN = int(Kind.RUN)
_REPLAY = int(Kind.REPLAY)
IDLE, RECORD, MATCH, PLAIN = 0, 1, 2, 3  # between segments; learning; replaying; sending RUNs
log = logging.getLogger("rgpu")
BARREN_LIMIT = 4  # recorded segments in a row that taught nothing before recording backs off
MAX_BACKOFF = 64  # segments left unrecorded at most, between recordings, when nothing repeats


class Replayer:
    """One session's replayed sequences: learning, holding, and sending REPLAY messages."""

    def __init__(self, session: Any, hook: Callable[[Any], Any], enabled: bool) -> None:
        """`session` queues messages (`queue_locked`); `hook` encodes what msgpack does not know."""
        self.session = session
        self.on = enabled
        self.flush_ops = session.config.flush_ops
        self.library = Library(max_define_bytes=session.max_message // 2)
        self._hook = hook
        self._pack = msgpack.Packer(default=self._relative, use_bin_type=True, autoreset=True).pack
        self._out_exts: list = []
        self._in_exts: list = []
        # counters (rgpu.stats()["replayed_ops"] and the benchmarks)
        self.replayed_ops = 0  # ops that went out inside REPLAY messages
        self.defines = 0
        self.fallbacks = 0  # replays a differing op ended
        self.segments = 0
        self._quiet_until = 0  # backoff: segments before this one are not recorded
        self._backoff = 0
        self._barren = 0
        self.sent = False  # a REPLAY went out during the last `take`
        self.commits = 0  # ops held so far (`failed` tells a held op from one to queue)
        self.unsent_ops = 0  # ops in REPLAYs queued since the session's frame number `_frames`
        self._frames = 0
        _REPLAYERS.add(self)
        _watch_optimizers()
        self.device = 0  # the device the segment's ops run on (a device change ends it)
        self._reset()

    def _reset(self) -> None:
        self.mode = IDLE
        self.base: int | None = None  # the segment's first output id: ids are offsets from it
        self.max_off = -1  # the highest output offset so far (larger ids are inputs)
        self.ext_ids: list[int] = []  # the segment's inputs, in order of first use
        self.ext_index: dict[int, int] = {}
        self.rec: list[OpRec] | None = None  # the recording, while learning
        self.t: Template | None = None  # the template being followed
        self.a = 0  # its first op not sent yet
        self.held: list = []  # per held op: its varying floats, or None (appended: the commit)
        self.held_sites: list = []  # per held op: where it was queued (rgpu.settings.op_sites)
        self.inputs_sent = 0
        self._slots: dict = {}  # a tensor's wire ext -> its slot ext in this segment

    # -- the relative form ----------------------------------------------------------------

    def _relative(self, obj: Any) -> Any:
        """msgpack hook: a tensor as a slot of the segment (an output or an input), not an id."""
        if type(obj) is not RemoteTensor:
            return self._hook(obj)
        h = obj._r
        slot = self._slots.get(h.ext)  # a tensor's slot never changes within a segment
        if slot is not None:
            return slot
        b = h.base
        tid = h.id if b is None else b.id
        base = self.base
        if base is not None and 0 <= tid - base <= self.max_off:
            kind, index = SlotKind.OUT, tid - base
            exts = self._out_exts
        else:
            index = self.ext_index.get(tid)
            if index is None:  # a new input: listed first, so an interrupt can only renumber
                ids = self.ext_ids
                ids.append(tid)
                index = len(ids) - 1
                self.ext_index[tid] = index
            kind = SlotKind.INPUT
            exts = self._in_exts
        if b is not None:
            slot = slot_view_ext(kind, index, h.ext.data[8:])
        else:
            while len(exts) <= index:
                exts.append(slot_ext(kind, len(exts)))
            slot = exts[index]
        self._slots[h.ext] = slot
        return slot

    def _rel(self, msg: tuple) -> bytes:
        if len(msg) == 5:
            return self._pack((msg[1], msg[2], msg[3]))
        return self._pack((msg[1], msg[2], msg[3], msg[5]))

    def _offsets(self, outs: list) -> tuple | None:
        """Output ids as offsets from the segment's first (None: an id before it)."""
        offs = []
        for o in outs:
            if o is None:
                offs.append(None)
                continue
            if self.base is None:
                self.base = o
            off = o - self.base
            if off < 0:
                return None
            offs.append(off)
        return tuple(offs)

    # -- the hot path ---------------------------------------------------------------------

    def take(self, msg: tuple) -> bool:
        """Session.post's hook (lock held): True when the message is held for a REPLAY; False
        when it is to be queued as it is (a message of another kind ends the segment)."""
        self.sent = False
        if msg[0] != _RUN:
            if self.mode != IDLE:
                self.end()
            return False
        mode = self.mode
        if mode == PLAIN:
            if self.rec is not None:
                self._record(msg, None)
            return False
        try:
            rel = self._pack((msg[1], msg[2], msg[3]) if len(msg) == 5 else (*msg[1:4], msg[5]))
        except Exception:  # unsendable: the RUN's own encoding raises it on the user's line
            self.cut()
            self.mode, self.rec = PLAIN, None
            return False
        if mode == MATCH:  # the hot path: the template's next op, one output, no parameter
            held = self.held
            ops = self.t.ops
            j = self.a + len(held)
            base = self.base
            if j < len(ops) and base is not None:
                op = ops[j]
                outs = msg[4]
                if (
                    rel == op.rel
                    and len(outs) == 1
                    and len(self.ext_ids) == op.ninputs
                    and not op.mask
                ):
                    o, w = outs[0], op.outs
                    if len(w) == 1 and (o - base == w[0] if o is not None else w[0] is None):
                        if self.session.record_sites:
                            self.held_sites.append(self.session.sites.here())
                        held.append(None)  # the commit
                        self.commits += 1
                        w = w[0]
                        if w is not None and w > self.max_off:
                            self.max_off = w
                        if len(held) >= self.flush_ops:
                            self.cut()
                        return True
            return self._match(msg, rel)
        if mode == IDLE:
            self.segments += 1
            self.device = self.session.wire_device
            group = self.library.candidates(rel, self.device)
            if group:
                self.mode, self.t = MATCH, group[0]
            elif self.segments >= self._quiet_until:
                self.mode, self.rec = RECORD, []
            else:
                self.mode = PLAIN
                return False
        if self.mode == MATCH:
            return self._match(msg, rel)
        self._record(msg, rel)
        return False

    def _fits(self, op: OpRec, msg: tuple, rel: bytes) -> bool:
        if not (rel == op.rel or (op.mask and op.same(rel))):
            return False
        if len(self.ext_ids) != op.ninputs:
            return False
        outs = msg[4]
        want = op.outs
        if len(outs) != len(want):
            return False
        base = self.base
        for o, w in zip(outs, want):
            if o is None or w is None:
                if o is not w:
                    return False
            elif base is None:
                if w != 0:
                    return False
                self.base = base = o
            elif o - base != w:
                return False
        return True

    def _match(self, msg: tuple, rel: bytes) -> bool:
        t = self.t
        j = self.a + len(self.held)
        if j >= len(t.ops) or not self._fits(t.ops[j], msg, rel):
            for u in self.library.switch(t, j):  # a template sharing what was held goes on
                if self._fits(u.ops[j], msg, rel):
                    self.t = t = u
                    break
            else:
                self._diverge(msg, rel, j)
                return False
        op = t.ops[j]
        if self.session.record_sites:
            self.held_sites.append(self.session.sites.here())
        self.held.append(op.params(rel) if op.mask else None)  # the commit
        self.commits += 1
        for w in op.outs:
            if w is not None and w > self.max_off:
                self.max_off = w
        if len(self.held) >= self.flush_ops:
            self.cut()
        return True

    def _diverge(self, msg: tuple, rel: bytes, j: int) -> None:
        """An op differs from the template: what matched goes out, then RUNs (recorded)."""
        self.cut()
        self.fallbacks += 1
        t = self.t
        self.mode = PLAIN
        self.rec = list(t.ops[:j]) if self.segments >= self._quiet_until else None
        if self.rec is not None:
            self._record(msg, rel)

    def _record(self, msg: tuple, rel: bytes | None) -> None:
        rec = self.rec
        try:
            if rel is None:
                rel = self._rel(msg)
            offs = self._offsets(msg[4])
        except Exception:
            offs = None
        if offs is None or len(rec) >= MAX_SEQUENCE_OPS:
            self.mode, self.rec = PLAIN, None  # too long or odd to learn: the rest goes as it is
            return
        rec.append(OpRec(rel, offs, len(self.ext_ids)))
        for w in offs:
            if w is not None and w > self.max_off:
                self.max_off = w

    # -- sending --------------------------------------------------------------------------

    def cut(self) -> None:
        """Queue the held ops (lock held): one REPLAY, after the DEFINE if the server lacks it.
        The queue goes out once the REPLAYs queued since the last frame hold `flush_ops` ops,
        the cadence of a queue of as many RUNs; until then the queue's own rules send it (a
        wait, a full batch, the quiet-flush thread). A frame per cut cost the client and the
        server about what the replayed ops saved: most cuts come before the FREEs of a step's
        activations, and a Llama training step went out in ~28 frames instead of ~4."""
        held = self.held
        if not held:
            return
        t = self.t
        a = self.a
        j = a + len(held)
        need = t.ops[j - 1].ninputs
        inputs = self.ext_ids[self.inputs_sent : need]
        params = [x for p in held if p for x in p]
        sites = self.held_sites[: len(held)]
        self.held = []  # first: an interrupt from here on loses these ops, never sends them twice
        self.held_sites = []
        self.a = j
        self.inputs_sent = need
        if len(inputs) != need - (t.ops[a - 1].ninputs if a else 0) or len(params) != sum(
            len(op.mask) for op in t.ops[a:j]
        ):  # bookkeeping an interrupt broke: those ops are lost (as interrupted RUNs are)
            self.mode, self.rec = PLAIN, None
            return
        sess = self.session
        if not t.defined:
            define = t.define_message()
            sess.queue_locked(define)
            t.defined = True  # after: a DEFINE sent twice is harmless, a missing one is not
            self.defines += 1
        sites = sites if sess.record_sites and len(sites) == len(held) else None
        sess.queue_locked((_REPLAY, t.slot, a, j, self.base or 0, inputs, params), sites=sites)
        if sess.frames != self._frames:  # a frame went out since: it took the earlier REPLAYs
            self._frames, self.unsent_ops = sess.frames, 0
        self.unsent_ops += j - a
        if self.unsent_ops >= self.flush_ops:
            sess.flush_locked()
            self._frames, self.unsent_ops = sess.frames, 0
        self.replayed_ops += j - a
        self.sent = True
        self.library.used(t)

    def end(self) -> None:
        """The segment ends (lock held): send what is held; learn from what was recorded."""
        mode = self.mode
        if mode == IDLE:
            return
        if mode == MATCH:
            self.cut()
            self._barren = 0
            self._backoff = 0
        elif self.rec is not None and len(self.rec) >= MIN_OPS:
            if self.library.learn(self.rec, self.device):
                self._barren = self._backoff = 0
            else:
                self._barren += 1
                if self._barren >= BARREN_LIMIT:  # nothing repeats: record less often
                    self._barren = 0
                    self._backoff = min(max(2 * self._backoff, 1), MAX_BACKOFF)
                    self._quiet_until = self.segments + self._backoff
        self._reset()

    def mark(self) -> None:
        """A step ended (an optimizer's `step()` returned): so does the segment."""
        if self.mode != IDLE:
            with self.session.lock:
                self.end()

    def offer(self, msg: tuple) -> bool:
        """`take`, except that a bug in it turns replaying off (`failed`) instead of costing
        the user's op; the connection's errors pass, as a RUN would have met them."""
        commits = self.commits
        try:
            return self.take(msg)
        except RgpuError:
            raise
        except Exception as e:
            return self.failed(e, commits)

    def failed(self, exc: BaseException, commits: int) -> bool:
        """`take` raised (a bug here, not the user's: `commits` is `self.commits` before it):
        turn replaying off for this session and send what is held; the ops after it go as RUNs.
        True when the op itself was held (and so is sent now). If what is held cannot be sent,
        the session is marked broken: ops lost without an error would be wrong numbers."""
        log.warning("rgpu: replayed steps turned off for this session after an internal error "
                    "(%r); every op goes as it is from here", exc)  # fmt: skip
        self.on = False
        try:
            self.end()
        except Exception as e:
            self.held = []
            self._reset()
            self.session.mark_broken(RgpuError(
                f"rgpu lost ops it held for a replayed step ({e!r}); this session's results can "
                "no longer be trusted. Call rgpu.connect() again, with RGPU_REPLAY=0, and please "
                "report this."))  # fmt: skip
            self.session.check_usable()
        return self.commits != commits

    def set_enabled(self, on: bool) -> None:
        """Turn replaying on or off (`rgpu.settings.replay`); what is held goes out first."""
        with self.session.lock:
            if not on:
                self.end()
            self.on = on


_REPLAYERS: weakref.WeakSet = weakref.WeakSet()  # every session's, for the optimizer hook
_watching = False


def _watch_optimizers() -> None:
    """An optimizer's `step()` ends a training step, so it ends the segment too: a loop that
    never waits (the advice: read the loss every N steps) still repeats segment by segment.
    One hook for every optimizer (torch's global step hook), added with the first session."""
    global _watching
    if not _watching:
        _watching = True
        from torch.optim.optimizer import register_optimizer_step_post_hook  # torch is up now

        register_optimizer_step_post_hook(_step_done)


def _step_done(optimizer: Any, args: Any, kwargs: Any) -> None:
    for replayer in list(_REPLAYERS):
        if replayer.on:
            replayer.mark()
