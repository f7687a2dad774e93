"""``modelfleet chat``: a terminal client that streams answers from a gateway."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import typer
from rich.console import Console

from modelfleet.commands.fleet import DEMO_MODEL, DEMO_PROMPT

err = Console(stderr=True, soft_wrap=True)


def _post(url: str, body: dict, api_key: str | None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")


def stream_chat(url: str, body: dict, api_key: str | None, timeout: float) -> Iterator[str]:
    """The content pieces of a streamed chat completion (Server-Sent Events)."""
    with urllib.request.urlopen(_post(url + "/v1/chat/completions", body, api_key), timeout=timeout) as response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "the gateway reported an error"))
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    yield piece


def _model_name(url: str, api_key: str | None, timeout: float) -> str:
    request = urllib.request.Request(
        url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return str(json.loads(response.read())["data"][0]["id"])


def chat(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The gateway (what `modelfleet up` printed)."),
    model: str | None = typer.Option(None, "--model", help="Served model name (default: the gateway's first)."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="Most tokens an answer may have."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 is greedy (the same answer each time)."),
    stop: str = typer.Option(
        "\n\n\n", "--stop", help="An answer ends at this text (default: two blank lines); empty: no stop text."
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="MF_API_KEY", help="Bearer key, if the gateway has keys."
    ),
    system: str | None = typer.Option(None, "--system", help="A system message to start the conversation."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait for an answer."),
) -> None:
    """Chat with a running fleet in the terminal; answers stream as they are generated. Ctrl-D ends."""
    url = url.rstrip("/")
    try:
        name = model or _model_name(url, api_key, timeout)
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
        err.print(f"[bold red]error:[/] no gateway answers at {url} ({exc}); start one with `modelfleet up`")
        raise typer.Exit(code=2) from exc
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    if interactive:
        err.print(f"chatting with {name} at {url} (Ctrl-D ends)")
        if name == DEMO_MODEL.name:
            err.print(f"the demo model writes Python and knows no prose: start some code, e.g. {DEMO_PROMPT}")
    while True:
        if interactive:
            err.print("[bold cyan]you>[/] ", end="")
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        body = {
            "model": name,
            "messages": messages,
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": temperature,
            **({"stop": [stop]} if stop else {}),
        }
        answer = []
        try:
            for piece in stream_chat(url, body, api_key, timeout):
                answer.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")
            err.print(f"\n[bold red]error:[/] the gateway answered {exc.code}: {detail}")
            messages.pop()
            continue
        except (urllib.error.URLError, OSError, RuntimeError) as exc:
            err.print(f"\n[bold red]error:[/] {exc}")
            messages.pop()
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})
