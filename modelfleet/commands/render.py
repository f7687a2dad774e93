"""Kubernetes commands: ``render`` (the objects the operator would create), ``operator``, and
``inspect`` (a checkpoint's summary, as the operator's inspection Job reports it).

``render`` runs the operator's own planner and builders on files, offline: a ModelFleet manifest,
Node objects (``kubectl get nodes -o yaml`` output, a YAML list, or several documents) and the
model summary (a JSON file, or a local checkpoint to inspect).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
import yaml
from rich.console import Console

app = typer.Typer()
err = Console(stderr=True, soft_wrap=True)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the plan JSON) as literal blocks, readable in the output."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_Dumper.add_representer(str, _str)


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code=2)


def _documents(path: Path) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        _fail(f"cannot read {path}: {exc}")
        return []


def _nodes(path: Path) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = []
    for doc in _documents(path):
        items = doc if isinstance(doc, list) else doc.get("items", [doc]) if isinstance(doc, dict) else []
        nodes += [item for item in items if isinstance(item, dict) and item.get("kind", "Node") == "Node"]
    return nodes


@app.command()
def render(
    fleet_file: Path = typer.Option(..., "--fleet", help="ModelFleet manifest (YAML)."),
    nodes_file: Path = typer.Option(..., "--nodes", help="Node objects (YAML), e.g. `kubectl get nodes -o yaml`."),
    summary_file: Path | None = typer.Option(None, "--model-summary", help="Model summary JSON."),
    model_dir: Path | None = typer.Option(None, "--model", help="Local checkpoint to summarise instead."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Compute dtype when summarising --model."),
) -> None:
    """Print the objects the operator would create for a ModelFleet on these nodes (YAML)."""
    import zmq

    from modelfleet.operator import objects
    from modelfleet.operator.placement import Infeasible, place
    from modelfleet.operator.spec import SpecError, parse_spec
    from modelfleet.operator.summary import ModelSummary, inspect_checkpoint
    from modelfleet.plan import PlanError

    if (summary_file is None) == (model_dir is None):
        _fail("give exactly one of --model-summary FILE or --model DIR")
    fleets = [d for d in _documents(fleet_file) if isinstance(d, dict) and d.get("kind") == "ModelFleet"]
    if len(fleets) != 1:
        _fail(f"{fleet_file} must hold exactly one ModelFleet, found {len(fleets)}")
    fleet = fleets[0]
    fleet.setdefault("metadata", {}).setdefault("namespace", "default")
    try:
        spec = parse_spec(fleet.get("spec") or {})
        summary = (
            ModelSummary.from_json(summary_file.read_text())
            if summary_file
            else inspect_checkpoint(model_dir or "", dtype)
        )
    except (SpecError, PlanError, OSError) as exc:
        _fail(str(exc))
        return
    meta = fleet["metadata"]
    placement = place(spec, summary, _nodes(nodes_file), meta["name"], meta["namespace"])
    if isinstance(placement, Infeasible):
        _fail(
            f"{placement.reason}: {placement.message} (nodes considered: {', '.join(placement.nodes_considered) or 'none'})"
        )
        return
    public, secret = zmq.curve_keypair()  # the operator makes the pair once per fleet, as here
    rendered = [
        *objects.fleet_objects(fleet, spec, placement),
        objects.transport_secret(fleet, public.decode(), secret.decode()),
    ]
    typer.echo(yaml.dump_all(rendered, Dumper=_Dumper, sort_keys=False), nl=False)


TERMINATION_LOG = Path("/dev/termination-log")
TERMINATION_LOG_BYTES = 4096  # what the kubelet keeps of a termination message


@app.command()
def inspect(
    source: str | None = typer.Argument(
        None, metavar="CHECKPOINT", help="Checkpoint directory, hf://ORG/NAME or hf://ORG/NAME@REV (or --model)."
    ),
    model: str | None = typer.Option(None, "--model", help="Checkpoint directory, hf://ORG/NAME or hf://ORG/NAME@REV."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Compute dtype the sizes are counted at."),
    output: Path | None = typer.Option(None, "--output", help="Write the JSON here (errors too) instead of stdout."),
) -> None:
    """Print a checkpoint's model summary (JSON), read from its config and safetensors headers only.

    For hf:// the headers are read with HTTP Range requests (HF_TOKEN, HF_ENDPOINT as for fetch):
    no tensor bytes are downloaded."""
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.operator.summary import inspect_checkpoint

    if (source is None) == (model is None):
        _fail("give the checkpoint once: a directory or hf:// URI, as an argument or with --model")
    checkpoint = str(source or model)
    try:
        text = inspect_checkpoint(checkpoint, dtype).model_dump_json()
        if output == TERMINATION_LOG and len(text) > TERMINATION_LOG_BYTES:
            raise ModelfleetError(
                f"the summary is {len(text)} bytes; a termination message holds {TERMINATION_LOG_BYTES}"
            )
    except (ModelfleetError, OSError) as exc:
        message = str(exc) if str(exc).startswith(checkpoint) else f"{checkpoint}: {exc}"
        if output is not None:
            output.write_text(message)
        _fail(message)
        return
    if output is None:
        typer.echo(text)
    else:
        output.write_text(text)


@app.command()
def operator(
    namespace: list[str] = typer.Option([], "--namespace", "-n", help="Namespace to serve (repeatable)."),
    all_namespaces: bool = typer.Option(False, "--all-namespaces", "-A", help="Serve every namespace."),
    standalone: bool = typer.Option(False, "--standalone", help="No peering with other operator replicas."),
    liveness: str | None = typer.Option(None, "--liveness", help="e.g. http://0.0.0.0:8080/healthz"),
    metrics_port: int | None = typer.Option(None, "--metrics-port", min=1, max=65535, help="Serve /metrics here."),
) -> None:
    """Run the ModelFleet operator (kopf) against the current cluster."""
    import kopf

    import modelfleet.operator.handlers  # noqa: F401  (registers the handlers)
    from modelfleet.operator import metrics

    if bool(namespace) == all_namespaces:
        _fail("give --namespace NS (one or more) or --all-namespaces")
    if metrics_port is not None:
        metrics.serve(metrics_port)
    kopf.run(clusterwide=all_namespaces, namespaces=namespace, standalone=standalone, liveness_endpoint=liveness)
