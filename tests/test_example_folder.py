"""The official example folder layout, in the offline command's sibling and in the app's offline tab.

The offline command's --action-path is tested in tests/test_generate.py; here: reading the layout
(from a folder and from files dropped together, each in a folder of its own as Gradio stores uploads),
and the app's /generate endpoint with an official 961-frame example dropped whole.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from lingbot_core.boundary.example_folder import (  # noqa: E402
    MAX_PROMPT_BYTES,
    ExampleFolderError,
    example_from_files,
    read_example_folder,
)
from lingbot_core.serving.contract import EngineConfig  # noqa: E402
from lingbot_core.serving.streaming import StreamConfig  # noqa: E402
from lingbot_core.boundary.video import count_frames  # noqa: E402
from tests.test_generate import official_example_folder  # noqa: E402

FOREST = Path(__file__).resolve().parent.parent / "examples" / "forest.png"
pytestmark = pytest.mark.filterwarnings("ignore:::gradio.queueing")


@pytest.fixture
def example(tmp_path) -> Path:
    return official_example_folder(tmp_path / "examples" / "00", FOREST)


def _dropped(folder: Path, tmp_path: Path, names=None) -> list[Path]:
    """The folder's files as Gradio hands over uploads: each copied into a folder of its own."""
    out = []
    for i, path in enumerate(sorted(folder.iterdir())):
        if names is None or path.name in names:
            target = tmp_path / "uploads" / f"{i:02d}" / path.name
            target.parent.mkdir(parents=True)
            target.write_bytes(path.read_bytes())
            out.append(target)
    return out


def test_a_folder_in_the_official_layout_is_read(example):
    folder = read_example_folder(example)
    assert (folder.poses.name, folder.intrinsics.name, folder.image.name) == ("poses.npy", "intrinsics.npy",
                                                                              "image.jpg")
    assert folder.prompt.startswith("The video presents a slow walk")
    assert np.load(folder.poses).shape == (961, 4, 4)


def test_dropped_files_are_known_by_name_and_action_files_are_not_read(example, tmp_path):
    files = _dropped(example, tmp_path)
    assert {p.name for p in files} >= {"action.npy", "wasd_action.npy", "ijkl_action.npy"}
    folder = example_from_files([str(p) for p in files])
    assert folder.poses.parent != folder.intrinsics.parent  # stored apart, found by name
    assert folder.image.name == "image.jpg" and folder.prompt == (example / "prompt.txt").read_text()
    partial = example_from_files(_dropped(example, tmp_path / "b", {"poses.npy", "intrinsics.npy"}))
    assert partial.image is None and partial.prompt is None


def test_prompt_text_is_utf8_with_or_without_a_byte_order_mark(example):
    (example / "prompt.txt").write_bytes("\ufeffun café au bord de l'eau".encode("utf-8"))
    assert read_example_folder(example).prompt == "un café au bord de l'eau"


@pytest.mark.parametrize("case,pattern", [
    ("no poses", "lack poses.npy"),
    ("no intrinsics", "lack intrinsics.npy"),
    ("stranger", "notes.md is not a file of an example folder"),
    ("twice", "poses.npy was given twice"),
    ("two images", "hold 2 images"),
    ("latin-1 prompt", r"prompt.txt: is not UTF-8 text"),
    ("huge prompt", f"larger than {MAX_PROMPT_BYTES} bytes"),
])
def test_bad_folders_are_refused_with_the_reason(example, tmp_path, case, pattern):
    files = _dropped(example, tmp_path)
    by_name = {p.name: p for p in files}
    if case == "no poses":
        files.remove(by_name["poses.npy"])
    elif case == "no intrinsics":
        files.remove(by_name["intrinsics.npy"])
    elif case == "stranger":
        extra = tmp_path / "notes.md"
        extra.write_text("x")
        files.append(extra)
    elif case == "twice":
        files.append(by_name["poses.npy"])
    elif case == "two images":
        png = tmp_path / "extra" / "image.png"
        png.parent.mkdir()
        Image.open(by_name["image.jpg"]).save(png)
        files.append(png)
    elif case == "latin-1 prompt":
        by_name["prompt.txt"].write_bytes("caf\xe9".encode("latin-1"))
    elif case == "huge prompt":
        by_name["prompt.txt"].write_bytes(b"a" * (MAX_PROMPT_BYTES + 1))
    with pytest.raises(ExampleFolderError, match=pattern):
        example_from_files(files)


def test_not_a_folder(tmp_path):
    with pytest.raises(ExampleFolderError, match="is not a folder"):
        read_example_folder(tmp_path / "absent")


# ---- the app's offline tab ------------------------------------------------------------------------------

APP_SERVER = dict(engine=EngineConfig(max_sessions=1), stream=StreamConfig(lead_s=1e6),
                  build=dict(offline_max_blocks=2))  # the `server` fixture (conftest.py)


def test_the_app_takes_an_official_example_dropped_whole(server, example, tmp_path):
    """961 frames: more than this server's 2-block limit, so it is cut to 2 blocks (21 frames), and says so."""
    url, engine, _ = server
    client = Client(url, verbose=False, download_files=False)
    files = [handle_file(str(p)) for p in sorted(example.iterdir())]
    video, message = client.predict(handle_file(str(FOREST)), "a prompt the folder replaces", 0, "", None, None,
                                    None, files, api_name="/generate")
    assert "2 blocks, 21 frames" in message and "21 of its 961 frames used for 2 blocks, 940 dropped" in message
    mp4 = tmp_path / "example.mp4"
    import httpx
    mp4.write_bytes(httpx.get(video["video"]["url"] if "video" in video else video["url"], timeout=30).content)
    assert count_frames(mp4)[0] == engine.pipeline.config.pixel_frames_for_blocks(2) == 21

    # a folder without its trajectory, or an example together with a script, is refused with the reason
    no_poses = [handle_file(str(p)) for p in sorted(example.iterdir()) if p.name != "poses.npy"]
    with pytest.raises(AppError, match="lack poses.npy"):
        client.predict(handle_file(str(FOREST)), "x", 0, "", None, None, None, no_poses, api_name="/generate")
    with pytest.raises(AppError, match="not both"):
        client.predict(handle_file(str(FOREST)), "x", 0, '{"event_id": 0, "keys": ["w"]}', None, None, None, files,
                       api_name="/generate")
