"""A starved but living stage must not be called dead (issue 30, item 4); a stopped one must.

A local three-stage fleet of the bundled demo model serves ``--streams`` streams, each resubmitted
as it ends, for ``--seconds``. Meanwhile stage 1 runs only ``--run`` seconds out of every
``--stop`` + ``--run`` (SIGSTOP, then SIGCONT): a stand-in for a stage that gets little CPU on an
overloaded machine, but lives. Then, after ``--recover`` seconds of running normally (the head
forgets how late the stage beat), stage 1 is stopped for good and the time until a stream fails
is measured. Prints a table and writes CSV: streams finished, by how they ended, and the
seconds from the final SIGSTOP to the failure.

    python benchmarks/liveness_starved.py --seconds 40 --stop 2.0 --run 0.3
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from modelfleet.results import write_csv

if TYPE_CHECKING:
    from modelfleet.agent.client import FleetClient

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


def starve(process: subprocess.Popen[str], stop: float, run: float, done: threading.Event) -> None:
    while not done.is_set():
        process.send_signal(signal.SIGSTOP)
        time.sleep(stop)
        process.send_signal(signal.SIGCONT)
        time.sleep(run)


def serve(client: FleetClient, seconds: float, streams: int) -> collections.Counter[str]:
    """Keep ``streams`` streams running for ``seconds``; how the finished ones ended."""
    from modelfleet.engine.sampling import SamplingParams

    rng, ended, active = random.Random(0), collections.Counter[str](), set[int]()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        while len(active) < streams:
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(8, 32))]
            active.add(client.submit(prompt, SamplingParams(max_tokens=16, stop_token_ids=())))
            if ended["not_ready"] > 0:
                time.sleep(0.05)  # a refused submit comes back at once: do not spin on it
        client.poll(0.05)
        for request in [r for r in active if client.results[r].finish_reason is not None]:
            active.discard(request)
            result = client.results[request]
            ended[result.code or result.finish_reason or "?"] += 1
            if result.code and ended[result.code] == 1:
                print(result.code, result.error)
    return ended


def time_to_fail(client: FleetClient, process: subprocess.Popen[str]) -> float:
    """Seconds from a SIGSTOP of ``process`` (a stage) to the failure of a stream it serves."""
    from modelfleet.engine.sampling import SamplingParams

    process.send_signal(signal.SIGCONT)
    request = client.submit([1, 2, 3], SamplingParams(max_tokens=1000, stop_token_ids=()))
    while not client.results[request].token_ids:
        client.poll(0.05)
    process.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    client.wait([request])
    return time.monotonic() - stopped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stop", type=float, default=2.0, help="seconds stage 1 is stopped each cycle")
    parser.add_argument("--run", type=float, default=0.3, help="seconds stage 1 runs each cycle")
    parser.add_argument("--recover", type=float, default=20.0, help="seconds stage 1 runs freely before its stop")
    parser.add_argument("--base-port", type=int, default=27700)
    parser.add_argument("--out", default="out/liveness_starved.csv")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from modelfleet.agent.client import FleetClient
    from modelfleet.agent.launcher import LocalFleet, check_ports
    from modelfleet.commands.fleet import make_plan

    plan = make_plan(DEMO, 3, max_streams=args.streams, context_length=256, window_rows=4, base_port=args.base_port)
    check_ports(plan)
    workdir = Path(tempfile.mkdtemp(prefix="mf-liveness-"))
    plan_path = workdir / "plan.json"
    plan_path.write_text(plan.to_json())
    log = (workdir / "fleet.log").open("w")
    fleet = LocalFleet(plan, plan_path, out=log)
    os.environ["OMP_NUM_THREADS"] = "1"  # three stages share the cores; spinning OpenMP threads would starve them more
    fleet.start()
    done = threading.Event()
    try:
        fleet.wait_ready(300)
        stage = fleet.children[1].process
        with FleetClient(plan.groups[0].stages[0].address, timeout_seconds=120) as client:
            threading.Thread(target=starve, args=(stage, args.stop, args.run, done), daemon=True).start()
            ended = serve(client, args.seconds, args.streams)
            done.set()
            time.sleep(args.stop + args.run)
            stage.send_signal(signal.SIGCONT)
            time.sleep(args.recover)
            fail_seconds = time_to_fail(client, stage)
            stage.send_signal(signal.SIGCONT)
    finally:
        done.set()
        fleet.stop()
        log.close()

    row = {"seconds": args.seconds, "streams": args.streams, "stop_s": args.stop, "run_s": args.run,
           "finished": ended.get("length", 0) + ended.get("stop", 0), "stage_lost": ended.get("stage_lost", 0),
           "not_ready": ended.get("not_ready", 0), "sigstop_to_failure_s": round(fail_seconds, 2)}  # fmt: skip
    table = Table(title=f"stage 1 of 3 runs {args.run} s of every {args.stop + args.run} s, {args.streams} streams")
    for column in row:
        table.add_column(column, justify="right")
    table.add_row(*(str(v) for v in row.values()))
    Console().print(table)
    write_csv(Path(args.out), [row])


if __name__ == "__main__":
    main()
