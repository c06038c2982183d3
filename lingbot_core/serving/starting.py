"""The local engine while its model loads: the page comes up first, and the model loads behind it.

Importing diffusers and transformers and loading the weights takes seconds on a CPU, longer than importing
Gradio and building the page. `StartingEngine` is a Backend whose model config is read from the checkpoint's
config files (blocks/model_source.py) before anything loads, so the page and the protocol servers can be
built and served at once; `load()` then builds the real engine, and every verb waits for it (each is called
on a worker thread, never on the event loop). Pictures to prewarm are handed on once it is there.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from lingbot_core.config import ModelConfig
from lingbot_core.blocks.model_source import same_but_vae
from lingbot_core.serving.contract import Backend, CloseCause, EngineConfig, Message, Ticket


class ModelLoadFailed(RuntimeError):
    """The model could not be loaded behind the page; the message says why."""


class StartingEngine:
    """A Backend that is the engine `make()` returns, once `load()` has made it."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, make: Callable[[], Backend]) -> None:
        self._model_config = model_config
        self.config = config
        self._make = make
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._engine: Backend | None = None
        self._error: BaseException | None = None
        self._prewarm: list = []
        self._stopped = False

    # -- loading ---------------------------------------------------------------------------------

    def load(self) -> Backend:
        """Make the engine (on the calling thread); raises what making it raised, also to every waiting verb."""
        try:
            engine = self._make()
            if not same_but_vae(self._model_config, engine.model_config):
                engine.shutdown()
                raise ModelLoadFailed(f"the model loaded as {engine.model_config!r}, but its config files said "
                                      f"{self._model_config!r}")
        except BaseException as error:
            self._error = error
            self._ready.set()
            raise
        with self._lock:
            self._engine = engine
            pictures, self._prewarm = self._prewarm, []
            stopped = self._stopped
        self._ready.set()
        if stopped:  # shut down while it loaded
            engine.shutdown()
        elif pictures:
            engine.prewarm(pictures)
        return engine

    def start_loading(self, on_error: Callable[[BaseException], None]) -> threading.Thread:
        """`load()` on a thread of its own; `on_error` hears a failure."""
        def run() -> None:
            try:
                self.load()
            except BaseException as error:  # noqa: BLE001  (told to the owner, which stops the app)
                on_error(error)

        thread = threading.Thread(target=run, name="lingbot-model-load", daemon=True)
        thread.start()
        return thread

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def engine(self, timeout: float | None = None) -> Backend:
        """The engine, once loaded (waits); ModelLoadFailed if loading failed, TimeoutError after `timeout`."""
        if not self._ready.wait(timeout):
            raise TimeoutError("the model is still loading")
        if self._engine is None:
            raise ModelLoadFailed(f"the model failed to load: {self._error}") from self._error
        return self._engine

    # -- the Backend verbs -----------------------------------------------------------------------

    @property
    def model_config(self) -> ModelConfig:
        return self._model_config

    @property
    def capacity(self) -> int:
        return self.engine().capacity

    def describe(self) -> str:
        return self.engine().describe()

    def admit(self, request, first_events: tuple = (), early_frames: bool = False) -> Ticket:
        return self.engine().admit(request, first_events, early_frames)

    def withdraw(self, session_id: str, reason: str = "left the line") -> bool:
        return self.engine().withdraw(session_id, reason)

    def post_event(self, session_id: str, raw: Any) -> None:
        self.engine().post_event(session_id, raw)

    def reset(self, session_id: str, request) -> None:
        self.engine().reset(session_id, request)

    def next_message(self, session_id: str, timeout: float | None = None) -> Message | None:
        return self.engine().next_message(session_id, timeout)

    def keep_alive(self, session_id: str) -> None:
        self.engine().keep_alive(session_id)

    def pace(self, session_id: str, start_in_s: float) -> None:
        self.engine().pace(session_id, start_in_s)

    def close(self, session_id: str, reason: str = "closed", cause: CloseCause = CloseCause.USER) -> None:
        self.engine().close(session_id, reason, cause)

    def session_status(self, session_id: str) -> dict[str, Any]:
        return self.engine().session_status(session_id)

    def replay(self, session_id: str):
        return self.engine().replay(session_id)

    def render(self, request, out_path: Path, owner: str | None = None, progress=None) -> int:
        return self.engine().render(request, out_path, owner=owner, progress=progress)

    def prewarm(self, pictures) -> None:
        with self._lock:
            if self._engine is None:
                self._prewarm.extend(pictures)
                return
        self._engine.prewarm(pictures)

    def prompt_notice(self, prompt: str) -> str | None:
        return self.engine().prompt_notice(prompt)

    def stats(self) -> dict[str, Any]:
        return self.engine().stats()

    def accounted_bytes(self) -> int:
        return self._engine.accounted_bytes() if self._engine is not None else 0

    def session_ids(self) -> list[str]:
        return self._engine.session_ids() if self._engine is not None else []

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            engine = self._engine
        if engine is not None:
            engine.shutdown()
