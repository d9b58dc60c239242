"""A real one-node Slurm cluster on loopback, for tests/test_slurm.py.

Debian's slurm-wlm (22.05 here) and munge (`.ci/run` installs them): a munged on its own socket,
slurmctld and slurmd as foreground processes this object owns, state, spool and logs in a temp
dir, nothing in /etc touched. The node is named ``rgpu-node`` (slurmd -N), its address is
127.0.0.1 and its CPUs are what `slurmd -C` finds; partitions ``debug`` (default) and ``short``.
In a container without cgroup delegation, the cgroup plugins are off: processes are tracked by
parentage (proctrack/linuxproc), no task containment (task/none), no accounting.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from ssh_host import free_port

NODE = "rgpu-node"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "srun")


def missing() -> str | None:
    """Why no Slurm can run here (None when it can)."""
    absent = [d for d in DAEMONS if not shutil.which(d) and not os.path.exists(f"/usr/sbin/{d}")]
    if absent:
        return f"Slurm/munge not installed ({', '.join(absent)}): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs (these tests start their own cluster)"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """munged + slurmctld + slurmd for one node; `env` is what Slurm's commands need."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []
        munge = d / "munge"
        for sub in ("munge", "state", "spool", "log"):
            (d / sub).mkdir(mode=0o755)
        (munge / "munge.key").write_bytes(os.urandom(1024))
        os.chmod(munge / "munge.key", 0o400)
        self.socket = munge / "munge.socket"
        self._start([_exe("munged"), "-F", "-f", f"--socket={self.socket}",
                     f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                     f"--seed-file={munge / 'munged.seed'}"], "munged")  # fmt: skip
        self._wait(lambda: self.socket.exists(), "munged", 10)
        found = subprocess.run([_exe("slurmd"), "-C"], capture_output=True, text=True).stdout
        hardware = re.sub(r"^NodeName=\S+", "", found.splitlines()[0]).strip()
        memory = int(re.search(r"RealMemory=(\d+)", hardware).group(1))
        hardware = re.sub(r"RealMemory=\d+", f"RealMemory={min(memory, 4000)}", hardware)
        self.conf = d / "slurm.conf"
        self.conf.write_text(
            f"ClusterName=rgputest\nSlurmctldHost=localhost(127.0.0.1)\n"
            f"SlurmctldPort={free_port()}\nSlurmdPort={free_port()}\n"
            "SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={self.socket}\nStateSaveLocation={d / 'state'}\n"
            f"SlurmdSpoolDir={d / 'spool'}\nSlurmctldPidFile={d / 'slurmctld.pid'}\n"
            f"SlurmdPidFile={d / 'slurmd.pid'}\nSlurmctldLogFile={d / 'log' / 'slurmctld.log'}\n"
            f"SlurmdLogFile={d / 'log' / 'slurmd.log'}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
            "JobCompType=jobcomp/none\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
            "MpiDefault=none\nReturnToService=2\nSchedulerType=sched/backfill\nKillWait=5\n"
            "SlurmctldDebug=info\nSlurmdDebug=info\n"
            f"NodeName={NODE} NodeHostname=localhost NodeAddr=127.0.0.1 {hardware} State=UNKNOWN\n"
            f"PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP\n"
            f"PartitionName=short Nodes={NODE} MaxTime=1 State=UP\n"
        )
        self.env = {"SLURM_CONF": str(self.conf)}
        self._start([_exe("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._start([_exe("slurmd"), "-D", "-N", NODE, "-f", str(self.conf)], "slurmd")
        self._wait(lambda: self.sinfo() == "idle", "the node to be idle in sinfo", 30)

    def _start(self, argv: list[str], name: str) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")
        self._logs.append(log)
        self.procs.append(
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             env={**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")})
        )  # fmt: skip

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while not ready():
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.time() > deadline:
                logs = "\n".join(
                    f"{f.name}: {f.read_text(errors='replace')[-800:]}"
                    for f in sorted((self.dir / "log").iterdir())
                )
                self.stop()
                raise RuntimeError(f"Slurm did not start (waiting for {what}):\n{logs}")
            time.sleep(0.2)

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        """A Slurm command (sinfo, squeue, sbatch, scancel...) against this cluster."""
        return subprocess.run(argv, capture_output=True, text=True,
                              env={**os.environ, **self.env}, timeout=30)  # fmt: skip

    def sinfo(self) -> str:
        return self.run("sinfo", "-h", "-n", NODE, "-o", "%t").stdout.strip()

    def jobs(self, states: str = "PENDING,RUNNING,CONFIGURING,COMPLETING") -> dict[str, str]:
        """Job id -> state, for jobs in `states`."""
        out = self.run("squeue", "-h", "--states", states, "-o", "%i %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def state(self, job: str) -> str:
        out = self.run("squeue", "--states=all", "-h", "-j", job, "-o", "%T|%r").stdout
        return out.strip()

    def wait_idle(self, timeout: float = 30) -> None:
        """Until no job is left (running, pending or completing)."""
        deadline = time.time() + timeout
        while self.jobs() and time.time() < deadline:
            time.sleep(0.2)

    def log(self, name: str) -> str:
        path = self.dir / "log" / name
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.procs and self.procs[0].poll() is None and len(self.procs) > 1:
            self.run("scancel", "--user", "root")
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        self.procs.clear()
        for log in self._logs:
            log.close()
