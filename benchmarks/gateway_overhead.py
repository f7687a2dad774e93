"""What the gateway adds per token: the gateway in front of a stand-in head, many streaming clients.

The stand-in head (its own process) speaks the head's protocol (ZeroMQ ROUTER at the plan's
client port, ``/status`` at its HTTP port) and, for every submitted request, sends one token every ``--period-ms``
on a fixed schedule, stamping nothing on the wire; it records each token's scheduled and actual
send time (its own emission jitter: the bound on what this benchmark can resolve). The gateway
runs under uvicorn in its own process, as ``modelfleet gateway`` does. The clients (a third
process, aiohttp, one SSE stream each) record when each token's chunk arrives. All three read
the same machine's monotonic clock, so per token

    added = client arrival - scheduled emission      path = client arrival - actual send

``added`` is the latency the gateway (with ZeroMQ, HTTP and the client's parsing) adds over a
head that emits exactly on time; ``path`` leaves out the stand-in's own lateness. The first token
of each stream (which also carries the response's start) is reported apart from the rest.

Two emission patterns: ``spread`` (streams start evenly over one period, so tokens arrive
steadily) and ``burst`` (every stream's tokens fall on one shared tick, as a head's decode step
emits a token for every stream of a group at once). A run is ``sustained`` when every token
arrives and the median ``path`` stays under one period (a gateway that cannot keep up builds a
backlog, and ``path`` grows through the run).

    python benchmarks/gateway_overhead.py --streams 16,64,256 --tokens 100 --out out/gateway_overhead.csv
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import multiprocessing as mp
import os
import random
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from modelfleet.results import write_csv

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "models" / "demo"
PROMPT_BASE = 10  # client i sends the prompt [PROMPT_BASE + i % 1000, PROMPT_BASE + i // 1000]


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports: the stand-in head's three, then the gateway's."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        if all(port_free(base + k) for k in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ---- the stand-in head ------------------------------------------------------------------------


def stand_in_head(port: int, token_id: int, period_s: float, burst: bool, records: Any, stop: Any,
                  cpus: set[int] | None = None) -> None:  # fmt: skip
    """Tokens on schedule for every submit; on stop, puts {prompt key: [(scheduled, sent), ...]}."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    import zmq

    sys.path.insert(0, str(REPO))
    from modelfleet.agent import transport as wire

    class Status(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = b'{"ready": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    from modelfleet.plan import stage_at

    head = stage_at(f"127.0.0.1:{port}")  # the head's other ports, as the plan derives them
    http = ThreadingHTTPServer(("127.0.0.1", head.http_port), Status)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{head.client_port}")
    due: list[tuple[float, int, bytes, int]] = []  # (scheduled, sequence, client, request_id)
    streams: dict[tuple[bytes, int], dict[str, Any]] = {}
    log: dict[str, list[tuple[float, float]]] = {}
    sequence = 0
    while not stop.is_set():
        now = time.monotonic()
        while due and due[0][0] <= now:
            scheduled, _, client, request_id = heapq.heappop(due)
            stream = streams.get((client, request_id))
            if stream is None:
                continue  # cancelled
            stream["left"] -= 1
            last = stream["left"] == 0
            msg = wire.OutputMsg(request_id=request_id, token_ids=(token_id,), finish_reason="length" if last else None)
            router.send_multipart([client, *wire.encode(msg)])
            # stamped when the send returns: on an idle machine a client may read it a few us sooner
            log[stream["key"]].append((scheduled, time.monotonic()))
            if last:
                del streams[client, request_id]
            else:
                sequence += 1
                heapq.heappush(due, (scheduled + period_s, sequence, client, request_id))
        wait_ms = 50 if not due else max(0, int((due[0][0] - time.monotonic()) * 1000))
        if not router.poll(wait_ms):
            continue
        while True:
            try:
                client, *parts = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = wire.decode(parts)
            if isinstance(msg, wire.SubmitMsg):
                received = time.monotonic()
                first = (int(received / period_s) + 1) * period_s if burst else received + period_s
                key = ",".join(map(str, msg.prompt_ids.tolist()))
                streams[client, msg.request_id] = {"key": key, "left": msg.max_tokens}
                log[key] = []
                sequence += 1
                heapq.heappush(due, (first, sequence, client, msg.request_id))
            elif isinstance(msg, wire.CancelMsg):
                streams.pop((client, msg.request_id), None)
    records.put(log)
    router.close(linger=0)
    context.term()
    http.shutdown()


# ---- the gateway ------------------------------------------------------------------------------


def gateway_process(plan_json: str, port: int, max_streams: int, cpus: set[int] | None = None,
                    server: tuple[str, str] = ("auto", "auto")) -> None:  # fmt: skip
    if cpus:
        os.sched_setaffinity(0, cpus)  # the gateway alone on these CPUs (the others run elsewhere)
    sys.path.insert(0, str(REPO))
    import logging

    import uvicorn

    from modelfleet.agent.gateway import Gateway, GatewayConfig
    from modelfleet.plan import FleetPlan

    logging.basicConfig(level="WARNING")
    config = GatewayConfig.of(FleetPlan.from_json(plan_json), max_streams=max_streams, max_queue=max_streams)
    loop, http = server
    uvicorn.run(Gateway(config).app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                loop=loop, http=http)  # fmt: skip


# ---- the clients ------------------------------------------------------------------------------


async def one_stream(session: Any, url: str, model: str, index: int, tokens: int, delay: float) -> tuple[str, list]:
    """The stream's prompt key and its tokens' arrival times; a failed stream is named in FAILED."""
    await asyncio.sleep(delay)
    prompt = [PROMPT_BASE + index % 1000, PROMPT_BASE + index // 1000]
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    arrivals: list[float] = []
    key = ",".join(map(str, prompt))
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            async for line in response.content:
                if line.startswith(b"data: {"):
                    arrived = time.monotonic()
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"error event: {event['error']['message']}")
                    # a gateway behind its head merges the tokens waiting into one chunk: each arrived now
                    arrivals += [arrived] * len(event["choices"][0]["token_ids"])
    except Exception as exc:  # counted and shown, so one broken stream does not hide the rest
        arrivals.append(float("nan"))
        print(f"stream {index} failed after {len(arrivals) - 1} tokens: {type(exc).__name__}: {exc}"[:300])
    return key, arrivals


async def all_streams(url: str, model: str, streams: int, tokens: int, spread_s: float) -> dict[str, list]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        jobs = [one_stream(session, url, model, i, tokens, spread_s * i / streams) for i in range(streams)]
        return dict(await asyncio.gather(*jobs))


def clients_process(url: str, model: str, streams: int, tokens: int, spread_s: float, results: Any,
                    cpus: set[int] | None = None) -> None:  # fmt: skip
    if cpus:
        os.sched_setaffinity(0, cpus)
    results.put(asyncio.run(all_streams(url, model, streams, tokens, spread_s)))


# ---- one run ----------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_http(url: str, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s")


def run(plan: Any, token_id: int, streams: int, tokens: int, period_s: float, pattern: str,
        gateway_cpus: set[int] | None = None, server: tuple[str, str] = ("auto", "auto")) -> dict[str, Any]:  # fmt: skip
    ctx = mp.get_context("spawn")
    others = (set(range(os.cpu_count() or 1)) - gateway_cpus) or None if gateway_cpus else None
    records, results, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    head_port = plan.groups[0].stages[0].port
    head = ctx.Process(
        target=stand_in_head, args=(head_port, token_id, period_s, pattern == "burst", records, stop, others)
    )
    gateway_port = plan.groups[0].stages[0].rendezvous_port  # free: the stand-in head has no tensor group
    gateway = ctx.Process(target=gateway_process, args=(plan.to_json(), gateway_port, streams, gateway_cpus, server))
    head.start()
    gateway.start()
    try:
        wait_http(f"http://127.0.0.1:{gateway_port}/readyz", 60)
        url = f"http://127.0.0.1:{gateway_port}/v1/completions"
        spread_s = period_s if pattern == "spread" else 0.0
        clients = ctx.Process(target=clients_process,
                              args=(url, plan.model.served_name, streams, tokens, spread_s, results, others))  # fmt: skip
        started, cpu_before = time.monotonic(), cpu_seconds(gateway.pid)  # type: ignore[arg-type]
        clients.start()
        arrivals: dict[str, list[float]] = results.get(timeout=600)
        wall = time.monotonic() - started
        gateway_cpu = cpu_seconds(gateway.pid) - cpu_before  # type: ignore[arg-type]
        clients.join()
        stop.set()
        emitted: dict[str, list[tuple[float, float]]] = records.get(timeout=30)
    finally:
        stop.set()
        gateway.terminate()
        gateway.join(10)
        head.join(10)
        if head.is_alive():
            head.terminate()
    row = summarize(streams, tokens, period_s, pattern, arrivals, emitted, wall, gateway_cpu)
    return {"server": "+".join(resolved(*server)), **row}


def resolved(loop: str, http: str) -> tuple[str, str]:
    """The event loop and HTTP parser uvicorn picks: "auto" means uvloop and httptools when installed."""
    import importlib.util

    def have(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return ("uvloop" if loop == "auto" and have("uvloop") else "asyncio" if loop == "auto" else loop,
            "httptools" if http == "auto" and have("httptools") else "h11" if http == "auto" else http)  # fmt: skip


def summarize(streams: int, tokens: int, period_s: float, pattern: str, arrivals: dict[str, list[float]],
              emitted: dict[str, list[tuple[float, float]]], wall: float, gateway_cpu: float) -> dict[str, Any]:  # fmt: skip
    added, path, jitter, first = [], [], [], []
    delivered = 0
    failed = sum(1 for times in arrivals.values() if times and math.isnan(times[-1]))
    arrivals = {key: [t for t in times if not math.isnan(t)] for key, times in arrivals.items()}
    for key, times in arrivals.items():
        schedule = emitted.get(key, [])
        delivered += len(times)
        for k, (arrived, (scheduled, sent)) in enumerate(zip(times, schedule, strict=False)):
            (first if k == 0 else added).append(arrived - scheduled)
            if k:
                path.append(arrived - sent)
            jitter.append(sent - scheduled)
    ms = 1000.0
    return {
        "pattern": pattern, "streams": streams, "tokens_per_stream": tokens, "period_ms": period_s * ms,
        "offered_tokens_per_s": round(streams / period_s), "delivered_tokens": delivered, "failed_streams": failed,
        "expected_tokens": streams * tokens, "wall_s": round(wall, 2),
        "gateway_cpu_share": round(gateway_cpu / wall, 2),  # of one core, over the clients' run
        "gateway_cpu_us_per_token": round(gateway_cpu / max(1, delivered) * 1e6, 1),
        "added_p50_ms": percentile(added, 0.5) * ms, "added_p99_ms": percentile(added, 0.99) * ms,
        "added_max_ms": max(added, default=float("nan")) * ms,
        "path_p50_ms": percentile(path, 0.5) * ms, "path_p99_ms": percentile(path, 0.99) * ms,
        "first_token_added_p50_ms": percentile(first, 0.5) * ms, "first_token_added_p99_ms": percentile(first, 0.99) * ms,
        "jitter_p50_ms": percentile(jitter, 0.5) * ms, "jitter_p99_ms": percentile(jitter, 0.99) * ms,
        # kept pace: every token came, and the typical token left the gateway within one period of its send
        "sustained": delivered == streams * tokens and percentile(path, 0.5) < period_s,
    }  # fmt: skip


# ---- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="16,64,256", help="comma-separated concurrent streams per run")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    parser.add_argument("--period-ms", type=float, default=20.0, help="the stand-in's time between a stream's tokens")
    parser.add_argument("--patterns", default="spread,burst", help="spread and/or burst")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL, help="tokenizer and config for the gateway")
    parser.add_argument("--out", type=Path, default=Path("out/gateway_overhead.csv"))
    parser.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                        help="uvicorn's event loop for the gateway (auto: uvloop when installed)")  # fmt: skip
    parser.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                        help="uvicorn's HTTP parser for the gateway (auto: httptools when installed)")  # fmt: skip
    parser.add_argument("--gateway-cpus", default="", help="pin the gateway to these CPUs (e.g. 0,1) and the rest away")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from modelfleet.commands.fleet import make_plan
    from modelfleet.engine.tokenizer import TextTokenizer

    token_id = TextTokenizer(args.model).encode(" the")[-1]
    counts = [int(n) for n in args.streams.split(",")]
    rows = []
    for pattern in args.patterns.split(","):
        for streams in counts:
            plan = make_plan(args.model, 1, max_streams=streams, context_length=args.tokens + 16,
                             base_port=free_ports(4))  # fmt: skip
            cpus = {int(c) for c in args.gateway_cpus.split(",") if c}
            row = run(plan, token_id, streams, args.tokens, args.period_ms / 1000, pattern, cpus or None,
                      (args.loop, args.http))  # fmt: skip
            rows.append(row)
            print_row(row, header=len(rows) == 1)
    write_csv(args.out, rows)
    where = f"the gateway on CPUs {args.gateway_cpus}" if args.gateway_cpus else "all processes sharing them"
    load = os.getloadavg()[0]
    server = rows[0]["server"]
    print(f"\n{os.cpu_count()} CPUs, {where}; the gateway on uvicorn with {server}; load average {load:.1f} at the end;"
          f" wrote {args.out}")  # fmt: skip
    print(json.dumps({"goal": "p99 added < 5 ms at 256 streams", "measured": {
        f"{r['pattern']}/{r['streams']}": round(r["added_p99_ms"], 2) for r in rows}}))  # fmt: skip


def print_row(row: dict[str, Any], header: bool) -> None:
    columns = [("pattern", "{:>7}"), ("streams", "{:>7}"), ("offered_tokens_per_s", "{:>9}"),
               ("delivered_tokens", "{:>9}"), ("added_p50_ms", "{:>9.2f}"), ("added_p99_ms", "{:>9.2f}"),
               ("path_p50_ms", "{:>9.2f}"), ("path_p99_ms", "{:>9.2f}"), ("first_token_added_p99_ms", "{:>9.2f}"),
               ("jitter_p50_ms", "{:>9.2f}"), ("jitter_p99_ms", "{:>9.2f}"), ("gateway_cpu_share", "{:>9.2f}"),
               ("gateway_cpu_us_per_token", "{:>9.1f}"), ("sustained", "{!s:>9}")]  # fmt: skip
    if header:
        names = ["pattern", "streams", "tok/s", "tokens", "add p50", "add p99", "path p50", "path p99",
                 "1st p99", "jit p50", "jit p99", "gw cpu", "gw us/tok", "sustained"]  # fmt: skip
        print(" ".join(f"{n:>9}" if i > 1 else f"{n:>7}" for i, n in enumerate(names)))
        print(
            "  (ms; add = arrival - scheduled, path = arrival - sent, jit = sent - scheduled at the stand-in;"
            " gw cpu = the gateway's share of one core, gw us/tok = its CPU per token)"
        )
    print(" ".join(fmt.format(row[name]) for name, fmt in columns))


if __name__ == "__main__":
    main()
