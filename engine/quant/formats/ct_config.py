"""The `quantization_config` of a compressed-tensors checkpoint (llmcompressor's `oneshot`, the Hub's
"-W4A16" / "-W8A8" / "-FP8-dynamic" models), parsed into config groups, and which group a linear belongs to.

    quantization_config
      format              pack-quantized | int-quantized | naive-quantized | float-quantized | mixed-precision
      config_groups.<g>   targets ["Linear", "re:.*q_proj", "model.layers.0.mlp.down_proj"], weights, input_activations
                          (a group's own `format` overrides the global one)
      ignore              names / "re:" patterns never quantized (e.g. "lm_head")

Matching follows compressed-tensors' `apply_quantization_config`: a linear is quantized when some target matches
its module name and no `ignore` entry does; "re:" patterns use `re.match` (anchored at the start only); among the
matching targets an exact name wins over a pattern, a pattern over the class name "Linear"; a target listed in two
groups belongs to the later one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.models.errors import ConfigFieldError
from engine.quant.formats.base import ActivationQuant
from engine.quant.formats.fields import Fields

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
FORMATS_OF_TYPE = {"int": ("pack-quantized", "int-quantized", "naive-quantized"),
                   "float": ("float-quantized", "naive-quantized")}
BITS_OF_TYPE = {"int": (4, 8), "float": (8,)}
STRATEGIES_OF_TYPE = {"int": ("tensor", "channel", "group"), "float": ("tensor", "channel")}
ACTIVATION_STRATEGIES = ("token", "tensor")
LINEAR_CLASS = "Linear"


@dataclass(frozen=True)
class CtWeights:
    """One group's weight quantization. `group_size` is set only for the "group" strategy."""

    type: str
    bits: int
    strategy: str
    group_size: int | None
    symmetric: bool
    format: str

    @property
    def scheme(self) -> str:
        return "fp8" if self.type == "float" else f"int{self.bits}"

    @property
    def label(self) -> str:
        shape = {"group": f"-g{self.group_size}", "channel": "" if self.type == "float" else "-ch", "tensor": "-t"}
        return self.scheme + shape[self.strategy] + ("" if self.symmetric else "-asym")


@dataclass(frozen=True)
class CtGroup:
    name: str
    targets: tuple[str, ...]
    weights: CtWeights
    activations: ActivationQuant | None

    @property
    def label(self) -> str:
        if self.activations is not None:
            return self.weights.label + ("" if self.weights.type == "float" else "-a8")
        return self.weights.label + ("-a16" if self.weights.type == "float" else "")


def _strategy(f: Fields, kind: str) -> tuple[str, int | None]:
    group_size = f.integer("group_size", None)
    inferred = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    strategy = f.choice("strategy", STRATEGIES_OF_TYPE[kind], inferred)
    if strategy == "group" and (group_size is None or group_size <= 0):
        raise f.error("group_size", group_size, "a positive number of input columns for the group strategy")
    return strategy, group_size if strategy == "group" else None


def parse_weights(f: Fields, fmt: str, fmt_field: str) -> CtWeights:
    kind = f.choice("type", ("int", "float"), "int")
    bits = f.choice("num_bits", BITS_OF_TYPE[kind], 8)
    strategy, group_size = _strategy(f, kind)
    symmetric = f.choice("symmetric", (True,) if kind == "float" else (True, False), True)
    f.choice("dynamic", (False,), False)
    if f.get("actorder") not in (None, False):      # "weight": a calibration order only; "group": g_idx stored
        f.choice("actorder", ("weight", "static", "group", "dynamic"))
    if fmt not in FORMATS_OF_TYPE[kind]:
        raise ConfigFieldError(f"{f.source}: {fmt_field} is {fmt!r}, which does not store {kind} weights "
                               f"({f.path}.type); supported for {kind}: {list(FORMATS_OF_TYPE[kind])}")
    return CtWeights(kind, bits, strategy, group_size, symmetric, fmt)


def parse_activations(f: Fields | None, weights: CtWeights) -> ActivationQuant | None:
    """Only dynamic (run-time) activation quantization in the weights' own 8-bit type: W8A8-FP8 and W8A8-int8."""
    if f is None:
        return None
    kind, bits = str(f.get("type", "int")).lower(), f.get("num_bits", 8)
    if (kind, bits) != (weights.type, 8) or weights.bits != 8:
        raise ConfigFieldError(
            f"{f.source}: {f.path} is {kind} {bits}-bit (with {weights.type} {weights.bits}-bit weights); supported: "
            "none (weight-only), or dynamic 8-bit activations of the weights' own type (FP8 weights with FP8 "
            "activations, int8 weights with int8 activations)")
    f.choice("dynamic", (True,))
    f.choice("symmetric", (True,), True)
    strategy = f.choice("strategy", ACTIVATION_STRATEGIES, "tensor")
    return ActivationQuant("fp8" if weights.type == "float" else "int8", strategy)


def _group_format(f: Fields, global_format: str | None) -> tuple[str, str]:
    if f.has("format"):
        return f.choice("format", FORMATS), f.name("format")
    if global_format is None:
        raise f.error("format", None, f"one of {list(FORMATS)} when quantization_config.format is mixed-precision")
    return global_format, "quantization_config.format"


def parse_group(f: Fields, name: str, global_format: str | None) -> CtGroup:
    targets = f.strings("targets")
    if not targets:
        raise f.error("targets", f.get("targets"), "a non-empty list of module names, 're:' patterns or 'Linear'")
    weights_f = f.sub("weights")
    if weights_f is None:
        raise f.error("weights", None, "a weight quantization (activation-only groups are not supported)")
    f.refuse_set("output_activations", "output activation quantization is not supported")
    fmt, fmt_field = _group_format(f, global_format)
    weights = parse_weights(weights_f, fmt, fmt_field)
    return CtGroup(name, targets, weights, parse_activations(f.sub("input_activations"), weights))


def parse_groups(qc: Fields) -> tuple[CtGroup, ...]:
    fmt = qc.choice("format", FORMATS + ("mixed-precision",))
    groups_f = qc.sub("config_groups")
    if groups_f is None or not groups_f.data:
        raise qc.error("config_groups", qc.get("config_groups"), "at least one group with targets and weights")
    groups = []
    for name, value in groups_f.data.items():
        if not isinstance(value, dict):
            raise groups_f.error(name, value, "a scheme object (targets, weights, ...); preset names are not")
        groups.append(parse_group(Fields(value, groups_f.name(name), qc.source), name,
                                  None if fmt == "mixed-precision" else fmt))
    return tuple(groups)


def _match_name(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _matches(name: str, target: str) -> bool:
    """For a linear module: its name, or its class (only "Linear" names a class every linear has)."""
    return _match_name(name, target) or target == LINEAR_CLASS


def group_of(name: str, groups: tuple[CtGroup, ...], ignore: tuple[str, ...]) -> CtGroup | None:
    """The group quantizing linear module `name`, None when no target matches or an `ignore` entry does."""
    if any(_matches(name, ign) for ign in ignore):
        return None
    by_target = {t: g for g in groups for t in g.targets}                # later groups win, as in compressed-tensors
    ordered = sorted(by_target, key=lambda t: ("re:" in t, t))         # compressed-tensors' match_targets order
    for target in ordered:
        if _match_name(name, target):
            return by_target[target]
    return by_target.get(LINEAR_CLASS)
