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
