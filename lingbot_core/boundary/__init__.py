"""What crosses the edge, parsed once: a start, events, pictures, offline requests in; video out."""
