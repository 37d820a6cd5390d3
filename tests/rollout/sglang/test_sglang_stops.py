"""Stop strings, stop tokens and grammar fields as SGLang 0.5.23 treats them, checked against SGLang's own code
taken out of the installed wheel (tests/helpers/sglang_wheel.py): the finish rules both CPU engines use
(mgrpo/rollout/stops.py) against `Req.update_finish_state`, and the CPU server's sampling checks
(cpu/generate.py::check_sampling) against `SamplingParams.normalize` + `verify`."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from types import SimpleNamespace

import pytest

from mgrpo.data.printable import VOCAB, printable_tokenizer
from mgrpo.rollout.sglang.cpu.generate import check_sampling
from mgrpo.rollout.sglang.cpu.receive import RequestError
from mgrpo.rollout.stops import StopStrings, finish_after
from tests.helpers.sglang_wheel import sampling_params_class, sglang_req

EOS = VOCAB["<|im_end|>"]
CALL_END = VOCAB["</tool_call>"]


@pytest.fixture(scope="module")
def tok():
    return printable_tokenizer()


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _run_ours(tok, stream, stops, stop_token_ids, max_new, ignore_eos, ended_at=None, regex=None):
    s = StopStrings.normalize(stops, tok, regex)
    out = []
    for k, t in enumerate(stream):
        out.append(t)
        fin = finish_after(out, stops=s, tokenizer=tok, stop_token_ids=set(stop_token_ids) | {EOS},
                           max_new_tokens=max_new, ignore_eos=ignore_eos,
                           grammar_ended=ended_at is not None and k > ended_at)
        if fin is not None:
            return fin, len(out)
    return None, len(out)


def _run_sglang(tok, stream, stops, stop_token_ids, max_new, ignore_eos, ended_at=None, regex=None):
    sp = sampling_params_class()(stop=stops, stop_token_ids=stop_token_ids, max_new_tokens=max_new,
                                 ignore_eos=ignore_eos, stop_regex=regex)
    sp.normalize(tok)
    r = sglang_req(tok, stop_strs=sp.stop_strs, stop_str_max_len=sp.stop_str_max_len,
                   stop_token_ids=sp.stop_token_ids or (), eos_token_ids=[EOS], max_new_tokens=max_new,
                   ignore_eos=ignore_eos, vocab_size=len(VOCAB), stop_regex_strs=sp.stop_regex_strs,
                   stop_regex_max_len=sp.stop_regex_max_len)
    fed = [0]  # the grammar has seen the tokens before the newest one when update_finish_state runs
    r.grammar = SimpleNamespace(is_terminated=lambda: ended_at is not None and fed[0] > ended_at)
    for t in stream:
        r.output_ids.append(t)
        r.update_finish_state(1)
        fed[0] += 1
        if r.finished():
            return r.finished_reason.to_json(), r.finished_len or len(r.output_ids)
    return None, len(r.output_ids)


def test_a_stop_string_ends_the_response_as_in_sglang(tok):
    call = '<tool_call>\n{"name": "peek", "arguments": {}}\n'
    as_token = _ids(tok, call) + [CALL_END] + _ids(tok, "more")
    assert _run_ours(tok, as_token, ["</tool_call>"], [], 100, False) == \
        ({"type": "stop", "matched": "</tool_call>"}, len(_ids(tok, call)) + 1)  # the stop's tokens are kept
    # the same text in characters: SGLang decodes only the last (1 + 1) tokens, which never hold it
    spelled = _ids(tok, call) + [VOCAB[c] for c in "</tool_call>"] + _ids(tok, "more")
    assert _run_ours(tok, spelled, ["</tool_call>"], [], 100, False) == (None, len(spelled))
    # a stop string beats EOS and applies with ignore_eos; EOS alone does not with ignore_eos
    assert _run_ours(tok, _ids(tok, "xab") + [EOS], ["ab"], [], 100, True)[0] == {"type": "stop", "matched": "ab"}
    assert _run_ours(tok, _ids(tok, "x") + [EOS, 12], [], [], 2, True)[0] == {"type": "length", "length": 2}


def test_finish_rules_are_sglangs_on_random_streams(tok):
    """2,000 random streams over the tokens that matter (the call's end as one token and as characters, stop
    texts, EOS, a request stop token), every combination of stops, ignore_eos and grammar end: the finish
    reason and the kept length are SGLang's after every token."""
    rng = random.Random(0)
    alphabet = [CALL_END, EOS, 5] + [VOCAB[c] for c in "</tool_call>abx\n"]
    stop_sets = [None, "x", ["</tool_call>"], ["ab", "\n\n"], ["</tool_call>", "call>", "x"], ["b</tool_call>"]]
    seen: dict[str, int] = {}
    for case in range(2000):
        stream = [rng.choice(alphabet) for _ in range(rng.randint(1, 24))]
        stops, ignore_eos = rng.choice(stop_sets), rng.random() < 0.3
        stop_ids = rng.choice([[], [5]])
        max_new = rng.randint(1, 24)
        ended_at = rng.choice([None, None, rng.randint(0, 20)])
        ours = _run_ours(tok, stream, stops, stop_ids, max_new, ignore_eos, ended_at)
        ref = _run_sglang(tok, stream, stops, stop_ids, max_new, ignore_eos, ended_at)
        assert ours == ref, (case, stream, stops, stop_ids, max_new, ignore_eos, ended_at)
        fin = ours[0]
        kind = "none" if fin is None else fin["type"] + ("-str" if isinstance(fin.get("matched"), str) else "")
        seen[kind] = seen.get(kind, 0) + 1
    assert all(seen.get(k, 0) > 100 for k in ("none", "stop", "stop-str", "length")), seen


def test_stop_regexes_end_the_response_as_in_sglang(tok):
    """3,000 random streams of digits, spaces, the call's end (one token and in characters), EOS, with stop
    regexes (bounded, end-anchored and unbounded, alternations, one that parses but does not compile) alone
    and after stop strings: finish reason, matched pattern and kept length are SGLang's after every token."""
    rng = random.Random(1)
    alphabet = [CALL_END, EOS, VOCAB[" "], VOCAB["\n"]] + [VOCAB[c] for c in "12x</tool_call>"]
    regex_sets = [r"\d{2}", [r"</tool_call>\s*$"], ["ab|x\n|2 1", r"\d\d"], [r"(?<=1+)2", "x"],
                  ["1[^2]{3}1", r"l>\s+\d"], "", []]
    stop_sets = [None, None, ["x"], ["</tool_call>", "21"]]
    seen: dict[str, int] = {}
    for case in range(3000):
        stream = [rng.choice(alphabet) for _ in range(rng.randint(1, 20))]
        regex, stops, ignore_eos = rng.choice(regex_sets), rng.choice(stop_sets), rng.random() < 0.3
        max_new = rng.randint(1, 20)
        ours = _run_ours(tok, stream, stops, [], max_new, ignore_eos, regex=regex)
        ref = _run_sglang(tok, stream, stops, [], max_new, ignore_eos, regex=regex)
        assert ours == ref, (case, stream, stops, regex, max_new, ignore_eos)
        fin = ours[0]
        patterns = [regex] if isinstance(regex, str) else regex
        kind = "none" if fin is None else fin["type"]
        if fin is not None and fin.get("matched") in patterns and fin.get("matched") not in (stops or []):
            kind = "regex"
        seen[kind] = seen.get(kind, 0) + 1
    assert all(seen.get(k, 0) > 50 for k in ("none", "stop", "regex", "length", "abort")), seen
    # by hand: the tail an end-anchored pattern is searched in is the whole output (its bound is 2**30)
    call = _ids(tok, "<tool_call>{}") + [CALL_END]
    assert _run_ours(tok, call + [VOCAB[" "]], None, [], 50, False, regex=r"</tool_call>\s*$") == \
        ({"type": "stop", "matched": r"</tool_call>\s*$"}, len(call))
    # \d{2} looks at 3 tokens: 2 digits split by a space never match, 2 in a row do at the second
    assert _run_ours(tok, _ids(tok, "1 2 12x"), None, [], 50, False, regex=r"\d{2}")[1] == 6


def test_a_stop_regex_bound_is_sglangs():
    """stop_regex_max_len (the tail a pattern is searched in) against the wheel's get_max_seq_length, over
    every construct its walk treats apart."""
    from mgrpo.rollout.stops import UNBOUNDED, regex_max_len
    from tests.helpers.sglang_wheel import get_max_seq_length

    patterns = [r"\d{2}", r"</tool_call>\s*$", "ab|cde", "(?=x)y", r"\bfoo\b", "[abc]{3,5}", "a+?", "(?P<n>a)(?P=n)",
                "x{0}", "", "[^a]", "[^ab]", "(a|bc){2}", "(?:x(y|zz)){3,4}?", ".", r"\.", "a{2,}", "(?i)abc",
                "(?<=a)b", "a|", r"\Aab\Z", r"[\d\s]", "(a)(?(1)b|cc)", "é{3}", "((a{2}){3}){4}"]
    got = {p: regex_max_len(p) for p in patterns}
    assert got == {p: get_max_seq_length(p) for p in patterns}
    assert got[r"\d{2}"] == 2 and got["((a{2}){3}){4}"] == 24 and got[r"</tool_call>\s*$"] == 12 + UNBOUNDED


def _sglang_check(sp: dict, tokenizer):
    """SGLang's tokenizer manager: SamplingParams(**sp).normalize(tokenizer); .verify(vocab_size). A ValueError
    is its 400; any other exception (re.error) escapes its HTTP handler: ('500', message)."""
    import re

    try:
        p = sampling_params_class()(**sp)
        p.normalize(tokenizer)
        p.verify(len(VOCAB))
    except ValueError as e:
        return str(e)
    except re.error as e:
        return ("500", str(e))
    return p


@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["tokenizer", "skip-tokenizer-init"])
def test_stop_and_grammar_fields_are_checked_as_sglang_checks_them(tok, with_tokenizer):
    tokenizer = tok if with_tokenizer else None
    tag = json.dumps({"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a>"]})
    cases = [{}, {"stop": "x"}, {"stop": ["</tool_call>", "ab"]}, {"stop": []}, {"stop": ["x"] * 32},
             {"stop": ["x"] * 33}, {"stop": ["<tool_call>\n{", ""]}, {"structural_tag": tag}, {"regex": "a+"},
             {"structural_tag": tag, "regex": "a+"}, {"json_schema": "{}", "ebnf": 'root ::= "a"'},
             {"structural_tag": "", "regex": "a+"}, {"stop": ["x"] * 33, "temperature": -1.0},
             {"temperature": -1.0, "structural_tag": tag, "json_schema": "{}"}, {"stop": "x", "top_p": 0.0},
             {"stop_regex": r"\d{2}"}, {"stop_regex": [r"</tool_call>\s*$", "a|bc"], "stop": "x"},
             {"stop_regex": []}, {"stop_regex": ""}, {"stop_regex": ["a"] * 32}, {"stop_regex": ["a"] * 33},
             {"stop_regex": "a" * 256}, {"stop_regex": "a" * 257}, {"stop_regex": ["x", "é" * 129]},
             {"stop_regex": "("}, {"stop_regex": ["a", "a{2,1}"]}, {"stop_regex": "(?<=a+)b"},
             {"stop": ["x"] * 33, "stop_regex": ["a"] * 33}, {"stop": "x", "stop_regex": ["a"] * 33},
             {"stop": "x", "stop_regex": "("}, {"stop_regex": "(", "temperature": -1.0},
             {"stop_regex": "x", "top_p": 0.0}]
    for sp in cases:
        ref = _sglang_check(sp, tokenizer)
        try:
            ours = check_sampling(sp, 0, tokenizer)
        except RequestError as e:
            if isinstance(ref, tuple):  # SGLang's server answers 500 "Internal Server Error"; the log says why
                assert (e.status, e.internal) == (500, True) and ref[1] in str(e), (sp, str(e), ref)
            else:
                assert (str(e), e.status, e.internal) == (ref, 400, False), (sp, str(e), ref)
            continue
        assert not isinstance(ref, (str, tuple)), (sp, ref)
        assert ours["stops"] == StopStrings(tuple(ref.stop_strs), ref.stop_str_max_len, tuple(ref.stop_regex_strs),
                                            ref.stop_regex_max_len), sp
        kinds = [(k, v) for k, v in (("json", ref.json_schema), ("regex", ref.regex), ("ebnf", ref.ebnf),
                                     ("structural_tag", ref.structural_tag)) if v is not None]
        assert [ours["grammar_key"]] == (kinds or [None]), sp


def test_without_a_tokenizer_a_grammar_is_refused_with_sglangs_words(tok):
    """A server without a tokenizer (--skip-tokenizer-init, or a checkpoint without one) has no grammar backend:
    SGLang's message, read from its grammar_manager.py; with one, a bad grammar gets SGLang's compile error."""
    from mgrpo.rollout.sglang.cpu.model import Req
    from mgrpo.rollout.sglang.cpu.text import NO_GRAMMAR_BACKEND, ServerText
    from mgrpo.rollout.sglang.protocol import wheel

    source = wheel.wheel_file("srt", "constrained", "grammar_manager.py")
    if source is not None:
        assert f'"{NO_GRAMMAR_BACKEND}"' in open(source).read()
    with pytest.raises(RequestError) as e:
        ServerText(None, len(VOCAB), [EOS]).compile([Req(rid="a", input_ids=[1], grammar_key=("regex", "a+"))])
    assert str(e.value) == NO_GRAMMAR_BACKEND
    r = Req(rid="b", input_ids=[1], grammar_key=("regex", "a+"))
    ServerText(tok, len(VOCAB), [EOS]).compile([r])
    assert r.grammar is not None
    with pytest.raises(RequestError, match=r"^Failed to compile regex grammar: "):
        ServerText(tok, len(VOCAB), [EOS]).compile([Req(rid="c", input_ids=[1], grammar_key=("regex", "(a"))])


def test_stop_regex_is_sent_only_when_set_and_never_through_the_router():
    from mgrpo.rollout.sglang.generate_io import build_generate_payload
    from mgrpo.rollout.types import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(uid=0, prompt_ids=[1, 2])]
    plain = build_generate_payload(reqs, SamplingParams(), rids=["a"])["sampling_params"]
    assert "stop_regex" not in plain
    sp = build_generate_payload(reqs, SamplingParams(stop_regex=(r"\d{2}", "a|b")), rids=["a"])["sampling_params"]
    assert sp == {**plain, "stop_regex": [r"\d{2}", "a|b"]}
    with pytest.raises(ValueError, match="sglang-router 0.3.2 drops the field"):
        build_generate_payload(reqs, SamplingParams(stop_regex=("x",)), rids=["a"], single=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tok):
    import dataclasses

    from mgrpo.config.schema import ModelConfig
    from mgrpo.models.hf_io import init_hf_checkpoint
    from tests.helpers.sglang_cpu import launch

    m = dataclasses.replace(ModelConfig(), tokenizer="printable", vocab_size=len(VOCAB), max_position_embeddings=512)
    ckpt = init_hf_checkpoint(str(tmp_path_factory.mktemp("ckpt")), m, seed=3, tokenizer=tok)  # with its tokenizer
    engine = launch(ckpt, str(tmp_path_factory.mktemp("logs")))
    yield engine, ckpt
    engine.shutdown()


@pytest.mark.integration
def test_a_stop_regex_ends_a_request_over_http_as_in_sglang(tok, server):
    """/generate built with SGLang's request classes (api/v1/api_types.py): a pattern ends the request with
    SGLang's {"type": "stop", "matched": <pattern>} where the wheel's Req ends the same tokens; the client's
    SamplingParams.stop_regex ends the CPU server's and the in-process engine's greedy responses at the same
    token; bad patterns get SGLang's status and body."""
    from mgrpo.rollout.hf_engine import HFRolloutEngine
    from mgrpo.rollout.sglang.protocol import wheel
    from mgrpo.rollout.types import GenerateRequest, SamplingParams
    from tests.helpers.sglang_cpu import post

    api = wheel.contract()
    if api is None:
        pytest.skip("the sglang wheel is not installed")
    engine, ckpt = server
    prompt = _ids(tok, "<|im_start|>user\nCount to nine.<|im_end|>\n<|im_start|>assistant\n")

    def body(**sp):
        sp = {"temperature": 1.0, "max_new_tokens": 120, "no_stop_trim": True, **sp}
        return api.GenerateRequest(input_ids=prompt, return_logprob=True,
                                   sampling_params=api.SamplingParams(**sp)).to_json_value()

    patterns = [r"\d\s*\d", r"</tool_call>\s*$", "ab|ba"]
    ended = 0
    for seed in range(6):
        r = post(engine.url, "/generate", body(stop_regex=patterns, sampling_seed=seed))
        assert r.status_code == 200, r.text
        ids = api.GenerateResponse.from_json_value(r.json()).output_ids
        finish = r.json()["meta_info"]["finish_reason"]
        want = _run_sglang(tok, ids, None, [], 120, False, regex=patterns)
        assert (finish, len(ids)) == want, (seed, tok.decode(ids))
        ended += finish.get("matched") in patterns
    assert ended >= 3, ended  # most of them end on a pattern
    # the client's field, both engines, greedy: the same tokens, ended by the same pattern
    greedy = SamplingParams(temperature=0.0, max_new_tokens=80)
    free = engine.generate([GenerateRequest(uid=0, prompt_ids=prompt)], greedy)[0]
    text = tok.decode(free.token_ids)
    k = next(k for k in range(6, len(text)) if text[k] != text[k - 1])  # where the free response first changes
    pattern = re.escape(text[k - 1:k + 1]) + "|q{2}"  # a pair it holds, or one it does not
    stopped = dataclasses.replace(greedy, stop_regex=(pattern,))
    local = HFRolloutEngine(ckpt, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                            tokenizer="printable")
    got = [e.generate([GenerateRequest(uid=0, prompt_ids=prompt)], stopped)[0] for e in (engine, local)]
    want = _run_sglang(tok, free.token_ids, None, [], 80, False, regex=pattern)
    assert want[0] == {"type": "stop", "matched": pattern} and want[1] < len(free.token_ids), (text, want)
    for g in got:
        assert (g.token_ids, g.finish_reason) == (free.token_ids[:want[1]], "stop"), (text, pattern)
    # refusals: normalize's limits (400), a pattern Python cannot parse (SGLang's uncaught re.error: 500), one
    # that parses but does not compile (the scheduler's abort: 400 with its message)
    for sp, status, message in [
            ({"stop_regex": ["a"] * 33}, 400, {"error": {"message": "at most 32 stop_regex patterns are allowed, "
                                                                    "got 33"}}),
            ({"stop_regex": "a" * 257}, 400, {"error": {"message": "stop_regex is 257 bytes, over the 256-byte "
                                                                   "limit"}}),
            ({"stop_regex": "(?<=a+)b", "ignore_eos": True}, 400,
             {"error": {"message": "invalid stop_regex '(?<=a+)b': look-behind requires fixed-width pattern"}})]:
        r = post(engine.url, "/generate", body(**sp))
        assert (r.status_code, r.json()) == (status, message), (sp, r.text)
    r = post(engine.url, "/generate", body(stop_regex="("))
    assert (r.status_code, r.text) == (500, "Internal Server Error")
    with pytest.raises(ValueError, match=r"^invalid stop_regex '\(\?<=a\+\)b': look-behind requires"):
        local.generate([GenerateRequest(uid=0, prompt_ids=prompt)], dataclasses.replace(stopped,
                                                                                       stop_regex=("(?<=a+)b",)))
    assert engine.health().ok  # refusals leave it serving


def test_an_unbounded_pattern_is_decoded_once_per_token(tok):
    """`a.*b` can match any length (SGLang's bound 2**30), so each step of the CPU engines' decode loop
    (rollout/decode.py) decodes the whole output, as SGLang's scheduler does; a finished row then decodes
    nothing more (checking every prefix again would decode n(n+1)/2 more tokens: 2 million for this 2,000-token
    row). A scripted model's logits make the greedy rows the two streams."""
    import torch

    from mgrpo.rollout.decode import Req, decode

    calls = []

    class Counting:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

        def encode(self, *a, **kw):
            return tok.encode(*a, **kw)

    n = 2000
    streams = [[VOCAB["a"]] + [VOCAB["x"]] * (n - 2) + [VOCAB["b"]], [VOCAB["x"], EOS] + [VOCAB["y"]] * (n - 2)]
    step = [0]

    def model(input_ids, **kw):
        logits = torch.zeros(len(streams), 1, len(VOCAB))
        for i, s in enumerate(streams):
            logits[i, 0, s[step[0]]] = 1.0
        step[0] += 1
        return SimpleNamespace(logits=logits, past_key_values=None)

    stops = StopStrings.normalize(None, tok, "a.*b")
    reqs = [Req(rid=str(i), input_ids=[VOCAB["x"]], temperature=0.0, max_new_tokens=4096, stops=stops)
            for i in range(2)]
    decode(model, reqs, pad_id=0, stop_ids={EOS}, tokenizer=Counting())
    assert [r.finish for r in reqs] == [{"type": "stop", "matched": "a.*b"}, {"type": "stop", "matched": EOS}]
    assert [r.out for r in reqs] == [streams[0], streams[1][:2]]
    # one decode per step of the long row, of the output so far; the row that ended on EOS at step 2 no more
    assert calls == [1, 1, 2, 2] + list(range(3, n + 1))
