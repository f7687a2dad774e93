"""Write examples/summaries/*.json: each example fleet's model summary, as `modelfleet inspect`
makes it of the checkpoint (or config-only directory) the example names.

python tools/summaries.py            # rewrite the summaries
python tools/summaries.py --check    # exit 1 if one is out of date

mixed-fleet.json is the one written by hand: a Qwen3-30B-A3B-sized model of 48 equal layers
(1.25 GB each) whose checkpoint is not in the repository.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARIES = ROOT / "examples" / "summaries"
# summary name -> the directory `modelfleet inspect` reads, relative to the repository root
SOURCES = {
    "cascadia-11-aipc": "examples/configs/inkling-975b",
    "freetoken-4gpu": "examples/configs/deepseek-v4-flash",
    "local-cpu": "models/demo",
}
HAND_WRITTEN = ("mixed-fleet",)


def render(name: str) -> str:
    """The summary ``name`` as inspect prints it, indented for review (the summaries are read as JSON)."""
    from modelfleet.operator.summary import inspect_checkpoint

    return inspect_checkpoint(ROOT / SOURCES[name]).model_dump_json(indent=1) + "\n"


def main() -> None:
    stale = []
    for name in SOURCES:
        path, text = SUMMARIES / f"{name}.json", render(name)
        if "--check" in sys.argv:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python tools/summaries.py", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
