"""The sandbox's parts that need no process: how an ending is classified, what the model sees, the counts,
the config checks, the refusal of a level the machine lacks, and the tool's function schema. The sandbox
itself, against hostile code, is tests/sandbox/test_sandbox_hostile.py (integration)."""

from __future__ import annotations

import inspect
import os
import json

import pytest

from mgrpo.config.schema import MGRPOConfig, SandboxConfig
from mgrpo.config.validate import InputError, field_errors, sandbox_errors
from mgrpo.sandbox import probe as probe_module
from mgrpo.sandbox.counts import OutcomeCounts
from mgrpo.sandbox.result import OUTCOME_KEYS, SandboxResult, classify, exit_status


@pytest.mark.parametrize("killed_for, returncode, stderr, expected", [
    ("wall_time", None, "", ("timeout", "wall_time", None)),
    ("output", None, "", ("limit", "output", None)),
    (None, 0, "", ("ok", None, 0)),
    (None, 1, "Traceback ...\nValueError: 3\n", ("error", None, 1)),
    (None, 128 + 24, "", ("limit", "cpu_time", -24)),            # bwrap reports SIGXCPU as 128 + 24
    (None, -24, "", ("limit", "cpu_time", -24)),                 # unshare re-raises the signal
    (None, 128 + 25, "", ("limit", "file_size", -25)),
    (None, 128 + 9, "", ("error", None, -9)),                    # a SIGKILL of its own: not a limit
    (None, 1, "Traceback\nMemoryError\n", ("limit", "memory", 1)),
    (None, 1, "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 8.00 GiB", ("limit", "memory", 1)),
    (None, 1, "BlockingIOError: [Errno 11] Resource temporarily unavailable\n", ("limit", "processes", 1)),
    (None, 1, "OSError: [Errno 24] Too many open files: 'x'", ("limit", "open_files", 1)),
    (None, 1, "OSError: [Errno 27] File too large\n\n", ("limit", "file_size", 1)),
    (None, 1, "OSError: [Errno 28] No space left on device", ("limit", "file_size", 1)),
    # only the last exception counts: a MemoryError caught and followed by another failure is that failure
    (None, 1, "MemoryError\nDuring handling...\nKeyError: 'x'", ("error", None, 1)),
    # a fork bomb's children write their tracebacks into one pipe at once: the last line may be another's start
    (None, 1, "BlockingIOError: [Errno 11] Resource temporarily unavailable\nTraceback (most recent call last):\n"
              '  File "main.py", line 2, in <module>\n', ("limit", "processes", 1)),
])
def test_classify(killed_for, returncode, stderr, expected):
    assert classify(killed_for=killed_for, returncode=returncode, stderr=stderr) == expected


def test_exit_status_reads_bwraps_signal_convention():
    assert [exit_status(c) for c in (0, 1, 127, 128, 129, 137, 193, -9)] == [0, 1, 127, 128, -1, -9, 193, -9]


def _result(**kw):
    base = dict(outcome="ok", limit=None, exit_status=0, stdout="", stderr="", stdout_truncated=False,
                stderr_truncated=False, wall_s=0.1, isolation="bwrap")
    return SandboxResult(**{**base, **kw})


def test_what_the_model_sees():
    assert _result(stdout="42\n").for_model() == "42"
    assert _result().for_model() == "[no output]"
    assert _result(outcome="error", exit_status=1, stderr="ValueError: 3\n").for_model() == \
        "ValueError: 3\n[exit status 1]"
    assert _result(outcome="timeout", limit="wall_time", exit_status=None, stdout="a").for_model() == \
        "a\n[timeout: wall_time]"
    assert _result(outcome="limit", limit="output", exit_status=None, stdout="yyy", stdout_truncated=True
                   ).for_model() == "yyy\n[stdout truncated]\n[killed: output limit]"
    assert _result(outcome="limit", limit="memory", exit_status=1, stderr="MemoryError").for_model() == \
        "MemoryError\n[memory limit, exit status 1]"
    line = json.loads(_result(stdout="é").to_json())
    assert line["stdout"] == "é" and set(line) == {"outcome", "limit", "exit_status", "stdout", "stderr",
                                                   "stdout_truncated", "stderr_truncated", "wall_s", "isolation"}


def test_counts_every_key_and_drain_zeroes():
    counts = OutcomeCounts()
    counts.add(_result())
    counts.add(_result(outcome="limit", limit="memory"))
    counts.add(_result(outcome="timeout", limit="wall_time"))
    counts.add_sandbox_error()
    got = counts.drain()
    assert set(OUTCOME_KEYS) <= set(got)
    assert {k: v for k, v in got.items() if v} == {
        "sandbox/ok": 1, "sandbox/limit": 1, "sandbox/limit/memory": 1, "sandbox/timeout": 1,
        "sandbox/limit/wall_time": 1, "sandbox/calls": 4, "sandbox/sandbox_errors": 1}
    assert not any(counts.drain().values())


def test_config_checks_name_the_key():
    assert field_errors(MGRPOConfig(), check_files=False) == []
    bad = SandboxConfig(isolation="chroot", memory_mb=16, max_processes=1, wall_time_s=0, pool_size=-1, uid=0)
    errors = sandbox_errors(bad)
    for key in ("sandbox.isolation='chroot'", "sandbox.memory_mb=16", "sandbox.max_processes=1",
                "sandbox.wall_time_s=0", "sandbox.pool_size=-1", "sandbox.uid=0"):
        assert any(e.startswith(key) for e in errors), (key, errors)
    assert any("sandbox.memory_mb" in e for e in field_errors(MGRPOConfig(sandbox=bad), check_files=False))


def test_a_level_the_machine_cannot_give_is_refused_in_one_line(monkeypatch):
    lacking = {"bwrap": "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)", "unshare": None}
    monkeypatch.setattr(probe_module, "probe", lambda: lacking)
    with pytest.raises(InputError) as e:
        probe_module.resolve("bwrap")
    assert str(e.value) == ("sandbox.isolation=bwrap: this machine cannot give it: bwrap is not installed "
                            "(Debian/Ubuntu: apt-get install bubblewrap)")
    assert probe_module.resolve("auto") == "unshare"
    monkeypatch.setattr(probe_module, "probe", lambda: {"bwrap": "missing", "unshare": "refused"})
    with pytest.raises(InputError, match="no isolation works on this machine, refusing"):
        probe_module.resolve("auto")


def test_command_refuses_bad_flags_with_status_2(capsys):
    from mgrpo_launchers.sandbox import main

    assert main(["--memory-mb", "8"]) == 2
    assert "sandbox.memory_mb=8 must be at least 64" in capsys.readouterr().err


def test_command_flags_default_to_the_config():
    from mgrpo_launchers.sandbox import parser

    args, cfg = parser().parse_args([]), SandboxConfig()
    for name in ("cpu_time_s", "wall_time_s", "memory_mb", "max_processes", "max_open_files", "max_file_size_mb",
                 "scratch_mb", "max_output_bytes", "isolation"):
        assert getattr(args, name) == getattr(cfg, name), name


def test_tool_is_a_plain_function_with_a_schema():
    from mgrpo.sandbox.tool import python

    sig = inspect.signature(python)
    assert list(sig.parameters) == ["code"] and sig.parameters["code"].annotation in (str, "str")
    assert sig.return_annotation in (str, "str")
    doc = inspect.getdoc(python)
    assert "Args:" in doc and "code:" in doc and "Returns:" in doc
    # transformers turns hints + a Google docstring into the OpenAI function schema that chat templates render
    from transformers.utils import get_json_schema

    schema = get_json_schema(python)
    assert schema["function"]["name"] == "python"
    assert schema["function"]["parameters"]["properties"]["code"]["type"] == "string"
    assert schema["function"]["parameters"]["required"] == ["code"]


def test_preflight_refuses_a_named_level_the_machine_lacks(monkeypatch):
    from mgrpo.config import ConfigError
    from mgrpo.preflight import preflight

    monkeypatch.setattr(probe_module, "probe", lambda: {"bwrap": "bwrap is not installed", "unshare": None})
    with pytest.raises(ConfigError) as e:
        preflight(MGRPOConfig(sandbox=SandboxConfig(isolation="bwrap")), check_files=False, check_memory=False)
    assert str(e.value) == ("invalid configuration: sandbox.isolation=bwrap: this machine cannot give it: "
                            "bwrap is not installed")
    # auto asks nothing before the start (no trial sandbox for a run that runs no code)
    preflight(MGRPOConfig(), check_files=False, check_memory=False)


def test_preflight_refuses_a_run_with_the_code_tool_when_no_level_works(monkeypatch):
    from mgrpo.config import ConfigError
    from mgrpo.config.multi_turn import MultiTurnConfig
    from mgrpo.config.schema import ModelConfig, RolloutConfig
    from mgrpo.preflight import preflight

    lacking = {"bwrap": f"bwrap is not installed: {probe_module.INSTALL}", "unshare": "refused"}
    monkeypatch.setattr(probe_module, "probe", lambda: lacking)
    tool = MultiTurnConfig(enable=True, function_tools=["mgrpo.sandbox.tool:python"])
    with pytest.raises(ConfigError) as e:  # auto, but the run runs code: refused before anything starts
        preflight(MGRPOConfig(model=ModelConfig(tokenizer="qwen3"), rollout=RolloutConfig(multi_turn=tool)),
                  check_files=False, check_memory=False)
    assert "sandbox.isolation=auto: no isolation works on this machine" in str(e.value)
    assert "apt-get install bubblewrap" in str(e.value)
    # multi-turn without the code tool runs no code: nothing asked
    other = MultiTurnConfig(enable=True, function_tools=["tests.helpers.agent:add"])
    preflight(MGRPOConfig(model=ModelConfig(tokenizer="qwen3"), rollout=RolloutConfig(multi_turn=other)),
              check_files=False, check_memory=False)


@pytest.mark.skipif(os.getuid() != 0, reason="the sandbox user differs from the caller only when run by root")
def test_unshare_as_root_names_the_private_home_and_what_to_install(monkeypatch):
    import shutil
    import tempfile

    top = tempfile.mkdtemp(dir="/tmp")  # under /tmp itself: pytest's own folders are 0700
    try:
        os.chmod(top, 0o755)
        home = os.path.join(top, "home")
        os.makedirs(os.path.join(home, "pyenv"))
        os.chmod(home, 0o700)
        monkeypatch.setattr(probe_module, "interpreter_paths", lambda: [os.path.join(home, "pyenv")])
        assert probe_module.closed_folder() == f"{home} (mode 0700)"
        why = probe_module._works("unshare")  # said without starting a trial sandbox
        assert f"lives under {home} (mode 0700), which the sandbox user cannot enter" in why
        assert "apt-get install bubblewrap" in why
        os.chmod(home, 0o755)
        assert probe_module.closed_folder() is None
    finally:
        shutil.rmtree(top)
