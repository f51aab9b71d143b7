"""No config key is accepted and silently ignored (``meshrl.config.key_policy``).

The walk covers every key of the schema: a key is refused, FSDP-only or inert by the policy's tables (and then
setting it away from its default must refuse or warn, naming it), or some module of meshrl reads it. "Reads" is
found in the source: the key's name appears as an attribute or a string outside the schema and the policy. That
cannot tell ``critic.megatron.seed`` from ``actor_rollout_ref.actor.megatron.seed`` (both are read); it does
catch a new key that nothing reads.
"""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from meshrl.config import ConfigError, load_config
from meshrl.config.key_policy import classify, leaf_keys
from meshrl.config.loader import default_config
from meshrl.config.validate import validate_config

PACKAGE = Path(__file__).resolve().parents[2] / "meshrl"
SOURCE = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py")
                   if p.relative_to(PACKAGE).as_posix() not in ("config/schema.py", "config/key_policy.py"))
KEYS = leaf_keys(default_config())


def read_somewhere(key: str) -> bool:
    leaf = key.rpartition(".")[2]
    return re.search(r"\.%s\b|[\"']%s[\"']" % (leaf, leaf), SOURCE) is not None


def test_every_schema_key_is_read_refused_or_warned():
    unaccounted = [key for key in KEYS if classify(key) == "read" and not read_somewhere(key)]
    assert not unaccounted, ("keys neither read by meshrl nor in meshrl.config.key_policy's tables: "
                             + ", ".join(unaccounted))


def other_value(key: str):
    """A value of the key's type other than its default."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(default_config(), parent)._get_node(leaf)
    default = OmegaConf.select(default_config(), key)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "_other"
    if "List" in str(node._metadata.ref_type):  # also an Optional[List[...]] left at None
        return [7] if node._metadata.element_type in (int, float) else ["other"]
    if default is None:
        return 7
    return {"other": 1}


def overrides_for(key: str) -> list[str]:
    value = other_value(key)
    if isinstance(value, dict):
        return [f"+{key}.other=1"]
    return [f"{key}={value if not isinstance(value, list) else '[' + ','.join(map(str, value)) + ']'}"]


@pytest.mark.parametrize("key", [k for k in KEYS if classify(k) == "refused"])
def test_a_refused_key_stops_at_config_time_naming_itself(key):
    try:
        cfg = load_config(overrides_for(key), recipe="cpu_tiny_grpo")
    except ConfigError as exc:  # a value of another type is refused by the loader, naming the key too
        assert key in str(exc)
        return
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert key in str(info.value)


@pytest.mark.parametrize("key", [k for k in KEYS if classify(k) in ("fsdp_only", "inert")])
def test_an_fsdp_only_or_inert_key_loads_and_is_named_in_a_warning(key):
    try:
        cfg = load_config(overrides_for(key), recipe="cpu_tiny_grpo")
    except ConfigError:
        pytest.skip(f"{key}: the generated value is not of the key's type")
    plan = validate_config(cfg)
    assert any(key in warning for warning in plan.warnings), plan.warnings


def test_defaults_raise_no_warning():
    assert validate_config(load_config([], recipe="cpu_tiny_grpo")).warnings == ()
