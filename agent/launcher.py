"""A local fleet: every stage of a plan as a child process of this one.

Children are started with the same Python (``-P``: the repository's operator/ folder must not
shadow the standard library), their output is prefixed with their stage (and tensor rank), and they die with
their parent: on Linux each child asks the kernel for SIGTERM when the launcher exits, and the
launcher itself stops them all (SIGTERM, then SIGKILL after a grace period) on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..engine.errors import ModelfleetError
from ..plan import FleetPlan, StagePlan
from .cores import available_cpus, core_sets

PR_SET_PDEATHSIG = 1


def rank_http_port(stage: StagePlan, tp_rank: int) -> int:
    """Where a rank serves HTTP on this machine, where every rank shares rank 0's host (the plan's rule)."""
    return stage.rank_http_port(tp_rank, shared_host=True)


def stage_ports(stage: StagePlan) -> list[int]:
    """Frames, HTTP, clients, and with tp_size > 1 the rendezvous and every other rank's HTTP."""
    return list(stage.ports)


class LaunchError(ModelfleetError):
    """A local fleet could not start; the message says what to change."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def check_ports(plan: FleetPlan, extra: Sequence[int] = ()) -> None:
    """Every port a local fleet needs must be free; the error names the first busy one."""
    for group in plan.groups:
        for stage in group.stages:
            for port in stage_ports(stage):
                if not port_free(stage.host, port):
                    raise LaunchError(
                        f"port {port} on {stage.host} (stage {stage.stage_index}) is in use; stop what holds it "
                        "or choose other ports with --base-port"
                    )
    for port in extra:
        if not port_free("127.0.0.1", port):
            raise LaunchError(f"port {port} is in use; stop what holds it or choose another with --port")


@dataclass
class Child:
    name: str
    process: subprocess.Popen[str]
    status_url: str | None = None
    command: list[str] = field(default_factory=list)  # what started it, to start it again (.supervisor)
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None  # the cores it is pinned to


class LocalFleet:
    def __init__(self, plan: FleetPlan, plan_path: Path, out: TextIO | None = None, keys_dir: Path | None = None):
        """``keys_dir``: the fleet's CURVE keys (fleet.key, fleet.key_secret) every stage is given; None: plain TCP."""
        self.plan, self.plan_path, self.keys_dir = plan, plan_path, keys_dir
        self.out = out or sys.stdout
        self.children: list[Child] = []
        self._lock = threading.Lock()

    def stage_command(self, stage_index: int, group_index: int = 0, tp_rank: int = 0) -> list[str]:
        agent = ["agent", "--plan", str(self.plan_path), "--stage", str(stage_index), "--group", str(group_index)]
        if tp_rank:
            stage = self.plan.stage(group_index, stage_index)
            agent += ["--tp-rank", str(tp_rank), "--http-port", str(rank_http_port(stage, tp_rank))]
        if self.keys_dir is not None:
            agent += ["--keys-dir", str(self.keys_dir)]
        return [sys.executable, "-P", "-m", "modelfleet.cli", *agent]

    def start(self) -> None:
        """Every rank of every stage of every pipeline group, named ``stage S`` (``gG stage S`` with
        several groups, ``stage S rank R`` for ranks R > 0)."""
        env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
        processes = sum(s.tp_size for g in self.plan.groups for s in g.stages)
        # every stage process (tensor ranks too) pinned to its own share of the cores, as many threads
        cores = iter(core_sets(available_cpus(), processes))
        for group in self.plan.groups:
            prefix = f"g{group.group_index} " if len(self.plan.groups) > 1 else ""
            for stage in group.stages:
                for rank in range(stage.tp_size):
                    name = f"{prefix}stage {stage.stage_index}" + (f" rank {rank}" if rank else "")
                    command = self.stage_command(stage.stage_index, group.group_index, rank)
                    cpus = next(cores)
                    self.spawn(name, command, {**env, "OMP_NUM_THREADS": str(len(cpus))},
                               f"http://{stage.host}:{rank_http_port(stage, rank)}/status", cpus=cpus)  # fmt: skip

    def spawn(
        self,
        name: str,
        command: list[str],
        env: dict[str, str],
        status_url: str | None = None,
        cpus: tuple[int, ...] | None = None,
    ) -> Child:
        """Start a child process (``cpus``: pinned to those cores)."""
        child = self._start(name, command, env, status_url, cpus)
        self.children.append(child)
        return child

    def respawn(self, index: int, extra_env: dict[str, str]) -> Child:
        """Start child ``index`` again, as it was started, in its place (its old process has exited)."""
        old = self.children[index]
        child = self._start(old.name, old.command, {**old.env, **extra_env}, old.status_url, old.cpus)
        self.children[index] = child
        return child

    def _start(
        self, name: str, command: list[str], env: dict[str, str], status_url: str | None, cpus: tuple[int, ...] | None
    ) -> Child:
        def in_child() -> None:  # between fork and exec
            _die_with_parent()
            if cpus and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cpus)

        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            preexec_fn=in_child if sys.platform == "linux" else None,
            # a group of its own: a terminal's Ctrl-C reaches only the launcher, which stops its
            # children (SIGTERM) in order, rather than every child dying mid-load with a traceback
            process_group=0,
        )  # fmt: skip
        child = Child(name, process, status_url, command, env, cpus)
        threading.Thread(target=self._pump, args=(child,), daemon=True).start()
        return child

    def _pump(self, child: Child) -> None:
        assert child.process.stdout is not None
        for line in child.process.stdout:
            with self._lock:
                self.out.write(f"[{child.name}] {line}")
                self.out.flush()

    def statuses(self) -> list[dict[str, Any] | None]:
        return [fetch_json(c.status_url) if c.status_url else None for c in self.children]

    def wait_ready(
        self, timeout_seconds: float, on_progress: Callable[[list[dict[str, Any] | None]], None] | None = None
    ) -> None:
        """Until every group's head reports ready; raises LaunchError if a child exits or time runs out."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            for child in self.children:
                if child.process.poll() is not None:
                    raise LaunchError(
                        f"{child.name} exited with code {child.process.returncode}; see its log lines above"
                    )
            statuses = self.statuses()
            if on_progress is not None:
                on_progress(statuses)
            heads = [s for s in statuses if s is not None and s.get("stage_index") == 0 and not s.get("tensor_rank")]
            if len(heads) == len(self.plan.groups) and all(head.get("ready") for head in heads):
                return
            time.sleep(0.2)
        raise LaunchError(f"the fleet was not ready within {timeout_seconds:.0f} s")

    def stop(self, grace_seconds: float = 10.0) -> None:
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for child in self.children:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def fetch_json(url: str, timeout_seconds: float = 1.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_seconds) as response:
            data = json.loads(response.read())
            return data if isinstance(data, dict) else None
    except (urllib.error.URLError, OSError, ValueError):
        return None
