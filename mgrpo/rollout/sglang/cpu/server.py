"""A CPU rollout server speaking SGLang's HTTP protocol over transformers.

    python -m mgrpo.rollout.sglang.cpu.server --model-path D --tp-size 1 --host H --port P \\
        --mem-fraction-static F --weight-version V [--enable-memory-saver] [--config KEYS.yaml] ...

It takes `sglang.launch_server`'s command line (SGLangEngine.launch runs either with the same arguments) and
serves the native endpoints the rollout path uses, with SGLang 0.5.23's request and answer shapes
(`srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`, `tokenizer_manager.py`,
`scheduler_components/weight_updater.py`), FastAPI + uvicorn as SGLang. Stop strings and grammars (json_schema,
regex, ebnf, structural_tag) work as SGLang's with the tokenizer of `--tokenizer-path` / `--model-path`
(cpu/text.py; without one, as under `--skip-tokenizer-init`). Requests are checked with SGLang's own classes
where the wheel is installed (receive.py, ../protocol/). It is stricter than SGLang where SGLang would silently
do the wrong thing: unknown fields, generating with released or not-yet-reloaded weights, releasing memory with
requests in flight. API keys (`--api-key`, `--admin-api-key`, or both from a `--config` YAML file, SGLang's way
of keeping them off the command line) are enforced by SGLang's rules before any route runs (guard.py);
`/generate` is checked and answered as SGLang does (generate.py), with sampling masks and routed experts. With
`--enable-lora` it holds LoRA adapters by name and applies them to the requests that name them (lora.py).

With `--is-embedding` it serves a sequence classifier (a reward model) on `/classify` and `/encode`, as
SGLang serves one (classify.py), and refuses `/generate`.

Not served: text prompts to /generate (the trainer tokenises), streaming, the OpenAI routes, `--tp-size` > 1 for
the distributed transport (the tensor transport accepts one payload per TP rank, as SGLang does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from fastapi import Request  # module level: FastAPI resolves the string annotations here

from mgrpo.rollout.sglang.cpu import generate as cpu_generate
from mgrpo.rollout.sglang.cpu import lora as cpu_lora
from mgrpo.rollout.sglang.cpu import receive
from mgrpo.rollout.sglang.cpu.guard import BodyTooLarge, Guard, Refusals
from mgrpo.rollout.sglang.cpu.receive import RequestError
from mgrpo.rollout.sglang.protocol import wheel

log = logging.getLogger("mgrpo.cpu_server")

HEALTH_CHECK_TIMEOUT_S = 20.0  # sglang/srt/entrypoints/http_server.py HEALTH_CHECK_TIMEOUT

# SGLang launch arguments that mean nothing on one CPU process: accepted and ignored.
IGNORED_FLAGS = ("--enable-deterministic-inference", "--disable-cuda-graph", "--trust-remote-code",
                 "--disable-radix-cache", "--enable-metrics", "--disable-overlap-schedule",
                 "--enable-torch-compile", "--disable-custom-all-reduce", "--enable-return-hidden-states")
IGNORED_OPTIONS = ("--chunked-prefill-size", "--max-running-requests", "--max-total-tokens", "--attention-backend",
                   "--sampling-backend", "--base-gpu-id", "--gpu-id-step", "--nnodes", "--node-rank",
                   "--dist-init-addr", "--load-format", "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill",
                   "--schedule-policy", "--log-level-http", "--quantization", "--kv-cache-dtype",
                   "--watchdog-timeout", "--dist-timeout", "--device")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\nThe CPU rollout server takes the SGLang launch arguments it "
                     f"implements (see --help) and ignores these GPU-only ones: {' '.join(IGNORED_FLAGS)} "
                     f"{' '.join(IGNORED_OPTIONS)} (each with its value); anything else is refused.\n")


def _merge_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """SGLang's `--config FILE.yaml` (server_args.py::prepare_server_args): the file's keys become
    arguments placed before the command line's (which win). SGLang's own merger where the wheel is
    installed, the same conversion (scalars and store_true flags) otherwise."""
    if "--config" not in argv:
        return argv
    merger = wheel.config_merger()
    if merger is not None:
        try:
            return merger.ConfigArgumentMerger(parser).merge_config_with_args(argv)
        except ValueError as e:
            parser.error(f"--config: {e}")
    import yaml

    i = argv.index("--config")
    if i + 1 >= len(argv):
        parser.error("--config: no config file specified after --config flag")
    with open(argv[i + 1]) as f:
        data = yaml.safe_load(f) or {}
    flags = {a.dest for a in parser._actions if isinstance(a, argparse._StoreTrueAction)}
    extra: list[str] = []
    for key, value in data.items():
        if isinstance(value, bool) and key.replace("-", "_") in flags:
            extra += [f"--{key}"] if value else []
        else:
            extra += [f"--{key}", str(value)]
    return extra + argv[:i] + argv[i + 2:]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m mgrpo.rollout.sglang.cpu.server", allow_abbrev=False,
                description="CPU rollout server speaking SGLang's HTTP protocol (transformers underneath).")
    p.add_argument("--model-path", required=True, help="HF checkpoint directory")
    p.add_argument("--tokenizer-path", default=None,
                   help="the tokenizer for stop strings and grammars (default: --model-path; input is token ids)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: stop strings and grammars are refused, as SGLang refuses them")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1, dest="tp_size")
    p.add_argument("--dp-size", type=int, default=1, choices=[1])
    p.add_argument("--pp-size", type=int, default=1, choices=[1])
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted; CPU memory is not reserved")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="release_memory_occupation really frees the weights (contents lost unless backed up)")
    p.add_argument("--enable-weights-cpu-backup", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16"])
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--log-level", default="info")
    p.add_argument("--api-key", default=None, help="every endpoint but health and metrics requires it")
    p.add_argument("--admin-api-key", default=None, help="the weight, memory and control endpoints require it")
    p.add_argument("--context-length", type=int, default=None, help="default: the model config's")
    p.add_argument("--sampling-mask-max-tokens", type=int, default=4096)
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--ep-size", "--expert-parallel-size", "--ep", type=int, default=1, dest="ep_size",
                   help="accepted (one process holds every expert); 1 or --tp-size, as SGLang checks")
    p.add_argument("--is-embedding", action="store_true",
                   help="serve a sequence classifier (a reward model) on /classify and /encode (cpu/classify.py)")
    p.add_argument("--config", default=None, help="YAML file of arguments (SGLang's --config)")
    cpu_lora.add_arguments(p)
    for flag in IGNORED_FLAGS:
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for opt in IGNORED_OPTIONS:
        p.add_argument(opt, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(_merge_config(p, list(sys.argv[1:] if argv is None else argv)))
    if args.tp_size < 1:
        p.error(f"--tp-size must be >= 1, got {args.tp_size}")
    if args.ep_size < 1 or (args.ep_size > 1 and args.ep_size != args.tp_size):
        p.error(f"--ep-size {args.ep_size}: ep_size * moe_dp_size must be equal to tp_size ({args.tp_size})")
    if args.sampling_mask_max_tokens <= 0:
        p.error(f"--sampling-mask-max-tokens must be positive (got {args.sampling_mask_max_tokens}).")
    return args


class State:
    def __init__(self, args: argparse.Namespace, model, text=None):
        from mgrpo.rollout.sglang.cpu.text import ServerText

        self.args = args
        self.model = model
        self.text = text or ServerText(None, model.model.config.vocab_size, [])
        """The tokenizer and grammar compiler (cpu/text.py)."""
        self.weight_version = str(args.weight_version)
        self.session_open = False
        self.groups: dict[str, Any] = {}
        self.recv_buffer = None  # flattened broadcasts land here (grown to the largest bucket)
        self.pending = 0  # generation jobs queued or running
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.queue: list = []  # (reqs, submitted, future) of /generate calls waiting for the model
        self.in_flight: dict[str, int] = {}  # rids of the /generate calls not answered yet (SGLang's rid_to_state)
        self.draining = False
        self.refusals = Refusals()
        cfg = model.model.config
        self.limits = cpu_generate.Limits(
            vocab_size=cfg.vocab_size, context_len=args.context_length or cfg.max_position_embeddings,
            mask_max_tokens=args.sampling_mask_max_tokens, routes=args.enable_return_routed_experts)

    async def generate(self, reqs, submitted: float):
        """Continuous batching, as SGLang's scheduler does: calls that arrive while the model is busy wait
        together and run as one batch (a router sends one request per call, so without this every request
        would be a forward pass of its own)."""
        fut = asyncio.get_running_loop().create_future()
        self.queue.append((reqs, submitted, fut))
        for r in reqs:
            self.in_flight[r.rid] = self.in_flight.get(r.rid, 0) + 1
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain())
        try:
            return await fut
        finally:
            for r in reqs:
                self.in_flight[r.rid] -= 1
                if not self.in_flight[r.rid]:
                    del self.in_flight[r.rid]

    async def _drain(self) -> None:
        from mgrpo.rollout.sglang.cpu.model import ModelError

        try:
            while self.queue:
                jobs, self.queue = self.queue, []
                # Calls an abort_all already covers run alone (and are aborted at once); the rest run as one
                # batch stamped with the newest arrival, so a later abort_all still aborts all of them.
                cut = self.model.abort_all_before
                alone = [j for j in jobs if j[1] <= cut]
                merged = [j for j in jobs if j[1] > cut]
                groups = [[j] for j in alone] + ([merged] if merged else [])
                for group in groups:
                    reqs = [r for j in group for r in j[0]]
                    try:
                        await self.on_model(self.model.generate, reqs, max(j[1] for j in group), generation=True)
                    except ModelError as e:
                        if len(group) > 1:
                            groups.extend([j] for j in group)  # one bad call must not fail the others
                        elif not group[0][2].done():
                            group[0][2].set_exception(e)
                        continue
                    except Exception as e:  # noqa: BLE001 - handed to each waiting call
                        for j in group:
                            if not j[2].done():
                                j[2].set_exception(e)
                        continue
                    for j in group:
                        if not j[2].done():
                            j[2].set_result(j[0])
        finally:
            self.draining = False

    async def on_model(self, fn, *args, generation: bool = False):
        """Run `fn` on the single model thread (generation and weight loads never interleave)."""
        if generation:
            self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)
        finally:
            if generation:
                self.pending -= 1


def build_app(state: State):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    from mgrpo.rollout.sglang.cpu.model import ModelError

    app = FastAPI(title="mgrpo CPU rollout server (SGLang protocol)")
    app.add_middleware(Guard, api_key=state.args.api_key, admin_api_key=state.args.admin_api_key,
                       refusals=state.refusals)
    model = state.model

    def result(success: bool, message: str, **extra) -> JSONResponse:
        return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        if e.internal:  # what SGLang's server answers an exception it does not catch
            log.error("%s %s: %s", request.method, request.url.path, e)
            return PlainTextResponse("Internal Server Error", status_code=500)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ModelError)
    async def _model_error(request, e: ModelError):
        return JSONResponse({"error": {"message": str(e)}}, status_code=400)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request, e: BodyTooLarge):
        return JSONResponse({"error": {"message": str(e)}}, status_code=413)

    async def json_body(request: Request, path: str):
        raw = await request.body()
        try:
            return json.loads(raw) if raw else None
        except ValueError as e:  # FastAPI's json_invalid, answered by SGLang's handler as a 400
            raise RequestError(f"{path}: the body is not JSON: {e}", validation=True) from e

    async def body_of(request: Request, path: str) -> dict:
        return receive.check_request(path, await json_body(request, path))

    if state.args.is_embedding:
        from mgrpo.rollout.sglang.cpu import classify

        classify.add_routes(app, state, json_body)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        if state.args.is_embedding:
            from mgrpo.rollout.sglang.cpu.classify import NOT_GENERATION

            return JSONResponse({"error": {"message": NOT_GENERATION}}, status_code=400)
        t0 = time.monotonic()
        body = await json_body(request, "/generate")
        try:
            receive.check_generate(body)
        except RequestError as e:  # SGLang's contract error: {"error": "<message>"}
            return JSONResponse({"error": str(e)}, status_code=400)
        reqs, single, logprob = cpu_generate.parse(body, state.limits, state.text.tokenizer)
        cpu_lora.attach(model.lora, reqs, body, single)  # the adapter each request names (SGLang's lora_path)
        if any(r.grammar_key is not None for r in reqs):  # compiling may take a while: not on the event loop
            await asyncio.get_running_loop().run_in_executor(None, state.text.compile, reqs)
        model.check_servable()
        done = await state.generate(reqs, t0)
        refused = cpu_generate.refusal(done)
        if refused is not None:
            raise refused
        items = [cpu_generate.answer(r, state.weight_version, lp, t0) for r, lp in zip(done, logprob)]
        return items[0] if single else items

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.refusals.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        """SGLang: healthy when the scheduler answers anything within the timeout; a one-token
        generation when idle. With memory released there is nothing to generate with: 200 as /health."""
        tic = time.monotonic()
        if model.released or model.stale:
            return Response(status_code=200)
        from mgrpo.rollout.sglang.cpu.model import Req

        if state.args.is_embedding:  # SGLang probes an embedding model with an EmbeddingReqInput of [0]
            job = asyncio.ensure_future(state.on_model(model.scores, [[0]]))
        else:
            probe = Req(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0], temperature=0.0, max_new_tokens=1)
            job = asyncio.ensure_future(state.on_model(model.generate, [probe]))
        while time.monotonic() < tic + HEALTH_CHECK_TIMEOUT_S:
            if job.done() or model.last_progress > tic:
                return Response(status_code=200)
            await asyncio.sleep(0.05)
        return Response(status_code=503)

    async def model_info():
        return {"model_path": state.args.model_path, "is_generation": not state.args.is_embedding,
                "served_model_name": state.args.served_model_name or state.args.model_path,
                "tokenizer_path": state.args.tokenizer_path or state.args.model_path,
                "preferred_sampling_params": None, "weight_version": state.weight_version, "load_format": None,
                "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
                "model_type": model.model.config.model_type, "architectures": getattr(model.model.config,
                                                                                       "architectures", None)}

    app.get("/model_info")(model_info), app.get("/get_model_info")(model_info)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if state.pending:  # SGLang flushes only when idle
            return PlainTextResponse("Flush cache failed: there are running or waiting requests.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await body_of(request, "/abort_request")
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all", False))
        if abort_all:
            model.abort(None, True)
        elif rid in state.in_flight:
            # SGLang 0.5.23: the tokenizer manager passes on only a rid it holds (one tokenizer worker; an empty or
            # unknown rid is ignored), and the scheduler then aborts every request whose rid starts with it.
            for other in [r for r in state.in_flight if r.startswith(rid)]:
                model.abort(other, False)
        return Response(status_code=200)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await body_of(request, "/update_weight_version")
        if body.get("abort_all_requests", True):
            model.abort(None, True)
        state.weight_version = body["new_version"]
        log.info("weight version -> %s", state.weight_version)
        return result(True, f"Weight version updated to {body['new_version']}", new_version=body["new_version"])

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        await body_of(request, "/begin_weight_update")
        if state.session_open:
            return result(False, "a weight-update session is already open; call end_weight_update() first")
        state.session_open = True
        return result(True, "Success")

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        await body_of(request, "/end_weight_update")
        if not state.session_open:
            return result(False, "no weight-update session is open; call begin_weight_update() first")
        state.session_open = False
        return result(True, "Success")

    from mgrpo.rollout.sglang.cpu import weights as cpu_weights

    cpu_weights.add_routes(app, state, body_of, result)
    cpu_lora.add_routes(app, state, body_of)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        body = await body_of(request, "/release_memory_occupation")
        if state.pending:
            raise ModelError("release_memory_occupation should be called only when server is idle.")
        await state.on_model(model.release, body.get("tags"))
        log.info("released %s", body.get("tags") or "all")
        return None

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        body = await body_of(request, "/resume_memory_occupation")
        await state.on_model(model.resume, body.get("tags"))
        log.info("resumed %s", body.get("tags") or "all")
        return None

    return app


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stdout)
    import uvicorn

    from mgrpo.rollout.sglang.cpu.model import CPUModel

    t0 = time.monotonic()
    try:
        if args.is_embedding:
            from mgrpo.rollout.sglang.cpu.classify import ClassifierModel

            model = ClassifierModel(args.model_path, dtype=args.dtype)
        else:
            model = CPUModel(args.model_path, dtype=args.dtype, seed=args.random_seed,
                             enable_memory_saver=args.enable_memory_saver,
                             enable_weights_cpu_backup=args.enable_weights_cpu_backup,
                             return_routed_experts=args.enable_return_routed_experts)
    except ValueError as e:
        sys.exit(f"python -m mgrpo.rollout.sglang.cpu.server: {e}")
    text = None
    if not args.is_embedding:
        from mgrpo.rollout.sglang.cpu.text import ServerText

        text = ServerText.load(args, model.model.config.vocab_size, model.eos_ids)
        model.use_tokenizer(text.tokenizer, text.stop_ids())
    model.lora = cpu_lora.from_args(model.model, args)
    state = State(args, model, text)
    log.info("loaded %s (%d parameters) in %.1fs; sglang request classes: %s; API key: %s", args.model_path,
             model.info()["parameters"], time.monotonic() - t0,
             "checked with the installed wheel" if wheel.request_classes() else "field tables only (no sglang wheel)",
             "required" if args.api_key or args.admin_api_key else "NONE (anyone who reaches the port may use it)")
    uvicorn.run(build_app(state), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
