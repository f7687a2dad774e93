"""Chaos soak (issue 34): streams survive lost stages, checked token by token.

A local fleet of the bundled demo model, ``--stages`` stages x ``--groups`` pipeline replicas,
behind one gateway, serves ``--streams`` concurrent streamed requests (each resubmitted as it
ends) for ``--seconds``: greedy ones, and a share (``--sampled``) seeded sampled with frequency and
presence penalties, whose tokens must also survive a replay or a failover unchanged. Every ``--every`` seconds (a range) a random stage process, the heads
included, is SIGKILLed (and restarted after a backoff, as ``modelfleet up`` supervises:
:mod:`modelfleet.agent.supervisor`) or SIGSTOPed for ``--stop`` seconds (a range) and continued.
Every completed request is checked against the single-process engine's tokens for the same
prompt and sampling parameters. Faults stop 10 s before the end; requests still running
``--drain`` seconds after it are reported as unfinished, so the program always ends.

Prints and writes (CSV) requests, completed correct, completed wrong, failed, the latency a fault
added to the requests in flight across it (p50/p99 of their latency minus the median of requests
no fault touched), replays (heads' modelfleet_head_replays_total, read before each head is killed
and at the end) and failovers (the gateway's modelfleet_gateway_failovers_total).

    python benchmarks/chaos_soak.py --seconds 180 --streams 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from modelfleet.results import write_csv

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


SAMPLED = {"temperature": 0.8, "top_k": 40, "frequency_penalty": 0.5, "presence_penalty": 0.3}  # and a seed per case


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    max_tokens: int
    seed: int | None  # None: greedy; else sampled with SAMPLED and this seed
    expected: list[int]

    def body(self) -> dict[str, object]:
        sampling = {"temperature": 0} if self.seed is None else {**SAMPLED, "seed": self.seed}
        return {"prompt": self.prompt, "max_tokens": self.max_tokens, **sampling}


@dataclass
class Tally:
    results: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, correct|wrong|failed)
    sampled: list[str] = field(default_factory=list)  # the outcomes of the sampled requests among them
    faults: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, what)
    replays_before_kill: float = 0.0
    unfinished: int = 0  # requests still running when the drain ended
    failures: dict[str, int] = field(default_factory=dict)  # why, and how often
    lock: threading.Lock = field(default_factory=threading.Lock)


def metric(url: str, name: str) -> float:
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def stream(client: httpx.Client, model: str, case: Case) -> list[int] | str:
    """One streamed request's token ids, or why it failed."""
    body = {"model": model, **case.body(), "return_token_ids": True, "stream": True}
    tokens: list[int] = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return f"HTTP {response.status_code}: {response.text[:160]}"
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return f"error event: {chunk['error'].get('message', '')[:160]}"
            tokens += chunk["choices"][0].get("token_ids") or []
    return tokens


def load(url: str, model: str, cases: list[Case], end: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=300) as client:
        while time.monotonic() < end:
            case = rng.choice(cases)
            started = time.monotonic()
            try:
                got = stream(client, model, case)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                got = f"{type(exc).__name__}: {exc}"[:160]
            outcome = "failed" if isinstance(got, str) else "correct" if got == case.expected else "wrong"
            with tally.lock:
                tally.results.append((started, time.monotonic(), outcome))
                if case.seed is not None:
                    tally.sampled.append(outcome)
                if isinstance(got, str):
                    tally.failures[got] = tally.failures.get(got, 0) + 1
            if isinstance(got, str):
                time.sleep(0.5)


def chaos(fleet, supervisor, plan, end: float, args: argparse.Namespace, tally: Tally) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(args.seed)
    stages = [c.name for c in fleet.children if c.name != "gateway"]  # by name: a restart replaces the Child
    while True:
        time.sleep(rng.uniform(*args.every))
        if time.monotonic() > end - 10:
            return
        name = rng.choice(stages)
        index = next(i for i, c in enumerate(fleet.children) if c.name == name)
        child = fleet.children[index]  # the current process in that place
        started = time.monotonic()
        if rng.random() < 0.5:
            what = f"SIGKILL {child.name}"
            if child.status_url and "stage 0" in child.name:
                tally.replays_before_kill += metric(child.status_url.replace("/status", "/metrics"),
                                                    "modelfleet_head_replays_total{")  # fmt: skip
            child.process.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 120
            while fleet.children[index] is child and time.monotonic() < deadline:
                supervisor.poll(time.monotonic())
                time.sleep(0.1)
            while time.monotonic() < deadline and (fleet.statuses()[index] or {}).get("phase") != "Ready":
                supervisor.poll(time.monotonic())
                time.sleep(0.2)
        else:
            stop = rng.uniform(*args.stop)
            what = f"SIGSTOP {child.name} for {stop:.1f} s"
            child.process.send_signal(signal.SIGSTOP)
            time.sleep(stop)
            child.process.send_signal(signal.SIGCONT)
        print(f"[chaos] {what} ({time.monotonic() - started:.1f} s)", flush=True)
        tally.faults.append((started, time.monotonic(), what))


def references(cases: int, sampled: float, seed: int) -> list[Case]:
    from modelfleet.engine.generate import LocalModel, generate_batch
    from modelfleet.engine.sampling import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(4, 40))] for _ in range(cases)]
    lengths = [rng.randrange(24, 96) for _ in range(cases)]
    seeds = [rng.randrange(1 << 20) if i < round(sampled * cases) else None for i in range(cases)]
    lm = LocalModel.load(DEMO, max_slots=cases, max_context=512)
    # the model's EOS stops, as over HTTP
    params = [SamplingParams(max_tokens=n, **({} if s is None else {**SAMPLED, "seed": s}))  # type: ignore[arg-type]
              for n, s in zip(lengths, seeds, strict=True)]  # fmt: skip
    outputs = generate_batch(lm, prompts, params)
    return [Case(p, n, s, o.token_ids) for p, n, s, o in zip(prompts, lengths, seeds, outputs, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--every", type=float, nargs=2, default=(20.0, 40.0), help="seconds between faults")
    parser.add_argument("--stop", type=float, nargs=2, default=(4.0, 10.0), help="seconds a SIGSTOP lasts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--base-port", type=int, default=27100)
    parser.add_argument("--cases", type=int, default=24, help="distinct prompts, each with its reference output")
    parser.add_argument("--sampled", type=float, default=0.25, help="share of seeded sampled requests")
    parser.add_argument("--drain", type=float, default=60.0, help="seconds requests may run past the end")
    parser.add_argument("--workdir", type=Path, default=None, help="for the plan and fleet.log (default: a temp dir)")
    parser.add_argument("--csv", type=Path, default=Path("docs/results/chaos_soak.csv"))
    args = parser.parse_args()

    from modelfleet.agent.launcher import LocalFleet, check_ports
    from modelfleet.agent.supervisor import RestartPolicy, Supervisor
    from modelfleet.commands.fleet import make_plan

    cases = references(args.cases, args.sampled, args.seed)
    print(f"[soak] {len(cases)} reference outputs from the single-process engine", flush=True)
    plan = make_plan(DEMO, args.stages, groups=args.groups, max_streams=8, context_length=512,
                     base_port=args.base_port)  # fmt: skip
    check_ports(plan, extra=[args.port])
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "plan.json").write_text(plan.to_json())
    log = (workdir / "fleet.log").open("w")
    fleet = LocalFleet(plan, workdir / "plan.json", out=log)
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{args.port}"
    try:
        fleet.start()
        fleet.wait_ready(300)
        gateway = [sys.executable, "-P", "-m", "modelfleet.cli", "gateway", "--plan", str(workdir / "plan.json"),
                   "--port", str(args.port), "--no-auth"]  # fmt: skip
        fleet.spawn("gateway", gateway, env)
        deadline = time.monotonic() + 120
        while metric(url + "/metrics", "modelfleet_gateway_ready ") < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"[soak] fleet and gateway ready; {args.streams} streams for {args.seconds:g} s", flush=True)
        supervisor = Supervisor(fleet, RestartPolicy(max_stage_restarts=1000, backoff_seconds=1.0), print)
        tally = Tally()
        end = time.monotonic() + args.seconds
        workers = [threading.Thread(target=load, args=(url, plan.model.served_name, cases, end, tally, i), daemon=True)
                   for i in range(args.streams)]  # fmt: skip
        for worker in workers:
            worker.start()
        chaos(fleet, supervisor, plan, end, args, tally)
        for worker in workers:
            worker.join(max(0.0, end + args.drain - time.monotonic()))
        tally.unfinished = sum(1 for worker in workers if worker.is_alive())
        heads = [c for c in fleet.children if "stage 0" in c.name and c.status_url]
        replays = tally.replays_before_kill + sum(
            metric(c.status_url.replace("/status", "/metrics"), "modelfleet_head_replays_total{") for c in heads
        )
        failovers = metric(url + "/metrics", "modelfleet_gateway_failovers_total{")
    finally:
        fleet.stop()
        log.close()
    report(tally, replays, failovers, args)
    print(f"fleet log: {workdir / 'fleet.log'}")


def report(tally: Tally, replays: float, failovers: float, args: argparse.Namespace) -> None:
    outcomes = [r[2] for r in tally.results]
    touched = [(s, e) for s, e, _ in tally.results if any(s < fe and e > fs for fs, fe, _ in tally.faults)]
    quiet = [e - s for s, e, o in tally.results if (s, e) not in touched and o == "correct"]
    base = statistics.median(quiet) if quiet else 0.0
    added = sorted(max(0.0, (e - s) - base) for s, e in touched)

    def pct(q: float) -> float:
        return added[min(len(added) - 1, int(q * len(added)))] if added else 0.0

    row = {
        "seconds": args.seconds, "stages": args.stages, "groups": args.groups, "streams": args.streams,
        "faults": len(tally.faults), "requests": len(outcomes), "correct": outcomes.count("correct"),
        "wrong": outcomes.count("wrong"), "failed": outcomes.count("failed"), "unfinished": tally.unfinished,
        "sampled_correct": tally.sampled.count("correct"), "sampled_wrong": tally.sampled.count("wrong"),
        "requests_across_a_fault": len(touched), "quiet_latency_p50_s": round(base, 2),
        "added_latency_p50_s": round(pct(0.5), 2), "added_latency_p99_s": round(pct(0.99), 2),
        "replays": int(replays), "failovers": int(failovers),
    }  # fmt: skip
    width = max(map(len, row))
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")
    for _, _, what in tally.faults:
        print(f"  fault: {what}")
    for why, count in sorted(tally.failures.items(), key=lambda item: -item[1]):
        print(f"  failed {count}x: {why}")
    write_csv(args.csv, [row])


if __name__ == "__main__":
    main()
