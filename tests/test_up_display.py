"""`modelfleet up`'s load display: one live display of one bar per stage rank, fed by their /status,
with the stages' log lines printed whole above it; when the fleet is ready every bar has finished."""

from __future__ import annotations

import io
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rich.console import Console

from modelfleet.commands import fleet as fleet_command

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


class FakeFleet:
    """Three stages whose statuses arrive as a launcher's would, and whose log lines are written in
    fragments through ConsoleLines while the display is live; the third stage never reports before
    the fleet is ready (its last statuses were lost to a slow poll)."""

    def __init__(self, plan: Any, log: io.TextIOBase):
        self.plan, self.log = plan, log
        self.children = [SimpleNamespace(name=f"stage {s.stage_index}") for s in plan.groups[0].stages]

    def wait_ready(self, timeout: float, show: Any) -> None:
        for loaded in range(3):
            self.log.write(f"[stage {loaded}] INFO loading layers")
            self.log.write(f" of stage {loaded}\n")
            show([{"layers_loaded": loaded}, {"layers_loaded": min(loaded, 1)}, None])


def test_with_three_stages_every_bar_appears_and_finishes_with_the_log_lines_whole_above_it(monkeypatch):
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100, color_system=None)
    monkeypatch.setattr(fleet_command, "out", console)
    plan = fleet_command.make_plan(DEMO, 3)
    fleet_command._wait_loaded(FakeFleet(plan, fleet_command.ConsoleLines(console)), 10.0, lambda: False)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())  # the cursor moves of the live display
    for stage in range(3):
        assert f"[stage {stage}] INFO loading layers of stage {stage}" in text.splitlines()
    final = text.splitlines()[-3:]
    assert [line.split()[:2] for line in final] == [["stage", "0"], ["stage", "1"], ["stage", "2"]]
    assert all(line.endswith("2/2 layers") for line in final), final


def test_a_stop_while_loading_leaves_the_display_without_finishing_the_bars(monkeypatch):
    import pytest

    console = Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)
    monkeypatch.setattr(fleet_command, "out", console)
    plan = fleet_command.make_plan(DEMO, 3)
    with pytest.raises(fleet_command._Stopped):
        fleet_command._wait_loaded(FakeFleet(plan, fleet_command.ConsoleLines(console)), 10.0, lambda: True)
