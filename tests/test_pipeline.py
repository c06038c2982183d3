"""Pipeline-level oracles: paged KV through the real block step, offline == realtime, the sampler, transactions.

Most tests share one recorded 7-block rollout (`window_run`) of the fp64 tiny pipeline whose window slides
from block 2 on (sink 3, window 9, RoPE table of 8 frames, see conftest.WINDOW_CONFIG).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from itertools import islice

import numpy as np
import pytest
import torch

from training.world import RecordKV

from conftest import WINDOW_CONFIG
from lingbot_core.config import SamplerConfig
from lingbot_core.blocks.kv_cache import KVPagePool
from lingbot_core.model.attention import block_causal_mask, context_frames
from lingbot_core.blocks.pages import PageAllocator
from lingbot_core.boundary.requests import BlockControl
from lingbot_core.blocks.rollout import PoolExhausted, RolloutState, release
from lingbot_core.blocks.sampler import sample_block

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = WINDOW_CONFIG.transformer
BLOCK = CFG.num_frames_per_block
TOKENS = WINDOW_CONFIG.tokens_per_frame
PROMPT = "a red brick house by a quiet river"
OTHER_PROMPT = "a snowy pine forest at night"
SEED = 7
NUM_BLOCKS = 7
STAGES = ("condition", "denoise", "decode", "commit", "done")  # decode before the commit forward (rollout.py)


def _actions(*frames: str) -> BlockControl:
    return BlockControl(actions=tuple(frozenset(keys) for keys in frames))


# Varied keys so every block's Plücker map differs (turns, pitch, strafing, standing still).
CONTROLS = [_actions("w", "w", "wj"), _actions("wl", "d", ""), _actions("i", "wi", "w"), _actions("", "", ""),
            _actions("k", "sk", "a"), _actions("j", "j", "wj"), _actions("w", "dl", "l")]


class CommitRecorder(torch.nn.Module):
    """Wraps the transformer; records every forward that writes the cache (the t=0 commit) and counts reads."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.commits: list[dict] = []
        self.read_only_calls = 0

    def prepare_text(self, text_states):
        return self.inner.prepare_text(text_states)

    def forward(self, hidden_states, timestep, text_kv, plucker, start_frame, cache=None, attn_mask=None):
        out = self.inner(hidden_states, timestep, text_kv, plucker, start_frame, cache=cache, attn_mask=attn_mask)
        if cache is not None and cache.writes:
            self.commits.append(dict(hidden_states=hidden_states, timestep=timestep, plucker=plucker,
                                     start_frame=start_frame, out=out))
        else:
            self.read_only_calls += 1
        return out


@dataclass
class Paged:
    """A page pool's tensors and their bookkeeping, which a rollout's owner keeps side by side (copied together
    for the snapshots below)."""

    pool: KVPagePool
    pages: PageAllocator

    def copy(self) -> "Paged":
        return copy.deepcopy(self)


@dataclass
class Run:
    """A tick-by-tick rollout: states[i] / pools[i] are the world and a copy of its pool before block i."""

    outputs: list = field(default_factory=list)
    states: list[RolloutState] = field(default_factory=list)
    pools: list[Paged] = field(default_factory=list)
    in_use_peak: list[int] = field(default_factory=list)  # pages in use while block i decodes
    recorder: CommitRecorder | None = None


@pytest.fixture(scope="module")
def window_run(tiny_pipeline, start_image) -> Run:
    recorder = CommitRecorder(tiny_pipeline.transformer)
    pipe = dataclasses.replace(tiny_pipeline, transformer=recorder)
    pool = pipe.new_pool()
    pages = PageAllocator(pool.num_pages)
    assert pool.num_pages == CFG.sliding_window_num_frames  # exactly one window: pages must recycle
    state = pipe.start(start_image, PROMPT, SEED)
    run = Run(recorder=recorder)
    for control in CONTROLS:
        run.states.append(state)
        run.pools.append(Paged(pool, pages).copy())
        peak = []
        output, state = pipe.step(pool, pages, state, control,
                                  on_stage=lambda s: peak.append(pages.num_in_use) if s == "decode" else None)
        run.outputs.append(output)
        run.in_use_peak.extend(peak)
    run.states.append(state)
    run.pools.append(Paged(pool, pages))
    return run


# A cache for the one-shot forward: no context, and every layer's rotated K/V kept (training uses the same).
KVCapture = RecordKV


# ---- 1. paged KV through the real block step == one full masked forward --------------------------


@torch.no_grad()
def test_paged_block_steps_equal_one_masked_forward(tiny_pipeline, window_run):
    commits = window_run.recorder.commits
    assert [c["start_frame"] for c in commits] == [b * BLOCK for b in range(NUM_BLOCKS)]
    assert window_run.recorder.read_only_calls == len(WINDOW_CONFIG.sampler.timesteps) * NUM_BLOCKS
    for commit, output in zip(commits, window_run.outputs):
        assert commit["timestep"].tolist() == [0.0]
        # The commit forward reruns exactly the clean latents the block returned.
        assert torch.equal(commit["hidden_states"][:, :CFG.out_channels], output.latents)
    # The RoPE table (8 frames) is crossed by one committed block and exceeded by later ones.
    starts = [c["start_frame"] for c in commits]
    assert any(s < CFG.rope_max_seq_len < s + BLOCK for s in starts) and starts[-1] > CFG.rope_max_seq_len

    frames = NUM_BLOCKS * BLOCK
    x = torch.cat([c["hidden_states"] for c in commits], dim=2)  # [1, in_channels, frames, h, w]
    plucker = torch.cat([c["plucker"] for c in commits], dim=1)  # [1, frames, 6, H, W]
    text_kv = window_run.states[0].text_kv
    t0 = torch.zeros(1, dtype=torch.float64)
    capture = KVCapture()
    full = tiny_pipeline.transformer(x, t0, text_kv, plucker, 0, cache=capture,
                                     attn_mask=block_causal_mask(frames, TOKENS, CFG))
    for b, commit in enumerate(commits):
        got = full[:, :, b * BLOCK:(b + 1) * BLOCK]
        assert (got - commit["out"]).abs().max().item() <= 1e-10, f"block {b}"

    # The pages the rollout kept hold exactly the one-shot forward's rotated K/V of their frames.
    final_state, pool = window_run.states[-1], window_run.pools[-1].pool
    for frame, page in final_state.kv.frame_pages.items():
        tokens = slice(frame * TOKENS, (frame + 1) * TOKENS)
        for layer in range(CFG.num_layers):
            assert (pool.k[layer, page] - capture.k[layer][0, tokens]).abs().max().item() <= 1e-10
            assert (pool.v[layer, page] - capture.v[layer][0, tokens]).abs().max().item() <= 1e-10

    # Sensitivity: without the sliding window (every earlier frame visible) the last block comes out different.
    frame_mask = torch.zeros(frames, frames, dtype=torch.bool)
    for start in range(0, frames, BLOCK):
        frame_mask[start:start + BLOCK, :start + BLOCK] = True
    no_window = frame_mask.repeat_interleave(TOKENS, 0).repeat_interleave(TOKENS, 1)
    unwindowed = tiny_pipeline.transformer(x, t0, text_kv, plucker, 0, attn_mask=no_window)
    assert (unwindowed[:, :, -BLOCK:] - commits[-1]["out"]).abs().max().item() > 1e-6


def test_pages_follow_the_window_and_are_recycled(window_run):
    retained = CFG.sliding_window_num_frames - BLOCK  # sink + recent: what a committed rollout holds
    pages_seen = []
    for b, state in enumerate(window_run.states[1:], start=1):
        frames_so_far = b * BLOCK
        pages = window_run.pools[b].pages
        table = state.kv.frame_pages
        assert sorted(table) == context_frames(frames_so_far, CFG)
        assert pages.num_in_use == len(table) == min(frames_so_far, retained)
        assert len(set(table.values())) == len(table)  # one page per frame
        # While a block is in flight its pages are held too: the whole window, never more.
        assert window_run.in_use_peak[b - 1] == min(frames_so_far, CFG.sliding_window_num_frames)
        pages_seen.extend(page for frame, page in table.items() if frame >= frames_so_far - BLOCK)
    # 21 frames went through a 9-page pool: pages that left the window were given back and reused.
    assert len(pages_seen) == NUM_BLOCKS * BLOCK > window_run.pools[-1].pages.num_pages
    assert set(pages_seen) == set(range(window_run.pools[-1].pages.num_pages))
    # Once the window is full the pool's in-use count stays constant.
    assert {p.pages.num_in_use for p in window_run.pools[3:]} == {retained}
    # release() gives every page back.
    pages = window_run.pools[-1].copy().pages
    release(pages, dataclasses.replace(window_run.states[-1]))
    assert pages.num_in_use == 0


def test_rollout_noise_is_one_stream_from_the_seed(window_run):
    """Block b starts where block b-1 left the generator: 4 draws of the latent shape per block."""
    shape = tuple(window_run.outputs[0].latents.shape)
    draws_per_block = len(WINDOW_CONFIG.sampler.timesteps)
    reference = torch.Generator().manual_seed(SEED)
    for b, state in enumerate(window_run.states):
        assert torch.equal(state.rng_state, reference.get_state()), f"before block {b}"
        for _ in range(draws_per_block):
            torch.randn(shape, generator=reference)


# ---- 2. one offline call == one tick at a time ---------------------------------------------------


def test_offline_rollout_equals_tick_by_tick(tiny_pipeline, start_image):
    controls = [CONTROLS[0], CONTROLS[1], dataclasses.replace(CONTROLS[2], prompt=OTHER_PROMPT), CONTROLS[3]]
    offline = list(tiny_pipeline.rollout(start_image, PROMPT, SEED, controls))

    pool = tiny_pipeline.new_pool()
    pages = PageAllocator(pool.num_pages)
    state = tiny_pipeline.start(start_image, PROMPT, SEED)
    for b, control in enumerate(controls):
        if control.prompt is not None:
            state = tiny_pipeline.with_prompt(state, control.prompt)
        tick, state = tiny_pipeline.step(pool, pages, state, control)
        assert tick.block_index == offline[b].block_index == b
        assert torch.equal(tick.latents, offline[b].latents), f"block {b} latents"
        assert torch.equal(tick.frames, offline[b].frames), f"block {b} frames"
        assert (tick.poses == offline[b].poses).all()
    assert [o.frames.shape[2] for o in offline] == [9, 12, 12, 12]

    other_seed = next(islice(tiny_pipeline.rollout(start_image, PROMPT, SEED + 1, controls), 1))
    assert (other_seed.latents - offline[0].latents).abs().max() > 0.1
    assert not torch.equal(other_seed.frames, offline[0].frames)


# ---- 3. the sampler ---------------------------------------------------------------------------------


def test_dmd_sigmas_and_model_timesteps():
    sampler = SamplerConfig()
    assert sampler.flow_shift == 5.0
    sigmas = sampler.sigmas()
    assert sigmas[0] == 1.0 and sigmas[1] == 0.9375 and sigmas[3] == 0.625
    assert sigmas[2] == pytest.approx(5 / 6, abs=1e-15)

    seen = []

    def velocity(x_t, timestep):
        seen.append(timestep)
        return torch.zeros_like(x_t)

    sample_block(velocity, (1, 2, 3), sampler, torch.Generator().manual_seed(0), "cpu")
    assert seen == pytest.approx([1000.0, 937.5, 2500.0 / 3.0, 625.0], abs=1e-9)


def test_true_flow_recovers_x0_exactly_in_one_step():
    shape = (1, 4, 3, 2, 5)
    # float32-representable target: x_t (float32 noise) - (x_t - x0) is then exact in float64
    x0_true = torch.randn(shape, generator=torch.Generator().manual_seed(1)).double()
    one_step = SamplerConfig(timesteps=(1000.0,))

    def velocity(x_t, timestep):  # at sigma = 1, x_t is the noise itself: v = noise - x0
        return x_t.double() - x0_true

    got = sample_block(velocity, shape, one_step, torch.Generator().manual_seed(3), "cpu")
    assert torch.equal(got, x0_true)


def test_four_steps_renoise_with_fresh_draws_from_one_generator():
    shape = (1, 4, 3, 2, 5)
    sampler = SamplerConfig()
    sigmas = sampler.sigmas()
    x0_true = torch.randn(shape, generator=torch.Generator().manual_seed(1)).double()
    draws = torch.Generator().manual_seed(5)
    noises = [torch.randn(shape, generator=draws) for _ in sigmas]  # the start draw + one per re-noise
    inputs = []

    def velocity(x_t, timestep):  # the true flow for x_t = (1 - s) x0 + s * noise
        inputs.append(x_t)
        sigma = timestep / sampler.num_train_timesteps
        return (x_t.double() - x0_true) / sigma

    generator = torch.Generator().manual_seed(5)
    got = sample_block(velocity, shape, sampler, generator, "cpu")
    assert torch.equal(inputs[0], noises[0])
    for step in range(1, len(sigmas)):
        expected = (1 - sigmas[step]) * x0_true + sigmas[step] * noises[step].double()
        assert (inputs[step] - expected).abs().max().item() < 1e-6  # the noise term is float32
    assert (got - x0_true).abs().max().item() < 1e-12
    assert torch.equal(generator.get_state(), draws.get_state())  # exactly four draws were taken


def test_generator_state_carries_between_blocks():
    shape = (1, 4, 3, 2, 5)
    sampler = SamplerConfig()

    def velocity(x_t, timestep):  # any deterministic function of the input
        return torch.sin(x_t) * (timestep / 1000.0)

    one = torch.Generator().manual_seed(11)
    first, second = (sample_block(velocity, shape, sampler, one, "cpu") for _ in range(2))

    carried = torch.Generator().manual_seed(11)
    again_first = sample_block(velocity, shape, sampler, carried, "cpu")
    resumed = torch.Generator()
    resumed.set_state(carried.get_state())  # what RolloutState.rng_state does between blocks
    again_second = sample_block(velocity, shape, sampler, resumed, "cpu")

    assert torch.equal(first, again_first) and torch.equal(second, again_second)
    assert not torch.equal(first, second)


# ---- 4. transactions: a failed block leaves the world and the pool as they were -------------------


class InjectedFailure(RuntimeError):
    pass


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).clone()  # compare storage bytes, not float values


def _tensor_list(items):
    return [(item.clone() if isinstance(item, torch.Tensor) else item) for item in items]


def _snapshot(state: RolloutState, paged: Paged) -> dict:
    pool = paged.pool
    condition, decoder = state.condition, state.decoder
    pages = torch.tensor(state.kv.pages(), dtype=torch.long)
    return dict(
        fields={f.name: getattr(state, f.name) for f in dataclasses.fields(state)},  # identities
        condition=_tensor_list([condition.image, condition.condition, *(condition.history or [])]),
        condition_ids=[id(t) for t in (condition.history or [])],
        decoder=_tensor_list(decoder.cache or []),
        decoder_ids=[id(t) for t in (decoder.cache or [])],
        frame_pages=dict(state.kv.frame_pages),
        rng_state=state.rng_state.clone(),
        camera=(state.camera.pose.copy(), state.camera.pitch_deg),
        in_use=paged.pages.num_in_use,
        k=_bytes(pool.k[:, pages]),
        v=_bytes(pool.v[:, pages]),
    )


def _assert_same_items(now, before):
    assert len(now) == len(before)
    for a, b in zip(now, before):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and torch.equal(a, b)
        else:
            assert a == b


def _assert_unchanged(state: RolloutState, paged: Paged, snap: dict) -> None:
    pool = paged.pool
    for name, value in snap["fields"].items():
        assert getattr(state, name) is value, name
    condition, decoder = state.condition, state.decoder
    _assert_same_items([condition.image, condition.condition, *(condition.history or [])], snap["condition"])
    assert [id(t) for t in (condition.history or [])] == snap["condition_ids"]
    _assert_same_items(decoder.cache or [], snap["decoder"])
    assert [id(t) for t in (decoder.cache or [])] == snap["decoder_ids"]
    assert state.kv.frame_pages == snap["frame_pages"]
    assert torch.equal(state.rng_state, snap["rng_state"])
    assert (state.camera.pose == snap["camera"][0]).all() and state.camera.pitch_deg == snap["camera"][1]
    assert paged.pages.num_in_use == snap["in_use"]
    pages = torch.tensor(state.kv.pages(), dtype=torch.long)
    assert torch.equal(_bytes(pool.k[:, pages]), snap["k"]) and torch.equal(_bytes(pool.v[:, pages]), snap["v"])


def _assert_same_block(output, new_state, paged: Paged, reference, ref_state, ref_paged: Paged):
    pool, ref_pool = paged.pool, ref_paged.pool
    assert torch.equal(output.latents, reference.latents)
    assert torch.equal(output.frames, reference.frames)
    assert sorted(new_state.kv.frame_pages) == sorted(ref_state.kv.frame_pages)
    for frame, page in new_state.kv.frame_pages.items():  # page ids may differ, contents may not
        ref_page = ref_state.kv.frame_pages[frame]
        assert torch.equal(pool.k[:, page], ref_pool.k[:, ref_page])
        assert torch.equal(pool.v[:, page], ref_pool.v[:, ref_page])
    assert torch.equal(new_state.rng_state, ref_state.rng_state)
    assert paged.pages.num_in_use == ref_paged.pages.num_in_use


# Block 3: the window is full and this block's commit drops frames, so every kind of state is live.
FAIL_BLOCK = 3


@pytest.mark.parametrize("stage", STAGES)
def test_failed_stage_leaves_state_and_pool_untouched_and_retry_matches(tiny_pipeline, window_run, stage):
    state, paged = window_run.states[FAIL_BLOCK], window_run.pools[FAIL_BLOCK].copy()
    control = CONTROLS[FAIL_BLOCK]
    snap = _snapshot(state, paged)
    whole_pool_k = paged.pool.k.clone()
    stages_seen = []

    def fail(name):
        stages_seen.append(name)
        if name == stage:
            raise InjectedFailure(name)

    with pytest.raises(InjectedFailure):
        tiny_pipeline.step(paged.pool, paged.pages, state, control, on_stage=fail)
    assert stages_seen == list(STAGES[:STAGES.index(stage) + 1])
    _assert_unchanged(state, paged, snap)
    if STAGES.index(stage) > STAGES.index("commit"):
        # The commit forward did write the reserved pages; they were freed, the committed ones kept.
        assert not torch.equal(paged.pool.k, whole_pool_k)

    output, new_state = tiny_pipeline.step(paged.pool, paged.pages, state, control)
    _assert_same_block(output, new_state, paged, window_run.outputs[FAIL_BLOCK], window_run.states[FAIL_BLOCK + 1],
                       window_run.pools[FAIL_BLOCK + 1])


def test_pool_exhausted_takes_nothing(tiny_pipeline, window_run):
    state, paged = window_run.states[FAIL_BLOCK], window_run.pools[FAIL_BLOCK].copy()
    snap = _snapshot(state, paged)
    squatter = paged.pages.allocate(paged.pages.num_free - 1)  # one page short of a block
    with pytest.raises(PoolExhausted, match="free pages"):
        tiny_pipeline.step(paged.pool, paged.pages, state, CONTROLS[FAIL_BLOCK])
    assert paged.pages.num_in_use == snap["in_use"] + len(squatter)
    paged.pages.free(squatter)
    _assert_unchanged(state, paged, snap)


# ---- 5. prompt switch ------------------------------------------------------------------------------


def test_prompt_switch_changes_output_and_keeps_original_state_usable(tiny_pipeline, window_run):
    b = 2
    state, control = window_run.states[b], CONTROLS[b]
    text_kv = state.text_kv
    switched = tiny_pipeline.with_prompt(state, OTHER_PROMPT)
    assert switched.prompt == OTHER_PROMPT and switched.kv is state.kv
    assert state.prompt == PROMPT and state.text_kv is text_kv

    expected_kv = tiny_pipeline.encode_prompt(OTHER_PROMPT)
    assert all(torch.equal(a, b) for a, b in zip(switched.text_kv.keys + switched.text_kv.values,
                                                 expected_kv.keys + expected_kv.values))

    # Random tiny weights make cross-attention a small term; fp64 rounding differences would be ~1e-14.
    fresh = window_run.pools[b].copy()
    out_switched, _ = tiny_pipeline.step(fresh.pool, fresh.pages, switched, control)
    assert (out_switched.latents - window_run.outputs[b].latents).abs().max() > 1e-6

    # The original state still steps to exactly the block it would have made.
    paged = window_run.pools[b].copy()
    output, new_state = tiny_pipeline.step(paged.pool, paged.pages, state, control)
    _assert_same_block(output, new_state, paged, window_run.outputs[b], window_run.states[b + 1],
                       window_run.pools[b + 1])

    # The same prompt in other whitespace is the same prompt, once the boundary has cleaned it.
    from lingbot_core.boundary.prompt import clean_prompt
    respaced = tiny_pipeline.with_prompt(state, clean_prompt("  " + PROMPT.replace(" ", " \t ") + "\n", 1000))
    assert respaced.prompt == PROMPT
    fresh = window_run.pools[b].copy()
    same, _ = tiny_pipeline.step(fresh.pool, fresh.pages, respaced, control)
    assert torch.equal(same.latents, window_run.outputs[b].latents)


# ---- action guidance: the first steps pushed away from a still camera ----------------------------


def test_action_guidance_mixes_the_still_velocity_into_the_first_steps_only():
    shape = (1, 4, 3, 2, 5)
    sampler = SamplerConfig(action_guidance=3.0, action_guidance_steps=1)
    sigmas = sampler.sigmas()
    calls = []

    def velocity(x_t, timestep):
        calls.append(("keys", timestep))
        return 2.0 * x_t + timestep / 1000.0

    def still_velocity(x_t, timestep):
        calls.append(("still", timestep))
        return x_t

    generator = torch.Generator().manual_seed(4)
    got = sample_block(velocity, shape, sampler, generator, "cpu", still_velocity)
    assert [who for who, _ in calls] == ["keys", "still", "keys", "keys", "keys"]

    # The same loop by hand: step 0 uses x + 3 * (2x + 1 - x); the others the keys' velocity alone.
    draws = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=draws)
    for step, sigma in enumerate(sigmas):
        v = 2.0 * x + sigma
        if step == 0:
            v = x + 3.0 * (v - x)
        x0 = x - sigma * v
        if step + 1 < len(sigmas):
            x = (1 - sigmas[step + 1]) * x0 + sigmas[step + 1] * torch.randn(shape, generator=draws)
    assert torch.allclose(got, x0, rtol=0, atol=1e-5)
    assert torch.equal(generator.get_state(), draws.get_state())  # guidance draws no noise of its own

    unguided = sample_block(velocity, shape, SamplerConfig(), torch.Generator().manual_seed(4), "cpu")
    assert not torch.allclose(got, unguided)
    with pytest.raises(ValueError, match="still-camera velocity"):
        sample_block(velocity, shape, sampler, torch.Generator().manual_seed(4), "cpu")
    # a scale of 1 is no guidance: the still forward is never run
    calls.clear()
    off = sample_block(velocity, shape, SamplerConfig(action_guidance=1.0, action_guidance_steps=2),
                       torch.Generator().manual_seed(4), "cpu", still_velocity)
    assert all(who == "keys" for who, _ in calls) and torch.equal(off, unguided)


@pytest.mark.parametrize("bad", [dict(action_guidance=-1.0), dict(action_guidance=float("nan")),
                                 dict(action_guidance_steps=5), dict(action_guidance_steps=-1)])
def test_action_guidance_settings_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="action_guidance"):
        SamplerConfig(**bad)


class CameraRecorder(torch.nn.Module):
    """Wraps the transformer; records the camera map of every forward that only reads the cache."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.read_cameras: list[torch.Tensor] = []

    def prepare_text(self, text_states):
        return self.inner.prepare_text(text_states)

    def forward(self, hidden_states, timestep, text_kv, plucker, start_frame, cache=None, attn_mask=None):
        if cache is None or not cache.writes:
            self.read_cameras.append(plucker)
        return self.inner(hidden_states, timestep, text_kv, plucker, start_frame, cache=cache, attn_mask=attn_mask)


def test_a_guided_block_runs_the_still_camera_once_and_skips_it_without_keys(tiny_pipeline, window_run):
    from lingbot_core.model import camera

    guided_config = dataclasses.replace(
        WINDOW_CONFIG, sampler=dataclasses.replace(WINDOW_CONFIG.sampler, action_guidance=3.0, action_guidance_steps=1))
    recorder = CameraRecorder(tiny_pipeline.transformer)
    guided = dataclasses.replace(tiny_pipeline, config=guided_config, transformer=recorder)
    moving, still = 2, 3  # CONTROLS[3] holds no key
    assert CONTROLS[still].actions == (frozenset(),) * BLOCK

    # Keys held: five reads (four steps, one more with the camera held still), a different block.
    state, paged = window_run.states[moving], window_run.pools[moving].copy()
    output, _ = guided.step(paged.pool, paged.pages, state, CONTROLS[moving])
    assert len(recorder.read_cameras) == len(WINDOW_CONFIG.sampler.timesteps) + 1
    keys_map, still_map = recorder.read_cameras[0], recorder.read_cameras[1]
    held = np.repeat(state.camera.pose[None], BLOCK, axis=0)
    intrinsics = camera.reference_intrinsics(WINDOW_CONFIG.camera, BLOCK, WINDOW_CONFIG.width, WINDOW_CONFIG.height)
    expected = camera.plucker_block(state.camera.pose, held, intrinsics, WINDOW_CONFIG.width, WINDOW_CONFIG.height,
                                    WINDOW_CONFIG.camera)
    assert torch.equal(still_map[0], expected.to(still_map.dtype))
    assert not torch.equal(keys_map, still_map)
    assert not torch.allclose(output.latents, window_run.outputs[moving].latents)

    # No key: the still camera is the block's own, so v_still + 3 (v - v_still) would be v; the step skips
    # that forward and the block is the unguided one, bit for bit.
    recorder.read_cameras.clear()
    state, paged = window_run.states[still], window_run.pools[still].copy()
    output, next_state = guided.step(paged.pool, paged.pages, state, CONTROLS[still])
    assert len(recorder.read_cameras) == len(WINDOW_CONFIG.sampler.timesteps)
    assert torch.equal(output.latents, window_run.outputs[still].latents)
    assert torch.equal(output.frames, window_run.outputs[still].frames)
    assert torch.equal(next_state.rng_state, window_run.states[still + 1].rng_state)
