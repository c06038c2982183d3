"""A stream's recording: a download's video and replay hold the same blocks, even while blocks arrive.

The browser test once downloaded a replay of 9 blocks beside a video of 8: the stream's thread added a
block between the export of the video and the write of the replay. Here a block arrives in the middle
of an export, deterministically, by adding it from inside the video join.
"""

from __future__ import annotations

import json

import numpy as np

import lingbot_core.boundary.video as video
from lingbot_core.serving.session import Replay
from lingbot_core.boundary.video import Recording, count_frames

FPS, FRAMES = 16, 12


def _block(value: int) -> np.ndarray:
    return np.full((FRAMES, 32, 64, 3), value, np.uint8)


def _entry(index: int) -> dict:
    return {"frames": [[], [], []], "event_ids": [index]}


def test_a_block_arriving_during_an_export_is_in_neither_the_video_nor_the_replay(tmp_path, monkeypatch):
    recording = Recording(tmp_path / "rec")
    recording.new_world(Replay(model="tiny", image_sha256="0" * 64, seed=1, prompt="p"))
    for index in range(3):
        recording.add(_block(40 * index), FPS, _entry(index))

    join = video.concat_mp4

    def join_while_a_block_arrives(segments, out_path):
        recording.add(_block(200), FPS, _entry(3))  # the stream's thread, mid-export
        return join(segments, out_path)

    monkeypatch.setattr(video, "concat_mp4", join_while_a_block_arrives)
    mp4, replay_path = tmp_path / "out.mp4", tmp_path / "replay.json"
    assert recording.export(mp4, replay_path) == 3
    replay = json.loads(replay_path.read_text())
    assert count_frames(mp4)[0] == FRAMES * len(replay["blocks"]) == FRAMES * 3
    assert [b["event_ids"] for b in replay["blocks"]] == [[0], [1], [2]]

    monkeypatch.setattr(video, "concat_mp4", join)  # the next export holds the late block in both
    assert recording.export(mp4, replay_path) == 4
    assert count_frames(mp4)[0] == FRAMES * len(json.loads(replay_path.read_text())["blocks"]) == FRAMES * 4


def test_an_export_before_any_block_writes_nothing(tmp_path):
    recording = Recording(tmp_path / "rec")
    mp4, replay_path = tmp_path / "out.mp4", tmp_path / "replay.json"
    assert recording.export(mp4, replay_path) == 0
    assert not mp4.exists() and not replay_path.exists()
