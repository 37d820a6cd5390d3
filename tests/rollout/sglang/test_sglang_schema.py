"""Our knowledge of SGLang's protocol (mgrpo/rollout/sglang/protocol/) against SGLang's own code,
read from the installed sglang wheel (the test extra installs it: requirements-sglang.txt), and
the fallbacks the CPU server uses where the wheel is missing."""

from __future__ import annotations

import pickle

import pytest
import torch

from mgrpo.rollout.sglang.cpu import receive
from mgrpo.rollout.sglang.cpu.receive import RequestError, check_generate, check_request
from mgrpo.rollout.sglang.protocol import tables, wheel
from mgrpo.rollout.sglang.weights_tensor import tensor_payloads


def _wheel():
    classes = wheel.request_classes()
    if classes is None:
        pytest.skip("sglang wheel or msgspec not installed (pip install --no-deps -r requirements-sglang.txt)")
    return classes


def test_the_installed_wheel_is_the_version_the_shapes_were_read_from():
    _wheel()
    from importlib.metadata import version

    assert version("sglang") == tables.SGLANG_VERSION


def test_field_tables_match_sglangs_request_classes():
    import msgspec

    for path, cls in _wheel().items():
        real = {f.name for f in msgspec.structs.fields(cls)}
        assert real == tables.REQUESTS[path][1] | tables.BASE_FIELDS, path
    sampling = wheel.contract().SamplingParams
    assert {f.name for f in msgspec.structs.fields(sampling)} == tables.SAMPLING_FIELDS


def test_sglangs_classes_check_types_and_required_fields():
    _wheel()
    check_request("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1,
                                                 "world_size": 2, "group_name": "g", "backend": "gloo"})
    with pytest.raises(RequestError, match=r"master_port: Field required") as e:
        check_request("/init_weights_update_group", {"master_address": "x", "rank_offset": 1, "world_size": 2})
    assert e.value.status == 400 and e.value.validation  # SGLang answers FastAPI's validation error 400
    with pytest.raises(RequestError, match=r"new_version: Input should be a valid string"):
        check_request("/update_weight_version", {"new_version": 3})
    with pytest.raises(RequestError, match=r"serialized_named_tensors.*base64"):
        check_request("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]})


def test_fallbacks_without_the_wheel(monkeypatch):
    """What the CPU server does where the wheel is not installed: field tables, our unpickler."""
    monkeypatch.setattr(receive, "request_classes", lambda: None)
    monkeypatch.setattr(receive, "_adapter", lambda path: None)
    monkeypatch.setattr(receive, "contract", lambda: None)
    monkeypatch.setattr(receive, "common", lambda: None)
    check_request("/update_weight_version", {"new_version": "3"})
    with pytest.raises(RequestError, match=r"unknown fields \['new_versoin'\]"):
        check_request("/update_weight_version", {"new_versoin": "3"})
    with pytest.raises(RequestError, match=r"unknown sampling_params fields \['temprature'\]"):
        check_generate({"input_ids": [[1]], "sampling_params": [{"temprature": 1.0}]})
    t = torch.arange(6, dtype=torch.float32)
    payloads, keep = tensor_payloads([("w", t)], 1, None)
    (name, back), = receive.deserialize(payloads[0])
    assert name == "w" and torch.equal(back, t)
    evil = pickle.dumps(pickle.loads)  # a global outside the allow-list
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        receive.deserialize(evil)


def test_unknown_fields_are_refused_even_where_sglang_would_ignore_them():
    with pytest.raises(RequestError, match=r"unknown fields \['flush_cahce'\].*ignore them silently"):
        check_request("/update_weights_from_tensor", {"serialized_named_tensors": [], "flush_cahce": False})


# --- launch arguments and /generate fields against the wheel's ServerArgs and GenerateReqInput -----------
def _sglang_cli_flags() -> set[str]:
    """Every option string `python -m sglang.launch_server` accepts (0.5.23): the dataclass fields of
    srt/arg_groups/fields/*.py (`A[type, "help"]` or `A[type, Arg(...)]`: --field-name, its aliases, or its
    cli_name; no_cli fields have none) and the options server_args.py adds by hand (--config, ...)."""
    import ast
    import glob
    import os

    root = wheel.sglang_dir()
    if root is None:
        pytest.skip("sglang wheel not installed")
    flags: set[str] = set()
    for path in glob.glob(os.path.join(root, "srt", "arg_groups", "fields", "*.py")):
        for node in ast.walk(ast.parse(open(path).read())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(node.annotation, ast.Subscript) and isinstance(node.annotation.slice, ast.Tuple)):
                continue
            meta = node.annotation.slice.elts[1]
            names = [f"--{node.target.id.replace('_', '-')}"]
            if isinstance(meta, ast.Call) and getattr(meta.func, "id", None) == "Arg":
                kw = {k.arg: k.value for k in meta.keywords}
                if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
                    continue
                if "cli_name" in kw:
                    names = [ast.literal_eval(kw["cli_name"])]
                names += ast.literal_eval(kw["aliases"]) if "aliases" in kw else []
            elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
                continue
            flags.update(names)
    for node in ast.walk(ast.parse(open(os.path.join(root, "srt", "server_args.py")).read())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
    assert {"--tp-size", "--api-key", "--admin-api-key", "--config", "--ep-size"} <= flags  # the reader works
    return flags


def test_launch_command_and_cpu_server_flags_are_sglangs():
    """What SGLangEngine.launch runs (every option on) and every flag the CPU server takes exist in
    SGLang's ServerArgs, under the same spelling."""
    from mgrpo.rollout.sglang.cpu.server import build_parser
    from mgrpo.rollout.sglang.server import SGLANG_MODULE, launch_command

    flags = _sglang_cli_flags()
    cmd = launch_command(SGLANG_MODULE, "/ckpt", tp=2, host="10.0.0.1", port=1, mem_fraction_static=0.7,
                         weight_version=0, enable_memory_saver=True, ep=2, return_routed_experts=True,
                         key_file="/tmp/k.yaml")
    used = {a for a in cmd if a.startswith("--")}
    assert {"--ep-size", "--enable-return-routed-experts", "--config", "--enable-memory-saver"} <= used
    assert used <= flags, sorted(used - flags)
    theirs = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    assert theirs <= flags, sorted(theirs - flags)  # its ignored GPU-only options included


def test_generate_fields_are_sglangs():
    """The /generate fields the CPU server implements are GenerateReqInput's (io_struct.py)."""
    import ast
    import os

    from mgrpo.rollout.sglang.cpu.generate import GENERATE_FIELDS, SAMPLING_DEFAULTS, SAMPLING_IMPLEMENTED, \
        SAMPLING_TEXT_ONLY

    root = wheel.sglang_dir()
    if root is None:
        pytest.skip("sglang wheel not installed")
    tree = ast.parse(open(os.path.join(root, "srt", "managers", "io_struct.py")).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    fields = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)}
    assert GENERATE_FIELDS <= fields, sorted(GENERATE_FIELDS - fields)
    # every sampling parameter of SGLang's contract is implemented, text-only, or refused unless at its default
    assert SAMPLING_IMPLEMENTED | SAMPLING_TEXT_ONLY | set(SAMPLING_DEFAULTS) == tables.SAMPLING_FIELDS


def test_classify_fields_are_sglangs():
    """The /classify fields the CPU server implements are EmbeddingReqInput's (io_struct.py)."""
    import ast
    import os

    from mgrpo.rollout.sglang.cpu.classify import CLASSIFY_FIELDS

    root = wheel.sglang_dir()
    if root is None:
        pytest.skip("sglang wheel not installed")
    tree = ast.parse(open(os.path.join(root, "srt", "managers", "io_struct.py")).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EmbeddingReqInput")
    fields = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)}
    assert CLASSIFY_FIELDS <= fields, sorted(CLASSIFY_FIELDS - fields)
    http = open(os.path.join(root, "srt", "entrypoints", "http_server.py")).read()
    assert '@app.api_route("/classify", methods=["POST", "PUT"])\nasync def classify_request(obj: EmbeddingReqInput' \
        in http
