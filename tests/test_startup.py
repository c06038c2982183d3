"""Start-up that talks: each stage printed with its time, and the precision's reason on the page header."""

from __future__ import annotations

import io
from types import SimpleNamespace

from lingbot_core.config import tiny_config
from lingbot_core.process.precision import Precision
from lingbot_core.process.startup import StartupLog, maybe_stage, process_age_s


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stages_are_printed_with_their_time_and_details():
    out, clock = io.StringIO(), Clock()
    log = StartupLog(out, clock)
    start = log.started
    with log.stage("load the model") as details:
        clock.now += 2.5
        details.append("embedded, fp32")
    clock.now += 0.5
    log.note("ready at http://127.0.0.1:7860/")
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("load the model took 2.5 s: embedded, fp32")
    assert lines[0].startswith(f"[{clock.now - 0.5 - start:6.1f} s]")
    assert lines[1].endswith("ready at http://127.0.0.1:7860/")
    assert 0.0 <= process_age_s() < 24 * 3600  # stamps count from the process start, imports included


def test_without_a_log_stages_are_silent(capsys):
    with maybe_stage(None, "memory probe") as details:
        details.append("nothing printed")
    assert details == ["nothing printed"]  # the stage body ran with a usable details list
    assert capsys.readouterr() == ("", "")  # and nothing reached stdout or stderr


def test_the_page_header_names_the_precision_and_its_reason():
    import app

    from lingbot_core.serving.engine import Engine

    precision = Precision("fp32", "auto on an AVX2 CPU without native bf16")
    engine = SimpleNamespace(capacity=2, pipeline=SimpleNamespace(precision=precision))
    engine.describe = lambda: Engine.describe(engine)  # the local engine's own wording
    header = app._header(tiny_config(), engine)
    assert "Precision **fp32**: auto on an AVX2 CPU without native bf16." in header
