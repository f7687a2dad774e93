"""A stage agent: one process holding layers [layer_start, layer_end) of one pipeline.

Every stage receives frames on a PULL socket at its plan address, computes its backend (the
plan names it per stage: :func:`stage_backend`), and pushes the result to the next stage. The
last stage (the tail) samples the frame's output rows and pushes token ids straight back to the
head. Stage 0 also runs the head (:mod:`modelfleet.agent.head`): it admits client requests,
schedules frames and receives tokens.

Control messages (release, rewind, probe) travel the same path as frames, so each stage sees
them in the order the head sent them. Heartbeats do not: every stage after the head sends them
straight to the head from a thread and socket of their own (:mod:`.liveness`), so a stage busy
with a long frame still beats. Nothing from the wire is trusted: a malformed message is
counted and dropped. Rows the backend refuses (a slot's gap in positions, a full context) fail
only their stream: the stage reports each such slot to the head with its error code and passes
the frame's other rows on; a frame it cannot compute at all is reported whole.

A stage with ``tp_size`` > 1 runs here as its rank 0: its backend is a :class:`TensorStage`,
which sends every engine call to the stage's other ranks (:mod:`.follower`) before running it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from ..engine.backend import StageBackend, backend_info, load_backend
from ..engine.errors import ConfigError, ErrorCode, ModelfleetError
from ..engine.expert_offload import StoreOptions, expert_counters, offload_experts, placement_report, stores_of
from ..engine.formats.plain import PLAIN_DTYPES
from ..engine.formats.plan import FormatPlan
from ..engine.frame import Frame
from ..engine.sampling import TailSampler
from ..engine.scheduler import Scheduler
from ..engine.shard import Shard
from ..engine.speculative.build import build_proposer
from ..engine.speculative.config import SpeculativeConfig
from ..engine.speculative.mtp import MtpProposer, TailMtp, TailProposals, propose_at_tail
from ..engine.speculative.speculator import Speculator
from ..engine.speculative.verify import tail_step
from ..engine.structured import Grammars
from ..engine.tensor_parallel import TensorGroup, init_tensor_group
from ..plan import FleetPlan, Formats, StagePlan
from . import numa
from . import transport as wire
from .head import Head, HeadConfig, scheduler_config
from .health import AgentStatus, Phase, StageMetrics, serve_http
from .liveness import HEARTBEAT_INTERVAL_SECONDS
from .supervisor import RESTARTS_ENV
from .tensor_group import DistChannel, TensorGroupLost, TensorStage, rendezvous_namespace

log = logging.getLogger("modelfleet.agent")
SEND_HWM = 10_000


def bind_numa(stage: StagePlan, tp_rank: int, status: AgentStatus) -> None:
    """Bind this rank to its GPU-local NUMA node before any large allocation (the shard's banks
    are then first-touched there), and publish the binding. Ranks of a stage are planned as if they
    share this host; a pod pinned to one node sees one node and is left as the kubelet placed it."""
    device = numa.device_index(stage.device)
    result = numa.bind_rank(tp_rank, [device] * stage.tp_size)
    status.numa = result.as_dict()
    log.info("numa: %s", status.numa)


def verify_numa(status: AgentStatus) -> None:
    """After loading: where this process's pages actually are (from /proc/self/numa_maps)."""
    status.numa["resident_bytes_by_node"] = {
        f"N{node}": nbytes for node, nbytes in sorted(numa.numa_map_bytes(numa.read_numa_maps()).items())
    }
    log.info("numa placement after load: %s", status.numa["resident_bytes_by_node"])


def format_plan(formats: Formats) -> FormatPlan | None:
    """The engine's formats for a plan's ``model.formats``: a quantized format is applied to its
    role at load; a plain one (bf16, fp16, fp32) leaves the role as the checkpoint stores it, in
    the compute dtype (so a checkpoint shipped in a format keeps it). None: nothing to apply."""
    chosen = {role: name for role, name in formats.model_dump().items() if name not in PLAIN_DTYPES}
    return FormatPlan(**chosen) if chosen else None


def stage_backend(
    plan: FleetPlan,
    stage: StagePlan,
    tensor: TensorGroup | None,
    on_layer: Callable[[int, int], None] | None,
    status: AgentStatus | None = None,
) -> StageBackend:
    """The backend the plan names for ``stage`` (this rank's share when ``tensor`` is given): how
    both a stage's rank 0 and its followers load. With ``serving.gpu_memory_bytes`` the MoE layers
    that do not fit keep their experts in host banks (:mod:`~modelfleet.engine.expert_store`),
    computed on the CPU by this rank's workers (its NUMA binding's, see :func:`bind_numa`)."""
    model = plan.model
    cap = plan.serving.gpu_memory_bytes
    backend = load_backend(
        stage.backend, model.path, stage.layer_start, stage.layer_end, device=stage.device, dtype=model.dtype,
        formats=format_plan(model.formats), tensor=tensor, on_layer=on_layer,
        experts_on_host=cap is not None and str(stage.device).startswith("cuda"),
    )  # fmt: skip
    if cap is not None and isinstance(backend, Shard):
        workers = max(1, int((status.numa if status else {}).get("cpu_workers", 0) or 0))
        options = StoreOptions(
            q=plan.serving.expert_split_q, cpu_workers=workers, prefetch=plan.serving.expert_prefetch
        )
        placement = offload_experts(backend, cap, None, options, kv_bytes=stage.kv_budget_bytes)
        if status is not None:
            report = placement_report(stores_of(backend), placement)
            node_row = {
                "numa_node": status.numa.get("numa_node"), "ranks": [status.tensor_rank],
                "host_expert_bytes": placement.expert_host_bytes,
                "device_bytes": placement.other_bytes + placement.expert_device_bytes, "cpu_workers": workers,
            }  # fmt: skip
            status.expert_placement = {**report, "by_numa_node": [node_row]}
            log.info("expert placement by NUMA node: %s", json.dumps(node_row))
            log.info("expert placement: %s", json.dumps(status.expert_placement))
    return backend


@dataclass(frozen=True)
class AgentConfig:
    plan: FleetPlan
    stage_index: int
    group_index: int = 0
    http_host: str | None = None  # default: the stage's own host
    keys: wire.KeyPair | None = None  # the fleet's CURVE key pair; None: plain TCP
    probe_interval_seconds: float = 1.0
    unready_after_seconds: float = 3.0  # the head calls a stage lost when its heartbeats stop this long
    tp_rank: int = 0  # this process's rank in its stage's tensor group (the plan gives the size)
    http_port: int | None = None  # default: the stage's port + 1 (ranks r > 0: on their own host)
    tensor_timeout_seconds: float = 300.0  # the rendezvous, or a collective, waiting longer fails
    tensor_lost_exit_seconds: float = 10.0  # a leader whose group is lost reports Failed, then exits
    speculative: SpeculativeConfig | None = None  # the head's speculative decoding instead of the plan's


class StageAgent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.plan = config.plan
        self.stages = self.plan.groups[config.group_index].stages
        self.stage = self.stages[config.stage_index]
        self.is_head = config.stage_index == 0
        self.is_tail = config.stage_index == len(self.stages) - 1
        role = (
            "head+tail"
            if self.is_head and self.is_tail
            else "head"
            if self.is_head
            else "tail"
            if self.is_tail
            else "middle"
        )
        self.status = AgentStatus(
            config.group_index, config.stage_index, self.stage.layer_start, self.stage.layer_end, role,
            layers_total=self.stage.num_layers, tensor_rank=config.tp_rank, tensor_size=self.stage.tp_size,
        )  # fmt: skip
        self.metrics = StageMetrics(config.group_index, config.stage_index)
        self.status.restarts = int(os.environ.get(RESTARTS_ENV, "0") or 0)
        self.metrics.restarts.set(self.status.restarts)
        self.stopping = threading.Event()
        self.backend: StageBackend | None = None
        self.sampler: TailSampler | None = None  # the tail's
        self.grammars: Grammars | None = None  # the tail's structured-output compiler
        self.tail_mtp: TailMtp | None = None  # the tail's MTP layers (speculative method mtp)
        self.context = zmq.Context()
        self.inbox: zmq.Socket[Any] | None = None
        self.outbox: zmq.Socket[Any] | None = None
        self.authenticator: Any = None
        self.pending: deque[tuple[float, list[bytes]]] = deque()
        self.head: Head | None = None  # stage 0
        self.heart: threading.Thread | None = None  # stages after the head: heartbeats to it
        self.heart_stop = threading.Event()
        self.incarnation = secrets.randbits(63)  # this process's: see wire.HeartbeatMsg

    # ---- lifecycle ------------------------------------------------------------------------

    def run(self) -> None:
        http_port = self.config.http_port or self.stage.http_port
        http = serve_http(self.config.http_host or self.stage.host, http_port, self.status, self.metrics)
        try:
            self.load()
            self.open_sockets()
            if self.is_head:
                self.head = self._head()
            else:
                self.heart = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
                self.heart.start()
            self.status.phase = Phase.READY
            log.info(
                "stage %d ready: layers [%d, %d)", self.stage.stage_index, self.stage.layer_start, self.stage.layer_end
            )
            self.loop()
            if self.head is not None:
                self.head.shutdown("its head stage was asked to stop")
        except Exception as exc:
            self.status.phase, self.status.reason = Phase.FAILED, f"{type(exc).__name__}: {exc}"
            log.exception("stage %d failed", self.stage.stage_index)
            raise
        finally:
            http.shutdown()
            self.close()

    def _head(self) -> Head:
        assert self.backend is not None
        config = self.config
        head_config = HeadConfig(
            f"{self.stage.host}:{self.stage.client_port}", config.probe_interval_seconds,
            config.unready_after_seconds, config.keys, stages=len(self.stages),
            replay_timeout_seconds=self.plan.serving.replay_timeout_seconds,
        )  # fmt: skip
        scheduler = Scheduler(scheduler_config(self.plan, self.backend, len(self.stages)), self._speculator())
        head = Head(
            scheduler, self.backend, head_config, compute=self.compute, send=None if self.is_tail else self.send,
            context=self.context, plan_hash=self.plan.plan_hash(), metrics=self.metrics, status=self.status,
            grammars=self.grammars,
        )  # fmt: skip
        head.tail_mtp = self.tail_mtp  # a one-stage fleet's head is its tail: it proposes there
        return head

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def stop(self) -> None:
        self.status.phase = Phase.DRAINING
        self.stopping.set()

    def load(self) -> None:
        """This rank's share of the stage's layers (all of them when tp_size is 1), then its KV cache."""
        stage = self.stage
        bind_numa(stage, self.config.tp_rank, self.status)
        tensor = None
        if stage.tp_size > 1:  # rank 0 of the group: see tensor_group
            timeout = self.config.tensor_timeout_seconds
            secret = None if self.config.keys is None else self.config.keys.secret
            namespace = rendezvous_namespace(secret, self.plan.plan_hash(), self.config.group_index, stage.stage_index)
            tensor = init_tensor_group(0, stage.tp_size, stage.host, stage.rendezvous_port, stage.device, timeout,
                                       namespace)  # fmt: skip
        backend = stage_backend(self.plan, stage, tensor, self._loaded, self.status)
        if tensor is not None:
            channel = DistChannel(tensor, torch.device(stage.device))
            backend = TensorStage(backend, channel, f"stage {stage.stage_index}")
        self.backend = backend
        budget = stage.kv_budget_bytes or None
        backend.allocate_cache(self.plan.streams_per_group, self.plan.serving.context_length, budget)
        self.status.weights_bytes, self.status.kv_bytes = backend.weights_bytes, backend.kv_bytes
        self.status.bytes_by_role = backend.bytes_by_role
        verify_numa(self.status)
        self.status.backend = backend_info(backend)
        if self.is_tail:
            # the grammar compiler for the checkpoint's tokenizer, built beside the serving loop
            self.grammars = Grammars(self.plan.model.path, backend.spec.vocab_size)
            self.grammars.prepare()
            self.sampler = TailSampler(backend.spec.eos_token_ids, self.grammars)
            self.tail_mtp = self._tail_mtp(backend)

    def _loaded(self, done: int, total: int) -> None:
        self.status.layers_loaded = done
        self.metrics.layers_loaded.set(done)

    def open_sockets(self) -> None:
        keys = self.config.keys
        self.inbox = self.context.socket(zmq.PULL)
        wire.limit_message_bytes(self.inbox)
        if keys is not None:
            self.authenticator = wire.start_authenticator(self.context, [keys.public])
            wire.curve_server(self.inbox, keys)
        self.inbox.bind(f"tcp://{self.stage.address}")
        if self.is_head and self.is_tail:
            return
        target = self.stages[0] if self.is_tail else self.stages[self.stage.stage_index + 1]
        self.outbox = self.context.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is gone
        self.outbox.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.outbox.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            wire.curve_client(self.outbox, keys, keys.public)
        self.outbox.connect(f"tcp://{target.address}")
        self.status.peers = {"next": target.address}

    def _beat(self) -> None:
        """Every HEARTBEAT_INTERVAL_SECONDS, a heartbeat to the head on a socket of this thread's own."""
        keys, head, plan_hash = self.config.keys, self.stages[0], self.plan.plan_hash()
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            wire.curve_client(sock, keys, keys.public)
        sock.connect(f"tcp://{head.address}")
        try:
            while True:
                beat = wire.HeartbeatMsg(
                    sent_ns=time.monotonic_ns(), group_index=self.config.group_index,
                    stage_index=self.stage.stage_index, ready=self.status.phase == Phase.READY,
                    plan_hash=plan_hash, incarnation=self.incarnation,
                )  # fmt: skip
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(wire.encode(beat), zmq.NOBLOCK)
                if self.heart_stop.wait(HEARTBEAT_INTERVAL_SECONDS) or self.stopping.is_set():
                    return
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self.heart_stop.set()
        if self.heart is not None:
            self.heart.join(5)
        if isinstance(self.backend, TensorStage):
            self.backend.close()
        for sock in (self.inbox, self.outbox):
            if sock is not None:
                sock.close(linger=0)
        if self.head is not None:  # the last answers to clients (a stopping fleet's errors) may still leave
            self.head.clients.close(linger=500)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.context.term()

    # ---- the loop -------------------------------------------------------------------------

    def loop(self) -> None:
        assert self.inbox is not None
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        if self.head is not None:
            poller.register(self.head.clients, zmq.POLLIN)
        while not self.stopping.is_set():
            waited = time.perf_counter()
            timeout_ms = 50 if self.head is None else self.head.poll_timeout_ms()
            ready = dict(poller.poll(timeout_ms))
            self.metrics.idle_seconds.inc(time.perf_counter() - waited)
            if self.inbox in ready:
                self._drain(self.inbox)
            while self.pending:
                arrived, parts = self.pending.popleft()
                self._handle(parts, arrived)
            if self.head is not None:
                if self.head.clients in ready:
                    self.head.drain_clients()
                self.head.tick()
            self._update_gauges()
            if isinstance(self.backend, TensorStage):
                self._tend_tensor_group(self.backend)

    def _tend_tensor_group(self, tensor: TensorStage) -> None:
        """Heartbeats while idle; once a rank is lost, report Failed (the head turns unready), and
        exit after ``tensor_lost_exit_seconds`` so that every rank of the stage is restarted."""
        tensor.heartbeat()
        if tensor.lost is None:
            return
        self.status.phase, self.status.reason = Phase.FAILED, tensor.lost
        if time.monotonic() - tensor.lost_at > self.config.tensor_lost_exit_seconds:
            raise TensorGroupLost(tensor.lost)

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.pending.append((time.perf_counter(), parts))

    def _handle(self, parts: list[bytes], arrived: float) -> None:
        self.metrics.bytes("in", "in", sum(len(p) for p in parts))
        try:
            msg = wire.decode(parts)
        except wire.MalformedMessage as exc:
            self.metrics.malformed.inc()
            log.warning("dropped a malformed message: %s", exc.reason)
            return
        try:
            if self.head is not None:
                self.head.on_chain_message(msg, arrived)
            else:
                self.on_message(msg, arrived)
        except Exception as exc:  # a bug must not take the stage down: report it and keep serving
            self.metrics.errors.inc()
            log.exception("failed to handle a %s message", msg.TYPE)
            if isinstance(msg, wire.FrameMsg):
                self.send(wire.ErrorMsg(
                    code=ErrorCode.INTERNAL.value, message=str(exc)[:4000], microbatch=msg.microbatch, step=msg.step,
                ))  # fmt: skip

    def _speculator(self) -> Speculator | None:
        """The head's speculative decoding, as the agent's override or else the plan asks (a draft
        model runs on this stage's device; mtp runs at the tail, which returns its proposals)."""
        config = self.config.speculative or self.plan.serving.speculative_config()
        if config is None:
            return None
        if config.method == "mtp":
            return Speculator(config, TailProposals(), clock=time.monotonic)
        proposer = build_proposer(config, self.plan.model.path, self.plan.streams_per_group, self.stage.device)
        # a draft samples a sampled stream's proposals from its own q, which goes with the frame to the tail
        return Speculator(config, proposer, clock=time.monotonic, sampled_drafts=True)

    def _tail_mtp(self, backend: StageBackend) -> TailMtp | None:
        """The tail's MTP layers, when the plan speculates with them: they read the final hidden
        rows of every frame, which the tail's shard keeps from now on."""
        config = self.plan.serving.speculative_config()
        if config is None or config.method != "mtp":
            return None
        if not isinstance(backend, Shard):
            raise ConfigError(
                f"speculative method \"mtp\" reads the tail's final hidden rows; stage {self.stage.stage_index}'s "
                f"backend ({type(backend).__name__}) does not keep them: use a torch stage without tensor parallelism"
            )
        plan = self.plan
        proposer = MtpProposer.load(plan.model.path, plan.streams_per_group, plan.serving.context_length,
                                    self.stage.device)  # fmt: skip
        backend.keep_hidden = proposer.reads
        return TailMtp(proposer, config.num_speculative_tokens)

    def _proposals(self, frame: Frame, tokens: wire.TokensMsg) -> tuple[wire.ProposalRecord, ...]:
        """The tail's mtp proposals after the tokens it just sampled for ``frame``."""
        hidden = getattr(self.backend, "last_hidden", None)
        if self.tail_mtp is None or hidden is None or frame.token_ids is None:
            return ()
        rows = (frame.slots.tolist(), frame.positions.tolist(), frame.token_ids.tolist())
        emitted = list(zip(tokens.slots.tolist(), tokens.positions.tolist(), tokens.token_ids.tolist(), strict=True))
        return tuple(wire.ProposalRecord(slot=slot, position=n, token_ids=tuple(drafts))
                     for slot, n, drafts in propose_at_tail(self.tail_mtp, rows, hidden, emitted))  # fmt: skip

    def on_message(self, msg: wire.Message, arrived: float) -> None:
        """A message arriving at a stage after the head."""
        if isinstance(msg, wire.FrameMsg):
            self.on_frame(msg, arrived)
        elif isinstance(msg, wire.ReleaseMsg):
            self.release(msg.slots)
            self.forward(msg)
        elif isinstance(msg, wire.RewindMsg):
            self.rewind(msg.slot, msg.position)
            self.forward(msg)
        elif isinstance(msg, wire.ProbeMsg):
            if self.is_tail:
                self.send(self._probe_ack(msg))
            else:
                self.forward(msg)
        elif isinstance(msg, wire.ErrorMsg):
            self.forward(msg)
        else:
            self.metrics.malformed.inc()
            log.warning("dropped a %s message: stages accept frame, release, rewind, probe, error", msg.TYPE)

    def _probe_ack(self, probe: wire.ProbeMsg) -> wire.ProbeAckMsg:
        return wire.ProbeAckMsg(
            nonce=probe.nonce, sent_ns=probe.sent_ns, group_index=self.config.group_index,
            stage_index=self.stage.stage_index, ready=self.status.phase == Phase.READY, plan_hash=probe.plan_hash,
        )  # fmt: skip

    # ---- frames ---------------------------------------------------------------------------

    def compute(self, frame: Frame, arrived: float) -> torch.Tensor:
        assert self.backend is not None
        started = time.perf_counter()
        self.metrics.queue_wait_seconds.inc(max(0.0, started - arrived))
        out = self.backend.forward(frame)
        self.metrics.compute_seconds.inc(time.perf_counter() - started)
        self.metrics.frames.inc()
        self.metrics.rows.inc(frame.rows)
        return out

    def on_frame(self, msg: wire.FrameMsg, arrived: float) -> None:
        assert self.backend is not None
        output_rows = torch.tensor(msg.output_rows, dtype=torch.int64)
        # every row's output wanted, no stream starting: a fixed-shape step may run it
        decode_only = len(msg.output_rows) == msg.slots.shape[0] and not msg.new_streams
        frame = Frame(msg.slots, msg.positions, token_ids=msg.token_ids, hidden=msg.hidden, output_rows=output_rows,
                      decode_only=decode_only)  # fmt: skip
        refused = self.backend.refusals(frame)
        for slot, exc in refused.items():  # only these streams fail; the frame's other rows go on
            self._refuse(msg, exc, slot)
        kept = [r for r, slot in enumerate(msg.slots.tolist()) if slot not in refused]
        if not kept:
            return
        if refused:
            frame = frame.keep_rows(kept)
        try:
            out = self.compute(frame, arrived)
        except ModelfleetError as exc:
            self._refuse(msg, exc, None)
            return
        slots = frame.slots.tolist()
        rows = [] if frame.output_rows is None else frame.output_rows.tolist()
        starts = tuple(s for s in msg.new_streams if s.slot in set(slots))
        if self.is_tail:
            positions = frame.positions.tolist()
            ids = [] if frame.token_ids is None else frame.token_ids.tolist()
            output_tokens = [ids[r] for r in rows] if ids else None  # a verify window's proposals
            sampled = self.sample(
                msg, starts, [slots[r] for r in rows], [positions[r] for r in rows], output_tokens, out
            )
            if self.tail_mtp is not None:
                sampled = dataclasses.replace(sampled, proposals=self._proposals(frame, sampled))
            self.send(sampled)
        else:
            self.send(wire.FrameMsg(
                microbatch=msg.microbatch, step=msg.step, slots=frame.slots, positions=frame.positions, hidden=out,
                token_ids=frame.token_ids, output_rows=tuple(rows), new_streams=starts,
                **wire.draft_q_fields(msg.draft_q(slots)),  # the kept windows' q, on to the tail
            ))  # fmt: skip

    def _refuse(self, msg: wire.FrameMsg, exc: ModelfleetError, slot: int | None) -> None:
        self.metrics.errors.inc()
        which = "frame" if slot is None else f"slot {slot} of frame"
        log.warning("refused %s %d of microbatch %d: %s", which, msg.step, msg.microbatch, exc)
        self.send(wire.ErrorMsg(
            code=exc.code.value, message=str(exc)[:4000], slot=slot, microbatch=msg.microbatch, step=msg.step,
        ))  # fmt: skip

    def sample(
        self,
        msg: wire.FrameMsg,
        starts: tuple[wire.StreamStart, ...],
        slots: list[int],
        positions: list[int],
        output_tokens: list[int] | None,
        logits: torch.Tensor,
    ) -> wire.TokensMsg:
        """Tail: one token per lone output row, and a verify window's accepted proposals plus one
        token, with each stream's own parameters; a stream that cannot be sampled is reported on
        its own and has no token."""
        assert self.sampler is not None
        for start in starts:
            self.sampler.start(start.slot, start.sampling_params(), start.prompt_tokens, start.drawn,
                               start.output_position)  # fmt: skip
        every = msg.slots.tolist(), msg.positions.tolist(), [] if msg.token_ids is None else msg.token_ids.tolist()
        if every[2]:
            self.sampler.observe(*every)
        is_prompt = self.sampler.prompt_rows(slots, positions)
        frame_rows = lambda: list(zip(*every, strict=False))  # noqa: E731
        tokens, errors, logprobs, prompt = tail_step(
            self.sampler, slots, positions, output_tokens, logits, frame_rows, msg.draft_q(slots)
        )
        for slot, exc in errors.items():
            self._refuse(msg, exc, slot)
        first: dict[int, int] = {}  # each slot's first sampled row's position: its window's tokens follow it
        for slot, position, scored in zip(slots, positions, is_prompt, strict=True):
            if not scored:
                first.setdefault(slot, position)
        rows = [(s, first[s] + i, t) for s in first if s in tokens for i, t in enumerate(_as_list(tokens[s]))]
        return wire.TokensMsg(
            microbatch=msg.microbatch, step=msg.step, slots=torch.tensor([r[0] for r in rows], dtype=torch.int64),
            positions=torch.tensor([r[1] for r in rows], dtype=torch.int64),
            token_ids=torch.tensor([r[2] for r in rows], dtype=torch.int64),
            logprobs=tuple(wire.LogprobsRecord.of(i, logprobs[r[0]]) for i, r in enumerate(rows) if r[0] in logprobs),
            prompt_slots=tuple(slot for slot, entries in prompt.items() for _ in entries),
            prompt_logprobs=tuple(wire.LogprobsRecord.of(p, v) for entries in prompt.values() for p, v in entries),
        )  # fmt: skip

    def release(self, slots: tuple[int, ...]) -> None:
        assert self.backend is not None and self.backend.slots is not None
        for slot in slots:
            if slot < self.backend.slots.max_slots:
                self.backend.release(slot)
            if self.sampler is not None:
                self.sampler.release(slot)
            if self.tail_mtp is not None and slot < self.backend.slots.max_slots:
                self.tail_mtp.release(slot)

    def rewind(self, slot: int, position: int) -> None:
        assert self.backend is not None
        try:
            self.backend.rewind(slot, position)
        except ModelfleetError as exc:
            log.warning("refused a rewind: %s", exc)

    # ---- sending --------------------------------------------------------------------------

    def forward(self, msg: wire.Message) -> None:
        if not self.is_tail:
            self.send(msg)
        elif isinstance(msg, wire.ErrorMsg):
            self.send(msg)  # errors reach the head from the tail

    def send(self, msg: wire.Message) -> None:
        if self.outbox is None:
            return
        parts = wire.encode(msg)
        try:
            self.outbox.send_multipart(parts, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("next stage unreachable: dropped a %s message", msg.TYPE)
            return
        self.metrics.bytes("next", "out", sum(len(p) for p in parts))

    def _update_gauges(self) -> None:
        if self.status.expert_placement and isinstance(self.backend, Shard):
            placement = self.status.expert_placement
            self.status.expert_placement = {**placement, **expert_counters(stores_of(self.backend))}
            self.metrics.expert_store(self.status.expert_placement)
        if self.backend is not None and self.backend.slots is not None:
            in_use = self.backend.slots.in_use()
            self.status.slots_in_use = in_use
            self.metrics.active_slots.set(in_use)


def _as_list(tokens: int | list[int]) -> list[int]:
    return [tokens] if isinstance(tokens, int) else tokens
