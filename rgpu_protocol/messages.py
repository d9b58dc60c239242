"""Messages: their kinds, the shape of each kind, and the facts both ends must agree on.

A *message* is a msgpack array whose first item is its kind. `SPECS` says, for every kind, which
fields follow and of which types (as decoded); the server checks each message against it before
running it (`check_message`), and the client builds only messages of these shapes. Everything
else that both ends must agree on about message contents lives here too, written once: the
largest number of outputs of a data-dependent op, the seed of a fresh session, the form of a
download answered on the bulk lane, the tags of a shipped graph's nodes, and which arguments of
an operator it writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from .errors import ProtocolError

MAX_DYNAMIC_OUTPUTS = 4096  # values one RUN_DYN may return; the client reserves this many ids
MAX_TREE_TENSORS = 1 << 20  # tensors one LOAD may make; the client reserves this many ids
DEFAULT_SEED = 67280421310721  # torch's own default seed: a fresh session acts like a new process
MAX_SEQUENCES = 64  # sequence slots (DEFINE) one session holds: slot numbers 0 .. 63
MAX_SEQUENCE_OPS = 16384  # ops in one defined sequence...
MAX_SEQUENCE_TOTAL_OPS = 4 * MAX_SEQUENCE_OPS  # ...and in all of a session's sequences together


class Kind(IntEnum):
    """Message kinds. Waited kinds get exactly one REPLY; the others get none."""

    RUN = 1
    RUN_DYN = 2
    UPLOAD = 3
    DOWNLOAD = 4
    FREE = 5
    SEED = 6
    SYNC = 7
    INFO = 8
    RNG_GET = 9
    RNG_SET = 10
    DEFINE = 11
    REPLAY = 12
    COMPILE = 16
    CALL = 17
    ACK = 18
    LOAD = 20
    SAVE = 21
    LIST_DIR = 22
    STAT = 23
    REMOVE = 24
    READ_BYTES = 25
    WRITE_BYTES = 26
    COMMIT = 27
    KEEP = 28
    KEPT = 29
    FORGET = 30
    SESSIONS = 31
    DROP_SESSION = 32
    DEVICE = 33
    GROUP = 34
    COLLECTIVE = 35
    EXPORT = 36
    IMPORT = 37
    SETTINGS = 38
    GENERATOR = 39
    GENERATOR_STATE = 40


class Status(IntEnum):
    OK = 0
    ERROR = 1  # value: [op_label, message, seq, index?] -- a remote failure; the session carries on
    PROTOCOL = 2  # value: message -- the server could not understand what it got


# -- the shape of each kind -----------------------------------------------------------------------

ANY = object()  # a field decoded by the receiver itself (a tensor reference, an operator name)
_NoneType = type(None)


@dataclass(frozen=True)
class Field:
    name: str
    types: tuple | object  # accepted Python types after decoding, or ANY
    optional: bool = False  # may be left off the end of the message


@dataclass(frozen=True)
class MessageSpec:
    kind: Kind
    fields: tuple[Field, ...]
    waited: bool
    doc: str

    def __post_init__(self) -> None:  # what check_message needs, computed once
        object.__setattr__(self, "min_len", 1 + sum(not f.optional for f in self.fields))
        object.__setattr__(self, "max_len", 1 + len(self.fields))
        typed = tuple((i, f.types) for i, f in enumerate(self.fields, 1) if f.types is not ANY)
        object.__setattr__(self, "typed", typed)

    def usage(self) -> str:
        names = ", ".join(f"{f.name}?" if f.optional else f.name for f in self.fields)
        return f"[{self.kind.name}{', ' if names else ''}{names}]"


def _spec(kind: Kind, waited: bool, doc: str, *fields: Field) -> MessageSpec:
    return MessageSpec(kind, fields, waited, doc)


_OP = Field("op", ANY)  # an operator name, resolved by the server (a bad one fails like an op)
_ARGS = Field("args", (list,))
_KWARGS = Field("kwargs", (dict, _NoneType))
_REF = Field("tensor", ANY)  # a tensor reference (EXT_REF or EXT_VIEW)
_PATH = Field("path", (str,))

SPECS: dict[int, MessageSpec] = {
    s.kind: s
    for s in (
        _spec(Kind.RUN, False, "run an aten op; its outputs get the client's ids",
              _OP, _ARGS, _KWARGS, Field("out_ids", (list,)),
              Field("expect", (list, _NoneType), optional=True)),
        _spec(Kind.RUN_DYN, True, "run an op whose outputs only the data can tell; reply: "
              "output metadata and values, ids from first_id on",
              _OP, _ARGS, _KWARGS, Field("first_id", (int,))),
        _spec(Kind.UPLOAD, False, "bytes into a tensor: inline host data, a chunk header "
              "[dtype, shape, nbytes] (CHUNK frames follow), or a lane header "
              "[dtype, shape, nbytes, ticket]",
              _REF, Field("data", ANY)),
        _spec(Kind.DOWNLOAD, True, "a tensor's bytes; reply: the bytes, their count after DATA "
              "frames, or lane_reply(nbytes)",
              _REF, Field("ticket", (int, _NoneType), optional=True)),
        _spec(Kind.FREE, False, "drop these ids", Field("ids", (list,))),
        _spec(Kind.SEED, False, "seed the session's generators: every device's, or (with a "
              "device index) that device's", Field("seed", (int,)),
              Field("device", (int, _NoneType), optional=True)),
        _spec(Kind.SYNC, True, "reply once everything before ran; value: the server's clock"),
        _spec(Kind.INFO, True, "reply: a map of session and server facts"),
        _spec(Kind.RNG_GET, True, "reply: the session generator's state"),
        _spec(Kind.RNG_SET, False, "set the session generator's state", Field("state", (bytes,))),
        _spec(Kind.DEFINE, False, "keep a sequence of ops in a slot (0 .. MAX_SEQUENCES - 1), "
              "replacing what it held: ops [op, args, kwargs, out offsets, expect], tensors and "
              "varying scalars named by EXT_SLOT values", Field("slot", (int,)),
              Field("ops", (list,))),
        _spec(Kind.REPLAY, False, "run ops [start, stop) of the sequence in a slot as if each "
              "came as a RUN: ids base + offset, the run's inputs (ids, in order of first use; "
              "these ops' new ones), these ops' varying scalars",
              Field("slot", (int,)), Field("start", (int,)), Field("stop", (int,)),
              Field("base", (int,)), Field("inputs", (list,)), Field("params", (list,))),
        _spec(Kind.COMPILE, False, "build (and cache) a shipped graph",
              Field("key", (str,)), Field("nodes", (list,)), Field("compiler", (str,)),
              Field("mode", (str, _NoneType)),
              Field("layouts", (list, _NoneType), optional=True)),
        _spec(Kind.CALL, False, "run a compiled graph",
              Field("key", (str,)), Field("inputs", (list,)), Field("out_ids", (list,))),
        _spec(Kind.ACK, True, "a no-op whose reply confirms everything before it was applied"),
        # files in the server's data directories (paths: "[ROOT:]relative/path")
        _spec(Kind.LOAD, True, "tensors from a file (safetensors, torch, raw, npy) under ids "
              "from first_id on; reply: [tree of tensor metadata and values, file metadata]",
              _PATH, Field("format", (str,)), Field("options", (dict, _NoneType)),
              Field("first_id", (int,))),
        _spec(Kind.SAVE, True, "a tree of tensors and values into a file (safetensors or "
              "torch); reply: its size", _PATH, Field("format", (str,)), Field("tree", ANY),
              Field("metadata", (dict, _NoneType))),
        _spec(Kind.LIST_DIR, True, "reply: [[name, is_dir, size, mtime], ...]", _PATH),
        _spec(Kind.STAT, True, "reply: {size, mtime, is_dir, partial, sha256?}", _PATH,
              Field("hash", (bool,))),
        _spec(Kind.REMOVE, True, "remove a file or an empty directory; reply: bytes freed", _PATH),
        _spec(Kind.READ_BYTES, True, "reply: up to nbytes of a file from offset", _PATH,
              Field("offset", (int,)), Field("nbytes", (int,))),
        _spec(Kind.WRITE_BYTES, False, "bytes into an upload's partial file at offset", _PATH,
              Field("offset", (int,)), Field("data", (bytes,))),
        _spec(Kind.COMMIT, True, "the upload's partial file becomes the file if its size and "
              "SHA-256 match; reply: its size", _PATH, Field("size", (int,)),
              Field("sha256", (bytes,))),
        # named sessions: objects kept for a later client, and this token's sessions
        _spec(Kind.KEEP, True, "keep a tree of tensor references and values under a name, to "
              "be found again by a later client (durable: also on the server's disk); reply: "
              "bytes it holds", Field("name", (str,)), Field("tree", ANY),
              Field("durable", (bool,))),
        _spec(Kind.KEPT, True, "a kept tree, its tensors under ids from first_id on (reply: "
              "[the tree with tensor metadata, each tensor's device index]); or, for a nil "
              "name, the kept names",
              Field("name", (str, _NoneType)), Field("first_id", (int,))),
        _spec(Kind.FORGET, True, "drop a kept name (and its copy on disk)", Field("name", (str,))),
        _spec(Kind.SESSIONS, True, "reply: this token's sessions, as maps"),
        _spec(Kind.DROP_SESSION, True, "end a named session of this token, live or detached",
              Field("name", (str,))),
        # several devices (devices.py): the device later messages run on, collectives, and
        # copies from server to server
        _spec(Kind.DEVICE, False, "later messages run on this device (an index into WELCOME's "
              "devices), until the next DEVICE", Field("index", (int,))),
        _spec(Kind.GROUP, True, "join a collective group as rank of size (every rank's session "
              "sends it; the reply comes once all have joined)", Field("group", (str,)),
              Field("rank", (int,)), Field("size", (int,)), Field("timeout", (float, int))),
        _spec(Kind.COLLECTIVE, False, "run a collective of a joined group on tensors of this "
              "session, with the server's torch.distributed", Field("group", (str,)),
              Field("op", (str,)), Field("tensors", (list,)),
              Field("options", (dict, _NoneType))),
        _spec(Kind.EXPORT, False, "offer a snapshot of a tensor's bytes to one other server, "
              "which fetches it with the capability (peer.py)", _REF,
              Field("capability", (bytes,))),
        _spec(Kind.IMPORT, False, "fetch an exported tensor from another server into a tensor "
              "of this session", _REF, Field("url", (str,)), Field("capability", (bytes,))),
        _spec(Kind.SETTINGS, False, "torch's numeric settings for this session's later "
              "messages: [[name, value], ...] in the order they were set (SETTING_NAMES)",
              Field("settings", (list,))),
        # generators the client made with torch.Generator(device="rgpu") (generators.py)
        _spec(Kind.GENERATOR, False, "seed a generator (an int), set its state (bytes from "
              "GENERATOR_STATE), or drop it (nil)", Field("generator", ANY),
              Field("value", (int, bytes, _NoneType))),
        _spec(Kind.GENERATOR_STATE, True, "reply: a generator's state", Field("generator", ANY)),
    )
}  # fmt: skip

# The process-wide torch settings a client's calls carry to its server (SETTINGS), by name:
# "deterministic" is [mode, warn_only] of torch.use_deterministic_algorithms; the others are
# torch.utils.deterministic.fill_uninitialized_memory, torch.set_float32_matmul_precision's
# argument, and attributes of torch.backends under the path they are set at.
SETTING_NAMES = (
    "deterministic",
    "fill_uninitialized_memory",
    "float32_matmul_precision",
    "backends.fp32_precision",
    *(f"backends.cuda.matmul.{a}" for a in (
        "allow_tf32", "allow_fp16_reduced_precision_reduction",
        "allow_bf16_reduced_precision_reduction", "allow_fp16_accumulation", "fp32_precision",
    )),
    *(f"backends.cudnn.{a}" for a in (
        "enabled", "benchmark", "benchmark_limit", "deterministic", "allow_tf32",
        "fp32_precision", "conv.fp32_precision", "rnn.fp32_precision",
    )),
    *(f"backends.mkldnn.{a}" for a in (
        "enabled", "deterministic", "allow_tf32", "fp32_precision", "matmul.fp32_precision",
        "conv.fp32_precision", "rnn.fp32_precision",
    )),
)  # fmt: skip

WAITED = frozenset(k for k, s in SPECS.items() if s.waited)
# the kinds an interrupt cancels when the server has not started them: the work. (FREE, SEED,
# RNG_SET, UPLOAD and the like still run: they are cheap, and later messages rely on them; so do
# COLLECTIVE, which the other ranks wait for, and EXPORT/IMPORT, which another server waits for.)
CANCELLABLE = frozenset(
    {Kind.RUN, Kind.RUN_DYN, Kind.CALL, Kind.REPLAY, Kind.DOWNLOAD, Kind.LOAD, Kind.SAVE, Kind.SYNC}
)


_CHECKS = {k: (s.min_len, s.max_len, s.typed, s) for k, s in SPECS.items()}  # type: ignore[attr-defined]


def check_message(msg: list) -> MessageSpec:
    """The spec of a decoded message, once its length and field types match it; a
    ProtocolError that names the kind and its form otherwise. (Every message a server runs
    goes through here: it is written for speed.)"""
    check = _CHECKS.get(msg[0])
    if check is None:
        raise ProtocolError(f"unknown message kind {msg[0]}")
    min_len, max_len, typed, spec = check
    n = len(msg)
    if n < min_len or n > max_len:
        raise ProtocolError(f"{spec.kind.name} takes {spec.usage()}, got {n - 1} field(s)")
    for i, types in typed:
        if i < n and type(msg[i]) not in types:
            f = spec.fields[i - 1]
            raise ProtocolError(
                f"{spec.kind.name}'s {f.name} must be "
                + " or ".join("null" if t is _NoneType else t.__name__ for t in types)
                + f", not {type(msg[i]).__name__}"
            )
    return spec


# -- facts about message contents -----------------------------------------------------------------


def lane_reply(nbytes: int) -> list:
    """The value of a DOWNLOAD's reply when its bytes went out on the bulk lane."""
    return ["lane", nbytes]


def lane_reply_bytes(value: Any) -> int | None:
    """The byte count of a lane reply; None when `value` is an ordinary download reply."""
    if type(value) is list and len(value) == 2 and value[0] == "lane" and type(value[1]) is int:
        return value[1]
    return None


class NodeTag:
    """The first item of each node of a shipped graph (COMPILE's `nodes`)."""

    PLACEHOLDER = "p"  # ["p"]: the next input
    CALL = "c"  # ["c", op, args, kwargs]: an aten op over earlier nodes (NodeRef) and constants
    GETITEM = "g"  # ["g", node, i]: item i of an earlier node's result
    OUTPUT = "o"  # ["o", [values]]: the graph's outputs; the last node
    CONSTANT = "k"  # ["k", host tensor]: a small CPU tensor the graph holds (GRAPH_CONSTANT_BYTES)


GRAPH_CONSTANT_BYTES = 64 << 10  # the most a shipped graph's constant tensor may hold


def written_arguments(schema: Any) -> tuple[tuple[int, str], ...]:
    """(position, or -1 when keyword-only; name) of each argument an operator writes: both
    ends must treat these the same (a failed op poisons them; its result aliases them)."""
    return tuple(
        (-1 if a.kwarg_only else i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def written_returns(schema: Any) -> tuple[tuple[int, int, str], ...]:
    """(return index, argument position or -1, argument name) for each return that is a written
    argument itself (in-place and out= ops)."""
    found = []
    for i, r in enumerate(schema.returns):
        if r.alias_info is None or not r.alias_info.is_write:
            continue
        for j, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.before_set == r.alias_info.before_set:
                found.append((i, -1 if a.kwarg_only else j, a.name))
                break
    return tuple(found)


# -- collectives (COLLECTIVE's `op` and options) --------------------------------------------------

# op -> how its `tensors` field is laid out; a failed collective poisons every tensor it names
COLLECTIVE_OPS = {
    "all_reduce": "[tensor, ...]: reduced in place across the ranks",
    "broadcast": "[tensor, ...]: the root rank's values, in place",
    "all_gather": "[[output, ...], input]: output k receives rank k's input",
    "all_gather_into_tensor": "[output, input]: the ranks' inputs concatenated along dim 0",
    "reduce_scatter": "[output, [input, ...]]: output = the reduction of every rank's input r",
    "reduce_scatter_tensor": "[output, input]: output = the reduction of rank r's slice of input",
    "reduce": "[tensor, ...]: the root rank's become the reduction of every rank's, in place",
    "gather": "[[output, ...] (the root; [] elsewhere), input]: output k receives rank k's input",
    "scatter": "[output, [input, ...] (the root; [] elsewhere)]: output = the root's input r",
    "all_to_all_single": "[output, input]: rank r's slice k of input goes to slice r of rank k's "
    "output (options: in_splits, out_splits, empty for equal slices along dim 0)",
    "barrier": "[]: every rank's stream reaches this point before any goes on",
}
REDUCE_OPS = ("sum", "product", "min", "max", "band", "bor", "bxor", "avg")  # options["op"]
