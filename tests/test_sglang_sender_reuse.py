"""Issue 9: disaggregated weight sync, several syncs in one run.

`RolloutGroup.receivers()` builds a new `DistributedWeightSender` for every sync and ships it to
the trainer's source rank; its group name resolves to `mgrpo-weights-rank{N}` (or -pid{P}) on
that rank, so the second sync asks torch.distributed for a second group of the same name.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle

import torch

from mgrpo.rollout.sglang.weights_distributed import DistributedWeightSender
from tests.test_sglang_engine import FakeSGLang


def _bucket(version: int):
    g = torch.Generator().manual_seed(version)
    return [("model.embed_tokens.weight", torch.randn(5, 3, generator=g)), ("model.norm.weight", torch.randn(3, generator=g))]


def _trainer(payloads, out):
    """The source rank: one sender per sync, arriving pickled as Ray delivers it."""
    try:
        for version, data in enumerate(payloads, start=1):
            sender = pickle.loads(data)
            sender.update_weights(_bucket(version))
            out.put(("synced", version))
        out.put(("ok", None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(e)))


def test_new_sender_per_sync_reuses_the_group():
    """Was xfail(strict) on the code before the fix (commit 255cf37): the 2nd sync raised
    'The specified group name has already been created'."""
    ctx = mp.get_context("spawn")
    with FakeSGLang(lifetime_s=60) as fake:
        # exactly what receivers() does on every sync: same URLs, no group name, backend fixed
        payloads = [pickle.dumps(DistributedWeightSender([fake.url], [1], master_address="127.0.0.1",
                                                         backend="gloo", timeout_s=20)) for _ in range(3)]
        out = ctx.Queue()
        proc = ctx.Process(target=_trainer, args=(payloads, out))
        proc.start()
        events = []
        try:
            while True:
                status, detail = out.get(timeout=50)
                events.append((status, detail))
                if status == "synced":
                    fake.session_open = False  # the driver's finish_weight_update closes each sync
                else:
                    break
        finally:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        assert events[-1] == ("ok", None), (events, fake.errors)
        assert len(fake.bodies("/update_weights_from_distributed")) == 3 and not fake.errors
        assert len(fake.bodies("/init_weights_update_group")) == 1  # one group, reused by every sync
