"""Speculative decoding: proposers, exact verification, and the per-step choice of widths.

- :mod:`.config`: :class:`SpeculativeConfig`, validated from vLLM-style JSON (torch-free: the
  fleet plan holds one);
- :mod:`.proposers`: ngram, phrase table, hybrid;
- :mod:`.verify`: exact verification at the tail (greedy, rejection sampling);
- :mod:`.adaptive`: the width model and the fallback controller, pure;
- :mod:`.speculator`: :class:`Speculator`, what the pure scheduler consults when it builds a step.

This package's ``__init__`` imports nothing, so the plan can import the config without torch.
"""
