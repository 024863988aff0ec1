"""User errors: mistakes in the user's own input (a missing model, a data set that is not there, a config the run
cannot honour). The entry scripts print them as one line and exit with code 2; anything else is a bug and keeps
its traceback.

    @hydra.main(version_base="1.3", config_path="../conf", config_name="distill")
    @exit_on_user_error
    def main(cfg) -> None: ...

The user-facing classes subclass UserError and keep their historical second base (ValueError / RuntimeError), so
`except ValueError` in callers still works: models.ModelNotFoundError, models.TokenizerMismatchError,
data.DataNotFoundError, training.EmptyDatasetError, training.DistillConfigError.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

EXIT_USER_ERROR = 2

F = TypeVar("F", bound=Callable)


class UserError(Exception):
    """A mistake in the user's input, reported as one line without a traceback."""


def exit_on_user_error(fn: F) -> F:
    """Run `fn`; on a UserError print `error: <message>` to stderr and exit with code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)

    return wrapper  # type: ignore[return-value]
