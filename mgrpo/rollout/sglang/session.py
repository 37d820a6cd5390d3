"""The weight-update session: the control calls around one weight sync on one engine.

SGLang (0.5.23, `srt/managers/scheduler_components/weight_updater.py`) refuses
`update_weights_from_tensor` / `update_weights_from_distributed` outside a session opened with
`POST /begin_weight_update {"selector": "all"}` and closed with `POST /end_weight_update {}`;
`begin` on an open session fails with "already open", `end` on none with "no weight-update
session is open". The trainer-side senders open it (several pipeline stages may each try: "already
open" from another sender is fine), the driver closes it once per sync in `finish_weight_update`.
"""

from __future__ import annotations

import threading

from mgrpo.rollout.sglang.http import HTTPClient, SGLangRequestError


class WeightSession:
    def __init__(self, client: HTTPClient):
        self.client = client
        self._lock = threading.Lock()
        self.open = False

    def __getstate__(self):
        return {"client": self.client, "open": False}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def begin(self, force: bool = False) -> None:
        """Open the session unless this object opened it already (`force`: ask the server anyway,
        for senders whose session someone else closes); another sender having opened it is fine."""
        with self._lock:
            if self.open and not force:
                return
            try:
                self.client.post_result("/begin_weight_update", {"selector": "all"})
            except SGLangRequestError as e:
                if "already open" not in str(e):
                    raise
            self.open = True

    def end(self) -> bool:
        """Close the session; False when none was open (no bucket reached the engine)."""
        with self._lock:
            self.open = False
            try:
                self.client.post_result("/end_weight_update", {})
            except SGLangRequestError as e:
                if "no weight-update session is open" in str(e):
                    return False
                raise
            return True

    def set_version(self, version: int) -> None:
        # abort_all_requests defaults to True in SGLang: never abort rollouts to bump a label.
        self.client.post_result("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    def flush_cache(self) -> None:
        # 400 when requests are still running: a stale prefix cache would feed old-weight KV to new rollouts.
        self.client.post("/flush_cache", {})
