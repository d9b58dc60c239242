"""One Slurm job, driven over SSH to the cluster's login node: submit it (with the token on the
SSH session's stdin), watch it start, ask its state, read its output, cancel it.

Every command is one `ssh login sh -c SCRIPT` (the scripts are in rgpu.slurm_target); the ssh
children run in their own process session, so a Ctrl-C in the terminal reaches only Python,
which then cancels the job itself.
"""

from __future__ import annotations

import queue
import secrets
import shlex
import subprocess
import time
from collections.abc import Callable

from .errors import SessionLost
from .slurm_target import (
    JobFailed,
    JobState,
    SlurmError,
    SlurmMissing,
    SlurmRefused,
    SlurmTarget,
    cancel_script,
    job_script,
    parse_state,
    state_command,
    submit_script,
    watch_script,
)
from .ssh_process import INSTALL_HINT, START_TIMEOUT, Output, popen, ssh_base, ssh_error, terminate
from .ssh_target import ServerMissing, SshError

NO_SLURM = (
    "no Slurm on {login}: `{command}` is not on the PATH of a non-interactive SSH session there. "
    "Is {login} the cluster's login node? If Slurm's commands need `module load slurm` or a "
    "profile, make them reachable without one (e.g. PATH in ~/.bashrc, above its interactive "
    "check)."
)


class SlurmJob:
    """A job of `target`'s cluster: one it submits (`submit`, cancelled by `cancel`) or one of
    the user's that it only uses (`target.job`, never cancelled)."""

    def __init__(self, target: SlurmTarget, timeout: float) -> None:
        self.target = target
        self.login = target.login.destination
        self.timeout = timeout
        self.ssh = ssh_base(target.login, timeout)
        self.id: str | None = target.job
        self.owned = False  # submitted here (or being submitted): cancelled at the end
        self.name = secrets.token_hex(6)  # the job is rgpu-NAME, in directory WORKDIR/NAME
        self.directory: str | None = None  # the job directory on the shared home
        self.last = JobState("PENDING")
        self.last_at = 0.0  # when `last` was read (time.monotonic)
        self._watcher: subprocess.Popen | None = None

    def __str__(self) -> str:
        return f"Slurm job {self.id}" if self.id else "the Slurm job"

    def argv(self, script: str) -> list[str]:
        return [*self.ssh, "-T", "-o", "ClearAllForwardings=yes", "--", self.login,
                "sh -c " + shlex.quote(script)]  # fmt: skip

    def run(self, script: str, what: str, stdin: str = "", timeout: float = 60.0) -> tuple:
        """Run `script` on the login node: (status, stdout, stderr). ssh's own failure (255)
        raises the SSH error that names it."""
        p = popen(self.argv(script), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        try:
            out, err = p.communicate(stdin.encode(), timeout=self.timeout + timeout)
        except BaseException:  # a timeout, or Ctrl-C
            terminate(p)
            raise
        out, err = out.decode(errors="replace"), err.decode(errors="replace")
        if p.returncode == 255:
            raise ssh_error(self.login, 255, err, what)
        return p.returncode, out, err

    # -- submitting and watching -------------------------------------------------------------

    def submit(self, token: str, idle: float) -> str:
        """Submit the job: its directory (0700) and token file (0600) on the shared home, then
        `sbatch` with the job script on stdin. Returns the job id."""
        name = self.name
        self.owned = True  # a Ctrl-C from here on cancels by name
        rc, out, err = self.run(
            submit_script(self.target, name),
            "submitting the job",
            stdin=token + "\n" + job_script(self.target, idle),
        )
        lines = out.splitlines()
        if "RGPU_NO_SLURM" in lines:
            self.owned = False
            raise SlurmMissing(NO_SLURM.format(login=self.login, command="sbatch"))
        for line in lines:
            if line.startswith("RGPU_DIR="):
                self.directory = line.split("=", 1)[1]
        said = err.strip() or out.strip() or f"status {rc}"
        if self.directory is None:
            self.owned = False
            raise SlurmError(
                f"could not make the job directory {self.target.workdir}/{name} on {self.login} "
                f"({said}). Set workdir= to a directory under your home that the compute nodes "
                "also see."
            )
        if rc != 0:
            self.owned = False  # the script removed the directory
            raise SlurmRefused(
                f"sbatch on {self.login} refused the job ({said}). Check the partition, gres, "
                f"time and account against `sinfo` and your site's limits; sbatch was given: "
                f"{shlex.join(self.target.sbatch_args()) or '(no options)'}"
            )
        job = lines[-1].split(";")[0].strip() if lines else ""
        if not job.isdigit():
            raise SlurmError(f"sbatch on {self.login} printed no job id: {out.strip()!r}")
        self.id = job
        return job

    def watch(
        self, on_state: Callable[[JobState], None], tick: Callable[[], None] = lambda: None
    ) -> tuple[str, int]:
        """Follow the job until its rgpu-server listens: (node, port). `on_state` gets every new
        squeue line, `tick` is called every second meanwhile. A job that ends first raises with the tail of its output; one that runs but
        whose server does not listen within START_TIMEOUT is given up on."""
        assert self.id is not None
        lines: queue.Queue = queue.Queue()
        p = popen(self.argv(watch_script(self.id, self.directory)), stdin=subprocess.DEVNULL,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        self._watcher = p
        stdout, stderr = Output(p.stdout, lines), Output(p.stderr)
        said: dict[str, str] = {}
        running_since: float | None = None
        try:
            while True:
                try:
                    line = lines.get(timeout=1.0)
                except queue.Empty:
                    tick()
                    if running_since and time.monotonic() - running_since > START_TIMEOUT:
                        raise JobFailed(
                            f"{self} runs on {self.last.node}, but its rgpu-server did not listen "
                            f"within {START_TIMEOUT:.0f} s. Its output so far:\n{self.tail()}"
                        ) from None
                    continue
                if line is None:
                    break
                if line.startswith("STATE|"):
                    self.last, self.last_at = parse_state(line[6:]), time.monotonic()
                    if self.last.state == "RUNNING" and running_since is None:
                        running_since = time.monotonic()
                    on_state(self.last)
                elif line.startswith("RGPU_"):
                    key, _, value = line.partition("=")
                    said[key] = value
                    if key == "RGPU_SERVER":
                        node = said.get("RGPU_NODE") or self.last.node
                        return node, int(value.rsplit(":", 1)[1].strip("/"))
                elif line == "ENDED":
                    raise self.failure(stdout.text(wait=5).split("ENDED", 1)[-1].strip())
        finally:
            self._watcher = None
            terminate(p)
        if p.returncode == 255:
            raise ssh_error(self.login, 255, stderr.text(wait=2), f"watching {self}")
        raise SlurmError(f"watching {self} on {self.login} stopped: {stderr.text(wait=2)}")

    def failure(self, tail: str) -> SlurmError:
        """The error for a job that ended before its server listened."""
        state = self.last
        if "RGPU_NO_SERVER" in tail or (self.target.server_command and "not found" in tail):
            import torch

            hint = INSTALL_HINT.format(
                torch=".".join(torch.__version__.split(".")[:2]), dest=self.login
            ).replace("ssh://", "slurm://")
            node = state.node or "its node"
            if self.target.server_command:
                what = f"`{self.target.server_command}` was not found on {node}"
            else:
                what = (f"neither `rgpu-server` nor a python with the rgpu_server module is on "
                        f"the PATH the job inherits from a non-interactive SSH session on "
                        f"{self.login}")  # fmt: skip
            return ServerMissing(
                f"{self} found no rgpu-server: {what}. {hint}\nIts output:\n{tail}"
            )
        return JobFailed(
            f"{self} ended ({state.describe()}) before its rgpu-server listened. The end of its "
            f"output ({self.directory}/job.out):\n{tail or '(nothing)'}"
        )

    # -- while the session lives -------------------------------------------------------------

    def state(self) -> JobState:
        """The job's state now (one squeue over SSH)."""
        assert self.id is not None
        check = "command -v squeue >/dev/null 2>&1 || { echo RGPU_NO_SLURM; exit 127; }; "
        rc, out, _ = self.run(check + state_command(self.id), f"asking Slurm about {self}")
        if rc == 127 and "RGPU_NO_SLURM" in out:
            raise SlurmMissing(NO_SLURM.format(login=self.login, command="squeue"))
        self.last, self.last_at = parse_state(out.splitlines()[0] if out else ""), time.monotonic()
        return self.last

    def tail(self, lines: int = 20) -> str:
        """The end of the job's output file (empty for a job rgpu did not submit)."""
        if not self.directory:
            return ""
        try:
            path = shlex.quote(f"{self.directory}/job.out")
            return self.run(f"tail -n {lines} {path}", f"reading the output of {self}")[1].strip()
        except (SshError, subprocess.TimeoutExpired):
            return ""

    def lost(self, state: JobState) -> SessionLost:
        """The error for a session whose job ended under it, in Slurm's words."""
        tail = "\n".join(ln for ln in self.tail(8).splitlines() if "RGPU_" not in ln)
        return SessionLost(
            f"{self} on {state.node or self.last.node} ended ({state.describe()}): this session "
            "and every rgpu tensor in it are gone. Call rgpu.connect() to start a new one."
            + (f" The end of its output:\n{tail}" if tail else "")
        )

    def cancel(self) -> None:
        """scancel a job submitted here and remove its directory; stop a watch. Best effort:
        a login node that cannot be reached now leaves the job to its server's idle exit."""
        watcher = self._watcher
        if watcher is not None:
            terminate(watcher)
        if not self.owned:
            return
        self.owned = False
        try:
            script = cancel_script(self.id, self.name, self.directory)
            self.run(script, f"cancelling {self}", timeout=20)
        except (SshError, subprocess.TimeoutExpired, OSError):
            pass
