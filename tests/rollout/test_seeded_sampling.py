"""SGLang's per-request seeded sampler (mgrpo/rollout/seeded.py) and the two CPU engines that use it: the hash
against MurmurHash3's reference, the draw against the distribution, and a seeded row's tokens alone against the
same row in a batch of 8 (what makes a multi-turn trajectory independent of its dispatch batch)."""

from __future__ import annotations

import struct

import torch

from mgrpo.rollout.seeded import multinomial_with_seed, murmur_hash32
from mgrpo.rollout.types import GenerateRequest, SamplingParams


def _murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Austin Appleby's MurmurHash3_x86_32, written from the reference C (smhasher), byte by byte."""
    c1, c2, m = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & m

    h, n = seed, len(data) // 4
    for i in range(n):
        k = struct.unpack_from("<I", data, 4 * i)[0]
        k = rotl((k * c1) & m, 15) * c2 & m
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & m
    k = 0
    for i, b in enumerate(data[4 * n:]):
        k |= b << (8 * i)
    if len(data) % 4:
        h ^= rotl((k * c1) & m, 15) * c2 & m
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_murmur_hash_is_murmur3_of_seed_position_column():
    assert _murmur3_x86_32(b"hello") == 613153351  # the reference's published value (mmh3.hash("hello"))
    seeds = torch.tensor([0, 12345, -7, 2 ** 62 + 3])
    positions = torch.tensor([0, 5, 99, 2 ** 31 + 1])
    got = murmur_hash32(seeds, positions, torch.arange(64))
    want = [[_murmur3_x86_32(struct.pack("<qII", int(s), int(p), c)) for c in range(64)]
            for s, p in zip(seeds, positions)]
    assert got.tolist() == want


def test_seeded_draws_follow_the_distribution_and_ignore_the_batch():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 20_000
    seeds, positions = torch.arange(n) * 7_919 + 11, torch.full((n,), 17)
    picks = multinomial_with_seed(torch.log(probs).expand(n, -1), seeds, positions).view(-1)
    freq = torch.bincount(picks, minlength=5).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() < 5 * sigma).all(), (freq, probs)
    # a row's draw is its own: the first 8 rows drawn alone give the same tokens
    alone = [int(multinomial_with_seed(torch.log(probs)[None], seeds[i:i + 1], positions[i:i + 1]))
             for i in range(8)]
    assert alone == picks[:8].tolist()
    # the position changes the draw (each token of a request gets fresh noise)
    later = multinomial_with_seed(torch.log(probs).expand(n, -1), seeds, positions + 1).view(-1)
    assert (later != picks).float().mean() > 0.3


def _rows(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, vocab, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_hf_engine_seeded_row_alone_equals_the_row_in_a_batch(tmp_path):
    from mgrpo.rollout.hf_engine import HFRolloutEngine
    from tests.helpers.sglang_cpu import VOCAB, tiny_checkpoint

    engine = HFRolloutEngine(tiny_checkpoint(str(tmp_path)), eos_token_ids=[VOCAB + 1], pad_token_id=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a decode step of a tiny model is all overhead: two threads on a loaded machine, 20x
    try:
        _batch_invariant(engine, VOCAB)
    finally:
        torch.set_num_threads(threads)


def _batch_invariant(engine, VOCAB):
    prompts = _rows(8, VOCAB)
    for sampling in (SamplingParams(temperature=1.0, max_new_tokens=12, seed=3),
                     SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=12, seed=3,
                                    return_support=True)):
        batch = engine.generate([GenerateRequest(uid=i, prompt_ids=p, seed=1000 + i) for i, p in enumerate(prompts)],
                                sampling)
        for i in (0, 5):
            alone = engine.generate([GenerateRequest(uid=0, prompt_ids=prompts[i], seed=1000 + i)],
                                    SamplingParams(**{**sampling.__dict__, "seed": 99}))[0]
            assert alone.token_ids == batch[i].token_ids
            assert max(abs(a - b) for a, b in zip(alone.logprobs, batch[i].logprobs)) < 1e-5
            assert alone.support == batch[i].support
        assert len({tuple(r.token_ids) for r in batch}) > 4  # different seeds, different rows
        if sampling.return_support:  # the draw stays inside the support the sampler kept
            assert all(t in s for r in batch for t, s in zip(r.token_ids, r.support) if s is not None)


def test_cpu_server_model_seeded_row_alone_equals_the_row_in_a_batch(tmp_path):
    from mgrpo.rollout.sglang.cpu.model import CPUModel, Req
    from tests.helpers.sglang_cpu import VOCAB, Reference, tiny_checkpoint

    hf = tiny_checkpoint(str(tmp_path))
    model = CPUModel(hf)
    prompts = _rows(8, VOCAB)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as above)
    try:
        _server_batch_invariant(model, hf, prompts, Req, Reference)
    finally:
        torch.set_num_threads(threads)


def _server_batch_invariant(model, hf, prompts, Req, Reference):
    from mgrpo.rollout.sampler import RowSampling, sample


    def reqs(idx):
        return [Req(rid=str(i), input_ids=prompts[i], temperature=0.8, top_k=6, max_new_tokens=10, seed=77 + i,
                    ignore_eos=True) for i in idx]

    batch = model.generate(reqs(range(8)))
    for i in (1, 6):
        alone = model.generate(reqs([i]))[0]
        assert alone.out == batch[i].out
    # the first token is SGLang's seeded draw at position len(prompt) - 1 of the reference model's logits
    ref = Reference(hf).model
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([prompts[2]])).logits[0, -1].float()
    tok = sample(logits[None], [RowSampling(0.8, 6, 1.0, 79)], [len(prompts[2]) - 1], [True])[0].token
    assert batch[2].out[0] == tok


def test_both_cpu_engines_draw_the_same_tokens_for_a_seeded_request(tmp_path):
    """The same sampler in both: one seeded request (whole vocabulary, temperature 0.8) gives the same tokens in
    the in-process engine and in the CPU server's model, each decoding with its own forward."""
    from mgrpo.rollout.hf_engine import HFRolloutEngine
    from mgrpo.rollout.sglang.cpu.model import CPUModel, Req
    from tests.helpers.sglang_cpu import VOCAB, tiny_checkpoint

    hf = tiny_checkpoint(str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = HFRolloutEngine(hf, eos_token_ids=[VOCAB + 1], pad_token_id=0)
        server = CPUModel(hf)
        for i, prompt in enumerate(_rows(4, VOCAB)):
            a = engine.generate([GenerateRequest(uid=0, prompt_ids=prompt, seed=500 + i)],
                                SamplingParams(temperature=0.8, max_new_tokens=12, seed=1))[0]
            (b,) = server.generate([Req(rid="r", input_ids=prompt, temperature=0.8, max_new_tokens=12, seed=500 + i,
                                        ignore_eos=True)])
            assert a.token_ids == b.out
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    finally:
        torch.set_num_threads(threads)


def test_a_requests_own_seed_is_its_sglang_sampling_seed():
    from mgrpo.config.seeds import request_seed, turn_seed
    from mgrpo.rollout.sglang.generate_io import build_generate_payload

    reqs = [GenerateRequest(uid=0, prompt_ids=[1, 2], seed=turn_seed(5, 3, 1)), GenerateRequest(uid=1, prompt_ids=[1])]
    body = build_generate_payload(reqs, SamplingParams(temperature=1.0, seed=9), rids=["a", "b"])
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == [turn_seed(5, 3, 1), request_seed(9, 1)]
    # a call without a seed of its own still sends the requests' seeds (and none for a request without one)
    body = build_generate_payload(reqs, SamplingParams(temperature=1.0), rids=["a", "b"])
    assert [sp.get("sampling_seed") for sp in body["sampling_params"]] == [turn_seed(5, 3, 1), None]
    one = build_generate_payload(reqs[:1], SamplingParams(temperature=1.0), rids=["a"], single=True)
    assert one["sampling_params"]["sampling_seed"] == turn_seed(5, 3, 1)
    # turns and trajectories of a step get distinct seeds, all within SGLang's int64 range
    got = {turn_seed(s, t, k) for s in (0, 2 ** 40) for t in range(64) for k in range(8)}
    assert len(got) == 2 * 64 * 8 and all(0 <= x < 2 ** 63 for x in got)
