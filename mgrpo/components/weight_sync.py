"""Weight sync: the actor's weights, resharded into Hugging Face layout, into every rollout engine.

One sync: health-check the engines (a dead one is restarted first), for engines that share the actor's devices
(`RolloutConfig.shares_actor_devices`: rollout.mode colocated or hybrid) take back the engines' weight memory, let every Megatron rank stream its buckets through the engines' receivers, then
close the update on every engine with the new version (which also flushes its prefix cache), and
take back the rest of the engines' memory. A restarted engine gets the current weights the same way.

LoRA with actor.lora.sync resolved to adapter: the engines keep the frozen base they started from, and each sync
sends only the adapters (PEFT layout, gathered to one rank) through SGLang's /load_lora_adapter_from_tensors under
the name `mgrpo-lora-v<version>`, which every generate request names from then on; the previous version is
unloaded. A restarted engine starts from the base and gets the current adapter.

While the ranks stream, the engines are health-checked as during generation: one that dies or hangs while it
takes the weights is restarted (which ends a delivery stuck on it), and the sync is made once more to every
engine (also when the delivery itself went through: the restarted engine missed part of it); each restart is
counted in `rollout/restarts`.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from mgrpo.config import RolloutConfig
from mgrpo.rollout.types import WeightDeliveryError

log = logging.getLogger("mgrpo")

SYNC_ATTEMPTS = 3


def adapter_name(version: int) -> str:
    return f"mgrpo-lora-v{version}"


class WeightSync:
    def __init__(self, cfg: RolloutConfig, actor, rollout, adapters: bool = False):
        self.shares_actor_devices = cfg.shares_actor_devices
        self.actor = actor
        """`ActorClient`."""
        self.rollout = rollout
        """`RolloutGroup`."""
        self.adapters = adapters
        """actor.lora.sync resolved to adapter: the engines take the adapters alone."""
        self.current: Optional[tuple] = None
        """(version, tensors, config) of the adapter the engines hold (adapter sync)."""
        rollout.on_restart = self._catch_up

    def _catch_up(self, engines: list) -> None:
        """A restarted engine: the current weights (adapter sync: it started from the base; the current adapter)."""
        if not self.adapters:
            self.actor.sync_weights(self.rollout.receivers(engines))
        elif self.current is not None:
            version, tensors, config = self.current
            self.rollout.load_adapter(adapter_name(version), tensors, config, version, engines=engines)

    def release_engines(self) -> dict:
        """Engines that share the actor's devices give it their accelerator memory between generation and
        sync; returns the counts of what that took (engines found dead and restarted)."""
        if not self.shares_actor_devices:
            return {}
        return {"rollout/restarts": self.rollout.release_memory()}

    def sync(self, version: int) -> dict:
        """Push the actor's current weights as `version`; return the sync's metrics."""
        if self.adapters:
            return self._sync_adapter(version)
        t0 = time.perf_counter()
        restarted = self.rollout.health_check()
        if self.shares_actor_devices:  # room for the new weights, KV cache still released
            restarted += self.rollout.resume_memory(["weights"])
        watched = [0]

        def watch() -> None:
            watched[0] += self.rollout.health_check()

        for _ in range(SYNC_ATTEMPTS):
            before = watched[0]
            try:
                sent = self.actor.sync_weights(self.rollout.receivers(), version, watch=watch)
            except WeightDeliveryError as err:
                watch()  # a dead engine not restarted yet is restarted now
                if watched[0] == before:
                    raise
                log.warning("weight sync %d failed while an engine was restarted; syncing every engine again (%s)",
                            version, str(err).splitlines()[0][:300])
                continue
            if watched[0] == before:
                break
            # An engine restarted mid-stream got part of this stream on its old server and was closed by its
            # restart: every engine takes the whole stream once more before the update is closed.
            log.warning("an engine was restarted during weight sync %d; syncing every engine again", version)
        else:
            raise RuntimeError(f"weight sync {version}: an engine was restarted during each of {SYNC_ATTEMPTS} "
                               "attempts (see the restarts above)")
        restarted += watched[0]
        self.rollout.finish_weight_update(version, done=sent["finished"])
        if self.shares_actor_devices:
            restarted += self.rollout.resume_memory()
        seconds = time.perf_counter() - t0
        return {"perf/update_weights_bytes": float(sent["bytes"]), "rollout/weight_version": float(version),
                "perf/update_weights_gbps": sent["bytes"] / max(seconds, 1e-9) / 1e9,
                "perf/update_weights_s": seconds, "rollout/restarts": restarted}

    def _sync_adapter(self, version: int) -> dict:
        t0 = time.perf_counter()
        restarted = self.rollout.health_check()
        if self.shares_actor_devices:  # the base comes back from the engines' CPU backup
            restarted += self.rollout.resume_memory(["weights"])
        tensors, config = self.actor.adapter()
        self.current = (version, tensors, config)
        sent = self.rollout.load_adapter(adapter_name(version), tensors, config, version)
        if self.shares_actor_devices:
            restarted += self.rollout.resume_memory()
        seconds = time.perf_counter() - t0
        return {"perf/update_weights_bytes": float(sent), "rollout/weight_version": float(version),
                "perf/update_weights_gbps": sent / max(seconds, 1e-9) / 1e9,
                "perf/update_weights_s": seconds, "rollout/restarts": restarted}
