"""Options a connector declares, so that a misspelt one is an error and `--connector-help` can list them.

A scheduler class declares `kvtool_options`, a tuple of `ConnectorOption`; both halves of the
connector read the values from `llm_args.connector_options`. A connector that declares nothing
gets every option unchecked (the command line says so).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtool.errors import InputError


@dataclass(frozen=True)
class ConnectorOption:
    name: str
    help: str
    default: str | None = None
    """The value used when the option is not given (None: no default, the connector decides)."""
    choices: tuple[str, ...] = ()
    check: Callable[[str], object] | None = None
    """Raises (InputError or ValueError, with a message) for a value that cannot be used."""

    def describe(self) -> str:
        choices = f" ({'|'.join(self.choices)})" if self.choices else ""
        default = f" [default: {self.default}]" if self.default is not None else ""
        return f"{self.name}{choices}: {self.help}{default}"


def declared_options(scheduler_class: type) -> tuple[ConnectorOption, ...] | None:
    """The options a connector declares, or None when it declares none."""
    declared = getattr(scheduler_class, "kvtool_options", None)
    return None if declared is None else tuple(declared)


def check_options(connector: str, declared: Sequence[ConnectorOption], given: Mapping[str, str]) -> None:
    """InputError naming the known options for an unknown key, and the choices for a bad value."""
    by_name = {o.name: o for o in declared}
    for key, value in given.items():
        option = by_name.get(key)
        if option is None:
            known = ", ".join(by_name) or "none"
            raise InputError(f"connector {connector!r} has no option {key!r}; its options: {known} "
                             f"(see kvtool validate {connector} --connector-help)")
        if option.choices and value not in option.choices:
            raise InputError(f"connector {connector!r}: option {key}={value!r} must be one of "
                             f"{', '.join(option.choices)}")
        if option.check is not None:
            try:
                option.check(value)
            except (InputError, ValueError) as exc:
                raise InputError(f"connector {connector!r}: option {key}={value!r}: {exc}") from None
