#!/usr/bin/env bash
# Installs everything the app and the tests need on a fresh Debian machine: system packages
# (ffmpeg for Gradio's streaming video, Chromium for the browser tests) and the pinned Python packages.
set -euo pipefail
cd "$(dirname "$0")"
need=()
command -v ffmpeg >/dev/null 2>&1 && command -v ffprobe >/dev/null 2>&1 || need+=(ffmpeg)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
python3 -m pip install -q -r requirements.txt
# torch.compile's graphs for the embedded model, for `--compile` (on a CPU the app and the offline command
# serve eager by default: compiling is not measured to pay there). Built here, into ~/.cache/lingbot/inductor,
# a later `--compile` start takes seconds instead of minutes. It takes several minutes on a 2-core AVX2 CPU
# (about 7 when that host was busy), so it is opt-in.
if [ "${LINGBOT_WARM_COMPILE:-0}" = 1 ]; then
  echo "setup: building torch.compile's graphs for the embedded model (python3 -m lingbot_core.warm_compile)"
  python3 -m lingbot_core.warm_compile || echo "setup: the compile warm-up failed; the app will build the graphs in the background or run eager"
else
  echo "setup: skipping the torch.compile warm-up (minutes on a CPU; LINGBOT_WARM_COMPILE=1 bash setup.sh runs it)"
fi
