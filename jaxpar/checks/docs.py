"""docs/config_checks.md, written from the catalogue: `python -m jaxpar.checks --markdown`."""

from __future__ import annotations

from jaxpar.checks import CATALOGUE, base_config, example_config, validate
from jaxpar.checks.rule import BASES, Rule
from jaxpar.errors import ConfigError

COMMAND = ".venv/bin/python -m jaxpar.checks --markdown > docs/config_checks.md"
READS = {"devices": "device count", "sizes": "mesh sizes", "platform": "platform"}

# Checks that need more than the config and the device count, so they run where those
# facts are; listed so the page covers every ConfigError a run can give.
LATER = (
    (
        "`build`, deriving shardings (`jaxpar.sharding.annotate.check_divisible`)",
        "an array dimension that its mesh axes do not divide, naming the array, the dimension and the degrees that "
        "would work",
    ),
    (
        "`build`, parallel.zero.quantized_weights (`jaxpar.step.trainer`)",
        "a parameter whose storage axes do not follow its compute axes cannot be gathered in int8",
    ),
    ("`make_mesh` (`jaxpar.mesh`)", "mesh.hosts.* asks for a host layout the processes the devices come from cannot give"),
    (
        "opening the data (`jaxpar.data.sources`)",
        "data.path is not a file, has an unknown suffix, holds no integers, too few tokens or an id outside "
        "the vocabulary (every id is read); data.dtype is not a numpy dtype",
    ),
    (
        "resuming (`jaxpar.loop.checkpoint`)",
        "checkpoint.dir holds no checkpoint, or one written with other model.* fields or a float32/bfloat16 "
        "compute_dtype swap",
    ),
    (
        "joining other processes (`jaxpar.distributed.from_environment`, `jaxpar launch`)",
        "JAXPAR_* variables set in part or malformed (not host:port, not integers, an index outside the count), "
        "a SLURM job without a node list; --nproc or --cpu-devices-per-proc below 1, a launched command other "
        "than train",
    ),
    (
        "the command line (`jaxpar.commands`, `recipes`, `jaxpar.config.apply_overrides`)",
        "unknown recipes and keys, unparsable values, bad flags",
    ),
)


def markdown() -> str:
    lines = [
        "# Configuration checks",
        "",
        f"Written from the catalogue in `jaxpar/checks/` by `{COMMAND}`;",
        "`tests/unit/test_checks.py` fails when this page and the catalogue disagree, so change the rules, not the page.",
        "",
        "`jaxpar.checks.validate(config, num_devices, platform=None)`, which `build` calls before anything is",
        "compiled, runs these rules in this order; the first that fails raises a `ConfigError` naming the field, the",
        "value and what would work, with `.rule` set to the rule's id. The order matters where a rule relies on an",
        "earlier one (the context rules divide heads by the tensor degree the layout rules checked). The first rule",
        "resolves the mesh axis sizes the others read; the rules that read the platform run only when validate is",
        "given the devices' platform, as `build` does. Two rules wrap a check that also serves elsewhere",
        "(`MeshConfig.resolve`, which `make_mesh` calls; `parse_table`, which reads the rule tables for `build`) and",
        "so give several messages: they show one example for each.",
        "",
        "Each example is a list of `--set` overrides that breaks the rule on one of these base configs, on 8 devices:",
        "",
        *[f"- **{name}**: {_describe(name)}" for name in BASES],
        "",
        "| # | rule | fields | reads |",
        "|---|---|---|---|",
        *[f"| {i} | [`{r.id}`](#{r.id}) | {_fields(r)} | {READS[r.needs]} |" for i, r in enumerate(CATALOGUE, 1)],
        "",
    ]
    for i, rule in enumerate(CATALOGUE, 1):
        where = f"Rule {i}; fields {_fields(rule)}; base {rule.base}, {rule.devices} {rule.platform} devices."
        lines += [f"## {rule.id}", "", rule.summary, "", where, ""]
        for example in rule.examples:
            overrides = " ".join("--set " + o for o in example)
            lines += [f"`{overrides}`", "", "```text", message(rule, example), "```", ""]
    lines += _choices()
    lines += ["## Checked later", "", "These need more than the config and the device count, so they run where those facts are:", ""]
    lines += [f"- {where}: {what}." for where, what in LATER]
    return "\n".join(lines) + "\n"


def _choices() -> list[str]:
    """The choice fields and their values, as their Literal types give them."""
    from jaxpar.choices import RULE, choice_fields
    from jaxpar.config import Config, flatten

    default = flatten(Config())
    return [
        "## Choice fields", "",
        f"The values each choice field takes, from its type in `jaxpar/choices.py`. Rule [`{RULE}`](#{RULE}) "
        "checks them; `--set` refuses any other value as it parses, with that rule's message.", "",
        "| field | values | default |",
        "|---|---|---|",
        *[f"| `{key}` | {', '.join(f'`{v}`' for v in allowed)} | `{default[key]}` |"
          for key, allowed in choice_fields(Config).items()],
        "",
    ]


def message(rule: Rule, example: tuple[str, ...]) -> str:
    """The message `example` gets from the catalogue (and a note if no rule refuses it)."""
    import jax

    try:
        validate(example_config(rule, example), rule.devices, rule.platform)
    except ConfigError as e:  # the page must not change with the jax a checkout installs
        return str(e).replace(f"jaxlib {jax.__version__}", "jaxlib X.Y.Z")
    return "(no rule refuses this example)"


def _fields(rule: Rule) -> str:
    return ", ".join(f"`{f}`" for f in rule.fields)


def _describe(name: str) -> str:
    from jaxpar.config import Config, flatten

    config = base_config(name)
    default = flatten(Config(model=type(config.model)()))
    changed = [f"{k}={v}" for k, v in flatten(config).items() if default[k] != v]
    return f"{type(config.model).__name__} with " + ", ".join(f"`{c}`" for c in changed)
