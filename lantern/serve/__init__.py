"""``lantern serve``: an image-generation server with continuous batching (``scheduler``)."""
