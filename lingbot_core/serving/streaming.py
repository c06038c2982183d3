"""The live stream of one viewer (a browser tab or an API client): engine blocks -> H.264 segments.

`LiveService.stream` is the long-lived async generator behind one viewer. It waits in line for a
seat, then takes each finished block from the engine, writes it as a self-contained MP4 segment
(gr.Video(streaming=True) appends the segments into one growing video) and keeps it for the
download. Buttons and keys never produce video: they only post events (`act`).

Pacing, just in time: a block applies the input queued when it starts, so the later it starts the
fresher the picture. The stream takes each block as soon as it is made and tells the engine when to
start the next one (`Engine.pace`): late enough that it reaches the stream `lead_s` before the
viewer's playhead (reported by the page, else estimated) runs out of video, given how long a block
takes to make. No finished block waits in the outbox with old input: a key pressed u seconds before a
block starts shows up u + the block's making + lead_s later (a median of 0.9-1.0 s in a browser, README)
when blocks make faster than they play. Where blocks take longer than they play, each starts at once and the viewer
waits for it anyway. The lead adapts per viewer (`AdaptiveLead`): the page reports how often its player
ran dry, a stall after a held-back block lengthens the lead, smooth playback shortens it again, so it
settles at the least this viewer's delivery path plays without stalls. The telemetry line shows each
key's press -> frame latency as the stream estimates it, and the lead.

The stream only drains the engine's messages for its session (Waiting, NewWorld, Block, Failed, Closed): the
world's state, its idle policy and its close reason are the engine's, and the recording builds the
download's replay from the messages it received. Every way out (Stop, tab close, the viewer
disconnecting, nobody reading the stream) closes the engine session; the engine's own closes (no
input for --idle-ttl, eviction) reach the stream as its Closed message.

Who may do what: a world belongs to the viewer that started it (its Gradio session hash, the same for
a page and for one gradio_client.Client); the session id is for display, and a verb from any other
viewer is refused. A viewer holds at most `max_streams_per_viewer` streams (a world or a place in
line) and one client address at most `max_streams_per_address`, so a few anonymous requests cannot
take every seat and every place in line; a stream whose updates nobody reads for `unread_timeout_s`
gives its seat or place back. Nothing here holds tensors beyond one block's frames in flight:
the engine owns the sessions; this module keeps session ids and recordings (lingbot_core/boundary/video.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import AsyncIterator, Callable

from lingbot_core.boundary import requests
from lingbot_core.boundary.events import EventError, parse_actions
from lingbot_core.boundary.user_text import quote
from lingbot_core.boundary.video import Recording
from lingbot_core.serving.clients import ClientGate, ClientLimits, LimitReached
from lingbot_core.serving.contract import (Admission, AdmissionRefused, Backend, Block, CloseCause, Closed, Failed,
                                           Frames, NewWorld, UnknownSession, Waiting)
from lingbot_core.serving.pacing import AdaptiveLead, PlaybackClock
from lingbot_core.serving.contract import SessionStatus
from lingbot_core.serving import telemetry
from lingbot_core.serving.telemetry import telemetry_line, waiting_line



MAX_TRACKED_EVENTS = 256  # posted events whose times are kept for the key -> frame figure


class StreamError(ValueError):
    """Something the viewer asked for cannot be done; the message says why and what to do."""


@dataclass(frozen=True)
class StreamConfig:
    # Video still queued ahead of the playhead when the next block reaches the stream. It must cover the
    # segment's way to the player (muxing, SSE, HLS fetch: ~0.3 s measured here) plus the ~0.1 s a player
    # wants in hand; below that it stalls for a moment every block, above it only adds latency.
    lead_s: float = 0.6
    # The page's socket player (serving/live_socket.py): a frame reaches the canvas tens of milliseconds after
    # it is sent, so a small lead plays without stalls and the world stays that much closer to its keys.
    socket_lead_s: float = 0.2
    socket_lead_min_s: float = 0.1  # ... and adapts down to this while the player never runs dry
    socket_delivery_s: float = 0.03
    player_blocks_queued: int = 32  # frame batches kept for a socket player not (yet) reading; older ones are dropped
    # The lead adapts to each viewer whose page reports its stalls (AdaptiveLead): up by lead_up_s after a
    # block during which the player ran dry although that block had been held back for pacing (a larger lead
    # would have helped), down by lead_down_s after lead_calm_blocks blocks in a row without a stall. An API
    # client that reports no stalls keeps lead_s.
    lead_min_s: float = 0.3
    lead_max_s: float = 2.0
    lead_up_s: float = 0.15
    lead_down_s: float = 0.05
    lead_calm_blocks: int = 4
    delivery_s: float = 0.4  # a sent segment starts playing about this much later (for the estimate)
    block_margin_s: float = 0.05  # added to a block's measured time when its start is scheduled (pixels, queueing)
    repace_s: float = 0.02  # the engine is told a new start time when the estimate moves by more than this
    poll_s: float = 0.1  # longest single wait on the engine, so a stop or disconnect is noticed quickly
    keep_recordings_s: float = 1800.0  # an ended stream's segments stay downloadable this long
    keep_ended_stream_s: float = 60.0  # Gradio's in-memory copy of an ended stream (its HLS playlist) this long
    workers: int = 16  # threads for engine calls (they may wait on the model lock) and segment encoding
    # A stream whose updates have sat unread this long ends: a fire-and-forget API call must not keep a
    # seat or a place in line. A reading client drains each update within milliseconds.
    unread_timeout_s: float = 5.0
    max_streams_per_viewer: int = 1  # worlds or places in line per page / API client (Gradio session)
    max_streams_per_address: int = 4  # the same per client IP address (app option --max-per-address)
    decode_slots: int = 2  # start pictures decoded at once, whoever sends them (bounds their memory and CPU)

    def __post_init__(self) -> None:
        if min(self.max_streams_per_viewer, self.max_streams_per_address, self.decode_slots) < 1:
            raise ValueError("max_streams_per_viewer, max_streams_per_address and decode_slots must be at least 1")
        if not 0.0 <= self.lead_min_s <= self.lead_max_s or self.lead_calm_blocks < 1:
            raise ValueError("need 0 <= lead_min_s <= lead_max_s and lead_calm_blocks >= 1")


@dataclass(frozen=True)
class StreamUpdate:
    """One step of a viewer's stream: a new segment (or None) and the telemetry line to show."""

    segment: Path | None
    telemetry: str
    session_id: str | None
    finished: bool = False  # the stream ends after this update
    block: Block | None = None  # the block this segment shows (its camera path: poses, start_pose)


# ---------------------------------------------------------------------------------------------
# The service


class PlayerChannel:
    """A stream's frames on their way to the page's socket player (serving/live_socket.py): a bounded queue of
    (block index, first frame's index in it, frames in the block, uint8 frames), the oldest dropped when the
    player does not keep up; None ends it."""

    def __init__(self, session_id: str, viewer: str | None, queue: asyncio.Queue) -> None:
        self.session_id, self.viewer, self.queue = session_id, viewer, queue
        self.connected = False
        self.ended: str | None = None

    def put(self, item) -> None:
        """On the event loop only."""
        if self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(item)

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
            self.put(None)


@dataclass
class _Record:
    """What the app keeps per stream: who owns it, its recording and its player's clock. The world's state
    (liveness, input times, why it closed, its replay) is the engine's; this record learns of it only
    from the messages the stream drains."""

    session_id: str
    viewer: str | None  # the Gradio session that started it: the only one whose verbs it obeys
    recording: Recording
    playhead: tuple[float, float] | None = None  # (when, seconds): the player's last report, if it reports
    stalls: int | None = None  # how often the player ran dry so far, if its page reports it (a running count)
    # When this app posted each event not yet seen in a block (event id -> time): the key -> frame figure.
    posted: OrderedDict[int, float] = field(default_factory=OrderedDict)
    live: bool = True  # False once this app closed the world or the stream saw it close: frees the claim
    ended_at: float | None = None
    streaming: bool = True  # its generator is running (and may still write segments)
    discarded: bool = False  # its viewer left: delete the recording once nothing writes to it
    stopped: bool = False  # its viewer pressed Stop: the stream ends on stopped_line
    player: PlayerChannel | None = None  # the page's socket player, when the stream plays through it


STOPPED_BY_USER = "stopped by the user"  # the close reason of Stop: the stream ends on stopped_line for it


def stopped_line(record: _Record) -> str:
    return telemetry.stopped_line(len(record.recording.segments))


@dataclass
class _Registry:
    records: dict[str, _Record] = field(default_factory=dict)
    tickets: dict[str, _Record] = field(default_factory=dict)  # socket player tickets (serving/live_socket.py)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _ReadWatch:
    """Whether anyone reads a stream: `unread()` counts the updates sent but not yet delivered (None: the
    transport cannot tell, so the stream counts as read).

    A stream is abandoned when every sample for `timeout_s` saw undelivered updates. Samples are taken
    only after the stream has awaited something since its last update, so that a live reader has had
    its turn on the event loop to take that update.
    """

    def __init__(self, unread: Callable[[], int] | None, clock, timeout_s: float) -> None:
        self.unread, self.clock, self.timeout_s = unread, clock, timeout_s
        self.unread_since: float | None = None  # first of the unbroken run of samples with unread updates

    def abandoned(self) -> bool:
        if self.unread is None:
            return False
        now = self.clock()
        if self.unread() == 0:
            self.unread_since = None
            return False
        if self.unread_since is None:
            self.unread_since = now
        return now - self.unread_since > self.timeout_s


class LiveService:
    """Streams, actions and downloads for every viewer of one engine. Thread-safe; owns no tensors."""

    def __init__(self, engine: Backend, recordings_root: Path, config: StreamConfig = StreamConfig(),
                 clock=time.monotonic, gate: ClientGate | None = None) -> None:
        """gate: what each client may hold (serving/clients.py), shared with the realtime protocols' routes of
        the same server; None: one of its own from the config's limits."""
        self.engine = engine
        self.config = config
        self.clock = clock
        self.model_config = engine.model_config
        self.fps = self.model_config.fps
        self.recordings_root = Path(recordings_root)
        self.recordings_root.mkdir(parents=True, exist_ok=True)
        self._registry = _Registry()
        self._executor = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="lingbot-stream")
        self.gate = gate or ClientGate(ClientLimits(config.max_streams_per_viewer, config.max_streams_per_address,
                                                    config.decode_slots))

    # -- the stream --------------------------------------------------------------------------------

    async def stream(self, image, prompt, seed, viewer: str | None = None, address: str | None = None,
                     unread: Callable[[], int] | None = None, player: str = "hls") -> AsyncIterator[StreamUpdate]:
        """Admit, then yield one update per block until the session ends. Raises StreamError for bad input.

        viewer: the Gradio session hash (the world obeys only it); address: the client's IP address;
        unread: how many of this stream's updates wait undelivered (see _ReadWatch); player: "hls" (each
        block's segment in its update, for gr.Video) or "socket" (frames to the page's socket player,
        serving/live_socket.py, updates carry the telemetry only).
        """
        if player not in ("hls", "socket"):
            raise StreamError(f"player must be hls or socket, got {quote(player)}")
        # The claim comes first, so one client cannot make the server decode many pictures at once; the
        # decode (the costly check) runs on a worker thread, at most `decode_slots` at a time.
        try:
            claim = self.gate.claim(viewer, address)
        except LimitReached as exc:
            raise StreamError(str(exc)) from None
        queued, record = None, None  # queued: the session id while this stream waits in line
        try:
            request = await self._call(self._parse_start, image, prompt, seed)
            self._background(self.sweep)
            watch = _ReadWatch(unread, self.clock, self.config.unread_timeout_s)
            ticket = await self._admit(request, early_frames=player == "socket")
            session_id = ticket.session_id
            if ticket.admission is Admission.WAITING:
                # The engine posts this place's position on joining and whenever it changes, then NewWorld
                # when it seats it: the stream only drains them.
                queued = session_id
                while True:
                    message = await self._call(self.engine.next_message, session_id, self.config.poll_s)
                    if watch.abandoned():  # nobody reads: give the place in line back now
                        return
                    if isinstance(message, Waiting):
                        stats = await self._call(self.engine.stats)
                        yield StreamUpdate(None, waiting_line(message.position, stats), None)
                    elif isinstance(message, Closed):
                        yield StreamUpdate(None, f"stopped: {message.reason}; press Start to try again", None, True)
                        return
                    elif isinstance(message, NewWorld):
                        break
                queued = None

            record = await self._call(self._register, session_id, viewer)
            if player == "socket":
                record.player = PlayerChannel(session_id, viewer,
                                              asyncio.Queue(maxsize=self.config.player_blocks_queued))
            claim.alive = lambda: record.live
            notice = self.engine.prompt_notice(request.prompt)
            yield StreamUpdate(None, "starting: the first block is on its way" + (f" ({notice})" if notice else ""),
                               record.session_id)
            async for update in self._blocks(record, watch):
                yield update
        finally:
            self.gate.release(claim)
            if queued is not None:
                self._background(self.engine.withdraw, queued)
            if record is not None:
                record.streaming = False
                if record.player is not None:
                    record.player.end("the world ended")
                self._background(self._end, record, "the stream ended")

    async def _admit(self, request: requests.StartRequest, early_frames: bool = False):
        future = asyncio.ensure_future(self._call(self.engine.admit, request, (), early_frames))
        try:
            return await asyncio.shield(future)
        except AdmissionRefused as exc:
            raise StreamError(str(exc)) from None
        except asyncio.CancelledError:
            # The admission goes on in its thread; a session it opens has no viewer left, so close it.
            future.add_done_callback(self._close_orphan)
            raise

    def _close_orphan(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        # A session, or a place in line (close takes either).
        self._background(self.engine.close, future.result().session_id, "the viewer left while it was starting")

    async def _blocks(self, record: _Record, watch: _ReadWatch) -> AsyncIterator[StreamUpdate]:
        """Drain the session's outbox, paced to the viewer's playhead, until the engine says it closed."""
        cfg = self.config
        socket = record.player is not None
        early_sent: dict[int, int] = {}  # frames of a block already sent to the socket player as Frames
        clock = PlaybackClock(cfg.socket_delivery_s if socket else cfg.delivery_s)
        session_id = record.session_id
        abandoned = f"nobody read the stream for {cfg.unread_timeout_s:g} s"
        just_sent = True  # an update was sent and nothing awaited since: its reader may not have had a turn
        block_s = None  # how long a block takes to make (a running average), once one was made
        paced_at = None  # when the engine was last told to start the next block (None: not since the last block)
        lead = AdaptiveLead(cfg)
        if socket:
            lead = AdaptiveLead(replace(cfg, lead_s=cfg.socket_lead_s, lead_min_s=cfg.socket_lead_min_s))
        held_back = False  # whether the block being made was told to wait at some point (pacing)
        stalls_seen = None  # the page's stall count at the last block (None: no report yet)
        while True:
            if not just_sent and watch.abandoned():  # nobody reads (a fire-and-forget API call): free the seat
                await self._call(self._end, record, abandoned)
                return
            just_sent = False
            now = self.clock()
            if record.playhead is not None:
                clock.observe(record.playhead[1], record.playhead[0])
            if record.live and block_s is not None:
                # Just in time: the next block starts so that it reaches this stream `lead_s` before the player
                # runs dry, and so applies every key pressed until then (a playhead report may move it).
                start_in = clock.wait_before_next(now, lead.lead_s + block_s)
                held_back = held_back or start_in > 0.0
                if paced_at is None or abs(now + start_in - paced_at) > cfg.repace_s:
                    with contextlib.suppress(UnknownSession):  # closed: next_message says why
                        await self._call(self.engine.pace, session_id, start_in)
                    paced_at = now + start_in
            try:
                message = await self._call(self.engine.next_message, session_id, cfg.poll_s)
            except UnknownSession:  # closed so long ago that the engine forgot why
                self._mark_ended(record)
                yield StreamUpdate(None, "stopped: the session was closed", session_id, True)
                return
            if message is None:
                continue
            if isinstance(message, Closed):
                self._mark_ended(record)
                if message.cause is CloseCause.USER and record.stopped:  # this viewer's Stop
                    # The same line Stop answers with: the page shows both, in either order, in one field.
                    yield StreamUpdate(None, stopped_line(record), session_id, True)
                    return
                hint = "; press Start to play again" if message.idle else ""
                yield StreamUpdate(None, f"stopped: {message.reason}{hint}", session_id, True)
                return
            if isinstance(message, Failed):
                hint = "; press a key or Reset to try again" if message.waiting_for_input else "; the world goes on"
                yield StreamUpdate(None, message.text + hint, session_id)
                just_sent = True
                continue
            if isinstance(message, NewWorld):
                await self._call(record.recording.new_world, message.replay)
                continue
            if isinstance(message, Frames):  # frames decoded ahead of their block (a socket player's session)
                if socket:
                    record.player.put((message.block_index, message.first, message.frames_in_block, message.pixels))
                    clock.on_sent(len(message.pixels) / self.fps, self.clock())
                    early_sent[message.block_index] = early_sent.get(message.block_index, 0) + len(message.pixels)
                continue
            if isinstance(message, Waiting):  # a remote world whose server failed waits for the next free one
                stats = await self._call(self.engine.stats)
                yield StreamUpdate(None, waiting_line(message.position, stats), session_id)
                just_sent = True
                continue
            stalls = record.stalls
            if stalls is not None:  # the page reports when its player runs dry: adapt this viewer's lead
                if stalls_seen is not None:
                    lead.after_block(stalls > stalls_seen, held_back)
                stalls_seen = stalls
            held_back = False  # the next block's own pacing decides
            # What the pacing waits for: the whole block, or where its frames leave as they are decoded, its first.
            made_ms = message.first_frame_ms if socket and message.first_frame_ms is not None else message.block_ms
            made_s = 1.1 * made_ms / 1000.0 + cfg.block_margin_s  # the block, its pixels, the scheduling
            block_s = made_s if block_s is None else 0.7 * block_s + 0.3 * made_s
            paced_at = None  # taking it held the next block back until the next `pace`
            try:
                segment, frames = await self._call(self._record_block, record, message)
            except OSError:
                if record.live:
                    raise
                continue  # the viewer left and its recording went with it: the engine's Closed comes next
            early = early_sent.pop(message.block_index, 0)
            if frames > early:
                clock.on_sent((frames - early) / self.fps, self.clock())
            # Key -> frame: from the first of this block's events reaching the server to the block's first frame
            # on screen (estimated as the playback clock places it).
            posted = [t for t in (record.posted.pop(i, None) for i in message.event_ids) if t is not None]
            shows_at = clock.origin + clock.sent_s - frames / self.fps
            key_ms = 1000.0 * (shows_at - min(posted)) if posted else None
            telemetry = await self._call(self._telemetry, message, frames, session_id, key_ms,
                                         lead.lead_s if stalls_seen is not None else None)
            if watch.abandoned():  # sampled after the awaits above, so a reader has had its turn
                await self._call(self._end, record, abandoned)
                return
            if socket:
                if frames > early:  # the frames not sent ahead (all of them without early frames)
                    record.player.put((message.block_index, early, frames, message.pixels[early:]))
                segment = None
            yield StreamUpdate(segment, telemetry, session_id, block=message)
            just_sent = True

    def _record_block(self, record: _Record, message: Block) -> tuple[Path, int]:
        """Encode one block as the next segment of the recording; returns it and its frame count."""
        return record.recording.add(message.pixels, self.fps, message.replay_entry), len(message.pixels)

    def _telemetry(self, message: Block, frames: int, session_id: str, key_ms: float | None = None,
                   lead_s: float | None = None) -> str:
        try:
            status = self.engine.session_status(session_id)
        except UnknownSession:
            status = None
        if status is not None and status["status"] == SessionStatus.CLOSED.value:
            status = None  # closed since this block was made: no memory or queue figures to show
        return telemetry_line(message, frames, self.fps, status, self.engine.stats(), key_ms=key_ms, lead_s=lead_s)

    def _background(self, fn, *args) -> None:
        """Run a cleanup without waiting for it (it may wait on the engine's model lock)."""
        try:
            self._executor.submit(fn, *args)
        except RuntimeError:  # shut down already: run it here
            fn(*args)

    def _parse_start(self, image, prompt, seed) -> requests.StartRequest:
        """The start's one parse (requests.parse_start) behind the decode gate: however many clients upload at
        once, at most `decode_slots` pictures are decoded together (each may take ~150 MiB and most of a core)."""
        try:
            return self.gate.decode(requests.parse_start, image, prompt, seed, self.model_config)
        except ValueError as exc:  # ImageError, PromptError, RequestError: their messages name the problem
            raise StreamError(str(exc)) from None

    async def _call(self, fn, *args):
        """Run a blocking call (engine locks, encoding) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- bookkeeping -------------------------------------------------------------------------------

    def _register(self, session_id: str, viewer: str | None) -> _Record:
        record = _Record(session_id, viewer, Recording(self.recordings_root / session_id))
        with self._registry.lock:
            self._registry.records[session_id] = record
        return record

    def _record(self, session_id: str, viewer: str | None) -> _Record:
        """The session's record, for the viewer that started it only (its id is shown, so it is no key)."""
        if not isinstance(session_id, str) or not session_id.strip():
            raise StreamError("no session: press Start first")
        with self._registry.lock:
            record = self._registry.records.get(session_id.strip())
        if record is None:
            raise StreamError(f"no session {quote(session_id)} here: it ended long ago or never existed")
        if record.viewer != viewer:
            raise StreamError(f"session {quote(session_id)} belongs to the page or API client that started it; "
                              "only that one may control or download it")
        return record

    def _mark_ended(self, record: _Record) -> None:
        if record.live:
            record.live = False
            record.ended_at = self.clock()

    def _end(self, record: _Record, reason: str) -> None:
        """Close the engine session (idempotent: the first reason given stays); the recording stays for the
        download unless discarded."""
        self._mark_ended(record)
        self.engine.close(record.session_id, reason)
        if record.discarded and not record.streaming:
            shutil.rmtree(record.recording.root, ignore_errors=True)
        self.sweep()  # a quiet server forgets old recordings too, not only when a new stream starts

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

    def act(self, session_id: str, events, viewer: str | None = None) -> str:
        """Post one event or a list of them to a live session, in order."""
        record = self._record(session_id, viewer)
        try:
            items = parse_actions(events, self.model_config.transformer.num_frames_per_block,
                                  self.model_config.text.max_prompt_chars)
        except EventError as exc:
            raise StreamError(str(exc)) from None
        for number, event in enumerate(items):
            try:
                self.engine.post_event(record.session_id, event)
                record.posted[event.event_id] = self.clock()
                while len(record.posted) > MAX_TRACKED_EVENTS:  # events no block applied (dropped, reset)
                    record.posted.popitem(last=False)
            except EventError as exc:
                done = f" ({number} earlier events of this call were queued)" if number else ""
                raise StreamError(f"{exc}{done}") from None
            except UnknownSession as exc:
                raise StreamError(f"session {record.session_id} is not running "
                                  f"({exc.reason or 'it was closed'}); press Start") from None
        notices = [n for n in (self.engine.prompt_notice(e.prompt) for e in items if e.prompt is not None) if n]
        return f"queued {len(items)} event(s)" + (f"; {notices[-1]}" if notices else "")

    def ticket(self, session_id: str, viewer: str | None = None) -> str:
        """A ticket for the page's socket player of this session, for the viewer that started it only (the
        socket takes it in place of the Gradio session, which it does not carry)."""
        record = self._record(session_id, viewer)
        if record.player is None:
            raise StreamError("this world plays through the video player (HLS), not the socket player")
        ticket = secrets.token_urlsafe(24)
        with self._registry.lock:
            self._registry.tickets = {t: r for t, r in self._registry.tickets.items() if r.live}
            self._registry.tickets[ticket] = record
        return ticket

    def connect_player(self, ticket: str) -> PlayerChannel:
        """The socket player's channel for this ticket; StreamError for an unknown ticket or a second player."""
        with self._registry.lock:
            record = self._registry.tickets.get(ticket) if isinstance(ticket, str) else None
            if record is None or record.player is None or not record.live:
                raise StreamError("unknown or ended player ticket: press Start")
            if record.player.connected:
                raise StreamError("this world's player is connected already (one player a world)")
            record.player.connected = True
        return record.player

    def disconnect_player(self, channel: PlayerChannel) -> None:
        channel.connected = False

    def report_playhead(self, session_id: str, playhead_s, viewer: str | None = None, stalls=None) -> None:
        """The player's currentTime, reported while it plays; the stream paces to it. stalls: how many times
        the player has run dry on this page so far (a count that only grows), which adapts the lead."""
        try:
            value = float(playhead_s)
        except (TypeError, ValueError, OverflowError):
            raise StreamError(f"playhead must be a number of seconds, got {quote(playhead_s)}") from None
        if not value >= 0.0 or value == float("inf"):
            raise StreamError(f"playhead must be a finite number of seconds >= 0, got {quote(playhead_s)}")
        count = None
        if stalls is not None:
            try:
                count = int(stalls)
            except (TypeError, ValueError, OverflowError):
                raise StreamError(f"stalls must be a whole number, got {quote(stalls)}") from None
            if count < 0 or str(count) != str(stalls).strip():
                raise StreamError(f"stalls must be a whole number >= 0, got {quote(stalls)}")
        record = self._record(session_id, viewer)
        record.playhead = (self.clock(), value)
        if count is not None:
            record.stalls = count

    def stop(self, session_id: str, viewer: str | None = None) -> str:
        record = self._record(session_id, viewer)
        record.stopped = True
        self._end(record, STOPPED_BY_USER)
        return stopped_line(record)

    def reset(self, session_id: str, image, prompt, seed, viewer: str | None = None) -> str:
        """A new world (image, prompt, seed) in the same session and the same stream."""
        record = self._record(session_id, viewer)
        request = self._parse_start(image, prompt, seed)
        try:
            self.engine.reset(record.session_id, request)
        except UnknownSession:
            raise StreamError("the session is not running; press Start") from None
        notice = self.engine.prompt_notice(request.prompt)
        return f"reset: a new world from seed {request.seed}" + (f"; {notice}" if notice else "")

    def download(self, session_id: str, viewer: str | None = None) -> tuple[Path, Path]:
        """The current world so far (or as it ended) as one MP4, and its replay JSON cut to the same blocks.

        Two exports at most are kept per session: Gradio copies each into its own cache as it answers,
        so an older one is only disk space (the previous one stays, in case its copy is still running).
        """
        record = self._record(session_id, viewer)
        exports = sorted(record.recording.root.glob("export-*"), key=lambda path: path.stat().st_mtime_ns)
        for old in exports[:-1]:
            shutil.rmtree(old, ignore_errors=True)
        out_dir = record.recording.root / f"export-{uuid.uuid4().hex[:8]}"
        out_dir.mkdir()
        stem = f"lingbot-{record.session_id[:8]}-world{record.recording.world}"
        mp4 = out_dir / f"{stem}.mp4"
        replay_path = out_dir / f"{stem}-replay.json"
        if not record.recording.export(mp4, replay_path):  # the video and replay of the same blocks
            raise StreamError("nothing has been generated yet; press Start and wait for the first block")
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
