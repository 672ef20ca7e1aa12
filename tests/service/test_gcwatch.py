"""The services' garbage-collector policy (services/common/gcwatch.py), against the real collector of this process."""

from __future__ import annotations

import gc
import weakref

import pytest

from services.common import gcwatch, metrics


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def watch():
    gcwatch.uninstall()
    yield gcwatch
    gcwatch.uninstall()


def pauses(generation: int) -> float:
    return metrics.GC_PAUSE_SECONDS.labels(str(generation))._sum.get()


def count(generation: int) -> float:
    return sum(b.get() for b in metrics.GC_PAUSE_SECONDS.labels(str(generation))._buckets)


def test_every_collection_is_measured_and_a_full_one_freezes_its_survivors(watch):
    watch.install(freeze=True, complete_every_s=3600)
    before = count(2)
    gc.collect()
    assert count(2) == before + 1 and pauses(2) > 0
    assert gc.get_freeze_count() > 0  # the survivors no longer cost the next full collection
    frozen = gc.get_freeze_count()
    gc.collect()
    # Not given back by a collection that is not a complete one (frozen objects that other threads of this worker
    # drop meanwhile leave the permanent generation by reference counting: hence not an exact count).
    assert gc.get_freeze_count() >= 0.9 * frozen


def test_without_freezing_only_the_measurement_stays(watch):
    watch.install(freeze=False)
    before = count(2)
    gc.collect()
    assert count(2) == before + 1 and gc.get_freeze_count() == 0


def test_cyclic_garbage_among_frozen_objects_is_collected_by_the_next_complete_collection(watch):
    state = gcwatch._Watch(freeze=True, complete_every_s=3600)
    gc.callbacks.append(state)
    gcwatch._watch.append(state)
    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    gc.collect()  # a and b survive and are frozen
    del a, b
    gc.collect()
    assert alive() is not None  # frozen: the collector does not walk them
    state.complete_every_s = 0  # the complete collection is due
    gc.collect()  # gives the permanent generation back
    assert gc.get_freeze_count() == 0 and state.complete_next
    gc.collect()  # walks the whole heap
    assert alive() is None
    assert not state.complete_next and gc.get_freeze_count() > 0  # and the freezing goes on


def test_install_reads_the_environment_and_is_idempotent(watch, monkeypatch):
    monkeypatch.setenv("PHALANX_GC_FREEZE", "0")
    monkeypatch.setenv("PHALANX_GC_COMPLETE_S", "42")
    watch.install()
    watch.install(freeze=True)
    assert len(gcwatch._watch) == 1
    assert gcwatch._watch[0].freeze is False and gcwatch._watch[0].complete_every_s == 42
