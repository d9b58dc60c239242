"""Errors raised by the wire layer. Both ends use them; neither does I/O here."""


class ProtocolError(ValueError):
    """Bytes that do not form a valid rgpu frame or message.

    Raised by decoders on hostile or corrupt input, and by encoders for values the wire cannot
    carry. The receiver answers it with a protocol-error reply or closes that one connection; it
    never crashes the process.
    """


class EncodeError(ProtocolError, TypeError):
    """A value the wire cannot carry (a Generator, an object, an int wider than 64 bits)."""


class LimitExceeded(ProtocolError):
    """A frame or value larger or deeper than the negotiated limits."""
