"""Hugging Face `generate()` on rgpu without a round trip per token.

transformers' decode loop (`GenerationMixin._sample`) asks after every token whether every
sequence has finished, `bool(unfinished.max() == 0)`: a read of a device value, so on rgpu one
round trip per token, 50 ms per token over a 50 ms link. transformers already lets that check be
answered late and undone (its `DeferredStopCheck`, one step late, used on MPS). On rgpu the check
here reads each step's answer without waiting, keeps decoding while up to `lookahead` answers
are on their way, and when one says "everything had finished at step t" it has the loop undo the
steps decoded after t: `generate` cuts the tokens and scores back, the returned cache is cropped,
and the server's generator is set back to its state after step t. What the caller gets — tokens,
scores, cache, and the random numbers drawn afterwards — is what a loop checking every step gives.

The price: when every sequence ends on an EOS token, up to `lookahead` forward passes run past the
end (none when generation stops at max_new_tokens, which is known without a read), and each step
sends two small requests (its stop answer and the generator's state). `rgpu.settings.
generate_lookahead = 0` (or RGPU_GENERATE_LOOKAHEAD=0) restores the wait per token.

transformers is not imported by rgpu: the loop is adapted when the user's program imports it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from rgpu_protocol import Kind

from . import devices as _devices
from .import_hooks import after_import
from .progress import settings
from .tensor import DEVICE_TYPE

TARGET = "transformers.generation.utils"


class LookaheadStopCheck:
    """transformers' stop check for rgpu tensors: answers read up to `lookahead` steps late.

    Called once per decoded token with the loop's `unfinished_sequences`, that step's tokens and
    the sequence length; returns whether to stop. `finish` says how many steps to undo."""

    def __init__(
        self,
        session: Any,
        max_length: int | None,
        cache: Any,
        streamer: Any,
        lookahead: int,
        device: int | None = None,
    ) -> None:
        self.session = session
        self.device = device  # the generator read and set back: the one of the tokens' device
        self.max_length = max_length
        self.cache = cache  # the cache generate returns, cut back on undo; None if it drops it
        self.streamer = streamer
        self.lookahead = lookahead
        self.steps = 0
        self.stop_step: int | None = None  # the first step after which every sequence was done
        self.state_at_stop: bytes | None = None
        self.pending: deque[tuple[int, Any, torch.Tensor, Any]] = deque()

    def __call__(
        self, unfinished_sequences: torch.Tensor, tokens: torch.Tensor, length: int
    ) -> bool:
        self.steps += 1
        # the generator's state after this step first: once the answer below has arrived, so has
        # it (the answer's request sends both)
        state = self.session.request_async(
            (Kind.RNG_GET,), detached=True, device=self.device, send=False
        )
        answer = unfinished_sequences.max().view(1)
        if self.streamer is not None:
            answer = torch.cat([answer.to(tokens.dtype), tokens.reshape(-1)])
        target, waiter = self.session.download_later(answer)
        self.pending.append((self.steps, state, target, waiter))
        self._read(wait=len(self.pending) > self.lookahead)
        if self.stop_step is not None:
            return True
        return self.max_length is not None and length >= self.max_length

    def finish(self) -> int:
        """The loop has ended: read the answers still on their way (one wait), then the number of
        steps `generate` must undo."""
        if self.stop_step is None and self.pending:
            self.session.wait_for(self.pending[-1][3])  # replies come in order: all are here
            self._read(wait=False)
        self.pending.clear()
        if self.stop_step is None:
            return 0
        undo = self.steps - self.stop_step
        if undo:
            if self.cache is not None:
                self.cache.crop(-undo)
            self.session.post((Kind.RNG_SET, self.state_at_stop), device=self.device)
        return undo

    def _read(self, wait: bool) -> None:
        """Take the answers that have arrived (and, with `wait`, the oldest one in any case)."""
        while self.pending and self.stop_step is None:
            step, state, target, waiter = self.pending[0]
            if not (wait or waiter.event.is_set()):
                return
            wait = False
            self.session.wait_for(waiter)  # one wait if it has not arrived; raises a failure
            self.pending.popleft()
            if self.streamer is not None:
                self.streamer.put(target[1:].clone())
            if int(target[0]) == 0:
                self.stop_step = step
                self.state_at_stop = self.session.wait_for(state)
                self.pending.clear()


def lookahead_applies(cache: Any, cache_is_returned: bool, is_assistant: bool) -> bool:
    """Whether the stop check may run ahead here: not for an assistant model (its caller crops
    the cache itself), and a cache handed back to the caller must be one that `crop(-n)` cuts
    back exactly after n steps (full-attention layers; sliding-window and recurrent layers
    forget what an undo would need). No cache after the prefill does not mean the model keeps
    none: RWKV and RecurrentGemma keep their state under other names, out of reach of an undo,
    so when the caller gets it back the loop checks every step."""
    if settings.generate_lookahead <= 0 or is_assistant:
        return False
    if not cache_is_returned:
        return True
    if cache is None:
        return False
    inner = getattr(cache, "self_attention_cache", cache)
    layers = getattr(inner, "layers", None)
    return (
        bool(getattr(cache, "is_croppable", False))
        and layers is not None
        and not any(
            hasattr(layer, "record_past") or getattr(layer, "is_sliding", False) for layer in layers
        )
    )


def patch(utils: Any) -> bool:
    """Make `utils._sample` use `LookaheadStopCheck` for rgpu tensors (transformers versions
    with a `DeferredStopCheck`); other devices keep transformers' own choice."""
    original = getattr(utils, "DeferredStopCheck", None)
    if original is None or getattr(original, "rgpu_lookahead", False):
        return False

    class DeferredStopCheck(original):  # type: ignore[misc, valid-type]
        __doc__ = original.__doc__
        rgpu_lookahead = True

        @staticmethod
        def is_supported(
            device: Any, cache: Any, cache_is_returned: bool, is_assistant: bool
        ) -> bool:
            if torch.device(device).type == DEVICE_TYPE:
                return lookahead_applies(cache, cache_is_returned, is_assistant)
            return original.is_supported(device, cache, cache_is_returned, is_assistant)

        def __new__(cls, input_ids, max_length, cache, cache_is_returned, streamer=None):  # noqa: ANN001, ANN204
            if input_ids.device.type == DEVICE_TYPE:
                h = input_ids._r  # the session and device the tokens live on
                return LookaheadStopCheck(
                    h.sess, max_length, cache if cache_is_returned else None, streamer,
                    settings.generate_lookahead, _devices.local_index(h) if _devices.MULTI else None,
                )  # fmt: skip
            return super().__new__(cls)

    DeferredStopCheck.__module__ = original.__module__
    DeferredStopCheck.__qualname__ = original.__qualname__
    utils.DeferredStopCheck = DeferredStopCheck
    return True


def install() -> None:
    """Adapt transformers' loop now if it is imported, else as soon as it is."""
    after_import(TARGET, patch)
