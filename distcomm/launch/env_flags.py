"""argparse actions whose defaults come from the environment: DISTCOMM_<FLAG>, else
torchrun's PET_<FLAG>; and the two spellings (--flag_name, --flag-name) of every flag."""

from __future__ import annotations

import argparse
import os

from ..config import FLAG_PREFIX, parse_bool

__all__ = ["EnvDefault", "EnvFlag", "flag_names"]


def _env_name(dest: str) -> str:
    return FLAG_PREFIX + dest.upper()


def _env_value(dest: str) -> tuple[str, str | None]:
    """(variable, value) of a flag's environment default: DISTCOMM_<FLAG>, else torchrun's
    PET_<FLAG>; the value is None when neither is set."""
    for name in (_env_name(dest), "PET_" + dest.upper()):
        value = os.environ.get(name)
        if value is not None:
            return name, value
    return _env_name(dest), None


class EnvDefault(argparse.Action):
    """A flag whose default comes from DISTCOMM_<FLAG> (or torchrun's PET_<FLAG>) when set."""

    def __init__(
        self,
        option_strings: list[str],
        dest: str,
        default: object = None,
        required: bool = False,
        **kwargs: object,
    ) -> None:
        _, env = _env_value(dest)
        if env is not None:
            default, required = env, False
        super().__init__(option_strings, dest, default=default, required=required, **kwargs)  # type: ignore[arg-type]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


class EnvFlag(argparse.Action):
    """A store_true flag whose default comes from DISTCOMM_<FLAG> (or PET_<FLAG>):
    1/true/yes/on."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        name, value = _env_value(dest)
        default = parse_bool(name, value or "")
        super().__init__(option_strings, dest, nargs=0, default=default, **kwargs)  # type: ignore[arg-type]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)


def flag_names(flag: str) -> list[str]:
    """--flag_name and --flag-name, torchrun's two spellings."""
    under, dash = "--" + flag, "--" + flag.replace("_", "-")
    return [dash, under] if dash != under else [dash]
