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


def test_gc_freeze_is_result_neutral_so_a_checkpoint_from_before_it_resumes(tmp_path):
    """trainer.gc_freeze changes no number a run computes: a checkpoint whose fingerprint predates the key (or was
    saved with the other value) resumes without the 'holds another run' refusal; a result-changing key still refuses."""
    import dataclasses

    import pytest

    from mgrpo.components.run_folder import RunFolder, fingerprint
    from mgrpo.config import ConfigError, MGRPOConfig

    cfg = MGRPOConfig()
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=str(tmp_path)))
    saved_fp = fingerprint(cfg)
    assert "trainer.gc_freeze" not in saved_fp
    off = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, gc_freeze=False))
    got = RunFolder(str(tmp_path), off).decide("ckpt", {"step": 3, "config": saved_fp, "total_steps": 10}, 10)
    assert got.resume_dir == "ckpt" and not got.finished
    other_lr = dataclasses.replace(off, actor=dataclasses.replace(off.actor, lr=off.actor.lr * 2))
    with pytest.raises(ConfigError, match=r"actor\.lr"):
        RunFolder(str(tmp_path), other_lr).decide("ckpt", {"step": 3, "config": saved_fp, "total_steps": 10}, 10)
