"""Building a proposer from a speculative config, a draft model included.

Apart from :mod:`.speculator` because a draft model is a whole engine model
(:mod:`engine.generate`), which imports the scheduler, which imports the speculator: the callers
that build (``generate``, the stage agent) import this module; the scheduler never does.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .config import SpeculativeConfig
from .draft import DraftModelProposer
from .mtp import MtpProposer
from .proposers import Proposer, simple_proposer


def build_proposer(
    config: SpeculativeConfig,
    target: str | Path | None = None,
    max_streams: int = 1,
    device: str = "cpu",
    max_context: int = 4096,
) -> Proposer:
    """The proposer ``config.method`` names, ready to propose. A draft model is loaded on
    ``device`` with a slot for each of ``max_streams`` streams, and bridged through text when its
    tokenizer is not the ``target`` checkpoint's; ``mtp`` loads the target's MTP layers (streams of
    ``max_context`` positions; the caller hands it the target's hidden rows, LocalModel.keep_hidden)."""
    if config.method == "mtp":
        if target is None:
            raise InputError('speculative method "mtp" reads the target checkpoint\'s MTP layers: give its directory')
        return MtpProposer.load(target, max_streams, max_context, device)
    if not config.model:
        return simple_proposer(config)
    draft = DraftModelProposer.load(config.model, target, max_streams, device)
    return draft if config.method == "draft_model" else simple_proposer(config, draft)
