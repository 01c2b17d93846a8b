"""Ordering pieces of the scheduling policy: the waiting queue and the order of the running list.

fcfs (and static): serve by arrival; a preempted request goes back to the front of the waiting queue.
priority: lower `priority` value first, ties by arrival; a preempted request re-enters at its own rank.

The running list is kept in service order, so the preemption victim is always its last element: the newest
admission under fcfs, the lowest priority (then the newest arrival) under priority.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from typing import Iterator

from minillm.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_preempted(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)


class PriorityQueue:
    """Min-heap on (priority, arrival_time, insertion number)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._counter), req))

    # A preempted request keeps its rank: its (priority, arrival) already puts it ahead of later arrivals.
    push_preempted = push

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, req: Request) -> None:
        # O(n), but only aborts and stop strings of waiting requests come here.
        self._heap = [e for e in self._heap if e[-1] is not req]
        heapq.heapify(self._heap)


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()


def insert_running(running: list[Request], req: Request, policy: str) -> None:
    """Add a newly admitted request to the running list, keeping service order (victim = last)."""
    if policy == "priority":
        # Equal keys go after existing ones, so among equals the newest admission is preempted first.
        bisect.insort_right(running, req, key=lambda r: (r.priority, r.arrival_time))
    else:
        running.append(req)
