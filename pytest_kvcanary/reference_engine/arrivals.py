"""The reference engine's arrival loop (`Engine.serve`): requests submitted, aborted, paused and
resumed at the forwards their arrivals name, while the engine steps."""

from __future__ import annotations

from typing import Protocol, Sequence

from pytest_kvcanary.canary.seam import Arrival

from .request import Request
from .scheduler import Scheduler


class Served(Protocol):
    """What the loop drives (the Engine): its forward count, scheduler, submit and step."""

    forward_count: int
    scheduler: Scheduler

    def submit(self, prompt: Sequence[int], max_new_tokens: int, context_key: int = 0) -> Request: ...

    def step(self) -> list[Request]: ...


def serve_arrivals(engine: Served, arrivals: Sequence[Arrival]) -> list[list[int]]:
    """Engine.serve: greedy output ids per arrival (its docstring says when each is submitted,
    aborted and paused); runs until every request is done or aborted."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].at_forward)
    reqs: list[Request | None] = [None] * len(arrivals)
    aborts: list[tuple[int, Request]] = []  # (the forward to abort at, the request)
    pauses: list[tuple[int, Request, int]] = []  # (the forward to pause at, the request, for how long)
    resumes: list[tuple[int, Request]] = []  # (the forward to resume at, the request)
    start, idle = engine.forward_count, 0  # idle: forwards skipped while nothing ran
    while order or engine.scheduler.has_work:
        now = engine.forward_count - start + idle
        if order and not engine.scheduler.has_work and arrivals[order[0]].at_forward > now:
            idle, now = idle + arrivals[order[0]].at_forward - now, arrivals[order[0]].at_forward
        while order and arrivals[order[0]].at_forward <= now:
            i = order.pop(0)
            a = arrivals[i]
            reqs[i] = engine.submit(list(a.prompt), a.max_new_tokens, a.context_key)
            if a.abort_after is not None:
                aborts.append((now + a.abort_after, reqs[i]))
            if a.pause is not None:
                pauses.append((now + a.pause[0], reqs[i], a.pause[1]))
        for at, req in [x for x in aborts if x[0] <= now]:
            aborts.remove((at, req))
            if not req.finished:
                engine.scheduler.abort_request(req)
        for at, req in [x for x in resumes if x[0] <= now]:
            resumes.remove((at, req))
            engine.scheduler.resume(req)
        for at, req, length in [x for x in pauses if x[0] <= now]:
            pauses.remove((at, req, length))
            if req in engine.scheduler.running:
                engine.scheduler.pause(req)
                resumes.append((now + length, req))
        ran = engine.forward_count
        if engine.scheduler.has_work:
            engine.step()
        if engine.forward_count == ran and resumes:  # only paused requests left: their pauses run out
            idle += max(0, min(at for at, _ in resumes) - now)
    return [r.output_ids for r in reqs]
