"""Messages about the session rather than tensors: seeding and reading its generator, syncing
with the device, facts for INFO, and explicit confirmation (ACK)."""

from __future__ import annotations

import time

import torch

from rgpu_protocol import Status

from . import multidevice, rng
from .poison import describe
from .state import SessionState


def seed(s: SessionState, seq: int, msg: list) -> None:
    multidevice.seed(s, msg[1], msg[2] if len(msg) > 2 else None)


def sync(s: SessionState, seq: int, msg: list) -> None:
    if s.error_pending(seq):
        return
    if s.device.type == "cuda":
        torch.cuda.synchronize(s.device)
    elif s.device.type == "mps":
        torch.mps.synchronize()
    # the server's clock once the device is idle: the client's Event.elapsed_time
    s.reply(seq, Status.OK, time.perf_counter())


def info(s: SessionState, seq: int, msg: list) -> None:
    if not s.error_pending(seq):
        value = s.info()
        value["device_bytes"] = multidevice.memory_by_device(s)  # per device index
        s.reply(seq, Status.OK, value)


def rng_get(s: SessionState, seq: int, msg: list) -> None:
    if not s.error_pending(seq):
        s.reply(seq, Status.OK, rng.state_of(s.generator))


def rng_set(s: SessionState, seq: int, msg: list) -> None:
    try:
        rng.set_state(s.generator, msg[1])
    except RuntimeError as e:
        s.fail("set_rng_state", describe(e), ())


def ack(s: SessionState, seq: int, msg: list) -> None:
    if not s.error_pending(seq):
        s.reply(seq, Status.OK, s.last_seq)
