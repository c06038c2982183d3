"""The page before the model: the config read from the checkpoint's files is the loaded one, the engine that
stands in while the model loads waits for it in every verb, and `python app.py` serves its page first."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lingbot_core.blocks.loading import load_pipeline_parts
from lingbot_core.blocks.model_source import choose_source, planned_config
from lingbot_core.config import EMBEDDED, TEST_PRESETS
from lingbot_core.serving.contract import EngineConfig
from lingbot_core.serving.starting import ModelLoadFailed, StartingEngine

ROOT = Path(__file__).resolve().parents[1]


def test_the_embedded_models_config_is_read_exactly_before_loading():
    for preset in (None, "tiny"):
        source, hint = choose_source(None, preset, environ={})
        kwargs = {} if hint is None else {"preset_hint": hint}
        loaded = load_pipeline_parts(source, dtype=torch.float32, **kwargs).config
        assert planned_config(source, hint) == loaded
    assert planned_config("embedded").trained and planned_config("embedded").name == EMBEDDED.name
    assert not planned_config("embedded", TEST_PRESETS["tiny"]()).trained  # seeded weights


def test_a_hub_id_has_no_config_before_its_download():
    assert planned_config("someone/some-model") is None


class FakeEngine:
    def __init__(self, model_config):
        self.model_config = model_config
        self.capacity = 3
        self.prewarmed, self.admitted, self.stopped = [], [], False

    def describe(self):
        return "fake"

    def admit(self, request, first_events=(), early_frames=False):
        self.admitted.append(request)
        return "ticket"

    def prewarm(self, pictures):
        self.prewarmed.extend(pictures)

    def shutdown(self):
        self.stopped = True


CONFIG = TEST_PRESETS["tiny"]()


def test_verbs_wait_for_the_model_and_prewarms_reach_it():
    release = threading.Event()
    fake = FakeEngine(CONFIG)

    def make():
        release.wait(10)
        return fake

    starting = StartingEngine(CONFIG, EngineConfig(), make)
    assert starting.model_config is CONFIG and not starting.loaded
    starting.prewarm(["picture"])
    answers = []
    caller = threading.Thread(target=lambda: answers.append(starting.admit("request")))
    caller.start()
    loader = threading.Thread(target=starting.load)
    loader.start()
    time.sleep(0.2)
    assert answers == [] and fake.admitted == []  # the caller waits for the model
    release.set()
    caller.join(10)
    loader.join(10)
    assert answers == ["ticket"] and fake.admitted == ["request"]
    assert fake.prewarmed == ["picture"] and starting.loaded
    assert starting.capacity == 3 and starting.describe() == "fake"
    starting.prewarm(["another"])
    assert fake.prewarmed == ["picture", "another"]
    starting.shutdown()
    assert fake.stopped


def test_a_shutdown_during_the_load_stops_the_engine_once_it_is_made():
    fake = FakeEngine(CONFIG)
    starting = StartingEngine(CONFIG, EngineConfig(), lambda: fake)
    starting.shutdown()
    starting.load()
    assert fake.stopped and starting.loaded


def test_a_failed_load_reaches_every_waiting_verb():
    def make():
        raise RuntimeError("weights are broken")

    starting = StartingEngine(CONFIG, EngineConfig(), make)
    with pytest.raises(RuntimeError, match="weights are broken"):
        starting.load()
    assert isinstance(starting.error, RuntimeError)
    with pytest.raises(ModelLoadFailed, match="weights are broken"):
        starting.admit("request")


def test_a_loaded_model_unlike_its_config_files_is_refused_and_stopped():
    other = dataclasses.replace(CONFIG, fps=8)
    fake = FakeEngine(other)
    starting = StartingEngine(CONFIG, EngineConfig(), lambda: fake)
    with pytest.raises(ModelLoadFailed, match="its config files said"):
        starting.load()
    assert fake.stopped


def _app(*args: str, env_extra: dict[str, str], ignore_sigint: bool = False) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "GRADIO_TEMP_DIR"}
    env.update(GRADIO_ANALYTICS_ENABLED="False", **env_extra)
    # ignore_sigint: start it as a script's background job starts, with SIGINT ignored (children inherit that).
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    return subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ignore)


@pytest.mark.slow  # two app start-ups, ten seconds or more on 2 cores
def test_the_app_serves_its_page_before_the_model_and_stops_when_the_model_fails(tmp_path):
    from tests.test_serve import free_port

    process = _app("--port", str(free_port()), env_extra={"LINGBOT_TEST_PRESET": "tiny"})
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "the model is ready" in line:
                break
    finally:
        process.terminate()
        process.wait(60)
    ready = next(i for i, line in enumerate(lines) if "ready at http" in line)
    loaded = next(i for i, line in enumerate(lines) if "load the model and choose its precision" in line)
    assert ready < loaded, "".join(lines)

    # A folder whose config files read well but whose weights do not: the page comes up, then the app stops
    # with the loader's reason and a failing exit status, also when it was started with SIGINT ignored (as
    # .ci/run's tests are when CI runs in the background: the app stayed up with no model behind its page).
    from tests.checkpoint_writer import write_tiny_checkpoint

    folder = tmp_path / "broken"
    write_tiny_checkpoint(folder, TEST_PRESETS["tiny"](), shards=1)
    for weights in (folder / "transformer").glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    process = _app("--port", str(free_port()), "--model", str(folder), env_extra={}, ignore_sigint=True)
    try:
        out, _ = process.communicate(timeout=120)
    finally:
        process.kill()  # never outlive the test, stopped or not
    assert process.returncode != 0, out
    assert out.index("ready at http") < out.index("error: the model failed to load"), out


def test_the_page_built_while_the_model_loads_says_so_then_shows_the_engine(tmp_path):
    import app as lingbot_app
    from lingbot_core.serving.factory import create_engine

    release = threading.Event()

    def make():
        release.wait(30)
        return create_engine(preset="tiny", compile=False, engine_config=EngineConfig(max_sessions=1))

    starting = StartingEngine(planned_config(*choose_source(None, "tiny", environ={})), EngineConfig(max_sessions=1),
                              make)
    app = lingbot_app.build_demo(starting, workdir=tmp_path / "work")  # built before the model loads
    try:
        header = next(b for b in app.demo.blocks.values() if "realtime world model" in str(getattr(b, "value", "")))
        assert "The model is loading; Start waits for it." in header.value
        [fill] = [f.fn for f in app.demo.fns.values() if f.name == "loaded_header"]
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(fill()))
        waiter.start()
        time.sleep(0.2)
        assert answers == []  # the page's load event waits for the model
        release.set()
        starting.load()
        waiter.join(30)
        assert "Up to 1 worlds at once." in answers[0] and "loading" not in answers[0]
    finally:
        app.close()
        starting.shutdown()
