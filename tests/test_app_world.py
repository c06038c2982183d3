"""The procedural world in the app: world examples, New world, Ground truth beside the stream, the header.

What must hold: the shipped examples are the held-out worlds their names say; New world gives the
start picture of a held-out world at the preset's size, the same for the same seed; a block's ground
truth is the world rendered along the poses the key integrator gives for the whole walk (the
oracle: `key_path` of every block's keys, rendered at once); the PSNR on the telemetry line is the
PSNR of the block the engine made and that truth; a busy renderer skips a block rather than waiting;
a picture that is not a world render is named out of distribution; the header follows
`config.trained`. Tiny model, fp32.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import os

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

import app as lingbot_app  # noqa: E402
from app_driver import FOREST, ROOT, stream_outputs  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402
from lingbot_core.config import EMBEDDED, LINGBOT_WORLD_V2_14B, tiny_config  # noqa: E402
from lingbot_core.model import camera  # noqa: E402
from lingbot_core.boundary.requests import BlockControl  # noqa: E402
from lingbot_core.serving.contract import EngineConfig  # noqa: E402
from lingbot_core.serving.streaming import StreamConfig  # noqa: E402
from lingbot_core.boundary.video import frames_to_uint8  # noqa: E402
from lingbot_core.world import HELD_OUT_SEEDS, held_keys, key_path, make_world, render, to_uint8  # noqa: E402
from lingbot_core.world.examples import (EXAMPLE_SEEDS, StartPictures, example_name, seed_from_name,  # noqa: E402
                                         start_picture)
from lingbot_core.world.ground_truth import (GroundTruthRenderer, GroundTruthView, block_intrinsics,  # noqa: E402
                                             block_pixel_poses, psnr)

pytestmark = pytest.mark.filterwarnings("ignore:::gradio.queueing")
PSNR_TEXT = re.compile(r"ground truth PSNR (\S+) dB \(block (\d+)\)")


APP_SERVER = dict(engine=EngineConfig(max_sessions=2, idle_ttl_s=120), stream=StreamConfig(lead_s=1e6))  # conftest


# ---------------------------------------------------------------------------------------------
# Pictures


def test_examples_are_the_held_out_worlds_their_names_say():
    """If this fails after a change to the world: python -m lingbot_core.world.examples --out examples/"""
    pictures = StartPictures(EMBEDDED)
    for seed in EXAMPLE_SEEDS:
        path = ROOT / "examples" / example_name(seed)
        assert seed in HELD_OUT_SEEDS and seed_from_name(path) == seed
        assert Image.open(path).size == (EMBEDDED.width, EMBEDDED.height)
        assert pictures.recognise(path) == seed
    assert [row[0] for row in lingbot_app.world_examples()] == [
        str(ROOT / "examples" / example_name(seed)) for seed in EXAMPLE_SEEDS]
    # The app knows them (StartPictures.know) so that Start with Ground truth recognises one without a render:
    # what it knows is what a render gives, and knowing costs no render.
    renders = []
    known = StartPictures(EMBEDDED, lambda *args: renders.append(args))
    for seed in EXAMPLE_SEEDS:
        known.know(ROOT / "examples" / example_name(seed))
        assert known.recognise(ROOT / "examples" / example_name(seed)) == seed
        assert np.array_equal(known.picture(seed), pictures.picture(seed))
    assert renders == []


def test_a_picture_is_a_world_only_when_its_pixels_are(tmp_path):
    pictures = StartPictures(tiny_config())
    seed = HELD_OUT_SEEDS.start + 5
    named = pictures.write(seed, tmp_path)
    assert named.name == f"world_{seed}.png" and pictures.recognise(named) == seed
    other = tmp_path / "other" / example_name(seed + 1)  # another world's pixels under this world's name
    other.parent.mkdir()
    shutil.copy(named, other)
    assert pictures.recognise(other) is None
    photo = tmp_path / "photo" / example_name(seed)  # a photograph renamed as a world
    photo.parent.mkdir()
    Image.open(FOREST).resize((64, 32)).save(photo)
    assert pictures.recognise(photo) is None
    assert pictures.recognise(FOREST) is None and pictures.recognise(None) is None
    assert "out of distribution" in lingbot_app.picture_note(None, True)
    assert lingbot_app.picture_note(None, False) == ""
    assert f"World **{seed}** (held out" in lingbot_app.picture_note(seed, True)


def test_header_follows_config_trained():
    engine = SimpleNamespace(capacity=2, describe=lambda: "")  # the contract's describe(): where worlds are made
    random_weights = lingbot_app._header(dataclasses.replace(EMBEDDED, trained=False), engine)
    assert "random (untrained)" in random_weights and "procedural" not in random_weights
    trained = lingbot_app._header(dataclasses.replace(EMBEDDED, trained=True), engine)
    assert "random" not in trained
    assert "trained on a procedural 3D world" in trained and "never on real footage" in trained
    assert "`--model`" in trained
    real = lingbot_app._header(LINGBOT_WORLD_V2_14B, engine)
    assert "random" not in real and "procedural" not in real


# ---------------------------------------------------------------------------------------------
# Ground truth of blocks


def test_block_pixel_poses_chain_into_the_whole_walk():
    """Per-block poses from the engine's per-block integration = the walk's pixel poses, block after block."""
    config = tiny_config()
    keys = ["", "w", "jw", "l", "i", "ad"]
    frames_per_block = config.transformer.num_frames_per_block
    actions = held_keys(keys, frames_per_block)
    whole = key_path(actions, config).pixel_poses
    state, parts = camera.CameraState.initial(), []
    for index in range(len(keys)):
        poses, after = camera.integrate_actions(state, actions[index * frames_per_block:(index + 1) * frames_per_block],
                                                config.camera)
        parts.append(block_pixel_poses(state.pose, poses, index, config.vae_temporal_factor))
        state = after
    assert [len(p) for p in parts] == [9] + [12] * (len(keys) - 1)
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=0, atol=1e-12)


def test_psnr_of_a_pair():
    a = np.full((2, 4, 4, 3), 100, dtype=np.uint8)
    assert psnr(a, a) == float("inf")
    assert psnr(a, a + 10) == pytest.approx(10 * np.log10(255**2 / 100))
    with pytest.raises(ValueError, match="shape"):
        psnr(a, a[:1])


def test_the_workers_truth_of_a_block_is_the_world_rendered_along_its_poses():
    config = tiny_config()
    seed = HELD_OUT_SEEDS.start + 9
    actions = held_keys(["", "wj", "l"], config.transformer.num_frames_per_block)
    path = key_path(actions, config)
    renderer = GroundTruthRenderer()
    try:
        view = GroundTruthView(renderer, config, seed)
        pixels = np.random.default_rng(0).integers(0, 256, (12, config.height, config.width, 3), dtype=np.uint8)
        block = SimpleNamespace(block_index=2, pixels=pixels, poses=path.latent_poses[6:9],
                                start_pose=path.latent_poses[5])
        assert view.submit(block) == ""
        view.pending[1].result(timeout=900)  # a bound on a hung worker only: a starved host can take minutes
        comparison = view.take()
        if hasattr(os, "SCHED_IDLE"):  # Linux: the renderer takes only CPU time the world leaves
            assert os.sched_getscheduler(renderer._process.pid) == os.SCHED_IDLE
    finally:
        renderer.close()
    truth = to_uint8(render(make_world(seed), path.pixel_poses[21:33], path.intrinsics, config.width,
                            config.height))
    np.testing.assert_array_equal(comparison.truth, truth)
    assert comparison.block_index == 2 and comparison.psnr_db == psnr(pixels, truth)
    assert comparison.describe() == f"ground truth PSNR {psnr(pixels, truth):.1f} dB (block 2)"


def test_a_busy_renderer_skips_the_block_and_a_photo_has_no_truth():
    config = tiny_config()
    busy = SimpleNamespace(submit=lambda *args: None)
    block = SimpleNamespace(block_index=1, pixels=None, poses=np.eye(4)[None].repeat(3, 0), start_pose=np.eye(4))
    view = GroundTruthView(busy, config, HELD_OUT_SEEDS.start)
    assert view.submit(block) == "ground truth skipped: busy" and view.pending is None and view.skipped == 1
    photo = GroundTruthView(busy, config, None)
    first = SimpleNamespace(**{**vars(block), "block_index": 0})
    assert photo.submit(first) == "ground truth: this picture is not a world render"


# ---------------------------------------------------------------------------------------------
# Through the app


def test_new_world_is_a_held_out_world_at_the_preset_size(server):
    url, engine, _ = server
    config = engine.pipeline.config
    client = Client(url, verbose=False)
    image, note = client.predict(api_name="/new_world")
    seed = seed_from_name(image)
    assert seed in HELD_OUT_SEEDS and f"World **{seed}** (held out" in note
    picture = np.asarray(Image.open(image).convert("RGB"))
    assert picture.shape == (config.height, config.width, 3)
    # Deterministic per seed: the app's render (in its worker process) is the world's start picture here.
    np.testing.assert_array_equal(picture, start_picture(seed, config))
    np.testing.assert_array_equal(start_picture(seed, config), start_picture(seed, config))
    client.close()


@pytest.mark.slow  # a minute or more on 2 cores: .ci/run runs it, the fast suite does not
def test_ground_truth_beside_the_stream_and_its_psnr(server, tmp_path):
    """/play with Ground truth on a New world: each truth segment and PSNR is the world along the walk."""
    url, engine, _ = server
    config = engine.pipeline.config
    client = Client(url, verbose=False, download_files=False)
    picture = Path(Client(url, verbose=False).predict(api_name="/new_world")[0])
    seed = seed_from_name(picture)
    job = client.submit(handle_file(str(picture)), "a procedural world", 3, True, api_name="/play")
    session_id, blocks, truths, shown, acted = None, 0, 0, {}, False
    for video, truth, text, sid in stream_outputs(job):
        session_id = sid or session_id
        blocks += isinstance(video, dict) and bool(video.get("url"))
        truths += isinstance(truth, dict) and bool(truth.get("url"))
        match = PSNR_TEXT.search(text or "")
        if match:
            shown[int(match.group(2))] = match.group(1)
        if blocks >= 1 and not acted:  # walk and turn from a later block on: the truth must follow the keys
            client.predict(session_id, json.dumps({"event_id": 1, "keys": ["w", "j"]}), api_name="/act")
            acted = True
        if len(shown) >= 4 and blocks >= 6:
            mp4_data, replay_data = client.predict(session_id, api_name="/download")
            client.predict(session_id, api_name="/stop")
            blocks = -10**6  # ask once
    assert truths >= len(shown) >= 4
    replay = json.loads(httpx.get(replay_data["url"], timeout=30).text)
    assert any(frame for block in replay["blocks"] for frame in block["frames"]), "the walk never moved"

    # Oracle: the replay regenerated offline gives the engine's pixels; the whole walk's poses give the truth.
    controls = [BlockControl(actions=tuple(frozenset(f) for f in block["frames"])) for block in replay["blocks"]]
    generated = [frames_to_uint8(out.frames) for out in engine.pipeline.rollout(picture, replay["prompt"],
                                                                                replay["seed"], controls)]
    path = key_path([a for control in controls for a in control.actions], config)
    truth = to_uint8(render(make_world(seed), path.pixel_poses, block_intrinsics(config), config.width,
                            config.height))
    starts = np.cumsum([0] + [len(g) for g in generated])
    for index, text in shown.items():
        if index < len(generated):
            assert text == f"{psnr(generated[index], truth[starts[index]:starts[index + 1]]):.1f}", index
    client.close()


def test_reset_to_a_photo_stops_the_truth_and_the_page_says_out_of_distribution(server):
    url, engine, _ = server
    client = Client(url, verbose=False, download_files=False)
    picture = Path(Client(url, verbose=False).predict(api_name="/new_world")[0])
    job = client.submit(handle_file(str(picture)), "a procedural world", 1, True, api_name="/play")
    session_id, reset, before, after = None, False, [], []
    for video, _, text, sid in stream_outputs(job):
        session_id = sid or session_id
        if not (isinstance(video, dict) and video.get("url")):
            (after if after else before).append(text)  # a truth, a note, the final "stopped"
            continue
        if not reset:
            before.append(text)
            if any(PSNR_TEXT.search(t) for t in before):  # the old world has shown its truth: switch
                client.predict(session_id, handle_file(str(FOREST)), "a forest", 5, api_name="/reset")
                reset = True
        elif after or text.startswith("block 0 · "):  # blocks the old world had made already may come first
            after.append(text)
            if sum(t.startswith("block ") and " ms/block" in t for t in after) == 3:
                client.predict(session_id, api_name="/stop")
    assert any(PSNR_TEXT.search(t) for t in before), before
    assert "ground truth: this picture is not a world render" in after[0]
    assert not any(PSNR_TEXT.search(t) for t in after), after
    client.close()
