"""rgpu-server: runs the tensors and kernels of remote `device="rgpu"` clients on this host.

It speaks the wire contract of `rgpu_protocol` and never imports the client package `rgpu`.
"""

__version__ = "0.1.0"
