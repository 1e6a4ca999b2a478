"""Pausing a running request (`Scheduler.pause` / `resume`, and `Arrival.pause` in `serve`): it sits
out the decodes holding its row, KV and locks, nothing it holds is freed or reused meanwhile (under
async scheduling, nothing a launched step writes for it either), and once resumed its outputs are
the ones it would have produced unpaused, with the canary silent."""

from __future__ import annotations

import pytest

from pytest_kvcanary.canary.seam import Arrival
from pytest_kvcanary.reference_engine.scheduler import Scheduler

from test_async_scheduling import assert_silent
from test_host_tier import attach

TIMINGS = {"sync": {}, "async": {"async_scheduling": True}, "async jittered": {"async_scheduling": True,
                                                                               "jitter_seed": 2}}


class PauseWatch:
    """Per pause that ran out (the request still running when resumed): the slots the request held
    when paused (no decode may take it meanwhile), every slot freed until it was resumed, its row
    then, and the forwards run meanwhile."""

    def __init__(self, engine, monkeypatch) -> None:
        self.open, self.done = {}, []
        engine.add_free_listener(lambda kind, slots, cause: [w["freed"].update(slots.tolist())
                                                             for w in self.open.values()])
        pause, resume = Scheduler.pause, Scheduler.resume

        def paused(scheduler, req):
            pause(scheduler, req)
            held = engine.req_to_token_pool.read(req.row, 0, req.launched_len).tolist()
            self.open[req] = {"held": held, "freed": set(), "at": engine.forward_count}

        def resumed(scheduler, req):
            watch = self.open.pop(req, None)
            if watch is not None and req in scheduler.paused:
                assert req.launched_len == len(watch["held"]), "a decode took the paused request"
                self.done.append({**watch, "forwards": engine.forward_count - watch["at"],
                                  "row": engine.req_to_token_pool.read(req.row, 0, len(watch["held"])).tolist()})
            resume(scheduler, req)

        monkeypatch.setattr(Scheduler, "pause", paused)
        monkeypatch.setattr(Scheduler, "resume", resumed)


@pytest.mark.parametrize("timing", TIMINGS)
def test_a_paused_request_keeps_what_it_holds_and_resumes_to_its_unpaused_outputs(
        timing, make_engine, random_prompts, assert_reference, monkeypatch):
    prompts = random_prompts(3, 4)
    fields = {"page_size": 4, "max_running": 4, **TIMINGS[timing]}
    plain = [Arrival(p, 8, at_forward=i % 2) for i, p in enumerate(prompts)]
    expected = make_engine("mha", **fields).serve(plain)
    engine = make_engine("mha", **fields)
    watch = PauseWatch(engine, monkeypatch)
    runtime = attach(engine)
    paused = [a._replace(pause=(2, 3)) if i in (0, 1) else a for i, a in enumerate(plain)]
    outputs = engine.serve(paused)
    assert outputs == expected
    assert_reference(engine, prompts, outputs)
    # 3 forwards each, fewer where only paused requests were left (serve lets the pauses run out then)
    assert len(watch.done) == 2 and all(1 <= w["forwards"] <= 3 for w in watch.done), watch.done
    for w in watch.done:
        assert not set(w["held"]) & w["freed"], "a slot the paused request held was freed while it was paused"
        assert w["row"] == w["held"], "the paused request's row changed while it was paused"
    assert engine.liveness()["pauses"] == 2
    assert_silent(runtime)


def test_when_only_paused_requests_are_left_serve_lets_their_pauses_run_out(make_engine):
    engine = make_engine("mha", async_scheduling=True)
    step, calls = engine.step, []

    def counted():
        calls.append(1)
        assert len(calls) < 100, "serve waits for forwards that never come"
        return step()

    engine.step = counted
    out = engine.serve([Arrival(list(range(1, 9)), 6, pause=(2, 40))])
    assert out == make_engine("mha").generate([list(range(1, 9))], 6)
    assert engine.liveness()["pauses"] == 1


def test_memory_pressure_retracts_a_paused_request_first(make_engine, random_prompts, assert_reference, monkeypatch):
    """Five requests on a pool that holds about three: the paused one (the oldest) is retracted (it
    waits again, no longer paused) before any running one, and every output is still right."""
    engine = make_engine("mha", page_size=4, num_slots=48, max_running=5)
    prompts = random_prompts(4, 5)[:5]
    reqs = [engine.submit(p, 12) for p in prompts]
    engine.step()  # the prefill
    engine.scheduler.pause(reqs[0])
    retracted = []
    retract = Scheduler._retract

    def recorded(scheduler, req, *args):
        retracted.append(req)
        retract(scheduler, req, *args)

    monkeypatch.setattr(Scheduler, "_retract", recorded)
    while engine.scheduler.has_work:
        engine.step()
    assert retracted and retracted[0] is reqs[0] and not engine.scheduler.paused
    assert_reference(engine, prompts, [r.output_ids for r in reqs])


def test_only_a_running_request_can_be_paused(make_engine):
    engine = make_engine("mha")
    req = engine.submit([1, 2, 3], 2)
    with pytest.raises(ValueError, match="only a running request can be paused; request 0 is not running"):
        engine.scheduler.pause(req)
