"""`slurm://` URLs and the text sent to a Slurm login node: what a job asks for, the scripts that
submit it, run rgpu-server in it and watch it, and the errors a cluster can give. No I/O here.

The scripts are POSIX sh run on the login node over SSH (`sh -c`); every value from the user is
quoted with `shlex.quote`, so none of it is read by a shell as code.
"""

from __future__ import annotations

import os
import re
import shlex
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConnectError
from .ssh_process import SSH_SERVER_ARGS, launch_script
from .ssh_target import SshTarget, parse_port, split_netloc


class SlurmError(ConnectError):
    """The cluster could not give rgpu a GPU (the message says what Slurm said and what to do)."""


class SlurmMissing(SlurmError):
    """No Slurm commands (`sbatch`, `squeue`) on the login node."""


class SlurmRefused(SlurmError):
    """`sbatch` refused the request (a bad partition, account, gres, time limit...)."""


class JobFailed(SlurmError):
    """The job ended before its rgpu-server listened (the message has the tail of its output)."""


class NodeUnreachable(SlurmError):
    """The job's node could not be reached over SSH through the login node."""


@dataclass(frozen=True)
class JobState:
    """One line of `squeue` about a job."""

    # PENDING, RUNNING, CANCELLED, TIMEOUT, ...; "" when Slurm no longer knows the job; "?"
    # when squeue failed (a busy or restarting controller: not a reason to give up on the job)
    state: str
    reason: str = ""  # why it pends or ended (Slurm's words: Resources, Priority, TimeLimit...)
    node: str = ""
    time_left: float | None = None  # seconds until the time limit; None: no limit or unknown
    said: str = ""  # what squeue printed instead, for "?"

    LIVE = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
            "REQUEUE_FED", "RESIZING", "STOPPED", "?")  # fmt: skip

    @property
    def ended(self) -> bool:
        return self.state not in self.LIVE

    def describe(self) -> str:
        if self.state == "RUNNING":
            return f"RUNNING on {self.node}"
        if self.state == "?":
            return f"unknown (squeue said: {self.said})"
        if not self.state:
            return "no longer known to Slurm (it ended)"
        reason = self.reason if self.reason and self.reason != "None" else ""
        return f"{self.state} ({reason})" if reason else self.state


STATE_FORMAT = "%T|%r|%N|%L"  # squeue -o: state, reason, nodes, time left


GONE = "Invalid job id"  # squeue's words for a job it no longer knows


def parse_state(line: str) -> JobState:
    """A `squeue -h -o STATE_FORMAT` line. Nothing, or "Invalid job id", is a job Slurm no
    longer knows; any other error is an unknown state."""
    line = line.strip()
    parts = line.split("|")
    if len(parts) == 4 and re.fullmatch(r"[A-Z_]+", parts[0]):
        return JobState(parts[0], parts[1], parts[2], parse_duration(parts[3]))
    if not line or GONE in line:
        return JobState("")
    return JobState("?", said=line[-200:])


def parse_duration(text: str) -> float | None:
    """Slurm's [days-][hours:]minutes:seconds as seconds; UNLIMITED, NOT_SET, INVALID: None."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        return None
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if c is not None:
        h, mnt, s = a, b, c
    elif b is not None:
        h, mnt, s = (a, b, 0) if days is not None else (0, a, b)
    else:
        h, mnt, s = (a, 0, 0) if days is not None else (0, a, 0)
    return float((days or 0) * 86400 + h * 3600 + mnt * 60 + s)


# sbatch options: URL name -> sbatch flag
SBATCH_FLAGS = {
    "partition": "--partition", "gres": "--gres", "gpus": "--gpus", "cpus": "--cpus-per-task",
    "mem": "--mem", "time": "--time", "account": "--account", "qos": "--qos",
    "constraint": "--constraint",
}  # fmt: skip
# extra sbatch arguments that would break how rgpu runs the job
REFUSED_SBATCH = ("-o", "--output", "-e", "--error", "-D", "--chdir", "--wrap", "-a", "--array",
                  "--parsable")  # fmt: skip


@dataclass
class SlurmTarget:
    """A Slurm cluster reached over SSH, and the job to ask it for."""

    login: SshTarget  # the login node; its ssh_port, identity and ssh_command apply to every hop
    partition: str | None = None
    gres: str | None = None
    gpus: str | None = None
    cpus: str | None = None
    mem: str | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    sbatch: tuple[str, ...] = ()  # more sbatch arguments
    server_command: str | None = None  # how the job runs rgpu-server (default: found on PATH)
    device: str | None = None  # --device of that server (default: cuda when the node has one)
    job: str | None = None  # a running job of yours to start the server in (not cancelled)
    idle: float | None = None  # seconds unused before the server stops (None: config default)
    workdir: str = ".rgpu/slurm"  # on the login node, relative to home; nodes must see it
    token: str | None = field(default=None, repr=False)

    def sbatch_args(self) -> list[str]:
        args = [f"{flag}={getattr(self, name)}" for name, flag in SBATCH_FLAGS.items()
                if getattr(self, name) is not None]  # fmt: skip
        return args + list(self.sbatch)


_OPTIONS = [*SBATCH_FLAGS, "sbatch", "server_command", "device", "job", "idle", "workdir",
            "identity", "ssh_command"]  # fmt: skip


def parse_slurm_url(url: str, options: Mapping[str, Any] | None = None) -> SlurmTarget:
    """``slurm://[user@]login[:sshport]?partition=gpu&gres=gpu:1&time=02:00:00&...`` and keyword
    options (which win over the query) as a `SlurmTarget`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "slurm":
        raise ConnectError(f"not a slurm:// URL: {url}")
    destination, port_text = split_netloc(parts.netloc, url, "slurm")
    values: dict[str, Any] = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    values.update({k: v for k, v in (options or {}).items() if v is not None})
    unknown = sorted(set(values) - set(_OPTIONS))
    if unknown:
        raise ConnectError(
            f"unknown slurm option(s) {', '.join(unknown)} for {url}; known: {', '.join(_OPTIONS)}"
        )
    identity = values.pop("identity", None)
    login = SshTarget(
        destination=destination,
        ssh_port=parse_port("ssh port", port_text, url) if port_text else None,
        identity=os.path.expanduser(str(identity)) if identity else None,
        ssh_command=values.pop("ssh_command", None),
    )
    for name in (*SBATCH_FLAGS, "server_command", "device", "workdir"):
        if name in values:
            values[name] = str(values[name]).strip()
            if not values[name]:
                raise ConnectError(f"{name} is empty in {url}: give it a value or leave it out")
    if "cpus" in values and not values["cpus"].isdigit():
        raise ConnectError(f"cpus must be a whole number, not {values['cpus']!r} ({url})")
    if "job" in values:
        values["job"] = str(values["job"]).strip()
        if not re.fullmatch(r"\d+(_\d+)?", values["job"]):
            raise ConnectError(f"job must be a Slurm job id such as 12345, not {values['job']!r}")
    if "idle" in values:
        try:
            values["idle"] = float(values["idle"])
        except (TypeError, ValueError):
            raise ConnectError(f"idle must be seconds, not {values['idle']!r} ({url})") from None
    extra = values.get("sbatch", ())
    extra = tuple(shlex.split(extra) if isinstance(extra, str) else (str(a) for a in extra))
    for arg in extra:
        if arg.split("=", 1)[0] in REFUSED_SBATCH:
            raise ConnectError(
                f"sbatch argument {arg!r} is rgpu's to set (it runs the job with its own output "
                f"file, directory and script); leave it out of {url}"
            )
    values["sbatch"] = extra
    return SlurmTarget(login=login, **values)


# -- the scripts ------------------------------------------------------------------------------


def job_script(target: SlurmTarget, idle: float) -> str:
    """The batch script: rgpu-server on the node's loopback address, a free port, the token read
    from the job directory's token file (removed before the server starts)."""
    # files: the user's home (on a cluster, usually the shared one), as over ssh://
    args = '--host 127.0.0.1 --port 0 --announce --token-stdin --data-dir "home=$HOME"'
    if idle > 0:
        args += f" --idle-exit {idle:g}"
    if target.device:
        args += " --device " + shlex.quote(target.device)
    return (
        "#!/bin/sh\n"
        "# rgpu-server for one rgpu client (rgpu.connect('slurm://...')); rgpu cancels this job\n"
        "# when the client disconnects, and the server stops when its client is gone.\n"
        'if [ ! -r token ]; then echo "RGPU_NO_TOKEN: no token file in $PWD"; exit 1; fi\n'
        "exec 3<token\n"
        "rm -f token\n"
        'echo "RGPU_NODE=${SLURMD_NODENAME:-$(hostname)}"\n'
        f"{launch_script(target.server_command, args + ' <&3 3<&-')}\n"
    )


def submit_script(target: SlurmTarget, name: str) -> str:
    """Run by `sh -c` on the login node with the token, then the job script, on stdin: makes the
    job directory (0700), writes the token file (0600) and submits the job from there."""
    parent = target.workdir.rstrip("/") or "/"
    workdir = shlex.quote(f"{parent.rstrip('/')}/{name}")
    sbatch = shlex.join(["sbatch", "--parsable", f"--job-name=rgpu-{name}", "--no-requeue",
                         *target.sbatch_args()])  # fmt: skip
    return (
        "command -v sbatch >/dev/null 2>&1 || { echo RGPU_NO_SLURM; exit 127; }\n"
        "umask 077\n"
        f"mkdir -p {shlex.quote(parent)} && mkdir {workdir} && cd {workdir} || exit 1\n"
        "d=$PWD\n"
        "IFS= read -r t || exit 1\n"
        "printf '%s\\n' \"$t\" > token\n"
        "t=\n"
        'echo "RGPU_DIR=$PWD"\n'
        f'{sbatch} --output="$d/job.out" || {{ rc=$?; cd / && rm -rf "$d"; exit $rc; }}\n'
    )


def watch_script(job: str, directory: str | None) -> str:
    """Run on the login node while a job starts: prints ``STATE|...`` whenever squeue's line
    changes, and ends with ``RGPU_SERVER=...`` (the server listens; ``RGPU_NODE=`` before it)
    or ``ENDED`` and the tail of the job's output (a squeue error is shown, not taken for the
    job's end). squeue runs every 0.5 s for the first 10 s,
    then every 5 s, so a long queue does not load the controller."""
    out = shlex.quote(f"{directory}/job.out") if directory else "/dev/null"
    live = "|".join(f"{s}'|'*" for s in JobState.LIVE if s != "?")
    return (
        f"job={shlex.quote(job)}; out={out}; last=; i=0\n"
        "while :; do\n"
        '  ready=; [ -f "$out" ] && grep -q \'^RGPU_SERVER=\' "$out" && ready=1\n'
        '  if [ -n "$ready" ] || [ $i -lt 20 ] || [ $((i % 10)) -eq 0 ]; then\n'
        f"    s=$(squeue --states=all -h -j \"$job\" -o '{STATE_FORMAT}' 2>&1 | head -n 1)\n"
        '    [ "$s" = "$last" ] || { echo "STATE|$s"; last=$s; }\n'
        "  fi\n"
        '  if [ -n "$ready" ]; then grep -E \'^RGPU_(NODE|SERVER)=\' "$out"; exit 0; fi\n'
        f'  case "$last" in {live}) ;; ""|*"{GONE}"*|[A-Z]*"|"*)\n'
        '    echo ENDED; tail -n 30 "$out" 2>/dev/null; exit 0;;\n'
        "  esac\n"
        "  i=$((i + 1)); sleep 0.5 2>/dev/null || sleep 1\n"
        "done\n"
    )


def state_command(job: str) -> str:
    return f"squeue --states=all -h -j {shlex.quote(job)} -o '{STATE_FORMAT}' 2>&1 | head -n 1"


def cancel_script(job: str | None, name: str, directory: str | None) -> str:
    """scancel (by name when the id never came back: Ctrl-C during sbatch), and the job
    directory removed (its token file is gone already if the job ran)."""
    if job:
        script = f"scancel {shlex.quote(job)}"
    else:
        script = f'scancel --name={shlex.quote("rgpu-" + name)} --user="$(id -un)"'
    if directory:
        script += f"; rm -rf {shlex.quote(directory)}"
    return script


def step_command(target: SlurmTarget, job: str) -> str:
    """The login node's command line that starts rgpu-server as a step of a running job of the
    user's (`srun --overlap`); the token follows on stdin, and the step ends with the SSH session."""
    args = SSH_SERVER_ARGS + ' --data-dir "home=$HOME"'
    if target.device:
        args += " --device " + shlex.quote(target.device)
    srun = ["srun", f"--jobid={job}", "--overlap", "-N1", "-n1", "--quiet"]
    srun += [f"{SBATCH_FLAGS[k]}={getattr(target, k)}" for k in ("gres", "gpus")
             if getattr(target, k)]  # fmt: skip
    script = 'echo "RGPU_NODE=$SLURMD_NODENAME"; ' + launch_script(target.server_command, args)
    return f"exec {shlex.join(srun)} sh -c {shlex.quote(script)}"
