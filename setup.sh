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
