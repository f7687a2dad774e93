"""The scheduler as a specification: admission, steps, stop and length rules, failures, no processes."""

from __future__ import annotations

import math

import pytest

from modelfleet.engine.errors import ErrorCode
from modelfleet.engine.sampling import SamplingParams
from modelfleet.engine.scheduler import (
    Finish,
    FinishReason,
    Refusal,
    Scheduler,
    SchedulerConfig,
    Step,
    StreamState,
    Token,
)

EOS = 2


def scheduler(**overrides: object) -> Scheduler:
    fields: dict[str, object] = dict(max_streams=4, context_length=32, vocab_size=100, eos_token_ids=(EOS,),
                                     window_rows=4, microbatches=1, frames_in_flight=1, max_queue=4)  # fmt: skip
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))  # type: ignore[arg-type]


def admit(s: Scheduler, key: object, prompt: list[int], max_tokens: int = 8, now: float = 0.0, **params: object):
    stream = s.submit(key, prompt, SamplingParams(max_tokens=max_tokens, **params), now)  # type: ignore[arg-type]
    assert isinstance(stream, StreamState), stream
    return stream


def rows(step: Step) -> list[tuple[int, int, int]]:
    return list(zip(step.slots, step.positions, step.token_ids, strict=True))


def answer(s: Scheduler, step: Step, token: int = 7) -> list[Token | Finish]:
    return s.complete(step.id, {stream.slot: token for stream in step.sampled})


# ---- admission ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "code", "says"),
    [
        ([], ErrorCode.INPUT, "the prompt is empty"),
        ([1] * 32, ErrorCode.CONTEXT_LENGTH, "the prompt has 32 tokens; the context length is 32"),
        ([1, 100], ErrorCode.INPUT, "token id 100 is outside the vocabulary [0, 100)"),
        ([1, -1], ErrorCode.INPUT, "token id -1 is outside the vocabulary"),
    ],
)
def test_a_prompt_the_model_cannot_take_is_refused_with_a_code_and_the_limit(prompt, code, says) -> None:
    refusal = scheduler().submit("r", prompt, SamplingParams(), 0.0)
    assert isinstance(refusal, Refusal) and refusal.code == code and says in refusal.message


def test_when_every_slot_is_taken_and_the_queue_is_full_a_stream_is_refused_as_busy() -> None:
    s = scheduler(max_streams=1, max_queue=1)
    admit(s, "a", [1])
    s.schedule(0.0)  # "a" takes the only slot
    admit(s, "b", [1])  # queued
    refusal = s.submit("c", [1], SamplingParams(), 0.0)
    assert isinstance(refusal, Refusal) and refusal.code == ErrorCode.BUSY and "queue holds 1" in refusal.message


def test_a_stream_waiting_past_the_queue_timeout_fails_with_its_code() -> None:
    s = scheduler(max_streams=1, queue_timeout_seconds=5.0)
    admit(s, "a", [1], now=0.0)
    s.schedule(0.0)
    b = admit(s, "b", [1], now=1.0)
    assert s.expire(6.0) == []
    [finish] = s.expire(6.5)
    assert finish.stream is b and finish.reason == FinishReason.ERROR and finish.code == ErrorCode.QUEUE_TIMEOUT
    assert not s.queue


# ---- steps ----------------------------------------------------------------------------------


def test_a_prompt_prefills_in_windows_then_decodes_one_row_per_step() -> None:
    s = scheduler(window_rows=4)
    a = admit(s, "a", [10, 11, 12, 13, 14, 15], max_tokens=3)
    [first] = s.schedule(0.0)
    assert rows(first) == [(0, 0, 10), (0, 1, 11), (0, 2, 12), (0, 3, 13)] and first.output_rows == ()
    assert first.new_streams == (a,)
    assert s.schedule(0.0) == []  # one frame in flight per microbatch
    assert s.complete(first.id, {}) == []
    [second] = s.schedule(0.0)
    assert rows(second) == [(0, 4, 14), (0, 5, 15)] and second.output_rows == (1,) and second.new_streams == ()
    assert [e.token_id for e in answer(s, second, 40) if isinstance(e, Token)] == [40]
    [third] = s.schedule(0.0)
    assert rows(third) == [(0, 6, 40)] and third.decode_only
    answer(s, third, 41)
    [fourth] = s.schedule(0.0)
    assert rows(fourth) == [(0, 7, 41)]
    events = answer(s, fourth, 42)
    assert [type(e) for e in events] == [Token, Finish] and events[1].reason == FinishReason.LENGTH  # type: ignore[union-attr]
    assert a.generated == [40, 41, 42] and s.idle and s.free_slots == [0, 1, 2, 3]


def test_streams_of_one_microbatch_share_a_frame_and_are_matched_by_slot() -> None:
    s = scheduler()
    a, b = admit(s, "a", [1, 2]), admit(s, "b", [3])
    [step] = s.schedule(0.0)
    assert rows(step) == [(0, 0, 1), (0, 1, 2), (1, 0, 3)] and step.output_rows == (1, 2)
    events = s.complete(step.id, {b.slot: 9, a.slot: 8})
    assert [(e.stream, e.token_id) for e in events if isinstance(e, Token)] == [(a, 8), (b, 9)]


def test_streams_spread_over_microbatches_and_each_sends_its_own_frame() -> None:
    s = scheduler(microbatches=2)
    for key in "abc":
        admit(s, key, [1])
    steps = s.schedule(0.0)
    assert [step.microbatch for step in steps] == [0, 1]
    assert [[x.key for x in step.streams] for step in steps] == [["a", "c"], ["b"]]


def test_prefill_windows_stream_back_to_back_up_to_the_frames_in_flight() -> None:
    s = scheduler(window_rows=2, frames_in_flight=3, microbatches=3)
    admit(s, "a", list(range(1, 9)))
    steps = [step for _ in range(4) for step in s.schedule(0.0)]
    assert [step.positions for step in steps] == [(0, 1), (2, 3), (4, 5)]  # three in flight, the fourth waits
    s.complete(steps[0].id, {})
    [fourth] = s.schedule(0.0)
    assert fourth.positions == (6, 7) and fourth.output_rows == (1,)


def test_extra_prefill_frames_only_use_the_share_of_idle_microbatches() -> None:
    s = scheduler(window_rows=2, frames_in_flight=2, microbatches=2, max_streams=2)
    admit(s, "a", list(range(1, 9)))
    first = s.schedule(0.0) + s.schedule(0.0)
    assert [step.microbatch for step in first] == [0, 0]  # a's windows take microbatch 1's idle share
    assert s.schedule(0.0) == []
    admit(s, "b", list(range(1, 9)))
    [own] = s.schedule(0.0)
    assert own.microbatch == 1 and own.positions == (0, 1)  # an idle microbatch always sends
    s.complete(first[0].id, {})
    assert s.schedule(0.0) == []  # three frames in flight, over the pipeline's two: no extra
    s.complete(first[1].id, {})
    [next_a] = s.schedule(0.0)
    assert next_a.microbatch == 0 and next_a.positions == (4, 5)


def test_decode_rows_wait_for_the_microbatch_so_they_rejoin_one_frame() -> None:
    s = scheduler(frames_in_flight=2)
    a = admit(s, "a", [1])
    [first] = s.schedule(0.0)  # a's prompt, sampled
    b = admit(s, "b", [1, 2, 3])
    [second] = s.schedule(0.0)  # b prefills while a's token travels
    assert [x.key for x in second.streams] == ["b"]
    answer(s, first)
    assert s.schedule(0.0) == []  # a's decode row waits: b's frame is still in flight
    answer(s, second)
    [joined] = s.schedule(0.0)
    assert [x.key for x in joined.streams] == ["a", "b"] and joined.decode_only and a.awaiting and b.awaiting


# ---- stop and length ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "max_tokens", "context", "reason", "kept"),
    [
        ([5, 6, EOS], 8, 32, FinishReason.STOP, [5, 6]),  # the stop token is not output
        ([5, 6, 7], 3, 32, FinishReason.LENGTH, [5, 6, 7]),
        ([5, 6, 7, 8], 8, 7, FinishReason.LENGTH, [5, 6, 7]),  # prompt 4 + 3 fills a context of 7
    ],
)
def test_a_stream_ends_at_a_stop_token_at_max_tokens_or_at_the_context(tokens, max_tokens, context, reason, kept):
    s = scheduler(context_length=context)
    stream = admit(s, "a", [1, 1, 1, 1], max_tokens=max_tokens)
    finish = None
    for token in tokens:
        [step] = s.schedule(0.0)
        finish = next((e for e in answer(s, step, token) if isinstance(e, Finish)), None)
        if finish is not None:
            break
    assert finish is not None and finish.reason == reason and stream.generated == kept


def test_a_stream_naming_its_own_stop_tokens_ignores_the_models_eos() -> None:
    s = scheduler()
    stream = admit(s, "a", [1], max_tokens=2, stop_token_ids=(9,))
    [step] = s.schedule(0.0)
    answer(s, step, EOS)
    [step] = s.schedule(0.0)
    assert isinstance(answer(s, step, 9)[0], Finish) and stream.generated == [EOS]


# ---- failures -------------------------------------------------------------------------------


def test_one_failed_stream_leaves_the_others_of_its_frame_running() -> None:
    s = scheduler()
    a, b = admit(s, "a", [1]), admit(s, "b", [1])
    [step] = s.schedule(0.0)
    finish = s.fail(b, ErrorCode.INPUT, "bad values")
    assert finish is not None and finish.code == ErrorCode.INPUT and b.slot in s.free_slots
    events = s.complete(step.id, {a.slot: 5})  # the tail sampled only a
    assert [(e.stream, e.token_id) for e in events if isinstance(e, Token)] == [(a, 5)]
    assert s.fail(b, ErrorCode.INPUT, "again") is None  # failing twice is a no-op


def test_a_token_for_a_finished_stream_is_dropped_even_when_its_slot_is_reused() -> None:
    s = scheduler(max_streams=1, frames_in_flight=2)
    a = admit(s, "a", [1, 2, 3], max_tokens=4)
    [step] = s.schedule(0.0)
    s.cancel(a)
    b = admit(s, "b", [4])
    [again] = s.schedule(0.0)
    assert b.slot == a.slot == 0 and again.new_streams == (b,)
    assert s.complete(step.id, {0: 5}) == []  # a's token: a is gone, b is not fooled
    assert [e.stream for e in answer(s, again)] == [b]


def test_a_frame_refused_whole_fails_its_streams_and_a_stalled_one_fails_with_stage_lost() -> None:
    s = scheduler(microbatches=2)
    a, b = admit(s, "a", [1]), admit(s, "b", [1])
    first, second = s.schedule(0.0)
    [finish] = s.fail_step(first.id, ErrorCode.UNAVAILABLE, "tensor group lost")
    assert finish.stream is a and finish.code == ErrorCode.UNAVAILABLE
    assert s.fail_stalled(2.0, 3.0, ErrorCode.STAGE_LOST, "silent") == []
    [stalled] = s.fail_stalled(3.5, 3.0, ErrorCode.STAGE_LOST, "silent")
    assert stalled.stream is b and stalled.code == ErrorCode.STAGE_LOST and s.idle and not s.in_flight


def test_a_queued_stream_cancelled_frees_nothing_and_never_runs() -> None:
    s = scheduler(max_streams=1)
    admit(s, "a", [1])
    s.schedule(0.0)
    b = admit(s, "b", [1])
    finish = s.cancel(b)
    assert finish is not None and finish.reason == FinishReason.CANCELLED and b.slot == -1 and not s.queue


def test_more_prompts_than_slots_wait_and_run_as_slots_free() -> None:
    s = scheduler(max_streams=2, max_queue=8, queue_timeout_seconds=math.inf)
    streams = [admit(s, key, [1], max_tokens=1) for key in "abcde"]
    done = []
    while not s.idle:
        for step in s.schedule(0.0):
            done += [e.stream.key for e in answer(s, step) if isinstance(e, Finish)]
    assert done == ["a", "b", "c", "d", "e"] and all(x.generated == [7] for x in streams)


# ---- replay after a lost stage ----------------------------------------------------------------


def test_a_lost_stage_pauses_the_pipeline_and_keeps_every_stream_with_its_committed_tokens() -> None:
    s = scheduler(window_rows=4)
    a, b = admit(s, "a", [10, 11], max_tokens=5), admit(s, "b", [20], max_tokens=5)
    [first] = s.schedule(0.0)
    answer(s, first, 30)
    [second] = s.schedule(1.0)  # in flight when the stage is lost: its frames are gone
    s.pause(2.0)
    assert s.paused and not s.in_flight and s.schedule(3.0) == [] and s.waiting_for_replay == 2
    assert s.complete(second.id, {a.slot: 31, b.slot: 31}) == []  # a late answer of a dropped step
    assert a.generated == b.generated == [30] and not a.done and not b.done


def test_resume_releases_every_slot_and_prefills_prompt_plus_committed_output_then_decodes_on() -> None:
    s = scheduler(window_rows=4, max_streams=2)
    a = admit(s, "a", [10, 11, 12], max_tokens=6)
    answer(s, s.schedule(0.0)[0], 40)
    answer(s, s.schedule(0.0)[0], 41)
    s.pause(1.0)
    replay = s.resume(4.0)
    assert replay.slots == (0, 1) and replay.streams == 1 and replay.tokens == 5 and replay.paused_seconds == 3.0
    [window, rest] = [s.schedule(5.0)[0], None]
    assert rows(window) == [(0, 0, 10), (0, 1, 11), (0, 2, 12), (0, 3, 40)] and window.new_streams == (a,)
    assert s.complete(window.id, {}) == []
    [rest] = s.schedule(5.0)
    assert rows(rest) == [(0, 4, 41)] and rest.output_rows == (0,) and rest.new_streams == ()
    answer(s, rest, 42)
    [decode] = s.schedule(5.0)
    assert rows(decode) == [(0, 5, 42)] and a.generated == [40, 41, 42] and a.replays == 1


def test_a_stream_still_prefilling_its_prompt_when_the_stage_is_lost_starts_over() -> None:
    s = scheduler(window_rows=2)
    a = admit(s, "a", [1, 2, 3, 4, 5])
    s.schedule(0.0)
    s.pause(0.5)
    s.resume(0.6)
    [again] = s.schedule(0.7)
    assert rows(again) == [(0, 0, 1), (0, 1, 2)] and again.new_streams == (a,) and a.generated == []


def test_a_pause_past_the_replay_deadline_fails_seated_streams_with_replay_timeout_and_stays_paused() -> None:
    s = scheduler()
    a = admit(s, "a", [1])
    s.schedule(0.0)
    s.pause(10.0)
    assert s.expire_paused(100.0, 120.0) == []
    [finish] = s.expire_paused(130.5, 120.0)
    assert finish.stream is a and finish.code == ErrorCode.REPLAY_TIMEOUT and "replay_timeout_seconds" in finish.message
    assert s.free_slots == [0, 1, 2, 3] and s.paused  # released everywhere once the chain heals: resume()
    assert s.resume(131.0).slots == (0, 1, 2, 3)


def test_a_greedy_run_through_a_replay_commits_the_tokens_of_an_undisturbed_run() -> None:
    """The model here: the next token is the sum of the previous rows mod 97, so a row lost or
    repeated in the replay would change every later token."""

    def run(lose_at: int | None) -> list[int]:
        s = scheduler(window_rows=3, max_streams=2, context_length=64)
        streams = [admit(s, "a", [3, 5, 7, 9], max_tokens=12), admit(s, "b", [1], max_tokens=9)]
        kv: dict[int, dict[int, int]] = {0: {}, 1: {}}  # slot -> position -> token: the stages' state
        steps = 0
        while not s.idle:
            for step in s.schedule(0.0):
                steps += 1
                if steps == lose_at:
                    s.pause(0.0)
                    for slot in s.resume(0.0).slots:
                        kv[slot].clear()
                    break
                for slot, position, token in rows(step):
                    assert position not in kv[slot], "a position computed twice without a release"
                    kv[slot][position] = token
                for finish in [e for e in answer_with(s, step, kv) if isinstance(e, Finish)]:
                    kv[finish.stream.slot].clear()
        return [t for stream in streams for t in stream.generated]

    undisturbed = run(None)
    assert all(run(lose) == undisturbed for lose in (2, 3, 5, 9))


def answer_with(s: Scheduler, step: Step, kv: dict[int, dict[int, int]]) -> list[Token | Finish]:
    return s.complete(step.id, {st.slot: sum(kv[st.slot].values()) % 97 + 3 for st in step.sampled})  # type: ignore[return-value]


def test_a_continuation_prefills_prompt_and_output_so_far_and_keeps_the_streams_length_rules() -> None:
    """Issue 34: a stream another pipeline failed goes on here as a replayed one would: its output
    so far is committed, prefilled after the prompt, and counts toward max_tokens."""
    s = scheduler(window_rows=4)
    a = s.submit("a", [10, 11, 12], SamplingParams(max_tokens=5), 0.0, output=[40, 41])
    assert isinstance(a, StreamState) and a.generated == [40, 41] and a.confirmed == 5
    [window] = s.schedule(0.0)
    assert rows(window) == [(0, 0, 10), (0, 1, 11), (0, 2, 12), (0, 3, 40)] and window.new_streams == (a,)
    assert s.complete(window.id, {}) == []
    [rest] = s.schedule(0.0)
    assert rows(rest) == [(0, 4, 41)] and rest.output_rows == (0,)
    assert [e.token_id for e in answer(s, rest, 42) if isinstance(e, Token)] == [42]
    answer(s, s.schedule(0.0)[0], 43)
    assert a.generated == [40, 41, 42, 43] and not a.done
    assert isinstance(answer(s, s.schedule(0.0)[0], 44)[-1], Finish) and a.generated == [40, 41, 42, 43, 44]
    refused = s.submit("b", [1], SamplingParams(max_tokens=2), 0.0, output=[5, 6])
    assert isinstance(refused, Refusal) and "not fewer than max_tokens=2" in refused.message
    too_long = s.submit("c", [1] * 30, SamplingParams(max_tokens=8), 0.0, output=[5, 6])
    assert isinstance(too_long, Refusal) and too_long.code == ErrorCode.CONTEXT_LENGTH


def test_a_stream_queued_while_the_pipeline_is_paused_waits_for_the_heal_bounded_by_the_replay_deadline() -> None:
    """Issue 34: a request arriving while a pipeline replays is not refused: it waits in the
    queue, the time paused does not count toward its queue timeout, and the replay deadline
    fails it as it fails the seated streams."""
    s = scheduler(max_streams=1, queue_timeout_seconds=30.0)
    seated = admit(s, "a", [1], max_tokens=4)
    s.schedule(0.0)
    s.pause(10.0)
    queued = admit(s, "b", [2], now=12.0)
    assert s.expire(100.0) == [] and s.schedule(100.0) == []
    s.resume(100.0)
    assert queued.arrived_at == 100.0 and s.expire(125.0) == []  # queued from the heal on
    [window] = s.schedule(125.0)
    assert window.new_streams == (seated,)
    s.pause(130.0)
    late = admit(s, "c", [3], now=131.0)
    finishes = s.expire_paused(251.0, 120.0)
    assert {f.stream.key for f in finishes} == {"a", "b", "c"} and late.done
    assert all(f.code == ErrorCode.REPLAY_TIMEOUT for f in finishes)
