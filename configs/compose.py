"""DictConfig -> TrainConfig, and composing hydra_conf/ without a command line (tests and tools).

Hydra checks a key against the schema only when it overrides one: `+key=value` (and `++key=value`) adds a key
to the composed tree, typed schema or not, and OmegaConf then carries it into the dataclass as a stray
attribute no code reads. So `+trainer.max_step=5` would run the default number of steps and say nothing, and
Hydra's own error for the misspelt key without `+` suggests exactly that `+`. Every key of the composed tree is
therefore checked here against the dataclasses, wherever it came from (command line, YAML, `+`), and the entry
points check their command line first (check_overrides), so that the refusal names the field that was meant.
"""

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Sequence

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from configs.errors import ConfigError
from configs.store import register_configs
from configs.train import TrainConfig

HYDRA_CONF_DIR = Path(__file__).resolve().parent.parent / "hydra_conf"


def to_dataclass(dict_cfg: Any, schema: type = TrainConfig):
    """Merge onto the schema (keys and types checked), resolve interpolations, return the typed tree."""
    check_known_keys(dict_cfg, schema)
    tree = OmegaConf.to_container(dict_cfg, resolve=False) if isinstance(dict_cfg, DictConfig) else dict_cfg
    _words_for_str_fields(tree, schema)
    merged = OmegaConf.merge(OmegaConf.structured(schema), tree)
    return OmegaConf.to_object(merged)


def compose_config(overrides: Sequence[str] = (), config_name: str = "train") -> TrainConfig:
    """Compose hydra_conf/<config_name>.yaml with command-line style overrides, e.g. ["parallelism.cp=4"]."""
    register_configs()
    with initialize_config_dir(config_dir=str(HYDRA_CONF_DIR), version_base="1.3"):
        dict_cfg = compose(config_name=config_name, overrides=list(overrides))
    return to_dataclass(dict_cfg)


def check_known_keys(dict_cfg: Any, schema: type = TrainConfig) -> None:
    """Refuse a key the schema has no field for, naming the closest field. A free dict field (model.arch: any HF
    config kwarg) takes any key below it."""
    tree = OmegaConf.to_container(dict_cfg, resolve=False) if isinstance(dict_cfg, DictConfig) else dict_cfg
    _walk(tree, schema, "")


def check_overrides(args: Sequence[str], schema: type = TrainConfig) -> None:
    """A command line's key overrides, before Hydra composes them: Hydra's error for a misspelt key would suggest
    adding it with `+`. Preset choices (model=tiny), hydra.* and what does not parse are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except Exception:  # Hydra says what is malformed, better than we would
        return
    groups = {p.name for p in HYDRA_CONF_DIR.iterdir() if p.is_dir()}
    for override in overrides:
        key = override.key_or_group
        if override.is_delete() or override.package is not None or "/" in key or key in groups or \
                key.split(".")[0] == "hydra":
            continue
        node, prefix = schema, ""
        for part in key.split("."):
            fields = typing.get_type_hints(node)
            if part not in fields:
                raise ConfigError(unknown_key_message(f"{prefix}{part}", override.value(), fields, prefix))
            node, prefix = _dataclass_in(fields[part]), f"{prefix}{part}."
            if node is None:  # a value, or a free dict (model.arch) that takes any key below it
                break


def _walk(tree: dict, schema: type, prefix: str) -> None:
    fields = typing.get_type_hints(schema)
    for key, value in tree.items():
        if key not in fields:
            raise ConfigError(unknown_key_message(f"{prefix}{key}", value, fields, prefix))
        child = _dataclass_in(fields[key])
        if child is not None and isinstance(value, dict):
            _walk(value, child, f"{prefix}{key}.")


def _words_for_str_fields(tree: dict, schema: type) -> None:
    """Hydra's grammar reads `false` and `true` as booleans, and the typed schema then stores one in a str field as
    Python's "False" / "True": `fp8.compile=false` was refused as "fp8.compile=False is not one of {..., false}". A
    str field gets the word back as typed (lower case: no choice of ours is capitalised)."""
    fields = typing.get_type_hints(schema)
    for key, value in tree.items():
        child = _dataclass_in(fields.get(key))
        if child is not None and isinstance(value, dict):
            _words_for_str_fields(value, child)
        elif fields.get(key) is str and (isinstance(value, bool) or value in ("True", "False")):
            tree[key] = str(value).lower()


def _dataclass_in(hint) -> type | None:
    """The dataclass a field holds (also behind Optional[...]); None for plain values and free dicts."""
    if dataclasses.is_dataclass(hint):
        return hint
    inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
    return inner[0] if inner else None


def unknown_key_message(path: str, value: Any, fields: Sequence[str], prefix: str) -> str:
    name = path[len(prefix):]
    close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
    section = prefix.rstrip(".") or "the top level"
    fix = (f"did you mean {prefix}{close[0]}? Use {prefix}{close[0]}={value}" if close else
           f"remove it; {section}'s keys are: {', '.join(fields)}")
    return f"unknown key {path}: {section} has no such field, so nothing would read it (given with + or not): {fix}"
