"""LaunchReplay: a key's launches run eagerly, then are captured, then replayed; a buffer that moves,
changes shape or dtype is another key; while an engine captures its own graph, launches stay eager.
CUDA graphs are stood in for by recording fakes, so the policy is checked on any machine (the
GPU tests run the real graphs under fault injection: tests/adapters/transformers/test_launch_replay.py)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from pytest_kvcanary.canary import launch_replay as replay
from pytest_kvcanary.canary.seam import ForwardView, GroupInputs
from pytest_kvcanary.canary.runtime import view_tensors
from pytest_kvcanary.canary.launch_replay import LaunchReplay, buffers_key
from kvcanary_kernels.records import GroupKind


class Recorder:
    """What the replay did, in order: "launch" (eager), "captured launch", "replay"."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.capturing = False

    def launch(self) -> None:
        self.events.append("captured launch" if self.capturing else "launch")


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    """CUDA graphs stood in for: a capture records launches as captured, a replay as a replay."""
    rec = Recorder()

    class FakeGraph:
        def capture_begin(self, capture_error_mode: str = "global") -> None:
            assert capture_error_mode == "thread_local"
            rec.capturing = True

        def capture_end(self) -> None:
            rec.capturing = False

        def replay(self) -> None:
            rec.events.append("replay")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: rec.capturing)
    return rec


def test_a_key_runs_eagerly_then_is_captured_then_replayed(recorder):
    runs = LaunchReplay(torch.device("cuda"), enabled=True)
    for _ in range(4):
        runs.run("a", recorder.launch)
    assert recorder.events == ["launch", "launch", "captured launch", "replay", "replay"]
    runs.run("b", recorder.launch)  # another key starts over
    assert recorder.events[-1] == "launch" and (runs.captures, runs.replays) == (1, 2)


def test_disabled_or_inside_an_engines_capture_every_run_is_eager(recorder):
    off = LaunchReplay(torch.device("cpu"), enabled=False)
    for _ in range(3):
        off.run("a", recorder.launch)
    assert recorder.events == ["launch"] * 3
    on = LaunchReplay(torch.device("cuda"), enabled=True)
    recorder.capturing = True  # an engine's graph is being captured
    for _ in range(3):
        on.run("a", recorder.launch)
    assert recorder.events[3:] == ["captured launch"] * 3 and on.captures == 0


def test_captures_stop_at_the_budget_and_the_least_recent_graph_goes_first(recorder, monkeypatch):
    monkeypatch.setattr(replay, "MAX_CAPTURES", 3)
    monkeypatch.setattr(replay, "KEPT_GRAPHS", 2)
    runs = LaunchReplay(torch.device("cuda"), enabled=True)
    for key in ("a", "b", "c", "d"):
        runs.run(key, recorder.launch)
        runs.run(key, recorder.launch)
    assert runs.captures == 3  # d stays eager
    recorder.events.clear()
    for key in ("a", "b", "c", "d"):
        runs.run(key, recorder.launch)
    assert recorder.events == ["launch", "replay", "replay", "launch"]  # a's graph was dropped for c's


def _view(n: int = 4, t: int = 6) -> ForwardView:
    z = torch.zeros
    return ForwardView(rows=z(n, dtype=torch.int64), prefix_lens=z(n, dtype=torch.int64),
                       extend_lens=z(n, dtype=torch.int64), input_ids=z(t, dtype=torch.int64),
                       positions=z(t, dtype=torch.int64), token_table=z(n, 8, dtype=torch.int64))


def test_the_key_follows_every_buffer_a_launch_reads_not_what_it_holds():
    view = _view()
    key = buffers_key(view_tensors(view))
    for tensor in view_tensors(view):
        if tensor is not None:
            tensor.fill_(7)  # refilled in place: the same launches
    assert buffers_key(view_tensors(view)) == key
    fields = ("rows", "prefix_lens", "extend_lens", "input_ids", "positions", "token_table")
    for name in fields:
        old = getattr(view, name)
        for moved in (old.clone(), old[:-1], old.to(torch.int32)):
            other = ForwardView(**{f: moved if f == name else getattr(view, f) for f in fields})
            assert buffers_key(view_tensors(other)) != key, (name, moved.shape, moved.dtype)
    drafted = ForwardView(**{f: getattr(view, f) for f in fields},
                          group_inputs={GroupKind.DRAFT: GroupInputs(view.input_ids.clone(), view.positions)})
    assert buffers_key(view_tensors(drafted)) != key
