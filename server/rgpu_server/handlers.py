"""The handler of each message kind: the server's whole dispatch, as one table.

A handler takes the session's state, the message's sequence number and the message, already
checked against its `MessageSpec` (rgpu_protocol.messages).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rgpu_protocol import SPECS, Kind

from . import (
    collectives,
    control,
    execute,
    files,
    generators,
    graph_messages,
    keeping,
    multidevice,
    numerics,
    peers,
    replay,
    transfers,
)
from .state import SessionState

Handler = Callable[[SessionState, int, list], None]

HANDLERS: dict[int, Handler] = {
    Kind.RUN: execute.run,
    Kind.RUN_DYN: execute.run_dynamic,
    Kind.FREE: execute.free,
    Kind.UPLOAD: transfers.upload,
    Kind.DOWNLOAD: transfers.download,
    Kind.SEED: control.seed,
    Kind.SYNC: control.sync,
    Kind.INFO: control.info,
    Kind.RNG_GET: control.rng_get,
    Kind.RNG_SET: control.rng_set,
    Kind.DEFINE: replay.define,
    Kind.REPLAY: replay.replay,
    Kind.ACK: control.ack,
    Kind.COMPILE: graph_messages.compile_graph,
    Kind.CALL: graph_messages.call_graph,
    Kind.LOAD: files.load,
    Kind.SAVE: files.save,
    Kind.LIST_DIR: files.list_dir,
    Kind.STAT: files.stat_path,
    Kind.REMOVE: files.remove,
    Kind.READ_BYTES: files.read_bytes,
    Kind.WRITE_BYTES: files.write_bytes,
    Kind.COMMIT: files.commit,
    Kind.KEEP: keeping.keep,
    Kind.KEPT: keeping.kept,
    Kind.FORGET: keeping.forget,
    Kind.SESSIONS: keeping.sessions,
    Kind.DROP_SESSION: keeping.drop_session,
    Kind.DEVICE: multidevice.device,
    Kind.GROUP: collectives.group,
    Kind.COLLECTIVE: collectives.collective,
    Kind.EXPORT: peers.export,
    Kind.IMPORT: peers.import_,
    Kind.SETTINGS: numerics.settings,
    Kind.GENERATOR: generators.generator,
    Kind.GENERATOR_STATE: generators.state,
}


def cancel_message(s: SessionState, seq: int, spec: Any, msg: list) -> None:
    """An interrupt cancelled this message before it ran (a REPLAY: each of its ops)."""
    if msg[0] == Kind.REPLAY:
        replay.cancel(s, seq, spec, msg)
    else:
        execute.cancel(s, seq, spec, msg)


discard_chunks = transfers.DISCARD  # where the chunks of a replayed, already applied upload go

assert set(HANDLERS) == set(SPECS), "every message kind of the protocol needs a handler"
