"""A tensor rank r > 0 of a stage: its share of the stage's layers, driven by the stage's rank 0.

It serves no frame or client socket, only its own HTTP (/healthz, /readyz, /status, /metrics) so
that every rank's pod answers its probes. It joins its stage's tensor group at rank 0's host and
rendezvous port, loads its share of the backend the plan names, and runs the commands rank 0 broadcasts (:mod:`.tensor_group`) until
rank 0 says stop. When rank 0 disappears the process exits with an error (LeaderGone) so that it
is restarted and meets the restarted rank 0 at the rendezvous again.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch

from ..engine.backend import StageBackend
from ..engine.tensor_parallel import close_tensor_group, init_tensor_group
from .health import AgentStatus, Phase, StageMetrics, serve_http
from .stage import AgentConfig, bind_numa, stage_backend, verify_numa
from .tensor_group import Command, DistChannel, RankFollower, rendezvous_namespace

log = logging.getLogger("modelfleet.agent")


class FollowerAgent:
    def __init__(self, config: AgentConfig):
        self.config = config
        stages = config.plan.groups[config.group_index].stages
        self.stage = stages[config.stage_index]
        if not 1 <= config.tp_rank < self.stage.tp_size:
            raise ValueError(f"tp_rank={config.tp_rank} is not a follower rank of a group of {self.stage.tp_size}")
        self.status = AgentStatus(
            config.group_index, config.stage_index, self.stage.layer_start, self.stage.layer_end, "tensor-rank",
            layers_total=self.stage.num_layers, tensor_rank=config.tp_rank, tensor_size=self.stage.tp_size,
        )  # fmt: skip
        self.metrics = StageMetrics(config.group_index, config.stage_index)
        self.stopping = threading.Event()
        self.backend: StageBackend | None = None
        self.handle_signals = False

    def install_signal_handlers(self) -> None:
        """Until it serves, SIGTERM ends the process at once (it may wait in the rendezvous, where
        Python handlers do not run); serve() then takes SIGTERM as "stop after this command"."""
        self.handle_signals = True

    def _stop_after_command(self) -> None:
        # the handler runs once a broadcast returns: at the latest after rank 0's next heartbeat
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())

    def run(self) -> None:
        stage, rank = self.stage, self.config.tp_rank
        http_port = self.config.http_port or stage.http_port
        http = serve_http(self.config.http_host or stage.host, http_port, self.status, self.metrics)
        try:
            bind_numa(stage, rank, self.status)
            keys, plan = self.config.keys, self.config.plan
            namespace = rendezvous_namespace(None if keys is None else keys.secret, plan.plan_hash(), self.config.group_index,
                                             stage.stage_index)  # fmt: skip
            group = init_tensor_group(
                rank,
                stage.tp_size,
                stage.host,
                stage.rendezvous_port,
                stage.device,
                self.config.tensor_timeout_seconds,
                namespace,
            )
            self.backend = backend = stage_backend(self.config.plan, stage, group, self._loaded, self.status)
            channel = DistChannel(group, torch.device(stage.device))
            follower = RankFollower(backend, channel, rank, on_command=self._applied)
            self.status.weights_bytes, self.status.bytes_by_role = backend.weights_bytes, backend.bytes_by_role
            verify_numa(self.status)
            self.status.phase = Phase.READY
            log.info("stage %d tensor rank %d of %d ready", stage.stage_index, rank, stage.tp_size)
            if self.handle_signals:
                self._stop_after_command()
            follower.serve(self.stopping.is_set)
        except Exception as exc:
            self.status.phase, self.status.reason = Phase.FAILED, f"{type(exc).__name__}: {exc}"
            log.error("stage %d tensor rank %d failed: %s", stage.stage_index, rank, exc)
            raise
        finally:
            http.shutdown()
            close_tensor_group()

    def _loaded(self, done: int, total: int) -> None:
        self.status.layers_loaded = done
        self.metrics.layers_loaded.set(done)

    def _applied(self, command: Command) -> None:
        if command.frame is not None:
            self.metrics.frames.inc()
            self.metrics.rows.inc(command.frame.rows)
        assert self.backend is not None
        self.status.kv_bytes = self.backend.kv_bytes
        if self.backend.slots is not None:
            self.status.slots_in_use = self.backend.slots.in_use()
