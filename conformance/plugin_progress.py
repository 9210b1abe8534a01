"""Progress with counts and an estimate (a job of lockstep's pytest plugin): while a run's tests go,
one line now and then, ``lockstep: 1234/7000 tests, 17%, 2 min elapsed, ~9 min left (from the rate
so far)``, on a line of its own between pytest's dots.

A line is written when the finished tests cross another tenth of the run, and no sooner than
``MIN_GAP_S`` after the last one (a short run prints none); past ``HEARTBEAT_S`` without a line, the
next finished test writes one whatever its tenth. The time is counted from the first test's start
(collection and the models' builds are not tests: their own lines say what they took), and the
estimate is the rate so far: the largest golden models' tests are dealt out first
(``plugin_collection.longest_first``), so an early estimate is high rather than low.

It counts where reports arrive: the one process of a plain run, the controller under pytest-xdist
(``pytest_runtest_logreport`` of each test's teardown). On by default when the terminal is not
verbose (``-v`` names every test already); ``--lockstep-progress=on|off|auto`` or
``LOCKSTEP_PROGRESS`` (the option wins) says otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import pytest

SETTINGS = ("auto", "on", "off")
ENV = "LOCKSTEP_PROGRESS"
MIN_GAP_S = 30.0      # no two lines closer than this
HEARTBEAT_S = 120.0   # a line at least this often while tests finish, whatever their tenth
STEPS = 10            # a line per tenth of the run


def setting(option: str | None, environ: Mapping[str, str]) -> str:
    """``--lockstep-progress`` when given, else ``LOCKSTEP_PROGRESS``, else ``auto``; anything else
    is a usage error naming the choices."""
    raw, where = (option, "--lockstep-progress") if option is not None else (environ.get(ENV), ENV)
    value = (raw or "auto").strip().lower()
    aliases = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off", "": "auto"}
    value = aliases.get(value, value)
    if value not in SETTINGS:
        raise pytest.UsageError(f"{where}={raw}: expected one of {', '.join(SETTINGS)}")
    return value


def enabled(value: str, verbose: int) -> bool:
    """Whether lines are written: ``on``, or ``auto`` on a terminal that is not verbose."""
    return value == "on" or (value == "auto" and verbose <= 0)


def duration(seconds: float) -> str:
    """``45 s``, ``2 min`` (under an hour, rounded), ``1 h 05 min``."""
    s = max(0.0, seconds)
    if s < 59.5:
        return f"{s:.0f} s"
    m = round(s / 60)
    if m < 60:
        return f"{m} min"
    return f"{m // 60} h {m % 60:02d} min"


ESTIMATE_AFTER = 20  # an estimate once 1/20 of the tests is done


def remaining(done: int, total: int, elapsed: float) -> float | None:
    """Seconds left at the rate so far (``elapsed`` seconds for ``done`` tests); None before a
    twentieth of the tests is done (the largest models' tests run first: a rate from the first few
    said "~178 h left" of a 13-minute run)."""
    if done <= 0 or total <= 0 or done * ESTIMATE_AFTER < total:
        return None
    return elapsed / done * max(0, total - done)


def line(done: int, total: int, elapsed: float) -> str:
    """``lockstep: 1234/7000 tests, 17%, 2 min elapsed, ~9 min left (from the rate so far)``."""
    pct = 100 * done // total if total > 0 else 0
    left = remaining(done, total, elapsed)
    tail = ("estimate after 5% of the tests (the largest models' run first)" if left is None
            else f"~{duration(left)} left (from the rate so far)")
    return f"lockstep: {done}/{total} tests, {pct}%, {duration(elapsed)} elapsed, {tail}"


def due(done: int, total: int, now: float, last_step: int, last_at: float) -> bool:
    """Whether a line is due: ``done`` reached a tenth past ``last_step`` (the tenth of the last line)
    and ``MIN_GAP_S`` passed since it (``last_at``), or ``HEARTBEAT_S`` passed; never at the end
    (pytest's own summary says it)."""
    if total <= 0 or done >= total:
        return False
    step = STEPS * done // total
    gap = now - last_at
    return (step > last_step and gap >= MIN_GAP_S) or gap >= HEARTBEAT_S


class Progress:
    """The plugin (registered by ``pytest_plugin`` where it applies): counts finished tests, writes
    a line when one is ``due``."""

    def __init__(self, config: pytest.Config, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self.session: pytest.Session | None = None
        self.started: float | None = None
        self.done = 0
        self.last_step = 0
        self.last_at = 0.0

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        if self.started is None:
            self.started = self.last_at = self.clock()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            return
        self.done += 1
        total = self.session.testscollected if self.session is not None else 0
        now = self.clock()
        if self.started is None:
            self.started = self.last_at = now
        if not due(self.done, total, now, self.last_step, self.last_at):
            return
        self.last_step, self.last_at = STEPS * self.done // total, now
        self.write(line(self.done, total, now - self.started))

    def write(self, text: str) -> None:
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is None:
            return
        tr.ensure_newline()
        tw = getattr(tr, "_tw", None)
        if tw is not None and getattr(tw, "width_of_current_line", 0):  # after -q's dots: a line of its own
            tw.line()
        tr.write_line(text)
