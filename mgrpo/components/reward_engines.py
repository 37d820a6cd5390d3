"""A reward model's servers (reward.models.<name>): hosted exactly as rollout engines are. Each server lives in an
`EngineHost` actor (cluster/engine_host.py, the rollout engines' host class) built by the rollout engine registry's
`sglang` engine (the launcher, with the run's API key), in the run's Ray placement groups (cluster/placement.py:
bundles of its own with placement=own, the rollout engines' bundles with placement=shared). They are frozen: nothing
here syncs weights or releases memory, and the weight sync only knows the rollout group's engines.

The driver talks to the servers by URL (an `SGLangEngine.connect` client each). Several servers of a judge sit
behind SGLang's router (`RoutedClient`, as several rollout engines do), which spreads its /generate requests; a
classifier's /classify requests go to its servers in turn (the router has no route that returns a reward head's
score, see `RewardModel.routed`). When a call fails (and, behind a router, before each scoring call) every
server's host is health-checked (`hosts_alive`, the rollout group's check, in cluster/aux_engines.py); a dead or hung
one is started again in its bundle (counted in reward/model_restarts), the router re-pointed at its new URL, and the
failed call sent once more. `RewardModel` scores a sequence classifier through `/classify`; the generative
judge (components/judges.py) is a RewardModel whose servers are chat servers.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from mgrpo.algorithms.failed_samples import OK, TIMEOUT
from mgrpo.config.reward import RewardModelConfig, engine_share
from mgrpo.rewards import ScoreRequest

log = logging.getLogger("mgrpo")

ENGINE = "sglang"
"""The rollout engine registry's entry that builds a reward server (the CPU server stands in where SGLang cannot)."""


class RewardModel:
    """One named reward model: its servers' hosts, the clients and router the driver reaches them through, its
    tokenizer, its scoring."""

    label = "model"
    """How a failure it causes is named (failed_by 'model:<name>', reward/failed/model:<name>)."""
    server_flags: tuple[str, ...] = ("--is-embedding",)
    routed = False
    """Whether several servers sit behind SGLang's router. Not for a classifier: sglang-router 0.3.x serves SGLang's
    /classify only as the OpenAI /v1/classify, which answers softmax probabilities (SGLang's serving_classify.py:
    [1.0] for a one-label reward head), so the driver spreads /classify requests over the servers in turn."""

    def __init__(self, name: str, cfg: RewardModelConfig, *, api_key: Optional[str], log_dir: str,
                 placement=None, devices: Optional[list[list[str]]] = None, cpus: float = 1):
        """`placement`: the run's `Placement` (its reward bundles); None outside a run (the hosts go wherever the
        Ray this process started or joined has room). `devices[k]`: the accelerator ids engine k's server must
        use (placement=shared: its rollout engine's), else None. `cpus`: CPUs of an own bundle's host."""
        from transformers import AutoTokenizer

        from mgrpo.rollout.sglang import SGLangEngine

        self.name, self.cfg, self.api_key, self.log_dir = name, cfg, api_key, log_dir
        self.placement, self.devices, self.cpus = placement, devices, cpus
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.hf_path)
        self.restarts = 0
        self._turn = 0
        self._lock = threading.Lock()
        self.servers = None
        """The servers' hosts (cluster/aux_engines.py `AuxEngineHosts`); None for a server at a url."""
        self.front = None
        """SGLang's router in front of several servers (a `RoutedClient`): scoring goes through it."""
        if cfg.url:
            self.engines = [SGLangEngine.connect(cfg.url, **self._client_kwargs())]
            return
        self.engines = []
        try:
            self._start_all()
        except BaseException:
            self.close()
            raise

    # --- hosting (cluster/aux_engines.py: the rollout engines' host class and checks) -----------------------
    def _client_kwargs(self) -> dict:
        return dict(request_timeout_s=self.cfg.timeout_s, max_retries=self.cfg.max_retries, api_key=self.api_key)

    def _engine_kwargs(self, k: int) -> dict:
        """What the registry's sglang engine is launched with: the reward flags, frozen (no memory saver)."""
        c = self.cfg
        return dict(tp=c.tp, mem_fraction_static=engine_share(c), enable_memory_saver=False,
                    extra_args=[*self.server_flags, *c.server_args], api_key=self.api_key,
                    log_dir=os.path.join(self.log_dir, f"engine-{k}"), request_timeout_s=c.timeout_s,
                    max_retries=c.max_retries, visible_devices=self.devices[k] if self.devices else None)

    def _start_all(self) -> None:
        from mgrpo.cluster.aux_engines import AuxEngineHosts
        from mgrpo.rollout.sglang import SGLangEngine

        self.servers = AuxEngineHosts(self.name, ENGINE, self.cfg.hf_path,
                                      [self._engine_kwargs(k) for k in range(self.cfg.engines)],
                                      placement=self.placement, cpus=self.cpus, tp=self.cfg.tp,
                                      timeout_s=self.cfg.timeout_s)
        self.engines = [SGLangEngine.connect(url, **self._client_kwargs()) for url in self.servers.urls]
        if self.routed and len(self.engines) > 1:
            self.front = self._router(self.servers.urls)

    def _router(self, urls: list[str]):
        from mgrpo.net import node_ip
        from mgrpo.rollout.sglang.router import RoutedClient

        return RoutedClient(urls, host=node_ip(), log_dir=os.path.join(self.log_dir, "router"),
                            **self._client_kwargs())

    @property
    def hosts(self) -> list:
        return self.servers.hosts if self.servers is not None else []

    @property
    def addresses(self) -> list[dict]:
        """`EngineSlot.address()` of each server's host: node, URL, server pid."""
        return self.servers.addresses if self.servers is not None else []

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _restart(self, k: int) -> None:
        """Start server k again through its host, in the same bundle; re-point the router."""
        from mgrpo.rollout.sglang import SGLangEngine

        old = self.addresses[k]
        log.warning("reward %s %s: server %d at %s (pid %s) failed its health check; starting it again in its "
                    "bundle", self.label, self.name, k, old["url"], old.get("pid"))
        new = self.servers.restart(k)
        self.engines[k] = SGLangEngine.connect(new["url"], **self._client_kwargs())
        self.restarts += 1
        if self.front is not None:
            if self.front.alive(self.cfg.timeout_s):
                self.front.replace(old["url"], new["url"])
            else:
                self.front.restart(self.urls)

    def _revive(self) -> int:
        """Health-check every server's host, restarting each dead or hung one (and the router if it died);
        the number restarted. Scoring threads share the servers, so this holds a lock: one restart per death."""
        if self.servers is None:
            return 0
        with self._lock:
            restarted = 0
            for k in self.servers.dead():
                self._restart(k)
                restarted += 1
            if self.front is not None and not self.front.alive(self.cfg.timeout_s):
                self.front.restart(self.urls)
                restarted += 1
            return restarted

    def on_engine(self, k: int, call):
        """`call(client)` on server k, or through the router when there is one. When it fails, the servers are
        health-checked (a dead or hung one restarted, as the rollout group recovers a failed chunk's engine) and the
        call is sent once more if what it went to was replaced meanwhile (by this thread or another)."""
        from mgrpo.rollout.sglang.http import SGLangRequestError

        def target():
            return self.front.client if self.front is not None else self.engines[k]

        used = target()
        try:
            return call(used)
        except SGLangRequestError:
            if self.servers is None:
                raise
            restarted = self._revive()
            if not restarted and target() is used:
                raise
        return call(target())

    def _check(self) -> None:
        """Before a scoring call: behind a router, every server is health-checked (the router would quietly route
        around a dead one, as the rollout group's periodic check finds); servers used directly are checked when a
        call to them fails (`on_engine`), which costs nothing while they are healthy."""
        if self.front is not None:
            self._revive()

    @property
    def parallel(self) -> int:
        """Requests sent at once: one per server."""
        return len(self.engines)

    # --- scoring -----------------------------------------------------------------------------------------
    def inputs(self, req: ScoreRequest) -> list[int]:
        """The token ids the reward model reads for one response (see reward_models.py's docstring)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            prompt = req.prompt if isinstance(req.prompt, list) else [{"role": "user", "content": str(req.prompt)}]
            text = tok.apply_chat_template(list(prompt) + [{"role": "assistant", "content": req.response}],
                                           tokenize=False, add_generation_prompt=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        ids = tok(str(req.prompt or "") + req.response, add_special_tokens=False)["input_ids"]
        stopped = (req.extra_info or {}).get("finish_reason") == "stop"
        return ids + ([tok.eos_token_id] if stopped and tok.eos_token_id is not None else [])

    def score(self, reqs: Sequence[ScoreRequest]) -> tuple[list[Optional[float]], list[str], list[str]]:
        """(score or None, outcome, error or '') per request; never raises for a server's failure."""
        from mgrpo.rollout.sglang.http import SGLangRequestError

        n = len(reqs)
        scores: list[Optional[float]] = [None] * n
        status, errors = [OK] * n, [""] * n
        if not n:
            return scores, status, errors
        self._check()
        inputs = [self.inputs(r) for r in reqs]
        size = self.cfg.batch_size
        chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]

        def run(k: int) -> None:
            idx = chunks[k]
            try:
                got = self.on_engine((self._turn + k) % len(self.engines),
                                     lambda engine: engine.classify([inputs[i] for i in idx]))
            except SGLangRequestError as e:
                for i in idx:
                    status[i], errors[i] = TIMEOUT if e.timeout else "failed", f"model:{self.name}: {e}"
                return
            for i, values in zip(idx, got):
                scores[i] = values[0]  # a Bradley-Terry head: one score (num_labels=1)

        with ThreadPoolExecutor(max_workers=max(1, min(self.parallel, len(chunks)))) as pool:
            list(pool.map(run, range(len(chunks))))
        self._turn += len(chunks)
        return scores, status, errors

    def close(self) -> None:
        if self.front is not None:
            try:
                self.front.shutdown()
            except Exception as err:  # noqa: BLE001 - a failing shutdown must not hide what caused it
                log.warning("reward model %s: router shutdown failed: %s", self.name, err)
            self.front = None
        if self.servers is not None:
            self.servers.close()
        self.engines = []

