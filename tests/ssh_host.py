"""A real OpenSSH server on a loopback port, for the tests that reach a host over SSH.

Debian's `sshd` with a generated host key and a throwaway user key (`.ci/run` installs
openssh-server); the host is this machine. `start_sshd` writes an sshd_config and a client
config (`ssh -F CONFIG`, what the tests put in RGPU_SSH_COMMAND) with these aliases:
``rgpu-test`` (the key that works), ``rgpu-test-badkey``, ``rgpu-test-strict`` (an empty
known_hosts), plus what a test adds (`client_extra`, formatted with {port}, {dir} and {user}). Sessions get this repo's python on PATH and the
test run's PYTHONPATH, so a server started over SSH runs this tree.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        return True
    except OSError:
        return False


def missing() -> str | None:
    """Why no sshd can run here (None when it can)."""
    if not (os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen")):
        return "OpenSSH server/client not installed (apt-get install openssh-server)"
    return None


class SshHost:
    """A running sshd; `config` is the client config, `port` its port, `dir` its files."""

    def __init__(
        self,
        d: Path,
        *,
        setenv: dict[str, str] | None = None,
        sshd_extra: str = "",
        client_extra: str = "",
        ports: tuple[int, ...] = (),
    ) -> None:
        self.dir, self.user = d, getpass.getuser()
        for name in ("host_key", "user_key", "bad_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True
            )
        (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
        (d / "empty_known_hosts").write_text("")
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir
        self.port = free_port()
        bindir = os.path.dirname(sys.executable)  # this repo's python and its rgpu-server
        env = {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin"}
        if os.environ.get("PYTHONPATH"):  # a test run of another tree: its servers run it too
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env.update(setenv or {})
        listen = "".join(f"Port {p}\n" for p in (self.port, *ports))
        (d / "sshd_config").write_text(
            f"{listen}ListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\nPidFile {d / 'sshd.pid'}\n"
            "StrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nAllowTcpForwarding yes\n"
            "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()) + "\n" + sshd_extra
        )
        self.config = d / "ssh_config"
        self.config.write_text(
            f"Host rgpu-test-badkey\n  IdentityFile {d / 'bad_key'}\n"
            f"Host rgpu-test-strict\n  StrictHostKeyChecking yes\n"
            f"  UserKnownHostsFile {d / 'empty_known_hosts'}\n"
            f"Host rgpu-test rgpu-test-strict\n  IdentityFile {d / 'user_key'}\n"  # (adds up)
            f"Host rgpu-test rgpu-test-*\n  HostName 127.0.0.1\n  Port {self.port}\n"
            f"  User {self.user}\n"
            + client_extra.format(port=self.port, dir=d, user=self.user)
            + "Host *\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
            "  ConnectTimeout 5\n"
        )
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(d / "sshd_config")],
            stdout=subprocess.DEVNULL,
            stderr=open(d / "sshd.log", "wb"),
        )
        deadline = time.time() + 10
        while not accepts(self.port):
            if self.proc.poll() is not None or time.time() > deadline:
                self.proc.kill()
                raise RuntimeError(f"sshd did not start: {(d / 'sshd.log').read_text()[-500:]}")
            time.sleep(0.05)

    @property
    def ssh_command(self) -> str:
        return f"ssh -F {self.config}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
