"""Rank 0's progress bar (logging/progress_bar.py): shown on a terminal, not in a captured
stderr, forced on or off by SHARDWISE_PROGRESS or an argument, and only on rank 0."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import sys
import termios
from collections.abc import Iterator
from typing import TextIO

import pytest

from shardwise.logging.progress_bar import ENV_VAR, progress_bar, progress_wanted
from shardwise.testing import run_ranks


@pytest.fixture
def terminal() -> Iterator[tuple[TextIO, int]]:
    """A pseudo-terminal: the end a process writes to, and the end to read that from. (pytest
    sets sys.stderr again between a fixture and its test: the test puts it there.)"""
    reader, writer = os.openpty()
    # 24 rows of 100 columns, as a terminal window has (a new one has none: tqdm draws nothing).
    fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    stream = open(writer, "w", buffering=1, closefd=True)  # noqa: SIM115 - closed below
    try:
        yield stream, reader
    finally:
        stream.close()
        os.close(reader)


def _read(fd: int) -> str:
    text = b""
    while True:
        os.set_blocking(fd, False)
        try:
            block = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not block:
            break
        text += block
    return text.decode(errors="replace")


def test_a_terminal_gets_the_bar(
    monkeypatch: pytest.MonkeyPatch, terminal: tuple[TextIO, int]
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(sys, "stderr", terminal[0])
    assert progress_wanted()
    bar = progress_bar(3 * 2**20, "checkpoint save", shown=progress_wanted())
    for _ in range(3):
        bar.update(2**20)
    bar.close()
    drawn = _read(terminal[1])
    assert "checkpoint save" in drawn and "100%" in drawn and "3.00M" in drawn, drawn


def test_a_captured_stderr_gets_no_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stderr", captured)
    assert not progress_wanted()
    bar = progress_bar(10, "checkpoint load", shown=progress_wanted())
    bar.update(10)
    bar.close()
    assert captured.getvalue() == ""


@pytest.mark.parametrize("value", ["1", "true", "ON"])
def test_the_environment_forces_the_bar_on(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stderr", captured)
    assert progress_wanted()
    bar = progress_bar(4, "disk tier write", shown=progress_wanted(), unit="chunk")
    bar.update(4)
    bar.close()
    assert "disk tier write" in captured.getvalue() and "4/4" in captured.getvalue()


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_the_environment_turns_the_bar_off_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, terminal: tuple[TextIO, int], value: str
) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    monkeypatch.setattr(sys, "stderr", terminal[0])
    assert not progress_wanted()
    bar = progress_bar(4, "checkpoint save", shown=progress_wanted())
    bar.update(4)
    bar.close()
    assert _read(terminal[1]) == ""


def test_the_argument_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "0")
    assert progress_wanted(True)
    monkeypatch.setenv(ENV_VAR, "1")
    assert not progress_wanted(False)


def test_an_unknown_setting_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="SHARDWISE_PROGRESS='sometimes'"):
        progress_wanted()
    with pytest.raises(ValueError, match="got 'yes please'"):
        progress_wanted("yes please")  # type: ignore[arg-type]


def _wanted_on_each_rank() -> bool:
    return progress_wanted(True)


def test_only_rank_0_draws_a_bar() -> None:
    assert run_ranks(_wanted_on_each_rank, 2) == [True, False]
