"""A layer's per-stream state as named entries of their own windows and strides: how many rows
each keeps, which are rings, how deep a rewind stays exact, and that the shard, the planner and
the operator's summary size them with one formula (engine.cache_layout)."""

from __future__ import annotations

import pytest
import torch

from modelfleet.engine.cache_layout import REWIND_SLACK_POSITIONS, CacheEntry, LayerCache, rows_kept
from modelfleet.engine.kvcache import LayerKV
from modelfleet.operator.summary import KVEntry, ModelSummary

SLACK = REWIND_SLACK_POSITIONS

# attention at every position, a convolution's history (kernel 3: window 3), and a
# compressor's blocks of 4 positions (one row each), as a hybrid layer would declare them
HYBRID = LayerCache(
    {
        "k": CacheEntry((2, 8)),
        "v": CacheEntry((2, 8)),
        "conv": CacheEntry((16,), window=3),
        "blocks": CacheEntry((8,), stride=4),
    }
)


@pytest.mark.parametrize(
    "context, window, stride, rows",
    [(1000, None, 1, 1000), (1000, 3, 1, 3 + SLACK), (10, 3, 1, 10), (1000, None, 4, 250), (1001, None, 4, 251)],
)
def test_an_entry_keeps_a_row_per_stride_positions_of_all_or_its_window_plus_the_slack(
    context, window, stride, rows
) -> None:
    assert rows_kept(context, window, stride) == rows == CacheEntry((1,), window, stride).rows(context)


def test_only_entries_that_keep_fewer_rows_than_the_context_are_rings() -> None:
    entries = HYBRID.entries
    assert [entries[name].is_ring(1000) for name in ("k", "conv", "blocks")] == [False, True, False]
    assert not entries["conv"].is_ring(10)  # the whole context fits in its window + slack


def test_the_deepest_exact_rewind_is_the_smallest_rings_slack() -> None:
    assert HYBRID.rewind_limit(1000) == SLACK + 1  # (3 + slack) - 3 + 1
    assert HYBRID.rewind_limit(10) is None  # no ring: any rewind
    assert LayerCache.attention({"k": (2, 8)}, window=100).rewind_limit(1000) == SLACK + 1


def test_bytes_count_each_entry_at_its_own_rows() -> None:
    per_stream = 1000 * 16 * 2 + (3 + SLACK) * 16 + 250 * 8
    assert HYBRID.nbytes(3, 1000, 2) == 3 * per_stream * 2


def test_a_tensor_rank_keeps_its_share_of_split_entries_only() -> None:
    layout = LayerCache({"k": CacheEntry((4, 8)), "latent": CacheEntry((32,), split=False)})
    rank = layout.for_rank(2)
    assert rank.entries["k"].shape == (2, 8) and rank.entries["latent"].shape == (32,)


def test_the_operators_summary_sizes_kv_as_the_layout_does() -> None:
    entries = tuple(
        KVEntry(bytes_per_row=e.values_per_row * 2, window=e.window, stride=e.stride) for e in HYBRID.entries.values()
    )
    summary = ModelSummary(
        family="x", num_layers=2, layer_bytes=(0, 0), embed_bytes=0, norm_bytes=0, head_matrix_bytes=0,
        kv_entries=(entries, entries),
    )  # fmt: skip
    for streams, context in [(1, 1), (2, 10), (3, 1000), (5, 4097)]:
        assert summary.kv_bytes(streams, context) == [HYBRID.nbytes(streams, context, 2)] * 2


def test_a_layers_state_stores_each_entry_at_its_own_capacity_and_reads_back_what_it_keeps() -> None:
    context = 200
    entries = HYBRID.entries
    state = LayerKV(
        2,
        {name: e.rows(context) for name, e in entries.items()},
        {name: e.shape for name, e in entries.items()},
        torch.float32,
        torch.device("cpu"),
        {name: e.is_ring(context) for name, e in entries.items()},
    )
    assert state.capacities == {"k": 200, "v": 200, "conv": 3 + SLACK, "blocks": 50}
    assert (state.capacity, state.ring) == (200, False)  # the first entry's: attention's
    conv = torch.arange(150 * 16, dtype=torch.float32).reshape(150, 16)
    state.write(1, 0, {"conv": conv[:100]})
    state.write(1, 100, {"conv": conv[100:]})  # wraps the ring
    kept = state.read(1, 150 - 3 - SLACK, 150, ["conv"])
    assert list(kept) == ["conv"] and torch.equal(kept["conv"], conv[150 - 3 - SLACK :])
    state.write(1, 7, {"blocks": torch.ones(2, 8)})  # rows 7 and 8: positions 28..35
    assert torch.equal(state.read(1, 7, 9, ["blocks"])["blocks"], torch.ones(2, 8))
    assert state.tensors["blocks"][0].abs().sum() == 0  # another slot untouched
