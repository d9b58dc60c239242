"""A process forked after connecting (multiprocessing's default start method on Linux,
DataLoader workers): the session stays the parent's. A child that exited ran rgpu's exit
handlers, which closed the shared connection and ended the parent's session on the server (every
tensor gone); a child that used rgpu waited forever. Now the child forgets the parent's session
and says what to do if it uses the device.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

CODE = """
    import os, sys, time, torch, rgpu
    rgpu.connect(sys.argv[1])
    w = torch.arange(4.0, device="rgpu")
    assert w.sum().item() == 6.0
    pid = os.fork()
    if pid == 0:
        try:
            (w * 2).sum().item()
            print("child used the parent's session")
        except rgpu.RgpuError as e:
            print("child:", "spawn" in str(e) and "forked" in str(e))
        sys.stdout.flush()
        sys.exit(0)  # atexit handlers run, as for any child that returns normally
    os.waitpid(pid, 0)
    time.sleep(0.5)
    print("parent:", (w + 1).sum().item())
"""


def test_a_forked_child_neither_ends_nor_uses_the_parents_session(server):
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CODE), server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "child: True" in lines
    assert lines[-1] == "parent: 10.0"
