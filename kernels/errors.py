"""The one error type of ``kernels``: malformed input to a reference or a kernel wrapper."""

from __future__ import annotations

from kvown.core.errors import LocalProtocolError


class KernelInputError(LocalProtocolError, ValueError):
    """A kernel or reference was called with a wrong dtype, shape, stride or argument.

    It is a ``ValueError`` (what callers outside kvown expect) and a ``LocalProtocolError`` (the
    caller's bug, in kvown's hierarchy). ``field`` names the argument; the message says what is wrong.
    """
