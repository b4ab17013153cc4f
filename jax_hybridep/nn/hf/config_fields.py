"""Reading the fields of a HuggingFace `config.json`, an untrusted file: each field by its type and
range (nothing coerced: `"8"`, `8.7` and `true` are not 8, `"false"` is not False), by any of the
names the family's HF config class accepts for it (its `attribute_map`: the family's `aliases`,
`nn.hf.family`), every error a ValueError naming the model_type and the field as the file spells
it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jax_hybridep.values import is_int, is_real, short

REQUIRED = object()
# A field whose default differs between HF's families (or versions) has none: a config without it
# is refused, naming it, rather than read as another model.


class Config:
    """One family's config dict; every error names the model_type and the field.

    `get` returns a field as it is (None counts as absent, as in HF's classes); `integer`,
    `number`, `flag`, `text`, `integers` and `nested` also check its type and range."""

    def __init__(
        self,
        config: Mapping,
        model_type: str,
        path: str = "",
        aliases: Sequence[tuple[str, ...]] = (),
    ):
        # path: where a nested config sits ("ffn_config."), so errors name the whole field.
        # aliases: groups of names for one field, the first the one asked for (`Family.aliases`).
        self.config, self.model_type, self.path = config, model_type, path
        self._names = {name: group for group in aliases for name in group}

    def names(self, key: str) -> tuple[str, ...]:
        """Every spelling of field `key` (itself first)."""
        group = self._names.get(key, (key,))
        return (key, *(n for n in group if n != key))

    def _find(self, key: str):
        """(name as spelled, value) of field `key`, or None when no spelling holds a value; a
        ValueError when two spellings hold different values."""
        found = [(n, self.config[n]) for n in self.names(key) if self.config.get(n) is not None]
        for name, value in found[1:]:
            if value != found[0][1] or type(value) is not type(found[0][1]):
                first = found[0][0]
                raise ValueError(
                    f"config.json of model_type {self.model_type!r}: {self.path}{first}="
                    f"{short(found[0][1])} and {self.path}{name}={short(value)} name one field "
                    "(HF's config class takes either) with two values"
                )
        return found[0] if found else None

    def has(self, key: str) -> bool:
        return self._find(key) is not None

    def get(self, key: str, default=REQUIRED):
        found = self._find(key)
        if found is not None:
            return found[1]
        if default is REQUIRED:
            self.lacks(key)
        return default

    def lacks(self, key: str):
        others = [repr(self.path + n) for n in self.names(key)[1:]]
        also = f" (or {', '.join(others)})" if others else ""
        raise ValueError(
            f"config.json of model_type {self.model_type!r} lacks {self.path + key!r}{also}"
        )

    def fail(self, key: str, why: str):
        found = self._find(key)
        name, value = found if found is not None else (key, self.config.get(key))
        raise ValueError(
            f"config.json of model_type {self.model_type!r}: {self.path}{name}={short(value)} {why}"
        )

    def integer(self, key: str, default=REQUIRED, low: int = 1, high: int | None = None):
        """An int in [low, high]; `default` (taken as it is) when absent."""
        value = self.get(key, default)
        if value is default and default is not REQUIRED:
            return value
        if not is_int(value) or value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            self.fail(key, f"is not an int {bounds}")
        return int(value)

    def number(
        self,
        key: str,
        default=REQUIRED,
        low=-math.inf,
        high=math.inf,
        *,
        above: bool = False,
        below: bool = False,
    ):
        """A finite int or float in [low, high] (> low with `above`, < high with `below`)."""
        value = self.get(key, default)
        if value is default and default is not REQUIRED:
            return value
        ok = (
            is_real(value)
            and math.isfinite(value)
            and (value > low if above else value >= low)
            and (value < high if below else value <= high)
        )
        if not ok:
            lo = f"{'(' if above else '['}{low:g}"
            hi = f"{high:g}{')' if below else ']'}"
            self.fail(key, f"is not a finite number in {lo}, {hi}")
        return float(value)

    def flag(self, key: str, default=REQUIRED) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, "is not true or false")
        return value

    def text(self, key: str, default=REQUIRED) -> str:
        value = self.get(key, default)
        if not isinstance(value, str):
            self.fail(key, "is not a string")
        return value

    def integers(self, key: str, default=REQUIRED, low: int = 0) -> list[int]:
        """A list of ints >= low."""
        value = self.get(key, default)
        if (
            isinstance(value, str | bytes)
            or not isinstance(value, Sequence)
            or not all(is_int(v) and v >= low for v in value)
        ):
            self.fail(key, f"is not a list of ints >= {low}")
        return [int(v) for v in value]

    def nested(self, key: str) -> Config:
        """The nested config `key` (a JSON object), read like this one."""
        value = self.get(key)
        if not isinstance(value, Mapping):
            self.fail(key, "is not a JSON object")
        return Config(value, self.model_type, f"{self.path}{key}.")

    def activation(self, key: str, default, table: Mapping[str, str]) -> str:
        """The block activation `table` maps the field's name to (DBRX nests it: {"name": ...})."""
        act = self.get(key, default)
        if isinstance(act, Mapping):
            act = act.get("name")
        if not isinstance(act, str) or act not in table:
            self.fail(key, f"is not supported here (supported: {sorted(table)})")
        return table[act]
