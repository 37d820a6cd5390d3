"""The SGLang client's pure parts and the server-process plumbing, without a server.

The request/answer shapes were read in sglang 0.5.23 (`srt/entrypoints/http_server.py`,
`srt/managers/io_struct.py`, `api/v1/api_types.py`, `tokenizer_manager.py`); where the sglang wheel
is installed, SGLang's own JSON contract checks our payloads (mgrpo/rollout/sglang/protocol/).
Everything that needs a server runs against the real CPU server: test_sglang_cpu_server.py and
test_sglang_sync.py.
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from mgrpo.rollout.sglang.client import (SGLangEngine, build_generate_payload, checkpoint_tensor_names,
                                         parse_generate_item)
from mgrpo.rollout.sglang.http import SGLangRequestError, SGLangUnavailableError
from mgrpo.rollout.sglang.protocol import tables, wheel
from mgrpo.net import free_port
from mgrpo.rollout.sglang.server import check_host, start_server
from mgrpo.rollout.types import GenerateRequest, SamplingParams

EOS = 2


def _requests(n=4):
    return [GenerateRequest(uid=i, prompt_ids=[1, i + 3, 5]) for i in range(n)]


# --- payloads ----------------------------------------------------------------------------------------------
def test_generate_payload_fields():
    reqs = _requests(4)
    body = build_generate_payload(reqs, SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=4, seed=11),
                                  rids=[f"r{i}" for i in range(4)], stop_token_ids=[EOS])
    assert body["input_ids"] == [r.prompt_ids for r in reqs] and body["rid"] == ["r0", "r1", "r2", "r3"]
    assert body["return_logprob"] is True
    sps = body["sampling_params"]
    assert [sp["temperature"] for sp in sps] == [0.7] * 4
    assert sps[0]["top_p"] == 0.9 and sps[0]["top_k"] == -1 and sps[0]["max_new_tokens"] == 4
    assert sps[0]["no_stop_trim"] is True and sps[0]["skip_special_tokens"] is False
    assert sps[0]["stop_token_ids"] == [EOS]
    assert len({sp["sampling_seed"] for sp in sps}) == 4  # n copies of a prompt must not share a seed
    assert set(sps[0]) <= tables.SAMPLING_FIELDS


def test_generate_without_seed_sends_one_sampling_dict_and_greedy_as_temperature_zero():
    body = build_generate_payload(_requests(2), SamplingParams(temperature=0.0, max_new_tokens=3), rids=["a", "b"])
    assert isinstance(body["sampling_params"], dict)
    assert body["sampling_params"]["temperature"] == 0.0 and "sampling_seed" not in body["sampling_params"]
    assert "stop_token_ids" not in body["sampling_params"]


def test_payload_passes_sglang_json_contract():
    contract = wheel.contract()
    if contract is None:
        pytest.skip("sglang wheel or msgspec not installed (pip install --no-deps -r requirements-sglang.txt)")
    body = build_generate_payload(_requests(3), SamplingParams(temperature=1.0, top_k=5, seed=3), rids=["a", "b", "c"],
                                  stop_token_ids=[EOS])
    req = contract.GenerateRequest.from_json_value(body)
    assert req.input_ids == [[1, 3, 5], [1, 4, 5], [1, 5, 5]]
    with pytest.raises(contract.JsonContractError):  # the decoder is strict: this check can fail
        contract.GenerateRequest.from_json_value({**body, "sampling_params": {"temprature": 1.0}})


def test_parse_rejects_inconsistent_answers():
    item = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                                                "output_token_logprobs": [[-0.5, 5, None]], "weight_version": "7"}}
    with pytest.raises(SGLangRequestError, match="disagree"):
        parse_generate_item(item, 0, 0)
    item["output_ids"] = [5]
    assert parse_generate_item(item, 0, 0).weight_version == 7
    item["meta_info"]["weight_version"] = "default"
    assert parse_generate_item(item, 0, 4).weight_version == 4
    item["meta_info"]["finish_reason"] = {"type": "weird"}
    with pytest.raises(SGLangRequestError, match="unexpected finish_reason"):
        parse_generate_item(item, 0, 0)


def test_connection_refused_is_retried_then_reported():
    eng = SGLangEngine.connect(f"http://127.0.0.1:{free_port('127.0.0.1')}", max_retries=1, retry_backoff_s=0.01)
    with pytest.raises(SGLangRequestError, match="failed after 2 attempts.*ConnectionError"):
        eng.generate(_requests(1), SamplingParams())
    assert eng.retries == 1
    assert eng.health().ok is False


# --- launch ----------------------------------------------------------------------------------------------
def test_launch_refuses_wildcard_addresses():
    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="cluster address"):
            SGLangEngine.launch("/nonexistent", host=host)
    assert check_host("10.1.2.3") == "10.1.2.3"
    with pytest.raises(ValueError, match="host="):
        SGLangEngine.launch("/nonexistent", host="127.0.0.1", extra_args=["--host", "0.0.0.0"])


def test_forcing_sglang_where_it_cannot_run_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SGLangUnavailableError, match=r"(?s)cannot run here.*rollout\.engine=sglang"):
        SGLangEngine.launch("/nonexistent", host="127.0.0.1", server="sglang")
    with pytest.raises(ValueError, match="one of"):
        SGLangEngine.launch("/nonexistent", host="127.0.0.1", server="tpu")


@pytest.mark.integration
def test_dead_server_reports_its_log_tail(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('loading...'); print('RuntimeError: CUDA out of memory', "
           "flush=True); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*CUDA out of memory"):
        start_server(cmd, "http://127.0.0.1:9", str(tmp_path / "s.log"), startup_timeout_s=30, poll_s=0.1)


@pytest.mark.integration
def test_server_that_never_gets_healthy_is_killed(tmp_path):
    cmd = [sys.executable, "-c", "import time; print('stuck', flush=True); time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"(?s)startup_timeout_s=1.*stuck"):
        start_server(cmd, "http://127.0.0.1:9", str(tmp_path / "s.log"), startup_timeout_s=1, poll_s=0.1)
    assert time.monotonic() - t0 < 20


def test_checkpoint_tensor_names(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(2, 2), "lm_head.weight": torch.zeros(2, 2)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert checkpoint_tensor_names(str(tmp_path)) == {"model.embed_tokens.weight"}
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert checkpoint_tensor_names(str(tmp_path)) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert checkpoint_tensor_names(str(tmp_path / "missing")) is None


def test_cpu_server_takes_sglangs_command_line(capsys):
    from mgrpo.rollout.sglang.cpu.server import parse_args
    from mgrpo.rollout.sglang.server import CPU_MODULE, launch_command

    cmd = launch_command(CPU_MODULE, "/ckpt", tp=1, host="127.0.0.1", port=30000, mem_fraction_static=0.7,
                         weight_version=3, enable_memory_saver=True,
                         extra_args=["--enable-deterministic-inference", "--context-length", "4096"])
    assert cmd[1:3] == ["-m", CPU_MODULE]
    args = parse_args(cmd[3:])  # exactly what SGLangEngine.launch runs
    assert (args.model_path, args.tp_size, args.port, args.weight_version) == ("/ckpt", 1, 30000, "3")
    assert args.enable_memory_saver and args.mem_fraction_static == 0.7
    with pytest.raises(SystemExit) as e:
        parse_args(cmd[3:] + ["--speculative-algorithm", "EAGLE"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-algorithm" in err and "ignores these GPU-only ones" in err
