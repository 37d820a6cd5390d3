"""User reward functions for tests, loaded by import path through reward.custom_functions."""


def dense_sum_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Partial credit for the sum task: 1 - |first digit - answer| / 9 (0 without a digit).

    Unlike the exact-match reward, a random model gets different scores within a group, so the very
    first steps already have non-zero advantages and gradients to compare across layouts."""
    digits = [c for c in solution_str if c.isdigit()]
    if not digits:
        return 0.0
    return 1.0 - abs(int(digits[0]) - int(ground_truth)) / 9.0


def solved_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Every response scores 1: every prompt group scores alike, as in a run that has solved its data."""
    return 1.0


FLAKY_CALLS: dict[str, int] = {}
"""flaky_digit_reward's calls per response text (reset by the tests that read it)."""


def flaky_digit_reward(data_source, solution_str, ground_truth, extra_info=None):
    """The first digit / 10, except: '9' raises (a judge bug), '8' answers garbage (not a number), and '7' fails
    its first three calls and then scores 0.7 (a judge that recovers: what small_group=rejudge is for)."""
    FLAKY_CALLS[solution_str] = FLAKY_CALLS.get(solution_str, 0) + 1
    if solution_str == "9":
        raise RuntimeError("judge bug on 9")
    if solution_str == "8":
        return "I think it is good"
    if solution_str == "7" and FLAKY_CALLS["7"] <= 3:
        raise TimeoutError("judge busy")
    return int(solution_str[0]) / 10


def failing_on_3_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A judge that breaks on every response containing a '3' (about a quarter of a random model's), else the
    dense sum reward: the run must mask and count those samples and go on."""
    if "3" in solution_str:
        raise RuntimeError("judge broke on a 3")
    return dense_sum_reward(data_source, solution_str, ground_truth, extra_info)
