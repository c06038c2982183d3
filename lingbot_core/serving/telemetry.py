"""What the page's telemetry line says: a block's figures, a place in line, the server's load, a stopped world."""

from __future__ import annotations

from typing import Any

from lingbot_core.serving.contract import Block


def telemetry_line(block: Block, frames: int, fps: int, status: dict[str, Any] | None,
                   stats: dict[str, Any], note: str = "", key_ms: float | None = None,
                   lead_s: float | None = None) -> str:
    """key_ms: the estimated key press -> first frame on screen latency of the keys this block applied;
    lead_s: the viewer's adaptive pacing lead (AdaptiveLead), where its page reports stalls."""
    generated_fps = frames / (block.block_ms / 1000.0) if block.block_ms > 0 else float("inf")
    parts = [f"block {block.block_index}", f"{block.block_ms:.0f} ms/block",
             f"{generated_fps:.1f} FPS generated (playback {fps})"]
    if block.first_frame_ms is not None:  # its frames left as they were decoded (the socket player)
        parts.append(f"first frame {block.first_frame_ms:.0f} ms")
    if key_ms is not None:
        parts.append(f"key → frame ≈ {key_ms:.0f} ms")
    if lead_s is not None:
        parts.append(f"lead {lead_s:.2f} s")
    if block.source is not None:  # a remote server's block: its own figures (chunk_stats)
        remote = block.source
        figures = [f"{name} {remote[key]:.0f} ms" for name, key in (("forward", "forward_ms"), ("total", "total_ms"))
                   if remote.get(key) is not None]
        parts.append(f"from {remote['server']}: " + ", ".join(figures + [f"{remote['bytes'] / 2**20:.1f} MB"]))
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
    if "servers_total" in stats:  # the remote backend: one seat per server
        text += f" on {stats['servers_up']}/{stats['servers_total']} remote servers up"
        trouble = [f"{stats[key]} {name}" for key, name in (("servers_busy", "busy"), ("servers_down", "down"))
                   if stats.get(key)]
        if trouble:
            text += f" ({', '.join(trouble)})"
    return text


def stopped_line(blocks: int) -> str:
    """What a stopped world says, from Stop and from its stream alike (the page shows whichever comes last)."""
    return f"stopped after {blocks} block(s) of this world; the rollout can be downloaded"
