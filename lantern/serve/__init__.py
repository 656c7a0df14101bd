"""``lantern serve``: an image-generation server with continuous batching.

``scheduler`` (the engine side: jobs, tickets, batches that rows join at round boundaries),
``schema`` (the request and response bodies), ``plan`` (a request checked against the model: jobs
and resolved settings), ``metrics`` (counters and their Prometheus text), ``limits`` (the server's
bounds as plain numbers), ``guards`` (connections, header deadlines, the Host check, uvicorn's
settings), ``app`` (the FastAPI app) and ``static/`` (the web page). Only ``app`` and ``guards``
import FastAPI or uvicorn (the ``serve`` extra); nothing here is imported by ``import lantern``.
"""
