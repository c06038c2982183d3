"""The block loop: checkpoint in, one block of a world out, every state a caller's."""
