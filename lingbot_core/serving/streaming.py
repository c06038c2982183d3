"""The live stream of one viewer (a browser tab or an API client): engine blocks -> H.264 segments.

`LiveService.stream` is the long-lived async generator behind one viewer. It waits in line for a
seat, then takes each finished block from the engine, writes it as a self-contained MP4 segment
(gr.Video(streaming=True) appends the segments into one growing video) and keeps it for the
download. Buttons and keys never produce video: they only post events (`act`).

Pacing: the engine computes at most one block ahead of what its consumer has taken, so *when* the
stream takes a block decides when the next one is computed, and so how old the input is that the
viewer sees. The stream takes the next block only once the viewer's playhead (reported by the page,
else estimated) is within `lead_s` of the end of what was sent. The world then stays one block ahead
of the screen: a key pressed u seconds before a take shows up u + lead_s + one block later (about
1.6 s at 16 FPS). Where blocks take longer than they play, the viewer waits for each block anyway
and the stream takes blocks as they come: latency is then about 1.5 blocks' compute time.

Every way out (Stop, tab close, input idle, the viewer disconnecting, the engine closing the
session) closes the engine session. Nothing here holds tensors beyond one block's frames in flight:
the engine owns the sessions; this module keeps session ids, segment files and replay logs.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import av
import numpy as np

from ..events import EventError
from ..image import load_image
from ..model.text import normalize_prompt
from ..video import mp4_segment
from .engine import Admission, AdmissionRefused, BlockMessage, Engine, ErrorMessage, UnknownSession
from .session import SessionStatus

MAX_SEED = 2**63 - 1
MAX_EVENTS_PER_CALL = 64


class StreamError(ValueError):
    """Something the viewer asked for cannot be done; the message says why and what to do."""


@dataclass(frozen=True)
class StreamConfig:
    # Video still queued ahead of the playhead when the next block is taken. It must cover the segment's
    # way to the player (muxing, SSE, HLS fetch: ~0.3 s measured here) plus the ~0.1 s a player wants
    # in hand; below that it stalls for a moment every block, above it only adds latency.
    lead_s: float = 0.6
    delivery_s: float = 0.4  # a sent segment starts playing about this much later (for the estimate)
    poll_s: float = 0.1  # longest single wait on the engine, so a stop or disconnect is noticed quickly
    line_poll_s: float = 1.0  # how often a viewer waiting in line asks again (the engine drops silent tickets)
    input_idle_s: float = 120.0  # no action for this long ends the stream and frees the seat
    keep_recordings_s: float = 1800.0  # an ended stream's segments stay downloadable this long
    workers: int = 16  # threads for engine calls (they may wait on the model lock) and segment encoding


@dataclass(frozen=True)
class StreamUpdate:
    """One step of a viewer's stream: a new segment (or None) and the telemetry line to show."""

    segment: Path | None
    telemetry: str
    session_id: str | None
    finished: bool = False  # the stream ends after this update


# ---------------------------------------------------------------------------------------------
# Pacing


class PlaybackClock:
    """Where the viewer's playhead is: reported by the player when it can, else estimated from what was sent.

    `origin` is the wall time at which the playhead would have been at 0 had the player never waited.
    Estimate: a segment reaches the player `delivery_s` after it is sent, and a player that ran dry
    resumes when the next one arrives (origin moves forward). A report (`observe`) replaces the estimate:
    a paused or stalled player stops the clock, so the world waits for its viewer.
    """

    def __init__(self, delivery_s: float = 0.0) -> None:
        self.delivery_s = delivery_s
        self.sent_s = 0.0  # seconds of video sent so far
        self.origin: float | None = None

    def playhead(self, now: float) -> float:
        if self.origin is None:
            return 0.0
        return min(max(now - self.origin, 0.0), self.sent_s)

    def on_sent(self, duration_s: float, now: float) -> None:
        arrives = now + self.delivery_s
        if self.origin is None or arrives - self.origin > self.sent_s:  # first segment, or the viewer ran dry
            self.origin = arrives - self.sent_s
        self.sent_s += duration_s

    def observe(self, playhead_s: float, now: float) -> None:
        self.origin = now - min(max(playhead_s, 0.0), self.sent_s)

    def wait_before_next(self, now: float, lead_s: float) -> float:
        """Seconds until the playhead is within `lead_s` of the end of the sent video (0: take now)."""
        if self.origin is None:
            return 0.0
        return max(0.0, self.origin + self.sent_s - lead_s - now)


# ---------------------------------------------------------------------------------------------
# Recording (for the download)


class Recording:
    """The segments of a session on disk, one folder per world (a reset starts a new world)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.world = 0
        self.segments: list[Path] = []
        self.new_world()

    @property
    def world_dir(self) -> Path:
        return self.root / f"world-{self.world}"

    def new_world(self) -> None:
        self.world += 1
        self.world_dir.mkdir(parents=True, exist_ok=True)
        self.segments = []

    def add(self, frames: np.ndarray, fps: int) -> Path:
        """Encode [T, H, W, 3] uint8 frames as the next segment; the file appears whole or not at all."""
        path = self.world_dir / f"block-{len(self.segments):06d}.mp4"
        partial = path.with_suffix(".part")
        partial.write_bytes(mp4_segment(frames, fps))
        partial.replace(path)
        self.segments.append(path)
        return path

    def export_mp4(self, out_path: Path) -> int:
        """Join this world's segments into one MP4 without re-encoding; returns the block count."""
        segments = list(self.segments)
        if not segments:
            raise StreamError("nothing has been generated yet; press Start and wait for the first block")
        concat_mp4(segments, out_path)
        return len(segments)


def concat_mp4(segments: list[Path], out_path: Path) -> None:
    """Remux H.264 MP4 segments (same codec settings, no B-frames) into one file, end to end in time."""
    with av.open(str(out_path), mode="w") as output:
        out_stream, offset = None, 0
        for segment in segments:
            with av.open(str(segment)) as source:
                stream = source.streams.video[0]
                if out_stream is None:
                    out_stream = output.add_stream_from_template(stream)
                end = offset
                for packet in source.demux(stream):
                    if packet.dts is None:  # the demuxer's end-of-stream marker
                        continue
                    packet.pts += offset
                    packet.dts += offset
                    end = max(end, packet.pts + packet.duration)
                    packet.stream = out_stream
                    output.mux(packet)
                offset = end


# ---------------------------------------------------------------------------------------------
# Telemetry


def telemetry_line(block: BlockMessage, frames: int, fps: int, status: dict[str, Any] | None,
                   stats: dict[str, Any], note: str = "") -> str:
    generated_fps = frames / (block.block_ms / 1000.0) if block.block_ms > 0 else float("inf")
    parts = [f"block {block.block_index}", f"{block.block_ms:.0f} ms/block",
             f"{generated_fps:.1f} FPS generated (playback {fps})"]
    if status is not None:
        parts.append(f"session memory {status['bytes'] / 2**20:.1f} MiB")
        if status.get("queued_events"):
            parts.append(f"{status['queued_events']} events queued")
    parts.append(_load_text(stats))
    return " · ".join(parts) + (f" — {note}" if note else "")


def waiting_line(position: int | None, stats: dict[str, Any]) -> str:
    return f"waiting in line: position {position} · " + _load_text(stats)


def _load_text(stats: dict[str, Any]) -> str:
    text = f"{stats['active_sessions']}/{stats['capacity']} sessions active"
    if stats.get("waiting"):
        text += f", {stats['waiting']} waiting"
    return text


# ---------------------------------------------------------------------------------------------
# Input checks


def check_start(image, prompt, seed, max_prompt_chars: int) -> tuple[Any, str, int]:
    """The start inputs, checked before anyone waits in line; raises StreamError naming the problem."""
    if image is None:
        raise StreamError("upload an image (or pick one of the examples) first")
    try:
        load_image(image)
        text = normalize_prompt(prompt, max_prompt_chars)
    except ValueError as exc:  # ImageError, PromptError
        raise StreamError(str(exc)) from None
    return image, text, check_seed(seed)


def check_seed(seed) -> int:
    if seed is None or seed == "":
        return 0
    try:
        value = float(seed)
    except (TypeError, ValueError):
        raise StreamError(f"seed must be a whole number, got {seed!r}") from None
    if not value.is_integer() or not 0 <= value <= MAX_SEED:
        raise StreamError(f"seed must be a whole number from 0 to {MAX_SEED}, got {seed!r}")
    return int(value)


def parse_actions(events: str | dict | list) -> list[dict]:
    """One event object or a list of them, as JSON text or already decoded."""
    if isinstance(events, str):
        if not events.strip():
            return []
        try:
            events = json.loads(events)
        except json.JSONDecodeError as exc:
            raise StreamError(f"events are not valid JSON: {exc}") from None
    if isinstance(events, dict):
        events = [events]
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise StreamError('events must be a JSON object like {"event_id": 1, "keys": ["w"]} or a list of them')
    if len(events) > MAX_EVENTS_PER_CALL:
        raise StreamError(f"at most {MAX_EVENTS_PER_CALL} events per call, got {len(events)}")
    return events


# ---------------------------------------------------------------------------------------------
# The service


@dataclass
class _Record:
    """What the app keeps per session: small handles only (ids, paths, the replay log object)."""

    session_id: str
    viewer: str | None
    recording: Recording
    replay: Any = None  # the session's Replay: kept so the download still works after the session closed
    last_input: float = 0.0
    playhead: tuple[float, float] | None = None  # (when, seconds): the player's last report, if it reports
    live: bool = True
    ended_at: float | None = None
    closing_reason: str | None = None  # set when this app closed the session (stop, idle, tab closed)
    streaming: bool = True  # its generator is running (and may still write segments)
    discarded: bool = False  # its viewer left: delete the recording once nothing writes to it


@dataclass
class _Registry:
    records: dict[str, _Record] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class LiveService:
    """Streams, actions and downloads for every viewer of one engine. Thread-safe; owns no tensors."""

    def __init__(self, engine: Engine, recordings_root: Path, config: StreamConfig = StreamConfig(),
                 clock=time.monotonic) -> None:
        self.engine = engine
        self.config = config
        self.clock = clock
        self.fps = engine.pipeline.config.fps
        self.max_prompt_chars = engine.pipeline.config.text.max_prompt_chars
        self.recordings_root = Path(recordings_root)
        self.recordings_root.mkdir(parents=True, exist_ok=True)
        self._registry = _Registry()
        self._executor = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="lingbot-stream")

    # -- the stream --------------------------------------------------------------------------------

    async def stream(self, image, prompt, seed, viewer: str | None = None) -> AsyncIterator[StreamUpdate]:
        """Admit, then yield one update per block until the session ends. Raises StreamError for bad input."""
        image, prompt, seed = check_start(image, prompt, seed, self.max_prompt_chars)
        self._background(self.sweep)
        ticket_id = None
        while True:
            ticket = await self._admit(image, prompt, seed, ticket_id)
            if ticket.admission is Admission.ADMITTED:
                break
            ticket_id = ticket.ticket_id
            stats = await self._call(self.engine.stats)
            yield StreamUpdate(None, waiting_line(ticket.position, stats), None)
            await asyncio.sleep(self.config.line_poll_s)

        session_id = ticket.session_id
        record = await self._call(self._register, session_id, viewer)
        try:
            yield StreamUpdate(None, "starting: the first block is on its way", session_id)
            async for update in self._blocks(record):
                yield update
        finally:
            record.streaming = False
            self._background(self._end, record, "the stream ended")

    async def _admit(self, image, prompt: str, seed: int, ticket_id: str | None):
        future = asyncio.ensure_future(self._call(self.engine.admit, image, prompt, seed, ticket_id))
        try:
            return await asyncio.shield(future)
        except AdmissionRefused as exc:
            raise StreamError(str(exc)) from None
        except ValueError as exc:  # the image or prompt failed inside the session start
            raise StreamError(str(exc)) from None
        except asyncio.CancelledError:
            # The admission goes on in its thread; a session it opens has no viewer left, so close it.
            future.add_done_callback(self._close_orphan)
            raise

    def _close_orphan(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        ticket = future.result()
        if ticket.admission is Admission.ADMITTED:
            self._background(self.engine.close, ticket.session_id, "the viewer left while it was starting")

    async def _blocks(self, record: _Record) -> AsyncIterator[StreamUpdate]:
        cfg = self.config
        clock = PlaybackClock(cfg.delivery_s)
        session_id = record.session_id
        while True:
            if not record.live:  # closed by this app: Stop, tab closed, shutdown
                yield StreamUpdate(None, f"stopped: {record.closing_reason}", session_id, True)
                return
            now = self.clock()
            if now - record.last_input > cfg.input_idle_s:
                reason = f"no input for {cfg.input_idle_s:.0f} s"
                await self._call(self._end, record, reason)
                yield StreamUpdate(None, f"stopped: {reason}; press Start to play again", session_id, True)
                return
            if record.playhead is not None:
                clock.observe(record.playhead[1], record.playhead[0])
            wait = clock.wait_before_next(now, cfg.lead_s)
            if wait > 0:
                await asyncio.sleep(min(wait, cfg.poll_s))
                continue
            try:
                message = await self._call(self.engine.next_message, session_id, cfg.poll_s)
            except UnknownSession:
                yield StreamUpdate(None, f"stopped: {record.closing_reason or 'the session was closed'}",
                                   session_id, True)
                return
            if message is None:
                continue
            if isinstance(message, ErrorMessage):
                if message.fatal:
                    text = record.closing_reason or message.text.removeprefix("session closed: ")
                    yield StreamUpdate(None, f"stopped: {text}", session_id, True)
                    return
                yield StreamUpdate(None, f"{message.text}; press a key or Reset to try again", session_id)
                continue
            if message.block_index == 0 and record.recording.segments:  # a reset started a new world
                record.recording.new_world()
                record.replay = await self._replay(session_id)
            try:
                segment, frames = await self._call(self._record_block, record, message)
            except OSError:
                if record.live:
                    raise
                continue  # the viewer left and its recording went with it: the loop ends above
            clock.on_sent(frames / self.fps, self.clock())
            yield StreamUpdate(segment, await self._call(self._telemetry, message, frames, session_id), session_id)

    def _record_block(self, record: _Record, message: BlockMessage) -> tuple[Path, int]:
        """Encode one block as the next segment of the recording; returns it and its frame count."""
        return record.recording.add(message.pixels, self.fps), len(message.pixels)

    def _telemetry(self, message: BlockMessage, frames: int, session_id: str) -> str:
        try:
            status = self.engine.session_status(session_id)
        except UnknownSession:
            status = None
        if status is not None and status["status"] == SessionStatus.CLOSED.value:
            status = None  # closed since this block was made: no memory or queue figures to show
        return telemetry_line(message, frames, self.fps, status, self.engine.stats())

    async def _replay(self, session_id: str):
        try:
            return await self._call(self.engine.replay, session_id)
        except UnknownSession:
            return None

    def _background(self, fn, *args) -> None:
        """Run a cleanup without waiting for it (it may wait on the engine's model lock)."""
        try:
            self._executor.submit(fn, *args)
        except RuntimeError:  # shut down already: run it here
            fn(*args)

    async def _call(self, fn, *args):
        """Run a blocking call (engine locks, encoding) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- bookkeeping -------------------------------------------------------------------------------

    def _register(self, session_id: str, viewer: str | None) -> _Record:
        recording = Recording(self.recordings_root / session_id)
        record = _Record(session_id, viewer, recording, last_input=self.clock())
        try:
            record.replay = self.engine.replay(session_id)
        except UnknownSession:
            pass
        with self._registry.lock:
            self._registry.records[session_id] = record
        return record

    def _record(self, session_id: str) -> _Record:
        if not isinstance(session_id, str) or not session_id.strip():
            raise StreamError("no session: press Start first")
        with self._registry.lock:
            record = self._registry.records.get(session_id.strip())
        if record is None:
            raise StreamError(f"no session {session_id!r} here: it ended long ago or never existed")
        return record

    def _end(self, record: _Record, reason: str) -> None:
        """Close the engine session (idempotent); the recording stays for the download unless discarded."""
        if record.closing_reason is None:
            record.closing_reason = reason
        if record.live:
            record.live = False
            record.ended_at = self.clock()
        self.engine.close(record.session_id, reason)
        if record.discarded and not record.streaming:
            shutil.rmtree(record.recording.root, ignore_errors=True)

    def sweep(self) -> None:
        """Forget ended sessions whose recordings are older than keep_recordings_s."""
        now = self.clock()
        with self._registry.lock:
            stale = [r for r in self._registry.records.values()
                     if not r.live and r.ended_at is not None and now - r.ended_at > self.config.keep_recordings_s]
            for record in stale:
                del self._registry.records[record.session_id]
        for record in stale:
            shutil.rmtree(record.recording.root, ignore_errors=True)

    def live_session_ids(self) -> list[str]:
        with self._registry.lock:
            return [sid for sid, r in self._registry.records.items() if r.live]

    # -- verbs for buttons and the API -------------------------------------------------------------

    def act(self, session_id: str, events) -> str:
        """Post one event or a list of them to a live session, in order."""
        record = self._record(session_id)
        items = parse_actions(events)
        for number, raw in enumerate(items):
            try:
                self.engine.post_event(record.session_id, raw)
            except EventError as exc:
                done = f" ({number} earlier events of this call were queued)" if number else ""
                raise StreamError(f"{exc}{done}") from None
            except UnknownSession:
                raise StreamError(f"session {record.session_id} is not running "
                                  f"({record.closing_reason or 'it was closed'}); press Start") from None
        record.last_input = self.clock()
        return f"queued {len(items)} event(s)"

    def report_playhead(self, session_id: str, playhead_s) -> None:
        """The player's currentTime, reported while it plays; the stream paces to it."""
        try:
            value = float(playhead_s)
        except (TypeError, ValueError):
            raise StreamError(f"playhead must be a number of seconds, got {playhead_s!r}") from None
        if not value >= 0.0 or value == float("inf"):
            raise StreamError(f"playhead must be a finite number of seconds >= 0, got {playhead_s!r}")
        self._record(session_id).playhead = (self.clock(), value)

    def stop(self, session_id: str) -> str:
        record = self._record(session_id)
        self._end(record, "stopped by the user")
        blocks = len(record.recording.segments)
        return f"stopped after {blocks} block(s) of this world; the rollout can be downloaded"

    def reset(self, session_id: str, image, prompt, seed) -> str:
        """A new world (image, prompt, seed) in the same session and the same stream."""
        record = self._record(session_id)
        image, prompt, seed = check_start(image, prompt, seed, self.max_prompt_chars)
        try:
            self.engine.reset(record.session_id, image, prompt, seed)
        except UnknownSession:
            raise StreamError("the session is not running; press Start") from None
        except ValueError as exc:
            raise StreamError(str(exc)) from None
        record.last_input = self.clock()
        return f"reset: a new world from seed {seed}"

    def download(self, session_id: str) -> tuple[Path, Path]:
        """The current world so far (or as it ended) as one MP4, and its replay JSON cut to the same blocks."""
        record = self._record(session_id)
        out_dir = record.recording.root / f"export-{uuid.uuid4().hex[:8]}"
        out_dir.mkdir()
        stem = f"lingbot-{record.session_id[:8]}-world{record.recording.world}"
        mp4 = out_dir / f"{stem}.mp4"
        blocks = record.recording.export_mp4(mp4)
        replay = json.loads(record.replay.to_json()) if record.replay is not None else {"blocks": []}
        replay["blocks"] = replay["blocks"][:blocks]  # the engine may have run a block past the video
        replay_path = out_dir / f"{stem}-replay.json"
        replay_path.write_text(json.dumps(replay, indent=1))
        return mp4, replay_path

    def close_viewer(self, viewer: str | None) -> int:
        """A tab closed: close its sessions and drop their recordings. Returns how many were live."""
        if viewer is None:
            return 0
        with self._registry.lock:
            records = [r for r in self._registry.records.values() if r.viewer == viewer]
            for record in records:
                del self._registry.records[record.session_id]
        live = sum(r.live for r in records)
        for record in records:
            record.discarded = True
            self._end(record, "the tab was closed")
        return live

    def shutdown(self) -> None:
        with self._registry.lock:
            records = list(self._registry.records.values())
            self._registry.records.clear()
        for record in records:
            self._end(record, "the server is shutting down")
        self._executor.shutdown(wait=True, cancel_futures=False)
        shutil.rmtree(self.recordings_root, ignore_errors=True)
