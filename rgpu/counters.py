"""`Counters`: what `rgpu.stats()` reports for a session (docs/architecture.md, "Counters")."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Counters:
    """What `rgpu.stats()` reports (see the README's definitions)."""

    messages: int = 0
    waits: int = 0
    bytes_out: int = 0  # on the wire, after op-stream compression
    bytes_in: int = 0
    frames: int = 0
    wait_seconds: float = 0.0
    reconnects: int = 0
    async_readbacks: int = 0
    dedup_hits: int = 0
    dedup_bytes_saved: int = 0
    compressed_frames: int = 0
    compression_saved: int = 0
    lane_transfers: int = 0
    replayed_ops: int = 0  # RUNs that went out inside REPLAY messages (each REPLAY: 1 message)

    def as_dict(self) -> dict:
        return asdict(self)
