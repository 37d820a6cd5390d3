"""The rollout fleet's key: SGLang's rules read from the wheel, the CPU server enforcing
them on every route it serves, the key kept off command lines, the client, the weight senders and the
router using it, and refusals counted."""

from __future__ import annotations

import ast
import asyncio
import itertools
import os
import subprocess
import sys

import pytest
import requests

from mgrpo.rollout.sglang import auth
from mgrpo.rollout.sglang.auth import resolve_api_key
from mgrpo.rollout.sglang.cpu.auth import decide_fallback
from mgrpo.rollout.sglang.cpu.guard import Guard, Refusals
from mgrpo.rollout.sglang.http import SGLangAuthError
from mgrpo.rollout.sglang.protocol import wheel
from mgrpo.rollout.sglang.protocol.tables import ADMIN_OPTIONAL
from mgrpo.rollout.types import GenerateRequest, SamplingParams
from tests.helpers.sglang_cpu import Reference, launch, perturbed, tiny_checkpoint

API, ADMIN = "api-key-AAAA", "admin-key-BBBB"


def _wheel_file(*parts):
    path = wheel.wheel_file(*parts)
    if path is None:
        pytest.skip("sglang wheel not installed (pip install --no-deps -r requirements-sglang.txt)")
    return path


def _served_routes() -> dict[str, set[str]]:
    """path -> methods of every route the CPU server defines (read from its source, as the app builds them)."""
    import mgrpo.rollout.sglang.cpu.lora as lora
    import mgrpo.rollout.sglang.cpu.server as srv
    import mgrpo.rollout.sglang.cpu.weights as wts

    routes: dict[str, set[str]] = {}
    for mod in (srv, wts, lora):
        for node in ast.walk(ast.parse(open(mod.__file__).read())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "app"):
                continue
            verb = node.func.attr
            if verb not in ("get", "post", "api_route") or not node.args or not isinstance(node.args[0], ast.Constant):
                continue
            methods = {verb.upper()} if verb != "api_route" else {
                m.value for kw in node.keywords if kw.arg == "methods" for m in kw.value.elts}
            routes.setdefault(node.args[0].value, set()).update(methods)
    return routes


ROUTES = _served_routes()


# --- SGLang's rules -------------------------------------------------------------------------------------
def test_admin_table_is_sglangs_for_every_route_the_cpu_server_serves():
    tree = ast.parse(open(_wheel_file("srt", "entrypoints", "http_server.py")).read())
    sglang: dict[str, bool] = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths = [d.args[0].value for d in fn.decorator_list if isinstance(d, ast.Call)
                 and isinstance(d.func, ast.Attribute) and getattr(d.func.value, "id", None) == "app"
                 and d.args and isinstance(d.args[0], ast.Constant)]
        admin = any("ADMIN_OPTIONAL" in ast.unparse(d) for d in fn.decorator_list)
        for p in paths:
            sglang[p] = admin
    assert len(ROUTES) >= 17 and {"/generate", "/update_weights_from_tensor", "/health_generate"} <= set(ROUTES)
    # SGLang serves /metrics through its Prometheus exporter, not as a route of its own
    missing = sorted(p for p in ROUTES if p not in sglang and p != "/metrics")
    assert not missing, f"routes SGLang does not have: {missing}"
    assert {p for p in ROUTES if sglang.get(p)} == set(ADMIN_OPTIONAL)


def test_fallback_decides_exactly_as_sglangs_decide_request_auth():
    mod = wheel.auth_rules()
    if mod is None:
        pytest.skip("sglang wheel not installed")
    headers = [None, "", "Bearer", f"Bearer {API}", f"bearer {API}", f"Bearer {ADMIN}", "Bearer wrong", f"Basic {API}",
               f"Bearer  {API}"]
    paths = ["/generate", "/update_weights_from_tensor", "/health", "/health_generate", "/metrics", "/ready", "/nope"]
    n = 0
    for method, path, header, (api, admin), level in itertools.product(
            ["GET", "POST", "OPTIONS"], paths, headers, [(None, None), (API, None), (None, ADMIN), (API, ADMIN)],
            list(mod.AuthLevel)):
        real = mod.decide_request_auth(method=method, path=path, authorization_header=header, api_key=api,
                                       admin_api_key=admin, auth_level=level)
        mine = decide_fallback(method=method, path=path, authorization_header=header, api_key=api,
                               admin_api_key=admin, auth_level=level.value)
        assert (mine.allowed, mine.error_status_code if not mine.allowed else 401) == \
               (real.allowed, real.error_status_code if not real.allowed else 401), (method, path, header, api, admin)
        n += 1
    assert n == 3 * 7 * 9 * 4 * 3


def test_resolve_api_key():
    a, b = resolve_api_key("auto", {}), resolve_api_key("auto", {})
    assert a != b and len(a) >= 40  # fresh per run: 32 random bytes
    # never a key a server's argument parser reads as a flag (a urlsafe key began with '-' in a chaos run:
    # every engine restart after the resume failed with 'argument --api-key: expected one argument')
    assert not any(resolve_api_key("auto", {}).startswith("-") for _ in range(500))
    assert resolve_api_key("auto", {auth.ENV_KEY: "per-job"}) == "per-job"  # slurm/train.sbatch's
    assert resolve_api_key("none", {auth.ENV_KEY: "per-job"}) is None
    assert resolve_api_key("env:MY_KEY", {"MY_KEY": "mine"}) == "mine"
    assert resolve_api_key("s3cret", {}) == "s3cret"
    with pytest.raises(ValueError, match=r"rollout.api_key=env:MY_KEY: the environment variable MY_KEY is not set"):
        resolve_api_key("env:MY_KEY", {})
    with pytest.raises(ValueError, match=r"\$MGRPO_ROLLOUT_API_KEY: a key may not start with '-'"):
        resolve_api_key("auto", {auth.ENV_KEY: "-abc"})
    for bad in ("", "a b", "a:b", "-abc"):
        with pytest.raises(ValueError, match="rollout.api_key"):
            resolve_api_key(bad, {})


def test_guard_counts_refusals_and_bounds_bodies_before_the_route_runs():
    """The ASGI middleware alone: refused requests never reach the app; bodies over the bound get 413."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    refusals = Refusals()
    guard = Guard(app, api_key=API, admin_api_key=ADMIN, refusals=refusals, max_body_bytes=100)

    def call(path, header=None, body=b"{}", length=True):
        sent = []
        headers = ([(b"authorization", header.encode())] if header else []) + \
                  ([(b"content-length", str(len(body)).encode())] if length else [])
        scope = {"type": "http", "path": path, "method": "POST", "headers": headers, "client": ("1.2.3.4", 5)}
        chunks = iter([{"type": "http.request", "body": body[i:i + 64], "more_body": i + 64 < len(body)}
                       for i in range(0, max(len(body), 1), 64)])

        async def receive():
            return next(chunks)

        async def send(msg):
            sent.append(msg)

        try:
            asyncio.run(guard(scope, receive, send))
        except ValueError as e:  # the bounded receive raising on a chunked body (the server answers 413)
            return 413, str(e)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]).decode()

    assert call("/generate") == (401, '{"error": "Unauthorized"}')
    assert call("/generate", f"Bearer {ADMIN}")[0] == 401  # the admin key is not the API key
    assert call("/generate", f"Bearer {API}") == (200, "ok")
    assert call("/update_weights_from_tensor", f"Bearer {API}")[0] == 401  # admin routes take the admin key only
    assert call("/update_weights_from_tensor", f"Bearer {ADMIN}") == (200, "ok")
    assert call("/health_generate") == (200, "ok") and call("/metrics") == (200, "ok")
    assert call("/no_such_route")[0] == 401  # unknown routes are NORMAL: the key first, then 404
    assert reached == ["/generate", "/update_weights_from_tensor", "/health_generate", "/metrics"]
    assert call("/generate", f"Bearer {API}", body=b"x" * 101)[0] == 413
    assert call("/generate", f"Bearer {API}", body=b"x" * 300, length=False)[0] == 413
    assert refusals.total() == 4 and refusals.total((413,)) == 2
    assert 'mgrpo_cpu_server_refused_total{path="/generate",status="401"} 2' in refusals.prometheus()


# --- the CPU server, launched with two different keys ----------------------------------------------------
@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    ckpt = tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))
    cfg = tmp_path_factory.mktemp("keys") / "keys.yaml"
    cfg.write_text(f"api-key: {API}\nadmin-api-key: {ADMIN}\n")
    eng = launch(ckpt, str(tmp_path_factory.mktemp("logs")), extra_args=["--config", str(cfg)])
    yield eng, ckpt
    eng.shutdown()


def _send(url, method, path, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.request(method, url + path, data=b"\x80\x04garbage that is neither JSON nor a pickle",
                            headers=headers, timeout=30)


@pytest.mark.integration
def test_every_endpoint_refuses_missing_and_wrong_keys(keyed):
    eng, _ = keyed
    before = eng.refused_requests()
    sent = 0
    for path, methods in sorted(ROUTES.items()):
        for method in sorted(methods):
            for key in (None, "wrong", API if path in ADMIN_OPTIONAL else ADMIN):
                r = _send(eng.url, method, path, key)
                if path.startswith(("/health", "/metrics")):  # SGLang keeps probes and metrics open
                    assert r.status_code == 200, (method, path)
                    continue
                # 401 with SGLang's body, before the body was read: the garbage never met a parser
                assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), (method, path, key)
                sent += 1
    assert sent >= 3 * 16
    assert eng.refused_requests() - before == sent  # the server counted every one (its /metrics)
    right = _send(eng.url, "POST", "/update_weights_from_tensor", ADMIN)
    assert right.status_code == 400 and "not JSON" in right.text  # with the key the body is parsed, and refused


@pytest.mark.integration
def test_the_right_keys_serve(keyed):
    eng, ckpt = keyed
    from mgrpo.rollout.sglang import SGLangEngine, TensorWeightSender

    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    assert requests.post(eng.url + "/generate", json=body, headers={"Authorization": f"Bearer {API}"},
                         timeout=30).status_code == 200
    client = SGLangEngine.connect(eng.url, api_key=API)
    assert len(client.generate([GenerateRequest(0, [1, 2])], SamplingParams(max_new_tokens=3))[0].token_ids) == 3
    with pytest.raises(SGLangAuthError, match=r"HTTP 401.*rollout.api_key") as e:
        SGLangEngine.connect(eng.url, api_key="wrong").generate([GenerateRequest(0, [1])], SamplingParams())
    assert e.value.status == 401
    admin = SGLangEngine.connect(eng.url, api_key=ADMIN)  # weight updates take the admin key
    ref = Reference(ckpt)
    new = perturbed(ref.state(), 7)
    TensorWeightSender([eng.url], 1, api_key=ADMIN).update_weights(new)
    with pytest.raises(SGLangAuthError):
        TensorWeightSender([eng.url], 1, api_key=API).update_weights(new[:1])
    admin.finish_weight_update(7)
    ref.load(new)
    out = client.generate([GenerateRequest(0, [1, 2])], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert out[0].weight_version == 7 and ref.max_diff([1, 2], out[0], 0.0) < 1e-5


@pytest.mark.integration
def test_launch_keeps_the_key_off_every_command_line(tmp_path):
    ckpt = tiny_checkpoint(str(tmp_path / "tiny"))
    key = "do-not-show-this-key-0123456789"
    eng = launch(ckpt, str(tmp_path / "logs"), api_key=key)
    try:
        cmdlines = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert key not in cmdlines and "--config" in open(f"/proc/{eng.process.pid}/cmdline").read()
        key_file = open(f"/proc/{eng.process.pid}/cmdline").read().split("\0")
        key_file = key_file[key_file.index("--config") + 1]
        assert not os.path.exists(key_file) and not os.path.exists(os.path.dirname(key_file))  # removed once up
        assert oct(os.stat(eng.log_path).st_mode & 0o777) == "0o600"
        assert requests.post(eng.url + "/generate", json={"input_ids": [1]}, timeout=30).status_code == 401
        assert eng.generate([GenerateRequest(0, [1, 2])], SamplingParams(max_new_tokens=2))[0].token_ids
    finally:
        eng.shutdown()


# --- the router ----------------------------------------------------------------------------------------
@pytest.mark.integration
def test_router_requires_the_key_and_counts_refusals(keyed, tmp_path):
    pytest.importorskip("sglang_router")
    from mgrpo.rollout.sglang.router import RoutedClient

    eng, _ = keyed
    # the router sends its key to the worker on /generate: the worker's API key
    front = RoutedClient([eng.url], host="127.0.0.1", log_dir=str(tmp_path), api_key=API, max_retries=0)
    try:
        pid = front.router.process.pid
        assert API not in open(f"/proc/{pid}/cmdline").read()
        assert API not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        out = front.generate([GenerateRequest(0, [1, 2]), GenerateRequest(1, [3])], SamplingParams(max_new_tokens=2))
        assert [len(r.token_ids) for r in out] == [2, 2]
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
        base = front.router.url
        codes = [requests.post(base + "/generate", json=body, headers=h, timeout=30).status_code
                 for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {ADMIN}"})]
        codes += [requests.get(base + "/workers", headers=h, timeout=30).status_code
                  for h in ({}, {"Authorization": "Bearer wrong"})]
        assert codes == [401] * 5
        assert requests.get(base + "/workers", headers={"Authorization": f"Bearer {API}"}, timeout=30).ok
        assert front.refused_requests() == 5
    finally:
        front.shutdown()
    assert front.router.process.poll() is not None


@pytest.mark.integration
def test_cpu_server_reads_keys_from_config_like_sglang(tmp_path):
    """`--config` YAML: SGLang's merger (dash-spelled keys become flags); the command line wins."""
    from mgrpo.rollout.sglang.cpu.server import parse_args

    cfg = tmp_path / "k.yaml"
    cfg.write_text("api-key: from-file\nadmin-api-key: admin-file\nenable-return-routed-experts: true\n")
    base = ["--model-path", "/m", "--host", "127.0.0.1", "--port", "1"]
    args = parse_args(base + ["--config", str(cfg)])
    assert (args.api_key, args.admin_api_key, args.enable_return_routed_experts) == ("from-file", "admin-file", True)
    assert parse_args(base + ["--config", str(cfg), "--api-key", "cli"]).api_key == "cli"
    cfg.write_text("no-such-option: 1\n")
    r = subprocess.run([sys.executable, "-m", "mgrpo.rollout.sglang.cpu.server", *base, "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--no-such-option" in r.stderr


@pytest.mark.integration
def test_key_file_goes_when_the_launcher_dies_mid_start(tmp_path):
    """A launcher SIGKILLed while its server starts (a Ray actor killed during a restart) runs no cleanup:
    the server's watchdog removes the key file with the server."""
    import signal
    import time

    script = tmp_path / "launcher.py"
    script.write_text(
        "import sys\n"
        "from mgrpo.rollout.sglang.auth import key_config_file\n"
        "from mgrpo.rollout.sglang.server import start_server\n"
        "path = key_config_file('k' * 40)\n"
        "print(path, flush=True)\n"
        "start_server([sys.executable, '-c', 'import time; time.sleep(120)'], 'http://127.0.0.1:9', "
        f"{str(tmp_path / 'server.log')!r}, startup_timeout_s=120, key_file=path)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert os.path.exists(path)
    deadline = time.monotonic() + 60
    while not (tmp_path / "server.log").exists() and time.monotonic() < deadline:  # the server is starting
        time.sleep(0.1)
    time.sleep(1.0)  # and its watchdog with it
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60  # the watchdog polls every 2 s, then gives the server 15 s to stop
    while os.path.exists(os.path.dirname(path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not os.path.exists(os.path.dirname(path))
