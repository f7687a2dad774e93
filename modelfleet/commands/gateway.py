"""The ``gateway`` command: serve a running fleet through an OpenAI-compatible HTTP API."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console

err = Console(stderr=True, soft_wrap=True)


def gateway(
    plan_paths: list[Path] = typer.Option(
        ...,
        "--plan",
        envvar="MF_PLAN",
        help="A fleet plan JSON; repeat for several fleets serving one model (every group's head is served).",
    ),
    host: str = typer.Option("127.0.0.1", "--host", envvar="MF_GATEWAY_HOST", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", envvar="MF_GATEWAY_PORT", min=1, max=65535),
    api_keys_file: Path | None = typer.Option(
        None,
        "--api-keys-file",
        envvar="MF_API_KEYS_FILE",
        help="Bearer API keys, one per line, # comments (also MF_API_KEYS).",
    ),
    no_auth: bool = typer.Option(
        False, "--no-auth", envvar="MF_NO_AUTH", help="Serve without API keys (no key source may be given)."
    ),
    metrics_auth: bool = typer.Option(False, "--metrics-auth", help="Require an API key for /metrics too."),
    max_streams: int | None = typer.Option(
        None, "--max-streams", min=1, help="Streams per head; default: each plan's max_streams."
    ),
    max_queue: int | None = typer.Option(None, "--max-queue", min=0, help="Default: the first plan's max_queue."),
    queue_timeout: float | None = typer.Option(
        None,
        "--queue-timeout",
        min=0.001,
        help="Seconds a request may wait; default: the first plan's queue_timeout_seconds.",
    ),
    retries: int = typer.Option(
        1,
        "--retries",
        envvar="MF_GATEWAY_RETRIES",
        min=0,
        help="Further heads a request is tried on when its head fails it before any of its text was sent.",
    ),
    max_body_bytes: int = typer.Option(4 << 20, "--max-body-bytes", min=1024, help="Larger request bodies get 413."),
    model_dir: Path | None = typer.Option(
        None,
        "--model-dir",
        envvar="MF_MODEL_DIR",
        help="Tokenizer and config directory; default: the plan's model path.",
    ),
    keys_dir: Path | None = typer.Option(
        None, "--keys-dir", envvar="MF_KEYS_DIR", help="Folder with fleet.key and fleet.key_secret (CURVE to the head)."
    ),
    log_level: str = typer.Option("INFO", "--log-level", envvar="MF_LOG_LEVEL"),
) -> None:
    """Serve the fleet's model at /v1/completions and /v1/chat/completions (OpenAI-compatible, streaming)."""
    import logging

    import uvicorn

    from modelfleet.agent import transport
    from modelfleet.agent.gateway import Gateway, GatewayConfig, load_api_keys
    from modelfleet.engine.errors import ModelfleetError
    from modelfleet.plan import load

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        api_keys = load_api_keys(api_keys_file, os.environ.get("MF_API_KEYS"), no_auth)  # fails closed, first
        plans = [load(path) for path in plan_paths]
        config = GatewayConfig.of(
            plans[0], more_plans=tuple(plans[1:]), max_streams=max_streams, max_queue=max_queue,
            queue_timeout_seconds=queue_timeout, retries=retries,
            api_keys=api_keys, metrics_auth=metrics_auth,
            max_body_bytes=max_body_bytes, model_dir=model_dir,
            keys=transport.load_keypair(keys_dir, "fleet") if keys_dir else None,
        )  # fmt: skip
        app = Gateway(config).app
        if not config.api_keys and not no_auth:
            err.print("[bold yellow]warning:[/] no API keys (--api-keys-file, MF_API_KEYS): every request is "
                      "accepted; pass --no-auth to say that is meant")  # fmt: skip
    except (ModelfleetError, OSError) as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(code=2) from exc
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), access_log=False)
