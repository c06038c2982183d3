"""SGLang's realtime video protocol: the wire format (protocol.py), frame batches (batching.py), keys and
camera actions (actions.py), and a WebSocket client of it (client.py)."""
