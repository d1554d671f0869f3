"""A plugin's own Config from its composed node (datasets, precisions, loggers): a key the schema
does not have is a ConfigError naming the nearest key, and a value of the wrong type or out of
range is a ConfigError naming the key (the schema's __post_init__ checks)."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mixprec.core.errors import ConfigError, nearest


def parse(schema: type, node: dict, group: str, option: str) -> Any:
    """`node` as an instance of `schema` (`option`, e.g. "data=digits", names it in messages)."""
    known = {f.name for f in dataclasses.fields(schema)}
    for key in node:
        if key not in known:
            raise ConfigError(
                f"{group}.{key} is not a key of {option}{nearest(key, known)} "
                f"(its keys: {', '.join(sorted(known))})"
            )
    return structured(schema, node, group)


def structured(schema: type, node: dict, group: str) -> Any:
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except OmegaConfBaseException as e:  # __post_init__ errors arrive wrapped
        cause = e.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"{group}: {str(e).splitlines()[0]}") from None
