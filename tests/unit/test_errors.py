"""One error base: a user error is one line on stderr and exit code 2; a bug keeps its traceback."""

from __future__ import annotations

import pytest

from resispec.benchmark.load import LoadTestError
from resispec.data import DataNotFoundError
from resispec.errors import EXIT_USER_ERROR, UserError, exit_on_user_error
from resispec.models import ModelNotFoundError, TokenizerMismatchError
from resispec.training import DistillConfigError, EmptyDatasetError


def test_user_facing_errors_share_the_base_and_keep_their_second_one() -> None:
    for cls, second in (
        (ModelNotFoundError, RuntimeError),
        (TokenizerMismatchError, ValueError),
        (DataNotFoundError, RuntimeError),
        (EmptyDatasetError, ValueError),
        (DistillConfigError, ValueError),
        (LoadTestError, ValueError),
    ):
        assert issubclass(cls, UserError) and issubclass(cls, second), cls


def test_user_error_is_one_line_and_exit_2(capsys) -> None:
    @exit_on_user_error
    def main() -> None:
        raise ModelNotFoundError("no model at /nowhere")

    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == EXIT_USER_ERROR == 2
    assert capsys.readouterr().err == "error: no model at /nowhere\n"


def test_a_bug_keeps_its_traceback() -> None:
    @exit_on_user_error
    def main() -> int:
        return 1 // 0

    with pytest.raises(ZeroDivisionError):
        main()
