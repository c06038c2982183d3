"""vLLM-Omni's realtime video protocol (`WS /v1/realtime/video`): its JSON messages, parsed once and strictly
(messages.py), and our keys as its structural camera payloads (keys.py)."""
