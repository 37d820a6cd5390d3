"""The reward part of the run configuration (`reward.*`): rule judges, reward models, how they combine per
data_source, the failed-sample policy.

Kept apart from mgrpo/config/schema.py (which re-exports these) so each file stays one idea.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mgrpo.config.choices import Gsm8kMethod, JudgeParser, RewardModelKind, RewardPlacement, SmallGroup


@dataclass
class Gsm8kJudgeConfig:
    """The built-in GSM8K judge (data_source openai/gsm8k): veRL's gsm8k scorer and its options."""

    method: Gsm8kMethod = "strict"
    """strict (the number after '#### ', veRL's default: no '#### <number>', no answer) | flexible (the last
    number in the response)"""
    format_score: float = 0.0
    """Score of a response whose answer was found but is wrong (veRL's format_score; 1.0 when right, 0 when
    no answer was found)."""


@dataclass
class FailedSamplesConfig:
    """Samples whose reward could not be produced (a judge that raised, timed out or answered garbage; a
    producer's generation or environment failure). Such a sample has no score: it is left out of the loss and
    out of its group's baseline (the advantages are over the group's remaining members), and counted."""

    min_group_size: int = 2
    """Fewest scored samples a prompt group needs to keep a baseline; a group with fewer is handled by
    small_group. (A group that had fewer samples to begin with, rollout.n=1, is never short.)"""
    small_group: SmallGroup = "drop"
    """drop (the group leaves the loss) | rejudge (score its failed samples again, then drop if still short)"""
    rejudge_attempts: int = 1
    """Rounds of re-scoring with small_group=rejudge."""
    warn_rate: float = 0.05
    """A warning line when a step's share of failed samples passes this."""
    max_rate: float = 0.5
    """The run stops (an error naming this key) when a training step's share of failed samples passes this:
    past it, the judges are broken, not flaky. 1.0 never stops."""


@dataclass
class JudgeConfig:
    """A generative judge (reward.models.<name>.kind=generative): what it is asked and how its answer is read
    (mgrpo/rewards/judge.py)."""

    template: str = ""
    """The judge's user message as a Jinja template over question, messages, response, reference, rubric (pairwise:
    response_a, response_b); rendered with the judge model's own chat template (client-side) for an SGLang engine."""
    template_file: Optional[str] = None
    """A file holding the template instead (one of template / template_file)."""
    system: Optional[str] = None
    """A system message before the template's user message."""
    rubric: str = ""
    """The template's `rubric` (a record's extra_info.rubric replaces it for that record)."""
    parser: JudgeParser = "number"
    pattern: str = r"(-?\d+(?:\.\d+)?)"
    """parser=number: a regular expression; the last match (its first group) is the score."""
    json_key: str = "score"
    """parser=json: the key holding the score."""
    range: list[float] = field(default_factory=lambda: [0.0, 10.0])
    """[low, high] a number or JSON score must lie in (outside: a failed judgement); pairwise scales it to [0, 1]."""
    yes: str = "Yes"
    """parser=yes_no: the text of the yes token (one token of the judge's tokenizer)."""
    no: str = "No"
    top_logprobs: int = 20
    """parser=yes_no: how many of the first position's most likely tokens the engine returns."""
    max_new_tokens: int = 256
    """The answer's length limit (parser=yes_no reads one token and asks for one)."""
    temperature: float = 0.0
    pairwise: bool = False
    """Judge the response against the reference answer in both orders (A/B then B/A), the score the mean
    preference for the response in [0, 1]; orders that disagree are counted (reward/<name>/disagreements)."""
    openai_url: Optional[str] = None
    """An OpenAI-compatible endpoint (base URL ending in /v1) instead of an SGLang engine: /chat/completions through
    the openai client; nothing is launched."""
    openai_model: str = ""
    """The model name sent to openai_url."""
    api_key_env: Optional[str] = None
    """The environment variable holding openai_url's key; never the key itself."""
    concurrency: int = 16
    """Requests in flight at once."""


@dataclass
class RewardModelConfig:
    """One named reward model (reward.models.<name>): an auxiliary SGLang engine, frozen (no weight sync),
    launched with the run's API key and health-checked, restarted when found dead."""

    hf_path: str = ""
    """The model's HF checkpoint (its tokenizer and chat template format the conversations it scores)."""
    kind: RewardModelKind = "classifier"
    engines: int = 1
    """Servers of this model (requests spread over them in turn)."""
    tp: int = 1
    """Tensor-parallel size of each server."""
    placement: RewardPlacement = "own"
    """own (accelerators of its own) | shared (the rollout engines' accelerators); mgrpo-plan counts either."""
    gpu_memory_utilization: Optional[float] = None
    """Each server's share of its card (SGLang --mem-fraction-static); None: 0.8 with placement=own, 0.15 shared."""
    server_args: list[str] = field(default_factory=list)
    """More SGLang launch arguments (e.g. ['--context-length', '4096']); never an API key."""
    url: Optional[str] = None
    """A server someone else runs (nothing is launched; the run's key is sent)."""
    timeout_s: float = 60.0
    """One scoring request's limit; past it the samples of that request time out (no score, never 0)."""
    max_retries: int = 2
    """Retries of a failed request (connection, 5xx, garbage), with exponential backoff."""
    batch_size: int = 64
    """Inputs per /classify (or, for a judge, /generate) request."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """kind=generative: the judge's template and parser."""


OWN_SHARE, SHARED_SHARE = 0.8, 0.15
"""reward.models.<name>.gpu_memory_utilization when unset, by placement."""


def engine_share(m: RewardModelConfig) -> float:
    """The card share a reward model's server takes (its --mem-fraction-static)."""
    if m.gpu_memory_utilization is not None:
        return float(m.gpu_memory_utilization)
    return SHARED_SHARE if m.placement == "shared" else OWN_SHARE


@dataclass
class RewardServiceConfig:
    """One named HTTP reward service (reward.services.<name>; slime's --rm-url): POST {prompt, response, label},
    answered with a number or {score_key: number} (mgrpo/rewards/service.py)."""

    url: str = ""
    api_key_env: Optional[str] = None
    """The environment variable holding the service's key (sent as a bearer token); never the key itself."""
    score_key: str = "score"
    timeout_s: float = 30.0
    max_retries: int = 3
    """Retries of a connection error, timeout, 5xx or 429, with exponential backoff from backoff_s."""
    backoff_s: float = 0.5
    concurrency: int = 16
    """Requests in flight at once."""


@dataclass
class RewardConfig:
    """Judgers: reward functions keyed by data_source."""

    custom_functions: dict[str, str] = field(default_factory=dict)
    """data_source -> 'module:function' or 'path/to/file.py:function' for user reward functions (veRL's signature).
    The data_source '*' is veRL's custom_reward_function: every data_source without a function of its own.
    On the command line: reward.custom_functions={my_source: my_reward.py:score}."""
    gsm8k: Gsm8kJudgeConfig = field(default_factory=Gsm8kJudgeConfig)
    timeout_s: float = 10.0
    num_workers: int = 2
    """Parallel scoring processes (0 = score in the calling process) for the calls that need isolation: user
    functions and math-verify (see isolate_builtin_rules)."""
    isolate_builtin_rules: bool = False
    """Score the built-in string rules (mgrpo/sum, mgrpo/peek, openai/gsm8k: `rewards/registry.py::IN_PROCESS_SAFE`)
    in the worker processes too. Off: they run in the calling process, because they are short functions of ours
    that cannot hang or end the interpreter, and a worker's round trip costs more than the rule (tiny job: 7.9 vs
    0.6 ms a step); user functions and math-verify always go to the workers."""
    failed: FailedSamplesConfig = field(default_factory=FailedSamplesConfig)
    models: dict[str, RewardModelConfig] = field(default_factory=dict)
    """Named reward models: reward.models={rm: {hf_path: path/to/rm}}."""
    services: dict[str, RewardServiceConfig] = field(default_factory=dict)
    """Named HTTP reward services: reward.services={judge: {url: http://host:8000/score, api_key_env: JUDGE_KEY}}."""
    compose: dict[str, dict[str, float]] = field(default_factory=dict)
    """data_source -> {scorer: weight}, the sample's reward the weighted sum; a scorer is 'rule' (the data_source's
    reward function) or the name of a reward.models or reward.services entry: reward.compose={mgrpo/sum: {rm: 1.0}}. A data_source without an entry is scored by its rule alone. With a
    model in the sum, the rule (where one exists) is still computed and logged (reward/rule/mean) at weight 0,
    so a policy that pleases the model without solving the task shows up. '*' applies to every data_source."""
