"""mgrpo/observe/gc_pauses.py: the collector's pauses counted, start-up's objects frozen and given back."""

from __future__ import annotations

import gc

from mgrpo.observe import gc_pauses


def test_pauses_count_full_collections_and_their_time_then_start_again():
    pauses = gc_pauses.GCPauses()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        got = pauses.take()
        assert got["perf/gc_full_collections"] == 2.0  # the generation-0 one is timed, not counted as full
        assert got["perf/gc_pause_s"] > 0.0
        assert pauses.take() == {"perf/gc_full_collections": 0.0, "perf/gc_pause_s": 0.0}
    finally:
        pauses.close()
    assert pauses._on not in gc.callbacks
    gc.collect(2)
    assert pauses.take()["perf/gc_full_collections"] == 0.0  # closed: no longer listening


def test_freeze_exempts_what_is_alive_and_unfreeze_gives_it_back():
    assert gc.get_freeze_count() == 0
    try:
        frozen = gc_pauses.freeze()
        assert frozen == gc.get_freeze_count() > 1000  # this process's modules, functions, classes
    finally:
        gc_pauses.unfreeze()
    assert gc.get_freeze_count() == 0
