"""Choose the launch plan for a problem: tuned table entry if one applies, else the heuristic."""

from __future__ import annotations

from fdpp.configs import (
    MAX_SPLITS,
    DecodeProblem,
    DeviceLimits,
    LaunchPlan,
    combine_config,
    default_config,
)


def select_plan(problem: DecodeProblem, device: DeviceLimits, num_splits: int | None = None) -> LaunchPlan:
    """The plan ``decode_attention`` launches for ``problem`` on ``device``.

    ``num_splits`` given by the caller overrides the split count (the kernel config stays the
    heuristic's); ``None`` asks the tuned table, then the heuristic.
    """
    plan = default_config(problem, device)
    if num_splits is None:
        return plan
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    comb = combine_config(plan.split.dtype, problem.head_dim) if num_splits > 1 else None
    return LaunchPlan(plan.split, num_splits, comb, source="user")
