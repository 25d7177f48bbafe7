"""The serving engine's turns (`functional_dit/serve/_engine.py`), driven in process one
`Engine.turn` at a time: which running batch steps when images of several sizes are in
flight (first come, first served across sizes, by the engine's order), and preemption
with the fixed-shape backend (`functional_dit.serve._xla`) resuming an image where it stopped."""

from __future__ import annotations

import numpy as np
import pytest

import functional_dit as fd
from functional_dit import tiny
from functional_dit.pipelines import sampling
from functional_dit.serve import _engine


@pytest.fixture(scope="module")
def model():
    pipe = tiny.pipeline("flux")
    return fd.from_diffusers(pipe.transformer), pipe


def _job(name, size, arrived, delivered, priority=0):
    req = sampling.Request("a scene", height=size, width=size, steps=2, seed=1, max_sequence_length=32)
    deliver = lambda images, error: delivered.append((name, error, len(images or [])))  # noqa: E731
    return _engine.Job(name, [req], deliver, priority=priority, arrived=arrived)


@pytest.mark.parametrize("priority", [0, 1])
def test_the_first_image_s_size_steps_until_it_is_done(model, priority):
    """Two sizes in flight: the batch holding the first image in the order (earliest
    arrival; priority 1 is a 10 s head start) takes every step until that image is done,
    then the other size steps (a round robin alternated them: both finished late). With
    mixed resolutions off: each size its own model call."""
    delivered = []
    engine = _engine.Engine(*model, max_batch=4, aging=10.0, mixed=False)
    early = _job("early", 32, 100.0, delivered)
    late = _job("late", 48, 101.0, delivered, priority=priority)
    engine.submit(late), engine.submit(early)
    first, second = (early, late) if priority == 0 else (late, early)
    engine.turn()  # both encoded and admitted (two keys); the first's batch steps
    assert (first.progress, second.progress) == ([1], [0])
    engine.turn()
    assert delivered == [(first.id, None, 1)] and second.progress == [0]
    engine.turn(), engine.turn()
    assert delivered == [(first.id, None, 1), (second.id, None, 1)] and engine.idle()


def test_with_mixed_resolutions_the_other_size_joins_the_first_s_call(model):
    """Mixed resolutions on (the default): the second size rides in the first image's
    model call (32x32 and 48x48 pad to 1.06 x their tokens, under the 1.10 bound), so
    both advance every turn and finish together; one mixed call per turn."""
    delivered = []
    engine = _engine.Engine(*model, max_batch=4, aging=10.0)
    early, late = _job("early", 32, 100.0, delivered), _job("late", 48, 101.0, delivered)
    engine.submit(late), engine.submit(early)
    engine.turn()
    assert (early.progress, late.progress) == ([1], [1]) and engine.metrics.mixed_calls == 1
    engine.turn()
    assert sorted(delivered) == sorted([(early.id, None, 1), (late.id, None, 1)]) and engine.idle()


def _run(engine, jobs_at: dict) -> None:
    """Turns until idle; ``jobs_at``: {turn number: jobs submitted before it}."""
    turn = 0
    while turn in jobs_at or not engine.idle():
        for job in jobs_at.get(turn, []):
            engine.submit(job)
        engine.turn()
        turn += 1


def test_the_fixed_backend_preempts_and_resumes_an_item_to_the_same_image(model):
    """Priorities with the fixed-shape backend (`serve --xla-buckets`, its padded steps
    eager on the CPU): a batch of one; a priority-0 image has taken a step when a
    priority-5 one arrives, takes its slot (preempted: its padded slot given back as it is)
    and finishes first; the first resumes where it stopped. Its image is bitwise the image
    of the same request run uninterrupted on the same backend (bucket 1 both ways)."""
    from functional_dit.serve import _xla

    def engine():
        fixed = lambda ctx, adapters: _xla.Fixed(ctx, adapters.values(), (1,), text=32)  # noqa: E731
        return _engine.Engine(*model, max_batch=1, aging=10.0, backend=fixed)

    def job(name, seed, arrived, got, priority=0):
        req = sampling.Request("a scene", height=32, width=32, steps=4, seed=seed, max_sequence_length=32)
        return _engine.Job(
            name, [req], lambda images, error: got.append((name, error, images)), priority=priority, arrived=arrived
        )

    got, busy = [], engine()
    low, high = job("low", 7, 100.0, got), job("high", 8, 101.0, got, priority=5)
    busy.submit(low), busy.turn()
    busy.submit(high), busy.turn()
    assert (low.progress, high.progress, busy.metrics.preempted) == ([1], [1], 1)  # low kept its step
    _run(busy, {})
    assert [(n, e) for n, e, _ in got] == [("high", None), ("low", None)]
    assert busy.metrics.steps == 8  # 4 + 4: the preempted image resumed, none of its steps ran twice
    alone = []
    _run(engine(), {0: [job("low", 7, 100.0, alone)]})
    assert np.array_equal(np.asarray(got[1][2][0]), np.asarray(alone[0][2][0]))
