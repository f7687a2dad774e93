"""Fleet commands: ``plan``, ``agent``, ``up``, ``keys`` and ``complete``."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from modelfleet.engine.expert_placement import DEFAULT_EXPERT_PREFETCH
from modelfleet.engine.format_names import PACKED_FORMATS, PLAIN_FORMATS
from modelfleet.planner import DEFAULT_CONTEXT_CAP

err = Console(stderr=True, soft_wrap=True)
DEMO_MODEL = Path(__file__).resolve().parents[2] / "models" / "demo"  # the repository's bundled model
out = Console(soft_wrap=True)


def fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code=2)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def placement_table(plan: Any, model: Path) -> Table | None:
    """Per stage and MoE layer: where the experts go under serving.gpu_memory_bytes (None: not capped)."""
    from modelfleet.planner import expert_placements

    placements = expert_placements(plan, model)
    if not placements:
        return None
    table = Table(title=f"expert placement with {_gib(plan.serving.gpu_memory_bytes)} of device memory per stage")
    for col in ("group", "stage", "layer", "placement", "slots", "device experts", "host experts"):
        table.add_column(col, justify="left" if col == "placement" else "right")
    for (g, s), placement in placements.items():
        for p in placement.layers:
            table.add_row(str(g), str(s), str(p.layer), str(p.placement), f"{p.slots}/{p.num_experts}",
                          _gib(p.device_bytes), _gib(p.host_bytes))  # fmt: skip
    return table


GPU_MEMORY_HELP = (
    "Device memory each stage (rank) plans for (serving.gpu_memory_bytes): MoE layers that do not fit keep "
    "their experts in host banks with device cache slots; simulates a smaller GPU."
)


def plan_table(plan: Any) -> Table:
    table = Table(
        title=f"fleet plan for {plan.model.served_name} ({plan.model.family}, {plan.model.num_layers} layers)"
    )
    for col in ("group", "stage", "layers", "tp", "weights", "KV budget", "device", "address"):
        table.add_column(col, justify="right" if col in ("tp", "weights", "KV budget") else "left")
    for group in plan.groups:
        for s in group.stages:
            table.add_row(
                str(group.group_index), str(s.stage_index), f"[{s.layer_start}, {s.layer_end})", str(s.tp_size),
                _gib(s.weights_bytes), _gib(s.kv_budget_bytes), s.device, s.address,
            )  # fmt: skip
    return table


def _load_nodes(path: Path) -> list[dict[str, Any]]:
    import yaml

    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        fail(f"cannot read Node objects from {path}: {exc}")
    nodes: list[dict[str, Any]] = []
    for doc in docs:
        items = doc.get("items", [doc]) if isinstance(doc, dict) else doc
        nodes += [n for n in items if isinstance(n, dict)]
    if not nodes:
        fail(f"{path} holds no Node objects (a YAML list, a NodeList, or documents of kind Node)")
    return nodes


EXPERT_PREFETCH_HELP = (
    "Copy experts into the device cache slots ahead of the step that uses them (capped devices): off; exact "
    "(hash-routed layers, whose experts the token ids fix); predicted (also learned routers: the next layer's "
    "router applied to this layer's input; a wrong guess costs copy bandwidth)."
)


def expert_prefetch_option(text: str) -> Any:
    """--expert-prefetch as the store option it names (engine.expert_placement.ExpertPrefetch)."""
    from modelfleet.engine.expert_placement import ExpertPrefetch

    choices = [mode.value for mode in ExpertPrefetch]
    if text not in choices:
        fail(f"--expert-prefetch {text!r}: choose one of {', '.join(choices)}")
    return ExpertPrefetch(text)


CONTEXT_HELP = (
    f"Positions per stream (default: the model's max_position_embeddings, at most {DEFAULT_CONTEXT_CAP}; "
    "more than the model's is refused)."
)


def context_length_for(model: Path, asked: int | None) -> int:
    """The plan's context length for ``model`` (planner.context_length_for on its config)."""
    from modelfleet.engine.spec import load_spec
    from modelfleet.planner import context_length_for as for_positions

    return for_positions(load_spec(model).max_position_embeddings, asked)


def make_plan(
    model: Path, stages: int, *, nodes: Path | None = None, max_streams: int = 16, context_length: int | None = None,
    window_rows: int = 8, microbatches: int | None = None, max_queue: int = 64, dtype: str = "float32",
    device: str = "cpu", base_port: int = 5555, served_name: str | None = None, groups: int = 1, tensor: int = 1,
    formats: Any = None, backend: str = "torch", speculative: dict[str, Any] | None = None,
    gpu_memory_bytes: int | None = None, expert_prefetch: str = DEFAULT_EXPERT_PREFETCH.value,
    cuda_devices: int | None = None,
) -> Any:  # fmt: skip
    """A plan of ``groups`` pipeline replicas of ``stages`` stages each, every stage split over
    ``tensor`` ranks; stage ports run from ``base_port`` (planner.local_address), group after group.
    ``cuda_devices``: this machine's, when the stages will run here (``up``). ``device`` CPU
    (OpenVINO's spelling, ``--backend openvino --device CPU``) is the plan's cpu."""
    from modelfleet.plan import ServingLimits
    from modelfleet.planner import build_plan, local_address

    device = "cpu" if device == "CPU" else device

    serving = ServingLimits(
        max_streams=max_streams, context_length=context_length_for(model, context_length), window_rows=window_rows,
        microbatches=microbatches, max_queue=max_queue, speculative=speculative, gpu_memory_bytes=gpu_memory_bytes,
        expert_prefetch=expert_prefetch_option(expert_prefetch),
    )  # fmt: skip
    return build_plan(
        model, stages, _load_nodes(nodes) if nodes else None, groups=groups, tensor=tensor, dtype=dtype,
        device=device, backend=backend, serving=serving, served_name=served_name or model.resolve().name,
        model_path=str(model.resolve()), address_of=local_address(base_port, stages, tensor), formats=formats,
        cuda_devices=cuda_devices,
    )  # fmt: skip


FORMAT_HELP = (
    f"{', '.join(PACKED_FORMATS)} (quantized at load) or {', '.join(PLAIN_FORMATS)} (as stored); default as stored"
)
BACKEND_HELP = (
    "What executes the stages: torch (cpu or cuda devices) or openvino (fused MoE blocks on cpu or an Intel GPU); "
    "one for all stages, or one per stage, comma-separated (torch,openvino)."
)
MICROBATCHES_HELP = "Sets of streams whose frames the head keeps in flight separately (default: one per stage)."
GROUPS_HELP = "Pipeline replicas (groups); the gateway balances requests over them."
STAGES_HELP = "Pipeline stages per group; the layers are split evenly over them."
WINDOW_HELP = "Rows of one stream's prefill window per frame."
STREAMS_HELP = "Streams served at once over all groups (each stage reserves KV for its group's share)."
QUEUE_HELP = "Requests the head holds waiting for a stream slot before refusing more."
DTYPE_HELP = "Compute dtype: float32, bfloat16 or float16 (what activations and plain weights use)."
DEVICE_HELP = "Where the stages run: cpu, cuda or cuda:N (CPU or GPU with --backend openvino)."
SERVED_NAME_HELP = "The model name the gateway serves (the `model` field of requests; default: the folder's name)."
SPECULATIVE_HELP = (
    'Speculative decoding at every head, as JSON: {"method": "ngram"|"phrase"|"hybrid"|"draft_model"|"mtp", '
    '"num_speculative_tokens": K, ...} (serving.speculative in the plan); the output is unchanged.'
)


AGENT_SPECULATIVE_HELP = (
    "Speculative decoding at this head (stage 0) instead of the plan's serving.speculative, as JSON "
    "(same keys); other stages ignore it. The plan and its hash are unchanged."
)


def speculative_option(text: str | None) -> dict[str, Any] | None:
    """--speculative-config's JSON, checked now (a bad config fails here, not in every stage)."""
    if text is None:
        return None
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.speculative.config import SpeculativeConfig

    try:
        SpeculativeConfig.from_json(text)
    except ModelfleetError as exc:
        fail(f"--speculative-config: {exc}")
    document: dict[str, Any] = json.loads(text)
    return document


def plan_formats(experts: str | None, attention: str | None, head: str | None, embeddings: str | None) -> Any:
    """The plan's ``model.formats`` from the command line's role options (None: as stored)."""
    from modelfleet.engine.format_names import unsupported
    from modelfleet.plan import Formats

    roles = {"experts": experts, "attention": attention, "head": head, "embeddings": embeddings}
    given = {role: name for role, name in roles.items() if name}
    for role, name in given.items():
        if (why := unsupported(role, name)) is not None:
            fail(f"--{role} {why}")
    return Formats.model_validate(given) if given else None  # None: the checkpoint's own (see build_plan)


def plan(
    model: Path = typer.Option(..., "--model", help="Checkpoint directory."),
    stages: int = typer.Option(2, "--stages", min=1, help=STAGES_HELP),
    nodes: Path | None = typer.Option(None, "--nodes", help="YAML of Kubernetes Node objects: split by their memory."),
    out_path: Path = typer.Option(Path("plan.json"), "--out", help="Where to write the plan."),
    max_streams: int = typer.Option(16, "--max-streams", min=1, help=STREAMS_HELP),
    context_length: int | None = typer.Option(None, "--context-length", min=1, help=CONTEXT_HELP),
    window_rows: int = typer.Option(8, "--window-rows", min=1, help=WINDOW_HELP),
    dtype: str = typer.Option("float32", "--dtype", help=DTYPE_HELP),
    served_name: str | None = typer.Option(None, "--served-name", help=SERVED_NAME_HELP),
    tensor: int = typer.Option(1, "--tensor", min=1, help="Tensor-parallel ranks per stage (tp_size)."),
    groups: int = typer.Option(1, "--groups", min=1, help=GROUPS_HELP),
    microbatches: int | None = typer.Option(None, "--microbatches", min=1, help=MICROBATCHES_HELP),
    backend: str = typer.Option("torch", "--backend", help=BACKEND_HELP),
    experts_format: str | None = typer.Option(None, "--experts", help=f"Experts' format: {FORMAT_HELP}."),
    attention_format: str | None = typer.Option(None, "--attention", help=f"Attention's format: {FORMAT_HELP}."),
    head_format: str | None = typer.Option(None, "--head", help=f"Output head's format: {FORMAT_HELP}."),
    embeddings_format: str | None = typer.Option(
        None, "--embeddings", help=f"Embedding table's format (a tied head follows it): {FORMAT_HELP}."
    ),
    speculative_config: str | None = typer.Option(None, "--speculative-config", metavar="JSON", help=SPECULATIVE_HELP),
    gpu_memory_bytes: int | None = typer.Option(None, "--gpu-memory-bytes", min=1, help=GPU_MEMORY_HELP),
    expert_prefetch: str = typer.Option(DEFAULT_EXPERT_PREFETCH.value, "--expert-prefetch", help=EXPERT_PREFETCH_HELP),
) -> None:
    """Plan a fleet: contiguous layer ranges per stage (sized in the weight formats asked for),
    printed as a table and written as JSON."""
    from modelfleet.engine.errors import ModelfleetError

    formats = plan_formats(experts_format, attention_format, head_format, embeddings_format)
    try:
        fleet_plan = make_plan(model, stages, nodes=nodes, max_streams=max_streams, context_length=context_length,
                               window_rows=window_rows, dtype=dtype, tensor=tensor, formats=formats, groups=groups,
                               microbatches=microbatches, backend=backend, served_name=served_name,
                               speculative=speculative_option(speculative_config),
                               gpu_memory_bytes=gpu_memory_bytes, expert_prefetch=expert_prefetch)  # fmt: skip
        placements = placement_table(fleet_plan, model)
    except ModelfleetError as exc:
        fail(str(exc))
    out.print(plan_table(fleet_plan))
    if placements is not None:
        out.print(placements)
    out_path.write_text(fleet_plan.to_json())
    out.print(f"wrote {out_path} (plan hash {fleet_plan.plan_hash()[:12]})")


def agent(
    plan_path: Path = typer.Option(..., "--plan", envvar="MF_PLAN", help="Fleet plan JSON."),
    stage: int = typer.Option(..., "--stage", envvar="MF_STAGE", min=0, help="Stage index in the group."),
    group: int = typer.Option(0, "--group", envvar="MF_GROUP", min=0, help="Group (pipeline replica) index."),
    keys_dir: Path | None = typer.Option(
        None, "--keys-dir", envvar="MF_KEYS_DIR", help="Folder with fleet.key and fleet.key_secret (CURVE)."
    ),
    http_host: str | None = typer.Option(None, "--http-host", envvar="MF_HTTP_HOST", help="Bind /healthz etc. here."),
    http_port: int | None = typer.Option(
        None, "--http-port", envvar="MF_HTTP_PORT", min=1, max=65535, help="HTTP port (default: the plan's)."
    ),
    tp_rank: int = typer.Option(
        0, "--tp-rank", envvar="MF_TP_RANK", min=0, help="Tensor rank in the stage; rank 0 serves it, others follow."
    ),
    speculative_config: str | None = typer.Option(
        None, "--speculative-config", envvar="MF_SPECULATIVE_CONFIG", metavar="JSON", help=AGENT_SPECULATIVE_HELP
    ),
    log_level: str = typer.Option("INFO", "--log-level", envvar="MF_LOG_LEVEL"),
) -> None:
    """Run one stage of a fleet: load its layers, serve frames (stage 0 also schedules streams)."""
    import logging

    from modelfleet.agent import transport
    from modelfleet.agent.cores import size_threads
    from modelfleet.agent.follower import FollowerAgent
    from modelfleet.agent.stage import AgentConfig, StageAgent
    from modelfleet.engine.backend import backend_refusal
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.speculative.config import SpeculativeConfig
    from modelfleet.plan import load

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    size_threads()  # torch's threads = the cores this stage is allotted (pinning, a pod's CPU limit)
    try:
        fleet_plan = load(plan_path)
        if group >= len(fleet_plan.groups) or stage >= len(fleet_plan.groups[group].stages):
            fail(f"the plan has no stage {stage} in group {group}")
        # what executes the stage is the plan's (stages[].backend): refused here, before anything loads
        refusal = backend_refusal(fleet_plan.stage(group, stage).backend, fleet_plan.stage(group, stage).device)
        if refusal is not None:
            fail(f"stage {stage}: {refusal}")
        tp_size = fleet_plan.stage(group, stage).tp_size
        if tp_rank >= tp_size:
            fail(
                f"--tp-rank {tp_rank} is outside stage {stage}'s tensor group (tp_size={tp_size}, ranks 0..{tp_size - 1})"
            )
        keys = transport.load_keypair(keys_dir, "fleet") if keys_dir else None
        speculative = speculative_option(speculative_config)
        planned = fleet_plan.serving.speculative_config()
        if (
            speculative is not None
            and "mtp" in (speculative["method"], planned and planned.method)
            and (planned is None or planned.method != speculative["method"])
        ):
            fail("--speculative-config cannot switch to or from mtp: its MTP layers run at the tail, which reads the "
                 "plan's serving.speculative; put mtp in the plan instead")  # fmt: skip
        config = AgentConfig(fleet_plan, stage, group, http_host=http_host, keys=keys, tp_rank=tp_rank,
                             http_port=http_port,
                             speculative=None if speculative is None else SpeculativeConfig.from_mapping(speculative))  # fmt: skip
        runner: StageAgent | FollowerAgent = StageAgent(config) if tp_rank == 0 else FollowerAgent(config)
    except ModelfleetError as exc:
        fail(str(exc))
    runner.install_signal_handlers()
    runner.run()


def keys(
    out_dir: Path = typer.Option(Path("keys"), "--out", help="Folder for fleet.key and fleet.key_secret."),
) -> None:
    """Generate the fleet's CURVE key pair: agents with keys refuse peers without them."""
    from modelfleet.agent import transport

    out_dir.mkdir(parents=True, exist_ok=True)
    transport.save_keypair(transport.generate_keypair(), out_dir, "fleet")
    out.print(f"wrote {out_dir / 'fleet.key'} and {out_dir / 'fleet.key_secret'} (keep the secret one secret)")


def up(
    model: Path | None = typer.Option(
        None, "--model", help="Checkpoint directory (default: the bundled demo model, models/demo)."
    ),
    stages: int = typer.Option(2, "--stages", min=1, help=STAGES_HELP),
    groups: int = typer.Option(1, "--groups", min=1, help=GROUPS_HELP),
    replicas: int | None = typer.Option(None, "--replicas", min=1, hidden=True, help="Deprecated: --groups."),
    microbatches: int | None = typer.Option(None, "--microbatches", min=1, help=MICROBATCHES_HELP),
    backend: str = typer.Option("torch", "--backend", help=BACKEND_HELP),
    window_rows: int = typer.Option(8, "--window-rows", min=1, help=WINDOW_HELP),
    max_streams: int = typer.Option(16, "--max-streams", min=1, help=STREAMS_HELP),
    max_queue: int = typer.Option(64, "--max-queue", min=0, help=QUEUE_HELP),
    context_length: int | None = typer.Option(None, "--context-length", min=2, help=CONTEXT_HELP),
    dtype: str = typer.Option("float32", "--dtype", help=DTYPE_HELP),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    served_name: str | None = typer.Option(None, "--served-name", help=SERVED_NAME_HELP),
    tensor: int = typer.Option(
        1, "--tensor", min=1, help="Tensor-parallel ranks (processes) per stage; each gets its share of the cores."
    ),
    base_port: int = typer.Option(
        5555, "--base-port", help="First stage port; stages are 10 ports apart (more with --tensor > 7)."
    ),
    experts_format: str | None = typer.Option(None, "--experts", help=f"Experts' format: {FORMAT_HELP}."),
    attention_format: str | None = typer.Option(None, "--attention", help=f"Attention's format: {FORMAT_HELP}."),
    head_format: str | None = typer.Option(None, "--head", help=f"Output head's format: {FORMAT_HELP}."),
    embeddings_format: str | None = typer.Option(
        None, "--embeddings", help=f"Embedding table's format (a tied head follows it): {FORMAT_HELP}."
    ),
    ready_timeout: float = typer.Option(600.0, "--ready-timeout", help="Seconds to wait for the fleet."),
    host: str = typer.Option("127.0.0.1", "--host", help="Where the gateway (OpenAI-compatible API) listens."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="The gateway's port."),
    api_keys_file: Path | None = typer.Option(
        None, "--api-keys-file", help="Bearer API keys for the gateway, one per line, # comments (also MF_API_KEYS)."
    ),
    keys_dir: Path | None = typer.Option(
        None, "--keys-dir", help="The fleet's CURVE keys (fleet.key, fleet.key_secret); default: a new pair per run."
    ),
    insecure_wire: bool = typer.Option(
        False,
        "--insecure-wire",
        help="Plain TCP between stages, the gateway and clients: any local process may submit.",
    ),
    speculative_config: str | None = typer.Option(None, "--speculative-config", metavar="JSON", help=SPECULATIVE_HELP),
    gpu_memory_bytes: int | None = typer.Option(None, "--gpu-memory-bytes", min=1, help=GPU_MEMORY_HELP),
    expert_prefetch: str = typer.Option(DEFAULT_EXPERT_PREFETCH.value, "--expert-prefetch", help=EXPERT_PREFETCH_HELP),
    plan_dir: Path | None = typer.Option(
        None, "--plan-dir", help="Folder for this run's plan.json, kept on exit (default: a temporary one, removed)."
    ),
    max_stage_restarts: int = typer.Option(
        3,
        "--max-stage-restarts",
        min=0,
        help="Times a stage or the gateway that exits is restarted (with backoff) before the fleet fails, per "
        "process (as restartPolicy.maxStageRestarts); the head replays its streams into a restarted stage.",
    ),
) -> None:
    """Run a whole fleet on this machine: plan, start every stage and the gateway, wait until ready.

    The stages, the gateway and their clients speak CURVE (authenticated, encrypted) with a key
    pair made for this run, unless --keys-dir brings one or --insecure-wire turns it off."""
    from modelfleet.agent.launcher import LaunchError, LocalFleet, check_ports
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.planner import local_cuda_devices

    if model is None:
        model = DEMO_MODEL
        if not model.is_dir():
            fail(f"the bundled demo model is not at {model} (run from a clone of the repository), or pass --model DIR")
    if not model.is_dir():
        fail(f"model directory {str(model)!r} does not exist; pass --model DIR with a checkpoint")
    formats = plan_formats(experts_format, attention_format, head_format, embeddings_format)
    _check_api_keys(api_keys_file)
    if replicas is not None:
        err.print("[yellow]warning:[/] --replicas is deprecated; it is --groups (pipeline replicas)")
        groups = replicas
    try:
        fleet_plan = make_plan(model, stages, max_streams=max_streams, context_length=context_length,
                               window_rows=window_rows, microbatches=microbatches, max_queue=max_queue, dtype=dtype,
                               device=device, base_port=base_port, groups=groups, tensor=tensor, formats=formats,
                               served_name=served_name,
                               backend=backend, speculative=speculative_option(speculative_config),
                               gpu_memory_bytes=gpu_memory_bytes, expert_prefetch=expert_prefetch,
                               cuda_devices=local_cuda_devices() if device.startswith("cuda") else None)  # fmt: skip
        check_ports(fleet_plan, extra=[port])
    except ModelfleetError as exc:
        fail(str(exc))
    out.print(plan_table(fleet_plan))
    workdir = _run_dir(plan_dir)
    plan_path = _write_plan(fleet_plan, workdir, kept=plan_dir is not None)
    wire_keys = _wire_keys(keys_dir, insecure_wire, workdir)
    fleet = LocalFleet(fleet_plan, plan_path, keys_dir=wire_keys, out=ConsoleLines(out))
    stop_requested = _trap_signals()
    try:
        fleet.start()
        _wait_loaded(fleet, ready_timeout, stop_requested)
        head = fleet_plan.groups[0].stages[0]
        out.print(f"[bold green]fleet ready[/]: head at {head.address} (clients on port {head.client_port}), "
                  f"status at http://{head.host}:{head.http_port}/status")  # fmt: skip
        _start_gateway(fleet, plan_path, host, port, api_keys_file, ready_timeout, wire_keys)
        if wire_keys is not None:
            out.print(f"the fleet's wire is CURVE with the keys in {wire_keys} (clients of the head, such as "
                      f"`modelfleet complete`, need --keys-dir {wire_keys})")  # fmt: skip
        _print_endpoint(fleet_plan, host, port, keyed=api_keys_file is not None or bool(os.environ.get("MF_API_KEYS")))
        failed = _supervise(fleet, max_stage_restarts, stop_requested)
        if failed is not None:
            raise LaunchError(f"the fleet failed: {failed}")
    except _Stopped:
        pass  # Ctrl-C or SIGTERM while loading: a stop, not a failure
    except LaunchError as exc:
        if not stop_requested():  # children that died of the terminal's Ctrl-C are a stop too
            err.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(code=1) from exc
    finally:
        err.print("stopping the fleet...")
        fleet.stop()
        if keys_dir is None and wire_keys is not None:  # this run's pair: no use once its fleet is gone
            shutil.rmtree(wire_keys, ignore_errors=True)
        if plan_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


class ConsoleLines(io.TextIOBase):
    """A text stream that prints each whole line through a rich console, so that the children's
    log lines (the launcher pumps them here) appear above the console's live display while one is
    shown instead of tearing it."""

    def __init__(self, console: Console):
        self.console, self.partial = console, ""

    def write(self, text: str) -> int:
        self.partial += text
        *lines, self.partial = self.partial.split("\n")
        for line in lines:
            self.console.print(line, markup=False, highlight=False, emoji=False)
        return len(text)


def load_progress(console: Console) -> Any:
    from rich.progress import BarColumn, Progress, TextColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} layers"))
    return Progress(*columns, console=console)


def _wait_loaded(fleet: Any, timeout: float, stop_requested: Any) -> None:
    """Wait for the fleet with one live bar per child (every rank of every stage, in the order
    LocalFleet.start spawned them) fed by their /status; the children's log lines go above it
    (ConsoleLines on the same console). Ready means every stage loaded: every bar finishes."""
    layers = [s.num_layers for g in fleet.plan.groups for s in g.stages for _ in range(s.tp_size)]
    with load_progress(out) as progress:
        tasks = [progress.add_task(c.name, total=n) for c, n in zip(fleet.children, layers, strict=True)]

        def show(statuses: list[dict[str, Any] | None]) -> None:
            if stop_requested():
                raise _Stopped
            for task, status in zip(tasks, statuses, strict=False):
                if status is not None:
                    progress.update(task, completed=status.get("layers_loaded", 0))

        fleet.wait_ready(timeout, show)
        for task, total in zip(tasks, layers, strict=True):
            progress.update(task, completed=total)


class _Stopped(Exception):
    """A stop was asked for (SIGINT, SIGTERM) before the fleet was ready."""


def _run_dir(plan_dir: Path | None) -> Path:
    """Where ``up`` writes this run's plan (and keys): ``plan_dir``, made if missing, or a new
    temporary folder (mode 0700) that ``up`` removes on exit."""
    if plan_dir is None:
        return Path(tempfile.mkdtemp(prefix="modelfleet-"))
    try:
        plan_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        fail(f"--plan-dir {plan_dir}: {exc}")
    if (plan_dir / "keys").exists():
        fail(f"--plan-dir {plan_dir} holds keys/ from another run; remove it or choose another folder")
    return plan_dir


def _write_plan(plan: Any, workdir: Path, kept: bool) -> Path:
    """Write the plan into ``workdir`` and say where (``modelfleet complete --plan`` reads it)."""
    plan_path = workdir / "plan.json"
    plan_path.write_text(plan.to_json())
    lifetime = "kept" if kept else "removed when up stops; --plan-dir keeps it"
    out.print(f"plan: {plan_path} (for `modelfleet complete --plan`; {lifetime})", markup=False)
    return plan_path


def _supervise(fleet: Any, max_stage_restarts: int, stop_requested: Any) -> str | None:
    """Restart children that exit (agent.supervisor) until asked to stop; the reason the fleet failed, or None."""
    from modelfleet.agent.supervisor import RestartPolicy, Supervisor

    supervisor = Supervisor(fleet, RestartPolicy(max_stage_restarts), lambda line: err.print(f"[yellow]{line}[/]"))
    while not stop_requested() and supervisor.failed is None:
        supervisor.poll(time.monotonic())
        time.sleep(0.2)
    return supervisor.failed


def _wire_keys(keys_dir: Path | None, insecure: bool, workdir: Path) -> Path | None:
    """Where the fleet's CURVE keys are: ``keys_dir`` (checked now), a pair made for this run in
    ``workdir``, or None (plain TCP) with ``--insecure-wire``, said loudly."""
    from modelfleet.agent import transport
    from modelfleet.engine.errors import ModelfleetError

    if insecure:
        if keys_dir is not None:
            fail("--keys-dir and --insecure-wire disagree; give one of them")
        err.print("[bold red]warning: --insecure-wire:[/] stages, the gateway and the head's client port speak plain "
                  "TCP: any process that can reach them can submit requests (no API key), hold stream slots "
                  "or end other users' streams")  # fmt: skip
        return None
    if keys_dir is not None:
        try:
            transport.load_keypair(keys_dir, "fleet")
        except ModelfleetError as exc:
            fail(f"--keys-dir {keys_dir}: {exc} (make a pair with `modelfleet keys --out {keys_dir}`)")
        return keys_dir
    generated = workdir / "keys"
    generated.mkdir(mode=0o700)
    transport.save_keypair(transport.generate_keypair(), generated, "fleet")
    return generated


def _check_api_keys(keys_file: Path | None) -> None:
    """The gateway's key sources, read as it will (an empty one is an error), before any stage starts."""
    from modelfleet.agent.gateway import load_api_keys
    from modelfleet.engine.errors import ModelfleetError

    try:
        load_api_keys(keys_file, os.environ.get("MF_API_KEYS"))
    except (ModelfleetError, OSError) as exc:
        fail(str(exc))


def _start_gateway(fleet: Any, plan_path: Path, host: str, port: int, keys_file: Path | None, timeout: float,
                   wire_keys: Path | None) -> None:  # fmt: skip
    """Spawn ``modelfleet gateway`` beside the stages and wait until its /readyz answers 200."""
    import urllib.error
    import urllib.request

    from modelfleet.agent.launcher import LaunchError

    command = [sys.executable, "-P", "-m", "modelfleet.cli", "gateway", "--plan", str(plan_path), "--host", host,
               "--port", str(port), *(["--api-keys-file", str(keys_file)] if keys_file else []),
               *(["--keys-dir", str(wire_keys)] if wire_keys else [])]  # fmt: skip
    child = fleet.spawn("gateway", command, {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"})
    url = f"http://{_local(host)}:{port}/readyz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise LaunchError(f"the gateway exited with code {child.process.returncode}; see its log lines above")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise LaunchError(f"the gateway did not report ready at {url} within {timeout:.0f} s")


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _print_endpoint(plan: Any, host: str, port: int, keyed: bool) -> None:
    from modelfleet.engine.tokenizer import TextTokenizer

    base = f"http://{_local(host)}:{port}/v1"
    prompt = json.dumps(starter_prompt(plan.model.path)) if TextTokenizer.exists(plan.model.path) else "[1, 2, 3]"
    body = f'{{"model": "{plan.model.served_name}", "prompt": {prompt}, "max_tokens": 48}}'
    auth = ' -H "Authorization: Bearer $API_KEY"' if keyed else ""
    out.print(f"[bold green]serving[/] {plan.model.served_name} at {base} (OpenAI-compatible; Ctrl-C stops)")
    out.print(f"try: curl {base}/completions -H 'Content-Type: application/json'{auth} -d '{body}'", markup=False)


# The bundled model writes Python and nothing else: what to ask it first (the README's and the model
# card's examples use it). A prompt that stops before a newline lets the model choose the indentation,
# which its tokenizer merges with the newline ("\n    " is one token).
DEMO_PROMPT = "def read_lines(path):"


def starter_prompt(model_path: str | Path) -> str:
    """A first prompt to suggest for ``model_path``: code for the bundled demo model, prose for others."""
    return DEMO_PROMPT if Path(model_path).resolve() == DEMO_MODEL.resolve() else "Hello, my name is"


def _trap_signals():  # type: ignore[no-untyped-def]
    import signal

    flag = {"stop": False}

    def handler(signum: int, frame: Any) -> None:
        flag["stop"] = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return lambda: flag["stop"]


def complete(
    plan_path: Path = typer.Option(..., "--plan", envvar="MF_PLAN", help="The running fleet's plan."),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text (the checkpoint needs tokenizer.json)."),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="Prompt as comma-separated token ids."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0),
    seed: int | None = typer.Option(None, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object last."),
    keys_dir: Path | None = typer.Option(
        None, "--keys-dir", envvar="MF_KEYS_DIR", help="The fleet's CURVE keys, when its head requires them."
    ),
) -> None:
    """Send one prompt to a running fleet's head and stream the answer."""
    from modelfleet.agent import transport
    from modelfleet.agent.client import FleetClient, FleetError
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.engine.sampling import SamplingParams
    from modelfleet.engine.tokenizer import IncrementalDecoder, TextTokenizer
    from modelfleet.plan import load

    if (prompt is None) == (prompt_ids is None):
        fail("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    try:
        fleet_plan = load(plan_path)
        model_dir = Path(fleet_plan.model.path)
        tokenizer = TextTokenizer(model_dir) if prompt is not None else None
        ids = (
            tokenizer.encode(prompt)
            if tokenizer and prompt is not None
            else [int(t) for t in (prompt_ids or "").split(",") if t.strip()]
        )
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
        decoder = IncrementalDecoder(tokenizer) if tokenizer else None
        keys = transport.load_keypair(keys_dir, "fleet") if keys_dir else None
        with FleetClient(fleet_plan.groups[0].stages[0].address, keys=keys) as client:
            request = client.submit(ids, params)
            for token in client.stream(request):
                sys.stdout.write(decoder.push(token) if decoder else f"{token} ")
                sys.stdout.flush()
            result = client.results[request]
    except (ModelfleetError, ValueError) as exc:
        fail(str(exc) if not isinstance(exc, FleetError) else f"the fleet answered: {exc}")
        return
    sys.stdout.write((decoder.flush() if decoder else "") + "\n")
    if as_json:
        print(json.dumps({"token_ids": result.token_ids, "finish_reason": result.finish_reason}))
