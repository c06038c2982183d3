"""One user's world: its rollout state, its event queue, a transactional step and a replay log.

A session owns everything one world carries between blocks: the rollout state (condition encoder
history or its fixed-point marker, decoder stream state, KV page table, text K/V, RNG state, camera
tail pose and pitch, prompt, block index) plus the input side (queued events, held keys, event
floor) and a replay log. It holds no global state and never touches another session's state.

`step` takes the block's control from the queued events, runs the block and, only when every stage
succeeded, commits the new rollout state, consumes the events, raises the event floor and appends
to the replay, all at once. A failure leaves every one of those exactly as it was; the session is
marked FAILED (with `last_error`) and the next step may succeed.

Threads: input (`post_event`, `nbytes`, `describe`) may come from any thread while another steps;
a small internal lock guards the queue and the commit. The KV pool is not thread-safe, so `step`,
`reset` and `close` of sessions sharing a pool must be serialised by the caller (the engine does).
"""

from __future__ import annotations

import enum
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import torch

from ..condition_cache import ConditionCache
from ..events import Event, EventError, KeyStateEvent, ScriptEvent, parse_event
from ..image import image_digest, load_image
from ..kv_cache import KVPagePool
from ..model import vae_stream
from ..model.text import PromptError, normalize_prompt
from ..rollout import BlockControl, BlockOutput, RolloutState, release
from ..video import frames_to_uint8


class SessionStatus(enum.Enum):
    ACTIVE = "active"
    FAILED = "failed"  # the last block raised; the state is intact and the next step may succeed
    CLOSED = "closed"


class SessionClosed(RuntimeError):
    """The session was closed (by the user, a disconnect, its idle TTL or eviction)."""


class SessionBusy(RuntimeError):
    """A block of this session is already running; a session steps one block at a time."""


# ---------------------------------------------------------------------------------------------
# Bytes


def held_bytes(value: Any, seen: set[int] | None = None) -> int:
    """Bytes of the tensor storages and NumPy buffers reachable from `value` (containers, dataclasses,
    objects); each buffer once."""
    seen = set() if seen is None else seen
    total = 0
    stack = [value]
    visited: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, np.ndarray):  # e.g. a block's uint8 pixels; may share memory with a tensor
            root = item
            while isinstance(root.base, np.ndarray):
                root = root.base
            pointer = root.__array_interface__["data"][0]
            if pointer not in seen:
                seen.add(pointer)
                total += root.nbytes
        elif isinstance(item, (str, bytes, int, float, bool, type(None), type, torch.nn.Module)):
            continue  # scalars hold no tensors; classes and modules (weights) are not session state
        elif id(item) in visited:
            continue
        else:
            visited.add(id(item))
            if isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple, set, frozenset)):
                stack.extend(item)
            elif hasattr(item, "__dict__"):
                stack.extend(vars(item).values())
    return total


@dataclass(frozen=True)
class Footprint:
    """Peak bytes of one session of a pipeline, measured once on a probe rollout (see `measure_footprint`).

    `committed` is what a session holds between blocks at worst; `in_flight` is what one running block
    adds on top (its reserved pages, the pending encoder and decoder states, the block's working tensors).
    """

    page_bytes: int
    kv_pages: int  # the committed page table at its fullest: sink + recent window
    text_kv: int
    condition: int  # condition stream at its largest: encoder history + the last condition block
    decoder: int  # decoder feature cache at its largest
    rng: int  # the generator state carried between blocks
    block_pages: int  # pages a block reserves for its own K/V
    scratch: int  # a block's working tensors: noise and latents, mask + condition input, Plücker map, frames
    message: int  # one finished block handed to a consumer: uint8 pixels + latents

    @property
    def committed(self) -> int:
        return self.kv_pages + self.text_kv + self.condition + self.decoder + self.rng

    @property
    def in_flight(self) -> int:
        """A block with a prompt switch: pending pages, encoder, decoder and text K/V, plus scratch."""
        return self.block_pages + self.condition + self.decoder + self.text_kv + self.scratch


def block_scratch_bytes(config, model_dtype: torch.dtype, vae_dtype: torch.dtype) -> int:
    """Working tensors a block keeps across its stages, from the config's shapes.

    latents and the mask + condition input are float32 (the sampler's dtype); the Plücker map is in the
    model dtype; the decoded frames are in the VAE dtype. Transformer activations are transient within a
    stage and belong to the worker, not to a session.
    """
    t = config.transformer
    latent = t.num_frames_per_block * config.latent_height * config.latent_width
    fp32 = torch.empty((), dtype=torch.float32).element_size()
    latents = t.out_channels * latent * fp32  # [1, z, F, h, w]
    extra = (t.mask_channels + t.out_channels) * latent * fp32  # [1, mask + z, F, h, w]
    mask = t.mask_channels * latent * torch.empty((), dtype=vae_dtype).element_size()
    pixels = config.height * config.width
    plucker = t.num_frames_per_block * t.camera_channels * pixels * torch.empty((), dtype=model_dtype).element_size()
    frames = 3 * config.pixel_frames_per_block * pixels * torch.empty((), dtype=vae_dtype).element_size()
    return latents + extra + mask + plucker + frames


def measure_footprint(pipeline, seed: int = 0) -> Footprint:
    """Each component's peak for one session of `pipeline`, without running a block of the model.

    The KV pages, the RNG state, a block's scratch and a finished block's size follow from the config;
    the text K/V are one real prompt encoding; the condition and decoder states come from
    `vae_stream.probe_stream_bytes` (two blocks streamed through the VAE on a small frame, scaled to the
    model's frame). Start-up used to run two whole blocks for this, 19 s on a 2-core AVX2 CPU in fp32.
    """
    config = pipeline.config
    t = config.transformer
    frames_per_block = t.num_frames_per_block
    page_bytes = KVPagePool.page_nbytes(config, pipeline.dtype)
    streams = vae_stream.probe_stream_bytes(pipeline.vae, config)
    generator_state = torch.Generator(device="cpu").manual_seed(seed).get_state()
    # What the engine hands a consumer: the frames as uint8 pixels (sized by the conversion itself) and the
    # float32 latents the sampler returns.
    pixels = frames_to_uint8(torch.zeros(1, 3, streams.pixel_frames, config.height, config.width)).nbytes
    latents = held_bytes(torch.zeros(1, t.out_channels, frames_per_block, config.latent_height, config.latent_width))
    vae_dtype = next(pipeline.vae.parameters()).dtype
    return Footprint(page_bytes=page_bytes, kv_pages=(t.sliding_window_num_frames - frames_per_block) * page_bytes,
                     text_kv=held_bytes(pipeline.encode_prompt("probe")), condition=streams.condition,
                     decoder=streams.decoder, rng=held_bytes(generator_state),
                     block_pages=frames_per_block * page_bytes,
                     scratch=block_scratch_bytes(config, pipeline.dtype, vae_dtype), message=pixels + latents)


# ---------------------------------------------------------------------------------------------
# Replay


@dataclass
class Replay:
    """Enough to regenerate the identical latents offline: image hash, seed, prompts and per-block keys.

    Each block records the key set of each latent frame it applied, the ids of the events it consumed
    and, when the text changed at that block, the new prompt.
    """

    model: str
    image_sha256: str
    seed: int
    prompt: str
    blocks: list[dict[str, Any]] = field(default_factory=list)
    dtype: str | None = None  # bit-identical latents need the same dtype (and device kind) offline

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "dtype": self.dtype, "image_sha256": self.image_sha256,
                           "seed": self.seed, "prompt": self.prompt, "blocks": self.blocks}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Replay":
        raw = json.loads(text)
        return cls(model=raw["model"], image_sha256=raw["image_sha256"], seed=int(raw["seed"]),
                   prompt=raw["prompt"], blocks=list(raw["blocks"]), dtype=raw.get("dtype"))

    def to_events_jsonl(self) -> str:
        """The action script that `python -m lingbot_core.generate --events` replays block for block."""
        lines = []
        for index, block in enumerate(self.blocks):
            event = {"event_id": index, "frames": block["frames"]}
            if "prompt" in block:
                event["prompt"] = block["prompt"]
            lines.append(json.dumps(event))
        return "".join(line + "\n" for line in lines)


# ---------------------------------------------------------------------------------------------
# The session


@dataclass(frozen=True)
class _Plan:
    """One block's input, taken from the queue at the block boundary."""

    control: BlockControl
    consumed: int  # queued events this block applies
    held_after: frozenset[str]
    event_ids: tuple[int, ...]


class Session:
    def __init__(self, session_id: str, pipeline, pool: KVPagePool, image, prompt: str, seed: int,
                 max_queued_events: int = 64, clock: Callable[[], float] = time.monotonic,
                 footprint: Footprint | None = None, conditions: ConditionCache | None = None) -> None:
        """conditions: where sessions share one condition stream per start picture (the engine's cache)."""
        if max_queued_events < 1:
            raise ValueError(f"max_queued_events must be at least 1, got {max_queued_events}")
        self.session_id = session_id
        self.pipeline = pipeline
        self.pool = pool
        self.max_queued_events = max_queued_events
        self.clock = clock
        self.footprint = footprint
        self.conditions = conditions
        self._lock = threading.Lock()  # queue, held keys, floor, replay, status: the parts input touches
        self._busy = False
        self._close_requested = False
        self._in_flight: dict[str, int] = {}
        self.status = SessionStatus.ACTIVE
        self.last_error: str | None = None
        self.event_floor = -1  # id of the last event a committed block applied
        self._last_event_id = -1  # highest id ever accepted: ids increase across blocks and resets
        self.queue: deque[Event] = deque()
        self._failed_event_ids: tuple[int, ...] = ()  # the input of the last failed block
        self.held_keys: frozenset[str] = frozenset()
        self.last_input = self.last_consumed = clock()
        self.rollout: RolloutState | None = None
        self.replay: Replay | None = None
        self._start(image, prompt, seed)

    # -- lifecycle ---------------------------------------------------------------------------------

    def _start(self, image, prompt: str, seed: int) -> None:
        """Build the new world first; only then drop the old one, so a bad image or prompt changes nothing."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        picture = load_image(image)
        text = normalize_prompt(prompt, self.pipeline.config.text.max_prompt_chars)
        rollout = self.pipeline.start(picture, text, seed, conditions=self.conditions)
        replay = Replay(self.pipeline.config.name, image_digest(picture), int(seed), text,
                        dtype=str(self.pipeline.dtype).removeprefix("torch."))
        with self._lock:
            old, self.rollout, self.replay = self.rollout, rollout, replay
            self.queue.clear()  # input meant for the old world; its ids stay spent
            self.event_floor = self._last_event_id
            self.held_keys = frozenset()
            self.status = SessionStatus.ACTIVE
            self.last_error = None
            self.last_input = self.clock()
        if old is not None:
            release(self.pool, old)

    def reset(self, image, prompt: str, seed: int) -> None:
        """A new world in the same session; event ids keep increasing from where they were."""
        with self._lock:
            self._check_open()
            if self._busy:
                raise SessionBusy(f"session {self.session_id} is running a block; reset at the block boundary")
        self._start(image, prompt, seed)

    def close(self) -> None:
        """Return every page and drop every tensor. Closing during a block defers the release to its end."""
        with self._lock:
            if self.status is SessionStatus.CLOSED:
                return
            self.status = SessionStatus.CLOSED
            self.queue.clear()
            if self._busy:
                self._close_requested = True  # the stepping thread releases on its way out
                return
            rollout, self.rollout = self.rollout, None
        if rollout is not None:
            release(self.pool, rollout)

    @property
    def block_index(self) -> int:
        rollout = self.rollout
        return rollout.block_index if rollout is not None else 0

    @property
    def busy(self) -> bool:
        return self._busy

    # -- input -------------------------------------------------------------------------------------

    def post_event(self, raw: dict | Event) -> Event:
        """Queue one event for the next block boundary; a bad event raises EventError and changes nothing."""
        frames_per_block = self.pipeline.config.transformer.num_frames_per_block
        event = raw if isinstance(raw, (ScriptEvent, KeyStateEvent)) else parse_event(raw, frames_per_block)
        if isinstance(event, ScriptEvent) and len(event.frames) != frames_per_block:
            raise EventError(f"event {event.event_id} frames must hold {frames_per_block} key sets, "
                             f"got {len(event.frames)}")
        if event.prompt is not None:
            limit = self.pipeline.config.text.max_prompt_chars
            try:
                event = replace(event, prompt=normalize_prompt(event.prompt, limit))
            except PromptError as exc:
                raise EventError(f"event {event.event_id} prompt: {exc}") from None
        with self._lock:
            self._check_open()
            if event.event_id <= self._last_event_id:
                raise EventError(f"event_id {event.event_id} is stale or a duplicate; "
                                 f"the next id must exceed {self._last_event_id}")
            if len(self.queue) >= self.max_queued_events:
                raise EventError(f"the event queue is full ({self.max_queued_events} events); "
                                 "wait for the next block")
            self.queue.append(event)
            self._last_event_id = event.event_id
            self.last_input = self.clock()
        return event

    def _plan(self) -> _Plan:
        """This block's control from the queue (caller holds the lock); the queue itself is not changed.

        Held-key events fold into one key state: a key stays held until an event releases it, and a key
        pressed and released between two blocks still acts on the block's first frame. A script event
        ends the block's input: it gives the block's frames (plus any held keys), and later events wait.
        """
        frames_per_block = self.pipeline.config.transformer.num_frames_per_block
        held, tapped, prompt, ids = self.held_keys, frozenset(), None, []
        frames = None
        for event in self.queue:
            ids.append(event.event_id)
            prompt = event.prompt if event.prompt is not None else prompt
            if isinstance(event, ScriptEvent):
                frames = tuple(keys | held for keys in event.frames)
                frames = (frames[0] | tapped,) + frames[1:]
                break
            tapped |= event.keys - held
            held = event.keys
        if frames is None:
            frames = (held | tapped,) + (held,) * (frames_per_block - 1)
        return _Plan(BlockControl(actions=frames, prompt=prompt), len(ids), held, tuple(ids))

    # -- the block ---------------------------------------------------------------------------------

    def step(self, on_stage: Callable[[str], None] | None = None) -> BlockOutput:
        """Run one block; commit everything or nothing.

        on_stage(name) is called before each stage: "text" (only when the prompt changes), then the
        rollout's "condition", "denoise", "commit", "decode" and "done". Raising from it fails the block.
        """
        with self._lock:
            self._check_open()
            if self._busy:
                raise SessionBusy(f"session {self.session_id} is already running a block")
            plan = self._plan()
            state = self.rollout
            switch = plan.control.prompt is not None and plan.control.prompt != state.prompt
            self._busy = True
            self._in_flight = self._in_flight_estimate(state, switch)
        try:
            if switch:
                if on_stage is not None:
                    on_stage("text")
                state = self.pipeline.with_prompt(state, plan.control.prompt)  # text K/V once per switch
            output, committed = self.pipeline.step(self.pool, state, plan.control, on_stage=on_stage)
        except BaseException as exc:
            with self._lock:
                self._busy, self._in_flight = False, {}
                abandoned = self._close_requested
                if not abandoned:
                    self.status = SessionStatus.FAILED
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    self._failed_event_ids = plan.event_ids
                rollout = self.rollout if abandoned else None
                if abandoned:
                    self.rollout = None
            if rollout is not None:
                release(self.pool, rollout)
            raise

        # Commit: the rollout, the consumed events, the held keys and the replay move together.
        record: dict[str, Any] = {"frames": [sorted(keys) for keys in plan.control.actions],
                                  "event_ids": list(plan.event_ids)}
        if switch:
            record["prompt"] = committed.prompt
        with self._lock:
            self._busy, self._in_flight = False, {}
            if self._close_requested:
                self.rollout = None
                abandoned = committed
            else:
                abandoned = None
                self.rollout = committed
                for _ in range(plan.consumed):
                    self.queue.popleft()
                if plan.event_ids:
                    self.event_floor = plan.event_ids[-1]
                self.held_keys = plan.held_after
                self.replay.blocks.append(record)
                self.status = SessionStatus.ACTIVE
                self.last_error = None
        if abandoned is not None:
            release(self.pool, abandoned)
            raise SessionClosed(f"session {self.session_id} was closed while its block ran")
        return output

    def drop_failed_events(self) -> tuple[int, ...]:
        """After a failed block: take the events it tried to apply off the queue (their ids stay spent), so
        the next block runs without them. Returns their ids; () if the block had no new input."""
        with self._lock:
            failed, self._failed_event_ids = set(self._failed_event_ids), ()
            dropped = []
            while self.queue and self.queue[0].event_id in failed:
                dropped.append(self.queue.popleft().event_id)
            return tuple(dropped)

    # -- accounting --------------------------------------------------------------------------------

    def _in_flight_estimate(self, state: RolloutState, prompt_switch: bool) -> dict[str, int]:
        """Bytes a block adds while it runs: reserved pages, pending encoder/decoder/text state, scratch."""
        config = self.pipeline.config
        page_bytes = KVPagePool.page_nbytes(config, self.pool.k.dtype)
        fp = self.footprint
        if fp is not None:
            condition, decoder, scratch = fp.condition, fp.decoder, fp.scratch
        else:  # without a probe, the committed states stand in for their pending copies
            vae_dtype = next(self.pipeline.vae.parameters()).dtype
            condition, decoder = state.condition.nbytes(), state.decoder.nbytes()
            scratch = block_scratch_bytes(config, self.pool.k.dtype, vae_dtype)
        return {
            "pending_pages": config.transformer.num_frames_per_block * page_bytes,
            # At the fixed point the pending condition stream shares the committed condition tensor.
            "pending_condition": 0 if state.condition.fixed else condition,
            "pending_decoder": decoder,
            "pending_text_kv": held_bytes(state.text_kv) if prompt_switch else 0,
            "scratch": scratch,
        }

    def nbytes(self) -> dict[str, int]:
        """Bytes this session holds now, by component: the committed state plus, during a block, in-flight."""
        with self._lock:
            rollout, in_flight = self.rollout, dict(self._in_flight)
        if rollout is None:
            return {}
        page_bytes = KVPagePool.page_nbytes(self.pipeline.config, self.pool.k.dtype)
        committed = {
            "kv_pages": len(rollout.kv.frame_pages) * page_bytes,
            "text_kv": held_bytes(rollout.text_kv),
            "condition": rollout.condition.nbytes(),
            "decoder": rollout.decoder.nbytes(),
            "rng": held_bytes(rollout.rng_state),
        }
        return {**committed, **in_flight}

    def describe(self) -> dict[str, Any]:
        """A consistent snapshot for status displays."""
        with self._lock:
            return {"block_index": self.block_index, "status": self.status.value, "last_error": self.last_error,
                    "queued_events": len(self.queue), "event_floor": self.event_floor,
                    "held_keys": sorted(self.held_keys),
                    "prompt": self.rollout.prompt if self.rollout is not None else None}

    def _check_open(self) -> None:
        if self.status is SessionStatus.CLOSED:
            raise SessionClosed(f"session {self.session_id} is closed")
