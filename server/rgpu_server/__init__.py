"""rgpu-server: runs the tensors and kernels of remote `device="rgpu"` clients on this host.

This package is imported before `rgpu.protocol`, which marks the process as a server so that
importing `rgpu` for its wire protocol does not register the rgpu device here.
"""

__version__ = "0.1.0"
