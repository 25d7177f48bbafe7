"""The serving engine: step-level continuous batching over `functional_dit.sampling`.

One worker thread owns the model. Its loop, each turn:

1. drops the images of cancelled jobs (client gone, timed out) from every stage;
2. encodes waiting images (prompt, noise, schedule: `sampling.init`) in order (below),
   at most ``max_batch`` per turn so running batches keep stepping;
3. moves ready images into the running batch of their key (latent size and text length)
   while it holds fewer than ``max_batch`` images: a newcomer joins between two steps; a
   full batch whose lowest-ordered image comes after a ready one gives it up (preemption:
   the item, its latents, step index and cache state, goes back to the ready queue
   untouched and resumes there when it is first again);
4. runs ONE step of ONE batch: the key whose running batch holds the first image in the
   order below (first come, first served across sizes, batched within one: a size's
   batch steps until its first image is done, then the next first image's size goes;
   none starves, as the order is a queue); with mixed resolutions on (``mixed``), the
   batches of other keys join that model call while it holds at most ``max_batch``
   images padded to at most ``max_padding`` times their tokens (`_together`,
   `functional_dit.pipelines.sampler._packing`; docs/serving.md says when it pays);
5. decodes the images that finished and hands each job its images once all are done.

**Order** (admission, encoding, preemption, the batch stepped): by *virtual arrival*, a
job's arrival time less ``priority * aging`` seconds, earliest first (ties: the job id,
then the image). A priority is so a head start: priority 2 with ``aging`` 10 s goes
before every priority-0 job that arrived less than 20 s before it, and after those that
waited longer. The order of two jobs never changes while they wait (both age alike), so a
preempted image is not taken back and forth; and no job starves: only jobs arriving
within ``(p' - p) * aging`` seconds after a priority-p job can overtake it. It is the same
on every rank (rank 0's arrival times are broadcast).

The HTTP side (`functional_dit.serve._app`) only submits jobs and awaits their futures.
Items are made, stepped and decoded by the engine's ``backend``: `functional_dit.sampling`
(``init``, ``step``, ``decode``), or under ``serve --device xla`` the fixed-shape step graphs
of `functional_dit.serve._xla.Fixed` (the same three, the same order and batching).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from ..pipelines import sampling

MAX_PADDING = 1.10  # the padded over real tokens a mixed-resolution call may hold (docs/serving.md)


class QueueFull(Exception):
    """The waiting images would exceed ``max_queue``."""


@dataclasses.dataclass(eq=False)
class Job:
    """One HTTP request: its images' `sampling.Request`\\ s, and where the results go."""

    id: str
    requests: list
    deliver: object  # deliver(images or None, error or None), called once from the worker thread
    body: dict | None = None  # the HTTP body (other ranks rebuild the job from it)
    images: list = dataclasses.field(default_factory=list)
    left: int = 0
    cancelled: bool = False  # asked for by the HTTP side (client gone, timeout), at any time
    dropped: bool = False  # applied by the engine at the start of a turn (the same turn on every rank)
    finished: bool = False
    group: int = 0  # the dp group that runs it (`functional_dit.serve._ranks`)
    priority: int = 0  # higher first (the engine's order: its module docstring)
    arrived: float = dataclasses.field(default_factory=time.monotonic)  # rank 0's clock on every rank
    progress: list = dataclasses.field(default_factory=list)  # steps done per image (the worker writes it)

    def __post_init__(self):
        self.images, self.left = [None] * len(self.requests), len(self.requests)
        self.progress = [0] * len(self.requests)


class Metrics:
    """Counters for /metrics (Prometheus text): read from the event loop, written by the worker."""

    def __init__(self):
        self.requests = collections.Counter()  # HTTP status -> count
        self.images = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.last_step_seconds = 0.0
        self.joined = 0  # images that joined a batch already running (mid-batch arrivals)
        self.preempted = 0  # images taken out of a running batch for a job ordered before them
        self.mixed_calls = 0  # model calls holding two or more resolutions (`Engine._together`)
        self.latency = collections.defaultdict(lambda: [0.0, 0])  # priority -> [seconds, answers] of 200s
        self.cache_skipped = 0  # branch-steps of finished images whose step cache skipped blocks
        self.groups = collections.Counter()  # dp group -> images it made
        self.recent = collections.deque()  # finish times of recent images, for images/s
        self.started = time.monotonic()

    def answered(self, priority: int, seconds: float) -> None:
        """A 200 to a job of ``priority``, ``seconds`` after it arrived (/metrics' latency)."""
        entry = self.latency[priority]
        entry[0], entry[1] = entry[0] + seconds, entry[1] + 1

    def images_per_second(self, window: float = 60.0) -> float:
        now = time.monotonic()
        while self.recent and self.recent[0] < now - window:
            self.recent.popleft()
        return len(self.recent) / min(window, max(now - self.started, 1e-9))


class Engine:
    """Continuous batching of ``params`` over ``pipe``; ``adapters`` by name."""

    def __init__(
        self, params, pipe, adapters=None, *, max_batch=8, max_queue=64, sync=None, aging=10.0, image_jobs=False,
        mixed=True, max_padding=MAX_PADDING, backend=None,
    ):  # fmt: skip
        self.params, self.adapters = params, dict(adapters or {})
        # mixed: images of several sizes in one model call, padded to at most max_padding x their tokens
        self.mixed, self.max_padding = mixed, max_padding
        # image_jobs: a pipeline that is an image job of its own (Kontext, the edit pipelines), every item its own
        self.ctx = sampling.context(params, pipe, text_to_image=not image_jobs)
        # what makes, steps and decodes items: ``init`` / ``step`` / ``decode`` of `functional_dit.sampling`,
        # or of what ``backend(ctx, adapters)`` makes (``serve``'s fixed-shape XLA one: `functional_dit.serve._xla`)
        self.backend = sampling if backend is None else backend(self.ctx, self.adapters)
        self.max_batch, self.max_queue, self.aging = max_batch, max_queue, aging
        self.metrics = Metrics()
        self._lock = threading.Condition()
        self._inbox: list = []  # jobs submitted since the last turn began
        self._live: dict = {}  # id -> job, from its turn of arrival until it is answered
        self._waiting: collections.deque = collections.deque()  # (job, index) not yet encoded
        # sync(new jobs, ids to cancel, stop) -> the same, as every rank applies them this turn
        # (`functional_dit.serve._ranks`); on one process, as they are
        self.sync = sync or (lambda new, cancel, stop: (new, cancel, stop))
        self.heartbeat = None if sync is None else 1.0  # idle turns keep the other ranks' collectives alive
        self._ready: dict = collections.defaultdict(collections.deque)  # key -> encoded items
        self._running: dict = {}  # key -> sampling.State
        self._stop = False
        self.group = 0  # this rank's dp group
        self.others = None  # rank 0 under --dp: the jobs other groups run (`_ranks.Ranks`)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="fd-serve-engine", daemon=True)

    # ------------------------------------------------------------------ the HTTP side

    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, job: Job, force: bool = False) -> None:
        """Queue ``job`` (its requests already checked) or raise `QueueFull` (``force``: never)."""
        with self._lock:
            if not force and self.queued() + len(job.requests) > self.max_queue:
                raise QueueFull(f"{self.queued()} images queued, max_queue {self.max_queue}")
            self._inbox.append(job)
            self._lock.notify()

    def queued(self) -> int:
        inbox = sum(len(job.requests) for job in self._inbox)
        here = inbox + len(self._waiting) + sum(len(q) for q in self._ready.values())
        return here + (0 if self.others is None else self.others.queued())

    def running(self) -> int:
        here = sum(len(s) for s in self._running.values())
        return here + (0 if self.others is None else self.others.running())

    def idle(self) -> bool:
        return not self.queued() and not self.running() and (self.others is None or self.others.idle())

    def outstanding(self) -> int:
        """Images of this engine's jobs not yet answered (those that arrived at a turn)."""
        return sum(job.left for job in self._live.values() if not job.dropped)

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the worker

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._stop and self.idle():
                        self._lock.wait(self.heartbeat)
                    stop = self._stop
                if stop:
                    self.sync([], [], True)  # the other ranks stop too
                    return
                if not self.idle() or self.heartbeat is not None:
                    self.turn()
        except BaseException as e:  # noqa: BLE001 - every waiting job learns of it
            self.error = e
            self._fail_all(e)

    def turn(self) -> bool:
        """One turn of the loop (module docstring), on the calling thread. Returns whether
        the ranks were told to stop (other ranks' `follow`)."""
        with self._lock:
            new, self._inbox = self._inbox, []
        cancel = [job.id for job in self._live.values() if job.cancelled and not job.dropped]
        new, cancel, stop = self.sync(new, cancel, False)
        if stop:
            return True
        for job in new:
            self._live[job.id] = job
            self._waiting.extend((job, j) for j in range(len(job.requests)))
        if new:
            self._waiting = collections.deque(sorted(self._waiting, key=lambda e: self.order(*e)))
        for job_id in cancel:
            job = self._live.pop(job_id, None)
            if job is not None:
                job.dropped = True
        self._drop_cancelled()
        self._encode()
        self._admit()
        key = self._next_key()
        if key is not None:
            self._step(self._together(key))
        return False

    def _step(self, keys: list) -> None:
        """One step of the running batches of ``keys`` in one model call (several: mixed
        resolutions, `_together`); the finished images decoded and delivered."""
        ctx = self.ctx
        state = (
            sampling.merge(*(self._running[k] for k in keys), mixed=True) if len(keys) > 1 else self._running[keys[0]]
        )
        t0 = time.perf_counter()
        state = self.backend.step(self.params, state)
        dt = time.perf_counter() - t0
        m = self.metrics
        m.steps, m.step_seconds, m.last_step_seconds = m.steps + 1, m.step_seconds + dt, dt
        m.mixed_calls += len(keys) > 1 and sampling.resolutions(state.items) > 1
        for it in state.items:
            it.tag[0].progress[it.tag[1]] = it.i
        done, rest = sampling.split(state)
        for k in keys:
            self._running[k] = sampling.State(ctx, tuple(it for it in rest.items if it.key == k))
            if not self._running[k].items:
                del self._running[k]
        if done.items:
            self._finish(done)

    def _together(self, key) -> list:
        """``key`` and, with mixed resolutions on, the other running keys whose images join
        its model call: in the order of their first images (`_next_key`'s), each while the
        call then holds at most ``max_batch`` images that may share it (`sampling.packs`)
        and pads them to at most ``max_padding`` times their tokens (`sampling.padding`;
        docs/serving.md)."""
        if not self.mixed:
            return [key]
        chosen, items = [key], list(self._running[key].items)
        for k in sorted((k for k in self._running if k != key), key=self._first):
            more = items + list(self._running[k].items)
            if len(more) <= self.max_batch and self._packs(more):
                chosen, items = [*chosen, k], more
        return chosen

    def _packs(self, items) -> bool:
        return sampling.packs(self.params, self.ctx, items) and sampling.padding(items) <= self.max_padding

    def _drop_cancelled(self) -> None:
        with self._lock:
            self._waiting = collections.deque(e for e in self._waiting if not e[0].dropped)
        for q in self._ready.values():
            kept = [it for it in q if not it.tag[0].dropped]
            q.clear(), q.extend(kept)
        for key, state in list(self._running.items()):
            _, kept = sampling.split(state, keep=lambda it: not it.tag[0].dropped)
            self._running[key] = kept
            if not kept.items:
                del self._running[key]

    def _encode(self) -> None:
        for _ in range(self.max_batch):
            with self._lock:
                if not self._waiting:
                    return
                job, j = self._waiting.popleft()
            try:
                state = self.backend.init(self.params, self.ctx, [job.requests[j]], tags=[(job, j)])
            except Exception as e:  # noqa: BLE001 - the job fails, the server goes on
                self._deliver(job, None, e)
                continue
            item = state.items[0]
            self._ready[item.key].append(item)
            self._sort(item.key)

    def order(self, job: Job, j: int) -> tuple:
        """Image ``j`` of ``job``'s place: earliest virtual arrival first (module docstring)."""
        return job.arrived - job.priority * self.aging, job.id, j

    def _sort(self, key) -> None:
        q = sorted(self._ready[key], key=lambda it: self.order(*it.tag))
        self._ready[key] = collections.deque(q)

    def _admit(self) -> None:
        for key in list(self._ready):
            while self._fill(key) and self._preempt(key):
                pass

    def _fill(self, key) -> bool:
        """``key``'s ready images into its batch while it has room; whether some still wait."""
        q, state = self._ready[key], self._running.get(key)
        have = 0 if state is None else len(state)
        new = []
        while q and have + len(new) < self.max_batch:
            new.append(q.popleft())
        if new:
            if state is not None and any(it.i > 0 for it in state.items):
                self.metrics.joined += len(new)
            joined = sampling.State(self.ctx, tuple(new))
            self._running[key] = joined if state is None else sampling.merge(state, joined)
        return bool(q)

    def _preempt(self, key) -> bool:
        """Whether ``key``'s full batch gave its last image back to the ready queue, as it
        is (latents, step index, cache state: it resumes where it stopped), because it
        comes after the queue's first; `_fill` then admits that one."""
        q, state = self._ready[key], self._running[key]
        last = max(state.items, key=lambda it: self.order(*it.tag))
        if self.order(*last.tag) <= self.order(*q[0].tag):
            return False
        _, self._running[key] = sampling.split(state, keep=lambda it: it is not last)
        self.metrics.preempted += 1
        q.append(last)
        self._sort(key)
        return True

    def _next_key(self):
        """The key whose running batch holds the first image in the order (None: nothing
        runs). Not a round robin over keys: with k sizes in flight that made every image
        take k times its steps' turns (processor sharing, which a queue of equal jobs
        serves worse than first come, first served), and kept each size's batch small.
        The price: a request of many steps holds the other sizes back until it is done
        (its own size's newcomers still join its batch)."""
        if not self._running:
            return None
        return min(self._running, key=self._first)

    def _first(self, key):
        """The order of the first image in ``key``'s running batch."""
        return min(self.order(*it.tag) for it in self._running[key].items)

    def _finish(self, done: sampling.State) -> None:
        images = self.backend.decode(done, "pil")
        now = time.monotonic()
        for it, img in zip(done.items, images):
            job, j = it.tag
            self.metrics.images += 1
            self.metrics.cache_skipped += sampling.cache_skipped(it.cache_state)
            self.metrics.recent.append(now)
            self.metrics.groups[self.group] += 1
            job.images[j], job.left = img, job.left - 1
            if job.left == 0:
                self._deliver(job, job.images, None)

    def _deliver(self, job: Job, images, error) -> None:
        if job.finished:
            return
        job.finished = True
        job.dropped = True  # an error: its other images leave too
        self._live.pop(job.id, None)
        job.deliver(images, error)

    def _fail_all(self, error) -> None:
        with self._lock:
            jobs = {e[0] for e in self._waiting} | set(self._inbox)
        jobs |= {it.tag[0] for q in self._ready.values() for it in q}
        jobs |= {it.tag[0] for s in self._running.values() for it in s.items}
        jobs |= set(self._live.values())  # also those whose images were between steps (finishing)
        jobs |= set(self.others.jobs()) if self.others is not None else set()
        for job in jobs:
            self._deliver(job, None, error)
