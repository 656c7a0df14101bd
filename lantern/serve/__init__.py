"""``lantern serve``: an image-generation server with continuous batching.

``scheduler`` (the engine side: jobs, tickets, batches that rows join at round boundaries),
``schema`` (the request and response bodies), ``plan`` (a request checked against the model: jobs
and resolved settings), ``metrics`` (counters and their Prometheus text), ``app`` (the FastAPI app)
and ``static/`` (the web page). Only ``app`` imports FastAPI (the ``serve`` extra); nothing here is
imported by ``import lantern``.
"""
