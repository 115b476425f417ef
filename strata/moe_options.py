"""The expert-parallel and MoE options every entry point takes alike: `strata serve` (for both roles' workers) and the
worker CLIs (`--expert-parallel N`, `--moe-capacity-factor F`, `--moe-overflow drop|next`, `--num-redundant-experts
R`, `--eplb-interval STEPS`, `--eplb-window STEPS`). They are checked here once, so each door refuses a bad value with
the same words, naming the option and what it allows, before any process starts or any model loads.

No torch here: the launcher (`strata serve`'s parent process) checks the options without loading an engine.
"""
from __future__ import annotations

from typing import Any, Callable

from engine.config import MOE_OVERFLOW_POLICIES, MoEConfig

MAX_EXPERT_PARALLEL = 64
MAX_REDUNDANT_EXPERTS = 1024          # `MoEConfig`'s own bound (spare slots per rank)
DEFAULTS = MoEConfig()
OVERFLOW_HELP = ", ".join(MOE_OVERFLOW_POLICIES)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_expert_parallel(value: int) -> int:
    """`--expert-parallel`: ranks of one worker group on this host (1 = a plain worker)."""
    if not _is_int(value) or not 1 <= value <= MAX_EXPERT_PARALLEL:
        raise ValueError(f"must be an integer in [1, {MAX_EXPERT_PARALLEL}], got {value!r}")
    return value


def check_capacity_factor(value: float | None) -> float | None:
    """`--moe-capacity-factor`: None (no limit) or a number > 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"must be a number > 0 (unset: no capacity limit), got {value!r}")
    return value


def check_overflow(value: str) -> str:
    """`--moe-overflow`: what a full expert does with the tokens past its capacity."""
    if value not in MOE_OVERFLOW_POLICIES:
        raise ValueError(f"must be one of {OVERFLOW_HELP}, got {value!r}")
    return value


def check_num_redundant_experts(value: int) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_REDUNDANT_EXPERTS:
        raise ValueError(f"must be an integer in [0, {MAX_REDUNDANT_EXPERTS}] (spare expert slots per rank), "
                         f"got {value!r}")
    return value


def check_eplb_interval(value: int) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"must be an integer >= 0 (forwards between rebalances; 0 = never), got {value!r}")
    return value


def check_eplb_window(value: int) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"must be an integer >= 1 (forwards of expert load kept), got {value!r}")
    return value


# The config field each option fills, its check, its worker flag.
OPTIONS: tuple[tuple[str, Callable[[Any], Any], str], ...] = (
    ("expert_parallel", check_expert_parallel, "--expert-parallel"),
    ("moe_capacity_factor", check_capacity_factor, "--moe-capacity-factor"),
    ("moe_overflow", check_overflow, "--moe-overflow"),
    ("num_redundant_experts", check_num_redundant_experts, "--num-redundant-experts"),
    ("eplb_interval", check_eplb_interval, "--eplb-interval"),
    ("eplb_window", check_eplb_window, "--eplb-window"),
)
OPTION_DEFAULTS: dict[str, Any] = {
    "expert_parallel": 1, "moe_capacity_factor": DEFAULTS.capacity_factor, "moe_overflow": DEFAULTS.overflow,
    "num_redundant_experts": DEFAULTS.num_redundant_experts, "eplb_interval": DEFAULTS.eplb_interval,
    "eplb_window": DEFAULTS.eplb_window,
}


def check_options(values: dict[str, Any]) -> None:
    """Every option in `values` (keyed by config field); a ValueError names the field and what it allows."""
    for name, check, _ in OPTIONS:
        try:
            check(values[name])
        except ValueError as exc:
            raise ValueError(f"{name} {exc}") from None


def moe_config(values: dict[str, Any]) -> MoEConfig:
    """The engine's MoE config for these options (keyed by config field): the expert-parallel backend when
    `expert_parallel` > 1, else the local one."""
    check_options(values)
    return MoEConfig(backend="expert_parallel" if values["expert_parallel"] > 1 else "local",
                     capacity_factor=values["moe_capacity_factor"], overflow=values["moe_overflow"],
                     num_redundant_experts=values["num_redundant_experts"], eplb_interval=values["eplb_interval"],
                     eplb_window=values["eplb_window"])


def worker_args(values: dict[str, Any]) -> list[str]:
    """The worker CLI flags for these options (keyed by config field); options at their defaults are left out."""
    args: list[str] = []
    for name, _, flag in OPTIONS:
        if values[name] != OPTION_DEFAULTS[name]:
            args += [flag, str(values[name])]
    return args
